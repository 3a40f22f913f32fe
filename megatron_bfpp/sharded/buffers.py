"""Flat per-chunk buffers: one contiguous parameter buffer and one gradient buffer per model chunk and dtype.

The buffer is padded so that every data-parallel rank owns an equal shard whose length is a multiple of
`align` elements; parameters become views into the full buffer (Megatron's `param.data = view` remapping).
A `FlatLayout` holds only index arithmetic (where each parameter lives, which part of it falls into which
rank's shard); `FlatParamBuffer` and `FlatGradBuffer` own the tensors and can free and re-allocate the
full-size storage while every view into it stays a valid tensor object (ZeRO-2/3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from .quantized import check_plain_parameter

DEFAULT_SHARD_ALIGN = 128  # elements; every rank's shard length is a multiple of this
DEFAULT_PARAM_ALIGN = 64  # elements; each parameter starts at a multiple of this (aligned vector loads)


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives in the flat buffer: elements [start, end)."""

    index: int
    name: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ShardPiece:
    """The part of one parameter that lies in one rank's shard.

    `param_lo:param_hi` indexes the flattened parameter, `shard_lo:shard_hi` the rank's shard.
    """

    slot: ParamSlot
    param_lo: int
    param_hi: int
    shard_lo: int
    shard_hi: int

    @property
    def numel(self) -> int:
        return self.param_hi - self.param_lo


class FlatLayout:
    """Index arithmetic of a flat buffer holding `params` (name, shape) for `dp_size` shards."""

    def __init__(
        self,
        params: Sequence[tuple[str, Sequence[int]]],
        dp_size: int,
        shard_align: int = DEFAULT_SHARD_ALIGN,
        param_align: int = DEFAULT_PARAM_ALIGN,
    ) -> None:
        if dp_size < 1:
            raise ValueError(f"data-parallel size must be >= 1 (got {dp_size})")
        if shard_align < 1 or param_align < 1:
            raise ValueError("shard and parameter alignment must be >= 1 element")
        self.dp_size = dp_size
        self.shard_align = shard_align
        slots: list[ParamSlot] = []
        offset = 0
        for i, (name, shape) in enumerate(params):
            shape = tuple(int(s) for s in shape)
            n = math.prod(shape)
            offset = _round_up(offset, param_align)
            slots.append(ParamSlot(i, name, shape, offset, offset + n))
            offset += n
        self.slots = slots
        self.numel = offset  # used elements, including the alignment gaps between parameters
        self.shard_numel = max(shard_align, _round_up(_ceil_div(offset, dp_size), shard_align))
        self.padded_numel = self.shard_numel * dp_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        """Elements [lo, hi) of the full buffer owned by data-parallel `rank`."""
        if not 0 <= rank < self.dp_size:
            raise ValueError(f"rank {rank} outside data-parallel size {self.dp_size}")
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def piece(self, slot: ParamSlot, rank: int) -> ShardPiece | None:
        """The part of `slot` in `rank`'s shard, or None if they do not overlap."""
        lo, hi = self.shard_range(rank)
        a, b = max(slot.start, lo), min(slot.end, hi)
        if a >= b:
            return None
        return ShardPiece(slot, a - slot.start, b - slot.start, a - lo, b - lo)

    def pieces(self, rank: int) -> list[ShardPiece]:
        """Every parameter piece in `rank`'s shard, in buffer order."""
        return [p for p in (self.piece(s, rank) for s in self.slots) if p is not None]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _ceil_div(a, b) * b


class LiveBufferCounter:
    """Which owners (model chunks) hold a live full-size buffer of one kind, with high-water marks.

    The unit is the owner, as in the schedule: a chunk whose parameters (or gradients) come in two dtypes
    holds two flat buffers but takes one of the schedule's weight (or gradient) buffers. Buffers report
    themselves here when their storage is allocated or freed, so the figures are read from the buffers,
    not inferred from the schedule. `limit` is the bound the schedule promises (None: no bound).
    """

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit
        self._refs: dict[int, int] = {}  # id(owner) -> live buffers of that owner
        self.live_bytes = 0
        self.peak = 0  # owners, since the last reset_peak() (the start of a step)
        self.peak_bytes = 0
        self.max_peak = 0  # owners, since construction
        self.max_peak_bytes = 0

    @property
    def live(self) -> int:
        return len(self._refs)

    def holds(self, owner: object) -> bool:
        return id(owner) in self._refs

    def acquire(self, owner: object, nbytes: int) -> None:
        key = id(owner)
        self._refs[key] = self._refs.get(key, 0) + 1
        self.live_bytes += nbytes
        self.peak = max(self.peak, self.live)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self.max_peak = max(self.max_peak, self.live)
        self.max_peak_bytes = max(self.max_peak_bytes, self.live_bytes)

    def release(self, owner: object, nbytes: int) -> None:
        key = id(owner)
        n = self._refs.get(key, 0) - 1
        if n < 0:
            raise RuntimeError("internal: a buffer was released that was never counted as live")
        if n == 0:
            del self._refs[key]
        else:
            self._refs[key] = n
        self.live_bytes -= nbytes

    def reset_peak(self) -> None:
        self.peak = self.live
        self.peak_bytes = self.live_bytes

    def merge(self, other: "LiveBufferCounter") -> None:
        """Take over `other`'s live buffers and high-water marks (linking the chunks of one rank)."""
        for key, n in other._refs.items():
            self._refs[key] = self._refs.get(key, 0) + n
        self.live_bytes += other.live_bytes
        self.peak = max(self.peak, other.peak, self.live)
        self.peak_bytes = max(self.peak_bytes, other.peak_bytes, self.live_bytes)
        self.max_peak = max(self.max_peak, other.max_peak, self.live)
        self.max_peak_bytes = max(self.max_peak_bytes, other.max_peak_bytes, self.live_bytes)
        if self.limit is None:
            self.limit = other.limit
        elif other.limit is not None:
            self.limit = min(self.limit, other.limit)


class _CountedFull:
    """Mixin: the `full` buffer's allocations are reported to a LiveBufferCounter under an owner."""

    full: torch.Tensor
    counter: LiveBufferCounter | None = None
    owner: object = None

    def attach_counter(self, counter: LiveBufferCounter, owner: object) -> None:
        """Count this buffer in `counter` from now on (moving it out of the previous counter if live)."""
        if self.counter is counter and self.owner is owner:
            return
        live = storage_allocated(self.full)
        if live and self.counter is not None:
            self.counter.release(self.owner, self.full_bytes)
        self.counter, self.owner = counter, owner
        if live:
            counter.acquire(owner, self.full_bytes)

    def alloc_full(self, zero: bool = False) -> None:
        """(Re-)allocate the full buffer's storage (contents undefined unless `zero`)."""
        if storage_allocated(self.full):
            if zero:
                self.full.zero_()
            return
        alloc_storage(self.full, zero=zero)
        if self.counter is not None:
            self.counter.acquire(self.owner, self.full_bytes)

    def free_full(self) -> None:
        """Free the full buffer's storage; the views into it stay valid tensor objects."""
        if not storage_allocated(self.full):
            return
        free_storage(self.full)
        if self.counter is not None:
            self.counter.release(self.owner, self.full_bytes)

    @property
    def full_bytes(self) -> int:
        return self.full.numel() * self.full.element_size()


def storage_allocated(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() > 0


def free_storage(t: torch.Tensor) -> None:
    """Release the memory behind `t` (and all its views) while keeping the tensor objects."""
    st = t.untyped_storage()
    if st.nbytes() > 0:
        st.resize_(0)


def alloc_storage(t: torch.Tensor, zero: bool = False) -> None:
    """Re-allocate the storage of a buffer freed by `free_storage` (contents undefined unless `zero`)."""
    st = t.untyped_storage()
    need = t.numel() * t.element_size()
    if st.nbytes() != need:
        st.resize_(need)
    if zero:
        t.zero_()


class FlatParamBuffer(_CountedFull):
    """The parameters of one chunk and dtype as views into one flat buffer, plus this rank's shard.

    - `full`: the whole padded buffer; parameters are views into it. Under ZeRO-3 its storage is freed
      at rest and re-allocated for each gather (the parameter views survive, empty, in between).
    - `shard`: this rank's part. A view of `full` when parameters stay resident (ZeRO-1/2); a separate
      tensor, the only copy at rest, under ZeRO-3.
    - `main_param`: the fp32 master shard the optimizer updates (aliases `shard` for fp32 parameters).
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str],
        dp_size: int,
        dp_rank: int,
        sharded_at_rest: bool,
        shard_align: int = DEFAULT_SHARD_ALIGN,
        param_align: int = DEFAULT_PARAM_ALIGN,
    ) -> None:
        if not params:
            raise ValueError("a flat buffer needs at least one parameter")
        for p, name in zip(params, names):  # before any parameter is remapped
            check_plain_parameter(p, name)
        dtypes = {p.dtype for p in params}
        devices = {p.device for p in params}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(f"one flat buffer holds one dtype on one device (got {dtypes} on {devices})")
        self.dtype = params[0].dtype
        self.device = params[0].device
        self.params = list(params)
        self.layout = FlatLayout([(n, p.shape) for n, p in zip(names, params)], dp_size, shard_align, param_align)
        self.dp_rank = dp_rank
        self.sharded_at_rest = sharded_at_rest
        self.full = torch.zeros(self.layout.padded_numel, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for p, slot in zip(self.params, self.layout.slots):
                view = self.full[slot.start : slot.end].view(slot.shape)
                view.copy_(p.data)
                p.data = view  # the parameter object (and its autograd identity) is kept
        lo, hi = self.layout.shard_range(dp_rank)
        if sharded_at_rest:
            self.shard = self.full[lo:hi].clone()
            free_storage(self.full)
        else:
            self.shard = self.full[lo:hi]
        self.main_param: torch.Tensor | None = None  # fp32 master shard, made by `make_main_param`

    def make_main_param(self) -> torch.Tensor:
        """The fp32 master copy of this rank's shard; the shard itself when parameters already are fp32."""
        if self.main_param is None:
            if self.dtype == torch.float32:
                self.main_param = self.shard
            else:
                self.main_param = self.shard.detach().to(torch.float32)
        return self.main_param

    @property
    def main_param_bytes(self) -> int:
        """Bytes held by a separate fp32 master shard (0 when it aliases the parameter shard)."""
        if self.main_param is None or self.main_param is self.shard:
            return 0
        return self.main_param.numel() * self.main_param.element_size()

    @property
    def gathered(self) -> bool:
        return storage_allocated(self.full)

    @property
    def shard_bytes(self) -> int:
        return self.shard.numel() * self.shard.element_size()


class FlatGradBuffer(_CountedFull):
    """Gradients of one chunk and dtype: a full-size accumulation buffer and this rank's fp32 shard.

    Each parameter's `main_grad` is a view into `full` (Megatron's convention, so Megatron layers that
    accumulate weight gradients directly into `main_grad` work). `main_grad_shard` is the fp32
    reduce-scatter target the optimizer reads; it accumulates over several reduces per step (ZeRO-2/3).
    """

    def __init__(self, pbuf: FlatParamBuffer, grad_dtype: torch.dtype, resident: bool) -> None:
        self.layout = pbuf.layout
        self.params = pbuf.params
        self.dtype = grad_dtype
        self.device = pbuf.device
        self.full = torch.zeros(self.layout.padded_numel, dtype=grad_dtype, device=self.device)
        for p, slot in zip(self.params, self.layout.slots):
            p.main_grad = self.full[slot.start : slot.end].view(slot.shape)
        if not resident:
            free_storage(self.full)
        self.main_grad_shard = torch.zeros(self.layout.shard_numel, dtype=torch.float32, device=self.device)

    @property
    def allocated(self) -> bool:
        return storage_allocated(self.full)

    @property
    def shard_bytes(self) -> int:
        return self.main_grad_shard.numel() * self.main_grad_shard.element_size()
