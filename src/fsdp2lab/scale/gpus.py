"""Accelerators a plan can target: memory, peak dense bf16 compute, memory and NVLink bandwidth.

Every figure is the vendor's public datasheet value (dense, i.e. without 2:4 sparsity), or a
published or measured microbenchmark's where the time model needs what a GPU achieves, with its
source beside it. ``hbm_gib`` is the memory the driver reports (what the allocator can use
plus the CUDA context), in GiB. ``intra_node_gbs`` is one GPU's bandwidth to its node's other
GPUs in one direction (the datasheets quote both directions together: half of it). Bandwidth
between nodes is no property of a GPU: ``fsdp2lab plan --inter-node-gbs`` (default
:data:`DEFAULT_INTER_NODE_GBS`).
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp2lab.errors import UsageError

# Maximum Achievable Matmul FLOPS: the best bf16 matmul TFLOP/s over many shapes, measured by
# mamf-finder.py, https://github.com/stas00/ml-engineering/blob/master/compute/accelerator/README.md
# ("Maximum Achievable Matmul FLOPS comparison table"): A100 SXM 271.2, H100 SXM 794.5 ("H200 is
# the same"), B200 SXM 1745.0, MI300X 668.4.
# Flash attention's share of the peak: FlashAttention-2 (Dao, 2023, arXiv:2307.08691) "reaching
# 50-73% of the theoretical maximum FLOPs/s on A100" (the middle of that range here), and only
# "35% utilization on H100" (FlashAttention-3, Shah et al., 2024, arXiv:2407.08608), torch's own
# flash kernel being FlashAttention-2; no figure is published for B200 and MI300X: Hopper's.
HOPPER_ATTENTION = 0.35
AMPERE_ATTENTION = (0.50 + 0.73) / 2
# A matmul computes its output in tiles; a wave is one tile per SM. cuBLAS's and CUTLASS's bf16
# kernels on Ampere and Hopper use 128 x 128 output tiles or larger.
MATMUL_TILE = (128, 128)
# The host's time to issue one op in eager PyTorch (dispatcher, autograd, the CUDA launch).
LAUNCH_S = 10e-6

H100_96GB_MAMF = 794.5 * (989.0 + 835.0) / 2 / 989.0

# One 400 Gb/s NIC (InfiniBand NDR / 400G RoCE) per GPU, as in DGX H100 / H200 / B200 nodes:
# 50 GB/s per direction. https://docs.nvidia.com/dgx/dgxh100-user-guide/introduction-to-dgxh100.html
DEFAULT_INTER_NODE_GBS = 50.0


@dataclass(frozen=True)
class GPU:
    name: str
    description: str
    hbm_gib: float
    bf16_tflops: float  # peak dense bf16 tensor-core TFLOP/s
    hbm_tbs: float  # memory bandwidth, TB/s
    intra_node_gbs: float  # to the node's other GPUs, GB/s per direction
    sms: int  # streaming multiprocessors (compute units)
    mamf_tflops: float  # maximum achievable matmul bf16 TFLOP/s (a microbenchmark, MAMF)
    attention_efficiency: float  # flash attention's achieved / peak bf16 FLOP/s
    tile: tuple[int, int] = MATMUL_TILE  # a matmul's output tile: (1, 1) where there are no waves
    launch_s: float = LAUNCH_S  # the host's time to issue one op
    # The host thread that issues a kernel runs it (a CPU): no op overlaps another, and a step
    # takes the sum of every op's launch and run.
    host_runs_kernels: bool = False


GPUS: dict[str, GPU] = {
    g.name: g
    for g in (
        # https://www.nvidia.com/en-us/data-center/h100/ (H100 SXM: 80 GB, 1,979 TFLOPS bf16
        # with sparsity = 989 dense, 3.35 TB/s, NVLink 900 GB/s both directions)
        GPU(
            "h100", "NVIDIA H100 SXM 80 GB", 79.6, 989.0, 3.35, 450.0, 132, 794.5, HOPPER_ATTENTION
        ),
        # The 96 GB HBM2e SXM H100 of torchtitan's benchmarks
        # (https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md:
        # "96GB HBM2e with 2.4 TB/sec peak memory bandwidth", NVLink, 500 W); torchtitan's MFU
        # takes the SXM's 989 TFLOPS for it (its true peak, it says, lies between SXM and NVL).
        # Its MAMF: the SXM's, scaled to the middle of that range (H100 NVL: 835 TFLOPS dense,
        # https://www.nvidia.com/en-us/data-center/h100/).
        GPU(
            "h100-96gb",
            "NVIDIA H100 96 GB HBM2e",
            94.5,
            989.0,
            2.4,
            450.0,
            132,
            H100_96GB_MAMF,
            HOPPER_ATTENTION,
        ),
        # https://www.nvidia.com/en-us/data-center/h200/ (141 GB, 989 TFLOPS bf16 dense,
        # 4.8 TB/s, NVLink 900 GB/s). What the time model takes is measured on one (700 W,
        # torch 2.11.0+cu130) by scripts/gpu_constants.py: matmuls at up to 682.6 TFLOP/s at the
        # models' shapes, copies at 4.25 TB/s, causal flash attention at 42% of the peak, an op
        # launched in 9.4 us.
        GPU(
            "h200",
            "NVIDIA H200 SXM 141 GB",
            140.4,
            989.0,
            4.25,
            450.0,
            132,
            682.6,
            0.42,
            launch_s=9.4e-6,
        ),
        # https://www.nvidia.com/en-us/data-center/hgx/ (HGX B200: 8 GPUs, 1.4 TB memory,
        # 18 PFLOPS fp16/bf16 with sparsity = 2.25 dense per GPU, 62 TB/s HBM = 7.7 per GPU,
        # NVLink 5: 1.8 TB/s per GPU both directions)
        GPU("b200", "NVIDIA B200 180 GB", 178.4, 2250.0, 7.7, 900.0, 148, 1745.0, HOPPER_ATTENTION),
        # https://www.nvidia.com/en-us/data-center/a100/ (A100 40 GB SXM: 312 TFLOPS bf16 dense,
        # 1,555 GB/s; 80 GB SXM: 2,039 GB/s; NVLink 600 GB/s)
        GPU(
            "a100-40gb",
            "NVIDIA A100 SXM 40 GB",
            39.4,
            312.0,
            1.555,
            300.0,
            108,
            271.2,
            AMPERE_ATTENTION,
        ),
        GPU(
            "a100", "NVIDIA A100 SXM 80 GB", 79.2, 312.0, 2.039, 300.0, 108, 271.2, AMPERE_ATTENTION
        ),
        # https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html (192 GB HBM3,
        # 1,307.4 TFLOPS bf16 dense, 5.3 TB/s, 896 GB/s Infinity Fabric peer bandwidth)
        GPU(
            "mi300x",
            "AMD Instinct MI300X 192 GB",
            191.5,
            1307.4,
            5.3,
            448.0,
            304,
            668.4,
            HOPPER_ATTENTION,
        ),
    )
}


def get_gpu(name: str) -> GPU:
    key = name.strip().lower()
    if key not in GPUS:
        raise UsageError(f"--gpu {name!r} is not in the table; choose one of: {', '.join(GPUS)}")
    return GPUS[key]
