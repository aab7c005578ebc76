"""A deep model's plan figures from two shallow copies of it: how ``plan --search`` ranks layouts
without simulating every layer of each.

A transformer's layer units are alike, so each figure of a rank role (every phase's tracked peak
and reserved memory, its state, FLOPs, collectives' calls and bytes, kernels and every part of
the step time) grows by the same amount with each layer. :func:`shallow` keeps the first ``m``
layer units of each pipeline stage (the others removed from the meta model, as a pipeline stage
removes another stage's modules); :func:`extended` takes each role's figures at ``SHALLOW`` =
(2, 4) layers and extends every figure along the line through them to the role's own count.
Tokens/s, MFU and whether each phase fits are then worked out from the extended step time and
headroom. Both counts are even, so AC ``selective`` (every other unit) keeps its pattern.

It applies (:func:`extendable`) where every layer unit has the same parameter shapes, the FSDP
units are ``layer`` or ``root`` (``auto`` groups by size, which a shallow copy changes), and every
role holds more than 8 layers (below that, two copies cost as much as the whole).
``tests/test_search_layers.py`` checks it against full simulations.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING

from fsdp2lab.scale.estimate import Hardware, throughput

if TYPE_CHECKING:
    from fsdp2lab.plan import RunPlan

SHALLOW = (2, 4)


def stage_layers(plan: RunPlan) -> list[list[str]]:
    """The layer units of each rank role (:func:`~fsdp2lab.scale.simulate.stage_ranks` order)."""
    if not plan.stages:
        return [list(plan.units)]
    return [[n for n in stage if n in plan.units] for stage in plan.stages]


def extendable(plan: RunPlan) -> bool:
    """Whether :func:`extended` gives ``plan``'s figures (the module docstring's conditions)."""
    if plan.cfg.fsdp_units not in ("layer", "root"):
        return False
    roles = stage_layers(plan)
    if plan.stages and sum(map(len, roles)) != len(plan.units):  # a stage module holds units
        return False
    if min(map(len, roles)) <= 2 * SHALLOW[-1]:  # two copies would cost as much as the whole
        return False
    model = plan.meta_model
    shapes = {tuple(p.shape for p in model.get_submodule(u).parameters()) for u in plan.units}
    return len(shapes) == 1


def shallow(plan: RunPlan, m: int) -> RunPlan:
    """``plan`` with the first ``m`` layer units of each stage only."""
    from fsdp2lab.parallel.pp import remove_modules

    drop = {name for layers in stage_layers(plan) for name in layers[m:]}
    model = copy.deepcopy(plan.meta_model)
    remove_modules(model, sorted(drop))
    return dataclasses.replace(
        plan,
        meta_model=model,
        units=tuple(u for u in plan.units if u not in drop),
        stages=tuple(tuple(n for n in stage if n not in drop) for stage in plan.stages),
    )


def extended(plan: RunPlan, hw: Hardware, low: list[dict], high: list[dict]) -> list[dict]:
    """``plan``'s rank roles (:func:`~fsdp2lab.scale.estimate.estimate`'s figures) from those of
    its shallow copies at ``SHALLOW[0]`` (``low``) and ``SHALLOW[1]`` (``high``) layers a role."""
    m1, m2 = SHALLOW
    out = []
    for i, (layers, a, b) in enumerate(zip(stage_layers(plan), low, high, strict=True)):
        a, b = ({k: v for k, v in r.items() if k != "modules"} for r in (a, b))
        role = _line(a, b, (len(layers) - m1) / (m2 - m1))
        if plan.stages:
            role["modules"] = list(plan.stages[i])
        for phase in role["phases"]:
            phase["fits"] = phase["headroom_bytes"] >= 0
        role["fits"] = all(p["fits"] for p in role["phases"])
        role["headroom_bytes"] = min(p["headroom_bytes"] for p in role["phases"])
        role["peak_phase"] = max(role["phases"], key=lambda p: p["reserved_bytes_estimate"])[
            "phase"
        ]
        role["tokens_per_s_per_gpu"], role["mfu"] = throughput(
            plan, hw, role["time"]["step_s"], role["model_flops_per_step"]
        )
        out.append(role)
    return out


def _line(a, b, t: float):
    """``a`` + (``b`` - ``a``) x ``t``, for every number of two figures alike in structure;
    anything else (names, flags) is ``b``'s."""
    if isinstance(a, dict):
        return {key: _line(a[key], value, t) for key, value in b.items()}
    if isinstance(a, list):
        return [_line(x, y, t) for x, y in zip(a, b, strict=True)]
    if isinstance(a, bool) or not isinstance(a, (int, float)):
        return b
    value = a + (b - a) * t
    return round(value) if isinstance(a, int) and isinstance(b, int) else value
