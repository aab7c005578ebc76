"""docs/scale.md's time check table: each published or measured run the tests check
(tests/test_scale_published.py, tests/test_hf_plan.py), planned, with where its step goes.

    python scripts/plan_time_table.py [--out-of-sample]

Prints one markdown row per run: the plan's tokens/s per GPU, the run's, the error, and the
plan's step broken down (ms of matmul, attention and memory-bound kernels on the compute stream,
communication the compute waits for, the optimizer). A few minutes of CPU. With
``--out-of-sample``, the out-of-sample table instead: the published runs that chose nothing
(``OUT_OF_SAMPLE`` in tests/test_scale_published.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import test_scale_published as published  # noqa: E402
from fsdp2lab.scale.estimate import Hardware, estimate  # noqa: E402
from fsdp2lab.scale.gpus import DEFAULT_INTER_NODE_GBS, get_gpu  # noqa: E402
from fsdp2lab.scale.simulate import simulate  # noqa: E402


def rows(folder: Path):
    """(plan, its simulation, GPU, [(variant, --compile, measured tokens/s)]): the checked runs."""
    for plan, gpu, variants in _checked_plans(folder):
        yield plan, simulate(plan), gpu, variants


def _checked_plans(folder: Path):
    import test_hf_plan as hf  # needs transformers, which the out-of-sample runs do not

    table = {}
    for name, (gpus, compile, rate) in published.TIME_ROWS.items():
        table.setdefault(gpus, []).append((name, compile, rate))
    for gpus, variants in table.items():
        yield published._plan(published.LLAMA3_8B, gpus), "h100-96gb", variants
    yield (
        published._plan(published.LLAMA2_13B, 64),
        "a100",
        [("Llama 2 13B, 64 A100", False, published.LLAMA2_13B_A100_TOKENS_S)],
    )
    by_layers = {}
    for name, (layers, compile, rate) in hf.H200_ROWS.items():
        by_layers.setdefault(layers, []).append((f"H200 1.2B shape, {name}", compile, rate))
    for layers, variants in by_layers.items():
        config = hf.config_folder(folder / f"l{layers}", **hf.h200_config(layers))
        flags = ["--model", f"hf:{config}", *hf.H200_FLAGS]
        yield published._plan(flags, 1), "h200", variants


def out_of_sample_rows():
    """As ``rows``: the out-of-sample runs (simulated once a session)."""
    for name, (*_, rate) in published.OUT_OF_SAMPLE.items():
        yield *published.out_of_sample_run(name), "a100", [(name, False, rate)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-of-sample", action="store_true")
    args = parser.parse_args()
    print(
        "| run | plan tokens/s/GPU | measured | error | matmul ms | attention ms | "
        "memory-bound ms | exposed comm ms | optimizer ms |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory() as tmp:
        table = out_of_sample_rows() if args.out_of_sample else rows(Path(tmp))
        for plan, run, gpu, variants in table:
            hw = Hardware(get_gpu(gpu), 8, DEFAULT_INTER_NODE_GBS)
            for name, compile, measured in variants:
                cfg = dataclasses.replace(plan.cfg, compile=compile)
                e = estimate(dataclasses.replace(plan, cfg=cfg), run, hw)
                t, rate = e["time"], e["tokens_per_s_per_gpu"]
                ms = [t[k] * 1e3 for k in ("matmul_s", "attention_s", "memory_bound_s")]
                ms += [t["exposed_comm_s"] * 1e3, t["optimizer_s"] * 1e3]
                print(
                    f"| {name} | {rate:,.0f} | {measured:,} | {rate / measured - 1:+.0%} | "
                    + " | ".join(f"{v:,.0f}" for v in ms)
                    + " |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
