"""From what a simulation measured to a GPU: memory as the allocator reserves it, communication
time per mesh dimension, step time, tokens per second and MFU.

Measured (traced by running the code): tensor memory by category and its peak, the sharded
state, every collective's bytes, FLOPs, every op in order. Estimated here, each by a stated model:

* reserved memory (:func:`reserved_bytes`): the caching allocator keeps its blocks per stream.
  FSDP2 makes the sharded gradients on its reduce-scatter stream (they are views of the
  reduce-scatter output), so their blocks stay reserved in that stream's pool for the whole step,
  freed or not, and the compute stream cannot lend them to activations. Reserved = (tracked peak
  - the gradients live at it) x (1 + ALLOCATOR_OVERHEAD) + all the sharded gradients. Outside
  PyTorch: the CUDA context and NCCL's buffers, ``NON_TORCH_GIB``. A plan fits where reserved +
  that <= the GPU's memory x (1 - margin).
* step time (:mod:`fsdp2lab.scale.timing`): every op of the traced step on the GPU's roofline,
  on the streams FSDP2 and c10d put it on, with the host's launches; collectives' ring bytes per
  rank over NVLink where a mesh dimension's ranks share a node (``--nproc-per-node`` consecutive
  ranks), else over ``--inter-node-gbs``, plus a latency per call; the optimizer's bytes.
* ``--cpu-offload`` (:func:`offload_time`): the shards copied to the GPU and the gradients
  copied back at the GPU's PCIe rate per direction (``gpus.H2D_SHARE`` / ``D2H_SHARE`` of its
  line rate), added to the step (not overlapped), and the optimizer stepping on the host instead:
  its bytes at the node's host memory bandwidth shared by the node's ranks, where known
  (``GPU.host_memory_gbs``); else the host's step is uncharacterized and left out.
* pipeline (``--pp``): a stage computes its micro-batches in turn, and GPipe and 1F1B both leave
  it idle for P - 1 micro-batches' time (filling and draining the pipeline): the bubble,
  (P - 1) / (n + P - 1) of the step's compute, i.e. the stage's compute x (P - 1) / n.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fsdp2lab.scale.gpus import D2H_SHARE, GPU, H2D_SHARE
from fsdp2lab.scale.timing import compute_floor_s, step_time

if TYPE_CHECKING:  # importing them imports torch: ``fsdp2lab plan --help`` goes without it
    from fsdp2lab.plan import RunPlan
    from fsdp2lab.scale.simulate import Phase, RoleRun

GIB = 1024**3
# Calibrated on torchtitan's Table 1 memory only (Llama 3.1 8B, FSDP on 8 H100 96 GB, local
# batch 2, sequence 8192, per-op selective AC, bf16: 82.4 GiB max reserved;
# tests/test_scale_published.py): the compute stream's reserved over its tracked peak,
# (82.4 - 3.74 GiB of gradients) / 68.76. Table 3's memory (128 GPUs) checks it.
ALLOCATOR_OVERHEAD = 0.144  # the caching allocator's reserved over the compute stream's peak
NON_TORCH_GIB = 1.0  # CUDA context and NCCL buffers (not calibrated: nothing published)
DEFAULT_MARGIN = 0.05  # of the GPU's memory kept free
LATENCY_S = {"intra": 10e-6, "inter": 30e-6}  # per collective call


@dataclass(frozen=True)
class Hardware:
    gpu: GPU
    nproc_per_node: int
    inter_node_gbs: float
    margin: float = DEFAULT_MARGIN


def dim_spans_nodes(plan: RunPlan, dim: str, nproc_per_node: int) -> bool:
    """Whether a mesh dimension's groups reach beyond one node (ranks are laid out row-major:
    pp, dp_replicate, dp_shard, tp, the last varying fastest)."""
    named = plan.dims.named_dims()
    sizes = dict(named)
    if dim not in sizes:
        return False
    inner = 1
    for name, size in reversed(named):
        if name == dim:
            return inner * sizes[dim] > nproc_per_node
        inner *= size
    return False


ALLOCATOR_MODEL = (
    f"reserved = (tracked peak - the gradients live at it) x {1 + ALLOCATOR_OVERHEAD:.3f} + "
    "the sharded gradients (kept in the reduce-scatter stream's pool)"
)


def reserved_bytes(run: RoleRun, phase: Phase | None = None) -> int:
    """The caching allocator's reserved memory for ``run``'s training step (or ``phase``), by the
    model in the module's docstring."""
    grads = 0 if run.offload else run.state.get("grad_bytes", 0)  # offloaded: on the host
    peak, by_category = (
        (run.peak_bytes, run.peak_by_category)
        if phase is None
        else (phase.peak_bytes, phase.peak_by_category)
    )
    return int((peak - by_category.get("grads", 0)) * (1 + ALLOCATOR_OVERHEAD)) + grads


def phase_figures(run: RoleRun, hw: Hardware) -> list[dict]:
    """Each phase of ``run`` (its training step where it has none listed): tracked peak, reserved
    estimate, host bytes, whether it fits and its headroom."""
    from fsdp2lab.scale.simulate import Phase

    usable = hw.gpu.hbm_gib * GIB * (1 - hw.margin)
    phases = run.phases or [Phase("training step", run.peak_bytes, run.peak_by_category)]
    out = []
    for phase in phases:
        reserved = reserved_bytes(run, phase)
        needed = reserved + int(NON_TORCH_GIB * GIB)
        out.append(
            {
                "phase": phase.name,
                "note": phase.note,
                "peak_bytes": phase.peak_bytes,
                "reserved_bytes_estimate": reserved,
                "host_bytes": phase.host_bytes,
                "fits": needed <= usable,
                "headroom_bytes": int(usable - needed),
            }
        )
    return out


def _fused_optimizer_bytes(plan: RunPlan, run: RoleRun) -> int | None:
    """What a fused optimizer step reads and writes (parameters, gradients, state once; the
    parameters and state written back); None for the others (timed from their ops). It steps
    the parameters that have gradients (not a LoRA's frozen base), as many bytes as their
    gradients, which take their dtype."""
    if plan.cfg.optimizer not in ("adam", "adamw"):
        return None
    state = run.state
    return 3 * state.get("grad_bytes", 0) + 2 * state.get("optimizer_state_bytes", 0)


def estimate(plan: RunPlan, run: RoleRun, hw: Hardware) -> dict:
    """The plan's figures for one rank role, as the ``--json`` output carries them."""
    gpu = hw.gpu
    reserved = reserved_bytes(run)
    phases = phase_figures(run, hw)
    peak_phase = max(phases, key=lambda p: p["reserved_bytes_estimate"])

    comm = {}
    links = {}
    for dim, kinds in sorted(run.comm.items()):
        where = "inter" if dim_spans_nodes(plan, dim, hw.nproc_per_node) else "intra"
        gbs = hw.inter_node_gbs if where == "inter" else gpu.intra_node_gbs
        links[dim] = (gbs, LATENCY_S[where])
        entry = {"bandwidth_gbs": gbs, "across_nodes": where == "inter"}
        for kind, c in kinds.items():
            entry[kind] = {
                "calls": c.calls,
                "bytes": c.tensor_bytes,
                "wire_bytes": c.wire_bytes,
                "seconds": c.wire_bytes / (gbs * 1e9) + c.calls * LATENCY_S[where],
            }
        entry["seconds"] = sum(v["seconds"] for v in entry.values() if isinstance(v, dict))
        comm[dim] = entry
    links.setdefault("other", (gpu.intra_node_gbs, LATENCY_S["intra"]))

    t = step_time(
        run.ops,
        gpu,
        compiled=plan.cfg.compile,
        links=links,
        optimizer_bytes=_fused_optimizer_bytes(plan, run),
    )
    compute_s = sum(t.busy.values())
    stages, n = plan.dims.pp, plan.n_microbatches
    bubble_s = compute_s * (stages - 1) / n  # (P - 1) / (n + P - 1) of compute + bubble
    optimizer_s, offload = t.optimizer_s, {}
    if run.offload:
        offload = offload_time(plan, run, hw)
        optimizer_s = offload["host_optimizer_s"] or 0.0
    step_s = t.step_s - t.optimizer_s + optimizer_s + offload.get("copies_s", 0.0) + bubble_s
    model_flops = 3 * run.forward_flops  # forward + backward (2x), no recomputation
    per_gpu, mfu = throughput(plan, hw, step_s, model_flops)
    return {
        "rank": run.rank,
        **({"stage": run.stage, "modules": list(run.modules)} if run.stage is not None else {}),
        "memory": {
            **{k: v for k, v in run.peak_by_category.items()},
            "peak_bytes": run.peak_bytes,
            "reserved_bytes_estimate": reserved,
            "non_torch_bytes_estimate": int(NON_TORCH_GIB * GIB),
            "gpu_bytes": int(gpu.hbm_gib * GIB),
        },
        "state": dict(run.state),
        "state_bytes": run.state_bytes,
        "fits": all(p["fits"] for p in phases),
        "headroom_bytes": min(p["headroom_bytes"] for p in phases),
        "phases": phases,
        "peak_phase": peak_phase["phase"],
        "comm": comm,
        "flops_per_step": run.flops,
        "model_flops_per_step": model_flops,
        "time": {
            "compute_s": compute_s,
            "matmul_s": t.busy["matmul"],
            "attention_s": t.busy["attention"],
            "compute_floor_s": compute_floor_s(gpu, run.ops),
            "memory_bound_s": t.busy["memory"],
            "launch_bound_s": t.launch_bound_s,
            "kernels": t.kernels,
            "comm_s": t.comm,
            "exposed_comm_s": t.exposed_comm_s,
            "pipeline_bubble_s": bubble_s,
            "optimizer_s": optimizer_s,
            "step_s": step_s,
        },
        **({"offload": offload} if offload else {}),
        "tokens_per_s_per_gpu": per_gpu,
        "mfu": mfu,
    }


def offload_time(plan: RunPlan, run: RoleRun, hw: Hardware) -> dict:
    """``--cpu-offload``'s figures for ``run`` (its ``offload`` bytes): the host's memory, the
    copies each way and their time at the GPU's PCIe rates, and the optimizer's step on the host:
    its bytes (a fused Adam(W)'s, else its ops') and time where the host's memory bandwidth is
    known (the node's, shared by the ranks on it), else None."""
    gpu = hw.gpu
    h2d_gbs = gpu.pcie_gbs * H2D_SHARE if gpu.pcie_gbs else None
    d2h_gbs = gpu.pcie_gbs * D2H_SHARE if gpu.pcie_gbs else None
    fused = _fused_optimizer_bytes(plan, run)
    optimizer_bytes = (
        fused if fused is not None else sum(op.bytes for op in run.ops if op.optimizer)
    )
    host_gbs = None
    if gpu.host_memory_gbs:
        host_gbs = gpu.host_memory_gbs / min(hw.nproc_per_node, plan.world_size)
    o = run.offload
    copies_s = (
        o["h2d_bytes"] / (h2d_gbs * 1e9) + o["d2h_bytes"] / (d2h_gbs * 1e9) if h2d_gbs else 0.0
    )
    return {
        **o,
        "h2d_gbs": h2d_gbs,
        "d2h_gbs": d2h_gbs,
        "copies_s": copies_s,
        "host_optimizer_bytes": optimizer_bytes,
        "host_memory_gbs_per_rank": host_gbs,
        "host_optimizer_s": optimizer_bytes / (host_gbs * 1e9) if host_gbs else None,
    }


def throughput(plan: RunPlan, hw: Hardware, step_s: float, model_flops: int) -> tuple[float, float]:
    """Tokens/s per GPU and MFU of ``plan``'s step of ``step_s`` seconds."""
    tokens = plan.global_batch * (plan.cfg.seq_len if plan.spec.task == "lm" else 1)
    return tokens / plan.world_size / step_s, model_flops / step_s / (hw.gpu.bf16_tflops * 1e12)
