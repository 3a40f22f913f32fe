"""Validation of built and lowered schedules, before anything runs.

`validate` checks that every (stage, microbatch) has exactly one F and one B on the rank that owns the stage,
that every local order respects the data dependencies, that sends match receives, and that the schedule
completes under an event simulation (non-blocking sends, blocking receives matched first-in first-out per
channel, bounded weight buffers). Errors name the rank, the step (index in the rank's list) and the action.
"""

from __future__ import annotations

from collections import Counter, deque

from .ir import COMPUTE_OPS, DP_OPS, Action, Op, Schedule, ScheduleError


def check_compute(schedule: Schedule) -> None:
    """Exactly one F (and one B unless forward-only) per (stage, microbatch), on the owning rank."""
    if len(schedule.ranks) != schedule.pp:
        raise ScheduleError(f"schedule has {len(schedule.ranks)} rank lists for pp={schedule.pp}")
    s_count, m_count = schedule.num_stages, schedule.microbatches
    for r, actions in enumerate(schedule.ranks):
        for i, a in enumerate(actions):
            if not 0 <= a.stage < s_count:
                raise ScheduleError(f"rank {r} step {i}: {a.text} names stage {a.stage} outside [0, {s_count})")
            if a.microbatch is not None and not 0 <= a.microbatch < m_count:
                raise ScheduleError(f"rank {r} step {i}: {a.text} names micro-batch outside [0, {m_count})")
            if schedule.rank_of(a.stage) != r:
                raise ScheduleError(
                    f"rank {r} step {i}: {a.text} belongs to rank {schedule.rank_of(a.stage)} (stage mod P)"
                )
        counts = Counter((a.op, a.stage, a.microbatch) for a in actions if a.op in COMPUTE_OPS)
        for (op, s, m), n in counts.items():
            if n > 1:
                raise ScheduleError(f"rank {r}: {Action(op, s, m).text} appears {n} times")
        ops = (Op.F,) if schedule.forward_only else (Op.F, Op.B)
        for s in schedule.stages_of(r):
            for m in range(m_count):
                for op in ops:
                    if (op, s, m) not in counts:
                        raise ScheduleError(f"rank {r}: {Action(op, s, m).text} is missing")
        if schedule.forward_only and any(op == Op.B for op, _, _ in counts):
            raise ScheduleError(f"rank {r}: forward-only schedule contains backward actions")


def _deps(schedule: Schedule, a: Action) -> list[tuple[int, Action]]:
    """(rank, action) pairs that must have executed before `a` can start."""
    last = schedule.num_stages - 1
    s, m, pp = a.stage, a.microbatch, schedule.pp
    local = pp == 1
    if a.op == Op.F:
        if s == 0:
            return []
        prev = Action(Op.F, s - 1, m) if local else Action(Op.RECV_F, s, m)
        return [(schedule.rank_of(s), prev)]
    if a.op == Op.B:
        deps = [(schedule.rank_of(s), Action(Op.F, s, m))]
        if s < last:
            deps.append((schedule.rank_of(s), Action(Op.B, s + 1, m) if local else Action(Op.RECV_B, s, m)))
        return deps
    if a.op == Op.SEND_F:
        return [(schedule.rank_of(s), Action(Op.F, s, m))]
    if a.op == Op.SEND_B:
        return [(schedule.rank_of(s), Action(Op.B, s, m))]
    if a.op == Op.RECV_F:
        return [(schedule.rank_of(s - 1), Action(Op.SEND_F, s - 1, m))]
    if a.op == Op.RECV_B:
        return [(schedule.rank_of(s + 1), Action(Op.SEND_B, s + 1, m))]
    return []


def _channel(schedule: Schedule, a: Action) -> tuple[int, int] | None:
    """(src, dst) of a p2p action."""
    r = schedule.rank_of(a.stage)
    if a.op == Op.SEND_F:
        return (r, schedule.rank_of(a.stage + 1))
    if a.op == Op.RECV_F:
        return (schedule.rank_of(a.stage - 1), r)
    if a.op == Op.SEND_B:
        return (r, schedule.rank_of(a.stage - 1))
    if a.op == Op.RECV_B:
        return (schedule.rank_of(a.stage + 1), r)
    return None


def check_p2p(schedule: Schedule) -> None:
    """Every send has its receive and vice versa, each channel matched in the same order on both ends.

    A channel is (source rank, destination rank, direction): activations and gradients travel on separate
    channels (separate process groups in the runtime), so their relative order never has to agree. A single
    shared channel is what makes Megatron's interleaved PP = 2 order ambiguous.
    """
    if schedule.pp == 1:
        for r, acts in enumerate(schedule.ranks):
            for i, a in enumerate(acts):
                if _channel(schedule, a) is not None:
                    raise ScheduleError(f"rank {r} step {i}: {a.text} with pp=1 has no peer")
        return
    last = schedule.num_stages - 1
    sends: dict[tuple[int, int, str], list[tuple[str, int, int]]] = {}
    recvs: dict[tuple[int, int, str], list[tuple[str, int, int]]] = {}
    for r, acts in enumerate(schedule.ranks):
        for i, a in enumerate(acts):
            pair = _channel(schedule, a)
            if pair is None:
                continue
            ch = (*pair, "F" if a.op in (Op.SEND_F, Op.RECV_F) else "B")
            if (a.op == Op.SEND_F and a.stage == last) or (a.op == Op.RECV_F and a.stage == 0) or (
                a.op == Op.SEND_B and a.stage == 0) or (a.op == Op.RECV_B and a.stage == last):
                raise ScheduleError(f"rank {r} step {i}: {a.text} has no neighbour stage")
            # The payload is named by the producing stage: F output of s feeds s + 1; B output of s feeds s - 1.
            if a.op == Op.SEND_F:
                sends.setdefault(ch, []).append(("F", a.stage, a.microbatch))  # type: ignore[arg-type]
            elif a.op == Op.RECV_F:
                recvs.setdefault(ch, []).append(("F", a.stage - 1, a.microbatch))  # type: ignore[arg-type]
            elif a.op == Op.SEND_B:
                sends.setdefault(ch, []).append(("B", a.stage, a.microbatch))  # type: ignore[arg-type]
            else:
                recvs.setdefault(ch, []).append(("B", a.stage + 1, a.microbatch))  # type: ignore[arg-type]
    for ch in sorted(set(sends) | set(recvs)):
        s_list, r_list = sends.get(ch, []), recvs.get(ch, [])
        for k in range(max(len(s_list), len(r_list))):
            sent = s_list[k] if k < len(s_list) else None
            got = r_list[k] if k < len(r_list) else None
            if sent != got:
                raise ScheduleError(
                    f"channel rank {ch[0]} -> rank {ch[1]} ({'activations' if ch[2] == 'F' else 'gradients'}), message {k}: rank {ch[0]} sends {_payload(sent)} "
                    f"but rank {ch[1]} expects {_payload(got)}"
                )


def _payload(p: tuple[str, int, int] | None) -> str:
    if p is None:
        return "nothing"
    kind, stage, mb = p
    return f"{'activation' if kind == 'F' else 'gradient'} of stage {stage} micro-batch {mb}"


def simulate_order(schedule: Schedule) -> list[tuple[int, int]]:
    """Run the schedule as events; return the global completion order [(rank, step)].

    Raises ScheduleError naming each blocked rank, its step and action when no rank can progress.
    """
    pcs = [0] * schedule.pp
    done: list[set[Action]] = [set() for _ in range(schedule.pp)]
    gathered: list[set[int]] = [set() for _ in range(schedule.pp)]
    zero3 = schedule.zero_stage == 3 or any(a.op == Op.GATHER for acts in schedule.ranks for a in acts)
    order: list[tuple[int, int]] = []
    total = sum(len(a) for a in schedule.ranks)
    pending = deque(range(schedule.pp))
    while len(order) < total:
        progressed = False
        for r in range(schedule.pp):
            while pcs[r] < len(schedule.ranks[r]):
                a = schedule.ranks[r][pcs[r]]
                if not all(dep in done[dr] for dr, dep in _deps(schedule, a)):
                    break
                if a.op == Op.GATHER:
                    if a.stage in gathered[r]:
                        raise ScheduleError(f"rank {r} step {pcs[r]}: {a.text} but stage {a.stage} is already gathered")
                    if len(gathered[r]) >= schedule.weight_buffers:
                        raise ScheduleError(
                            f"rank {r} step {pcs[r]}: {a.text} needs a weight buffer but all "
                            f"{schedule.weight_buffers} hold stages {sorted(gathered[r])}"
                        )
                    gathered[r].add(a.stage)
                elif a.op == Op.RELEASE:
                    if a.stage not in gathered[r]:
                        raise ScheduleError(f"rank {r} step {pcs[r]}: {a.text} but stage {a.stage} is not gathered")
                    gathered[r].discard(a.stage)
                elif a.op in COMPUTE_OPS and zero3 and a.stage not in gathered[r]:
                    raise ScheduleError(
                        f"rank {r} step {pcs[r]}: {a.text} runs without its parameters gathered (ZeRO-3)"
                    )
                if a in done[r] and a.op not in DP_OPS:
                    raise ScheduleError(f"rank {r} step {pcs[r]}: {a.text} appears twice")
                done[r].add(a)
                order.append((r, pcs[r]))
                pcs[r] += 1
                progressed = True
        if not progressed:
            blocked = [
                f"rank {r} step {pcs[r]} waits at {schedule.ranks[r][pcs[r]].text}"
                for r in pending
                if pcs[r] < len(schedule.ranks[r])
            ]
            raise ScheduleError("deadlock: " + "; ".join(blocked))
    for r in range(schedule.pp):
        if zero3 and gathered[r]:
            raise ScheduleError(f"rank {r}: stages {sorted(gathered[r])} still gathered at the end of the step")
    return order


def check_reduce(schedule: Schedule) -> None:
    """With data-parallel actions: every stage reduce-scattered after its last backward, nothing after."""
    if schedule.zero_stage is None or schedule.forward_only:
        return
    for r, acts in enumerate(schedule.ranks):
        for s in schedule.stages_of(r):
            last_b = max(i for i, a in enumerate(acts) if a.op == Op.B and a.stage == s)
            reduces = [i for i, a in enumerate(acts) if a.op == Op.REDUCE and a.stage == s]
            if not reduces or reduces[-1] < last_b:
                raise ScheduleError(f"rank {r}: stage {s} has no REDUCE after its last backward (step {last_b})")


def peak_activations(schedule: Schedule) -> list[int]:
    """Per rank, the largest number of (stage, microbatch) forward outputs alive (F done, B not yet)."""
    peaks = []
    for acts in schedule.ranks:
        alive = peak = 0
        for a in acts:
            if a.op == Op.F:
                alive += 1
                peak = max(peak, alive)
            elif a.op == Op.B:
                alive -= 1
        peaks.append(peak if not schedule.forward_only else 1 if peak else 0)
    return peaks


def validate(schedule: Schedule) -> Schedule:
    """Raise ScheduleError on the first problem; return the schedule unchanged when it is sound."""
    check_compute(schedule)
    check_p2p(schedule)
    if not schedule.lowered and schedule.pp > 1:
        # Dependencies of an unlowered schedule: lower a copy and simulate that.
        from .lower import add_p2p

        simulate_order(add_p2p(schedule))
    else:
        simulate_order(schedule)
    check_reduce(schedule)
    return schedule
