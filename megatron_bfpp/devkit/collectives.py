"""Which torch.distributed operations a leg's workers ran, on groups of how many ranks; and the start-up mark.

In a worker (`instrument`, before anything imports torch.distributed's functions by name): each collective and
point-to-point function of torch.distributed is wrapped to count its calls by group size (a call made inside
another counted call, such as the isend of a batch_isend_irecv, is not counted again); at exit each rank writes
its counts to DIR/rank<R>.json. `init_process_group` is wrapped too: once it returns, the world group runs one
barrier and the rank prints STARTUP_MARK, so a leg that hangs before every rank printed it hung while its
process groups were being set up, before any of the code under test communicated.

In the kit (`summarize`, `summary_text`; standard library only): the counts of every rank, summed, by operation
family (all-gather, reduce-scatter, all-reduce, broadcast, p2p, ...) and group size.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import json
import os
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from .outputs import STARTUP_MARK

ENV_DIR = "BFPP_DEVKIT_COLLECTIVES"
FAMILIES = {
    "all_gather": "all-gather", "all_gather_into_tensor": "all-gather", "all_gather_single": "all-gather",
    "_all_gather_base": "all-gather", "all_gather_object": "all-gather",
    "reduce_scatter": "reduce-scatter", "reduce_scatter_tensor": "reduce-scatter",
    "reduce_scatter_single": "reduce-scatter", "_reduce_scatter_base": "reduce-scatter",
    "all_reduce": "all-reduce", "reduce": "reduce", "broadcast": "broadcast", "broadcast_object_list": "broadcast",
    "all_to_all": "all-to-all", "all_to_all_single": "all-to-all", "gather": "gather", "scatter": "scatter",
    "barrier": "barrier", "send": "p2p", "recv": "p2p", "isend": "p2p", "irecv": "p2p", "batch_isend_irecv": "p2p",
}
ZERO_FAMILIES = ("all-gather", "reduce-scatter")

_counts: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
_depth = threading.local()


def _group_size(dist: Any, group: Any) -> int:
    try:
        return int(dist.get_world_size(group))
    except Exception:  # not a member, or torch.distributed not up
        return -1


def _wrap(dist: Any, name: str, fn: Any) -> Any:
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def counted(*args: Any, **kwargs: Any) -> Any:
        depth = getattr(_depth, "n", 0)
        if depth == 0:
            if name == "batch_isend_irecv":
                ops = args[0] if args else kwargs.get("p2p_op_list", [])
                for op in ops:
                    _counts[name][_group_size(dist, op.group)] += 1
            else:
                try:
                    group = sig.bind_partial(*args, **kwargs).arguments.get("group")
                except TypeError:
                    group = None
                _counts[name][_group_size(dist, group)] += 1
        _depth.n = depth + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _depth.n = depth

    return counted


def _startup(dist: Any, init: Any) -> Any:
    @functools.wraps(init)
    def init_then_mark(*args: Any, **kwargs: Any) -> Any:
        t0 = time.monotonic()
        result = init(*args, **kwargs)
        if dist.get_backend() == "nccl":
            import torch

            dist.barrier(device_ids=[torch.cuda.current_device()])
        else:
            dist.barrier()
        # One write: lines of several ranks sharing the log do not interleave.
        sys.stdout.write(f"{STARTUP_MARK} rank {dist.get_rank()} of {dist.get_world_size()} "
                         f"({dist.get_backend()}) in {time.monotonic() - t0:.1f} s\n")
        sys.stdout.flush()
        return result

    return init_then_mark


def instrument(out_dir: str | None = None) -> None:
    """Count torch.distributed's calls in this process and mark its start-up (see the module docstring). The
    counts go to `out_dir` (default $BFPP_DEVKIT_COLLECTIVES; none written when neither is set)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    for name in FAMILIES:
        fn = getattr(c10d, name, None)
        if fn is None:
            continue
        wrapped = _wrap(dist, name, fn)
        # Both namespaces: P2POp checks its op against c10d's isend/irecv, callers use torch.distributed's.
        setattr(c10d, name, wrapped)
        if getattr(dist, name, None) is fn:
            setattr(dist, name, wrapped)
    marked = _startup(dist, c10d.init_process_group)
    c10d.init_process_group = marked
    dist.init_process_group = marked
    out_dir = out_dir or os.environ.get(ENV_DIR)
    if out_dir:
        atexit.register(_write, out_dir)


def _write(out_dir: str) -> None:
    rank = os.environ.get("RANK", "0")
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    data = {"rank": int(rank), "calls": {name: {str(k): v for k, v in sizes.items()} for name, sizes in
                                         _counts.items()}}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(data))


# ------------------------------------------------------------------------------------------------ the kit's side

def summarize(out_dir: Path) -> dict[str, dict[int, int]] | None:
    """{family: {group size: calls summed over the ranks}} from a leg's per-rank files; None when none."""
    files = sorted(Path(out_dir).glob("rank*.json")) if Path(out_dir).is_dir() else []
    if not files:
        return None
    total: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for f in files:
        for name, sizes in json.loads(f.read_text())["calls"].items():
            for size, n in sizes.items():
                total[FAMILIES.get(name, name)][int(size)] += n
    return {fam: dict(sorted(sizes.items())) for fam, sizes in sorted(total.items())}


def summary_text(summary: dict[str, dict[int, int]] | None, ranks: int) -> str:
    """One clause of the report: each family with its calls per group size, summed over the leg's ranks."""
    if summary is None:
        return f"collectives: no counts written (by {ranks} rank{'s' if ranks > 1 else ''})"
    parts = [f"{fam} " + ", ".join(f"{n}x on {size} rank{'s' if size != 1 else ''}" for size, n in sizes.items())
             for fam, sizes in summary.items()]
    return f"torch.distributed calls over {ranks} rank{'s' if ranks > 1 else ''}: " + ("; ".join(parts) or "none")


def zero_collectives_on(summary: dict[str, dict[int, int]] | None, size: int) -> list[str]:
    """The ZeRO collective families (all-gather, reduce-scatter) that did NOT run on `size`-rank groups."""
    return [fam for fam in ZERO_FAMILIES if not (summary or {}).get(fam, {}).get(size)]
