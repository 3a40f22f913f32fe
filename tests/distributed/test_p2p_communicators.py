"""Both ends of every pipeline transfer run it on one NCCL communicator, and the channel groups get fresh NCCL
options.

Under NCCL's lazy initialisation torch runs a lone isend/irecv on a 2-rank communicator of the pair and a
batch_isend_irecv on the group's own (`tests.support.strict_p2p.nccl_communicator`); the lowering batches per
rank, so a transfer can be a batch on one end and alone on the other. The runtime posts every post coalesced
(`runtime.p2p.PipelineP2P.post`); these tests check that over every schedule's JSON form, and on gloo under strict
mode, which records what the runtime hands to torch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from megatron_bfpp.runtime import p2p
from megatron_bfpp.schedule import SCHEDULE_NAMES, ScheduleError, build, lower, to_json
from tests.support import toy_pipeline as toy
from tests.support.distributed import run_distributed
from tests.support.strict_p2p import nccl_communicator, strict_p2p

P2P = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
DEFAULT_COMM = {"SEND_F": "activations", "RECV_F": "activations", "SEND_B": "gradients", "RECV_B": "gradients"}


def _transfer_ends(d: dict, lone_ops_alone: bool = False) -> dict[tuple[str, int, int], list[str]]:
    """From a schedule's JSON form: each transfer (kind, producing stage, micro-batch) -> the communicator each end
    runs it on, when each rank posts its actions as the runtime does (one post per action, or per run of
    consecutive actions with one `batch` value), each post one batch_isend_irecv; with `lone_ops_alone`, a post of
    one op as an isend/irecv of its own instead (the runtime's former rule)."""
    pp, num_stages = d["pp"], d["pp"] * d["vp"]
    ends: dict[tuple[str, int, int], list[str]] = {}
    for rank, acts in enumerate(d["ranks"]):
        i = 0
        while i < len(acts):
            if acts[i]["op"] not in P2P:
                i += 1
                continue
            j = i + 1
            while acts[i].get("batch") is not None and j < len(acts) and acts[j].get("batch") == acts[i]["batch"]:
                j += 1
            for a in acts[i:j]:
                op, s, m = a["op"], a["stage"], a["microbatch"]
                producer = {"SEND_F": s, "RECV_F": s - 1, "SEND_B": s, "RECV_B": s + 1}[op]
                consumer = producer + 1 if op.endswith("F") else producer - 1
                assert 0 <= producer < num_stages and 0 <= consumer < num_stages
                peer = (consumer if op.startswith("SEND") else producer) % pp
                coalesced = not (lone_ops_alone and j - i == 1)
                comm = nccl_communicator(a.get("channel") or DEFAULT_COMM[op], rank, peer, coalesced)
                ends.setdefault((op[-1], producer, m), []).append(comm)
            i = j
    return ends


def _layouts(name: str, pp: int):
    vps = (1,) if name in ("gpipe", "1f1b", "zb-h1") else (2, 3, 4)
    for vp in vps:
        for m in sorted({1, pp - 1, pp, 2 * pp + 1} - {0}):
            yield vp, m


def _mismatches(d: dict, lone_ops_alone: bool = False) -> list:
    ends = _transfer_ends(d, lone_ops_alone)
    assert ends and all(len(e) == 2 for e in ends.values())  # one send and one receive per transfer
    return [(t, e) for t, e in ends.items() if e[0] != e[1]]


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_every_transfer_uses_one_communicator_on_both_ends(name):
    """Every builder x P <= 8 x V x M (below, at and above P), training and forward-only: the JSON form of
    `bfpp schedule --lowered` (its lowering, without the validation the command adds) posted as the runtime
    posts it puts both ends of each transfer on one communicator."""
    checked = 0
    for pp in range(2, 9):
        for vp, m in _layouts(name, pp):
            for forward_only in (False, True):
                try:
                    s = lower(build(name, pp, vp, m, None, forward_only))
                except ScheduleError:  # a configuration the builder refuses
                    continue
                d = json.loads(to_json(s))
                assert _mismatches(d) == [], (name, pp, vp, m, forward_only)
                checked += 1
    assert checked >= 7 * 3


def test_a_lone_op_meeting_a_batch_is_seen(subprocesses):
    """The check above can fail: posting lone ops alone (the runtime before every post was coalesced) puts
    1F1B P = 4 M = 8's `SEND_F0:1` (alone on rank 0) and `RECV_F1:1` (batched on rank 1) on different
    communicators. The JSON comes from the `bfpp schedule` command itself."""
    out = subprocess.run([sys.executable, "-m", "megatron_bfpp.cli", "schedule", "--schedule", "1f1b", "--pp", "4",
                          "--microbatches", "8", "--lowered", "--format", "json"], capture_output=True, text=True, check=True)
    d = json.loads(out.stdout)
    assert _mismatches(d) == []
    bad = dict(_mismatches(d, lone_ops_alone=True))
    assert bad[("F", 0, 1)] == ["activations[0:1]", "activations"]


def _lone_meets_batch(link: p2p.PipelineP2P, rank: int, prefix: str) -> str:
    """Rank 0 posts a send and then a receive, one op per post; rank 1 posts the matching receive and send as one
    batch. On gloo all of it completes; strict mode must see whether NCCL would run both ends on one
    communicator."""
    if rank == 0:
        posts = [[link.send_op(torch.ones(2), 1, "activations")], [link.recv_op((2,), torch.float32, 1, "activations")]]
    else:
        posts = [[link.recv_op((2,), torch.float32, 0, "activations"), link.send_op(torch.ones(2), 0, "activations")]]
    result, done = "completed", 0
    with strict_p2p(timeout_s=3, prefix=prefix, p2p_class=type(link)):
        try:
            for ops in posts:
                done += 1
                link.post(ops)
        except TimeoutError as e:
            result = str(e)
    for ops in posts[done:]:  # complete the exchange, so that no transfer is left pending
        link.post(ops)
    for ops in posts:
        for _, pending in ops:
            pending.work.wait()
    return result


class _LoneOpsAlone(p2p.PipelineP2P):
    """The runtime's former rule: a post of one op is an isend/irecv of its own, outside a coalescing group."""

    def post(self, ops: list) -> None:
        if len(ops) > 1:
            super().post(ops)
            return
        (op, pending), = ops
        pending.work = op.op(op.tensor, op.peer, group=op.group)


def _lone_meets_batch_worker(rank: int, world: int) -> tuple[str, str]:
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    pp_group = dist.new_group([0, 1])
    now = _lone_meets_batch(p2p.PipelineP2P(pp_group, torch.device("cpu")), rank, "now")
    return now, _lone_meets_batch(_LoneOpsAlone(pp_group, torch.device("cpu")), rank, "before")


@pytest.mark.timeout(300)
def test_strict_mode_matches_partners_by_communicator(run_distributed):
    (now0, before0), (now1, before1) = run_distributed(_lone_meets_batch_worker, 2)
    assert now0 == now1 == "completed"
    # Under the former rule both wait on a communicator the other end never uses.
    assert "not posted" in before0 and "before/activations[0:1]/0->1/0/recv" in before0, before0
    assert "not posted" in before1 and "before/activations/0->1/0/send" in before1, before1


def _one_f_one_b_worker(rank: int, world: int, m: int) -> tuple:
    import torch.distributed as dist

    from megatron_bfpp.runtime import get_forward_backward_func, set_wait_timeout

    dist.init_process_group("gloo", rank=rank, world_size=world)
    set_wait_timeout(60)
    pg = SimpleNamespace(pp=dist.new_group(list(range(world))), dp=None)
    chunk = toy.ToyStage(toy.make_config(), rank, world)
    with strict_p2p(timeout_s=15):
        store = get_forward_backward_func("1f1b")(
            forward_step_func=toy.forward_step, data_iterator=[iter(toy.make_batches(m))], model=[chunk],
            num_microbatches=m, seq_length=toy.SEQ, micro_batch_size=toy.MBS, pg_collection=pg)
    return ([float(d["lm loss"][0] / d["lm loss"][1]) for d in store],
            chunk.linear.weight.grad.clone(), chunk.linear.bias.grad.clone())


@pytest.mark.timeout(300)
def test_1f1b_p4_runs_under_strict_mode(run_distributed):
    """1F1B P = 4 M = 8 (lone sends on rank 0 meet batches on rank 1) completes under strict mode on 4 gloo
    processes with the single-process reference's losses and gradients."""
    m = 8
    per_rank = run_distributed(_one_f_one_b_worker, 4, m)
    ref_losses, ref_grads = toy.reference(4, toy.make_batches(m))
    assert per_rank[3][0] == pytest.approx(ref_losses, rel=1e-6)
    for r, (_, w, b) in enumerate(per_rank):
        torch.testing.assert_close(w, ref_grads[r][0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(b, ref_grads[r][1], rtol=1e-5, atol=1e-6)


class _FakeConfig:
    """torch 2.14's ProcessGroupNCCL.NCCLConfig fields; unset ones are NCCL_CONFIG_UNDEF_INT / None."""

    def __init__(self) -> None:
        for field in p2p.NCCL_CONFIG_FIELDS + ("blocking", "split_share"):
            setattr(self, field, -2147483648)
        self.net_name = self.comm_name = None


class _FakeOptions:
    def __init__(self, is_high_priority_stream: bool = False) -> None:
        self.is_high_priority_stream = is_high_priority_stream
        self.config = _FakeConfig()
        self.group_name, self.global_ranks_in_group = "", []


def test_channel_groups_get_fresh_nccl_options():
    """The pipeline group's options (as Megatron's --nccl-communicator-config-path sets them) are copied into a
    new object: torch writes each new group's name, ranks and timeout into the object it is given."""
    live = _FakeOptions(is_high_priority_stream=True)
    live.config.cga_cluster_size, live.config.max_ctas, live.config.min_ctas = 2, 16, 4
    live.config.net_name, live.config.comm_name, live.config.blocking = "IB", "pp-comm", 0
    live.group_name, live.global_ranks_in_group = "pp", [0, 1]
    fresh = p2p.fresh_nccl_options(live, _FakeOptions)
    assert fresh is not live and fresh.config is not live.config
    assert fresh.is_high_priority_stream
    assert (fresh.config.cga_cluster_size, fresh.config.max_ctas, fresh.config.min_ctas) == (2, 16, 4)
    assert fresh.config.net_name == "IB"
    assert fresh.config.comm_name is None and fresh.config.blocking == -2147483648
    assert (fresh.group_name, fresh.global_ranks_in_group) == ("", [])
    fresh.config.max_ctas = 8
    assert live.config.max_ctas == 16


@pytest.mark.skipif(not torch.distributed.is_nccl_available(), reason="torch built without NCCL")
def test_fresh_nccl_options_with_torchs_own_type():
    """The same copy with torch's ProcessGroupNCCL.Options: every listed field exists in this torch."""
    live = torch.distributed.ProcessGroupNCCL.Options(is_high_priority_stream=True)
    live.config.max_ctas, live.config.net_name = 16, "Socket"
    fresh = p2p.fresh_nccl_options(live)
    assert isinstance(fresh, torch.distributed.ProcessGroupNCCL.Options) and fresh is not live
    assert fresh.is_high_priority_stream and fresh.config.max_ctas == 16 and fresh.config.net_name == "Socket"
    assert all(hasattr(fresh.config, f) for f in p2p.NCCL_CONFIG_FIELDS)
