"""Measured timelines: a wait is never counted as compute.

Real multi-process runs of the runtime (gloo) with the action recorder on: compute intervals contain no wait
of their rank and receive waits name their sender; a sender that is late (it sleeps before posting a send)
shows up as its receiver's bubble, not as anybody's compute; and under ZeRO-3 at D = 2 (4 ranks), a
data-parallel replica that launches its collectives late shows up as the other replica's exposed
data-parallel wait, not as anybody's compute. (That the parts add up to the step time holds by construction
of `trace.metrics`: every instant goes to exactly one part; it is not tested here.)
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from tests.support import toy_pipeline as toy
from tests.support.distributed import run_distributed

DELAY_S = 0.5


def _recorded_worker(rank: int, world: int, name: str, vp: int, m: int, delay_send: str | None) -> dict:
    """This rank's recorded events, and where it slept before a send (wall-clock intervals, the recorder's
    clock)."""
    import torch.distributed as dist

    from megatron_bfpp.runtime import ActionRecorder, get_forward_backward_func, set_recorder
    from megatron_bfpp.runtime.p2p import PipelineP2P

    dist.init_process_group("gloo", rank=rank, world_size=world)
    pg = SimpleNamespace(pp=dist.new_group(list(range(world))), dp=None)
    cfg = toy.make_config()
    chunks = [toy.ToyStage(cfg, rank + c * world, world * vp) for c in range(vp)]
    fb = get_forward_backward_func(name)
    recorder = ActionRecorder(rank, use_cuda=False)
    set_recorder(recorder)
    original = PipelineP2P.post
    sleeps: list[tuple[float, float]] = []
    if delay_send is not None and rank == 0:
        def late_post(self, ops):  # the sender is slow (e.g. a straggling GPU) right before one send
            if any(op.op is dist.isend and op.tensor.data_ptr() == getattr(self, "_late", None) for op, _ in ops):
                start = time.time()
                time.sleep(DELAY_S)
                sleeps.append((start, time.time()))
            original(self, ops)
        PipelineP2P.post = late_post
    for iteration in range(2):  # the first iteration carries warm-up costs; both are recorded
        recorder.enabled, recorder.iteration = True, iteration
        if delay_send is not None and rank == 0 and iteration == 1:
            _arm_late_send(fb, chunks, delay_send)
        fb(forward_step_func=toy.forward_step, data_iterator=[iter(toy.make_batches(m)) for _ in chunks],
           model=chunks, num_microbatches=m, seq_length=toy.SEQ, micro_batch_size=toy.MBS, pg_collection=pg)
        recorder.flush()
    PipelineP2P.post = original
    set_recorder(None)
    return {"events": [e.to_dict() for e in recorder.events], "sleeps": sleeps}


def _arm_late_send(fb, chunks, send: str) -> None:
    """Mark the output tensor of the named SEND_F's forward as the one to delay (set once it exists)."""
    from megatron_bfpp.runtime import executor as ex

    stage, mb = (int(x) for x in send.removeprefix("SEND_F").split(":"))
    original = ex.ScheduleExecutor._do_F

    def do_f(self, a):
        original(self, a)
        if (a.stage, a.microbatch) == (stage, mb):
            self.p2p._late = self.outputs[(stage, mb)].contiguous().data_ptr()
            ex.ScheduleExecutor._do_F = original

    ex.ScheduleExecutor._do_F = do_f


def _metrics(events_per_rank, iteration=1):
    from megatron_bfpp.schedule.events import TimelineEvent
    from megatron_bfpp.trace.metrics import iteration_metrics

    events = [TimelineEvent.from_dict(e) for evs in events_per_rank for e in evs]
    return events, iteration_metrics(events, iteration)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,vp,m", [("breadth-first", 2, 8), ("interleaved-1f1b", 2, 8)])
def test_accounting_identity_on_a_four_process_run(run_distributed, name, vp, m):
    events, metrics = _metrics([run["events"] for run in run_distributed(_recorded_worker, 4, name, vp, m, None)])
    assert metrics.consistent, metrics.overlaps
    assert all(r.compute_s > 0 for r in metrics.ranks), metrics.ranks
    # No compute interval contains a wait of its own rank.
    for rank in range(4):
        computes = [e for e in events if e.rank == rank and e.stream == "compute" and e.op in ("F", "B")]
        waits = [e for e in events if e.rank == rank and e.op == "WAIT" and e.end > e.start]
        for w in waits:
            assert not any(c.start < w.start and w.end < c.end for c in computes), (w, rank)
    # Receive waits name their sender, whose send is in the timeline.
    recv_waits = [e for e in events if e.op == "WAIT" and e.name.startswith("wait RECV")]
    assert recv_waits and all(e.peer is not None for e in recv_waits)


@pytest.mark.timeout(300)
def test_a_late_sender_is_its_receivers_bubble_not_compute(run_distributed):
    """Rank 0 sleeps 0.5 s before posting SEND_F0:1 (gpipe-like breadth-first, P = 2): rank 1's wait for that
    activation is bubble; no rank's compute grows by the delay."""
    _, base = _metrics([run["events"] for run in run_distributed(_recorded_worker, 2, "breadth-first", 2, 4, None)])
    late_runs = run_distributed(_recorded_worker, 2, "breadth-first", 2, 4, "SEND_F0:1")
    late_events, late = _metrics([run["events"] for run in late_runs])
    r1_base, r1_late = base.ranks[1], late.ranks[1]
    assert r1_late.bubble_s - r1_base.bubble_s > 0.8 * DELAY_S, (r1_base, r1_late)
    assert r1_late.exposed_p2p_wait_s < r1_base.exposed_p2p_wait_s + 0.2 * DELAY_S
    # Rank 0 slept once, outside every compute interval of its own.
    assert [len(run["sleeps"]) for run in late_runs] == [1, 0]
    (start, end), = late_runs[0]["sleeps"]
    assert not any(e.rank == 0 and e.stream == "compute" and e.op not in ("WAIT", "IDLE") and e.start < end
                   and start < e.end for e in late_events), (start, end)
    # The same in aggregate, with room for the noise of processes on shared cores.
    for b, lt in zip(base.ranks, late.ranks):
        assert lt.compute_s < b.compute_s + 0.5 * DELAY_S, (b, lt)
    # The sleeping rank spends it outside compute (posting its send).
    assert late.ranks[0].other_s - base.ranks[0].other_s > 0.8 * DELAY_S


# ZeRO-3, breadth-first, P = 2, V = 2, D = 2 (4 ranks) through the trainer; the second iteration is recorded.
ZERO3_D2 = ("--num-layers 4 --hidden-size 16 --num-attention-heads 2 --seq-length 16 --max-position-embeddings 16 "
            "--micro-batch-size 1 --global-batch-size 8 --train-iters 2 --lr 1e-3 --seed 5 --vocab-size 64 "
            "--mock-data --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 "
            "--pipeline-schedule breadth-first --zero-stage 3 --log-interval 100").split()
DP_DELAY_S = 0.6


def _zero3_worker(rank: int, world: int) -> list[dict]:
    """Two runs: as they are, then with data-parallel rank 1 sleeping DP_DELAY_S before launching each
    all-gather and reduce-scatter. Returns, per run, this rank's recorded events, data-parallel rank and sleeps
    (wall-clock intervals, the recorder's clock)."""
    import torch.distributed as dist

    import megatron_bfpp.runtime as runtime
    from megatron_bfpp.train import parallel
    from megatron_bfpp.sharded import comm
    from megatron_bfpp.train import Trainer
    from megatron_bfpp.train.config import parse_trainer_args

    dist.init_process_group("gloo", rank=rank, world_size=world)
    originals = comm.all_gather, comm.reduce_scatter

    sleeps: list[tuple[float, float]] = []

    def late(launch):
        def wrapper(out, inp, group, *args, **kwargs):
            if comm.group_rank(group) == 1:
                start = time.time()
                time.sleep(DP_DELAY_S)
                sleeps.append((start, time.time()))
            return launch(out, inp, group, *args, **kwargs)
        return wrapper

    set_recorder = runtime.set_recorder
    recorders: list = []
    runtime.set_recorder = lambda r: (recorders.append(r), set_recorder(r))  # the trainer's, to read its events
    runs = []
    for delayed in (False, True):
        comm.all_gather, comm.reduce_scatter = (late(f) for f in originals) if delayed else originals
        trainer = Trainer(parse_trainer_args(ZERO3_D2, world_size=world))
        trainer.run()
        recorder = next(r for r in recorders if r is not None)
        recorders.clear()
        runs.append({"events": [e.to_dict() for e in recorder.events], "dp_rank": trainer.dp_rank,
                     "sleeps": list(sleeps)})
        sleeps.clear()
        parallel.destroy_parallel()
    comm.all_gather, comm.reduce_scatter = originals
    runtime.set_recorder = set_recorder
    return runs


@pytest.mark.timeout(300)
def test_zero3_data_parallel_waits_are_exposed_dp_not_compute(run_distributed):
    """D = 2, ZeRO-3: every data-parallel wait (parameter all-gather, gradient buffer, final reduce) lies
    outside its rank's compute; when one replica launches its collectives DP_DELAY_S late, the other
    replica's exposed data-parallel wait grows by at least most of it, none of its sleeps lies inside a compute
    interval of its rank, and no rank's compute grows by most of it."""
    per_rank = run_distributed(_zero3_worker, 4)
    base_events, base = _metrics([runs[0]["events"] for runs in per_rank], iteration=2)
    late_events, late = _metrics([runs[1]["events"] for runs in per_rank], iteration=2)
    for events, metrics in ((base_events, base), (late_events, late)):
        assert metrics.consistent, metrics.overlaps
        dp_waits = [e for e in events if e.iteration == 2 and e.op == "WAIT" and e.stream == "dp"]
        assert {e.rank for e in dp_waits} == {0, 1, 2, 3}, "a rank recorded no data-parallel wait"
        for w in dp_waits:
            computes = [e for e in events if e.rank == w.rank and e.iteration == 2 and e.stream == "compute"
                        and e.op not in ("WAIT", "IDLE")]
            assert not any(c.start < w.end and w.start < c.end for c in computes), w
    dp_rank_of = {rank: runs[0]["dp_rank"] for rank, runs in enumerate(per_rank)}
    for rank, runs in enumerate(per_rank):
        assert bool(runs[1]["sleeps"]) == (dp_rank_of[rank] == 1), (rank, runs[1]["sleeps"])
        computes = [e for e in late_events if e.rank == rank and e.stream == "compute" and e.op not in ("WAIT", "IDLE")]
        for start, end in runs[1]["sleeps"]:
            assert not any(c.start < end and start < c.end for c in computes), (rank, start, end)
    # The same in aggregate, with room for the noise of four processes on shared cores.
    for b, lt in zip(base.ranks, late.ranks):
        assert lt.compute_s < b.compute_s + 0.5 * DP_DELAY_S, (b, lt)
        if dp_rank_of[b.rank] == 0:
            assert lt.exposed_dp_wait_s - b.exposed_dp_wait_s > 0.8 * DP_DELAY_S, (b, lt)
