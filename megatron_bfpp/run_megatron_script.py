"""Run an unmodified Megatron-LM training script with the plugin installed.

    python -m megatron_bfpp.run_megatron_script MEGATRON_LM_DIR/pretrain_gpt.py [Megatron flags] [plugin flags]
    torchrun --nproc-per-node 8 -m megatron_bfpp.run_megatron_script MEGATRON_LM_DIR/pretrain_gpt.py ...

The script's directory goes first on sys.path (as `python script.py` would put it, so the checkout's
`megatron` package and helpers such as `gpt_builders` are the ones imported); Megatron's argument parsing
is hooked so the plugin's flags are accepted and `install(args)` runs right after Megatron validated them;
then the script runs as `__main__` through runpy.
"""

from __future__ import annotations

import os
import runpy
import sys

USAGE = (
    "usage: python -m megatron_bfpp.run_megatron_script SCRIPT.py [SCRIPT FLAGS...]\n"
    "  e.g. python -m megatron_bfpp.run_megatron_script $MEGATRON_LM_DIR/pretrain_gpt.py "
    "--pipeline-schedule breadth-first --num-layers-per-virtual-pipeline-stage 2 ...\n"
    "Runs a Megatron-LM training script with megatron_bfpp's flags (--pipeline-schedule, --zero-stage, "
    "--bfpp-weight-buffers, --bfpp-grad-buffers, --timeline) accepted and installed."
)


def _check_megatron_origin(script_dir: str) -> None:
    """A `megatron` imported before the checkout went on sys.path would shadow the checkout's: refuse."""
    mod = sys.modules.get("megatron")
    if mod is None or not os.path.isdir(os.path.join(script_dir, "megatron")):
        return
    paths = [os.path.realpath(p) for p in getattr(mod, "__path__", [])]
    want = os.path.realpath(os.path.join(script_dir, "megatron"))
    if want not in paths:
        raise SystemExit(
            f"megatron_bfpp.run_megatron_script: error: 'megatron' was already imported from {paths} before "
            f"{script_dir} went on sys.path; start the script runner in a fresh interpreter"
        )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    script = argv[0]
    if not script.endswith(".py") or not os.path.isfile(script):
        print(f"megatron_bfpp.run_megatron_script: error: {script!r} is not a Python script; pass the path of a "
              f"Megatron-LM training script, e.g. $MEGATRON_LM_DIR/pretrain_gpt.py\n\n{USAGE}", file=sys.stderr)
        return 2
    script_dir = os.path.dirname(os.path.abspath(script))
    _check_megatron_origin(script_dir)
    sys.path.insert(0, script_dir)

    from megatron_bfpp.megatron import hook_argument_parsing

    hook_argument_parsing()  # imports Megatron: from the checkout now that it leads sys.path
    sys.argv = [script] + argv[1:]
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
