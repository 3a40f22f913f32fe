"""The simulator against published Megatron-LM training runs: predicted / published step time per row.

Each row of bench/data/published_runs.json is a published run (source, table, hardware, GPUs) described by the
`pretrain_gpt.py` flags it was launched with; `megatron_bfpp.megatron.sim_flags.read_run` reads them with
Megatron-LM's own parser into the simulator's model and configuration, and `sim.predict` times one step. The
published figure becomes a step time by the row's own count: iteration seconds as published; tokens per second per
GPU as B s / (rate N); TFLOP/s per GPU through the FLOP count the source used (`sc21-eq3`: Narayanan et al. 2021,
eq. 3, 96 B s l h^2 (1 + s / 6h + V / 16 l h) with the paper's V = 51200, recomputation included;
`korthikanti-model`: Korthikanti et al. 2022, 72 B L s h^2 (1 + s / 6h + V / 12 h L); `megatron`: Megatron's own
`num_floating_point_operations`). No constant of the simulator is fitted to these rows (docs/simulator.md lists
where each comes from); rows not named by the project's targets are a hold-out set.

Targets: dense rows median |predicted / published - 1| <= 10% and worst <= 20%; each MoE row <= 25%; the same
bounds on the hold-out rows.

Run: python bench/published_runs.py [--json OUT] [--only ID ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from megatron_bfpp.megatron.sim_flags import read_run
from megatron_bfpp.sim import Config, get_hardware, predict
from megatron_bfpp.sim.model import ModelProfile

DATA = Path(__file__).resolve().parent / "data" / "published_runs.json"
SC21_VOCAB = 51200  # Narayanan et al. 2021 count every model with this vocabulary
DENSE_MEDIAN, DENSE_WORST, MOE_WORST = 0.10, 0.20, 0.25


@dataclass
class Result:
    row: dict
    published_s: float
    predicted_s: float | None
    layout: str
    error: str | None = None

    @property
    def ratio(self) -> float | None:
        return None if self.predicted_s is None else self.predicted_s / self.published_s


def published_step_s(row: dict, model: ModelProfile, cfg: Config) -> float:
    """The published figure as seconds per step, counted as its source counts (at the run's configuration, as
    Megatron's parser read it)."""
    pub, n, tp = row["published"], row["gpus"], cfg.tp
    gbs, s = cfg.global_batch_size, model.seq_length
    metric, value = pub["metric"], float(pub["value"])
    if metric == "iteration_time_s":
        return value
    if metric == "tokens_per_s_per_gpu":
        return gbs * s / (value * n)
    if metric not in ("tflops_per_gpu", "mfu"):
        raise ValueError(f"{row['id']}: unknown published metric {metric!r}")
    h, layers = model.hidden_size, model.num_layers
    if pub["flops"] == "sc21-eq3":
        flops = 96 * gbs * s * layers * h * h * (1 + s / (6 * h) + SC21_VOCAB / (16 * layers * h))
    elif pub["flops"] == "korthikanti-model":
        v = model.padded_vocab_size(tp)
        flops = 72 * gbs * layers * s * h * h * (1 + s / (6 * h) + v / (12 * h * layers))
    elif pub["flops"] == "megatron":
        flops = model.megatron_flops_per_sequence(tp) * gbs
    else:
        raise ValueError(f"{row['id']}: unknown FLOP count {pub['flops']!r}")
    rate = value * 1e12 if metric == "tflops_per_gpu" else value * get_hardware(row["hardware"]).peak_flops
    return flops / (rate * n)


def evaluate(row: dict) -> Result:
    hw = get_hardware(row["hardware"])
    try:
        model, cfg = read_run(row["megatron_args"], row["gpus"], hw, name=row["id"])
    except ValueError as e:
        return Result(row, float("nan"), None, "-", f"{e}")
    layout = (f"T{cfg.tp} P{cfg.pp} V{cfg.vp} CP{cfg.cp} EP{cfg.ep} D{cfg.dp} b{cfg.micro_batch_size} "
              f"M{cfg.microbatches}")
    pred = predict(model, hw, cfg)
    return Result(row, published_step_s(row, model, cfg), pred.step_time_s, layout)


def summary(results: list[Result]) -> dict:
    """Median and worst error per group (named dense, named MoE, hold-out dense, hold-out MoE), and the targets."""
    out = {}
    for named in (True, False):
        for kind in ("dense", "moe"):
            errs = [r.ratio - 1 for r in results
                    if r.ratio is not None and r.row["named_by_issue"] == named and r.row["kind"] == kind]
            if not errs:
                continue
            worst = max(errs, key=abs)
            median = statistics.median(abs(e) for e in errs)
            met = (median <= DENSE_MEDIAN and abs(worst) <= DENSE_WORST) if kind == "dense" else abs(worst) <= MOE_WORST
            out[f"{'named' if named else 'hold-out'} {kind}"] = {
                "rows": len(errs), "median_abs_error": median, "worst_error": worst, "target_met": met}
    failed = [r.row["id"] for r in results if r.ratio is None]
    if failed:
        out["not simulated"] = failed
    return out


def table(results: list[Result]) -> str:
    lines = [f"{'row':<38} {'set':<5} {'hardware':<9} {'GPUs':>5}  {'layout':<32} {'published s':>11} "
             f"{'predicted s':>11} {'error':>7}"]
    for r in results:
        row = r.row
        tag = ("named" if row["named_by_issue"] else "held") + (" MoE" if row["kind"] == "moe" else "")
        if r.ratio is None:
            lines.append(f"{row['id']:<38} {tag:<5} {row['hardware']:<9} {row['gpus']:>5}  not simulated: {r.error}")
            continue
        lines.append(f"{row['id']:<38} {tag:<5} {row['hardware']:<9} {row['gpus']:>5}  {r.layout:<32} "
                     f"{r.published_s:>11.3f} {r.predicted_s:>11.3f} {r.ratio - 1:>+7.1%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write rows and summary as JSON here")
    p.add_argument("--only", nargs="+", help="row ids to run")
    a = p.parse_args(argv)
    rows = json.loads(DATA.read_text())["rows"]
    if a.only:
        rows = [r for r in rows if r["id"] in a.only]
    results = [evaluate(r) for r in rows]
    print(table(results))
    s = summary(results)
    print()
    for group, v in s.items():
        if group == "not simulated":
            print(f"not simulated: {', '.join(v)}")
            continue
        print(f"{group:<15} {v['rows']:>3} rows  median |error| {v['median_abs_error']:.1%}  worst {v['worst_error']:+.1%}"
              f"  target {'met' if v['target_met'] else 'MISSED'}")
    if a.json:
        Path(a.json).write_text(json.dumps({
            "rows": [{"id": r.row["id"], "named_by_issue": r.row["named_by_issue"], "kind": r.row["kind"],
                      "hardware": r.row["hardware"], "gpus": r.row["gpus"], "layout": r.layout,
                      "published_step_s": r.published_s, "predicted_step_s": r.predicted_s,
                      "error": None if r.ratio is None else r.ratio - 1, "not_simulated": r.error}
                     for r in results],
            "summary": s}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
