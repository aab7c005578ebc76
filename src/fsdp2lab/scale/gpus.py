"""Accelerators a plan can target: memory, peak dense bf16 compute, memory and NVLink bandwidth.

Every figure is the vendor's public datasheet value (dense, i.e. without 2:4 sparsity), with
its source beside it. ``hbm_gib`` is the memory the driver reports (what the allocator can use
plus the CUDA context), in GiB. ``intra_node_gbs`` is one GPU's bandwidth to its node's other
GPUs in one direction (the datasheets quote both directions together: half of it). Bandwidth
between nodes is no property of a GPU: ``fsdp2lab plan --inter-node-gbs`` (default
:data:`DEFAULT_INTER_NODE_GBS`).
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp2lab.errors import UsageError

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


GPUS: dict[str, GPU] = {
    g.name: g
    for g in (
        # https://www.nvidia.com/en-us/data-center/h100/ (H100 SXM: 80 GB, 1,979 TFLOPS bf16
        # with sparsity = 989 dense, 3.35 TB/s, NVLink 900 GB/s both directions)
        GPU("h100", "NVIDIA H100 SXM 80 GB", 79.6, 989.0, 3.35, 450.0),
        # The 96 GB HBM2e SXM H100 of torchtitan's benchmarks
        # (https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md:
        # "96GB HBM2e with 2.4 TB/sec peak memory bandwidth", NVLink, 500 W); torchtitan's MFU
        # takes the SXM's 989 TFLOPS for it (its true peak, it says, lies between SXM and NVL).
        GPU("h100-96gb", "NVIDIA H100 96 GB HBM2e", 94.5, 989.0, 2.4, 450.0),
        # https://www.nvidia.com/en-us/data-center/h200/ (141 GB, 989 TFLOPS bf16 dense,
        # 4.8 TB/s, NVLink 900 GB/s)
        GPU("h200", "NVIDIA H200 SXM 141 GB", 140.4, 989.0, 4.8, 450.0),
        # https://www.nvidia.com/en-us/data-center/hgx/ (HGX B200: 8 GPUs, 1.4 TB memory,
        # 18 PFLOPS fp16/bf16 with sparsity = 2.25 dense per GPU, 62 TB/s HBM = 7.7 per GPU,
        # NVLink 5: 1.8 TB/s per GPU both directions)
        GPU("b200", "NVIDIA B200 180 GB", 178.4, 2250.0, 7.7, 900.0),
        # https://www.nvidia.com/en-us/data-center/a100/ (A100 40 GB SXM: 312 TFLOPS bf16 dense,
        # 1,555 GB/s; 80 GB SXM: 2,039 GB/s; NVLink 600 GB/s)
        GPU("a100-40gb", "NVIDIA A100 SXM 40 GB", 39.4, 312.0, 1.555, 300.0),
        GPU("a100", "NVIDIA A100 SXM 80 GB", 79.2, 312.0, 2.039, 300.0),
        # https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html (192 GB HBM3,
        # 1,307.4 TFLOPS bf16 dense, 5.3 TB/s, 896 GB/s Infinity Fabric peer bandwidth)
        GPU("mi300x", "AMD Instinct MI300X 192 GB", 191.5, 1307.4, 5.3, 448.0),
    )
}


def get_gpu(name: str) -> GPU:
    key = name.strip().lower()
    if key not in GPUS:
        raise UsageError(f"--gpu {name!r} is not in the table; choose one of: {', '.join(GPUS)}")
    return GPUS[key]
