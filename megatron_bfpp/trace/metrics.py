"""Measurements from a timeline: step time, bubble, exposed communication, and consistency checks.

Per rank and iteration, the window (by default from the first event start to the last event end over all
ranks: ranks meet at the optimizer step, so the iteration costs every rank the same wall time; the caller may
pass each rank's own window instead) is split into disjoint parts, so that

    compute + bubble + exposed p2p + exposed dp + optimizer + other = step time

(the simulator's accounting). Each instant of the window goes to the first that applies:
- compute: a compute event (F, B, I, W; only the computation: the runtime records its waits apart);
- optimizer: an OPTIMIZER event, or a STEP (a stage's optimizer step, which the schedule places at the step
  boundary: recorded on the compute stream by the optimizer, but optimizer time, neither compute nor bubble);
- exposed dp: a WAIT on the "dp" stream (parameter all-gather, gradient buffer, final reduce);
- bubble / exposed p2p: a WAIT on the "p2p" stream. A receive's wait names the sending rank; the part before
  that rank posted the matching send is bubble (the input did not exist yet), the rest exposed p2p (the
  transfer itself). Waits whose sender is not in the timeline count as exposed p2p;
- bubble: an IDLE event (a recorder's explicit idle time, e.g. the simulator's pipeline drain);
- other: any other recorded event (posting p2p ops, issuing collectives) and unrecorded gaps between this
  rank's events (host overhead);
- bubble: the unrecorded time before this rank's first and after its last event (idle at the edges).
Summaries over ranks are means (bubble, waits) and the maximum (step time). `bubble` is a fraction of the
step time; `*_s` fields are seconds.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Iterable, Mapping

from ..schedule import COMPUTE_OPS, Op, Schedule
from ..schedule.validate import tail_gathers
from ..schedule.events import TimelineEvent

_COMPUTE = {op.value for op in COMPUTE_OPS}
_OPTIMIZER = {"OPTIMIZER", Op.STEP.value}  # the optimizer outside the schedule, and the schedule's STEPs


@dataclass
class RankMetrics:
    rank: int
    step_time_s: float
    compute_s: float
    bubble: float  # bubble_s / step_time_s
    exposed_dp_wait_s: float
    exposed_p2p_wait_s: float
    span_s: float  # this rank's own first start .. last end
    bubble_s: float = 0.0
    optimizer_s: float = 0.0  # OPTIMIZER and STEP time
    other_s: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def accounted_s(self) -> float:
        """compute + bubble + exposed p2p + exposed dp + optimizer + other: the step time."""
        return (self.compute_s + self.bubble_s + self.exposed_p2p_wait_s + self.exposed_dp_wait_s
                + self.optimizer_s + self.other_s)


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

    @property
    def optimizer_s(self) -> float:
        return _mean(r.optimizer_s for r in self.ranks)

    def to_dict(self) -> dict:
        """The "measured" block of a trainer's --report-json (peak memory is added by the trainer per rank)."""
        return {
            "iteration": self.iteration,
            "step_time_s": self.step_time_s,
            "bubble": self.bubble,
            "exposed_dp_wait_s": self.exposed_dp_wait_s,
            "exposed_p2p_wait_s": self.exposed_p2p_wait_s,
            "optimizer_s": self.optimizer_s,
            "consistent": self.consistent,
            "overlaps": list(self.overlaps),
            "per_rank": [r.to_dict() for r in self.ranks],
        }


def _mean(values: Iterable[float]) -> float:
    vals = list(values)
    return sum(vals) / len(vals) if vals else 0.0


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


# Parts of a rank's window, in the order an instant is given to them.
_PARTS = ("compute", "optimizer", "dp", "p2p", "bubble", "other")


def _sender_post_times(evs: list[TimelineEvent]) -> dict[tuple[int, str], float]:
    """(rank, send name) -> when that rank posted the send."""
    return {(e.rank, e.name): e.start for e in evs if e.op in ("SEND_F", "SEND_B")}


def _matching_send(e: TimelineEvent) -> str | None:
    """Name of the send a receive wait waits for: `wait RECV_F4:0` <- `SEND_F3:0`, `wait RECV_B4:0` <- `SEND_B5:0`."""
    if e.stage is None or e.microbatch is None:
        return None
    if e.name.startswith("wait RECV_F"):
        return f"SEND_F{e.stage - 1}:{e.microbatch}"
    if e.name.startswith("wait RECV_B"):
        return f"SEND_B{e.stage + 1}:{e.microbatch}"
    return None


def _parts(rev: list[TimelineEvent], w0: float, w1: float, posted: dict[tuple[int, str], float]) -> dict[str, float]:
    """Split [w0, w1] into the disjoint parts of the module docstring."""
    intervals: list[tuple[float, float, str]] = []
    for e in rev:
        if e.op in _OPTIMIZER:
            intervals.append((e.start, e.end, "optimizer"))
        elif e.op == "IDLE":
            intervals.append((e.start, e.end, "bubble"))
        elif e.op == "WAIT" and e.stream == "dp":
            intervals.append((e.start, e.end, "dp"))
        elif e.op == "WAIT" and e.stream == "p2p":
            send = _matching_send(e)
            tp = posted.get((e.peer, send)) if e.peer is not None and send is not None else None
            if tp is not None and tp > e.start:
                intervals.append((e.start, min(tp, e.end), "bubble"))
                if tp < e.end:
                    intervals.append((tp, e.end, "p2p"))
            else:
                intervals.append((e.start, e.end, "p2p"))
        elif e.stream == "compute" and e.op not in ("WAIT", "IDLE"):
            intervals.append((e.start, e.end, "compute"))
        else:
            intervals.append((e.start, e.end, "other"))
    first, last = min(e.start for e in rev), max(e.end for e in rev)
    bounds = sorted({w0, w1, max(w0, min(first, w1)), min(w1, max(last, w0))}
                    | {min(max(x, w0), w1) for s, e, _ in intervals for x in (s, e)})
    # Sweep the elementary segments; an interval covers [start, end).
    starts = sorted(((max(s, w0), _PARTS.index(p)) for s, e, p in intervals if e > s), key=lambda t: t[0])
    ends = sorted(((min(e, w1), _PARTS.index(p)) for s, e, p in intervals if e > s), key=lambda t: t[0])
    active = [0] * len(_PARTS)
    totals = dict.fromkeys(_PARTS, 0.0)
    i = j = 0
    for a, b in zip(bounds, bounds[1:]):
        while i < len(starts) and starts[i][0] <= a:
            active[starts[i][1]] += 1
            i += 1
        while j < len(ends) and ends[j][0] <= a:
            active[ends[j][1]] -= 1
            j += 1
        k = next((k for k, n in enumerate(active) if n > 0), None)
        if k is not None:
            part = _PARTS[k]
        else:
            part = "other" if first <= a and b <= last else "bubble"
        totals[part] += b - a
    return totals


def iteration_metrics(
    events: Iterable[TimelineEvent],
    iteration: int | None = None,
    windows: Mapping[int, tuple[float, float]] | None = None,
) -> IterationMetrics:
    """Per-rank step time and its parts, of one iteration (see the module docstring)."""
    iteration, evs = select_iteration(events, iteration)
    lo = min(e.start for e in evs)
    hi = max(e.end for e in evs)
    posted = _sender_post_times(evs)
    per_rank: dict[int, list[TimelineEvent]] = defaultdict(list)
    for e in evs:
        per_rank[e.rank].append(e)
    ranks = []
    for rank in sorted(per_rank):
        rev = per_rank[rank]
        w0, w1 = (windows or {}).get(rank, (lo, hi))
        step = w1 - w0
        parts = _parts(rev, w0, w1, posted)
        ranks.append(RankMetrics(
            rank=rank, step_time_s=step, compute_s=parts["compute"],
            bubble=parts["bubble"] / step if step > 0 else 0.0,
            exposed_dp_wait_s=parts["dp"], exposed_p2p_wait_s=parts["p2p"],
            span_s=max(e.end for e in rev) - min(e.start for e in rev),
            bubble_s=parts["bubble"], optimizer_s=parts["optimizer"], other_s=parts["other"],
        ))
    return IterationMetrics(iteration, max(r.step_time_s for r in ranks), ranks, compute_overlaps(evs))


def check_against_schedule(
    events: Iterable[TimelineEvent],
    schedule: Schedule,
    pp_rank_of: Mapping[int, int] | None = None,
    iteration: int | None = None,
) -> list[str]:
    """Problems of a recorded iteration against the schedule it ran; an empty list means it ran as scheduled.

    Checks per rank: the compute events are exactly the schedule's F/B actions in the schedule's order (STEP
    events, the optimizer's, are not computation: they are checked apart, each stage's STEP once and none between
    two computations of the rank: after the last, as the runtime records the step boundary, or before the
    first, as the simulator lays out the previous iteration's in steady state); with GATHER actions (ZeRO-3), every compute on a stage starts after a GATHER of
    that stage with no RELEASE of it in between, a stage the step boundary gathers counting as gathered from
    the iteration's start (steady state: the previous iteration's boundary gathered it, and the first GATHER of
    it is a no-op the runtime may not record); the compute track has no overlap. `pp_rank_of` maps a global
    rank to its pipeline rank (needed when there is data parallelism; identity otherwise).
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
    zero3 = schedule.zero_stage == 3 or (schedule.zero_stage is None
                                         and any(a.op == Op.GATHER for acts in schedule.ranks for a in acts))
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
        steps = [e for e in rev if e.op == Op.STEP.value]
        if steps:
            want_steps = sorted(a.stage for a in schedule.step_tail(pr) if a.op == Op.STEP)
            comp = [e for e in rev if e.stream == "compute" and e.op in _COMPUTE]
            first = min((e.start for e in comp), default=float("inf"))
            last = max((e.end for e in comp), default=float("-inf"))
            if sorted(e.stage for e in steps) != want_steps:  # type: ignore[type-var]
                problems.append(f"rank {rank} (pipeline rank {pr}) iteration {iteration}: STEP events for stages "
                                f"{sorted(e.stage for e in steps)}, the schedule steps {want_steps}")  # type: ignore[type-var]
            for e in steps:
                if e.end > first and e.start < last:
                    problems.append(f"rank {rank} iteration {iteration}: {e.name} at {e.start:.9g} runs between the "
                                    "rank's computations (the optimizer steps at the step boundary)")
        if zero3:
            gathered = set(tail_gathers(schedule, pr))
            for e in rev:
                if e.op == Op.GATHER.value:
                    gathered.add(e.stage)  # type: ignore[arg-type]
                elif e.op == Op.RELEASE.value:
                    gathered.discard(e.stage)  # type: ignore[arg-type]
                elif e.stream == "compute" and e.op in _COMPUTE and e.stage not in gathered:
                    problems.append(f"rank {rank} iteration {iteration}: {e.name} at {e.start:.9g} runs before "
                                    f"a GATHER of stage {e.stage} (or after its RELEASE)")
    return problems
