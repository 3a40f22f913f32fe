"""The A/B driver's runs as data: the variants, the layout, the flags they share, each run's command and environment.

Pure: nothing here starts a process (the srun rendezvous host is resolved by `run.first_node` and passed in).
"""

from __future__ import annotations

import argparse
import os
import shlex
from dataclasses import dataclass
from pathlib import Path

from .plan_file import PlannedRun, base_args_for, flag_values, select

# The folder holding the megatron_bfpp package (in a source checkout, the repository): first on the ranks'
# PYTHONPATH, so they run this package; the test-only CPU shim lives under it.
ROOT = Path(__file__).resolve().parents[3]
CPU_SHIM = ROOT / "tests" / "support" / "cpu_shim"

# name -> (layers, hidden, heads, seq, tp, pp, layers per virtual stage, global batch); shapes as scripts/slurm/.
MODELS: dict[str, tuple[int, int, int, int, int, int, int, int]] = {
    "tiny": (8, 512, 8, 1024, 1, 4, 1, 16),
    "1.3b": (24, 2048, 16, 2048, 1, 4, 2, 64),
    "13b": (40, 5120, 40, 2048, 2, 8, 1, 128),
    "52b": (64, 8192, 64, 2048, 8, 8, 2, 128),
    "cpu-smoke": (4, 64, 4, 64, 1, 2, 1, 8),
    # Fewer micro-batches than pipeline ranks (M = 2 < P = 4, V = 2): stock cannot interleave, ours can.
    "cpu-p4-m2": (8, 64, 4, 64, 1, 4, 1, 2),
    # One micro-batch of 4 sequences on P = 2 (V = 2): `--cpu-pair p2m1`, one core per rank.
    "cpu-p2-m1": (8, 384, 6, 256, 1, 2, 2, 4),
}
DEFAULT_MODEL = "1.3b"
CPU_MODELS = tuple(name for name in MODELS if name.startswith("cpu"))
DIST_OPT = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
# What stock adds when it interleaves: the first chunk's parameter all-gather overlapped with the optimizer step;
# Megatron-LM allows it only without distributed checkpointing (arguments.py), which these runs do not save.
STOCK_INTERLEAVED = ["--overlap-param-gather-with-optimizer-step", "--ckpt-format", "torch"]
BUILTIN = ("stock", "plugin-bf-distopt", "plugin-bf-zero3")
# Under --plan: stock at the candidate's layout (or --stock-plan's candidate) and the candidate itself.
PLANNED = ("stock", "ours")
# The training settings every variant shares (a plan's base flags, where they set one, win).
TRAINING = ["--lr", "1.5e-4", "--min-lr", "1.5e-5", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
            "--weight-decay", "0.1", "--clip-grad", "1.0", "--init-method-std", "0.006"]
# On CPU: gloo, no fused kernels (the CPU shim's contract), fp32.
CPU_FLAGS = ["--distributed-backend", "gloo", "--num-workers", "0", "--no-gradient-accumulation-fusion",
             "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion",
             "--no-persist-layer-norm", "--hidden-dropout", "0", "--attention-dropout", "0"]
# The rendezvous host of srun runs where the allocation's nodes are not known (a dry run, outside an allocation).
FIRST_NODE = "<first node of the allocation>"


@dataclass
class Variant:
    name: str
    plugin: bool  # through python -m megatron_bfpp.run_megatron_script
    flags: list[str]
    description: str = ""


@dataclass
class RunRecord:
    """One process of one variant (one repetition): what ran and how it ended."""

    variant: str
    rep: int
    log: str
    command: list[str]
    returncode: int | None = None
    timeline: str | None = None


def abs_path(path: str | None) -> str | None:
    return str(Path(path).expanduser().absolute()) if path else None


def layout(a: argparse.Namespace) -> dict:
    """The model's shape and parallel layout with the command line's overrides; V stages per rank, M per
    data-parallel rank. `variant_layout` (the layout flags each variant carries itself: none here, every variant
    shares them), `vs_flags` (the virtual stages) and `recompute` (none) as for a plan (`plan_layout`)."""
    layers, hidden, heads, seq, tp, pp, lps, gbs = MODELS[a.model or DEFAULT_MODEL]
    tp, pp, lps, gbs, mbs = a.tp or tp, a.pp or pp, a.layers_per_stage or lps, a.gbs or gbs, a.mbs or 1
    world = a.nnodes * a.gpus_per_node
    if world % (tp * pp):
        raise SystemExit(f"error: {a.nnodes} node(s) x {a.gpus_per_node} = {world} ranks is not a multiple of "
                         f"TP x PP = {tp * pp}")
    dp = world // (tp * pp)
    if layers % (pp * lps):
        raise SystemExit(f"error: {lps} layer(s) per virtual stage do not divide the {layers // pp} layers of a "
                         f"pipeline rank ({layers} layers, PP = {pp})")
    return dict(layers=layers, hidden=hidden, heads=heads, seq=seq, tp=tp, pp=pp, lps=lps, vp=layers // (pp * lps),
                gbs=gbs, mbs=mbs, world=world, dp=dp, m=gbs // (mbs * dp), variant_layout=[],
                vs_flags=["--num-layers-per-virtual-pipeline-stage", str(lps)], recompute=[], plan=None,
                stock_plan=None)


def plan_layout(a: argparse.Namespace, ours: PlannedRun, stock: PlannedRun | None = None) -> dict:
    """`layout`'s dict for a plan's candidate (`ours`; `stock`: --stock-plan's): its sizes from its config, the
    model from its base flags; each variant carries the candidate's layout flags (a stock plan's candidate has its
    own)."""
    c, base = ours.config, flag_values(ours.base_args)

    def size(name: str) -> int | None:
        return int(base[name][-1]) if base.get(name) else None

    pp, vp, dp = (ours.size(k) for k in ("pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
                                         "data_parallel_size"))
    layers = size("--num-layers")
    return dict(layers=layers, hidden=size("--hidden-size"), heads=size("--num-attention-heads"),
                seq=size("--seq-length"), tp=ours.size("tensor_model_parallel_size"), pp=pp, vp=vp,
                lps=layers // (pp * vp) if layers and layers % (pp * vp) == 0 else None,
                gbs=int(c["micro_batch_size"]) * int(c["num_micro_batches"]) * dp, mbs=int(c["micro_batch_size"]),
                world=a.nnodes * a.gpus_per_node, dp=dp, m=int(c["num_micro_batches"]),
                variant_layout=ours.layout_args(), vs_flags=ours.virtual_stage_args(), recompute=ours.recompute_args(),
                plan=ours, stock_plan=stock)


def common_flags(a: argparse.Namespace, lay: dict, impl: str) -> list[str]:
    """The Megatron flags every variant gets: model, layout (the virtual stages are each variant's), batch, data,
    seed, optimizer schedule, logging. Under a plan: its base flags (model, precision, features) in place of the
    model's, the layout each variant's own (`plan_layout`)."""
    if lay["plan"] is not None:
        return _planned_common_flags(a, lay, impl)
    flags = [
        "--num-layers", str(lay["layers"]), "--hidden-size", str(lay["hidden"]),
        "--num-attention-heads", str(lay["heads"]), "--seq-length", str(lay["seq"]),
        "--max-position-embeddings", str(lay["seq"]),
        "--tensor-model-parallel-size", str(lay["tp"]), "--pipeline-model-parallel-size", str(lay["pp"]),
        "--micro-batch-size", str(lay["mbs"]), "--global-batch-size", str(lay["gbs"]),
        "--transformer-impl", impl, *TRAINING, *_run_flags(a),
    ]
    flags += CPU_FLAGS if a.cpu_smoke else ["--bf16"]
    if lay["tp"] > 1:
        flags.append("--sequence-parallel")
        if impl == "transformer_engine" and not a.no_tp_comm_overlap:
            flags.append("--tp-comm-overlap")
    return flags + _data_flags(a, has_tokenizer=False) + list(a.extra)


def _planned_common_flags(a: argparse.Namespace, lay: dict, impl: str) -> list[str]:
    """A plan's: the driver's training settings the plan's base flags leave unset, the base flags (on CPU without
    bf16/fp16), the TransformerEngine choice unless the plan makes it, the run's length, logging and seed, data.
    Sequence parallelism and TP overlap are the plan's, as planned."""
    base = base_args_for(lay["plan"], a.cpu_smoke)
    given = flag_values(base)
    flags = [*select(TRAINING, list(given), keep=False), *base]
    if "--transformer-impl" not in given:
        flags += ["--transformer-impl", impl]
    flags += _run_flags(a) + (CPU_FLAGS if a.cpu_smoke else [])
    return flags + _data_flags(a, has_tokenizer="--tokenizer-type" in given) + list(a.extra)


def _run_flags(a: argparse.Namespace) -> list[str]:
    return ["--train-iters", str(a.iters), "--eval-iters", "0", "--eval-interval", str(a.iters + 1),
            "--log-interval", "1", "--log-throughput", "--log-memory-interval", "1", "--seed", str(a.seed)]


def _data_flags(a: argparse.Namespace, has_tokenizer: bool) -> list[str]:
    """--data-path with GPT-2's tokenizer, else Megatron's mock data (with the null tokenizer unless the flags set
    a tokenizer)."""
    if a.data_path:
        if not (a.vocab_file and a.merge_file):
            raise SystemExit("error: --data-path needs --vocab-file and --merge-file (GPT2BPETokenizer)")
        return ["--data-path", abs_path(a.data_path), "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
                abs_path(a.vocab_file), "--merge-file", abs_path(a.merge_file), "--split", "949,50,1"]
    if has_tokenizer:
        return ["--mock-data"]
    return ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128" if a.cpu_smoke else "50257"]


def virtual_stage_flags(lay: dict) -> list[str]:
    """What every variant that runs the layout's virtual stages starts with: the layout flags it carries itself
    (a plan's), then the virtual stages."""
    return [*lay["variant_layout"], *lay["vs_flags"]]


def stock_group_sizes(a: argparse.Namespace, lay: dict, stock_vp: int) -> list[int]:
    """Stock's micro-batch group sizes to try when it interleaves (none when it runs 1F1B, `stock_vp` = 1): the
    command line's, else P and 2P where 2P divides M."""
    if stock_vp == 1:
        if a.stock_group_sizes != "auto":
            raise SystemExit(f"error: --stock-group-sizes: stock runs 1F1B without virtual stages here (M = {lay['m']}, "
                             f"P = {lay['pp']}, V = {lay['vp']}), which takes no group size")
        return []
    if a.stock_group_sizes != "auto":
        return [int(g) for g in a.stock_group_sizes.split(",") if g.strip()]
    pp, m = lay["pp"], lay["m"]
    return [pp] + ([2 * pp] if 2 * pp <= m and m % (2 * pp) == 0 else [])


def stock_variants(a: argparse.Namespace, lay: dict, stock_vp: int) -> list[Variant]:
    """Stock Megatron at its best at this layout, with V = `stock_vp` stages per rank (the planner's
    `stock_schedule`, which the command line resolves): interleaved 1F1B per group size with the distributed
    optimizer and every overlap it has; where it cannot interleave (M < P), 1F1B without virtual stages. Under a
    plan it keeps the candidate's recomputation; with --stock-plan it is that candidate, exactly."""
    if lay["stock_plan"] is not None:
        run = lay["stock_plan"]
        return [Variant("stock", False, list(run.args), f"stock Megatron as planned: {run.name} ({run.summary()})")]
    groups = stock_group_sizes(a, lay, stock_vp)
    rc = lay["recompute"]
    if stock_vp == 1 and lay["vp"] > 1:
        if "--pipeline-model-parallel-layout" in lay["vs_flags"]:
            raise SystemExit(f"error: --plan {lay['plan'].path}: stock cannot interleave at M = {lay['m']} < P = "
                             f"{lay['pp']}, and the candidate's --pipeline-model-parallel-layout places V = "
                             f"{lay['vp']} stages per rank: give stock's own plan (--stock-plan, from bfpp plan "
                             f"--stock --json)")
        return [Variant("stock", False, [*lay["variant_layout"], *DIST_OPT, *rc],
                        f"Megatron 1F1B without virtual stages (its interleaved schedule needs M >= P: M = {lay['m']}, "
                        f"P = {lay['pp']}), distributed optimizer")]
    if not groups:  # the layout itself has one stage per rank
        return [Variant("stock", False, [*virtual_stage_flags(lay), *DIST_OPT, *rc],
                        "Megatron 1F1B, distributed optimizer")]
    return [Variant("stock" if len(groups) == 1 else f"stock-g{g}", False,
                    [*virtual_stage_flags(lay), *DIST_OPT, *STOCK_INTERLEAVED,
                     "--microbatch-group-size-per-virtual-pipeline-stage", str(g), *rc],
                    f"Megatron interleaved 1F1B, group size {g}, distributed optimizer")
            for g in groups]


def variants(a: argparse.Namespace, lay: dict, stock_vp: int) -> list[Variant]:
    """The variants of --variants in order (stock expanded per group size), with --add-variant's and each one's
    --variant-flags. Every variant but a stock one that cannot interleave runs the layout's virtual stages."""
    out: list[Variant] = []
    vs = virtual_stage_flags(lay)
    table = {
        "plugin-bf-distopt": Variant("plugin-bf-distopt", True,
                                     [*vs, "--pipeline-schedule", "breadth-first", *DIST_OPT],
                                     "breadth-first, Megatron's distributed optimizer"),
        "plugin-bf-zero3": Variant("plugin-bf-zero3", True,
                                   [*vs, "--pipeline-schedule", "breadth-first", "--zero-stage", "3"],
                                   "breadth-first, the plugin's ZeRO-3"),
        "plugin-izb-distopt": Variant("plugin-izb-distopt", True,
                                      [*vs, "--pipeline-schedule", "interleaved-zb", *DIST_OPT],
                                      "interleaved zero-bubble (split backward), Megatron's distributed optimizer"),
        "plugin-bfzb-zero3": Variant("plugin-bfzb-zero3", True,
                                     [*vs, "--pipeline-schedule", "breadth-first-zb", "--zero-stage", "3"],
                                     "breadth-first with W deferral (split backward), the plugin's ZeRO-3"),
        "plugin-bfzb-distopt": Variant("plugin-bfzb-distopt", True,
                                       [*vs, "--pipeline-schedule", "breadth-first-zb", *DIST_OPT],
                                       "breadth-first with W deferral (split backward), Megatron's distributed "
                                       "optimizer"),
    }
    if lay["plan"] is not None:
        run = lay["plan"]
        table["ours"] = Variant("ours", run.plugin, list(run.args), f"as planned: {run.name} ({run.summary()})")
    for spec in a.add_variant:
        name, _, rest = spec.partition("=")
        kind, _, flags = rest.partition(":")
        if not name or kind not in ("stock", "plugin"):
            raise SystemExit(f"error: --add-variant {spec!r}: use NAME=stock:\"FLAGS\" or NAME=plugin:\"FLAGS\"")
        table[name] = Variant(name, kind == "plugin", [*vs, *shlex.split(flags)], f"added ({kind})")
    for name in [v.strip() for v in (a.variants or ",".join(BUILTIN)).split(",") if v.strip()]:
        if name == "stock":
            out += stock_variants(a, lay, stock_vp)
        elif name in table:
            out.append(table[name])
        else:
            raise SystemExit(f"error: --variants {name} unknown: choose from {', '.join(['stock', *table])}")
    extra: dict[str, list[str]] = {}
    for spec in a.variant_flags:
        name, _, flags = spec.partition("=")
        extra.setdefault(name, []).extend(shlex.split(flags))
    names = {v.name for v in out}
    for name, flags in extra.items():
        targets = [v for v in out if v.name == name or (name == "stock" and v.name.startswith("stock"))]
        if not targets:
            raise SystemExit(f"error: --variant-flags {name}=...: no such variant among {', '.join(sorted(names))}")
        for v in targets:
            v.flags = v.flags + flags
    return out


def site_srun_args() -> list[str]:
    return shlex.split(os.environ.get("BFPP_SRUN_ARGS", ""))


def launch_prefix(a: argparse.Namespace, port: int, run_id: str, host: str = FIRST_NODE) -> list[str]:
    """torchrun on this node, or srun + torchrun with its rendezvous on `host` (the allocation's first node)."""
    if a.launcher == "srun":
        return ["srun", f"--nodes={a.nnodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1", *site_srun_args(),
                "torchrun", "--nnodes", str(a.nnodes), "--nproc-per-node", str(a.gpus_per_node),
                "--rdzv-id", f"{os.environ.get('SLURM_JOB_ID', 'ab')}-{run_id}", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{host}:{port}"]
    return ["torchrun", "--nnodes", "1", "--nproc-per-node", str(a.gpus_per_node), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"localhost:{port}"]


def pin_cores(ranks: int, available: list[int], why: str) -> list[int]:
    """One core per rank, rank k on the k-th of the `available` cores (sorted), so that a rank's idle time is not
    another's CPU time; `why` names the option that asks for it in the refusal."""
    cores = sorted(available)
    if len(cores) < ranks:
        raise SystemExit(f"error: {why} pins each of its {ranks} ranks to a core of its own, and this process may run "
                         f"on {len(cores)} core(s) ({','.join(map(str, cores))}): run it where {ranks} cores are free "
                         f"(e.g. taskset -c 0-{ranks - 1} python scripts/ab_megatron.py ...)")
    return cores[:ranks]


def run_env(a: argparse.Namespace, mlm: str) -> dict[str, str]:
    """The runs' environment: this package and the Megatron-LM checkout on the path (the CPU shim first under
    --cpu-smoke, with the ranks' cores, BFPP_CPU_CORES, where they are pinned: `a.cores`)."""
    env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1", TORCH_NCCL_ASYNC_ERROR_HANDLING="1",
               PYTHONUNBUFFERED="1")
    paths = [str(ROOT), mlm]
    if a.cpu_smoke:
        paths.insert(0, str(CPU_SHIM))
        env.update(BFPP_CPU_SHIM="1", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        if getattr(a, "cores", None):
            env["BFPP_CPU_CORES"] = ",".join(map(str, a.cores))
    env["PYTHONPATH"] = ":".join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def plan(a: argparse.Namespace, mlm: str, out: Path, vs: list[Variant], flags: list[str],
         host: str = FIRST_NODE) -> list[RunRecord]:
    """Every run in order: repetitions interleaved A B C A B C, each with its own rendezvous port."""
    script = str(Path(mlm) / "pretrain_gpt.py")
    records, k = [], 0
    for rep in range(1, a.reps + 1):
        for v in vs:
            log = out / f"{v.name}.rep{rep}.log"
            vflags = flags + v.flags
            timeline = None
            if v.plugin:
                timeline = str(out / f"{v.name}.rep{rep}.timeline.json")
                vflags = vflags + ["--timeline", timeline]
            entry = ["-m", "megatron_bfpp.run_megatron_script", script] if v.plugin else [script]
            cmd = launch_prefix(a, a.master_port + k, f"{v.name}-{rep}", host) + entry + vflags
            records.append(RunRecord(v.name, rep, str(log), cmd, timeline=timeline))
            k += 1
    return records


def shell_line(cmd: list[str]) -> str:
    return " ".join(shlex.quote(c) for c in cmd)
