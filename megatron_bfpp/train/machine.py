"""What one rank measures of the machine for the measured prediction (`measured_prediction`): its CPU time per
iteration, the cores it may run on, the bytes its stages gather and reduce, the collectives' timings, and, for
context, how busy other processes kept the machine."""

from __future__ import annotations

import os
import socket
import time
from typing import TYPE_CHECKING, Any, Sequence

import torch

from . import comm_bench
from .measured_prediction import WARMUP_ITERATIONS

if TYPE_CHECKING:
    from ..sharded.ddp import ShardedDataParallel


class CpuClock:
    """Per iteration (`start` / `stop` around it): this process's and its main thread's CPU seconds, the wall
    seconds, and the CPU seconds every process of the machine ran (`machine_busy_s`; None where unknown)."""

    def __init__(self) -> None:
        self.process_s: list[float] = []
        self.thread_s: list[float] = []
        self.wall_s: list[float] = []
        self.machine_s: list[float | None] = []
        self._t0: tuple[float, float, float, float | None] = (0.0, 0.0, 0.0, None)

    def start(self) -> None:
        self._t0 = (time.process_time(), time.thread_time(), time.perf_counter(), machine_busy_s())

    def stop(self) -> None:
        busy = machine_busy_s()
        self.process_s.append(time.process_time() - self._t0[0])
        self.thread_s.append(time.thread_time() - self._t0[1])
        self.wall_s.append(time.perf_counter() - self._t0[2])
        self.machine_s.append(None if busy is None or self._t0[3] is None else busy - self._t0[3])


def machine_busy_s() -> float | None:
    """CPU seconds all processes of the machine have run since boot (user, nice, system, interrupts, and time
    the hypervisor gave to others: steal), from Linux's /proc/stat; None elsewhere."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return None


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
    steady = range(min(WARMUP_ITERATIONS, len(clock.process_s)), len(clock.process_s))
    on_cpu = device.type == "cpu"
    machine_s = [clock.machine_s[i] for i in steady]
    return {
        "pp_rank": pp_rank,
        "cpu_s": [clock.process_s[i] for i in picked] if on_cpu else None,
        "thread_cpu_s": [clock.thread_s[i] for i in picked] if on_cpu else None,
        "machine": socket.gethostname(),
        "cpus": cores_available(),
        "load_average_1min": load_average(),
        "steady_cpu_s": sum(clock.process_s[i] for i in steady),
        "steady_wall_s": sum(clock.wall_s[i] for i in steady),
        "steady_machine_busy_s": None if None in machine_s else sum(machine_s),  # type: ignore[arg-type]
        "stage_bytes": own,
        "p2p_bytes": p2p_bytes,
        "collectives": timings,
    }
