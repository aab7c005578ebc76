"""Where a step's GPU time goes, kernel by kernel: fsdp2lab's FSDP2, its LoRA and the plain loop.

    PYTHONPATH=src python scripts/gpu_kernels.py --layers 4 --out kernels.txt   # needs transformers

The model and flags are scripts/gpu_table.py's (the Llama-3.2-1B shape, here with ``--layers``
of its 16 layers). ``fsdp2lab train --profile`` records 3 steps of the ``fsdp2`` and ``lora``
rows, and torch's profiler 3 steps of the plain loop (fused AdamW). For each, from its trace:
the host's step, the kernels a step launches, their summed time and the GPU's busy time (the
union of the kernels' intervals), then the 40 kernels (and copies) of most time, each with its
time and count a step. The profiler adds a few microseconds to each kernel: take step times
from scripts/gpu_table.py, and the split between kernels from here. ``--device cpu`` runs a tiny
model on the CPU (its traces hold no kernels: how the script is tested).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_table  # noqa: E402

ROWS = {"fsdp2": [], "lora": gpu_table.TRAIN_ROWS["lora"]}
TINY = dict(vocab=512, hidden=64, intermediate=128, heads=4, kv_heads=2, seq_len=64)
FULL = dict(vocab=128256, hidden=2048, intermediate=8192, heads=32, kv_heads=8, seq_len=2048)


def kernel_table(trace: Path, label: str, top: int = 40) -> str:
    """A trace's steps: host time, kernels, GPU time; the ``top`` kernels by time a step."""
    events = json.loads(trace.read_text())["traceEvents"]
    # CUDA traces repeat each ProfilerStep on the GPU's lane (gpu_user_annotation): host's only.
    steps = [e for e in events if e.get("name", "").startswith("ProfilerStep#")
             and e.get("cat") in ("user_annotation", "cpu_op", "python_function")]  # fmt: skip
    n = max(1, len({e["name"] for e in steps}))
    host_ms = sum(e["dur"] for e in steps) / n / 1e3
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    by_name = collections.defaultdict(lambda: [0.0, 0])
    for e in kernels:
        entry = by_name[f"{e['cat'][:4]} {e['name'][:110]}"]
        entry[0] += e["dur"]
        entry[1] += 1
    busy, end = 0.0, float("-inf")
    for start, stop in sorted((e["ts"], e["ts"] + e["dur"]) for e in kernels):
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    lines = [f"=== {label}: {n} steps; a step: host {host_ms:.2f} ms, {len(kernels) / n:.0f} "
             f"kernels, kernel time {sum(e['dur'] for e in kernels) / n / 1e3:.2f} ms, GPU busy "
             f"{busy / n / 1e3:.2f} ms"]  # fmt: skip
    for name, (dur, count) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"{dur / n / 1e3:9.3f} ms {count / n:7.1f}x  {name}")
    return "\n".join(lines)


def fsdp2lab_trace(args, folder: Path, work: Path, name: str) -> Path:
    out = work / name
    gpu_table._run([sys.executable, "-m", "fsdp2lab", "train", *gpu_table.train_flags(args, folder),
                    "--device", args.device, "--max-steps", "10", "--log-every-steps", "5",
                    "--progress", "off", "--profile", str(out), "--profile-steps", "3",
                    *ROWS[name]])  # fmt: skip
    return out / "rank0.pt.trace.json"


def plain_trace(args, folder: Path, work: Path) -> Path:
    """The plain loop of scripts/gpu_table.py (fused AdamW), 3 steps profiled after 6."""
    import torch

    device = torch.device(args.device)
    step = gpu_table.plain_step(folder, device, "fused", args.batch_size, args.seq_len)
    for _ in range(5):
        step()
    path = work / "plain.pt.trace.json"
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=3, repeat=1)
    with torch.profiler.profile(activities=activities, schedule=schedule,
                                on_trace_ready=lambda p: p.export_chrome_trace(str(path))) as prof:  # fmt: skip
        for _ in range(4):
            step()
            prof.step()
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--out", help="also write the tables to this file")
    args = p.parse_args(argv)
    for key, value in (FULL if args.device == "cuda" else TINY).items():
        setattr(args, key, value)
    args.batch_size, args.synthetic_size = 4, 256
    with tempfile.TemporaryDirectory(prefix="gpu_kernels.") as tmp:
        work = Path(tmp)
        folder = work / "llama"
        gpu_table.llama_config(args).save_pretrained(folder)
        tables = [
            kernel_table(fsdp2lab_trace(args, folder, work, n), f"fsdp2lab {n}") for n in ROWS
        ]
        tables.append(kernel_table(plain_trace(args, folder, work), "plain loop, AdamW fused"))
    text = "\n\n".join(tables)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
