"""The regime stock Megatron cannot enter: the planned best of ours against stock Megatron-Core at its best, with
the simulator, over batch per GPU (52B GPT on 512 A100 by default: 1/32 ... 1 sequence per GPU).

Ours is `bfpp plan` without restriction (`SearchSpace()`: every schedule this package runs, ZeRO-0..3); stock is
`bfpp plan --stock` (`megatron_bfpp.sim.planner.STOCK`: 1F1B at V = 1, interleaved 1F1B at V >= 2 with a group
size in [P, M], so only 1F1B at M < P; the distributed optimizer with every overlap it has). Writes a CSV and the
markdown table (README.md and docs/simulator.md quote it) and prints the table; the CSV adds each plan's step,
compute and optimizer seconds (the optimizer's work and what of it the step waits for). Two ceilings from the
simulator's step lower bound: stock's step over the bound of ours' plan (what any order of its stages could
give) and over the smallest bound of every layout searched for ours that fits (what no layout and no order
passes under the cost model).

Run: python bench/regime_table.py [--gpus 512] [--batch-per-gpu 1/32 1/16 ...]
"""

from __future__ import annotations

import argparse
import csv
import sys
from fractions import Fraction
from pathlib import Path

from megatron_bfpp.sim import STOCK, SearchSpace, analytic_costs, get_hardware, get_model, plan, step_lower_bound_s
from megatron_bfpp.sim.hardware import Hardware
from megatron_bfpp.sim.model import ModelProfile
from megatron_bfpp.sim.planner import enumerate_configs, smallest_lower_bound, stock_schedule
from megatron_bfpp.sim.costs import Config
from megatron_bfpp.sim.predict import Prediction, schedule_for

ROOT = Path(__file__).resolve().parent.parent
BETAS = [Fraction(1, 32), Fraction(1, 16), Fraction(1, 8), Fraction(1, 4), Fraction(1, 2), Fraction(1)]
SIDES = {"ours": SearchSpace(), "stock": STOCK}

FIELDS = ["batch_per_gpu", "global_batch_size", "stock_can_interleave", "ratio", "ratio_at_ours_bound",
          "ratio_at_any_bound", "any_bound_s", "any_bound_layout"] + [
    f"{side}_{k}" for side in SIDES for k in (
        "schedule", "tensor_model_parallel_size", "pipeline_model_parallel_size",
        "virtual_pipeline_model_parallel_size", "data_parallel_size", "micro_batch_size", "num_micro_batches",
        "microbatch_group_size_per_vp_stage", "zero_stage", "recompute", "overlap_param_gather_with_optimizer_step",
        "tflops_per_gpu", "peak_memory_gib", "step_time_s", "step_lower_bound_s", "compute_s", "optimizer_s",
        "optimizer_exposed_s", "optimizer_in_schedule")] + ["stock_at_ours_layout"]


def regime_rows(model: ModelProfile, hw: Hardware, gpus: int, betas: list[Fraction],
                sides: dict[str, SearchSpace] = SIDES) -> list[dict]:
    """One row per batch per GPU: the best plan of each side (`sides`: ours and stock), their ratio (ours / stock)
    and what stock runs."""
    rows = []
    for beta in betas:
        batch = beta * gpus
        if batch.denominator != 1:
            raise SystemExit(f"--batch-per-gpu {beta} x --gpus {gpus} is not a whole global batch")
        row: dict = {"batch_per_gpu": str(beta), "global_batch_size": int(batch)}
        best: dict[str, Prediction | None] = {}
        for side, space in sides.items():
            res = plan(model, hw, gpus, int(batch), space, top=1)
            best[side] = res.candidates[0] if res.candidates else None
            if best[side] is not None:
                d = best[side].to_dict()
                row.update({f"{side}_{k}": v for k, v in d["config"].items() if f"{side}_{k}" in FIELDS})
                row.update({f"{side}_schedule": d["config"]["pipeline_schedule"],
                            f"{side}_tflops_per_gpu": d["tflops_per_gpu"],
                            f"{side}_peak_memory_gib": d["peak_memory_gib"],
                            # the optimizer: ours steps stage by stage in the schedule (mostly hidden), stock after it
                            **{f"{side}_{k}": d[k] for k in ("step_time_s", "step_lower_bound_s", "compute_s",
                                                             "optimizer_s", "optimizer_exposed_s")}})
            print(f"  beta={beta} {side}: "
                  f"{f'{best[side].tflops_per_gpu:.1f} TFLOP/s' if best[side] else 'nothing fits'}", file=sys.stderr)
        ours, stock = best["ours"], best["stock"]
        row["ratio"] = ours.tflops_per_gpu / stock.tflops_per_gpu if ours and stock else None
        # The most any order of ours' stages could give against stock's plan (`step_lower_bound_s`), and the
        # most any layout searched and any order of its stages could.
        row["ratio_at_ours_bound"] = stock.step_time_s / ours.step_lower_bound_s if ours and stock else None
        found = smallest_lower_bound(model, hw, gpus, int(batch), sides["ours"])
        if found is None:
            raise SystemExit(f"nothing fits at global batch {batch}")
        bound, c = found
        row["any_bound_s"] = bound
        row["ratio_at_any_bound"] = stock.step_time_s / bound if stock else None
        row["any_bound_layout"] = (f"{c.schedule}, T/P/V/D = {c.tp}/{c.pp}/{c.vp}/{c.dp}, "
                                   f"b x M = {c.micro_batch_size} x {c.microbatches}")
        # Whether any layout of this batch lets stock interleave at all (M >= P with V >= 2 stages per rank).
        row["stock_can_interleave"] = any(c.vp >= 2 for c in enumerate_configs(model, hw, gpus, int(batch),
                                                                            sides["stock"])[0])
        if ours:
            c = ours.config
            kind, vp = stock_schedule(c.pp, c.vp, c.microbatches)
            row["stock_at_ours_layout"] = f"{kind} V={vp}" + (" (falls back: M < P)" if vp != c.vp else "")
        rows.append(row)
    return rows


def _side(row: dict, side: str) -> tuple[str, str, str]:
    """(schedule and layout, TFLOP/s, GiB) cells of one side."""
    if row.get(f"{side}_tflops_per_gpu") is None:
        return "nothing fits", "-", "-"
    def g(key: str):
        return row[f"{side}_{key}"]

    group = g("microbatch_group_size_per_vp_stage")
    extras = [f"G = {group}"] if group is not None else []
    extras += ["recompute"] if g("recompute") else []
    extras += ["param gather in the optimizer step"] if g("overlap_param_gather_with_optimizer_step") else []
    layout = (f"{g('schedule')}, ZeRO-{g('zero_stage')}, T/P/V/D = {g('tensor_model_parallel_size')}/"
              f"{g('pipeline_model_parallel_size')}/{g('virtual_pipeline_model_parallel_size')}/"
              f"{g('data_parallel_size')}, b x M = {g('micro_batch_size')} x {g('num_micro_batches')}"
              + "".join(f", {e}" for e in extras))
    return layout, f"{g('tflops_per_gpu'):.1f}", f"{g('peak_memory_gib'):.1f}"


def markdown(rows: list[dict]) -> str:
    lines = ["| batch/GPU | global batch | planned best of ours | TFLOP/s | GiB | stock Megatron at its best | TFLOP/s | "
             "GiB | ours / stock | at ours' lower bound | at any layout's lower bound | stock can interleave | "
             "stock at ours' layout |", "|" + "---|" * 13]
    for r in rows:
        ours, stock = _side(r, "ours"), _side(r, "stock")
        ratio = f"{r['ratio']:.3f}x" if r["ratio"] is not None else "-"
        ceiling = f"{r['ratio_at_ours_bound']:.3f}x" if r["ratio_at_ours_bound"] is not None else "-"
        anywhere = f"{r['ratio_at_any_bound']:.3f}x ({r['any_bound_layout']})" if r["ratio_at_any_bound"] else "-"
        lines.append(f"| {r['batch_per_gpu']} | {r['global_batch_size']} | {' | '.join(ours)} | {' | '.join(stock)} | "
                     f"{ratio} | {ceiling} | {anywhere} | {'yes' if r['stock_can_interleave'] else 'no: M < P everywhere'} | "
                     f"{r.get('stock_at_ours_layout', '-')} |")
    return "\n".join(lines)


def write_csv(rows: list[dict], path: Path) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt-52b")
    p.add_argument("--hardware", default="dgx-a100")
    p.add_argument("--gpus", type=int, default=512)
    p.add_argument("--batch-per-gpu", type=Fraction, nargs="+", default=BETAS)
    p.add_argument("--csv", type=Path, default=ROOT / "bench" / "results" / "regime_table.csv")
    p.add_argument("--markdown", type=Path, default=ROOT / "bench" / "results" / "regime_table.md")
    args = p.parse_args(argv)
    rows = regime_rows(get_model(args.model), get_hardware(args.hardware), args.gpus, args.batch_per_gpu)
    table = markdown(rows)
    write_csv(rows, args.csv)
    args.markdown.write_text(f"<!-- generated by bench/regime_table.py: {args.model} on {args.gpus} x "
                             f"{args.hardware}, simulated -->\n{table}\n")
    print(table)
    print(f"\nwrote {args.csv} and {args.markdown}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
