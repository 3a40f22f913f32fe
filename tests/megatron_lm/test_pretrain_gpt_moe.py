"""MoE with expert parallelism under `--zero-stage`, through Megatron-LM's own `pretrain_gpt.py` on CPU (the shim
and runner of tests/support/megatron_lm.py), against stock Megatron with its distributed optimizer on the same
flags: lm loss, grad norm and params norm per iteration, fp32, rtol 1e-5.

Expert-parallel parameters differ between expert-parallel ranks: they shard over the expert-data-parallel group
(E_dp = D / E), dense parameters over the data-parallel group, and the schedule's GATHER / REDUCE actions move
both buffers of a stage. Four ranks: P = 2, V = 2, D = 2, E = 2 (E_dp = 1) under breadth-first, and P = 1,
D = 4, E = 2 (E_dp = 2: the expert buffers are sharded) under zb-h1, whose W's fill the expert buffers; a
ZeRO-3 checkpoint (optimizer state of the expert buffers gathered over expert data parallelism) resumes exactly.

The router uses Megatron's aux-loss-free expert bias and an auxiliary loss, so the router state the plugin's
gradient finalisation must update (the expert bias, from the tokens each expert received) is exercised too.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import megatron_bfpp.megatron as bm
from megatron_bfpp.megatron.check import main as check_main
from megatron_bfpp.megatron.check import parse_megatron_args
from tests.support.megatron_lm import (
    P2V2,
    TINY,
    Runner,
    _tail,
    assert_same_training,
    needs_checkout,
)

# Four experts, two per expert-parallel rank; the all-gather dispatcher (on CPU the all-to-all one hands
# all_to_all_single its split sizes as tensors, which torch refuses, stock included: Megatron's
# maybe_move_tensor_to_cpu makes them numpy arrays only on a GPU). No evaluation: only training is compared.
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
       "--moe-token-dispatcher-type", "allgather", "--moe-router-score-function", "sigmoid",
       "--moe-router-enable-expert-bias", "--moe-aux-loss-coeff", "1e-2", "--eval-iters", "0"]
PIPELINED = TINY + P2V2 + MOE  # 4 ranks: P = 2, D = 2, E = 2, E_dp = 1
DATA_PARALLEL = TINY + MOE  # 4 ranks: P = 1, D = 4, E = 2, E_dp = 2


def _stock(mlm: Runner, args: list[str]):
    ref = mlm.run("stock", args + ["--use-distributed-optimizer"], nproc=4)
    assert ref.iterations() == [1, 2, 3, 4], _tail(ref.output)
    return ref


@needs_checkout
@pytest.mark.timeout(900)
@pytest.mark.parametrize("zero", ["1", "3"])
def test_expert_parallel_breadth_first_matches_stock_distributed_optimizer(mlm: Runner, zero: str) -> None:
    """P = 2, V = 2, D = 2, E = 2: expert buffers apart from dense ones, gathered / reduced at the same actions."""
    run = mlm.run("patched", PIPELINED + ["--pipeline-schedule", "breadth-first", "--zero-stage", zero], nproc=4)
    assert "megatron_bfpp: installed pipeline schedule breadth-first" in run.output
    assert_same_training(run, _stock(mlm, PIPELINED))


@needs_checkout
@pytest.mark.timeout(900)
def test_expert_parameters_shard_over_expert_data_parallel(mlm: Runner) -> None:
    """P = 1, D = 4, E = 2: each expert exists on 2 ranks (E_dp = 2) and ZeRO-3 keeps half of it on each,
    gathered over that pair only; the dense parameters are in quarters over all 4 ranks. zb-h1: the experts'
    linear layers defer their weight GEMMs to W, which accumulates into the expert gradient buffers."""
    run = mlm.run("patched", DATA_PARALLEL + ["--pipeline-schedule", "zb-h1", "--zero-stage", "3"], nproc=4)
    assert "megatron_bfpp: installed pipeline schedule zb-h1" in run.output
    deferred = re.findall(r"zb-h1, model chunk 0: (\d+) linear layers defer their weight GEMMs to W", run.output)
    # 4 layers x (QKV and projection + 2 local experts x 2 linears) + the output layer: the experts' too
    assert deferred == ["25"], deferred
    assert_same_training(run, _stock(mlm, DATA_PARALLEL))


@needs_checkout
@pytest.mark.timeout(900)
def test_expert_parallel_zero3_save_resume_matches_stock(mlm: Runner, tmp_path: Path) -> None:
    """ZeRO-3 saves at iteration 2 (torch_dist: the optimizer state of each buffer gathered over its own group,
    expert buffers over expert data parallelism) and exits; the resumed run's iterations 3-4 equal the
    uninterrupted stock run's."""
    bf3 = PIPELINED + ["--pipeline-schedule", "breadth-first", "--zero-stage", "3"]
    ckpt = str(tmp_path / "ckpt")
    first = mlm.run("patched", bf3 + ["--save", ckpt, "--save-interval", "2", "--exit-interval", "2"], nproc=4)
    assert sorted(first.by_iteration()) == [1, 2], _tail(first.output)
    resumed = mlm.run("patched", bf3 + ["--load", ckpt], nproc=4)
    assert sorted(resumed.by_iteration()) == [3, 4], _tail(resumed.output)
    # Megatron's log line after the first resumed iteration averages it with the next (stock too): compare that
    # line for iteration 3 only, the full-precision records for both.
    assert_same_training(resumed, _stock(mlm, PIPELINED), iterations=[3, 4], logged=[3])


# ----------------------------------------------------------------- argument checks (no process group needed)

CHECK = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "1", "--global-batch-size", "8",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--train-iters", "4", "--lr", "1e-3",
         "--mock-data", *P2V2, "--pipeline-schedule", "breadth-first", *MOE]


@pytest.mark.parametrize("zero", ["1", "2", "3"])
def test_check_accepts_expert_parallel_zero_stage(zero: str, capsys: pytest.CaptureFixture) -> None:
    assert check_main(["--world-size", "4", "--", *CHECK, "--zero-stage", zero]) == 0
    assert capsys.readouterr().out.startswith("ok: ")


def test_expert_parallel_zero_stage_accepts_checkpoints() -> None:
    bm.validate_args(parse_megatron_args(CHECK + ["--zero-stage", "3", "--save", "/tmp/unused-ckpt", "--load",
                                                  "/tmp/unused-ckpt", "--save-interval", "2"], 4))
