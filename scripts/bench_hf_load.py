"""How cheap loading a pretrained Hugging Face folder is: memory and speed of ``--model hf:PATH``.

    python scripts/bench_hf_load.py FOLDER [--nproc 2] [--drop-caches] [--reader auto|slices]
                                           [--json OUT.json]
    python scripts/bench_hf_load.py FOLDER --make-llama [--hidden 2048 --layers 8 ...]

In one run: (1) the raw sequential read speed of the folder's safetensors files (16 MiB reads);
(2) ``--nproc`` ranks (torchrun, gloo, CPU) that build the model on meta, shard it with FSDP2
(one unit per decoder layer), materialise it and read the weights (what ``fsdp2lab train`` does),
each sampling its anonymous memory (``RssAnon``) every millisecond from before the shards are
allocated. ``--drop-caches`` (root) empties the page cache before each read, so both read from
disk. ``--make-llama`` first saves a bf16 Llama of the given sizes into FOLDER (the defaults:
~1.1 GiB of weights).

Reported per rank: the peak RssAnon growth against its bound, fp32 shard x 1.2 + the largest
tensor (fp32); and the load's speed (file bytes / the slowest rank's load time) against the raw
read speed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

BLOCK = 16 << 20


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def weight_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def raw_read_speed(folder: Path) -> tuple[int, float]:
    """(bytes, seconds) reading every safetensors file once, sequentially."""
    buffer = bytearray(BLOCK)
    view = memoryview(buffer)
    total = 0
    start = time.perf_counter()
    for file in weight_files(folder):
        with open(file, "rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    return total, time.perf_counter() - start


def make_llama(folder: Path, hidden: int, layers: int, intermediate: int, vocab: int) -> None:
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
        max_position_embeddings=2048, tie_word_embeddings=False,
    )  # fmt: skip
    with torch.device("cpu"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="500MB")


class PeakSampler:
    """The highest RssAnon seen, sampled every millisecond on a thread."""

    def __init__(self):
        self.peak = rss_anon()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_anon())
            time.sleep(0.001)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, rss_anon())


def worker(folder: Path, out: Path, reader: str) -> None:
    """One rank: build, shard, materialise, read; write its figures to OUT/rank<R>.json."""
    import copy

    if reader == "slices":  # safetensors' get_slice, as where DCP's reader reads whole files
        from fsdp2lab.models import hf_weights

        hf_weights.hf_storage_reader = lambda: None

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from fsdp2lab.config import TrainConfig
    from fsdp2lab.models.materialize import to_empty
    from fsdp2lab.plan import resolve
    from fsdp2lab.runtime.mesh import build_mesh

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = TrainConfig(model=f"hf:{folder}", seq_len=16, fsdp_units="layer", device="cpu")
    plan = resolve(cfg, world)
    mesh = build_mesh(plan.dims, "cpu")
    device = torch.device("cpu")
    model = plan.strategy.parallelize(copy.deepcopy(plan.meta_model), plan, mesh, device)
    largest = max(p.numel() for p in plan.meta_model.parameters()) * 4
    dist.barrier()
    before = rss_anon()
    sampler = PeakSampler()
    start = time.perf_counter()
    to_empty(model, device)
    plan.spec.load_weights(model, plan.meta_model)
    dist.barrier()
    seconds = time.perf_counter() - start
    peak = sampler.stop()
    shard = sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() * 4 for p in model.parameters()
    )
    figures = {
        "rank": rank,
        "load_s": seconds,
        "rss_anon_growth": peak - before,
        "fp32_shard": shard,
        "largest_tensor_fp32": largest,
        "bound": 1.2 * shard + largest,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(figures))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--drop-caches", action="store_true", help="root: before each read")
    parser.add_argument("--json", type=Path, help="also write the report here")
    parser.add_argument(
        "--reader",
        choices=("auto", "slices"),
        default="auto",
        help="auto: as training reads (DCP's reader where it reads slices); slices: get_slice",
    )
    parser.add_argument("--make-llama", action="store_true")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        from fsdp2lab.runtime.distributed import exit_process

        worker(args.folder, args.worker, args.reader)
        exit_process(0)  # a rank: no interpreter teardown beside gloo's threads
    if args.make_llama:
        make_llama(args.folder, args.hidden, args.layers, args.intermediate, args.vocab)
    if args.drop_caches:
        drop_caches()
    nbytes, raw_s = raw_read_speed(args.folder)
    if args.drop_caches:
        drop_caches()
    out = args.json.parent if args.json else Path.cwd()
    ranks_dir = out / "bench_hf_load.ranks"
    ranks_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={args.nproc}", __file__, str(args.folder), "--worker",
           str(ranks_dir), "--reader", args.reader]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    subprocess.run(cmd, check=True, env=env)
    ranks = [json.loads((ranks_dir / f"rank{r}.json").read_text()) for r in range(args.nproc)]
    load_s = max(r["load_s"] for r in ranks)
    report = {
        "folder": str(args.folder),
        "file_bytes": nbytes,
        "page_cache_dropped": args.drop_caches,
        "reader": args.reader,
        "raw_read_s": raw_s,
        "raw_read_gb_s": nbytes / raw_s / 1e9,
        "load_s": load_s,
        "load_gb_s": nbytes / load_s / 1e9,
        "load_over_raw": raw_s / load_s,
        "ranks": ranks,
        "memory_within_bound": all(r["rss_anon_growth"] <= r["bound"] for r in ranks),
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"{nbytes / 2**30:.2f} GiB of safetensors: raw read {report['raw_read_gb_s']:.2f} GB/s, "
        f"load on {args.nproc} ranks {report['load_gb_s']:.2f} GB/s "
        f"({100 * report['load_over_raw']:.0f}% of raw; page cache "
        f"{'dropped' if args.drop_caches else 'kept'})"
    )
    for r in ranks:
        print(
            f"rank {r['rank']}: RssAnon growth {r['rss_anon_growth'] / 2**20:,.0f} MiB, bound "
            f"{r['bound'] / 2**20:,.0f} MiB (fp32 shard {r['fp32_shard'] / 2**20:,.0f} MiB x 1.2 "
            f"+ largest tensor {r['largest_tensor_fp32'] / 2**20:,.0f} MiB)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
