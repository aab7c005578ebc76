"""A plan for ``fsdp2lab plan``: simulate the run, estimate it on the GPU, and when it does not
fit, the variants that would (more shards, another HSDP shape, full AC, TP), each with its
figures. ``plan_report`` returns the ``--json`` object; ``format_report`` the text."""

from __future__ import annotations

import dataclasses

import torch

from fsdp2lab.config import TrainConfig
from fsdp2lab.errors import UsageError
from fsdp2lab.parallel.fsdp2 import reduces_every_micro_batch
from fsdp2lab.parallel.strategies import label
from fsdp2lab.plan import RunPlan, resolve
from fsdp2lab.scale.estimate import (
    ALLOCATOR_MODEL,
    GIB,
    LATENCY_S,
    NON_TORCH_GIB,
    Hardware,
    estimate,
)
from fsdp2lab.scale.op_trace import nbytes
from fsdp2lab.scale.simulate import RoleRun, simulate, stage_ranks

MODELLED = (
    "model, mesh (--dp-replicate, --dp-shard, --tp), batch, --seq-len, --grad-accum-steps, "
    "--mixed-precision fp32/bf16, --activation-checkpointing, --reshard-after-forward, "
    "--fsdp-units, --prefetch, --optimizer, --compile (fused elementwise kernels), --pp (each "
    "stage a rank role) with --pp-schedule gpipe/1f1b and --pp-microbatches, --lora-rank with "
    "--quantize-base nf4, --cpu-offload (sharded parameters, gradients and optimizer state on "
    "the host; each unit's shards copied in per all-gather, gradients out per reduction, the "
    "optimizer stepping on the host); besides the training step, evaluation "
    "(--test-batch-size), the --save-model gather and checkpoint saves (--ckpt-dir, "
    "--async-checkpoint)"
)


def summarize(plan: RunPlan, hw: Hardware, runs: list[RoleRun] | None = None) -> dict:
    """Simulate and estimate every distinct rank role of ``plan``: one (every rank alike), or
    one per pipeline stage under --pp. The per-rank figures are the worst role's. ``runs``: the
    roles' simulations, where they are at hand (:func:`stage_ranks`' order)."""
    if runs is None:
        runs = [simulate(plan, rank=rank) for rank in stage_ranks(plan)]
    return combine(plan, [estimate(plan, run, hw) for run in runs])


def combine(plan: RunPlan, roles: list[dict]) -> dict:
    """The plan's figures from its rank roles' (:func:`~fsdp2lab.scale.estimate.estimate`)."""
    worst = max(roles, key=lambda r: r["memory"]["peak_bytes"])
    # Per phase, the worst role's figures; the phase that sets the run's peak reserved memory.
    phases: dict[str, dict] = {}
    for role in roles:
        for phase in role["phases"]:
            name = phase["phase"]
            if (
                name not in phases
                or phase["reserved_bytes_estimate"] > phases[name]["reserved_bytes_estimate"]
            ):
                phases[name] = {k: v for k, v in phase.items() if k != "phase"}
            if not phase["fits"]:
                phases[name]["fits"] = False
    peak_phase = max(phases, key=lambda name: phases[name]["reserved_bytes_estimate"])
    comm_bytes: dict[str, int] = {}
    for role in roles:
        for dim, entry in role["comm"].items():
            total = sum(v["bytes"] for v in entry.values() if isinstance(v, dict))
            comm_bytes[dim] = max(comm_bytes.get(dim, 0), total)
    pipeline = {}
    if plan.dims.pp > 1:
        p, n = plan.dims.pp, plan.n_microbatches
        pipeline = {
            "pipeline": {
                "stages": p,
                "schedule": plan.cfg.pp_schedule,
                "n_microbatches": n,
                "microbatch": plan.micro_batch // n,
                "bubble_fraction": (p - 1) / (n + p - 1),
            }
        }
    return {
        "label": label(plan.cfg, plan.dims),
        "mesh": dict(plan.dims.named_dims()),
        "activation_checkpointing": plan.cfg.activation_checkpointing,
        "global_batch": plan.global_batch,
        "micro_batch": plan.micro_batch,
        "peak_bytes_per_rank": worst["memory"]["peak_bytes"],
        "reserved_bytes_per_rank": worst["memory"]["reserved_bytes_estimate"],
        "state_bytes_per_rank": max(r["state_bytes"] for r in roles),
        # --cpu-offload: the state each rank keeps in host memory
        "host_bytes_per_rank": max(r.get("offload", {}).get("host_bytes", 0) for r in roles),
        "comm_bytes_per_step": comm_bytes,
        "step_s": max(r["time"]["step_s"] for r in roles),
        "tokens_per_s_per_gpu": min(r["tokens_per_s_per_gpu"] for r in roles),
        "mfu": min(r["mfu"] for r in roles),
        "fits": all(r["fits"] for r in roles),
        "peak_phase": peak_phase,
        "phases": phases,
        **pipeline,
        "roles": roles,
    }


def variants(
    cfg: TrainConfig, plan: RunPlan, phases: dict | None = None
) -> list[tuple[str, TrainConfig]]:
    """What else to try where a plan does not fit: (what changes, its config); ``phases``: the
    plan's (a smaller evaluation batch where evaluation does not fit)."""
    out: list[tuple[str, TrainConfig]] = []
    dims = plan.dims
    if dims.dp_replicate > 1:
        out.append(("shard over all data-parallel ranks (--dp-replicate 1)",
                    dataclasses.replace(cfg, dp_replicate=1, dp_shard=-1)))  # fmt: skip
        half = dims.dp_replicate // 2
        if half > 1 and dims.dp_replicate % 2 == 0:
            out.append((f"--dp-replicate {half} (twice the shards)",
                        dataclasses.replace(cfg, dp_replicate=half, dp_shard=-1)))  # fmt: skip
    evaluation = (phases or {}).get("evaluation")
    if evaluation is not None and not evaluation["fits"]:
        smaller = max(1, min(plan.micro_batch, plan.cfg.test_batch_size // 2))
        out.append((f"--test-batch-size {smaller}",
                    dataclasses.replace(cfg, test_batch_size=smaller)))  # fmt: skip
    if cfg.activation_checkpointing != "full":
        out.append(("--activation-checkpointing full",
                    dataclasses.replace(cfg, activation_checkpointing="full")))  # fmt: skip
    if plan.spec.tp_plan is not None:
        for tp in (2, 4, 8):
            if tp > dims.tp and plan.world_size % (tp * dims.dp_replicate * dims.pp) == 0:
                out.append((f"--tp {tp}", dataclasses.replace(cfg, tp=tp, dp_shard=-1)))
    return out


def plan_report(cfg: TrainConfig, world_size: int, hw: Hardware, alternatives: bool = True) -> dict:
    """The ``--json`` object: the plan for ``cfg`` on ``world_size`` GPUs of ``hw``."""
    # The run plan a cluster of GPUs gets, without this machine's checks (plan.check_machine).
    plan = resolve(cfg, world_size, device_type="cuda")
    report = {
        "model": cfg.model,
        "params_total": plan.params_total,
        "world_size": world_size,
        "nodes": -(-world_size // hw.nproc_per_node),
        "gpu": dataclasses.asdict(hw.gpu),
        "inter_node_gbs": hw.inter_node_gbs,
        "margin": hw.margin,
        "allocator_model": f"{ALLOCATOR_MODEL}; {NON_TORCH_GIB:g} GiB outside PyTorch (CUDA "
        "context, NCCL)",
        "latency_s": LATENCY_S,
        "modelled": MODELLED,
        "not_modelled": (
            ["evaluation under --pp (the pipeline's schedule infers its shapes)"]
            if plan.dims.pp > 1
            else []
        ),
        **({"lora": lora_summary(plan)} if plan.cfg.lora_rank else {}),
        **summarize(plan, hw),
    }
    if cfg.grad_accum_steps > 1 and plan.dims.dp_shard > 1:
        # Both ways to accumulate: reduce-scatter every micro-batch, or only on the last.
        used = (
            "every"
            if reduces_every_micro_batch(cfg.grad_accum_reduce, plan.dims.dp_shard)
            else "last"
        )
        other = "last" if used == "every" else "every"
        alt = summarize(
            resolve(dataclasses.replace(cfg, grad_accum_reduce=other), world_size, "cuda"), hw
        )
        alt.pop("roles")
        report["grad_accum_reduce"] = used
        report["grad_accum_other"] = {"grad_accum_reduce": other, **alt}
    if not report["fits"] and alternatives:
        report["alternatives"] = []
        for what, variant in variants(cfg, plan, report["phases"]):
            try:
                alt = summarize(resolve(variant, world_size, "cuda"), hw)
            except UsageError as e:
                report["alternatives"].append({"change": what, "error": str(e)})
                continue
            alt.pop("roles")
            report["alternatives"].append({"change": what, **alt})
    return report


def lora_summary(plan: RunPlan) -> dict:
    """A LoRA run's adapters and frozen base, as the plan's meta model holds them."""
    from fsdp2lab.models.lora import is_adapter

    params = list(plan.meta_model.named_parameters())
    base_dtypes = sorted(
        {str(p.dtype).removeprefix("torch.") for n, p in params if not is_adapter(n)}
    )
    return {
        "rank": plan.cfg.lora_rank,
        "alpha": plan.cfg.lora_alpha,
        "targets": plan.cfg.lora_targets.split(","),
        "adapter_params": sum(p.numel() for n, p in params if is_adapter(n)),
        "base_params": sum(p.numel() for n, p in params if not is_adapter(n)),
        "base_dtype": "/".join(base_dtypes),
        **({"quantized": nf4_summary(plan)} if plan.cfg.quantize_base else {}),
    }


def nf4_summary(plan: RunPlan) -> dict:
    """``--quantize-base``: the base's quantized linear weights, whole, as torchao stores them:
    their count, values and bytes (packed values, block scales, the scales' factors and mean,
    the NF4 levels). A weight's bytes are linear in its double-quantization blocks: taken from
    torchao's ``to_nf4`` of one block and of two (on meta tensors: a whole weight's would loop
    over it in chunks)."""
    from fsdp2lab.models import quantize

    _, to_nf4 = quantize.nf4_api()

    def stored(blocks: int) -> int:
        values = torch.empty(blocks, quantize.VALUES_PER_SCALER_BLOCK, device="meta")
        weight = to_nf4(values, quantize.BLOCK, quantize.SCALER_BLOCK)
        return nbytes([getattr(weight, name) for name in weight.__tensor_flatten__()[0]])

    one, two = stored(1), stored(2)
    linears = quantize.base_linears(plan.meta_model, plan.units)
    values = sum(module.weight.numel() for _, module in linears)
    blocks = values // quantize.VALUES_PER_SCALER_BLOCK
    return {
        "scheme": plan.cfg.quantize_base,
        "block": quantize.BLOCK,
        "scaler_block": quantize.SCALER_BLOCK,
        "weights": len(linears),
        "values": values,
        "bytes": blocks * (two - one) + len(linears) * (2 * one - two),
    }


def gib_text(n: float) -> str:
    if abs(n) < GIB:
        return f"{n / 2**20:,.1f} MiB"
    return f"{n / GIB:,.2f} GiB"


def offload_text(o: dict) -> str:
    """The ``--cpu-offload`` line of a rank role (:func:`~fsdp2lab.scale.estimate.offload_time`)."""

    def rate(gbs: float | None) -> str:
        return f"{gbs:,.1f} GB/s" if gbs else "an uncharacterized rate"

    host_step = (
        f"{o['host_optimizer_s'] * 1e3:,.1f} ms at {rate(o['host_memory_gbs_per_rank'])} (the "
        "node's host memory bandwidth shared by its ranks)"
        if o["host_optimizer_s"] is not None
        else "time uncharacterized (no host memory bandwidth published for this GPU's hosts: "
        "left out of the step)"
    )
    return (
        f"  --cpu-offload: host memory {gib_text(o['host_bytes'])} a rank (sharded parameters, "
        f"gradients, optimizer state); a step copies {gib_text(o['h2d_bytes'])} of shards to the "
        f"GPU (each all-gather's) at {rate(o['h2d_gbs'])} and {gib_text(o['d2h_bytes'])} of "
        f"gradients back at {rate(o['d2h_gbs'])}, {o['copies_s'] * 1e3:,.1f} ms not overlapped; "
        f"a unit's shards ({gib_text(o['shard_copy_bytes'])}) on the GPU as copied in; the "
        f"optimizer steps on the host: {gib_text(o['host_optimizer_bytes'])} moved, {host_step}"
    )


def format_report(r: dict) -> str:
    gpu = r["gpu"]
    lines = [
        f"plan: {r['model']} ({r['params_total']:,} parameters), {r['label']} on {r['world_size']} x "
        f"{gpu['description']} ({r['nodes']} node(s)), mesh "
        + " x ".join(f"{k}={v}" for k, v in r["mesh"].items())
        + f", batch {r['micro_batch']}/rank (global {r['global_batch']}), AC {r['activation_checkpointing']}",
    ]
    if "lora" in r:
        lo = r["lora"]
        lines.append(
            f"LoRA: rank {lo['rank']}, alpha {lo['alpha']:g} on {','.join(lo['targets'])}: "
            f"{lo['adapter_params']:,} adapter parameters (fp32, trained) on a frozen "
            f"{lo['base_dtype']} base of {lo['base_params']:,} (no gradient, no optimizer state)"
        )
    if "quantized" in r.get("lora", {}):
        q = r["lora"]["quantized"]
        lines.append(
            f"base quantized ({q['scheme']}): {q['weights']} linear weights, {q['values']:,} "
            f"values in {gib_text(q['bytes'])} whole (blocks of {q['block']}, int8 scales "
            f"double-quantized in blocks of {q['scaler_block']}), gathered a unit at a time and "
            "dequantized to the compute dtype for each matmul"
        )
    if "pipeline" in r:
        p = r["pipeline"]
        lines.append(
            f"pipeline: {p['stages']} stages, {p['schedule']}, {p['n_microbatches']} micro-batches "
            f"of {p['microbatch']}, bubble {p['bubble_fraction']:.0%} of compute + bubble"
        )
    for role in r["roles"]:
        mem = role["memory"]
        if "stage" in role:
            lines.append(
                f"rank role {role['rank']}: pipeline stage {role['stage']} "
                f"[{', '.join(role['modules'])}] (every rank of the stage alike):"
            )
        else:
            lines.append(f"rank role {role['rank']} (every rank alike):")
        lines.append("  memory (tracked tensors, at the training step's peak):")
        for key in ("params", "grads", "optimizer_state", "unsharded_params", "unsharded_grads",
                    "activations", "temporaries", "all_gather", "reduce_scatter", "inputs",
                    "shard_copies"):  # fmt: skip
            if key in mem:
                lines.append(f"    {key:<18} {gib_text(mem[key])}")
        lines.append(f"    {'peak total':<18} {gib_text(mem['peak_bytes'])}")
        step = role["phases"][0]  # the training step
        lines.append(
            f"    reserved (estimate) {gib_text(mem['reserved_bytes_estimate'])} + "
            f"{gib_text(mem['non_torch_bytes_estimate'])} outside PyTorch of {gib_text(mem['gpu_bytes'])}: "
            + ("FITS" if step["fits"] else "DOES NOT FIT")
            + f" with {r['margin']:.0%} margin (headroom {gib_text(step['headroom_bytes'])})"
        )
        if len(role["phases"]) > 1:
            lines.append("  phases (tracked peak, reserved estimate; host memory):")
            for phase in role["phases"]:
                host = f"; host {gib_text(phase['host_bytes'])}" if phase["host_bytes"] else ""
                lines.append(
                    f"    {phase['phase']:<20} {gib_text(phase['peak_bytes']):>11}, "
                    f"{gib_text(phase['reserved_bytes_estimate']):>11}: "
                    + ("fits" if phase["fits"] else "DOES NOT FIT")
                    + f"{host} ({phase['note']})"
                )
            lines.append(
                f"  the run's peak: {role['peak_phase']}; "
                + (
                    "every phase FITS"
                    if role["fits"]
                    else "DOES NOT FIT: "
                    + ", ".join(p["phase"] for p in role["phases"] if not p["fits"])
                )
            )
        lines.append(
            f"  sharded state: {gib_text(role['state_bytes'])} (params {gib_text(role['state']['param_bytes'])}, "
            f"grads {gib_text(role['state']['grad_bytes'])}, optimizer {gib_text(role['state']['optimizer_state_bytes'])})"
        )
        lines.append("  communication per step:")
        for dim, entry in role["comm"].items():
            where = "across nodes" if entry["across_nodes"] else "within a node"
            for kind, c in entry.items():
                if isinstance(c, dict):
                    lines.append(
                        f"    {dim:<13} {kind:<15} {c['calls']:>4} calls {gib_text(c['bytes']):>13} "
                        f"({where}, {entry['bandwidth_gbs']:g} GB/s): {c['seconds'] * 1e3:,.1f} ms"
                    )
        if "offload" in role:
            lines.append(offload_text(role["offload"]))
        t = role["time"]
        lines.append(
            f"  step: {t['step_s'] * 1e3:,.1f} ms = {t['kernels']:,} kernels on the compute "
            f"stream (matmul {t['matmul_s'] * 1e3:,.1f} ms, attention "
            f"{t['attention_s'] * 1e3:,.1f} ms, memory-bound {t['memory_bound_s'] * 1e3:,.1f} ms)"
            f" + waiting for the host to launch them {t['launch_bound_s'] * 1e3:,.1f} ms + "
            f"exposed communication {t['exposed_comm_s'] * 1e3:,.1f} ms + optimizer "
            f"{t['optimizer_s'] * 1e3:,.1f} ms"
            + (
                f" (on the host) + host copies {role['offload']['copies_s'] * 1e3:,.1f} ms"
                if "offload" in role
                else ""
            )
            + (
                f" + pipeline bubble {t['pipeline_bubble_s'] * 1e3:,.1f} ms"
                if "stage" in role
                else ""
            )
        )
        lines.append(
            f"  {role['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, MFU {role['mfu']:.1%}"
        )
    lines.append(f"modelled: {r['modelled']}")
    if r["not_modelled"]:
        lines.append("not modelled: " + "; ".join(r["not_modelled"]))
    if "grad_accum_other" in r:
        o = r["grad_accum_other"]
        lines.append(
            f"gradient accumulation: --grad-accum-reduce {r['grad_accum_reduce']} (above); with "
            f"{o['grad_accum_reduce']}: peak {gib_text(o['peak_bytes_per_rank'])}, "
            f"step {o['step_s'] * 1e3:,.1f} ms, {o['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, "
            + ", ".join(f"{d} {gib_text(b)}" for d, b in o["comm_bytes_per_step"].items())
            + " a step"
        )
    if r.get("alternatives"):
        lines.append("it does not fit; what would:")
    for alt in r.get("alternatives", []):
        if "error" in alt:
            lines.append(f"  instead: {alt['change']}: not possible ({alt['error']})")
            continue
        peak = alt["phases"][alt["peak_phase"]]
        lines.append(
            f"  instead: {alt['change']}: peak {gib_text(peak['peak_bytes'])}, reserved "
            f"{gib_text(peak['reserved_bytes_estimate'])} ({alt['peak_phase']}), "
            f"{'fits' if alt['fits'] else 'does not fit'}, "
            f"step {alt['step_s'] * 1e3:,.1f} ms, {alt['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, "
            f"MFU {alt['mfu']:.1%}"
        )
    return "\n".join(lines)
