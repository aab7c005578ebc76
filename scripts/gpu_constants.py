"""Measure the time model's constants (src/fsdp2lab/scale/gpus.py) on the GPU at hand.

    PYTHONPATH=src python scripts/gpu_constants.py --json constants.json

The GPU first runs large matmuls for ``--warmup-s`` seconds, so that its clocks settle where a
training run keeps them (a short burst runs at boost clocks a long run does not hold). Each
figure is then a median of ``--repeats`` runs, each timed by CUDA events over ``--iters`` back to
back calls after ``--warmup`` untimed ones:

* ``mamf_tflops``: the best bf16 matmul TFLOP/s over square and transformer-shaped matmuls
  (torch.mm), and each shape's own rate (``matmul_shapes``: what a shape-dependent model can be
  checked against);
* ``hbm_tbs``: a large device-to-device copy's bytes read and written per second;
* ``attention``: causal flash attention forward and backward
  (``scaled_dot_product_attention``, bf16) at half its counted FLOPs, over the dense peak;
* ``launch_s``: the host's time to issue one small elementwise op (the GPU idle, kernels queued).

The table's published figures stay until replaced by these with the GPU named beside them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = [  # (m, n, k): square, and a Llama layer's at 8,192 and 16,384 tokens
    (8192, 8192, 8192),
    (16384, 4096, 4096),
    (16384, 14336, 4096),
    (16384, 4096, 14336),
    (16384, 1024, 4096),
    (8192, 2048, 2048),
    (8192, 8192, 2048),
    (8192, 2048, 8192),
    (8192, 128256, 2048),
]


def timed(fn, iters: int, repeats: int, warmup: int) -> float:
    """Median seconds per call of ``fn``."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / iters)
    return statistics.median(samples)


def settle_clocks(seconds: float) -> None:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(20):
            torch.mm(a, a)
        torch.cuda.synchronize()


def matmuls(args) -> dict:
    rates = {}
    for m, n, k in SHAPES:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        seconds = timed(lambda a=a, b=b: torch.mm(a, b), args.iters, args.repeats, args.warmup)
        rates[f"{m}x{n}x{k}"] = 2 * m * n * k / seconds / 1e12
        del a, b
    return rates


def bandwidth(args) -> float:
    src = torch.empty(1 << 30, device="cuda", dtype=torch.uint8)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), args.iters, args.repeats, args.warmup)
    return 2 * src.numel() / seconds / 1e12


def attention(args, peak_tflops: float) -> float:
    b, h, s, d = 2, 32, 8192, 128
    q, k, v = (
        torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    grad = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)

    def step():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(grad)

    seconds = timed(step, max(1, args.iters // 10), args.repeats, args.warmup)
    counted = 4 * b * h * s * s * d * (1 + 2)  # forward, backward twice it
    return counted / 2 / seconds / (peak_tflops * 1e12)


def launch(args) -> float:
    x = torch.zeros(16, device="cuda")
    torch.cuda.synchronize()
    n = 20_000
    start = time.perf_counter()
    for _ in range(n):
        x.add_(1)
    host = (time.perf_counter() - start) / n
    torch.cuda.synchronize()
    return host


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peak-tflops", type=float, default=989.0, help="the datasheet's dense bf16")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--warmup-s", type=float, default=30.0, help="seconds of matmuls first")
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args()
    settle_clocks(args.warmup_s)
    shapes = matmuls(args)
    out = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "mamf_tflops": max(shapes.values()),
        "matmul_shapes": shapes,
        "hbm_tbs": bandwidth(args),
        "attention": attention(args, args.peak_tflops),
        "launch_s": launch(args),
    }
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
