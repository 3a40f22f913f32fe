"""Split backward for the zero-bubble schedules: I (gradient of the stage input) now, W (weight gradients) later.

Model-agnostic, on the autograd graph, with PyTorch pipelining's `stage_backward_input`: I computes the input
gradient with the graph kept and records, per group of weights, the gradients flowing into the intermediate
nodes they depend on. W then runs the rest of the graph from those intermediates down to the weights with
`torch.autograd.backward(..., inputs=weights)`, so the weights' gradients are *accumulated* as in a fused
backward: every post-accumulate-grad / grad-accumulator hook fires, and Megatron's DDP and the sharded
wrapper add them into `main_grad` exactly as they do for a B.

Stage 0 has no input tensor to differentiate: its I does nothing and its W is the whole backward (nothing
upstream waits for it). Loss scaling on the last stage follows Megatron's `backward_step`. Outputs of split
schedules are not pseudo-deallocated (autograd checks their shapes), which keeps one output per pending I.

A custom autograd Function computes all its input gradients together, so a layer implemented as one would
run its whole backward at I and again at W. Megatron-Core's local linear layers are such a Function
(`LinearWithGradAccumulationAndAsyncCommunication`); where it reduces to a plain matmul (no tensor-parallel
communication, no fused gradient accumulation, no deferred embedding wgrad) `split_friendly_linears` runs
the same ops as built-in autograd nodes instead, which compute only the gradient asked for: the input
gradient at I, the weight gradient at W. Elsewhere (TransformerEngine layers, tensor parallelism) the
layer's backward runs at both: exact, but the split then saves no work there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import GradientEdge
from torch.distributed.pipelining._backward import _get_grad_fn_or_grad_acc, stage_backward_input


def _plain_matmul_impl(original):
    """A `_forward_impl` that computes Megatron's linear with built-in autograd ops when that is all it is."""

    def forward_impl(input, weight, bias=None, gradient_accumulation_fusion=False, allreduce_dgrad=False,
                     sequence_parallel=False, grad_output_buffer=None, *args, **kwargs):
        plain = (weight.requires_grad and not gradient_accumulation_fusion and not allreduce_dgrad
                 and not sequence_parallel and grad_output_buffer is None and not args
                 and kwargs.get("gtp_remat_size", 1) == 1)
        if not plain:
            return original(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                            grad_output_buffer, *args, **kwargs)
        output = torch.matmul(input, weight.t())  # the Function's forward, op for op
        return output + bias if bias is not None else output

    return forward_impl


def split_friendly_linears(chunk: torch.nn.Module) -> int:
    """Give the chunk's Megatron-Core local linear layers the plain-matmul path; returns how many. Once per
    chunk: later calls return 0 without walking its modules (the runtime calls it every step)."""
    if getattr(chunk, "_bfpp_split_linears", False):
        return 0
    chunk._bfpp_split_linears = True
    try:
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    except ImportError:  # megatron-core without these layers: nothing to adapt
        return 0
    count = 0
    for module in chunk.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and not getattr(module, "_bfpp_split", False):
            module._forward_impl = _plain_matmul_impl(module._forward_impl)
            module._bfpp_split = True  # a layer reached through two chunks' wrappers is adapted once
            count += 1
    return count


@dataclass
class PendingWeightGrad:
    """What a W needs: the I's weight groups, or (stage 0) the output and its gradient for a whole backward."""

    weights: list[torch.nn.Parameter]
    param_groups: list[dict[str, Any]] | None = None
    output: torch.Tensor | None = None
    output_grad: torch.Tensor | None = None


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
    grads = None if output_grad is None else [output_grad]
    dinputs, groups = stage_backward_input([output], grads, [input_tensor], iter(weights))
    return dinputs[0], PendingWeightGrad(weights, param_groups=groups)


def backward_weight(pending: PendingWeightGrad) -> None:
    """W: accumulate the weight gradients (hooks fire as in a fused backward)."""
    if pending.param_groups is None:
        if pending.output is not None and pending.output.requires_grad:
            torch.autograd.backward(pending.output, grad_tensors=pending.output_grad)
        return
    weight_of = {_get_grad_fn_or_grad_acc(w): w for w in pending.weights}
    for group in pending.param_groups:
        edges, grads = [], []
        for grads_tuple, node in zip(group.get("grads") or [], group["intermediates"]):
            for i, g in enumerate(grads_tuple):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    grads.append(g)
        handles = []
        if len(group["intermediates"]) > 1:
            # Feed each intermediate exactly the gradient saved at I, not what flows into it again from
            # another intermediate of the group (which would count it twice).
            for grads_tuple, node in zip(group["grads"], group["intermediates"]):
                handles.append(node.register_prehook(lambda _g, saved=grads_tuple: saved))
        try:
            if edges:
                torch.autograd.backward(edges, grad_tensors=grads, inputs=[weight_of[n] for n in group["params"]])
        finally:
            for h in handles:
                h.remove()
        group.clear()  # drop the kept graph state as soon as it is used
