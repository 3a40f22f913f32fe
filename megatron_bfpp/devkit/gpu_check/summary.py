"""The GPU check's summary: its runs (NAME.cmd: the command, one argument per line; NAME.log; NAME.json: the
trainer's --report-json when there is one), each compared with its reference (losses within the bf16 tolerance,
step-time ratio), peak memory against the planner's prediction, the layer table; the printed table and the
gpu_check.json result.

Peak memory: measured is torch.cuda.max_memory_allocated (bfpp train's report) or Megatron's "max allocated"
memory log line; predicted is the planner's per-GPU total (`megatron_bfpp.sim.predict.memory`, through the device
kit's `workers.predicted_per_rank`) for the run's shape, schedule and ZeRO stage, without the profile's fixed
reserve (CUDA context, workspaces), which the allocator's figure does not include either.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Any

from ...schedule.kinds import megatron_kind
from ..iterations import ELAPSED_RE, ITERATION_RE, LOSS_RE, losses_agree, relative_differences
from ..plan import ALL_ITERATIONS_RTOL, FIRST_ITERATION_RTOL
from ..workers import predicted_per_rank
from .layer import layer_table

WARMUP_ITERATIONS = 2  # left out of the step-time medians (allocator, autotuning, NCCL set-up)
MEMORY_RE = re.compile(r"\(after \d+ iterations\) memory \(MB\) \| allocated: [0-9.]+ \| max allocated: ([0-9.]+)")


def _flag(args: list[str], name: str, default: str | None = None) -> str | None:
    return args[args.index(name) + 1] if name in args else default


def run_config(args: list[str]) -> dict[str, Any]:
    """Shape, schedule and ZeRO stage of a run from its command line (Megatron flag names)."""
    layers = int(_flag(args, "--num-layers"))
    lpvs = _flag(args, "--num-layers-per-virtual-pipeline-stage")
    pp = int(_flag(args, "--pipeline-model-parallel-size", "1"))
    vp = layers // pp // int(lpvs) if lpvs else 1
    bfpp = any(Path(x).name == "bfpp" for x in args) or "megatron_bfpp.train" in args
    world = int(_flag(args, "--nproc-per-node", "1"))
    schedule = _flag(args, "--pipeline-schedule", "breadth-first" if bfpp else "default")
    zero = _flag(args, "--zero-stage")
    if zero is None:  # bfpp train defaults to ZeRO-1; Megatron without the plugin is plain DDP or its dist-opt
        zero = "1" if bfpp or "--use-distributed-optimizer" in args else "0"
    vocab = int(_flag(args, "--vocab-size", "50257"))
    div = int(_flag(args, "--make-vocab-size-divisible-by", "128"))
    return {
        "tool": "bfpp train" if bfpp else "pretrain_gpt.py", "num_layers": layers,
        "hidden_size": int(_flag(args, "--hidden-size")), "num_attention_heads": int(_flag(args, "--num-attention-heads")),
        "seq_length": int(_flag(args, "--seq-length")), "vocab_size": -(-vocab // div) * div,
        "micro_batch_size": int(_flag(args, "--micro-batch-size", "1")),
        "global_batch_size": int(_flag(args, "--global-batch-size")), "pp": pp, "vp": vp, "dp": max(world // pp, 1),
        "schedule": schedule, "zero_stage": int(zero),
    }


def predicted_peak_bytes(cfg: dict[str, Any]) -> float:
    """The planner's per-GPU memory for a `run_config` (largest pipeline rank), without the profile's fixed
    reserve. Megatron's default schedule is 1F1B, interleaved with virtual stages."""
    schedule = cfg["schedule"]
    if schedule == "default":
        schedule = megatron_kind(cfg["vp"])
    m = cfg["global_batch_size"] // (cfg["micro_batch_size"] * cfg["dp"])  # per data-parallel rank
    return max(predicted_per_rank({**cfg, "microbatches": m, "pipeline_schedule": schedule}))


def log_metrics(text: str) -> tuple[list[float], list[float], float | None]:
    """lm losses, per-iteration seconds and peak "max allocated" bytes (None without a memory line) of a
    Megatron-style training log."""
    losses: list[float] = []
    seconds: list[float] = []
    peak = None
    for line in text.splitlines():
        if ITERATION_RE.search(line) and "elapsed time per iteration" in line:
            if (e := ELAPSED_RE.search(line)) is not None:
                seconds.append(float(e.group(1)) / 1e3)
            if (lm := LOSS_RE.search(line)) is not None:
                losses.append(float(lm.group(1)))
        if (mem := MEMORY_RE.search(line)) is not None:
            peak = max(peak or 0.0, float(mem.group(1)) * 2**20)
    return losses, seconds, peak


def read_run(out: Path, name: str) -> dict[str, Any]:
    """Losses, per-iteration seconds and measured peak bytes of run `name` (report JSON, else its log)."""
    args = (out / f"{name}.cmd").read_text().split("\n") if (out / f"{name}.cmd").exists() else []
    args = [x for x in args if x]
    run: dict[str, Any] = {"name": name, "command": args, "losses": [], "iteration_s": [], "peak_bytes": None}
    if args:
        run["config"] = run_config(args)
    report = out / f"{name}.json"
    if report.exists():
        r = json.loads(report.read_text())
        run["losses"] = list(r.get("losses", []))
        run["iteration_s"] = list(r.get("iteration_times_s", []))
        peaks = [m.get("peak_bytes") for m in r.get("memory", []) if m.get("peak_bytes") is not None]
        run["peak_bytes"] = max(peaks) if peaks else None
        return run
    log = out / f"{name}.log"
    if log.exists():
        run["losses"], run["iteration_s"], run["peak_bytes"] = log_metrics(log.read_text(errors="replace"))
    return run


def compare(run: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    """Loss agreement (bf16 tolerance) and step-time ratio of `run` against `ref`."""
    rel = relative_differences(run["losses"], ref["losses"])

    def med(t: list[float]) -> float | None:
        steady = t[WARMUP_ITERATIONS:] or t
        return statistics.median(steady) if steady else None

    ta, tb = med(run["iteration_s"]), med(ref["iteration_s"])
    return {"iterations": len(rel), "first_rel_diff": rel[0] if rel else None, "max_rel_diff": max(rel) if rel else None,
            "losses_ok": losses_agree(run["losses"], ref["losses"]), "step_s": ta, "ref_step_s": tb,
            "step_time_ratio": ta / tb if ta and tb else None}


def summarize(out: Path, pairs: list[str], not_run: list[str], hardware: str) -> dict[str, Any]:
    """The check's result (gpu_check.json) over its `pairs` ("RUN=REFERENCE"); runs in `not_run` (left out for the
    time budget) are listed, not compared. `failures` lists a run without iterations and a pair whose losses
    differ."""
    result: dict[str, Any] = {
        "tolerance": {"first_iteration_rtol": FIRST_ITERATION_RTOL, "all_iterations_rtol": ALL_ITERATIONS_RTOL,
                      "note": "relative |loss - reference loss| per iteration, bf16"},
        "hardware_profile": hardware, "runs": [], "pairs": [], "failures": [], "not_run": list(not_run),
    }
    runs: dict[str, dict] = {}
    for pair in pairs:
        name, _, ref = pair.partition("=")
        if name in not_run or ref in not_run:  # out of the check's time budget: said so, not compared
            result["pairs"].append({"run": name, "reference": ref, "not_run": True})
            continue
        for n in (name, ref):
            if n not in runs:
                runs[n] = read_run(out, n)
                r = runs[n]
                if "config" in r:
                    try:
                        r["predicted_peak_bytes"] = predicted_peak_bytes(r["config"])
                    except Exception as e:  # outside the planner's model: say so, keep the rest of the summary
                        r["prediction_error"] = str(e)
                    if r["peak_bytes"] and r.get("predicted_peak_bytes"):
                        r["memory_ratio"] = r["peak_bytes"] / r["predicted_peak_bytes"]
                if not r["losses"]:
                    result["failures"].append(f"{n}: no iterations (see {out / (n + '.log')})")
        c = compare(runs[name], runs[ref])
        c.update(run=name, reference=ref)
        if c["iterations"] and not c["losses_ok"]:
            result["failures"].append(
                f"{name} vs {ref}: losses differ (first {c['first_rel_diff']:.2e}, max {c['max_rel_diff']:.2e}; "
                f"tolerance {FIRST_ITERATION_RTOL:g} / {ALL_ITERATIONS_RTOL:g})")
        result["pairs"].append(c)
    result["runs"] = [{k: v for k, v in r.items() if k != "command"} | {"command": " ".join(r["command"])}
                      for r in runs.values()]
    layer = out / "layer.json"
    if layer.exists():
        result["layer"] = json.loads(layer.read_text())
    return result


def summary_table(result: dict[str, Any]) -> str:
    """The printed summary: one line per pair, one per reference, the tolerance, the layer table, what failed and
    what did not run."""
    def f(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    runs = {r["name"]: r for r in result["runs"]}
    w = max([len(p[k]) for p in result["pairs"] for k in ("run", "reference")] + [14])
    lines = [f"{'run':<{w}} {'reference':<{w}} {'iters':>5} {'loss[0]':>9} {'loss[-1]':>9} {'max rel':>9} "
             f"{'ok':>3} {'step ms':>8} {'ref ms':>8} {'ratio':>6} {'peak GiB':>9} {'plan GiB':>9} {'ratio':>6}"]
    for p in result["pairs"]:
        if p.get("not_run"):
            lines.append(f"{p['run']:<{w}} {p['reference']:<{w}} not run (the check's time budget was spent)")
            continue
        r = runs[p["run"]]
        losses = r["losses"]
        lines.append(
            f"{p['run']:<{w}} {p['reference']:<{w}} {p['iterations']:>5} {f(losses[0] if losses else None, '.4f'):>9} "
            f"{f(losses[-1] if losses else None, '.4f'):>9} {f(p['max_rel_diff'], '.2e'):>9} "
            f"{'yes' if p['losses_ok'] else 'NO':>3} {f(p['step_s'] and p['step_s'] * 1e3, '.1f'):>8} "
            f"{f(p['ref_step_s'] and p['ref_step_s'] * 1e3, '.1f'):>8} {f(p['step_time_ratio'], '.2f'):>6} "
            f"{f(r['peak_bytes'] and r['peak_bytes'] / 2**30, '.2f'):>9} "
            f"{f(r.get('predicted_peak_bytes') and r['predicted_peak_bytes'] / 2**30, '.2f'):>9} "
            f"{f(r.get('memory_ratio'), '.2f'):>6}")
    refs = {p["reference"] for p in result["pairs"] if p["reference"] in runs}
    for name in sorted(refs):
        r = runs[name]
        lines.append(f"{name:<{w}} {'(reference)':<{w}} {len(r['losses']):>5} "
                     f"{f(r['losses'][0] if r['losses'] else None, '.4f'):>9} "
                     f"{f(r['losses'][-1] if r['losses'] else None, '.4f'):>9} {'':>9} {'':>3} {'':>8} {'':>8} {'':>6} "
                     f"{f(r['peak_bytes'] and r['peak_bytes'] / 2**30, '.2f'):>9} "
                     f"{f(r.get('predicted_peak_bytes') and r['predicted_peak_bytes'] / 2**30, '.2f'):>9} "
                     f"{f(r.get('memory_ratio'), '.2f'):>6}")
    tol = result["tolerance"]
    lines.append(f"loss tolerance (bf16): relative difference <= {tol['first_iteration_rtol']:g} at iteration 1, "
                 f"<= {tol['all_iterations_rtol']:g} at every iteration; step times: median after "
                 f"{WARMUP_ITERATIONS} warm-up iterations; planner: '{result['hardware_profile']}' profile")
    if "layer" in result:
        lay = result["layer"]
        lines += ["", layer_table(lay["ops"], lay["model"], lay["hardware_profile"])
                  + (f"   [{lay.get('device', '?')}, {lay.get('spec', '?')} spec]" if "device" in lay else "")]
    for msg in result["failures"]:
        lines.append(f"FAILED: {msg}")
    for name in result.get("not_run", []):
        lines.append(f"NOT RUN: {name} (the check's time budget was spent)")
    return "\n".join(lines)
