"""A `bfpp plan --json` file as the A/B driver and the SLURM scripts launch it.

The file holds `megatron_base_args` (the flags every candidate keeps: model, precision, features) and per candidate
`megatron_args` (the flags that launch it: sizes, virtual stages, schedule, sharding, batch, recomputation,
overlaps) and `config` (every field); `stock` says whether it was a `bfpp plan --stock` search. Candidate K (1-based,
as `bfpp plan` prints them) launches as `pretrain_gpt.py <megatron_base_args> <megatron_args>` plus data, tokenizer
and output flags.

Pure and without torch or Megatron (the SLURM scripts run `python -m megatron_bfpp.megatron.ab.plan_file` in the
batch shell, before any step): nothing here starts a process.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..plan_flags import CANDIDATE_SWITCHES, CANDIDATE_VALUE_FLAGS

# How a candidate's launch flags divide. The layout is what stock at the candidate's layout keeps (sizes, stage split,
# batch); the virtual stages are kept too where stock can interleave; recomputation is kept (the same activations
# in memory); the rest (schedule, sharding, data-parallel overlaps, group size) is the candidate's own.
LAYOUT_FLAGS = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
                "--expert-model-parallel-size", "--decoder-first-pipeline-num-layers",
                "--decoder-last-pipeline-num-layers", "--account-for-embedding-in-pipeline-split",
                "--account-for-loss-in-pipeline-split", "--micro-batch-size", "--global-batch-size")
VIRTUAL_STAGE_FLAGS = ("--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank",
                       "--pipeline-model-parallel-layout")
RECOMPUTE_FLAGS = ("--recompute-granularity", "--recompute-method", "--recompute-num-layers")
# What a candidate's launch flags own: given elsewhere while the candidate leaves it out, it would change the plan.
OWNED_FLAGS = frozenset((*CANDIDATE_VALUE_FLAGS, *CANDIDATE_SWITCHES, *VIRTUAL_STAGE_FLAGS))
# Flags only the plugin reads: a candidate with one runs through the plugin's script runner.
PLUGIN_FLAGS = ("--pipeline-schedule", "--zero-stage", "--bfpp-weight-buffers", "--bfpp-grad-buffers")
PRECISION_FLAGS = ("--bf16", "--fp16")


def flag_items(flags: Sequence[str]) -> list[tuple[str, tuple[str, ...]]]:
    """`flags` as (name, values) in order: a name is a word starting with `--` (`--name=value` split), its values
    the words up to the next name."""
    items: list[tuple[str, tuple[str, ...]]] = []
    for word in flags:
        if word.startswith("--"):
            name, eq, value = word.partition("=")
            items.append((name, (value,) if eq else ()))
        elif items:
            items[-1] = (items[-1][0], (*items[-1][1], word))
        else:
            items.append(("", (word,)))  # a value before any name: kept, never matched
    return items


def flag_values(flags: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """Each flag's values as Megatron-LM's parser keeps them: the last occurrence wins."""
    return {name: values for name, values in flag_items(flags) if name}


def select(flags: Sequence[str], names: Sequence[str], keep: bool = True) -> list[str]:
    """The flags (with their values) named in `names` (`keep`), or all the others."""
    out: list[str] = []
    for name, values in flag_items(flags):
        if (name in names) == keep:
            out += ([name] if name else []) + list(values)
    return out


@dataclass(frozen=True)
class PlannedRun:
    """Candidate `number` of the plan file at `path`."""

    path: str
    number: int  # 1-based, as `bfpp plan` prints it
    stock: bool  # the file is a `bfpp plan --stock` search
    base_args: tuple[str, ...]
    args: tuple[str, ...]
    config: dict

    def size(self, key: str) -> int:
        return int(self.config.get(key) or 1)

    @property
    def world(self) -> int:
        """Megatron's world size: T x CP x P x D."""
        return (self.size("tensor_model_parallel_size") * self.size("context_parallel_size")
                * self.size("pipeline_model_parallel_size") * self.size("data_parallel_size"))

    @property
    def name(self) -> str:
        return f"{self.path} candidate {self.number}"

    @property
    def plugin(self) -> bool:
        """Whether it runs the plugin (its flags name a schedule or a sharding of the plugin's)."""
        values = flag_values(self.args)
        return any(values.get(f, ("default",)) != ("default",) for f in PLUGIN_FLAGS)

    @property
    def schedule(self) -> str:
        return str(self.config.get("pipeline_schedule", ""))

    def layout_args(self) -> list[str]:
        return select(self.args, LAYOUT_FLAGS)

    def virtual_stage_args(self) -> list[str]:
        return select(self.args, VIRTUAL_STAGE_FLAGS)

    def recompute_args(self) -> list[str]:
        return select(self.args, RECOMPUTE_FLAGS)

    def own_args(self) -> list[str]:
        """What is the candidate's own: its flags but the layout, virtual stages and recomputation."""
        return select(self.args, (*LAYOUT_FLAGS, *VIRTUAL_STAGE_FLAGS, *RECOMPUTE_FLAGS), keep=False)

    def summary(self) -> str:
        c = self.config
        return (f"T={self.size('tensor_model_parallel_size')} P={self.size('pipeline_model_parallel_size')} "
                f"V={self.size('virtual_pipeline_model_parallel_size')} D={self.size('data_parallel_size')}"
                + "".join(f" {k}={self.size(key)}" for k, key in (("CP", "context_parallel_size"),
                                                                 ("EP", "expert_model_parallel_size"))
                          if self.size(key) > 1)
                + f" b={c.get('micro_batch_size')} M={c.get('num_micro_batches')} {self.schedule} "
                  f"ZeRO-{c.get('zero_stage')}{' recompute' if c.get('recompute') else ''}")


def _refuse(message: str) -> SystemExit:
    return SystemExit(f"error: {message}")


def read_plan(path: str, number: int = 1, flag: str = "--plan", number_flag: str = "--candidate",
              stock: bool = False) -> PlannedRun:
    """Candidate `number` (1-based) of the `bfpp plan --json` output at `path`; `stock`: it must be a
    `bfpp plan --stock --json` output (stock's candidates), else it must not be. One error naming the flag."""
    make = "bfpp plan --stock --json ... > FILE" if stock else "bfpp plan --json ... > FILE"
    p = Path(path).expanduser()
    if not p.is_file():
        raise _refuse(f"{flag} {path}: no such file (write one with `{make}`)")
    try:
        data = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise _refuse(f"{flag} {path}: not a `bfpp plan --json` output ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("megatron_base_args"), list) or \
            not isinstance(data.get("candidates"), list):
        raise _refuse(f"{flag} {path}: not a `bfpp plan --json` output (no megatron_base_args and candidates; write "
                      f"one with `{make}`)")
    if bool(data.get("stock")) != stock:
        raise _refuse(f"{flag} {path} is a `bfpp plan --stock` output (stock Megatron's candidates): pass it as "
                      f"--stock-plan, and ours (a `bfpp plan --json` output) as --plan" if not stock else
                      f"{flag} {path} is not a `bfpp plan --stock` output: give stock Megatron's plan (`{make}`)")
    cands = data["candidates"]
    if not 1 <= number <= len(cands):
        held = f"candidates 1 to {len(cands)}" if cands else "no candidate (nothing fit)"
        raise _refuse(f"{number_flag} {number}: {path} holds {held}")
    cand = cands[number - 1]
    if not isinstance(cand, dict) or not isinstance(cand.get("megatron_args"), list) or \
            not isinstance(cand.get("config"), dict):
        raise _refuse(f"{flag} {path}: candidate {number} has no megatron_args and config (write the file with a "
                      f"`bfpp plan --json` that prints them)")
    run = PlannedRun(str(p), number, stock, tuple(map(str, data["megatron_base_args"])),
                     tuple(map(str, cand["megatron_args"])), cand["config"])
    if stock and run.plugin:
        raise _refuse(f"{flag} {path}: candidate {number} runs the plugin ({' '.join(select(run.args, PLUGIN_FLAGS))}"
                      f"), not stock Megatron")
    return run


def check_world(run: PlannedRun, world: int, flag: str, launch: str) -> None:
    """Refuse a candidate whose world size (T x CP x P x D of its config) is not the launch's (`launch` says where
    that comes from)."""
    if run.world != world:
        c = run.config
        raise _refuse(f"{flag} {run.path}: candidate {run.number} runs on T x CP x P x D = "
                      f"{c.get('tensor_model_parallel_size')} x {c.get('context_parallel_size', 1)} x "
                      f"{c.get('pipeline_model_parallel_size')} x {c.get('data_parallel_size')} = {run.world} ranks, "
                      f"the launch on {world} ({launch}): launch {run.world} ranks, or plan for {world} GPUs "
                      f"(bfpp plan --gpus {world})")


def conflict(given: Sequence[str], run: PlannedRun) -> str | None:
    """What in flags given beside a plan conflicts with it (None: nothing): a flag the plan's flags give another
    value, or one the candidate's launch flags own (a size, the split, the schedule, sharding, batch,
    recomputation, a data-parallel overlap) that it runs without."""
    planned = flag_values([*run.base_args, *run.args])
    for name, values in flag_items(given):
        shown = " ".join([name, *values])
        if name in planned and planned[name] != values:
            return f"{shown} against candidate {run.number}'s {' '.join([name, *planned[name]])}"
        if name not in planned and name in OWNED_FLAGS:
            return f"{shown}, which candidate {run.number} runs without"
    return None


def base_args_for(run: PlannedRun, cpu: bool) -> list[str]:
    """The base flags as launched: on CPU without the precision flags (fp32: the CPU shim runs no bf16/fp16)."""
    return select(run.base_args, PRECISION_FLAGS, keep=False) if cpu else list(run.base_args)


# ------------------------------------------------------------------------------------ the SLURM scripts' reader

def shell_main(argv: Sequence[str] | None = None) -> int:
    """`python -m megatron_bfpp.megatron.ab.plan_file --plan FILE [--candidate K] --world N [-- GIVEN FLAGS]`: check
    the candidate against the launch and the flags given beside it, then print shell assignments (`eval`ed by
    scripts/slurm/common.sh): plan_flags (base then launch flags), plan_has_tokenizer, plan_has_impl,
    plan_name (for the run's name) and plan_summary."""
    p = argparse.ArgumentParser(prog="python -m megatron_bfpp.megatron.ab.plan_file")
    p.add_argument("--plan", required=True)
    p.add_argument("--candidate", type=int, default=1)
    p.add_argument("--world", type=int, required=True, help="the job's ranks (nodes x GPUs per node)")
    p.add_argument("--launch", default="the job", help="where the world size comes from, for the error")
    p.add_argument("--launch-flags", default="the flags after --",
                   help="where the given flags come from, for the error")
    p.add_argument("given", nargs="*", help="flags given beside the plan (after --)")
    a = p.parse_args(argv)
    run = read_plan(a.plan, a.candidate)
    check_world(run, a.world, "--plan", a.launch)
    why = conflict(a.given, run)
    if why:
        raise _refuse(f"--plan {run.path}: the job's settings conflict with it: {why} (given beside --plan: "
                      f"{a.launch_flags}): drop it, or plan with it")
    values = flag_values(run.base_args)
    out = {
        "plan_flags": "(" + " ".join(shlex.quote(f) for f in [*run.base_args, *run.args]) + ")",
        "plan_has_tokenizer": "1" if "--tokenizer-type" in values else "0",
        "plan_has_impl": "1" if "--transformer-impl" in values else "0",
        "plan_name": shlex.quote(f"plan-{Path(run.path).stem}-c{run.number}"),
        "plan_summary": shlex.quote(f"{run.name}: {run.summary()}"),
    }
    print("\n".join(f"{k}={v}" for k, v in out.items()))
    return 0


if __name__ == "__main__":
    sys.exit(shell_main())
