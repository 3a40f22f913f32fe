"""The split backward on the autograd graph (chunks without Megatron-Core modules) equals a fused backward.

For sequential, residual, reused-module (`a(tanh(b(a(x))))`) and tied-weight chunks, I then W give the input
gradient and every weight gradient of one fused backward (fp32, rtol 1e-5, atol 1e-6), with two micro-batches
whose I's both run before their W's (as the split schedules order them), each weight's accumulation hook
firing as often as in the fused backward, the I + W matmul FLOPs of the fused backward (plus, where a weight is
used at two depths, the upper use's input-gradient GEMM once more) and the graph freed after the W.
"""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

H, TOKENS = 8, 6


class Sequential(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(H, H), torch.nn.Linear(H, H)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class Residual(Sequential):
    def forward(self, x):
        h = x + self.a(x)
        return h + self.b(torch.tanh(h))


class Reused(Sequential):
    def forward(self, x):
        return self.a(torch.tanh(self.b(self.a(x))))


class Tied(Sequential):
    def __init__(self):
        super().__init__()
        self.b.weight = self.a.weight

    def forward(self, x):  # the two uses adjacent: the lower one is directly below the upper one
        return torch.tanh(self.b(self.a(x)))


# Extra matmul FLOPs the W runs: none, except the input-gradient GEMM of a weight's upper use (autograd computes
# it because the lower use, below it on the input path, is reached through it), 2 * TOKENS * H * H each.
CHUNKS = {"sequential": (Sequential, 0), "residual": (Residual, 0), "reused": (Reused, 1), "tied": (Tied, 1)}
CONFIG = SimpleNamespace(grad_scale_func=None)


def _chunk(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    chunk = CHUNKS[kind][0]()
    with torch.no_grad():  # weights of order 1, so that errors in a gradient are not hidden by the tolerance
        for p in chunk.parameters():
            p.copy_(torch.randn(p.shape))
    return chunk


def _operands(microbatch: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10 + microbatch)
    return torch.randn(TOKENS, H, generator=gen), torch.randn(TOKENS, H, generator=gen)


def _counting_hooks(chunk: torch.nn.Module) -> dict[int, int]:
    calls = {id(p): 0 for p in chunk.parameters()}
    for p in chunk.parameters():
        p.register_post_accumulate_grad_hook(lambda q: calls.__setitem__(id(q), calls[id(q)] + 1))
    return calls


def _flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def _fused(kind: str) -> tuple[dict[str, torch.Tensor], list[torch.Tensor], dict[int, int], int]:
    chunk = _chunk(kind)
    hooks = _counting_hooks(chunk)
    dxs, flops = [], 0
    for m in range(2):
        x, g = _operands(m)
        x.requires_grad_()
        out = chunk(x)
        flops += _flops(lambda: out.backward(g))
        dxs.append(x.grad)
    return {n: p.grad.clone() for n, p in chunk.named_parameters()}, dxs, hooks, flops


def _split(kind: str, chunk: torch.nn.Module | None = None):
    from megatron_bfpp.runtime.split_backward import backward_input, backward_weight

    chunk = chunk or _chunk(kind)
    hooks = _counting_hooks(chunk)
    weights = [p for p in chunk.parameters() if p.requires_grad]
    saved: list[weakref.ref] = []  # what autograd saves in the forwards, each in a box: all freed after the W's

    class Box:
        def __init__(self, t):
            self.t = t.detach()  # not the tensor itself: an output saved by its own node would be a cycle
            saved.append(weakref.ref(self))

    pending, dxs, flops = [], [], 0
    for m in range(2):  # both I's before the W's, as the split schedules order them
        x, g = _operands(m)
        x.requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(Box, lambda box: box.t):
            out = chunk(x)
        box = {}
        flops += _flops(lambda: box.update(zip(("dx", "w"), backward_input(x, out, g, weights, CONFIG))))
        assert all(p.grad is None for p in weights)  # I computes no weight gradient
        dxs.append(box["dx"])
        pending.append(box["w"])
    for w in pending:
        flops += _flops(lambda: backward_weight(w))
    del pending, box, out, x, w
    gc.collect()
    return chunk, dxs, hooks, flops, [r for r in saved if r() is not None]


@pytest.mark.parametrize("kind", list(CHUNKS))
def test_input_then_weight_backward_equals_the_fused_backward(kind):
    ref_grads, ref_dxs, ref_hooks, ref_flops = _fused(kind)
    chunk, dxs, hooks, flops, alive = _split(kind)
    for dx, ref in zip(dxs, ref_dxs):
        torch.testing.assert_close(dx, ref, rtol=1e-5, atol=1e-6)
    for name, p in chunk.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-5, atol=1e-6, msg=f"{kind}: {name}")
    assert sorted(hooks.values()) == sorted(ref_hooks.values())  # each weight's hook fires as often
    assert flops == ref_flops + 2 * CHUNKS[kind][1] * 2 * TOKENS * H * H  # (two micro-batches)
    assert alive == []  # the W released the graph the I kept


def test_stage_without_input_runs_the_whole_backward_at_w():
    """Stage 0 has no input gradient: its I does nothing and its W is the fused backward."""
    from megatron_bfpp.runtime.split_backward import backward_input, backward_weight

    ref = _chunk("reused")
    x, g = _operands(0)
    ref(x).backward(g)
    chunk = _chunk("reused")
    dx, pending = backward_input(None, chunk(x), g, list(chunk.parameters()), CONFIG)
    assert dx is None and all(p.grad is None for p in chunk.parameters())
    backward_weight(pending)
    for (name, p), q in zip(chunk.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
