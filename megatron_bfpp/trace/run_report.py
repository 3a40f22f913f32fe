"""The trainer's run report (`--report-json`), its console lines and its timeline file, from plain data.

The trainer (`train/report.py`) collects what only the live run knows (each rank's communication and memory
counters and recorded events, the simulator's prediction) and hands it here; everything below is a function
of those inputs, so a report is built, and tested, without a process group. `report.py` reads the files
written here (`bfpp report`).
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable, Mapping, Sequence

from ..schedule.events import TimelineEvent
from .chrome import write_chrome_trace
from .metrics import iteration_metrics


def rank_events(per_rank: Iterable[Mapping[str, Any]]) -> list[TimelineEvent]:
    """The recorded events of every rank, from the gathered per-rank stats ("events": list of dicts)."""
    return [TimelineEvent.from_dict(e) for stats in per_rank for e in stats["events"]]


def steady_step_time(times: Sequence[float]) -> float:
    """The iteration time throughput is quoted at: the median without the first (warm-up) iteration when there
    are several; for an even count, the upper of the two middle times."""
    steady = times[1:] if len(times) > 1 else times
    return sorted(steady)[len(steady) // 2]


def measured_metrics(events: Iterable[TimelineEvent], iteration: int,
                     memory: Sequence[Mapping[str, Any]]) -> dict | None:
    """`iteration_metrics` of `iteration` with each rank's peak memory (`memory`: per-rank dicts with "rank" and
    "peak_bytes") merged in, per rank and as the maximum; None when no event of `iteration` was recorded."""
    events = [e for e in events if e.iteration == iteration]
    if not events:
        return None
    measured = iteration_metrics(events, iteration).to_dict()
    peak_of = {m["rank"]: m["peak_bytes"] for m in memory}
    for r in measured["per_rank"]:
        r["peak_memory_bytes"] = peak_of.get(r["rank"])
    measured["peak_memory_bytes"] = max(peak_of.values())
    return measured


def with_step_bubble(predicted: dict | None) -> dict | None:
    """The prediction with "bubble" added: the simulator's bubble is relative to compute (`bubble_fraction` b),
    the measurement's to step time, so b / (1 + b) is the figure to compare with the measured bubble."""
    if predicted is None or not isinstance(predicted.get("bubble_fraction"), (int, float)):
        return predicted
    b = predicted["bubble_fraction"]
    return {**predicted, "bubble": b / (1 + b)}


def build_run_report(*, config: dict, losses: Sequence[float], first_iteration: int,
                     skipped_iterations: Sequence[int], loss_scales: Sequence[float],
                     iteration_times_s: Sequence[float], tokens_per_iteration: int,
                     per_rank: Sequence[Mapping[str, Any]], events: Iterable[TimelineEvent], measured_iteration: int,
                     predicted: dict | None) -> dict:
    """The `--report-json` object. `per_rank`: each rank's gathered {"comm": ..., "memory": ...} in rank order;
    `events`: the recorded events of all ranks, of which those of `measured_iteration` give "measured" (left
    out when there are none); `predicted`: the simulator's prediction, or None."""
    memory = [stats["memory"] for stats in per_rank]
    report: dict[str, Any] = {
        "config": config,
        "losses": list(losses),
        "first_iteration": first_iteration,
        "skipped_iterations": list(skipped_iterations),
        "loss_scales": list(loss_scales),
        "iteration_times_s": list(iteration_times_s),
        "tokens_per_s": tokens_per_iteration / steady_step_time(iteration_times_s),
        "comm": [stats["comm"] for stats in per_rank],
        "memory": memory,
    }
    measured = measured_metrics(events, measured_iteration, memory)
    if measured is not None:
        report["measured"] = measured
    report["predicted"] = with_step_bubble(predicted)
    return report


def measured_line(measured: dict, predicted: Mapping[str, Any]) -> str:
    """Per-rank bubble, exposed waits and peak memory of the measured iteration, next to the prediction."""
    ranks = " ".join(
        f"r{r['rank']}={r['bubble']:.0%}/{r['exposed_dp_wait_s'] * 1e3:.0f}ms/{r['exposed_p2p_wait_s'] * 1e3:.0f}ms/"
        f"{(r.get('peak_memory_bytes') or 0) / 2**20:.1f}MiB" for r in measured["per_rank"])
    line = (f"measured (iteration {measured['iteration']}): bubble {measured['bubble']:.1%}, exposed dp wait "
            f"{measured['exposed_dp_wait_s'] * 1e3:.1f} ms, exposed p2p wait "
            f"{measured['exposed_p2p_wait_s'] * 1e3:.1f} ms, peak memory "
            f"{measured['peak_memory_bytes'] / 2**20:.1f} MiB | per rank bubble/dp/p2p/peak: {ranks}")
    if isinstance(predicted.get("bubble"), float):
        line += f" | predicted bubble {predicted['bubble']:.1%} ({predicted.get('basis', 'simulator')})"
    return line


def prediction_line(predicted: Mapping[str, Any] | None, measured: Mapping[str, Any] | None) -> str | None:
    """Predicted step time beside the measured one (and bubbles, and what bounds the step); None without both
    step times."""
    if not predicted or not all(isinstance(predicted.get(k), float) for k in ("step_time_s", "measured_step_time_s")):
        return None
    p, m = predicted["step_time_s"], predicted["measured_step_time_s"]
    first, last = predicted.get("measured_iterations") or ("?", "?")
    label = str(predicted.get("basis", "simulator")).split(":")[0]
    line = (f"predicted ({label}): step time {p * 1e3:.1f} ms vs measured {m * 1e3:.1f} ms (median of iterations "
            f"{first}-{last}), {p / m - 1:+.1%}")
    if isinstance(predicted.get("bubble"), float):
        line += f" | bubble {predicted['bubble']:.1%}"
        if measured:
            line += f" vs measured {measured['bubble']:.1%} (iteration {measured['iteration']})"
    machine = predicted.get("cpu_bound_machine")
    if predicted.get("bound") == "cpu" and machine:
        line += (f" | bound by CPU: {machine['ranks']} ranks need {machine['cpu_s_per_step'] * 1e3:.0f} ms of CPU "
                 f"per step on {machine['cores']} cores (the schedule alone, one core per rank: "
                 f"{predicted['schedule_bound_s'] * 1e3:.1f} ms)")
        if isinstance(machine.get("other_processes_cores"), float):
            line += f"; other processes kept {machine['other_processes_cores']:.1f} cores busy meanwhile"
        elif isinstance(machine.get("load_average_1min"), float):
            line += f"; load average {machine['load_average_1min']:.1f}"
    elif machine:
        line += (f" | bound by the schedule (the ranks' CPU time over the cores: "
                 f"{predicted['cpu_bound_s'] * 1e3:.1f} ms)")
    return line


def done_line(iterations: int, schedule: str, final_loss: float, tokens_per_s: float) -> str:
    return (f"done: {iterations} iterations, schedule {schedule}, final lm loss {final_loss:.4f}, "
            f"{tokens_per_s:.1f} tokens/s")


def write_timeline(events: Iterable[TimelineEvent], path: str, iterations: Iterable[int], config: dict) -> None:
    """The Chrome trace of the events of `iterations`, with the run's configuration as metadata."""
    wanted = set(iterations)
    write_chrome_trace([e for e in events if e.iteration in wanted], path, metadata={"config": config})


def write_json_atomic(path: str, obj: dict) -> None:
    """Write `obj` as JSON so that `path` holds either its old content or all of the new, never a torn file."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
