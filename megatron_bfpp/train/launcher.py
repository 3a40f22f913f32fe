"""`bfpp train --nproc-per-node N [trainer flags]`: run the trainer on N local processes through torchrun.

The flags are checked here first, once (the workers' own check then passes): a bad configuration is one
`error: ...` line and exit status 2, without starting any worker. torchrun's elastic agent starts the workers,
tears the others down when one fails, and reports the first failure (its rank and exit code) as the root
cause; a configuration error found by the workers (exit status 2) was printed once by the worker that found
it (megatron_bfpp.train.faults), and the launcher then only says so.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_flags(argv: list[str], nproc_per_node: int) -> str | None:
    """The trainer's checks on `argv` for a world of `nproc_per_node` processes, in this process (no process
    group); the error message, or None. The environment is left as it was."""
    from . import library_warnings
    from .config import TrainerConfigError, parse_trainer_args

    saved = dict(os.environ)
    library_warnings.install(None)  # rank 0 prints the libraries' warnings once it starts
    try:
        parse_trainer_args(argv, world_size=nproc_per_node, log=None)
    except TrainerConfigError as e:
        return str(e)
    finally:
        library_warnings.uninstall()
        os.environ.clear()
        os.environ.update(saved)
    return None


def _config_failure(e: BaseException) -> bool:
    """Whether torchrun's ChildFailedError reports a worker that exited on a configuration error."""
    from .faults import CONFIG_ERROR_EXIT_CODE

    failures = getattr(e, "failures", None) or {}
    return any(getattr(f, "exitcode", None) == CONFIG_ERROR_EXIT_CODE for f in failures.values())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(
        prog="bfpp train", add_help=False,
        description="Train a GPT with megatron_bfpp on N local processes (gloo on CPU, NCCL on GPU). All other "
        "flags are the trainer's (Megatron-LM names): see `python -m megatron_bfpp.train --help`.",
    )
    p.add_argument("--nproc-per-node", type=int, default=1)
    p.add_argument("--master-port", type=int, default=None)
    p.add_argument("-h", "--help", action="store_true")
    ours, rest = p.parse_known_args(argv)
    if ours.help:
        p.print_help()
        print()
        from .loop import main as train_main

        return train_main(["--help"])
    if ours.nproc_per_node < 1:
        print("bfpp train: error: --nproc-per-node must be >= 1", file=sys.stderr)
        return 2
    try:
        problem = check_flags(rest, ours.nproc_per_node)
    except SystemExit as e:  # argparse already printed the usage and the error
        return int(e.code or 0)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr, flush=True)
        return 2
    from torch.distributed import run as torchrun

    port = ours.master_port or _free_port()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args = ["--nproc-per-node", str(ours.nproc_per_node), "--master-addr", "127.0.0.1", "--master-port", str(port),
            "--module", "megatron_bfpp.train", *rest]
    try:
        torchrun.main(args)
    except SystemExit as e:  # torchrun exits with the workers' status
        return int(e.code or 0)
    except Exception as e:  # ChildFailedError: torchrun already printed the root-cause rank
        if _config_failure(e):  # the worker printed the one message
            print("bfpp train: stopped by the configuration error above", file=sys.stderr)
            return 2
        print(f"bfpp train: failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
