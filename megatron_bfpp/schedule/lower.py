"""Lowering passes: add pipeline p2p actions, then data-parallel GATHER / RELEASE / REDUCE actions.

p2p: each rank's SEND/RECV actions are listed in the order the rank posts them, with batched groups marked;
the order is built to be deadlock-free under NCCL's rendezvous semantics (see `add_p2p`), and `validate`
checks it under those semantics and under gloo's.

Data parallel, over "runs" (maximal stretches of consecutive compute actions on one stage):
- ZeRO-3 keeps at most `weight_buffers` stages gathered. The stage of the next run is gathered before the
  current run starts (prefetch); when all buffers are taken, the gathered stage used furthest in the future
  is released right after its last run so far. Everything still gathered is released at the end of the step.
- ZeRO-2/3 keep at most `grad_buffers` full-size gradient buffers. A stage's gradient is reduce-scattered
  right after its last backward (B, or W for a split backward) of the accumulation group (the breadth-first group, otherwise the step), or
  earlier when its buffer must be handed to another stage.
- ZeRO-1 keeps full gradients and reduce-scatters each stage once, right after its last backward of the step.

Optimizer step (`add_optimizer_step`), at the end of each rank's list: one STEP per local stage, in the order
the rank's list first uses its stages (the order the next iteration's forward needs them), each followed by
the all-gather of the updated parameters it allows: every stage under ZeRO-1/2 (their resident parameters),
the first stage under ZeRO-3 (the next iteration's first GATHER of it then finds it gathered). The gradient
norm that clipping needs is the one synchronisation before the first STEP; the next forward waits for one
stage's step and gather, not for the whole optimizer.
"""

from __future__ import annotations

import dataclasses

from .ir import COMPUTE_OPS, INPUT_GRAD_OPS, P2P_OPS, Action, Op, Schedule, ScheduleError, grad_write_ops, weight_ops
from .kinds import KINDS
from .pairs import pairs_of


# Nominal compute durations used to decide where transfers go (the order, not the timing, is what matters).
NOMINAL = {Op.F: 1.0, Op.B: 2.0, Op.I: 1.0, Op.W: 1.0}


def _message(schedule: Schedule, a: Action) -> tuple[str, int, int, int] | None:
    """(kind, producing stage, microbatch, consumer rank) of the message a compute action sends, if any."""
    if a.op == Op.F and a.stage < schedule.num_stages - 1:
        return ("F", a.stage, a.microbatch, schedule.rank_of(a.stage + 1))  # type: ignore[return-value]
    if a.op in INPUT_GRAD_OPS and a.stage > 0:
        return ("B", a.stage, a.microbatch, schedule.rank_of(a.stage - 1))  # type: ignore[return-value]
    return None


def _needs(schedule: Schedule, a: Action) -> tuple[str, int, int] | None:
    """(kind, producing stage, microbatch) of the message a compute action consumes, if any."""
    if a.op == Op.F and a.stage > 0:
        return ("F", a.stage - 1, a.microbatch)  # type: ignore[return-value]
    if a.op in INPUT_GRAD_OPS and a.stage < schedule.num_stages - 1 and not schedule.forward_only:
        return ("B", a.stage + 1, a.microbatch)  # type: ignore[return-value]
    return None


def add_p2p(schedule: Schedule) -> Schedule:
    """Insert SEND_F/RECV_F/SEND_B/RECV_B in the order each rank posts them, safe under NCCL's semantics.

    NCCL (worst case) runs a rank's p2p ops on one communicator in posting order, completes a send only once
    its receive is posted, and with CUDA_DEVICE_MAX_CONNECTIONS=1 serialises everything a rank posts. A
    posting order is safe under all of these when it is the projection of one global sequence of events in
    which every transfer is a single event that both ends take part in. This pass builds such a sequence by
    running the compute order on nominal durations: a produced message waits in its producer's outbox until
    producer and consumer are both between computes, and is then transferred (SEND on one, RECV on the
    other, at the same point of the sequence). The consumer keeps received inputs until its compute needs
    them. Consecutive transfers of one rank at the same instant on the same channel are posted as one
    batch. `validate` re-checks the result against the NCCL models.

    With a pairing (`Schedule.pairing`, `pairs`) each pair runs as one compute that needs both inputs before it
    starts and produces both outputs when it ends.
    """
    if schedule.lowered:
        return schedule
    if schedule.pp == 1:  # every stage on one rank: no p2p
        return dataclasses.replace(schedule, lowered=True)
    for r, actions in enumerate(schedule.ranks):
        for i, a in enumerate(actions):
            if a.op not in COMPUTE_OPS:
                raise ScheduleError(f"add_p2p expects only compute actions, found rank {r} step {i}: {a.text}")
    pp = schedule.pp
    computes = schedule.ranks
    merged = [pairs_of(schedule, r) for r in range(pp)]  # first -> partner (the next compute)
    pc = [0] * pp
    free_at = [0.0] * pp  # end of the rank's current compute
    # (kind, consumer rank) -> (producing stage, microbatch) of the messages produced and not yet transferred
    outbox: list[dict[tuple[str, int], list[tuple[int, int]]]] = [{} for _ in range(pp)]
    inbox: list[set[tuple[str, int, int]]] = [set() for _ in range(pp)]
    produced_at: list[list[tuple[float, tuple[str, int, int, int]]]] = [[] for _ in range(pp)]
    out: list[list[tuple[Action, tuple[float, int]]]] = [[] for _ in range(pp)]  # (action, instant)
    t, round_ = 0.0, 0

    def done() -> bool:
        return all(pc[r] == len(computes[r]) for r in range(pp)) and not any(
            q for box in outbox for q in box.values()) and not any(produced_at)

    while not done():
        progressed = True
        while progressed:
            progressed = False
            round_ += 1
            avail = [free_at[r] <= t for r in range(pp)]
            for r in range(pp):  # computes that ended by now hand their messages to the outbox
                while produced_at[r] and produced_at[r][0][0] <= t:
                    kind, stage, mb, dst = produced_at[r].pop(0)[1]
                    outbox[r].setdefault((kind, dst), []).append((stage, mb))
            # Transfers between ranks that are both between computes: activations first, then gradients
            # (one fixed global order, so both ends agree), each channel first-in first-out.
            for kind in ("F", "B"):
                for r in range(pp):
                    for (k, dst), queue in sorted(outbox[r].items()):
                        if k != kind or not avail[r] or not avail[dst]:
                            continue
                        while queue:
                            stage, mb = queue.pop(0)
                            send_op, recv_op = (Op.SEND_F, Op.RECV_F) if kind == "F" else (Op.SEND_B, Op.RECV_B)
                            out[r].append((Action(send_op, stage, mb), (t, round_)))
                            out[dst].append((Action(recv_op, stage + 1 if kind == "F" else stage - 1, mb),
                                             (t, round_)))
                            inbox[dst].add((kind, stage, mb))
                            progressed = True
            for r in range(pp):
                if not avail[r] or pc[r] == len(computes[r]):
                    continue
                a = computes[r][pc[r]]
                unit = (a, computes[r][pc[r] + 1]) if merged[r] and pc[r] in merged[r] else (a,)  # or a pair
                needs = [n for n in (_needs(schedule, x) for x in unit) if n is not None]
                if needs and any(n not in inbox[r] for n in needs):
                    continue  # idle until the inputs arrive
                inbox[r].difference_update(needs)
                pc[r] += len(unit)
                free_at[r] = t + sum(NOMINAL[x.op] for x in unit)
                for x in unit:
                    out[r].append((x, (t, round_)))
                    msg = _message(schedule, x)
                    if msg is not None:
                        produced_at[r].append((free_at[r], msg))
                progressed = True
        upcoming = [free_at[r] for r in range(pp) if free_at[r] > t]
        upcoming += [p[0][0] for p in produced_at if p and p[0][0] > t]
        if not upcoming:
            if done():
                break
            stuck = [f"rank {r} waits at {computes[r][pc[r]].text}" for r in range(pp) if pc[r] < len(computes[r])]
            raise ScheduleError((f"the {schedule.pairing} pairing's " if schedule.pairing else "")
                                + "compute order cannot complete: " + "; ".join(stuck))
        t = min(upcoming)
    return dataclasses.replace(schedule, ranks=[_batch(acts) for acts in out], lowered=True)


def _batch(timed: list[tuple[Action, tuple[float, int]]]) -> list[Action]:
    """Number runs of consecutive p2p actions posted at one instant on one channel as one batch."""
    result: list[Action] = []
    i, next_id = 0, 0
    while i < len(timed):
        a, when = timed[i]
        j = i + 1
        if a.op in P2P_OPS:
            while j < len(timed) and timed[j][0].op in P2P_OPS and timed[j][1] == when and timed[j][0].channel == a.channel:
                j += 1
        if j - i > 1:
            result += [dataclasses.replace(b, batch=next_id) for b, _ in timed[i:j]]
            next_id += 1
        else:
            result.append(a)
        i = j
    return result


def accumulation_group(schedule: Schedule, microbatch: int) -> int:
    """Index of the gradient-accumulation group of a micro-batch (the groups of kinds whose groups run one after
    the other, e.g. breadth-first; else one per step)."""
    kind = KINDS.get(schedule.name)  # None for a schedule loaded from a file under another name
    if kind is not None and kind.sequential_groups and schedule.group_size:
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
            runs[-1] += pending + [a]  # receives posted before this send stay before it
            pending = []
            continue
        raise ScheduleError(f"data-parallel lowering expects no {a.op} actions yet (found {a.text})")
    if pending:
        raise ScheduleError(f"receives {[p.text for p in pending]} feed no compute action")
    return runs


def _run_stage(run: list[Action]) -> int:
    return next(a.stage for a in run if a.op in COMPUTE_OPS)


def add_data_parallel(
    schedule: Schedule, zero_stage: int, weight_buffers: int = 2, grad_buffers: int = 2,
    w_needs_weights: bool = True, i_writes_grads: bool = False,
) -> Schedule:
    """Insert GATHER/RELEASE/REDUCE for ZeRO stage 1, 2 or 3 with a bounded number of buffers. With
    `w_needs_weights` False a W is not a use of its stage's weights (ZeRO-3 may release them before it); with
    `i_writes_grads` an I writes its stage's gradient buffer (it is taken at the first I, not the first W)."""
    if zero_stage not in (1, 2, 3):
        raise ScheduleError(f"--zero-stage must be 1, 2 or 3 (got {zero_stage})")
    if weight_buffers < 1 or grad_buffers < 1:
        raise ScheduleError("--weight-buffers and --grad-buffers must be >= 1")
    if schedule.zero_stage is not None:
        raise ScheduleError("schedule already has data-parallel actions")
    ranks = [
        _lower_rank_dp(schedule, actions, zero_stage, weight_buffers, grad_buffers, weight_ops(w_needs_weights),
                       grad_write_ops(i_writes_grads))
        for actions in schedule.ranks
    ]
    return dataclasses.replace(
        schedule, ranks=ranks, zero_stage=zero_stage, weight_buffers=weight_buffers, grad_buffers=grad_buffers,
        w_needs_weights=w_needs_weights, i_writes_grads=i_writes_grads,
    )


def _lower_rank_dp(schedule: Schedule, actions: list[Action], zero: int, nw: int, ng: int,
                   reads_weights: frozenset[Op], writes_grads: frozenset[Op]) -> list[Action]:
    """One rank's data-parallel actions. Ops in `writes_grads` need their stage's gradient buffer and its REDUCE
    follows the last of them (without fused accumulation, the small gradients an I computes besides the
    deferred weight GEMMs wait beside their parameter until its W)."""
    runs = _runs(actions)
    stages = [_run_stage(r) for r in runs]
    weight_runs = [i for i, r in enumerate(runs) if any(a.op in reads_weights for a in r)]
    pre: list[list[Action]] = [[] for _ in runs]
    post: list[list[Action]] = [[] for _ in runs]
    tail: list[Action] = []

    def next_grad_use(stage: int, after: int) -> int:
        for j in range(after + 1, len(runs)):
            if stages[j] == stage and any(a.op in writes_grads for a in runs[j]):
                return j
        return len(runs) + 1  # never again this step

    if zero == 3:
        resident: list[int] = []
        last_run: dict[int, int] = {}

        def next_weight_use(stage: int, after: int) -> int:
            return next((j for j in weight_runs if j > after and stages[j] == stage), len(runs) + 1)

        def make_room(i: int, keep: int, due: int | None = None) -> bool:
            """Free a weight buffer at run i, keeping `keep`; for a prefetch due at run `due`, only by evicting
            a stage not used again before it."""
            if len(resident) < nw:
                return True
            victims = [s for s in resident if s != keep and (due is None or next_weight_use(s, i) > due)]
            if not victims:
                return False
            victim = max(victims, key=lambda s: next_weight_use(s, i))
            resident.remove(victim)
            post[last_run[victim]].append(Action(Op.RELEASE, victim))
            return True

        for k, i in enumerate(weight_runs):
            s = stages[i]
            if s not in resident:  # first run, or a prefetch that had no free buffer
                if k > 0 and not make_room(i, s):
                    raise ScheduleError("internal: no weight buffer for the current stage")  # nw >= 1
                pre[i].append(Action(Op.GATHER, s))
                resident.append(s)
            # Prefetch the next stage another weight run uses: the next run, or (split backward, where runs of
            # one stage are cut by W's of others) the first run past this stage's.
            nxt_k = next((j for j in range(k + 1, len(weight_runs)) if stages[weight_runs[j]] != s), None)
            if nxt_k is not None and stages[weight_runs[nxt_k]] not in resident:
                nxt = stages[weight_runs[nxt_k]]
                if make_room(i, s, weight_runs[nxt_k]):
                    pre[i].append(Action(Op.GATHER, nxt))
                    resident.append(nxt)
                elif nxt_k == k + 1 and nw == 1:  # one buffer only: gather after this run, without overlap
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
        return accumulation_group(schedule, next(a.microbatch for a in run if a.op in writes_grads))  # type: ignore[arg-type]

    bwd_runs = [i for i, r in enumerate(runs) if any(a.op in writes_grads for a in r)]
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
                victim = max((v for v in grad_resident if v != s), key=lambda v: next_grad_use(v, i))
                grad_resident.remove(victim)
                post[last_bwd[victim]].append(Action(Op.REDUCE, victim))
            grad_resident.append(s)
        last_bwd[s] = i
        if i in last_bwd_of_scope:
            post[i].append(Action(Op.REDUCE, s))
            if s in grad_resident:
                grad_resident.remove(s)

    def after_last(run: list[Action], ops: frozenset[Op]) -> int:
        """Index just past the run's last action in `ops` (and the gradient send that follows it)."""
        cut = max(k for k, a in enumerate(run) if a.op in ops) + 1
        return cut + 1 if cut < len(run) and run[cut].op == Op.SEND_B else cut

    def before_trailing_w(run: list[Action]) -> int:
        """Index of the run's first W after its last use of the weights (its end if there is none)."""
        cut = after_last(run, reads_weights)
        while cut < len(run) and run[cut].op not in COMPUTE_OPS:
            cut += 1
        return cut

    out: list[Action] = []
    for i, run in enumerate(runs):
        # A REDUCE goes right after the run's last backward (and its send), ahead of any forward that follows;
        # a RELEASE right after the run's last use of the weights (before trailing W's that do not read them).
        reduces = [a for a in post[i] if a.op == Op.REDUCE]
        others = [a for a in post[i] if a.op != Op.REDUCE]
        inserts: dict[int, list[Action]] = {}
        if reduces:
            inserts.setdefault(after_last(run, writes_grads), []).extend(reduces)
        if others:
            inserts.setdefault(before_trailing_w(run), []).extend(others)
        seq: list[Action] = []
        for k, a in enumerate(run):
            seq += inserts.get(k, [])
            seq.append(a)
        out += pre[i] + seq + inserts.get(len(run), [])
    return _keep_batches_together(out + tail)


def _keep_batches_together(actions: list[Action]) -> list[Action]:
    """Move data-parallel actions that landed inside a p2p batch to right after it (a batch is posted at once)."""
    last_of = {a.batch: i for i, a in enumerate(actions) if a.batch is not None}
    out: list[Action] = []
    held: list[Action] = []
    open_batch = None
    for i, a in enumerate(actions):
        if open_batch is not None and a.batch != open_batch:
            held.append(a)
            continue
        out.append(a)
        if a.batch is not None:
            open_batch = a.batch if i < last_of[a.batch] else None
            if open_batch is None:
                out += held
                held = []
    return out + held


def first_use_order(actions: list[Action]) -> list[int]:
    """The stages of a rank's list in the order its compute actions first use them."""
    order: list[int] = []
    for a in actions:
        if a.op in COMPUTE_OPS and a.stage not in order:
            order.append(a.stage)
    return order


def add_optimizer_step(schedule: Schedule) -> Schedule:
    """Append each rank's step boundary: STEP per stage in first-use order, each followed by the parameter
    all-gather it allows (ZeRO-1/2: every stage; ZeRO-3: the first stage, which the next iteration's first
    GATHER then finds gathered)."""
    if schedule.zero_stage is None:
        raise ScheduleError("the optimizer step is lowered after the data-parallel actions (--zero-stage)")
    if schedule.forward_only:
        raise ScheduleError("a forward-only schedule has no optimizer step")
    if any(a.op == Op.STEP for acts in schedule.ranks for a in acts):
        raise ScheduleError("schedule already has optimizer steps")
    ranks = []
    for acts in schedule.ranks:
        tail: list[Action] = []
        for k, s in enumerate(first_use_order(acts)):
            tail.append(Action(Op.STEP, s))
            if schedule.zero_stage in (1, 2) or k == 0:
                tail.append(Action(Op.GATHER, s))
        ranks.append(acts + tail)
    return dataclasses.replace(schedule, ranks=ranks)


def lower(
    schedule: Schedule, zero_stage: int | None = None, weight_buffers: int = 2, grad_buffers: int = 2,
    w_needs_weights: bool = True, i_writes_grads: bool = False, optimizer_step: bool = True,
) -> Schedule:
    """p2p lowering, then (if `zero_stage` is given) data-parallel lowering and, unless forward-only or
    `optimizer_step` is False (an optimizer outside the schedule, e.g. stock Megatron's), the step boundary."""
    lowered = add_p2p(schedule)
    if zero_stage is not None:
        lowered = add_data_parallel(lowered, zero_stage, weight_buffers, grad_buffers, w_needs_weights,
                                    i_writes_grads)
        if optimizer_step and not lowered.forward_only:
            lowered = add_optimizer_step(lowered)
    return lowered
