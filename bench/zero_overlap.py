#!/usr/bin/env python3
"""Exposed data-parallel wait per step, measured: breadth-first vs interleaved-1f1b under ZeRO-1/2/3.

Runs the trainer (`bfpp train`, 4 processes: P = 2, V = 2, D = 2 by default) once per configuration with a
timeline of the last iterations, and prints, per configuration, the median step time, the exposed
data-parallel wait (time the compute stream waited on GATHER/REDUCE completions, from the recorded timeline),
the exposed p2p wait, the measured bubble (idle over step time; waits are never counted as compute, see
docs/timelines.md) and the data-parallel collectives per rank per step. Not a test: CPU timings on a shared
machine are noisy, so configurations are run in turn and each reports the median of its iterations.

    python bench/zero_overlap.py [--iters 8] [--out bench/results/zero_overlap.csv]
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CONFIGS = [(s, z) for s in ("breadth-first", "interleaved-1f1b") for z in (1, 2, 3)]


def run(schedule: str, zero: int, iters: int, workdir: Path, extra: list[str]) -> dict:
    report = workdir / f"{schedule}-z{zero}.json"
    cmd = [sys.executable, "-m", "megatron_bfpp.cli", "train", "--nproc-per-node", "4",
           "--num-layers", "8", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
           "--micro-batch-size", "1", "--global-batch-size", "16", "--train-iters", str(iters), "--lr", "1e-4",
           "--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "4",
           "--pipeline-schedule", schedule, "--zero-stage", str(zero), "--log-interval", "1000",
           "--report-json", str(report), *extra]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(report.read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--out", default="bench/results/zero_overlap.csv")
    args, extra = p.parse_known_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for schedule, zero in CONFIGS:
            rep = run(schedule, zero, args.iters, Path(tmp), extra)
            steady = rep["iteration_times_s"][1:] or rep["iteration_times_s"]
            comm = rep["comm"]
            rows.append({
                "schedule": schedule, "zero_stage": zero,
                "median_step_s": statistics.median(steady),
                "bubble": rep["measured"]["bubble"],
                "exposed_dp_wait_s": rep["measured"]["exposed_dp_wait_s"],
                "exposed_p2p_wait_s": rep["measured"]["exposed_p2p_wait_s"],
                "allgathers_per_rank": max(c["dp_allgather_calls"] for c in comm),
                "reduce_scatters_per_rank": max(c["dp_reduce_scatter_calls"] for c in comm),
                "dp_bytes_per_rank": max(c["dp_allgather_bytes"] + c["dp_reduce_scatter_bytes"]
                                         + c["dp_allreduce_bytes"] for c in comm),
            })
            print(f"{schedule:17s} ZeRO-{zero}: step {rows[-1]['median_step_s']*1e3:7.1f} ms, exposed dp wait "
                  f"{rows[-1]['exposed_dp_wait_s']*1e3:6.1f} ms", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print("\n| schedule | ZeRO | median step (ms) | bubble | exposed dp wait (ms) | exposed p2p wait (ms) | "
          "all-gathers | reduce-scatters | dp MB/rank |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['schedule']} | {r['zero_stage']} | {r['median_step_s']*1e3:.1f} | {r['bubble']:.1%} | "
              f"{r['exposed_dp_wait_s']*1e3:.1f} | {r['exposed_p2p_wait_s']*1e3:.1f} | {r['allgathers_per_rank']} | "
              f"{r['reduce_scatters_per_rank']} | {r['dp_bytes_per_rank']/1e6:.2f} |")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
