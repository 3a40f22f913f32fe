"""Hardware profiles: peak compute, memory, links, and the calibration factors that turn peaks into achieved rates.

Every nominal number carries its public source. The `*_efficiency` and latency fields are calibration values
(what a well-tuned kernel or NCCL collective reaches on that hardware, not what the datasheet promises); their
origin is given next to them and `bench/sim_fidelity.py` shows how to re-measure them on a machine at hand.
Bandwidths are per GPU and per direction, in bytes/s.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

GB = 1e9
GIB = 1024**3


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  # dense bf16 tensor-core FLOP/s per GPU
    hbm_bytes: float  # device memory per GPU
    hbm_bandwidth: float  # bytes/s
    nvlink_bandwidth: float  # bytes/s per GPU per direction, inside a node
    ib_bandwidth: float  # bytes/s per GPU per direction, between nodes (one NIC per GPU on DGX systems)
    gpus_per_node: int
    # --- calibration (achieved / nominal) ---
    gemm_efficiency: float  # large bf16 GEMM throughput / peak_flops
    kernel_overhead_s: float  # fixed cost per kernel (launch + tail); makes small matrices inefficient
    memory_efficiency: float  # achieved / nominal HBM bandwidth for streaming (elementwise, optimizer) kernels
    nvlink_efficiency: float  # NCCL bus bandwidth / nominal, inside a node
    ib_efficiency: float  # NCCL bus bandwidth / nominal, between nodes
    nvlink_latency_s: float  # per ring step or p2p message, inside a node
    ib_latency_s: float  # per ring step or p2p message, between nodes
    collective_overhead_s: float  # fixed cost per collective / p2p operation (launch, synchronisation)
    memory_reserve_bytes: float  # CUDA context, NCCL and cuBLAS workspaces, allocator fragmentation

    @property
    def nvlink_bw(self) -> float:
        return self.nvlink_bandwidth * self.nvlink_efficiency

    @property
    def ib_bw(self) -> float:
        return self.ib_bandwidth * self.ib_efficiency

    @property
    def usable_memory_bytes(self) -> float:
        return self.hbm_bytes - self.memory_reserve_bytes

    def replace(self, **changes: float) -> "Hardware":
        return dataclasses.replace(self, **changes)


# Calibration shared by the NVIDIA profiles below (same software stack: cuBLAS + NCCL):
# - gemm_efficiency 0.80: large bf16 GEMMs in cuBLAS reach about 80% of the tensor-core peak on A100/H100
#   (NVIDIA "Matrix Multiplication Background User's Guide", docs.nvidia.com/deeplearning/performance; the
#   same ratio appears as the best per-layer throughput in Narayanan et al., SC'21, "Efficient Large-Scale
#   Language Model Training on GPU Clusters", whose end-to-end 52% of peak includes bubbles and communication).
# - kernel_overhead_s 5 us: launch latency plus the partial last wave of a GEMM, the usual few-microsecond
#   figure for CUDA kernels (CUDA C++ Best Practices Guide); it is what makes small matrices slow.
# - memory_efficiency 0.85: STREAM-like kernels reach 80-90% of nominal HBM bandwidth (NVIDIA BabelStream /
#   nvbandwidth results); elementwise ops and Adam are bandwidth-bound.
# - nvlink_efficiency 0.77: nccl-tests all_reduce bus bandwidth on 8-GPU DGX A100 is about 230 GB/s of the
#   300 GB/s per direction (NVIDIA NCCL performance notes); H100/H200 reach a similar fraction of 450 GB/s.
# - ib_efficiency 0.90: nccl-tests across nodes with one HDR/NDR NIC per GPU reach ~90% of the line rate.
# - latencies: NVLink p2p ~2 us, InfiniBand ~5 us per message including NCCL protocol overhead; a fixed
#   10 us per collective for launch and synchronisation (nccl-tests small-message times are 10-30 us).
# - memory_reserve 4 GiB: CUDA context (~0.5-1 GiB), NCCL buffers, cuBLAS workspace and allocator
#   fragmentation; Megatron users typically keep a few GiB of headroom.
_CAL = dict(
    gemm_efficiency=0.80,
    kernel_overhead_s=5e-6,
    memory_efficiency=0.85,
    nvlink_efficiency=0.77,
    ib_efficiency=0.90,
    nvlink_latency_s=2e-6,
    ib_latency_s=5e-6,
    collective_overhead_s=10e-6,
    memory_reserve_bytes=4 * GIB,
)

PROFILES: dict[str, Hardware] = {
    # NVIDIA A100 80GB SXM: 312 TFLOP/s dense bf16, 80 GB HBM2e at 2,039 GB/s, NVLink 3 600 GB/s total
    # (300 GB/s per direction) -- NVIDIA A100 Tensor Core GPU datasheet. DGX A100: 8 GPUs per node, 8 single-port
    # ConnectX-6 HDR 200 Gb/s InfiniBand NICs for compute traffic, one per GPU (25 GB/s per direction) --
    # NVIDIA DGX A100 datasheet / DGX A100 User Guide.
    "dgx-a100": Hardware(
        name="dgx-a100", peak_flops=312e12, hbm_bytes=80 * GB, hbm_bandwidth=2039 * GB,
        nvlink_bandwidth=300 * GB, ib_bandwidth=25 * GB, gpus_per_node=8, **_CAL,
    ),
    # NVIDIA H100 SXM5 80GB: 989 TFLOP/s dense bf16 (1,979 with sparsity), 80 GB HBM3 at 3.35 TB/s, NVLink 4
    # 900 GB/s total (450 per direction) -- NVIDIA H100 Tensor Core GPU datasheet. DGX H100: 8 GPUs, 8 ConnectX-7
    # NDR 400 Gb/s NICs, one per GPU (50 GB/s per direction) -- NVIDIA DGX H100 datasheet.
    "dgx-h100": Hardware(
        name="dgx-h100", peak_flops=989e12, hbm_bytes=80 * GB, hbm_bandwidth=3350 * GB,
        nvlink_bandwidth=450 * GB, ib_bandwidth=50 * GB, gpus_per_node=8, **_CAL,
    ),
    # NVIDIA H200 SXM 141GB: 989 TFLOP/s dense bf16, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s total --
    # NVIDIA H200 Tensor Core GPU datasheet. DGX H200: 8 GPUs, 8 ConnectX-7 NDR 400 Gb/s NICs (one per GPU) --
    # NVIDIA DGX H200 datasheet.
    "h200": Hardware(
        name="h200", peak_flops=989e12, hbm_bytes=141 * GB, hbm_bandwidth=4800 * GB,
        nvlink_bandwidth=450 * GB, ib_bandwidth=50 * GB, gpus_per_node=8, **_CAL,
    ),
}


def get_hardware(name: str) -> Hardware:
    """The named profile; a clear error naming the flag otherwise."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown --hardware {name!r}: choose one of {', '.join(PROFILES)}") from None
