"""Python side of scripts/gpu_check.sh.

    layer    per-op forward/backward times of one transformer layer of a simulator model shape (default gpt-52b,
             T = 1) measured on this device, next to the simulator's cost model for a hardware profile (default
             h200): the four weight GEMMs, core attention, the rest of the layer (elementwise work) and the
             whole Megatron-Core layer (TransformerEngine spec when importable on CUDA, else the local spec).
    probe    prints what the check's commands depend on, one `key=value` a line: te_version (TransformerEngine's,
             empty when `transformer_engine.pytorch` does not import) and apex_fused_wgrad (1 when apex's
             fused_weight_gradient_mlp_cuda imports after torch, as Megatron-Core's tensor_parallel/layers.py
             imports it; without it Megatron-LM's default gradient-accumulation fusion fails in ColumnParallelLinear).
    summary  reads the check's runs (NAME.cmd: the command, one argument per line; NAME.log; NAME.json: the
             trainer's --report-json when there is one), compares each run with its reference (losses within
             the stated bf16 tolerance, step-time ratio), compares peak memory with the planner's prediction,
             adds the layer table, prints it all and writes gpu_check.json. Exit status 1 when a loss check
             fails or a run produced no iterations.

Peak memory: measured is torch.cuda.max_memory_allocated (bfpp train's report) or Megatron's "max allocated"
memory log line; predicted is the planner's per-GPU total (`megatron_bfpp.sim.predict.memory`) for the run's
shape, schedule and ZeRO stage, without the profile's fixed reserve (CUDA context, workspaces), which the
allocator's figure does not include either.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

# bf16 tolerance of the loss comparison: relative difference per iteration. The first iteration sees the same
# weights and data, so only reduction order differs (a few bf16 ulps, 2^-8 relative each); later iterations
# also carry the optimizer's different summation orders forward, and 20 steps of lr warm-up let them grow.
FIRST_ITERATION_RTOL = 5e-3
ALL_ITERATIONS_RTOL = 2e-2
WARMUP_ITERATIONS = 2  # left out of the step-time medians (allocator, autotuning, NCCL set-up)

ITERATION_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|(.*)$")
ELAPSED_RE = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")
LOSS_RE = re.compile(r"lm loss: ([0-9.eE+-]+)")
MEMORY_RE = re.compile(r"\(after \d+ iterations\) memory \(MB\) \| allocated: [0-9.]+ \| max allocated: ([0-9.]+)")


# ------------------------------------------------------------------------------------------------ probe

def probe() -> dict[str, str]:
    """The environment facts the check's commands depend on (see the module docstring)."""
    facts = {"te_version": "", "apex_fused_wgrad": "0"}
    try:
        import transformer_engine
        import transformer_engine.pytorch  # noqa: F401  (the layers Megatron-LM builds)

        facts["te_version"] = str(getattr(transformer_engine, "__version__", "unknown"))
    except Exception:  # not installed, or built against another torch: Megatron-LM falls back to local layers
        pass
    try:
        import torch  # noqa: F401  (the extension links against torch's libraries)
        import fused_weight_gradient_mlp_cuda  # noqa: F401

        facts["apex_fused_wgrad"] = "1"
    except Exception:
        pass
    return facts


def probe_main(a: argparse.Namespace) -> int:
    for key, value in probe().items():
        print(f"{key}={value}")
    return 0


# ------------------------------------------------------------------------------------------------ layer

def resolve_model(spec: str):
    """A simulator model by name (gpt-52b, ...) or a shape `HIDDEN:HEADS:SEQ` (small smoke runs)."""
    from megatron_bfpp.sim.model import ModelProfile, get_model

    if spec.count(":") == 2:
        h, heads, seq = (int(x) for x in spec.split(":"))
        return ModelProfile(spec, 1, h, heads, seq)
    return get_model(spec)


def simulated_ops(model_name: str, hardware: str, micro_batch_size: int) -> dict[str, dict[str, float]]:
    """Seconds per op of one layer (T = 1) under the simulator's cost model: {op: {"fwd": s, "bwd": s}}."""
    from megatron_bfpp.sim import costs
    from megatron_bfpp.sim.hardware import get_hardware
    from megatron_bfpp.sim.model import Partition

    hw, m, b = get_hardware(hardware), resolve_model(model_name), micro_batch_size
    tokens, h, f, s = b * m.seq_length, m.hidden_size, m.ffn, m.seq_length
    ops: dict[str, dict[str, float]] = {}
    for name, (k, n) in {"qkv": (h, 3 * h), "proj": (h, h), "fc1": (h, f), "fc2": (f, h)}.items():
        t = costs.gemm_time(hw, tokens, k, n)
        ops[name] = {"fwd": t, "bwd": 2 * t}  # dgrad + wgrad
    attn = 4.0 * b * s * s * h / (hw.peak_flops * hw.gemm_efficiency) + hw.kernel_overhead_s
    ops["attention"] = {"fwd": attn, "bwd": 2.5 * attn}
    elem = (costs.ELEMENTWISE_BYTES_PER_TOKEN_HIDDEN * tokens * h / (hw.hbm_bandwidth * hw.memory_efficiency)
            + costs.ELEMENTWISE_KERNELS_PER_LAYER * hw.kernel_overhead_s)
    ops["elementwise"] = {"fwd": elem, "bwd": 2 * elem}
    fwd, bwd = costs.layer_times(hw, Partition(m, 1, 1, 1), b)
    ops["layer"] = {"fwd": fwd, "bwd": bwd}
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


def layer_main(a: argparse.Namespace) -> int:
    sim = simulated_ops(a.model, a.hardware, a.micro_batch_size)
    out: dict[str, Any] = {"model": a.model, "hardware_profile": a.hardware, "micro_batch_size": a.micro_batch_size,
                           "tensor_parallel": 1, "dropout": a.dropout, "ops": []}
    meas: dict[str, dict[str, float]] = {}
    if not a.sim_only:
        import torch

        meas, out["spec"] = measured_ops(a.model, a.micro_batch_size, a.device, a.iters, a.warmup, a.dropout)
        out["device"] = torch.cuda.get_device_name(a.device) if a.device.startswith("cuda") else a.device
    for op in ("qkv", "proj", "fc1", "fc2", "attention", "elementwise", "layer"):
        row: dict[str, Any] = {"op": op}
        for k in ("fwd", "bwd"):
            row[f"{k}_sim_ms"] = sim[op][k] * 1e3
            if op in meas:
                row[f"{k}_measured_ms"] = meas[op][k] * 1e3
                row[f"{k}_ratio"] = meas[op][k] / sim[op][k] if sim[op][k] > 0 else None
        out["ops"].append(row)
    if op_rows := out["ops"]:
        print(layer_table(op_rows, a.model, a.hardware))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


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


# ---------------------------------------------------------------------------------------------- summary

def _flag(args: list[str], name: str, default: str | None = None) -> str | None:
    return args[args.index(name) + 1] if name in args else default


def run_config(args: list[str]) -> dict[str, Any]:
    """Shape, schedule and ZeRO stage of a run from its command line (Megatron flag names)."""
    layers = int(_flag(args, "--num-layers"))
    lpvs = _flag(args, "--num-layers-per-virtual-pipeline-stage")
    pp = int(_flag(args, "--pipeline-model-parallel-size", "1"))
    vp = layers // pp // int(lpvs) if lpvs else 1
    bfpp = any(Path(x).name == "bfpp" for x in args) or "megatron_bfpp.train" in args
    world = int(_flag(args, "--nproc-per-node", "1"))
    schedule = _flag(args, "--pipeline-schedule", "breadth-first" if bfpp else "default")
    zero = _flag(args, "--zero-stage")
    if zero is None:  # bfpp train defaults to ZeRO-1; Megatron without the plugin is plain DDP or its dist-opt
        zero = "1" if bfpp or "--use-distributed-optimizer" in args else "0"
    vocab = int(_flag(args, "--vocab-size", "50257"))
    div = int(_flag(args, "--make-vocab-size-divisible-by", "128"))
    return {
        "tool": "bfpp train" if bfpp else "pretrain_gpt.py", "num_layers": layers,
        "hidden_size": int(_flag(args, "--hidden-size")), "num_attention_heads": int(_flag(args, "--num-attention-heads")),
        "seq_length": int(_flag(args, "--seq-length")), "vocab_size": -(-vocab // div) * div,
        "micro_batch_size": int(_flag(args, "--micro-batch-size", "1")),
        "global_batch_size": int(_flag(args, "--global-batch-size")), "pp": pp, "vp": vp, "dp": max(world // pp, 1),
        "schedule": schedule, "zero_stage": int(zero),
    }


def predicted_peak_bytes(cfg: dict[str, Any], hardware: str) -> float:
    """The planner's per-GPU memory for the run (largest pipeline rank), without the profile's fixed reserve."""
    from megatron_bfpp.sim.costs import Config
    from megatron_bfpp.sim.model import ModelProfile
    from megatron_bfpp.sim.predict import memory

    schedule = cfg["schedule"]
    if schedule == "default":
        schedule = "1f1b" if cfg["vp"] == 1 else "interleaved-1f1b"
    model = ModelProfile("check", cfg["num_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["seq_length"],
                     cfg["vocab_size"])
    dp = cfg.get("dp", 1)
    m = cfg["global_batch_size"] // (cfg["micro_batch_size"] * dp)  # per data-parallel rank
    c = Config(1, cfg["pp"], cfg["vp"], dp, cfg["micro_batch_size"], m, schedule, cfg["zero_stage"], False)
    return max(r["total"] for r in memory(model, c))


def read_run(out: Path, name: str) -> dict[str, Any]:
    """Losses, per-iteration seconds and measured peak bytes of run `name` (report JSON, else its log)."""
    args = (out / f"{name}.cmd").read_text().split("\n") if (out / f"{name}.cmd").exists() else []
    args = [x for x in args if x]
    run: dict[str, Any] = {"name": name, "command": args, "losses": [], "iteration_s": [], "peak_bytes": None}
    if args:
        run["config"] = run_config(args)
    report = out / f"{name}.json"
    if report.exists():
        r = json.loads(report.read_text())
        run["losses"] = list(r.get("losses", []))
        run["iteration_s"] = list(r.get("iteration_times_s", []))
        peaks = [m.get("peak_bytes") for m in r.get("memory", []) if m.get("peak_bytes") is not None]
        run["peak_bytes"] = max(peaks) if peaks else None
        return run
    log = out / f"{name}.log"
    if log.exists():
        peak = None
        for line in log.read_text(errors="replace").splitlines():
            if (it := ITERATION_RE.search(line)) and "elapsed time per iteration" in line:
                if (e := ELAPSED_RE.search(line)) is not None:
                    run["iteration_s"].append(float(e.group(1)) / 1e3)
                if (lm := LOSS_RE.search(line)) is not None:
                    run["losses"].append(float(lm.group(1)))
            if (mem := MEMORY_RE.search(line)) is not None:
                peak = max(peak or 0.0, float(mem.group(1)) * 2**20)
        run["peak_bytes"] = peak
    return run


def compare(run: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    """Loss agreement (bf16 tolerance) and step-time ratio of `run` against `ref`."""
    a, b = run["losses"], ref["losses"]
    n = min(len(a), len(b))
    rel = [abs(x - y) / abs(y) if y else math.inf for x, y in zip(a[:n], b[:n])]
    ok = n > 0 and len(a) == len(b) and all(math.isfinite(x) for x in a) and rel[0] <= FIRST_ITERATION_RTOL \
        and max(rel) <= ALL_ITERATIONS_RTOL
    def med(t: list[float]) -> float | None:
        steady = t[WARMUP_ITERATIONS:] or t
        return statistics.median(steady) if steady else None
    ta, tb = med(run["iteration_s"]), med(ref["iteration_s"])
    return {"iterations": n, "first_rel_diff": rel[0] if rel else None, "max_rel_diff": max(rel) if rel else None,
            "losses_ok": ok, "step_s": ta, "ref_step_s": tb, "step_time_ratio": ta / tb if ta and tb else None}


def summary_main(a: argparse.Namespace) -> int:
    out = Path(a.out)
    result: dict[str, Any] = {
        "tolerance": {"first_iteration_rtol": FIRST_ITERATION_RTOL, "all_iterations_rtol": ALL_ITERATIONS_RTOL,
                      "note": "relative |loss - reference loss| per iteration, bf16"},
        "hardware_profile": a.hardware, "runs": [], "pairs": [], "failures": [], "not_run": list(a.not_run),
    }
    runs: dict[str, dict] = {}
    for pair in a.pair:
        name, _, ref = pair.partition("=")
        if name in a.not_run or ref in a.not_run:  # out of the check's time budget: said so, not compared
            result["pairs"].append({"run": name, "reference": ref, "not_run": True})
            continue
        for n in (name, ref):
            if n not in runs:
                runs[n] = read_run(out, n)
                r = runs[n]
                if "config" in r:
                    try:
                        r["predicted_peak_bytes"] = predicted_peak_bytes(r["config"], a.hardware)
                    except Exception as e:  # outside the planner's model: say so, keep the rest of the summary
                        r["prediction_error"] = str(e)
                    if r["peak_bytes"] and r.get("predicted_peak_bytes"):
                        r["memory_ratio"] = r["peak_bytes"] / r["predicted_peak_bytes"]
                if not r["losses"]:
                    result["failures"].append(f"{n}: no iterations (see {out / (n + '.log')})")
        c = compare(runs[name], runs[ref])
        c.update(run=name, reference=ref)
        if c["iterations"] and not c["losses_ok"]:
            result["failures"].append(
                f"{name} vs {ref}: losses differ (first {c['first_rel_diff']:.2e}, max {c['max_rel_diff']:.2e}; "
                f"tolerance {FIRST_ITERATION_RTOL:g} / {ALL_ITERATIONS_RTOL:g})")
        result["pairs"].append(c)
    result["runs"] = [{k: v for k, v in r.items() if k != "command"} | {"command": " ".join(r["command"])}
                      for r in runs.values()]
    layer = out / "layer.json"
    if layer.exists():
        result["layer"] = json.loads(layer.read_text())
    print(summary_table(result))
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1))
    print(f"\nwritten: {out / 'gpu_check.json'}")
    return 1 if result["failures"] else 0


def summary_table(result: dict[str, Any]) -> str:
    def f(v: Any, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    runs = {r["name"]: r for r in result["runs"]}
    w = max([len(p[k]) for p in result["pairs"] for k in ("run", "reference")] + [14])
    lines = [f"{'run':<{w}} {'reference':<{w}} {'iters':>5} {'loss[0]':>9} {'loss[-1]':>9} {'max rel':>9} "
             f"{'ok':>3} {'step ms':>8} {'ref ms':>8} {'ratio':>6} {'peak GiB':>9} {'plan GiB':>9} {'ratio':>6}"]
    for p in result["pairs"]:
        if p.get("not_run"):
            lines.append(f"{p['run']:<{w}} {p['reference']:<{w}} not run (the check's time budget was spent)")
            continue
        r = runs[p["run"]]
        losses = r["losses"]
        lines.append(
            f"{p['run']:<{w}} {p['reference']:<{w}} {p['iterations']:>5} {f(losses[0] if losses else None, '.4f'):>9} "
            f"{f(losses[-1] if losses else None, '.4f'):>9} {f(p['max_rel_diff'], '.2e'):>9} "
            f"{'yes' if p['losses_ok'] else 'NO':>3} {f(p['step_s'] and p['step_s'] * 1e3, '.1f'):>8} "
            f"{f(p['ref_step_s'] and p['ref_step_s'] * 1e3, '.1f'):>8} {f(p['step_time_ratio'], '.2f'):>6} "
            f"{f(r['peak_bytes'] and r['peak_bytes'] / 2**30, '.2f'):>9} "
            f"{f(r.get('predicted_peak_bytes') and r['predicted_peak_bytes'] / 2**30, '.2f'):>9} "
            f"{f(r.get('memory_ratio'), '.2f'):>6}")
    refs = {p["reference"] for p in result["pairs"] if p["reference"] in runs}
    for name in sorted(refs):
        r = runs[name]
        lines.append(f"{name:<{w}} {'(reference)':<{w}} {len(r['losses']):>5} "
                     f"{f(r['losses'][0] if r['losses'] else None, '.4f'):>9} "
                     f"{f(r['losses'][-1] if r['losses'] else None, '.4f'):>9} {'':>9} {'':>3} {'':>8} {'':>8} {'':>6} "
                     f"{f(r['peak_bytes'] and r['peak_bytes'] / 2**30, '.2f'):>9} "
                     f"{f(r.get('predicted_peak_bytes') and r['predicted_peak_bytes'] / 2**30, '.2f'):>9} "
                     f"{f(r.get('memory_ratio'), '.2f'):>6}")
    tol = result["tolerance"]
    lines.append(f"loss tolerance (bf16): relative difference <= {tol['first_iteration_rtol']:g} at iteration 1, "
                 f"<= {tol['all_iterations_rtol']:g} at every iteration; step times: median after "
                 f"{WARMUP_ITERATIONS} warm-up iterations; planner: '{result['hardware_profile']}' profile")
    if "layer" in result:
        lay = result["layer"]
        lines += ["", layer_table(lay["ops"], lay["model"], lay["hardware_profile"])
                  + (f"   [{lay.get('device', '?')}, {lay.get('spec', '?')} spec]" if "device" in lay else "")]
    for msg in result["failures"]:
        lines.append(f"FAILED: {msg}")
    for name in result.get("not_run", []):
        lines.append(f"NOT RUN: {name} (the check's time budget was spent)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    lay = sub.add_parser("layer", help="per-op layer times against the simulator")
    lay.add_argument("--model", default="gpt-52b", help="simulator model name, or HIDDEN:HEADS:SEQ")
    lay.add_argument("--hardware", default="h200")
    lay.add_argument("--micro-batch-size", type=int, default=1)
    lay.add_argument("--device", default="cuda")
    lay.add_argument("--iters", type=int, default=10)
    lay.add_argument("--warmup", type=int, default=3)
    lay.add_argument("--dropout", type=float, default=0.1, help="hidden and attention dropout (Megatron's default)")
    lay.add_argument("--sim-only", action="store_true", help="only the simulator's column (no device needed)")
    lay.add_argument("--json")
    s = sub.add_parser("summary", help="table and JSON of the check's runs")
    s.add_argument("--out", required=True, help="the check's output directory")
    s.add_argument("--pair", action="append", default=[], metavar="RUN=REFERENCE")
    s.add_argument("--hardware", default="h200")
    s.add_argument("--not-run", action="append", default=[], metavar="RUN",
                   help="a run the check left out for its time budget (listed, not compared)")
    sub.add_parser("probe", help="TransformerEngine's version and apex's fused weight-gradient kernel, key=value")
    a = p.parse_args(argv)
    return {"layer": layer_main, "summary": summary_main, "probe": probe_main}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
