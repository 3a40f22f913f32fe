"""Schedule IR, builders, lowering and validation (pure Python)."""

import dataclasses
import json
import re
import subprocess
import sys

import pytest
from hypothesis import given, settings, strategies as st

from megatron_bfpp.schedule import (
    COMPUTE_OPS, SCHEDULE_NAMES, Action, Op, Schedule, ScheduleError, build, from_csv, from_json, lower, make_schedule, peak_activations,
    simulate_order, to_csv, to_json, validate,
)
from megatron_bfpp.schedule.builders import interleaved_warmup, megatron_schedule_table
from megatron_bfpp.schedule.validate import _compute_only_lowering, simulate_nccl


def test_action_text_round_trip():
    for a in [Action(Op.F, 4, 0), Action(Op.SEND_B, 3, 11), Action(Op.GATHER, 2), Action(Op.REDUCE, 0),
              Action(Op.RECV_F, 1, 2, batch=7), Action(Op.SEND_F, 0, 1, batch=3, channel="activations"),
              Action(Op.SEND_F, 0, 1, batch=3, channel="gradients")]:
        back = Action.parse(a.text)
        assert (back, back.batch, back.channel) == (a, a.batch, a.channel)
    # A p2p action always holds its channel; the text form names it only when it is not the op's default.
    assert (Action(Op.SEND_B, 3, 1).channel, Action(Op.F, 3, 1).channel) == ("gradients", None)
    assert Action(Op.SEND_F, 0, 1, channel="activations").text == "SEND_F0:1"
    assert Action(Op.SEND_F, 0, 1, channel="gradients").text == "SEND_F0:1/gradients"
    with pytest.raises(ScheduleError):
        Action(Op.GATHER, 1, 3)
    with pytest.raises(ScheduleError):
        Action.parse("X3:1")


@pytest.mark.parametrize("name,pp,vp,m,g,z", [
    ("gpipe", 3, 1, 5, None, 3), ("1f1b", 4, 1, 6, None, 2), ("interleaved-1f1b", 2, 3, 6, 3, 1),
    ("breadth-first", 4, 2, 8, 4, 3), ("breadth-first", 1, 3, 2, None, 2),
])
def test_text_json_csv_round_trip(name, pp, vp, m, g, z):
    s = make_schedule(name, pp, vp, m, g, zero_stage=z)
    for back in (Schedule.from_text(s.to_text()), from_json(to_json(s)),
                 from_csv(to_csv(s), pp=pp, vp=vp, microbatches=m)):
        assert back.ranks == s.ranks
        assert [[(a.batch, a.channel) for a in acts] for acts in back.ranks] == \
            [[(a.batch, a.channel) for a in acts] for acts in s.ranks]
        assert (back.pp, back.vp, back.microbatches) == (pp, vp, m)
        validate(back)


def test_breadth_first_order():
    s = build("breadth-first", 4, 2, 8)
    r1 = [a.text for a in s.ranks[1]]
    assert r1 == [f"F1:{m}" for m in range(8)] + [f"F5:{m}" for m in range(8)] + \
        [f"B5:{m}" for m in range(8)] + [f"B1:{m}" for m in range(8)]


def test_breadth_first_groups():
    s = build("breadth-first", 2, 2, 6, group_size=3)
    assert [a.text for a in s.ranks[0]] == (
        ["F0:0", "F0:1", "F0:2", "F2:0", "F2:1", "F2:2", "B2:0", "B2:1", "B2:2", "B0:0", "B0:1", "B0:2",
         "F0:3", "F0:4", "F0:5", "F2:3", "F2:4", "F2:5", "B2:3", "B2:4", "B2:5", "B0:3", "B0:4", "B0:5"])
    assert peak_activations(s) == [6, 6]  # V * G, not V * M


def _megatron_order(pp, rank, vp, m, g):
    """Rank's F/B order straight from megatron-core's own table and warm-up count."""
    sched = pytest.importorskip("megatron.core.pipeline_parallel.schedules")
    table = sched.get_schedule_table(m, vp, g)
    total = m * vp
    warm = (pp - rank - 1) * 2 + (vp - 1) * g
    warm = min(warm, total)
    f = [("F", c * pp + rank, mb) for mb, c in table]
    b = [("B", (vp - 1 - c) * pp + rank, mb) for mb, c in table]
    out = f[:warm]
    for k in range(total - warm):
        out += [f[warm + k], b[k]]
    return out + b[total - warm:]


@pytest.mark.parametrize("pp,vp,m,g", [
    (2, 2, 2, 2), (2, 2, 4, 2), (2, 3, 6, 3), (4, 2, 4, 4), (4, 2, 8, 4), (4, 2, 8, 8), (4, 3, 12, 4),
    (4, 4, 16, 6), (8, 4, 16, 8), (8, 2, 24, 12), (3, 2, 7, 4), (4, 2, 10, 5), (2, 4, 5, 3), (2, 4, 5, 5),
])
def test_interleaved_matches_megatron_core(pp, vp, m, g):
    sched = pytest.importorskip("megatron.core.pipeline_parallel.schedules")
    assert megatron_schedule_table(m, vp, g) == sched.get_schedule_table(m, vp, g)
    s = build("interleaved-1f1b", pp, vp, m, group_size=g)
    for r in range(pp):
        assert [(a.op.value, a.stage, a.microbatch) for a in s.ranks[r]] == _megatron_order(pp, r, vp, m, g)
        assert interleaved_warmup(pp, r, vp, m, g) == min((pp - r - 1) * 2 + (vp - 1) * g, m * vp)
    validate(lower(s, 3))


def test_interleaved_warmup_matches_megatron_function():
    sched = pytest.importorskip("megatron.core.pipeline_parallel.schedules")
    from megatron.core import parallel_state

    for pp, vp, m, g in [(4, 2, 8, 4), (2, 3, 6, 2), (8, 4, 32, 8)]:
        for r in range(pp):
            orig = (parallel_state.get_pipeline_model_parallel_world_size,
                    parallel_state.get_pipeline_model_parallel_rank,
                    parallel_state.get_virtual_pipeline_model_parallel_world_size)
            try:
                parallel_state.get_pipeline_model_parallel_world_size = lambda: pp
                parallel_state.get_pipeline_model_parallel_rank = lambda: r
                parallel_state.get_virtual_pipeline_model_parallel_world_size = lambda: vp
                _, _, warm, _ = sched.get_pp_rank_microbatches(m, vp, g)
            finally:
                (parallel_state.get_pipeline_model_parallel_world_size,
                 parallel_state.get_pipeline_model_parallel_rank,
                 parallel_state.get_virtual_pipeline_model_parallel_world_size) = orig
            assert interleaved_warmup(pp, r, vp, m, g) == warm


def test_one_f_one_b_order():
    s = build("1f1b", 4, 1, 6)
    assert [a.text for a in s.ranks[0]] == ["F0:0", "F0:1", "F0:2", "F0:3", "B0:0", "F0:4", "B0:1", "F0:5",
                                            "B0:2", "B0:3", "B0:4", "B0:5"]
    assert [a.text for a in s.ranks[3]][:4] == ["F3:0", "B3:0", "F3:1", "B3:1"]


@pytest.mark.parametrize("m", [8, 32])
def test_zero3_counts_breadth_first_constant_interleaved_grows(m):
    pp, vp = 8, 4
    bf = make_schedule("breadth-first", pp, vp, m, zero_stage=3)
    bf_small = make_schedule("breadth-first", pp, vp, pp, zero_stage=3)
    for r in range(pp):
        # The step boundary gathers the first stage once more, for the next iteration's first forward.
        assert [a.text for a in bf.step_tail(r) if a.op == Op.GATHER] == [f"GATHER{r}"]
        assert bf.count(r, Op.GATHER) <= 2 * vp
        assert bf.count(r, Op.GATHER) - 1 == 2 * vp - 2 == bf_small.count(r, Op.GATHER) - 1
        assert bf.count(r, Op.REDUCE) == vp == bf_small.count(r, Op.REDUCE)
    df_small = make_schedule("interleaved-1f1b", pp, vp, pp, zero_stage=3)
    df_big = make_schedule("interleaved-1f1b", pp, vp, 4 * pp, zero_stage=3)
    for r in range(pp):
        assert df_big.count(r, Op.GATHER) > df_small.count(r, Op.GATHER)
        assert df_big.count(r, Op.REDUCE) > df_small.count(r, Op.REDUCE)
        assert df_big.count(r, Op.GATHER) > 2 * vp


def test_zero3_prefetch_gathers_next_stage_before_current_compute():
    s = make_schedule("breadth-first", 2, 3, 4, zero_stage=3)
    acts = s.ranks[1]
    first_f = {st: min(i for i, a in enumerate(acts) if a.op == Op.F and a.stage == st) for st in (1, 3, 5)}
    gathers = {a.stage: i for i, a in enumerate(acts) if a.op == Op.GATHER and a.stage in (3, 5)}
    # stage 3's gather is issued before stage 1's first forward; stage 5's before stage 3's first compute.
    assert gathers[3] < first_f[1] and gathers[5] < first_f[3]


def test_zero_stage_1_reduces_once_per_step_with_groups():
    s = make_schedule("breadth-first", 2, 2, 8, group_size=2, zero_stage=1)
    z2 = make_schedule("breadth-first", 2, 2, 8, group_size=2, zero_stage=2)
    for r in range(2):
        assert s.count(r, Op.REDUCE) == 2
        # ZeRO-1's parameters are resident: all-gathered only at the step boundary, each after its STEP.
        assert [a.text for a in s.step_tail(r)] == [f"STEP{r}", f"GATHER{r}", f"STEP{r + 2}", f"GATHER{r + 2}"]
        assert z2.count(r, Op.REDUCE) == 2 * 4  # once per stage per group


@pytest.mark.parametrize("args,needle", [
    (("interleaved-1f1b", 4, 1, 8, None), "--vp"),
    (("interleaved-1f1b", 4, 2, 2, None), "at least P=4"),
    (("interleaved-1f1b", 4, 2, 8, 3), "--group-size"),
    (("interleaved-1f1b", 4, 2, 10, 8), "last group of 2"),
    (("breadth-first", 2, 2, 4, 5), "--group-size"),
    (("breadth-first", 2, 1, 4, None), "--vp"),
    (("gpipe", 2, 2, 4, None), "V = 1"),
    (("nope", 2, 2, 4, None), "unknown"),
    (("1f1b", 0, 1, 4, None), "--pp"),
])
def test_bad_configurations(args, needle):
    with pytest.raises(ScheduleError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        build(*args)


def test_validation_catches_errors():
    s = lower(build("breadth-first", 2, 2, 4))
    broken = Schedule(**{**s.__dict__, "ranks": [list(s.ranks[0]), list(s.ranks[1])]})
    broken.ranks[0].remove(Action(Op.F, 2, 3))
    with pytest.raises(ScheduleError, match="rank 0: F2:3 is missing"):
        validate(broken)
    # Swap the order of two sends: the receiving rank expects them the other way round.
    swapped = Schedule(**{**s.__dict__, "ranks": [list(s.ranks[0]), list(s.ranks[1])]})
    i = swapped.ranks[0].index(Action(Op.SEND_F, 0, 0))
    j = swapped.ranks[0].index(Action(Op.SEND_F, 0, 1))
    swapped.ranks[0][i], swapped.ranks[0][j] = swapped.ranks[0][j], swapped.ranks[0][i]
    with pytest.raises(ScheduleError, match="channel rank 0 -> rank 1"):
        validate(swapped)
    # A rank that waits for a gradient before sending the activation that produces it: deadlock.
    dead = Schedule(**{**s.__dict__, "ranks": [list(s.ranks[0]), list(s.ranks[1])]})
    r1 = dead.ranks[1]
    k = r1.index(Action(Op.SEND_B, 1, 0))
    r1.insert(0, r1.pop(k))
    with pytest.raises(ScheduleError, match="deadlock: .*rank 1 step 0 waits at SEND_B1:0"):
        simulate_order(dead)


@settings(max_examples=150, deadline=None)
@given(pp=st.integers(1, 6), vp=st.integers(1, 4), m=st.integers(1, 16), gfrac=st.floats(0, 1),
       name=st.sampled_from(list(SCHEDULE_NAMES)),
       zero=st.sampled_from([None, 1, 2, 3]), nw=st.integers(1, 3), ng=st.integers(1, 3), fo=st.booleans())
def test_property_every_built_and_lowered_schedule_validates(pp, vp, m, gfrac, name, zero, nw, ng, fo):
    if name in ("gpipe", "1f1b", "zb-h1"):
        vp, g = 1, None
        if name == "zb-h1" and m % max(1, m // pp):
            return
    elif name == "interleaved-zb":
        g = None
        if vp < 2 or m % max(1, m // pp):
            return
    elif name == "interleaved-1f1b":
        if vp < 2 or m < pp:
            return
        g = pp + int(gfrac * (m - pp))
        if 0 < m % g < pp:
            return
    else:
        if vp < 2:
            return
        g = 1 + int(gfrac * (m - 1))
    s = build(name, pp, vp, m, g, forward_only=fo)
    validate(s)
    lowered = lower(s, zero, nw, ng)
    validate(lowered)
    assert [a for a in lowered.ranks[0] if a.op in COMPUTE_OPS] == s.ranks[0]
    if zero == 3:
        for r in range(pp):
            assert lowered.count(r, Op.GATHER) == lowered.count(r, Op.RELEASE) + (0 if fo else 1)


def test_cli_json_contract_and_errors(subprocesses):
    out = subprocess.run([sys.executable, "-m", "megatron_bfpp.cli", "schedule", "--schedule", "breadth-first",
                          "--pp", "2", "--vp", "2", "--microbatches", "4", "--zero-stage", "3", "--format", "json"],
                         capture_output=True, text=True, check=True).stdout
    d = json.loads(out)
    assert set(d) == {"schedule", "pp", "vp", "microbatches", "group_size", "zero_stage", "ranks",
                      "peak_activations"}
    assert (d["pp"], d["vp"], d["microbatches"], d["group_size"], d["zero_stage"]) == (2, 2, 4, 4, 3)
    assert d["peak_activations"] == [8, 8]
    gathers = [a for a in d["ranks"][0] if a["op"] == "GATHER"]
    assert gathers and all(a["microbatch"] is None for a in gathers)
    plain = json.loads(subprocess.run(
        [sys.executable, "-m", "megatron_bfpp.cli", "schedule", "--schedule", "1f1b", "--pp", "2",
         "--microbatches", "3", "--format", "json"], capture_output=True, text=True, check=True).stdout)
    assert {a["op"] for acts in plain["ranks"] for a in acts} == {"F", "B"}
    bad = subprocess.run([sys.executable, "-m", "megatron_bfpp.cli", "schedule", "--schedule", "interleaved-1f1b",
                          "--pp", "4", "--vp", "2", "--microbatches", "2"], capture_output=True, text=True)
    assert bad.returncode != 0
    assert len(bad.stderr.strip().splitlines()) == 1 and "micro-batches" in bad.stderr


def _layouts(name: str, pp: int):
    """(V, M, group size) for one builder at one P: M below, at and above P, several group sizes."""
    vps = (1,) if name in ("gpipe", "1f1b", "zb-h1") else (2, 3, 4) if pp < 8 else (2, 4)
    for vp in vps:
        for m in sorted({1, pp - 1, pp, 2 * pp + 1}):
            if m < 1:
                continue
            groups = {None}
            if name in ("breadth-first", "breadth-first-zb"):
                groups |= {2, max(1, m // 2)}
            elif name == "interleaved-1f1b":
                groups |= {g for g in (pp + 1, m) if g >= pp and not 0 < m % g < pp}
            for g in groups:
                yield vp, m, g


@pytest.mark.parametrize("zero", [None, 3])
@pytest.mark.parametrize("name", SCHEDULE_NAMES)
@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_every_layout_posts_an_nccl_safe_order(name, pp, zero):
    """Every builder x P x V x M (M < P too) x group size lowers to an order that completes under NCCL's
    rendezvous semantics, per communicator and with one queue per rank, without ZeRO actions and with ZeRO-3's
    (one case each: a test's CPU budget)."""
    checked = 0
    for vp, m, g in _layouts(name, pp):
        for forward_only in (False, True):
            try:  # make_schedule validates the lowered order under gloo and both NCCL models
                make_schedule(name, pp, vp, m, g, zero_stage=zero, forward_only=forward_only)
            except ScheduleError as e:  # configurations the builder refuses (not orders it cannot post)
                assert "deadlock" not in str(e), (name, pp, vp, m, g, zero, forward_only, e)
                continue
            checked += 1
    assert checked > 0


def _receives_preposted(s: Schedule) -> Schedule:
    """The posting order of the earlier runtime: each compute's receives posted ahead of the compute before it."""
    ranks = []
    for acts in _compute_only_lowering(s).ranks:
        out: list = []
        for a in acts:
            if a.op in (Op.RECV_F, Op.RECV_B):
                prev = max((i for i, b in enumerate(out) if b.op in (Op.F, Op.B)), default=len(out))
                out.insert(prev, a)
            else:
                out.append(a)
        ranks.append(out)
    return Schedule(s.name, s.pp, s.vp, s.microbatches, s.group_size, ranks, lowered=True)


def test_earlier_posting_order_is_rejected_at_p2():
    """Interleaved 1F1B at P = 2 with receives posted ahead of earlier sends: rank 0 posts
    `SEND_F0:0 RECV_F2:0 SEND_F0:1`, rank 1 `RECV_F1:0 RECV_F1:1 SEND_F1:0`: a cycle on one communicator."""
    old = _receives_preposted(build("interleaved-1f1b", 2, 2, 4))
    simulate_order(old)  # gloo buffers sends: it completes there
    with pytest.raises(ScheduleError, match=r"deadlock under NCCL semantics \(one queue per communicator\)") as e:
        simulate_nccl(old)
    msg = str(e.value)
    assert "rank 0 step" in msg and "rank 1 step" in msg and "'activations'" in msg and "cycle" in msg
    with pytest.raises(ScheduleError, match="deadlock"):
        validate(old)


def test_sends_right_after_their_compute_deadlock_with_one_queue_per_rank():
    """Breadth-first P = 4, V = 3, M = 16 with each send right after its compute: with
    CUDA_DEVICE_MAX_CONNECTIONS=1 rank 0's stage-0 sends block the wrap-around receive from rank 3 (this order
    deadlocks per communicator too; the test below has one that deadlocks with one queue per rank only)."""
    naive = _compute_only_lowering(build("breadth-first", 4, 3, 16))
    simulate_order(naive)
    with pytest.raises(ScheduleError, match=r"one queue per rank.*cycle") as e:
        simulate_nccl(naive, single_queue=True)
    assert "rank 3" in str(e.value) and "rank 0" in str(e.value)
    simulate_nccl(make_schedule("breadth-first", 4, 3, 16), single_queue=True)


def test_validate_refuses_an_order_that_deadlocks_only_with_one_queue_per_rank():
    """Rank 0 sends micro-batch 1's activation before receiving micro-batch 0's gradient; rank 1 sends that
    gradient before receiving the activation. gloo buffers the sends and NCCL with one queue per communicator
    runs activations and gradients apart: both complete. With CUDA_DEVICE_MAX_CONNECTIONS=1 each rank's queue
    blocks at its send, waiting for a receive queued behind the other rank's send: `validate` must refuse it."""
    s = Schedule.from_text("""# schedule=1f1b pp=2 vp=1 microbatches=2 lowered=1
        rank 0: F0:0 SEND_F0:0 F0:1 SEND_F0:1 RECV_B0:0 B0:0 RECV_B0:1 B0:1
        rank 1: RECV_F1:0 F1:0 B1:0 SEND_B1:0 RECV_F1:1 F1:1 B1:1 SEND_B1:1""")
    simulate_order(s)
    simulate_nccl(s, single_queue=False)
    with pytest.raises(ScheduleError, match=r"one queue per rank.*SEND_F0:1 waits for rank 1 to post RECV_F1:1"):
        validate(s)


def test_batches_are_consecutive_on_one_communicator_in_json():
    d = json.loads(to_json(make_schedule("interleaved-1f1b", 2, 2, 4, zero_stage=3)))
    batched = 0
    for acts in d["ranks"]:
        positions: dict = {}
        for i, a in enumerate(acts):
            if a["op"] in ("SEND_F", "RECV_F", "SEND_B", "RECV_B"):
                assert "batch" in a
                if a["batch"] is not None:
                    positions.setdefault(a["batch"], []).append(i)
            else:
                assert "batch" not in a
        for pos in positions.values():
            assert pos == list(range(pos[0], pos[0] + len(pos))) and len(pos) >= 2
            kinds = {acts[i]["op"][-1] for i in pos}
            assert len(kinds) == 1  # one communicator: all activations (F) or all gradients (B)
            batched += 1
    assert batched > 0
    # A batch split by another action is refused.
    s = make_schedule("interleaved-1f1b", 2, 2, 4)
    acts = s.ranks[0]
    i = next(k for k, a in enumerate(acts) if a.batch is not None)
    broken = acts[:i + 1] + [acts[i + 2], acts[i + 1]] + acts[i + 3:]
    with pytest.raises(ScheduleError):
        validate(Schedule(s.name, 2, 2, 4, s.group_size, [broken, s.ranks[1]], lowered=True))


def _torch_zero_bubble_order(pp: int, vp: int, m: int) -> list[list[str]]:
    """F/I/W order per rank of torch.distributed.pipelining's own ScheduleInterleavedZeroBubble."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble, _ComputationType

    rounds = max(1, m // pp)
    fake = SimpleNamespace(n_local_stages=vp, pp_group_size=pp, _n_microbatches=m,
                           microbatches_per_round=m // rounds)
    names = {_ComputationType.FORWARD: "F", _ComputationType.BACKWARD_INPUT: "I",
             _ComputationType.BACKWARD_WEIGHT: "W"}
    return [[f"{names[a.computation_type]}{a.stage_index}:{a.microbatch_index}"
             for a in ScheduleInterleavedZeroBubble._calculate_single_rank_operations(fake, r) if a is not None]
            for r in range(pp)]


@pytest.mark.parametrize("pp,vp,m", [(2, 2, 2), (2, 2, 4), (2, 3, 6), (4, 2, 4), (4, 2, 8), (4, 3, 12), (3, 2, 9),
                                     (4, 2, 2), (8, 2, 8), (8, 4, 16), (2, 4, 8), (4, 1, 8), (2, 1, 6),
                                     (2, 3, 1), (4, 3, 3), (4, 1, 2)])
def test_zero_bubble_order_equals_torch_pipelining(pp, vp, m):
    name = "zb-h1" if vp == 1 else "interleaved-zb"
    ours = [[a.text for a in acts] for acts in build(name, pp, vp, m).ranks]
    assert ours == _torch_zero_bubble_order(pp, vp, m)
    validate(make_schedule(name, pp, vp, m, zero_stage=3))


def test_split_backward_validation():
    s = build("breadth-first-zb", 2, 2, 2)
    validate(s)
    r0 = s.ranks[0]
    w = next(i for i, a in enumerate(r0) if a.op == Op.W)
    i_ = next(i for i, a in enumerate(r0) if a.op == Op.I and a.stage == r0[w].stage and a.microbatch == r0[w].microbatch)
    swapped = list(r0)
    swapped[w], swapped[i_] = swapped[i_], swapped[w]
    with pytest.raises(ScheduleError, match="runs before"):
        validate(Schedule(s.name, 2, 2, 2, s.group_size, [swapped, s.ranks[1]]))
    no_w = [a for a in r0 if a != r0[w]]
    with pytest.raises(ScheduleError, match="misses its W"):
        validate(Schedule(s.name, 2, 2, 2, s.group_size, [no_w, s.ranks[1]]))
    both = r0 + [Action(Op.B, r0[w].stage, r0[w].microbatch)]
    with pytest.raises(ScheduleError, match="both B and"):
        validate(Schedule(s.name, 2, 2, 2, s.group_size, [both, s.ranks[1]]))


@pytest.mark.parametrize("name,vp", [("breadth-first-zb", 3), ("interleaved-zb", 2), ("zb-h1", 1)])
def test_split_backward_reduce_follows_last_w_and_w_fills_bubbles(name, vp):
    from megatron_bfpp.schedule import peak_pending_weight_grads

    for m in (2, 4, 8):
        s = make_schedule(name, 4, vp, m, zero_stage=2)
        for r, acts in enumerate(s.ranks):
            for st in s.stages_of(r):
                last_w = max(i for i, a in enumerate(acts) if a.op == Op.W and a.stage == st)
                assert any(a.op == Op.REDUCE and a.stage == st and i > last_w for i, a in enumerate(acts))
        assert max(peak_pending_weight_grads(s)) >= 1
    # Breadth-first with W deferral at M < P: the W's fill backward-phase gaps, so with unit costs its step is
    # shorter than plain breadth-first's.
    if name == "breadth-first-zb":
        from megatron_bfpp.trace.inputs import simulated_unit_timeline
        from megatron_bfpp.trace.metrics import iteration_metrics

        bf = iteration_metrics(simulated_unit_timeline(make_schedule("breadth-first", 8, vp, 2), 1.0, 2.0))
        zb = iteration_metrics(simulated_unit_timeline(make_schedule("breadth-first-zb", 8, vp, 2), 1.0, 2.0))
        assert zb.step_time_s < bf.step_time_s


@pytest.mark.parametrize("name,vp,pp,m", [
    (name, vp, pp, m) for name, vp in (("breadth-first-zb", 3), ("interleaved-zb", 3), ("zb-h1", 1))
    for pp, m in ((2, 2), (4, 2), (4, 8)) if name != "interleaved-zb" or m % pp == 0  # its rounds are P wide
])
def test_zero3_releases_before_ws_that_read_no_weights(name, vp, pp, m):
    """With W = deferred weight GEMMs (kept activations only), ZeRO-3 releases a stage after its last F/B/I: no
    RELEASE waits for a W, every F/I still runs gathered, buffers stay bounded, and the flag survives the text
    and JSON forms. Reading weights in W (the default) keeps every W gathered."""
    from megatron_bfpp.schedule.formats import from_json, to_json

    needs, free = (make_schedule(name, pp, vp, m, zero_stage=3, w_needs_weights=x) for x in (True, False))
    assert needs.w_needs_weights and not free.w_needs_weights
    earlier = 0
    for s in (needs, free):
        for r, acts in enumerate(s.ranks):
            held: set[int] = set()
            for i, a in enumerate(acts):
                if a.op == Op.GATHER:
                    held.add(a.stage)
                elif a.op == Op.RELEASE:
                    held.discard(a.stage)
                    if s is free:  # nothing that reads the weights follows, up to the next GATHER of the stage
                        nxt = next((j for j in range(i + 1, len(acts)) if acts[j].op == Op.GATHER
                                    and acts[j].stage == a.stage), len(acts))
                        assert not any(b.op in (Op.F, Op.B, Op.I) and b.stage == a.stage for b in acts[i + 1:nxt])
                        earlier += any(b.op == Op.W and b.stage == a.stage for b in acts[i + 1:nxt])
                elif a.op in COMPUTE_OPS and (s is needs or a.op != Op.W):
                    assert a.stage in held, (r, i, a.text)
                assert len(held) <= s.weight_buffers
    if vp > free.weight_buffers:  # stages are evicted during the step: some W's run after their RELEASE
        assert earlier > 0
    assert Schedule.from_text(free.to_text()).w_needs_weights is False
    assert from_json(to_json(free)).w_needs_weights is False
    assert "w_needs_weights" not in json.loads(to_json(needs))  # the default keeps the JSON contract's fields
    if earlier:  # validation knows the difference: that order is invalid for a W that reads weights
        with pytest.raises(ScheduleError, match="without its parameters gathered"):
            validate(dataclasses.replace(free, w_needs_weights=True))


def _live_grad_buffers(acts: list, writers: frozenset) -> int:
    """Peak number of stages holding a full gradient buffer: taken at a stage's first writer op after its last
    REDUCE (the runtime allocates there), given back at its REDUCE."""
    live: set[int] = set()
    peak = 0
    for a in acts:
        if a.op in writers:
            live.add(a.stage)
        elif a.op == Op.REDUCE:
            live.discard(a.stage)
        peak = max(peak, len(live))
    return peak


LOOPED_LAYOUTS = ((2, 2, 4, None), (4, 3, 8, None), (4, 4, 4, None), (4, 3, 8, 4), (4, 2, 2, None))


@pytest.mark.parametrize("name,pp,vp,m,g", [
    *[("breadth-first-zb", *layout) for layout in LOOPED_LAYOUTS],
    *[("interleaved-zb", pp, vp, m, g) for pp, vp, m, g in LOOPED_LAYOUTS if m % pp == 0 and g is None],
    *[("zb-h1", pp, 1, m, None) for pp, m in ((2, 4), (4, 8), (4, 2))],
])
@pytest.mark.parametrize("grad_buffers", [1, 2])
def test_i_writes_grads_holds_the_gradient_buffer_from_the_first_i(name, pp, vp, m, g, grad_buffers):
    """Gradient-accumulation fusion writes main_grad inside the I: lowered with i_writes_grads, ZeRO-2/3 keep
    at most `grad_buffers` stages' buffers live counting I's as writers, every stage is reduced after its last
    I and W, and the flag survives the text and JSON forms."""
    from megatron_bfpp.schedule.formats import from_json, to_json

    for zero in (2, 3):
        fused = make_schedule(name, pp, vp, m, g, zero_stage=zero, grad_buffers=grad_buffers,
                              w_needs_weights=False, i_writes_grads=True)
        assert fused.grad_write_ops == {Op.B, Op.I, Op.W}
        for r, acts in enumerate(fused.ranks):
            assert _live_grad_buffers(acts, fused.grad_write_ops) <= grad_buffers, (zero, r)
            for s in fused.stages_of(r):
                last_write = max(i for i, a in enumerate(acts) if a.op in (Op.I, Op.W) and a.stage == s)
                assert any(a.op == Op.REDUCE and a.stage == s for a in acts[last_write:]), (zero, r, s)
        assert Schedule.from_text(fused.to_text()).i_writes_grads is True
        assert from_json(to_json(fused)).i_writes_grads is True
    plain = make_schedule(name, pp, vp, m, g, zero_stage=3, grad_buffers=grad_buffers, w_needs_weights=False)
    assert not plain.i_writes_grads and "i_writes_grads" not in json.loads(to_json(plain))
    assert all(_live_grad_buffers(acts, plain.grad_write_ops) <= grad_buffers for acts in plain.ranks)


def test_without_i_writes_grads_an_i_may_run_outside_its_gradient_buffer():
    """The flag matters: lowered for W-only writers, I's run where their stage holds no buffer (with one buffer
    and two stages per rank), which fused layers would write into freed memory."""
    plain = make_schedule("breadth-first-zb", 2, 2, 4, zero_stage=2, grad_buffers=1, w_needs_weights=False)
    assert any(_live_grad_buffers(acts, frozenset({Op.B, Op.I, Op.W})) > 1 for acts in plain.ranks)


def _moved_after(s: Schedule, rank: int, x: str, y: str) -> Schedule:
    """`s` with action `x` of `rank` (text form) moved to right after action `y`."""
    acts = list(s.ranks[rank])
    moved = acts.pop(acts.index(Action.parse(x)))
    acts.insert(acts.index(Action.parse(y)) + 1, moved)
    return dataclasses.replace(s, ranks=[acts if r == rank else list(a) for r, a in enumerate(s.ranks)])


@pytest.mark.parametrize("name, rank, x, y, first", [
    ("breadth-first", 0, "F2:0", "F2:1", "forward"),
    ("1f1b", 1, "B1:0", "B1:1", "backward (B or I)"),
    ("breadth-first-zb", 0, "I2:0", "I2:1", "backward (B or I)"),
    ("breadth-first-zb", 0, "W2:0", "W2:1", "weight-gradient pass (B or W)"),
    ("interleaved-zb", 0, "W0:0", "W0:1", "weight-gradient pass (B or W)"),
])
def test_validation_requires_micro_batch_0_first_in_each_stage(name: str, rank: int, x: str, y: str,
                                                               first: str) -> None:
    """TransformerEngine re-quantizes a layer's FP8 weights in the forward of micro-batch 0 (is_first_microbatch)
    and overwrites, instead of accumulating, the fused weight gradient in its backward: each stage must run
    micro-batch 0 first in F, in B/I and in B/W. An order otherwise sound (dependencies, p2p) is refused."""
    vp = 1 if name == "1f1b" else 2
    s = build(name, 2, vp, 4)
    validate(s)
    broken = _moved_after(s, rank, x, y)
    stage = Action.parse(x).stage
    with pytest.raises(ScheduleError, match=rf"rank {rank} step \d+: {y} is stage {stage}'s first {re.escape(first)}, "
                                            rf"before micro-batch 0 \(.*is_first_microbatch"):
        validate(broken)


def test_forward_only_needs_micro_batch_0_first_too() -> None:
    s = build("breadth-first", 2, 2, 4, forward_only=True)
    with pytest.raises(ScheduleError, match="F0:1 is stage 0's first forward"):
        validate(_moved_after(s, 0, "F0:0", "F0:1"))


@pytest.mark.parametrize("name, vp", [("breadth-first", 2), ("interleaved-1f1b", 2), ("breadth-first-zb", 2),
                                      ("1f1b", 1)])
def test_last_releases_are_each_stages_release_after_its_last_compute(name: str, vp: int) -> None:
    s = make_schedule(name, 2, vp, 4, zero_stage=3)
    for r in range(2):
        acts = s.ranks[r]
        last = s.last_releases(r)
        assert sorted(acts[i].stage for i in last) == s.stages_of(r)
        for i in last:
            assert acts[i].op == Op.RELEASE
            assert not any(a.op in COMPUTE_OPS and a.stage == acts[i].stage for a in acts[i + 1:])
            assert not any(a.op == Op.RELEASE and a.stage == acts[i].stage for a in acts[i + 1:])
