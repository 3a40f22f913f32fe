"""Trainer checkpoints: bitwise resume, loading at other layouts, and a save killed before its commit.

Reference layout: D = 2, P = 2, V = 2, breadth-first, ZeRO-3, fp32 on CPU (4 gloo processes), dropout 0.
  A: 6 iterations straight.  B: the same run stopped after 3 (--save, --exit-interval 3).  C: --load B's
  checkpoint, 3 more.  C's losses equal A's iterations 4-6 bit for bit, and so do, on every rank, C's final
  parameters and optimizer state (fp32 master weights, Adam moments, step, hyper-parameters, LR scheduler).
  D: B's checkpoint at D = 4, P = 1, V = 2 (breadth-first, ZeRO-2); E: at D = 1, P = 2, V = 1 (gpipe, ZeRO-1):
  both continue with A's losses within fp32 tolerance (the optimizer state is resharded). With
  --no-load-optim the loaded weights alone give A's iteration-4 loss.
Interrupted save: F loads B's checkpoint at E's layout and saves every iteration; rank 1 is SIGKILLed while
the iteration-4 checkpoint is written (shards on disk, not committed). The tracker still names iteration 3,
which E then loads; E's iteration 4 equals F's, and E's own save removes F's leftover.
Killed rank: A's run under `bfpp train` (torchrun, 4 processes) saving at iteration 3, with rank 2 SIGKILLed
during iteration 6: the launcher fails within the timeout plus a margin naming rank 2 as the root cause, the
survivors report the lost peer themselves; R resumes from its last checkpoint (iteration 3) and repeats
iterations 4-6 with A's losses bit for bit.
bf16 with dropout 0.1 (same layout): S trains 4 iterations saving at 2; T resumes from iteration 2 and ends
with S's losses and state bit for bit (fp32 master weights and RNG states restored).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time

import pytest
import torch

from tests.support.distributed import free_port, run_distributed

MODEL = ["--num-layers", "4", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "16",
         "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "6", "--lr", "1e-2",
         "--lr-decay-style", "linear", "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "7",
         "--vocab-size", "128", "--log-interval", "1"]
TIMEOUT_S = 30  # --distributed-timeout-seconds: bounds every wait, hence how long a failure can take to surface
BASE = MODEL + ["--distributed-timeout-seconds", str(TIMEOUT_S)]
REFERENCE = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
             "--pipeline-schedule", "breadth-first", "--zero-stage", "3"]
D4_P1_V2 = ["--pipeline-model-parallel-size", "1", "--num-layers-per-virtual-pipeline-stage", "2",
            "--pipeline-schedule", "breadth-first", "--zero-stage", "2"]
D1_P2_V1 = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "gpipe", "--zero-stage", "1"]
RTOL, ATOL = 1e-5, 1e-6
# The reference layout in bf16 with dropout, 4 iterations: a resume must restore the fp32 master weights (they
# differ from the bf16 weights) and the RNG state (the dropout masks of the resumed iterations).
NOISY = BASE + REFERENCE + ["--bf16"]
for _flag, _value in (("--train-iters", "4"), ("--hidden-dropout", "0.1"), ("--attention-dropout", "0.1")):
    NOISY[NOISY.index(_flag) + 1] = _value


def _train(argv: list[str], world: int, state: dict | None = None, key: str = "") -> list[float]:
    """Train; return the losses. With `state`, also store this rank's final state there under `key`."""
    from megatron_bfpp.train import parallel
    from megatron_bfpp.train import Trainer
    from megatron_bfpp.train.config import parse_trainer_args

    trainer = Trainer(parse_trainer_args(argv, world_size=world))
    trainer.run()
    if state is not None:
        state[key] = _final_state(trainer)
    parallel.destroy_parallel()
    return trainer.losses


def _final_state(trainer) -> dict:
    """This rank's parameters (gathered whole) and optimizer state, as copies."""
    from contextlib import ExitStack

    from megatron_bfpp.train.model import global_named_parameters

    with ExitStack() as stack:
        for chunk in trainer.model:
            stack.enter_context(chunk.full_params())
        params = {n: p.detach().clone() for n, p in
                  global_named_parameters(trainer.model, trainer.pp_rank, trainer.pp).items()}
    sd = trainer.optimizer.state_dict()
    clone = lambda d: {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in d.items()}  # noqa: E731
    return {"params": params, "step": sd["step"], "param_groups": sd["param_groups"],
            "grad_scaler": sd["grad_scaler"], "buckets": [clone(b) for b in sd["buckets"]],
            "replicated": [clone(r) for r in sd["replicated"]], "scheduler": trainer.scheduler.state_dict()}


def _reference_worker(rank: int, world: int, ckpt: str, killed_ckpt: str, noisy_ckpt: str) -> dict:
    import datetime

    import torch.distributed as dist

    # One default group for the four trainers run here one after another (each builds Megatron's groups anew).
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    states: dict = {}
    out = {"A": _train(BASE + REFERENCE, world, states, "A")}
    out["B"] = _train(BASE + REFERENCE + ["--save", ckpt, "--save-interval", "3", "--exit-interval", "3"], world)
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as f:
        out["tracker_after_B"] = f.read()
    out["C"] = _train(BASE + REFERENCE + ["--load", ckpt], world, states, "C")
    out["D"] = _train(BASE + D4_P1_V2 + ["--load", ckpt], world)
    out["model_only"] = _train(BASE + REFERENCE + ["--load", ckpt, "--no-load-optim", "--exit-interval", "4"], world)
    out["R"] = _train(BASE + REFERENCE + ["--load", killed_ckpt], world, states, "R")
    # bf16 with dropout: 4 iterations saving at 2 (and 4), then a resume from iteration 2 (--ckpt-step).
    out["S"] = _train(NOISY + ["--save", noisy_ckpt, "--save-interval", "2"], world, states, "S")
    out["T"] = _train(NOISY + ["--load", noisy_ckpt, "--ckpt-step", "2"], world, states, "T")
    return {"losses": out, "state": states}


MARGIN_S = 30  # process start-up/teardown on a loaded machine


@pytest.fixture(scope="module")
def killed(subprocesses, tmp_path_factory) -> dict:
    """A's run under `bfpp train` saving at iteration 3; rank 2 SIGKILLed in its first forward of iteration 6."""
    ckpt = str(tmp_path_factory.mktemp("killed") / "run")
    argv = BASE + REFERENCE
    env = {**os.environ, "OMP_NUM_THREADS": "1", "BFPP_FAULT_INJECT": "rank=2,iteration=6,point=forward"}
    p = subprocess.run([sys.executable, "-W", "ignore", "-m", "megatron_bfpp.cli", "train", "--nproc-per-node", "4",
                        *argv, "--save", ckpt, "--save-interval", "3"], env=env, capture_output=True, text=True,
                       timeout=600)
    return {"rc": p.returncode, "out": p.stdout + p.stderr, "end": time.time(), "ckpt": ckpt}


@pytest.fixture(scope="module")
def reference(run_distributed, tmp_path_factory, killed) -> dict:
    ckpt = str(tmp_path_factory.mktemp("ckpt") / "run")
    noisy = str(tmp_path_factory.mktemp("noisy") / "run")
    results = run_distributed(_reference_worker, 4, ckpt, killed["ckpt"], noisy, timeout=600)
    assert all(r["losses"] == results[0]["losses"] for r in results)  # every rank learns the global loss
    return {**results[0]["losses"], "ckpt": ckpt, "states": [r["state"] for r in results]}


def _assert_bitwise_equal(got, expected, where: str) -> None:
    """Exact equality of nested dicts/lists of tensors and plain values (tensors: same dtype, shape, bits)."""
    if isinstance(expected, dict):
        assert isinstance(got, dict) and set(got) == set(expected), f"{where}: keys {set(got) ^ set(expected)}"
        for k in expected:
            _assert_bitwise_equal(got[k], expected[k], f"{where}.{k}")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(expected), f"{where}: lengths differ"
        for i, (g, e) in enumerate(zip(got, expected)):
            _assert_bitwise_equal(g, e, f"{where}[{i}]")
    elif isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == expected.dtype and got.shape == expected.shape, where
        assert torch.equal(got, expected), f"{where}: max |diff| {(got - expected).abs().max().item():.3e}"
    else:
        assert got == expected, f"{where}: {got!r} != {expected!r}"


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= ATOL + RTOL * abs(y) for x, y in zip(a, b))


@pytest.mark.timeout(900)
def test_resume_is_bitwise_identical(reference):
    a = reference["A"]
    assert len(a) == 6 and a[5] < a[0]  # it trains
    assert reference["B"] == a[:3]
    assert reference["tracker_after_B"].strip() == "3"
    assert reference["C"] == a[3:]  # exact float equality: nothing lost, nothing changed


@pytest.mark.timeout(900)
def test_bf16_dropout_resume_restores_master_weights_and_rng_bitwise(reference):
    """S: bf16, dropout 0.1, 4 iterations saving at 2. T: resumed from S's iteration 2. Iterations 3-4 and the
    final state (bf16 weights, fp32 masters, moments) equal S's bit for bit: the masters were restored (not
    re-derived from the bf16 weights) and so were the RNG states (dropout draws the same masks)."""
    s = reference["S"]
    assert len(s) == 4 and reference["T"] == s[2:]
    for rank, state in enumerate(reference["states"]):
        masters = [b["main_param"] for b in state["S"]["buckets"]]
        assert masters and all(m.dtype == torch.float32 for m in masters), f"rank {rank}: no fp32 masters"
        _assert_bitwise_equal(state["T"], state["S"], f"rank {rank}")


@pytest.mark.timeout(900)
def test_resume_restores_parameters_and_optimizer_state_bitwise(reference):
    """After C (resumed at 3, trained to 6) every rank holds exactly A's parameters and optimizer state."""
    for rank, state in enumerate(reference["states"]):
        a, c = state["A"], state["C"]
        assert a["step"] == 6 and len(a["buckets"]) > 0 and a["params"], f"rank {rank}: {a['step']}"
        _assert_bitwise_equal(c, a, f"rank {rank}")


@pytest.mark.timeout(900)
def test_loads_at_d4_p1_v2_zero2(reference):
    assert _close(reference["D"], reference["A"][3:]), (reference["D"], reference["A"][3:])


@pytest.mark.timeout(900)
def test_killed_rank_fails_the_job_within_the_bound(killed):
    out = killed["out"]
    assert killed["rc"] != 0, out[-4000:]
    m = re.search(r"fault injection: rank 2 SIGKILLs itself at iteration 6 \(forward\) t=([\d.]+)", out)
    assert m, out[-4000:]
    assert killed["end"] - float(m.group(1)) < TIMEOUT_S + MARGIN_S
    # torchrun's root-cause report names the killed rank and its signal.
    root = re.search(r"Root Cause \(first observed failure\):(.*?)={10}", out, re.S)
    assert root, out[-4000:]
    assert re.search(r"rank\s*:\s*2 \(local_rank: 2\)", root.group(1)) and "-9" in root.group(1), root.group(1)
    # Each survivor ended, within the bound, either by detecting the lost peer itself or by the launcher's
    # SIGTERM (torchrun tears the others down within its monitor interval, which usually wins the race;
    # detection without a launcher is tested by test_killed_save_leaves_previous_checkpoint_loadable and
    # tests/distributed/test_faults.py).
    for rank in (0, 1, 3):
        by_itself = re.search(rf"rank {rank}: failed because another rank failed", out)
        torn_down = re.search(rf"rank\s*:\s*{rank} \(local_rank: {rank}\)\s*\n\s*exitcode\s*:\s*-15", out)
        assert by_itself or torn_down, (rank, out[-4000:])


@pytest.mark.timeout(900)
def test_killed_run_resumes_with_nothing_lost(killed, reference):
    a = reference["A"]
    logged = {int(i): v for i, v in re.findall(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: (\S+) \|", killed["out"])}
    assert logged == {i + 1: f"{a[i]:.6E}" for i in range(5)}  # A's run, up to the iteration that died
    assert reference["R"] == a[3:]  # resumed from iteration 3: iterations 4-6 exactly as uninterrupted
    for rank, state in enumerate(reference["states"]):
        _assert_bitwise_equal(state["R"], state["A"], f"rank {rank}")


def test_model_weights_load_without_the_optimizer(reference):
    # Iteration 4's loss is the forward pass of the loaded weights: it must not need the optimizer state.
    assert reference["model_only"] == reference["A"][3:4]


def test_checkpoint_layout_on_disk(reference):
    ckpt = reference["ckpt"]
    assert sorted(os.listdir(ckpt)) == ["iter_0000003", "latest_checkpointed_iteration.txt"]
    assert os.path.isfile(os.path.join(ckpt, "iter_0000003", "metadata.json"))


def test_model_shape_mismatch_names_the_flag(reference):
    from megatron_bfpp.train.config import TrainerConfigError, parse_trainer_args

    argv = BASE + REFERENCE + ["--load", reference["ckpt"], "--hidden-size", "32"]
    with pytest.raises(TrainerConfigError) as info:
        parse_trainer_args(argv, world_size=4)
    msg = str(info.value)
    assert "--hidden-size" in msg and "16" in msg and "32" in msg and reference["ckpt"] in msg


# ------------------------------------------------------------------------------- interrupted save, D = 1
def _launch_two_ranks(argv: list[str], env_extra: dict[str, str]) -> tuple[list[int], list[str], list[float]]:
    """`python -m megatron_bfpp.train` as ranks 0 and 1 of a 2-process world, no launcher agent between
    them; (exit codes, outputs, exit times)."""
    port = free_port()
    procs, logs = [], []
    for rank in range(2):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1", **env_extra}
        logs.append(tempfile.TemporaryFile("w+"))
        procs.append(subprocess.Popen([sys.executable, "-W", "ignore", "-m", "megatron_bfpp.train", *argv], env=env,
                                      stdout=logs[-1], stderr=subprocess.STDOUT, text=True))
    ends: list[float | None] = [None, None]
    deadline = time.time() + 600
    while None in ends and time.time() < deadline:
        for i, p in enumerate(procs):
            if ends[i] is None and p.poll() is not None:
                ends[i] = time.time()
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.kill()
    outs = []
    for f in logs:
        f.seek(0)
        outs.append(f.read())
        f.close()
    return [p.wait() for p in procs], outs, [e if e is not None else float("inf") for e in ends]


@pytest.fixture(scope="module")
def interrupted(subprocesses, reference, tmp_path_factory) -> dict:
    ckpt = reference["ckpt"]
    report = str(tmp_path_factory.mktemp("reports") / "e.json")
    killed = _launch_two_ranks(BASE + D1_P2_V1 + ["--load", ckpt, "--save", ckpt, "--save-interval", "1"],
                               {"BFPP_FAULT_INJECT": "rank=1,iteration=4,point=save"})
    state = {"listing": sorted(os.listdir(ckpt)),
             "tracker": open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read().strip()}
    resumed = _launch_two_ranks(BASE + D1_P2_V1 + ["--load", ckpt, "--save", ckpt, "--save-interval", "1",
                                                   "--report-json", report], {})
    with open(report) as f:
        losses = json.load(f)["losses"]
    return {"killed": killed, "state": state, "resumed": resumed, "E": losses,
            "final_listing": sorted(os.listdir(ckpt)),
            "final_tracker": open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read().strip()}


def _logged_loss(output: str, iteration: int) -> str:
    m = re.search(rf"iteration\s+{iteration}/.*?lm loss: (\S+) \|", output)
    assert m, output[-3000:]
    return m.group(1)


@pytest.mark.timeout(900)
def test_killed_save_leaves_previous_checkpoint_loadable(interrupted):
    (rc0, rc1), (out0, out1), (end0, _) = interrupted["killed"]
    assert rc1 == -9, out1[-3000:]  # SIGKILL while writing iteration 4
    m = re.search(r"fault injection: rank 1 SIGKILLs itself at iteration 4 \(save\) t=([\d.]+)", out1)
    assert m, out1[-3000:]
    # Rank 0, waiting for rank 1 to finish the save, fails by itself within the bound.
    assert rc0 == 1 and "rank 0: failed because another rank failed" in out0, out0[-3000:]
    assert end0 - float(m.group(1)) < TIMEOUT_S + MARGIN_S
    assert interrupted["state"]["tracker"] == "3"
    assert "iter_0000004.tmp" in interrupted["state"]["listing"]  # the uncommitted write
    assert "iter_0000004" not in interrupted["state"]["listing"]
    (rc0, rc1), (out0, _), _ = interrupted["resumed"]
    assert (rc0, rc1) == (0, 0), out0[-3000:]
    assert re.search(r"loaded checkpoint \S+iter_0000003 \(iteration 3, 24 samples consumed", out0), out0[-3000:]
    # The killed run had logged iteration 4 before saving it: the resumed run repeats it exactly.
    assert _logged_loss(out0, 4) == _logged_loss(interrupted["killed"][1][0], 4)
    assert interrupted["final_tracker"] == "6"
    assert not any(name.endswith(".tmp") for name in interrupted["final_listing"]), interrupted["final_listing"]


@pytest.mark.timeout(900)
def test_loads_at_d1_p2_v1_gpipe_zero1(reference, interrupted):
    assert _close(interrupted["E"], reference["A"][3:]), (interrupted["E"], reference["A"][3:])
