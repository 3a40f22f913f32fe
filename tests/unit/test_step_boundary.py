"""The optimizer step as schedule data: STEP actions at the end of each rank's list (pure Python)."""

import dataclasses

import pytest

from megatron_bfpp.schedule import SCHEDULE_NAMES, Action, Op, ScheduleError, ScheduleSpec, make_schedule, validate
from megatron_bfpp.schedule.lower import first_use_order


def _with_rank(schedule, rank, actions):
    ranks = list(schedule.ranks)
    ranks[rank] = actions
    return dataclasses.replace(schedule, ranks=ranks)


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_every_rank_steps_each_stage_once_in_first_use_order(name, zero):
    vp = 1 if name in ("gpipe", "1f1b", "zb-h1") else 2
    s = make_schedule(name, 2, vp, 4, zero_stage=zero)  # validated
    for r in range(2):
        tail = s.step_tail(r)
        body = s.ranks[r][:s.step_boundary(r)]
        assert [a.stage for a in tail if a.op == Op.STEP] == first_use_order(body) == s.stages_of(r)
        gathers = [a.stage for a in tail if a.op == Op.GATHER]
        # ZeRO-1/2: each stage's resident parameters all-gathered right after its STEP; ZeRO-3: the first stage
        # only, which the next iteration's first forward needs.
        assert gathers == (s.stages_of(r) if zero in (1, 2) else [r])
        for a in tail:
            if a.op == Op.GATHER:
                assert tail.index(Action(Op.STEP, a.stage)) == tail.index(a) - 1
        assert all(a.op not in (Op.STEP,) for a in body)


def test_no_step_without_the_sharded_optimizer_or_in_forward_only_runs():
    assert make_schedule("breadth-first", 2, 2, 4).step_boundary(0) is None  # no data-parallel actions
    assert make_schedule("breadth-first", 2, 2, 4, zero_stage=3, forward_only=True).step_boundary(0) is None
    stock = ScheduleSpec("interleaved-1f1b", 2, 2, 4, zero_stage=1, optimizer_step=False).build()
    assert stock.step_boundary(0) is None and all(a.op != Op.GATHER for acts in stock.ranks for a in acts)


def test_text_json_round_trip_keeps_the_boundary():
    from megatron_bfpp.schedule import Schedule, from_json, to_json

    s = make_schedule("interleaved-zb", 2, 2, 4, zero_stage=3)
    for back in (Schedule.from_text(s.to_text()), from_json(to_json(s))):
        assert back.ranks == s.ranks and back.step_tail(1) == s.step_tail(1)
        validate(back)


def _p2p_after_boundary(acts, b):
    """The body's last lone p2p action moved behind the first STEP."""
    k = max(i for i, a in enumerate(acts[:b]) if a.op in (Op.SEND_F, Op.SEND_B, Op.RECV_F, Op.RECV_B)
            and a.batch is None)
    return acts[:k] + acts[k + 1:b + 1] + [acts[k]] + acts[b + 1:]


@pytest.mark.parametrize("edit,needle", [
    # a STEP before its stage's REDUCE (gradients not reduced yet)
    (lambda acts, b: [Action(Op.STEP, 0)] + [a for a in acts if a != Action(Op.STEP, 0)], "no REDUCE"),
    # a p2p action after the boundary (the gradient norm's all-reduce meets every rank first)
    (lambda acts, b: _p2p_after_boundary(acts, b), "only STEP and GATHER"),
    # a stage never stepped
    (lambda acts, b: [a for a in acts if a not in (Action(Op.STEP, 2), Action(Op.GATHER, 2))], "no STEP for stages [2]"),
    # stepped twice
    (lambda acts, b: acts + [Action(Op.STEP, 2)], "appears twice"),
    # a ZeRO-1 all-gather before its STEP
    (lambda acts, b: acts[:b] + [Action(Op.GATHER, 0)] + acts[b:], "before the optimizer step"),
    # a ZeRO-1 stage left without its all-gather
    (lambda acts, b: [a for a in acts if a != Action(Op.GATHER, 2)], "have none"),
])
def test_bad_boundaries_are_refused(edit, needle):
    s = make_schedule("breadth-first", 2, 2, 4, zero_stage=1)
    bad = _with_rank(s, 0, edit(list(s.ranks[0]), s.step_boundary(0)))
    with pytest.raises(ScheduleError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        validate(bad)


def test_step_without_its_reduce_is_refused():
    s = make_schedule("breadth-first", 2, 2, 4, zero_stage=2)
    bad = _with_rank(s, 1, [a for a in s.ranks[1] if a != Action(Op.REDUCE, 3)])
    with pytest.raises(ScheduleError, match="REDUCE"):
        validate(bad)


def test_zero3_carries_only_the_boundary_gathers():
    s = make_schedule("breadth-first", 2, 2, 4, zero_stage=3)
    # A stage gathered at the boundary without being released in the body would be gathered twice.
    acts = [a for a in s.ranks[0] if a != Action(Op.RELEASE, 0)]
    with pytest.raises(ScheduleError, match="already gathered|still gathered"):
        validate(_with_rank(s, 0, acts))
    # More boundary gathers than weight buffers.
    with pytest.raises(ScheduleError, match="gathers 2 stages into the next iteration; 1 weight buffers"):
        validate(_with_rank(dataclasses.replace(s, weight_buffers=1), 0, s.ranks[0] + [Action(Op.GATHER, 2)]))


def test_nccl_model_meets_every_rank_at_the_gradient_norm():
    """The gradient norm's all-reduce before the first STEP is a rendezvous of every rank: a send posted after
    it, which another rank's backward needs, deadlocks with one queue per rank (CUDA_DEVICE_MAX_CONNECTIONS=1)
    and not with one per communicator, and the error names the all-reduce."""
    from megatron_bfpp.schedule.validate import simulate_nccl

    s = make_schedule("breadth-first", 2, 2, 4, zero_stage=1)
    acts, b = list(s.ranks[1]), s.step_boundary(1)
    k = max(i for i, a in enumerate(acts[:b]) if a.op == Op.SEND_B and a.batch is None)
    moved = _with_rank(s, 1, acts[:k] + acts[k + 1:b + 1] + [acts[k]] + acts[b + 1:])
    simulate_nccl(moved, single_queue=False)
    with pytest.raises(ScheduleError, match="gradient norm's all-reduce"):
        simulate_nccl(moved, single_queue=True)
    simulate_nccl(s, single_queue=True)
