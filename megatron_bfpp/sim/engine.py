"""Event simulator: times a lowered schedule with a `Costs` table.

Each pipeline rank runs its action list in order on three streams:
- compute: F and B, in list order. An F/B starts when the compute stream is free and its inputs are there:
  the activation / gradient from the matching SEND (cross-rank dependency), its stage's parameters (ZeRO-3:
  the last GATHER of the stage, waited for at the first F/B after it, as the runtime does; ZeRO-1/2: the
  post-optimizer parameter all-gather, waited for bucket by bucket as Megatron's overlapped param gather),
  and, ZeRO-2/3, a free gradient buffer at the first B of a stage.
- p2p: SEND_F / SEND_B transfers, one lane per direction (activations and gradients use separate channels),
  each lane in list order; a transfer starts when its producing compute has finished and the lane is free. A
  RECV completes when the matching transfer ends. With `p2p_overlap` off (Megatron-LM 2022: blocking p2p) the
  sender's compute stream is held until its send completes.
- dp: GATHER / REDUCE collectives in list order. A GATHER needs a free weight buffer (freed at the RELEASE of
  its previous stage, once that stage's last compute ended). A REDUCE starts after the stage's last backward;
  with `reduce_buckets` > 1 it starts after the first bucket's share of that backward and ends no earlier than
  one bucket after it (bucketed gradient reduction overlapping the backward: Megatron's 1F1B on its first
  stage). With `dp_overlap` off
  (Megatron-LM 2022) every collective holds the compute stream, and ZeRO-0/1 gradient reductions run after
  the last backward of the rank, as Megatron did then.
Merged pairs (`Schedule.pairing`, `schedule.pairs`: the plugin's paired order, Megatron's combined 1F1B): a pair
of computations whose all-to-alls hide runs as one, when the compute stream is free and both inputs, the first's
parameters (and the partner's, if another stage's) are there; each hides min(its expert all-to-all, the partner's
cover: `Costs.moe_cover_*`) of its own, so the pair takes the two computations less what each hides, never less
than their all-to-alls together (they still run one after the other on the network) nor than their computations
together. Both outputs are ready when the pair ends. Actions outside a pair, and pairs with nothing to hide, run
one at a time with their all-to-all exposed (`EngineResult.exposed_moe_a2a_s`).
End of step: all ranks meet after their compute and outstanding REDUCEs (the optimizer needs every gradient
and a global gradient norm). Then, for a schedule without STEP actions (an optimizer outside the schedule:
stock Megatron's), they run the optimizer (slowest rank), and with ZeRO-1/2 and `dp_overlap` off all-gather
the updated parameters; with `dp_overlap` on that all-gather overlaps the next step's forward, which the
simulation models in steady state by issuing it at the start of the step (the first stage's
`Costs.param_sync_lead` earlier: Megatron's --overlap-param-gather-with-optimizer-step).

Schedule-placed optimizer step (STEP actions, `Schedule.step_tail`): the step ends at the meeting point plus
the gradient norm's all-reduce (`Costs.grad_norm`, latency only), and the rank's tail runs in steady state at
the start of the next step, in list order: each STEP s on the compute stream (`Costs.step[s]`), each tail
GATHER s on the dp stream once its STEP ended (ZeRO-1/2: `Costs.param_sync[s]`, waited for by the stage's
first F as the post-optimizer all-gather above; ZeRO-3: `Costs.gather[s]`, after which the stage is gathered
and the body's first GATHER of it is a no-op). A ZeRO-3 GATHER of the body also waits for its stage's STEP
(it gathers the updated shards). So the next forward waits for its first stage's step and all-gather, the
rank's other STEPs overlap that all-gather, and on later ranks they fall in the pipeline fill.

Time accounting per rank: every instant of the step is compute, bubble (waiting for another rank's compute),
exposed p2p (waiting on a transfer or blocked by a send), exposed dp (waiting on a collective or a buffer) or
optimizer (`optimizer_rank_s`: the whole optimizer for every rank without STEPs; with them, the rank's STEP
time and the gradient norm). Of the latter, `optimizer_exposed_s` is what delays the rank: without STEPs all
of it; with them the gradient norm and how much later the rank's first computation starts than it would with
free STEPs (its input and parameters otherwise ready no earlier); the rest (`optimizer_hidden_s`) ran while
the rank waited anyway. A wait on a later stage's tail all-gather counts as exposed dp.
A wait is charged to the dependency that ends it; a wait on a receive counts as bubble until the
producing compute ended and as p2p after. At the end of the step, idling until the last rank's compute ends
is bubble, and the time outstanding reductions add after that is exposed dp. `bubble_fraction` is bubble / compute (the (P-1)/(V*M) convention).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..schedule import COMPUTE_OPS, Action, Op, Schedule, ScheduleError, add_p2p
from ..schedule.pairs import pairs_of
from ..schedule.events import TimelineEvent
from ..schedule.lower import first_use_order
from .costs import Costs, most_hidden


@dataclass
class EngineResult:
    step_time_s: float
    compute_s: list[float]  # per rank: F/B busy time
    bubble_s: list[float]
    exposed_pp_s: list[float]
    exposed_dp_s: list[float]
    optimizer_s: float  # the slowest rank's optimizer work (its STEPs together, or the outside optimizer)
    pipeline_end_s: float  # when the last compute of the step ended
    dp_traffic: dict[str, list[int]]  # per rank: number of "gather" / "reduce" / "param_sync" collectives
    events: list[TimelineEvent] = field(default_factory=list)
    # Per rank: optimizer time of its step accounting (compute + bubble + p2p + dp + this = step time) and the
    # part of it the rank waits for (module docstring); the gradient norm's all-reduce (0 without STEPs).
    optimizer_rank_s: list[float] = field(default_factory=list)
    optimizer_exposed_s: list[float] = field(default_factory=list)
    grad_norm_s: float = 0.0
    # Per rank: seconds of its compute that are expert all-to-all the compute stream waits for (part of
    # `compute_s`), and how many of its actions ran merged with another (`Schedule.pairing`).
    exposed_moe_a2a_s: list[float] = field(default_factory=list)
    paired_actions: list[int] = field(default_factory=list)

    @property
    def optimizer_hidden_s(self) -> list[float]:
        """Per rank: optimizer time that ran while the rank would have waited anyway (STEPs in the fill)."""
        return [t - e for t, e in zip(self.optimizer_rank_s, self.optimizer_exposed_s)]

    @property
    def max_optimizer_exposed_s(self) -> float:
        return max(self.optimizer_exposed_s, default=0.0)

    @property
    def bubble_fraction(self) -> float:
        busy = sum(self.compute_s)
        return sum(self.bubble_s) / busy if busy else 0.0

    @property
    def bubble_fraction_per_rank(self) -> list[float]:
        return [b / c if c else 0.0 for b, c in zip(self.bubble_s, self.compute_s)]

    @property
    def mean_exposed_pp_s(self) -> float:
        return sum(self.exposed_pp_s) / len(self.exposed_pp_s)

    @property
    def mean_exposed_moe_a2a_s(self) -> float:
        return sum(self.exposed_moe_a2a_s) / len(self.exposed_moe_a2a_s) if self.exposed_moe_a2a_s else 0.0

    @property
    def mean_exposed_dp_s(self) -> float:
        return sum(self.exposed_dp_s) / len(self.exposed_dp_s)


_BUBBLE, _PP, _DP = 0, 1, 2


class _Rank:
    """Mutable per-rank state of the simulation."""

    __slots__ = ("r", "pc", "compute_free", "lane_free", "dp_free", "acct", "gather_end", "wbuf_free",
                 "gbuf_free", "grad_resident", "last_end", "last_b", "sync", "first_use_done", "deferred",
                 "counts", "compute_busy", "step_end", "fresh", "step_busy", "cf", "exposed", "started", "merged",
                 "a2a", "paired")

    def __init__(self, r: int, weight_buffers: int, grad_buffers: int) -> None:
        self.r = r
        self.pc = 0
        self.compute_free = 0.0
        self.lane_free = [0.0, 0.0]  # activations, gradients
        self.dp_free = 0.0
        self.acct = [0.0, 0.0, 0.0]  # bubble, pp, dp
        self.gather_end: dict[int, float] = {}
        self.wbuf_free = [0.0] * weight_buffers
        self.gbuf_free = [0.0] * grad_buffers
        self.grad_resident: set[int] = set()
        self.last_end: dict[int, float] = {}  # stage -> end of its last compute so far
        self.last_b: dict[int, tuple[float, float]] = {}  # stage -> (start, end) of its last backward
        self.sync: dict[int, tuple[float, float]] = {}  # stage -> post-optimizer all-gather (start, end)
        self.first_use_done: set[int] = set()
        self.deferred: list[Action] = []
        self.counts = {"gather": 0, "reduce": 0, "param_sync": 0}
        self.compute_busy = 0.0
        self.step_end: dict[int, float] = {}  # stage -> end of its STEP (the tail, at the start of the step)
        self.fresh: set[int] = set()  # ZeRO-3: gathered by the tail, not released since
        self.step_busy = 0.0
        # The tail with free STEPs (compute stream, and per stage its parameters' readiness): the reference for
        # how much the STEPs delay the rank's first computation.
        self.cf: dict = {"compute": 0.0, "dp": 0.0, "sync": {}, "gather_end": {}}
        self.exposed = 0.0
        self.started = False
        self.merged: dict[int, tuple[float, float]] = {}  # index of a pair's second -> its (start, end), run already
        self.a2a = 0.0  # exposed all-to-all seconds of its computations
        self.paired = 0


def _lowered(schedule: Schedule) -> Schedule:
    if schedule.lowered or schedule.pp == 1:
        return schedule
    return add_p2p(schedule)


def _has_step(sched: Schedule) -> bool:
    """Whether the optimizer step is schedule data (STEP actions) rather than a call after the schedule."""
    return any(a.op is Op.STEP for acts in sched.ranks for a in acts)


def _post_step_param_sync_s(sched: Schedule, costs: Costs) -> float:
    """Without dp overlap and without STEPs: the post-optimizer parameter all-gathers the step ends with (the
    slowest rank's, its stages one after the other)."""
    if costs.dp_overlap:
        return 0.0
    return max(sum(costs.param_sync[s] for s in sched.stages_of(r)) for r in range(sched.pp))


def _earliest_end(jobs: list[tuple[float, float]]) -> float:
    """When (release, duration) jobs on one stream end at the earliest: in order of release."""
    t = 0.0
    for release, dur in sorted(jobs):
        t = max(t, release) + dur
    return t


def _in_turn(release: np.ndarray, dur: float) -> np.ndarray:
    """When the k-th of a stage's jobs, each taking `dur`, starts at the earliest: after its release and the
    k-1-th's end (k * dur + the running maximum of release[j] - j * dur)."""
    k = np.arange(len(release)) * dur
    return k + np.maximum.accumulate(release - k)


def _after_both(prev: np.ndarray, p_prev: float, own: np.ndarray, p_own: float) -> np.ndarray:
    """For each k, the earliest end on one machine of k + 1 jobs released at `prev` (each taking p_prev) and k
    released at `own` (p_own), both non-decreasing: the most, over thresholds t among their releases, of t plus
    the work released at or after t. The k-th forward of a stage waits for those of the rank's stage before it
    (its micro-batch and the k before it passed there) and its own k."""
    m = len(prev)
    k = np.arange(m)
    taus = np.concatenate([prev, own])
    joins = np.concatenate([k, k + 1])  # the first k whose set holds that release
    work = (p_prev * np.maximum(0, k[None, :] + 1 - np.searchsorted(prev, taus)[:, None])
            + p_own * np.maximum(0, k[None, :] - np.searchsorted(own, taus)[:, None]))
    return np.where(joins[:, None] <= k[None, :], taus[:, None] + work, -np.inf).max(axis=0)


def step_lower_bound_s(schedule: Schedule, costs: Costs) -> float:
    """A step time that no order of `schedule`'s stages beats under `costs` and the rules of
    `simulate_schedule`: the largest of three things every order contains, each followed by what ends the step (the
    gradient norm with STEP actions, the optimizer outside the schedule otherwise).

    All rest on when the k-th forward (backward) of each stage can start at the earliest, as in a flow shop:
    after the k-th of the stage before (after) it and its hop, and after k others of its own; a stage's forwards
    after its parameters are ready, a rank's F's after its STEPs, a stage's k-th forward after its rank ran k + 1
    forwards of the rank's stage before it and k of its own (one machine, in the best order), and the last
    stage's k-th backward after its rank ran k + 1 of its forwards and k of its backwards (the input-gradient
    part where split).

    - The first stage's last backward (the whole backward: its reduction needs the weight gradients), then its
      gradient reduction (its last bucket where bucketed): the last micro-batch's chain, the bound at M < P.
    - A rank's work: every F and backward of its stages, each no earlier than above, in the order of those
      times (the best order for one machine with release times); then the reduction of the stage it ends
      with. The fill, each forward round's wait for its first micro-batch and, at M <= P, the turn from
      forwards to backwards and the last stage's pace are in it. Its data-parallel stream likewise: every
      gradient reduction of its stages, each after a backward of that stage has produced its first bucket of
      gradients (the stage's last reduction after its last backward has).
    - A rank's drain (`drain_end`): each stage's last backward op after the work it needs, then its reduction and
      those of the stages whose backward ends later; this holds a long reduction of a later stage (a stage of two
      layers, say) that the first stage's tail does not."""
    sched = _lowered(schedule)
    n, pp, m = sched.num_stages, sched.pp, sched.microbatches
    share = costs.input_grad_share
    # Each action no shorter than when a partner hides the most of its all-to-all (under the schedule's pairing).
    hide_f, hide_b = most_hidden(sched.pairing, costs.moe_a2a_forward, costs.moe_a2a_backward,
                                 costs.moe_cover_forward, costs.moe_cover_backward)
    fwd = [f - h for f, h in zip(costs.forward, hide_f)]
    bwd = [b - h for b, h in zip(costs.backward, hide_b)]
    hops = costs.send_forward if pp > 1 else [0.0] * n
    back_hops = costs.send_backward if pp > 1 else [0.0] * n
    has_step = _has_step(sched)
    zero = sched.zero_stage
    reduces = [[a.stage for a in acts if a.op is Op.REDUCE] for acts in sched.ranks]  # per rank, in list order
    reduced = {s for stages in reduces for s in stages}

    def reduce_tail(s: int) -> float:
        """How long stage s's reduction outlasts its last backward at the least (its last bucket)."""
        if sched.forward_only or s not in reduced:
            return 0.0
        return costs.reduce[s] / max(1, costs.reduce_buckets[s]) if costs.dp_overlap else costs.reduce[s]

    def reduction(s: int) -> float:
        """Stage s's gradient reduction (0.0 where the schedule reduces none)."""
        return costs.reduce[s] if s in reduced else 0.0

    boundaries = [sched.step_boundary(r) if has_step else None for r in range(pp)]
    tail_gathers = {a.stage for r, b in enumerate(boundaries) if b is not None
                    for a in sched.ranks[r][b:] if a.op is Op.GATHER}

    def params_ready(s: int) -> float:
        """When stage s's first forward may start at the earliest for its parameters: after its STEP and its
        all-gather (the first bucket of a ZeRO-1/2 one) in the step's tail, or after the first bucket of its
        post-optimizer all-gather, issued at the step's start (the rank's first one `param_sync_lead` earlier)."""
        if has_step:
            if s not in tail_gathers:
                return 0.0
            if zero == 3:
                return costs.step[s] + costs.gather[s]
            return costs.step[s] + costs.param_sync[s] / max(1, costs.param_sync_buckets[s])
        if costs.dp_overlap and zero in (1, 2, None) and costs.param_sync[s] > 0:
            return max(0.0, costs.param_sync[s] / max(1, costs.param_sync_buckets[s])
                       - costs.param_sync_lead[sched.rank_of(s)])
        return 0.0

    # A rank's STEPs run on its compute stream before its first forward.
    steps = [sum(costs.step[s] for s in sched.stages_of(r)) if has_step else 0.0 for r in range(pp)]
    fstart = [[0.0] * m for _ in range(n)]  # fstart[s][k]: the k-th forward of stage s starts no earlier
    before = {s: max((t for t in sched.stages_of(sched.rank_of(s)) if t < s), default=None) for s in range(n)}
    for s in range(n):
        arrive = np.zeros(m) if s == 0 else np.array(fstart[s - 1]) + (fwd[s - 1] + hops[s - 1])
        starts = _in_turn(np.maximum(arrive, max(steps[sched.rank_of(s)], params_ready(s))), fwd[s])
        if before[s] is not None:  # and after its rank ran the forwards it needs of both stages
            starts = _in_turn(np.maximum(starts, _after_both(np.array(fstart[before[s]]), fwd[before[s]], starts,
                                                             fwd[s])), fwd[s])
        fstart[s] = starts.tolist()
    if sched.forward_only:
        chain = fstart[n - 1][m - 1] + fwd[n - 1]
        bstart: list[list[float]] = []
    else:
        split_stages = {s for s, _ in sched.split_pairs()}
        # what stage s - 1 waits for (an I holds all of a split backward's all-to-all)
        grad = [costs.backward[s] * share[s] - hide_b[s] if s in split_stages else bwd[s] for s in range(n)]
        bstart = [[0.0] * m for _ in range(n)]  # bstart[s][k]: the k-th backward of stage s starts no earlier
        for s in range(n - 1, -1, -1):
            for k in range(m):
                after = (max(fstart[s][k] + fwd[s], fstart[s][0] + (k + 1) * fwd[s] + k * grad[s]) if s == n - 1
                         else bstart[s + 1][k] + grad[s + 1] + back_hops[s + 1])
                bstart[s][k] = max(after, bstart[s][k - 1] + grad[s] if k else 0.0)
        chain = bstart[0][m - 1] + bwd[0] + reduce_tail(0)

    def reduce_lead(s: int) -> float:
        """How long after a backward of stage s starts its gradients' reduction may start at the least: after the
        op that produces them (the B, or the W of a split backward) has run its first bucket's share, or all of it
        unbucketed; a split backward's I comes first."""
        if sched.forward_only:
            return 0.0
        last_op = bwd[s] - grad[s] if s in split_stages else bwd[s]
        nb = max(1, costs.reduce_buckets[s])
        return bwd[s] - last_op + last_op / nb

    def rank_tail(r: int) -> float:
        """How long rank r's data-parallel stream outlasts its compute at the least. Every F and I of its other
        stages precedes its first stage's last backward (they feed it), so after that stage's last W (or B) only
        W's of its other split stages S may run, S = {} or any set; the stream then still holds the first stage's
        last bucket and every reduction of S: the step outlasts the compute by the least of, over S, the larger
        of S's least last bucket and the first stage's plus S's reductions less S's W's. Overlapped reductions
        only; otherwise the last bucket of whichever stage ends last."""
        stages = sched.stages_of(r)
        any_last = min(reduce_tail(s) for s in stages)
        if sched.forward_only or not costs.dp_overlap:
            return any_last
        first = min(stages)
        # Each deferrable stage's last bucket and its net: its reduction less the W's the compute can run meanwhile.
        deferrable = [(reduce_tail(s), reduction(s) - m * (bwd[s] - grad[s]))
                      for s in stages if s != first and s in split_stages]
        tail = reduce_tail(first)  # S = {}: the first stage's last W ends the compute
        for i, (last, net) in enumerate(deferrable):  # S's least last bucket, with every other stage whose net < 0
            rest = sum(n for j, (b, n) in enumerate(deferrable) if j != i and b >= last and n < 0)
            tail = min(tail, max(last, reduce_tail(first) + net + rest))
        return max(any_last, tail)

    def drain_end(r: int, compute: float, floor: float) -> float:
        """When rank r's data-parallel stream ends at the least, seen from each stage c's last backward op (its
        last W or B). That op follows every F of the rank, every I of its later stages (they feed c's input
        gradients) and all of c's backward; every other stage either ran its backward ops before it too (all of
        them below c, its W's above c) or reduces after it, with c. So from any time t, the work above released at
        or after t, then c's reduction (from its first bucket) and those stages', each stage taking the lesser of
        its work and its reduction. Overlapped reductions only. It outlasts the rank's `compute` (its least
        end) by at most a reduction less its lead: 0.0 where that cannot pass `floor`."""
        if sched.forward_only or not costs.dp_overlap:
            return 0.0
        stages = sched.stages_of(r)  # ascending
        rs = np.array([reduction(s) for s in stages])
        lead = np.array([bwd[s] - reduce_lead(s) for s in stages])  # the first bucket's reduction before the op ends
        if compute + float((rs - lead).max()) <= floor:
            return 0.0
        f_rel = np.array([fstart[s][k] for s in stages for k in range(m)])
        order = np.argsort(f_rel)
        f_rel = f_rel[order]
        f_after = np.cumsum(np.repeat([fwd[s] for s in stages], m)[order][::-1])[::-1]  # released at or after
        b_rel = np.array([bstart[s] for s in stages])  # [stage, k], non-decreasing in k
        ts = np.unique(np.concatenate([f_rel, b_rel.ravel()]))  # thresholds
        f_from = np.searchsorted(f_rel, ts)  # the first forward released at or after t
        base = ts + np.where(f_from < len(f_rel), f_after[np.minimum(f_from, len(f_rel) - 1)], 0.0)
        # [t, stage]: the stage's backwards released at or after t
        late = m - np.stack([np.searchsorted(row, ts) for row in b_rel], axis=1)
        b, i_part = np.array([bwd[s] for s in stages]), np.array([grad[s] for s in stages])
        whole = late * b  # a stage's backward ops
        later = late * i_part + np.minimum(rs, late * (b - i_part))  # a later stage: its I's, then W's or reduction
        below = np.cumsum(np.minimum(rs, whole), axis=1) - np.minimum(rs, whole)  # the stages below c
        above = later.sum(axis=1, keepdims=True) - np.cumsum(later, axis=1)  # the stages above c
        value = base[:, None] + whole + rs - lead + below + above
        # The work counted from t runs after t only if some of it is certain, not a stage's choice: t no later
        # than the last release of c's own backward, the rank's F's and its later stages' I's.
        certain = np.maximum(f_rel.max(), np.maximum.accumulate(b_rel[::-1, -1])[::-1])
        valid = (ts[:, None] <= certain[None, :]) & (rs > 0)[None, :]
        return float(value[valid].max(initial=0.0))

    work, computes = chain, []
    for r in range(pp):
        jobs = [(fstart[s][k], fwd[s]) for s in sched.stages_of(r) for k in range(m)]
        if not sched.forward_only:
            jobs += [(bstart[s][k], bwd[s]) for s in sched.stages_of(r) for k in range(m)]
        computes.append(_earliest_end(jobs))
        work = max(work, computes[-1] + rank_tail(r))
        # Its data-parallel stream: each gradient reduction of a stage after the op producing its first bucket,
        # the stage's last one after its last backward.
        last = {s: i for i, s in enumerate(reduces[r])}
        work = max(work, _earliest_end([(bstart[s][m - 1 if last[s] == i else 0] + reduce_lead(s), costs.reduce[s])
                                        for i, s in enumerate(reduces[r])]))
    for r in range(pp):
        work = max(work, drain_end(r, computes[r], work))
    end = costs.grad_norm if has_step else max(costs.optimizer) + _post_step_param_sync_s(sched, costs)
    return work + end


def simulate_schedule(schedule: Schedule, costs: Costs, record_events: bool = True,
                      iteration: int = 0) -> EngineResult:
    """Time one training step of `schedule` (lowered here for p2p if needed) under `costs`."""
    sched = _lowered(schedule)
    pp, n_stages = sched.pp, sched.num_stages
    if costs.num_stages != n_stages:
        raise ScheduleError(f"costs describe {costs.num_stages} stages but the schedule has {n_stages}")
    if len(costs.optimizer) != pp:
        raise ScheduleError(f"costs give an optimizer time for {len(costs.optimizer)} ranks, schedule has {pp}")
    zero = sched.zero_stage
    fwd, bwd = costs.forward, costs.backward
    dp_on, p2p_on = costs.dp_overlap, costs.p2p_overlap
    last_stage = n_stages - 1
    ranks = [_Rank(r, sched.weight_buffers, sched.grad_buffers) for r in range(pp)]
    events: list[TimelineEvent] = []
    rec = record_events
    # (kind, producing stage, microbatch) -> (transfer start, transfer end, producing compute end)
    sent: dict[tuple[int, int, int], tuple[float, float, float]] = {}
    compute_end: dict[tuple[int, int, int], float] = {}  # (0=F/1=B, stage, mb) -> end

    def duration(op: Op, s: int) -> float:
        share = costs.input_grad_share[s]
        return {Op.F: fwd[s], Op.B: bwd[s], Op.I: bwd[s] * share, Op.W: bwd[s] * (1 - share)}[op]

    def a2a(a: Action) -> float:
        """Expert all-to-all seconds inside one action that a partner can hide (a W has none)."""
        return costs.moe_a2a_forward[a.stage] if a.op is Op.F else 0.0 if a.op is Op.W else \
            costs.moe_a2a_backward[a.stage]

    def hidden(a: Action, partner: Action) -> float:
        """Of `a2a(a)`, what runs behind `partner`'s compute when the two run merged."""
        cover = costs.moe_cover_forward if partner.op is Op.F else costs.moe_cover_backward
        return min(a2a(a), cover[partner.stage]) if partner.op is not Op.W else 0.0

    def exposed_a2a(a: Action) -> float:
        """All-to-all seconds of an action run alone (a backward's recomputed forwards' included)."""
        return a2a(a) + (costs.moe_a2a_recomputed[a.stage] if a.op in (Op.B, Op.I) else 0.0)

    def input_key(a: Action) -> tuple[int, int, int] | None:
        """The message (kind, producing stage, micro-batch) a compute action waits for from another rank."""
        if pp == 1 or a.op is Op.W:  # a W needs only its own I, run before it on this rank
            return None
        if a.op is Op.F:
            return (0, a.stage - 1, a.microbatch) if a.stage > 0 else None  # type: ignore[return-value]
        return (1, a.stage + 1, a.microbatch) if a.stage < last_stage else None  # type: ignore[return-value]

    def ev(r: int, stream: str, name: str, op: str, stage: int | None, mb: int | None, t0: float, t1: float,
           peer: int | None = None):
        events.append(TimelineEvent(r, stream, name, op, stage, mb, t0, t1, iteration, peer))  # type: ignore[arg-type]

    def stall(st: _Rank, until: float, cat: int, stream: str, name: str, stage: int | None, mb: int | None):
        """Hold the compute stream until `until`, charging the idle time to `cat`."""
        if until > st.compute_free:
            st.acct[cat] += until - st.compute_free
            if rec:
                ev(st.r, stream, f"wait {name}", "WAIT", stage, mb, st.compute_free, until)
            st.compute_free = until

    # Schedule-placed optimizer step: each rank's list ends with its step boundary (STEPs and the all-gathers
    # they allow), which runs at the start of the next step; the body is what comes before it.
    has_step = _has_step(sched)
    body_end = []
    for r in range(pp):
        b = sched.step_boundary(r) if has_step else None
        body_end.append(len(sched.ranks[r]) if b is None else b)

    # Optimizer outside the schedule: the post-optimizer parameter all-gather (ZeRO-1/2), overlapped with the
    # forward, issued at step start in the order the rank first uses its stages; the first one
    # `param_sync_lead` earlier (during the optimizer step).
    if not has_step and dp_on and sched.zero_stage in (1, 2, None):
        for st in ranks:
            for i, s in enumerate(first_use_order(sched.ranks[st.r])):
                d = costs.param_sync[s]
                if d > 0:
                    t0 = -costs.param_sync_lead[st.r] if i == 0 else st.dp_free
                    st.sync[s] = (t0, t0 + d)
                    st.dp_free = max(t0 + d, 0.0)  # the other stages' gathers are issued from the step's start
                    st.counts["param_sync"] += 1
                    if rec:
                        ev(st.r, "dp", f"GATHER{s}", "GATHER", s, None, t0, t0 + d)

    def run_tail(st: _Rank) -> None:
        """The previous step's boundary, at the start of this one: STEPs on the compute stream in list order,
        each tail GATHER on the dp stream after its STEP; alongside, the same tail with free STEPs (`st.cf`)."""
        cf = st.cf
        for a in sched.ranks[st.r][body_end[st.r]:]:
            s = a.stage
            if a.op is Op.STEP:
                d = costs.step[s]
                t0 = st.compute_free
                st.compute_free = st.step_end[s] = t0 + d
                st.step_busy += d
                if rec:
                    ev(st.r, "compute", a.text, "STEP", s, None, t0, t0 + d)
            elif a.op is Op.GATHER:
                d = costs.gather[s] if zero == 3 else costs.param_sync[s]
                if zero != 3 and d <= 0:
                    continue  # nothing to gather (ZeRO-0's all-reduced parameters)
                t0, c0 = max(st.dp_free, st.step_end.get(s, 0.0)), cf["dp"]
                if zero == 3:
                    st.wbuf_free.sort()
                    t0 = max(t0, st.wbuf_free.pop(0) if st.wbuf_free else 0.0)
                if not dp_on:
                    t0, c0 = max(t0, st.compute_free), max(c0, cf["compute"])
                t1, c1 = t0 + d, c0 + d
                st.dp_free, cf["dp"] = t1, c1
                if zero == 3:
                    st.gather_end[s], cf["gather_end"][s] = t1, c1
                    st.fresh.add(s)
                    st.counts["gather"] += 1
                else:
                    st.sync[s], cf["sync"][s] = (t0, t1), (c0, c1)
                    st.counts["param_sync"] += 1
                if rec:
                    ev(st.r, "dp", a.text, "GATHER", s, None, t0, t1)
                if not dp_on:
                    stall(st, t1, _DP, "dp", a.text, s, None)
                    cf["compute"] = c1
            else:
                raise ScheduleError(f"rank {st.r}: {a.text} after the optimizer step began")

    if has_step:
        for st in ranks:
            run_tail(st)

    def do_reduce(st: _Rank, a: Action, blocking: bool) -> None:
        s = a.stage
        d = costs.reduce[s]
        b_start, b_end = st.last_b.get(s, (st.compute_free, st.compute_free))
        if blocking:
            t0 = max(st.dp_free, st.compute_free)
            t1 = t0 + d
            stall(st, t1, _DP, "dp", a.text, s, None)
        else:
            nb = max(1, costs.reduce_buckets[s])
            # the stage's last backward op (a B, or with a split backward the last W, which produces the
            # weight gradients) hands its gradients over bucket by bucket
            first_ready = b_start + (b_end - b_start) / nb if nb > 1 else b_end
            t0 = max(st.dp_free, first_ready)
            t1 = max(t0 + d, b_end + d / nb)
        st.dp_free = t1
        st.counts["reduce"] += 1
        if zero is not None and zero >= 2 and s in st.grad_resident:
            st.grad_resident.discard(s)
            st.gbuf_free.append(t1)
        if rec:
            ev(st.r, "dp", a.text, "REDUCE", s, None, t0, t1)

    def step_rank(st: _Rank) -> bool:
        """Advance one rank as far as its dependencies allow; True if anything ran."""
        acts = sched.ranks[st.r]
        progressed = False
        while st.pc < body_end[st.r]:
            a = acts[st.pc]
            op, s, m = a.op, a.stage, a.microbatch
            if op in COMPUTE_OPS and st.pc in st.merged:  # the second of a pair: it ran with the first
                t0, t1 = st.merged.pop(st.pc)
                if rec:
                    ev(st.r, "compute", a.text, op.value, s, m, t0, t1)
                st.pc += 1
                progressed = True
                continue
            if op in COMPUTE_OPS:
                is_f = op is Op.F
                dur = duration(op, s)
                j = pairs[st.r].get(st.pc)  # the partner this action runs merged with, if any
                partner = acts[j] if j is not None else None
                partner_key = input_key(partner) if partner is not None else None
                if partner_key is not None and partner_key not in sent:
                    return progressed  # the merged pair needs both inputs (the paired lowering posts both first)
                start = st.compute_free
                why, why_t, split, wname, wpeer = -1, start, 0.0, "", 0
                input_t = 0.0
                # input from another rank (the partner's too)
                for x_key, x_act in ((input_key(a), a), (partner_key, partner)):
                    if x_key is None:
                        continue
                    x = sent[x_key]  # the RECV before this compute (or the wait above) guaranteed it exists
                    input_t = max(input_t, x[1])
                    if x[1] > why_t:
                        why, why_t, split = _PP, x[1], x[2]
                        wname = ("RECV_F" if x_key[0] == 0 else "RECV_B") + f"{x_act.stage}:{x_act.microbatch}"
                        wpeer = sched.rank_of(x_key[1])
                # parameters
                end_floor = 0.0
                uses_weights = op in sched.weight_ops
                cf_params = 0.0  # when they would be ready with free STEPs (the rank's first computation)
                if zero == 3 and uses_weights:
                    g = st.gather_end.get(s, 0.0)
                    cf_params = st.cf["gather_end"].get(s, 0.0)
                    if g > why_t:
                        why, why_t, wname = _DP, g, f"GATHER{s}"
                elif s in st.sync and s not in st.first_use_done:
                    t0, t1 = st.sync[s]
                    nb = max(1, costs.param_sync_buckets[s])
                    ready = t0 + (t1 - t0) / nb
                    end_floor = t1 + dur / nb
                    if s in st.cf["sync"]:
                        c0, c1 = st.cf["sync"][s]
                        cf_params = c0 + (c1 - c0) / nb
                    if ready > why_t:
                        why, why_t, wname = _DP, ready, f"GATHER{s}"
                st.first_use_done.add(s)
                if partner is not None and partner.stage != s:  # Megatron's combined 1F1B: another stage's weights
                    ps = partner.stage
                    if zero == 3 and partner.op in sched.weight_ops and st.gather_end.get(ps, 0.0) > why_t:
                        why, why_t, wname = _DP, st.gather_end[ps], f"GATHER{ps}"
                    elif ps in st.sync and ps not in st.first_use_done:
                        t0, t1 = st.sync[ps]
                        ready = t0 + (t1 - t0) / max(1, costs.param_sync_buckets[ps])
                        if ready > why_t:
                            why, why_t, wname = _DP, ready, f"GATHER{ps}"
                    st.first_use_done.add(ps)
                if has_step and not st.started:  # how much later the STEPs let the rank start computing
                    st.started = True
                    st.exposed = max(0.0, max(st.compute_free, why_t) - max(st.cf["compute"], input_t, cf_params))
                # gradient buffer (ZeRO-2/3)
                if op in sched.grad_write_ops and zero is not None and zero >= 2 and s not in st.grad_resident:
                    st.grad_resident.add(s)
                    st.gbuf_free.sort()
                    free_t = st.gbuf_free.pop(0) if st.gbuf_free else 0.0
                    if free_t > why_t:
                        why, why_t, wname = _DP, free_t, f"grad buffer {s}"
                if why_t > st.compute_free:
                    if why == _PP:  # bubble until the producer finished, transfer after
                        cut = min(max(split, st.compute_free), why_t)
                        st.acct[_BUBBLE] += cut - st.compute_free
                        st.acct[_PP] += why_t - cut
                        if rec:  # the sender is named: metrics split the wait into bubble and transfer
                            ev(st.r, "p2p", f"wait {wname}", "WAIT", s, m, st.compute_free, why_t, peer=wpeer)
                        st.compute_free = why_t
                    else:
                        stall(st, why_t, _DP, "dp", wname, s, m)
                start = st.compute_free
                busy = own = dur - (hidden(a, partner) if partner is not None else 0.0)
                st.a2a += exposed_a2a(a) + own - dur
                if partner is not None:  # merged: each hides the other's all-to-all; both outputs at the end
                    other = duration(partner.op, partner.stage) - hidden(partner, a)
                    busy += other
                    st.a2a += exposed_a2a(partner) + other - duration(partner.op, partner.stage)
                    st.paired += 2
                end = max(start + busy, end_floor)
                st.compute_busy += busy
                st.acct[_DP] += end - start - busy  # compute slowed by parameter buckets still arriving
                st.compute_free = end
                if uses_weights:
                    st.last_end[s] = end  # a RELEASE frees the buffer once the last use ended
                if op is not Op.W:
                    compute_end[(0 if is_f else 1, s, m)] = end
                if op in (Op.B, Op.W):
                    st.last_b[s] = (start, end)
                if partner is not None:
                    compute_end[(0 if partner.op is Op.F else 1, partner.stage, partner.microbatch)] = end
                    st.merged[j] = (start + own, end)  # type: ignore[index]
                    if partner.op in sched.weight_ops:
                        st.last_end[partner.stage] = end
                    if partner.op is Op.B:
                        st.last_b[partner.stage] = (start, end)
                if rec:
                    ev(st.r, "compute", a.text, op.value, s, m, start, start + own if partner is not None else end)
            elif op is Op.SEND_F or op is Op.SEND_B:
                kind = 0 if op is Op.SEND_F else 1
                produced = compute_end[(kind, s, m)]
                d = costs.send_forward[s] if kind == 0 else costs.send_backward[s]
                t0 = max(produced, st.lane_free[kind])
                if not p2p_on:
                    t0 = max(t0, st.compute_free)
                t1 = t0 + d
                st.lane_free[kind] = t1
                sent[(kind, s, m)] = (t0, t1, produced)
                if rec:
                    ev(st.r, "p2p", a.key, op.value, s, m, t0, t1)
                if not p2p_on:
                    stall(st, t1, _PP, "p2p", a.key, s, m)
            elif op is Op.RECV_F or op is Op.RECV_B:
                key = (0, s - 1, m) if op is Op.RECV_F else (1, s + 1, m)
                x = sent.get(key)
                if x is None:
                    return progressed  # the producing rank has not reached its send yet
                if rec:
                    ev(st.r, "p2p", a.key, op.value, s, m, x[0], x[1])
            elif op is Op.GATHER and s in st.fresh:
                st.fresh.discard(s)  # gathered by the step boundary (the tail): nothing to do
            elif op is Op.GATHER:
                d = costs.gather[s]
                st.wbuf_free.sort()
                buf = st.wbuf_free.pop(0) if st.wbuf_free else 0.0
                t0 = max(st.dp_free, buf, st.step_end.get(s, 0.0))  # it gathers the shards its STEP updated
                if not dp_on:
                    t0 = max(t0, st.compute_free)
                t1 = t0 + d
                st.dp_free = t1
                st.gather_end[s] = t1
                st.counts["gather"] += 1
                if has_step and not st.started:  # before the first computation: follow it with free STEPs too
                    c0 = st.cf["dp"] if dp_on else max(st.cf["dp"], st.cf["compute"])
                    st.cf["dp"] = st.cf["gather_end"][s] = c0 + d
                    if not dp_on:
                        st.cf["compute"] = c0 + d
                if rec:
                    ev(st.r, "dp", a.text, "GATHER", s, None, t0, t1)
                if not dp_on:
                    stall(st, t1, _DP, "dp", a.text, s, None)
            elif op is Op.RELEASE:
                st.fresh.discard(s)
                t = st.last_end.get(s, 0.0)
                st.wbuf_free.append(t)
                if rec:
                    ev(st.r, "dp", a.text, "RELEASE", s, None, t, t)
            elif op is Op.REDUCE:
                if dp_on:
                    do_reduce(st, a, blocking=False)
                elif zero is None or zero <= 1:
                    st.deferred.append(a)  # 2022 Megatron: gradient all-reduce after the whole backward
                else:
                    do_reduce(st, a, blocking=True)
            st.pc += 1
            progressed = True
        for a in st.deferred:
            do_reduce(st, a, blocking=True)
        st.deferred = []
        return progressed

    # The schedule's pairing (`schedule.pairs`): per rank, the first of each pair -> its partner, the pairs that
    # hide an all-to-all run merged; the others one after the other.
    pairs = []
    for r in range(pp):
        body = sched.ranks[r][:body_end[r]]
        pairs.append({i: j for i, j in pairs_of(sched, r, body).items()
                      if hidden(body[i], body[j]) + hidden(body[j], body[i]) > 0})
    remaining = set(range(pp))
    while remaining:
        moved = False
        for r in sorted(remaining):
            st = ranks[r]
            if step_rank(st):
                moved = True
            if st.pc >= body_end[r]:
                remaining.discard(r)
        if not moved and remaining:
            blocked = "; ".join(f"rank {r} at {sched.ranks[r][ranks[r].pc].text}" for r in sorted(remaining))
            raise ScheduleError(f"schedule deadlocks in the simulator: {blocked}")

    # End of step.
    compute_ends = [st.compute_free for st in ranks]
    pipeline_end = max(compute_ends)
    sync_point = max(max(st.compute_free, st.dp_free) for st in ranks)
    post_sync = 0.0
    if has_step:  # the gradient norm, then the next step (whose start ran this step's tail)
        opt = max(st.step_busy for st in ranks)
        norm = costs.grad_norm
        step = sync_point + norm
        opt_rank = [st.step_busy + norm for st in ranks]
        opt_exposed = [st.exposed + norm for st in ranks]
    else:
        opt = max(costs.optimizer)
        norm = 0.0
        post_sync = _post_step_param_sync_s(sched, costs)
        step = sync_point + opt + post_sync
        opt_rank = [opt] * pp
        opt_exposed = [opt] * pp
    for st in ranks:
        # Until the last rank's compute ends a rank is draining the pipeline (its own outstanding reductions
        # are hidden behind that); what the reductions add after it is exposed data-parallel time.
        ce = st.compute_free
        st.acct[_BUBBLE] += pipeline_end - ce
        st.acct[_DP] += sync_point - pipeline_end + post_sync
        if rec:
            if pipeline_end > ce:
                ev(st.r, "compute", "idle", "IDLE", None, None, ce, pipeline_end)
            if sync_point > max(ce, pipeline_end):
                ev(st.r, "dp", "wait REDUCE", "WAIT", None, None, max(ce, pipeline_end), sync_point)
            if has_step:
                if norm > 0:
                    ev(st.r, "compute", "grad norm", "OPTIMIZER", None, None, sync_point, step)
            elif opt > 0:
                ev(st.r, "compute", "OPTIMIZER", "OPTIMIZER", None, None, sync_point,
                   sync_point + costs.optimizer[st.r])
            if post_sync > 0:
                ev(st.r, "dp", "PARAM_SYNC", "GATHER", None, None, sync_point + opt, step)
    return EngineResult(
        step_time_s=step,
        compute_s=[st.compute_busy for st in ranks],
        bubble_s=[st.acct[_BUBBLE] for st in ranks],
        exposed_pp_s=[st.acct[_PP] for st in ranks],
        exposed_dp_s=[st.acct[_DP] for st in ranks],
        optimizer_s=opt,
        pipeline_end_s=pipeline_end,
        dp_traffic={k: [st.counts[k] for st in ranks] for k in ("gather", "reduce", "param_sync")},
        events=events,
        optimizer_rank_s=opt_rank,
        optimizer_exposed_s=opt_exposed,
        grad_norm_s=norm,
        exposed_moe_a2a_s=[st.a2a for st in ranks],
        paired_actions=[st.paired for st in ranks],
    )
