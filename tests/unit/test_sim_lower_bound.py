"""`engine.step_lower_bound_s`: no simulated order beats it, and it is exact where one path is the whole step."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from megatron_bfpp.schedule import ScheduleError, ScheduleSpec
from megatron_bfpp.schedule.ir import Action, Op, Schedule
from megatron_bfpp.schedule.lower import lower
from megatron_bfpp.schedule.kinds import KINDS
from megatron_bfpp.sim import (SearchSpace, analytic_costs, get_hardware, get_model, plan, simulate_schedule,
                               step_lower_bound_s)
from megatron_bfpp.sim.costs import Config, Costs
from megatron_bfpp.sim.predict import predict, schedule_for
from tests.support.paths import load_script


def _costs(n: int, pp: int, *, dp_overlap: bool = True, p2p_overlap: bool = True, buckets: int = 1) -> Costs:
    """Stages that differ (the first and last heavier, as with the embedding and the output layer)."""
    fwd = [1.0 + 0.3 * (s == 0) + 0.6 * (s == n - 1) + 0.05 * (s % 3) for s in range(n)]
    return Costs(fwd, [2.1 * f for f in fwd], [0.15] * n, [0.2] * n, [0.8 + 0.1 * (s == 0) for s in range(n)],
                 [1.1 + 0.7 * (s == 0) for s in range(n)], [0.5 + 0.3 * (s == 0) for s in range(n)],
                 [0.4 + 0.1 * r for r in range(pp)], grad_norm=0.05, reduce_buckets=[buckets] * n,
                 param_sync_buckets=[buckets] * n, param_sync_lead=[0.2] * pp,
                 input_grad_share=[0.55] * n, dp_overlap=dp_overlap, p2p_overlap=p2p_overlap)


@pytest.fixture(scope="module")
def specs() -> list:
    """Every schedule of `_specs`, built (and so validated) once for the tests below: most of their time."""
    return list(_specs())


def _specs():
    for kind, pp, vp, m, zero, step in itertools.product(
            KINDS, (1, 2, 4), (1, 2, 3), (1, 3, 4, 8), (None, 1, 2, 3), (True, False)):
        if zero is None and not step:
            continue
        spec = ScheduleSpec(kind, pp, vp, m, zero_stage=zero, optimizer_step=step)
        try:
            yield spec, spec.build()
        except ScheduleError:
            continue  # a combination the kind refuses


@pytest.mark.parametrize("overlap", [(True, True), (False, True), (True, False), (False, False)],
                         ids=["overlapped", "dp-blocking", "p2p-blocking", "both-blocking"])
def test_no_simulated_order_beats_the_bound(overlap, specs) -> None:
    dp_overlap, p2p_overlap = overlap
    checked = 0
    for i, (spec, sched) in enumerate(specs):
        costs = _costs(sched.num_stages, sched.pp, dp_overlap=dp_overlap, p2p_overlap=p2p_overlap,
                       buckets=1 + 2 * (i % 2))  # every other one with bucketed gathers and reductions
        step = simulate_schedule(sched, costs, record_events=False).step_time_s
        bound = step_lower_bound_s(sched, costs)
        assert bound > 0
        assert step >= bound - 1e-9, f"{spec}: step {step} below the bound {bound}"
        checked += 1
    assert checked > 300


@pytest.mark.parametrize("kind,pp", [("gpipe", 1), ("gpipe", 4), ("1f1b", 3), ("zb-h1", 4)])
@pytest.mark.parametrize("zero", [1, 3])
def test_one_micro_batch_is_the_chain_exactly(kind: str, pp: int, zero: int) -> None:
    """M = 1, V = 1: the step is one micro-batch down and back, the first stage's collectives and the norm."""
    sched = ScheduleSpec(kind, pp, 1, 1, zero_stage=zero).build()
    costs = _costs(pp, pp)
    assert simulate_schedule(sched, costs, record_events=False).step_time_s == pytest.approx(
        step_lower_bound_s(sched, costs), rel=1e-12)


def test_work_bound_is_exact_without_a_pipeline() -> None:
    """P = 1: a rank's work alone is the step (its STEPs overlap the first all-gather)."""
    sched = ScheduleSpec("breadth-first", 1, 3, 4, zero_stage=3).build()
    costs = _costs(3, 1)
    step = simulate_schedule(sched, costs, record_events=False).step_time_s
    assert step >= step_lower_bound_s(sched, costs) - 1e-12
    assert step == pytest.approx(step_lower_bound_s(sched, costs), rel=0.05)


@pytest.mark.parametrize("batch,layout", [(32, (8, 8, 8, "interleaved-zb", 1)), (128, (4, 4, 16, "interleaved-zb", 1)),
                                          (32, (8, 32, 1, "1f1b", 1))])
def test_predictions_carry_the_bound(batch: int, layout: tuple) -> None:
    tp, pp, vp, sched, zero = layout
    cfg = Config(tp, pp, vp, 512 // (tp * pp), 1, batch * tp * pp // 512, sched, zero, False, None)
    p = predict(get_model("gpt-52b"), get_hardware("dgx-a100"), cfg)
    assert 0 < p.step_lower_bound_s <= p.step_time_s
    assert p.to_dict()["step_lower_bound_s"] == p.step_lower_bound_s


def test_ceiling_is_above_what_the_planner_reaches() -> None:
    """bench/regime_table.py's ceiling: the smallest bound over every layout is no larger than the best plan's step,
    and the pruned search finds exactly the smallest of every fitting configuration's bound."""
    from megatron_bfpp.sim.planner import _Bounds, enumerate_configs, smallest_lower_bound, unfit_reason

    model, hw = get_model("gpt-1.3b"), get_hardware("dgx-a100")
    # 4 sequences on 16 GPUs: the profile bound (compute only) ranks first configurations whose communication the
    # schedule's bound charges, so the search must go on past the first that fits (42 of 184 visited).
    space = SearchSpace(micro_batch_sizes=(1,), zero_stages=(0, 3), recompute=(False,), vp_sizes=(2, 3),
                        schedules=("1f1b", "breadth-first"), refine_layouts=False)
    bound, cfg = smallest_lower_bound(model, hw, 16, 4, space)
    ours = plan(model, hw, 16, 4, space, top=1).candidates[0]
    assert bound <= ours.step_time_s * (1 + 1e-12)  # equal where the bound is exact
    cheap = _Bounds(model, hw)
    every = [max(cheap.step_lower_bound(c, c.partition(model)),
                 step_lower_bound_s(schedule_for(c), analytic_costs(hw, c.partition(model), c)))
             for c in enumerate_configs(model, hw, 16, 4, space)[0] if unfit_reason(model, hw, c) is None]
    assert bound == pytest.approx(min(every), rel=1e-12)
    # Refining the found configuration's layout by its bound only lowers it.
    refined, refined_cfg = smallest_lower_bound(model, hw, 16, 4, dataclasses.replace(space, refine_layouts=True))
    assert refined <= bound and (refined == bound) == (refined_cfg == cfg)


def test_rank_work_holds_the_turn_and_the_last_stage_pace() -> None:
    """P = V = M = 2, F = 1, backward = 2, free transfers and collectives, by hand: stage s's k-th forward
    starts at s + k at the earliest; the last stage's second backward after its rank ran two forwards and one
    backward of it (3 + 2 + 2 = 7), each backward of the stages above it 2 later per stage (rank 0: stage 2 at
    6 and 9, stage 0 at 10 and 13); in earliest-release order rank 0 ends at 15, which breadth-first reaches,
    above the longest single chain (13) and rank 0's bare work (12)."""
    n, pp = 4, 2
    costs = Costs([1.0] * n, [2.0] * n, [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * pp,
                  grad_norm=0.0, dp_overlap=True, p2p_overlap=True)
    sched = ScheduleSpec("breadth-first", pp, 2, 2).build()
    assert step_lower_bound_s(sched, costs) == pytest.approx(15.0, rel=1e-12)
    assert simulate_schedule(sched, costs, record_events=False).step_time_s == pytest.approx(15.0, rel=1e-12)


def test_data_parallel_stream_holds_every_reduction() -> None:
    """P = 1, V = 3, M = 1, ZeRO-1, F = 1, backward = 2, a reduction of 10 per stage, by hand: the backwards start
    at 3, 5 and 7 at the earliest and each stage's reduction, unbucketed, after its backward has ended, one after
    the other on the rank's data-parallel stream: 5 + 3 * 10 = 35, above the rank's compute and its last reduction
    (19). The simulation is exactly that."""
    n = 3
    costs = Costs([1.0] * n, [2.0] * n, [0.0] * n, [0.0] * n, [0.0] * n, [10.0] * n, [0.0] * n, [0.0],
                  grad_norm=0.0, dp_overlap=True, p2p_overlap=True)
    sched = ScheduleSpec("breadth-first", 1, n, 1, zero_stage=1, optimizer_step=False).build()
    assert step_lower_bound_s(sched, costs) == pytest.approx(35.0, rel=1e-12)
    assert simulate_schedule(sched, costs, record_events=False).step_time_s == pytest.approx(35.0, rel=1e-12)
    # Two buckets per stage: the first reduction may start once half its backward ran (4): 4 + 30 = 34, as simulated.
    costs = dataclasses.replace(costs, reduce_buckets=[2] * n)
    assert step_lower_bound_s(sched, costs) == pytest.approx(34.0, rel=1e-12)
    assert simulate_schedule(sched, costs, record_events=False).step_time_s == pytest.approx(34.0, rel=1e-12)


def test_rank_tail_holds_the_first_stage_reduction_past_deferred_weight_gradients() -> None:
    """P = 1, V = 2, M = 2 with a split backward, F = I = W = 1, reductions of 10 (stage 0) and 1 (stage 1), by
    hand. Every F and I precedes stage 0's last W (stage 1's I's feed stage 0's), so the compute (12) can outlast
    that W only by stage 1's two W's, while the stream still holds stage 0's reduction and stage 1's: 12 - 2 + 10
    + 1 = 21, which the order deferring stage 1's W's to the end reaches (stage 1's W's first: 22). A bound of the
    compute and stage 0's reduction (22), or of the compute and the least reduction (13), is wrong or loose."""
    n = 2
    costs = Costs([1.0] * n, [2.0] * n, [0.0] * n, [0.0] * n, [0.0] * n, [10.0, 1.0], [0.0] * n, [0.0],
                  grad_norm=0.0, input_grad_share=[0.5] * n, dp_overlap=True, p2p_overlap=True)

    def order(w_stages: tuple[int, int]) -> Schedule:
        acts = [Action(Op.F, s, k) for k in range(2) for s in range(2)]
        acts += [Action(Op.I, s, k) for k in range(2) for s in (1, 0)]
        acts += [Action(Op.W, s, k) for s in w_stages for k in range(2)]
        return lower(Schedule("by-hand", 1, 2, 2, None, [acts]), zero_stage=1, optimizer_step=False)

    deferred, eager = order((0, 1)), order((1, 0))
    assert simulate_schedule(deferred, costs, record_events=False).step_time_s == pytest.approx(21.0, rel=1e-12)
    assert simulate_schedule(eager, costs, record_events=False).step_time_s == pytest.approx(22.0, rel=1e-12)
    for sched in (deferred, eager):
        assert step_lower_bound_s(sched, costs) == pytest.approx(21.0, rel=1e-12)


def test_rank_tail_defers_every_stage_that_gains() -> None:
    """P = 1, V = 3, M = 1, F = I = W = 1, reductions of 10, 0.5 and 0.5, by hand: deferring both later stages' W's
    past stage 0's gains 0.5 each, 9 - 2 + 10 + 0.5 + 0.5 = 18, as the order F F F I I I W0 W1 W2 steps."""
    n = 3
    costs = Costs([1.0] * n, [2.0] * n, [0.0] * n, [0.0] * n, [0.0] * n, [10.0, 0.5, 0.5], [0.0] * n, [0.0],
                  grad_norm=0.0, input_grad_share=[0.5] * n, dp_overlap=True, p2p_overlap=True)
    acts = ([Action(Op.F, s, 0) for s in range(n)] + [Action(Op.I, s, 0) for s in reversed(range(n))]
            + [Action(Op.W, s, 0) for s in range(n)])
    sched = lower(Schedule("by-hand", 1, n, 1, None, [acts]), zero_stage=1, optimizer_step=False)
    assert simulate_schedule(sched, costs, record_events=False).step_time_s == pytest.approx(18.0, rel=1e-12)
    assert step_lower_bound_s(sched, costs) == pytest.approx(18.0, rel=1e-12)


def test_drain_holds_a_heavy_reduction_of_a_later_stage() -> None:
    """P = 1, V = 3, M = 1, F = I = W = 1, reductions of 1, 10 and 0.5, by hand. Stage 1's last W follows every F,
    stage 2's I and its own backward (6); stage 0 either runs its backward before it or reduces after it, and
    stage 2 likewise with its W: 6 + 10 + 1 + 0.5 = 17.5, which the order running W1 right after I1 reaches (W2
    before it: 18). The first stage's tail and the data-parallel stream alone allow less."""
    n = 3
    costs = Costs([1.0] * n, [2.0] * n, [0.0] * n, [0.0] * n, [0.0] * n, [1.0, 10.0, 0.5], [0.0] * n, [0.0],
                  grad_norm=0.0, input_grad_share=[0.5] * n, dp_overlap=True, p2p_overlap=True)
    orders = {tuple(a.text for a in acts): lower(Schedule("by-hand", 1, n, 1, None, [acts]), zero_stage=1,
                                                 optimizer_step=False) for acts in _orders(n, 1)}
    steps = {text: simulate_schedule(sched, costs, record_events=False).step_time_s for text, sched in orders.items()}
    assert min(steps.values()) == pytest.approx(17.5, rel=1e-12)
    assert steps[("F0:0", "F1:0", "F2:0", "I2:0", "I1:0", "W1:0", "I0:0", "W0:0", "W2:0")] == pytest.approx(17.5)
    assert steps[("F0:0", "F1:0", "F2:0", "I2:0", "I1:0", "W2:0", "W1:0", "I0:0", "W0:0")] == pytest.approx(18.0)
    for sched in orders.values():
        assert step_lower_bound_s(sched, costs) == pytest.approx(17.5, rel=1e-12)


def _random_pipeline_costs(rng: random.Random, n: int, pp: int) -> Costs:
    """Random stage costs for P ranks: transfers, and collectives from a tenth to ten times a stage's work."""
    fwd = [rng.uniform(0.2, 2.0) for _ in range(n)]
    buckets = [rng.choice([1, 1, 2, 4]) for _ in range(n)]
    return Costs(fwd, [f * rng.uniform(1.5, 2.5) for f in fwd], [rng.uniform(0.0, 0.3) for _ in range(n)],
                 [rng.uniform(0.0, 0.3) for _ in range(n)], [rng.uniform(0.0, 2.0) for _ in range(n)],
                 [f * rng.uniform(0.1, 10.0) for f in fwd], [rng.uniform(0.0, 2.0) for _ in range(n)],
                 [rng.uniform(0.1, 0.5) for _ in range(pp)], grad_norm=0.01,
                 input_grad_share=[rng.uniform(0.3, 0.7) for _ in range(n)], reduce_buckets=buckets,
                 param_sync_buckets=buckets, param_sync_lead=[0.1] * pp, dp_overlap=True, p2p_overlap=True)


def test_no_schedule_beats_the_bound_under_random_costs(specs) -> None:
    """Every schedule kind at P = 2 and 4 under random costs, reductions up to ten times a stage's work (where a
    rank's drain, not its compute, ends the step): the bound is at most the simulated step."""
    rng = random.Random(7)
    checked = 0
    for spec, sched in specs:
        if sched.pp == 1 or spec.zero_stage not in (1, 3):
            continue
        for _ in range(2):
            costs = _random_pipeline_costs(rng, sched.num_stages, sched.pp)
            step = simulate_schedule(sched, costs, record_events=False).step_time_s
            assert step >= step_lower_bound_s(sched, costs) - 1e-9, f"{spec}: {costs}"
            checked += 1
    assert checked > 200


def _needs(vp: int):
    """What an action of one rank's split backward (P = 1) waits for, besides its stage's earlier micro-batch."""
    return {Op.F: lambda s, k: [(Op.F, s - 1, k)] if s else [],
            Op.I: lambda s, k: [(Op.I, s + 1, k)] if s < vp - 1 else [(Op.F, s, k)],
            Op.W: lambda s, k: [(Op.I, s, k)]}


def _orders(vp: int, m: int, prefix: tuple[Action, ...] = ()):
    """Every order of one rank's F, I and W actions (P = 1) that keeps their dependencies and each stage's
    micro-batch order."""
    if len(prefix) == 3 * vp * m:
        yield list(prefix)
        return
    done = {(a.op, a.stage, a.microbatch) for a in prefix}
    needs = _needs(vp)
    for op in (Op.F, Op.I, Op.W):
        for s in range(vp):
            k = sum(1 for a in prefix if a.op is op and a.stage == s)
            if k < m and all(d in done for d in needs[op](s, k)):
                yield from _orders(vp, m, prefix + (Action(op, s, k),))


def _random_costs(rng: random.Random, vp: int, m: int) -> Costs:
    """Random stage costs with reductions from a tenth to ten times a stage's work, unbucketed or bucketed."""
    fwd = [rng.uniform(0.2, 2.0) for _ in range(vp)]
    return Costs(fwd, [f * rng.uniform(1.5, 2.5) for f in fwd], [0.0] * vp, [0.0] * vp,
                 [rng.uniform(0.0, 2.0) for _ in range(vp)], [f * m * rng.uniform(0.1, 10.0) for f in fwd],
                 [rng.uniform(0.0, 2.0) for _ in range(vp)], [0.3], grad_norm=0.01,
                 input_grad_share=[rng.uniform(0.3, 0.7) for _ in range(vp)],
                 reduce_buckets=[rng.choice([1, 1, 2, 4]) for _ in range(vp)], dp_overlap=True, p2p_overlap=True)


@pytest.mark.parametrize("vp,m,count", [(2, 2, 908), (3, 1, 15)])
@pytest.mark.parametrize("zero", [1, 3])
def test_no_order_beats_the_bound(vp: int, m: int, count: int, zero: int) -> None:
    """Every order of a split backward at P = 1 (908 at V = 2, M = 2; 15 at V = 3, M = 1), under random costs: the
    bound is at most the best order's step."""
    orders = [lower(Schedule("by-hand", 1, vp, m, None, [acts]), zero_stage=zero, optimizer_step=False)
              for acts in _orders(vp, m)]
    assert len(orders) == count
    rng = random.Random(zero)
    for trial in range(40):
        costs = _random_costs(rng, vp, m)
        best = min(simulate_schedule(sched, costs, record_events=False).step_time_s for sched in orders)
        assert best >= step_lower_bound_s(orders[0], costs) - 1e-9, f"trial {trial}: {costs}"


def test_a_forward_waits_for_its_rank_to_run_the_stage_before_it() -> None:
    """P = V = M = 2, forward only, F = 2, 1, 4, 1 for stages 0-3, free transfers, by hand. Stage 2's second
    forward follows stage 1's (4 + 1) and its own first (3 + 4), so a flow shop allows 7 and the end 7 + 4 + 1 =
    12; but rank 0 runs both of stage 0's forwards (0-2, 2-4) and stage 2's first (4-8) before it, so it starts
    at 8 and the step ends at 13, which every order reaches at best (breadth-first does)."""
    n, pp = 4, 2
    costs = Costs([2.0, 1.0, 4.0, 1.0], [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n,
                  [0.0] * pp, grad_norm=0.0, dp_overlap=True, p2p_overlap=True)
    sched = ScheduleSpec("breadth-first", pp, 2, 2, forward_only=True).build()
    assert step_lower_bound_s(sched, costs) == pytest.approx(13.0, rel=1e-12)
    assert simulate_schedule(sched, costs, record_events=False).step_time_s == pytest.approx(13.0, rel=1e-12)


@pytest.mark.parametrize("zero", [1, 3])
def test_each_stage_waits_for_its_parameters(zero: int) -> None:
    """P = 2, V = M = 1 with the optimizer in the schedule, F = 1, backward = 2, free transfers, STEPs of 0.1, by
    hand: stage 1's parameters (an all-gather of 5 after its STEP, ZeRO-1's post-optimizer one or ZeRO-3's) are
    ready at 5.1, long after stage 0's forward ended (0.6 + 1), so its forward runs 5.1-6.1, the backwards 6.1-8.1
    and 8.1-10.1, stage 0's reduction 10.1-11.1: the step is that chain, which a flow shop from stage 0's
    parameters alone puts at 7.6."""
    n, pp = 2, 2
    gathers = [0.5, 5.0]
    costs = Costs([1.0] * n, [2.0] * n, [0.0] * n, [0.0] * n, gathers if zero == 3 else [0.0] * n, [1.0] * n,
                  [0.0] * n if zero == 3 else gathers, [0.2] * pp, step=[0.1] * n, grad_norm=0.0,
                  dp_overlap=True, p2p_overlap=True)
    sched = ScheduleSpec("1f1b", pp, 1, 1, zero_stage=zero).build()
    assert simulate_schedule(sched, costs, record_events=False).step_time_s == pytest.approx(11.1, rel=1e-12)
    assert step_lower_bound_s(sched, costs) == pytest.approx(11.1, rel=1e-12)
