"""`ShardedDriver`: the runtime's DataParallelDriver for a rank's `ShardedDataParallel` chunks.

The runtime calls it at the GATHER / RELEASE / REDUCE actions of the lowered schedule and before every
F/B; the driver forwards each call to the chunk it names. It also makes the chunks share one `RankStats`,
so the per-rank traffic and gathered-memory figures cover all chunks.
"""

from __future__ import annotations

from typing import Sequence

from .comm import RankStats
from .ddp import ShardedDataParallel


def link_stats(chunks: Sequence[ShardedDataParallel]) -> RankStats:
    """Make all chunks count into one RankStats (idempotent); returns it."""
    if not chunks:
        raise ValueError("no model chunks given")
    shared = chunks[0].stats
    for c in chunks[1:]:
        if c.stats is shared:
            continue
        shared.gathered_param_bytes += c.stats.gathered_param_bytes
        shared.peak_gathered_param_bytes = max(shared.peak_gathered_param_bytes, shared.gathered_param_bytes)
        for k, v in c.stats.comm_stats().items():
            setattr(shared, k, getattr(shared, k) + v)
        c.stats = shared
    return shared


class ShardedDriver:
    """Implements runtime.hooks.DataParallelDriver over the local chunks (index = stage // P)."""

    def __init__(self, chunks: Sequence[ShardedDataParallel]) -> None:
        self.chunks = list(chunks)
        for i, c in enumerate(self.chunks):
            if not isinstance(c, ShardedDataParallel):
                raise TypeError(f"model chunk {i} is a {type(c).__name__}, not a ShardedDataParallel")
        stages = {c.zero_stage for c in self.chunks}
        if len(stages) != 1:
            raise ValueError(f"all model chunks must use the same --zero-stage (got {sorted(stages)})")
        self.zero_stage = stages.pop()
        self.stats = link_stats(self.chunks)

    def _chunk(self, chunk: int) -> ShardedDataParallel:
        try:
            return self.chunks[chunk]
        except IndexError:
            raise IndexError(
                f"schedule names model chunk {chunk} but this rank has {len(self.chunks)} chunks: the schedule's "
                "virtual pipeline size must match the number of model chunks"
            ) from None

    def start_step(self, forward_only: bool) -> None:
        # Gradients are zeroed by zero_grad_buffer() (Megatron's train_step calls it before the schedule);
        # nothing else must happen before the first action.
        pass

    def gather(self, chunk: int) -> None:
        self._chunk(chunk).start_param_gather()

    def wait_params(self, chunk: int) -> None:
        self._chunk(chunk).wait_params()

    def release(self, chunk: int) -> None:
        self._chunk(chunk).release_params()

    def before_backward(self, chunk: int) -> None:
        self._chunk(chunk).before_backward()

    def reduce(self, chunk: int) -> None:
        self._chunk(chunk).start_grad_sync()

    def finish_step(self) -> None:
        for c in self.chunks:
            c.wait_all()

    # -- accounting ------------------------------------------------------------------------------------------

    def comm_stats(self) -> dict[str, int]:
        """Data-parallel collectives of this rank since the last zero_grad_buffer() (the last step)."""
        return self.stats.comm_stats()

    def memory_stats(self, optimizer=None) -> dict[str, int]:
        """Resident parameter / gradient / optimizer bytes of this rank, and the step's peak gathered bytes."""
        return memory_stats(self.chunks, optimizer)


def memory_stats(chunks: Sequence[ShardedDataParallel], optimizer=None) -> dict[str, int]:
    """Per-rank memory figures over `chunks` (optimizer state included when `optimizer` is given)."""
    out = {"param_bytes": 0, "grad_bytes": 0, "optimizer_bytes": 0, "peak_gathered_param_bytes": 0}
    for c in chunks:
        for k, v in c.memory_stats().items():
            out[k] += v
    if optimizer is not None:
        out["optimizer_bytes"] = optimizer.state_bytes()
    out["peak_gathered_param_bytes"] = link_stats(chunks).peak_gathered_param_bytes
    return out
