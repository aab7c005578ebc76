"""``device_reads.HostWaits`` counts each kind of call that makes the host wait for the device on
CUDA, on a CPU too, and not its twin that waits for nothing (issue: the GPU step does the plain
loop's work; a CPU proves it)."""

from __future__ import annotations

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
    "copy": (lambda x: x.to("meta"), lambda x: x.to("meta", non_blocking=True)),
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
