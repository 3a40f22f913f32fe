"""The `bfpp` command: dispatches to each subcommand's module (imported lazily, so `bfpp schedule` needs no torch)."""

from __future__ import annotations

import importlib
import sys

# command -> (module, function taking argv and returning an exit code, one-line help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "schedule": ("megatron_bfpp.schedule.cli", "main", "build, lower, validate and print a pipeline schedule"),
    "train": ("megatron_bfpp.train.launcher", "main", "train a GPT on N local processes (CPU/gloo or GPU/NCCL)"),
    "simulate": ("megatron_bfpp.megatron.sim_cli", "simulate_main",
                 "predict step time, bubble, memory of a run given as pretrain_gpt.py flags"),
    "plan": ("megatron_bfpp.megatron.sim_cli", "plan_main", "search parallel layouts and rank them by throughput"),
    "draw": ("megatron_bfpp.trace.cli", "draw_main", "draw a schedule, simulation or recorded timeline as PNG"),
    "report": ("megatron_bfpp.trace.cli", "report_main", "side-by-side summary of run reports"),
}


def usage() -> str:
    lines = ["usage: bfpp COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    lines.append("\n`bfpp COMMAND --help` for a command's flags.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"bfpp: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[name]
    return int(getattr(importlib.import_module(module), func)(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
