"""A training step's time on a GPU, op by op, from the ops the plan's simulation issued
(:class:`fsdp2lab.scale.op_trace.OpTrace`), with the constants of :mod:`fsdp2lab.scale.gpus`.

Each op's time on its stream:

* **matmul**: its FLOPs at the GPU's sustained matmul rate (``GPU.mamf_tflops``), scaled by how
  much of the last wave of output tiles is useful (a skinny or small matmul leaves SMs idle), and
  never less than its bytes at the copy bandwidth;
* **attention** (flash kernels): its FLOPs (half under a causal mask) at the GPU's published
  flash-attention speed for its direction, mask, head dimension and sequence length
  (``GPU.attention``: a curve), else at the GPU's one share of the peak;
* **everything else**: its bytes read and written at the achieved copy bandwidth;
* **collectives**: their bytes on the wire at the link's bandwidth (NCCL's bus bandwidth over
  NVLink within a node, the network across nodes) plus a latency per call.

Streams, as the GPU runs them: the host issues ops one after another, each costing it
``launch_s`` in eager mode (a kernel cannot start before it is issued); the compute stream runs
its kernels in order; every mesh dimension's collectives (with FSDP2's copies into their
buffers) run on a side stream of their own, each starting when issued and when the compute
stream has run what was issued before it (the stream waits FSDP2 and c10d put in); an op that
reads a collective's output waits for it; the ops that finish a data-parallel reduction (FSDP2's
division and copy into the sharded gradients) run on its stream. So FSDP2's prefetched all-gathers and its
reduce-scatters overlap compute as far as the order of issue allows, and tensor-parallel
collectives, whose outputs the next op reads, sit on the critical path. Where the host runs
the kernels itself (a CPU: ``GPU.host_runs_kernels``), nothing overlaps: the step is every op's
launch and run in turn.

Under ``--compile``, each run of consecutive elementwise and reduction ops of the compiled units
becomes one kernel that reads what the run takes from outside and writes what it does not
consume itself; the loss's ops, which the per-unit compile leaves eager, stay as they are.

The optimizer step runs when every gradient is reduced: fused Adam(W) reads and writes
parameters, gradients and state once; other optimizers move the bytes of their per-tensor ops
(grouped into a few launches by ``foreach``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fsdp2lab.scale.gpus import GPU

if TYPE_CHECKING:  # op_trace imports torch: ``fsdp2lab plan --help`` goes without it
    from fsdp2lab.scale.op_trace import Op


@dataclass
class StepTime:
    """A step's time and where it goes: ``busy`` is each kind's kernel time summed (what the
    stream would take alone), ``exposed`` the collectives' time not hidden behind compute."""

    step_s: float
    busy: dict[str, float]  # compute stream: matmul, attention, memory; and optimizer_s
    comm: dict[str, float]  # per mesh dimension: its collectives' time
    exposed_comm_s: float  # waits of the compute stream for collectives
    launch_bound_s: float  # time the compute stream waited for the host to issue kernels
    kernels: int  # launched on the compute stream
    optimizer_s: float


def matmul_s(gpu: GPU, flops: int, nbytes: int, mnk: tuple[int, int, int]) -> float:
    m, n, _ = mnk
    tm, tn = gpu.tile
    tiles = math.ceil(m / tm) * math.ceil(n / tn)
    waves = math.ceil(tiles / gpu.sms)
    useful = (m * n) / (waves * gpu.sms * tm * tn) if tiles else 1.0
    return max(flops / (gpu.mamf_tflops * 1e12 * useful), nbytes / (gpu.hbm_tbs * 1e12))


def compute_floor_s(gpu: GPU, ops: list[Op]) -> float:
    """The least time the compute stream takes over ``ops``' matmuls and attention: each matmul
    at the matmul rate with no wave of tiles lost (what :func:`matmul_s` never goes below), attention as
    timed."""
    matmul_flops = sum(op.flops for op in ops if op.kind == "matmul")
    attention = sum(kernel_s(gpu, op) for op in ops if op.kind == "attention")
    return matmul_flops / (gpu.mamf_tflops * 1e12) + attention


def kernel_s(gpu: GPU, op: Op) -> float:
    """One kernel's time on its stream (collectives: see :func:`step_time`)."""
    if op.kind == "matmul":
        return matmul_s(gpu, op.flops, op.bytes, op.mnk)
    if op.kind == "attention":
        flops = op.flops / 2 if op.causal else op.flops
        return flops / (gpu.bf16_tflops * 1e12 * attention_share(gpu, op))
    return op.bytes / (gpu.hbm_tbs * 1e12)


def attention_share(gpu: GPU, op: Op) -> float:
    """Flash attention's achieved share of ``gpu``'s peak for ``op``: its published curve at the
    op's direction, mask, head dimension and key length where the GPU has one, else its one
    share."""
    if isinstance(gpu.attention, float):
        return gpu.attention
    head_dim, seq_len = op.attention_shape
    return gpu.attention.share(op.backward, op.causal, head_dim, seq_len)


def fused(ops: list[Op]) -> list[Op]:
    """The ops as a compiler fuses them: each run of consecutive fusable memory-bound ops one
    kernel, reading the tensors the run does not make and writing those it does not consume."""
    from fsdp2lab.scale.op_trace import Op

    out: list[Op] = []
    run: list[Op] = []

    def flush():
        if len(run) == 1:
            out.append(run[0])
        elif run:
            made = {s for op in run for s in op.writes}
            read: dict[int, int] = {}
            consumed: set[int] = set()
            for op in run:
                for s, b in zip(op.reads, op.read_bytes, strict=True):
                    if s not in made:
                        read[s] = max(read.get(s, 0), b)
                    consumed.add(s)
            written: dict[int, int] = {}
            for i, op in enumerate(run):
                later = {s for o in run[i + 1 :] for s in o.reads}
                for s, b in zip(op.writes, op.write_bytes, strict=True):
                    if s not in later or i == len(run) - 1:
                        written[s] = max(written.get(s, 0), b)
            out.append(
                Op(
                    "memory",
                    sum(op.flops for op in run),
                    sum(read.values()) + sum(written.values()),
                    tuple(read),
                    tuple(written),
                    optimizer=run[0].optimizer,
                )
            )
        run.clear()

    for op in ops:
        if op.kind == "memory" and op.fusable and not op.optimizer:
            run.append(op)
        else:
            flush()
            out.append(op)
    flush()
    return out


def step_time(
    ops: list[Op],
    gpu: GPU,
    *,
    compiled: bool,
    links: dict[str, tuple[float, float]],
    optimizer_bytes: int | None,
) -> StepTime:
    """The step of ``ops`` on ``gpu``. ``links``: per mesh dimension, (bandwidth GB/s, latency s
    per call). ``optimizer_bytes``: what a fused optimizer moves; None to time the optimizer's
    own ops from the trace."""
    if compiled:
        ops = fused(ops)
    if gpu.host_runs_kernels:
        return _host_step(ops, gpu, links, optimizer_bytes)
    host = gpu_free = copied_out = 0.0
    side_free: dict[str, float] = defaultdict(float)
    ready: dict[int, float] = {}
    side_made: set[int] = set()  # storages a side stream wrote
    post_reduce = ""  # the data-parallel dimension whose reduction the ops now finish
    busy = dict.fromkeys(("matmul", "attention", "memory"), 0.0)
    comm: dict[str, float] = defaultdict(float)
    exposed = launch_bound = 0.0
    kernels = 0
    optimizer_ops = []
    for i, op in enumerate(ops):
        if op.optimizer:
            optimizer_ops.append(op)
            continue
        host += gpu.launch_s
        inputs = max((ready.get(s, 0.0) for s in op.reads), default=0.0)
        finishing = op.kind == "memory" and not op.fsdp and side_made.intersection(op.reads)
        if post_reduce and not finishing:
            post_reduce = ""
        if op.kind in ("collective", "copy_in") or post_reduce:
            dim = op.dim or post_reduce or _next_dim(ops, i)
            if op.kind == "collective":
                gbs, latency = links[dim]
                seconds = op.wire_bytes / (gbs * 1e9) + latency
                comm[dim] += seconds
            else:
                seconds = kernel_s(gpu, op)
            start = max(
                host, side_free[dim], inputs, _waits_for(op, gpu_free, copied_out, side_made)
            )
            side_free[dim] = start + seconds
            for s in op.writes:
                ready[s] = side_free[dim]
                side_made.add(s)
            if op.collective in ("reduce_scatter", "all_reduce") and dim.startswith("dp"):
                post_reduce = dim
            continue
        seconds = kernel_s(gpu, op)
        busy[op.kind] += seconds
        kernels += 1
        start = max(host, gpu_free, inputs)
        if start > gpu_free:
            if inputs >= host:
                exposed += start - gpu_free
            else:
                launch_bound += start - gpu_free
        gpu_free = start + seconds
        for s in op.writes:
            ready[s] = gpu_free
            side_made.discard(s)
        if op.fsdp == "split_with_sizes_copy":
            copied_out = gpu_free
    end = max(gpu_free, host, *side_free.values())
    exposed += end - max(gpu_free, host)
    if optimizer_bytes is not None:
        optimizer_s = optimizer_bytes / (gpu.hbm_tbs * 1e12)
    else:
        optimizer_s = sum(kernel_s(gpu, op) for op in optimizer_ops)
    return StepTime(
        step_s=end + optimizer_s,
        busy=busy,
        comm=dict(comm),
        exposed_comm_s=exposed,
        launch_bound_s=launch_bound,
        kernels=kernels,
        optimizer_s=optimizer_s,
    )


def _host_step(
    ops: list[Op], gpu: GPU, links: dict[str, tuple[float, float]], optimizer_bytes: int | None
) -> StepTime:
    """The step where the host runs each kernel it issues: every op's launch and run in turn
    (``launch_bound_s``: the launches; every collective's time is exposed)."""
    busy = dict.fromkeys(("matmul", "attention", "memory"), 0.0)
    comm: dict[str, float] = defaultdict(float)
    kernels = 0
    optimizer_s = 0.0
    if optimizer_bytes is not None:  # one fused kernel
        kernels, optimizer_s = 1, optimizer_bytes / (gpu.hbm_tbs * 1e12)
    for i, op in enumerate(ops):
        if op.kind == "collective":
            dim = op.dim or _next_dim(ops, i)
            gbs, latency = links[dim]
            comm[dim] += op.wire_bytes / (gbs * 1e9) + latency
        elif op.optimizer:
            if optimizer_bytes is None:
                kernels += 1
                optimizer_s += kernel_s(gpu, op)
        else:
            kernels += 1
            busy[op.kind if op.kind in busy else "memory"] += kernel_s(gpu, op)
    launches = kernels + sum(op.kind == "collective" for op in ops)
    comm_s = sum(comm.values())
    return StepTime(
        step_s=launches * gpu.launch_s + sum(busy.values()) + comm_s + optimizer_s,
        busy=busy,
        comm=dict(comm),
        exposed_comm_s=comm_s,
        launch_bound_s=launches * gpu.launch_s,
        kernels=kernels,
        optimizer_s=optimizer_s,
    )


def _waits_for(op: Op, gpu_free: float, copied_out: float, side_made: set[int]) -> float:
    """What a side-stream op waits for on the compute stream besides its inputs. FSDP2's
    all-gather copy-in waits for the previous all-gather's copy-out only (so the host, running
    ahead, prefetches the next unit while this one computes); a collective fed by a copy-in (or
    by another collective) waits for its input alone; the others (the reduce-scatter's copy-in,
    tensor- and pipeline-parallel collectives) wait for what the compute stream was given
    before them."""
    if op.fsdp.startswith("all_gather"):
        return copied_out
    if op.kind == "collective" and any(s in side_made for s in op.reads):
        return 0.0
    return gpu_free


def _next_dim(ops: list[Op], i: int) -> str:
    """The mesh dimension of the collective a copy-in feeds: the next collective's."""
    for op in ops[i + 1 :]:
        if op.kind == "collective":
            return op.dim
    return "other"
