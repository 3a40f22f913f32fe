"""Regime tables: the planned best of ours against stock Megatron-Core at its best, with the simulator, over batch
per GPU (1/32 ... 1 sequence per GPU), for a model given as a preset and Megatron-LM flags.

Both sides come from the same `bfpp plan` inputs (`megatron.plan_flags.read_plan` of the preset's flags and the
table's): ours is that search space (every schedule this package runs, ZeRO-0..3, free stage layouts), stock is
`stock_space` of it (`bfpp plan --stock`: 1F1B at V = 1, interleaved 1F1B at V >= 2 with a group size in [P, M], so
only 1F1B at M < P; the distributed optimizer with every overlap it has; the same free layouts). What the flags fix
(sequence parallelism, FP8, expert-tensor parallelism, token dropping, overlaps) applies to both, and parallel-size
flags restrict both searches alike. `TABLES` names the tables README.md and docs/simulator.md quote.

Each table writes bench/results/regime_<name>.csv and .md and prints the table. Per batch: each side's plan
(schedule, sizes, stage layout, TFLOP/s, peak memory, step and its lower bound, the busiest pipeline rank's load
over the mean), their ratio, and two ceilings from the simulator's step lower bound: stock's step over the bound
of ours' plan (what any order of its stages could give) and over the smallest bound of every configuration
searched for ours that fits (what no layout and no order passes under the cost model).

`--what-if output-layer-over-pipeline` plans ours with the output layer and loss spread over the P pipeline ranks
(`SearchSpace.output_layer_over_pipeline`, a what-if of the cost model, not something the runtime does); stock as
modelled.

Run: python bench/regime_table.py [--table NAME | --model PRESET --hardware HW --gpus N [--name NAME]]
                                  [--batch-per-gpu 1/32 1/16 ...] [--what-if output-layer-over-pipeline]
                                  [-- <pretrain_gpt.py flags for both sides>]
     python bench/regime_table.py --summary   # the ratios of every table written, one line each
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import sys
import time
from fractions import Fraction
from pathlib import Path
from typing import NamedTuple

from megatron_bfpp.megatron.plan_flags import SIZE_FLAGS, SearchOptions, base_flags, read_plan, take
from megatron_bfpp.megatron.presets import preset_flags
from megatron_bfpp.megatron.sim_flags import launch_flags
from megatron_bfpp.sim import SearchSpace, get_hardware, plan, stock_space
from megatron_bfpp.sim.costs import Config
from megatron_bfpp.sim.hardware import Hardware
from megatron_bfpp.sim.layouts import layout_string, parse_layout
from megatron_bfpp.sim.model import ModelProfile, StageSplit
from megatron_bfpp.sim.planner import enumerate_configs, smallest_lower_bound, stated_group_size, stock_schedule
from megatron_bfpp.sim.predict import Prediction

import results_csv  # bench/, which `python bench/<script>.py` puts first on sys.path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
BETAS = [Fraction(1, 32), Fraction(1, 16), Fraction(1, 8), Fraction(1, 4), Fraction(1, 2), Fraction(1)]
WHAT_IFS = {"output-layer-over-pipeline": "output_layer_over_pipeline"}  # --what-if -> SearchSpace field (ours)


class Table(NamedTuple):
    """One regime table: a preset, the hardware and GPU count, and the Megatron-LM flags both sides share (after
    the preset's; parallel-size flags restrict the search), with why they are set."""

    model: str
    hardware: str
    gpus: int
    flags: tuple[str, ...] = ()
    about: str = ""


# Sequence parallelism wherever T > 1 (Megatron's recipes; the 52B table of before searched with it), and each
# model's flags as the published runs the simulator is compared with set them (docs/simulator.md, "Against
# published runs").
TABLES = {
    "gpt-52b-a100": Table("gpt-52b", "dgx-a100", 512, ("--sequence-parallel",),
                          "the paper's 52B GPT, bf16, sequence parallelism"),
    "llama3-70b-h100-bf16": Table(
        "llama3-70b", "dgx-h100", 1024, ("--sequence-parallel", "--tp-comm-overlap"),
        "bf16, sequence parallelism and TP communication overlap as NeMo's and Megatron-Bridge's Llama-3-70B runs"),
    "llama3-70b-h100-fp8": Table(
        "llama3-70b", "dgx-h100", 1024, ("--sequence-parallel", "--tp-comm-overlap", "--fp8-format", "hybrid",
                                         "--fp8-recipe", "tensorwise"),
        "FP8 (hybrid, tensorwise scaling as Megatron-Bridge's Llama-3-70B H100 run), sequence parallelism, TP "
        "communication overlap"),
    "mixtral-8x7b-h100": Table(
        "mixtral-8x7b", "dgx-h100", 256, ("--sequence-parallel", "--expert-tensor-parallel-size", "1",
                                          "--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity"),
        "bf16, expert parallelism searched (EP = 1, 2, 4, 8), experts without tensor parallelism (ETP = 1) and "
        "token dropping with padding to capacity 1.0, as NeMo's Mixtral-8x7B performance recipe"),
}
DEFAULT_TABLE = "gpt-52b-a100"

_CONFIG_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
                "data_parallel_size", "micro_batch_size", "num_micro_batches", "microbatch_group_size_per_vp_stage",
                "zero_stage", "recompute", "overlap_param_gather_with_optimizer_step")
_RESULT_KEYS = ("tflops_per_gpu", "peak_memory_gib", "step_time_s", "step_lower_bound_s", "compute_s", "optimizer_s",
                "optimizer_exposed_s", "optimizer_in_schedule")
# Added later: each side's stage layout, load, context and expert parallelism; the what-if ours was planned under.
_ADDED_KEYS = ("pipeline_model_parallel_layout", "rank_load_max_over_mean", "context_parallel_size",
               "expert_model_parallel_size")
FIELDS = ["batch_per_gpu", "global_batch_size", "stock_can_interleave", "ratio", "ratio_at_ours_bound",
          "ratio_at_any_bound", "any_bound_s", "any_bound_layout"] + [
    f"{side}_{k}" for side in ("ours", "stock") for k in ("schedule", *_CONFIG_KEYS, *_RESULT_KEYS)] + [
    "stock_at_ours_layout"] + [f"{side}_{k}" for side in ("ours", "stock") for k in _ADDED_KEYS] + ["what_if"]


def sides_of(space: SearchSpace, what_if: tuple[str, ...] = ()) -> dict[str, SearchSpace]:
    """Ours (`space`, with the what-ifs named) and stock Megatron at its best in the same space."""
    unknown = [w for w in what_if if w not in WHAT_IFS]
    if unknown:
        raise ValueError(f"--what-if {unknown[0]}: choose from {', '.join(WHAT_IFS)}")
    ours = dataclasses.replace(space, **{WHAT_IFS[w]: True for w in what_if})
    return {"ours": ours, "stock": stock_space(space)}


def table_inputs(model: str, hw: Hardware, gpus: int, flags: tuple[str, ...] | list[str], global_batch: int,
                 what_if: tuple[str, ...] = ()) -> tuple[ModelProfile, dict[str, SearchSpace]]:
    """The model and both sides' search spaces, as `bfpp plan --model MODEL --gpus GPUS -- FLAGS` reads them (the
    preset's flags first); the space does not depend on the batch, `global_batch` only completes the flags."""
    inputs = read_plan([*preset_flags(model), *flags, "--global-batch-size", str(global_batch)], gpus, hw,
                       SearchOptions(), model)
    return inputs.model, sides_of(inputs.space, what_if)


def _stage_layout(cfg: Config) -> str:
    return "even" if cfg.split.layout is None else layout_string(cfg.split.layout)


def _sizes(cfg: Config) -> str:
    extra = "".join(f", {k} = {v}" for k, v in (("CP", cfg.cp), ("EP", cfg.ep)) if v > 1)
    return f"T/P/V/D = {cfg.tp}/{cfg.pp}/{cfg.vp}/{cfg.dp}{extra}, b x M = {cfg.micro_batch_size} x {cfg.microbatches}"


def regime_rows(model: ModelProfile, hw: Hardware, gpus: int, betas: list[Fraction],
                sides: dict[str, SearchSpace]) -> list[dict]:
    """One row per batch per GPU: the best plan of each side (`sides`: ours and stock), their ratio (ours / stock)
    and what stock runs."""
    rows = []
    what_if = ",".join(w for w, f in WHAT_IFS.items() if getattr(sides["ours"], f))
    for beta in betas:
        batch = beta * gpus
        if batch.denominator != 1:
            raise SystemExit(f"--batch-per-gpu {beta} x --gpus {gpus} is not a whole global batch")
        started = time.monotonic()
        row: dict = {"batch_per_gpu": str(beta), "global_batch_size": int(batch), "what_if": what_if or None}
        best: dict[str, Prediction | None] = {}
        for side, space in sides.items():
            res = plan(model, hw, gpus, int(batch), space, top=1)
            best[side] = res.candidates[0] if res.candidates else None
            if best[side] is not None:
                d = best[side].to_dict()
                row.update({f"{side}_{k}": v for k, v in d["config"].items() if f"{side}_{k}" in FIELDS})
                row.update({f"{side}_schedule": d["config"]["pipeline_schedule"],
                            f"{side}_pipeline_model_parallel_layout": _stage_layout(best[side].config),
                            # the optimizer: ours steps stage by stage in the schedule (mostly hidden), stock after it
                            **{f"{side}_{k}": d[k] for k in _RESULT_KEYS + ("rank_load_max_over_mean",)
                               if k in d}})
            print(f"  beta={beta} {side}: {res.searched} configurations, "
                  f"{f'{best[side].tflops_per_gpu:.1f} TFLOP/s' if best[side] else 'nothing fits'}", file=sys.stderr)
        ours, stock = best["ours"], best["stock"]
        row["ratio"] = ours.tflops_per_gpu / stock.tflops_per_gpu if ours and stock else None
        # The most any order of ours' stages could give against stock's plan (`step_lower_bound_s`), and the
        # most any layout searched and any order of its stages could.
        row["ratio_at_ours_bound"] = stock.step_time_s / ours.step_lower_bound_s if ours and stock else None
        found = smallest_lower_bound(model, hw, gpus, int(batch), sides["ours"])
        if found is None:
            raise SystemExit(f"nothing fits at global batch {batch}")
        bound, c = found
        if ours and ours.step_lower_bound_s < bound:  # a layout the search refined for ours' plan
            bound, c = ours.step_lower_bound_s, ours.config
        row["any_bound_s"] = bound
        row["ratio_at_any_bound"] = stock.step_time_s / bound if stock else None
        row["any_bound_layout"] = f"{c.schedule}, {_sizes(c)}, layout {_stage_layout(c)}"
        # Whether any layout of this batch lets stock interleave at all (M >= P with V >= 2 stages per rank).
        row["stock_can_interleave"] = any(c.vp >= 2 for c in enumerate_configs(model, hw, gpus, int(batch),
                                                                            sides["stock"])[0])
        if ours:
            c = ours.config
            kind, vp = stock_schedule(c.pp, c.vp, c.microbatches)
            row["stock_at_ours_layout"] = f"{kind} V={vp}" + (" (falls back: M < P)" if vp != c.vp else "")
        if row["ratio"] is not None:
            print(f"  beta={beta}: ratio {row['ratio']:.3f}x, at any layout's bound {row['ratio_at_any_bound']:.3f}x "
                  f"({time.monotonic() - started:.0f} s)", file=sys.stderr)
        rows.append(row)
    return rows


def _side(row: dict, side: str) -> tuple[str, ...]:
    """(schedule and layout, TFLOP/s, GiB, step (bound) s, load) cells of one side."""
    if row.get(f"{side}_tflops_per_gpu") is None:
        return "nothing fits", "-", "-", "-", "-"

    def g(key: str):
        return row.get(f"{side}_{key}")

    group = g("microbatch_group_size_per_vp_stage")
    extras = [f"G = {group}"] if group is not None else []
    extras += ["recompute"] if g("recompute") else []
    extras += ["param gather in the optimizer step"] if g("overlap_param_gather_with_optimizer_step") else []
    extras += [f"layout {g('pipeline_model_parallel_layout')}"] if g("pipeline_model_parallel_layout") else []
    sizes = "".join(f", {k} = {g(key)}" for k, key in (("CP", "context_parallel_size"),
                                                        ("EP", "expert_model_parallel_size")) if (g(key) or 1) > 1)
    layout = (f"{g('schedule')}, ZeRO-{g('zero_stage')}, T/P/V/D = {g('tensor_model_parallel_size')}/"
              f"{g('pipeline_model_parallel_size')}/{g('virtual_pipeline_model_parallel_size')}/"
              f"{g('data_parallel_size')}{sizes}, b x M = {g('micro_batch_size')} x {g('num_micro_batches')}"
              + "".join(f", {e}" for e in extras))
    load = g("rank_load_max_over_mean")
    return (layout, f"{g('tflops_per_gpu'):.1f}", f"{g('peak_memory_gib'):.1f}",
            f"{g('step_time_s'):.3f} ({g('step_lower_bound_s'):.3f})", f"{load:.3f}" if load is not None else "-")


def markdown(rows: list[dict]) -> str:
    head = ["batch/GPU", "global batch", "planned best of ours", "TFLOP/s", "GiB", "step (bound) s", "load",
            "stock Megatron at its best", "TFLOP/s", "GiB", "step (bound) s", "load", "ours / stock",
            "at ours' lower bound", "at any layout's lower bound", "stock can interleave", "stock at ours' layout"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ours, stock = _side(r, "ours"), _side(r, "stock")
        ratio = f"{r['ratio']:.3f}x" if r["ratio"] is not None else "-"
        ceiling = f"{r['ratio_at_ours_bound']:.3f}x" if r["ratio_at_ours_bound"] is not None else "-"
        anywhere = f"{r['ratio_at_any_bound']:.3f}x ({r['any_bound_layout']})" if r["ratio_at_any_bound"] else "-"
        lines.append(f"| {r['batch_per_gpu']} | {r['global_batch_size']} | {' | '.join(ours)} | {' | '.join(stock)} | "
                     f"{ratio} | {ceiling} | {anywhere} | {'yes' if r['stock_can_interleave'] else 'no: M < P everywhere'} | "
                     f"{r.get('stock_at_ours_layout', '-')} |")
    return "\n".join(lines)


def write_csv(rows: list[dict], path: Path) -> None:
    results_csv.write_csv(rows, path, FIELDS)


def read_csv(path: Path) -> list[dict]:
    """A table's rows as `write_csv` wrote them (numbers as text)."""
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _true(value: object) -> bool:
    return value in (True, "True")  # as regime_rows holds it, or as read_csv reads it back


def row_config(row: dict, side: str, space: SearchSpace) -> Config:
    """The plan of `side` ("ours" or "stock") in a row (as `regime_rows` made it or `read_csv` read it back), as the
    planner built it in `space`, that side's search space (`table_inputs`): the row's sizes, schedule, ZeRO stage,
    recomputation, group size, parameter gather and stage layout on the space's fixed settings."""
    def get(key: str):
        return row[f"{side}_{key}"]

    pp, m, schedule = int(get("pipeline_model_parallel_size")), int(get("num_micro_batches")), get("schedule")
    layout = get("pipeline_model_parallel_layout")
    split = space.split if layout == "even" else StageSplit(layout=parse_layout(layout))
    cfg = space.config(int(get("tensor_model_parallel_size")), pp, int(get("virtual_pipeline_model_parallel_size")),
                       int(get("data_parallel_size")), int(get("micro_batch_size")), m, schedule,
                       int(get("zero_stage")), _true(get("recompute")), split,
                       int(get("context_parallel_size") or 1), int(get("expert_model_parallel_size") or 1))
    group = get("microbatch_group_size_per_vp_stage")
    return dataclasses.replace(cfg, group_size=stated_group_size(schedule, pp, m, int(group) if group else None),
                               param_gather_with_optimizer=_true(get("overlap_param_gather_with_optimizer_step")))


def row_launch_args(table: Table, row: dict, side: str, model: ModelProfile, space: SearchSpace) -> list[str]:
    """The `pretrain_gpt.py` flags that launch a row's plan of `side` in `table` (`model` and `space` from
    `table_inputs`): `bfpp plan --json`'s megatron_base_args, then the candidate's megatron_args (`launch_flags`).
    ValueError for ours planned under a what-if, which no flag runs."""
    flags = [*preset_flags(table.model), *table.flags, "--global-batch-size", str(row["global_batch_size"])]
    return [*base_flags(flags), *launch_flags(row_config(row, side, space), model)]


def summary(names: list[str]) -> str:
    """One markdown line per table written (`names`, each bench/results/regime_<name>.csv): ours / stock per
    batch per GPU, and in parentheses the ratio at any layout's lower bound."""
    tables = {n: read_csv(RESULTS / f"regime_{n}.csv") for n in names if (RESULTS / f"regime_{n}.csv").is_file()}
    betas = list(dict.fromkeys(r["batch_per_gpu"] for rows in tables.values() for r in rows))
    lines = ["| table | " + " | ".join(betas) + " |", "|" + "---|" * (len(betas) + 1)]
    for name, rows in tables.items():
        by_beta = {r["batch_per_gpu"]: r for r in rows}
        cells = [f"{float(r['ratio']):.3f}x ({float(r['ratio_at_any_bound']):.3f}x)" if (r := by_beta.get(b)) and
                 r["ratio"] else "-" for b in betas]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    tables = "; ".join(f"{n}: {t.model} on {t.gpus} x {t.hardware}, {t.about}" for n, t in TABLES.items())
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False,
                                epilog=f"After --: pretrain_gpt.py flags for both sides, after the table's. Tables: "
                                       f"{tables}.")
    p.add_argument("--table", choices=TABLES, default=None,
                   help=f"a named table (default {DEFAULT_TABLE} when no --model is given)")
    p.add_argument("--model", default=None, help="a preset (megatron_bfpp/presets), instead of --table")
    p.add_argument("--hardware", default=None)
    p.add_argument("--gpus", type=int, default=None)
    p.add_argument("--name", default=None, help="writes bench/results/regime_<name>.csv and .md (default: the "
                                                "table's name, or MODEL-HARDWARE-GPUS)")
    p.add_argument("--batch-per-gpu", type=Fraction, nargs="+", default=BETAS)
    p.add_argument("--what-if", choices=WHAT_IFS, action="append", default=[],
                   help="plan ours under a what-if of the cost model (stock as modelled); adds -<what-if> to the name")
    p.add_argument("--summary", action="store_true",
                   help="plan nothing: print ours / stock (at any layout's lower bound) of every named table and "
                        "its what-ifs from bench/results")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args, extra = _parser().parse_args(argv[:cut]), argv[cut + 1:]
    if args.summary:
        print(summary([f"{t}{w}" for t in TABLES for w in ("", *(f"-{x}" for x in WHAT_IFS))]))
        return 0
    if args.table and args.model:
        raise SystemExit("--table names a model itself: give --table or --model, not both")
    if args.model:
        if args.hardware is None or args.gpus is None:
            raise SystemExit("--model needs --hardware and --gpus")
        table = Table(args.model, args.hardware, args.gpus)
        name = args.name or f"{args.model}-{args.hardware}-{args.gpus}"
    else:
        name = args.table or DEFAULT_TABLE
        table = TABLES[name]
        table = table._replace(hardware=args.hardware or table.hardware, gpus=args.gpus or table.gpus)
        name = args.name or name
    name += "".join(f"-{w}" for w in args.what_if)
    flags = [*table.flags, *extra]
    started = time.monotonic()
    try:  # Megatron's and the plan's refusals, one line naming the flag
        hw = get_hardware(table.hardware)
        model, sides = table_inputs(table.model, hw, table.gpus, flags,
                                    max(1, int(args.batch_per_gpu[0] * table.gpus)), tuple(args.what_if))
    except ValueError as e:
        raise SystemExit(f"regime_table.py: error: {e}") from None
    rows = regime_rows(model, hw, table.gpus, args.batch_per_gpu, sides)
    minutes = (time.monotonic() - started) / 60
    text = markdown(rows)
    csv_path, md_path = RESULTS / f"regime_{name}.csv", RESULTS / f"regime_{name}.md"
    write_csv(rows, csv_path)
    what = f"; ours under the what-if {', '.join(args.what_if)}" if args.what_if else ""
    restricted, _ = take(flags, list(SIZE_FLAGS))
    search = ("search restricted to " + "; ".join(f"{k} {' '.join(v)}" for k, v in restricted.items())
              if restricted else "search unrestricted: every T, P, V, CP, EP, D, b, schedule, group size, ZeRO stage, "
              "recomputation and stage layout bfpp plan tries")
    md_path.write_text(f"<!-- generated by python bench/regime_table.py {' '.join(argv)} ({minutes:.1f} min): "
                       f"{table.model} on {table.gpus} x {table.hardware}, flags for both sides: "
                       f"{' '.join(flags) or '(none)'}{what}; {search}; simulated -->\n{text}\n")
    print(text)
    print(f"\nwrote {csv_path} and {md_path} ({minutes:.1f} min)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
