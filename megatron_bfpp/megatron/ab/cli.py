"""A/B: stock Megatron-LM at its best against megatron_bfpp, same model, layout, batch, data and seed.

Variants (--variants; each can get its own extra flags with --variant-flags NAME="...", and more variants can be
added with --add-variant NAME=stock|plugin:"FLAGS", e.g. later schedules):

- stock (stock-g<G> for each --stock-group-sizes G): the unmodified pretrain_gpt.py at its best for the layout
  (the planner's `bfpp plan --stock` rules): interleaved 1F1B over the layout's virtual stages with the
  micro-batch group size G, Megatron's distributed optimizer with --overlap-grad-reduce, --overlap-param-gather
  and --overlap-param-gather-with-optimizer-step (with --ckpt-format torch, which that flag needs); the best of
  the stock-g<G> runs is the baseline. Where M < P its interleaved schedule refuses every group size, and stock
  runs 1F1B without virtual stages (no --num-layers-per-virtual-pipeline-stage) with the same optimizer flags
  but the last (it needs interleaving);
- plugin-bf-distopt: `python -m megatron_bfpp.run_megatron_script`, --pipeline-schedule breadth-first with
  Megatron's own distributed optimizer and overlap flags (no --zero-stage): what the schedule buys;
- plugin-bf-zero3: the script runner, --pipeline-schedule breadth-first --zero-stage 3: what the sharding adds;
- plugin-izb-distopt, plugin-bfzb-zero3, plugin-bfzb-distopt (not in the default list): the split-backward
  schedules interleaved-zb with Megatron's distributed optimizer and breadth-first-zb with ZeRO-3 or Megatron's
  distributed optimizer (under gradient-accumulation fusion,
  Megatron-LM's default, layers that cannot defer write main_grad at I, where ZeRO-3 then gives their stage its
  gradient buffer). Their W's move work only on layers
  that defer their weight GEMMs (Megatron-Core's local linears) and on TransformerEngine layers built with delay_wgrad_compute (TransformerEngine >= 2.7,
  2.8 with --overlap-grad-reduce); with an older TransformerEngine every W's work runs at its I, and these variants measure the
  split's overhead, not a gain (rank 0's log says how many linear layers deferred).

From a plan (--plan PLAN.json [--candidate K], a `bfpp plan --json` output, K 1-based as it prints them, default
1): the model, precision, features, layout and batch are the plan's, and the variants (default) are
- ours: the candidate exactly, `pretrain_gpt.py <megatron_base_args> <its megatron_args>` (through the script
  runner where they name the plugin's schedule or sharding);
- stock: stock at the candidate's layout at its best, as above (the same T, P, CP, EP, stage split, micro-batch,
  global batch, virtual stages where it can interleave, and the candidate's recomputation), or with --stock-plan
  STOCK.json [--stock-candidate K] (a `bfpp plan --stock --json` output) that candidate exactly.
The driver refuses, naming the flag, a plan file that is missing or not a plan (or a stock plan as --plan), a
candidate it does not hold, a candidate whose world size (T x CP x P x D) is not the launch's, and what the
command line sets otherwise: --model, --tp/--pp/--layers-per-stage/--mbs/--gbs, flags after -- or in
--variant-flags ours=/stock= that the plan gives another value or that the candidate's launch flags own and it
runs without. The driver's training settings (learning rate, ...) apply where the plan's flags set none; on
--cpu-smoke the plan's bf16/fp16 is dropped (fp32).

Every variant gets the same model-level settings: --bf16 (fp32 on --cpu-smoke), TransformerEngine layers when
importable (else --transformer-impl local, with a note), and at T > 1 --sequence-parallel plus, with
TransformerEngine, --tp-comm-overlap. Activation recomputation is off unless a variant needs it on the card:
--variant-flags stock="--recompute-granularity full --recompute-method uniform --recompute-num-layers 1".

Repetitions (rounds) run interleaved (A B C A B C ...; --reps); each round's ratios to the baseline's run of the
same round go to ab_rounds.csv and ab_rounds.md (drift between rounds hits every variant of a round alike).
Each run logs every iteration (--log-interval 1 --log-throughput --log-memory-interval 1); plugin variants also
record a --timeline of their first iterations, from which the measured bubble is taken. A run that exits
non-zero, or logs no iteration after --warmup, fails its variant, and so does a run that exits 0 before logging
all of its --iters iterations, in any repetition: the variant is marked failed in the CSV and the PNG (no numbers
are built from a partial log) and the driver exits 1 naming the variant, the repetition and the log. Every
variant must train the same model as the baseline: lm loss and grad norm at every iteration both logged agree
(--loss-rtol at the first, --loss-rtol-all at every one; bf16 tolerances by default), otherwise the driver exits
1. Where stock places layers on other pipeline ranks (M < P, or a stock plan of another layout), Megatron
initialises them from other seeds: the grad norm is then compared at the first iteration only.

--cpu-pair p2m1 is the measured CPU pair: 8 layers, hidden 384, sequence 256, P = 2, one micro-batch of 4
(M = 1 < P); stock's 1F1B against interleaved-zb and breadth-first-zb at V = 2 with Megatron's distributed
optimizer, three paired rounds of 10 iterations (3 left out), each rank pinned to a core of its own (the CPU
shim's BFPP_CPU_CORES; refused where fewer cores than ranks are free), so that a rank's idle time is lost as on a
GPU. --pin-cores does the same for any --cpu-smoke run.

Outputs in --out: <variant>.rep<k>.log, ab_runs.json (what ran), ab_iterations.csv, ab_memory.csv (peak
memory per rank), ab_summary.csv (per variant: status, medians over the repetitions' medians with min/max
spread of tokens/s, elapsed ms and TFLOP/s per GPU, peak memory, measured bubble, first-iteration loss,
deferred_linears: for split-backward variants how many of rank 0's linear layers deferred their weight GEMMs to
W (0: W has no work, e.g. TransformerEngine older than 2.7), ratios to the best stock, the range of the
per-round ratios), ab_rounds.csv and ab_rounds.md (per round and variant: tokens/s and the ratio to the baseline's
run of that round; the markdown heads the table with the command, iterations, cores and load average) and
ab_megatron.png.

    python scripts/ab_megatron.py --megatron-lm-dir ~/Megatron-LM --model 1.3b --gpus-per-node 8 --dry-run
    python scripts/ab_megatron.py --megatron-lm-dir ~/Megatron-LM --model 1.3b --gpus-per-node 8 --reps 3 --out ab-1.3b
    salloc -N 8 ... python scripts/ab_megatron.py --launcher srun --nnodes 8 --model 13b --out ab-13b
    python scripts/ab_megatron.py --parse-only --out ab-1.3b          # re-analyse existing logs
    python scripts/ab_megatron.py --cpu-smoke --out ab-cpu             # the real path on CPU (gloo, tiny GPT)
    python scripts/ab_megatron.py --cpu-smoke --model cpu-p4-m2 --variants stock,plugin-bf-distopt,plugin-izb-distopt \
        --out ab-cpu-m2                  # M = 2 < P = 4: stock runs 1F1B, ours breadth-first / interleaved-zb, V = 2
    bfpp plan --model gpt-1.3b --hardware dgx-h100 --gpus 16 --json -- --global-batch-size 64 > plan.json
    python scripts/ab_megatron.py --plan plan.json --candidate 1 --gpus-per-node 8 --nnodes 2 --out ab-plan
    python scripts/ab_megatron.py --plan plan.json --stock-plan stock.json --gpus-per-node 8 --nnodes 2 --out ab-plan
    python scripts/ab_megatron.py --cpu-pair p2m1 --out ab-cpu-p2m1   # the measured CPU pair (a quiet machine)
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

from ...sim.planner import STOCK_FALLBACK_RULE, stock_schedule
from .commands import (BUILTIN, CPU_MODELS, CPU_SHIM, DEFAULT_MODEL, MODELS, PLANNED, RunRecord, abs_path,
                       common_flags, layout, pin_cores, plan, plan_layout, run_env, shell_line, variants)
from .plan_file import PlannedRun, check_world, conflict, read_plan
from .report import BF16_RTOL, FP32_RTOL, analyse
from .run import check_flags, detect_transformer_impl, first_node, run_all

DEFAULTS = {"iters": 30, "warmup": 5, "reps": 3}
CPU_SMOKE_DEFAULTS = {"iters": 6, "warmup": 2, "reps": 1}
# Measured CPU configurations (--cpu-pair): a model of commands.MODELS, its micro-batch, variants and rounds. With
# one core per rank a rank's idle time is lost as on a GPU, so the pipeline bubble shows in the step time.
CPU_PAIRS: dict[str, dict] = {
    "p2m1": {"about": "8 layers, hidden 384, sequence 256, P = 2, one micro-batch of 4 (M = 1 < P): stock 1F1B "
                      "against interleaved-zb and breadth-first-zb at V = 2 (Megatron's distributed optimizer in "
                      "all three), three paired rounds, one core per rank",
             "model": "cpu-p2-m1", "mbs": 4, "variants": "stock,plugin-izb-distopt,plugin-bfzb-distopt",
             "iters": 10, "warmup": 3, "reps": 3},
}
# The driver's layout options and the Megatron flags they set, for the conflicts with a plan.
LAYOUT_OPTIONS = (("--tp", "tp", "--tensor-model-parallel-size"), ("--pp", "pp", "--pipeline-model-parallel-size"),
                  ("--layers-per-stage", "layers_per_stage", "--num-layers-per-virtual-pipeline-stage"),
                  ("--mbs", "mbs", "--micro-batch-size"), ("--gbs", "gbs", "--global-batch-size"))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--megatron-lm-dir", default=os.environ.get("MEGATRON_LM_DIR"),
                   help="Megatron-LM checkout (default: $MEGATRON_LM_DIR)")
    p.add_argument("--model", choices=sorted(MODELS), help=f"the model and its layout (default {DEFAULT_MODEL})")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=8, help="processes per node")
    p.add_argument("--tp", type=int, help="tensor-parallel size (default: the model's)")
    p.add_argument("--pp", type=int, help="pipeline-parallel size (default: the model's)")
    p.add_argument("--layers-per-stage", type=int, help="layers per virtual stage (default: the model's)")
    p.add_argument("--mbs", type=int, help="micro-batch size (default 1)")
    p.add_argument("--gbs", type=int, help="global batch size (default: the model's)")
    p.add_argument("--iters", type=int, help=f"training iterations per run (default {DEFAULTS['iters']})")
    p.add_argument("--warmup", type=int, help=f"iterations left out of the medians (default {DEFAULTS['warmup']})")
    p.add_argument("--reps", type=int,
                   help=f"repetitions (rounds) per variant, interleaved A B C A B C ... (default {DEFAULTS['reps']})")
    p.add_argument("--variants",
                   help=f"comma-separated, run in this order (default {','.join(BUILTIN)}, with --plan "
                        f"{','.join(PLANNED)}; 'stock' expands to stock-g<G> for each --stock-group-sizes G; also "
                        f"built in: plugin-izb-distopt, plugin-bfzb-zero3, plugin-bfzb-distopt)")
    p.add_argument("--plan", metavar="PLAN.json",
                   help="launch a `bfpp plan --json` candidate: variant 'ours' runs its flags (megatron_base_args + "
                        "its megatron_args), stock runs at its layout; the model, layout and batch are the plan's")
    p.add_argument("--candidate", type=int, help="--plan's candidate, 1-based as bfpp plan prints them (default 1)")
    p.add_argument("--stock-plan", metavar="STOCK.json",
                   help="with --plan: stock runs this `bfpp plan --stock --json` candidate exactly, instead of "
                        "stock at ours' layout")
    p.add_argument("--stock-candidate", type=int, help="--stock-plan's candidate, 1-based (default 1)")
    p.add_argument("--stock-group-sizes", default="auto",
                   help="stock's --microbatch-group-size-per-virtual-pipeline-stage candidates, comma-separated; the "
                        "best is the baseline (default auto: P and 2P where 2P divides M)")
    p.add_argument("--variant-flags", action="append", default=[], metavar='NAME="FLAGS"',
                   help="extra Megatron flags for one variant (repeatable)")
    p.add_argument("--add-variant", action="append", default=[], metavar='NAME=stock|plugin:"FLAGS"',
                   help="another variant: the stock script or the plugin's script runner with these flags (repeatable)")
    p.add_argument("--transformer-impl", choices=("auto", "local", "transformer_engine"), default="auto",
                   help="auto: TransformerEngine when importable where the ranks run, else local (with a note)")
    p.add_argument("--no-tp-comm-overlap", action="store_true", help="no --tp-comm-overlap at T > 1")
    p.add_argument("--data-path", help="Megatron --data-path PREFIX (default: mock data)")
    p.add_argument("--vocab-file")
    p.add_argument("--merge-file")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--loss-rtol", type=float,
                   help="same model: relative lm loss and grad norm agreement at the first iteration (default 5e-3 "
                   "bf16, 1e-4 fp32)")
    p.add_argument("--loss-rtol-all", type=float,
                   help="same model: the same at every iteration both runs logged (default 2e-2 bf16, 1e-4 fp32)")
    p.add_argument("--launcher", choices=("torchrun", "srun"), default="torchrun",
                   help="torchrun on this node, or srun + torchrun inside a SLURM allocation (site options: "
                        "$BFPP_SRUN_ARGS)")
    p.add_argument("--master-port", type=int, default=29500, help="first rendezvous port (one more per run)")
    p.add_argument("--out", default="ab-megatron", help="output directory (logs, CSVs, PNG)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the working directory and every command in run order, run the project's flag check")
    p.add_argument("--no-check", action="store_true", help="skip the flag check (python -m megatron_bfpp.megatron.check)")
    p.add_argument("--parse-only", action="store_true", help="only parse the logs already in --out (ab_runs.json)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="the real path on CPU: a tiny GPT (--model cpu-smoke, the default: P = 2, V = 2, M = 8; or "
                        "cpu-p4-m2: P = 4, V = 2, M = 2), one gloo process per pipeline rank, mock data, fp32, a few "
                        "iterations, through the test-only CPU shim (tests/support/cpu_shim)")
    p.add_argument("--cpu-pair", choices=sorted(CPU_PAIRS),
                   help="a measured CPU configuration (implies --cpu-smoke and --pin-cores): " + "; ".join(
                       f"{k}: {v['about']}" for k, v in CPU_PAIRS.items()))
    p.add_argument("--pin-cores", action="store_true",
                   help="--cpu-smoke: each rank on a core of its own (refused where fewer cores than ranks are free)")
    p.add_argument("extra", nargs="*", help="extra Megatron flags for every variant (after --)")
    return p


def apply_defaults(a: argparse.Namespace, ours: PlannedRun | None = None) -> None:
    """The defaults of what the command line leaves unset: --cpu-pair's, then --cpu-smoke's, then the driver's;
    --variants: stock and ours under a plan (`ours`), else the built-in list."""
    if a.cpu_pair:
        apply_cpu_pair(a)
    if a.cpu_smoke:
        apply_cpu_smoke(a, ours)
    elif a.pin_cores:
        raise SystemExit("error: --pin-cores pins the ranks of a CPU run: add --cpu-smoke")
    for key, value in DEFAULTS.items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    if a.variants is None:
        a.variants = ",".join(PLANNED if ours is not None else BUILTIN)


def apply_cpu_pair(a: argparse.Namespace) -> None:
    """--cpu-pair's settings (`CPU_PAIRS`): its model on CPU, one core per rank, its micro-batch, variants and
    rounds unless given."""
    pair = CPU_PAIRS[a.cpu_pair]
    if a.plan:
        raise SystemExit(f"error: --cpu-pair {a.cpu_pair} runs its own model and layout: drop --plan or --cpu-pair")
    if a.model not in (None, pair["model"]):
        raise SystemExit(f"error: --cpu-pair {a.cpu_pair} runs --model {pair['model']}: drop --model {a.model}")
    a.model, a.cpu_smoke, a.pin_cores = pair["model"], True, True
    for key in ("mbs", "variants", "iters", "warmup", "reps"):
        if getattr(a, key) is None:
            setattr(a, key, pair[key])


def apply_cpu_smoke(a: argparse.Namespace, ours: PlannedRun | None = None) -> None:
    """--cpu-smoke's settings: a CPU model (--model cpu-*, default cpu-smoke) on T x P local processes (D = 1), or
    a plan's candidate on its world size, fewer iterations and repetitions unless given, local layers (fp32:
    `apply_tolerances`)."""
    if ours is not None:
        world = ours.world
    else:
        if a.model not in CPU_MODELS:
            a.model = "cpu-smoke"
        _, _, _, _, tp, pp, _, _ = MODELS[a.model]
        world = (a.tp or tp) * (a.pp or pp)
    a.nnodes, a.gpus_per_node, a.launcher = 1, world, "torchrun"
    for key, value in CPU_SMOKE_DEFAULTS.items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    a.transformer_impl = "local"


def read_plans(a: argparse.Namespace) -> tuple[PlannedRun | None, PlannedRun | None]:
    """--plan's candidate and --stock-plan's (None where not given); the options that need them refused alone."""
    if a.plan is None:
        for option, value in (("--candidate", a.candidate), ("--stock-plan", a.stock_plan),
                              ("--stock-candidate", a.stock_candidate)):
            if value is not None:
                raise SystemExit(f"error: {option} needs --plan PLAN.json (a `bfpp plan --json` output)")
        return None, None
    if a.stock_plan is None and a.stock_candidate is not None:
        raise SystemExit("error: --stock-candidate needs --stock-plan STOCK.json (a `bfpp plan --stock --json` output)")
    ours = read_plan(a.plan, a.candidate or 1)
    stock = (read_plan(a.stock_plan, a.stock_candidate or 1, "--stock-plan", "--stock-candidate", stock=True)
             if a.stock_plan else None)
    return ours, stock


def check_plan_options(a: argparse.Namespace, ours: PlannedRun, stock: PlannedRun | None) -> None:
    """Refuse what the command line gives beside a plan that conflicts with it: the model, a layout option, flags
    after -- or for the planned variants (--variant-flags ours= / stock=) that the plan sets otherwise, stock's group
    sizes beside a stock plan, and a launch whose world size is not the candidates'."""
    plans = [(ours, "--plan")] + ([(stock, "--stock-plan")] if stock else [])
    if a.model is not None:
        raise SystemExit(f"error: --model {a.model} with --plan {ours.path}: the plan's megatron_base_args are the "
                         f"model; drop --model")
    for option, dest, megatron in LAYOUT_OPTIONS:
        value = getattr(a, dest)
        for run, flag in plans:
            why = conflict([megatron, str(value)], run) if value is not None else None
            if why:
                raise SystemExit(f"error: {option} {value} conflicts with {flag} {run.path}: {why}; drop {option}")
    if stock and a.stock_group_sizes != "auto":
        raise SystemExit(f"error: --stock-group-sizes with --stock-plan {stock.path}: stock runs its candidate's own "
                         f"group size; drop --stock-group-sizes")
    for run, flag in plans:
        why = conflict(a.extra, run)
        if why:
            raise SystemExit(f"error: the flags after -- conflict with {flag} {run.path}: {why}; drop them, or plan "
                             f"with them")
    for spec in a.variant_flags:
        name, _, flags = spec.partition("=")
        run, flag = (ours, "--plan") if name == "ours" else (stock, "--stock-plan") if name == "stock" else (None, "")
        why = conflict(shlex.split(flags), run) if run is not None else None
        if why:
            raise SystemExit(f"error: --variant-flags {name}=... conflicts with {flag} {run.path}: {why}; drop it, "
                             f"or plan with it")
    launch = f"--nnodes {a.nnodes} x --gpus-per-node {a.gpus_per_node}"
    for run, flag in plans:
        check_world(run, a.nnodes * a.gpus_per_node, flag, launch)


def apply_tolerances(a: argparse.Namespace, same_layers: bool) -> None:
    """--loss-rtol and --loss-rtol-all unless given: fp32's under --cpu-smoke where every variant builds each layer
    on the same pipeline rank, bf16's otherwise. Megatron seeds a rank's initialisation with its pipeline rank
    (seed + 100 x rank, megatron/training/initialize.py), so where stock runs without the layout's virtual stages
    (M < P) layers start from other weights and the loss curves can only agree as loosely as in bf16."""
    rtol = FP32_RTOL if a.cpu_smoke and same_layers else BF16_RTOL
    if a.loss_rtol is None:
        a.loss_rtol = rtol["first"]
    if a.loss_rtol_all is None:
        a.loss_rtol_all = rtol["all"]


def stock_vp_at(lay: dict) -> int:
    """Virtual stages per rank that stock Megatron-Core runs at this layout: the planner's rule (`stock_schedule`:
    the layout's V, or 1 where M < P leaves its interleaved schedule refused)."""
    return stock_schedule(lay["pp"], lay["vp"], lay["m"])[1]


def same_layers(lay: dict, stock_vp: int) -> bool:
    """Whether stock builds each layer on the same pipeline rank as ours: the same stages per rank (a stock plan's
    candidate: the same pipeline size and virtual stages)."""
    stock = lay["stock_plan"]
    if stock is None:
        return stock_vp == lay["vp"]
    return (stock.virtual_stage_args() == lay["vs_flags"]
            and stock.size("pipeline_model_parallel_size") == lay["pp"])


def title_of(a: argparse.Namespace, lay: dict) -> str:
    if lay["plan"] is None:
        return (f"GPT {a.model or DEFAULT_MODEL}: {lay['world']} ranks, TP={lay['tp']} PP={lay['pp']} DP={lay['dp']}, "
                f"M={lay['m']} - stock Megatron vs megatron_bfpp")
    stock = lay["stock_plan"]
    return (f"{lay['plan'].name} ({lay['plan'].summary()}) - stock Megatron "
            + (f"as planned ({stock.name}: {stock.summary()})" if stock else "at this layout") + " vs megatron_bfpp")


def main(argv: list[str] | None = None) -> int:
    """The driver (the module docstring). Exit status 0: every variant ran and trained the baseline's model; 1: one
    did not, or the flags are refused; 2: nothing to run (no Megatron-LM checkout, no run record, no CPU shim)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    ours, stock = read_plans(a)
    apply_defaults(a, ours)
    if a.cpu_smoke and not (CPU_SHIM / "sitecustomize.py").is_file():
        print(f"error: --cpu-smoke needs the test-only CPU shim {CPU_SHIM}/sitecustomize.py (a source checkout "
              f"of megatron_bfpp)", file=sys.stderr)
        return 2
    out = Path(a.out).expanduser().absolute()
    if ours is not None:
        check_plan_options(a, ours, stock)
        lay = plan_layout(a, ours, stock)
    else:
        lay = layout(a)
    stock_vp = stock_vp_at(lay)
    placed_alike = same_layers(lay, stock_vp)
    apply_tolerances(a, same_layers=placed_alike)
    title = title_of(a, lay)

    if a.parse_only:
        manifest = out / "ab_runs.json"
        if not manifest.is_file():
            print(f"error: {manifest} not found: run the driver first (it records what ran there)", file=sys.stderr)
            return 2
        data = json.loads(manifest.read_text())
        records = [RunRecord(**r) for r in data["runs"]]
        return analyse(out, data["variants"], records, data["seq_length"], data.get("title", title), a.warmup,
                       a.loss_rtol, a.loss_rtol_all, data.get("context"), placed_alike)

    mlm = abs_path(a.megatron_lm_dir)
    if not mlm or not (a.dry_run or (Path(mlm) / "pretrain_gpt.py").is_file()):
        print("error: --megatron-lm-dir (or $MEGATRON_LM_DIR) must point at a Megatron-LM checkout with "
              "pretrain_gpt.py", file=sys.stderr)
        return 2
    mlm = str(Path(mlm).resolve()) if Path(mlm).is_dir() else mlm
    if a.pin_cores:
        a.cores = pin_cores(lay["world"], sorted(os.sched_getaffinity(0)),
                            f"--cpu-pair {a.cpu_pair}" if a.cpu_pair else "--pin-cores")
    impl = detect_transformer_impl(a)
    flags = common_flags(a, lay, impl)
    vs = variants(a, lay, stock_vp)
    records = plan(a, mlm, out, vs, flags, first_node(a))
    if stock is None and stock_vp != lay["vp"] and any(not v.plugin for v in vs):
        print(f"note: M = {lay['m']} < P = {lay['pp']}: {STOCK_FALLBACK_RULE}; its layers then sit on other pipeline "
              f"ranks than ours, which Megatron seeds apart, so the same-model check compares loss curves within "
              f"--loss-rtol {a.loss_rtol:g} / --loss-rtol-all {a.loss_rtol_all:g} (the grad norm at the first "
              f"iteration only)", file=sys.stderr)
    cores = getattr(a, "cores", None)

    if a.dry_run:
        print(f"# {title}")
        print(f"# working directory: {mlm}")
        print(f"# training script:   {Path(mlm) / 'pretrain_gpt.py'}")
        print(f"# output:            {out}")
        print(f"# order:             {' '.join(f'{r.variant}#{r.rep}' for r in records)}")
        if cores:
            print(f"# cores:             {', '.join(f'rank {k} on core {c}' for k, c in enumerate(cores))}")
        if not a.no_check:
            for line in check_flags(a, mlm, vs, flags, lay["world"]):
                print(f"# check {line}")
        env = "CUDA_DEVICE_MAX_CONNECTIONS=1 TORCH_NCCL_ASYNC_ERROR_HANDLING=1"
        for r in records[: len(vs)]:
            print(f"# {r.variant}: log -> {r.log}")
            print(f"{env} {shell_line(r.command)}")
        return 0

    out.mkdir(parents=True, exist_ok=True)
    if not a.no_check:
        for line in check_flags(a, mlm, vs, flags, lay["world"]):
            print(f"check {line}")
    context = {"command": shell_line(["python", "scripts/ab_megatron.py", *argv]),
               "descriptions": {v.name: v.description for v in vs}, "iterations": a.iters, "warmup": a.warmup,
               "cores": cores, "load_before": list(os.getloadavg())}
    manifest: dict = {"variants": [v.name for v in vs], "seq_length": lay["seq"], "title": title, "runs": [],
                      "context": context}
    run_all(records, mlm, run_env(a, mlm), a.reps, manifest, out / "ab_runs.json")
    context["load_after"] = list(os.getloadavg())
    (out / "ab_runs.json").write_text(json.dumps(manifest, indent=1))
    return analyse(out, manifest["variants"], records, lay["seq"], title, a.warmup, a.loss_rtol, a.loss_rtol_all,
                   context, placed_alike)
