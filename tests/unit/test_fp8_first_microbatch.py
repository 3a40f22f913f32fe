"""TransformerEngine's first-micro-batch rules, in its stand-in (tests/support/toy_pipeline.py) and under the runtime.

Megatron marks a step's first micro-batch on TransformerEngine's layers (`set_is_first_microbatch` from
forward_step at micro-batch 0; the layers' `is_first_microbatch` starts True and every forward clears it), and
TransformerEngine then, in that micro-batch (transformer_engine/pytorch/module/linear.py, grouped_linear.py):
- re-quantizes the FP8 weight copy it caches for the later micro-batches (`get_weight_workspace(...,
  cache_name="weight", update_workspace=is_first_microbatch)`, module/base.py), which a missing cache entry
  rebuilds from the current weights;
- overwrites, instead of accumulating, the fused weight gradient in main_grad (`accumulate =
  fuse_wgrad_accumulation and not is_first_microbatch`), at W when the GEMM is deferred.
Hence the schedule invariant (each stage runs micro-batch 0 first in F, B/I and B/W; schedule/validate.py).
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from tests.support import toy_pipeline as toy


def _layer(band: str = "2.10", delay: bool = False, fp8: bool = True) -> toy.DelayedWgradLinear:
    linear = toy.ToyStage(toy.make_config(), 0, 1).linear
    layer = toy.DelayedWgradLinear(linear, delay_wgrad_compute=delay, fuse_wgrad_accumulation=True, version=band,
                                   fp8=fp8)
    layer.weight.main_grad = torch.full_like(layer.weight, 5.0)  # what a previous step left
    return layer


def _wgrad(x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    return dy.reshape(-1, toy.HIDDEN).t() @ x.reshape(-1, toy.HIDDEN)


@pytest.mark.parametrize("delay", [False, True], ids=["at-B", "at-W"])
@pytest.mark.parametrize("band", toy.TE_BANDS)
def test_stand_in_overwrites_the_fused_weight_gradient_at_micro_batch_0(band: str, delay: bool) -> None:
    """Micro-batch 0's weight GEMM writes main_grad, the others add to it: in order the gradient is the sum (what
    was there before is gone); micro-batch 1's backward first is overwritten by micro-batch 0's."""
    xs = [torch.randn(toy.SEQ, toy.MBS, toy.HIDDEN, generator=torch.Generator().manual_seed(m)) for m in range(2)]
    dys = [torch.randn(toy.SEQ, toy.MBS, toy.HIDDEN, generator=torch.Generator().manual_seed(10 + m))
           for m in range(2)]
    for order, want in (([0, 1], _wgrad(xs[0], dys[0]) + _wgrad(xs[1], dys[1])), ([1, 0], _wgrad(xs[0], dys[0]))):
        layer = _layer(band, delay)
        layer.is_first_microbatch = True  # Megatron's set_is_first_microbatch at micro-batch 0
        outs = [layer(x.requires_grad_()) for x in xs]
        assert layer.is_first_microbatch is False
        for m in order:
            outs[m].backward(dys[m])
            if delay:
                layer.backward_dw()
        torch.testing.assert_close(layer.weight.main_grad, want, msg=f"backward order {order}")


def test_stand_in_reuses_the_fp8_weights_of_micro_batch_0_and_rebuilds_a_dropped_copy() -> None:
    """The cached copy made at micro-batch 0 serves the later micro-batches even after the weights changed (what
    a stale cache would compute); at the next micro-batch 0, or when the cache entry is gone, the copy is made
    from the current weights."""
    layer = _layer()
    x = torch.randn(toy.SEQ, toy.MBS, toy.HIDDEN)
    before = layer.weight.detach().clone()
    layer.is_first_microbatch = True
    layer(x)
    assert set(layer._fp8_workspaces) == {"weight"}
    with torch.no_grad():
        layer.weight.add_(1.0)  # an optimizer step the cache has not seen
    torch.testing.assert_close(layer(x), x @ before.t() + layer.bias)
    layer._fp8_workspaces.clear()
    torch.testing.assert_close(layer(x), x @ layer.weight.t() + layer.bias)
    with torch.no_grad():
        layer.weight.add_(1.0)
    layer.is_first_microbatch = True
    torch.testing.assert_close(layer(x), x @ layer.weight.t() + layer.bias)


def test_stand_in_without_fp8_caches_nothing() -> None:
    layer = _layer(fp8=False)
    layer(torch.randn(toy.SEQ, toy.MBS, toy.HIDDEN))
    assert layer._fp8_workspaces == {}


def test_grouped_stand_in_overwrites_the_fused_expert_gradients_at_micro_batch_0() -> None:
    weights, biases = toy.expert_tensors(0)
    layer = toy.DelayedWgradGroupedLinear(weights, biases, toy.M_SPLITS, fuse_wgrad_accumulation=True)
    for w in layer.weights():
        w.main_grad = torch.full_like(w, 5.0)
    xs = [torch.randn(toy.SEQ, toy.MBS, toy.HIDDEN, generator=torch.Generator().manual_seed(m)) for m in range(2)]
    outs = [layer(x) for x in xs]  # the first forward is micro-batch 0 (is_first_microbatch starts True)
    for m in (1, 0):
        outs[m].sum().backward()
        layer.backward_dw()
    x0 = torch.split(xs[0].reshape(-1, toy.HIDDEN), toy.M_SPLITS)
    for i, w in enumerate(layer.weights()):  # micro-batch 0's gradient alone: 1's was overwritten
        torch.testing.assert_close(w.main_grad, torch.ones(toy.HIDDEN, x0[i].shape[0]) @ x0[i])


# ------------------------------------------------------- the runtime with FP8 stand-ins, ZeRO-1 and ZeRO-3


def _train_two_steps(schedule: str, zero: int) -> tuple[dict, dict, list, list]:
    """Two training steps of two FP8 stand-in chunks (P = 1, V = 2, M = 4) in the sharded wrapper at D = 1 with
    the sharded Adam; returns (step-2 gradients {stage: (weight, bias)}, the weights step 2 ran with, the FP8
    weight caches left after each step, memory stats after each step)."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from megatron_bfpp.runtime import get_forward_backward_func
    from megatron_bfpp.sharded import ShardedDataParallel, ShardedOptimizer
    from megatron_bfpp.train import parallel

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel.init_parallel(1, 2, distributed_timeout_seconds=60)
    try:
        cfg = toy.make_transformer_config()
        cfg.fp8 = "hybrid"  # MegatronModule.set_is_first_microbatch marks the TE layers only under FP8
        modules = [toy.DelayedWgradToyStage(cfg, s, 2, fp8=True) for s in range(2)]
        pg = SimpleNamespace(pp=parallel.pp_group(), dp=parallel.dp_group())
        chunks = [ShardedDataParallel(cfg, DistributedDataParallelConfig(), mod, pg_collection=pg, zero_stage=zero,
                                      shard_align=1, param_align=1) for mod in modules]
        opt = ShardedOptimizer(chunks, OptimizerConfig(optimizer="adam", lr=0.05, weight_decay=0.0, clip_grad=0.0),
                               param_groups=[{"params": [p for c in chunks for p in c.parameters()]}])
        caches, stats, weights = [], [], {}
        for step in range(2):
            if step == 1:
                with contextlib.ExitStack() as stack:
                    for c in chunks:
                        stack.enter_context(c.full_params())
                    weights = {s: (m.linear.weight.detach().clone(), m.linear.bias.detach().clone())
                               for s, m in enumerate(modules)}
            for c in chunks:
                c.zero_grad_buffer()
            get_forward_backward_func(schedule)(
                forward_step_func=toy.forward_step, data_iterator=[iter(toy.make_batches(M, seed=step + 1)) for _ in chunks],
                model=chunks, num_microbatches=M, seq_length=toy.SEQ, micro_batch_size=toy.MBS, pg_collection=pg)
            caches.append([dict(m.linear._fp8_workspaces) for m in modules])
            stats.append(opt.memory_stats())
            grads = {s: _weight_and_bias_grads(c) for s, c in enumerate(chunks)}
            if step == 0:
                assert opt.step()[0]
        return grads, weights, caches, stats
    finally:
        parallel.destroy_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def _weight_and_bias_grads(chunk) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk's reduced (weight, bias) gradients: at D = 1 its shard is the whole gradient."""
    b = chunk.flat_buffers[0]
    got = {sl.name: b.gbuf.main_grad_shard[sl.start:sl.end].view(sl.shape).clone() for sl in b.pbuf.layout.slots}
    return got["linear.weight"], got["linear.bias"]


def _reference_grads(weights: dict, batches: list[dict]) -> dict:
    params = {s: (w.clone().requires_grad_(), b.clone().requires_grad_()) for s, (w, b) in weights.items()}
    for batch in batches:
        h = batch["x"]
        for s in sorted(params):
            h = torch.tanh(h @ params[s][0].t() + params[s][1])
        ((h - batch["y"]) ** 2).sum(-1).mean().div(len(batches)).backward()
    return {s: (w.grad, b.grad) for s, (w, b) in params.items()}


M = 4
WEIGHT_COPY_BYTES = 2 * toy.HIDDEN * toy.HIDDEN * 4  # two stages' fp32 weight copies in the stand-in


@pytest.mark.parametrize("schedule, zero", [("breadth-first", 3), ("breadth-first-zb", 3), ("breadth-first", 1)])
def test_fp8_weight_copies_are_counted_and_dropped_at_each_stages_last_release(schedule: str, zero: int) -> None:
    """ZeRO-3: the FP8 weight copies micro-batch 0 makes are counted (peak_fp8_weight_copy_bytes) and dropped at
    each stage's last RELEASE of the step; the next step's micro-batch 0 makes them again from the updated
    weights, so step 2's gradients are those of the weights after step 1. ZeRO-1 (no RELEASE) keeps them, as
    Megatron's own DDP does."""
    grads, weights, caches, stats = _train_two_steps(schedule, zero)
    want = _reference_grads(weights, toy.make_batches(M, seed=2))
    for s in want:
        torch.testing.assert_close(grads[s][0], want[s][0], rtol=1e-5, atol=1e-6, msg=f"stage {s} weight")
        torch.testing.assert_close(grads[s][1], want[s][1], rtol=1e-5, atol=1e-6, msg=f"stage {s} bias")
    for step in range(2):
        assert stats[step]["peak_fp8_weight_copy_bytes"] == WEIGHT_COPY_BYTES, stats[step]
        if zero == 3:
            assert caches[step] == [{}, {}] and stats[step]["fp8_weight_copy_bytes"] == 0
        else:
            assert [set(c) for c in caches[step]] == [{"weight"}, {"weight"}]
            assert stats[step]["fp8_weight_copy_bytes"] == WEIGHT_COPY_BYTES
