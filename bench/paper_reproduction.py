"""Reproduce the comparison of the breadth-first paper with the simulator: a 52B GPT on a DGX A100 cluster,
throughput per GPU against batch size per GPU, each method at its best planned configuration.

Methods (each searched by `megatron_bfpp.sim.plan` over T, P, V, D, b, group size and recomputation):
- breadth-first + ZeRO-3 (this package: schedule-placed gathers / reduce-scatters, overlapped);
- non-looped 1F1B (Megatron's default schedule, DDP or distributed optimizer, overlapped);
  (these Megatron baselines step with Megatron's optimizer, outside the schedule: `stock_optimizer`; ours step
  stage by stage at the step boundary, the schedule's STEP actions)
- Megatron-LM as in 2022: interleaved 1F1B with its default group size P, DDP or distributed optimizer,
  data-parallel communication not overlapped with compute and blocking p2p;
- Megatron today: stock Megatron-Core at its best (`bfpp plan --stock`, `megatron_bfpp.sim.planner.STOCK`, the
  denominator of every "vs today" ratio): interleaved 1F1B with a searched micro-batch group size in [P, M], or
  1F1B (V = 1, also where M < P leaves interleaving refused), the distributed optimizer with overlapped gradient
  reduce-scatter and parameter all-gather (interleaved: also overlapped with the optimizer step);
- breadth-first-zb and interleaved-zb (split backward: I on the critical path, W deferred into idle slots),
  ZeRO-1/2/3, W costing its weight-gradient GEMMs alone (Qi et al.; the runtime on Megatron-Core's local
  linears);
- planned best of ours: the planner without schedule or ZeRO restriction (`bfpp plan` with no
  --pipeline-schedule), and the same with W's work at I (`--split-backward-w at-i`: layers that cannot defer
  their weight GEMMs, e.g. TransformerEngine older than 2.7, run their whole backward at I).

Writes docs/paper_reproduction.csv and docs/paper_reproduction.png and prints markdown tables.
Run: python bench/paper_reproduction.py [--gpus 512] [--batch-per-gpu 0.0625 0.125 ...]
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import sys
import time
from fractions import Fraction
from pathlib import Path

from megatron_bfpp.sim import STOCK, SearchSpace, get_hardware, get_model, plan
from megatron_bfpp.sim.predict import Prediction, config_dict

import results_csv  # bench/, which `python bench/<script>.py` puts first on sys.path

ROOT = Path(__file__).resolve().parent.parent

# Every method on Megatron's default split and the balanced layouts, not refined (`refine_layouts`): the
# analysis of docs/simulator.md is of those layouts; the regime tables (bench/regime_table.py) refine them.
_BALANCED = {"refine_layouts": False}
METHODS: dict[str, tuple[str, SearchSpace]] = {
    "bf_zero3": ("breadth-first + ZeRO-3",
                 SearchSpace(schedules=("breadth-first",), zero_stages=(3,), **_BALANCED)),
    "1f1b": ("non-looped 1F1B",
             SearchSpace(schedules=("1f1b",), zero_stages=(0, 1), stock_optimizer=True, **_BALANCED)),
    "megatron_2022": ("Megatron 2022 (interleaved, no overlap)",
                      SearchSpace(schedules=("interleaved-1f1b",), zero_stages=(0, 1), dp_overlap=False,
                                  p2p_overlap=False, search_group_size=False, stock_optimizer=True, **_BALANCED)),
    "megatron_today": ("Megatron today (stock at its best: bfpp plan --stock)",
                       dataclasses.replace(STOCK, **_BALANCED)),
    "bf_zb": ("breadth-first-zb", SearchSpace(schedules=("breadth-first-zb",), zero_stages=(1, 2, 3), **_BALANCED)),
    "interleaved_zb": ("interleaved-zb",
                       SearchSpace(schedules=("interleaved-zb",), zero_stages=(1, 2, 3), **_BALANCED)),
    "ours_best": ("planned best of ours", SearchSpace(**_BALANCED)),
    "ours_best_at_i": ("planned best, W at I", SearchSpace(w_at_input_grad=True, **_BALANCED)),
}
BASELINES = ("megatron_2022", "megatron_today", "1f1b")
PAPER_METHODS = ("bf_zero3", "1f1b", "megatron_2022", "megatron_today")  # the paper's comparison

FIELDS = ["method", "batch_per_gpu", "global_batch_size", "feasible", "tflops_per_gpu", "mfu", "step_time_s",
          "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
          "data_parallel_size", "micro_batch_size", "num_micro_batches", "microbatch_group_size_per_vp_stage",
          "zero_stage", "recompute", "pipeline_schedule", "w_at_input_grad", "bubble_fraction", "compute_s", "exposed_pp_s", "exposed_dp_s", "optimizer_s",
          "peak_memory_gib", "why_infeasible", "bf_speedup", "speedup_vs_megatron_today"]


def run(model_name: str, hw_name: str, gpus: int, betas: list[Fraction]) -> list[dict]:
    model, hw = get_model(model_name), get_hardware(hw_name)
    rows = []
    for beta in betas:
        batch = beta * gpus
        if batch.denominator != 1:
            raise SystemExit(f"--batch-per-gpu {beta} x --gpus {gpus} is not a whole global batch")
        best: dict[str, Prediction | None] = {}
        for key, (label, space) in METHODS.items():
            t0 = time.time()
            res = plan(model, hw, gpus, int(batch), space, top=1)
            best[key] = res.candidates[0] if res.candidates else None
            why = "" if res.candidates else (res.notes[0] if res.notes else "no configuration")
            print(f"  beta={float(beta):g} {label}: {'%.1f TFLOP/s' % best[key].tflops_per_gpu if best[key] else why}"
                  f" ({res.simulated} simulated, {time.time() - t0:.1f} s)", file=sys.stderr)
            rows.append(_row(key, beta, int(batch), best[key], why))
        bf, today = best["bf_zero3"], best["megatron_today"]
        for row in rows[-len(METHODS):]:
            other = best[row["method"]]
            row["bf_speedup"] = bf.tflops_per_gpu / other.tflops_per_gpu if bf and other else ""
            row["speedup_vs_megatron_today"] = other.tflops_per_gpu / today.tflops_per_gpu if other and today else ""
    return rows


def _row(key: str, beta: Fraction, batch: int, p: Prediction | None, why: str) -> dict:
    row = {k: "" for k in FIELDS}
    row.update(method=key, batch_per_gpu=float(beta), global_batch_size=batch, feasible=p is not None,
               why_infeasible=why)
    if p is not None:
        c = config_dict(p.config)
        row.update({k: c[k] for k in FIELDS if k in c})
        row.update(tflops_per_gpu=p.tflops_per_gpu, mfu=p.mfu, step_time_s=p.step_time_s,
                   bubble_fraction=p.bubble_fraction, compute_s=p.compute_s, exposed_pp_s=p.exposed_pp_s,
                   exposed_dp_s=p.exposed_dp_s, optimizer_s=p.optimizer_s, peak_memory_gib=p.peak_memory_gib)
    return row


def write_csv(rows: list[dict], path: Path) -> None:
    results_csv.write_csv(rows, path, FIELDS)


def _fmt_beta(b: float) -> str:
    fr = Fraction(b).limit_denominator(64)
    return str(fr) if fr.denominator != 1 else str(fr.numerator)


def markdown(rows: list[dict]) -> str:
    betas = sorted({r["batch_per_gpu"] for r in rows})
    by = {(r["method"], r["batch_per_gpu"]): r for r in rows}
    lines = ["| batch/GPU | global batch | " + " | ".join(METHODS[k][0] for k in PAPER_METHODS) +
             " | BF vs 2022 | BF vs today | BF vs 1F1B |",
             "|" + "---|" * (2 + len(PAPER_METHODS) + 3)]
    for b in betas:
        cells = [_fmt_beta(b), str(by[("bf_zero3", b)]["global_batch_size"])]
        for k in PAPER_METHODS:
            r = by[(k, b)]
            cells.append(f"{r['tflops_per_gpu']:.0f}" if r["feasible"] else "infeasible")
        for k in BASELINES:
            s = by[(k, b)]["bf_speedup"]
            cells.append(f"{(s - 1) * 100:+.0f}%" if s != "" else ("only BF runs" if by[("bf_zero3", b)]["feasible"]
                                                                  else "-"))
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Split backward (model TFLOP/s per GPU; ratios of throughput):", "", zero_bubble_table(rows)]
    lines += ["", "Chosen configurations (T/P/V/D, b x M, group size, ZeRO, recompute) and where the time goes "
                  "(bubble as a fraction of compute; exposed p2p / data-parallel seconds per step; peak GiB):", "",
              "| batch/GPU | method | schedule | TFLOP/s | T/P/V/D | b x M | G | ZeRO | rc | bubble | exp. p2p s | "
              "exp. dp s | step s | GiB |", "|" + "---|" * 14]
    for b in betas:
        for k in METHODS:
            r = by[(k, b)]
            if not r["feasible"]:
                lines.append(f"| {_fmt_beta(b)} | {METHODS[k][0]} | - | - | - | - | - | - | - | - | - | - | - | - |")
                continue
            g = r["microbatch_group_size_per_vp_stage"]
            lines.append(
                f"| {_fmt_beta(b)} | {METHODS[k][0]} | {r['pipeline_schedule']} | {r['tflops_per_gpu']:.0f} | "
                f"{r['tensor_model_parallel_size']}/{r['pipeline_model_parallel_size']}/"
                f"{r['virtual_pipeline_model_parallel_size']}/{r['data_parallel_size']} | "
                f"{r['micro_batch_size']} x {r['num_micro_batches']} | {g if g not in (None, '') else '-'} | "
                f"{r['zero_stage']} | {'y' if r['recompute'] else 'n'} | {r['bubble_fraction']:.3f} | "
                f"{r['exposed_pp_s']:.3f} | {r['exposed_dp_s']:.3f} | {r['step_time_s']:.3f} | "
                f"{r['peak_memory_gib']:.1f} |")
    return "\n".join(lines)


def _ratio(by: dict, a: str, b: str, beta: float) -> str:
    ra, rb = by[(a, beta)], by[(b, beta)]
    if ra["feasible"] and rb["feasible"]:
        return f"{ra['tflops_per_gpu'] / rb['tflops_per_gpu']:.3f}x"
    return "only ours runs" if ra["feasible"] else "-"


def zero_bubble_table(rows: list[dict]) -> str:
    """The split-backward columns against today's Megatron and plain breadth-first (README and docs)."""
    betas = sorted({r["batch_per_gpu"] for r in rows})
    by = {(r["method"], r["batch_per_gpu"]): r for r in rows}
    cols = ("megatron_today", "bf_zero3", "bf_zb", "interleaved_zb", "ours_best", "ours_best_at_i")
    lines = ["| batch/GPU | " + " | ".join(METHODS[k][0] for k in cols) +
             " | best of ours vs today | best (W at I) vs today | BF-ZB vs BF + ZeRO-3 | best of ours picks |",
             "|" + "---|" * (1 + len(cols) + 4)]
    for b in betas:
        cells = [_fmt_beta(b)]
        for k in cols:
            r = by[(k, b)]
            cells.append(f"{r['tflops_per_gpu']:.0f}" if r["feasible"] else "infeasible")
        cells += [_ratio(by, "ours_best", "megatron_today", b), _ratio(by, "ours_best_at_i", "megatron_today", b),
                  _ratio(by, "bf_zb", "bf_zero3", b)]
        r = by[("ours_best", b)]
        cells.append(f"{r['pipeline_schedule']}, ZeRO-{r['zero_stage']}, T/P/V = {r['tensor_model_parallel_size']}/"
                     f"{r['pipeline_model_parallel_size']}/{r['virtual_pipeline_model_parallel_size']}, M = "
                     f"{r['num_micro_batches']}" if r["feasible"] else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def readme_table(rows: list[dict]) -> str:
    """The README's compact table: the paper's methods, the split-backward ones and the planned best of ours."""
    betas = sorted({r["batch_per_gpu"] for r in rows})
    by = {(r["method"], r["batch_per_gpu"]): r for r in rows}
    cols = (("bf_zero3", "breadth-first + ZeRO-3"), ("bf_zb", "breadth-first-zb"),
            ("interleaved_zb", "interleaved-zb"), ("ours_best", "best of ours"), ("1f1b", "non-looped 1F1B"),
            ("megatron_2022", "Megatron 2022"), ("megatron_today", "Megatron today"))
    lines = ["| batch/GPU | " + " | ".join(c[1] for c in cols) + " | BF vs 2022 | BF vs today | best of ours vs today |"
             " BF-ZB vs BF |", "|" + "---|" * (1 + len(cols) + 4)]
    for b in betas:
        cells = [_fmt_beta(b)]
        for k, _ in cols:
            r = by[(k, b)]
            cells.append(f"{r['tflops_per_gpu']:.0f}" if r["feasible"] else "infeasible")
        for k in ("megatron_2022", "megatron_today"):
            sp = by[(k, b)]["bf_speedup"]
            cells.append(f"{(sp - 1) * 100:+.0f}%" if sp != "" else "only ours run")
        cells += [_ratio(by, "ours_best", "megatron_today", b), _ratio(by, "bf_zb", "bf_zero3", b)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def read_csv(path: Path) -> list[dict]:
    """Rows of a CSV written by `write_csv`, typed back (for regenerating the tables without re-planning)."""
    def conv(k: str, v: str) -> object:
        if v == "" or k in ("method", "why_infeasible", "pipeline_schedule"):
            return v
        if v in ("True", "False"):
            return v == "True"
        return float(v) if k in ("batch_per_gpu",) or "." in v or "e" in v else int(v)

    with path.open() as f:
        return [{k: conv(k, v) for k, v in r.items()} for r in csv.DictReader(f)]


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {"bf_zero3": ("C0", "o", "-"), "1f1b": ("C2", "^", "--"), "megatron_2022": ("C3", "s", ":"),
              "megatron_today": ("C1", "D", "-."), "bf_zb": ("C4", "v", "-"), "interleaved_zb": ("C5", "P", "--"),
              "ours_best": ("k", "*", "-"), "ours_best_at_i": ("C7", "x", ":")}
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    for k, (label, _) in METHODS.items():
        pts = sorted((r["batch_per_gpu"], r) for r in rows if r["method"] == k and r["feasible"])
        if not pts:
            continue
        c, m, ls = styles[k]
        ax.plot([p[0] for p in pts], [p[1]["tflops_per_gpu"] for p in pts], marker=m, color=c, ls=ls, label=label)
        ax2.plot([p[0] for p in pts], [p[1]["peak_memory_gib"] for p in pts], marker=m, color=c, ls=ls, label=label)
    for a in (ax, ax2):
        a.set_xscale("log", base=2)
        a.set_xlabel("batch size per GPU (sequences)")
        a.grid(True, which="both", alpha=0.3)
        ticks = sorted({r["batch_per_gpu"] for r in rows})
        a.set_xticks(ticks)
        a.set_xticklabels([_fmt_beta(t) for t in ticks])
    ax.set_ylabel("throughput per GPU (model TFLOP/s)")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="lower right")
    ax2.set_ylabel("peak memory of the chosen configuration (GiB)")
    ax2.set_title("memory at the best configuration")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt-52b")
    p.add_argument("--hardware", default="dgx-a100")
    p.add_argument("--gpus", type=int, default=512, help="cluster size (default 512 = 64 DGX A100 nodes)")
    p.add_argument("--batch-per-gpu", type=Fraction, nargs="+",
                   default=[Fraction(1, 16), Fraction(1, 8), Fraction(1, 4), Fraction(1, 2), Fraction(1), Fraction(2),
                            Fraction(4)])
    p.add_argument("--csv", type=Path, default=ROOT / "docs" / "paper_reproduction.csv")
    p.add_argument("--png", type=Path, default=ROOT / "docs" / "paper_reproduction.png")
    p.add_argument("--tables-from", type=Path, default=None,
                   help="print the tables of an existing CSV (no planning, nothing written)")
    args = p.parse_args(argv)
    if args.tables_from is not None:
        rows = read_csv(args.tables_from)
        print(markdown(rows) + "\n\nREADME table:\n\n" + readme_table(rows))
        return 0
    rows = run(args.model, args.hardware, args.gpus, args.batch_per_gpu)
    write_csv(rows, args.csv)
    plot(rows, args.png, f"{args.model} on {args.gpus} x {args.hardware} (simulated)")
    print(markdown(rows) + "\n\nREADME table:\n\n" + readme_table(rows))
    print(f"\nwrote {args.csv} and {args.png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
