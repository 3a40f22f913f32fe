"""Split backward on the autograd graph (chunks without Megatron-Core modules): I, then W, from one graph.

I computes the gradient of the stage input with the graph kept. Weights are grouped as in PyTorch pipelining's
`stage_backward_input` (torch/distributed/pipelining/_backward.py, `get_param_groups`): a weight's
*intermediates* are the nodes on the input's gradient path (the *input path*) that the weight's own subgraph
feeds, and weights sharing an intermediate share a group. I records the gradient flowing into each
intermediate. W runs, group by group, the graph from the group's intermediates down to its weights, with two
pre-hooks (PyTorch's `stage_backward_weight` has the first, not the second):

- each intermediate gets exactly the gradient it got at I. A weight used at two depths of the input path (a
  module applied twice, tied weights) has intermediates above one another, and what flows from the upper one
  into the lower one at W would count the lower one's gradient twice;
- every other input-path node directly below an intermediate gets no gradient. Autograd's generated nodes
  return no gradient for none, so the input path between two uses of a weight costs nothing at W (only the upper
  use's own input-gradient GEMM runs again: autograd computes it because the lower use needs it).

A node of the input path may run in the W calls of several groups (in one as an intermediate, in another as a
node passed through with no gradient), so every call keeps the graph; it is freed as the groups are dropped,
the last layers' first (the order of a fused backward).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd.graph import GradientEdge, Node
from torch.distributed.pipelining._backward import (_get_grad_fn_or_grad_acc, construct_reverse_graph,
                                                    get_param_groups, reverse_closure)


@dataclass
class WeightGroup:
    """Weights (their gradient accumulators) whose W runs as one autograd call, from their intermediates."""

    params: list[Node]
    intermediates: list[Node]
    cut: list[Node]  # input-path nodes below the intermediates (not intermediates of the group): fed nothing at W
    grads: list[tuple[torch.Tensor | None, ...] | None]  # per intermediate, the gradient it got at I
    # Older torch only (see _python_nodes_own_their_graph): a view of the stage output that owns its graph, shared
    # by the chunk's groups, so the graph lives until the last of them is dropped.
    anchor: torch.Tensor | None = None


_PYTHON_NODES_OWN_THEIR_GRAPH: bool | None = None


def _python_nodes_own_their_graph(device: torch.device) -> bool:
    """Whether the Python object of a custom autograd.Function's node keeps that node alive. Newer torch (the
    2.14 of requirements.txt; PyTorch #179924) holds an owning pointer; older torch (the 2.10 floor included) holds
    a weak one, so a custom-Function node kept only from Python (a group's intermediate, e.g. Megatron's linear
    layers) is freed with the graph once the output is detached, and W fails ("Attribute 'register_prehook' is
    invalid for this instance of _C._FunctionBase"). Probed once, on a one-element graph."""
    global _PYTHON_NODES_OWN_THEIR_GRAPH
    if _PYTHON_NODES_OWN_THEIR_GRAPH is None:
        class _Probe(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x.clone()

            @staticmethod
            def backward(ctx, grad):
                return grad

        with torch.enable_grad():
            node = _Probe.apply(torch.zeros(1, device=device, requires_grad=True)).grad_fn  # output dropped here
        try:
            node.next_functions
            _PYTHON_NODES_OWN_THEIR_GRAPH = True
        except RuntimeError:
            _PYTHON_NODES_OWN_THEIR_GRAPH = False
    return _PYTHON_NODES_OWN_THEIR_GRAPH


def input_grad(input_tensor: torch.Tensor, output: torch.Tensor, output_grad: torch.Tensor | None,
               weights: list[torch.nn.Parameter]) -> tuple[torch.Tensor | None, list[WeightGroup]]:
    """I: the gradient of `input_tensor` (the graph kept), and the weight groups W runs from."""
    input_node = _get_grad_fn_or_grad_acc(input_tensor)
    reverse_edges = construct_reverse_graph([output.grad_fn])
    input_path, _ = reverse_closure([input_node], set(), reverse_edges)
    groups = []
    for g in get_param_groups([input_node], [_get_grad_fn_or_grad_acc(w) for w in weights], reverse_edges):
        intermediates = list(g["intermediates"])
        own = set(intermediates)
        cut = {fn for node in intermediates for fn, _ in node.next_functions if fn in input_path and fn not in own}
        groups.append(WeightGroup(list(g["params"]), intermediates, list(cut), [None] * len(intermediates)))

    def recorder(group: WeightGroup, i: int):
        def record(grad_outputs):
            group.grads[i] = grad_outputs
        return record

    handles = [node.register_prehook(recorder(group, i))
               for group in groups for i, node in enumerate(group.intermediates)]
    try:
        (dinput,) = torch.autograd.grad(output, input_tensor, output_grad, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    if groups and not _python_nodes_own_their_graph(output.device):
        # Older torch: the groups' custom-Function nodes would die with the output's graph. A view of the output
        # (its node is a C++ one, which owns its inputs) keeps the graph until W has dropped every group: exact,
        # the graph is only freed at the end of the chunk's W instead of group by group.
        with torch.enable_grad():
            anchor = output.view_as(output)
        for group in groups:
            group.anchor = anchor
    output.detach_()  # the graph stays reachable from the groups only, so it is freed as W drops them
    return dinput, groups


def _no_gradient(grad_outputs):
    return tuple(None for _ in grad_outputs)


def weight_grads(groups: list[WeightGroup], weights: list[torch.nn.Parameter]) -> None:
    """W: accumulate the weight gradients of every group (their accumulation hooks fire as in a fused backward);
    the groups are consumed."""
    weight_of = {_get_grad_fn_or_grad_acc(w): w for w in weights}
    while groups:
        group = groups.pop()  # last layers first: each group's graph is freed as soon as no other needs it
        edges, grads = [], []
        for grads_tuple, node in zip(group.grads, group.intermediates):
            for i, g in enumerate(grads_tuple or ()):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    grads.append(g)
        if not edges:
            continue
        # An intermediate not run at I (none is, the input path being where I runs) contributes nothing.
        handles = [node.register_prehook(_no_gradient if saved is None else lambda _g, saved=saved: saved)
                   for node, saved in zip(group.intermediates, group.grads)]
        handles += [node.register_prehook(_no_gradient) for node in group.cut]
        try:
            torch.autograd.backward(edges, grad_tensors=grads, inputs=[weight_of[p] for p in group.params],
                                    retain_graph=True)
        finally:
            for h in handles:
                h.remove()
