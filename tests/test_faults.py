"""Faults are loud, bounded and recoverable.

- A schedule mismatch between ranks (M, schedule, V) is caught by the runtime's handshake on every rank,
  naming the other rank and what differs; a peer that stops answering fails the p2p wait within the
  configured bound (naming rank, step, action and peer); a data-parallel collective of megatron_bfpp.sharded
  with an absent peer fails within its process group's timeout.
- NaN/Inf (--check-for-nan-in-loss-and-grad) stops all ranks before the optimizer step with one error naming
  the iteration and the ranks; fp16 dynamic loss scaling skips the step and halves the scale instead.
- One of 4 ranks SIGKILLed mid-step under `bfpp train`: the launcher exits non-zero within the timeout plus
  a margin and names that rank as the root cause; the survivors report the peer failure themselves; the run
  resumes from the last checkpoint and repeats the lost iterations exactly.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from tests import toy_pipeline as toy
from tests.distributed import run_distributed

WAIT_S = 3.0


# ----------------------------------------------------------------------------------- runtime, 2 ranks
def _run_toy(rank: int, name: str, vp: int, m: int, pg, forward_step=toy.forward_step) -> None:
    from megatron_bfpp.runtime import get_forward_backward_func

    chunks = [toy.ToyStage(toy.make_config(), rank + c * 2, 2 * vp) for c in range(vp)]
    batches = toy.make_batches(m)
    get_forward_backward_func(name)(
        forward_step_func=forward_step, data_iterator=[iter(batches) for _ in chunks], model=chunks,
        num_microbatches=m, seq_length=toy.SEQ, micro_batch_size=toy.MBS, pg_collection=pg)


def _runtime_worker(rank: int, world: int) -> dict:
    import datetime

    import torch.distributed as dist

    from megatron_bfpp.runtime import PipelineError, set_wait_timeout
    from megatron_bfpp.sharded import comm

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
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
def runtime_faults() -> list[dict]:
    return run_distributed(_runtime_worker, 2, timeout=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case,expect", [("M", "M 4 vs 3"), ("schedule", "schedule "), ("V", "V 2 vs 3")])
def test_handshake_names_the_mismatch(runtime_faults, case, expect):
    for rank in (0, 1):
        msg = runtime_faults[rank][case]
        assert msg is not None, f"rank {rank} ran a mismatched schedule without noticing ({case})"
        other = 1 - rank
        assert f"rank {rank}:" in msg and f"pipeline-parallel rank {other} runs a different schedule" in msg, msg
        if rank == 0:
            assert expect in msg, msg


@pytest.mark.timeout(300)
def test_sharded_collective_wait_is_bounded(runtime_faults):
    kind, text, seconds = runtime_faults[0]["collective"]
    assert seconds < WAIT_S + 10, (kind, text, seconds)


@pytest.mark.timeout(300)
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


def _numerics_worker(rank: int, world: int, report: str) -> dict:
    import datetime

    import torch.distributed as dist

    from megatron_bfpp import parallel
    from megatron_bfpp.faults import NumericalFault
    from megatron_bfpp.train import Trainer
    from megatron_bfpp.train_config import parse_trainer_args

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
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
def numerics(tmp_path_factory) -> tuple[list[dict], dict]:
    report = str(tmp_path_factory.mktemp("fp16") / "report.json")
    results = run_distributed(_numerics_worker, 2, report, timeout=300)
    with open(report) as f:
        return results, json.load(f)


@pytest.mark.timeout(400)
def test_nan_in_loss_stops_every_rank_before_the_update(numerics):
    results, _ = numerics
    for rank in (0, 1):
        r = results[rank]["nan_loss"]
        assert r["error"] is not None and r["error"].startswith("iteration 2: NaN/Inf in lm loss on rank 1;"), r
        assert "--check-for-nan-in-loss-and-grad" in r["error"]
        assert r["iteration"] == 2 and r["finite"]  # the poisoned step was never applied
        assert r["scheduler_steps"] == 1 * 4  # one global batch of 4 samples stepped


@pytest.mark.timeout(400)
def test_nan_in_gradients_names_the_ranks(numerics):
    results, _ = numerics
    for rank in (0, 1):
        r = results[rank]["nan_grad"]
        assert r["error"] is not None and re.match(r"iteration 1: NaN/Inf in gradients on ranks? 0\b", r["error"]), r
        assert "lm loss" not in r["error"].split("(")[0]  # the loss itself was finite
        assert r["finite"] and r["scheduler_steps"] == 0


@pytest.mark.timeout(400)
def test_fp16_overflow_skips_the_step_and_halves_the_scale(numerics):
    results, report = numerics
    r = results[0]["fp16"]
    assert r["error"] is None and not r["check"]  # Megatron turns the NaN check off for dynamic scaling
    assert r["iteration"] == 3 and r["finite"]
    assert r["scheduler_steps"] == 2 * 4  # the skipped iteration did not advance the LR schedule
    assert report["skipped_iterations"] == [2]
    assert report["loss_scales"] == [1024.0, 512.0, 512.0]


# ----------------------------------------------------------------------------------- bfpp train, 4 ranks
KILL = ["--num-layers", "4", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "16",
        "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "6", "--lr", "1e-2",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--vocab-size", "128", "--log-interval", "1",
        "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
        "--pipeline-schedule", "breadth-first", "--zero-stage", "3", "--distributed-timeout-seconds", "30"]
TIMEOUT_S, MARGIN_S = 30, 30


def _bfpp_train(argv: list[str], env_extra: dict[str, str]) -> tuple[int, str, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env_extra}
    t0 = time.time()
    p = subprocess.run([sys.executable, "-W", "ignore", "-m", "megatron_bfpp.cli", "train", "--nproc-per-node", "4",
                        *argv], env=env, capture_output=True, text=True, timeout=600)
    return p.returncode, p.stdout + p.stderr, time.time()


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory) -> dict:
    ckpt = str(tmp_path_factory.mktemp("kill") / "ckpt")
    report = os.path.join(os.path.dirname(ckpt), "resumed.json")
    run = KILL + ["--save", ckpt, "--save-interval", "3"]
    rc, out, end = _bfpp_train(run, {"BFPP_FAULT_INJECT": "rank=2,iteration=6,point=forward"})
    resumed_rc, resumed_out, _ = _bfpp_train(run + ["--load", ckpt, "--report-json", report], {})
    losses = json.load(open(report))["losses"] if os.path.exists(report) else None
    return {"rc": rc, "out": out, "end": end, "resumed_rc": resumed_rc, "resumed_out": resumed_out,
            "resumed_losses": losses}


def _logged_losses(output: str) -> dict[int, str]:
    return {int(i): v for i, v in re.findall(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: (\S+) \|", output)}


@pytest.mark.timeout(1300)
def test_killed_rank_fails_the_job_within_the_bound(killed_and_resumed):
    r = killed_and_resumed
    out = r["out"]
    assert r["rc"] != 0, out[-4000:]
    m = re.search(r"fault injection: rank 2 SIGKILLs itself at iteration 6 \(forward\) t=([\d.]+)", out)
    assert m, out[-4000:]
    assert r["end"] - float(m.group(1)) < TIMEOUT_S + MARGIN_S
    # torchrun's root-cause report names the killed rank and its signal.
    root = re.search(r"Root Cause \(first observed failure\):(.*?)={10}", out, re.S)
    assert root, out[-4000:]
    assert re.search(r"rank\s*:\s*2 \(local_rank: 2\)", root.group(1)) and "-9" in root.group(1), root.group(1)
    # At least one survivor detected the loss of its peer by itself (before the launcher tore it down).
    assert re.search(r"rank [013]: failed because another rank failed", out), out[-4000:]


@pytest.mark.timeout(1300)
def test_resumed_run_repeats_the_lost_iterations_exactly(killed_and_resumed):
    r = killed_and_resumed
    assert r["resumed_rc"] == 0, r["resumed_out"][-4000:]
    assert "loaded checkpoint" in r["resumed_out"] and "(iteration 3, 24 samples consumed" in r["resumed_out"]
    before = _logged_losses(r["out"])
    assert sorted(before) == [1, 2, 3, 4, 5]  # iteration 6 died
    resumed = r["resumed_losses"]
    assert len(resumed) == 3  # iterations 4, 5, 6
    assert [f"{x:.6E}" for x in resumed[:2]] == [before[4], before[5]]
