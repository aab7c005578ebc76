"""``fsdp2lab plan``'s rank roles simulated one after another in one process, on this torch.

Each role runs over process groups of its own; DTensor caches its sharding decisions with the
DeviceMesh they were made on, and a new mesh of the same shape compares equal to the old one.
``torch_compat.clear_dtensor_caches`` forgets them after each role (Python and, on newer torch,
C++ caches); without it, the second tensor-parallel role runs collectives on the first role's
destroyed groups."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from fsdp2lab.cli import build_parser
from fsdp2lab.config import config_from_args
from fsdp2lab.plan import resolve
from fsdp2lab.runtime.torch_compat import clear_dtensor_caches
from fsdp2lab.scale import simulate as simulation
from skips import other_torch

pytestmark = pytest.mark.compat  # .ci/run runs these again on other torch versions

FLAGS = ["--model", "gpt", "--d-model", "64", "--seq-len", "64", "--batch-size", "4",
         "--pp", "2", "--tp", "2"]  # fmt: skip


def pp_tp_plan():
    return resolve(config_from_args(build_parser().parse_args(["train", *FLAGS])), 4)


def test_tensor_parallel_roles_in_turn():
    cleared = clear_dtensor_caches()
    assert "propagate_op_sharding" in cleared  # the Python cache, on every torch declared
    native = hasattr(torch._C, "_clear_DTensor_sharding_propagator_cache")
    assert ("native_sharding_propagator" in cleared) == native
    plan = pp_tp_plan()
    first, last = (simulation.simulate(plan, rank=r) for r in simulation.stage_ranks(plan))
    assert (first.stage, last.stage) == (0, 1)
    assert first.state != last.state
    # the pipeline's sends are the micro-batch's activations, sharded by sequence parallelism
    assert first.comm["pp"]["send"].calls == plan.n_microbatches
    assert first.comm["tp"]["all_gather"].calls > 0


@pytest.mark.skipif(
    not hasattr(torch._C, "_clear_DTensor_sharding_propagator_cache"),
    reason=other_torch(
        ">=2.15", "no native DTensor sharding cache: the failure is the newer torch's"
    ),
)
def test_without_clearing_the_second_role_fails(monkeypatch):
    """The negative control."""
    monkeypatch.setattr(simulation, "clear_dtensor_caches", lambda: [])
    plan = pp_tp_plan()
    try:
        simulation.simulate(plan, rank=0)
        with pytest.raises(RuntimeError, match="process group"):
            simulation.simulate(plan, rank=2)
    finally:
        clear_dtensor_caches()  # for the tests after this one


FAKE_CUDA_BACKWARD = """
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
with FakeTensorMode(allow_non_fake_inputs=True):
    w = torch.randn(8, 8, device="cuda", requires_grad=True)
    (w * 2).sum().backward()
print("backward ran")
"""


def test_fake_cuda_tensors_run_a_backward_only_with_a_gpu():
    """Why the plan's fake tensors are CPU ones: on a machine without a GPU, autograd's engine
    needs a CUDA device for fake CUDA tensors (torch 2.15: an error; 2.8: the process aborts). The
    day this fails without a GPU, the plan can trace on fake CUDA tensors."""
    proc = subprocess.run(
        [sys.executable, "-c", FAKE_CUDA_BACKWARD], capture_output=True, text=True, timeout=120
    )
    ran = proc.returncode == 0 and "backward ran" in proc.stdout
    assert ran == torch.cuda.is_available(), (proc.stdout, proc.stderr[-2000:])
