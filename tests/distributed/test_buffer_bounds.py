"""Live full-size buffers stay within the schedule's bounds in real multi-process trainer runs.

D = 2, P = 2, V = 3 (three chunks per rank, so two buffers can be exceeded), breadth-first with ZeRO-2 and
ZeRO-3 (two gradient buffers, and one) and interleaved-1f1b with ZeRO-3: the number of chunks holding a full gradient buffer never exceeds
`--bfpp-grad-buffers`, and (ZeRO-3) the number holding gathered weights never exceeds `--bfpp-weight-buffers`.
The figures are high-water marks kept by the flat buffers themselves as they allocate and free their storage
(`max_grad_buffers` / `max_weight_buffers` in the trainer's `--report-json` memory block), over the whole run.

A full gradient buffer is freed when its reduce-scatter is waited on; without the wait for the oldest
in-flight reduce before a new buffer is allocated, breadth-first holds V buffers at the end of the backward
pass (every stage's reduce still in flight), which this test catches.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.support.distributed import run_distributed

P, D, V = 2, 2, 3
WEIGHT_BUFFERS, GRAD_BUFFERS = 2, 2
BASE = ("--num-layers 6 --hidden-size 16 --num-attention-heads 2 --seq-length 8 --max-position-embeddings 8 "
        "--micro-batch-size 1 --global-batch-size 8 --train-iters 2 --lr 1e-2 --lr-decay-style constant "
        "--seed 3 --vocab-size 64 --mock-data --log-interval 100 "
        f"--pipeline-model-parallel-size {P} --num-layers-per-virtual-pipeline-stage 1").split()
RUNS = [("breadth-first", 2, GRAD_BUFFERS), ("breadth-first", 3, GRAD_BUFFERS), ("interleaved-1f1b", 3, GRAD_BUFFERS),
        ("breadth-first", 3, 1)]


def _worker(rank: int, world: int, out_dir: str) -> list:
    import torch.distributed as dist

    from megatron_bfpp.train import parallel
    from megatron_bfpp.train import Trainer
    from megatron_bfpp.train.config import parse_trainer_args

    dist.init_process_group("gloo", rank=rank, world_size=world)
    reports = []
    for i, (schedule, zero, grad_buffers) in enumerate(RUNS):
        path = os.path.join(out_dir, f"run{i}.json")
        extra = ["--pipeline-schedule", schedule, "--zero-stage", str(zero), "--bfpp-grad-buffers",
                 str(grad_buffers), "--report-json", path]
        if zero == 3:
            extra += ["--bfpp-weight-buffers", str(WEIGHT_BUFFERS)]
        args = parse_trainer_args(BASE + extra, world_size=world)
        Trainer(args).run()
        parallel.destroy_parallel()
        dist.barrier()
        if rank == 0:
            with open(path) as f:
                reports.append(json.load(f))
    return reports


@pytest.fixture(scope="module")
def reports(run_distributed, tmp_path_factory):
    out = tmp_path_factory.mktemp("bounds")
    return run_distributed(_worker, P * D, str(out), timeout=300)[0]


@pytest.mark.timeout(360)
@pytest.mark.parametrize("run", range(len(RUNS)), ids=[f"{s}-z{z}-g{g}" for s, z, g in RUNS])
def test_live_buffers_within_bounds(reports, run):
    schedule, zero, grad_buffers = RUNS[run]
    memory = reports[run]["memory"]
    assert len(memory) == P * D
    for m in memory:
        where = f"rank {m['rank']} ({schedule}, ZeRO-{zero})"
        assert m["grad_buffers_limit"] == grad_buffers, where
        assert 1 <= m["max_grad_buffers"] <= grad_buffers, f"{where}: {m['max_grad_buffers']} full gradient buffers"
        assert m["live_grad_buffers"] == 0, f"{where}: full gradient buffers left after the step"
        if zero == 3:
            assert m["weight_buffers_limit"] == WEIGHT_BUFFERS, where
            assert 1 <= m["max_weight_buffers"] <= WEIGHT_BUFFERS, \
                f"{where}: {m['max_weight_buffers']} gathered weight buffers"
            # The step boundary gathers the first stage for the next iteration's first forward; nothing else.
            assert m["live_weight_buffers"] == 1, f"{where}: {m['live_weight_buffers']} gathered after the step"
        else:
            assert m["weight_buffers_limit"] is None and m["live_weight_buffers"] == V, where  # resident


@pytest.mark.timeout(360)
def test_breadth_first_uses_its_buffers(reports):
    """The bound is met, not avoided: breadth-first overlaps a stage's reduce with the next stage's backward,
    so two gradient buffers are live at once (and ZeRO-3 prefetches the next stage's weights)."""
    for run in (RUNS.index(("breadth-first", 2, GRAD_BUFFERS)), RUNS.index(("breadth-first", 3, GRAD_BUFFERS))):
        for m in reports[run]["memory"]:
            assert m["max_grad_buffers"] == GRAD_BUFFERS
            if RUNS[run][1] == 3:
                assert m["max_weight_buffers"] == WEIGHT_BUFFERS


def _dp_group():
    import torch.distributed as dist

    if not dist.is_initialized():
        return object()  # D = 1 without a process group: the collectives degenerate to copies
    if dist.get_world_size() == 1:
        return dist.group.WORLD
    pytest.skip("a multi-process world is initialized in this process")


@pytest.mark.parametrize("limit", [None, 1, 2])
def test_driver_limit_waits_for_the_oldest_reduce(limit):
    """In-process, D = 1, ZeRO-2, three chunks run backward breadth-first (last stage first), each reduced
    right after its backward: the driver's limit (as the runtime sets it from the schedule) caps the live full
    gradient buffers by waiting on the oldest reduce; without a limit all three stay live until finish_step.
    The gradients are the same either way."""
    from types import SimpleNamespace

    import torch
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_bfpp.sharded import ShardedDataParallel, ShardedDriver

    torch.manual_seed(0)
    mods = [torch.nn.Linear(4, 4) for _ in range(3)]
    ref = [[p.detach().clone() for p in m.parameters()] for m in mods]
    pg = SimpleNamespace(dp_cp=_dp_group())
    chunks = [ShardedDataParallel(SimpleNamespace(), DistributedDataParallelConfig(), m, pg_collection=pg,
                                  zero_stage=2) for m in mods]
    driver = ShardedDriver(chunks)
    driver.set_buffer_limits(2, limit)
    for c in chunks:
        c.zero_grad_buffer()
    x = torch.randn(2, 4)
    live = []
    for i in (2, 1, 0):
        driver.before_backward(i)
        chunks[i].module(x).pow(2).sum().backward()
        driver.reduce(i)
        live.append(driver.budget.grads.live)
    driver.finish_step()
    stats = driver.memory_stats()
    assert stats["grad_buffers_limit"] == limit and stats["weight_buffers_limit"] is None  # ZeRO-2: resident
    assert stats["max_grad_buffers"] == (3 if limit is None else limit)
    assert live == ([1, 2, 3] if limit is None else [1, min(2, limit), limit])
    assert stats["live_grad_buffers"] == 0
    for c, params in zip(chunks, ref):
        params = [p.requires_grad_() for p in params]
        expect = torch.autograd.grad(torch.nn.functional.linear(x, *params).pow(2).sum(), params)
        gbuf = c.flat_buffers[0].gbuf
        for slot, g in zip(gbuf.layout.slots, expect):  # D = 1: the shard is the whole buffer
            torch.testing.assert_close(gbuf.main_grad_shard[slot.start:slot.end].view(slot.shape), g)
