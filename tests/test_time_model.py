"""The plan's time model (``scale.timing``) on traces written out by hand, where each figure
follows from the constants in ``scale.gpus``, and on a plan's own trace."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fsdp2lab.scale.gpus import GPUS, LAUNCH_S, MATMUL_TILE
from fsdp2lab.scale.op_trace import Op, OpTrace
from fsdp2lab.scale.timing import fused, kernel_s, matmul_s, step_time

H100 = GPUS["h100"]
LINKS = {"dp_shard": (H100.intra_node_gbs, 10e-6), "tp": (H100.intra_node_gbs, 10e-6)}
MB = 1 << 20
# The H100's published rates (scale.gpus): NCCL's ring bus bandwidth over NVLink 4, the mean of
# all-gather's 361.4 and reduce-scatter's 362.9 GB/s; a device-to-device copy, 2,903.4 GB/s.
NVLINK_BYTES_S = (361.4 + 362.9) / 2 * 1e9
COPY_BYTES_S = 2903.4e9


def mm(m: int, n: int, k: int, reads=(1, 2), writes=(3,)) -> Op:
    nbytes = 2 * (m * k + k * n + m * n)
    return Op("matmul", 2 * m * n * k, nbytes, reads, writes, mnk=(m, n, k))


def mem(nbytes: int, reads, writes) -> Op:
    half = nbytes // 2
    return Op(
        "memory",
        0,
        nbytes,
        tuple(reads),
        tuple(writes),
        tuple(half // len(reads) for _ in reads),
        tuple(half // len(writes) for _ in writes),
    )


def test_a_large_matmul_runs_at_the_maximum_achievable_flops():
    tm, tn = MATMUL_TILE
    m, n = tm * H100.sms * 4, tn * 8  # 32 waves of full tiles
    flops = 2 * m * n * 8192
    assert matmul_s(H100, flops, 0, (m, n, 8192)) == pytest.approx(
        flops / (H100.mamf_tflops * 1e12)
    )


def test_a_partial_last_wave_costs_a_whole_wave():
    tm, tn = MATMUL_TILE
    full = matmul_s(H100, 1, 0, (tm * H100.sms, tn, 4096))
    one_more = matmul_s(H100, 1, 0, (tm * (H100.sms + 1), tn, 4096))  # 133 tiles: 2 waves
    assert one_more / full == pytest.approx(2 * H100.sms / (H100.sms + 1))


def test_a_skinny_matmul_is_bound_by_its_bytes():
    op = mm(16384, 16, 4096)  # a LoRA adapter's A: rank 16
    assert matmul_s(H100, op.flops, op.bytes, op.mnk) == pytest.approx(op.bytes / COPY_BYTES_S)


def test_an_all_gather_issued_ahead_hides_behind_compute():
    big = mm(16384, 4096, 4096, reads=(10, 11), writes=(12,))
    gather = Op("collective", 0, 0, (20,), (21,), dim="dp_shard", wire_bytes=100 * MB)
    uses_it = mm(16384, 4096, 4096, reads=(21, 12), writes=(13,))
    alone = step_time([big, uses_it], H100, compiled=False, links=LINKS, optimizer_bytes=0)
    overlapped = step_time(
        [gather, big, uses_it], H100, compiled=False, links=LINKS, optimizer_bytes=0
    )
    comm_s = 100 * MB / NVLINK_BYTES_S + 10e-6
    assert big.flops / (H100.mamf_tflops * 1e12) > comm_s  # the matmul is the longer
    assert overlapped.step_s == pytest.approx(alone.step_s + LAUNCH_S)
    assert overlapped.exposed_comm_s == pytest.approx(0.0, abs=1e-12)
    assert overlapped.comm["dp_shard"] == pytest.approx(comm_s)


def test_a_collective_whose_output_the_next_op_reads_is_on_the_critical_path():
    a = mm(16384, 4096, 4096, reads=(10, 11), writes=(12,))
    reduce = Op("collective", 0, 0, (12,), (13,), dim="tp", wire_bytes=200 * MB)
    b = mm(16384, 4096, 4096, reads=(13, 11), writes=(14,))
    t = step_time([a, reduce, b], H100, compiled=False, links=LINKS, optimizer_bytes=0)
    comm_s = 200 * MB / NVLINK_BYTES_S + 10e-6
    compute = 2 * matmul_s(H100, a.flops, a.bytes, a.mnk)
    assert t.step_s == pytest.approx(LAUNCH_S + compute + comm_s)
    assert t.exposed_comm_s == pytest.approx(comm_s)


def test_tiny_kernels_wait_for_the_host():
    ops = [mem(1024, [i], [i + 1]) for i in range(1000)]
    t = step_time(ops, H100, compiled=False, links=LINKS, optimizer_bytes=0)
    last_kernel = 1024 / (H100.hbm_tbs * 1e12)
    assert t.step_s == pytest.approx(1000 * LAUNCH_S + last_kernel)
    assert t.kernels == 1000


def test_compiling_fuses_a_chain_into_one_kernel_that_moves_its_ends():
    chain = [mem(2 * MB, [1], [2]), mem(2 * MB, [2], [3]), mem(2 * MB, [3], [4])]
    (kernel,) = fused(chain)
    assert kernel.bytes == 2 * MB  # reads 1 (1 MiB), writes 4 (1 MiB)
    assert kernel.reads == (1,) and kernel.writes == (4,)
    between = fused([chain[0], mm(64, 64, 64), chain[1], chain[2]])
    assert [op.kind for op in between] == ["memory", "matmul", "memory"]
    eager = step_time(chain, H100, compiled=False, links=LINKS, optimizer_bytes=0)
    compiled = step_time(chain, H100, compiled=True, links=LINKS, optimizer_bytes=0)
    assert (eager.kernels, compiled.kernels) == (3, 1)
    assert compiled.busy["memory"] == pytest.approx(eager.busy["memory"] / 3)


def test_an_intermediate_read_later_in_the_chain_is_not_written():
    chain = [mem(2 * MB, [1], [2]), mem(3 * MB, [2, 1], [3])]  # 2 is consumed inside
    (kernel,) = fused(chain)
    assert set(kernel.writes) == {3} and set(kernel.reads) == {1}


def test_the_optimizer_is_timed_by_its_bytes_when_fused_and_from_its_ops_otherwise():
    step = [mm(4096, 4096, 4096)]
    opt = [mem(64 * MB, [7], [7]) for _ in range(3)]
    for op in opt:
        op.optimizer = True
    fused_t = step_time(step + opt, H100, compiled=False, links=LINKS, optimizer_bytes=32 * MB)
    loop_t = step_time(step + opt, H100, compiled=False, links=LINKS, optimizer_bytes=None)
    assert fused_t.optimizer_s == pytest.approx(32 * MB / COPY_BYTES_S)
    assert loop_t.optimizer_s == pytest.approx(3 * 64 * MB / COPY_BYTES_S)
    assert fused_t.kernels == loop_t.kernels == 1


def test_where_the_host_runs_the_kernels_the_step_is_every_launch_and_run_in_turn():
    cpu = dataclasses.replace(
        H100, tile=(1, 1), sms=1, launch_s=5e-6, host_runs_kernels=True, mamf_tflops=1e-3
    )
    a = mm(100, 30, 7, reads=(10, 11), writes=(12,))  # 2 tiles of 128 on the GPU: no waves here
    gather = Op("collective", 0, 0, (20,), (21,), dim="dp_shard", wire_bytes=100 * MB)
    ops = [gather, a, mem(8 * MB, [12], [13]), mem(1024, [13], [14])]
    t = step_time(ops, cpu, compiled=False, links=LINKS, optimizer_bytes=4 * MB)
    matmul = a.flops / 1e9
    memory = (8 * MB + 1024) / (cpu.hbm_tbs * 1e12)
    comm = 100 * MB / NVLINK_BYTES_S + 10e-6
    optimizer = 4 * MB / (cpu.hbm_tbs * 1e12)
    assert t.busy["matmul"] == pytest.approx(matmul)
    assert t.step_s == pytest.approx(5 * 5e-6 + matmul + memory + comm + optimizer)
    assert (t.kernels, t.launch_bound_s, t.exposed_comm_s) == (
        4,
        pytest.approx(25e-6),
        pytest.approx(comm),
    )


@pytest.mark.parametrize(
    "vocab, forward_reads, backward_reads",
    [(1024, 1, (1, 1)), (128_256, 3, (2, 1))],  # a row on chip; a Llama 3 vocabulary's is not
)
def test_a_softmax_over_rows_too_long_for_the_chip_reads_them_once_a_pass(
    vocab, forward_reads, backward_reads
):
    """torch's softmax kernels keep a row of up to 160 KiB on chip (registers, shared memory);
    a longer one is read from memory again for each pass: the max, the sum, the output forward;
    the sum and the gradient backward (op_trace.ROW_PASSES)."""
    import torch

    from fsdp2lab.scale.op_trace import OpTrace

    aten = torch.ops.aten
    logits = torch.empty(512, vocab, device="meta")
    out = torch.empty_like(logits)
    trace = OpTrace()
    trace.record(aten._log_softmax.default, (logits, 1, False), {}, out, 0)
    trace.record(aten._log_softmax_backward_data.default, (out, out, 1, torch.float32), {}, out, 0)
    tensor = logits.numel() * 4  # fp32
    forward, backward = trace.ops
    assert forward.read_bytes == (forward_reads * tensor,) and forward.write_bytes == (tensor,)
    assert forward.bytes == (forward_reads + 1) * tensor
    assert backward.read_bytes == tuple(n * tensor for n in backward_reads)
    assert backward.bytes == (sum(backward_reads) + 1) * tensor


def test_attention_runs_at_the_published_speed_of_its_direction_and_shape():
    """Flash attention on an H100 at FlashAttention-2's published TFLOP/s (FlashAttention-3's
    paper, Figures 5 and 6): causal forward at head dimension 128 and 8k keys 333, backward 318
    (the unmasked curve: no causal one is published); between published lengths interpolated in
    log2, held beyond them, at the nearest published head dimension. A GPU without a curve (the
    H200, measured) keeps its flat share."""
    aten = torch.ops.aten
    q = torch.empty(1, 32, 8192, 128, device="meta")
    lse = torch.empty(1, 32, 8192, device="meta")
    flops = 4 * 32 * 8192 * 8192 * 128  # QK^T and PV, unmasked
    trace = OpTrace()
    trace.record(aten._scaled_dot_product_flash_attention_for_cpu.default, (q, q, q, 0.0, True),
                 {}, (q, lse), flops)  # fmt: skip
    trace.record(aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                 (q, q, q, q, q, lse, 0.0, True), {}, (q, q, q), 5 * flops // 2)  # fmt: skip
    forward, backward = trace.ops
    assert (forward.attention_shape, forward.causal, forward.backward) == ((128, 8192), True, False)
    assert (backward.attention_shape, backward.causal, backward.backward) == (
        (128, 8192),
        True,
        True,
    )
    assert kernel_s(H100, forward) == pytest.approx(flops / 2 / 333e12)
    assert kernel_s(H100, backward) == pytest.approx(2.5 * flops / 2 / 318e12)
    h200 = GPUS["h200"]
    assert kernel_s(h200, forward) == pytest.approx(flops / 2 / (989e12 * h200.attention))
    curve = H100.attention
    assert curve.share(True, False, 128, 3000) * 989 == pytest.approx(
        291 + (310 - 291) * math.log2(3000 / 2048)
    )
    assert curve.share(False, True, 96, 1024) * 989 == pytest.approx(260)  # nearest: 128
    assert curve.share(True, False, 256, 1 << 20) * 989 == pytest.approx(322)  # 128, held at 16k
    assert curve.share(False, False, 64, 128) * 989 == pytest.approx(282)  # held at 512


def test_a_storage_made_where_a_freed_one_was_is_another_to_the_trace():
    """The trace keys storages by address; one made where a freed one was (by any op, not only
    an allocation) must not be taken for it, else an op reading it would wait for whatever wrote
    the freed one. The control: without a trace holding the freed storage, the allocator does
    make the next one at its address."""

    def made_after_a_free(trace: OpTrace | None) -> list[tuple[int, int]]:
        out = []
        with FakeTensorMode():
            for _ in range(10):
                a = torch.empty(4)
                address = a.untyped_storage()._cdata
                if trace is not None:  # a side stream writes it
                    trace.collective("all_reduce", "dp_shard", [], [a], 0)
                del a
                b = torch.ones(4)
                if trace is not None:
                    trace.collective("all_reduce", "dp_shard", [b], [], 0)
                out.append((address, b.untyped_storage()._cdata))
                del b
        return out

    assert any(freed == made for freed, made in made_after_a_free(None))
    trace = OpTrace()
    made_after_a_free(trace)
    writes, reads = trace.ops[0::2], trace.ops[1::2]
    assert not {op.writes[0] for op in writes} & {op.reads[0] for op in reads}
