"""Check a Megatron-LM command line with the plugin's flags for a given world size, without launching it.

    python -m megatron_bfpp.megatron.check --world-size 256 -- --num-layers 64 ... --pipeline-schedule breadth-first

Runs Megatron's own argument parser and `validate_args` (what pretrain_gpt.py does before touching a GPU), then
the plugin's checks, and prints the resolved pipeline configuration. Useful before submitting a large job.

What Megatron's argument validation takes from the machine: the world size and rank (environment WORLD_SIZE,
RANK: set here from --world-size) and, with tensor or context parallelism (and GTP, FSDP), the GPU architecture
(`get_device_arch_version()` reads cuda:0; `--moe-grouped-gemm` asks `torch.cuda.get_device_capability()`). Without
a GPU both are answered from --gpu-arch (default 9, Hopper).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
from typing import Iterator, Sequence

from .flags import ArgsProvider, chain_args_providers
from .validation import ConfigError, PluginConfig, check_before_megatron, validate_args


@contextlib.contextmanager
def _gpu_arch(arguments_module, arch: int) -> Iterator[None]:
    """Without CUDA, answer Megatron's architecture queries (its argument checks only branch on them)."""
    import torch

    if torch.cuda.is_available():
        yield
        return
    saved = [(arguments_module, "get_device_arch_version", lambda: arch),
             (torch.cuda, "get_device_capability", lambda device=None: (arch, 0))]
    saved = [(owner, name, getattr(owner, name), answer) for owner, name, answer in saved if hasattr(owner, name)]
    for owner, name, _, answer in saved:
        setattr(owner, name, answer)
    try:
        yield
    finally:
        for owner, name, original, _ in saved:
            setattr(owner, name, original)


@contextlib.contextmanager
def _argv_and_env(argv: Sequence[str], world_size: int, rank: int, env: dict[str, str] | None = None) -> Iterator[None]:
    names = ("WORLD_SIZE", "RANK", *(env or {}))
    saved_argv, saved_env = sys.argv, {k: os.environ.get(k) for k in names}
    sys.argv = ["pretrain_gpt.py", *argv]
    os.environ["WORLD_SIZE"], os.environ["RANK"] = str(world_size), str(rank)
    os.environ.update(env or {})
    try:
        yield
    finally:
        sys.argv = saved_argv
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def parse_megatron_args(
    argv: Sequence[str],
    world_size: int,
    rank: int = 0,
    extra_args_provider: ArgsProvider | None = None,
    args_defaults: dict | None = None,
    quiet: bool = True,
    gpu_arch: int = 9,
    env: dict[str, str] | None = None,
) -> argparse.Namespace:
    """Megatron-LM's parse_args + validate_args on `argv` as if run on `world_size` ranks (no global state set,
    no CUDA needed: `gpu_arch` answers the architecture queries) with the launch environment `env` set meanwhile
    (e.g. CUDA_DEVICE_MAX_CONNECTIONS); the plugin's flags are accepted, but for conflicts Megatron's own check
    would misreport (`check_before_megatron`, a ConfigError). Megatron's own rejections surface as its
    AssertionError / ValueError / SystemExit (argparse)."""
    from megatron.training import arguments

    defaults = {"tokenizer_type": "GPT2BPETokenizer"} if args_defaults is None else args_defaults
    sink = io.StringIO()
    with _argv_and_env(argv, world_size, rank, env), _gpu_arch(arguments, gpu_arch), contextlib.ExitStack() as stack:
        if quiet:
            stack.enter_context(contextlib.redirect_stdout(sink))
        # The unwrapped functions: argument hooks (if installed) would install the plugin as a side effect.
        parse = getattr(arguments.parse_args, "__wrapped__", arguments.parse_args)
        validate = getattr(arguments.validate_args, "__wrapped__", arguments.validate_args)
        args = parse(chain_args_providers(extra_args_provider), False)
        check_before_megatron(args)  # as the hooked parse_args does: before Megatron's check misreports them
        validate(args, defaults)
    return args


def check(argv: Sequence[str], world_size: int, gpu_arch: int = 9) -> PluginConfig:
    """Parse with Megatron and validate with the plugin (its argument checks, and those that depend on the
    installed TransformerEngine); raise on the first problem."""
    from .install import check_transformer_engine_flags

    args = parse_megatron_args(argv, world_size, gpu_arch=gpu_arch)
    cfg = validate_args(args)
    check_transformer_engine_flags(args, cfg)
    return cfg


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_bfpp.megatron.check", description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, required=True, help="total number of ranks of the job")
    p.add_argument("--gpu-arch", type=int, default=9,
                   help="GPU major architecture assumed without a GPU (8 Ampere, 9 Hopper, 10 Blackwell; default 9)")
    p.add_argument("flags", nargs=argparse.REMAINDER, help="pretrain_gpt.py flags (after --)")
    a = p.parse_args(argv)
    flags = a.flags[1:] if a.flags[:1] == ["--"] else a.flags
    try:
        cfg = check(flags, a.world_size, a.gpu_arch)
    except ConfigError as e:
        print(f"megatron_bfpp: error: {e}", file=sys.stderr)
        return 2
    except (AssertionError, ValueError) as e:
        print(f"Megatron-LM rejects the arguments: {e}", file=sys.stderr)
        return 2
    print(f"ok: {cfg}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
