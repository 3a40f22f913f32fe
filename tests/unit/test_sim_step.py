"""The simulator and the timelines with a schedule-placed optimizer step (STEP actions at each rank's step
boundary): the tail runs at the start of the next step, the step waits for the gradient norm and not for the
whole optimizer; stock Megatron's optimizer (outside the schedule) keeps its model. Pure Python, fast."""

import dataclasses

import pytest

from megatron_bfpp.schedule import Op, ScheduleSpec
from megatron_bfpp.schedule.events import TimelineEvent
from megatron_bfpp.sim import STOCK, SearchSpace, get_hardware, get_model, plan
from megatron_bfpp.sim.costs import Config, Costs, analytic_costs
from megatron_bfpp.sim.engine import simulate_schedule
from megatron_bfpp.sim.planner import _Bounds, enumerate_configs
from megatron_bfpp.sim.predict import predict, schedule_for, schedule_spec
from megatron_bfpp.trace.chrome import chrome_trace_dict, events_from_chrome_dict
from megatron_bfpp.trace.draw import OPTIMIZER_COLOUR, Panel, bar_style, draw_panels
from megatron_bfpp.trace.metrics import check_against_schedule, iteration_metrics

A100 = get_hardware("dgx-a100")
GPT13 = get_model("gpt-1.3b")


def _bf(zero: int, optimizer_step: bool = True):
    """Breadth-first, P = 2, V = 2, M = 4: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3."""
    return ScheduleSpec("breadth-first", 2, 2, 4, zero_stage=zero, optimizer_step=optimizer_step).build()


def _costs(t_opt: float, zero: int) -> Costs:
    """t_F = 1, t_B = 2, free p2p, a stage's all-gather 0.5 s, a rank's optimizer `t_opt` (each STEP half)."""
    sync = 0.5 if zero in (1, 2) else 0.0
    gather = 0.5 if zero == 3 else 0.0
    return Costs.uniform(4, 2, 1.0, 2.0, t_gather=gather, t_param_sync=sync, t_optimizer=t_opt, t_grad_norm=0.01)


def _ev(res, rank, name):
    return next(e for e in res.events if e.rank == rank and e.name == name)


# ---------------------------------------------------------------- the engine

def test_tail_hides_all_but_the_first_stages_step() -> None:
    """ZeRO-1, STEP 0.5 s per stage. Rank 0: STEP0 [0, 0.5], GATHER0 [0.5, 1.0] while STEP2 runs [0.5, 1.0],
    so F0:0 starts at 1.0; rank 1's STEPs end at 1.0, before its first input arrives (2.0). The pipeline after
    rank 0's first F is the unit layout's 3 V M (1 + (P-1)/(V M)) = 27 s, then the gradient norm: 28.01 s,
    where the optimizer outside the schedule costs 0.5 (parameter gather) + 27 + 1.0 (optimizer) = 28.5 s."""
    res = simulate_schedule(_bf(1), _costs(1.0, 1))
    assert _ev(res, 0, "STEP0").start == 0.0 and _ev(res, 0, "STEP0").end == 0.5
    assert (_ev(res, 0, "GATHER0").start, _ev(res, 0, "GATHER0").end) == (0.5, 1.0)
    assert (_ev(res, 0, "STEP2").start, _ev(res, 0, "STEP2").end) == (0.5, 1.0)
    assert _ev(res, 0, "F0:0").start == 1.0 and _ev(res, 1, "F1:0").start == 2.0
    assert res.step_time_s == pytest.approx(28.01)
    assert res.grad_norm_s == 0.01 and res.optimizer_s == 1.0
    assert res.optimizer_rank_s == pytest.approx([1.01, 1.01])
    # Rank 0 waits for its first stage's step (0.5) and the norm; rank 1 for the norm alone.
    assert res.optimizer_exposed_s == pytest.approx([0.51, 0.01])
    assert res.optimizer_hidden_s == pytest.approx([0.5, 1.0])
    assert [e.op for e in res.events if e.op in ("STEP", "OPTIMIZER") and e.rank == 0] == ["STEP", "STEP", "OPTIMIZER"]
    assert all(e.stream == "compute" for e in res.events if e.op == "STEP")
    assert res.dp_traffic["param_sync"] == [2, 2]

    stock = simulate_schedule(_bf(1, optimizer_step=False), _costs(1.0, 1))
    assert not any(e.op == "STEP" for e in stock.events)
    assert stock.step_time_s == pytest.approx(28.5)
    assert stock.optimizer_rank_s == stock.optimizer_exposed_s == [1.0, 1.0] and stock.grad_norm_s == 0.0


def test_long_steps_are_exposed_on_the_first_rank_only() -> None:
    """STEP 2 s per stage: rank 0's F0:0 waits for both STEPs (4.0; 3.5 later than GATHER0 alone would let
    it); rank 1's STEPs (until 4.0) still end before its first input (5.0)."""
    res = simulate_schedule(_bf(1), _costs(4.0, 1))
    assert _ev(res, 0, "F0:0").start == 4.0 and _ev(res, 1, "F1:0").start == 5.0
    assert res.step_time_s == pytest.approx(4.0 + 27 + 0.01)
    assert res.optimizer_exposed_s == pytest.approx([3.51, 0.01])


def test_zero3_tail_gather_makes_the_first_gather_a_no_op() -> None:
    """ZeRO-3: the boundary gathers the first stage (after its STEP); the body's first GATHER of it runs
    nothing, and the body's GATHER of another stage waits for that stage's STEP (it gathers the updated shards)."""
    sched = _bf(3)
    assert [a.text for a in sched.step_tail(0)] == ["STEP0", "GATHER0", "STEP2"]
    res = simulate_schedule(sched, _costs(1.0, 3))
    gathers0 = [e for e in res.events if e.rank == 0 and e.op == "GATHER"]
    assert [(e.name, e.start, e.end) for e in gathers0] == [("GATHER0", 0.5, 1.0), ("GATHER2", 1.0, 1.5)]
    assert sum(1 for a in sched.ranks[0] if a.op == Op.GATHER) == 3  # tail + body's (no-op) + stage 2
    assert res.dp_traffic["gather"] == [2, 2]
    assert _ev(res, 0, "F0:0").start == 1.0
    assert res.step_time_s == pytest.approx(28.01)
    slow = simulate_schedule(sched, _costs(4.0, 3))  # STEP2 ends at 4.0: GATHER2 cannot start before
    assert _ev(slow, 0, "GATHER2").start == 4.0


def test_stock_configurations_lower_without_step() -> None:
    ours = Config(2, 2, 4, 4, 1, 4, "interleaved-1f1b", 1, False)
    stock = dataclasses.replace(ours, stock_optimizer=True)
    with_flag = dataclasses.replace(ours, param_gather_with_optimizer=True)  # Megatron's flag: its optimizer
    assert ours.optimizer_in_schedule and not stock.optimizer_in_schedule and not with_flag.optimizer_in_schedule
    assert schedule_spec(ours).optimizer_step and not schedule_spec(stock).optimizer_step
    assert any(a.op == Op.STEP for a in schedule_for(ours).ranks[0])
    assert not any(a.op == Op.STEP for acts in schedule_for(stock).ranks for a in acts)
    p_ours, p_stock = predict(GPT13, A100, ours), predict(GPT13, A100, stock)
    assert p_stock.optimizer_exposed_s == p_stock.optimizer_s > 0
    assert 0 < p_ours.optimizer_exposed_s < p_ours.optimizer_s
    assert p_ours.step_time_s < p_stock.step_time_s
    d = p_ours.to_dict()
    assert d["config"]["optimizer_in_schedule"] is True and p_stock.to_dict()["config"]["optimizer_in_schedule"] is False
    assert {"optimizer_s", "optimizer_exposed_s"} <= set(d["per_rank"][0])


def test_analytic_step_costs_split_the_optimizer_by_parameters() -> None:
    cfg = Config(2, 2, 4, 4, 1, 4, "breadth-first", 1, False)
    part = cfg.partition(GPT13)
    c = analytic_costs(A100, part, cfg)
    for r in range(cfg.pp):
        stages = list(range(r, part.num_stages, cfg.pp))
        assert sum(c.step[s] for s in stages) == pytest.approx(c.optimizer[r])
        for s in stages:
            assert c.step[s] / c.optimizer[r] == pytest.approx(part.stage_params(s) / part.rank_params(r))
    assert c.grad_norm == A100.collective_overhead_s
    m = Costs.from_measurements(4, 2, 1.0, 2.0, 1e6, 1e9, 1e-5, [1.0, 1.0, 3.0, 1.0], 2, 1e9, 1e9, 2e-5, 1,
                                optimizer=0.8)
    assert m.step == pytest.approx([0.2, 0.4, 0.6, 0.4]) and m.grad_norm == 2e-5
    assert Costs.uniform(6, 2, 1.0, 2.0, t_optimizer=0.9).step == pytest.approx([0.3] * 6)


def test_planner_sides_and_bound() -> None:
    ours, _ = enumerate_configs(GPT13, A100, 16, 32, SearchSpace(tp_sizes=(2,), pp_sizes=(2,)))
    stock, _ = enumerate_configs(GPT13, A100, 16, 32, dataclasses.replace(STOCK, tp_sizes=(2,), pp_sizes=(2,)))
    assert ours and all(c.optimizer_in_schedule for c in ours)
    assert stock and all(c.stock_optimizer and not c.optimizer_in_schedule for c in stock)
    bounds = _Bounds(GPT13, A100)
    for cfg in ours[:: max(1, len(ours) // 12)] + stock[:: max(1, len(stock) // 6)]:  # a lower bound still
        try:
            p = predict(GPT13, A100, cfg)
        except ValueError:
            continue
        assert bounds.step_lower_bound(cfg, cfg.partition(GPT13)) <= p.step_time_s
    # (the layout refinement, tested in test_sim_layouts.py, left out: three quarters of this test's time)
    res = plan(GPT13, A100, 16, 32, SearchSpace(tp_sizes=(2,), pp_sizes=(2,), refine_layouts=False), top=2).to_dict()
    assert res["candidates"] and all(c["config"]["optimizer_in_schedule"] for c in res["candidates"])


# ---------------------------------------------------------------- timelines

def test_simulated_step_timeline_accounts_steps_as_optimizer() -> None:
    sched = _bf(3)
    res = simulate_schedule(sched, _costs(1.0, 3))
    assert check_against_schedule(res.events, sched) == []
    m = iteration_metrics(res.events)
    assert m.step_time_s == pytest.approx(res.step_time_s)
    for r, rm in enumerate(m.ranks):
        assert rm.compute_s == pytest.approx(res.compute_s[r])  # STEPs are not compute ...
        assert rm.optimizer_s == pytest.approx(res.optimizer_rank_s[r])  # ... but optimizer, and not bubble
        assert rm.accounted_s == pytest.approx(rm.step_time_s)
    assert m.to_dict()["optimizer_s"] == pytest.approx(1.01)


def _recorded(sched, res):
    """The simulated iteration as the runtime records it: the step boundary after the rank's body."""
    end = res.step_time_s
    out = []
    for e in res.events:
        if e.op == "STEP" or (e.op == "GATHER" and e.start < 1.0 and e.stage in (0, 1)):
            e = dataclasses.replace(e, start=e.start + end, end=e.end + end)
        out.append(e)
    return out


def test_recorded_step_events() -> None:
    """STEP events after the body (as the optimizer records them) check against the schedule; one between two
    computations, or a missing one, is reported; the metrics count them as optimizer time."""
    sched = _bf(3)
    res = simulate_schedule(sched, _costs(1.0, 3))
    rec = _recorded(sched, res)
    assert check_against_schedule(rec, sched) == []
    assert iteration_metrics(rec).ranks[0].optimizer_s == pytest.approx(1.01)
    f = _ev(res, 0, "F2:0")
    inside = [dataclasses.replace(e, start=f.start - 0.5, end=f.start) if e.rank == 0 and e.name == "STEP2" else e
              for e in rec if not (e.rank == 0 and e.name == "F0:3")]
    problems = check_against_schedule(inside, sched)
    assert any("STEP2" in p and "between the rank's computations" in p for p in problems)
    missing = [e for e in rec if not (e.rank == 1 and e.name == "STEP3")]
    assert any("STEP events for stages [1], the schedule steps [1, 3]" in p
               for p in check_against_schedule(missing, sched))


def test_step_events_drawn_and_round_tripped(tmp_path) -> None:
    res = simulate_schedule(_bf(1), _costs(1.0, 1))
    step = _ev(res, 0, "STEP2")
    kw, _, label = bar_style(step, {})
    assert kw["color"] == OPTIMIZER_COLOUR and label == "S2"
    back = events_from_chrome_dict(chrome_trace_dict(res.events))
    got = [e for e in back if e.op == "STEP"]
    assert len(got) == 4 and all(e.stream == "compute" and e.microbatch is None for e in got)
    w, h = draw_panels([Panel(res.events, "steps")], tmp_path / "steps.png")
    assert w > 0 and h > 0 and (tmp_path / "steps.png").stat().st_size > 0


def test_timeline_event_stream_of_step() -> None:
    from megatron_bfpp.schedule.events import stream_of

    assert stream_of(Op.STEP) == "compute"
    assert TimelineEvent(0, "compute", "STEP0", "STEP", 0, None, 0.0, 1.0).op == "STEP"
