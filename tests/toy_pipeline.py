"""A tiny stage model with Megatron's model-chunk surface (config, set_input_tensor) for runtime tests.

Stage s is `tanh(Linear_s(x))`; the first stage reads x from the batch, the last stage returns a per-token
squared-error loss in Megatron 0.19's 3-tuple form (loss_sum, num_tokens, {"lm loss": ...}).
"""

from __future__ import annotations

import queue
from functools import partial

import torch
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

HIDDEN, SEQ, MBS = 8, 4, 2


def make_config(**kw) -> ModelParallelConfig:
    cfg = ModelParallelConfig(pipeline_dtype=torch.float32, deallocate_pipeline_outputs=True, **kw)
    cfg.hidden_size = HIDDEN
    cfg.calculate_per_token_loss = False
    return cfg


def make_transformer_config() -> TransformerConfig:
    """make_config's settings as the TransformerConfig a Megatron-Core module carries."""
    return TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=1, pipeline_dtype=torch.float32,
                             deallocate_pipeline_outputs=True, calculate_per_token_loss=False)


class ToyStage(torch.nn.Module):
    def __init__(self, config, stage: int, num_stages: int, seed: int = 0):
        super().__init__()
        self.config = config
        self.stage, self.num_stages = stage, num_stages
        self.pre_process, self.post_process = stage == 0, stage == num_stages - 1
        g = torch.Generator().manual_seed(seed * 1000 + stage)
        self.linear = torch.nn.Linear(HIDDEN, HIDDEN)
        with torch.no_grad():
            self.linear.weight.copy_(torch.randn(HIDDEN, HIDDEN, generator=g) / HIDDEN**0.5)
            self.linear.bias.copy_(torch.randn(HIDDEN, generator=g) * 0.1)
        self.input_tensor = None

    def set_input_tensor(self, t):
        self.input_tensor = t[0] if isinstance(t, list) else t

    def forward(self, x):
        inp = x if self.pre_process else self.input_tensor
        return torch.tanh(self.linear(inp))


class _SelfAccumulatingLinear(torch.autograd.Function):
    """x W^T + b whose backward adds the weight gradient into `weight.main_grad` itself and returns none for
    the weight, as TransformerEngine's layers and Megatron's fused gradient accumulation do."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x)
        ctx.weight = weight  # the Parameter itself, which carries main_grad
        return x @ weight.t() + bias

    @staticmethod
    def backward(ctx, g):
        (x,), weight = ctx.saved_tensors, ctx.weight
        g2 = g.reshape(-1, g.shape[-1])
        weight.main_grad.add_(g2.t() @ x.reshape(-1, x.shape[-1]))
        return g @ weight, None, g2.sum(0)


class _MegatronToyStage(MegatronModule):
    """ToyStage as a Megatron-Core module (same weights); subclasses change how its linear runs (`_linear`)."""

    def __init__(self, config, stage: int, num_stages: int, seed: int = 0):
        super().__init__(config)
        toy = ToyStage(config, stage, num_stages, seed)
        self.stage, self.num_stages = stage, num_stages
        self.pre_process, self.post_process = toy.pre_process, toy.post_process
        self.linear = toy.linear
        self.input_tensor = None

    set_input_tensor = ToyStage.set_input_tensor

    def _linear(self, inp):
        raise NotImplementedError

    def forward(self, x):
        return torch.tanh(self._linear(x if self.pre_process else self.input_tensor))


class SelfAccumulatingToyStage(_MegatronToyStage):
    """A toy stage whose linear accumulates its weight gradient into `main_grad` in its own backward (read the
    weight's gradient there, the bias's in `.grad`), as a TransformerEngine module without delayed weight
    gradients does; it carries TransformerEngine's `fuse_wgrad_accumulation` as they do."""

    def __init__(self, config, stage: int, num_stages: int, seed: int = 0):
        super().__init__(config, stage, num_stages, seed)
        self.linear.weight.main_grad = torch.zeros_like(self.linear.weight)
        self.linear.fuse_wgrad_accumulation = True

    def _linear(self, inp):
        return _SelfAccumulatingLinear.apply(inp, self.linear.weight, self.linear.bias)


# --- A stand-in for TransformerEngine's Linear with delayed weight gradients (delay_wgrad_compute) -------------
# It models, per version band it claims, what TransformerEngine's sources do (module/base.py get_dummy_wgrad and
# TransformerEngineBaseModule.backward_dw; module/_common.py WeightGradStore; module/linear.py Linear.__init__,
# Linear.forward and _Linear.backward; LayerNormLinear and LayerNormMLP follow the same rules). Bands:
# "2.7" (2.7), "2.8" (2.8 and 2.9), "2.10" (>= 2.10). Older releases (2.3-2.6) have no
# wgrad_accumulation_and_reduce_hooks and are refused by the plugin's install. Lines, in NVIDIA/TransformerEngine
# at tag v2.8 unless said: module/base.py backward_dw 1480-1499 (v2.7: 1420-1440, weight.grad set only when None;
# v2.10: 1493-1512, behind need_backward_dw 1484), get_dummy_wgrad 107, grad_output_preprocess 1131-1196;
# module/_common.py WeightGradStore 217, pop 269; module/linear.py _Linear.backward: main_grad read 505, bias
# gradient 594 and the wgrad GEMM's "bias" argument 847, queued GEMM 885, "Handle custom DDP from mcore" 931-952;
# Linear.__init__ skip_backward_post_hook 1325; Linear.forward bias argument 1447, return_bias 1486.
TE_BANDS = ("2.7", "2.8", "2.10")

_dummy_wgrads: dict[tuple, torch.Tensor] = {}


def get_dummy_wgrad(shape: list, dtype: torch.dtype, zero: bool = False) -> torch.Tensor:
    """module/base.py get_dummy_wgrad: one cached tensor per (shape, dtype), handed out as `.detach()`; refilled
    with zeros when `zero`. TransformerEngine allocates it with torch.empty (contents undefined): NaN here, so a
    placeholder wrongly added to a gradient shows."""
    key = (*shape, dtype)
    if key not in _dummy_wgrads:
        _dummy_wgrads[key] = torch.full(shape, float("nan"), dtype=dtype)
    if zero:
        _dummy_wgrads[key].fill_(0)
    return _dummy_wgrads[key].detach()


class WeightGradStore:
    """module/_common.py WeightGradStore: a FIFO of (tensor_list, func); pop() runs the oldest and returns
    (func(*tensor_list), tensor_list), and raises on an empty queue."""

    def __init__(self, delay_wgrad_compute: bool) -> None:
        self.context: queue.Queue | None = queue.Queue() if delay_wgrad_compute else None
        self.enabled = delay_wgrad_compute

    def delay_wgrad_compute(self) -> bool:
        return self.enabled

    def put(self, tensor_list: list, func) -> None:
        assert self.enabled, "delay_wgrad_compute is not enabled"
        self.context.put([tensor_list, func])

    def pop(self):
        assert self.enabled, "delay_wgrad_compute is not enabled"
        if self.context.qsize() > 0:
            tensor_list, func = self.context.get()
            return func(*tensor_list), tensor_list
        raise RuntimeError("Pop empty queue.")


class _Linear(torch.autograd.Function):
    """module/linear.py _Linear with bias handling and wgrad as TransformerEngine's (2.7 ... 2.20 alike):
    - `bias` is None unless the module applies it inside (Linear.forward passes `bias_tensor if (self.apply_bias
      and not self.gemm_bias_unfused_add) else None`; `apply_bias = bias and not return_bias`);
      ctx.use_bias = bias is not None.
    - The bias gradient is computed at I under FP8 (grad_output_preprocess: "bgrad only if wgrad is in FP8,
      otherwise it is fused with wgrad"), else fused into the wgrad GEMM (`"bias": bias if (grad_bias is None
      and not ctx.fp8) else None`): with the delay, backward_dw's bgrad is None whenever the bias's gradient was
      computed at I or the bias was not passed in.
    - `main_grad = ctx.main_grad_func()` is read at the top of the backward (at I) and is the GEMM's `out`
      (accumulate) under fuse_wgrad_accumulation, also when the GEMM is queued.
    - "Handle custom DDP from mcore": with fuse_wgrad_accumulation and a weight carrying grad_added_to_main_grad,
      the flag is set and the weight's gradient is get_dummy_wgrad(...) (zeros with zero_out_wgrad); fused
      without it, None; unfused and delayed, None (the GEMM runs in backward_dw)."""

    @staticmethod
    def forward(ctx, weight, inp, bias, module):
        ctx.save_for_backward(inp, weight)
        ctx.bias, ctx.use_bias, ctx.module = bias, bias is not None, module
        out = inp @ weight.t()
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, grad_output):
        inp, weight = ctx.saved_tensors
        m = ctx.module
        param = m.weight  # the Parameter (weight.main_grad, weight.grad_added_to_main_grad)
        main_grad = param.main_grad if m.fuse_wgrad_accumulation else None
        x, dy = inp.reshape(-1, inp.shape[-1]), grad_output.reshape(-1, grad_output.shape[-1])
        grad_bias = dy.sum(0) if (m.fp8 and ctx.use_bias) else None  # grad_output_preprocess
        gemm_bias = ctx.use_bias and grad_bias is None and not m.fp8

        @torch.no_grad()  # TransformerEngine's GEMM is not recorded by autograd
        def wgrad_gemm(x, dy):
            dw = dy.t() @ x
            if main_grad is not None:  # out=main_grad, accumulate=True
                dw = main_grad.add_(dw)
            return dw, (dy.sum(0) if gemm_bias else None)

        dgrad = grad_output @ weight
        wgrad = None
        if m.wgrad_store.delay_wgrad_compute():
            m.wgrad_store.put([x, dy], wgrad_gemm)
        else:
            wgrad, grad_bias_ = wgrad_gemm(x, dy)
            if grad_bias is None:
                grad_bias = grad_bias_
        if not ctx.use_bias:
            grad_bias = None
        if m.fuse_wgrad_accumulation and hasattr(param, "grad_added_to_main_grad"):
            param.grad_added_to_main_grad = True
            wgrad = get_dummy_wgrad(list(main_grad.shape), param.dtype, zero=getattr(param, "zero_out_wgrad", False))
        elif m.fuse_wgrad_accumulation:
            wgrad = None
        return wgrad, dgrad, grad_bias, None


class DelayedWgradLinear(torch.nn.Module):
    """TransformerEngine's Linear (one weight, one bias) at a version band, with `return_bias` (Megatron's
    te_return_bias: the bias is returned for the caller to add, so its gradient flows through autograd at I) and
    `fp8` (the bias gradient at I, see _Linear)."""

    def __init__(self, linear: torch.nn.Linear, delay_wgrad_compute: bool = True, fuse_wgrad_accumulation: bool = False,
                 version: str = "2.10", return_bias: bool = False, fp8: bool = False):
        super().__init__()
        assert version in TE_BANDS, version
        self.weight, self.bias = linear.weight, linear.bias
        self.version = version
        self.fuse_wgrad_accumulation, self.return_bias, self.fp8 = fuse_wgrad_accumulation, return_bias, fp8
        self.use_bias, self.apply_bias = True, not return_bias
        self.weight_names, self.bias_names = ["weight"], ["bias"]
        self.wgrad_store = WeightGradStore(delay_wgrad_compute)
        self.wgrad_accumulation_and_reduce_hooks: list = []
        self.backward_dw_calls = 0
        # Linear.__init__: "if self.wgrad_store.delay_wgrad_compute(): ... param.skip_backward_post_hook = True"
        if self.wgrad_store.delay_wgrad_compute():
            for name, param in self.named_parameters():
                if name in self.weight_names or name in self.bias_names:
                    param.skip_backward_post_hook = True
        if version == "2.10":  # need_backward_dw() exists from 2.10 on
            self.need_backward_dw = self.wgrad_store.delay_wgrad_compute

    def forward(self, x):
        out = _Linear.apply(self.weight, x, self.bias if self.apply_bias else None, self)
        return (out, self.bias) if self.return_bias else out  # Linear.forward: "if self.return_bias: ..."

    def register_wgrad_accumulation_and_reduce_hooks(self, hook) -> None:
        self.wgrad_accumulation_and_reduce_hooks.append(hook)

    def backward_dw(self) -> None:
        """module/base.py TransformerEngineBaseModule.backward_dw of the band."""
        if not self.wgrad_store.delay_wgrad_compute():  # >= 2.10: `if not self.need_backward_dw()`, the same
            return
        self.backward_dw_calls += 1
        (wgrad, bgrad), _ = self.wgrad_store.pop()
        if not self.fuse_wgrad_accumulation:
            if self.version == "2.7":  # 2.7: "if weight_tensor.grad is None: weight_tensor.grad = wgrad.to(...)"
                if self.weight.grad is None:
                    self.weight.grad = wgrad.to(self.weight.dtype)
            else:  # 2.8 on: unconditionally
                self.weight.grad = wgrad.to(self.weight.dtype)
        if self.use_bias:
            if self.bias.grad is None:  # all bands; AttributeError when bgrad is None, as TransformerEngine's
                self.bias.grad = bgrad.to(self.bias.dtype)
        del wgrad, bgrad
        for hook in self.wgrad_accumulation_and_reduce_hooks:
            hook()


class DelayedWgradToyStage(_MegatronToyStage):
    """A toy stage whose linear is the TransformerEngine stand-in above; with `return_bias` the stage adds the
    returned bias itself, as Megatron's bias-dropout-add does with te_return_bias."""

    def __init__(self, config, stage: int, num_stages: int, seed: int = 0, fuse_wgrad_accumulation: bool = False,
                 version: str = "2.10", return_bias: bool = False, fp8: bool = False):
        super().__init__(config, stage, num_stages, seed)
        self.linear = DelayedWgradLinear(self.linear, fuse_wgrad_accumulation=fuse_wgrad_accumulation,
                                         version=version, return_bias=return_bias, fp8=fp8)

    def _linear(self, inp):
        out = self.linear(inp)
        if self.linear.return_bias:
            out, bias = out
            out = out + bias
        return out


def make_batches(num: int, seed: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(SEQ, MBS, HIDDEN, generator=g), "y": torch.randn(SEQ, MBS, HIDDEN, generator=g)}
            for _ in range(num)]


def _loss(y, output):
    err = ((output - y) ** 2).sum(-1)  # per token
    loss_sum = err.sum()
    n = torch.tensor(err.numel(), dtype=torch.int)
    return loss_sum, n, {"lm loss": torch.stack([loss_sum.detach(), n.float()])}


def forward_step(data_iterator, model):
    stage = model if hasattr(model, "pre_process") else model.module  # Megatron's DDP forwards no attributes
    batch = next(data_iterator) if (stage.pre_process or stage.post_process) else None
    out = model(batch["x"] if stage.pre_process else None)
    return out, partial(_loss, batch["y"] if stage.post_process else None)


def reference(num_stages: int, batches: list[dict], seed: int = 0):
    """Single process: per-micro-batch loss (Megatron normalisation) and gradients per stage."""
    cfg = make_config()
    stages = [ToyStage(cfg, s, num_stages, seed) for s in range(num_stages)]
    losses = []
    m = len(batches)
    for b in batches:
        h = b["x"]
        for st in stages:
            h = torch.tanh(st.linear(h))
        loss_sum, n, _ = _loss(b["y"], h)
        (loss_sum / n / m).backward()
        losses.append(float(loss_sum / n))
    grads = {s: (st.linear.weight.grad.clone(), st.linear.bias.grad.clone()) for s, st in enumerate(stages)}
    return losses, grads
