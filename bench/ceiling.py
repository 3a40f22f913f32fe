"""The most any layout and any order of its stages could give against stock Megatron at its best (simulated).

For each batch per GPU, every configuration the planner searches for ours (`enumerate_configs`, all schedule
kinds, T, P, V, D, b, ZeRO stages, recomputation) that fits in memory is lowered and given its step lower bound
(`step_lower_bound_s`: a step time no order of that layout's stages beats under the cost model); the smallest
bound against stock's planned best step (`bfpp plan --stock`) is a ceiling on "ours / stock" that no schedule,
present or future, on these layouts can pass under the same cost model.

    python bench/ceiling.py            # 52B GPT on 512 A100 at 1/32 ... 1/2 sequence per GPU (about 5 minutes)
"""

from __future__ import annotations

import argparse
import csv
import sys
from fractions import Fraction
from pathlib import Path

from megatron_bfpp.sim import STOCK, SearchSpace, analytic_costs, get_hardware, get_model, plan, step_lower_bound_s
from megatron_bfpp.sim.planner import enumerate_configs
from megatron_bfpp.sim.predict import memory, schedule_for

ROOT = Path(__file__).resolve().parent.parent
BETAS = [Fraction(1, 32), Fraction(1, 16), Fraction(1, 8), Fraction(1, 4), Fraction(1, 2)]
FIELDS = ["batch_per_gpu", "global_batch_size", "configurations", "stock_step_time_s", "smallest_lower_bound_s",
          "ceiling_ratio", "schedule", "tensor_model_parallel_size", "pipeline_model_parallel_size",
          "virtual_pipeline_model_parallel_size", "data_parallel_size", "micro_batch_size", "num_micro_batches",
          "zero_stage", "recompute"]


def ceiling_row(model_name: str, hw_name: str, gpus: int, beta: Fraction) -> dict:
    model, hw = get_model(model_name), get_hardware(hw_name)
    batch = int(beta * gpus)
    stock = plan(model, hw, gpus, batch, STOCK, top=1).candidates[0]
    best, n = None, 0
    for cfg in enumerate_configs(model, hw, gpus, batch, SearchSpace())[0]:
        if max(r["total"] for r in memory(model, cfg)) > hw.usable_memory_bytes:
            continue
        bound = step_lower_bound_s(schedule_for(cfg), analytic_costs(hw, cfg.partition(model), cfg))
        n += 1
        if best is None or bound < best[0]:
            best = (bound, cfg)
    bound, cfg = best
    return {"batch_per_gpu": str(beta), "global_batch_size": batch, "configurations": n,
            "stock_step_time_s": stock.step_time_s, "smallest_lower_bound_s": bound,
            "ceiling_ratio": stock.step_time_s / bound, "schedule": cfg.schedule,
            "tensor_model_parallel_size": cfg.tp, "pipeline_model_parallel_size": cfg.pp,
            "virtual_pipeline_model_parallel_size": cfg.vp, "data_parallel_size": cfg.dp,
            "micro_batch_size": cfg.micro_batch_size, "num_micro_batches": cfg.microbatches,
            "zero_stage": cfg.zero_stage, "recompute": cfg.recompute}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt-52b")
    p.add_argument("--hardware", default="dgx-a100")
    p.add_argument("--gpus", type=int, default=512)
    p.add_argument("--batch-per-gpu", type=Fraction, nargs="+", default=BETAS)
    p.add_argument("--csv", type=Path, default=ROOT / "bench" / "results" / "ceiling.csv")
    args = p.parse_args(argv)
    rows = []
    for beta in args.batch_per_gpu:
        rows.append(ceiling_row(args.model, args.hardware, args.gpus, beta))
        r = rows[-1]
        print(f"beta={beta}: at most {r['ceiling_ratio']:.4f}x stock over {r['configurations']} configurations "
              f"(smallest bound {r['smallest_lower_bound_s']:.4f} s: {r['schedule']}, T/P/V/D = "
              f"{r['tensor_model_parallel_size']}/{r['pipeline_model_parallel_size']}/"
              f"{r['virtual_pipeline_model_parallel_size']}/{r['data_parallel_size']}, M = {r['num_micro_batches']})",
              flush=True)
    with args.csv.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()} for r in rows)
    print(f"wrote {args.csv}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
