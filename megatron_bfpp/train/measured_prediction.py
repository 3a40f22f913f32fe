"""The step time of a run predicted from costs measured on the machine it runs on.

Measured, per action (nothing is fitted to the step time):
- F, B (I, W) and STEP of every stage: the median of its recorded occurrences over the calibration
  iterations (`timeline_costs`), the first `WARMUP_ITERATIONS` left out;
- host work per compute action, per pipeline rank: the main thread's CPU time per iteration (median) less the
  recorded actions it spent it in, spread over the rank's F/B actions (Python around the actions: posting
  p2p, launching collectives, the trainer's bookkeeping);
- collectives: latency and bandwidth of all-gather, reduce-scatter and p2p from `comm_bench` (timed on the
  run's own groups at fixed sizes and, for the data-parallel ones, the run's largest stage);
- on CPU, every rank's process CPU time per iteration (median: compute, Python, the backend's threads) and
  the cores it may run on.

Prediction: the simulator times the very schedule the run executed with those costs, one processor per
pipeline rank (`schedule_bound_s`). On CPU the ranks of a machine share its cores: a step also takes at least
the CPU time of all of its ranks over its cores (`cpu_bound_s`, the busiest machine). The predicted step time
is the larger: with more ranks than cores the ranks take turns, each stretched alike, so the simulated bubble
fraction stands.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Sequence

from ..schedule import Op, Schedule
from ..sim import Costs, simulate_schedule
from .comm_bench import fit_latency_bandwidth, merge_ranks

WARMUP_ITERATIONS = 2  # allocator and backend warm-up make the first iterations several times slower
CALIBRATION_ITERATIONS = 8


def calibration_iterations(first: int, last: int) -> list[int]:
    """The iterations whose actions are timed: after the warm-up of a run going from `first` to `last`."""
    start = first + WARMUP_ITERATIONS
    return list(range(start, min(last, start + CALIBRATION_ITERATIONS - 1) + 1))


def steady_iterations(first: int, count: int) -> list[int]:
    """The iterations whose median time is the measured step time: every one after the warm-up."""
    return list(range(first + WARMUP_ITERATIONS, first + count))


@dataclass
class MachineCosts:
    """What was measured, per stage (index), pipeline rank or global rank; seconds, bytes."""

    pp: int
    dp: int
    zero_stage: int
    forward_s: list[float]
    backward_s: list[float]  # B, or I + W
    input_grad_share: list[float] | None  # split backward: I / (I + W); None: fused
    step_s: list[float]
    host_s_per_action: list[float]  # per pipeline rank, added to each of its F/B (I, W)
    collectives: dict[str, tuple[float, float]]  # kind -> (latency s, bandwidth bytes/s) of the whole op
    p2p_bytes: float
    stage_param_bytes: list[float]
    stage_grad_bytes: list[float]
    iterations: list[int]
    # CPU runs: per global rank, its process CPU time per iteration and its machine; cores per machine.
    cpu_s: list[float] = field(default_factory=list)
    machine_of_rank: list[str] = field(default_factory=list)
    cores: dict[str, int] = field(default_factory=dict)
    # Context, not used to predict: other work on the machine's cores.
    load_average_1min: dict[str, float | None] = field(default_factory=dict)
    other_processes_cores: dict[str, float | None] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> "MachineCosts":
        d = dict(d)
        d["collectives"] = {k: tuple(v) for k, v in d["collectives"].items()}
        return MachineCosts(**d)


def schedule_costs(mc: MachineCosts, overlap: bool = True) -> Costs:
    """The simulator's cost table (`Costs.from_measurements`) with the measured STEPs and I shares written in.
    `overlap` False: communication holds the compute stream (no spare core for the backend's threads)."""
    n = len(mc.forward_s)
    per_action = [mc.host_s_per_action[s % mc.pp] for s in range(n)]
    backward_actions = 2 if mc.input_grad_share is not None else 1
    forward = [f + h for f, h in zip(mc.forward_s, per_action)]
    backward = [b + backward_actions * h for b, h in zip(mc.backward_s, per_action)]
    p2p_lat, p2p_bw = mc.collectives.get("p2p", (0.0, float("inf")))
    ag_lat, ag_bw = mc.collectives.get("all_gather", (0.0, float("inf")))
    rs_lat, rs_bw = mc.collectives.get("reduce_scatter", (0.0, float("inf")))
    # The micro-benchmark times the whole collective on the full tensor; from_measurements applies (D-1)/D of
    # the bytes: the bandwidth per byte of the full tensor is scaled to match.
    frac = (mc.dp - 1) / mc.dp if mc.dp > 1 else 1.0
    costs = Costs.from_measurements(
        n, mc.pp, forward=forward, backward=backward, p2p_bytes=mc.p2p_bytes, p2p_bandwidth=p2p_bw,
        p2p_latency=p2p_lat, stage_param_bytes=list(mc.stage_param_bytes), dp=mc.dp,
        gather_bandwidth=ag_bw * frac, reduce_bandwidth=rs_bw * frac, collective_latency=max(ag_lat, rs_lat),
        zero_stage=mc.zero_stage, optimizer=max(_rank_sums(mc.step_s, mc.pp)),
        dp_overlap=overlap, p2p_overlap=overlap, stage_grad_bytes=list(mc.stage_grad_bytes))
    costs.step = list(mc.step_s)
    costs.optimizer = _rank_sums(mc.step_s, mc.pp)
    if mc.input_grad_share is not None:
        costs.input_grad_share = [(share * b + h) / (b + 2 * h) if b + 2 * h > 0 else 0.5
                                  for share, b, h in zip(mc.input_grad_share, mc.backward_s, per_action)]
    return costs


def _rank_sums(per_stage: Sequence[float], pp: int) -> list[float]:
    return [sum(per_stage[s] for s in range(r, len(per_stage), pp)) for r in range(pp)]


def cpu_bound_s(mc: MachineCosts) -> tuple[float, str | None]:
    """The most CPU time per step any machine's ranks need, over its cores; with that machine (None: no CPU
    figures)."""
    if not mc.cpu_s:
        return 0.0, None
    need: dict[str, float] = {}
    for t, host in zip(mc.cpu_s, mc.machine_of_rank):
        need[host] = need.get(host, 0.0) + t
    host = max(need, key=lambda h: need[h] / mc.cores[h])
    return need[host] / mc.cores[host], host


def predict(schedule: Schedule, mc: MachineCosts, overlap: bool = True) -> dict:
    """The report's "predicted" block for `schedule` under the measured costs (module docstring)."""
    res = simulate_schedule(schedule, schedule_costs(mc, overlap), record_events=False)
    cpu_s, host = cpu_bound_s(mc)
    step = max(res.step_time_s, cpu_s)
    out: dict[str, Any] = {
        "basis": basis(mc, host),
        "step_time_s": step,
        "schedule_bound_s": res.step_time_s,
        "bound": "cpu" if cpu_s > res.step_time_s else "schedule",
        "bubble_fraction": res.bubble_fraction,
        "exposed_dp_s": res.mean_exposed_dp_s,
        "exposed_pp_s": res.mean_exposed_pp_s,
        "optimizer_s": res.optimizer_s,
        "compute_s": sum(res.compute_s) / len(res.compute_s),
    }
    if host is not None:
        out["cpu_bound_s"] = cpu_s
        out["cpu_bound_machine"] = {"ranks": mc.machine_of_rank.count(host), "cores": mc.cores[host],
                                    "cpu_s_per_step": cpu_s * mc.cores[host],
                                    "load_average_1min": mc.load_average_1min.get(host),
                                    "other_processes_cores": mc.other_processes_cores.get(host)}
    out["costs"] = mc.to_dict()
    return out


def basis(mc: MachineCosts, host: str | None) -> str:
    its = f"iterations {mc.iterations[0]}-{mc.iterations[-1]}" if mc.iterations else "no iteration"
    text = (f"costs measured on this machine: F/B/STEP of every stage from this run's timeline (median over {its}), "
            "host work per action from each rank's CPU time, collectives from a micro-benchmark on the run's "
            "groups; the simulator times the schedule that ran, one processor per pipeline rank")
    if host is not None:
        text += (f"; {mc.machine_of_rank.count(host)} ranks share {mc.cores[host]} cores, so a step also takes "
                 "their CPU time over the cores")
    return text


# ---------------------------------------------------------------- from what the ranks gathered

def machine_costs(schedule: Schedule, costs: Mapping[tuple[str, int], float], per_rank: Sequence[Mapping[str, Any]],
                  iterations: Sequence[int], dp: int, zero_stage: int) -> MachineCosts:
    """MachineCosts of a run: `costs` from `timeline_costs.action_costs` over `iterations`; `per_rank` in
    global rank order, each rank's `machine.rank_stats`: {"pp_rank", "cpu_s" and "thread_cpu_s" (per
    iteration of `iterations`; None off CPU), "machine", "cpus" (the cores it may run on), "stage_bytes"
    {stage: [gathered, reduced]}, "p2p_bytes", "collectives" (`comm_bench.time_collectives`)}."""
    n, pp = schedule.num_stages, schedule.pp
    split = any(op == "I" for op, _ in costs)
    missing = [f"{op}{s}" for s in range(n) for op in (("F", "I", "W") if split else ("F", "B")) if (op, s) not in costs]
    if missing:
        raise ValueError(f"no recorded {', '.join(missing)} to time")
    forward = [costs[("F", s)] for s in range(n)]
    if split:
        backward = [costs[("I", s)] + costs[("W", s)] for s in range(n)]
        share: list[float] | None = [costs[("I", s)] / b if b > 0 else 0.5 for s, b in enumerate(backward)]
    else:
        backward = [costs[("B", s)] for s in range(n)]
        share = None
    step = [costs.get(("STEP", s), 0.0) for s in range(n)]
    host = _host_per_action(schedule, costs, per_rank)
    stage_bytes: dict[int, list[float]] = {}
    for r in per_rank:
        for s, b in r["stage_bytes"].items():
            stage_bytes[int(s)] = [float(x) for x in b]
    collectives = {k: fit_latency_bandwidth(v) for k, v in merge_ranks([r["collectives"] for r in per_rank]).items()
                   if v}
    out = MachineCosts(
        pp=pp, dp=dp, zero_stage=zero_stage,
        forward_s=forward, backward_s=backward, input_grad_share=share, step_s=step, host_s_per_action=host,
        collectives=collectives, p2p_bytes=max((float(r["p2p_bytes"]) for r in per_rank), default=0.0),
        stage_param_bytes=[stage_bytes.get(s, [0.0, 0.0])[0] for s in range(n)],
        stage_grad_bytes=[stage_bytes.get(s, [0.0, 0.0])[1] for s in range(n)], iterations=list(iterations))
    if all(r.get("cpu_s") for r in per_rank):
        out.cpu_s = [statistics.median(r["cpu_s"]) for r in per_rank]
        out.machine_of_rank = [str(r["machine"]) for r in per_rank]
        cpus: dict[str, set[int]] = {}
        for r in per_rank:
            cpus.setdefault(str(r["machine"]), set()).update(r["cpus"])
        out.cores = {m: max(1, len(c)) for m, c in cpus.items()}
        out.load_average_1min = {str(r["machine"]): r.get("load_average_1min") for r in per_rank}
        if all("steady_cpu_s" in r for r in per_rank):
            out.other_processes_cores = other_processes_cores(per_rank)
    return out


def other_processes_cores(per_rank: Sequence[dict]) -> dict[str, float | None]:
    """Per machine: the cores other processes kept busy while the run's iterations ran (after the warm-up):
    all the machine's CPU time less its ranks' own, over the wall time, both as its first rank saw them. Context
    for a reader comparing predicted and measured step times; nothing predicted depends on it."""
    out: dict[str, float | None] = {}
    for r in per_rank:
        host = str(r["machine"])
        mine = sum(x["steady_cpu_s"] for x in per_rank if str(x["machine"]) == host)
        if host not in out:
            busy, wall = r.get("steady_machine_busy_s"), r.get("steady_wall_s")
            out[host] = max(busy - mine, 0.0) / wall if busy is not None and wall else None
    return out


def _host_per_action(schedule: Schedule, costs: Mapping[tuple[str, int], float],
                     per_rank: Sequence[Mapping[str, Any]]) -> list[float]:
    """Per pipeline rank: the main thread's CPU time per iteration outside its recorded compute and STEPs,
    per compute action (mean over the rank's data-parallel replicas); 0 without CPU times."""
    out = []
    for p in range(schedule.pp):
        acts = [a for a in schedule.ranks[p] if a.op in (Op.F, Op.B, Op.I, Op.W, Op.STEP)]
        in_actions = sum(costs.get((a.op.value, a.stage), 0.0) for a in acts)
        n_compute = sum(1 for a in acts if a.op != Op.STEP)
        spare = [max(statistics.median(r["thread_cpu_s"]) - in_actions, 0.0)
                 for r in per_rank if r["pp_rank"] == p and r.get("thread_cpu_s")]
        out.append(statistics.fmean(spare) / n_compute if spare and n_compute else 0.0)
    return out
