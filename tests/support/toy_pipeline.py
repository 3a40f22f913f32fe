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
# The first micro-batch of a step (`is_first_microbatch`: Megatron's TELinear starts it True, its forward passes
# it on and clears it, MegatronModule.set_is_first_microbatch sets it again under FP8; None with
# disable_parameter_transpose_cache), at v2.10 unless said: under FP8 _Linear.forward takes the weight from
# get_weight_workspace (module/base.py 1333) with cache_name "weight" and update_workspace=is_first_microbatch
# (linear.py 268-272; v2.8 253-257): the cached copy of micro-batch 0 serves the others, and a missing cache
# entry is rebuilt from the current weights; _Linear.backward's `accumulate_wgrad_into_param_main_grad =
# fuse_wgrad_accumulation and not is_first_microbatch` (834-838; v2.8 823-827): micro-batch 0 overwrites
# main_grad, also from a queued GEMM (the flag is bound when it is queued). GroupedLinear alike (grouped_linear.py
# cache_name f"weight{i}" 151-157, accumulate 350-354).
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


def accumulates_into_main_grad(fused: bool, is_first_microbatch: bool | None) -> bool:
    """Whether the weight GEMM adds to main_grad (`accumulate_wgrad_into_param_main_grad`): fused, and not the
    first micro-batch, which overwrites it."""
    return fused and not is_first_microbatch if is_first_microbatch is not None else fused


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
      without it, None; unfused and delayed, None (the GEMM runs in backward_dw).
    - `weightmat`: what the GEMMs read, the weight or under FP8 its cached copy; `is_first_microbatch` decides
      whether the weight GEMM accumulates into main_grad (see the comment above TE_BANDS)."""

    @staticmethod
    def forward(ctx, weight, inp, bias, module, weightmat, is_first_microbatch):
        ctx.save_for_backward(inp, weightmat)
        ctx.bias, ctx.use_bias, ctx.module = bias, bias is not None, module
        ctx.is_first_microbatch = is_first_microbatch
        out = inp @ weightmat.t()
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
        accumulate = accumulates_into_main_grad(m.fuse_wgrad_accumulation, ctx.is_first_microbatch)

        @torch.no_grad()  # TransformerEngine's GEMM is not recorded by autograd
        def wgrad_gemm(x, dy):
            dw = dy.t() @ x
            if main_grad is not None:  # out=main_grad
                dw = main_grad.add_(dw) if accumulate else main_grad.copy_(dw)
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
        return wgrad, dgrad, grad_bias, None, None, None


class _DelayedWgradModule(torch.nn.Module):
    """What TransformerEngine's layers share (module/base.py TransformerEngineBaseModule): the weight-gradient
    store, the hooks run after backward_dw, and backward_dw's guard; each layer says how it applies what it
    popped (`_apply_popped`)."""

    def _init_delayed_wgrads(self, delay_wgrad_compute: bool, version: str, delayed_names: set[str]) -> None:
        self.wgrad_store = WeightGradStore(delay_wgrad_compute)
        self.wgrad_accumulation_and_reduce_hooks: list = []
        self.backward_dw_calls = 0
        self.is_first_microbatch = True  # Megatron's TE layers: set at micro-batch 0, cleared by each forward
        self._fp8_workspaces: dict[str, torch.Tensor] = {}  # module/base.py: the cached quantized weights
        # __init__: "if self.wgrad_store.delay_wgrad_compute(): ... param.skip_backward_post_hook = True"
        if self.wgrad_store.delay_wgrad_compute():
            for name, param in self.named_parameters():
                if name in delayed_names:
                    param.skip_backward_post_hook = True
        if version == "2.10":  # need_backward_dw() exists from 2.10 on
            self.need_backward_dw = self.wgrad_store.delay_wgrad_compute

    def _take_is_first_microbatch(self) -> bool | None:
        """Megatron's TE layer forward: pass `is_first_microbatch` on and clear it."""
        is_first, self.is_first_microbatch = self.is_first_microbatch, False
        return is_first

    def get_weight_workspace(self, tensor: torch.Tensor, cache_name: str | None,
                             update_workspace: bool) -> torch.Tensor:
        """module/base.py get_weight_workspace: the "quantized" copy (a copy here, same values) cached under
        `cache_name`, made from `tensor` when missing and refreshed when `update_workspace`."""
        out = self._fp8_workspaces.get(cache_name) if cache_name is not None else None
        if out is None:
            out = tensor.detach().clone()
            if cache_name is not None:
                self._fp8_workspaces[cache_name] = out
        elif update_workspace:
            out.copy_(tensor.detach())
        return out

    def register_wgrad_accumulation_and_reduce_hooks(self, hook) -> None:
        self.wgrad_accumulation_and_reduce_hooks.append(hook)

    def backward_dw(self) -> None:
        """module/base.py TransformerEngineBaseModule.backward_dw of the band."""
        if not self.wgrad_store.delay_wgrad_compute():  # >= 2.10: `if not self.need_backward_dw()`, the same
            return
        self.backward_dw_calls += 1
        self._apply_popped(*self.wgrad_store.pop())
        for hook in self.wgrad_accumulation_and_reduce_hooks:
            hook()


class DelayedWgradLinear(_DelayedWgradModule):
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
        self._init_delayed_wgrads(delay_wgrad_compute, version, {*self.weight_names, *self.bias_names})

    def forward(self, x):
        is_first = self._take_is_first_microbatch()
        weightmat = self.weight
        if self.fp8:
            weightmat = self.get_weight_workspace(self.weight, None if is_first is None else "weight",
                                                  update_workspace=is_first is None or is_first)
        out = _Linear.apply(self.weight, x, self.bias if self.apply_bias else None, self, weightmat, is_first)
        return (out, self.bias) if self.return_bias else out  # Linear.forward: "if self.return_bias: ..."

    def _apply_popped(self, grads, _) -> None:
        wgrad, bgrad = grads
        if not self.fuse_wgrad_accumulation:
            if self.version == "2.7":  # 2.7: "if weight_tensor.grad is None: weight_tensor.grad = wgrad.to(...)"
                if self.weight.grad is None:
                    self.weight.grad = wgrad.to(self.weight.dtype)
            else:  # 2.8 on: unconditionally
                self.weight.grad = wgrad.to(self.weight.dtype)
        if self.use_bias:
            if self.bias.grad is None:  # all bands; AttributeError when bgrad is None, as TransformerEngine's
                self.bias.grad = bgrad.to(self.bias.dtype)


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


# --- A stand-in for TransformerEngine's GroupedLinear (MoE experts) with delayed weight gradients ---------------
# It models, per version band, what transformer_engine/pytorch/module/grouped_linear.py does (lines in
# NVIDIA/TransformerEngine at the tag named). Bands: "2.7"; "2.8" (2.8 and 2.9); "2.10" (2.10 to 2.12; later
# releases keep returning the weight-gradient buffers at I, 2.16 on as views of one packed buffer). No FP8: bias
# gradients come from the weight-gradient GEMM.
# - _GroupedLinear.backward (v2.8 263-485, v2.10 289-495, v2.12 311-529): unfused, `wgrad_list` is a fresh
#   `torch.empty(w.size())` per expert (v2.8 369-373, v2.12 426-430) that the queued GEMM fills later
#   (`ctx.wgrad_store.put([inputmats, grad_output, wgrad_list], grouped_gemm_wgrad)`, v2.8 409, v2.12 473); fused,
#   it is the experts' main_grad (v2.8 368), accumulated into. `handle_custom_ddp_from_mcore` (v2.8 421-447, v2.10
#   451-473) leaves an unfused one as it is; fused with `grad_added_to_main_grad` it sets the flag and gives a
#   placeholder: a fresh torch.empty / torch.zeros (zero_out_wgrad) in 2.7-2.9 (v2.8 424-441),
#   get_dummy_wgrad(..., zero=zero_out_wgrad) from 2.10 (v2.10 454-468); fused without it, None. Only 2.7 then
#   replaces them with None under the delay (`if ctx.wgrad_store ... delay_wgrad_compute(): wgrad_list = [None] *
#   ctx.num_gemms`, v2.7 455-456); from 2.8 on autograd is handed the unfilled buffers at I (`*wgrad_list` in the
#   returned tuple, v2.8 484, v2.12 528), so each unfused expert weight gets an expert-sized `.grad` of undefined
#   contents (a copy: TransformerEngine's queue still holds the buffer) from I until backward_dw. Bias gradients
#   are None at I under the delay without FP8 (v2.8 455-460).
# - GroupedLinear.backward_dw (v2.7 818-840, v2.8 815-836, v2.10 820-840): pops the oldest GEMM; unfused, sets
#   `weight{i}.grad = wgrad_list[i].to(...)` unconditionally from 2.8 (v2.8 829), only when None in 2.7 (v2.7
#   832-833); sets `bias{i}.grad` when None (v2.8 833); runs the wgrad_accumulation_and_reduce_hooks. From 2.10
#   it returns early unless need_backward_dw() (v2.10 825). GroupedLinear.__init__ marks weight{i} and bias{i}
#   skip_backward_post_hook under the delay (v2.8 662-666).
EXPERTS, M_SPLITS = 2, [3, 5]  # tokens per expert of a micro-batch's SEQ x MBS = 8 tokens


class _GroupedLinear(torch.autograd.Function):
    """module/grouped_linear.py _GroupedLinear (no FP8, no TP): the flattened input's rows split by m_splits, row
    group i through expert i."""

    @staticmethod
    def forward(ctx, inp, module, is_first_microbatch, *params):
        n = module.num_gemms
        weights, biases = params[:n], params[n:]
        ctx.save_for_backward(inp, *weights)
        ctx.module, ctx.is_first_microbatch = module, is_first_microbatch
        xs = torch.split(inp.reshape(-1, inp.shape[-1]), module.m_splits)
        outs = [x @ w.t() + (biases[i] if biases else 0) for i, (x, w) in enumerate(zip(xs, weights))]
        return torch.cat(outs).view(*inp.shape[:-1], weights[0].shape[0])

    @staticmethod
    def backward(ctx, grad_output):
        inp, *weights = ctx.saved_tensors
        m = ctx.module
        n, delayed, fused = m.num_gemms, m.wgrad_store.delay_wgrad_compute(), m.fuse_wgrad_accumulation
        accumulate = accumulates_into_main_grad(fused, ctx.is_first_microbatch)
        params = [getattr(m, f"weight{i}") for i in range(n)]  # the Parameters (main_grad, grad_added_to_main_grad)
        xs = torch.split(inp.reshape(-1, inp.shape[-1]), m.m_splits)
        dys = torch.split(grad_output.reshape(-1, grad_output.shape[-1]), m.m_splits)
        dgrad = torch.cat([dy @ w for dy, w in zip(dys, weights)]).view(inp.shape)
        if fused:
            wgrad_list = [p.main_grad for p in params]
        else:  # torch.empty in TransformerEngine: NaN here, so an unfilled buffer taken for a gradient shows
            wgrad_list = [torch.full(w.shape, float("nan"), dtype=w.dtype) for w in weights]

        @torch.no_grad()  # general_grouped_gemm: out=wgrad_list, accumulate as above, bias gradients fused in
        def grouped_gemm_wgrad(xs, dys, wgrad_list):
            for x, dy, out in zip(xs, dys, wgrad_list):
                if accumulate:
                    out.add_(dy.t() @ x)
                else:
                    out.copy_(dy.t() @ x)
            return None, [dy.sum(0) if m.use_bias else None for dy in dys], None

        grad_biases = [None] * n
        if delayed:
            m.wgrad_store.put([xs, dys, wgrad_list], grouped_gemm_wgrad)
        else:
            _, grad_biases, _ = grouped_gemm_wgrad(xs, dys, wgrad_list)

        def handle_custom_ddp_from_mcore(weight, wgrad):
            if fused and hasattr(weight, "grad_added_to_main_grad"):
                weight.grad_added_to_main_grad = True
                zero = getattr(weight, "zero_out_wgrad", False)
                if m.version == "2.10":
                    return get_dummy_wgrad(list(weight.main_grad.shape), weight.dtype, zero=zero)
                return torch.zeros_like(weight) if zero else torch.full_like(weight, float("nan"))
            return None if fused else wgrad

        wgrad_list = [handle_custom_ddp_from_mcore(p, w) for p, w in zip(params, wgrad_list)]
        if m.version == "2.7" and delayed:
            wgrad_list = [None] * n
        if not m.use_bias or delayed:
            grad_biases = [None] * n
        return (dgrad, None, None, *wgrad_list, *(grad_biases if m.use_bias else []))


class DelayedWgradGroupedLinear(_DelayedWgradModule):
    """TransformerEngine's GroupedLinear (`weight{i}`, `bias{i}` per expert) at a version band."""

    def __init__(self, weights: list, biases: list | None, m_splits: list[int], delay_wgrad_compute: bool = True,
                 fuse_wgrad_accumulation: bool = False, version: str = "2.10"):
        super().__init__()
        assert version in TE_BANDS, version
        self.num_gemms, self.m_splits, self.version = len(weights), list(m_splits), version
        self.use_bias = self.apply_bias = biases is not None
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        for i, w in enumerate(weights):
            self.register_parameter(f"weight{i}", torch.nn.Parameter(w.detach().clone()))
            if biases is not None:
                self.register_parameter(f"bias{i}", torch.nn.Parameter(biases[i].detach().clone()))
        self._init_delayed_wgrads(delay_wgrad_compute, version,
                                  {f"{kind}{i}" for kind in ("weight", "bias") for i in range(self.num_gemms)})

    def weights(self) -> list:
        return [getattr(self, f"weight{i}") for i in range(self.num_gemms)]

    def forward(self, x):
        biases = [getattr(self, f"bias{i}") for i in range(self.num_gemms)] if self.use_bias else []
        return _GroupedLinear.apply(x, self, self._take_is_first_microbatch(), *self.weights(), *biases)

    def _apply_popped(self, grads, tensor_list) -> None:
        _, grad_biases_, _ = grads
        wgrad_list = tensor_list[2]
        if not self.fuse_wgrad_accumulation:
            for w, wgrad in zip(self.weights(), wgrad_list):
                if self.version != "2.7" or w.grad is None:
                    w.grad = wgrad.to(w.dtype)
        if self.use_bias:
            for i in range(self.num_gemms):
                bias = getattr(self, f"bias{i}")
                if bias.grad is None:
                    bias.grad = grad_biases_[i].to(bias.dtype)


def expert_tensors(stage: int, seed: int = 0) -> tuple[list, list]:
    """Expert weights and biases of a grouped stage: expert 0 has ToyStage's, the others their own."""
    toy = ToyStage(make_config(), stage, stage + 1, seed)
    g = torch.Generator().manual_seed(seed * 1000 + stage + 500)
    weights = [toy.linear.weight.detach()] + [torch.randn(HIDDEN, HIDDEN, generator=g) / HIDDEN**0.5
                                              for _ in range(EXPERTS - 1)]
    biases = [toy.linear.bias.detach()] + [torch.randn(HIDDEN, generator=g) * 0.1 for _ in range(EXPERTS - 1)]
    return weights, biases


class GroupedToyStage(_MegatronToyStage):
    """A toy stage whose linear is the GroupedLinear stand-in: tanh of EXPERTS experts, each on its run of
    M_SPLITS tokens of the micro-batch."""

    def __init__(self, config, stage: int, num_stages: int, seed: int = 0, bias: bool = True, **grouped):
        super().__init__(config, stage, num_stages, seed)
        weights, biases = expert_tensors(stage, seed)
        self.linear = DelayedWgradGroupedLinear(weights, biases if bias else None, M_SPLITS, **grouped)

    def _linear(self, inp):
        return self.linear(inp)


def grouped_reference(num_stages: int, batches: list[dict], seed: int = 0, bias: bool = True) -> dict:
    """Single process, plain autograd: {stage: {"weight{i}" / "bias{i}": gradient}} of GroupedToyStage's."""
    params = {}
    for s in range(num_stages):
        weights, biases = expert_tensors(s, seed)
        params[s] = {f"weight{i}": w.clone().requires_grad_() for i, w in enumerate(weights)}
        if bias:
            params[s].update({f"bias{i}": b.clone().requires_grad_() for i, b in enumerate(biases)})
    for b in batches:
        h = b["x"]
        for s in range(num_stages):
            xs = torch.split(h.reshape(-1, HIDDEN), M_SPLITS)
            p = params[s]
            out = torch.cat([x @ p[f"weight{i}"].t() + (p[f"bias{i}"] if bias else 0) for i, x in enumerate(xs)])
            h = torch.tanh(out.view(h.shape))
        loss_sum, n, _ = _loss(b["y"], h)
        (loss_sum / n / len(batches)).backward()
    return {s: {name: t.grad.clone() for name, t in p.items()} for s, p in params.items()}


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
