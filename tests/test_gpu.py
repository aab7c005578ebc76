"""On CUDA: the NCCL path, bf16 autocast, ``--memory-snapshot``, ``peak_reserved``, CPU offload.

Marked ``gpu``: left out of the default suite, skipped without CUDA (and by device count), run by
.ci/run's gpu stage when ``torch.cuda.is_available()``. Until a machine with GPUs has run them,
docs/parallelisms.md lists what they check as unverified.

One GPU: training there follows the same run on CPU over 20 steps (different kernels: rounding
only, 1e-4); bf16 autocast follows fp32 within 5e-2 and is not fp32; ``--memory-snapshot``
writes torch's snapshot (with allocations in it); the summary reports peak allocated and reserved
(reserved >= allocated > the parameters' bytes); ``--cpu-offload`` equals the run without it
(1e-5). Two GPUs: NCCL FSDP2 follows one GPU (1e-5, as gloo on CPU does); four: HSDP 2x2 too.
"""

from __future__ import annotations

import pickle

import pytest
import torch

from conftest import GPT_TINY, TINY, assert_close_lists, train

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS == 0, reason="no CUDA device (torch.cuda.is_available() is False)"),
]
RUN = [*TINY, *GPT_TINY, "--max-steps", "20", "--log-every-steps", "1",
       "--global-batch-size", "32", "--optimizer", "adam"]  # fmt: skip
ONE = ["--nproc-per-node", "1"]


def needs(gpus: int):
    return pytest.mark.skipif(gpus > GPUS, reason=f"needs {gpus} GPUs, {GPUS} here")


@pytest.fixture(scope="module")
def one_gpu(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu")
    return train(out, *RUN, *ONE, "--strategy", "single", "--device", "cuda", name="cuda")


def test_one_gpu_follows_cpu(one_gpu, tmp_path):
    cpu = train(tmp_path, *RUN, *ONE, "--strategy", "single", "--device", "cpu", name="cpu")
    assert "[cuda/" in one_gpu.stdout and "[cpu/" in cpu.stdout
    assert_close_lists(one_gpu.step_losses, cpu.step_losses, 1e-4)
    assert one_gpu.step_losses[-1] < one_gpu.step_losses[0]


def test_bf16_autocast_on_cuda_follows_fp32(one_gpu, tmp_path):
    bf16 = train(tmp_path, *RUN, *ONE, "--strategy", "single", "--device", "cuda",
                 "--mixed-precision", "bf16", name="bf16")  # fmt: skip
    assert_close_lists(bf16.step_losses, one_gpu.step_losses, 5e-2)
    assert bf16.step_losses != one_gpu.step_losses  # it computes in bf16


def test_peak_allocated_and_reserved_are_reported(one_gpu):
    summary = one_gpu.summary
    (allocated,), (reserved,) = summary["peak_memory_bytes"], summary["peak_reserved_bytes"]
    (params,) = summary["param_bytes"]
    assert reserved >= allocated > params > 0, (reserved, allocated, params)
    assert "rss_growth_bytes" not in summary


def test_memory_snapshot_is_written(tmp_path):
    train(tmp_path, *RUN, *ONE, "--device", "cuda", "--memory-snapshot", "mem.pickle")
    snapshot = pickle.loads((tmp_path / "mem.pickle").read_bytes())
    assert snapshot["segments"] and any(t for t in snapshot["device_traces"])


def test_cpu_offload_on_cuda_equals_no_offload(tmp_path):
    plain = train(tmp_path, *RUN, *ONE, "--device", "cuda", name="plain")
    offload = train(tmp_path, *RUN, *ONE, "--device", "cuda", "--cpu-offload", name="offload")
    assert_close_lists(offload.step_losses, plain.step_losses, 1e-5)


@needs(2)
def test_nccl_fsdp2_on_two_gpus_follows_one(one_gpu, tmp_path):
    run = train(tmp_path, *RUN, "--nproc-per-node", "2", "--device", "cuda")
    assert "[cuda/nccl]" in run.stdout
    assert_close_lists(run.step_losses, one_gpu.step_losses, 1e-5)


@needs(4)
def test_nccl_hsdp_on_four_gpus_follows_one(one_gpu, tmp_path):
    run = train(tmp_path, *RUN, "--nproc-per-node", "4", "--dp-replicate", "2", "--device", "cuda")
    assert "[cuda/nccl]" in run.stdout and "dp_replicate=2" in run.stdout
    assert_close_lists(run.step_losses, one_gpu.step_losses, 1e-5)
