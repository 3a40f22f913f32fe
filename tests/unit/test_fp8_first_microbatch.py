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

import pytest
import torch

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
