#!/usr/bin/env python3
"""A/B: stock Megatron-LM at its best against megatron_bfpp, same model, layout, batch, data and seed.

Variants (--variants; each can get its own extra flags with --variant-flags NAME="...", and more variants can be
added with --add-variant NAME=stock|plugin:"FLAGS", e.g. later schedules):

- stock (stock-g<G> for each --stock-group-sizes G): the unmodified pretrain_gpt.py, interleaved 1F1B (virtual
  stages) with the micro-batch group size G, Megatron's distributed optimizer with --overlap-grad-reduce and
  --overlap-param-gather; the best of the stock-g<G> runs is the baseline;
- plugin-bf-distopt: `python -m megatron_bfpp.run_megatron_script`, --pipeline-schedule breadth-first with
  Megatron's own distributed optimizer and overlap flags (no --zero-stage): what the schedule buys;
- plugin-bf-zero3: the script runner, --pipeline-schedule breadth-first --zero-stage 3: what the sharding adds;
- plugin-izb-distopt, plugin-bfzb-zero3 (not in the default list): the split-backward schedules interleaved-zb
  with Megatron's distributed optimizer and breadth-first-zb with ZeRO-3 (under gradient-accumulation fusion,
  Megatron-LM's default, layers that cannot defer write main_grad at I, where ZeRO-3 then gives their stage its
  gradient buffer). Their W's move work only on layers
  that defer their weight GEMMs (Megatron-Core's local linears) and on TransformerEngine layers built with delay_wgrad_compute (TransformerEngine >= 2.7,
  2.8 with --overlap-grad-reduce); with an older TransformerEngine every W's work runs at its I, and these variants measure the
  split's overhead, not a gain (rank 0's log says how many linear layers deferred).

Every variant gets the same model-level settings: --bf16 (fp32 on --cpu-smoke), TransformerEngine layers when
importable (else --transformer-impl local, with a note), and at T > 1 --sequence-parallel plus, with
TransformerEngine, --tp-comm-overlap. Activation recomputation is off unless a variant needs it on the card:
--variant-flags stock="--recompute-granularity full --recompute-method uniform --recompute-num-layers 1".

Repetitions run interleaved (A B C A B C ...; --reps). Each run logs every iteration (--log-interval 1
--log-throughput --log-memory-interval 1); plugin variants also record a --timeline of their first iterations,
from which the measured bubble is taken. A run that exits non-zero, or logs no iteration after --warmup, fails
its variant, and so does a run that exits 0 before logging all of its --iters iterations, in any repetition:
the variant is marked failed in the CSV and the PNG (no numbers are built from a partial log) and the driver
exits 1 naming the variant, the repetition and the log. Every variant must train the same model as the baseline:
lm loss and grad norm at every iteration both logged agree (--loss-rtol at the first, --loss-rtol-all at every
one; bf16 tolerances by default), otherwise the driver exits 1.

Outputs in --out: <variant>.rep<k>.log, ab_runs.json (what ran), ab_iterations.csv, ab_memory.csv (peak
memory per rank), ab_summary.csv (per variant: status, medians over the repetitions' medians with min/max
spread of tokens/s, elapsed ms and TFLOP/s per GPU, peak memory, measured bubble, first-iteration loss,
deferred_linears: for split-backward variants how many of rank 0's linear layers deferred their weight GEMMs to
W (0: W has no work, e.g. TransformerEngine older than 2.3), ratios to the best stock) and ab_megatron.png.

    python scripts/ab_megatron.py --megatron-lm-dir ~/Megatron-LM --model 1.3b --gpus-per-node 8 --dry-run
    python scripts/ab_megatron.py --megatron-lm-dir ~/Megatron-LM --model 1.3b --gpus-per-node 8 --reps 3 --out ab-1.3b
    salloc -N 8 ... python scripts/ab_megatron.py --launcher srun --nnodes 8 --model 13b --out ab-13b
    python scripts/ab_megatron.py --parse-only --out ab-1.3b          # re-analyse existing logs
    python scripts/ab_megatron.py --cpu-smoke --out ab-cpu             # the real path on CPU (gloo, tiny GPT)
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CPU_SHIM = ROOT / "tests" / "support" / "cpu_shim"

# name -> (layers, hidden, heads, seq, tp, pp, layers per virtual stage, global batch); shapes as scripts/slurm/.
MODELS: dict[str, tuple[int, int, int, int, int, int, int, int]] = {
    "tiny": (8, 512, 8, 1024, 1, 4, 1, 16),
    "1.3b": (24, 2048, 16, 2048, 1, 4, 2, 64),
    "13b": (40, 5120, 40, 2048, 2, 8, 1, 128),
    "52b": (64, 8192, 64, 2048, 8, 8, 2, 128),
    "cpu-smoke": (4, 64, 4, 64, 1, 2, 1, 8),
}
DIST_OPT = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
BUILTIN = ("stock", "plugin-bf-distopt", "plugin-bf-zero3")
# On CPU: gloo, no fused kernels (the CPU shim's contract), fp32.
CPU_FLAGS = ["--distributed-backend", "gloo", "--num-workers", "0", "--no-gradient-accumulation-fusion",
             "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion",
             "--no-persist-layer-norm", "--hidden-dropout", "0", "--attention-dropout", "0"]

ITERATION_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|(.*)$")
FIELD_RE = {
    "elapsed_ms": re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)"),
    "tflops_per_gpu": re.compile(r"throughput per GPU \(TFLOP/s/GPU\): ([0-9.]+)"),
    "global_batch_size": re.compile(r"global batch size:\s*(\d+)"),
    "lm_loss": re.compile(r"lm loss: ([0-9.eE+-]+)"),
    "grad_norm": re.compile(r"grad norm: ([0-9.eE+-]+)"),
}
# "Same model" tolerances, relative, per logged iteration: bf16 (reduction order only at iteration 1; later the
# optimizer carries the differences forward, as in scripts/gpu_check.py) and fp32 (--cpu-smoke: the plugin matches
# stock Megatron-LM to 1e-5 in tests/megatron_lm/test_pretrain_gpt.py; 1e-4 leaves room for 2-process gloo reductions).
BF16_RTOL = {"first": 5e-3, "all": 2e-2}
FP32_RTOL = {"first": 1e-4, "all": 1e-4}
# The plugin's line, once per model chunk on rank 0, for split-backward schedules.
DEFERRAL_RE = re.compile(r"model chunk \d+: (\d+) linear layers defer their weight GEMMs to W")
MEMORY_RE = re.compile(
    r"\[Rank (\d+)\] \(after (\d+) iterations\) memory \(MB\) \| allocated: ([0-9.]+) \| max allocated: ([0-9.]+)"
    r"(?: \| reserved: ([0-9.]+) \| max reserved: ([0-9.]+))?"
)


@dataclass
class Variant:
    name: str
    plugin: bool  # through python -m megatron_bfpp.run_megatron_script
    flags: list[str]
    description: str = ""


@dataclass
class RunLog:
    variant: str
    iterations: list[dict] = field(default_factory=list)
    memory: list[dict] = field(default_factory=list)
    deferred_linears: int | None = None  # split backward: rank 0's linear layers whose W has work (None: no split)


@dataclass
class RunRecord:
    """One process of one variant (one repetition): what ran and how it ended."""

    variant: str
    rep: int
    log: str
    command: list[str]
    returncode: int | None = None
    timeline: str | None = None


def parse_log(text: str, variant: str, seq_length: int) -> RunLog:
    """Iteration and memory records from a Megatron-LM training log."""
    run = RunLog(variant)
    for line in text.splitlines():
        m = ITERATION_RE.search(line)
        if m and "elapsed time per iteration" in line:
            rec: dict = {"variant": variant, "iteration": int(m.group(1))}
            for key, rx in FIELD_RE.items():
                f = rx.search(m.group(2))
                rec[key] = float(f.group(1)) if f else None
            if rec["elapsed_ms"] and rec["global_batch_size"]:
                rec["tokens_per_s"] = rec["global_batch_size"] * seq_length / (rec["elapsed_ms"] / 1e3)
            else:
                rec["tokens_per_s"] = None
            run.iterations.append(rec)
            continue
        m = DEFERRAL_RE.search(line)
        if m:
            run.deferred_linears = (run.deferred_linears or 0) + int(m.group(1))
            continue
        m = MEMORY_RE.search(line)
        if m:
            run.memory.append({
                "variant": variant, "rank": int(m.group(1)), "iteration": int(m.group(2)),
                "allocated_mb": float(m.group(3)), "max_allocated_mb": float(m.group(4)),
                "max_reserved_mb": float(m.group(6)) if m.group(6) else None,
            })
    return run


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
              warmup: int, loss_rtol: float, loss_rtol_all: float) -> tuple[list[dict], list[str]]:
    """One summary row per variant and the list of errors (failed variants, loss mismatch)."""
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
        problem = same_model_problem(ours, theirs, loss_rtol, loss_rtol_all)
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


def same_model_problem(run: RunLog, base: RunLog, rtol_first: float, rtol_all: float) -> str | None:
    """Whether two runs trained the same model: lm loss and grad norm at every iteration both logged, within
    `rtol_first` at the first and `rtol_all` at every one (None: they agree). One iteration's loss alone is a weak
    test: every freshly initialised GPT of a vocabulary starts near ln(vocabulary); the later iterations and the
    gradient norms depend on the weights and the data."""
    theirs = {x["iteration"]: x for x in base.iterations}
    common = [(x, theirs[x["iteration"]]) for x in run.iterations if x["iteration"] in theirs]
    if not common or common[0][0].get("lm_loss") is None or common[0][1].get("lm_loss") is None:
        return "no lm loss in the iteration lines both runs logged"
    for k, (x, y) in enumerate(common):
        rtol, which = (rtol_first, "--loss-rtol") if k == 0 else (rtol_all, "--loss-rtol-all")
        for key, what in (("lm_loss", "lm loss"), ("grad_norm", "grad norm")):
            a, b = x.get(key), y.get(key)
            if a is None or b is None:
                continue  # not logged (grad norm: some Megatron-LM logging settings leave it out)
            if abs(a - b) > rtol * abs(b):
                return f"{what} {a:.6g} vs {b:.6g} at iteration {x['iteration']} (beyond {which} {rtol:g})"
    return None


def memory_per_rank(variants: list[str], records: list[RunRecord], logs: dict) -> list[dict]:
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--megatron-lm-dir", default=os.environ.get("MEGATRON_LM_DIR"),
                   help="Megatron-LM checkout (default: $MEGATRON_LM_DIR)")
    p.add_argument("--model", choices=sorted(MODELS), default="1.3b")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=8, help="processes per node")
    p.add_argument("--tp", type=int, help="tensor-parallel size (default: the model's)")
    p.add_argument("--pp", type=int, help="pipeline-parallel size (default: the model's)")
    p.add_argument("--layers-per-stage", type=int, help="layers per virtual stage (default: the model's)")
    p.add_argument("--mbs", type=int, default=1, help="micro-batch size")
    p.add_argument("--gbs", type=int, help="global batch size (default: the model's)")
    p.add_argument("--iters", type=int, default=30, help="training iterations per run")
    p.add_argument("--warmup", type=int, default=5, help="iterations left out of the medians")
    p.add_argument("--reps", type=int, default=3, help="repetitions per variant, interleaved A B C A B C ...")
    p.add_argument("--variants", default=",".join(BUILTIN),
                   help=f"comma-separated, run in this order (default {','.join(BUILTIN)}; 'stock' expands to "
                        f"stock-g<G> for each --stock-group-sizes G; also built in: plugin-izb-distopt, "
                        f"plugin-bfzb-zero3)")
    p.add_argument("--stock-group-sizes", default="auto",
                   help="stock's --microbatch-group-size-per-virtual-pipeline-stage candidates, comma-separated; the "
                        "best is the baseline (default auto: P and 2P where 2P divides M)")
    p.add_argument("--variant-flags", action="append", default=[], metavar='NAME="FLAGS"',
                   help="extra Megatron flags for one variant (repeatable)")
    p.add_argument("--add-variant", action="append", default=[], metavar='NAME=stock|plugin:"FLAGS"',
                   help="another variant: the stock script or the plugin's script runner with these flags (repeatable)")
    p.add_argument("--transformer-impl", choices=("auto", "local", "transformer_engine"), default="auto",
                   help="auto: TransformerEngine when importable where the ranks run, else local (with a note)")
    p.add_argument("--no-tp-comm-overlap", action="store_true", help="no --tp-comm-overlap at T > 1")
    p.add_argument("--data-path", help="Megatron --data-path PREFIX (default: mock data)")
    p.add_argument("--vocab-file")
    p.add_argument("--merge-file")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--loss-rtol", type=float,
                   help="same model: relative lm loss and grad norm agreement at the first iteration (default 5e-3 "
                   "bf16, 1e-4 fp32)")
    p.add_argument("--loss-rtol-all", type=float,
                   help="same model: the same at every iteration both runs logged (default 2e-2 bf16, 1e-4 fp32)")
    p.add_argument("--launcher", choices=("torchrun", "srun"), default="torchrun",
                   help="torchrun on this node, or srun + torchrun inside a SLURM allocation (site options: "
                        "$BFPP_SRUN_ARGS)")
    p.add_argument("--master-port", type=int, default=29500, help="first rendezvous port (one more per run)")
    p.add_argument("--out", default="ab-megatron", help="output directory (logs, CSVs, PNG)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the working directory and every command in run order, run the project's flag check")
    p.add_argument("--no-check", action="store_true", help="skip the flag check (python -m megatron_bfpp.megatron.check)")
    p.add_argument("--parse-only", action="store_true", help="only parse the logs already in --out (ab_runs.json)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="the real path on CPU: tiny GPT, 2 gloo processes, mock data, fp32, a few iterations, through "
                        "the test-only CPU shim (tests/support/cpu_shim)")
    p.add_argument("extra", nargs="*", help="extra Megatron flags for every variant (after --)")
    return p


def _abs(path: str | None) -> str | None:
    return str(Path(path).expanduser().absolute()) if path else None


def apply_cpu_smoke(a: argparse.Namespace) -> None:
    a.model, a.nnodes, a.gpus_per_node, a.launcher = "cpu-smoke", 1, 2, "torchrun"
    a.iters = a.iters if a.iters != 30 else 6
    a.warmup = a.warmup if a.warmup != 5 else 2
    a.reps = a.reps if a.reps != 3 else 1
    a.transformer_impl = "local"
    if a.loss_rtol is None:
        a.loss_rtol = FP32_RTOL["first"]
    if a.loss_rtol_all is None:
        a.loss_rtol_all = FP32_RTOL["all"]


def layout(a: argparse.Namespace) -> dict:
    layers, hidden, heads, seq, tp, pp, lps, gbs = MODELS[a.model]
    tp, pp, lps, gbs = a.tp or tp, a.pp or pp, a.layers_per_stage or lps, a.gbs or gbs
    world = a.nnodes * a.gpus_per_node
    if world % (tp * pp):
        raise SystemExit(f"error: {a.nnodes} node(s) x {a.gpus_per_node} = {world} ranks is not a multiple of "
                         f"TP x PP = {tp * pp}")
    dp = world // (tp * pp)
    return dict(layers=layers, hidden=hidden, heads=heads, seq=seq, tp=tp, pp=pp, lps=lps, gbs=gbs, world=world,
                dp=dp, m=gbs // (a.mbs * dp))


def common_flags(a: argparse.Namespace, lay: dict, impl: str) -> list[str]:
    flags = [
        "--num-layers", str(lay["layers"]), "--hidden-size", str(lay["hidden"]),
        "--num-attention-heads", str(lay["heads"]), "--seq-length", str(lay["seq"]),
        "--max-position-embeddings", str(lay["seq"]),
        "--tensor-model-parallel-size", str(lay["tp"]), "--pipeline-model-parallel-size", str(lay["pp"]),
        "--num-layers-per-virtual-pipeline-stage", str(lay["lps"]),
        "--micro-batch-size", str(a.mbs), "--global-batch-size", str(lay["gbs"]),
        "--transformer-impl", impl,
        "--lr", "1.5e-4", "--min-lr", "1.5e-5", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
        "--weight-decay", "0.1", "--clip-grad", "1.0", "--init-method-std", "0.006",
        "--train-iters", str(a.iters), "--eval-iters", "0", "--eval-interval", str(a.iters + 1),
        "--log-interval", "1", "--log-throughput", "--log-memory-interval", "1", "--seed", str(a.seed),
    ]
    flags += CPU_FLAGS if a.cpu_smoke else ["--bf16"]
    if lay["tp"] > 1:
        flags.append("--sequence-parallel")
        if impl == "transformer_engine" and not a.no_tp_comm_overlap:
            flags.append("--tp-comm-overlap")
    if a.data_path:
        if not (a.vocab_file and a.merge_file):
            raise SystemExit("error: --data-path needs --vocab-file and --merge-file (GPT2BPETokenizer)")
        flags += ["--data-path", _abs(a.data_path), "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
                  _abs(a.vocab_file), "--merge-file", _abs(a.merge_file), "--split", "949,50,1"]
    else:
        flags += ["--mock-data", "--tokenizer-type", "NullTokenizer",
                  "--vocab-size", "128" if a.cpu_smoke else "50257"]
    return flags + list(a.extra)


def stock_group_sizes(a: argparse.Namespace, lay: dict) -> list[int]:
    if a.stock_group_sizes != "auto":
        return [int(g) for g in a.stock_group_sizes.split(",") if g.strip()]
    pp, m = lay["pp"], lay["m"]
    return [pp] + ([2 * pp] if 2 * pp <= m and m % (2 * pp) == 0 else [])


def variants(a: argparse.Namespace, lay: dict) -> list[Variant]:
    out: list[Variant] = []
    groups = stock_group_sizes(a, lay)
    table = {
        "plugin-bf-distopt": Variant("plugin-bf-distopt", True, ["--pipeline-schedule", "breadth-first", *DIST_OPT],
                                     "breadth-first, Megatron's distributed optimizer"),
        "plugin-bf-zero3": Variant("plugin-bf-zero3", True, ["--pipeline-schedule", "breadth-first", "--zero-stage", "3"],
                                   "breadth-first, the plugin's ZeRO-3"),
        "plugin-izb-distopt": Variant("plugin-izb-distopt", True, ["--pipeline-schedule", "interleaved-zb", *DIST_OPT],
                                      "interleaved zero-bubble (split backward), Megatron's distributed optimizer"),
        "plugin-bfzb-zero3": Variant("plugin-bfzb-zero3", True,
                                     ["--pipeline-schedule", "breadth-first-zb", "--zero-stage", "3"],
                                     "breadth-first with W deferral (split backward), the plugin's ZeRO-3"),
    }
    for spec in a.add_variant:
        name, _, rest = spec.partition("=")
        kind, _, flags = rest.partition(":")
        if not name or kind not in ("stock", "plugin"):
            raise SystemExit(f"error: --add-variant {spec!r}: use NAME=stock:\"FLAGS\" or NAME=plugin:\"FLAGS\"")
        table[name] = Variant(name, kind == "plugin", shlex.split(flags), f"added ({kind})")
    for name in [v.strip() for v in a.variants.split(",") if v.strip()]:
        if name == "stock":
            for g in groups:
                out.append(Variant("stock" if len(groups) == 1 else f"stock-g{g}", False,
                                   [*DIST_OPT, "--microbatch-group-size-per-virtual-pipeline-stage", str(g)],
                                   f"Megatron interleaved 1F1B, group size {g}, distributed optimizer"))
        elif name in table:
            out.append(table[name])
        else:
            raise SystemExit(f"error: --variants {name} unknown: choose from {', '.join(['stock', *table])}")
    extra: dict[str, list[str]] = {}
    for spec in a.variant_flags:
        name, _, flags = spec.partition("=")
        extra.setdefault(name, []).extend(shlex.split(flags))
    names = {v.name for v in out}
    for name, flags in extra.items():
        targets = [v for v in out if v.name == name or (name == "stock" and v.name.startswith("stock"))]
        if not targets:
            raise SystemExit(f"error: --variant-flags {name}=...: no such variant among {', '.join(sorted(names))}")
        for v in targets:
            v.flags = v.flags + flags
    return out


def detect_transformer_impl(a: argparse.Namespace) -> str:
    if a.transformer_impl != "auto":
        return a.transformer_impl
    probe = ["python", "-c", "import transformer_engine.pytorch"]
    if a.launcher == "srun" and not a.dry_run:
        probe = ["srun", "--nodes=1", "--ntasks=1", *site_srun_args(), *probe]
    try:
        ok = subprocess.run(probe, capture_output=True, timeout=300).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    if not ok:
        print("note: TransformerEngine is not importable where the ranks run: every variant runs with "
              "--transformer-impl local (README, GPU environment)", file=sys.stderr)
    return "transformer_engine" if ok else "local"


def site_srun_args() -> list[str]:
    return shlex.split(os.environ.get("BFPP_SRUN_ARGS", ""))


def launch_prefix(a: argparse.Namespace, port: int, run_id: str) -> list[str]:
    if a.launcher == "srun":
        nodelist = os.environ.get("SLURM_JOB_NODELIST")
        host = "<first node of the allocation>"
        if nodelist and not a.dry_run:
            host = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                                  text=True).stdout.split()[0]
        return ["srun", f"--nodes={a.nnodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1", *site_srun_args(),
                "torchrun", "--nnodes", str(a.nnodes), "--nproc-per-node", str(a.gpus_per_node),
                "--rdzv-id", f"{os.environ.get('SLURM_JOB_ID', 'ab')}-{run_id}", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{host}:{port}"]
    return ["torchrun", "--nnodes", "1", "--nproc-per-node", str(a.gpus_per_node), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"localhost:{port}"]


def run_env(a: argparse.Namespace, mlm: str) -> dict[str, str]:
    env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1", TORCH_NCCL_ASYNC_ERROR_HANDLING="1",
               PYTHONUNBUFFERED="1")
    paths = [str(ROOT), mlm]
    if a.cpu_smoke:
        paths.insert(0, str(CPU_SHIM))
        env.update(BFPP_CPU_SHIM="1", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = ":".join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def plan(a: argparse.Namespace, mlm: str, out: Path, vs: list[Variant], flags: list[str]) -> list[RunRecord]:
    """Every run in order: repetitions interleaved A B C A B C."""
    script = str(Path(mlm) / "pretrain_gpt.py")
    records, k = [], 0
    for rep in range(1, a.reps + 1):
        for v in vs:
            log = out / f"{v.name}.rep{rep}.log"
            vflags = flags + v.flags
            timeline = None
            if v.plugin:
                timeline = str(out / f"{v.name}.rep{rep}.timeline.json")
                vflags = vflags + ["--timeline", timeline]
            entry = ["-m", "megatron_bfpp.run_megatron_script", script] if v.plugin else [script]
            cmd = launch_prefix(a, a.master_port + k, f"{v.name}-{rep}") + entry + vflags
            records.append(RunRecord(v.name, rep, str(log), cmd, timeline=timeline))
            k += 1
    return records


def check_flags(a: argparse.Namespace, mlm: str, vs: list[Variant], flags: list[str], world: int) -> list[str]:
    """The project's check (Megatron's parser and validate_args, then the plugin's) on every variant's flags, in
    one process with the Megatron-LM checkout first on the path; returns one verdict line per variant."""
    code = (
        "import json, sys\n"
        "from megatron_bfpp.megatron.check import check\n"
        "bad = 0\n"
        "for name, flags in json.load(sys.stdin):\n"
        "    try:\n"
        "        print(f'{name}: ok: {check(flags, world_size=" + str(world) + ")}')\n"
        "    except SystemExit as e:\n"
        "        bad = 1; print(f'{name}: Megatron-LM rejects the arguments (argparse exit {e.code})')\n"
        "    except Exception as e:\n"
        "        bad = 1; print(f'{name}: rejected: {type(e).__name__}: {e}')\n"
        "sys.exit(bad)\n"
    )
    payload = json.dumps([[v.name, flags + v.flags] for v in vs])
    env = run_env(a, mlm)
    env.pop("BFPP_CPU_SHIM", None)
    r = subprocess.run([sys.executable, "-c", code], input=payload, capture_output=True, text=True, env=env,
                       cwd=mlm if Path(mlm).is_dir() else None, timeout=600)
    lines = [ln for ln in r.stdout.splitlines() if ": ok: " in ln or ": rejected" in ln or "rejects" in ln]
    if r.returncode != 0:
        errs = [ln for ln in r.stderr.splitlines() if "error" in ln.lower() and "warn" not in ln.lower()]
        detail = "\n".join(lines + errs[-5:]) or r.stderr.strip()[-2000:]
        raise SystemExit(f"error: the project's flag check rejects a variant:\n{detail}\n"
                         f"(python -m megatron_bfpp.megatron.check --world-size {world} -- FLAGS for details)")
    return lines


def shell_line(cmd: list[str]) -> str:
    return " ".join(shlex.quote(c) for c in cmd)


def analyse(a: argparse.Namespace, out: Path, vs_names: list[str], records: list[RunRecord], seq: int,
            title: str) -> int:
    logs: dict[tuple[str, int], RunLog | None] = {}
    for r in records:
        p = Path(r.log)
        logs[(r.variant, r.rep)] = parse_log(p.read_text(errors="replace"), r.variant, seq) if p.is_file() else None
    rows, errors = summarize(vs_names, records, logs, a.warmup, a.loss_rtol, a.loss_rtol_all)
    iterations = []
    for r in records:
        run = logs.get((r.variant, r.rep))
        iterations += [dict(rec, rep=r.rep) for rec in (run.iterations if run else [])]
    write_csv(out / "ab_iterations.csv", iterations)
    write_csv(out / "ab_memory.csv", memory_per_rank(vs_names, records, logs))
    write_csv(out / "ab_summary.csv", rows)
    plot(rows, out / "ab_megatron.png", title)
    for s in rows:
        print(", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in s.items() if k != "logs"))
    print(f"wrote {out}/ab_summary.csv, ab_iterations.csv, ab_memory.csv, ab_megatron.png")
    for e in errors:
        print(f"error: {e}", file=sys.stderr)
    return 1 if errors else 0


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.cpu_smoke:
        apply_cpu_smoke(a)
        if not (CPU_SHIM / "sitecustomize.py").is_file():
            print(f"error: --cpu-smoke needs the test-only CPU shim {CPU_SHIM}/sitecustomize.py (a source checkout "
                  f"of megatron_bfpp)", file=sys.stderr)
            return 2
    if a.loss_rtol is None:
        a.loss_rtol = BF16_RTOL["first"]
    if a.loss_rtol_all is None:
        a.loss_rtol_all = BF16_RTOL["all"]
    out = Path(a.out).expanduser().absolute()
    lay = layout(a)
    title = (f"GPT {a.model}: {lay['world']} ranks, TP={lay['tp']} PP={lay['pp']} DP={lay['dp']}, M={lay['m']}"
             f" - stock Megatron vs megatron_bfpp")

    if a.parse_only:
        manifest = out / "ab_runs.json"
        if not manifest.is_file():
            print(f"error: {manifest} not found: run the driver first (it records what ran there)", file=sys.stderr)
            return 2
        data = json.loads(manifest.read_text())
        records = [RunRecord(**r) for r in data["runs"]]
        return analyse(a, out, data["variants"], records, data["seq_length"], data.get("title", title))

    mlm = _abs(a.megatron_lm_dir)
    if not mlm or not (a.dry_run or (Path(mlm) / "pretrain_gpt.py").is_file()):
        print("error: --megatron-lm-dir (or $MEGATRON_LM_DIR) must point at a Megatron-LM checkout with "
              "pretrain_gpt.py", file=sys.stderr)
        return 2
    mlm = str(Path(mlm).resolve()) if Path(mlm).is_dir() else mlm
    impl = detect_transformer_impl(a)
    flags = common_flags(a, lay, impl)
    vs = variants(a, lay)
    records = plan(a, mlm, out, vs, flags)

    if a.dry_run:
        print(f"# {title}")
        print(f"# working directory: {mlm}")
        print(f"# training script:   {Path(mlm) / 'pretrain_gpt.py'}")
        print(f"# output:            {out}")
        print(f"# order:             {' '.join(f'{r.variant}#{r.rep}' for r in records)}")
        if not a.no_check:
            for line in check_flags(a, mlm, vs, flags, lay["world"]):
                print(f"# check {line}")
        env = "CUDA_DEVICE_MAX_CONNECTIONS=1 TORCH_NCCL_ASYNC_ERROR_HANDLING=1"
        for r in records[: len(vs)]:
            print(f"# {r.variant}: log -> {r.log}")
            print(f"{env} {shell_line(r.command)}")
        return 0

    out.mkdir(parents=True, exist_ok=True)
    if not a.no_check:
        for line in check_flags(a, mlm, vs, flags, lay["world"]):
            print(f"check {line}")
    env = run_env(a, mlm)
    manifest = {"variants": [v.name for v in vs], "seq_length": lay["seq"], "title": title, "runs": []}
    for r in records:
        print(f"running {r.variant} (repetition {r.rep}/{a.reps}) -> {r.log}", flush=True)
        with open(r.log, "w") as f:
            f.write(f"# cd {shlex.quote(mlm)} && {shell_line(r.command)}\n")
            f.flush()
            try:
                r.returncode = subprocess.run(r.command, stdout=f, stderr=subprocess.STDOUT, cwd=mlm,
                                              env=dict(env, BFPP_AB_VARIANT=r.variant, BFPP_AB_REP=str(r.rep))).returncode
            except OSError as e:
                f.write(f"\ncould not start: {e}\n")
                r.returncode = 127
        if r.returncode != 0:
            print(f"warning: {r.variant} (repetition {r.rep}) exited with {r.returncode}; see {r.log}", file=sys.stderr)
        manifest["runs"].append(asdict(r))
        (out / "ab_runs.json").write_text(json.dumps(manifest, indent=1))
    return analyse(a, out, manifest["variants"], records, lay["seq"], title)


if __name__ == "__main__":
    sys.exit(main())
