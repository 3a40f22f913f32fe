"""`bfpp simulate` (predict one run) and `bfpp plan` (search and rank layouts), each taking the run as launched:
Megatron-LM's `pretrain_gpt.py` flags after `--`.

    bfpp simulate --hardware dgx-h100 --gpus 1024 [--model PRESET] [--json] [--trace PATH] -- <pretrain_gpt.py flags>
    bfpp plan --hardware dgx-h100 --gpus 1024 [--model PRESET] [--top K] [--stock] [--json] -- <flags without sizes>

A preset's flags (`--model`, `megatron_bfpp/presets/`) come first and the flags after `--` override them. Before
`--`, anything that is not one of the command's own options is taken as a Megatron-LM flag too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Callable, Sequence

from ..schedule import SCHEDULE_NAMES
from ..sim.costs import Config
from ..sim.hardware import PROFILES, Hardware, get_hardware
from ..sim.layer_costs import measured_profile
from ..sim.model import resolve_model
from ..sim.planner import STOCK_FALLBACK_RULE, ZERO_STAGES, PlanResult, plan, stock_schedule
from ..sim.predict import config_dict, predict
from .plan_flags import SearchOptions, read_plan
from .presets import preset_flags, preset_names
from .sim_flags import launch_flags, read_run

SPLIT_BACKWARD_W = ("wgrad-only", "at-i", "rerun-dgrad")
_EPILOG = ("After --: Megatron-LM's pretrain_gpt.py flags (model, batch, precision, features), parsed by Megatron-LM's "
           "own parser; a preset's flags (--model) come first and these override them.")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hardware", required=True, help=f"hardware profile: {', '.join(PROFILES)}")
    p.add_argument("--gpus", type=int, required=True, help="GPUs of the run N = T * CP * P * D (Megatron's world size)")
    p.add_argument("--model", default=None, help=f"a preset's flags first: {', '.join(preset_names())}")
    p.add_argument("--split-backward-w", choices=SPLIT_BACKWARD_W, default="wgrad-only",
                   help="cost of a W in split-backward schedules: wgrad-only = the weight-gradient GEMMs alone "
                        "(Qi et al.; the runtime on Megatron-Core's local linears and TransformerEngine >= 2.7), "
                        "at-i = nothing, the whole backward runs at I (layers that cannot defer), rerun-dgrad = the "
                        "fused linear nodes' whole backward again (a split on the autograd graph of one-Function "
                        "layers)")
    p.add_argument("--hardware-report", metavar="PATH", default=None,
                   help="the device kit's layer table measured on the GPU (scripts/gpu_check.py layer --json): its "
                        "achieved GEMM, attention and memory rates replace the profile's")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def hardware(opts: argparse.Namespace) -> Hardware:
    """The --hardware profile, with a device's own measured rates when --hardware-report gives them."""
    base = get_hardware(opts.hardware)
    if opts.hardware_report is None:
        return base
    try:
        report = json.loads(Path(opts.hardware_report).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--hardware-report {opts.hardware_report}: {e}") from None
    return measured_profile(base, report, resolve_model(str(report.get("model", ""))))


def simulate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bfpp simulate", description="Predict one training step of a run.",
                                epilog=_EPILOG, allow_abbrev=False)
    _common(p)
    p.add_argument("--trace", default=None, help="write the simulated timeline as a Chrome trace JSON file")
    return p


def plan_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bfpp plan", description="Search parallel layouts that fit in memory and rank them by throughput.",
        epilog=_EPILOG + " Parallel sizes (--tensor-model-parallel-size, --pipeline-model-parallel-size, "
        "--context-parallel-size, --expert-model-parallel-size, --num-layers-per-virtual-pipeline-stage, "
        "--num-virtual-stages-per-pipeline-rank, --micro-batch-size) restrict the search to the values given "
        "(repeatable); the rest is fixed in every candidate.", allow_abbrev=False)
    _common(p)
    p.add_argument("--pipeline-schedule", choices=("default", *SCHEDULE_NAMES), action="append", default=None,
                   help="restrict to this schedule (repeatable; default all, the split-backward ones included; "
                        "default = Megatron's own)")
    p.add_argument("--zero-stage", type=int, choices=ZERO_STAGES, action="append", default=None,
                   help="restrict to this ZeRO stage (repeatable; default 0-3)")
    p.add_argument("--recompute", choices=("on", "off", "search"), default="search",
                   help="full activation recomputation when the flags do not set --recompute-granularity "
                        "(default: search both)")
    p.add_argument("--group-size-search", choices=("on", "off"), default="on",
                   help="search micro-batch group sizes (off: P for interleaved, M for breadth-first)")
    p.add_argument("--layout-search", choices=("on", "off"), default="on",
                   help="beside Megatron's default split, try free stage layouts (--pipeline-model-parallel-layout) "
                        "that give the ranks holding the embedding and the output layer fewer layers, at any P and V, "
                        "then refine the best ones by moving single layers while the simulated step shortens "
                        "(default on; off: equal stages only, as without the flag)")
    p.add_argument("--max-microbatches", type=int, default=256, help="largest M simulated (default 256)")
    p.add_argument("--top", type=int, default=5, help="candidates to return (default 5)")
    p.add_argument("--stock", action="store_true",
                   help="search only what stock Megatron-Core runs, at its best: 1f1b (V = 1) and interleaved-1f1b "
                        "(V >= 2, group size in [P, M], so 1f1b at M < P), the distributed optimizer (ZeRO-1) with "
                        "overlapped gradient reduce and parameter gather, --overlap-param-gather-with-optimizer-step "
                        "tried when interleaved; the denominator of the benchmarks' \"vs Megatron\" ratios")
    return p


def split_argv(parser: argparse.ArgumentParser, argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """The command's own options, and the Megatron-LM flags: the preset's, then those before `--` that are not the
    command's, then those after it."""
    argv = list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args, megatron = parser.parse_known_args(argv[:cut])
    if args.gpus < 1:
        raise ValueError(f"--gpus must be >= 1 (got {args.gpus})")
    preset = preset_flags(args.model) if args.model else []
    return args, [*preset, *megatron, *argv[cut + 1:]]


def _run(prog: str, body: Callable[[list[str]], int], argv: Sequence[str] | None) -> int:
    try:
        return body(list(sys.argv[1:] if argv is None else argv))
    except ValueError as e:  # Megatron's rejection, the plugin's, the simulator's: one line naming the flag
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2


# ------------------------------------------------------------------------------------------------ simulate

def simulate_main(argv: Sequence[str] | None = None) -> int:
    return _run("bfpp simulate", _simulate, argv)


def _simulate(argv: list[str]) -> int:
    opts, flags = split_argv(simulate_parser(), argv)
    hw = hardware(opts)
    model, cfg = read_run(flags, opts.gpus, hw, opts.model)
    cfg = _with_split_backward_w(cfg, opts.split_backward_w)
    pred = predict(model, hw, cfg, record_events=opts.trace is not None, check=True)
    out = {**pred.to_dict(), "config": config_dict(cfg)}
    if opts.trace:
        from ..trace.chrome import write_chrome_trace

        write_chrome_trace(pred.events, opts.trace, metadata={"source": "bfpp simulate", **out["config"]})
    if opts.json:
        print(json.dumps(out, indent=2))
        return 0
    c = out["config"]
    extra = "".join(f" {k}={v}" for k, v in (("CP", cfg.cp), ("EP", cfg.ep)) if v > 1)
    print(f"{model.name} on {opts.gpus} x {hw.name}: T={cfg.tp} P={cfg.pp} V={cfg.vp}{extra} D={cfg.dp} "
          f"b={cfg.micro_batch_size} M={cfg.microbatches} {cfg.schedule} (group {c['microbatch_group_size_per_vp_stage']}) "
          f"ZeRO-{cfg.zero_stage}{' recompute' if cfg.recompute else ''}{' FP8 ' + cfg.fp8 if cfg.fp8 else ''}")
    rows = [("step time", f"{pred.step_time_s:.4f} s"),
            ("lower bound", f"{pred.step_lower_bound_s:.4f} s (no order of these stages steps faster)"),
            ("TFLOP/s per GPU", f"{pred.tflops_per_gpu:.1f}"),
            ("MFU", f"{pred.mfu:.1%} of the dense {'FP8' if cfg.fp8 else 'bf16'} peak"),
            ("bubble (of compute)", f"{pred.bubble_fraction:.1%}"),
            ("exposed p2p", f"{pred.exposed_pp_s:.4f} s"), ("exposed dp", f"{pred.exposed_dp_s:.4f} s"),
            ("optimizer", f"{pred.optimizer_s:.4f} s, {pred.optimizer_exposed_s:.4f} s exposed"
                          + (" (stage by stage at the step boundary)" if cfg.optimizer_in_schedule else "")),
            ("peak memory", f"{pred.peak_memory_gib:.1f} GiB ({'fits' if pred.fits else 'does NOT fit'} in "
                            f"{hw.usable_memory_bytes / 2**30:.1f} GiB usable)")]
    rows += [(f"  {k}", f"{v:.2f} GiB") for k, v in pred.memory_gib.items() if k != "total"]
    if model.is_moe and cfg.ep > 1:
        rows.append(("exposed all-to-all", f"{pred.exposed_moe_a2a_s:.4f} s, {pred.paired_actions} actions merged"
                     + (" (paired order: simulated only, a launch refuses it)" if cfg.paired_moe_a2a_overlap else
                        " (Megatron's combined 1F1B)" if cfg.moe_a2a_overlap else "")))
    if cfg.split_backward:
        rows.append(("pending W's (peak)", f"{max(pred.peak_pending_weight_grads)} per rank, their operands in "
                                           "activations" + (" (W re-runs dgrad)" if cfg.w_reruns_input_grad else
                                                            " (W's work runs at I)" if cfg.w_at_input_grad else "")))
    for k, v in rows:
        print(f"  {k:<22} {v}")
    return 0


def _with_split_backward_w(cfg: Config, how: str) -> Config:
    return dataclasses.replace(cfg, w_reruns_input_grad=how == "rerun-dgrad", w_at_input_grad=how == "at-i")


# ------------------------------------------------------------------------------------------------ plan

def plan_main(argv: Sequence[str] | None = None) -> int:
    return _run("bfpp plan", _plan, argv)


def _plan(argv: list[str]) -> int:
    opts, flags = split_argv(plan_parser(), argv)
    hw = hardware(opts)
    if opts.top < 1:
        raise ValueError(f"--top must be >= 1 (got {opts.top})")
    options = SearchOptions(
        schedules=tuple(opts.pipeline_schedule or ()), zero_stages=tuple(opts.zero_stage or ()),
        recompute=opts.recompute, group_size_search=opts.group_size_search == "on",
        max_microbatches=opts.max_microbatches, split_backward_w=opts.split_backward_w, stock=opts.stock,
        layout_search=opts.layout_search == "on")
    inputs = read_plan(flags, opts.gpus, hw, options, opts.model)
    model = inputs.model
    res = plan(model, hw, opts.gpus, inputs.global_batch, inputs.space, opts.top)
    res.notes += inputs.notes
    if opts.json:
        # A candidate launches as pretrain_gpt.py <megatron_base_args> <its megatron_args> (+ data and output).
        d = {"megatron_base_args": inputs.base_flags, **res.to_dict()}
        for cand, p in zip(d["candidates"], res.candidates):
            cand["megatron_args"] = launch_flags(p.config, model)
        print(json.dumps(d, indent=2))
        return 0 if res.candidates else 1
    _print_plan(res, model.name, opts.gpus, hw.name, inputs.global_batch, model)
    return 0 if res.candidates else 1


def _print_plan(res: PlanResult, name: str, gpus: int, hw: str, global_batch: int, model) -> None:
    what = ("stock Megatron-Core at its best (distributed optimizer, every overlap; 'ag@opt': "
            "--overlap-param-gather-with-optimizer-step), " if res.stock else "")
    print(f"{name} on {gpus} x {hw}, global batch {global_batch}: {what}"
          f"{res.searched} configurations, {res.simulated} simulated")
    wide = any(p.config.cp > 1 or p.config.ep > 1 for p in res.candidates)
    if res.candidates:
        print(f"  {'#':>2} {'TFLOP/s':>8} {'step s':>8} {'bound s':>8} {'load':>5} {'GiB':>6}  T  P   V    D  b    M  "
              "schedule          G  Z  rc  " + ("ag@opt" if res.stock else "stock at this layout")
              + ("  CP  EP" if wide else ""))
    for i, p in enumerate(res.candidates):
        c, g = p.config, p.to_dict()["config"]["microbatch_group_size_per_vp_stage"]
        print(f"  {i + 1:>2} {p.tflops_per_gpu:>8.1f} {p.step_time_s:>8.3f} {p.step_lower_bound_s:>8.3f} "
              f"{p.rank_load_max_over_mean:>5.3f} {p.peak_memory_gib:>6.1f} {c.tp:>2} {c.pp:>2} "
              f"{c.vp:>3} {c.dp:>4} {c.micro_batch_size:>2} {c.microbatches:>4}  {c.schedule:<16} {g if g else '-':>2} "
              f"{c.zero_stage:>2}  {'y' if c.recompute else 'n'}  "
              + (("y" if c.param_gather_with_optimizer else "n") if res.stock else _stock_here(c))
              + (f"  {c.cp:>2}  {c.ep:>2}" if wide else ""))
    if res.candidates:
        print("  load: the busiest pipeline rank's compute over the mean rank's (1 = balanced stages); bound: no "
              "order of the candidate's stages steps faster")
        print(f"  #1 launches with: {' '.join(launch_flags(res.candidates[0].config, model))}")
    if res.rejected:
        print("  most promising rejected:")
        for r in res.rejected:
            c = r.config
            sizes = "".join(f" {k}={v}" for k, v in (("CP", c.cp), ("EP", c.ep)) if v > 1)
            print(f"    T={c.tp} P={c.pp} V={c.vp}{sizes} D={c.dp} b={c.micro_batch_size} {c.schedule} "
                  f"ZeRO-{c.zero_stage}{' rc' if c.recompute else ''} (<= {r.tflops_upper_bound:.0f} TFLOP/s): "
                  f"{r.reason}")
    for n in res.notes:
        print(f"  note: {n}")
    if res.stock_fallback:
        shown = ", ".join("/".join(map(str, lay)) for lay in res.stock_fallback[:6])
        more = f" and {len(res.stock_fallback) - 6} more" if len(res.stock_fallback) > 6 else ""
        print(f"  stock falls back at M < P: {STOCK_FALLBACK_RULE}; {len(res.stock_fallback)} of the layouts searched "
              f"(T/P/D/b/M = {shown}{more})")


def _stock_here(cfg: Config) -> str:
    """What stock runs at a candidate's layout, for the table."""
    kind, vp = stock_schedule(cfg.pp, cfg.vp, cfg.microbatches)
    return f"{kind} V={vp}" + (" (falls back: M < P)" if vp != cfg.vp else "")


if __name__ == "__main__":
    sys.exit(simulate_main())
