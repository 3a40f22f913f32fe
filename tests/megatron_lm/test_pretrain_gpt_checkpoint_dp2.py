"""Checkpoints move between stock Megatron-LM and --zero-stage at data-parallel size 2.

The other stock <-> ZeRO checkpoint tests (tests/megatron_lm/test_pretrain_gpt_checkpoint.py) run at D = 1, where every flat
buffer is one rank's whole and the optimizer state's gather / slice over data parallelism is the identity. Here
4 ranks, P = 2 (V = 2), D = 2, through Megatron-LM's own `pretrain_gpt.py` on CPU with `--ckpt-format torch_dist`:
stock's plain optimizer (FP32Optimizer, every rank holding the whole state) saves at iteration 2; breadth-first
ZeRO-3 (parameters, gradients and Adam state split in halves over the two data-parallel ranks, cut anywhere
inside parameters) resumes with iterations 3-4 and saves at 4 (each rank gathering its buffers' halves); stock
resumes from that with iterations 5-6. Every resumed iteration equals the uninterrupted stock run (lm loss, grad
norm, params norm; rtol 1e-5): a half of a state loaded into the wrong rank's shard, or one left out of the save,
changes the next step.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.support.megatron_lm import P2V2, TINY, Run, Runner, _tail, assert_same_training, needs_checkout

NPROC = 4  # P = 2 x D = 2
SIX = ["--train-iters", "6"]
TIMEOUT = 600  # 4 processes on a small CPU machine


def _every_2(ckpt: Path) -> list[str]:
    return ["--save", str(ckpt), "--save-interval", "2"]


def _run(mlm: Runner, mode: str, flags: list[str]) -> Run:
    return mlm.run(mode, TINY + P2V2 + SIX + flags, nproc=NPROC, timeout=TIMEOUT)


def _at_2(src: Path, dst: Path) -> Path:
    """A copy of `src`'s iteration-2 checkpoint as the newest of `dst`."""
    if not dst.exists():
        dst.mkdir()
        shutil.copytree(src / "iter_0000002", dst / "iter_0000002")
        (dst / "latest_checkpointed_iteration.txt").write_text("2")
    return dst


def _resume(mlm: Runner, mode: str, flags: list[str], load: Path, iterations: list[int], ref: Run,
            save: Path | None = None) -> Run:
    extra = flags + ["--load", str(load), "--exit-interval", str(iterations[-1])]
    run = _run(mlm, mode, extra + (_every_2(save) if save is not None else []))
    assert sorted(run.by_iteration()) == iterations, _tail(run.output)
    # Megatron's first log line after a resume averages two iterations (stock too): that line for the first only.
    assert_same_training(run, ref, iterations=iterations, logged=iterations[:1])
    return run


@needs_checkout
@pytest.mark.timeout(2400)
def test_stock_zero3_stock_round_trip_at_data_parallel_2(mlm: Runner, tmp_path_factory: pytest.TempPathFactory):
    """Stock (plain optimizer) at D = 2 saves at 2; breadth-first ZeRO-3 at D = 2 resumes (3-4) and saves at 4;
    stock resumes (5-6): all equal the uninterrupted stock run."""
    ckpts = tmp_path_factory.mktemp("ckpts-dp2")
    ref = _run(mlm, "stock", _every_2(ckpts / "stock"))
    assert ref.iterations() == [1, 2, 3, 4, 5, 6], _tail(ref.output)
    assert "using world size: 4, data-parallel size: 2," in ref.output, _tail(ref.output)
    zero3 = _resume(mlm, "patched", ["--pipeline-schedule", "breadth-first", "--zero-stage", "3"],
                    _at_2(ckpts / "stock", ckpts / "stock-at-2"), [3, 4], ref, save=ckpts / "zero3")
    assert "megatron_bfpp: installed pipeline schedule breadth-first" in zero3.output, _tail(zero3.output)
    _resume(mlm, "stock", [], ckpts / "zero3", [5, 6], ref)
