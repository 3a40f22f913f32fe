"""Faults are loud, bounded and recoverable.

- A schedule mismatch between ranks (M, schedule, V) is caught by the runtime's handshake on every rank,
  naming the other rank and what differs; a peer that stops answering fails the p2p wait within the
  configured bound (naming rank, step, action and peer); a data-parallel collective of megatron_bfpp.sharded
  with an absent peer fails within its process group's timeout.
- NaN/Inf (--check-for-nan-in-loss-and-grad) stops all ranks before the optimizer step with one error naming
  the iteration and the ranks; fp16 dynamic loss scaling skips the step and halves the scale instead.
The trainer checks run first, then the runtime's, in one 2-process world. The rank killed under `bfpp train`
and its resume are in tests/distributed/test_checkpoint.py (the resume is compared bit for bit with the reference run).
"""

from __future__ import annotations

import json
import os
import re
import time
from types import SimpleNamespace

import pytest
import torch

from tests.support import toy_pipeline as toy
from tests.support.distributed import run_distributed

WAIT_S = 3.0


# ----------------------------------------------------------------------------------- runtime, 2 ranks
def _run_toy(rank: int, name: str, vp: int, m: int, pg, forward_step=toy.forward_step) -> None:
    from megatron_bfpp.runtime import get_forward_backward_func

    chunks = [toy.ToyStage(toy.make_config(), rank + c * 2, 2 * vp) for c in range(vp)]
    batches = toy.make_batches(m)
    get_forward_backward_func(name)(
        forward_step_func=forward_step, data_iterator=[iter(batches) for _ in chunks], model=chunks,
        num_microbatches=m, seq_length=toy.SEQ, micro_batch_size=toy.MBS, pg_collection=pg)


def _runtime_checks(rank: int) -> dict:
    import datetime

    import torch.distributed as dist

    from megatron_bfpp.runtime import PipelineError, set_wait_timeout
    from megatron_bfpp.sharded import comm

    set_wait_timeout(WAIT_S)
    pg = SimpleNamespace(pp=dist.new_group([0, 1]), dp=None)
    out: dict = {}
    mismatches = {  # case -> this rank's (schedule, V, M)
        "M": [("breadth-first", 2, 4), ("breadth-first", 2, 3)],
        "schedule": [("breadth-first", 2, 4), ("interleaved-1f1b", 2, 4)],
        "V": [("breadth-first", 2, 4), ("breadth-first", 3, 4)],
    }
    for case, per_rank in mismatches.items():
        name, vp, m = per_rank[rank]
        try:
            _run_toy(rank, name, vp, m, pg)
            out[case] = None
        except PipelineError as e:
            out[case] = str(e)
    # The ranks agree again: the same call runs.
    _run_toy(rank, "breadth-first", 2, 4, pg)

    # A data-parallel collective whose peer never comes: bounded by the group's timeout.
    slow = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=WAIT_S))
    if rank == 0:
        t0 = time.time()
        try:
            comm.all_gather(torch.empty(8), torch.ones(4), slow, None).wait()
            out["collective"] = None
        except Exception as e:  # gloo raises RuntimeError / DistBackendError on timeout
            out["collective"] = (type(e).__name__, str(e)[:200], time.time() - t0)
    else:
        time.sleep(WAIT_S + 2)

    # A p2p peer that stops answering: rank 1's first forward sleeps past the wait bound.
    def sleepy_forward_step(data_iterator, model):
        time.sleep(3 * WAIT_S)
        return toy.forward_step(data_iterator, model)

    t0 = time.time()
    try:
        _run_toy(rank, "gpipe", 1, 2, pg, toy.forward_step if rank == 0 else sleepy_forward_step)
        out["p2p"] = None
    except PipelineError as e:
        out["p2p"] = (str(e), time.time() - t0)
    return out


@pytest.fixture(scope="module")
def faults(run_distributed, tmp_path_factory) -> tuple[list[dict], dict]:
    report = str(tmp_path_factory.mktemp("fp16") / "report.json")
    results = run_distributed(_faults_worker, 2, report, timeout=400)
    with open(report) as f:
        return results, json.load(f)


@pytest.fixture(scope="module")
def runtime_faults(faults) -> list[dict]:
    return [r["runtime"] for r in faults[0]]


@pytest.mark.timeout(500)
@pytest.mark.parametrize("case,expect", [("M", "M 4 vs 3"), ("schedule", "schedule "), ("V", "V 2 vs 3")])
def test_handshake_names_the_mismatch(runtime_faults, case, expect):
    for rank in (0, 1):
        msg = runtime_faults[rank][case]
        assert msg is not None, f"rank {rank} ran a mismatched schedule without noticing ({case})"
        other = 1 - rank
        assert f"rank {rank}:" in msg and f"pipeline-parallel rank {other} runs a different schedule" in msg, msg
        if rank == 0:
            assert expect in msg, msg


@pytest.mark.timeout(500)
def test_sharded_collective_wait_is_bounded(runtime_faults):
    kind, text, seconds = runtime_faults[0]["collective"]
    assert seconds < WAIT_S + 10, (kind, text, seconds)


@pytest.mark.timeout(500)
def test_p2p_wait_names_rank_step_action_and_peer(runtime_faults):
    msg, seconds = runtime_faults[0]["p2p"]
    assert seconds < 3 * WAIT_S, seconds  # gave up before the sleeping peer woke
    assert re.search(r"rank 0 \(pipeline rank 0\) at step \d+ RECV_B0:0 of gpipe: .* from/to rank 1 failed", msg), msg
    # Bounded either by the executor's own wait or by the channel group's timeout (both are the set bound).
    assert f"within {WAIT_S:g} s" in msg or f"{WAIT_S * 1000:.0f}ms" in msg, msg


# ----------------------------------------------------------------------------------- trainer, 2 ranks
TINY = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "16",
        "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "3", "--lr", "1e-3",
        "--vocab-size", "128", "--log-interval", "1", "--pipeline-model-parallel-size", "2",
        "--pipeline-schedule", "gpipe", "--distributed-timeout-seconds", "60"]


def _faults_worker(rank: int, world: int, report: str) -> dict:
    import datetime

    import torch.distributed as dist

    # One default group for everything run here (each trainer builds Megatron's groups anew).
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    numerics = _numerics_checks(world, report)
    return {"numerics": numerics, "runtime": _runtime_checks(rank)}


def _numerics_checks(world: int, report: str) -> dict:
    from megatron_bfpp.train import parallel
    from megatron_bfpp.train.faults import NumericalFault
    from megatron_bfpp.train import Trainer
    from megatron_bfpp.train.config import parse_trainer_args

    out: dict = {}
    for case, spec, extra in (
        ("nan_loss", "rank=1,iteration=2,point=nan_loss", []),  # rank 1 holds the last stage
        ("nan_grad", "rank=0,iteration=1,point=nan_grad", []),
        ("fp16", "rank=1,iteration=2,point=inf_grad",
         ["--fp16", "--initial-loss-scale", "1024", "--hysteresis", "1", "--report-json", report]),
    ):
        os.environ["BFPP_FAULT_INJECT"] = spec
        trainer = Trainer(parse_trainer_args(TINY + extra, world_size=world))
        try:
            trainer.run()
            out[case] = {"error": None}
        except NumericalFault as e:
            out[case] = {"error": str(e)}
        finite = all(bool(torch.isfinite(p).all()) for c in trainer.model for p in c.parameters())
        out[case].update(iteration=trainer.iteration, finite=finite, losses=trainer.losses,
                         scheduler_steps=trainer.scheduler.num_steps,
                         check=trainer.args.check_for_nan_in_loss_and_grad)
        parallel.destroy_parallel()
    os.environ.pop("BFPP_FAULT_INJECT")
    return out


@pytest.fixture(scope="module")
def numerics(faults) -> tuple[list[dict], dict]:
    results, report = faults
    return [r["numerics"] for r in results], report


@pytest.mark.timeout(500)
def test_nan_in_loss_stops_every_rank_before_the_update(numerics):
    results, _ = numerics
    for rank in (0, 1):
        r = results[rank]["nan_loss"]
        assert r["error"] is not None and r["error"].startswith("iteration 2: NaN/Inf in lm loss on rank 1;"), r
        assert "--check-for-nan-in-loss-and-grad" in r["error"]
        assert r["iteration"] == 2 and r["finite"]  # the poisoned step was never applied
        assert r["scheduler_steps"] == 1 * 4  # one global batch of 4 samples stepped


@pytest.mark.timeout(500)
def test_nan_in_gradients_names_the_ranks(numerics):
    results, _ = numerics
    for rank in (0, 1):
        r = results[rank]["nan_grad"]
        assert r["error"] is not None and re.match(r"iteration 1: NaN/Inf in gradients on ranks? 0\b", r["error"]), r
        assert "lm loss" not in r["error"].split("(")[0]  # the loss itself was finite
        assert r["finite"] and r["scheduler_steps"] == 0


@pytest.mark.timeout(500)
def test_fp16_overflow_skips_the_step_and_halves_the_scale(numerics):
    results, report = numerics
    r = results[0]["fp16"]
    assert r["error"] is None and not r["check"]  # Megatron turns the NaN check off for dynamic scaling
    assert r["iteration"] == 3 and r["finite"]
    assert r["scheduler_steps"] == 2 * 4  # the skipped iteration did not advance the LR schedule
    assert report["skipped_iterations"] == [2]
    assert report["loss_scales"] == [1024.0, 512.0, 512.0]
