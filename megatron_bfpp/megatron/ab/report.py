"""The A/B driver's report: which runs count, per-variant medians and spread over the repetitions, ratios to the
best stock run (over the medians, and round by round), the same-model check, and the files (ab_iterations.csv,
ab_memory.csv, ab_summary.csv, ab_rounds.csv, ab_rounds.md, ab_megatron.png)."""

from __future__ import annotations

import csv
import statistics
import sys
from pathlib import Path

from .commands import RunRecord
from .logs import RunLog, parse_log

# "Same model" tolerances, relative, per logged iteration: bf16 (reduction order only at iteration 1; later the
# optimizer carries the differences forward, as in the GPU check, megatron_bfpp/devkit/gpu_check) and fp32
# (--cpu-smoke: the plugin matches stock Megatron-LM to 1e-5 in tests/megatron_lm/test_pretrain_gpt.py; 1e-4 leaves
# room for 2-process gloo reductions).
BF16_RTOL = {"first": 5e-3, "all": 2e-2}
FP32_RTOL = {"first": 1e-4, "all": 1e-4}
# Megatron-LM prints the grad norm with three decimals: two runs' printed norms may differ by one unit of the last
# digit however close the norms are.
GRAD_NORM_PRINTED_STEP = 1e-3


def steady(run: RunLog, warmup: int) -> list[dict]:
    """The iterations after the warm-up; never the warm-up itself (empty if the run did not get past it)."""
    return [r for r in run.iterations if r["iteration"] > warmup]


def _median(vals: list[float]) -> float | None:
    return statistics.median(vals) if vals else None


def run_metrics(run: RunLog, warmup: int) -> dict:
    """Medians of one run over its steady iterations."""
    it = steady(run, warmup)

    def med(key: str) -> float | None:
        return _median([r[key] for r in it if r.get(key) is not None])

    return {"iterations": len(it), "elapsed_ms": med("elapsed_ms"), "tokens_per_s": med("tokens_per_s"),
            "tflops_per_gpu": med("tflops_per_gpu")}


def planned_iterations(record: RunRecord) -> int | None:
    """The --train-iters the run was started with (None when its command does not say)."""
    cmd = record.command
    return int(cmd[cmd.index("--train-iters") + 1]) if "--train-iters" in cmd[:-1] else None


def run_failure(record: RunRecord, run: RunLog | None, warmup: int) -> str | None:
    """Why a run does not count, or None. A run counts only when it exited 0 and logged every iteration it was
    started for: medians are never taken from a partial log."""
    last = max((r["iteration"] for r in run.iterations), default=0) if run else 0
    if record.returncode is None:
        return f"no exit status recorded (the run did not finish) after {last} logged iteration(s)"
    if record.returncode != 0:
        return f"exited with status {record.returncode} after {last} logged iteration(s)"
    if run is None:
        return "no log"
    if not run.iterations:
        return "no Megatron iteration lines in the log"
    if not steady(run, warmup):
        return (f"only {len(run.iterations)} iteration(s) logged, none after the {warmup} warm-up iteration(s) "
                f"(raise --iters or lower --warmup)")
    planned = planned_iterations(record)
    if planned is not None and last < planned:
        return f"exited 0 after logging {last} of its {planned} iterations (a partial log)"
    return None


def measured_bubble(timeline: str | None) -> float | None:
    """Bubble of the last recorded iteration of a plugin run's --timeline (mean over ranks), or None."""
    if not timeline:
        return None
    try:
        from megatron_bfpp.megatron.timeline import merge
        from megatron_bfpp.trace.chrome import load_chrome_trace
        from megatron_bfpp.trace.metrics import iteration_metrics

        path, _ = merge(timeline)
        metrics = iteration_metrics(load_chrome_trace(path))
    except (FileNotFoundError, ValueError, OSError, KeyError):
        return None
    # Without device timing (the CPU shim's CUDA events are no-ops) compute spans are empty: not a measurement.
    return metrics.bubble if any(r.compute_s > 0 for r in metrics.ranks) else None


def summarize(variants: list[str], records: list[RunRecord], logs: dict[tuple[str, int], RunLog | None],
              warmup: int, loss_rtol: float, loss_rtol_all: float,
              placed_alike: bool = True) -> tuple[list[dict], list[str]]:
    """One summary row per variant and the list of errors (failed variants, loss mismatch); `placed_alike`: see
    `same_model_problem`."""
    rows, errors = [], []
    first_runs: dict[str, RunLog] = {}
    for v in variants:
        recs = [r for r in records if r.variant == v]
        failures = [(r, why) for r in recs if (why := run_failure(r, logs.get((v, r.rep)), warmup))]
        row: dict = {"variant": v, "status": "ok", "reps": len(recs), "error": "", "logs": " ".join(r.log for r in recs)}
        if failures or not recs:
            r, why = failures[0] if failures else (None, "did not run")
            row.update(status="failed", error=f"repetition {r.rep}: {why}; see {r.log}" if r else why)
            errors.append(f"variant {v} failed: {row['error']}")
            rows.append(row)
            continue
        per = [run_metrics(logs[(v, r.rep)], warmup) for r in recs]  # type: ignore[arg-type]
        for key in ("tokens_per_s", "elapsed_ms", "tflops_per_gpu"):
            vals = [p[key] for p in per if p[key] is not None]
            row[f"median_{key}"] = _median(vals)
            row[f"min_{key}"] = min(vals) if vals else None
            row[f"max_{key}"] = max(vals) if vals else None
        mem = [m for r in recs for m in logs[(v, r.rep)].memory]  # type: ignore[union-attr]
        row["peak_max_allocated_mb"] = max((m["max_allocated_mb"] for m in mem), default=None)
        row["peak_max_reserved_mb"] = max((m["max_reserved_mb"] for m in mem if m["max_reserved_mb"] is not None),
                                          default=None)
        bubbles = [b for r in recs if (b := measured_bubble(r.timeline)) is not None]
        row["bubble"] = _median(bubbles)
        first_runs[v] = logs[(v, recs[0].rep)]  # type: ignore[assignment]
        first = logs[(v, recs[0].rep)].iterations[0]  # type: ignore[union-attr]
        row["first_iteration"] = first["iteration"]
        row["first_lm_loss"] = first["lm_loss"]
        row["last_lm_loss"] = logs[(v, recs[0].rep)].iterations[-1]["lm_loss"]  # type: ignore[union-attr]
        row["deferred_linears"] = logs[(v, recs[0].rep)].deferred_linears  # type: ignore[union-attr]
        rows.append(row)

    ok = [r for r in rows if r["status"] == "ok"]
    stock = [r for r in ok if r["variant"].startswith("stock") and r.get("median_tokens_per_s")]
    base = max(stock, key=lambda r: r["median_tokens_per_s"]) if stock else (ok[0] if ok else None)
    for r in rows:
        r["baseline"] = base["variant"] if base else ""
        for key in ("median_tokens_per_s", "median_tflops_per_gpu", "peak_max_allocated_mb"):
            b = base.get(key) if base else None
            r[f"ratio_{key}"] = (r[key] / b) if (b and r.get(key) is not None) else None
        if r["status"] != "ok" or base is None:
            r["loss_check"] = ""
            continue
        ours, theirs = first_runs[r["variant"]], first_runs[base["variant"]]
        problem = same_model_problem(ours, theirs, loss_rtol, loss_rtol_all, placed_alike)
        if problem is None:
            r["loss_check"] = "ok"
        elif problem.startswith("no "):
            r["loss_check"] = problem
            errors.append(f"variant {r['variant']}: {problem}; see {r['logs'].split()[0]}")
        else:
            r["loss_check"] = f"mismatch: {problem} ({base['variant']})"
            errors.append(f"variant {r['variant']}: {problem} against {base['variant']}: the variants did not train "
                          f"the same model; see {r['logs'].split()[0]}")
    return rows, errors


def same_model_problem(run: RunLog, base: RunLog, rtol_first: float, rtol_all: float,
                       placed_alike: bool = True) -> str | None:
    """Whether two runs trained the same model: lm loss and grad norm at every iteration both logged, within
    `rtol_first` at the first and `rtol_all` at every one (None: they agree). One iteration's loss alone is a weak
    test: every freshly initialised GPT of a vocabulary starts near ln(vocabulary); the later iterations and the
    gradient norms depend on the weights and the data. Where the runs build some layers on other pipeline ranks
    (not `placed_alike`: stock without the layout's virtual stages), Megatron initialises those layers from other
    seeds: the loss curves are compared at every iteration, the grad norm at the first only (after an update it
    follows each run's own weights)."""
    theirs = {x["iteration"]: x for x in base.iterations}
    common = [(x, theirs[x["iteration"]]) for x in run.iterations if x["iteration"] in theirs]
    if not common or common[0][0].get("lm_loss") is None or common[0][1].get("lm_loss") is None:
        return "no lm loss in the iteration lines both runs logged"
    for k, (x, y) in enumerate(common):
        rtol, which = (rtol_first, "--loss-rtol") if k == 0 else (rtol_all, "--loss-rtol-all")
        for key, what, printed in (("lm_loss", "lm loss", 0.0), ("grad_norm", "grad norm", GRAD_NORM_PRINTED_STEP)):
            if key == "grad_norm" and k > 0 and not placed_alike:
                continue
            a, b = x.get(key), y.get(key)
            if a is None or b is None:
                continue  # not logged (grad norm: some Megatron-LM logging settings leave it out)
            if abs(a - b) > rtol * abs(b) + printed:
                return f"{what} {a:.6g} vs {b:.6g} at iteration {x['iteration']} (beyond {which} {rtol:g})"
    return None


def round_ratios(records: list[RunRecord], logs: dict[tuple[str, int], RunLog | None], baseline: str,
                 warmup: int) -> list[dict]:
    """Per round (repetition) and counted run: its median tokens/s and its ratio to the baseline's run of the same
    round. Rounds run the variants back to back (A B C, A B C, ...), so drift between rounds hits every variant of a
    round alike and a round's ratio leaves it out."""
    def tokens(r: RunRecord) -> float | None:
        run = logs.get((r.variant, r.rep))
        if run is None or run_failure(r, run, warmup):
            return None
        return run_metrics(run, warmup)["tokens_per_s"]

    base = {r.rep: tokens(r) for r in records if r.variant == baseline}
    rows = []
    for r in records:
        t, b = tokens(r), base.get(r.rep)
        if t is not None:
            rows.append({"round": r.rep, "variant": r.variant, "tokens_per_s": t, "baseline": baseline,
                         "ratio_tokens_per_s": t / b if b else None})
    return rows


def with_round_ranges(summary: list[dict], rounds: list[dict]) -> None:
    """Each summary row gains the smallest and largest of its rounds' ratios to the baseline."""
    for row in summary:
        ratios = [x["ratio_tokens_per_s"] for x in rounds
                  if x["variant"] == row["variant"] and x["ratio_tokens_per_s"] is not None]
        row["round_ratio_min"] = min(ratios) if ratios else None
        row["round_ratio_max"] = max(ratios) if ratios else None


def rounds_markdown(title: str, summary: list[dict], rounds: list[dict], context: dict | None) -> str:
    """ab_rounds.md: per variant, each round's throughput ratio to the baseline's run of that round and their range
    (the baseline's row: its tokens/s)."""
    context = context or {}
    numbers = sorted({x["round"] for x in rounds})
    lines = [f"# {title}", ""]
    if context.get("command"):
        lines += [f"`{context['command']}`", ""]
    facts = []
    if context.get("iterations") is not None:
        facts.append(f"{context['iterations']} iterations per run, the first {context.get('warmup')} left out")
    if context.get("cores"):
        facts.append("rank k on core " + ", ".join(map(str, context["cores"])) + " (k = 0, 1, ...)")
    for key, when in (("load_before", "before"), ("load_after", "after")):
        if context.get(key):
            facts.append(f"load average {when}: " + " ".join(f"{x:.2f}" for x in context[key]))
    if facts:
        lines += ["; ".join(facts) + ".", ""]
    base = summary[0].get("baseline", "") if summary else ""
    lines += [f"Throughput (tokens/s, median of each run's timed iterations) over {base}'s in the same round:", "",
              "| variant | what runs | " + " | ".join(f"round {k}" for k in numbers) + " | range |",
              "|---|---|" + "---|" * len(numbers) + "---|"]
    descriptions = context.get("descriptions", {})
    for row in summary:
        v = row["variant"]
        cells = {x["round"]: x for x in rounds if x["variant"] == v}
        if v == base:
            shown = [f"{cells[k]['tokens_per_s']:.0f} tok/s" if k in cells else "-" for k in numbers]
            span = "1.00"
        elif row["status"] != "ok":
            shown, span = ["failed"] * len(numbers), "failed"
        else:
            shown = [f"{cells[k]['ratio_tokens_per_s']:.3f}" if k in cells and cells[k]["ratio_tokens_per_s"]
                     else "-" for k in numbers]
            lo, hi = row.get("round_ratio_min"), row.get("round_ratio_max")
            span = f"{lo:.3f}-{hi:.3f}" if lo is not None else "-"
        lines.append(f"| {v} | {descriptions.get(v, '')} | " + " | ".join(shown) + f" | {span} |")
    return "\n".join(lines) + "\n"


def memory_per_rank(variants: list[str], records: list[RunRecord], logs: dict) -> list[dict]:
    """Per variant and rank, the peak max-allocated and max-reserved memory over every repetition."""
    out = []
    for v in variants:
        by_rank: dict[int, dict] = {}
        for r in records:
            run = logs.get((v, r.rep)) if r.variant == v else None
            for m in run.memory if run else []:
                cur = by_rank.setdefault(m["rank"], {"variant": v, "rank": m["rank"], "peak_max_allocated_mb": 0.0,
                                                     "peak_max_reserved_mb": None})
                cur["peak_max_allocated_mb"] = max(cur["peak_max_allocated_mb"], m["max_allocated_mb"])
                if m["max_reserved_mb"] is not None:
                    cur["peak_max_reserved_mb"] = max(cur["peak_max_reserved_mb"] or 0.0, m["max_reserved_mb"])
        out += [by_rank[k] for k in sorted(by_rank)]
    return out


def write_csv(path: Path, rows: list[dict]) -> None:
    keys = list(dict.fromkeys(k for r in rows for k in r)) or ["variant"]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def plot(summary: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("median_tokens_per_s", "tokens / s (median of repetitions, min-max)", 1.0),
              ("median_tflops_per_gpu", "TFLOP/s per GPU", 1.0),
              ("peak_max_allocated_mb", "peak memory, max over ranks (GiB)", 1 / 1024),
              ("bubble", "measured bubble (plugin timeline)", 100.0)]
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.6))
    names = [s["variant"] for s in summary]
    colors = ["tab:blue" if n.startswith("stock") else "tab:orange" if "distopt" in n else "tab:green"
              for n in names]
    for ax, (key, label, scale) in zip(axes, panels):
        vals = [(s.get(key) or 0.0) * scale if s["status"] == "ok" else 0.0 for s in summary]
        err = None
        if key == "median_tokens_per_s":
            err = [[max(0.0, v - (s.get("min_tokens_per_s") or v)) for v, s in zip(vals, summary)],
                   [max(0.0, (s.get("max_tokens_per_s") or v) - v) for v, s in zip(vals, summary)]]
        bars = ax.bar(names, vals, color=colors, yerr=err, capsize=4 if err else 0)
        top = max(vals + [1e-9])
        for bar, s in zip(bars, summary):
            x = bar.get_x() + bar.get_width() / 2
            if s["status"] != "ok":
                ax.text(x, top * 0.05, "FAILED", ha="center", va="bottom", color="red", fontweight="bold", rotation=90)
                continue
            if key == "bubble" and s.get(key) is None:
                ax.text(x, 0, "n/a", ha="center", va="bottom", color="gray")
                continue
            ratio = s.get(f"ratio_{key}")
            if ratio is not None and s["variant"] != s.get("baseline"):
                ax.annotate(f"x{ratio:.2f}", (x, bar.get_height()), ha="center", va="bottom")
        ax.set_ylim(0, top * 1.15 if top > 1e-9 else 1.0)
        ax.set_title(label, fontsize=10)
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
        ax.grid(axis="y", alpha=0.3)
        if key == "bubble":
            ax.set_ylabel("%")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def analyse(out: Path, vs_names: list[str], records: list[RunRecord], seq: int, title: str, warmup: int,
            loss_rtol: float, loss_rtol_all: float, context: dict | None = None, placed_alike: bool = True) -> int:
    """Parse every run's log, write the CSVs, the rounds' table and the PNG, print the summary and the errors; 1
    when any. `context` (what ran: command, descriptions, iterations, cores, load) heads ab_rounds.md."""
    logs: dict[tuple[str, int], RunLog | None] = {}
    for r in records:
        p = Path(r.log)
        logs[(r.variant, r.rep)] = parse_log(p.read_text(errors="replace"), r.variant, seq) if p.is_file() else None
    rows, errors = summarize(vs_names, records, logs, warmup, loss_rtol, loss_rtol_all, placed_alike)
    rounds = round_ratios(records, logs, rows[0]["baseline"], warmup) if rows and rows[0]["baseline"] else []
    with_round_ranges(rows, rounds)
    iterations = []
    for r in records:
        run = logs.get((r.variant, r.rep))
        iterations += [dict(rec, rep=r.rep) for rec in (run.iterations if run else [])]
    write_csv(out / "ab_iterations.csv", iterations)
    write_csv(out / "ab_memory.csv", memory_per_rank(vs_names, records, logs))
    write_csv(out / "ab_summary.csv", rows)
    write_csv(out / "ab_rounds.csv", rounds)
    (out / "ab_rounds.md").write_text(rounds_markdown(title, rows, rounds, context))
    plot(rows, out / "ab_megatron.png", title)
    for s in rows:
        print(", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in s.items() if k != "logs"))
    for x in rounds:
        if x["variant"] != x["baseline"] and x["ratio_tokens_per_s"] is not None:
            print(f"round {x['round']}: {x['variant']} / {x['baseline']} = {x['ratio_tokens_per_s']:.3f}")
    print(f"wrote {out}/ab_summary.csv, ab_rounds.csv, ab_rounds.md, ab_iterations.csv, ab_memory.csv, "
          f"ab_megatron.png")
    for e in errors:
        print(f"error: {e}", file=sys.stderr)
    return 1 if errors else 0
