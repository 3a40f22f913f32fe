"""The plugin's command-line flags, added to Megatron-LM's own parser through `extra_args_provider`.

Megatron's flags are reused where they already say what we need: the virtual pipeline size
(`--num-layers-per-virtual-pipeline-stage` / `--num-virtual-stages-per-pipeline-rank`) and the micro-batch
group size (`--microbatch-group-size-per-virtual-pipeline-stage`).
"""

from __future__ import annotations

import argparse
from typing import Callable

from ..schedule.kinds import KINDS

# "default" keeps Megatron's own choice of schedule; the others run the plugin's runtime.
PIPELINE_SCHEDULES = ("default", *(name for name, kind in KINDS.items() if kind.megatron_choice))
DEFAULT_BUFFERS = 2

ArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (got {value})")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the plugin's flags to a Megatron-LM parser (usable as `extra_args_provider`). Idempotent."""
    if "--pipeline-schedule" in parser._option_string_actions:  # already added (patch + script runner together)
        return parser
    group = parser.add_argument_group(title="megatron_bfpp (breadth-first pipeline parallelism)")
    group.add_argument(
        "--pipeline-schedule", choices=PIPELINE_SCHEDULES, default="default",
        help="Pipeline schedule. 'default' keeps Megatron's own (1F1B, or interleaved 1F1B with virtual stages); "
        "the others run megatron_bfpp's schedule runtime. breadth-first and interleaved-1f1b need virtual stages "
        "(--num-layers-per-virtual-pipeline-stage or --num-virtual-stages-per-pipeline-rank); the micro-batch group "
        "size is --microbatch-group-size-per-virtual-pipeline-stage (breadth-first default: all micro-batches).",
    )
    group.add_argument(
        "--zero-stage", type=int, choices=(1, 2, 3), default=None,
        help="Schedule-placed sharded data parallelism with megatron_bfpp's data-parallel wrapper and sharded "
        "Adam (replacing Megatron's DDP and optimizer). 1: shard optimizer state; 2: also gradients; 3: also "
        "weights, all-gathered per stage where the schedule says. Needs a --pipeline-schedule other than default. "
        "Without it, Megatron's own DDP (and --use-distributed-optimizer) run under the plugin's schedule.",
    )
    group.add_argument(
        "--bfpp-weight-buffers", type=_positive_int, default=None,
        help=f"--zero-stage 3: gathered-weight buffers per rank, i.e. stages whose full weights may be resident at "
        f"once (default {DEFAULT_BUFFERS}: the current stage and the prefetched next one).",
    )
    group.add_argument(
        "--bfpp-grad-buffers", type=_positive_int, default=None,
        help=f"--zero-stage 2/3: full-size gradient buffers per rank (default {DEFAULT_BUFFERS}: one accumulating, "
        "one being reduce-scattered).",
    )
    group.add_argument(
        "--timeline", metavar="PATH", default=None,
        help="Record the plugin runtime's actions of the first training iterations: one event file per rank "
        "(PATH with .rank<R> before the extension); `python -m megatron_bfpp.megatron.timeline PATH` merges them "
        "into a Chrome trace at PATH. Needs a --pipeline-schedule other than default.",
    )
    group.add_argument(
        "--paired-moe-a2a-overlap", action="store_true",
        help="Simulated only (bfpp simulate, bfpp plan; a launch refuses it): the paired order, in which two "
        "forwards (or backwards) of one stage that the schedule runs back to back run merged, each micro-batch's "
        "expert-parallel all-to-all behind the other's compute of the same layer. Needs a --pipeline-schedule "
        "other than default.",
    )
    return parser


def chain_args_providers(*providers: ArgsProvider | None) -> ArgsProvider:
    """One `extra_args_provider` applying each given provider (None skipped) and then the plugin's flags."""

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        for p in providers:
            if p is not None:
                parser = p(parser) or parser
        return add_arguments(parser)

    return provider


def extra_args_provider(other: ArgsProvider | None = None) -> ArgsProvider:
    """`extra_args_provider` for Megatron-LM scripts that already pass one (e.g. ModelOpt's): both are added."""
    return chain_args_providers(other)
