"""A tiny stage model with Megatron's model-chunk surface (config, set_input_tensor) for runtime tests.

Stage s is `tanh(Linear_s(x))`; the first stage reads x from the batch, the last stage returns a per-token
squared-error loss in Megatron 0.19's 3-tuple form (loss_sum, num_tokens, {"lm loss": ...}).
"""

from __future__ import annotations

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


class _DelayedWgradLinearFunction(torch.autograd.Function):
    """TransformerEngine's linear backward with delay_wgrad_compute, reduced to its protocol: the input gradient
    now; the weight-gradient GEMM queued (with main_grad bound now when fused, as TransformerEngine binds it) for
    the module's backward_dw(); no gradient for the weight or bias from autograd (a dummy weight gradient with
    grad_added_to_main_grad when fused)."""

    @staticmethod
    def forward(ctx, x, weight, bias, module):
        ctx.save_for_backward(x, weight)
        ctx.module = module
        return x @ weight.t() + bias

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        m = ctx.module
        main_grad = m.weight.main_grad if m.fuse_wgrad_accumulation else None

        @torch.no_grad()  # TransformerEngine's GEMM is not recorded by autograd
        def wgrad_gemm(x2, g2):
            dw = g2.t() @ x2
            if main_grad is not None:
                main_grad.add_(dw)
            return dw, g2.sum(0)

        x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
        dgrad = g @ weight
        if m.delay_wgrad_compute:
            m.wgrad_queue.append(((x2, g2), wgrad_gemm))
            dw = db = None
        else:
            dw, db = wgrad_gemm(x2, g2)
        if m.fuse_wgrad_accumulation:
            m.weight.grad_added_to_main_grad = True
            dw = torch.zeros_like(weight)
        return dgrad, dw, db, None


class DelayedWgradLinear(torch.nn.Module):
    """A linear with TransformerEngine's delayed weight-gradient surface (need_backward_dw, backward_dw,
    register_wgrad_accumulation_and_reduce_hooks, parameters marked skip_backward_post_hook)."""

    def __init__(self, linear: torch.nn.Linear, delay_wgrad_compute: bool = True, fuse_wgrad_accumulation: bool = False):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.delay_wgrad_compute, self.fuse_wgrad_accumulation = delay_wgrad_compute, fuse_wgrad_accumulation
        self.wgrad_queue: list = []
        self.hooks: list = []
        self.backward_dw_calls = 0
        if delay_wgrad_compute:
            for p in (self.weight, self.bias):
                p.skip_backward_post_hook = True

    def forward(self, x):
        return _DelayedWgradLinearFunction.apply(x, self.weight, self.bias, self)

    def need_backward_dw(self) -> bool:
        return self.delay_wgrad_compute

    def register_wgrad_accumulation_and_reduce_hooks(self, hook) -> None:
        self.hooks.append(hook)

    def backward_dw(self) -> None:
        if not self.need_backward_dw():
            return
        self.backward_dw_calls += 1
        tensors, gemm = self.wgrad_queue.pop(0)  # TransformerEngine raises on an empty queue too
        dw, db = gemm(*tensors)
        if not self.fuse_wgrad_accumulation:
            self.weight.grad = dw
        if self.bias.grad is None:
            self.bias.grad = db
        for hook in self.hooks:
            hook()


class DelayedWgradToyStage(_MegatronToyStage):
    """A toy stage whose linear delays its weight gradients as TransformerEngine's does."""

    def __init__(self, config, stage: int, num_stages: int, seed: int = 0, fuse_wgrad_accumulation: bool = False):
        super().__init__(config, stage, num_stages, seed)
        self.linear = DelayedWgradLinear(self.linear, fuse_wgrad_accumulation=fuse_wgrad_accumulation)

    def _linear(self, inp):
        return self.linear(inp)


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
    batch = next(data_iterator) if (model.pre_process or model.post_process) else None
    out = model(batch["x"] if model.pre_process else None)
    return out, partial(_loss, batch["y"] if model.post_process else None)


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
