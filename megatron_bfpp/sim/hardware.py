"""Hardware profiles: peak compute, memory, links, and the achieved fractions that turn peaks into rates.

Every nominal number is a datasheet figure with its source. Every achieved fraction (`*_efficiency`, latencies,
overheads) comes from a published measurement of a kernel or a collective on that hardware (never from an
end-to-end training run), cited next to it; docs/simulator.md lists them all. `layer_costs.measured_profile` builds a
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
    sm_count: int = 0  # streaming multiprocessors: a GEMM's output tiles run in waves of this many (0: no waves)
    # What a GEMM (or attention kernel) reaches inside a training layer, as a fraction of its measured stand-alone
    # rate (sustained clocks under a whole layer's power draw, fused epilogues): fitted to one layer's measured
    # times (`bench/calibrate_layer.py`).
    in_layer_fraction: float = 1.0
    # All-to-all bus bandwidth / nominal link bandwidth, inside a node (NVLink) and across nodes (the GPU's NIC).
    a2a_nvlink_efficiency: float = 0.70
    a2a_ib_efficiency: float = 0.96

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
        """Achieved FLOP/s of a large GEMM in bf16 or FP8 inside a training layer."""
        efficiency = self.fp8_gemm_efficiency if fp8 else self.gemm_efficiency
        return self.dense_peak(fp8) * efficiency * self.in_layer_fraction

    def attention_flops(self, backward: bool = False) -> float:
        """Achieved FLOP/s of causal flash attention inside a training layer."""
        eff = self.attention_bwd_efficiency if backward else self.attention_fwd_efficiency
        return self.peak_flops * eff * self.in_layer_fraction

    def dense_peak(self, fp8: bool = False) -> float:
        """The dense peak of the precision used, the MFU denominator."""
        if fp8:
            if self.peak_flops_fp8 is None:
                raise ValueError(f"--fp8-format: {self.name} has no FP8 tensor cores; drop the FP8 flags")
            return self.peak_flops_fp8
        return self.peak_flops

    def replace(self, **changes: object) -> "Hardware":
        return dataclasses.replace(self, **changes)


# Kernel and collective figures shared by the NVIDIA profiles (same software stack: CUDA, cuBLAS, NCCL); the measured
# collective bandwidths per GPU kind are set in each profile below.
# - kernel_overhead_s 5 us: launch latency plus the partial last wave of a kernel, the usual few-microsecond figure
#   for CUDA kernels (CUDA C++ Best Practices Guide); it is what makes small matrices slow.
# - memory_efficiency 0.85: STREAM-like kernels reach 80-90% of nominal HBM bandwidth (BabelStream and NVIDIA
#   nvbandwidth device-local copy results); elementwise ops and Adam are bandwidth-bound.
# - latencies: NVLink p2p ~2 us, InfiniBand ~5 us per message including NCCL protocol overhead; a fixed 10 us per
#   collective for launch and synchronisation (nccl-tests small-message times are 10-30 us).
# - memory_reserve 4 GiB: CUDA context (~0.5-1 GiB), NCCL buffers, cuBLAS workspace and allocator fragmentation.
# - in_layer_fraction 0.858: the least-squares fit of the one single-layer measurement cited here (Korthikanti et al.
#   2022, Table 4: one 22B layer on DGX A100, five settings; bench/calibrate_layer.py prints the fit and each
#   setting). No per-layer measurement of H100, H200 or B200 is cited yet: they take the A100 fraction until the
#   device kit's layer timings replace it (`layer_costs.measured_profile`).
_LINKS = dict(
    in_layer_fraction=0.858,
    kernel_overhead_s=5e-6,
    memory_efficiency=0.85,
    nvlink_latency_s=2e-6,
    ib_latency_s=5e-6,
    collective_overhead_s=10e-6,
    memory_reserve_bytes=4 * GIB,
)

# NCCL bus bandwidth measured with nccl-tests (NVIDIA GTC24 S62129 and GTC25 S72583 "Collective Communication
# Bandwidth" / "All-to-all Communication Bandwidth" slides; 8x H200 ring all-gather / reduce-scatter 361-363 GB/s,
# S. Bekman, "Machine Learning Engineering", network/README.md), as fractions of the nominal per-direction link:
# - ring all-reduce in one node: A100 232 of 300 GB/s (0.77), H100 370 of 450 (0.82), B200 700 of 900 (0.78);
# - across nodes, 8 NICs per node: DGX A100 192 of 8 x 25 GB/s (0.96), DGX H100 380 of 8 x 50 (0.95);
# - all-to-all in one node: A100 210 of 300 (0.70), H100 320 of 450 (0.71), B200 640 of 900 (0.71); across 4 nodes
#   24 GB/s on DGX A100 and 48 on DGX H100: the GPU's one NIC at 0.96 of its rate.
_A100_LINKS = dict(nvlink_efficiency=232 / 300, ib_efficiency=192 / 200, a2a_nvlink_efficiency=210 / 300,
                   a2a_ib_efficiency=24 / 25)
_HOPPER_LINKS = dict(nvlink_efficiency=370 / 450, ib_efficiency=380 / 400, a2a_nvlink_efficiency=320 / 450,
                     a2a_ib_efficiency=48 / 50)
_B200_LINKS = dict(nvlink_efficiency=700 / 900, ib_efficiency=380 / 400, a2a_nvlink_efficiency=640 / 900,
                   a2a_ib_efficiency=48 / 50)

# Achieved GEMM throughput: the "maximum achievable matmul FLOPS" (MAMF) measured by sweeping bf16 GEMM shapes with
# torch.mm on each accelerator (S. Bekman, "Machine Learning Engineering", compute/accelerator/README.md, MAMF
# table; benchmarks/matrix-multiplication): A100 SXM 271.2 of 312 TFLOP/s, H100 SXM 794.5 of 989, B200 1745 of 2250.
# FP8 (e4m3, same table): H100 SXM 1402.6 of 1979, H200 1453.4 of 1979, B200 3432.5 of 4500.
# Flash attention, causal, head dim 128 (Dao-AILab/flash-attention README benchmark figures; FlashAttention-2, Dao
# 2023, arXiv 2307.08691; FlashAttention-3, Shah et al. 2024, arXiv 2407.08608): on A100 FlashAttention-2 forward
# ~190 TFLOP/s and forward + backward 189 (so the backward also ~188); on H100 FlashAttention-3's forward 616 TFLOP/s
# (bf16), its backward taken at FlashAttention-2's forward + backward rate on H100, 328 (a FlashAttention-3 backward
# figure is not cited here: a conservative rate). B200: the H100 fractions until a B200 figure is cited.
# SMs (wave quantization, `layer_costs.gemm_time`): A100 108, H100 SXM and H200 132 (NVIDIA A100 and H100 architecture
# whitepapers), B200 148 (NVIDIA Blackwell architecture technical brief).
PROFILES: dict[str, Hardware] = {
    # NVIDIA A100 80GB SXM: 312 TFLOP/s dense bf16, 80 GB HBM2e at 2,039 GB/s, NVLink 3 600 GB/s total (300 GB/s
    # per direction) -- NVIDIA A100 Tensor Core GPU datasheet. DGX A100: 8 GPUs per node, 8 single-port ConnectX-6
    # HDR 200 Gb/s InfiniBand NICs for compute traffic, one per GPU (25 GB/s per direction) -- DGX A100 datasheet.
    "dgx-a100": Hardware(
        name="dgx-a100", peak_flops=312e12, hbm_bytes=80 * GB, hbm_bandwidth=2039 * GB,
        nvlink_bandwidth=300 * GB, ib_bandwidth=25 * GB, gpus_per_node=8, gemm_efficiency=271.2 / 312,
        attention_fwd_efficiency=190 / 312, attention_bwd_efficiency=188 / 312, sm_count=108, **_A100_LINKS, **_LINKS,
    ),
    # NVIDIA A100 40GB SXM: as the 80 GB part with 40 GB HBM2 at 1,555 GB/s -- A100 datasheet; DGX A100 (320 GB).
    "dgx-a100-40gb": Hardware(
        name="dgx-a100-40gb", peak_flops=312e12, hbm_bytes=40 * GB, hbm_bandwidth=1555 * GB,
        nvlink_bandwidth=300 * GB, ib_bandwidth=25 * GB, gpus_per_node=8, gemm_efficiency=271.2 / 312,
        attention_fwd_efficiency=190 / 312, attention_bwd_efficiency=188 / 312, sm_count=108, **_A100_LINKS, **_LINKS,
    ),
    # NVIDIA H100 SXM5 80GB: 989 TFLOP/s dense bf16, 1,979 dense FP8, 80 GB HBM3 at 3.35 TB/s, NVLink 4 900 GB/s
    # total (450 per direction) -- H100 Tensor Core GPU datasheet. DGX H100: 8 GPUs, 8 ConnectX-7 NDR 400 Gb/s NICs,
    # one per GPU (50 GB/s per direction) -- DGX H100 datasheet.
    "dgx-h100": Hardware(
        name="dgx-h100", peak_flops=989e12, hbm_bytes=80 * GB, hbm_bandwidth=3350 * GB,
        nvlink_bandwidth=450 * GB, ib_bandwidth=50 * GB, gpus_per_node=8, gemm_efficiency=794.5 / 989,
        attention_fwd_efficiency=616 / 989, attention_bwd_efficiency=328 / 989,
        peak_flops_fp8=1979e12, fp8_gemm_efficiency=1402.6 / 1979, sm_count=132, **_HOPPER_LINKS, **_LINKS,
    ),
    # NVIDIA H200 SXM 141GB: 989 TFLOP/s dense bf16, 1,979 dense FP8, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s
    # total -- H200 Tensor Core GPU datasheet. DGX H200: 8 GPUs, 8 ConnectX-7 NDR 400 Gb/s NICs -- DGX H200
    # datasheet. Same Hopper die as H100: the H100 kernel measurements apply.
    "h200": Hardware(
        name="h200", peak_flops=989e12, hbm_bytes=141 * GB, hbm_bandwidth=4800 * GB,
        nvlink_bandwidth=450 * GB, ib_bandwidth=50 * GB, gpus_per_node=8, gemm_efficiency=794.5 / 989,
        attention_fwd_efficiency=616 / 989, attention_bwd_efficiency=328 / 989,
        peak_flops_fp8=1979e12, fp8_gemm_efficiency=1453.4 / 1979, sm_count=132, **_HOPPER_LINKS, **_LINKS,
    ),
    # NVIDIA B200 (DGX B200): 2.25 PFLOP/s dense bf16, 4.5 dense FP8, 180 GB HBM3e at 8 TB/s per GPU, NVLink 5
    # 1.8 TB/s total (900 GB/s per direction), 8 ConnectX-7 400 Gb/s NICs, one per GPU -- DGX B200 datasheet.
    # Attention at the Hopper fractions until a B200 measurement is cited here.
    "dgx-b200": Hardware(
        name="dgx-b200", peak_flops=2250e12, hbm_bytes=180 * GB, hbm_bandwidth=8000 * GB,
        nvlink_bandwidth=900 * GB, ib_bandwidth=50 * GB, gpus_per_node=8, gemm_efficiency=1745 / 2250,
        attention_fwd_efficiency=616 / 989, attention_bwd_efficiency=328 / 989,
        peak_flops_fp8=4500e12, fp8_gemm_efficiency=3432.5 / 4500, sm_count=148, **_B200_LINKS, **_LINKS,
    ),
}


def get_hardware(name: str) -> Hardware:
    """The named profile; a clear error naming the flag otherwise."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown --hardware {name!r}: choose one of {', '.join(PROFILES)}") from None
