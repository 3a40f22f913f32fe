"""Simulator fidelity on this machine: predicted against measured trainer step times.

For each configuration (schedule x P x V x ZeRO stage, 4 local processes, gloo on CPU) the trainer runs
`--iters` iterations and predicts its own step time from costs measured on this machine
(`megatron_bfpp.train.measured_prediction`): F, B and STEP of every stage from its recorded timeline (median
over the iterations after a 2-iteration warm-up, at most 8), host work per action from each rank's CPU time,
collectives from a micro-benchmark on its own groups, the simulator over the very schedule it ran, and, since
four ranks share this machine's cores, the ranks' CPU time over the cores. This script collects each report's
prediction and the measured step time (median of the iterations after the warm-up), and re-times the same
measured costs with communication that cannot overlap compute (no spare core for gloo's threads). Each row
also says how many cores other processes kept busy meanwhile: they slow the run, not the prediction.

Run: python bench/sim_fidelity.py [--iters 12] [--only NAME ...]   (several minutes: one trainer per config)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megatron_bfpp.schedule import make_schedule
from megatron_bfpp.train import measured_prediction

WORLD = 4
MODEL = dict(num_layers=8, hidden_size=64, num_attention_heads=4, seq_length=64)
BATCH = dict(micro_batch_size=2, global_batch_size=16)

# name -> (schedule, P, layers per virtual stage or None, ZeRO stage)
CONFIGS: dict[str, tuple[str, int, int | None, int]] = {
    "1f1b-P2-Z1": ("1f1b", 2, None, 1),
    "interleaved-P2-V2-Z1": ("interleaved-1f1b", 2, 2, 1),
    "interleaved-P2-V4-Z3": ("interleaved-1f1b", 2, 1, 3),
    "breadth-first-P2-V2-Z3": ("breadth-first", 2, 2, 3),
    "breadth-first-P2-V4-Z3": ("breadth-first", 2, 1, 3),
    "breadth-first-P4-V2-Z1": ("breadth-first", 4, 1, 1),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_trainer(name: str, iters: int, workdir: Path) -> dict:
    sched, pp, lpv, zero = CONFIGS[name]
    report = workdir / f"{name}.json"
    m = MODEL
    cmd = [sys.executable, "-m", "megatron_bfpp.cli", "train", "--nproc-per-node", str(WORLD),
           "--master-port", str(_free_port()),
           "--num-layers", str(m["num_layers"]), "--hidden-size", str(m["hidden_size"]),
           "--num-attention-heads", str(m["num_attention_heads"]), "--seq-length", str(m["seq_length"]),
           "--max-position-embeddings", str(m["seq_length"]),
           "--micro-batch-size", str(BATCH["micro_batch_size"]), "--global-batch-size", str(BATCH["global_batch_size"]),
           "--train-iters", str(iters), "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "1",
           "--lr-decay-style", "cosine", "--seed", "1234", "--mock-data", "--log-interval", str(iters),
           "--pipeline-model-parallel-size", str(pp), "--pipeline-schedule", sched, "--zero-stage", str(zero),
           "--report-json", str(report)]
    if lpv is not None:
        cmd += ["--num-layers-per-virtual-pipeline-stage", str(lpv)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    log = workdir / f"{name}.log"
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        errors = [ln for ln in proc.stderr.splitlines() if "Error" in ln or "error:" in ln][:5]
        raise RuntimeError(f"trainer failed for {name} (rc {proc.returncode}, log {log}): " + " | ".join(errors))
    return json.loads(report.read_text())


def row(name: str, report: dict) -> dict:
    """The trainer's own prediction and measurement, and the same costs re-timed without overlap."""
    sched_name, pp, _, zero = CONFIGS[name]
    cfg, pred = report["config"], report["predicted"]
    if "costs" not in pred:
        raise RuntimeError(f"{name}: no measured prediction ({pred.get('measured_costs_error', pred.get('basis'))})")
    sched = make_schedule(sched_name, pp, cfg["vp"], cfg["microbatches"], cfg.get("group_size"), zero_stage=zero)
    serial = measured_prediction.predict(sched, measured_prediction.MachineCosts.from_dict(pred["costs"]),
                                         overlap=False)
    measured = pred["measured_step_time_s"]
    first, last = pred["measured_iterations"]
    times = report["iteration_times_s"][first - report["first_iteration"]: last - report["first_iteration"] + 1]
    return {"config": name, "P": pp, "V": cfg["vp"], "D": cfg["dp"], "M": cfg["microbatches"], "ZeRO": zero,
            "predicted_s": pred["step_time_s"], "predicted_no_overlap_s": serial["step_time_s"],
            "schedule_bound_s": pred["schedule_bound_s"], "cpu_bound_s": pred.get("cpu_bound_s"),
            "bound": pred["bound"], "measured_s": measured, "measured_min_s": min(times),
            "measured_max_s": max(times), "ratio": pred["step_time_s"] / measured,
            "ratio_no_overlap": serial["step_time_s"] / measured, "predicted_bubble": pred["bubble_fraction"],
            "other_processes_cores": (pred.get("cpu_bound_machine") or {}).get("other_processes_cores")}


def _cores(x: float | None) -> str:
    return "?" if x is None else f"{x:.1f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=12, help="trainer iterations per configuration (>= 4)")
    p.add_argument("--only", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    p.add_argument("--workdir", type=Path, default=None, help="keep reports and logs here")
    p.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    args = p.parse_args(argv)
    if args.iters < measured_prediction.WARMUP_ITERATIONS + 2:
        p.error(f"--iters must be >= {measured_prediction.WARMUP_ITERATIONS + 2} (warm-up, then timed iterations)")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for name in args.only:
            t0 = time.time()
            try:
                r = row(name, run_trainer(name, args.iters, work))
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                print(f"  {name}: {e}", file=sys.stderr)
                rows.append({"config": name, "failed": str(e)})
                continue
            r["load_average_1min"] = os.getloadavg()[0]
            rows.append(r)
            print(f"  {name}: predicted {r['predicted_s'] * 1e3:.1f} ms ({r['bound']}-bound), measured "
                  f"{r['measured_s'] * 1e3:.1f} ms ({time.time() - t0:.0f} s, load {r['load_average_1min']:.0f})",
                  file=sys.stderr)
    print(f"machine: {os.cpu_count()} cores\n")
    print("| configuration | P | V | D | M | ZeRO | predicted ms (bound) | schedule bound ms | predicted, no overlap ms "
          "| measured ms (min-max) | predicted / measured | no overlap / measured | other processes (cores) | load |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "failed" in r:
            print(f"| {r['config']} | trainer failed: {r['failed'][:80]} |")
            continue
        print(f"| {r['config']} | {r['P']} | {r['V']} | {r['D']} | {r['M']} | {r['ZeRO']} | "
              f"{r['predicted_s'] * 1e3:.0f} ({r['bound']}) | {r['schedule_bound_s'] * 1e3:.0f} | "
              f"{r['predicted_no_overlap_s'] * 1e3:.0f} | {r['measured_s'] * 1e3:.0f} "
              f"({r['measured_min_s'] * 1e3:.0f}-{r['measured_max_s'] * 1e3:.0f}) | {r['ratio']:.2f} | "
              f"{r['ratio_no_overlap']:.2f} | {_cores(r['other_processes_cores'])} | {r['load_average_1min']:.0f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
