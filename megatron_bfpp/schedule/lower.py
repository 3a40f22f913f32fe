"""Lowering passes: add pipeline p2p actions, then data-parallel GATHER / RELEASE / REDUCE actions.

p2p: a receive is placed right before the compute that consumes it and a send right after the compute that
produces it. Sends are non-blocking, so the lowered order is deadlock-free exactly when the event simulation
in `validate` completes (it also checks that every channel is matched first-in first-out, as NCCL needs).

Data parallel, over "runs" (maximal stretches of consecutive compute actions on one stage):
- ZeRO-3 keeps at most `weight_buffers` stages gathered. The stage of the next run is gathered before the
  current run starts (prefetch); when all buffers are taken, the gathered stage used furthest in the future
  is released right after its last run so far. Everything still gathered is released at the end of the step.
- ZeRO-2/3 keep at most `grad_buffers` full-size gradient buffers. A stage's gradient is reduce-scattered
  right after its last backward of the accumulation group (the breadth-first group, otherwise the step), or
  earlier when its buffer must be handed to another stage.
- ZeRO-1 keeps full gradients and reduce-scatters each stage once, right after its last backward of the step.
"""

from __future__ import annotations

import dataclasses

from .ir import COMPUTE_OPS, Action, Op, Schedule, ScheduleError


def add_p2p(schedule: Schedule) -> Schedule:
    """Insert SEND_F/RECV_F/SEND_B/RECV_B around compute actions whose neighbour stage is on another rank."""
    if schedule.lowered:
        return schedule
    last = schedule.num_stages - 1
    cross = schedule.pp > 1  # with P > 1, stages s and s + 1 always live on different ranks
    ranks = []
    for actions in schedule.ranks:
        out: list[Action] = []
        for a in actions:
            if a.op not in COMPUTE_OPS:
                raise ScheduleError(f"add_p2p expects only F/B actions, found {a.text}")
            if a.op == Op.F:
                if cross and a.stage > 0:
                    out.append(Action(Op.RECV_F, a.stage, a.microbatch))
                out.append(a)
                if cross and a.stage < last:
                    out.append(Action(Op.SEND_F, a.stage, a.microbatch))
            else:
                if cross and a.stage < last:
                    out.append(Action(Op.RECV_B, a.stage, a.microbatch))
                out.append(a)
                if cross and a.stage > 0:
                    out.append(Action(Op.SEND_B, a.stage, a.microbatch))
        ranks.append(out)
    return dataclasses.replace(schedule, ranks=ranks, lowered=True)


def accumulation_group(schedule: Schedule, microbatch: int) -> int:
    """Index of the gradient-accumulation group of a micro-batch (breadth-first groups; else one per step)."""
    if schedule.name == "breadth-first" and schedule.group_size:
        return microbatch // schedule.group_size
    return 0


def _runs(actions: list[Action]) -> list[list[Action]]:
    """Split a rank's list into runs: each run holds the actions of consecutive computes on one stage."""
    runs: list[list[Action]] = []
    run_stage = None
    pending: list[Action] = []  # receives waiting for the compute they feed
    for a in actions:
        if a.op in (Op.RECV_F, Op.RECV_B):
            pending.append(a)
            continue
        if a.op in COMPUTE_OPS:
            if a.stage != run_stage or not runs:
                runs.append([])
                run_stage = a.stage
            runs[-1] += pending + [a]
            pending = []
            continue
        if a.op in (Op.SEND_F, Op.SEND_B):
            runs[-1].append(a)
            continue
        raise ScheduleError(f"data-parallel lowering expects no {a.op} actions yet (found {a.text})")
    if pending:
        raise ScheduleError(f"receives {[p.text for p in pending]} feed no compute action")
    return runs


def _run_stage(run: list[Action]) -> int:
    return next(a.stage for a in run if a.op in COMPUTE_OPS)


def add_data_parallel(
    schedule: Schedule, zero_stage: int, weight_buffers: int = 2, grad_buffers: int = 2
) -> Schedule:
    """Insert GATHER/RELEASE/REDUCE for ZeRO stage 1, 2 or 3 with a bounded number of buffers."""
    if zero_stage not in (1, 2, 3):
        raise ScheduleError(f"--zero-stage must be 1, 2 or 3 (got {zero_stage})")
    if weight_buffers < 1 or grad_buffers < 1:
        raise ScheduleError("--weight-buffers and --grad-buffers must be >= 1")
    if schedule.zero_stage is not None:
        raise ScheduleError("schedule already has data-parallel actions")
    ranks = [
        _lower_rank_dp(schedule, actions, zero_stage, weight_buffers, grad_buffers) for actions in schedule.ranks
    ]
    return dataclasses.replace(
        schedule, ranks=ranks, zero_stage=zero_stage, weight_buffers=weight_buffers, grad_buffers=grad_buffers
    )


def _lower_rank_dp(schedule: Schedule, actions: list[Action], zero: int, nw: int, ng: int) -> list[Action]:
    runs = _runs(actions)
    stages = [_run_stage(r) for r in runs]
    pre: list[list[Action]] = [[] for _ in runs]
    post: list[list[Action]] = [[] for _ in runs]
    tail: list[Action] = []

    def next_use(stage: int, after: int, want_backward: bool = False) -> int:
        for j in range(after + 1, len(runs)):
            if stages[j] == stage and (not want_backward or any(a.op == Op.B for a in runs[j])):
                return j
        return len(runs) + 1  # never again this step

    if zero == 3:
        resident: list[int] = []
        last_run: dict[int, int] = {}

        def make_room(i: int, keep: int) -> bool:
            if len(resident) < nw:
                return True
            victims = [s for s in resident if s != keep]
            if not victims:
                return False
            victim = max(victims, key=lambda s: next_use(s, i))
            resident.remove(victim)
            post[last_run[victim]].append(Action(Op.RELEASE, victim))
            return True

        for i, s in enumerate(stages):
            if s not in resident:  # first run, or a prefetch that had no free buffer
                if i > 0 and not make_room(i, s):
                    raise ScheduleError("internal: no weight buffer for the current stage")  # nw >= 1
                pre[i].append(Action(Op.GATHER, s))
                resident.append(s)
            if i + 1 < len(runs) and stages[i + 1] not in resident:
                nxt = stages[i + 1]
                if make_room(i, s):
                    pre[i].append(Action(Op.GATHER, nxt))
                    resident.append(nxt)
                else:  # one buffer only: gather after this run, without overlap
                    post[i].append(Action(Op.RELEASE, s))
                    resident.remove(s)
                    post[i].append(Action(Op.GATHER, nxt))
                    resident.append(nxt)
            last_run[s] = i
        tail += [Action(Op.RELEASE, s) for s in resident]

    # Gradients: the last backward run of each (stage, scope).
    def scope_of(run: list[Action]) -> int:
        if zero == 1:
            return 0
        return accumulation_group(schedule, next(a.microbatch for a in run if a.op == Op.B))  # type: ignore[arg-type]

    bwd_runs = [i for i, r in enumerate(runs) if any(a.op == Op.B for a in r)]
    last_bwd_of_scope: set[int] = set()
    seen: set[tuple[int, int]] = set()
    for i in reversed(bwd_runs):
        key = (stages[i], scope_of(runs[i]))
        if key not in seen:
            seen.add(key)
            last_bwd_of_scope.add(i)

    grad_resident: list[int] = []
    last_bwd: dict[int, int] = {}
    for i in bwd_runs:
        s = stages[i]
        if zero >= 2 and s not in grad_resident:
            if len(grad_resident) >= ng:
                victim = max((v for v in grad_resident if v != s), key=lambda v: next_use(v, i, True))
                grad_resident.remove(victim)
                post[last_bwd[victim]].append(Action(Op.REDUCE, victim))
            grad_resident.append(s)
        last_bwd[s] = i
        if i in last_bwd_of_scope:
            post[i].append(Action(Op.REDUCE, s))
            if s in grad_resident:
                grad_resident.remove(s)

    out: list[Action] = []
    for i, run in enumerate(runs):
        # A REDUCE goes right after the run's last backward (and its send), ahead of any forward that follows.
        reduces = [a for a in post[i] if a.op == Op.REDUCE]
        others = [a for a in post[i] if a.op != Op.REDUCE]
        cut = len(run)
        if reduces:
            cut = max(k for k, a in enumerate(run) if a.op == Op.B) + 1
            if cut < len(run) and run[cut].op == Op.SEND_B:
                cut += 1
        out += pre[i] + run[:cut] + reduces + run[cut:] + others
    return out + tail


def lower(
    schedule: Schedule, zero_stage: int | None = None, weight_buffers: int = 2, grad_buffers: int = 2
) -> Schedule:
    """p2p lowering, then (if `zero_stage` is given) data-parallel lowering."""
    lowered = add_p2p(schedule)
    if zero_stage is not None:
        lowered = add_data_parallel(lowered, zero_stage, weight_buffers, grad_buffers)
    return lowered
