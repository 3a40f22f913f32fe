"""Communication and memory accounting of real runs (the trainer's --report-json).

Breadth-first ZeRO-3 all-gathers each stage at most twice and reduce-scatters it once per step, whatever M;
interleaved-1f1b (depth-first) re-enters stages and its counts grow with M / P. ZeRO-3 keeps about 1/D of the
model state resident.
"""

from __future__ import annotations

import pytest

from tests.support.distributed import run_distributed

P, V, D = 2, 3, 2
BASE = ("--num-layers 6 --hidden-size 16 --num-attention-heads 2 --seq-length 8 --max-position-embeddings 8 "
        "--micro-batch-size 1 --train-iters 1 --lr 1e-3 --seed 3 --vocab-size 64 --mock-data "
        "--untie-embeddings-and-output-weights "
        f"--pipeline-model-parallel-size {P} --num-layers-per-virtual-pipeline-stage 1 --log-interval 100").split()
RUNS = [(s, z, m) for s in ("breadth-first", "interleaved-1f1b") for z, m in ((3, P), (3, 4 * P))] + \
       [("breadth-first", 1, P)]


def _worker(rank: int, world: int) -> list:
    import torch.distributed as dist

    from megatron_bfpp.train import parallel
    from megatron_bfpp.train import Trainer
    from megatron_bfpp.train.config import parse_trainer_args

    dist.init_process_group("gloo", rank=rank, world_size=world)
    reports = []
    for schedule, zero, m in RUNS:
        args = parse_trainer_args(BASE + ["--pipeline-schedule", schedule, "--zero-stage", str(zero),
                                          "--global-batch-size", str(m * D)], world_size=world)
        reports.append(Trainer(args).run())
        parallel.destroy_parallel()
    return reports


@pytest.fixture(scope="module")
def reports(run_distributed):
    return run_distributed(_worker, P * D, timeout=600)[0]


def _comm(reports, schedule, zero, m):
    return reports[RUNS.index((schedule, zero, m))]["comm"]


@pytest.mark.timeout(700)
def test_breadth_first_zero3_collectives_do_not_grow_with_microbatches(reports):
    small, big = _comm(reports, "breadth-first", 3, P), _comm(reports, "breadth-first", 3, 4 * P)
    for a, b in zip(small, big):
        # One step: 2V - 2 in the body, and the step boundary's all-gather of the first stage for the next step
        # (whose body then finds it gathered).
        assert a["dp_allgather_calls"] == b["dp_allgather_calls"] == 2 * V - 2 + 1
        assert a["dp_reduce_scatter_calls"] == b["dp_reduce_scatter_calls"] == V
        assert a["dp_allgather_bytes"] == b["dp_allgather_bytes"]


@pytest.mark.timeout(700)
def test_interleaved_zero3_collectives_grow_with_microbatches(reports):
    small, big = _comm(reports, "interleaved-1f1b", 3, P), _comm(reports, "interleaved-1f1b", 3, 4 * P)
    bf = _comm(reports, "breadth-first", 3, 4 * P)
    for a, b, c in zip(small, big, bf):
        assert b["dp_allgather_calls"] > a["dp_allgather_calls"]
        assert b["dp_reduce_scatter_calls"] > a["dp_reduce_scatter_calls"]
        assert b["dp_allgather_calls"] > c["dp_allgather_calls"]


@pytest.mark.timeout(700)
def test_zero3_keeps_a_dth_of_the_model_state(reports):
    z1 = reports[RUNS.index(("breadth-first", 1, P))]["memory"]
    z3 = reports[RUNS.index(("breadth-first", 3, P))]["memory"]
    for a, b in zip(z1, z3):
        # ZeRO-1: full parameters and gradients, optimizer state sharded; ZeRO-3: everything sharded at rest.
        assert a["optimizer_bytes"] == pytest.approx(b["optimizer_bytes"], rel=0.1)
        # At rest ZeRO-3 holds its shards and the first stage's copy gathered for the next step (one buffer).
        assert b["live_weight_buffers"] == 1 and 0 < b["gathered_param_bytes"] < a["param_bytes"] / 2
        assert b["param_bytes"] - b["gathered_param_bytes"] == pytest.approx(a["param_bytes"] / D, rel=0.15)
        assert b["grad_bytes"] <= a["grad_bytes"] / D * 1.15
        assert 0 < b["peak_gathered_param_bytes"] <= a["param_bytes"]
