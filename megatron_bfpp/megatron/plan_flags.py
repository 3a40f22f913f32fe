"""`bfpp plan`'s reading of `pretrain_gpt.py` flags: the model, batch, precision and feature flags as the search's
fixed settings; the parallel sizes, schedule and ZeRO stage as its dimensions.

The flags naming a parallel size (--tensor-model-parallel-size, --pipeline-model-parallel-size,
--context-parallel-size, --expert-model-parallel-size, --num-layers-per-virtual-pipeline-stage,
--num-virtual-stages-per-pipeline-rank, --micro-batch-size), a schedule (--pipeline-schedule) or a ZeRO stage
(--zero-stage) restrict the search to the values given (each may repeat). The rest are parsed by Megatron-LM as
for `bfpp simulate`, at T = P = CP = EP = 1 on D = gcd(N, B) ranks (so that any global batch B of N GPUs
parses), before any search: Megatron's own errors come first. What Megatron reads only at T > 1
(--sequence-parallel, --tp-comm-overlap) or EP > 1 (--overlap-moe-expert-parallel-comm) is read as written.

Data parallelism: with Megatron's own optimizer flags (--use-distributed-optimizer, --overlap-grad-reduce,
--overlap-param-gather) every candidate runs Megatron's DDP or distributed optimizer as they say; otherwise the
search covers ZeRO-0..3 (the plugin's, overlapped), or the --zero-stage values given.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Sequence

from ..schedule import SCHEDULE_NAMES
from ..sim.hardware import Hardware
from ..sim.layouts import parse_layout
from ..sim.model import ModelProfile, StageSplit
from ..sim.planner import STOCK_SCHEDULES, STOCK_ZERO_STAGE, ZERO_STAGES, SearchSpace, stock_space
from .sim_flags import FlagError, check_dispatcher, given_flags, layer_settings, model_profile, parse_flags, \
    refuse_unmodelled, refuse_unmodelled_flags

# Flag -> SearchSpace field it restricts (whole numbers >= 1).
SIZE_FLAGS = {
    "--tensor-model-parallel-size": "tp_sizes",
    "--pipeline-model-parallel-size": "pp_sizes",
    "--context-parallel-size": "cp_sizes",
    "--expert-model-parallel-size": "ep_sizes",
    "--num-virtual-stages-per-pipeline-rank": "vp_sizes",
    "--num-layers-per-virtual-pipeline-stage": "layers_per_virtual_stage",
    "--micro-batch-size": "micro_batch_sizes",
}
# Read by the plan itself, not at the parse's T = P = 1: one value each.
SINGLE_FLAGS = ("--expert-tensor-parallel-size", "--decoder-first-pipeline-num-layers",
                "--decoder-last-pipeline-num-layers", "--pipeline-model-parallel-layout")
MEGATRON_DP_FLAGS = ("--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather")
# Plan searches these itself.
SEARCHED_FLAGS = {
    "--microbatch-group-size-per-virtual-pipeline-stage": "plan searches the group size (--group-size-search off: "
                                                         "each schedule's default)",
    "--overlap-param-gather-with-optimizer-step": "plan --stock tries it on and off",
}


@dataclass(frozen=True)
class SearchOptions:
    """`bfpp plan`'s own options: what to search beyond the flags."""

    schedules: tuple[str, ...] = ()  # restrict (with --pipeline-schedule in the flags); () = every schedule
    zero_stages: tuple[int, ...] = ()  # restrict (with --zero-stage in the flags); () = ZeRO-0..3
    recompute: str = "search"  # full recomputation: "on", "off" or "search" (both)
    group_size_search: bool = True
    max_microbatches: int = 256
    split_backward_w: str = "wgrad-only"
    stock: bool = False
    layout_search: bool = True  # free layouts beside Megatron's default split (SearchSpace.search_layouts)


@dataclass
class PlanInputs:
    model: ModelProfile
    global_batch: int
    space: SearchSpace
    notes: list[str] = field(default_factory=list)
    # The flags every candidate keeps (model, precision, features): a candidate launches as `pretrain_gpt.py
    # base_flags + sim_flags.launch_flags(candidate)`.
    base_flags: list[str] = field(default_factory=list)


# What a candidate's launch flags (`sim_flags.launch_flags`) set: dropped from the plan's flags to give the flags
# every candidate keeps. Flags taking a value, then switches.
CANDIDATE_VALUE_FLAGS = (*SIZE_FLAGS, "--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
                         "--pipeline-model-parallel-layout",
                         "--pipeline-schedule", "--zero-stage", "--global-batch-size", "--recompute-granularity",
                         "--recompute-method", "--recompute-num-layers", "--bfpp-weight-buffers",
                         "--bfpp-grad-buffers", "--microbatch-group-size-per-virtual-pipeline-stage")
CANDIDATE_SWITCHES = (*MEGATRON_DP_FLAGS, "--account-for-embedding-in-pipeline-split",
                      "--account-for-loss-in-pipeline-split", "--overlap-param-gather-with-optimizer-step")


def base_flags(flags: Sequence[str]) -> list[str]:
    """`flags` without those a candidate's launch flags set (sizes, split, schedule, sharding, batch, recomputation,
    data-parallel overlaps)."""
    _, rest = take(flags, CANDIDATE_VALUE_FLAGS)
    return [f for f in rest if f.partition("=")[0] not in CANDIDATE_SWITCHES]


def take(flags: Sequence[str], names: Sequence[str]) -> tuple[dict[str, list[str]], list[str]]:
    """Pull every `--name value` / `--name=value` of `names` out of `flags`: (values by name, the other flags)."""
    found: dict[str, list[str]] = {}
    rest: list[str] = []
    i = 0
    while i < len(flags):
        name, eq, value = flags[i].partition("=")
        if name not in names:
            rest.append(flags[i])
            i += 1
            continue
        if not eq:
            if i + 1 >= len(flags):
                raise FlagError(f"{name} needs a value")
            value = flags[i + 1]
            i += 1
        found.setdefault(name, []).append(value)
        i += 1
    return found, rest


def _whole(name: str, values: list[str]) -> tuple[int, ...]:
    out = []
    for v in values:
        try:
            n = int(v)
        except ValueError:
            raise FlagError(f"{name} {v!r}: a whole number, please") from None
        if n < 1:
            raise FlagError(f"{name} must be >= 1 (got {n})")
        out.append(n)
    return tuple(dict.fromkeys(out))


def _single(name: str, values: list[str] | None) -> int | None:
    if not values:
        return None
    if len(set(values)) > 1:
        raise FlagError(f"{name} given {len(set(values))} values ({', '.join(values)}): plan keeps it fixed; give one")
    return _whole(name, values)[0]


def read_plan(flags: Sequence[str], gpus: int, hw: Hardware, options: SearchOptions = SearchOptions(),
              name: str | None = None) -> PlanInputs:
    """The model, global batch and search space that `pretrain_gpt.py flags` without parallel sizes describe for
    `gpus` GPUs of `hw` (Megatron's errors and the plan's refusals as one ValueError naming the flag)."""
    found, rest = take(flags, [*SIZE_FLAGS, *SINGLE_FLAGS, "--pipeline-schedule", "--zero-stage"])
    given = given_flags(rest)
    refuse_unmodelled_flags(given)
    for flag, why in SEARCHED_FLAGS.items():
        if flag in given:
            raise FlagError(f"{flag}: {why}; drop it")
    batch, _ = take(rest, ["--global-batch-size"])
    if "--global-batch-size" not in batch:
        raise FlagError("--global-batch-size: plan searches layouts for a global batch; add --global-batch-size B")
    global_batch = _whole("--global-batch-size", batch["--global-batch-size"][-1:])[0]
    restrict = {field_: _whole(flag, found[flag]) for flag, field_ in SIZE_FLAGS.items() if flag in found}

    # Parsed at T = P = CP = EP = 1 (b = 1) on D = gcd(N, B): the sizes are the search's.
    parse = [f for f in rest if f not in ("--overlap-moe-expert-parallel-comm",)]
    if "--sequence-parallel" in given:  # Megatron turns it off at T = 1, and then refuses --tp-comm-overlap
        parse = [f for f in parse if f != "--tp-comm-overlap"]
    args = parse_flags([*parse, "--micro-batch-size", "1"], math.gcd(gpus, global_batch), hw)
    args.tp_comm_overlap = "--tp-comm-overlap" in given  # as written (not parsed at T = 1 / EP = 1)
    args.overlap_moe_expert_parallel_comm = "--overlap-moe-expert-parallel-comm" in given
    refuse_unmodelled(args)
    model = model_profile(args, name)
    settings = layer_settings(args, given)
    settings["etp"] = _single("--expert-tensor-parallel-size", found.get("--expert-tensor-parallel-size"))
    split = _split(found, args)
    notes: list[str] = []
    space = SearchSpace(
        max_microbatches=options.max_microbatches, search_group_size=options.group_size_search,
        w_reruns_input_grad=options.split_backward_w == "rerun-dgrad",
        w_at_input_grad=options.split_backward_w == "at-i", split=split, search_layouts=options.layout_search,
        p2p_overlap="--no-overlap-p2p-communication" not in given,
        weight_buffers=args.bfpp_weight_buffers or 2, grad_buffers=args.bfpp_grad_buffers or 2,
        **settings, **restrict,
    )
    space = _experts(space, model, args, notes)
    space = _recompute(space, args, options, settings)
    space = _schedules_and_sharding(space, found, given, args, options)
    if "layers_per_virtual_stage" in restrict and not split.even and (split.first_pipeline_num_layers or
                                                                      split.last_pipeline_num_layers):
        raise FlagError("--num-layers-per-virtual-pipeline-stage with --decoder-first/last-pipeline-num-layers: "
                        "Megatron-LM sets V of an uneven split with --num-virtual-stages-per-pipeline-rank; use it")
    if options.stock:
        space = _stock(space, found, given, options)
    return PlanInputs(model, global_batch, space, notes, base_flags(flags))


def _split(found: dict[str, list[str]], args) -> StageSplit:
    """The split every candidate keeps: a fixed --pipeline-model-parallel-layout (P then divides its stages), the
    uneven-split flags, or Megatron's default (the search then also tries free layouts)."""
    split = StageSplit(_single("--decoder-first-pipeline-num-layers", found.get("--decoder-first-pipeline-num-layers")),
                       _single("--decoder-last-pipeline-num-layers", found.get("--decoder-last-pipeline-num-layers")),
                       bool(args.account_for_embedding_in_pipeline_split),
                       bool(args.account_for_loss_in_pipeline_split))
    layouts = found.get("--pipeline-model-parallel-layout")
    if not layouts:
        return split
    if len(set(layouts)) > 1:
        raise FlagError("--pipeline-model-parallel-layout given twice: plan keeps it fixed; give one (or none, "
                        "and plan searches layouts)")
    try:  # StageSplit refuses the split flags beside a layout
        return dataclasses.replace(split, layout=parse_layout(layouts[0]))
    except ValueError as e:
        raise FlagError(str(e)) from None


def _experts(space: SearchSpace, model: ModelProfile, args, notes: list[str]) -> SearchSpace:
    eps = space.ep_sizes
    if not model.is_moe:
        if eps and max(eps) > 1:
            raise FlagError("--expert-model-parallel-size: Megatron-LM needs --num-experts for expert parallelism "
                            "(num_experts must be non None to use expert model parallelism)")
        if space.moe_a2a_overlap:
            raise FlagError("--overlap-moe-expert-parallel-comm: Megatron-LM supports it only with expert model "
                            "parallelism of an MoE model (--num-experts)")
        if space.paired_moe_a2a_overlap:
            raise FlagError("--paired-moe-a2a-overlap hides the expert-parallel all-to-all: it needs an MoE model "
                            "(--num-experts)")
        return space
    check_dispatcher(args, max(eps or (1,)))
    if args.moe_token_dispatcher_type == "allgather":
        notes.append("expert parallelism searched at EP = 1 only: --moe-token-dispatcher-type allgather (Megatron's "
                     "default); the simulator models EP > 1 with --moe-token-dispatcher-type alltoall")
        eps = (1,)
    if space.moe_a2a_overlap:
        eps = tuple(e for e in (eps or _divisors(model.num_experts)) if e > 1)  # Megatron needs EP > 1 for it
    if space.paired_moe_a2a_overlap:
        notes.append("--paired-moe-a2a-overlap: the paired order is simulated only; a launch refuses it (the runtime "
                     "has no merged execution of two micro-batches)")
    return dataclasses.replace(space, ep_sizes=eps)


def _divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)


def _recompute(space: SearchSpace, args, options: SearchOptions, settings: dict) -> SearchSpace:
    """Full recomputation: fixed by --recompute-granularity when given, else searched as --recompute says."""
    granularity = args.recompute_granularity
    if granularity is not None and options.recompute != "search":
        raise FlagError(f"--recompute {options.recompute} with --recompute-granularity {granularity}: give one")
    if granularity == "full":
        choices: tuple[bool, ...] = (True,)
    elif granularity == "selective":
        choices = (False,)
    else:
        choices = {"on": (True,), "off": (False,), "search": (False, True)}[options.recompute]
    if settings["moe_a2a_overlap"] and True in choices:
        if choices == (True,):
            raise FlagError("--overlap-moe-expert-parallel-comm with full recomputation: Megatron-Core refuses it "
                            "(disable full recomputation when enabling overlap_moe_expert_parallel_comm)")
        choices = (False,)  # Megatron-Core refuses the pair: search without recomputation
    return dataclasses.replace(space, recompute=choices)


def _schedules_and_sharding(space: SearchSpace, found: dict[str, list[str]], given: set[str], args,
                            options: SearchOptions) -> SearchSpace:
    schedules = tuple(dict.fromkeys([*options.schedules, *found.get("--pipeline-schedule", [])]))
    for s in schedules:
        if s not in (*SCHEDULE_NAMES, "default"):
            raise FlagError(f"--pipeline-schedule {s!r}: choose from default, {', '.join(SCHEDULE_NAMES)}")
    zeros = tuple(dict.fromkeys([*options.zero_stages, *(int(z) for z in found.get("--zero-stage", []))]))
    for z in zeros:
        if z not in ZERO_STAGES:
            raise FlagError(f"--zero-stage {z}: choose from {', '.join(map(str, ZERO_STAGES))}")
    megatron_dp = [f for f in MEGATRON_DP_FLAGS if f in given]
    stock_only = bool(schedules) and set(schedules) == {"default"}
    if "default" in schedules:  # Megatron's own schedules
        schedules = tuple(dict.fromkeys(s for x in schedules for s in (STOCK_SCHEDULES if x == "default" else [x])))
    changes: dict = {"schedules": schedules or SCHEDULE_NAMES}
    if megatron_dp:
        if zeros:
            raise FlagError(f"--zero-stage {zeros[0]} brings megatron_bfpp's sharded optimizer: drop {megatron_dp[0]} "
                            "(Megatron's DDP / distributed optimizer), or drop --zero-stage")
        changes.update(zero_stages=(1 if args.use_distributed_optimizer else 0,),
                       dp_overlap=bool(args.overlap_grad_reduce), stock_optimizer=True)
    elif stock_only:  # Megatron's schedules run Megatron's DDP or distributed optimizer
        if space.paired_moe_a2a_overlap:
            raise FlagError("--paired-moe-a2a-overlap is the paired order of the plugin's schedules: drop "
                            "--pipeline-schedule default, or use --overlap-moe-expert-parallel-comm")
        if zeros:
            raise FlagError("--zero-stage needs megatron_bfpp's schedule runtime: --pipeline-schedule default is "
                            "Megatron's own; drop one")
        changes.update(zero_stages=(0, 1), stock_optimizer=True)
    else:
        changes.update(zero_stages=zeros or ZERO_STAGES)
    return dataclasses.replace(space, **changes)


def _stock(space: SearchSpace, found: dict[str, list[str]], given: set[str], options: SearchOptions) -> SearchSpace:
    """`--stock`: the search narrowed to stock Megatron at its best; a flag asking for what it does not run is
    refused."""
    others = [s for s in [*options.schedules, *found.get("--pipeline-schedule", [])]
              if s not in (*STOCK_SCHEDULES, "default")]
    if others:
        raise FlagError(f"--stock searches stock Megatron's schedules ({', '.join(STOCK_SCHEDULES)}): drop "
                        f"--pipeline-schedule {' '.join(others)}")
    if options.zero_stages or "--zero-stage" in found:
        raise FlagError(f"--stock is Megatron's distributed optimizer (ZeRO-{STOCK_ZERO_STAGE}): drop --zero-stage")
    megatron_dp = [f for f in MEGATRON_DP_FLAGS if f in given]
    if megatron_dp and len(megatron_dp) < len(MEGATRON_DP_FLAGS):
        raise FlagError("--stock is Megatron at its best, every overlap on: give all of "
                        f"{' '.join(MEGATRON_DP_FLAGS)} or none")
    if not space.p2p_overlap:
        raise FlagError("--stock is Megatron at its best, every overlap on: drop --no-overlap-p2p-communication")
    if options.split_backward_w != "wgrad-only":
        raise FlagError("--stock runs no split backward: drop --split-backward-w")
    if space.paired_moe_a2a_overlap:
        raise FlagError("--stock runs Megatron's own schedules, which have no paired order: drop "
                        "--paired-moe-a2a-overlap (stock overlaps with --overlap-moe-expert-parallel-comm)")
    return stock_space(dataclasses.replace(space, zero_stages=ZERO_STAGES, stock_optimizer=False))
