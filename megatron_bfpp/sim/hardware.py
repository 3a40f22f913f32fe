"""Hardware profiles: peak compute, memory, links, and the achieved fractions that turn peaks into rates.

Every nominal number is a datasheet figure with its source. Every achieved fraction (`*_efficiency`, latencies,
overheads) comes from a published measurement of a kernel or a collective on that hardware (never from an
end-to-end training run), cited next to it; docs/simulator.md lists them all. `Hardware.from_op_timings` builds a
profile from a device's own per-op measurements (the device kit's GPU check). Bandwidths are per GPU and per
direction, in bytes/s.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

GB = 1e9
GIB = 1024**3
TFLOPS = 1e12


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  # dense bf16/fp16 tensor-core FLOP/s per GPU
    hbm_bytes: float  # device memory per GPU
    hbm_bandwidth: float  # bytes/s
    nvlink_bandwidth: float  # bytes/s per GPU per direction, inside a node
    ib_bandwidth: float  # bytes/s per GPU per direction, between nodes (one NIC per GPU on DGX systems)
    gpus_per_node: int
    # --- achieved / nominal, from kernel and collective measurements ---
    gemm_efficiency: float  # large bf16 GEMM throughput / peak_flops
    kernel_overhead_s: float  # fixed cost per kernel (launch + tail); makes small matrices inefficient
    memory_efficiency: float  # achieved / nominal HBM bandwidth for streaming (elementwise, optimizer) kernels
    nvlink_efficiency: float  # NCCL bus bandwidth / nominal, inside a node
    ib_efficiency: float  # NCCL bus bandwidth / nominal, between nodes
    nvlink_latency_s: float  # per ring step or p2p message, inside a node
    ib_latency_s: float  # per ring step or p2p message, between nodes
    collective_overhead_s: float  # fixed cost per collective / p2p operation (launch, synchronisation)
    memory_reserve_bytes: float  # CUDA context, NCCL and cuBLAS workspaces, allocator fragmentation
    # Flash attention (causal) forward and backward throughput / peak_flops, on the FLOPs it executes.
    attention_fwd_efficiency: float = 0.0
    attention_bwd_efficiency: float = 0.0
    peak_flops_fp8: float | None = None  # dense FP8 tensor-core FLOP/s (None: no FP8 tensor cores)
    fp8_gemm_efficiency: float = 0.0  # large FP8 GEMM throughput / peak_flops_fp8

    @property
    def nvlink_bw(self) -> float:
        return self.nvlink_bandwidth * self.nvlink_efficiency

    @property
    def ib_bw(self) -> float:
        return self.ib_bandwidth * self.ib_efficiency

    @property
    def usable_memory_bytes(self) -> float:
        return self.hbm_bytes - self.memory_reserve_bytes

    @property
    def memory_bw(self) -> float:
        return self.hbm_bandwidth * self.memory_efficiency

    def gemm_flops(self, fp8: bool = False) -> float:
        """Achieved FLOP/s of a large GEMM in bf16 or FP8."""
        if not fp8:
            return self.peak_flops * self.gemm_efficiency
        if self.peak_flops_fp8 is None:
            raise ValueError(f"--fp8-format: {self.name} has no FP8 tensor cores; drop the FP8 flags")
        return self.peak_flops_fp8 * self.fp8_gemm_efficiency

    def dense_peak(self, fp8: bool = False) -> float:
        """The dense peak of the precision used, the MFU denominator."""
        if fp8:
            if self.peak_flops_fp8 is None:
                raise ValueError(f"--fp8-format: {self.name} has no FP8 tensor cores; drop the FP8 flags")
            return self.peak_flops_fp8
        return self.peak_flops

    def replace(self, **changes: float) -> "Hardware":
        return dataclasses.replace(self, **changes)

    def from_op_timings(self, name: str, gemm_flops_per_s: float, memory_bytes_per_s: float,
                        attention_fwd_flops_per_s: float | None = None,
                        attention_bwd_flops_per_s: float | None = None) -> "Hardware":
        """This profile with its achieved rates replaced by a device's own measurements (the device kit's GPU
        check: the layer's weight GEMMs, elementwise kernels and attention timed on the device)."""
        changes: dict = dict(name=name, gemm_efficiency=gemm_flops_per_s / self.peak_flops,
                             memory_efficiency=memory_bytes_per_s / self.hbm_bandwidth)
        if attention_fwd_flops_per_s:
            changes["attention_fwd_efficiency"] = attention_fwd_flops_per_s / self.peak_flops
        if attention_bwd_flops_per_s:
            changes["attention_bwd_efficiency"] = attention_bwd_flops_per_s / self.peak_flops
        return dataclasses.replace(self, **changes)


# Collective and kernel figures shared by the NVIDIA profiles (same software stack: CUDA, cuBLAS, NCCL):
# - kernel_overhead_s 5 us: launch latency plus the partial last wave of a kernel, the usual few-microsecond figure
#   for CUDA kernels (CUDA C++ Best Practices Guide); it is what makes small matrices slow.
# - memory_efficiency 0.85: STREAM-like kernels reach 80-90% of nominal HBM bandwidth (BabelStream and NVIDIA
#   nvbandwidth device-local copy results); elementwise ops and Adam are bandwidth-bound.
# - nvlink_efficiency 0.77: nccl-tests all_reduce bus bandwidth on an 8-GPU DGX A100 is about 230 GB/s of the
#   300 GB/s per direction (NVIDIA NCCL performance notes); H100/H200/B200 reach a similar fraction.
# - ib_efficiency 0.90: nccl-tests across nodes with one NIC per GPU reach ~90% of the line rate.
# - latencies: NVLink p2p ~2 us, InfiniBand ~5 us per message including NCCL protocol overhead; a fixed 10 us per
#   collective for launch and synchronisation (nccl-tests small-message times are 10-30 us).
# - memory_reserve 4 GiB: CUDA context (~0.5-1 GiB), NCCL buffers, cuBLAS workspace and allocator fragmentation.
_LINKS = dict(
    kernel_overhead_s=5e-6,
    memory_efficiency=0.85,
    nvlink_efficiency=0.77,
    ib_efficiency=0.90,
    nvlink_latency_s=2e-6,
    ib_latency_s=5e-6,
    collective_overhead_s=10e-6,
    memory_reserve_bytes=4 * GIB,
)

# Achieved GEMM throughput: the "maximum achievable matmul FLOPS" (MAMF) measured by sweeping bf16 GEMM shapes with
# torch.mm on each accelerator (S. Bekman, "Machine Learning Engineering", compute/accelerator/README.md, MAMF
# table; benchmarks/matrix-multiplication): A100 SXM 271.2 of 312 TFLOP/s, H100 SXM 794.5 of 989, B200 1745 of 2250.
# FP8: NVIDIA's cuBLAS 12 FP8 GEMM measurements on H100 SXM (developer blog "New cuBLAS 12.0 Features and Matrix
# Multiplication Performance on NVIDIA Hopper GPUs"): large FP8 GEMMs at about 1,300 of 1,979 TFLOP/s.
# Flash attention: FlashAttention-2 (Dao, 2023, arXiv 2307.08691, Fig. 4-6, causal, head dim 128, seq 2k-8k) on
# A100: forward ~190, backward ~150 of 312 TFLOP/s; FlashAttention-3 (Shah et al., 2024, arXiv 2407.08608, causal
# bf16, head dim 128) on H100: forward ~600, backward ~470 of 989 TFLOP/s (the FlashAttention-2 kernels the cuDNN/TE
# stack replaced reached ~350/~300).
PROFILES: dict[str, Hardware] = {
    # NVIDIA A100 80GB SXM: 312 TFLOP/s dense bf16, 80 GB HBM2e at 2,039 GB/s, NVLink 3 600 GB/s total (300 GB/s
    # per direction) -- NVIDIA A100 Tensor Core GPU datasheet. DGX A100: 8 GPUs per node, 8 single-port ConnectX-6
    # HDR 200 Gb/s InfiniBand NICs for compute traffic, one per GPU (25 GB/s per direction) -- DGX A100 datasheet.
    "dgx-a100": Hardware(
        name="dgx-a100", peak_flops=312e12, hbm_bytes=80 * GB, hbm_bandwidth=2039 * GB,
        nvlink_bandwidth=300 * GB, ib_bandwidth=25 * GB, gpus_per_node=8, gemm_efficiency=271.2 / 312,
        attention_fwd_efficiency=190 / 312, attention_bwd_efficiency=150 / 312, **_LINKS,
    ),
    # NVIDIA A100 40GB SXM: as the 80 GB part with 40 GB HBM2 at 1,555 GB/s -- A100 datasheet; DGX A100 (320 GB).
    "dgx-a100-40gb": Hardware(
        name="dgx-a100-40gb", peak_flops=312e12, hbm_bytes=40 * GB, hbm_bandwidth=1555 * GB,
        nvlink_bandwidth=300 * GB, ib_bandwidth=25 * GB, gpus_per_node=8, gemm_efficiency=271.2 / 312,
        attention_fwd_efficiency=190 / 312, attention_bwd_efficiency=150 / 312, **_LINKS,
    ),
    # NVIDIA H100 SXM5 80GB: 989 TFLOP/s dense bf16, 1,979 dense FP8, 80 GB HBM3 at 3.35 TB/s, NVLink 4 900 GB/s
    # total (450 per direction) -- H100 Tensor Core GPU datasheet. DGX H100: 8 GPUs, 8 ConnectX-7 NDR 400 Gb/s NICs,
    # one per GPU (50 GB/s per direction) -- DGX H100 datasheet.
    "dgx-h100": Hardware(
        name="dgx-h100", peak_flops=989e12, hbm_bytes=80 * GB, hbm_bandwidth=3350 * GB,
        nvlink_bandwidth=450 * GB, ib_bandwidth=50 * GB, gpus_per_node=8, gemm_efficiency=794.5 / 989,
        attention_fwd_efficiency=600 / 989, attention_bwd_efficiency=470 / 989,
        peak_flops_fp8=1979e12, fp8_gemm_efficiency=1300 / 1979, **_LINKS,
    ),
    # NVIDIA H200 SXM 141GB: 989 TFLOP/s dense bf16, 1,979 dense FP8, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s
    # total -- H200 Tensor Core GPU datasheet. DGX H200: 8 GPUs, 8 ConnectX-7 NDR 400 Gb/s NICs -- DGX H200
    # datasheet. Same Hopper die as H100: the H100 kernel measurements apply.
    "h200": Hardware(
        name="h200", peak_flops=989e12, hbm_bytes=141 * GB, hbm_bandwidth=4800 * GB,
        nvlink_bandwidth=450 * GB, ib_bandwidth=50 * GB, gpus_per_node=8, gemm_efficiency=794.5 / 989,
        attention_fwd_efficiency=600 / 989, attention_bwd_efficiency=470 / 989,
        peak_flops_fp8=1979e12, fp8_gemm_efficiency=1300 / 1979, **_LINKS,
    ),
    # NVIDIA B200 (DGX B200): 2.25 PFLOP/s dense bf16, 4.5 dense FP8, 180 GB HBM3e at 8 TB/s per GPU, NVLink 5
    # 1.8 TB/s total (900 GB/s per direction), 8 ConnectX-7 400 Gb/s NICs, one per GPU -- DGX B200 datasheet.
    # Attention and FP8 GEMMs at the Hopper fractions until a B200 measurement is published here.
    "dgx-b200": Hardware(
        name="dgx-b200", peak_flops=2250e12, hbm_bytes=180 * GB, hbm_bandwidth=8000 * GB,
        nvlink_bandwidth=900 * GB, ib_bandwidth=50 * GB, gpus_per_node=8, gemm_efficiency=1745 / 2250,
        attention_fwd_efficiency=600 / 989, attention_bwd_efficiency=470 / 989,
        peak_flops_fp8=4500e12, fp8_gemm_efficiency=1300 / 1979, **_LINKS,
    ),
}


def get_hardware(name: str) -> Hardware:
    """The named profile; a clear error naming the flag otherwise."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown --hardware {name!r}: choose one of {', '.join(PROFILES)}") from None
