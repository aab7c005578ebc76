"""docs/scale.md's CPU check of the plan's time model: real ``fsdp2lab train`` steps on this CPU
against the plan's step on a device record made of this CPU's own measured constants.

    PYTHONPATH=src python scripts/cpu_time_check.py            # a few minutes, one thread
    PYTHONPATH=src python scripts/cpu_time_check.py --threads 2 --repeats 1

This CPU's constants, each the median of 3 timings on ``--threads`` threads, measured again at
the start of each of the ``--repeats`` rounds (the plan takes their medians):

* matmul FLOP/s: fp32 ``torch.mm`` at (4096 x 1024) @ (1024 x 1024);
* memory bandwidth: a 256 MiB tensor copied, bytes read and written per second;
* launch: the host's time for one tiny in-place add (the dispatcher and the op's call);
* attention: causal ``scaled_dot_product_attention`` forward and backward, fp32, at half its
  counted FLOPs (as the plan counts a causal attention), over the matmul rate.

From them a device record (:class:`fsdp2lab.scale.gpus.GPU` with ``host_runs_kernels``: no
overlap, one output element a tile), and for each model (``ROWS``: chosen so that launches,
matmuls, attention and memory-bound ops each take a large share) the plan's step on it
(``simulate`` + ``estimate`` at world size 1, ``device_type="cpu"``) beside the real step:
``fsdp2lab train --device cpu --nproc-per-node 1`` with ``OMP_NUM_THREADS`` = ``--threads``, a
step record every step; its step time is the samples of a step over the step's samples/s, the
median over the steps after ``--warmup``. The real runs go row after row, ``--repeats`` times over;
each cell is the median of the repeats with their range. Each repeat also profiles a run
(``--profile``: 2 steps after 5): the real step's time in matmul and attention ops and the rest,
beside the plan's terms (medians of the repeats; the profiler adds its own cost to the rest).
Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
COMMON = ["--dataset", "synthetic", "--mixed-precision", "fp32", "--optimizer", "adam"]
# name -> (what it exercises, train flags)
ROWS = {
    "gpt L8 d32 b2 s16": (
        "launches",
        ["--model", "gpt", "--n-layers", "8", "--d-model", "32", "--n-heads", "2",
         "--seq-len", "16", "--batch-size", "2"],
    ),
    "gpt L2 d512 b4 s128": (
        "matmuls",
        ["--model", "gpt", "--n-layers", "2", "--d-model", "512", "--n-heads", "8",
         "--seq-len", "128", "--batch-size", "4"],
    ),
    "gpt L2 d64 b2 s1024": (
        "attention",
        ["--model", "gpt", "--n-layers", "2", "--d-model", "64", "--n-heads", "1",
         "--seq-len", "1024", "--batch-size", "2"],
    ),
    "gpt L1 d8 b2048 s32": (
        "memory-bound",
        ["--model", "gpt", "--n-layers", "1", "--d-model", "8", "--n-heads", "1",
         "--seq-len", "32", "--batch-size", "2048"],
    ),
    "hf Llama L4 d128 b8 s128": (
        "all",
        ["--seq-len", "128", "--batch-size", "8"],
    ),
}  # fmt: skip
# The profiler's names of the ops the plan times as matmuls and attention (CPU kernels).
MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"}
ATTENTION_OPS = "aten::_scaled_dot_product_flash_attention_for_cpu"
LLAMA = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=256,
    tie_word_embeddings=True,
)


def _median_s(fn, iters: int, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        samples.append((time.perf_counter() - start) / iters)
    return statistics.median(samples)


def measure(repeats: int) -> dict:
    """This CPU's constants (the module's docstring)."""
    import torch
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode

    a, b = torch.randn(4096, 1024), torch.randn(1024, 1024)
    matmul = 2 * 4096 * 1024 * 1024 / _median_s(lambda: torch.mm(a, b), 2, repeats)
    src = torch.randn(64 << 20)  # 256 MiB
    dst = torch.empty_like(src)
    bandwidth = 2 * src.nbytes / _median_s(lambda: dst.copy_(src), 2, repeats)
    x = torch.zeros(8)
    launch = _median_s(lambda: x.add_(1.0), 20000, repeats)
    q, k, v = (torch.randn(4, 4, 512, 64, requires_grad=True) for _ in range(3))

    def attention():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    with FlopCounterMode(display=False) as counter:
        attention()
    flops = counter.get_total_flops() / 2  # causal: the kernel computes about half
    rate = flops / _median_s(attention, 2, repeats)
    return {
        "matmul_tflops": matmul / 1e12,
        "bandwidth_tbs": bandwidth / 1e12,
        "launch_s": launch,
        "attention": rate / matmul,
    }


def device(constants: dict):
    from fsdp2lab.scale.gpus import GPU

    return GPU(
        "cpu",
        "this CPU",
        hbm_gib=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30,
        bf16_tflops=constants["matmul_tflops"],
        hbm_tbs=constants["bandwidth_tbs"],
        intra_node_gbs=constants["bandwidth_tbs"] * 1e3,
        sms=1,
        mamf_tflops=constants["matmul_tflops"],
        attention=constants["attention"],
        tile=(1, 1),
        launch_s=constants["launch_s"],
        host_runs_kernels=True,
    )


def flags(name: str, folder: Path) -> list[str]:
    model = ["--model", f"hf:{folder}"] if name.startswith("hf") else []
    return [*model, *ROWS[name][1], *COMMON]


def plan_row(name: str, folder: Path, cpu) -> dict:
    """The plan's step on ``cpu`` (ms) and its parts."""
    from fsdp2lab.cli import build_parser
    from fsdp2lab.config import config_from_args
    from fsdp2lab.plan import resolve
    from fsdp2lab.scale.estimate import Hardware, estimate
    from fsdp2lab.scale.simulate import simulate

    cfg = config_from_args(build_parser().parse_args(["train", *flags(name, folder)]))
    plan = resolve(cfg, 1, "cpu")
    t = estimate(plan, simulate(plan, 0, "cpu"), Hardware(cpu, 1, 50.0))["time"]
    parts = ("step_s", "matmul_s", "attention_s", "memory_bound_s", "launch_bound_s")
    return {
        **{k.removesuffix("_s").removesuffix("_bound"): t[k] * 1e3 for k in parts},
        "other": (t["exposed_comm_s"] + t["optimizer_s"]) * 1e3,
        "kernels": t["kernels"],
    }


def train(name: str, folder: Path, args, steps: int, extra: list[str]) -> None:
    batch = int(ROWS[name][1][ROWS[name][1].index("--batch-size") + 1])
    cmd = [sys.executable, "-m", "fsdp2lab", "train", *flags(name, folder), "--device", "cpu",
           "--nproc-per-node", "1", "--max-steps", str(steps), "--synthetic-size",
           str(batch * steps), "--progress", "off", *extra]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"cpu_time_check: {' '.join(cmd)} exited {proc.returncode}\n{proc.stderr[-3000:]}")


def real_step_ms(name: str, folder: Path, work: Path, args) -> float:
    """The median step (ms) of a ``fsdp2lab train`` run after the warm-up."""
    metrics = work / "m.jsonl"
    metrics.unlink(missing_ok=True)
    train(
        name, folder, args, args.steps, ["--log-every-steps", "1", "--metrics-file", str(metrics)]
    )
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in records if r["event"] == "step"]
    return 1e3 * statistics.median(
        (r["samples_seen"] - before["samples_seen"]) / r["samples_per_s"]
        for before, r in zip(steps, steps[1:], strict=False)
        if r["step"] > args.warmup
    )


def profiled_ms(name: str, folder: Path, work: Path, args) -> dict:
    """A step of a ``fsdp2lab train --profile`` run (after 5 warm-up steps, 2 profiled): its
    time, the time in matmul and attention ops, and the rest (ms, the 2 steps' mean)."""
    trace = work / "profile" / "rank0.pt.trace.json"
    trace.unlink(missing_ok=True)
    train(name, folder, args, 7, ["--profile", str(trace.parent), "--profile-steps", "2"])
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    steps = [e for e in events if e["name"].startswith("ProfilerStep#")]
    out = {"step": sum(e["dur"] for e in steps), "matmul": 0.0, "attention": 0.0}
    for e in events:
        if e["name"] in MATMUL_OPS:
            out["matmul"] += e["dur"]
        elif e["name"].startswith(ATTENTION_OPS):
            out["attention"] += e["dur"]
    out = {k: v / len(steps) / 1e3 for k, v in out.items()}
    return {**out, "rest": out["step"] - out["matmul"] - out["attention"]}


def _cell(values: list[float]) -> str:
    mid = statistics.median(values)
    if len(values) == 1:
        return f"{mid:,.1f}"
    return f"{mid:,.1f} ({min(values):,.1f}-{max(values):,.1f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rows", default=",".join(ROWS), help="comma-separated: " + ", ".join(ROWS))
    p.add_argument("--json", help="write the constants and rows here too")
    args = p.parse_args()
    names = args.rows.split(",")
    if unknown := [n for n in names if n not in ROWS]:
        sys.exit(f"cpu_time_check: unknown rows {unknown}; choose from {list(ROWS)}")
    if args.warmup >= args.steps:
        sys.exit("cpu_time_check: --warmup must be below --steps")

    import torch

    torch.set_num_threads(args.threads)
    measured: list[dict] = []
    real: dict[str, list[float]] = {name: [] for name in names}
    runs: dict[str, list[dict]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        folder = work / "llama"
        if any(name.startswith("hf") for name in names):  # only hf: rows need transformers
            import transformers

            transformers.LlamaConfig(**LLAMA).save_pretrained(folder)
        for _ in range(args.repeats):
            measured.append(measure(3))
            for name in names:
                real[name].append(real_step_ms(name, folder, work, args))
                runs[name].append(profiled_ms(name, folder, work, args))
        constants = {k: statistics.median(m[k] for m in measured) for k in measured[0]}
        cpu = device(constants)
        plans = {name: plan_row(name, folder, cpu) for name in names}
    profiled = {
        name: {k: statistics.median(r[k] for r in runs[name]) for k in runs[name][0]}
        for name in names
    }

    def constant(key: str, scale: float, unit: str) -> str:
        values = [m[key] * scale for m in measured]
        mid, low, high = statistics.median(values), min(values), max(values)
        return f"{mid:.2f} {unit} ({low:.2f}-{high:.2f})"

    print(
        f"CPU, {args.threads} thread(s): fp32 matmul {constant('matmul_tflops', 1e3, 'GFLOP/s')}, "
        f"copy {constant('bandwidth_tbs', 1e3, 'GB/s')}, one op "
        f"{constant('launch_s', 1e6, 'us')}, causal attention "
        f"{constant('attention', 1, 'of the matmul rate')}\n"
    )
    print(
        "| model | exercises | ops | plan step ms | real step ms | real / plan | matmul ms: plan, "
        "real | attention: plan, real | the rest: plan (memory-bound + launch + other), real |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in names:
        t, prof = plans[name], profiled[name]
        ratios = [r / t["step"] for r in real[name]]
        rest = t["memory"] + t["launch"] + t["other"]
        print(
            f"| {name} | {ROWS[name][0]} | {t['kernels']:,} | {t['step']:,.1f} | "
            f"{_cell(real[name])} | {statistics.median(ratios):.2f} "
            f"({min(ratios):.2f}-{max(ratios):.2f}) | {t['matmul']:,.1f}, {prof['matmul']:,.1f} | "
            f"{t['attention']:,.1f}, {prof['attention']:,.1f} | {rest:,.1f} ({t['memory']:,.1f} + "
            f"{t['launch']:,.1f} + {t['other']:,.1f}), {prof['rest']:,.1f} |"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"constants": constants, "plan": plans, "real_step_ms": real, "profiled": profiled},
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
