"""``fsdp2lab plan --search``: the fastest layouts of a run that fit, over every layout fsdp2lab
can train on the given GPUs and global batch.

A layout is: the data-parallel split (``--dp-replicate``, HSDP when > 1, the rest sharded), ``--tp``,
``--pp`` with ``--pp-microbatches`` (``--pp`` or 2 x ``--pp``, dividing the micro-batch) and
``--pp-schedule`` 1F1B (GPipe where given: its bubble is 1F1B's, and it holds every micro-batch's
activations at once), ``--activation-checkpointing`` (every mode of ``config.AC_MODES``),
``--fsdp-units``
(``auto`` only where it groups the units otherwise than ``layer``), ``--reshard-after-forward``
true/false, and ``--grad-accum-steps`` (every divisor of the per-rank batch; the micro-batch follows).
Each is checked by :func:`fsdp2lab.plan.resolve`; those it refuses are skipped. A searched flag
given (``--tp 1``, ``--activation-checkpointing full``, ...) is kept as given.

**Derived figures.** A rank role's trace depends on everything but the data-parallel split: layouts
differing only in ``--dp-replicate`` are simulated once, fully sharded (``--dp-replicate 1``), and
the others derived from it (:func:`derive`): with ``s`` = the shards before over the shards after,
the sharded state (parameters, gradients, optimizer state) is multiplied by ``s`` in the state and
in every phase's peak (the peak moved by the difference); the ``dp_shard`` all-gathers and
reduce-scatters keep their bytes (the unsharded tensors) with the ring's ``(n - 1) / n`` of the new
degree; HSDP adds one all-reduce of each unit's gradient shard across replicas (once per step under
``--grad-accum-reduce every``). Pure replication (``--dp-shard 1``) is simulated itself.

**Pruning, by stated orders** (one layout leaner than another: less or equal memory; faster: less
or equal step time, all else equal). Leaner: AC ``full`` than any mode, any than ``none``; more
``--grad-accum-steps``; ``layer`` units than ``auto`` than ``root``; resharding after forward;
1F1B than GPipe; fewer replicas. Faster: AC ``none`` than any mode, any than ``full``; fewer
``--grad-accum-steps``; not resharding after forward. A layout is not simulated where a leaner one
does not fit, or where a faster one (fitting or not) is already no faster than the fifth fastest
that fits. Each family (layouts alike but for AC, accumulation and resharding) starts at its
fastest corner (simulated even where a leaner layout does not fit: its speed bounds the family's),
then its leanest; then goes on with the layout left that would rule out the most
others either way (the most of the lesser of: those it is leaner than, those it is faster than),
often a middle AC mode that settles ``none`` and ``full`` with it. Of layouts equally fast, the
leaner ranks first. Across families, a layout's step takes at least its matmuls' and attention's
time (and the pipeline bubble's share of it, :func:`speed_ceiling`), which every layout that
computes alike runs too (the same TP, PP and micro-batches, at least the same recomputation; any
replicas, units and resharding, :func:`computes_alike`): where that ceiling is no faster than the
fifth fastest that fits, none of them is simulated. And whatever the pipeline, a GPU's share of
the matmuls and attention is that of a layout with its TP degree and no pipeline or
recomputation (:func:`compute_ceiling`): with the bubble, that bounds every pipeline.

**Shallow copies.** Where a model's layer units are alike (:mod:`fsdp2lab.scale.layers`), a
layout is simulated at 2 and 4 layers a rank role, and each figure extended along the line
through them to the model's depth.

**Side by side.** Once the search has simulated for a while, a layout's simulations (its
shallow copies, its stages) run in worker processes (:mod:`fsdp2lab.scale.workers`).

The fastest five are then planned exactly, as ``fsdp2lab plan`` plans them (each with its own
simulation): the figures printed are exact, and their order is by those, but for ties: layouts
within the time model's error of each other (``scale.checked_rows.MODEL_ERROR``) rank the
simpler first (:func:`rank_with_ties`).
"""

from __future__ import annotations

import dataclasses
import math
import shlex
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from fsdp2lab.config import _FIELDS, AC_MODES, TrainConfig
from fsdp2lab.errors import UsageError
from fsdp2lab.scale.checked_rows import MODEL_ERROR
from fsdp2lab.scale.estimate import Hardware
from fsdp2lab.scale.report import combine, gib_text, summarize

TOP = 5
# The flags a search chooses; one given is kept fixed, but for --batch-size and --dp-shard.
SEARCHED = ("dp_replicate", "dp_shard", "tp", "pp", "pp_schedule", "pp_microbatches",
            "activation_checkpointing", "fsdp_units", "reshard_after_forward", "batch_size",
            "grad_accum_steps")  # fmt: skip
UNITS = ("layer", "auto", "root")  # leanest first
RESHARD = ("true", "false")
SCHEDULES = ("1f1b", "gpipe")


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    r: int  # --dp-replicate
    k: int  # --grad-accum-steps
    ac: str
    units: str
    reshard: str
    schedule: str = "1f1b"
    n: int = 1  # --pp-microbatches

    def config(self, cfg: TrainConfig) -> TrainConfig:
        return dataclasses.replace(
            cfg, strategy="fsdp2", dp_replicate=self.r, dp_shard=-1, tp=self.tp, pp=self.pp,
            pp_schedule=self.schedule, pp_microbatches=self.n if self.pp > 1 else None,
            activation_checkpointing=self.ac, fsdp_units=self.units,
            reshard_after_forward=self.reshard, grad_accum_steps=self.k, batch_size=None,
        )  # fmt: skip

    def flags(self) -> list[str]:
        out = ["--dp-replicate", str(self.r), "--tp", str(self.tp), "--pp", str(self.pp)]
        if self.pp > 1:
            out += ["--pp-schedule", self.schedule, "--pp-microbatches", str(self.n)]
        return out + ["--activation-checkpointing", self.ac, "--fsdp-units", self.units,
                      "--reshard-after-forward", self.reshard, "--grad-accum-steps", str(self.k)]  # fmt: skip


def _ac_leaner(a: str, b: str) -> bool:
    return a == b or a == "full" or b == "none"


def leaner(a: Layout, b: Layout) -> bool:
    """``a`` takes no more memory than ``b`` (the orders of the module's docstring)."""
    return (
        (a.tp, a.pp, a.n) == (b.tp, b.pp, b.n)
        and _ac_leaner(a.ac, b.ac)
        and a.k >= b.k
        and UNITS.index(a.units) <= UNITS.index(b.units)
        and (a.reshard == b.reshard or a.reshard == "true")
        and (a.schedule == b.schedule or a.schedule == "1f1b")
        and a.r <= b.r
    )


def faster(a: Layout, b: Layout) -> bool:
    """``a`` takes no more step time than ``b`` (the orders of the module's docstring)."""
    return (
        (a.tp, a.pp, a.n, a.schedule, a.units, a.r) == (b.tp, b.pp, b.n, b.schedule, b.units, b.r)
        and _ac_leaner(b.ac, a.ac)
        and a.k <= b.k
        and (a.reshard == b.reshard or a.reshard == "false")
    )


def computes_alike(a: Layout, b: Layout) -> bool:
    """``b`` runs at least ``a``'s matmuls and attention, each of the same shape: the same mesh
    but for data parallelism, the same micro-batches, and at least ``a``'s recomputation."""
    return (a.tp, a.pp, a.n, a.k) == (b.tp, b.pp, b.n, b.k) and _ac_leaner(b.ac, a.ac)


def speed_ceiling(f: dict) -> float:
    """The most tokens/s per GPU that a layout computing alike (:func:`computes_alike`) the one
    of figures ``f`` can reach: each rank role's step takes at least its matmuls' and
    attention's time (its compute stream runs them one after another) and the pipeline bubble's
    share of that."""
    pipe = f.get("pipeline")
    bubble = (pipe["stages"] - 1) / pipe["n_microbatches"] if pipe else 0.0
    least = max((r["time"]["matmul_s"] + r["time"]["attention_s"]) * (1 + bubble)
                for r in f["roles"])  # fmt: skip
    return f["tokens_per_s_per_gpu"] * f["step_s"] / least


def compute_ceiling(f: dict) -> float:
    """The most tokens/s per GPU that any layout with the TP degree of the one of figures ``f``
    reaches, ``f`` being a layout without a pipeline or recomputation: a GPU's share of the
    step's matmuls and attention is the same under a pipeline (a stage runs its part of the model
    for as many times the samples as there are stages), so the stages' compute floors
    (``compute_floor_s``) average at least ``f``'s, and the slowest stage's is no less. Under a
    pipeline of P stages and n micro-batches, divide by 1 + (P - 1) / n (the bubble)."""
    return f["tokens_per_s_per_gpu"] * f["step_s"] / f["roles"][0]["time"]["compute_floor_s"]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_args(cfg: TrainConfig, given: Iterable[str] = ()) -> tuple[str, ...]:
    """The searched flags the user fixed (``given``: those on the command line; else those not at
    their default); a UsageError names the first flag a search cannot take."""
    fixed = tuple(n for n in SEARCHED if n in given or getattr(cfg, n) != _FIELDS[n].default)
    for name in ("batch_size", "dp_shard"):
        if name in fixed:
            flag = "--" + name.replace("_", "-")
            raise UsageError(
                f"fsdp2lab plan --search chooses {flag} itself (from --global-batch-size, "
                "--grad-accum-steps and the mesh); leave it out"
            )
    if cfg.strategy != "fsdp2":
        raise UsageError(
            f"fsdp2lab plan --search searches --strategy fsdp2 layouts, not {cfg.strategy}"
        )
    if cfg.global_batch_size is None:
        raise UsageError("fsdp2lab plan --search needs --global-batch-size (samples per step)")
    if cfg.cpu_offload:  # its HSDP derivation and shallow copies scale no offloaded bytes
        raise UsageError(
            "fsdp2lab plan --search does not search --cpu-offload layouts yet: plan one layout "
            "without --search"
        )
    return fixed


def _shapes(batch: int, world_size: int, schedules: tuple[str, ...]) -> Iterable[Layout]:
    """Every mesh, gradient accumulation and pipeline micro-batching of ``batch`` samples."""
    for pp in _divisors(world_size):
        for tp in _divisors(world_size // pp):
            dp = world_size // (pp * tp)
            if batch % dp:
                continue
            for k in _divisors(batch // dp):
                micro = batch // dp // k
                pipes = [("1f1b", 1)]
                if pp > 1:
                    pipes = [(s, n) for s in schedules for n in (pp, 2 * pp) if micro % n == 0]
                for schedule, n in pipes:
                    for r in _divisors(dp):
                        yield Layout(tp, pp, r, k, "none", "layer", "true", schedule, n)


def candidates(
    cfg: TrainConfig, world_size: int, fixed: Iterable[str] = ()
) -> tuple[list[Layout], int]:
    """Every layout of the module's docstring with ``cfg``'s values of the ``fixed`` flags that
    ``resolve`` accepts, and how many shapes it refused. Validity does not depend on AC, units or
    resharding: one ``resolve`` per shape."""
    from fsdp2lab.plan import resolve
    from fsdp2lab.scale.simulate import check_supported

    def kept(layout: Layout) -> bool:
        c = layout.config(cfg)
        return all(getattr(c, name) == getattr(cfg, name) for name in fixed)

    out, refused = [], 0
    seen: dict[tuple[int, str], tuple] = {}  # (pp, units) -> the grouping
    # GPipe only where given: the same bubble as 1F1B, and all micro-batches' activations held
    schedules = (cfg.pp_schedule,) if "pp_schedule" in fixed else SCHEDULES[:1]
    for shape in _shapes(cfg.global_batch_size, world_size, schedules):
        try:
            check_supported(plan := resolve(shape.config(cfg), world_size, "cuda"))
        except UsageError:
            refused += 1
            continue
        groupings = {}
        for units in UNITS:
            if (shape.pp, units) not in seen:
                seen[shape.pp, units] = _grouping(plan, units)
            if seen[shape.pp, units] not in groupings.values():
                groupings[units] = seen[shape.pp, units]
        dp_shard = world_size // (shape.tp * shape.pp * shape.r)
        out += [
            layout
            for ac in AC_MODES
            for units in groupings
            # unsharded parameters: nothing to reshard
            for reshard in (RESHARD if dp_shard > 1 else RESHARD[:1])
            if kept(layout := dataclasses.replace(shape, ac=ac, units=units, reshard=reshard))
        ]
    return out, refused


def _grouping(plan, units: str) -> tuple:
    """The parameter counts of each of ``plan``'s stages' FSDP units under ``--fsdp-units
    units`` (two policies grouping alike trace alike)."""
    from fsdp2lab.parallel.fsdp2 import _numel, default_unit_min_params, unit_groups

    min_params = plan.cfg.fsdp_unit_min_params or default_unit_min_params("cuda")
    model = plan.meta_model
    stages = plan.stages or (plan.units,)
    out = []
    for stage in stages:
        mods = [model.get_submodule(u) for u in plan.units if u in stage or not plan.stages]
        out.append(tuple(tuple(_numel(m) for m in g) for g in unit_groups(mods, units, min_params)))
    return tuple(out)


def derive(plan, runs: list, replicas: int) -> tuple:
    """The plan and rank roles of ``plan`` (fully sharded) with ``replicas`` HSDP replica groups,
    by the module docstring's rules; returns (plan, runs)."""
    from fsdp2lab.parallel.fsdp2 import reduces_every_micro_batch
    from fsdp2lab.runtime.mesh import ParallelDims
    from fsdp2lab.scale.simulate import Collective

    d = plan.dims
    dims = ParallelDims.resolve(plan.world_size, replicas, -1, d.tp, d.pp)
    shards = dims.dp_shard
    s = d.dp_shard / shards
    cfg = dataclasses.replace(plan.cfg, dp_replicate=replicas, dp_shard=-1)
    new_plan = dataclasses.replace(plan, cfg=cfg, dims=dims)
    every = reduces_every_micro_batch(cfg.grad_accum_reduce, shards)
    state_cats = ("params", "grads", "optimizer_state")

    def scaled(peak: int, by: dict) -> tuple[int, dict]:
        by = dict(by)
        for cat in state_cats:
            if cat in by:
                new = int(by[cat] * s)
                peak += new - by[cat]
                by[cat] = new
        return peak, by

    out = []
    for run in runs:
        comm = {dim: {kind: dataclasses.replace(c) for kind, c in kinds.items()}
                for dim, kinds in run.comm.items()}  # fmt: skip
        rs = comm.get("dp_shard", {}).get("reduce_scatter")
        for c in comm.get("dp_shard", {}).values():
            c.wire_bytes = c.tensor_bytes * (shards - 1) // shards
        if rs is not None and rs.calls:
            steps = cfg.grad_accum_steps if every else 1  # reduce-scatters per all-reduce
            shard = rs.tensor_bytes // steps // shards
            wire = 2 * shard * (replicas - 1) // replicas
            ar = Collective(rs.calls // steps, shard, wire)
            comm["dp_replicate"] = {"all_reduce": ar}
        peak, by = scaled(run.peak_bytes, run.peak_by_category)
        phases = []
        for ph in run.phases:
            p, b = scaled(ph.peak_bytes, ph.peak_by_category)
            phases.append(dataclasses.replace(ph, peak_bytes=p, peak_by_category=b))
        state = {key: int(v * s) for key, v in run.state.items()}
        ops = _derived_ops(
            run.ops, d.dp_shard, shards, replicas, cfg.grad_accum_steps if every else 1
        )
        out.append(dataclasses.replace(run, peak_bytes=peak, peak_by_category=by, state=state,
                                       comm=comm, phases=phases, ops=ops))  # fmt: skip
    return new_plan, out


def _derived_ops(ops: list, before: int, shards: int, replicas: int, steps: int) -> list:
    """The step's ops (``scale.op_trace``) at ``shards`` shards of ``replicas`` replicas, from
    ``before`` shards of one: the ``dp_shard`` collectives' ring bytes at the new degree, and
    after each reduce-scatter of the step's last ``1 / steps`` (the micro-batch that reduces
    across replicas) an all-reduce of its output shard over ``dp_replicate``."""
    rs = [
        i for i, op in enumerate(ops) if op.dim == "dp_shard" and op.collective == "reduce_scatter"
    ]
    reducing = set(rs[len(rs) - len(rs) // steps :]) if replicas > 1 else set()
    out = []
    for i, op in enumerate(ops):
        if op.kind != "collective" or op.dim != "dp_shard":
            out.append(op)
            continue
        whole = op.wire_bytes * before // (before - 1)  # the unsharded tensor
        out.append(dataclasses.replace(op, wire_bytes=whole * (shards - 1) // shards))
        if i in reducing:
            shard = whole // shards
            out.append(
                dataclasses.replace(
                    op, bytes=2 * shard, reads=op.writes, dim="dp_replicate",
                    wire_bytes=2 * shard * (replicas - 1) // replicas, collective="all_reduce",
                )
            )  # fmt: skip
    return out


def search(
    cfg: TrainConfig,
    world_size: int,
    hw: Hardware,
    given: Iterable[str] = (),
    top: int = TOP,
    prune: bool = True,
    extend: bool = True,
    workers: int | None = None,
) -> dict:
    """The ``--json`` object of ``fsdp2lab plan --search``; UsageError where nothing fits.
    ``given``: the searched flags on the command line, kept as given (:func:`check_args`);
    ``prune=False``: simulate (or derive) every layout; ``extend=False``: simulate every layer;
    ``workers``: processes simulating side by side (:mod:`fsdp2lab.scale.workers`; None: one a
    CPU)."""
    from fsdp2lab.plan import resolve
    from fsdp2lab.scale import layers
    from fsdp2lab.scale.estimate import estimate
    from fsdp2lab.scale.simulate import frozen_heap
    from fsdp2lab.scale.workers import Simulations, cpus

    fixed = check_args(cfg, given)
    layouts, refused = candidates(cfg, world_size, fixed)
    if not layouts:
        raise UsageError(
            f"fsdp2lab plan --search: no layout of --global-batch-size {cfg.global_batch_size} "
            f"on {world_size} GPUs passes the plan's checks"
        )
    figures: dict[Layout, dict] = {}  # every layout simulated or derived
    ceilings: dict[Layout, float] = {}  # their speed_ceiling
    computing: dict[int, float] = {}  # per TP degree, the least compute_ceiling
    exact: set[Layout] = set()  # those simulated themselves
    done: set[Layout] = set()  # those pruned
    counts = {
        "simulated": 0,
        "extended": 0,
        "derived": 0,
        "pruned_by_memory": 0,
        "pruned_by_speed": 0,
    }

    def record(layout: Layout, f: dict) -> None:
        figures[layout] = f
        ceilings[layout] = speed_ceiling(f)
        if layout.pp == 1 and layout.ac == "none":
            computing[layout.tp] = min(computing.get(layout.tp, math.inf), compute_ceiling(f))

    def fifth() -> float:
        fit = sorted(
            (f["tokens_per_s_per_gpu"] for f in figures.values() if f["fits"]), reverse=True
        )
        return fit[top - 1] if len(fit) >= top else 0.0

    def too_big(layout: Layout) -> bool:
        return any(not f["fits"] and leaner(a, layout) for a, f in figures.items())

    def capped(layout: Layout, bar: float) -> bool:
        bubble = 1 + (layout.pp - 1) / layout.n
        if computing.get(layout.tp, math.inf) / bubble <= bar:
            return True
        return any(c <= bar and computes_alike(a, layout) for a, c in ceilings.items())

    def too_slow(layout: Layout) -> bool:
        bar = fifth()
        if any(f["tokens_per_s_per_gpu"] <= bar and faster(a, layout) for a, f in figures.items()):
            return True
        # a fastest corner left unsimulated bounds none of its family: capped only with them all
        kin = (
            [y for b in families[family(layout)] for y in members[b]] if corner(layout) == 0 else []
        )
        return capped(layout, bar) and all(capped(y, bar) for y in kin)

    def skip(layout: Layout, memory: bool = True) -> str | None:
        if not prune:
            return None
        if memory and too_big(layout):
            return "pruned_by_memory"
        return "pruned_by_speed" if too_slow(layout) else None

    def base(layout: Layout) -> Layout:
        dp = world_size // (layout.tp * layout.pp)
        return layout if dp // layout.r == 1 else dataclasses.replace(layout, r=1)

    # Each family of layouts alike but for AC, accumulation and resharding: its fastest corner
    # first, even where a leaner layout does not fit (were it no faster than the fifth, the rest
    # would not be), then its leanest (were it not to fit, the rest would not), then the one
    # that would rule out the most others either way (see ``_most_telling``).
    def family(x: Layout) -> tuple:
        return x.tp, x.pp, x.n, x.schedule, x.units

    ks: dict[tuple, tuple[int, int]] = {}  # a family's fewest and most accumulation steps
    for x in layouts:
        low, high = ks.get(family(x), (x.k, x.k))
        ks[family(x)] = min(x.k, low), max(x.k, high)

    def corner(x: Layout) -> int:
        low, high = ks[family(x)]
        sharded = world_size // (x.tp * x.pp * x.r) > 1  # else resharding is not searched
        if x.ac == "none" and x.k == low and (x.reshard == RESHARD[-1] or not sharded):
            return 0
        return 1 if x.ac == "full" and x.k == high and x.reshard == "true" else 2

    order = sorted(layouts, key=lambda x: (x.pp, x.tp, x.n, SCHEDULES.index(x.schedule),
                                            UNITS.index(x.units), corner(x), _ac_order(x.ac),
                                            x.k, x.reshard != "true", x.r))  # fmt: skip
    members: dict[Layout, list[Layout]] = {}  # a simulated layout -> those derived from it too
    families: dict[tuple, list[Layout]] = {}
    for x in order:
        members.setdefault(base(x), []).append(x)
        keys = families.setdefault(family(x), [])
        if base(x) not in keys:
            keys.append(base(x))

    def settled(key: Layout) -> bool:
        """Whether every layout of ``key`` is simulated or pruned (counting those pruned)."""
        left = [x for x in members[key] if x not in figures and x not in done]
        # a fastest corner bounds its family's speed: simulated unless all of the family is too big
        if corner(key) == 0:
            leanest = [y for y in families[family(key)] if corner(y) == 1 and y.r == key.r]
            memory = too_big(leanest[0] if leanest else key)
        else:
            memory = True
        reasons = [skip(x, memory) for x in left]
        if not all(reasons):
            return False
        for x, reason in zip(left, reasons, strict=True):
            counts[reason] += 1
            done.add(x)
        return True

    def speed(f: dict) -> tuple[float, int]:  # the fastest first; of equals, the leanest
        return -f["tokens_per_s_per_gpu"], f["reserved_bytes_per_rank"]

    with Simulations(cpus() if workers is None else workers) as sims, frozen_heap():
        for keys in families.values():
            while keys := [key for key in keys if not settled(key)]:
                key = keys[0] if corner(keys[0]) < 2 else _most_telling(keys)
                keys.remove(key)
                plan = resolve(key.config(cfg), world_size, "cuda")
                if extend and layers.extendable(plan):
                    counts["extended"] += 1
                    # the copies' figures as the whole plan's: they depend on its mesh and batch
                    shallow_runs = sims.roles([plan, plan], list(layers.SHALLOW))
                    for x in members[key]:
                        whole, roles = plan, []
                        for runs in shallow_runs:
                            whole, runs = (plan, runs) if x == key else derive(plan, runs, x.r)
                            roles.append([estimate(whole, run, hw) for run in runs])
                        record(x, combine(whole, layers.extended(whole, hw, *roles)))
                        counts["derived"] += x != key
                    continue
                [runs] = sims.roles([plan], [None])
                counts["simulated"] += 1
                record(key, summarize(plan, hw, runs=runs))
                exact.add(key)
                for x in members[key]:
                    if x != key:
                        derived_plan, derived_runs = derive(plan, runs, x.r)
                        record(x, summarize(derived_plan, hw, runs=derived_runs))
                        counts["derived"] += 1

        ranked = sorted((x for x in figures if figures[x]["fits"]), key=lambda x: speed(figures[x]))
        if not ranked:
            least = min(f["reserved_bytes_per_rank"] for f in figures.values())
            raise UsageError(
                f"no layout fits: the leanest searched needs {gib_text(least)} "
                f"reserved of the {hw.gpu.description}'s {hw.gpu.hbm_gib:g} GiB (margin "
                f"{hw.margin:.0%}); try more GPUs, a bigger GPU or a smaller --global-batch-size"
            )
        best: list[tuple[Layout, dict]] = []
        left = ranked
        while left and len(best) < top:  # exact plans, the fastest first, until five fit
            # as many as fill the workers' last round: one that turns out not to fit (a shallow
            # copy's memory is within 0.5%) may then cost no round of its own
            take = -(-(top - len(best)) // sims.at_once) * sims.at_once
            batch, left = left[:take], left[take:]
            fresh = [x for x in batch if x not in exact]
            plans = [resolve(x.config(cfg), world_size, "cuda") for x in fresh]
            runs = sims.roles(plans, [None] * len(plans))
            planned = {
                x: summarize(p, hw, runs=r) for x, p, r in zip(fresh, plans, runs, strict=True)
            }
            for x in batch:
                f = planned.get(x) or figures[x]
                if f["fits"]:
                    best.append((x, f))
    best = rank_with_ties(sorted(best, key=lambda pair: speed(pair[1]))[:top], MODEL_ERROR)
    return {
        "model": cfg.model,
        "world_size": world_size,
        "gpu": hw.gpu.name,
        "global_batch": cfg.global_batch_size,
        "seq_len": cfg.seq_len,
        "layouts": len(layouts),
        "refused_shapes": refused,
        "fixed": {name: getattr(cfg, name) for name in fixed},
        **counts,
        "fit": len(ranked),
        "model_error": MODEL_ERROR,
        "top": [{**_entry(cfg, x, f), "tie": tie} for x, f, tie in best],
    }


def simplicity(layout: Layout, f: dict) -> tuple[int, bool, int]:
    """What makes a layout simpler to run, the simplest least: fewer mesh dimensions, no TP
    before TP, less activation checkpointing."""
    dims = sum(size > 1 for size in f["mesh"].values())
    return dims, layout.tp > 1, AC_BY_RECOMPUTATION.index(layout.ac)


def rank_with_ties(best: list[tuple[Layout, dict]], error: float) -> list[tuple[Layout, dict, int]]:
    """``best`` (layouts and their figures, the fastest first) with ties: the layouts whose
    tokens/s are within ``error`` (the model's, :data:`MODEL_ERROR`) of the fastest left are a
    tie, ranked simplest first (:func:`simplicity`; of equals, the faster). Each comes with its
    tie's number, counted from 1."""
    out: list[tuple[Layout, dict, int]] = []
    left = list(best)
    while left:
        fastest = left[0][1]["tokens_per_s_per_gpu"]
        tie = [p for p in left if p[1]["tokens_per_s_per_gpu"] * (1 + error) >= fastest]
        left = [p for p in left if p not in tie]
        number = len({t for *_, t in out}) + 1
        out += [(x, f, number) for x, f in sorted(tie, key=lambda p: simplicity(*p))]
    return out


def _most_telling(keys: list[Layout]) -> Layout:
    """Of ``keys`` (a family's layouts left), the one that rules out the most others either way:
    were it not to fit, those it is leaner than; were it no faster than the fifth, those it is
    faster than. The most of the lesser of the two; of equals, the first."""

    def told(x: Layout) -> int:
        others = [y for y in keys if y != x]
        return min(sum(leaner(x, y) for y in others), sum(faster(x, y) for y in others))

    return max(keys, key=told)


# Activation checkpointing, the least recomputation first: per-op AC recomputes no attention,
# ``selective`` every other layer whole, ``full`` every layer.
AC_BY_RECOMPUTATION = ("none", "op", "selective", "full")


def _ac_order(ac: str) -> int:
    return 0 if ac == "none" else 1 if ac == "full" else 2


def _entry(cfg: TrainConfig, layout: Layout, f: dict) -> dict:
    slowest = max(f["roles"], key=lambda role: role["time"]["step_s"])
    return {
        "label": f["label"],
        "mesh": f["mesh"],
        "tokens_per_s_per_gpu": f["tokens_per_s_per_gpu"],
        "mfu": f["mfu"],
        "reserved_bytes_per_rank": f["reserved_bytes_per_rank"],
        "peak_phase": f["peak_phase"],
        "step_s": f["step_s"],
        "time": slowest["time"],
        "micro_batch": f["micro_batch"],
        "layout": dataclasses.asdict(layout),
        "command": "fsdp2lab train " + shlex.join(train_flags(cfg, layout)),
    }


def train_flags(cfg: TrainConfig, layout: Layout) -> list[str]:
    """The ``fsdp2lab train`` flags of ``cfg`` (those not at their default) with ``layout``'s."""
    out: list[str] = []
    for name, f in _FIELDS.items():
        value = getattr(cfg, name)
        if name in SEARCHED or name == "strategy" or value == f.default:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        else:
            out += [flag, str(value)]
    return out + layout.flags()


# The step's parts (scale.estimate's "time"), which add up to it.
STEP_PARTS = (
    ("matmul_s", "matmul"),
    ("attention_s", "attention"),
    ("memory_bound_s", "memory-bound"),
    ("launch_bound_s", "host launches"),
    ("exposed_comm_s", "exposed comm"),
    ("optimizer_s", "optimizer"),
    ("pipeline_bubble_s", "pipeline bubble"),
)


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:,.1f}" if ms >= 10 else f"{ms:.3g}"


def format_search(r: dict) -> str:
    lines = [
        f"search: {r['model']} on {r['world_size']} x {r['gpu']}, global batch "
        f"{r['global_batch']} x {r['seq_len']} tokens: {r['layouts']} layouts, "
        f"{r['simulated']} simulated, {r['extended']} from copies of 2 and 4 layers a stage, "
        f"{r['derived']} derived from those (other --dp-replicate), "
        f"{r['pruned_by_memory']} ruled out by memory and {r['pruned_by_speed']} by speed unsimulated; "
        f"{r['fit']} fit. The fastest {len(r['top'])}, planned exactly:"
    ]
    if r["fixed"]:
        kept = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in r["fixed"].items())
        lines[0] = lines[0].replace(" layouts, ", f" layouts (with {kept}), ", 1)
    ties = Counter(e["tie"] for e in r["top"])
    if any(n > 1 for n in ties.values()):
        lines.append(
            f"Layouts within the model's error ({r['model_error']:.0%}, its largest on the "
            "published runs it is checked against) are a tie, marked, the simplest first "
            "(fewer mesh dimensions, no TP, less AC)."
        )
    for i, e in enumerate(r["top"], 1):
        t = e["time"]
        tie = f"(tie {e['tie']}) " if ties[e["tie"]] > 1 else ""
        parts = " + ".join(
            f"{name} {_ms(t[key])}" for key, name in STEP_PARTS if t.get(key) or key == "matmul_s"
        )
        lines.append(
            f"{i}. {tie}{e['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, MFU {e['mfu']:.1%}, reserved "
            f"{gib_text(e['reserved_bytes_per_rank'])} (peak: {e['peak_phase']}), "
            f"{e['label']} "
            + " x ".join(f"{k}={v}" for k, v in e["mesh"].items())
            + f", AC {e['layout']['ac']}, micro-batch {e['micro_batch']}"
        )
        lines.append(f"   step {_ms(e['step_s'])} ms = {parts} ms ({t['kernels']:,} kernels)")
        lines.append(f"   {e['command']}")
    return "\n".join(lines)
