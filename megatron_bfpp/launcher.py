"""`bfpp train --nproc-per-node N [trainer flags]`: run the trainer on N local processes through torchrun.

torchrun's elastic agent starts the workers, tears the others down when one fails, and reports the first
failure (its rank and exit code) as the root cause.
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
        from .train import main as train_main

        return train_main(["--help"])
    if ours.nproc_per_node < 1:
        print("bfpp train: error: --nproc-per-node must be >= 1", file=sys.stderr)
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
        print(f"bfpp train: failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
