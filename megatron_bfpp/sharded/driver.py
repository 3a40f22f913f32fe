"""`ShardedDriver`: the runtime's driver (`DataParallelDriverProtocol`) for a rank's `ShardedDataParallel` chunks.

The runtime calls it at the GATHER / RELEASE / REDUCE actions of the lowered schedule and before every
F/B; the driver forwards each call to the chunk it names. It also makes the chunks share one `RankStats`,
so the per-rank traffic and gathered-memory figures cover all chunks, and one `BufferBudget`, so the bounds on
full gradient and gathered weight buffers hold for the rank, not per chunk.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from .comm import RankStats
from .ddp import BufferBudget, ShardedDataParallel


def link_stats(chunks: Sequence[ShardedDataParallel]) -> RankStats:
    """Make all chunks count into one RankStats and one BufferBudget (idempotent); returns the stats."""
    if not chunks:
        raise ValueError("no model chunks given")
    link_budget(chunks)
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


def link_budget(chunks: Sequence[ShardedDataParallel]) -> BufferBudget:
    """Make all chunks share one BufferBudget (idempotent); returns it."""
    shared = chunks[0].budget
    for c in chunks[1:]:
        if c.budget is shared:
            continue
        shared.merge(c.budget)
        c.budget = shared
        for b in c.flat_buffers:
            b.pbuf.counter, b.gbuf.counter = shared.weights, shared.grads  # live counts were merged above
    return shared


@dataclass
class StepPlan:
    """A rank's step boundary as the optimizer carries it out: ("step" | "gather", chunk, action to record as),
    in the schedule's order, and the recorder of the run that placed it (None: not recording)."""

    entries: list[tuple[str, int, Any]]
    recorder: Any = None

    @staticmethod
    def default(chunks: Sequence[ShardedDataParallel]) -> "StepPlan":
        """Without a schedule's plan (the optimizer used on its own): every chunk in order, each followed by the
        all-gather of its updated resident parameters (ZeRO-1/2; ZeRO-3 gathers at the next GATHER)."""
        entries: list[tuple[str, int, Any]] = []
        for i, c in enumerate(chunks):
            entries.append(("step", i, None))
            if c.zero_stage != 3:
                entries.append(("gather", i, None))
        return StepPlan(entries)


class ShardedDriver:
    """Implements runtime.hooks.DataParallelDriverProtocol over the local chunks (index = stage // P)."""

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
        self.budget = link_budget(self.chunks)

    def set_buffer_limits(self, weight_buffers: int | None, grad_buffers: int | None) -> None:
        """The schedule's bounds on this rank's gathered weight buffers (ZeRO-3) and full gradient buffers
        (ZeRO-2/3), in chunks; the runtime calls this with the lowered schedule's values."""
        self.budget.set_limits(weight_buffers if self.zero_stage == 3 else None,
                               grad_buffers if self.zero_stage >= 2 else None)

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

    def release(self, chunk: int, last_in_run: bool = False) -> None:
        c = self._chunk(chunk)
        if last_in_run:  # the rank's quantized weight copies peak before the first of them goes
            self.stats.on_fp8_weight_copies(sum(x.weight_copy_bytes() for x in self.chunks))
        c.release_params(last_in_run)

    def before_backward(self, chunk: int) -> None:
        self._chunk(chunk).before_backward()

    @contextlib.contextmanager
    def input_grad(self, chunk: int) -> Iterator[None]:
        # Every chunk holds: a tied parameter's gradient hook belongs to the chunk that owns it, which need
        # not be the one running the I.
        self._chunk(chunk)
        for c in self.chunks:
            c.holding_grads_for_w = True
        try:
            yield
        finally:
            for c in self.chunks:
                c.holding_grads_for_w = False

    def reduce(self, chunk: int) -> None:
        self._chunk(chunk).start_grad_sync()

    def finish_step(self) -> None:
        for c in self.chunks:
            c.wait_all()

    def plan_step(self, boundary: Sequence[tuple[Any, int]], recorder: Any = None) -> None:
        """Hand the schedule's step boundary to the optimizer (through the chunks it shares with it)."""
        entries = []
        for a, chunk in boundary:
            self._chunk(chunk)  # a schedule for another V is named here
            entries.append(("step" if a.op == "STEP" else "gather", chunk, a))
        plan = StepPlan(entries, recorder)
        for c in self.chunks:
            c.step_plan = plan

    # -- accounting ------------------------------------------------------------------------------------------

    def comm_stats(self) -> dict[str, int]:
        """Data-parallel collectives of this rank since the last zero_grad_buffer() (the last step)."""
        return self.stats.comm_stats()

    def memory_stats(self, optimizer=None) -> dict[str, int]:
        """Resident parameter / gradient / optimizer bytes of this rank, and the step's peak gathered bytes."""
        return memory_stats(self.chunks, optimizer)


def memory_stats(chunks: Sequence[ShardedDataParallel], optimizer=None) -> dict[str, int | None]:
    """Per-rank memory figures over `chunks` (optimizer state included when `optimizer` is given).

    Also the live full-size buffers, in chunks, read from the buffers: `peak_*_buffers` over the last step,
    `max_*_buffers` since the chunks were built (everything, including `full_params` for checkpoints), and
    the limits they are kept within (None: unbounded, e.g. resident buffers of ZeRO-1/2).

    `fp8_weight_copy_bytes`: TransformerEngine's quantized (FP8 / FP4) weight copies held now, outside the
    parameter buffers; `peak_fp8_weight_copy_bytes`: the most measured this step (now, and at each stage's last
    RELEASE of ZeRO-3, where they are dropped)."""
    out = {"param_bytes": 0, "grad_bytes": 0, "optimizer_bytes": 0, "peak_gathered_param_bytes": 0,
           "fp8_weight_copy_bytes": 0}
    for c in chunks:
        for k, v in c.memory_stats().items():
            out[k] += v
    if optimizer is not None:
        out["optimizer_bytes"] = optimizer.state_bytes()
    stats = link_stats(chunks)
    stats.on_fp8_weight_copies(out["fp8_weight_copy_bytes"])
    out["peak_fp8_weight_copy_bytes"] = stats.peak_fp8_weight_copy_bytes
    out["peak_gathered_param_bytes"] = stats.peak_gathered_param_bytes
    out["gathered_param_bytes"] = stats.gathered_param_bytes  # in param_bytes: full buffers allocated now
    out.update(chunks[0].budget.stats())
    return out
