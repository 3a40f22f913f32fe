"""A micro-benchmark of the collectives a run uses, on its own process groups (a fraction of a second).

All-gather and reduce-scatter over the data-parallel group, and a send from each even pipeline rank to the
next, at a few sizes; every timing starts after a barrier of all ranks, and each is the median of a few
repeats. `fit_latency_bandwidth` turns the points into latency + bytes / bandwidth, the form
`Costs.from_measurements` takes. Every rank calls `time_collectives` (it is collective).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

KINDS = ("all_gather", "reduce_scatter", "p2p")
SIZES_BYTES = (1 << 14, 1 << 18)  # 16 KiB, 256 KiB; the data-parallel kinds also at the largest stage
REPEATS = 5


def time_collectives(*, dp_group: Any, dp_size: int, p2p_peer: int | None, p2p_sends: bool,
                     dp_sizes_bytes: Sequence[int], p2p_sizes_bytes: Sequence[int], device: torch.device,
                     repeats: int = REPEATS) -> dict[str, list[tuple[int, float]]]:
    """This rank's (bytes, median seconds) per kind and size: fp32 tensors of the full size; all-gather and
    reduce-scatter with `dp_size` > 1, "p2p" on ranks with a `p2p_peer` (sending when `p2p_sends`). Every rank
    passes as many sizes of each list (all make the same barrier calls), the members of a group and the two
    ends of a pair the same sizes."""
    out: dict[str, list[tuple[int, float]]] = {k: [] for k in KINDS}
    plan = [(kind, nbytes) for nbytes in dp_sizes_bytes for kind in KINDS[:2]]
    plan += [("p2p", nbytes) for nbytes in p2p_sizes_bytes]
    for kind, nbytes in plan:
        n = max(dp_size, (int(nbytes) // 4) // dp_size * dp_size)  # a whole shard per rank
        full = torch.zeros(n, dtype=torch.float32, device=device)
        shard = torch.zeros(n // dp_size, dtype=torch.float32, device=device)
        times = []
        ran = False
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            ran = _run(kind, full, shard, dp_group, dp_size, p2p_peer, p2p_sends)
            if ran and device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        if ran:
            out[kind].append((n * 4, statistics.median(times)))
    dist.barrier()
    return out


def _run(kind: str, full: torch.Tensor, shard: torch.Tensor, group: Any, dp_size: int, peer: int | None,
         sends: bool) -> bool:
    from ..sharded import comm  # the runtime's own launches; imported here, after the trainer's start

    if kind == "all_gather" and dp_size > 1:
        comm.all_gather(full, shard, group, None).wait()
    elif kind == "reduce_scatter" and dp_size > 1:
        comm.reduce_scatter(shard, full, group, None).wait()
    elif kind == "p2p" and peer is not None:
        (dist.send if sends else dist.recv)(full, peer)
    else:
        return False
    return True


def merge_ranks(per_rank: Sequence[Mapping[str, Sequence[Sequence[float]]]]) -> dict[str, list[tuple[int, float]]]:
    """Per kind and size, the slowest rank's time: a collective is done when its last rank is."""
    slowest: dict[str, dict[int, float]] = {k: {} for k in KINDS}
    for points in per_rank:
        for kind, pts in points.items():
            for nbytes, t in pts:
                slowest[kind][int(nbytes)] = max(t, slowest[kind].get(int(nbytes), 0.0))
    return {k: sorted(v.items()) for k, v in slowest.items()}


def fit_latency_bandwidth(points: Sequence[Sequence[float]]) -> tuple[float, float]:
    """Least squares t = latency + bytes / bandwidth over (bytes, seconds) points; (latency s, bandwidth
    bytes/s). The latency is at least 0 and the bandwidth finite: one point, or times that do not grow with the
    bytes, give that time as latency over an unbounded-looking 1e15 bytes/s."""
    if not points:
        raise ValueError("no timings to fit")
    xs, ys = [float(p[0]) for p in points], [float(p[1]) for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var > 0 else 0.0
    slope = max(slope, 1e-15)
    return max(my - slope * mx, 0.0), 1.0 / slope
