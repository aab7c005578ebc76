"""``fsdp2lab plan --search``: the fastest layouts that fit, ranked by the plan's tokens/s, each
with train flags that ``fsdp2lab plan`` plans to the same figures; derived HSDP figures against
HSDP simulated; bad input."""

from __future__ import annotations

import dataclasses
import itertools
import json
import shlex
from pathlib import Path

import pytest

from fsdp2lab.cli import build_parser, main
from fsdp2lab.config import config_from_args
from fsdp2lab.plan import resolve
from fsdp2lab.scale import search as search_module
from fsdp2lab.scale import workers
from fsdp2lab.scale.estimate import GIB, NON_TORCH_GIB, Hardware, estimate
from fsdp2lab.scale.gpus import get_gpu
from fsdp2lab.scale.report import summarize
from fsdp2lab.scale.search import (
    Layout,
    compute_ceiling,
    computes_alike,
    derive,
    format_search,
    search,
    speed_ceiling,
)
from fsdp2lab.scale.simulate import simulate

GPT = ["--model", "gpt", "--n-layers", "2", "--d-model", "128", "--seq-len", "1024",
       "--global-batch-size", "8", "--mixed-precision", "bf16", "--optimizer", "adamw"]  # fmt: skip
WORLD = ["--world-size", "2", "--gpu", "a100-40gb", "--pp", "1"]  # --pp 1: kept, a shorter search
FIXTURE = str(Path(__file__).parent / "fixtures" / "llama3.py")


def cli_json(capsys, argv: list[str]) -> dict:
    assert main(["plan", *argv, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def margin_below(needed_reserved: int) -> str:
    """A --memory-margin leaving an A100 40 GB one byte less than a plan reserving that needs."""
    usable = needed_reserved + NON_TORCH_GIB * GIB - 1
    return repr(1 - usable / (get_gpu("a100-40gb").hbm_gib * GIB))


@pytest.mark.slow
def test_search_where_memory_rules_out_the_fastest(capsys, monkeypatch):
    """With room for everything, the fastest layout is listed; with a margin that leaves it one
    byte short, it is gone, the next fit in order of ties, and every printed command, planned by
    ``fsdp2lab plan``, gives the printed figures (the five are planned exactly)."""
    free = cli_json(capsys, [*GPT, *WORLD, "--search"])
    fastest = max(free["top"], key=lambda e: e["tokens_per_s_per_gpu"])
    assert fastest["layout"]["ac"] == "none"
    margin = margin_below(fastest["reserved_bytes_per_rank"])
    tight = cli_json(capsys, [*GPT, *WORLD, "--memory-margin", margin, "--search"])
    top = tight["top"]
    assert len(top) == 5 and fastest["command"] not in [e["command"] for e in top]
    speeds = [e["tokens_per_s_per_gpu"] for e in top]  # by tie (tests/test_search_ties.py)
    assert [e["tie"] for e in top] == sorted(e["tie"] for e in top)
    assert max(speeds) <= fastest["tokens_per_s_per_gpu"]
    # the fastest's family is simulated (its fastest corner bounds it), the rest pruned
    assert tight["pruned_by_memory"] + tight["pruned_by_speed"] > 0
    for e in top:
        flags = shlex.split(e["command"])[2:]
        planned = cli_json(capsys, [*flags, *WORLD, "--memory-margin", margin])
        assert planned["fits"] is True
        for key in ("tokens_per_s_per_gpu", "mfu", "reserved_bytes_per_rank", "peak_phase"):
            assert planned[key] == e[key], (e["command"], key)
    # the pruned search's five are the exhaustive search's (--tp 1, layer units: fewer layouts)
    kept = ["--tp", "1", "--pp", "1", "--fsdp-units", "layer"]
    cfg = config_from_args(build_parser().parse_args(["train", *GPT, *kept]))
    hw = Hardware(get_gpu("a100-40gb"), 8, 50.0, margin=float(margin))
    given = ("tp", "pp", "fsdp_units")
    pruned, every = (search(cfg, 2, hw, given, prune=p) for p in (True, False))
    assert pruned["simulated"] < every["simulated"] and every["pruned_by_speed"] == 0
    assert [e["tokens_per_s_per_gpu"] for e in pruned["top"]] == [
        e["tokens_per_s_per_gpu"] for e in every["top"]
    ]
    # without --json, plan --search prints that search as format_search writes it (not run again)
    monkeypatch.setattr(search_module, "search", lambda *args, **kwargs: tight)
    assert main(["plan", *GPT, *WORLD, "--memory-margin", margin, "--search"]) == 0
    text = capsys.readouterr().out
    assert text == format_search(tight) + "\n"
    assert text.count("fsdp2lab train ") == 5 and "1. " in text and "tokens/s/GPU" in text
    steps = [line.split() for line in text.splitlines() if line.startswith("   step ")]
    assert len(steps) == 5
    for words in steps:  # step X ms = name a + name b + ... ms (K kernels): the parts add up
        parts = " ".join(words[words.index("=") + 1 : words.index("ms", 3)]).split(" + ")
        total = sum(float(part.split()[-1].replace(",", "")) for part in parts)
        assert total == pytest.approx(float(words[1].replace(",", "")), rel=1e-2), words


@pytest.mark.slow
def test_search_in_workers_matches_search_in_process(monkeypatch, capfd):
    """Simulations in spawned workers (each resolving the layout's plan from its config, taking
    the shallow copy and the stage) give the search every figure it gets in this process: a
    pipelined GPT with layers enough for shallow copies. The workers end writing nothing (a heap
    left frozen at their exit had triton's bindings report leaks)."""
    monkeypatch.setattr(workers, "INLINE_S", 0.0)  # the workers from the first simulation
    pools = []  # each search's pool, as it ends
    end = workers.Simulations.__exit__
    monkeypatch.setattr(
        workers.Simulations, "__exit__", lambda self, *exc: pools.append(self._pool) or end(self)
    )
    argv = ["train", *GPT, "--n-layers", "18", "--tp", "1", "--pp", "2", "--fsdp-units", "layer",
            "--activation-checkpointing", "full", "--grad-accum-steps", "1"]  # fmt: skip
    cfg = config_from_args(build_parser().parse_args(argv))
    hw = Hardware(get_gpu("a100-40gb"), 8, 50.0)
    given = ("tp", "pp", "fsdp_units", "activation_checkpointing", "grad_accum_steps")
    pooled = search(cfg, 2, hw, given, top=2, workers=2)
    assert capfd.readouterr().err == ""
    assert pooled["extended"] > 0 and pooled["top"]
    assert pooled == search(cfg, 2, hw, given, top=2, workers=1)
    assert pools[0] is not None and pools[1] is None


def test_a_speed_ceiling_bounds_every_layout_computing_alike():
    """``speed_ceiling`` of a layout's figures against the tokens/s of every layout computing alike
    (the same TP, PP and micro-batches, at least as much recomputation; any replicas, units and
    resharding): none is faster, all simulated, on a pipeline whose step the matmuls dominate.
    The control: the same model without the pipeline (and its bubble) is faster than the
    pipeline's ceiling."""
    argv = ["train", "--model", "gpt", "--n-layers", "2", "--d-model", "4096", "--seq-len",
            "2048", "--global-batch-size", "8", "--mixed-precision", "bf16", "--optimizer",
            "adamw"]  # fmt: skip
    cfg = config_from_args(build_parser().parse_args(argv))
    hw = Hardware(get_gpu("h100"), 8, 50.0)
    pipelines = [
        Layout(tp=1, pp=2, r=r, k=1, ac="none", units=units, reshard=reshard, n=2)
        for r, units, reshard in itertools.product((1, 2), ("layer", "root"), ("true", "false"))
    ]
    pipelines.append(dataclasses.replace(pipelines[-1], ac="full"))
    figures = {x: summarize(resolve(x.config(cfg), 4, "cuda"), hw) for x in pipelines}
    pairs = [(a, b) for a in figures for b in figures if computes_alike(a, b)]
    assert len(pairs) == 8 * 8 + 8 + 1  # none -> none, none -> full, full -> full
    for a, b in pairs:
        ceiling = speed_ceiling(figures[a])
        assert figures[b]["tokens_per_s_per_gpu"] <= ceiling * (1 + 1e-12), (a, b)
    # not resharding: at NCCL's bus bandwidth, FSDP 4's all-gathers again in backward would
    # leave it 0.9% below the ceiling
    no_pipeline = Layout(tp=1, pp=1, r=1, k=1, ac="none", units="layer", reshard="false")
    assert not computes_alike(pipelines[0], no_pipeline)
    faster = summarize(resolve(no_pipeline.config(cfg), 4, "cuda"), hw)
    assert faster["tokens_per_s_per_gpu"] > speed_ceiling(figures[pipelines[0]])


def test_no_pipeline_beats_the_compute_ceiling_of_its_tp():
    """``compute_ceiling`` of a layout without a pipeline or recomputation, over the bubble,
    against the tokens/s of pipelines with its TP degree (micro-batches, accumulation, replicas,
    AC), all simulated: none is faster. What it rests on: the stages' compute floors average
    the flat layout's, exactly without recomputation; the control: with it, they average more."""
    argv = ["train", "--model", "gpt", "--n-layers", "2", "--d-model", "4096", "--seq-len",
            "2048", "--global-batch-size", "8", "--mixed-precision", "bf16", "--optimizer",
            "adamw"]  # fmt: skip
    cfg = config_from_args(build_parser().parse_args(argv))
    hw = Hardware(get_gpu("h100"), 8, 50.0)
    flat = {tp: Layout(tp=tp, pp=1, r=1, k=1, ac="none", units="layer", reshard="true")
            for tp in (1, 2)}  # fmt: skip
    pipe = Layout(tp=1, pp=2, r=1, k=1, ac="none", units="layer", reshard="true", n=2)
    pipelines = [
        pipe,
        dataclasses.replace(pipe, n=4, units="root", reshard="false"),
        dataclasses.replace(pipe, k=2, r=2, ac="full"),
        dataclasses.replace(pipe, tp=2, ac="op"),
        dataclasses.replace(pipe, tp=2, n=4),
    ]
    layouts = [*flat.values(), *pipelines]
    figures = {x: summarize(resolve(x.config(cfg), 4, "cuda"), hw) for x in layouts}

    def floor(x: Layout) -> float:  # the stages' mean
        times = [r["time"] for r in figures[x]["roles"]]
        assert all(t["compute_floor_s"] <= t["matmul_s"] + t["attention_s"] for t in times)
        return sum(t["compute_floor_s"] for t in times) / len(times)

    for x in pipelines:
        ceiling = compute_ceiling(figures[flat[x.tp]]) / (1 + (x.pp - 1) / x.n)
        assert figures[x]["tokens_per_s_per_gpu"] <= ceiling, x
        if x.ac == "none":
            assert floor(x) == pytest.approx(floor(flat[x.tp]), rel=1e-9), x
        else:
            assert floor(x) > 1.04 * floor(flat[x.tp]), x


def test_derived_hsdp_matches_simulated():
    """HSDP 2 x 4 derived from FSDP 8 against HSDP 2 x 4 simulated: state and collectives
    exact (no padding at these sizes), the state and peaks within 0.1%."""
    gpt = [*GPT[:-4], "--global-batch-size", "16", "--grad-accum-steps", "2", *GPT[-4:]]

    def plan(*extra):
        cfg = config_from_args(build_parser().parse_args(["train", *gpt, *extra]))
        return resolve(cfg, 8, "cuda")

    base = plan()
    hsdp, (derived,) = derive(base, [simulate(base)], 2)
    simulated = simulate(plan("--dp-replicate", "2"))
    # the step's time from the derived ops (ring bytes at 4 shards, the all-reduce across the
    # 2 replicas added) against the simulated ones': communication exact; the step within 12%
    # (this tiny step waits on the host's launches, and FSDP 8's trace has 25 ops more than
    # HSDP's 428, its gradient divisions: 0.25 ms of 2.3)
    hw = Hardware(get_gpu("h100"), 4, 50.0)  # 4 a node: the replicas talk across nodes
    times = [estimate(hsdp, run, hw)["time"] for run in (derived, simulated)]
    assert times[0]["comm_s"] == pytest.approx(times[1]["comm_s"], rel=1e-6)
    assert times[0]["step_s"] == pytest.approx(times[1]["step_s"], rel=0.12)
    # AdamW's step counters (4 bytes a tensor) are not sharded
    assert derived.state == pytest.approx(simulated.state, rel=1e-3)
    assert derived.comm == simulated.comm
    assert derived.peak_bytes == pytest.approx(simulated.peak_bytes, rel=1e-3)
    for d, s in zip(derived.phases, simulated.phases, strict=True):
        assert d.peak_bytes == pytest.approx(s.peak_bytes, rel=1e-3), d.name


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--dp-shard", "2"], "fsdp2lab plan --search chooses --dp-shard itself"),
        (["--batch-size", "2"], "fsdp2lab plan --search chooses --batch-size itself"),
        (["--strategy", "ddp"], "--search searches --strategy fsdp2 layouts, not ddp"),
        (["--memory-margin", "0.99"], "no layout fits: the leanest searched needs"),
    ],
)
def test_search_bad_input_is_one_line(capsys, extra, message):
    argv = ["plan", *GPT, *WORLD, "--search", *extra]
    if "--batch-size" in extra:
        argv.remove("--global-batch-size")
        argv.remove("8")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_search_needs_a_global_batch(capsys):
    argv = [a for a in GPT if a not in ("--global-batch-size", "8")]
    assert main(["plan", *argv, *WORLD, "--search"]) == 2
    assert capsys.readouterr().err.strip() == (
        "fsdp2lab: error: fsdp2lab plan --search needs --global-batch-size (samples per step)"
    )


@pytest.mark.slow
def test_search_llama3_8b_on_8_h100(capsys):
    """Llama 3.1 8B, global batch 16 x 8192 tokens on 8 H100: the winner is torchtitan's FSDP 8,
    or a layout faster than the fastest FSDP 8 the search found, its step broken down."""
    flags = ["--model", f"{FIXTURE}:build", "--model-args", 'sac="none"', "--loss",
             f"{FIXTURE}:loss", "--vocab-size", "128256", "--seq-len", "8192",
             "--global-batch-size", "16", "--mixed-precision", "bf16", "--optimizer", "adamw",
             "--world-size", "8", "--gpu", "h100"]  # fmt: skip
    r = cli_json(capsys, [*flags, "--search"])
    best = r["top"][0]
    fsdp8 = [e for e in r["top"] if e["mesh"] == {"dp_shard": 8}]
    assert (
        best["mesh"] == {"dp_shard": 8}
        or not fsdp8
        or (best["tokens_per_s_per_gpu"] > fsdp8[0]["tokens_per_s_per_gpu"])
    )
    assert best["time"]["step_s"] == best["step_s"] and best["time"]["compute_s"] > 0
