"""Peak memory of one GPT training step with activation checkpointing none / full / selective / op (CPU).

Every mode runs ``--repeats`` times, each in a fresh process (one warm-up step, then measured
steps); the table shows medians. Three measures, from the most to the least exact:

* ``saved MiB``: bytes forward leaves for backward: the storages it creates that are still alive
  when it ends (what autograd saved, the inputs a checkpointed unit holds for its recompute, the
  outputs per-op AC keeps, the logits and the loss). The activation memory AC is about;
  deterministic.
* ``peak MiB``: peak bytes of live tensors created during forward + backward + optimizer step
  (a ``TorchDispatchMode`` adds each new storage's size and a finalizer takes it off): what
  ``torch.cuda.max_memory_allocated`` would count on a GPU, less what existed before the step.
* ``rss MiB``: process peak RSS during the step minus RSS before it (``/proc/self/clear_refs``
  resets the high-water mark; glibc is told to return big blocks to the OS at once). Includes
  allocator slack; noisier.
* ``step s``: wall time of the step without the trackers (a shared machine: rough).

    OMP_NUM_THREADS=1 PYTHONPATH=src python scripts/ac_memory.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import weakref

MODES = ("none", "full", "selective", "op")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def child(args: argparse.Namespace) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from fsdp2lab.models.gpt import GPT, GPTConfig
    from fsdp2lab.parallel.activation_checkpoint import apply_activation_checkpointing

    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=256,
        seq_len=args.seq,
        n_layers=args.layers,
        d_model=args.d_model,
        n_heads=args.heads,
        dropout=0.0,
    )
    model = GPT(cfg)
    units = [f"blocks.{i}" for i in range(cfg.n_layers)]
    apply_activation_checkpointing(model, units, args.child)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len + 1))

    def forward() -> torch.Tensor:
        logits = model(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        forward().backward()
        opt.step()

    step()  # warm-up: Adam state exists from here on

    # 1. wall time and peak RSS, no trackers
    rss_before = _rss_bytes()
    can_reset = _reset_peak_rss()
    t0 = time.perf_counter()
    step()
    seconds = time.perf_counter() - t0
    rss_peak = _peak_rss_bytes() if can_reset else None

    class LiveBytes(TorchDispatchMode):
        def __init__(self, ignore: frozenset[int] = frozenset()) -> None:
            super().__init__()
            self.ignore = ignore  # storages that existed before (their views are not new)
            self.live: dict[int, int] = {}
            self.now = self.peak = 0

        def _gone(self, ptr: int) -> None:
            self.now -= self.live.pop(ptr, 0)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    st = t.untyped_storage()
                    ptr = st.data_ptr()
                    if ptr and ptr not in self.live and ptr not in self.ignore:
                        self.live[ptr] = st.nbytes()
                        self.now += st.nbytes()
                        self.peak = max(self.peak, self.now)
                        weakref.finalize(st, self._gone, ptr)
            return out

    # 2. bytes forward leaves for backward: new storages still alive when it ends
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    before = frozenset(t.untyped_storage().data_ptr() for t in [*model.parameters(), *state])
    opt.zero_grad(set_to_none=True)
    with LiveBytes(before) as left:
        loss = forward()
    saved_bytes = left.now
    loss.backward()

    # 3. peak bytes of tensors created during a whole step
    with LiveBytes() as tracker:
        step()
    return {
        "saved": saved_bytes,
        "peak": tracker.peak,
        "rss": None if rss_peak is None else rss_peak - rss_before,
        "seconds": seconds,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return

    env = {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        # glibc: blocks of 64 KiB and more are mmap-ed and unmapped on free, so RSS follows use.
        "MALLOC_MMAP_THRESHOLD_": "65536",
    }
    sizes = ["--seq", args.seq, "--d-model", args.d_model, "--heads", args.heads]
    sizes = [str(a) for a in (*sizes, "--layers", args.layers, "--batch", args.batch)]
    results: dict[str, list[dict]] = {m: [] for m in args.modes}
    for _ in range(args.repeats):
        for mode in args.modes:  # interleaved, so that load from other jobs falls on all modes
            out = subprocess.run(
                [sys.executable, __file__, *sizes, "--child", mode],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            results[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))

    mib = 2**20
    print(
        f"gpt: batch {args.batch}, seq {args.seq}, d_model {args.d_model}, heads {args.heads}, "
        f"{args.layers} blocks, fp32, CPU; median of {args.repeats} fresh processes per mode"
    )
    print(f"{'mode':<10} {'saved MiB':>10} {'peak MiB':>10} {'rss MiB':>10} {'step s':>8}")
    for mode, runs in results.items():
        med = {key: _median([r[key] for r in runs]) for key in ("saved", "peak", "rss", "seconds")}
        print(
            f"{mode:<10} {med['saved'] / mib:>10.1f} {med['peak'] / mib:>10.1f} "
            f"{med['rss'] / mib:>10.1f} {med['seconds']:>8.2f}"
        )


def _median(values: list) -> float:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


if __name__ == "__main__":
    main()
