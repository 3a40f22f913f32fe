"""Split backward for the zero-bubble schedules: I (gradient of the stage input) now, W (weight gradients) later.

Two ways to split, chosen per chunk by the runtime:

- Deferred weight GEMMs (Megatron-Core GPT chunks). `split_friendly_linears` gives Megatron's local linear
  layers a path that, for forwards run under `deferring_weight_grads()`, builds a linear node whose backward
  computes only the input gradient and leaves (weight, input, output gradient) in the list that context
  yields. I is then Megatron's own `backward_step` run under that context: every other gradient (norms,
  biases, embeddings, layers that cannot defer) is computed and accumulated there, as in a fused backward,
  and no work is done twice. W computes the deferred weight GEMMs and hands the results to autograd on the
  weights themselves, so their grad-accumulation hooks fire and Megatron's DDP and the sharded wrapper add
  them into `main_grad` exactly as for a B. This is the scheme of TransformerEngine's delayed weight
  gradients, and it costs an autograd call per W (per weight for large ones), not a second graph traversal.
- Model-agnostic, on the autograd graph (chunks without Megatron-Core modules; `graph_split`): I computes the
  input gradient with the graph kept and records, per group of weights, the gradients flowing into the
  intermediate nodes they feed; W runs the rest of the graph from those intermediates down to the weights. Stage 0
  has no input tensor to differentiate: its I does nothing and its W is the whole backward.

A linear defers unless it defers its embedding wgrad itself (a column-parallel linear at T > 1 sums its input
gradient over the tensor-parallel group at I, as Megatron's does; with sequence parallelism I gathers the
input, which its W keeps, and reduce-scatters the input gradient); with gradient-accumulation fusion its W
accumulates into `main_grad` with Megatron's fused kernel and hands autograd a placeholder, as Megatron's
linear does in its backward. TransformerEngine layers built with `delay_wgrad_compute` (>= 2.7, the first with
the weight-gradient hooks; the plugin's Megatron-LM install builds them so for split schedules) queue their
weight-gradient GEMMs themselves: W calls their `backward_dw()`, whose hooks reach the data-parallel wrapper,
and a B on such a chunk calls it right after its backward. Parameters whose gradient such a layer hands autograd
at I instead (biases under FP8 or `return_bias`, the placeholder weight gradient under gradient-accumulation
fusion) get a placeholder before a later `backward_dw()` finds their gradient already taken (see
`run_delayed_wgrads`); their weights without that fusion get nothing at I (TransformerEngine's GroupedLinear
hands autograd there, from 2.8, the expert-sized buffers its queued GEMM fills at W: see
`_unfilled_wgrads_at_input_grad`). Any other layer (TransformerEngine without the delay) runs its backward whole
at I, once: Megatron-Core chunks never take the graph split, whose W would run such a layer's backward again.
Loss scaling on the last stage follows Megatron's `backward_step`. Outputs of split schedules are not
pseudo-deallocated (autograd checks their shapes), which keeps one output per pending I.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .graph_split import WeightGroup, input_grad, weight_grads


@dataclass
class DeferredWeightGrad:
    """One linear's weight gradient left for W: weight.grad += output_grad^T @ input (over all tokens)."""

    weight: torch.nn.Parameter
    input: torch.Tensor
    output_grad: torch.Tensor
    fused: bool = False  # gradient-accumulation fusion: accumulate into weight.main_grad, as Megatron's kernel

    def compute(self) -> torch.Tensor | None:
        """The gradient autograd accumulates on the weight: the GEMM's result, or (fused) after the GEMM was
        accumulated into main_grad what Megatron's fused linear returns (a placeholder, or None)."""
        if self.fused:
            return _accumulate_into_main_grad(self.weight, self.input, self.output_grad)
        g, x = self.output_grad, self.input
        return g.reshape(-1, g.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))


def _accumulate_into_main_grad(weight: torch.nn.Parameter, input: torch.Tensor,
                               output_grad: torch.Tensor) -> torch.Tensor | None:
    """Megatron's fused weight-gradient accumulation, as in its linear's backward
    (`LinearWithGradAccumulationAndAsyncCommunication.backward`): main_grad += output_grad^T @ input (the gathered
    sequence under sequence parallelism) with apex's kernel. A weight a data-parallel wrapper watches (it carries
    `grad_added_to_main_grad`) then gets the placeholder gradient and the flag, so the wrapper's hook fires and
    does not add it again; any other weight gets None, as Megatron returns."""
    from megatron.core.tensor_parallel import layers

    grad_output, total_input = layers.prepare_input_tensors_for_wgrad_compute(output_grad, input)
    main_grad = weight.main_grad
    if main_grad.dtype == torch.float32:
        layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)
    elif main_grad.dtype in (torch.float16, torch.bfloat16):
        layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp16(total_input, grad_output, main_grad)
    else:
        raise RuntimeError(f"megatron_bfpp: gradient-accumulation fusion into a {main_grad.dtype} main_grad")
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    return placeholder_wgrad(main_grad.shape, input.dtype, main_grad.device,
                             zero=getattr(weight, "zero_out_wgrad", False))


_placeholders: dict[tuple, torch.Tensor] = {}


def placeholder_wgrad(shape: torch.Size | list[int], dtype: torch.dtype, device: torch.device,
                      zero: bool = False) -> torch.Tensor:
    """The gradient handed to a weight whose real gradient went into `main_grad`: only its hooks need it. One
    cached tensor per (shape, dtype, device), handed out as a fresh alias (`detach()`), as TransformerEngine's
    `get_dummy_wgrad` (module/base.py) does and Megatron's linear uses: autograd's AccumulateGrad then keeps the
    alias instead of cloning it (torch's accumulate_grad.h, "stealable" new_grad), so no weight-sized tensor is
    allocated per W. TransformerEngine's own cache where it is present (CUDA), so layers of both kinds share it;
    `zero` refills it with zeros (`zero_out_wgrad`: the wrapper adds it)."""
    if device.type == "cuda":
        try:
            from transformer_engine.pytorch.module.base import get_dummy_wgrad
        except ImportError:
            pass
        else:
            with torch.cuda.device(device):
                return get_dummy_wgrad(list(shape), dtype, zero=zero)
    key = (tuple(shape), dtype, device)
    cached = _placeholders.get(key)
    if cached is None:
        cached = _placeholders[key] = torch.empty(key[0], dtype=dtype, device=device)
    if zero:
        cached.zero_()
    return cached.detach()


# While not None: linear forwards build deferring nodes, and their backwards append here. A module-level
# variable, not a thread-local: on GPU the autograd engine runs backward functions on its own threads.
_deferred: list[DeferredWeightGrad] | None = None


@contextlib.contextmanager
def deferring_weight_grads() -> Iterator[list[DeferredWeightGrad]]:
    """Forwards run inside create deferring linear nodes (the forward of an (stage, micro-batch) whose backward
    is split, and its recomputation inside I); backwards run inside leave their weight GEMMs in the list."""
    global _deferred
    outer, _deferred = _deferred, []
    try:
        yield _deferred
    finally:
        _deferred = outer


class _Ref:
    """Carries the weight parameter (and whether its gradient accumulation is fused) through `Function.apply`
    without making it an autograd input (an input would get an AccumulateGrad call, and its hooks would fire,
    with no gradient at I)."""

    def __init__(self, param: torch.nn.Parameter, fused: bool = False) -> None:
        self.param = param
        self.fused = fused


def _gather_sequence(local: torch.Tensor, group: Any, async_op: bool = False):
    """The full sequence from each tensor-parallel rank's part (dim 0), in a tensor of its own (a W keeps it)."""
    size = list(local.shape)
    size[0] *= torch.distributed.get_world_size(group)
    total = torch.empty(size, dtype=local.dtype, device=local.device)
    handle = torch.distributed.all_gather_into_tensor(total, local.contiguous(), group=group, async_op=async_op)
    return (total, handle) if async_op else total


class _DeferredWeightGradLinear(torch.autograd.Function):
    """y = x @ W^T whose backward returns dx and defers dW to W, as Megatron's linear computes them. With
    `dgrad_group` (a column-parallel linear at T > 1) dx is summed over the tensor-parallel group; with
    `sequence_group` (sequence parallelism) x is this rank's part of the sequence: the forward all-gathers it,
    the backward gathers it again for the W to keep and reduce-scatters dx."""

    @staticmethod
    def forward(ctx, input: torch.Tensor, weight: torch.Tensor, ref: _Ref, dgrad_group: Any = None,
                sequence_group: Any = None) -> torch.Tensor:
        ctx.save_for_backward(input, weight)
        ctx.ref = ref
        ctx.dgrad_group = dgrad_group
        ctx.sequence_group = sequence_group
        total_input = input if sequence_group is None else _gather_sequence(input, sequence_group)
        return torch.matmul(total_input, weight.t())

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        input, weight = ctx.saved_tensors
        if _deferred is None:
            raise RuntimeError(
                "megatron_bfpp: a linear layer built for a split backward (I/W) was differentiated outside an I; "
                "its weight gradient would be lost. The schedule gives this micro-batch a B: report it as a bug."
            )
        group = ctx.sequence_group
        total_input, gathered = (input, None) if group is None else _gather_sequence(input, group, async_op=True)
        grad_input = grad_output.matmul(weight)  # beside the gather, as in Megatron's backward
        if group is not None:
            gathered.wait()
            local = torch.empty_like(input)
            torch.distributed.reduce_scatter_tensor(local, grad_input.contiguous(), group=group)
            grad_input = local
        _deferred.append(DeferredWeightGrad(ctx.ref.param, total_input, grad_output, ctx.ref.fused))
        if ctx.dgrad_group is not None:
            torch.distributed.all_reduce(grad_input, group=ctx.dgrad_group)
        return grad_input, None, None, None, None


def _plain_matmul_impl(original):
    """A `_forward_impl` that computes Megatron's linear with built-in autograd ops when that is all it is, and
    with a deferring node under `deferring_weight_grads()`."""

    def forward_impl(input, weight, bias=None, gradient_accumulation_fusion=False, allreduce_dgrad=False,
                     sequence_parallel=False, grad_output_buffer=None, *args, **kwargs):
        simple = (weight.requires_grad and grad_output_buffer is None and not args
                  and kwargs.get("gtp_remat_size", 1) == 1 and not hasattr(weight, "__fsdp_param__"))
        defer = simple and _deferred is not None and input.requires_grad and torch.is_grad_enabled()
        if defer:
            tp_group = _tensor_parallel_group(kwargs.get("tp_group")) if allreduce_dgrad or sequence_parallel else None
            fused = bool(gradient_accumulation_fusion) and hasattr(weight, "main_grad")
            output = _DeferredWeightGradLinear.apply(input, weight.detach(), _Ref(weight, fused),
                                                     tp_group if allreduce_dgrad else None,
                                                     tp_group if sequence_parallel else None)
        elif simple and not gradient_accumulation_fusion and not allreduce_dgrad and not sequence_parallel:
            output = torch.matmul(input, weight.t())  # the Function's forward, op for op
        else:
            return original(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                            grad_output_buffer, *args, **kwargs)
        return output + bias if bias is not None else output

    return forward_impl


def _tensor_parallel_group(tp_group: Any) -> Any:
    """The group Megatron's linear all-reduces the input gradient over (its default when None)."""
    from megatron.core.utils import get_tensor_model_parallel_group_if_none

    return get_tensor_model_parallel_group_if_none(tp_group)


def split_friendly_linears(chunk: torch.nn.Module) -> int:
    """Give the chunk's Megatron-Core local linear layers the plain-matmul path; returns how many the chunk has
    (adapted once; later calls only count)."""
    if hasattr(chunk, "_bfpp_split_linears"):
        return chunk._bfpp_split_linears
    count = 0
    try:
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    except ImportError:  # megatron-core without these layers: nothing to adapt
        ColumnParallelLinear = RowParallelLinear = ()  # noqa: N806
    for module in chunk.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            if not getattr(module, "_bfpp_split", False):  # a layer reached through two wrappers: adapt once
                module._forward_impl = _plain_matmul_impl(module._forward_impl)
                module._bfpp_split = True
            count += 1
    chunk._bfpp_split_linears = count
    return count


def _delays_wgrad(module: torch.nn.Module) -> bool:
    """TransformerEngine's delayed weight gradients (built with delay_wgrad_compute; the plugin's install requires
    >= 2.7): the module's backward queues its weight-gradient GEMMs and `backward_dw()` runs the oldest."""
    if not callable(getattr(module, "backward_dw", None)):
        return False
    need = getattr(module, "need_backward_dw", None)
    if callable(need):
        return bool(need())
    store = getattr(module, "wgrad_store", None)  # TransformerEngine releases without need_backward_dw
    return (store is not None and callable(getattr(store, "delay_wgrad_compute", None))
            and bool(store.delay_wgrad_compute()))


def delayed_wgrad_modules(chunk: torch.nn.Module) -> list[torch.nn.Module]:
    """The chunk's layers that delay their weight-gradient GEMMs themselves, in backward order (W and every B on
    the chunk run `backward_dw()` on each, once per backward). Decided once per chunk."""
    if not hasattr(chunk, "_bfpp_delayed_wgrad"):
        found = [m for m in chunk.modules() if _delays_wgrad(m)]
        for m in found:
            if getattr(getattr(m, "config", None), "delay_wgrad_compute", True) is False:
                raise ValueError(
                    f"megatron_bfpp: {type(m).__name__} queues its weight gradients (TransformerEngine "
                    "delay_wgrad_compute) but its Megatron config has delay_wgrad_compute=False, so its backward_dw() "
                    "would drop them: build the model with config.delay_wgrad_compute=True (the plugin's install does "
                    "for split-backward schedules) or without TransformerEngine's delay")
        for m in found:
            _watch_grads_at_input_grad(m)
        chunk._bfpp_delayed_wgrad = found[::-1]
    return chunk._bfpp_delayed_wgrad


def _params_set_at_w(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters whose gradients the module's `backward_dw()` sets and hands to its hooks: those
    TransformerEngine marks `skip_backward_post_hook` when it delays (its weight_names and bias_names). Found once
    per module (every W asks)."""
    if not hasattr(module, "_bfpp_set_at_w"):
        module._bfpp_set_at_w = [p for p in module.parameters() if getattr(p, "skip_backward_post_hook", False)]
    return module._bfpp_set_at_w


def _mark_grad_at_input_grad(param: torch.nn.Parameter):
    def hook(grad: torch.Tensor | None) -> None:
        if grad is not None:
            param._bfpp_grad_at_i = True

    return hook


def _unfilled_wgrads_at_input_grad(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The weights of a delaying module whose gradient its backward at I cannot have computed: without
    gradient-accumulation fusion its weight-gradient GEMM runs only in `backward_dw()`, which sets the weight's
    `.grad` itself. TransformerEngine's GroupedLinear (2.8 on: transformer_engine/pytorch/module/grouped_linear.py,
    `_GroupedLinear.backward` returns `*wgrad_list`, the `torch.empty` buffers its queued GEMM fills later, v2.8
    lines 369-373 and 484; 2.7 returned None under the delay, lines 455-456) hands autograd exactly those at I, so
    each expert weight would hold an expert-sized `.grad` of undefined contents (autograd's copy: the queue keeps
    the buffer) until `backward_dw()` replaces it (`weight{i}.grad = wgrad_list[i].to(...)`, v2.8 line 829);
    Linear returns None there. Weights by name: the module's `weight_names` (Linear, LayerNormLinear,
    LayerNormMLP), else `weight*` (GroupedLinear's `weight{i}`); its own parameters, marked
    `skip_backward_post_hook` by TransformerEngine under the delay (used by that module only: from 2.8 its
    `backward_dw()` overwrites any other gradient such a weight got)."""
    if getattr(module, "fuse_wgrad_accumulation", False):
        return []
    names = set(getattr(module, "weight_names", None) or ())
    return [p for name, p in module.named_parameters(recurse=False)
            if getattr(p, "skip_backward_post_hook", False) and (name in names if names else name.startswith("weight"))]


def _grad_accumulator(param: torch.nn.Parameter):
    """The parameter's AccumulateGrad node, without reading its data (ZeRO-3 keeps a weight's storage empty at
    rest, where Megatron's `param.expand_as(param).grad_fn.next_functions[0][0]` fails)."""
    get_gradient_edge = getattr(torch.autograd.graph, "get_gradient_edge", None)
    if get_gradient_edge is not None:
        return get_gradient_edge(param).node
    with torch.enable_grad():
        return param.expand_as(param).grad_fn.next_functions[0][0]


def _drop_unfilled_wgrads_at_input_grad(module: torch.nn.Module, params: list[torch.nn.Parameter]) -> None:
    """Autograd accumulates nothing into these weights in the module's backward: a pre-hook on each weight's
    AccumulateGrad node replaces what arrives with no gradient (the node then returns at once, and autograd
    neither copies the buffer nor allocates a `.grad`). W's `backward_dw()` sets the real gradient and its hooks
    hand it to the data-parallel wrapper, as before. The nodes are kept on the module: autograd holds a leaf's
    AccumulateGrad weakly, and a new one would come without the hook."""
    nodes = module.__dict__.setdefault("_bfpp_grad_accumulators", [])
    for p in params:
        if getattr(p, "_bfpp_dropped_at_i", False):
            continue
        node = _grad_accumulator(p)
        node.register_prehook(lambda grads: (None,) * len(grads))
        nodes.append(node)
        p._bfpp_dropped_at_i = True


def _watch_grads_at_input_grad(module: torch.nn.Module) -> None:
    """Record which of the module's delayed parameters autograd hands a gradient in the module's own backward
    (at I): TransformerEngine computes a bias's gradient there under FP8 or `return_bias` (its `backward_dw()`
    then has None for it), and returns its placeholder weight gradient there under gradient-accumulation
    fusion. Observed rather than derived from the layer's flags, which differ per module and version. Weights
    without gradient-accumulation fusion get no gradient at I (`_unfilled_wgrads_at_input_grad`): what their
    backward hands over there is not one."""
    unfilled = _unfilled_wgrads_at_input_grad(module)
    _drop_unfilled_wgrads_at_input_grad(module, unfilled)
    for p in _params_set_at_w(module):
        if not getattr(p, "_bfpp_watched", False) and not any(p is q for q in unfilled):
            p.register_hook(_mark_grad_at_input_grad(p))
            p._bfpp_watched = True


def writes_main_grad_at_input_grad(chunk: torch.nn.Module, config: Any) -> bool:
    """Whether an I on this chunk can write `main_grad` (ZeRO-2/3 must then give the stage its gradient buffer at
    its first I): with gradient-accumulation fusion, layers that run their fused backward whole at I, i.e.
    TransformerEngine modules (they carry `fuse_wgrad_accumulation`) that do not delay their weight GEMMs, and
    local linears that cannot defer (Megatron's own embedding-wgrad deferral, GTP-sharded weights). Deferring
    local linears and delaying TransformerEngine modules write at W (TransformerEngine binds `main_grad` at I,
    which stays valid: ZeRO-2/3 free and re-allocate a gradient buffer's storage in place)."""
    if not getattr(config, "gradient_accumulation_fusion", False):
        return False
    if getattr(config, "defer_embedding_wgrad_compute", False):
        return True
    if not hasattr(chunk, "_bfpp_fused_backward_at_i"):  # decided once per chunk (the runtime asks every step)
        delaying = {id(m) for m in delayed_wgrad_modules(chunk)}
        chunk._bfpp_fused_backward_at_i = any((getattr(m, "fuse_wgrad_accumulation", False) and id(m) not in delaying)
                                              or getattr(m, "gtp_remat_size", 1) > 1 for m in chunk.modules())
    return chunk._bfpp_fused_backward_at_i


def delayed_linears(modules: list[torch.nn.Module]) -> int:
    """How many linear layers (weight GEMMs) the delaying modules hold: one per name in TransformerEngine's
    `weight_names` (LayerNormMLP has two), one for a module without it."""
    return sum(len(getattr(m, "weight_names", None) or (None,)) for m in modules)


def run_delayed_wgrads(modules: list[torch.nn.Module]) -> None:
    """The oldest queued weight-gradient GEMMs of each module; their hooks hand the results to the data-parallel
    wrapper (Megatron's DDP with delay_wgrad_compute, or the sharded wrapper).

    TransformerEngine's `backward_dw()` (module/base.py; >= 2.7) sets `bias.grad = bgrad.to(...)` when the
    bias has no gradient, where bgrad is None if the bias got its gradient at I; with gradient-accumulation
    fusion it leaves `weight.grad` alone, which holds the placeholder its backward returned at I. The first W
    after an I hands both to the hooks, which clear them; a later W before the next I on this chunk (W after W or
    B) would find them None: TransformerEngine then fails on the bias, and Megatron's DDP hook, with
    overlap_grad_reduce, asserts the gradient is not None. Such parameters get what the I gave them in place of
    what it already handed over: zeros for a bias (the hook adds them), the placeholder for a fused weight (the
    hook skips it: grad_added_to_main_grad is still set from the I)."""
    for m in modules:
        for p in _params_set_at_w(m):
            if p.grad is None and getattr(p, "_bfpp_grad_at_i", False):
                if getattr(p, "grad_added_to_main_grad", False):
                    p.grad = placeholder_wgrad(p.main_grad.shape, p.dtype, p.main_grad.device,
                                               zero=getattr(p, "zero_out_wgrad", False))
                else:
                    p.grad = torch.zeros_like(p)  # bias-sized: a fresh one, never aliased by a cache
        m.backward_dw()


def splits_by_deferral(chunk: torch.nn.Module) -> bool:
    """Whether the chunk's backward splits by deferring weight GEMMs (every chunk holding a Megatron-Core module)
    rather than on the autograd graph (any other module). A second traversal of the graph would run again the
    backward of layers that are one autograd Function, and those that accumulate into `main_grad` themselves
    (TransformerEngine's, Megatron's with gradient-accumulation fusion) would add their weight gradient twice;
    deferral runs them whole at I, once. Decided once per chunk (the runtime asks every step)."""
    if not hasattr(chunk, "_bfpp_splits_by_deferral"):
        from megatron.core.transformer.module import MegatronModule

        split_friendly_linears(chunk)
        chunk._bfpp_splits_by_deferral = (any(isinstance(m, MegatronModule) for m in chunk.modules())
                                          or bool(delayed_wgrad_modules(chunk)))
    return chunk._bfpp_splits_by_deferral


def report_deferral(chunk: torch.nn.Module, deferred: int, label: str, show: bool) -> str | None:
    """Once per chunk: how many linear layers deferred their weight GEMMs in its first I (printed when `show`),
    so a run whose layers cannot defer (W then has nothing to do) says so. Returns the line, or None."""
    if getattr(chunk, "_bfpp_deferral_reported", False):
        return None
    chunk._bfpp_deferral_reported = True
    line = f"megatron_bfpp: {label}: {deferred} linear layers defer their weight GEMMs to W"
    if deferred < split_friendly_linears(chunk) + delayed_linears(delayed_wgrad_modules(chunk)) or deferred == 0:
        line += ("; layers that cannot defer (TransformerEngine without delay_wgrad_compute, Megatron's deferred "
                 "embedding wgrad) run their whole backward at I")
    if deferred == 0:
        line += " (W has no work here: the split schedule cannot fill bubbles with it)"
    if show:
        print(line, flush=True)
    return line


@dataclass
class PendingWeightGrad:
    """What a W needs: the deferred weight GEMMs; or the I's weight groups, or (stage 0) the output and its
    gradient for a whole backward."""

    weights: list[torch.nn.Parameter]
    param_groups: list[WeightGroup] | None = None
    output: torch.Tensor | None = None
    output_grad: torch.Tensor | None = None
    deferred: list[DeferredWeightGrad] | None = None


def kept_bytes(deferred: list[DeferredWeightGrad]) -> int:
    """Bytes a pending W keeps alive: the storages of its GEMMs' inputs and output gradients, each once."""
    seen: set[int] = set()
    total = 0
    for item in deferred:
        for t in (item.input, item.output_grad):
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def _scaled(output: torch.Tensor, output_grad: torch.Tensor | None, config: Any) -> torch.Tensor:
    """The last stage's loss scaled as Megatron's backward_step does (no incoming gradient there)."""
    if output_grad is None and config.grad_scale_func is not None:
        return config.grad_scale_func(output)
    return output


def backward_input(input_tensor: torch.Tensor | None, output: torch.Tensor, output_grad: torch.Tensor | None,
                   weights: list[torch.nn.Parameter], config: Any) -> tuple[torch.Tensor | None, PendingWeightGrad]:
    """I: the gradient of `input_tensor` (None on stage 0), and what the matching W needs."""
    output = _scaled(output, output_grad, config)
    if input_tensor is None or not output.requires_grad:
        return None, PendingWeightGrad(weights, output=output, output_grad=output_grad)
    dinput, groups = input_grad(input_tensor, output, output_grad, weights)
    return dinput, PendingWeightGrad(weights, param_groups=groups)


# Largest number of weight-gradient elements a W hands to autograd in one call (see backward_weight).
W_BATCH_NUMEL = 1 << 22


class _HandOff(torch.autograd.Function):
    """A root node whose backward returns the given gradients for `weights`: autograd accumulates them (hooks
    fire as in a fused backward) and, as the engine holds their only reference, takes each tensor as the
    weight's gradient instead of copying it (torch's accumulate_grad.h, "stealable" new_grad), which
    `torch.autograd.backward(weights, grads)` cannot (its root keeps a reference)."""

    @staticmethod
    def forward(ctx, grads: list[torch.Tensor], *weights: torch.Tensor) -> torch.Tensor:
        ctx.grads = grads
        return torch.empty((), device=weights[0].device)

    @staticmethod
    def backward(ctx, _unused: torch.Tensor):
        grads, ctx.grads = ctx.grads, None
        out = (None, *grads)
        grads.clear()
        return out


def backward_weight(pending: PendingWeightGrad) -> None:
    """W: accumulate the weight gradients (hooks fire as in a fused backward)."""
    if pending.deferred is not None:
        # Gradients go to autograd in batches of up to W_BATCH_NUMEL elements: one engine call for small
        # layers, where its fixed cost rivals the GEMMs, and one weight at a time for large ones, whose gradient
        # then exists only until its hooks moved it into main_grad.
        weights: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        numel = 0
        for k, item in enumerate(pending.deferred):
            with torch.no_grad():  # the operands are graph tensors: record nothing for this GEMM
                grad = item.compute()
            if grad is not None:  # None: fused into main_grad, no wrapper watching the weight (as Megatron)
                weights.append(item.weight)
                grads.append(grad)
                numel += grad.numel()
                del grad
            if weights and (k + 1 == len(pending.deferred) or numel >= W_BATCH_NUMEL):
                _HandOff.apply(grads, *weights).backward()
                weights, grads, numel = [], [], 0
        pending.deferred.clear()
        return
    if pending.param_groups is None:
        if pending.output is not None and pending.output.requires_grad:
            torch.autograd.backward(pending.output, grad_tensors=pending.output_grad)
        return
    weight_grads(pending.param_groups, pending.weights)
