"""Split backward's placeholder weight gradients (megatron_bfpp/runtime/split_backward.py), single-process.

A weight whose gradient was accumulated into `main_grad` by the layer itself (gradient-accumulation fusion) gets a
placeholder gradient only so that the data-parallel wrapper's hook fires; it is one cached tensor per shape, dtype
and device, handed out as an alias (TransformerEngine's `get_dummy_wgrad`), so no weight-sized tensor is allocated
per W. Megatron's linear (megatron/core/tensor_parallel/layers.py, `LinearWithGradAccumulationAndAsyncCommunication.
backward`) hands a weight marked `zero_out_wgrad` (the tied embedding / output weight at P = 1, set by
language_module.py) a zero-filled placeholder instead, because the hooks then ADD it to `main_grad` (Megatron's DDP:
`not param.grad_added_to_main_grad or param.zero_out_wgrad`; the sharded wrapper likewise): a stale placeholder
would be added into the gradient. Both hold on the two paths that hand out a placeholder: a fused deferred GEMM at
W (`backward_weight`) and a W after another W or B on a chunk with TransformerEngine's delayed weight gradients
(`run_delayed_wgrads`).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

# Imported here, not in the tests: the unit tier counts the CPU time of a test's call, not its module's import.
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.tensor_parallel import layers

from megatron_bfpp.runtime import split_backward as sb
from megatron_bfpp.sharded import ShardedDataParallel

SHAPE = (3, 4)


@pytest.fixture
def placeholders(monkeypatch):
    """A placeholder cache of this test's own, holding a stale (NaN) placeholder of SHAPE, as a reused one holds
    whatever a previous hook left in it."""
    monkeypatch.setattr(sb, "_placeholders", {})
    sb.placeholder_wgrad(SHAPE, torch.float32, torch.device("cpu")).fill_(float("nan"))
    return sb._placeholders


def _cached_storage() -> int:
    return sb._placeholders[(SHAPE, torch.float32, torch.device("cpu"))].untyped_storage().data_ptr()


def _megatron_ddp_hook(seen: list):
    """Megatron's DDP grad hook (distributed_data_parallel.py `_make_backward_post_hook`): adds the gradient
    unless the layer accumulated it itself, and always for `zero_out_wgrad` weights; records what it got."""

    def hook(p: torch.nn.Parameter) -> None:
        seen.append(p.grad)
        if p.grad is not None and (not p.grad_added_to_main_grad or getattr(p, "zero_out_wgrad", False)):
            p.main_grad.add_(p.grad)
        p.grad = None

    return hook


class _DelayingLinear(torch.nn.Module):
    """What `run_delayed_wgrads` sees of a TransformerEngine layer with delay_wgrad_compute and
    gradient-accumulation fusion whose weight got its placeholder at I: `skip_backward_post_hook` on the weight,
    `backward_dw()` leaving `weight.grad` as it finds it and calling the wrapper's hooks
    (`register_wgrad_accumulation_and_reduce_hooks`, as TransformerEngine's module/base.py)."""

    def __init__(self, zero_out_wgrad: bool) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(SHAPE))
        self.weight.skip_backward_post_hook = True
        if zero_out_wgrad:
            self.weight.zero_out_wgrad = True
        self.hooks: list = []
        self.backward_dw_calls = 0

    def register_wgrad_accumulation_and_reduce_hooks(self, hook) -> None:
        self.hooks.append(hook)

    def backward_dw(self) -> None:
        self.backward_dw_calls += 1  # the GEMM went into main_grad at I (fused): nothing queued here
        for hook in self.hooks:
            hook()


def _after_fused_input_grad(weight: torch.nn.Parameter, main_grad_value: torch.Tensor) -> None:
    """The state an I with a fused weight-gradient GEMM leaves: the GEMM in main_grad, the flag set, the weight's
    gradient seen at I (its placeholder, already handed over by the first W: `.grad` is None now)."""
    weight.main_grad.copy_(main_grad_value)
    weight.grad_added_to_main_grad = True
    weight._bfpp_grad_at_i = True
    weight.grad = None


def test_consecutive_ws_hand_a_fused_weight_the_one_cached_placeholder(placeholders):
    """W after W (no I between) on a delaying layer with a fused weight: every W hands the weight the cached
    placeholder (the same storage, no weight-sized allocation per W), and main_grad is left as the I wrote it."""
    m = _DelayingLinear(zero_out_wgrad=False)
    m.weight.main_grad = torch.zeros(SHAPE)
    seen: list = []
    hook = _megatron_ddp_hook(seen)
    m.register_wgrad_accumulation_and_reduce_hooks(lambda: hook(m.weight))
    want = torch.arange(12.0).view(SHAPE)
    _after_fused_input_grad(m.weight, want)
    for _ in range(3):
        sb.run_delayed_wgrads([m])
    assert m.backward_dw_calls == 3 and len(seen) == 3
    # `seen` keeps every gradient alive: a new tensor per W would have a storage of its own.
    assert [g.untyped_storage().data_ptr() for g in seen] == [_cached_storage()] * 3
    assert all(g.shape == SHAPE and g.dtype == torch.float32 for g in seen)
    torch.testing.assert_close(m.weight.main_grad, want, rtol=0, atol=0)


@pytest.mark.parametrize("wrapper", ["megatron-ddp-hook", "sharded"])
def test_consecutive_ws_give_a_zero_out_wgrad_weight_a_zero_placeholder(placeholders, wrapper):
    """The tied embedding at P = 1 (`zero_out_wgrad`): its hooks add the placeholder into main_grad, so a W
    after W hands it the cached placeholder filled with zeros; a stale one would be added to the gradient. Under
    Megatron's DDP hook and under the sharded wrapper (the weight replicated as a tied embedding, D = 1)."""
    m = _DelayingLinear(zero_out_wgrad=True)
    seen: list = []
    if wrapper == "sharded":
        m.weight.shared_embedding = True
        chunk = ShardedDataParallel(SimpleNamespace(calculate_per_token_loss=False), DistributedDataParallelConfig(),
                                    m, pg_collection=SimpleNamespace(dp_cp=object()), zero_stage=1)
        assert chunk.owned_replicated_params == [m.weight] and len(m.hooks) == 1  # the wrapper's own hook
        chunk.zero_grad_buffer()
        real = m.hooks[0]
        m.hooks[0] = lambda: (seen.append(m.weight.grad), real())
    else:
        m.weight.main_grad = torch.zeros(SHAPE)
        hook = _megatron_ddp_hook(seen)
        m.register_wgrad_accumulation_and_reduce_hooks(lambda: hook(m.weight))
    want = torch.arange(12.0).view(SHAPE)
    _after_fused_input_grad(m.weight, want)
    for _ in range(2):
        sb.run_delayed_wgrads([m])
    assert len(seen) == 2 and all(g is not None and g.untyped_storage().data_ptr() == _cached_storage() for g in seen)
    torch.testing.assert_close(m.weight.main_grad, want, rtol=0, atol=0)


def _wgrad_kernel_stand_in():
    """apex's fused_weight_gradient_mlp_cuda, on CPU: main_grad += grad_output^T @ input (2-D operands)."""

    def accumulate(total_input, grad_output, main_grad):
        main_grad.add_(grad_output.t().matmul(total_input).to(main_grad.dtype))

    return SimpleNamespace(wgrad_gemm_accum_fp32=accumulate, wgrad_gemm_accum_fp16=accumulate)


def test_fused_w_gives_a_zero_out_wgrad_weight_a_zero_placeholder(placeholders, monkeypatch):
    """A fused deferred GEMM at W on a `zero_out_wgrad` weight, as Megatron's linear backward: main_grad gets
    the GEMM and the hook adds the placeholder, which is the cached one filled with zeros; a plain watched weight
    gets the same cached placeholder as it is (not re-filled: its hook skips it)."""
    monkeypatch.setattr(layers, "fused_weight_gradient_mlp_cuda", _wgrad_kernel_stand_in(), raising=False)
    tied, plain = torch.nn.Parameter(torch.zeros(SHAPE)), torch.nn.Parameter(torch.zeros(SHAPE))
    tied.zero_out_wgrad = True
    seen: list = []
    for w in (tied, plain):
        w.main_grad = torch.zeros(SHAPE)
        w.grad_added_to_main_grad = False
        w.register_post_accumulate_grad_hook(_megatron_ddp_hook(seen))
    torch.manual_seed(0)
    x, g = torch.randn(2, 4), torch.randn(2, 3)
    for _ in range(2):
        sb.backward_weight(sb.PendingWeightGrad([], deferred=[sb.DeferredWeightGrad(tied, x, g, fused=True)]))
    assert len(seen) == 2 and all(s.untyped_storage().data_ptr() == _cached_storage() for s in seen)
    torch.testing.assert_close(tied.main_grad, 2 * g.t() @ x, rtol=1e-6, atol=1e-7)
    sb.backward_weight(sb.PendingWeightGrad([], deferred=[sb.DeferredWeightGrad(plain, x, g, fused=True)]))
    torch.testing.assert_close(plain.main_grad, g.t() @ x, rtol=1e-6, atol=1e-7)
