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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import GradientEdge
from torch.distributed.pipelining._backward import _get_grad_fn_or_grad_acc, stage_backward_input


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
