"""``device_reads.HostWaits`` counts each kind of call that makes the host wait for the device on
CUDA, on a CPU too, and not its twin that waits for nothing (issue: the GPU step does the plain
loop's work; a CPU proves it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fsdp2lab.training.device_reads import HostWaits

X = torch.arange(6.0)
MASK = X > 2
REPEATS = torch.tensor([1, 2, 1, 1, 2, 1])


def put_by_mask(x):
    x.clone()[MASK] = torch.tensor(0.0)


def put_by_index(x):
    x.clone()[torch.tensor([3, 4])] = torch.tensor(0.0)


# kind: (a call that waits, its twin that does not)
CASES = {
    "item": (lambda x: x.sum().item(), lambda x: x.sum()),
    "read": (lambda x: x.tolist(), lambda x: x.clone()),
    "read-cpu": (lambda x: x.cpu(), lambda x: x.double()),
    "read-numpy": (lambda x: x.numpy(), lambda x: x.detach()),
    "nonzero": (lambda x: x.nonzero(), lambda x: torch.nonzero_static(x, size=5)),
    "masked_select": (lambda x: x.masked_select(MASK), lambda x: x.masked_fill(~MASK, 0.0)),
    "mask_index": (lambda x: x[MASK], lambda x: x[torch.tensor([3, 4, 5])]),
    "mask_index-put": (put_by_mask, put_by_index),
    "repeat_interleave": (
        lambda x: x.repeat_interleave(REPEATS),
        lambda x: x.repeat_interleave(REPEATS, output_size=8),
    ),
    "read-to-cpu": (lambda x: x.to("cpu"), lambda x: x.to(x.device)),
    "read-into-a-host-tensor": (
        lambda x: torch.tensor([0.0] * 6).copy_(x),
        lambda x: torch.empty_like(x).copy_(x),
    ),
    "nonzero-of-where": (lambda x: torch.where(MASK), lambda x: torch.where(MASK, x, 0.0)),
    "unique": (lambda x: x.unique(), lambda x: x.sort()),
    "bincount": (
        lambda x: x.long().bincount(),
        lambda x: torch.zeros(6).scatter_add_(0, x.long(), x),
    ),
    "equal": (lambda x: torch.equal(x, x), lambda x: torch.eq(x, x).all()),
    "equal-allclose": (lambda x: torch.allclose(x, x), lambda x: torch.isclose(x, x).all()),
    "copy": (lambda x: x.to("meta"), lambda x: x.to("meta", non_blocking=True)),
    "copy-from-host": (
        lambda x: torch.tensor([1.0]).to(x.device),
        lambda x: torch.tensor([1.0]).to(x.device, non_blocking=True),
    ),
    "copy-from-numpy": (
        lambda x: torch.from_numpy(np.ones(2)).to(x.device, torch.float32),
        lambda x: torch.from_numpy(np.ones(2)).to(torch.float32),
    ),
    "host_value": (
        lambda x: torch.as_tensor(3, dtype=torch.float64, device=x.device),
        lambda x: torch.as_tensor(3, dtype=torch.float64),
    ),
    "host_value-tensor": (
        lambda x: torch.tensor([1.0, 2.0], device=x.device),
        lambda x: torch.tensor([1.0, 2.0]),
    ),
    "host_value-of-a-tensor": (
        lambda x: torch.as_tensor([1.0], device=x.device),
        lambda x: torch.as_tensor(x, device=x.device),  # already there
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_each_kind_is_counted_once_and_its_twin_not(case):
    waits, twin = CASES[case]
    kind = case.split("-")[0]
    with HostWaits("cpu") as counter:
        waits(X)
        seen = counter.take()
        twin(X)
    assert seen == {kind: 1}
    assert counter.take() == {}


def test_a_tensor_made_for_the_host_is_used_without_a_wait():
    """On a CPU, the tensors the code made for the host (from host values without a device,
    ``.cpu()``) and what is computed from them alone are the host's; on CUDA, every CPU tensor."""
    with HostWaits("cpu") as counter:
        host = torch.tensor([1.0, 2.0, 3.0])
        host.sum().item(), (host * 2).tolist(), host[host > 1].nonzero(), host.cpu().numpy()
        moved = X.cpu()
        moved.sum().item(), moved.tolist()
    assert counter.take() == {"read": 1}  # X.cpu() alone
    assert torch.equal(moved, X)
    with HostWaits("cuda") as counter:
        X.sum().item(), X.tolist(), X[MASK], X.cpu(), X.to("cpu"), torch.tensor([0.0] * 6).copy_(X)
    assert counter.take() == {}


def test_synchronizes_are_counted_and_a_query_is_not(monkeypatch):
    """Where no GPU is, the CUDA calls themselves are stand-ins: the count wraps what is there."""
    for owner, name in [(torch.cuda, "synchronize"), (torch.accelerator, "synchronize"),
                        (torch.cuda.Stream, "synchronize"), (torch.cuda.Event, "synchronize"),
                        (torch.cuda.Event, "query")]:  # fmt: skip
        monkeypatch.setattr(owner, name, lambda *args: None)
    with HostWaits("cuda") as counter:
        torch.cuda.synchronize()
        torch.accelerator.synchronize()
        torch.cuda.Stream.synchronize(None)
        torch.cuda.Event.synchronize(None)
        torch.cuda.Event.query(None)
    assert counter.take() == {"synchronize": 4}


def test_a_paused_count_and_the_calls_after_it_count_nothing():
    original = torch.Tensor.tolist
    with HostWaits("cpu") as counter:
        counter.paused = True
        X.tolist()
        torch.as_tensor(1, device="cpu")
    assert counter.take() == {}
    assert torch.Tensor.tolist is original  # the counted calls are put back
    X.tolist()
    assert counter.take() == {}
