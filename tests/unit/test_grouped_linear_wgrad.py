"""TransformerEngine GroupedLinear (MoE experts) with delayed weight gradients under the split-backward schedules.

From 2.8 on, TransformerEngine's GroupedLinear without gradient-accumulation fusion hands autograd, at I, the
weight-gradient buffers its queued GEMM fills only at W (tests/support/toy_pipeline.py's stand-in cites the lines): each
expert weight would hold an expert-sized `.grad` of undefined contents from I to W, which backward_dw then
overwrites. The plugin drops those at I (split_backward.py `_drop_unfilled_wgrads_at_input_grad`): between I and W
no expert weight holds a gradient, and the gradients W delivers equal the reference. Runs the plugin's runtime
in this process (P = 1, two chunks) under Megatron-Core's own DDP (on CPU), which takes the gradients through
the layers' weight-gradient hooks as with TransformerEngine.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

# Imported here, not in the tests: a unit test's call must stay short.
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

from megatron_bfpp.train import parallel
from megatron_bfpp.runtime import get_forward_backward_func
from megatron_bfpp.sharded import ShardedDataParallel
from tests.support import toy_pipeline as toy
from tests.support.megatron_ddp_cpu_shim import megatron_ddp_on_cpu

M = 4


def _run(schedule: str, band: str, fused: bool, bias: bool, wrapper: str) -> tuple[dict, list]:
    """Train one step of two GroupedToyStage chunks (P = 1, V = 2) in `wrapper` ("megatron-ddp" or "zero-N", the
    sharded wrapper at D = 1); returns ({stage: {name: gradient}}, [(stage, weight .grad sizes when backward_dw
    starts)] for every W / B)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel.init_parallel(1, 2, distributed_timeout_seconds=60)
    try:
        cfg = toy.make_transformer_config()
        cfg.gradient_accumulation_fusion = fused
        modules = [toy.GroupedToyStage(cfg, s, 2, bias=bias, fuse_wgrad_accumulation=fused, version=band)
                   for s in range(2)]
        seen: list = []
        for s, mod in enumerate(modules):
            grouped, original = mod.linear, mod.linear.backward_dw

            def backward_dw(grouped=grouped, original=original, s=s):
                seen.append((s, [None if w.grad is None else w.grad.numel() for w in grouped.weights()]))
                original()

            grouped.backward_dw = backward_dw
        pg = SimpleNamespace(pp=parallel.pp_group(), dp=parallel.dp_group())
        with megatron_ddp_on_cpu():
            if wrapper == "megatron-ddp":
                ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=True, delay_wgrad_compute=True)
                chunks = [DistributedDataParallel(cfg, ddp_config, mod, disable_bucketing=i > 0)
                          for i, mod in enumerate(modules)]
                cfg.no_sync_func = [ch.no_sync for ch in chunks]
                cfg.grad_sync_func = [ch.start_grad_sync for ch in chunks]
            else:
                chunks = [ShardedDataParallel(cfg, DistributedDataParallelConfig(), mod, pg_collection=pg,
                                              zero_stage=int(wrapper[-1]), shard_align=1, param_align=1)
                          for mod in modules]
            for ch in chunks:
                ch.zero_grad_buffer()
            get_forward_backward_func(schedule)(
                forward_step_func=toy.forward_step, data_iterator=[iter(toy.make_batches(M)) for _ in chunks],
                model=chunks, num_microbatches=M, seq_length=toy.SEQ, micro_batch_size=toy.MBS, pg_collection=pg)
            if wrapper == "megatron-ddp":
                for ch in chunks:
                    ch.finish_grad_sync()
        if wrapper == "megatron-ddp":
            grads = {s: {n: p.main_grad.detach().clone() for n, p in mod.linear.named_parameters()}
                     for s, mod in enumerate(modules)}
        else:  # D = 1: the shard is the whole gradient
            grads = {s: {sl.name.removeprefix("linear."): ch.flat_buffers[0].gbuf.main_grad_shard[sl.start:sl.end]
                         .view(sl.shape).clone() for sl in ch.flat_buffers[0].pbuf.layout.slots}
                     for s, ch in enumerate(chunks)}
        for s, mod in enumerate(modules):
            assert (mod.linear.backward_dw_calls, mod.linear.wgrad_store.context.qsize()) == (M, 0), s
        return grads, seen
    finally:
        parallel.destroy_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


# (schedule, band, fused, bias, wrapper); breadth-first-zb at P = 1 runs a chunk's four I's before its W's (W
# after W); ZeRO-3 keeps the weights' storage empty at rest.
CASES = [("breadth-first-zb", "2.10", False, True, "megatron-ddp"),
         ("interleaved-zb", "2.8", False, False, "megatron-ddp"),
         ("breadth-first-zb", "2.7", False, True, "megatron-ddp"),
         ("interleaved-zb", "2.10", True, True, "megatron-ddp"),
         ("breadth-first-zb", "2.8", True, False, "megatron-ddp"),
         ("breadth-first-zb", "2.10", False, True, "zero-3"),
         ("interleaved-zb", "2.8", False, True, "zero-1")]


@pytest.mark.parametrize("schedule, band, fused, bias, wrapper", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_no_expert_weight_holds_a_gradient_from_i_to_w(schedule, band, fused, bias, wrapper) -> None:
    """Unfused: every backward_dw (W, or after a B) finds no expert weight holding a gradient (TransformerEngine
    >= 2.8 handed autograd the unfilled buffers at I); all: the gradients equal the reference."""
    grads, seen = _run(schedule, band, fused, bias, wrapper)
    assert len(seen) == 2 * M
    if not fused:  # TransformerEngine >= 2.8 handed autograd the unfilled buffers: nothing may stay held
        assert all(sizes == [None] * toy.EXPERTS for _, sizes in seen), seen
    ref = toy.grouped_reference(2, toy.make_batches(M), bias=bias)
    for s in range(2):
        assert set(grads[s]) == set(ref[s])
        for name, want in ref[s].items():
            torch.testing.assert_close(grads[s][name], want, rtol=1e-5, atol=1e-6,
                                       msg=f"{schedule} {band} {wrapper} stage {s} {name}")


def test_stand_in_hands_unfilled_buffers_to_autograd_from_2_8() -> None:
    """The stand-in as TransformerEngine: after a plain backward (no plugin), an unfused delayed expert weight
    holds an expert-sized gradient of undefined contents from 2.8 on (None in 2.7); backward_dw replaces it with
    the GEMM's result."""
    for band, held in (("2.7", False), ("2.8", True), ("2.10", True)):
        weights, biases = toy.expert_tensors(0)
        layer = toy.DelayedWgradGroupedLinear(weights, biases, toy.M_SPLITS, version=band)
        x = torch.randn(toy.SEQ, toy.MBS, toy.HIDDEN)
        layer(x).sum().backward()
        grads = [w.grad for w in layer.weights()]
        assert all((g is not None and g.shape == w.shape and g.isnan().all()) if held else g is None
                   for g, w in zip(grads, weights)), (band, grads)
        layer.backward_dw()
        xs = torch.split(x.reshape(-1, toy.HIDDEN), toy.M_SPLITS)
        for w, xi in zip(layer.weights(), xs):
            torch.testing.assert_close(w.grad, torch.ones(xi.shape[0], toy.HIDDEN).t() @ xi)
