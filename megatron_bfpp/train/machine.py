"""What one rank measures of the machine for the measured prediction (`measured_prediction`): its CPU time per
iteration, the cores it may run on, the bytes its stages gather and reduce, and the collectives' timings."""

from __future__ import annotations

import os
import socket
import time
from typing import TYPE_CHECKING, Any, Sequence

import torch

from . import comm_bench

if TYPE_CHECKING:
    from ..sharded.ddp import ShardedDataParallel


class CpuClock:
    """Process and main-thread CPU seconds of each iteration (`start` / `stop` around it)."""

    def __init__(self) -> None:
        self.process_s: list[float] = []
        self.thread_s: list[float] = []
        self._t0 = (0.0, 0.0)

    def start(self) -> None:
        self._t0 = (time.process_time(), time.thread_time())

    def stop(self) -> None:
        self.process_s.append(time.process_time() - self._t0[0])
        self.thread_s.append(time.thread_time() - self._t0[1])


def cores_available() -> list[int]:
    """The CPUs this process may run on."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call on this platform: all of them
        return list(range(os.cpu_count() or 1))


def load_average() -> float | None:
    """The machine's 1-minute load average (runnable processes, ours included), for context; None where the
    platform has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def stage_bytes(chunks: Sequence[ShardedDataParallel], pp_rank: int, pp: int) -> dict[int, list[int]]:
    """Stage -> [bytes its parameters take gathered, bytes its gradients take before their reduction]."""
    return {c * pp + pp_rank: [sum(b.pbuf.full_bytes for b in chunk.flat_buffers),
                               sum(b.gbuf.full_bytes for b in chunk.flat_buffers)]
            for c, chunk in enumerate(chunks)}


def p2p_peer(pp_rank: int, pp: int, pp_ranks: Sequence[int]) -> tuple[int | None, bool]:
    """The micro-benchmark's pipeline pairs: pipeline rank 2k sends to 2k + 1 (global ranks); (peer, sends)."""
    if pp_rank % 2 == 0 and pp_rank + 1 < pp:
        return pp_ranks[pp_rank + 1], True
    if pp_rank % 2 == 1:
        return pp_ranks[pp_rank - 1], False
    return None, False


def rank_stats(chunks: Sequence[ShardedDataParallel], *, clock: CpuClock, iterations: Sequence[int],
               first_iteration: int, pp_rank: int, pp: int, pp_ranks: Sequence[int], dp_group: Any, dp_size: int,
               p2p_bytes: float, device: torch.device) -> dict:
    """This rank's part (collective: every rank calls it, after training). CPU times only on CPU, where the
    ranks share the cores; `iterations` select them from the clock (run's iteration numbers)."""
    own = stage_bytes(chunks, pp_rank, pp)
    largest = max([comm_bench.SIZES_BYTES[-1]] + [b[0] for b in own.values()])
    peer, sends = p2p_peer(pp_rank, pp, pp_ranks)
    # The data-parallel replicas of a stage hold the same stages: each group's members time the same sizes;
    # the two ends of a pipeline pair, the fixed sizes.
    timings = comm_bench.time_collectives(dp_group=dp_group, dp_size=dp_size, p2p_peer=peer, p2p_sends=sends,
                                          dp_sizes_bytes=[*comm_bench.SIZES_BYTES, largest],
                                          p2p_sizes_bytes=comm_bench.SIZES_BYTES, device=device)
    picked = [i - first_iteration for i in iterations if 0 <= i - first_iteration < len(clock.process_s)]
    on_cpu = device.type == "cpu"
    return {
        "pp_rank": pp_rank,
        "cpu_s": [clock.process_s[i] for i in picked] if on_cpu else None,
        "thread_cpu_s": [clock.thread_s[i] for i in picked] if on_cpu else None,
        "machine": socket.gethostname(),
        "cpus": cores_available(),
        "load_average_1min": load_average(),
        "stage_bytes": own,
        "p2p_bytes": p2p_bytes,
        "collectives": timings,
    }
