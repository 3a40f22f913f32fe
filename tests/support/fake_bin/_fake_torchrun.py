"""Stand-in for torchrun in the A/B driver tests: prints what Megatron-LM's training_log and report_memory print
for the run's --train-iters, without training.

Per variant ($BFPP_AB_VARIANT, set by the A/B driver): FAKE_AB_MS="name=ms,..." iteration time (default
1000), FAKE_AB_LOSS="name=loss,..." first-iteration loss (default 10.5), FAKE_AB_DRIFT="name=d,..." added to the
loss per iteration after the first (default 0), FAKE_AB_GNORM="name=g,..." grad norm (default 1.234),
FAKE_AB_FAIL="name,..." variants that die after iteration 7 with a CUDA out-of-memory error (exit 1),
FAKE_AB_STOP="name=k,..." variants that exit 0 after k iterations. A name may carry a repetition, "name#2": then
only that repetition ($BFPP_AB_REP) of the variant does it.
"""

from __future__ import annotations

import os
import sys


def _table(var: str) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in os.environ.get(var, "").split(",") if "=" in kv)


def main(argv: list[str]) -> int:
    variant = os.environ.get("BFPP_AB_VARIANT", "?")
    keys = (f"{variant}#{os.environ.get('BFPP_AB_REP', '1')}", variant)  # this repetition's entry first

    def pick(var: str, default: float) -> float:
        table = _table(var)
        return float(next((table[k] for k in keys if k in table), default))

    iters = int(argv[argv.index("--train-iters") + 1])
    gbs = int(argv[argv.index("--global-batch-size") + 1])
    ms, loss0, drift, gnorm = pick("FAKE_AB_MS", 1000.0), pick("FAKE_AB_LOSS", 10.5), pick("FAKE_AB_DRIFT", 0.0), \
        pick("FAKE_AB_GNORM", 1.234)
    fail = any(k in os.environ.get("FAKE_AB_FAIL", "").split(",") for k in keys)
    stop = int(pick("FAKE_AB_STOP", iters))
    print("fake torchrun:", " ".join(argv), flush=True)
    for it in range(1, min(iters, stop) + 1):
        t = ms * (3 if it == 1 else 1)
        print(f" [2026-01-01 00:00:00.000000] iteration {it:8d}/{iters:8d} | consumed samples: {it * gbs:12d} |"
              f" elapsed time per iteration (ms): {t:.1f} | throughput per GPU (TFLOP/s/GPU): {1e5 / t:.1f} |"
              f" learning rate: 1.500000E-04 | global batch size: {gbs:5d} | lm loss: {loss0 + (drift - 0.1) * (it - 1):.6E} |"
              f" loss scale: 1.0 | grad norm: {gnorm:.3f} | number of skipped iterations:   0 |"
              f" number of nan iterations:   0 |")
        for rank in (0, 4):
            peak = 4000.0 if variant.startswith("stock") else 3000.0
            print(f"[Rank {rank}] (after {it} iterations) memory (MB) | allocated: {peak / 2:.2f} | max allocated: "
                  f"{peak - rank:.2f} | reserved: {peak + 100:.2f} | max reserved: {peak + 200:.2f}")
        if fail and it == 7:
            print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", flush=True)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
