"""Measurements from a timeline: step time, bubble, exposed communication, and consistency checks.

Definitions (per rank, one iteration):
- step time: the iteration's window, by default from the first event start to the last event end over all
  ranks (ranks meet at the optimizer step, so the iteration costs every rank the same wall time); the caller
  may pass each rank's own window instead;
- compute time: length of the union of the compute track's work inside the window (F and B, and whatever
  else a recorder puts there, e.g. the simulator's OPTIMIZER step; WAIT events excluded);
- bubble fraction: (step time - compute time) / step time, i.e. idle compute over step time;
- exposed data-parallel / p2p wait: sum of the durations of WAIT events on the "dp" / "p2p" stream (a
  blocking wait is time the rank could not hide the communication behind compute).
Summaries over ranks are means (bubble, waits) and the maximum (step time).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Iterable, Mapping

from ..schedule import COMPUTE_OPS, Op, Schedule
from .events import TimelineEvent

_COMPUTE = {op.value for op in COMPUTE_OPS}


@dataclass
class RankMetrics:
    rank: int
    step_time_s: float
    compute_s: float
    bubble: float
    exposed_dp_wait_s: float
    exposed_p2p_wait_s: float
    span_s: float  # this rank's own first start .. last end

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class IterationMetrics:
    iteration: int
    step_time_s: float
    ranks: list[RankMetrics]
    overlaps: list[str] = field(default_factory=list)  # compute-track inconsistencies; empty when sound

    @property
    def consistent(self) -> bool:
        return not self.overlaps

    @property
    def bubble(self) -> float:
        return _mean(r.bubble for r in self.ranks)

    @property
    def exposed_dp_wait_s(self) -> float:
        return _mean(r.exposed_dp_wait_s for r in self.ranks)

    @property
    def exposed_p2p_wait_s(self) -> float:
        return _mean(r.exposed_p2p_wait_s for r in self.ranks)

    def to_dict(self) -> dict:
        """The "measured" block of a trainer's --report-json (peak memory is added by the trainer per rank)."""
        return {
            "iteration": self.iteration,
            "step_time_s": self.step_time_s,
            "bubble": self.bubble,
            "exposed_dp_wait_s": self.exposed_dp_wait_s,
            "exposed_p2p_wait_s": self.exposed_p2p_wait_s,
            "consistent": self.consistent,
            "overlaps": list(self.overlaps),
            "per_rank": [r.to_dict() for r in self.ranks],
        }


def _mean(values: Iterable[float]) -> float:
    vals = list(values)
    return sum(vals) / len(vals) if vals else 0.0


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by closed intervals (overlaps counted once)."""
    total, cur_start, cur_end = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_end is None or s > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start  # type: ignore[operator]
            cur_start, cur_end = s, e
        else:
            cur_end = max(cur_end, e)
    if cur_end is not None:
        total += cur_end - cur_start  # type: ignore[operator]
    return total


def iterations(events: Iterable[TimelineEvent]) -> list[int]:
    return sorted({e.iteration for e in events})


def select_iteration(events: Iterable[TimelineEvent], iteration: int | None = None) -> tuple[int, list[TimelineEvent]]:
    """Events of one iteration; None picks the last recorded one (the first often carries warm-up costs)."""
    events = list(events)
    its = iterations(events)
    if not its:
        raise ValueError("timeline has no events")
    if iteration is None:
        iteration = its[-1]
    elif iteration not in its:
        raise ValueError(f"--iteration {iteration} is not in the timeline; recorded iterations: "
                         f"{', '.join(map(str, its))}")
    return iteration, [e for e in events if e.iteration == iteration]


def compute_overlaps(events: Iterable[TimelineEvent], tol: float = 1e-9) -> list[str]:
    """Problems on the compute track: events ending before they start, or overlapping on one rank."""
    problems: list[str] = []
    by_rank: dict[tuple[int, int], list[TimelineEvent]] = defaultdict(list)
    for e in events:
        if e.end < e.start - tol:
            problems.append(f"rank {e.rank} iteration {e.iteration}: {e.name} ends before it starts "
                            f"({e.start:.9g} > {e.end:.9g})")
        if e.stream == "compute":
            by_rank[(e.rank, e.iteration)].append(e)
    for (rank, it), evs in sorted(by_rank.items()):
        evs = sorted(evs, key=lambda e: (e.start, e.end))
        for prev, nxt in zip(evs, evs[1:]):
            if nxt.start < prev.end - tol:
                problems.append(f"rank {rank} iteration {it}: compute {nxt.name} starts at {nxt.start:.9g} "
                                f"before {prev.name} ends at {prev.end:.9g}")
    return problems


def iteration_metrics(
    events: Iterable[TimelineEvent],
    iteration: int | None = None,
    windows: Mapping[int, tuple[float, float]] | None = None,
) -> IterationMetrics:
    """Per-rank step time, bubble and exposed waits of one iteration (see the module docstring)."""
    iteration, evs = select_iteration(events, iteration)
    lo = min(e.start for e in evs)
    hi = max(e.end for e in evs)
    per_rank: dict[int, list[TimelineEvent]] = defaultdict(list)
    for e in evs:
        per_rank[e.rank].append(e)
    ranks = []
    for rank in sorted(per_rank):
        rev = per_rank[rank]
        w0, w1 = (windows or {}).get(rank, (lo, hi))
        step = w1 - w0
        busy = union_length(
            (max(e.start, w0), min(e.end, w1)) for e in rev
            if e.stream == "compute" and e.op != "WAIT" and e.end > w0 and e.start < w1
        )
        waits = {s: sum(e.end - e.start for e in rev if e.op == "WAIT" and e.stream == s) for s in ("dp", "p2p")}
        ranks.append(RankMetrics(
            rank=rank, step_time_s=step, compute_s=busy, bubble=(step - busy) / step if step > 0 else 0.0,
            exposed_dp_wait_s=waits["dp"], exposed_p2p_wait_s=waits["p2p"],
            span_s=max(e.end for e in rev) - min(e.start for e in rev),
        ))
    return IterationMetrics(iteration, max(r.step_time_s for r in ranks), ranks, compute_overlaps(evs))


def check_against_schedule(
    events: Iterable[TimelineEvent],
    schedule: Schedule,
    pp_rank_of: Mapping[int, int] | None = None,
    iteration: int | None = None,
) -> list[str]:
    """Problems of a recorded iteration against the schedule it ran; an empty list means it ran as scheduled.

    Checks per rank: the compute events are exactly the schedule's F/B actions in the schedule's order; with
    GATHER actions (ZeRO-3), every compute on a stage starts after a GATHER of that stage with no RELEASE of
    it in between; the compute track has no overlap. `pp_rank_of` maps a global rank to its pipeline rank
    (needed when there is data parallelism; identity otherwise).
    """
    iteration, evs = select_iteration(events, iteration)
    problems = compute_overlaps(evs)
    by_rank: dict[int, list[TimelineEvent]] = defaultdict(list)
    for e in evs:
        by_rank[e.rank].append(e)
    if pp_rank_of is None:
        if any(r >= schedule.pp for r in by_rank):
            raise ValueError(f"timeline has ranks {sorted(by_rank)} but the schedule has pp={schedule.pp}: "
                             "pass pp_rank_of (global rank -> pipeline rank)")
        pp_rank_of = {r: r for r in by_rank}
    zero3 = any(a.op == Op.GATHER for acts in schedule.ranks for a in acts)
    for rank in sorted(by_rank):
        # Stable sort: a rank's zero-length actions recorded at one instant keep their recorded order.
        rev = sorted(by_rank[rank], key=lambda e: e.start)
        pr = pp_rank_of[rank]
        want = [a.text for a in schedule.compute_actions(pr)]
        got = [e.name for e in rev if e.stream == "compute" and e.op in _COMPUTE]
        if got != want:
            k = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), min(len(got), len(want)))
            problems.append(
                f"rank {rank} (pipeline rank {pr}) iteration {iteration}: {len(got)} compute events, schedule has "
                f"{len(want)}; first difference at position {k}: ran {got[k] if k < len(got) else 'nothing'}, "
                f"scheduled {want[k] if k < len(want) else 'nothing'}"
            )
        if zero3:
            gathered: set[int] = set()
            for e in rev:
                if e.op == Op.GATHER.value:
                    gathered.add(e.stage)  # type: ignore[arg-type]
                elif e.op == Op.RELEASE.value:
                    gathered.discard(e.stage)  # type: ignore[arg-type]
                elif e.stream == "compute" and e.op in _COMPUTE and e.stage not in gathered:
                    problems.append(f"rank {rank} iteration {iteration}: {e.name} at {e.start:.9g} runs before "
                                    f"a GATHER of stage {e.stage} (or after its RELEASE)")
    return problems
