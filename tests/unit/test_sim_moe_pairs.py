"""Merged pairs that hide the expert-parallel all-to-all (`schedule.pairs`, `sim.engine`): the plugin's paired order
(--paired-moe-a2a-overlap, simulated only) and Megatron's combined 1F1B (--overlap-moe-expert-parallel-comm).
Which actions pair, hand-computed steps, the bounds on what a pair hides, nothing changing without an all-to-all,
the step lower bound, and the flags (a launch refuses the paired order)."""

from __future__ import annotations

import itertools

import pytest

from megatron_bfpp.megatron.check import parse_megatron_args
from megatron_bfpp.megatron.plan_flags import SearchOptions, read_plan
from megatron_bfpp.megatron.sim_flags import FlagError, read_run
from megatron_bfpp.megatron.validation import ConfigError, validate_args
from megatron_bfpp.runtime import forward_backward as fb
from megatron_bfpp.schedule import Action, Op, Schedule, ScheduleError, ScheduleSpec, from_json, to_json
from megatron_bfpp.schedule.builders import interleaved_warmup
from megatron_bfpp.schedule.kinds import KINDS
from megatron_bfpp.schedule.pairs import COMBINED_1F1B, PAIRED, PAIRED_NOT_RUN, back_to_back_pairs, pairs_of
from megatron_bfpp.sim import Config, Costs, analytic_costs, get_hardware, predict, simulate_schedule, \
    step_lower_bound_s
from megatron_bfpp.sim.costs import memory_breakdown
from megatron_bfpp.sim.model import ModelProfile
from megatron_bfpp.sim.planner import _Bounds
from megatron_bfpp.sim.predict import check_config, schedule_for
import tests.support.megatron_parser  # noqa: F401  (Megatron's parser: imported once, at collection)

H100 = get_hardware("dgx-h100")
# Small MoE GPT: 4 layers, every second one MoE (8 experts, top-2).
MOE = ModelProfile("moe", 4, 1024, 16, 2048, 32000, 4096, swiglu=True, position_embedding="rope",
                   add_bias_linear=False, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=1024,
                   moe_layer_pattern=(0, 1, 0, 1))
DENSE = ModelProfile("dense", 4, 1024, 16, 2048, 32000)


def _acts(text: str) -> list[Action]:
    return [Action.parse(t) for t in text.split()]


def _costs(n: int, pp: int, *, a2a=(0.4, 0.5), cover=(1.0, 2.0), fwd=1.0, bwd=2.0, send=0.0, **kw) -> Costs:
    """Every stage alike: F and B with an all-to-all of a2a = (forward's, backward's) inside, and the compute a
    partner's may run behind, cover = (an F's, a B's); free collectives and optimizer unless given."""
    return Costs([fwd] * n, [bwd] * n, [send] * n, [send] * n, [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * pp,
                 moe_a2a_forward=[a2a[0]] * n, moe_a2a_backward=[a2a[1]] * n, moe_cover_forward=[cover[0]] * n,
                 moe_cover_backward=[cover[1]] * n, **kw)


# ------------------------------------------------------------------ which actions pair

def test_paired_order_pairs_back_to_back_actions_of_one_op_and_stage() -> None:
    """Within a run (non-compute actions between do not break it), first with second, third with fourth; the last
    of an odd run, an action alone in its run and every W run unpaired."""
    acts = _acts("F0:0 SEND_F0:0 F0:1 F0:2 F2:0 F2:1 RECV_B2:0 I2:0 W2:0 I2:1 W2:1 B0:0 B0:1 B0:2 B0:3 F1:0")
    assert back_to_back_pairs(acts) == {0: 2, 4: 5, 11: 12, 13: 14}


def test_combined_1f1b_pairs_megatrons_steady_state() -> None:
    """Megatron-Core's combined 1F1B: without a pipeline each backward with the next forward (the first forward and
    the last backward alone); interleaved, each steady-state forward with the backward after it, on its order
    with one more warm-up forward (none where every micro-batch is in the warm-up)."""
    one = ScheduleSpec("1f1b", 1, 1, 3, pairing=COMBINED_1F1B).order()
    assert [a.text for a in one.ranks[0]] == "F0:0 B0:0 F0:1 B0:1 F0:2 B0:2".split()
    assert pairs_of(one, 0) == {1: 2, 3: 4}
    for pp, vp, m, g in ((2, 2, 4, 2), (4, 2, 8, 4), (2, 3, 6, 4), (2, 2, 2, 2)):
        sched = ScheduleSpec("interleaved-1f1b", pp, vp, m, g, pairing=COMBINED_1F1B).order()
        for r, acts in enumerate(sched.ranks):
            warmup = min(interleaved_warmup(pp, r, vp, m, g) + 1, vp * m)
            assert [a.op for a in acts[:warmup + 1]].count(Op.F) == min(warmup + 1, vp * m)
            pairs = pairs_of(sched, r)
            assert len(pairs) == vp * m - warmup  # the steady state: every forward after the warm-up
            assert all(acts[i].op is Op.F and acts[j].op is Op.B and j == i + 1 for i, j in pairs.items())
    with pytest.raises(ScheduleError, match="needs virtual stages"):
        ScheduleSpec("1f1b", 2, 1, 4, pairing=COMBINED_1F1B).order()  # Megatron-Core refuses it at P > 1, V = 1
    with pytest.raises(ScheduleError, match="only its own schedules"):
        ScheduleSpec("breadth-first", 2, 2, 4, pairing=COMBINED_1F1B).order()


# ------------------------------------------------------------------ hand-computed steps

def test_one_stage_three_micro_batches_by_hand() -> None:
    """P = 1, M = 3, all forwards then all backwards, paired order: F0:0+F0:1 merged, F0:2 alone, B0:0+B0:1
    merged, B0:2 alone. An F (1 s) holds 0.4 s of all-to-all and covers 0.3 s of a partner's, so a merged pair
    of F's hides 0.3 s each (bounded by the cover); a B (2 s) holds 0.5 s and covers 2 s, so a pair hides all."""
    sched = ScheduleSpec("gpipe", 1, 1, 3, pairing=PAIRED).build()
    costs = _costs(1, 1, a2a=(0.4, 0.5), cover=(0.3, 2.0))
    res = simulate_schedule(sched, costs)
    assert res.step_time_s == pytest.approx((2 - 2 * 0.3) + 1 + (4 - 2 * 0.5) + 2, abs=1e-12)  # 7.4 s
    assert res.exposed_moe_a2a_s == pytest.approx([2 * (0.4 - 0.3) + 0.4 + 0 + 0.5])
    assert res.paired_actions == [4] and res.compute_s == pytest.approx([7.4])
    spans = {e.name: e.end - e.start for e in res.events if e.stream == "compute"}
    assert spans["F0:2"] == pytest.approx(1.0) and spans["B0:2"] == pytest.approx(2.0)  # unpaired: nothing hidden
    assert Schedule.from_text(sched.to_text()).pairing == PAIRED == from_json(to_json(sched)).pairing
    unpaired = simulate_schedule(ScheduleSpec("gpipe", 1, 1, 3).build(), costs)
    assert unpaired.step_time_s == pytest.approx(9.0) and unpaired.exposed_moe_a2a_s == pytest.approx([2.7])
    assert unpaired.paired_actions == [0]


def test_two_stages_a_pair_waits_for_both_inputs() -> None:
    """P = 2, M = 2, sends of 0.1 s on one lane per direction: stage 0's pair ends at 1.2 s and sends its outputs
    one after the other (1.3, 1.4 s); stage 1's pair starts when both are there (1.4 s), ends at 2.6 s, its
    backward pair at 5.6 s; its gradients arrive at 5.7 and 5.8 s, and stage 0's backward pair ends at 8.8 s.
    Without pairs: 9.2 s."""
    costs = _costs(2, 2, send=0.1)
    res = simulate_schedule(ScheduleSpec("gpipe", 2, 1, 2, pairing=PAIRED).build(), costs)
    assert res.step_time_s == pytest.approx(8.8, abs=1e-12)
    ev = {(e.rank, e.name): e for e in res.events if e.stream == "compute"}
    assert ev[(1, "F1:0")].start == pytest.approx(1.4) and ev[(1, "F1:1")].end == pytest.approx(2.6)
    assert res.exposed_moe_a2a_s == pytest.approx([0.0, 0.0]) and res.paired_actions == [4, 4]
    assert simulate_schedule(ScheduleSpec("gpipe", 2, 1, 2).build(), costs).step_time_s == pytest.approx(9.2)


def test_combined_1f1b_without_a_pipeline_by_hand() -> None:
    """Megatron's combined 1F1B at P = 1, M = 3: F0 alone, B0 with F1, B1 with F2, B2 alone. Each F's all-to-all
    (0.4 s) runs behind the B's cover, each B's (0.5 s) behind the F's cover (0.3 s)."""
    sched = ScheduleSpec("1f1b", 1, 1, 3, pairing=COMBINED_1F1B).build()
    res = simulate_schedule(sched, _costs(1, 1, a2a=(0.4, 0.5), cover=(0.3, 2.0)))
    pair = 1 + 2 - 0.4 - 0.3
    assert res.step_time_s == pytest.approx(1 + 2 * pair + 2, abs=1e-12)
    assert res.exposed_moe_a2a_s == pytest.approx([0.4 + 2 * 0.2 + 0.5]) and res.paired_actions == [4]
    one = simulate_schedule(ScheduleSpec("1f1b", 1, 1, 1, pairing=COMBINED_1F1B).build(), _costs(1, 1))
    assert one.paired_actions == [0] and one.step_time_s == pytest.approx(3.0)  # M = 1: no partner at all


# ------------------------------------------------------------------ bounds on what a pair hides

@pytest.mark.parametrize("pairing,kind,vp", [(PAIRED, "breadth-first", 2), (PAIRED, "breadth-first-zb", 2),
                                             (COMBINED_1F1B, "interleaved-1f1b", 2)])
@pytest.mark.parametrize("a2a,cover", [((0.4, 0.5), (0.2, 0.3)), ((0.4, 0.5), (0.9, 1.8)), ((0.0, 0.0), (0.9, 1.8))])
def test_a_pair_hides_at_most_the_partners_cover_and_never_beats_its_parts(pairing, kind, vp, a2a, cover) -> None:
    """Each merged pair takes its two durations less min(all-to-all, partner's cover) of each: never less than
    its two all-to-alls together (one network) nor its two computations; actions outside pairs hide nothing."""
    sched = ScheduleSpec(kind, 2, vp, 4, pairing=pairing, zero_stage=1).build()
    costs = _costs(sched.num_stages, 2, a2a=a2a, cover=cover, send=0.05, input_grad_share=[0.6] * 4)
    res = simulate_schedule(sched, costs)
    share = costs.input_grad_share[0]
    dur = {Op.F: 1.0, Op.B: 2.0, Op.I: 2.0 * share, Op.W: 2.0 * (1 - share)}
    own = {Op.F: a2a[0], Op.B: a2a[1], Op.I: a2a[1], Op.W: 0.0}
    cov = {Op.F: cover[0], Op.B: cover[1], Op.I: cover[1], Op.W: 0.0}
    merged = 0
    for r in range(2):
        body = [a for a in sched.ranks[r] if a.op is not Op.STEP]
        pairs = pairs_of(sched, r, body) if any(a2a) else {}
        evs = {e.name: e for e in res.events if e.rank == r and e.stream == "compute"}
        for i, j in pairs.items():
            a, b = body[i], body[j]
            span = evs[b.text].end - evs[a.text].start
            assert span == pytest.approx(dur[a.op] + dur[b.op] - min(own[a.op], cov[b.op]) - min(own[b.op], cov[a.op]))
            assert span >= own[a.op] + own[b.op] - 1e-12 and span >= dur[a.op] + dur[b.op] - own[a.op] - own[b.op] - 1e-12
            merged += 2
        for k, a in enumerate(body):
            if a.op in dur and k not in pairs and k not in pairs.values():
                assert evs[a.text].end - evs[a.text].start == pytest.approx(dur[a.op])  # alone: nothing hidden
    assert sum(res.paired_actions) == merged and (merged > 0) == any(a2a)


def test_nothing_changes_without_an_all_to_all() -> None:
    """No experts, or EP = 1: the same step whether the paired order is asked for or not (no pair merges; at EP = 1
    the schedule is not even paired); a dense stage's pairs run one after the other."""
    for kind, vp in (("breadth-first", 2), ("interleaved-zb", 2), ("zb-h1", 1)):
        plain = ScheduleSpec(kind, 2, vp, 4, zero_stage=2).build()
        paired = ScheduleSpec(kind, 2, vp, 4, zero_stage=2, pairing=PAIRED).build()
        costs = _costs(plain.num_stages, 2, a2a=(0.0, 0.0), send=0.05, input_grad_share=[0.6] * plain.num_stages)
        a, b = simulate_schedule(plain, costs), simulate_schedule(paired, costs)
        assert b.step_time_s == pytest.approx(a.step_time_s, abs=1e-12) and b.paired_actions == [0, 0]
    for model, ep in ((MOE, 1), (DENSE, 1)):
        base = Config(1, 2, 2, 4, 1, 8, "breadth-first", 2, False, None, ep=ep)
        with_pairs = Config(1, 2, 2, 4, 1, 8, "breadth-first", 2, False, None, ep=ep, paired_moe_a2a_overlap=True)
        assert schedule_for(with_pairs).pairing is None
        costs = analytic_costs(H100, with_pairs.partition(model), with_pairs)
        assert not any(costs.moe_a2a_forward + costs.moe_a2a_backward)
        assert simulate_schedule(schedule_for(with_pairs), costs).step_time_s == pytest.approx(
            simulate_schedule(schedule_for(base), analytic_costs(H100, base.partition(model), base)).step_time_s)
    with pytest.raises(ValueError, match="needs an MoE model"):
        check_config(DENSE, H100, Config(1, 2, 2, 4, 1, 8, "breadth-first", 2, False, None,
                                         paired_moe_a2a_overlap=True))


def test_moe_costs_and_prediction_with_pairs() -> None:
    """At EP = 4 the MoE stages carry an all-to-all and their cover; the paired order merges pairs, shows less
    exposed all-to-all and holds two micro-batches' transient memory; the dense stages' pairs hide nothing."""
    cfg = Config(1, 2, 1, 4, 1, 8, "zb-h1", 1, False, None, ep=4)
    paired = Config(1, 2, 1, 4, 1, 8, "zb-h1", 1, False, None, ep=4, paired_moe_a2a_overlap=True)
    c = analytic_costs(H100, paired.partition(MOE), paired)
    assert all(x > 0 for x in c.moe_a2a_forward + c.moe_a2a_backward + c.moe_cover_forward + c.moe_cover_backward)
    assert c.moe_cover_backward[0] < analytic_costs(H100, cfg.partition(MOE),
                                                    Config(1, 2, 1, 4, 1, 8, "1f1b", 1, False, None,
                                                           ep=4)).moe_cover_backward[0]  # an I covers less than a B
    a, b = predict(MOE, H100, cfg), predict(MOE, H100, paired)
    assert b.paired_actions > 0 and a.paired_actions == 0 and b.exposed_moe_a2a_s < a.exposed_moe_a2a_s
    part = paired.partition(MOE)
    assert memory_breakdown(part, paired, 0, 0.0)["working"] == pytest.approx(
        2 * memory_breakdown(part, cfg, 0, 0.0)["working"])
    # The planner's throughput bound takes off what pairs may hide: one rank, every action paired, stays below.
    one = Config(1, 1, 2, 4, 1, 4, "breadth-first", 1, False, None, ep=4, paired_moe_a2a_overlap=True)
    p = predict(MOE, H100, one)
    assert p.paired_actions == 16 and _Bounds(MOE, H100).step_lower_bound(one, one.partition(MOE)) <= p.step_time_s


def test_no_simulated_pairing_beats_the_lower_bound() -> None:
    checked = 0
    for kind, pp, vp, m, pairing in itertools.product(KINDS, (2, 4), (1, 2), (2, 3, 8), (PAIRED, COMBINED_1F1B)):
        spec = ScheduleSpec(kind, pp, vp, m, zero_stage=1, pairing=pairing)
        try:
            sched = spec.build()
        except ScheduleError:
            continue  # a combination the kind (or Megatron's combined 1F1B) refuses
        n = sched.num_stages
        fwd = [1.0 + 0.3 * (s == 0) + 0.05 * (s % 3) for s in range(n)]
        costs = Costs(fwd, [2.1 * f for f in fwd], [0.15] * n, [0.2] * n, [0.0] * n, [1.1] * n, [0.5] * n,
                      [0.4] * pp, input_grad_share=[0.55] * n, moe_a2a_forward=[0.3] * n,
                      moe_a2a_backward=[0.35 + 0.1 * (s % 2) for s in range(n)],
                      moe_cover_forward=[0.25] * n, moe_cover_backward=[0.6] * n)
        res = simulate_schedule(sched, costs, record_events=False)
        assert res.step_time_s >= step_lower_bound_s(sched, costs) - 1e-9, spec
        checked += 1
    assert checked > 30
    # One rank, every action in a pair: its work, each action less what its partner hides, is the step exactly.
    for kind, vp in (("gpipe", 1), ("breadth-first", 2)):
        sched = ScheduleSpec(kind, 1, vp, 4, pairing=PAIRED).build()
        costs = _costs(sched.num_stages, 1)
        assert simulate_schedule(sched, costs).step_time_s == pytest.approx(step_lower_bound_s(sched, costs), rel=1e-12)


# ------------------------------------------------------------------ the flags

MOE_FLAGS = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "2048",
             "--max-position-embeddings", "2048", "--bf16", "--tokenizer-type", "NullTokenizer", "--vocab-size",
             "32000", "--num-experts", "8", "--moe-token-dispatcher-type", "alltoall", "--disable-bias-linear",
             "--expert-model-parallel-size", "4", "--pipeline-model-parallel-size", "2", "--micro-batch-size", "1",
             "--global-batch-size", "32"]
SMALL_MOE = [*MOE_FLAGS, "--num-layers-per-virtual-pipeline-stage", "1"]


def test_simulate_reads_the_paired_order_and_a_launch_refuses_it() -> None:
    flags = [*SMALL_MOE, "--pipeline-schedule", "breadth-first", "--zero-stage", "1", "--paired-moe-a2a-overlap"]
    _, cfg = read_run(flags, 8, H100)
    assert cfg.paired_moe_a2a_overlap and cfg.pairing == PAIRED and schedule_for(cfg).pairing == PAIRED
    with pytest.raises(ConfigError, match="--pipeline-schedule breadth-first"):
        read_run([*SMALL_MOE, "--paired-moe-a2a-overlap"], 8, H100)  # Megatron's own schedule: refused
    with pytest.raises(ConfigError, match="simulated only") as e:
        validate_args(parse_megatron_args(flags, 8))  # what a launch and `bfpp check` run
    assert str(e.value) == PAIRED_NOT_RUN
    with pytest.raises(ValueError, match="simulated only"):
        fb._cached_schedule(ScheduleSpec("breadth-first", 2, 2, 4, pairing=PAIRED))  # the runtime itself


def test_megatrons_overlap_only_under_its_own_schedule_with_virtual_stages() -> None:
    _, cfg = read_run([*SMALL_MOE, "--overlap-moe-expert-parallel-comm", "--use-distributed-optimizer"], 8, H100)
    assert cfg.pairing == COMBINED_1F1B and predict(MOE, H100, cfg).paired_actions > 0
    model, c = read_run([*MOE_FLAGS, "--overlap-moe-expert-parallel-comm", "--use-distributed-optimizer"], 8, H100)
    with pytest.raises(ValueError, match="needs virtual stages"):  # Megatron-Core's rule at P > 1
        check_config(model, H100, c)
    with pytest.raises(ValueError, match="combined 1F1B"):
        check_config(MOE, H100, Config(1, 2, 2, 4, 1, 8, "breadth-first", 1, False, None, ep=4,
                                       moe_a2a_overlap=True))


def test_plan_takes_the_paired_order_but_not_for_stock() -> None:
    plan_flags = [*SMALL_MOE, "--paired-moe-a2a-overlap"]  # the sizes restrict the search
    inputs = read_plan(plan_flags, 8, H100)
    assert inputs.space.paired_moe_a2a_overlap and any("simulated only" in n for n in inputs.notes)
    with pytest.raises(FlagError, match="--paired-moe-a2a-overlap"):
        read_plan(plan_flags, 8, H100, SearchOptions(stock=True))
