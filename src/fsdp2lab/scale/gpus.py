"""Accelerators a plan can target: memory, peak dense bf16 compute, and what the time model takes
a GPU to achieve: its matmul rate, copy bandwidth, NCCL bandwidth within a node, attention's
share of the peak and the host's launch time.

The peak and the memory are the vendor's datasheet values (dense, i.e. without 2:4 sparsity);
every achieved figure is a published microbenchmark's (or, for the H200, measured on one), with
its source and the figure quoted beside it, and none is fitted to a training run. Where no
figure is published, the comment says "uncharacterized" and what stands in. ``hbm_gib`` is the
memory the driver reports (what the allocator can use plus the CUDA context), in GiB.
``intra_node_gbs`` is NCCL's bus bandwidth, the bytes one GPU's ring collective puts on the wire
per second in one direction. Bandwidth between nodes is no property of a GPU: ``fsdp2lab plan
--inter-node-gbs`` (default :data:`DEFAULT_INTER_NODE_GBS`).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from fsdp2lab.errors import UsageError

# Matmul rates. MSMF (Maximum Sustainable Matmul FLOPS), the rate a bf16 matmul holds with the
# GPU saturated at its power limit, is what a training step sees; MAMF, the best short burst at
# the boost clock, is 15-20% higher. Stas Bekman's ml-engineering, branch fast-mamf (commit
# 082816f), compute/accelerator/benchmarks/README.md, mamf-finder.py on all 8 GPUs of a node at
# once (as a training run keeps them): H200 "All 8 GPUs x 5 rounds (n=40) | 698.6" (MAMF 823.9),
# B200 "1426.4" (MAMF 1751.2). The H100 SXM is the H200's chip at the same 700 W ("H200 is the
# same", its MAMF table): the H200's MSMF. No MSMF is published for A100 and MI300X: their
# MAMF (compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS comparison table": A100
# SXM 271.2, MI300X 668.4), a burst rate, the sustained one uncharacterized.
H100_MSMF = 698.6
B200_MSMF = 1426.4
A100_MAMF = 271.2
MI300X_MAMF = 668.4
# Flash attention's share of the peak on the A100, where no curve is taken in: FlashAttention-2
# (Dao, 2023, arXiv:2307.08691) "reaching 50-73% of the theoretical maximum FLOPs/s on A100"
# (the middle of that range here).
AMPERE_ATTENTION = (0.50 + 0.73) / 2
# FlashAttention-2's speed on an H100 80GB SXM5 (torch's flash kernel is FlashAttention-2), bf16,
# batch x sequence 16k tokens, hidden 2048: FlashAttention-3's paper (arXiv:2407.08608v2), Figure 5
# (forward) and Figure 6 (backward), the TFLOP/s labelled on the FlashAttention-2 bars at
# sequence lengths 512, 1k, 2k, 4k, 8k and 16k. The FLOPs are counted as here: a causal mask
# halves them, backward is 2.5 times forward. Published per direction and mask: head dimension
# -> TFLOP/s. Not published: backward at head dimension 256 and backward causal (the nearest
# published head dimension, and the unmasked curve, stand in). The H100s take these shares of
# their peak; so do the B200 and the MI300X, for which no curve is published (uncharacterized).
# The H200 (measured), the A100s and the RTX 4090 take one share.
FA2_H100_SEQ_LENS = (512, 1024, 2048, 4096, 8192, 16384)
FA2_H100_TFLOPS = {
    "forward": {
        64: (282, 306, 318, 321, 322, 324),
        128: (309, 350, 362, 368, 370, 370),
        256: (275, 313, 321, 323, 324, 326),
    },
    "forward causal": {
        64: (180, 229, 262, 284, 295, 299),
        128: (191, 260, 298, 319, 333, 335),
        256: (208, 251, 278, 293, 297, 298),
    },
    "backward": {
        64: (198, 238, 264, 279, 287, 291),
        128: (214, 260, 291, 310, 318, 322),
    },
}
H100_SXM_BF16_TFLOPS = 989.0


@dataclass(frozen=True)
class AttentionCurve:
    """An attention kernel's published speed by direction, mask, head dimension and sequence
    length, as a share of the peak of the GPU it was measured on."""

    seq_lens: tuple[int, ...]
    tflops: dict[str, dict[int, tuple[float, ...]]]  # "forward", "forward causal", "backward" ...
    peak_tflops: float

    def share(self, backward: bool, causal: bool, head_dim: int, seq_len: int) -> float:
        """The share of the peak at ``seq_len`` (interpolated in log2 between the published
        lengths, held at the ends), at the nearest published head dimension; a direction and mask
        not published take the same direction unmasked."""
        direction = "backward" if backward else "forward"
        by_dim = self.tflops.get(f"{direction} causal" if causal else direction)
        by_dim = by_dim or self.tflops[direction]
        points = by_dim[min(by_dim, key=lambda d: (abs(math.log2(d / max(head_dim, 1))), d))]
        x = math.log2(min(max(seq_len, self.seq_lens[0]), self.seq_lens[-1]))
        xs = [math.log2(n) for n in self.seq_lens]
        i = min(bisect.bisect_right(xs, x), len(xs) - 1)
        lo, hi = max(i - 1, 0), i
        t = 0.0 if hi == lo else (x - xs[lo]) / (xs[hi] - xs[lo])
        return (points[lo] + t * (points[hi] - points[lo])) / self.peak_tflops


FA2_ON_H100 = AttentionCurve(FA2_H100_SEQ_LENS, FA2_H100_TFLOPS, H100_SXM_BF16_TFLOPS)
# A matmul computes its output in tiles; a wave is one tile per SM. cuBLAS's and CUTLASS's bf16
# kernels on Ampere and Hopper use 128 x 128 output tiles or larger.
MATMUL_TILE = (128, 128)
# The host's time to issue one op in eager PyTorch (dispatcher, autograd, the CUDA launch):
# uncharacterized, no published figure (the H200 here measured 9.4 us).
LAUNCH_S = 10e-6
# Achieved copy bandwidth over the datasheet's: an H100 SXM's device-to-device copy, "Device to
# Device (D2D) | 2903.4" GB/s of 3,350 (Voltage Park's 8x H100 node,
# https://github.com/ZiyanIshani/vpbenchmarking, results/stream_nvbench/stream_nvbench_summary.md;
# the H200 here measured 4.25 of 4.8 TB/s, 0.885). Taken for every GPU whose own achieved copy
# rate is unpublished (all but the H200, measured).
COPY_SHARE = 2903.4 / 3350
# NCCL's bus bandwidth within a node (ring all-gather and reduce-scatter, what the wire carries
# per GPU and direction), ml-engineering network/README.md (commit 744d01e): 8x H200, NVLink 4,
# 16 GiB, "all-gather | Ring | 361.4GBps", "reduce-scatter | Ring | 362.9GBps" of the 450 line
# rate (their mean here; the same NVLink 4 on every H100); 8x A100, NVLink 3, "234.89GBps" of
# 300. NCCL's maintainer: "450GB/s is the line rate. With the protocol overhead (~20%) NCCL can
# get an effective NVLink bandwidth of 370GB/s" (https://github.com/NVIDIA/nccl-tests/issues/212).
# No ring figure is published for B200 (NVLink 5) and MI300X (Infinity Fabric): their line
# rate, the achieved one uncharacterized.
NVLINK4_BUS_GBS = (361.4 + 362.9) / 2
NVLINK3_BUS_GBS = 234.89

# The 96 GB H100 of torchtitan's benchmarks ran capped at 500 W; no sustained matmul rate is
# published at that cap (uncharacterized): the SXM's MSMF, scaled to the middle of the peak range
# torchtitan gives for it (between the SXM's 989 and the NVL's 835 TFLOPS dense,
# https://www.nvidia.com/en-us/data-center/h100/).
H100_96GB_MSMF = H100_MSMF * (989.0 + 835.0) / 2 / 989.0

# One 400 Gb/s NIC (InfiniBand NDR / 400G RoCE) per GPU, as in DGX H100 / H200 / B200 nodes:
# 50 GB/s per direction. https://docs.nvidia.com/dgx/dgxh100-user-guide/introduction-to-dgxh100.html
# NCCL's achieved share of it is uncharacterized: the one published conversion (ml-engineering
# network/README.md, 4 nodes of 8 B200, all-reduce: 36.95 of 50 GB/s per GPU) is, it says, a
# floor whose value does not carry to another system. The line rate.
DEFAULT_INTER_NODE_GBS = 50.0

# Copies between host and GPU (``--cpu-offload``): a PCIe x16 link's line rate per direction
# (PCIe 5.0: 32 GT/s x 16 lanes, 128b/130b: 63.0 GB/s; PCIe 4.0: 31.5), and the share of it that
# pinned copies achieve, measured on an H100 SXM node: "Host to Device (H2D) | 54.8", "Device to
# Host (D2H) | 46.8" GB/s of "PCIe 5.0 x16 (63 GB/s theoretical)" (Voltage Park, the source of
# COPY_SHARE: results/stream_nvbench/stream_nvbench_summary.md, the peak over transfer sizes, as
# its D2D figure; its D2H falls to 20.5 GB/s above 2 MB, which it puts down to pinned memory on
# the other NUMA node). Taken for every GPU, at its own PCIe generation's line rate.
PCIE5_X16_GBS = 63.0
PCIE4_X16_GBS = 31.5
H2D_SHARE = 54.8 / 63.0
D2H_SHARE = 46.8 / 63.0
# The host's memory bandwidth, which an optimizer stepping on the host (``--cpu-offload``) is
# bound by: STREAM Triad on the same H100 node's two Xeon Platinum 8470, "Triad | 486.7" GB/s
# (same file), shared by the node's ranks. The H100 and H200 nodes of HGX boards carry such
# two-socket hosts: that figure for them; for the others' hosts it is uncharacterized (None),
# and a plan leaves the host's step out of their time and says so.
HOPPER_NODE_HOST_GBS = 486.7


@dataclass(frozen=True)
class GPU:
    name: str
    description: str
    hbm_gib: float
    bf16_tflops: float  # peak dense bf16 tensor-core TFLOP/s (the datasheet's; MFU's divisor)
    hbm_tbs: float  # achieved copy bandwidth, TB/s
    intra_node_gbs: float  # NCCL's bus bandwidth to the node's other GPUs, GB/s per direction
    sms: int  # streaming multiprocessors (compute units)
    mamf_tflops: float  # the matmul rate a step sees, bf16 TFLOP/s (sustained where published)
    # flash attention's achieved share of the peak bf16 FLOP/s: one share, or a published curve
    attention: float | AttentionCurve
    tile: tuple[int, int] = MATMUL_TILE  # a matmul's output tile: (1, 1) where there are no waves
    launch_s: float = LAUNCH_S  # the host's time to issue one op
    pcie_gbs: float | None = None  # its host link's line rate per direction, GB/s
    host_memory_gbs: float | None = None  # its node's host memory bandwidth, GB/s (None: unknown)
    # The host thread that issues a kernel runs it (a CPU): no op overlaps another, and a step
    # takes the sum of every op's launch and run.
    host_runs_kernels: bool = False


GPUS: dict[str, GPU] = {
    g.name: g
    for g in (
        # https://www.nvidia.com/en-us/data-center/h100/ (H100 SXM: 80 GB, 1,979 TFLOPS bf16
        # with sparsity = 989 dense, 3.35 TB/s, NVLink 900 GB/s both directions, "PCIe Gen5:
        # 128GB/s" both directions)
        GPU(
            "h100",
            "NVIDIA H100 SXM 80 GB",
            79.6,
            989.0,
            3.35 * COPY_SHARE,
            NVLINK4_BUS_GBS,
            132,
            H100_MSMF,
            FA2_ON_H100,
            pcie_gbs=PCIE5_X16_GBS,
            host_memory_gbs=HOPPER_NODE_HOST_GBS,
        ),
        # The 96 GB HBM2e SXM H100 of torchtitan's benchmarks
        # (https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md:
        # "96GB HBM2e with 2.4 TB/sec peak memory bandwidth", NVLink, 500 W); torchtitan's MFU
        # takes the SXM's 989 TFLOPS for it (its true peak, it says, lies between SXM and NVL);
        # Hopper's PCIe 5.0.
        GPU(
            "h100-96gb",
            "NVIDIA H100 96 GB HBM2e",
            94.5,
            989.0,
            2.4 * COPY_SHARE,
            NVLINK4_BUS_GBS,
            132,
            H100_96GB_MSMF,
            FA2_ON_H100,
            pcie_gbs=PCIE5_X16_GBS,
            host_memory_gbs=HOPPER_NODE_HOST_GBS,
        ),
        # https://www.nvidia.com/en-us/data-center/h200/ (141 GB, 989 TFLOPS bf16 dense,
        # 4.8 TB/s, NVLink 900 GB/s, "PCIe Gen5: 128GB/s"). Measured on one (700 W, torch
        # 2.11.0+cu130) by scripts/gpu_constants.py after 15 s of matmuls: matmuls at up to
        # 682.6 TFLOP/s at the models' shapes (MSMF 698.6), copies at 4.25 TB/s, causal flash
        # attention at 42% of the peak, an op launched in 9.4 us.
        GPU(
            "h200",
            "NVIDIA H200 SXM 141 GB",
            140.4,
            989.0,
            4.25,
            NVLINK4_BUS_GBS,
            132,
            682.6,
            0.42,
            launch_s=9.4e-6,
            pcie_gbs=PCIE5_X16_GBS,
            host_memory_gbs=HOPPER_NODE_HOST_GBS,
        ),
        # https://www.nvidia.com/en-us/data-center/hgx/ (HGX B200: 8 GPUs, 1.4 TB memory,
        # 18 PFLOPS fp16/bf16 with sparsity = 2.25 dense per GPU, 62 TB/s HBM = 7.7 per GPU,
        # NVLink 5: 1.8 TB/s per GPU both directions; PCIe 5.0 to the host)
        GPU(
            "b200",
            "NVIDIA B200 180 GB",
            178.4,
            2250.0,
            7.7 * COPY_SHARE,
            900.0,
            148,
            B200_MSMF,
            FA2_ON_H100,
            pcie_gbs=PCIE5_X16_GBS,
        ),
        # https://www.nvidia.com/en-us/data-center/a100/ (A100 40 GB SXM: 312 TFLOPS bf16 dense,
        # 1,555 GB/s; 80 GB SXM: 2,039 GB/s; NVLink 600 GB/s; "PCIe Gen4: 64 GB/s")
        GPU(
            "a100-40gb",
            "NVIDIA A100 SXM 40 GB",
            39.4,
            312.0,
            1.555 * COPY_SHARE,
            NVLINK3_BUS_GBS,
            108,
            A100_MAMF,
            AMPERE_ATTENTION,
            pcie_gbs=PCIE4_X16_GBS,
        ),
        GPU(
            "a100",
            "NVIDIA A100 SXM 80 GB",
            79.2,
            312.0,
            2.039 * COPY_SHARE,
            NVLINK3_BUS_GBS,
            108,
            A100_MAMF,
            AMPERE_ATTENTION,
            pcie_gbs=PCIE4_X16_GBS,
        ),
        # https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html (192 GB HBM3,
        # 1,307.4 TFLOPS bf16 dense, 5.3 TB/s, 896 GB/s Infinity Fabric peer bandwidth, PCIe 5.0
        # x16 to the host)
        GPU(
            "mi300x",
            "AMD Instinct MI300X 192 GB",
            191.5,
            1307.4,
            5.3 * COPY_SHARE,
            448.0,
            304,
            MI300X_MAMF,
            FA2_ON_H100,
            pcie_gbs=PCIE5_X16_GBS,
        ),
        # A 24 GB consumer GPU (Answer.AI's FSDP-QLoRA trains a 70B on two 24 GB gaming GPUs,
        # https://www.answer.ai/posts/2024-03-06-fsdp-qlora.html): NVIDIA Ada GPU Architecture
        # whitepaper, Appendix A, GeForce RTX 4090: 128 SMs, 24 GB GDDR6X (the driver
        # reports 24,564 MiB), 1,008 GB/s, "Peak BF16 Tensor TFLOPS with FP32 Accumulate
        # 165.2/330.4" (dense/sparse), PCIe 4.0 x16, no NVLink. Uncharacterized, with what
        # stands in: its sustained matmul rate (the peak), flash attention's share (Ampere's,
        # whose FlashAttention-2 kernels it runs), NCCL between two of them (through the host
        # over PCIe: the PCIe 4.0 x16 line rate), its host's memory bandwidth (none: a desktop's).
        GPU(
            "rtx4090",
            "NVIDIA GeForce RTX 4090 24 GB",
            24564 / 1024,
            165.2,
            1.008 * COPY_SHARE,
            PCIE4_X16_GBS,
            128,
            165.2,
            AMPERE_ATTENTION,
            pcie_gbs=PCIE4_X16_GBS,
        ),
    )
}


def get_gpu(name: str) -> GPU:
    key = name.strip().lower()
    if key not in GPUS:
        raise UsageError(f"--gpu {name!r} is not in the table; choose one of: {', '.join(GPUS)}")
    return GPUS[key]
