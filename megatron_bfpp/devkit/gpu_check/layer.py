"""Per-op forward/backward times of one transformer layer of a simulator model shape (T = 1) measured on this
device, next to the simulator's cost model for a hardware profile: the four weight GEMMs, core attention, the rest
of the layer (elementwise work) and the whole Megatron-Core layer (TransformerEngine spec when importable on CUDA,
else the local spec)."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

from megatron_bfpp.sim.model import resolve_model

OPS = ("qkv", "proj", "fc1", "fc2", "attention", "elementwise", "layer")


def simulated_ops(model_name: str, hardware: str, micro_batch_size: int) -> dict[str, dict[str, float]]:
    """Seconds per op of one layer (T = 1) under the simulator's cost model: {op: {"fwd": s, "bwd": s}}; the
    elementwise row holds every op of the cost model's layer that is not a weight GEMM or the core attention."""
    from megatron_bfpp.sim.hardware import get_hardware
    from megatron_bfpp.sim.layer_costs import layer_ops
    from megatron_bfpp.sim.model import Partition

    hw, m, b = get_hardware(hardware), resolve_model(model_name), micro_batch_size
    sim = layer_ops(hw, Partition(m, 1, 1, 1), b)
    ops: dict[str, dict[str, float]] = {}
    for op in ("qkv", "proj", "fc1", "fc2", "attention"):
        ops[op] = {"fwd": sim.fwd.get(op, 0.0), "bwd": sim.bwd.get(op, 0.0)}
    for k, table, total in (("fwd", sim.fwd, sim.forward), ("bwd", sim.bwd, sim.backward)):
        ops.setdefault("elementwise", {})[k] = total - sum(table.get(op, 0.0) for op in ops if op != "elementwise")
        ops.setdefault("layer", {})[k] = total
    return ops


def _timer(device) -> Callable[[Callable[[], Any], int, int], float]:
    import torch

    def timed(fn: Callable[[], Any], iters: int, warmup: int) -> float:
        """Median seconds of fn() (CUDA events on GPU, wall clock on CPU)."""
        for _ in range(warmup):
            fn()
        samples = []
        for _ in range(iters):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    return timed


def measured_ops(model_name: str, micro_batch_size: int, device_name: str, iters: int, warmup: int,
                 dropout: float) -> tuple[dict[str, dict[str, float]], str]:
    """Seconds per op of one bf16 layer of `model_name`'s shape on this device; also the layer spec used."""
    import torch
    import torch.nn.functional as F

    from megatron_bfpp.train import model as mm
    from megatron_bfpp.train import parallel

    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    m, b = resolve_model(model_name), micro_batch_size
    tokens, h, f, s, heads = b * m.seq_length, m.hidden_size, m.ffn, m.seq_length, m.num_heads
    dtype = torch.bfloat16
    timed = _timer(device)
    ops: dict[str, dict[str, float]] = {}

    for name, (k, n) in {"qkv": (h, 3 * h), "proj": (h, h), "fc1": (h, f), "fc2": (f, h)}.items():
        x = torch.randn(tokens, k, dtype=dtype, device=device)
        w = torch.randn(n, k, dtype=dtype, device=device)
        dy = torch.randn(tokens, n, dtype=dtype, device=device)
        fwd = timed(lambda: F.linear(x, w), iters, warmup)
        bwd = timed(lambda: (dy @ w, dy.t() @ x), iters, warmup)  # dgrad, wgrad
        ops[name] = {"fwd": fwd, "bwd": bwd}
        del x, w, dy

    d = h // heads
    q, k_, v = (torch.randn(b, heads, s, d, dtype=dtype, device=device, requires_grad=True) for _ in range(3))
    g = torch.randn(b, heads, s, d, dtype=dtype, device=device)
    fwd = timed(lambda: F.scaled_dot_product_attention(q, k_, v, is_causal=True), iters, warmup)
    both = timed(lambda: torch.autograd.grad(F.scaled_dot_product_attention(q, k_, v, is_causal=True), (q, k_, v), g),
                 iters, warmup)
    ops["attention"] = {"fwd": fwd, "bwd": max(both - fwd, 0.0)}
    del q, k_, v, g

    from megatron.core.transformer.spec_utils import build_module

    parallel.init_single_process()
    parallel.set_seed(1234)
    config = mm.make_transformer_config(num_layers=1, hidden_size=h, num_attention_heads=heads, ffn_hidden_size=f,
                                        params_dtype="bf16", hidden_dropout=dropout, attention_dropout=dropout,
                                        use_cpu_initialization=device.type != "cuda")
    spec = mm.layer_spec(device)
    spec_name = "transformer_engine" if device.type == "cuda" and mm.have_transformer_engine() else "local"
    layer = build_module(spec, config=config, layer_number=1).to(device=device, dtype=dtype)
    x = torch.randn(s, b, h, dtype=dtype, device=device, requires_grad=True)
    gy = torch.randn(s, b, h, dtype=dtype, device=device)

    def forward():
        out = layer(hidden_states=x, attention_mask=None)
        return out[0] if isinstance(out, tuple) else out

    def forward_backward():
        forward().backward(gy)
        for p in layer.parameters():
            p.grad = None

    fwd = timed(forward, iters, warmup)
    both = timed(forward_backward, iters, warmup)
    ops["layer"] = {"fwd": fwd, "bwd": max(both - fwd, 0.0)}
    parts = ("qkv", "proj", "fc1", "fc2", "attention")
    ops["elementwise"] = {k: max(ops["layer"][k] - sum(ops[p][k] for p in parts), 0.0) for k in ("fwd", "bwd")}
    return ops, spec_name



def layer_rows(sim: dict[str, dict[str, float]], meas: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
    """One row per op: simulated and (where measured) measured milliseconds and their ratio, forward and backward."""
    rows = []
    for op in OPS:
        row: dict[str, Any] = {"op": op}
        for k in ("fwd", "bwd"):
            row[f"{k}_sim_ms"] = sim[op][k] * 1e3
            if op in meas:
                row[f"{k}_measured_ms"] = meas[op][k] * 1e3
                row[f"{k}_ratio"] = meas[op][k] / sim[op][k] if sim[op][k] > 0 else None
        rows.append(row)
    return rows


def layer_table(rows: list[dict], model: str, hardware: str) -> str:
    lines = [f"per-layer times, {model} shape, T=1 (measured / simulator '{hardware}' profile):",
             f"{'op':<12} {'fwd ms':>9} {'sim':>9} {'ratio':>6}   {'bwd ms':>9} {'sim':>9} {'ratio':>6}"]
    for r in rows:
        def cell(k: str) -> str:
            v = r.get(k)
            return "-" if v is None else f"{v:.3f}" if k.endswith("_ms") else f"{v:.2f}"
        lines.append(f"{r['op']:<12} {cell('fwd_measured_ms'):>9} {cell('fwd_sim_ms'):>9} {cell('fwd_ratio'):>6}   "
                     f"{cell('bwd_measured_ms'):>9} {cell('bwd_sim_ms'):>9} {cell('bwd_ratio'):>6}")
    return "\n".join(lines)

