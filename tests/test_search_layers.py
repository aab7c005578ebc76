"""``plan --search`` ranks deep models by figures extended from two shallow copies
(``scale/layers.py``): every figure of every rank role, extended from 2 and 4 layers a role,
against the full model's simulation, over the layouts a search takes (TP, PP with both schedules,
every AC mode, root units, no resharding, HSDP derived). Time, FLOPs and communication agree to
rounding; memory within 0.5%: a pipeline stage's peak here is off by 640 KiB of 306 MB, and a
simulation's peak can hold a buffer or not by what an earlier one in the process left cached. The
control:
odd shallow counts break AC ``selective``'s every-other-unit pattern, and the comparison sees it."""

from __future__ import annotations

import math

import pytest

from fsdp2lab.cli import build_parser
from fsdp2lab.config import config_from_args
from fsdp2lab.plan import resolve
from fsdp2lab.scale import layers
from fsdp2lab.scale.estimate import Hardware, estimate
from fsdp2lab.scale.gpus import get_gpu
from fsdp2lab.scale.report import combine, summarize
from fsdp2lab.scale.search import derive
from fsdp2lab.scale.simulate import simulate, stage_ranks

pytestmark = [pytest.mark.hf]
transformers = pytest.importorskip("transformers")

HW = Hardware(get_gpu("h100"), nproc_per_node=8, inter_node_gbs=25.0)
WORLD = 4
LAYOUTS = {
    "fsdp": ["--batch-size", "2"],
    "tp, selective": ["--tp", "2", "--activation-checkpointing", "selective"],
    "pp 1f1b, op": ["--pp", "2", "--batch-size", "4", "--activation-checkpointing", "op"],
    "pp gpipe, full, accumulation": ["--pp", "2", "--batch-size", "4", "--pp-schedule", "gpipe",
                                     "--activation-checkpointing", "full", "--grad-accum-steps", "2"],
    "root units, no resharding": ["--fsdp-units", "root", "--reshard-after-forward", "false"],
}  # fmt: skip


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama") / "eighteen-layers"
    transformers.LlamaConfig(
        hidden_size=512, intermediate_size=1024, num_hidden_layers=18, num_attention_heads=8,
        num_key_value_heads=4, vocab_size=4096, max_position_embeddings=512,
        tie_word_embeddings=False,
    ).save_pretrained(path)  # fmt: skip
    return path


def _plan(folder, flags: list[str]):
    argv = ["train", "--model", f"hf:{folder}", "--seq-len", "256", "--mixed-precision", "bf16",
            "--optimizer", "adamw", *flags]  # fmt: skip
    return resolve(config_from_args(build_parser().parse_args(argv)), WORLD, "cuda")


def _extended(plan, replicas: int = 1) -> dict:
    roles = []
    for m in layers.SHALLOW:
        p = layers.shallow(plan, m)
        runs = [simulate(p, rank=rank) for rank in stage_ranks(p)]
        if replicas > 1:
            p, runs = derive(p, runs, replicas)
        roles.append([estimate(p, run, HW) for run in runs])
    whole = derive(plan, [], replicas)[0] if replicas > 1 else plan
    return combine(whole, layers.extended(whole, HW, *roles))


def _differences(a, b, rel: float, where: str = "") -> list[str]:
    """Where two figures differ: numbers by more than ``rel`` (integers by 8 more: the rounding
    of a line through two points), anything else at all."""
    if isinstance(b, dict):
        keys = sorted(set(a) | set(b))
        return [d for k in keys for d in _differences(a.get(k), b.get(k), rel, f"{where}.{k}")]
    if isinstance(b, list):
        if not isinstance(a, list) or len(a) != len(b):
            return [f"{where}: {a!r} != {b!r}"]
        pairs = enumerate(zip(a, b, strict=True))
        return [d for i, (x, y) in pairs for d in _differences(x, y, rel, f"{where}[{i}]")]
    if isinstance(b, (int, float)) and not isinstance(b, bool) and isinstance(a, (int, float)):
        slack = 8 if isinstance(b, int) else 0
        return [] if math.isclose(a, b, rel_tol=rel, abs_tol=slack) else [f"{where}: {a} != {b}"]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def _missed(extended: dict, full: dict) -> list[str]:
    """Each role's time, FLOPs and communication to rounding; every other figure within 0.5%,
    the peak's split by category within 0.5% of the peak."""
    out = []
    for i, (e, f) in enumerate(zip(extended["roles"], full["roles"], strict=True)):
        for key in ("time", "comm", "flops_per_step", "model_flops_per_step"):
            out += _differences(e[key], f[key], 1e-9, f".roles[{i}].{key}")
        peak = f["memory"]["peak_bytes"]
        for cat in set(e["memory"]) | set(f["memory"]):
            if not math.isclose(e["memory"][cat], f["memory"][cat], abs_tol=5e-3 * peak):
                out.append(f".roles[{i}].memory.{cat}: {e['memory'][cat]} != {f['memory'][cat]}")
    split = {"roles"}
    out += _differences({k: v for k, v in extended.items() if k not in split},
                        {k: v for k, v in full.items() if k not in split}, 5e-3)  # fmt: skip
    for i, (e, f) in enumerate(zip(extended["roles"], full["roles"], strict=True)):
        rest = [k for k in f if k != "memory"]
        out += _differences({k: e[k] for k in rest}, {k: f[k] for k in rest}, 5e-3, f".roles[{i}]")
    return out


@pytest.mark.parametrize("name", LAYOUTS)
def test_extended_figures_are_the_full_simulations(folder, name):
    plan = _plan(folder, LAYOUTS[name])
    assert layers.extendable(plan)
    assert _missed(_extended(plan), summarize(plan, HW)) == []


def test_derived_hsdp_from_shallow_copies(folder):
    """HSDP 2 x 2 derived from the fully sharded shallow copies, against HSDP derived from the
    full model's simulation (``test_plan_search.py`` checks derived against simulated)."""
    plan = _plan(folder, ["--batch-size", "2"])
    runs = [simulate(plan, rank=rank) for rank in stage_ranks(plan)]
    derived_plan, derived_runs = derive(plan, runs, 2)
    hsdp = summarize(derived_plan, HW, runs=derived_runs)
    ext = _extended(plan, replicas=2)
    assert ext["mesh"] == hsdp["mesh"] == {"dp_replicate": 2, "dp_shard": 2}
    assert _missed(ext, hsdp) == []


def test_odd_shallow_counts_miss_selective_ac(folder, monkeypatch):
    """The control: from 1 and 3 layers, AC ``selective`` checkpoints 1 of 1 and 2 of 3 units, a
    line that does not reach the 9 of 18 of the full model."""
    monkeypatch.setattr(layers, "SHALLOW", (1, 3))
    plan = _plan(folder, LAYOUTS["tp, selective"])
    missed = _missed(_extended(plan), summarize(plan, HW))
    assert any(".time.step_s" in d for d in missed), missed


def test_what_is_not_extended(folder):
    """``auto`` units group by size (a shallow copy groups otherwise); stages of 8 layers or
    fewer cost as much as copies of 2 and 4."""
    assert not layers.extendable(_plan(folder, ["--fsdp-units", "auto"]))
    assert not layers.extendable(
        _plan(folder, ["--pp", "4", "--batch-size", "4", "--pp-microbatches", "4"])
    )
    assert layers.extendable(_plan(folder, LAYOUTS["pp 1f1b, op"]))


def test_gpipe_is_searched_only_where_given(folder):
    """GPipe's bubble is 1F1B's and it holds every micro-batch's activations at once: the plan
    puts its step within 0.05% of 1F1B's, at more memory, and a search takes 1F1B unless told."""
    from fsdp2lab.scale.search import candidates, check_args

    one, gpipe = (
        summarize(_plan(folder, [*LAYOUTS["pp 1f1b, op"], "--pp-schedule", s]), HW)
        for s in ("1f1b", "gpipe")
    )
    assert gpipe["step_s"] == pytest.approx(one["step_s"], rel=5e-4)
    assert gpipe["reserved_bytes_per_rank"] > one["reserved_bytes_per_rank"]

    def schedules(*flags: str) -> set[str]:
        argv = ["plan", "--model", f"hf:{folder}", "--seq-len", "256", "--global-batch-size",
                "8", "--tp", "1", *flags]  # fmt: skip
        cfg = config_from_args(build_parser().parse_args(argv))
        given = ["tp"] + [f[2:].replace("-", "_") for f in flags[:1]]
        layouts, _ = candidates(cfg, WORLD, check_args(cfg, given))
        return {x.schedule for x in layouts if x.pp > 1}

    assert schedules() == {"1f1b"}
    assert schedules("--pp-schedule", "gpipe") == {"gpipe"}
