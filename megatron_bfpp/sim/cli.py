"""`bfpp simulate` (predict one configuration) and `bfpp plan` (search and rank configurations)."""

from __future__ import annotations

import argparse
import json
import sys

from ..schedule import SCHEDULE_NAMES
from ..schedule.kinds import megatron_kind
from .costs import Config
from .hardware import PROFILES, get_hardware
from .model import MODELS, ModelProfile, StageSplit, get_model
from .planner import (STOCK_FALLBACK_RULE, STOCK_SCHEDULES, STOCK_ZERO_STAGE, ZERO_STAGES, SearchSpace, plan,
                      stock_schedule, stock_space)
from .predict import predict


class _Error(Exception):
    pass


def _on_off(v: str) -> bool:
    return v == "on"


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help=f"model profile: {', '.join(MODELS)}")
    p.add_argument("--hardware", required=True, help=f"hardware profile: {', '.join(PROFILES)}")
    p.add_argument("--gpus", type=int, required=True, help="total number of GPUs N = T * P * D")
    p.add_argument("--global-batch-size", type=int, required=True, help="sequences per step B")
    p.add_argument("--seq-length", type=int, default=None, help="override the model's sequence length (2048)")
    p.add_argument("--dp-overlap", choices=("on", "off"), default="on",
                   help="overlap data-parallel communication with compute (off: Megatron-LM as of 2022)")
    p.add_argument("--p2p-overlap", choices=("on", "off"), default="on",
                   help="non-blocking pipeline p2p (off: blocking sends, Megatron-LM as of 2022)")
    p.add_argument("--split-backward-w", choices=("wgrad-only", "at-i", "rerun-dgrad"), default="wgrad-only",
                   help="cost of a W in split-backward schedules: wgrad-only = the weight-gradient GEMMs alone "
                        "(Qi et al.; the runtime on Megatron-Core's local linears), at-i = nothing, the whole "
                        "backward runs at I (layers that cannot defer, e.g. TransformerEngine < 2.3), rerun-dgrad = "
                        "the fused linear nodes' whole backward again (a split on the autograd graph of "
                        "one-Function layers)")
    p.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                   help="Megatron-LM's uneven split: layers on the first pipeline rank (all its virtual stages)")
    p.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                   help="Megatron-LM's uneven split: layers on the last pipeline rank")
    p.add_argument("--account-for-embedding-in-pipeline-split", action="store_true",
                   help="Megatron-LM's split counting the embedding as a layer (the first stage holds one less)")
    p.add_argument("--account-for-loss-in-pipeline-split", action="store_true",
                   help="Megatron-LM's split counting the output layer and loss as a layer (the last stage holds "
                        "one less)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def simulate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bfpp simulate", description="Predict one training step of a configuration.")
    _common(p)
    p.add_argument("--micro-batch-size", type=int, required=True, help="sequences per micro-batch b")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1, help="T (default 1)")
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="P (default 1)")
    p.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="layers per stage L; V = layers / (P * L) stages per rank (default: V = 1)")
    p.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None,
                   help="V directly (what an uneven split needs)")
    p.add_argument("--pipeline-schedule", choices=SCHEDULE_NAMES, default=None,
                   help="default: 1f1b when V = 1, interleaved-1f1b otherwise")
    p.add_argument("--microbatch-group-size-per-virtual-pipeline-stage", type=int, default=None,
                   dest="microbatch_group_size_per_vp_stage",
                   help="interleaved: Megatron's group size (default P); breadth-first(-zb): micro-batches per "
                        "breadth-first group, and for -zb the most W's left pending (default M)")
    p.add_argument("--zero-stage", type=int, choices=ZERO_STAGES, default=1,
                   help="0 = DDP all-reduce, 1 = distributed optimizer, 2, 3 = sharded gradients / weights "
                        "(default 1)")
    p.add_argument("--recompute", action="store_true", help="full activation recomputation")
    p.add_argument("--stock-optimizer", action="store_true",
                   help="stock Megatron's optimizer, outside the schedule: the step waits for the whole optimizer "
                        "(default: the plugin's, stepping stage by stage at the step boundary; implied by "
                        "--overlap-param-gather-with-optimizer-step)")
    p.add_argument("--overlap-param-gather-with-optimizer-step", action="store_true",
                   help="Megatron's flag (interleaved-1f1b, --zero-stage 1): the first chunk's parameter all-gather "
                        "runs during the other chunks' optimizer steps")
    p.add_argument("--weight-buffers", type=int, default=2, help="ZeRO-3 gathered stages kept at once")
    p.add_argument("--grad-buffers", type=int, default=2, help="ZeRO-2/3 full-size gradient buffers")
    p.add_argument("--trace", default=None, help="write the simulated timeline as a Chrome trace JSON file")
    return p


def plan_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bfpp plan",
                                description="Search parallel layouts that fit in memory and rank them by throughput.")
    _common(p)
    p.add_argument("--pipeline-schedule", choices=SCHEDULE_NAMES, action="append", default=None,
                   help="restrict to this schedule (repeatable; default all, the split-backward ones included)")
    p.add_argument("--zero-stage", type=int, choices=ZERO_STAGES, action="append", default=None,
                   help="restrict to this ZeRO stage (repeatable; default 0-3)")
    p.add_argument("--tensor-model-parallel-size", type=int, action="append", default=None,
                   help="restrict T (repeatable)")
    p.add_argument("--pipeline-model-parallel-size", type=int, action="append", default=None,
                   help="restrict P (repeatable)")
    p.add_argument("--micro-batch-size", type=int, action="append", default=None,
                   help="restrict b (repeatable; default 1, 2, 4, 8, 16)")
    p.add_argument("--recompute", choices=("on", "off", "search"), default="search",
                   help="full activation recomputation (default: search both)")
    p.add_argument("--group-size-search", choices=("on", "off"), default="on",
                   help="search micro-batch group sizes (off: P for interleaved, M for breadth-first)")
    p.add_argument("--max-microbatches", type=int, default=256, help="largest M simulated (default 256)")
    p.add_argument("--top", type=int, default=5, help="candidates to return (default 5)")
    p.add_argument("--stock", action="store_true",
                   help="search only what stock Megatron-Core runs, at its best: 1f1b (V = 1) and interleaved-1f1b "
                        "(V >= 2, group size in [P, M], so 1f1b at M < P), the distributed optimizer (ZeRO-1) with "
                        "overlapped gradient reduce and parameter gather, --overlap-param-gather-with-optimizer-step "
                        "tried when interleaved; the denominator of the benchmarks' \"vs Megatron\" ratios")
    return p


def _model(args: argparse.Namespace) -> ModelProfile:
    m = get_model(args.model)
    if args.seq_length is not None:
        if args.seq_length < 1:
            raise _Error(f"--seq-length must be >= 1 (got {args.seq_length})")
        m = ModelProfile(m.name, m.num_layers, m.hidden_size, m.num_heads, args.seq_length, m.vocab_size,
                     m.ffn_hidden_size)
    return m


def config_from_args(args: argparse.Namespace, model: ModelProfile) -> Config:
    t, p, n, bsz, b = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.gpus,
                       args.global_batch_size, args.micro_batch_size)
    for flag, v in (("--tensor-model-parallel-size", t), ("--pipeline-model-parallel-size", p), ("--gpus", n),
                    ("--global-batch-size", bsz), ("--micro-batch-size", b)):
        if v < 1:
            raise _Error(f"{flag} must be >= 1 (got {v})")
    if n % (t * p):
        raise _Error(f"--gpus {n} is not a multiple of --tensor-model-parallel-size {t} x "
                     f"--pipeline-model-parallel-size {p}: the data-parallel size D = N/(T*P) must be whole")
    d = n // (t * p)
    if bsz % (d * b):
        raise _Error(f"--global-batch-size {bsz} is not a multiple of D*b = {d}*{b}: choose B = D * b * M")
    m = bsz // (d * b)
    split = _split(args)
    if args.num_virtual_stages_per_pipeline_rank is not None:
        if args.num_layers_per_virtual_pipeline_stage is not None:
            raise _Error("--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank both set "
                         "V: give one")
        v = args.num_virtual_stages_per_pipeline_rank
        if v < 1:
            raise _Error(f"--num-virtual-stages-per-pipeline-rank must be >= 1 (got {v})")
    elif args.num_layers_per_virtual_pipeline_stage is None:
        v = 1
    elif not split.even:
        raise _Error("an uneven split sets V with --num-virtual-stages-per-pipeline-rank, not "
                     "--num-layers-per-virtual-pipeline-stage (stages hold different layer counts)")
    elif model.num_layers % p:
        raise _Error(f"--pipeline-model-parallel-size {p} does not divide the {model.num_layers} layers of {model.name}")
    else:
        lyr = args.num_layers_per_virtual_pipeline_stage
        if lyr < 1 or (model.num_layers // p) % lyr:
            raise _Error(f"--num-layers-per-virtual-pipeline-stage {lyr} must divide the {model.num_layers // p} "
                         f"layers per pipeline rank")
        v = model.num_layers // (p * lyr)
    sched = args.pipeline_schedule or megatron_kind(v)
    return Config(t, p, v, d, b, m, sched, args.zero_stage, args.recompute, args.microbatch_group_size_per_vp_stage,
                  _on_off(args.dp_overlap), _on_off(args.p2p_overlap), args.weight_buffers, args.grad_buffers,
                  w_reruns_input_grad=args.split_backward_w == "rerun-dgrad",
                  w_at_input_grad=args.split_backward_w == "at-i", split=split,
                  param_gather_with_optimizer=args.overlap_param_gather_with_optimizer_step,
                  stock_optimizer=args.stock_optimizer)


def _split(args: argparse.Namespace) -> StageSplit:
    return StageSplit(args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers,
                      args.account_for_embedding_in_pipeline_split, args.account_for_loss_in_pipeline_split)


def _run(prog: str, body, argv: list[str] | None) -> int:
    try:
        return body(argv)
    except (_Error, ValueError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2


def simulate_main(argv: list[str] | None = None) -> int:
    return _run("bfpp simulate", _simulate, argv)


def _simulate(argv: list[str] | None) -> int:
    args = simulate_parser().parse_args(argv)
    model, hw = _model(args), get_hardware(args.hardware)
    cfg = config_from_args(args, model)
    pred = predict(model, hw, cfg, record_events=args.trace is not None, check=True)
    if args.trace:
        from ..trace.chrome import write_chrome_trace

        write_chrome_trace(pred.events, args.trace, metadata={"source": "bfpp simulate", **pred.to_dict()["config"]})
    if args.json:
        print(json.dumps(pred.to_dict(), indent=2))
        return 0
    c = pred.to_dict()["config"]
    print(f"{model.name} on {args.gpus} x {hw.name}: T={cfg.tp} P={cfg.pp} V={cfg.vp} D={cfg.dp} b={cfg.micro_batch_size} "
          f"M={cfg.microbatches} {cfg.schedule} (group {c['microbatch_group_size_per_vp_stage']}) ZeRO-{cfg.zero_stage}"
          f"{' recompute' if cfg.recompute else ''}")
    rows = [("step time", f"{pred.step_time_s:.4f} s"),
            ("lower bound", f"{pred.step_lower_bound_s:.4f} s (no order of these stages steps faster)"),
            ("TFLOP/s per GPU", f"{pred.tflops_per_gpu:.1f}"),
            ("MFU", f"{pred.mfu:.1%}"), ("bubble (of compute)", f"{pred.bubble_fraction:.1%}"),
            ("exposed p2p", f"{pred.exposed_pp_s:.4f} s"), ("exposed dp", f"{pred.exposed_dp_s:.4f} s"),
            ("optimizer", f"{pred.optimizer_s:.4f} s, {pred.optimizer_exposed_s:.4f} s exposed"
                          + (" (stage by stage at the step boundary)" if cfg.optimizer_in_schedule else "")),
            ("peak memory", f"{pred.peak_memory_gib:.1f} GiB ({'fits' if pred.fits else 'does NOT fit'} in "
                            f"{hw.usable_memory_bytes / 2**30:.1f} GiB usable)")]
    rows += [(f"  {k}", f"{v:.2f} GiB") for k, v in pred.memory_gib.items() if k != "total"]
    if cfg.split_backward:
        rows.append(("pending W's (peak)", f"{max(pred.peak_pending_weight_grads)} per rank, their operands in "
                                           "activations" + (" (W re-runs dgrad)" if cfg.w_reruns_input_grad else
                                                            " (W's work runs at I)" if cfg.w_at_input_grad else "")))
    for k, v in rows:
        print(f"  {k:<22} {v}")
    return 0


def plan_main(argv: list[str] | None = None) -> int:
    return _run("bfpp plan", _plan, argv)


def _plan(argv: list[str] | None) -> int:
    args = plan_parser().parse_args(argv)
    model, hw = _model(args), get_hardware(args.hardware)
    for flag, vals in (("--tensor-model-parallel-size", args.tensor_model_parallel_size),
                       ("--pipeline-model-parallel-size", args.pipeline_model_parallel_size),
                       ("--micro-batch-size", args.micro_batch_size)):
        if vals and min(vals) < 1:
            raise _Error(f"{flag} must be >= 1 (got {min(vals)})")
    space = SearchSpace(
        schedules=tuple(dict.fromkeys(args.pipeline_schedule or SCHEDULE_NAMES)),
        zero_stages=tuple(dict.fromkeys(args.zero_stage if args.zero_stage is not None else ZERO_STAGES)),
        tp_sizes=tuple(args.tensor_model_parallel_size) if args.tensor_model_parallel_size else None,
        pp_sizes=tuple(args.pipeline_model_parallel_size) if args.pipeline_model_parallel_size else None,
        micro_batch_sizes=tuple(args.micro_batch_size) if args.micro_batch_size else (1, 2, 4, 8, 16),
        recompute={"on": (True,), "off": (False,), "search": (False, True)}[args.recompute],
        search_group_size=_on_off(args.group_size_search),
        dp_overlap=_on_off(args.dp_overlap), p2p_overlap=_on_off(args.p2p_overlap),
        max_microbatches=args.max_microbatches,
        w_reruns_input_grad=args.split_backward_w == "rerun-dgrad",
        w_at_input_grad=args.split_backward_w == "at-i",
        split=_split(args),
    )
    if args.stock:
        space = _stock(args, space)
    res = plan(model, hw, args.gpus, args.global_batch_size, space, args.top)
    if args.json:
        print(json.dumps(res.to_dict(), indent=2))
        return 0 if res.candidates else 1
    what = ("stock Megatron-Core at its best (distributed optimizer, every overlap; 'ag@opt': "
            "--overlap-param-gather-with-optimizer-step), " if res.stock else "")
    print(f"{model.name} on {args.gpus} x {hw.name}, global batch {args.global_batch_size}: {what}"
          f"{res.searched} configurations, {res.simulated} simulated")
    if res.candidates:
        print(f"  {'#':>2} {'TFLOP/s':>8} {'step s':>8} {'bound s':>8} {'GiB':>6}  T  P   V    D  b    M  schedule          G  "
              "Z  rc  "
              + ("ag@opt" if res.stock else "stock at this layout"))
    for i, p in enumerate(res.candidates):
        c, g = p.config, p.to_dict()["config"]["microbatch_group_size_per_vp_stage"]
        print(f"  {i + 1:>2} {p.tflops_per_gpu:>8.1f} {p.step_time_s:>8.3f} {p.step_lower_bound_s:>8.3f} "
              f"{p.peak_memory_gib:>6.1f} {c.tp:>2} {c.pp:>2} "
              f"{c.vp:>3} {c.dp:>4} {c.micro_batch_size:>2} {c.microbatches:>4}  {c.schedule:<16} {g if g else '-':>2} "
              f"{c.zero_stage:>2}  {'y' if c.recompute else 'n'}  "
              + (("y" if c.param_gather_with_optimizer else "n") if res.stock else _stock_here(c)))
    if res.rejected:
        print("  most promising rejected:")
        for r in res.rejected:
            c = r.config
            print(f"    T={c.tp} P={c.pp} V={c.vp} D={c.dp} b={c.micro_batch_size} {c.schedule} ZeRO-{c.zero_stage}"
                  f"{' rc' if c.recompute else ''} (<= {r.tflops_upper_bound:.0f} TFLOP/s): {r.reason}")
    for n in res.notes:
        print(f"  note: {n}")
    if res.stock_fallback:
        shown = ", ".join("/".join(map(str, lay)) for lay in res.stock_fallback[:6])
        more = f" and {len(res.stock_fallback) - 6} more" if len(res.stock_fallback) > 6 else ""
        print(f"  stock falls back at M < P: {STOCK_FALLBACK_RULE}; {len(res.stock_fallback)} of the layouts searched "
              f"(T/P/D/b/M = {shown}{more})")
    return 0 if res.candidates else 1


def _stock_here(cfg: Config) -> str:
    """What stock runs at a candidate's layout, for the table."""
    kind, vp = stock_schedule(cfg.pp, cfg.vp, cfg.microbatches)
    return f"{kind} V={vp}" + (" (falls back: M < P)" if vp != cfg.vp else "")


def _stock(args: argparse.Namespace, space: SearchSpace) -> SearchSpace:
    """`--stock`: the search narrowed to stock Megatron; a flag asking for something stock does not run is refused."""
    others = [s for s in args.pipeline_schedule or () if s not in STOCK_SCHEDULES]
    if others:
        raise _Error(f"--stock searches stock Megatron's schedules ({', '.join(STOCK_SCHEDULES)}): drop "
                     f"--pipeline-schedule {' '.join(others)}")
    if args.zero_stage is not None and set(args.zero_stage) != {STOCK_ZERO_STAGE}:
        raise _Error(f"--stock is Megatron's distributed optimizer (ZeRO-{STOCK_ZERO_STAGE}): drop --zero-stage")
    if args.dp_overlap == "off" or args.p2p_overlap == "off":
        raise _Error("--stock is Megatron at its best, every overlap on: drop --dp-overlap / --p2p-overlap off")
    if args.split_backward_w != "wgrad-only":
        raise _Error("--stock runs no split backward: drop --split-backward-w")
    return stock_space(space)


if __name__ == "__main__":
    sys.exit(simulate_main())
