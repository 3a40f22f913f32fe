"""Training on real text (Megatron's indexed dataset built from a plain-text file) lowers the loss."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.distributed import run_distributed
from tests.support.paths import ROOT

CORPUS = ROOT / "tests" / "support" / "data" / "tiny_corpus.txt"
SCRIPT = ROOT / "scripts" / "text_to_megatron.py"


def _worker(rank: int, world: int, prefix: str) -> list[float]:
    import torch.distributed as dist

    from megatron_bfpp.train import Trainer
    from megatron_bfpp.train.config import parse_trainer_args

    dist.init_process_group("gloo", rank=rank, world_size=world)
    argv = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
            "--global-batch-size 8 --train-iters 25 --lr 1e-2 --lr-warmup-iters 2 --seed 5 --log-interval 100 "
            "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 "
            "--pipeline-schedule breadth-first --zero-stage 2").split() + ["--data-path", prefix]
    trainer = Trainer(parse_trainer_args(argv, world_size=world))
    trainer.run()
    return trainer.losses


@pytest.mark.timeout(600)
def test_loss_falls_on_real_text(run_distributed, subprocesses, tmp_path):
    prefix = str(tmp_path / "corpus")
    subprocess.run([sys.executable, str(SCRIPT), str(CORPUS), prefix], check=True, capture_output=True)
    losses = run_distributed(_worker, 2, prefix)[0]
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.75 * first, losses
