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

The modules: `layer` (the layer benchmark), `summary` (the comparisons, table and JSON); the TransformerEngine and
apex checks are the device kit's (`megatron_bfpp/devkit/probe.py`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ..probe import apex_fused_wgrad, transformer_engine_facts
from .layer import layer_rows, layer_table, measured_ops, simulated_ops
from .summary import summarize, summary_table


def probe() -> dict[str, str]:
    """The environment facts the check's commands depend on (see the module docstring)."""
    return {"te_version": transformer_engine_facts().get("version", ""),
            "apex_fused_wgrad": "1" if apex_fused_wgrad() else "0"}


def probe_main(a: argparse.Namespace) -> int:
    for key, value in probe().items():
        print(f"{key}={value}")
    return 0


def layer_main(a: argparse.Namespace) -> int:
    sim = simulated_ops(a.model, a.hardware, a.micro_batch_size)
    out: dict[str, Any] = {"model": a.model, "hardware_profile": a.hardware, "micro_batch_size": a.micro_batch_size,
                           "tensor_parallel": 1, "dropout": a.dropout, "ops": []}
    meas: dict[str, dict[str, float]] = {}
    if not a.sim_only:
        import torch

        meas, out["spec"] = measured_ops(a.model, a.micro_batch_size, a.device, a.iters, a.warmup, a.dropout)
        out["device"] = torch.cuda.get_device_name(a.device) if a.device.startswith("cuda") else a.device
    out["ops"] = layer_rows(sim, meas)
    print(layer_table(out["ops"], a.model, a.hardware))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


def summary_main(a: argparse.Namespace) -> int:
    out = Path(a.out)
    result = summarize(out, a.pair, a.not_run, a.hardware)
    print(summary_table(result))
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1))
    print(f"\nwritten: {out / 'gpu_check.json'}")
    return 1 if result["failures"] else 0


def main(argv: list[str] | None = None) -> int:
    """`probe`, `layer` or `summary` (the module docstring); the subcommand's exit status."""
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
