"""Per-action compute costs from a run's own recorded timeline.

Each compute action (F, B, I, W) and each optimizer step of a stage (STEP) is timed by the recorder on every
rank; its cost here is the median over the calibration iterations of its duration less the waits recorded
inside it, per (op, stage). The median keeps the cost of the action itself: on a machine whose cores are
shared by more processes than it has, a few occurrences are stretched by the time their process was not
running, which is the machine's sharing, accounted for apart (`measured_prediction`), not the action's cost.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Collection, Iterable

from ..schedule.events import TimelineEvent

COSTED_OPS = ("F", "B", "I", "W", "STEP")


def net_durations(events: Iterable[TimelineEvent], iterations: Collection[int]) -> dict[tuple[str, int], list[float]]:
    """(op, stage) -> the durations, in seconds, of its occurrences in `iterations`, each less the waits of
    its rank recorded inside it."""
    wanted = set(iterations)
    evs = [e for e in events if e.iteration in wanted]
    waits: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    for e in evs:
        if e.op == "WAIT":
            waits[(e.rank, e.iteration)].append((e.start, e.end))
    out: dict[tuple[str, int], list[float]] = defaultdict(list)
    for e in evs:
        if e.op not in COSTED_OPS or e.stage is None:
            continue
        inside = sum(max(0.0, min(e.end, b) - max(e.start, a)) for a, b in waits[(e.rank, e.iteration)])
        out[(e.op, e.stage)].append(max(e.end - e.start - inside, 0.0))
    return dict(out)


def action_costs(events: Iterable[TimelineEvent], iterations: Collection[int]) -> dict[tuple[str, int], float]:
    """(op, stage) -> median seconds of one occurrence over `iterations` (see `net_durations`)."""
    return {k: statistics.median(v) for k, v in net_durations(events, iterations).items() if v}
