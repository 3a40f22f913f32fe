"""Validation of built and lowered schedules, before anything runs.

`validate` checks that every (stage, microbatch) has exactly one F and one B on the rank that owns the stage,
that each stage runs micro-batch 0 first (TransformerEngine's FP8 weights and fused weight gradients depend on
it, `check_first_microbatch`), that every local order respects the data dependencies, that sends match
receives, and that the schedule completes under event simulations of the backends:
- gloo: sends are buffered, receives are posted without blocking and the compute that consumes one waits
  for its send; bounded weight buffers;
- NCCL (`simulate_nccl`): a rank's p2p actions are posted in list order; per communicator they execute in
  posting order; a send completes only when its receive is active at the same time (rendezvous, the worst
  case for large messages); a batch is posted as one group; a p2p op starts after the computes posted before
  it (torch's NCCL stream waits on the compute stream); a compute waits for the receives it consumes. With
  `single_queue` (CUDA_DEVICE_MAX_CONNECTIONS=1) everything a rank posts runs in one queue, in order.
  The communicator is the action's `channel`, one queue for lone actions and batches alike: exactly what the
  runtime does, which posts every post as one `batch_isend_irecv` on the channel's process group, so that NCCL
  runs a lone op on the group's communicator too and not on a 2-rank one of its own (`runtime/p2p.py`,
  `PipelineP2P.post`). The gradient norm's all-reduce, right before each rank's first STEP, is a collective
  of every rank (a rendezvous: it completes when every rank has reached it), on its own communicator, or in
  the one queue.
Errors name the rank, the step (index in the rank's list), the action and, for deadlocks, the cycle.
"""

from __future__ import annotations

from collections import Counter, deque

from .ir import BACKWARD_OPS, COMPUTE_OPS, DP_OPS, INPUT_GRAD_OPS, P2P_OPS, Action, Op, Schedule, ScheduleError


def check_compute(schedule: Schedule) -> None:
    """Per (stage, microbatch), on the owning rank: exactly one F and, unless forward-only, either one B or one
    I followed later by one W (split backward)."""
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
        pos = {(a.op, a.stage, a.microbatch): i for i, a in enumerate(actions) if a.op in COMPUTE_OPS}
        for s in schedule.stages_of(r):
            for m in range(m_count):
                if (Op.F, s, m) not in counts:
                    raise ScheduleError(f"rank {r}: {Action(Op.F, s, m).text} is missing")
                if schedule.forward_only:
                    continue
                fused, i_, w_ = ((op, s, m) in counts for op in (Op.B, Op.I, Op.W))
                if fused and (i_ or w_):
                    raise ScheduleError(f"rank {r}: stage {s} micro-batch {m} has both B and a split backward (I/W)")
                if not fused and not (i_ and w_):
                    want = "B (or I and W)" if not (i_ or w_) else ("W" if i_ else "I")
                    raise ScheduleError(f"rank {r}: stage {s} micro-batch {m} misses its {want}")
                if i_ and pos[(Op.W, s, m)] < pos[(Op.I, s, m)]:
                    raise ScheduleError(f"rank {r} step {pos[(Op.W, s, m)]}: W{s}:{m} runs before I{s}:{m}")
        if schedule.forward_only and any(op in BACKWARD_OPS for op, _, _ in counts):
            raise ScheduleError(f"rank {r}: forward-only schedule contains backward actions")


# Per kind of pass over a stage, the ops that run it; each stage's first of them must be micro-batch 0.
_FIRST_MICROBATCH_PASSES = (("forward", frozenset({Op.F})), ("backward (B or I)", INPUT_GRAD_OPS),
                            ("weight-gradient pass (B or W)", frozenset({Op.B, Op.W})))


def check_first_microbatch(schedule: Schedule) -> None:
    """Each stage runs micro-batch 0 first in F, in B/I and in B/W. Megatron tells TransformerEngine's layers
    which micro-batch is a step's first (`is_first_microbatch`, set by forward_step at micro-batch 0): its
    forward re-quantizes the FP8 weight copies the later micro-batches reuse, and its backward overwrites the
    fused weight gradient (`accumulate = fuse_wgrad_accumulation and not is_first_microbatch`; at W when the
    weight GEMMs are deferred, at B or I otherwise) where the others accumulate. Another micro-batch first would
    run on last step's FP8 weights, or have its gradient overwritten by micro-batch 0's."""
    for r, acts in enumerate(schedule.ranks):
        seen: set[tuple[str, int]] = set()
        for i, a in enumerate(acts):
            for what, ops in _FIRST_MICROBATCH_PASSES:
                if a.op not in ops or (what, a.stage) in seen:
                    continue
                seen.add((what, a.stage))
                if a.microbatch != 0:
                    raise ScheduleError(
                        f"rank {r} step {i}: {a.text} is stage {a.stage}'s first {what}, before micro-batch 0 "
                        "(TransformerEngine re-quantizes FP8 weights in micro-batch 0's forward and overwrites "
                        "the fused weight gradient in its backward, from is_first_microbatch): run micro-batch 0 "
                        "first in each stage's F, B/I and B/W"
                    )


def _deps(schedule: Schedule, a: Action, split: set[tuple[int, int]]) -> list[tuple[int, Action]]:
    """(rank, action) pairs that must have executed before `a` can start; `split` holds the (stage, microbatch)
    whose backward is an I and a W."""
    last = schedule.num_stages - 1
    s, m, pp = a.stage, a.microbatch, schedule.pp
    local = pp == 1
    # Receives are posted without blocking; the compute that consumes one waits for its send.
    if a.op == Op.F:
        if s == 0:
            return []
        if local:
            return [(schedule.rank_of(s), Action(Op.F, s - 1, m))]
        return [(schedule.rank_of(s), Action(Op.RECV_F, s, m)), (schedule.rank_of(s - 1), Action(Op.SEND_F, s - 1, m))]
    if a.op == Op.W:
        return [(schedule.rank_of(s), Action(Op.I, s, m))]
    if a.op in INPUT_GRAD_OPS:
        deps = [(schedule.rank_of(s), Action(Op.F, s, m))]
        if s < last:
            if local:
                deps.append((schedule.rank_of(s), Action(Op.I if (s + 1, m) in split else Op.B, s + 1, m)))
            else:
                deps += [(schedule.rank_of(s), Action(Op.RECV_B, s, m)),
                         (schedule.rank_of(s + 1), Action(Op.SEND_B, s + 1, m))]
        return deps
    if a.op == Op.SEND_F:
        return [(schedule.rank_of(s), Action(Op.F, s, m))]
    if a.op == Op.SEND_B:
        return [(schedule.rank_of(s), Action(Op.I if (s, m) in split else Op.B, s, m))]
    return []


def _ends(schedule: Schedule, a: Action) -> tuple[int, int] | None:
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
    """Every send has its receive and vice versa, matched in the same order on both ends per (source rank,
    destination rank, channel).

    Activations and gradients travel on separate channels (separate process groups in the runtime), so their
    relative order never has to agree. A single shared channel is what makes Megatron's interleaved PP = 2
    order ambiguous.
    """
    if schedule.pp == 1:
        for r, acts in enumerate(schedule.ranks):
            for i, a in enumerate(acts):
                if _ends(schedule, a) is not None:
                    raise ScheduleError(f"rank {r} step {i}: {a.text} with pp=1 has no peer")
        return
    last = schedule.num_stages - 1
    sends: dict[tuple[int, int, str], list[tuple[str, int, int]]] = {}
    recvs: dict[tuple[int, int, str], list[tuple[str, int, int]]] = {}
    for r, acts in enumerate(schedule.ranks):
        for i, a in enumerate(acts):
            pair = _ends(schedule, a)
            if pair is None:
                continue
            ch = (*pair, a.channel)
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
                    f"channel rank {ch[0]} -> rank {ch[1]} ({ch[2]!r}), message {k}: rank {ch[0]} sends {_payload(sent)} "
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
    zero3 = zero_stage_of(schedule) == 3
    # ZeRO-3: stages the step boundary gathers stay gathered into the next iteration, whose first GATHER of
    # them finds them so (steady state: the iteration starts as the previous one ended).
    carried = [set(tail_gathers(schedule, r)) if zero3 else set() for r in range(schedule.pp)]
    gathered: list[set[int]] = [set(c) for c in carried]
    fresh = [set(c) for c in carried]  # carried and not released since: a GATHER of them is a no-op
    split = schedule.split_pairs()
    order: list[tuple[int, int]] = []
    total = sum(len(a) for a in schedule.ranks)
    pending = deque(range(schedule.pp))
    while len(order) < total:
        progressed = False
        for r in range(schedule.pp):
            while pcs[r] < len(schedule.ranks[r]):
                a = schedule.ranks[r][pcs[r]]
                if not all(dep in done[dr] for dr, dep in _deps(schedule, a, split)):
                    break
                if a.op == Op.GATHER and not zero3:
                    pass  # ZeRO-1/2: the step boundary's all-gather of resident parameters (check_step)
                elif a.op == Op.GATHER and a.stage in fresh[r]:
                    fresh[r].discard(a.stage)
                elif a.op == Op.GATHER:
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
                    fresh[r].discard(a.stage)
                elif a.op in schedule.weight_ops and zero3 and a.stage not in gathered[r]:
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
        if zero3 and gathered[r] != carried[r]:
            raise ScheduleError(f"rank {r}: stages {sorted(gathered[r] - carried[r])} still gathered at the end of "
                                "the step (only the step boundary's gathers carry into the next iteration)")
    return order


def zero_stage_of(schedule: Schedule) -> int | None:
    """The schedule's ZeRO stage, or for one loaded without it (a CSV file) what its actions imply: 3 when
    parameters are gathered before the step boundary, 1 (or 2: alike in their actions) with REDUCEs alone."""
    if schedule.zero_stage is not None:
        return schedule.zero_stage
    for r, acts in enumerate(schedule.ranks):
        boundary = schedule.step_boundary(r)
        if any(a.op == Op.GATHER for a in acts[:boundary]):
            return 3
    return 1 if any(a.op in (Op.REDUCE, Op.STEP) for acts in schedule.ranks for a in acts) else None


def tail_gathers(schedule: Schedule, rank: int) -> list[int]:
    """Stages the rank's step boundary all-gathers (after their STEP)."""
    return [a.stage for a in schedule.step_tail(rank) if a.op == Op.GATHER]


def check_step(schedule: Schedule) -> None:
    """The step boundary: after a rank's first STEP come only STEPs and parameter all-gathers; one STEP per
    local stage, after its REDUCE; each all-gather after its stage's STEP (ZeRO-1/2: one per stage; ZeRO-3: at
    most `weight_buffers` stages, which stay gathered). No p2p action may follow: the gradient norm's all-reduce,
    before the first STEP, meets every rank of the model, and under NCCL a peer waiting on a later send or
    receive would never get there."""
    zero = zero_stage_of(schedule)
    has_step = any(a.op == Op.STEP for acts in schedule.ranks for a in acts)
    if not has_step:
        if zero in (1, 2) and any(a.op == Op.GATHER for acts in schedule.ranks for a in acts):
            raise ScheduleError(f"ZeRO-{zero} schedule gathers parameters without an optimizer step")
        return
    if schedule.forward_only:
        raise ScheduleError("a forward-only schedule has no STEP actions (the optimizer steps after training only)")
    for r, acts in enumerate(schedule.ranks):
        start = schedule.step_boundary(r)
        assert start is not None
        for i, a in enumerate(acts[:start]):
            if a.op == Op.GATHER and zero != 3:
                raise ScheduleError(f"rank {r} step {i}: {a.text} before the optimizer step (ZeRO-{zero} "
                                    "parameters are resident: they are all-gathered after their STEP)")
        reduced = {b.stage for b in acts[:start] if b.op == Op.REDUCE}
        stepped: list[int] = []
        gathered: list[int] = []
        for i, a in enumerate(acts[start:], start):
            if a.op == Op.STEP:
                if a.stage in stepped:
                    raise ScheduleError(f"rank {r} step {i}: {a.text} appears twice")
                if a.stage not in reduced:
                    raise ScheduleError(f"rank {r} step {i}: {a.text} has no REDUCE of its gradients before it")
                stepped.append(a.stage)
            elif a.op == Op.GATHER:
                if a.stage not in stepped or a.stage in gathered:
                    raise ScheduleError(f"rank {r} step {i}: {a.text} must follow STEP{a.stage} once (it all-gathers "
                                        "the parameters that step updated)")
                gathered.append(a.stage)
            else:
                raise ScheduleError(f"rank {r} step {i}: {a.text} after the optimizer step began (step {start}): only "
                                    "STEP and GATHER may follow the gradient norm's all-reduce")
        missing = sorted(set(schedule.stages_of(r)) - set(stepped))
        if missing:
            raise ScheduleError(f"rank {r}: no STEP for stages {missing}")
        if zero in (1, 2) and sorted(gathered) != sorted(stepped):
            raise ScheduleError(f"rank {r}: ZeRO-{zero} all-gathers every stage after its STEP; "
                                f"stages {sorted(set(stepped) - set(gathered))} have none")
        if zero == 3 and len(gathered) > schedule.weight_buffers:
            raise ScheduleError(f"rank {r}: the step boundary gathers {len(gathered)} stages into the next iteration; "
                                f"{schedule.weight_buffers} weight buffers")


def check_batches(schedule: Schedule) -> None:
    """Actions of one batch are consecutive p2p actions on one channel."""
    for r, acts in enumerate(schedule.ranks):
        seen: dict[int, int] = {}
        for i, a in enumerate(acts):
            if a.batch is None:
                continue
            if a.op not in P2P_OPS:
                raise ScheduleError(f"rank {r} step {i}: {a.text} carries a batch but is not a p2p action")
            if a.batch in seen:
                prev = acts[i - 1]
                if prev.batch != a.batch:
                    raise ScheduleError(
                        f"rank {r} step {i}: {a.text} belongs to batch {a.batch}, whose actions are not consecutive "
                        f"(first at step {seen[a.batch]}): a batch is posted as one batch_isend_irecv group")
                if prev.channel != a.channel:
                    raise ScheduleError(f"rank {r} step {i}: batch {a.batch} mixes channels {prev.channel!r} and "
                                        f"{a.channel!r} (batch_isend_irecv takes one process group)")
            else:
                seen[a.batch] = i


def _p2p_partners(schedule: Schedule) -> dict[tuple[int, int], tuple[int, int]]:
    """(rank, step) of each p2p action -> (rank, step) of its match: k-th send to k-th receive per
    (channel, source, destination)."""
    sends: dict[tuple[str, int, int], list[tuple[int, int]]] = {}
    recvs: dict[tuple[str, int, int], list[tuple[int, int]]] = {}
    for r, acts in enumerate(schedule.ranks):
        for i, a in enumerate(acts):
            pair = _ends(schedule, a)
            if pair is None:
                continue
            key = (a.channel, *pair)
            (sends if a.op in (Op.SEND_F, Op.SEND_B) else recvs).setdefault(key, []).append((r, i))
    partners: dict[tuple[int, int], tuple[int, int]] = {}
    for key in set(sends) | set(recvs):
        s_list, r_list = sends.get(key, []), recvs.get(key, [])
        if len(s_list) != len(r_list):
            raise ScheduleError(f"channel {key[0]!r} rank {key[1]} -> rank {key[2]}: {len(s_list)} sends but "
                                f"{len(r_list)} receives")
        for x, y in zip(s_list, r_list):
            partners[x] = y
            partners[y] = x
    return partners


def simulate_nccl(schedule: Schedule, single_queue: bool = False) -> None:
    """Run the lowered schedule under NCCL's semantics (see the module docstring); raise on a deadlock,
    naming each rank, step, channel and the cycle of waits."""
    if schedule.pp == 1 or not schedule.lowered:
        return
    partners = _p2p_partners(schedule)
    model = "one queue per rank (CUDA_DEVICE_MAX_CONNECTIONS=1)" if single_queue else "one queue per communicator"
    # Per rank: queues of units (lists of steps); a batch is one unit.
    queues: dict[tuple[int, str], list[list[int]]] = {}
    queue_of: dict[tuple[int, int], tuple[int, str]] = {}
    computes_before: dict[tuple[int, int], int] = {}  # p2p step -> number of computes posted before it
    needs: dict[tuple[int, int], list[int]] = {}  # compute step -> p2p steps it waits on
    # The gradient norm's all-reduce, posted right before each rank's first STEP: a collective of every rank of
    # the model (the rendezvous below), on its own communicator, after the rank's computes.
    norm_at = {r: i for r in range(schedule.pp) if (i := schedule.step_boundary(r)) is not None}
    for r, acts in enumerate(schedule.ranks):
        pos = {a: i for i, a in enumerate(acts)}
        n_compute = 0
        for i, a in enumerate(acts):
            if norm_at.get(r) == i:
                qn = "all" if single_queue else "norm"
                computes_before[(r, i)] = n_compute
            elif a.op in COMPUTE_OPS:
                qn = "all" if single_queue else "compute"
                deps = []
                if a.op == Op.F and a.stage > 0:
                    deps.append(pos.get(Action(Op.RECV_F, a.stage, a.microbatch)))
                if a.op in INPUT_GRAD_OPS:
                    deps.append(pos.get(Action(Op.RECV_B, a.stage, a.microbatch)))
                    deps.append(pos.get(Action(Op.SEND_F, a.stage, a.microbatch)))  # output sent before its backward
                needs[(r, i)] = [d for d in deps if d is not None]
                n_compute += 1
            elif a.op in P2P_OPS:
                qn = "all" if single_queue else a.channel
                computes_before[(r, i)] = n_compute
            elif single_queue:
                qn = "all"  # data-parallel collectives: same position on every data-parallel peer
            else:
                continue
            q = queues.setdefault((r, qn), [])
            if a.batch is not None and q and acts[q[-1][-1]].batch == a.batch and q[-1][-1] == i - 1:
                q[-1].append(i)
            else:
                q.append([i])
            queue_of[(r, i)] = (r, qn)
    head = {k: 0 for k in queues}
    done: set[tuple[int, int]] = set()
    computes_done = [0] * schedule.pp

    def unit_at_head(r: int, i: int) -> bool:
        return _unit_at_head(queues, head, queue_of, r, i)

    def ready(r: int, i: int) -> bool:
        if single_queue:
            return True
        return computes_done[r] >= computes_before[(r, i)]

    def active(r: int, i: int) -> bool:
        return unit_at_head(r, i) and ready(r, i)

    progressed = True
    while progressed:
        progressed = False
        for k, units in queues.items():
            r = k[0]
            while head[k] < len(units):
                unit = units[head[k]]
                a = schedule.ranks[r][unit[0]]
                if norm_at.get(r) == unit[0]:
                    if (r, unit[0]) not in done:
                        if not all(active(q, j) for q, j in norm_at.items()):
                            break
                        done.update(norm_at.items())
                elif a.op in COMPUTE_OPS:
                    if not all((r, d) in done for d in needs[(r, unit[0])]):
                        break
                    computes_done[r] += 1
                elif a.op in P2P_OPS:
                    if not ready(r, unit[0]):
                        break
                    for i in unit:
                        if (r, i) not in done:
                            q, j = partners[(r, i)]
                            if active(q, j):
                                done.update({(r, i), (q, j)})
                    if not all((r, i) in done for i in unit):
                        break
                done.update((r, i) for i in unit)
                head[k] += 1
                progressed = True
    stuck = [k for k in queues if head[k] < len(queues[k])]
    if stuck:
        raise ScheduleError(f"deadlock under NCCL semantics ({model}): " + _nccl_cycle(
            schedule, stuck[0], queues, head, queue_of, partners, needs, done, computes_before, computes_done,
            single_queue, norm_at))


def _unit_at_head(queues, head, queue_of, r: int, i: int) -> bool:
    """Whether rank r's step i belongs to the unit at the head of its queue (the next that queue runs)."""
    k = queue_of[(r, i)]
    return head[k] < len(queues[k]) and i in queues[k][head[k]]


def _nccl_cycle(schedule, start, queues, head, queue_of, partners, needs, done, computes_before, computes_done,
                single_queue, norm_at) -> str:
    """Follow what each blocked queue waits for until a queue repeats; describe that cycle."""
    def describe(k: tuple[int, str]) -> tuple[tuple[int, str], str]:
        r = k[0]
        unit = queues[k][head[k]]
        i = unit[0]
        a = schedule.ranks[r][i]
        where = f"rank {r} step {i} {a.text}"
        if norm_at.get(r) == i:
            if not single_queue and computes_done[r] < computes_before[(r, i)]:
                return (r, "compute"), f"{where}: the gradient norm's all-reduce waits for the computes before it"
            q = next(q for q, j in norm_at.items() if not _unit_at_head(queues, head, queue_of, q, j))
            return queue_of[(q, norm_at[q])], (f"{where}: the gradient norm's all-reduce before it waits for rank {q} "
                                               f"(its step {norm_at[q]})")
        if a.op in COMPUTE_OPS:
            d = next(d for d in needs[(r, i)] if (r, d) not in done)
            b = schedule.ranks[r][d]
            why = "posted after it" if d > i else "not complete"
            return queue_of[(r, d)], f"{where} waits for {b.text} (step {d}, {why})"
        if not single_queue and computes_done[r] < computes_before[(r, i)]:
            return (r, "compute"), f"{where} on {a.channel!r} waits for the computes posted before it"
        j_own = next(j for j in unit if (r, j) not in done)
        q, j = partners[(r, j_own)]
        b = schedule.ranks[r][j_own]
        return queue_of[(q, j)], (f"{where} on channel {b.channel!r}: {b.text} waits for rank {q} to post "
                                  f"{schedule.ranks[q][j].text} (its step {j})")

    seen: list[tuple[int, str]] = []
    notes: list[str] = []
    k = start
    while k not in seen:
        seen.append(k)
        if head[k] >= len(queues[k]):
            notes.append(f"rank {k[0]} queue {k[1]!r} finished")
            break
        k, note = describe(k)
        notes.append(note)
    first = seen.index(k) if k in seen else 0
    return "cycle: " + "; ".join(notes[first:])


def check_reduce(schedule: Schedule) -> None:
    """With data-parallel actions: every stage reduce-scattered after its last backward, nothing after."""
    if schedule.zero_stage is None or schedule.forward_only:
        return
    for r, acts in enumerate(schedule.ranks):
        for s in schedule.stages_of(r):
            last_b = max(i for i, a in enumerate(acts) if a.op in schedule.grad_write_ops and a.stage == s)
            reduces = [i for i, a in enumerate(acts) if a.op == Op.REDUCE and a.stage == s]
            if not reduces or reduces[-1] < last_b:
                raise ScheduleError(f"rank {r}: stage {s} has no REDUCE after its last backward (step {last_b})")


def peak_activations(schedule: Schedule) -> list[int]:
    """Per rank, the largest number of (stage, microbatch) forward activations alive (F done, B or I not yet).
    What a pending W keeps (the inputs of the weight GEMMs, less than the layer's activations) is counted by
    `peak_pending_weight_grads`."""
    peaks = []
    for acts in schedule.ranks:
        alive = peak = 0
        for a in acts:
            if a.op == Op.F:
                alive += 1
                peak = max(peak, alive)
            elif a.op in INPUT_GRAD_OPS:
                alive -= 1
        peaks.append(peak if not schedule.forward_only else 1 if peak else 0)
    return peaks


def peak_pending_weight_grads(schedule: Schedule) -> list[int]:
    """Per rank, the largest number of (stage, microbatch) whose I ran and W did not yet."""
    peaks = []
    for acts in schedule.ranks:
        pending = peak = 0
        for a in acts:
            pending += 1 if a.op == Op.I else -1 if a.op == Op.W else 0
            peak = max(peak, pending)
        peaks.append(peak)
    return peaks


def _compute_only_lowering(schedule: Schedule) -> Schedule:
    """Receives right before their compute, sends right after it: a buffered-send order that completes exactly
    when the compute order respects the data dependencies."""
    last = schedule.num_stages - 1
    ranks = []
    for acts in schedule.ranks:
        out: list[Action] = []
        for a in acts:
            if a.op == Op.F:
                out += ([Action(Op.RECV_F, a.stage, a.microbatch)] if a.stage > 0 else []) + [a]
                out += [Action(Op.SEND_F, a.stage, a.microbatch)] if a.stage < last else []
            elif a.op in INPUT_GRAD_OPS:
                out += ([Action(Op.RECV_B, a.stage, a.microbatch)] if a.stage < last else []) + [a]
                out += [Action(Op.SEND_B, a.stage, a.microbatch)] if a.stage > 0 else []
            else:
                out.append(a)
        ranks.append(out)
    return Schedule(schedule.name, schedule.pp, schedule.vp, schedule.microbatches, schedule.group_size, ranks,
                    lowered=True, forward_only=schedule.forward_only)


def validate(schedule: Schedule) -> Schedule:
    """Raise ScheduleError on the first problem; return the schedule unchanged when it is sound."""
    check_compute(schedule)
    check_first_microbatch(schedule)
    check_p2p(schedule)
    check_batches(schedule)
    check_step(schedule)
    if not schedule.lowered and schedule.pp > 1:
        # Dependencies of an unlowered schedule: its compute order must complete with data dependencies alone.
        simulate_order(_compute_only_lowering(schedule))
    else:
        simulate_order(schedule)
        simulate_nccl(schedule, single_queue=False)
        simulate_nccl(schedule, single_queue=True)
    check_reduce(schedule)
    return schedule
