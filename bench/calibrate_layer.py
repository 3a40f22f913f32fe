"""The one constant the simulator fits, and to what: a single layer's measured times, never an end-to-end run.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", arXiv 2205.05198, Table 4)
timed one decoder layer of their 22B model (h = 6144, 64 heads, s = 2048, micro-batch 4, T = 8, fp16, Megatron's
unfused attention, DGX A100 80GB) under five settings (bench/data/calibration_sources.md, section 3). The cost model
prices that layer op by op from stand-alone kernel measurements (GEMMs at the maximum achievable matmul rate, HBM
and NVLink at their measured rates); this script finds the fraction of the stand-alone GEMM rate that makes the
modelled layer match the five measurements in the least-squares sense (`Hardware.in_layer_fraction`), and prints
the layer, setting by setting, at the profile's value and at the fit. The fit is then written into
megatron_bfpp/sim/hardware.py by hand, with this script named as its source.

Run: python bench/calibrate_layer.py
"""

from __future__ import annotations

from megatron_bfpp.sim.hardware import get_hardware
from megatron_bfpp.sim.layer_costs import layer_ops
from megatron_bfpp.sim.model import ModelProfile, Partition

MODEL = ModelProfile("korthikanti-22b", 48, 6144, 64, 2048, 51200)
MICRO_BATCH = 4
# (sequence parallel, recomputation) -> measured (forward ms, backward ms), Korthikanti et al. 2022, Table 4.
MEASURED = {
    (False, None): (7.7, 11.9),
    (True, None): (7.2, 11.8),
    (False, "full"): (7.7, 19.5),
    (False, "selective"): (7.7, 13.2),
    (True, "selective"): (7.2, 13.1),
}


def modelled_ms(fraction: float, sp: bool, recompute: str | None) -> tuple[float, float]:
    hw = get_hardware("dgx-a100").replace(in_layer_fraction=fraction)
    ops = layer_ops(hw, Partition(MODEL, 8, 1, 1, sequence_parallel=sp, attention="unfused"), MICRO_BATCH)
    fwd, bwd = ops.forward, ops.backward
    if recompute == "full":
        bwd += fwd
    elif recompute == "selective":
        bwd += ops.fwd["attention"]
    return fwd * 1e3, bwd * 1e3


def squared_error(fraction: float) -> float:
    err = 0.0
    for (sp, rc), (f, b) in MEASURED.items():
        mf, mb = modelled_ms(fraction, sp, rc)
        err += (mf / f - 1) ** 2 + (mb / b - 1) ** 2
    return err


def fit(lo: float = 0.5, hi: float = 1.0, iters: int = 60) -> float:
    """Golden-section search for the least-squares fraction (the error is unimodal in it)."""
    g = (5 ** 0.5 - 1) / 2
    a, b = lo, hi
    for _ in range(iters):
        c, d = b - g * (b - a), a + g * (b - a)
        if squared_error(c) < squared_error(d):
            b = d
        else:
            a = c
    return (a + b) / 2


def main() -> None:
    best = fit()
    current = get_hardware("dgx-a100").in_layer_fraction
    print(f"least-squares in-layer fraction of the stand-alone GEMM rate: {best:.4f} (profile: {current:.4f})")
    print(f"{'setting':<24} {'measured fwd/bwd ms':>20} {'profile':>16} {'fit':>16}")
    for (sp, rc), (f, b) in MEASURED.items():
        name = f"{'SP' if sp else 'no SP'}, {rc or 'no'} recompute"
        cur, fitted = modelled_ms(current, sp, rc), modelled_ms(best, sp, rc)
        print(f"{name:<24} {f:>9.1f} / {b:<8.1f} {cur[0]:>7.2f} / {cur[1]:<6.2f} {fitted[0]:>7.2f} / {fitted[1]:<6.2f}")


if __name__ == "__main__":
    main()
