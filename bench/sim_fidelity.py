"""Simulator fidelity on this machine: predicted against measured trainer step times.

For each configuration (schedule x P x V x ZeRO stage, 4 local processes, gloo on CPU) the trainer runs
`--iters` iterations with its timeline recorded; the first two are warm-up and left out. The first half of
the remaining iterations calibrates:
- F and B seconds per stage: the median of each recorded compute event minus the waits inside it;
- the step's work outside the pipeline schedule (optimizer, ZeRO-1/2 parameter all-gather, data, logging):
  the iteration time minus the schedule's span.
Collective costs come from a separate gloo micro-benchmark on the same machine (latency + bytes / bandwidth
fitted for all-gather and reduce-scatter over two ranks and for p2p send/recv). These measured costs go into
`Costs.from_measurements`, the simulator times the very schedule the trainer ran, and the prediction is
compared with the median measured step time of the second half of the iterations.

Run: python bench/sim_fidelity.py [--iters 12] [--only NAME ...]   (several minutes: one trainer per config)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_bfpp.schedule import make_schedule
from megatron_bfpp.sim import Costs, ModelProfile, Partition, simulate_schedule

WORLD = 4
WARMUP = 2  # iterations left out entirely (allocator and gloo warm-up make them several times slower)
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


# ---------------------------------------------------------------- collective micro-benchmark

_SIZES = [2**k for k in range(12, 21)]  # fp32 elements: 16 KiB .. 4 MiB


def _bench_worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = pairs[rank // 2]
    res: dict[str, list[tuple[int, float]]] = {"all_gather": [], "reduce_scatter": [], "p2p": []}
    for n in _SIZES:
        full, shard = torch.zeros(n), torch.zeros(n // 2)
        for kind in ("all_gather", "reduce_scatter", "p2p"):
            times = []
            for _ in range(7):
                dist.barrier()
                t0 = time.perf_counter()
                if kind == "all_gather":
                    dist.all_gather_into_tensor(full, shard, group=group)
                elif kind == "reduce_scatter":
                    dist.reduce_scatter_tensor(shard, full, group=group)
                elif rank < 2:  # pipeline-like pairs 0 -> 2 and 1 -> 3, concurrently
                    dist.send(full, rank + 2)
                else:
                    dist.recv(full, rank - 2)
                times.append(time.perf_counter() - t0)
            res[kind].append((n * 4, statistics.median(times[2:])))
    if rank == 0:
        Path(out).write_text(json.dumps(res))
    dist.destroy_process_group()


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares t = latency + bytes / bandwidth; returns (latency s, bandwidth bytes/s)."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    slope = max(slope, 1e-15)
    return max(my - slope * mx, 0.0), 1.0 / slope


def measure_collectives() -> dict[str, tuple[float, float]]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "coll.json")
        mp.spawn(_bench_worker, args=(_free_port(), out), nprocs=WORLD, join=True)
        res = json.loads(Path(out).read_text())
    return {k: _fit(v) for k, v in res.items()}


# ---------------------------------------------------------------- one trainer run

def run_trainer(name: str, iters: int, workdir: Path) -> tuple[dict, dict]:
    sched, pp, lpv, zero = CONFIGS[name]
    report, timeline = workdir / f"{name}.json", workdir / f"{name}_timeline.json"
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
           "--report-json", str(report), "--timeline", str(timeline),
           "--timeline-iterations", ",".join(str(i) for i in range(WARMUP + 1, iters + 1))]
    if lpv is not None:
        cmd += ["--num-layers-per-virtual-pipeline-stage", str(lpv)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    log = workdir / f"{name}.log"
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        errors = [ln for ln in proc.stderr.splitlines() if "Error" in ln or "error:" in ln][:5]
        raise RuntimeError(f"trainer failed for {name} (rc {proc.returncode}, log {log}): " + " | ".join(errors))
    return json.loads(report.read_text()), json.loads(timeline.read_text())


def _events(trace: dict) -> list[dict]:
    return [e for e in trace["traceEvents"] if e.get("ph") == "X"]


def calibrate(report: dict, trace: dict, calib: set[int]) -> tuple[dict[tuple[str, int], float], float]:
    """Per (op, stage) median net compute seconds and the median out-of-schedule seconds per iteration."""
    evs = [e for e in _events(trace) if e["args"].get("iteration") in calib]
    waits: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for e in evs:
        if e["args"].get("op") == "WAIT":
            waits.setdefault((e["pid"], e["args"]["iteration"]), []).append((e["ts"], e["ts"] + e["dur"]))
    samples: dict[tuple[str, int], list[float]] = {}
    for e in evs:
        op = e["args"].get("op")
        if op not in ("F", "B"):
            continue
        t0, t1 = e["ts"], e["ts"] + e["dur"]
        inside = sum(max(0.0, min(t1, b) - max(t0, a)) for a, b in waits.get((e["pid"], e["args"]["iteration"]), []))
        samples.setdefault((op, e["args"]["stage"]), []).append(max(e["dur"] - inside, 0.0) / 1e6)
    costs = {k: statistics.median(v) for k, v in samples.items()}
    outside = []
    times = report["iteration_times_s"]
    for it in calib:
        span = [e for e in evs if e["args"]["iteration"] == it]
        window = (max(e["ts"] + e["dur"] for e in span) - min(e["ts"] for e in span)) / 1e6
        outside.append(max(times[it - 1] - window, 0.0))
    return costs, statistics.median(outside)


def predict(name: str, report: dict, trace: dict, coll: dict[str, tuple[float, float]], iters: int) -> dict:
    sched_name, pp, lpv, zero = CONFIGS[name]
    cfg = report["config"]
    vp, dp, m = cfg["vp"], cfg["dp"], cfg["microbatches"]
    recorded = list(range(WARMUP + 1, iters + 1))
    calib = set(recorded[: len(recorded) // 2])
    test = [i for i in recorded if i not in calib]
    fb, outside = calibrate(report, trace, calib)
    n_stages = pp * vp
    model = ModelProfile("fidelity", MODEL["num_layers"], MODEL["hidden_size"], MODEL["num_attention_heads"],
                     MODEL["seq_length"], cfg["vocab_size"])
    part = Partition(model, 1, pp, vp)
    param_bytes = [4.0 * part.stage_params(s) for s in range(n_stages)]  # fp32 on CPU, gathered and reduced
    p2p_lat, p2p_bw = coll["p2p"]
    ag_lat, ag_bw = coll["all_gather"]
    rs_lat, rs_bw = coll["reduce_scatter"]
    # The micro-benchmark fits the whole collective over 2 ranks; from_measurements applies (D-1)/D of the
    # bytes, so express the fitted bandwidth per byte of the full tensor.
    frac = (dp - 1) / dp if dp > 1 else 1.0
    costs = Costs.from_measurements(
        n_stages, pp, forward=[fb[("F", s)] for s in range(n_stages)], backward=[fb[("B", s)] for s in range(n_stages)],
        p2p_bytes=4.0 * BATCH["micro_batch_size"] * MODEL["seq_length"] * MODEL["hidden_size"],
        p2p_bandwidth=p2p_bw, p2p_latency=p2p_lat, stage_param_bytes=param_bytes, dp=dp,
        gather_bandwidth=ag_bw * frac, reduce_bandwidth=rs_bw * frac, collective_latency=max(ag_lat, rs_lat),
        zero_stage=zero, optimizer=outside, stage_grad_bytes=param_bytes)
    costs.param_sync = [0.0] * n_stages  # ZeRO-1/2: the trainer all-gathers in its optimizer step, measured above
    sched = make_schedule(sched_name, pp, vp, m, cfg.get("group_size"), zero_stage=zero)
    sim = simulate_schedule(sched, costs, record_events=False)
    # Same costs with communication that cannot overlap compute (no spare core for gloo's threads).
    costs.dp_overlap = costs.p2p_overlap = False
    serial = simulate_schedule(sched, costs, record_events=False)
    times = [report["iteration_times_s"][i - 1] for i in test]
    measured = statistics.median(times)
    return {"config": name, "P": pp, "V": vp, "D": dp, "M": m, "ZeRO": zero, "predicted_s": sim.step_time_s,
            "predicted_no_overlap_s": serial.step_time_s, "measured_s": measured, "measured_min_s": min(times),
            "measured_max_s": max(times), "ratio": sim.step_time_s / measured,
            "ratio_no_overlap": serial.step_time_s / measured,
            "predicted_bubble": sim.bubble_fraction, "outside_schedule_s": outside}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=12, help="trainer iterations per configuration (>= 6)")
    p.add_argument("--only", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    p.add_argument("--workdir", type=Path, default=None, help="keep reports and timelines here")
    p.add_argument("--json", type=Path, default=None, help="also write the rows as JSON")
    args = p.parse_args(argv)
    if args.iters < WARMUP + 4:
        p.error(f"--iters must be >= {WARMUP + 4} (warm-up, then separate calibration and measurement iterations)")
    coll = measure_collectives()
    print("collectives (latency us, bandwidth MB/s): " + ", ".join(
        f"{k} {lat * 1e6:.0f} / {bw / 1e6:.0f}" for k, (lat, bw) in coll.items()), file=sys.stderr)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for name in args.only:
            t0 = time.time()
            try:
                report, trace = run_trainer(name, args.iters, work)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                print(f"  {name}: {e}", file=sys.stderr)
                rows.append({"config": name, "failed": str(e)})
                continue
            row = predict(name, report, trace, coll, args.iters)
            row["load_average_1min"] = os.getloadavg()[0]
            rows.append(row)
            print(f"  {name}: predicted {row['predicted_s'] * 1e3:.1f} ms, measured {row['measured_s'] * 1e3:.1f} ms "
                  f"({time.time() - t0:.0f} s, load {row['load_average_1min']:.0f})", file=sys.stderr)
    print(f"machine: {os.cpu_count()} cores\n")
    print("| configuration | P | V | D | M | ZeRO | predicted ms | predicted, no overlap ms | measured ms (min-max) "
          "| predicted / measured | no overlap / measured | load |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "failed" in r:
            print(f"| {r['config']} | trainer failed: {r['failed'][:80]} |")
            continue
        print(f"| {r['config']} | {r['P']} | {r['V']} | {r['D']} | {r['M']} | {r['ZeRO']} | "
              f"{r['predicted_s'] * 1e3:.0f} | {r['predicted_no_overlap_s'] * 1e3:.0f} | {r['measured_s'] * 1e3:.0f} "
              f"({r['measured_min_s'] * 1e3:.0f}-{r['measured_max_s'] * 1e3:.0f}) | {r['ratio']:.2f} | "
              f"{r['ratio_no_overlap']:.2f} | {r['load_average_1min']:.0f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
