"""Unit-time layout of a schedule: when each action would run with fixed compute costs and free communication.

Used to draw a schedule (`bfpp draw SCHEDULE.json`) without a cost model. Each rank runs its list in order;
F takes `t_forward`, B takes `t_backward`, sends / receives / GATHER / RELEASE / REDUCE take no time. A
receive that reaches its rank before the matching send has run becomes a WAIT event (name "wait RECV_F4:0",
p2p stream) lasting until the send, which is how idle compute (the bubble) shows up. The timing follows the
schedule's data dependencies only; ordering itself comes from the schedule, never from here.
"""

from __future__ import annotations

from ..schedule import COMPUTE_OPS, Action, Op, Schedule, ScheduleError, add_p2p
from .events import TimelineEvent, event_for


def _producer(schedule: Schedule, a: Action) -> tuple[int, Action] | None:
    """(rank, send) whose completion a receive waits for; None for every other action."""
    if a.op == Op.RECV_F:
        return schedule.rank_of(a.stage - 1), Action(Op.SEND_F, a.stage - 1, a.microbatch)
    if a.op == Op.RECV_B:
        return schedule.rank_of(a.stage + 1), Action(Op.SEND_B, a.stage + 1, a.microbatch)
    return None


def unit_timeline(
    schedule: Schedule, t_forward: float = 1.0, t_backward: float = 2.0, iteration: int = 0
) -> list[TimelineEvent]:
    """Timeline events of `schedule` (lowered here if it is not) under unit costs and free communication."""
    if t_forward <= 0 or t_backward <= 0:
        raise ScheduleError(f"--t-forward and --t-backward must be > 0 (got {t_forward}, {t_backward})")
    # Only p2p lowering is needed for dependencies; with P = 1 every dependency is already in local order.
    # A file with GATHER etc. but no sends (P = 1) reads back as not lowered; it needs no p2p either.
    has_other = any(a.op not in COMPUTE_OPS for acts in schedule.ranks for a in acts)
    sched = schedule if schedule.lowered or has_other else add_p2p(schedule)
    pp = sched.pp
    pcs = [0] * pp
    clock = [0.0] * pp
    finished: list[dict[Action, float]] = [{} for _ in range(pp)]
    events: list[TimelineEvent] = []
    remaining = sum(len(acts) for acts in sched.ranks)
    while remaining:
        progressed = False
        for r in range(pp):
            acts = sched.ranks[r]
            while pcs[r] < len(acts):
                a = acts[pcs[r]]
                prod = _producer(sched, a)
                if prod is not None:
                    src, send = prod
                    if send not in finished[src]:
                        break  # the sender has not reached its send yet: come back later
                    ready = finished[src][send]
                    if ready > clock[r]:
                        events.append(TimelineEvent(r, "p2p", f"wait {a.text}", "WAIT", a.stage, a.microbatch,
                                                    clock[r], ready, iteration))
                        clock[r] = ready
                cost = t_forward if a.op == Op.F else t_backward if a.op == Op.B else 0.0
                events.append(event_for(a, r, clock[r], clock[r] + cost, iteration))
                clock[r] += cost if a.op in COMPUTE_OPS else 0.0
                finished[r][a] = clock[r]
                pcs[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            blocked = "; ".join(f"rank {r} at {sched.ranks[r][pcs[r]].text}" for r in range(pp)
                                if pcs[r] < len(sched.ranks[r]))
            raise ScheduleError(f"schedule deadlocks under the unit-time layout: {blocked}")
    return events
