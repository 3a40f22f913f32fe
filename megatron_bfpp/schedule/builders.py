"""Schedule builders: the only place where pipeline ordering is decided.

Each builder returns, per pipeline rank, the order of compute actions: F and B, or F, I and W for the split
backward schedules. Stage s lives on rank s mod P. Every builder takes (P, V, M, group size, forward-only) and
is called by `kinds.build`, which has checked P, V, M, the kind's rule on V and whether it takes a group size,
and passes the group size with the kind's default applied (None for kinds without one): a builder checks only
what is particular to its order.
"""

from __future__ import annotations

import dataclasses

from .ir import Action, Op, Schedule, ScheduleError


def check_common(pp: int, vp: int, microbatches: int) -> None:
    """P, V and M are positive (what every kind needs)."""
    if pp < 1:
        raise ScheduleError(f"--pp (--pipeline-model-parallel-size) must be >= 1 (got {pp})")
    if vp < 1:
        raise ScheduleError(f"--vp must be >= 1 (got {vp})")
    if microbatches < 1:
        raise ScheduleError(f"--microbatches must be >= 1 (got {microbatches})")


def gpipe(pp: int, vp: int, microbatches: int, group_size: int | None, forward_only: bool) -> Schedule:
    """All forwards, then all backwards (V = 1)."""
    ranks = []
    for r in range(pp):
        acts = [Action(Op.F, r, m) for m in range(microbatches)]
        if not forward_only:
            acts += [Action(Op.B, r, m) for m in range(microbatches)]
        ranks.append(acts)
    return Schedule("gpipe", pp, 1, microbatches, None, ranks, forward_only=forward_only)


def one_f_one_b(pp: int, vp: int, microbatches: int, group_size: int | None, forward_only: bool) -> Schedule:
    """Megatron-Core's non-interleaved 1F1B: P - r - 1 warm-up forwards, then alternate, then drain."""
    ranks = []
    for r in range(pp):
        if forward_only:
            ranks.append([Action(Op.F, r, m) for m in range(microbatches)])
            continue
        warmup = min(pp - r - 1, microbatches)
        acts = [Action(Op.F, r, m) for m in range(warmup)]
        for k in range(microbatches - warmup):
            acts += [Action(Op.F, r, warmup + k), Action(Op.B, r, k)]
        acts += [Action(Op.B, r, m) for m in range(microbatches - warmup, microbatches)]
        ranks.append(acts)
    return Schedule("1f1b", pp, 1, microbatches, None, ranks, forward_only=forward_only)


def megatron_schedule_table(microbatches: int, vp: int, group_size: int) -> list[tuple[int, int]]:
    """(microbatch, chunk) per virtual micro-batch: same table as Megatron-Core's `get_schedule_table`."""
    table: list[tuple[int, int]] = []
    for start in range(0, microbatches, group_size):
        end = microbatches if start + group_size >= microbatches else start + group_size
        table += [(m, c) for c in range(vp) for m in range(start, end)]
    return table


def interleaved_warmup(pp: int, rank: int, vp: int, microbatches: int, group_size: int) -> int:
    """Warm-up forwards on `rank`, as Megatron-Core's `get_pp_rank_microbatches` counts them."""
    warmup = (pp - rank - 1) * 2 + (vp - 1) * group_size
    return min(warmup, microbatches * vp)


def _check_interleaved(pp: int, microbatches: int, group_size: int) -> None:
    if microbatches < pp:
        raise ScheduleError(
            f"interleaved-1f1b needs at least P={pp} micro-batches (got M={microbatches}): raise the global "
            "batch size or lower the micro-batch size, or use breadth-first"
        )
    if not pp <= group_size <= microbatches:
        raise ScheduleError(
            f"--group-size (--microbatch-group-size-per-virtual-pipeline-stage) must lie in [P={pp}, "
            f"M={microbatches}] for interleaved-1f1b (got {group_size})"
        )
    remainder = microbatches % group_size
    if 0 < remainder < pp:
        raise ScheduleError(
            f"--group-size {group_size} leaves a last group of {remainder} < P={pp} micro-batches: choose a "
            f"group size that divides M={microbatches} or leaves a remainder >= P"
        )


def interleaved_1f1b(pp: int, vp: int, microbatches: int, group_size: int, forward_only: bool,
                     extra_warmup: int = 0) -> Schedule:
    """Depth-first: Megatron-Core's interleaved 1F1B order, with its micro-batch group size (`extra_warmup` more
    warm-up forwards on every rank: its combined 1F1B, `combined_1f1b`)."""
    g = group_size
    _check_interleaved(pp, microbatches, g)
    table = megatron_schedule_table(microbatches, vp, g)
    total = len(table)

    def fwd(r: int, k: int) -> Action:
        m, c = table[k]
        return Action(Op.F, c * pp + r, m)

    def bwd(r: int, k: int) -> Action:
        m, c = table[k]
        return Action(Op.B, (vp - 1 - c) * pp + r, m)

    ranks = []
    for r in range(pp):
        if forward_only:
            ranks.append([fwd(r, k) for k in range(total)])
            continue
        warmup = min(interleaved_warmup(pp, r, vp, microbatches, g) + extra_warmup, total)
        acts = [fwd(r, k) for k in range(warmup)]
        for k in range(total - warmup):
            acts += [fwd(r, warmup + k), bwd(r, k)]
        acts += [bwd(r, k) for k in range(total - warmup, total)]
        ranks.append(acts)
    return Schedule("interleaved-1f1b", pp, vp, microbatches, g, ranks, forward_only=forward_only)


def combined_1f1b(pp: int, vp: int, microbatches: int, group_size: int | None) -> Schedule:
    """Megatron-Core's order under --overlap-moe-expert-parallel-comm, whose steady-state forward and backward run
    merged (`pairs.COMBINED_1F1B`, which `kinds.build` sets): its interleaved 1F1B with one more warm-up forward on
    every rank, so that each merged forward and backward are independent (`get_pp_rank_microbatches` in
    megatron/core/pipeline_parallel/schedules.py); without a pipeline its 1F1B (the first forward alone, then
    each backward with the next forward: `combined_1f1b_schedule_for_no_pipelining`). Megatron-Core refuses it
    at P > 1 without virtual stages (TransformerConfig)."""
    if vp > 1:
        return interleaved_1f1b(pp, vp, microbatches, group_size, False, extra_warmup=1)  # type: ignore[arg-type]
    if pp == 1:
        return one_f_one_b(pp, vp, microbatches, None, False)
    raise ScheduleError(f"--overlap-moe-expert-parallel-comm at --pipeline-model-parallel-size {pp} needs virtual "
                        "stages (Megatron-Core: 'virtual_pipeline_model_parallel_size must be specified when "
                        "pipeline_model_parallel_size > 1'): add --num-layers-per-virtual-pipeline-stage")


def _check_breadth_first(pp: int, microbatches: int, group_size: int) -> None:
    if not 1 <= group_size <= microbatches:
        raise ScheduleError(
            f"--group-size (--microbatch-group-size-per-virtual-pipeline-stage) must lie in [1, M={microbatches}] "
            f"for breadth-first (got {group_size}); groups of at least P={pp} avoid extra bubbles"
        )


def breadth_first(pp: int, vp: int, microbatches: int, group_size: int, forward_only: bool) -> Schedule:
    """Breadth-first: per group of G consecutive micro-batches, every micro-batch through each local stage in
    increasing stage order, then all backwards in decreasing stage order; groups run one after the other."""
    g = group_size
    _check_breadth_first(pp, microbatches, g)
    groups = [range(s, min(s + g, microbatches)) for s in range(0, microbatches, g)]
    ranks = []
    for r in range(pp):
        acts: list[Action] = []
        for group in groups:
            for c in range(vp):
                acts += [Action(Op.F, c * pp + r, m) for m in group]
            if not forward_only:
                for c in reversed(range(vp)):
                    acts += [Action(Op.B, c * pp + r, m) for m in group]
        ranks.append(acts)
    return Schedule("breadth-first", pp, vp, microbatches, g, ranks, forward_only=forward_only)


def zero_bubble(pp: int, vp: int, microbatches: int, group_size: int | None, forward_only: bool, *,
                name: str) -> Schedule:
    """Interleaved zero bubble (Qi et al.'s ZB1P): the order of PyTorch's `ScheduleInterleavedZeroBubble`.

    Micro-batches go in rounds of M / max(1, M // P); rank r runs (V - 1) * round + P - 1 - r warm-up
    forwards, then F I pairs, and from its (r + 1)-th pair on one W (the oldest pending) after each; the
    remaining I's, each followed by a W once r of them are pending, then the remaining W's. With V = 1 it is
    ZB-H1 (`zb-h1`).
    """
    rounds = max(1, microbatches // pp)
    if microbatches % rounds:
        raise ScheduleError(
            f"--pipeline-schedule {name} needs M a multiple of its number of rounds M // P = {rounds} (got "
            f"M={microbatches}): choose M <= P or a multiple of {rounds}")
    per_round = microbatches // rounds
    total = vp * microbatches
    ranks = []
    for r in range(pp):
        def stage(step: int, backward: bool, warmup: int) -> int:
            k = (step - warmup) // per_round if backward else step // per_round
            local = (vp - 1 - k % vp) if backward else k % vp
            return local * pp + r

        next_mb: dict[Op, dict[int, int]] = {Op.F: {}, Op.I: {}, Op.W: {}}

        def take(op: Op, st: int) -> Action:
            m = next_mb[op].get(st, 0)
            next_mb[op][st] = m + 1
            return Action(op, st, m)

        if forward_only:
            ranks.append([take(Op.F, stage(step, False, 0)) for step in range(total)])
            continue
        warmup = min((vp - 1) * per_round + pp - 1 - r, total)
        acts = []
        pending: list[int] = []  # stages of I's whose W is still to run, oldest first
        for step in range(total + warmup):
            if step < total:
                acts.append(take(Op.F, stage(step, False, 0)))
            if step >= warmup:
                st = stage(step, True, warmup)
                acts.append(take(Op.I, st))
                pending.append(st)
                if step - warmup >= r:
                    acts.append(take(Op.W, pending.pop(0)))
        acts += [take(Op.W, st) for st in pending]
        ranks.append(acts)
    return Schedule(name, pp, vp, microbatches, None, ranks, forward_only=forward_only)


def breadth_first_zero_bubble(pp: int, vp: int, microbatches: int, group_size: int, forward_only: bool) -> Schedule:
    """Breadth-first with W deferral: the breadth-first order with each backward split into I and W; the W's
    wait in a per-rank queue and run, oldest first, in the slots where the rank would otherwise idle, or as
    soon as G of them (the group size, default M) are pending, and all before the step ends.

    The idle slots come from running the order on nominal durations (F = I = W = 1, the ratios of Qi et al.
    for a transformer layer), every rank in lockstep.
    """
    base = breadth_first(pp, vp, microbatches, group_size, forward_only)
    if forward_only:
        return dataclasses.replace(base, name="breadth-first-zb")
    lag = group_size
    last = pp * vp - 1
    queues = [[Action(Op.I, a.stage, a.microbatch) if a.op == Op.B else a for a in acts] for acts in base.ranks]
    done: dict[tuple[Op, int, int], int] = {}  # (op, stage, microbatch) -> tick it ran in
    out: list[list[Action]] = [[] for _ in range(pp)]
    pcs = [0] * pp
    pending: list[list[Action]] = [[] for _ in range(pp)]

    def ready(a: Action, tick: int) -> bool:
        if a.op == Op.F:
            dep = None if a.stage == 0 else (Op.F, a.stage - 1, a.microbatch)
        else:
            dep = (Op.F, a.stage, a.microbatch) if a.stage == last else (Op.I, a.stage + 1, a.microbatch)
        return dep is None or done.get(dep, tick) < tick  # type: ignore[arg-type]

    tick = 0
    while any(pcs[r] < len(queues[r]) or pending[r] for r in range(pp)):
        ran = []
        for r in range(pp):
            nxt = queues[r][pcs[r]] if pcs[r] < len(queues[r]) else None
            if pending[r] and (len(pending[r]) >= lag or nxt is None or not ready(nxt, tick)):
                ran.append((r, pending[r].pop(0)))
            elif nxt is not None and ready(nxt, tick):
                pcs[r] += 1
                ran.append((r, nxt))
                if nxt.op == Op.I:
                    pending[r].append(Action(Op.W, nxt.stage, nxt.microbatch))
        if not ran and tick > 4 * sum(len(q) for q in queues):
            raise ScheduleError("internal: breadth-first-zb order does not complete")
        for r, a in ran:
            out[r].append(a)
            done[(a.op, a.stage, a.microbatch)] = tick  # type: ignore[index]
        tick += 1
    return dataclasses.replace(base, name="breadth-first-zb", ranks=out)
