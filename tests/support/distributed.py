"""Test helper: run a function on N local gloo processes and collect each rank's return value.

The ranks are forked from servers that have imported torch, Megatron and the package once per session
(tests/support/forkserver.py): a job starts in milliseconds instead of re-importing for seconds per rank."""

from __future__ import annotations

import os
import pickle
import socket
import sys
import tempfile
import traceback
from typing import Any, Callable

from tests.support.forkserver import ForkServers, Job


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import torch

    torch.set_num_threads(1)
    try:
        result = ("ok", fn(rank, world, *args))
    except BaseException as e:  # report to the parent instead of hanging it
        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass


# The modules every gloo job's ranks import, preloaded once per session by the fork servers.
PRELOAD = ["torch", "torch.distributed", "megatron.core", "megatron.core.models.gpt", "megatron.core.optimizer",
           "megatron_bfpp", "megatron_bfpp.runtime", "megatron_bfpp.sharded", "megatron_bfpp.train",
           "megatron_bfpp.train.model", "megatron_bfpp.train.parallel", "pytest", "tests.support.toy_pipeline"]
_servers: ForkServers | None = None


def close_servers() -> None:
    """Stops the fork servers of this session's gloo jobs (tests/conftest.py, at the end of the session)."""
    global _servers
    if _servers is not None:
        _servers.close()
        _servers = None


def run_distributed(fn: Callable, world: int, *args: Any, timeout: float = 300) -> list[Any]:
    """Run fn(rank, world, *args) on `world` gloo processes, forked from preloaded servers
    (tests/support/forkserver.py); raise if any failed or timed out, with the tail of each failed rank's log."""
    global _servers
    if _servers is None:
        _servers = ForkServers(PRELOAD)
    port = free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        env = dict(os.environ)
        jobs = [Job(env=env, cwd=os.getcwd(), log=os.path.join(out_dir, f"{r}.log"), sys_path=list(sys.path),
                    call=(_worker, (r, world, port, fn, args, out_dir))) for r in range(world)]
        codes = _servers.run(jobs, timeout)
        results = []
        errors = []
        for r in range(world):
            path = os.path.join(out_dir, f"{r}.pkl")
            if not os.path.exists(path):
                state = "still running (killed)" if codes[r] is None else f"exit code {codes[r]}"
                errors.append(f"rank {r}: no result ({state})\n{_tail(jobs[r].log)}")
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status != "ok":
                errors.append(f"rank {r}: {value}")
            results.append(value)
        alive = [r for r, c in enumerate(codes) if c is None]
        if alive:
            errors.insert(0, f"ranks {alive} still running after {timeout} s")
        if errors:
            raise AssertionError("\n".join(errors))
        return results


def _tail(log: str, lines: int = 30) -> str:
    try:
        with open(log) as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""
