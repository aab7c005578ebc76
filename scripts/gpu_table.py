"""docs/speed.md's GPU table in one command: fsdp2lab against a plain training loop and the plan.

    PYTHONPATH=src python scripts/gpu_table.py              # Llama-3.2-1B shape, one GPU
    PYTHONPATH=src python scripts/gpu_table.py --layers 4 --rows fsdp2,plain-fused,plan --json t.json
    PYTHONPATH=src python scripts/gpu_table.py --rows fsdp2,lora --profile prof   # + kernel tables

The model is a Llama-3.2-1B-shaped ``hf:`` folder holding only ``config.json`` (hidden 2048, 16
layers, 32 heads, 8 KV heads, vocabulary 128256, tied embeddings; transformers builds it with its
own init), trained on synthetic tokens: ``--seq-len 2048 --batch-size 4 --mixed-precision bf16
--optimizer adamw --max-steps 30`` on one device. Rows (``--rows``, in this order):

* ``fsdp2``, ``single``, ``ac-full``, ``compile``, ``lora``, ``qlora``, ``offload``: ``fsdp2lab
  train`` (FSDP2 on one rank; ``--strategy single``; ``--activation-checkpointing full``;
  ``--compile``; ``--lora-rank 16 --lora-dropout 0``; the same with ``--quantize-base nf4``,
  QLoRA, which needs torchao (one rank's FSDP2 leaves the NF4 base whole);
  ``--cpu-offload --max-grad-norm 1.0``), each in its own process, a step record every step
  (``--metrics-file``).
* ``fsdp2-log10``, ``lora-log10``: the ``fsdp2`` and ``lora`` rows with a step record every 10
  steps, as users log (``--log-every-steps 10``): against those rows, what a record a step costs.
* ``plain``, ``plain-fused``: the same Hugging Face model in a plain loop (fp32 weights, bf16
  autocast, ``torch.optim.AdamW`` with ``foreach=True``, then ``fused=True``), in a fresh process.
* ``plan``, ``plan-ac``: ``fsdp2lab plan --world-size 1 --gpu GPU`` of the ``fsdp2`` row, without
  and with full activation checkpointing: its predicted tokens/s, tracked peak and reserved bytes.

Tokens/s: the median of the rates of the step records whose window (the steps since the record
before) lies after ``--warmup``: each step's for the plain loop and the every-step rows, each 10
steps' for the ``-log10`` rows (a record's tokens over the device time since the record before).
MFU = tokens/s x (6 N + 12 L H D S) / peak FLOP/s (N: every parameter once, so the tied
embedding counts as the LM head's matmul; L layers, H heads of D dims, S tokens a sequence), the
peak from ``--peak-tflops`` or the GPU's name (``fsdp2lab.bench.results.PEAK_FLOPS``, bf16); none
on CPU. Peak allocated and reserved: ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``
over the training steps (fsdp2lab's last step record, before its evaluation; on CPU, peak RSS).
``--device cpu`` runs every row on the CPU (tiny sizes only: how this script is tested).

``--profile DIR``: each ``fsdp2lab train`` row also records 3 steps with ``--profile`` (steps 7-9;
the trace is written after step 9's record, in step 10's time: all inside the default warm-up of
10 steps, which it needs), its trace in ``DIR/ROW/``, and ``DIR/kernels.txt`` gets
scripts/gpu_kernels.py's table of each trace.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
LORA = ["--lora-rank", "16", "--lora-dropout", "0"]
TRAIN_ROWS = {
    "fsdp2": [],
    "single": ["--strategy", "single"],
    "ac-full": ["--activation-checkpointing", "full"],
    "compile": ["--compile"],
    "lora": LORA,
    "qlora": [*LORA, "--quantize-base", "nf4"],
    "offload": ["--cpu-offload", "--max-grad-norm", "1.0"],
    "fsdp2-log10": [],
    "lora-log10": LORA,
}
LOG_EVERY = {name: 10 if name.endswith("-log10") else 1 for name in TRAIN_ROWS}  # step records
PROFILED_STEPS = 3  # --profile: steps 7-9 (after fsdp2lab's 5 and the profiler's warm-up step)
PLAIN_ROWS = {"plain": "foreach", "plain-fused": "fused"}
PLAN_ROWS = {"plan": [], "plan-ac": ["--activation-checkpointing", "full"]}
ROWS = (*TRAIN_ROWS, *PLAIN_ROWS, *PLAN_ROWS)
LABELS = {
    "fsdp2": "fsdp2lab FSDP2, 1 rank",
    "single": "fsdp2lab --strategy single",
    "ac-full": "fsdp2lab --activation-checkpointing full",
    "compile": "fsdp2lab --compile",
    "lora": "fsdp2lab --lora-rank 16",
    "qlora": "fsdp2lab --lora-rank 16 --quantize-base nf4",
    "offload": "fsdp2lab --cpu-offload --max-grad-norm 1.0",
    "fsdp2-log10": "fsdp2lab FSDP2, 1 rank, a step record every 10 steps",
    "lora-log10": "fsdp2lab --lora-rank 16, a step record every 10 steps",
    "plain": "plain loop (HF model, fp32 weights, bf16 autocast, AdamW foreach)",
    "plain-fused": "plain loop, AdamW fused",
    "plan": "fsdp2lab plan, no AC",
    "plan-ac": "fsdp2lab plan, full AC",
}


def llama_config(args: argparse.Namespace):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=max(args.seq_len, 2048),
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH")) if p)
    return env


def _run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env())
    if proc.returncode != 0:
        sys.exit(f"gpu_table: {' '.join(cmd)} exited {proc.returncode}\n{proc.stderr[-4000:]}")
    return proc.stdout


def train_flags(args: argparse.Namespace, folder: Path) -> list[str]:
    return ["--model", f"hf:{folder}", "--dataset", "synthetic",
            "--synthetic-size", str(args.synthetic_size), "--seq-len", str(args.seq_len),
            "--batch-size", str(args.batch_size), "--mixed-precision", "bf16",
            "--optimizer", "adamw", "--nproc-per-node", "1"]  # fmt: skip


def train_row(args: argparse.Namespace, folder: Path, work: Path, name: str) -> dict:
    """A ``fsdp2lab train`` row from its metrics file: the step records whose window lies after
    the warm-up; with ``--profile``, its trace in ``args.profile/name``."""
    metrics = work / f"{name}.jsonl"
    metrics.unlink(missing_ok=True)
    profile = []
    if args.profile:
        profile = ["--profile", str(Path(args.profile) / name),
                   "--profile-steps", str(PROFILED_STEPS)]  # fmt: skip
    _run([sys.executable, "-m", "fsdp2lab", "train", *train_flags(args, folder),
          "--device", args.device, "--max-steps", str(args.steps), "--log-every-steps",
          str(LOG_EVERY[name]), "--progress", "off", "--metrics-file", str(metrics), *profile,
          *TRAIN_ROWS[name]])  # fmt: skip
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in records if r["event"] == "step"]
    last = steps[-1]
    reserved = last.get("peak_reserved_bytes", [None])[0]
    return {"tokens_per_s": statistics.median(steady_rates(steps, args.warmup)),
            "peak_allocated_bytes": last["peak_memory_bytes"][0],
            "peak_reserved_bytes": reserved}  # fmt: skip


def steady_rates(steps: list[dict], warmup: int) -> list[float]:
    """The tokens/s of the step records whose window, the steps since the record before (the
    first: since step 0), lies after step ``warmup``."""
    starts = [0, *(r["step"] for r in steps[:-1])]
    return [r["tokens_per_s"] for r, start in zip(steps, starts, strict=True) if start >= warmup]


def plan_row(args: argparse.Namespace, folder: Path, name: str) -> dict:
    out = _run([sys.executable, "-m", "fsdp2lab", "plan", "--world-size", "1", "--gpu", args.gpu,
                "--json", *train_flags(args, folder), *PLAN_ROWS[name]])  # fmt: skip
    report = json.loads(out)
    return {
        "tokens_per_s": report["tokens_per_s_per_gpu"],
        "peak_allocated_bytes": report["peak_bytes_per_rank"],
        "peak_reserved_bytes": report["reserved_bytes_per_rank"],
    }


def plain_row(args: argparse.Namespace, folder: Path, name: str) -> dict:
    cmd = [sys.executable, __file__, "--child", PLAIN_ROWS[name], "--folder", str(folder)]
    for key in ("device", "seq_len", "batch_size", "steps", "warmup"):
        cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    return json.loads(_run(cmd).splitlines()[-1])


def plain_step(folder, device, optimizer_kind: str, batch_size: int, seq_len: int):
    """The plain loop's step on a fresh HF model from ``folder`` (fp32 weights, initialised on
    ``device``, bf16 autocast, ``torch.optim.AdamW`` with ``optimizer_kind`` "fused" or
    "foreach"): a function that runs one step on random tokens."""
    import torch
    import torch.nn.functional as F
    import transformers

    torch.manual_seed(0)
    config = transformers.AutoConfig.from_pretrained(folder)
    with device:  # initialised where it trains
        model = transformers.AutoModelForCausalLM.from_config(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, **{optimizer_kind: True})
    vocab = config.vocab_size

    def step() -> None:
        tokens = torch.randint(vocab, (batch_size, seq_len + 1), device=device)
        x, y = tokens[:, :-1], tokens[:, 1:]
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(x).logits
        loss = F.cross_entropy(logits.reshape(-1, vocab).float(), y.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def plain_loop(args: argparse.Namespace) -> dict:
    """The plain loop (:func:`plain_step`), each step timed; this process's peaks."""
    import torch

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    step = plain_step(args.folder, device, args.child, args.batch_size, args.seq_len)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    tokens_per_step = args.batch_size * args.seq_len
    steady = [tokens_per_step / t for t in times[args.warmup :]]
    if cuda:
        allocated = torch.cuda.max_memory_allocated(device)
        reserved = torch.cuda.max_memory_reserved(device)
    else:
        import resource

        allocated, reserved = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, None
    return {"tokens_per_s": statistics.median(steady), "peak_allocated_bytes": allocated,
            "peak_reserved_bytes": reserved}  # fmt: skip


def flops_per_token(args: argparse.Namespace, config) -> float:
    """6 N + 12 L H D S, N counted on the meta device (tied weights once)."""
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())
    head_dim = args.hidden // args.heads
    return 6 * params + 12 * args.layers * args.heads * head_dim * args.seq_len


def peak_flops(args: argparse.Namespace) -> float | None:
    if args.peak_tflops:
        return args.peak_tflops * 1e12
    if args.device != "cuda":
        return None
    import torch

    from fsdp2lab.bench.results import PEAK_FLOPS

    name = torch.cuda.get_device_name()
    return next((p["bf16"] for gpu, p in PEAK_FLOPS.items() if gpu in name), None)


def write_kernel_tables(folder: Path, names: list[str]) -> None:
    """scripts/gpu_kernels.py's table of each profiled row's trace, in ``folder/kernels.txt``."""
    from gpu_kernels import kernel_table  # imports this script: here, not at the top

    tables = [kernel_table(folder / n / "rank0.pt.trace.json", LABELS[n]) for n in names]
    (folder / "kernels.txt").write_text("\n\n".join(tables) + "\n")
    print(f"gpu_table: kernel tables in {folder / 'kernels.txt'}", file=sys.stderr)


def table(rows: dict[str, dict]) -> str:
    def gib(b):
        return "-" if b is None else f"{b / 2**30:.1f}"

    lines = ["| row | tokens/s | MFU | peak allocated GiB | peak reserved GiB |",
             "|---|---:|---:|---:|---:|"]  # fmt: skip
    for name, r in rows.items():
        mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        lines.append(f"| {LABELS[name]} | {r['tokens_per_s']:,.0f} | {mfu} | "
                     f"{gib(r['peak_allocated_bytes'])} | {gib(r['peak_reserved_bytes'])} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=8192)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--synthetic-size", type=int, default=256)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10, help="steps left out of the medians")
    p.add_argument("--gpu", default="h200", help="the GPU fsdp2lab plan plans for")
    p.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak (for MFU)")
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument(
        "--profile", metavar="DIR", help="profile the train rows (traces and kernels.txt)"
    )
    p.add_argument("--child", choices=("foreach", "fused"), help=argparse.SUPPRESS)
    p.add_argument("--folder", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(plain_loop(args)))
        return 0
    names = [n for n in args.rows.split(",") if n]
    unknown = [n for n in names if n not in ROWS]
    if unknown or not 0 <= args.warmup < args.steps:
        p.error(f"unknown rows {unknown}" if unknown else "--warmup must be below --steps")
    every = max((LOG_EVERY[n] for n in names if n in TRAIN_ROWS), default=1)
    if -(-args.warmup // every) * every >= args.steps:  # the first record after the warm-up's
        p.error(f"a step record every {every} steps leaves none after --warmup {args.warmup} "
                f"in --steps {args.steps}")  # fmt: skip
    if "qlora" in names and importlib.util.find_spec("torchao") is None:
        p.error("the qlora row needs torchao: pip install -e '.[qlora]', or leave it out of --rows")
    if args.profile and args.warmup < 10:
        p.error("--profile records steps 7-9 and writes its trace in step 10's time: --warmup "
                "must be at least 10")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="gpu_table.") as tmp:
        work = Path(tmp)
        folder = work / "llama"
        config = llama_config(args)
        config.save_pretrained(folder)
        per_token, peak = flops_per_token(args, config), peak_flops(args)
        rows = {}
        for name in names:
            if name in TRAIN_ROWS:
                row = train_row(args, folder, work, name)
            elif name in PLAIN_ROWS:
                row = plain_row(args, folder, name)
            else:
                row = plan_row(args, folder, name)
            row["mfu"] = row["tokens_per_s"] * per_token / peak if peak else None
            rows[name] = row
            print(f"gpu_table: {name}: {row['tokens_per_s']:,.0f} tokens/s", file=sys.stderr)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.profile:
        write_kernel_tables(Path(args.profile), [n for n in names if n in TRAIN_ROWS])
    return 0


if __name__ == "__main__":
    sys.exit(main())
