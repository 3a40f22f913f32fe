"""Asynchronous data-parallel collectives with per-rank accounting, for gloo (CPU) and NCCL (GPU).

Every collective is launched with `async_op=True` and returns a `Pending`; callers wait only where the data
is first needed. On CUDA the launch happens on a dedicated communication stream that first waits for the
current (compute) stream, and the tensors are `record_stream`-ed on it so the caching allocator cannot hand
their memory to another tensor before the collective is done; `Pending.wait()` then makes the *current*
stream wait for the collective (NCCL's `Work.wait` is stream-ordered, it does not block the host). On CPU
`Pending.wait()` blocks until gloo is done.

Tensors passed in `unrecorded` skip `record_stream`: the caller promises to free them only after waiting on
the collective (from the compute stream that allocated them). Their memory then returns to the compute
stream's pool at once and is reused by the next allocation there, which runs after the wait; a recorded
block would stay unavailable until the allocator sees the communication stream's event complete, so a
buffer freed at a wait and re-allocated right after would briefly exist twice. The full-size parameter and
gradient buffers of `ddp.ShardedDataParallel` rely on this to keep their bounds in device memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.distributed as dist

_COMM_STREAMS: dict[torch.device, "torch.cuda.Stream"] = {}

# torch >= 2.13 renamed the tensor-in/tensor-out collectives; the old names still work but warn.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class RankStats:
    """Data-parallel traffic and gathered-parameter memory of one rank, reset at the start of each step.

    Bytes count the full (unsharded) message: the output of an all-gather, the input of a reduce-scatter,
    the tensor of an all-reduce.
    """

    dp_allgather_calls: int = 0
    dp_allgather_bytes: int = 0
    dp_reduce_scatter_calls: int = 0
    dp_reduce_scatter_bytes: int = 0
    dp_allreduce_calls: int = 0
    dp_allreduce_bytes: int = 0
    gathered_param_bytes: int = 0  # full-size parameter buffers currently allocated
    peak_gathered_param_bytes: int = 0
    # TransformerEngine's quantized weight copies (FP8 / FP4) in the rank's layers, as last measured
    fp8_weight_copy_bytes: int = 0
    peak_fp8_weight_copy_bytes: int = 0

    def reset(self) -> None:
        self.dp_allgather_calls = self.dp_allgather_bytes = 0
        self.dp_reduce_scatter_calls = self.dp_reduce_scatter_bytes = 0
        self.dp_allreduce_calls = self.dp_allreduce_bytes = 0
        self.peak_gathered_param_bytes = self.gathered_param_bytes
        self.peak_fp8_weight_copy_bytes = self.fp8_weight_copy_bytes

    def on_fp8_weight_copies(self, nbytes: int) -> None:
        """The rank's quantized weight copies measured now (all its chunks)."""
        self.fp8_weight_copy_bytes = nbytes
        self.peak_fp8_weight_copy_bytes = max(self.peak_fp8_weight_copy_bytes, nbytes)

    def on_gathered(self, nbytes: int) -> None:
        self.gathered_param_bytes += nbytes
        self.peak_gathered_param_bytes = max(self.peak_gathered_param_bytes, self.gathered_param_bytes)

    def on_released(self, nbytes: int) -> None:
        self.gathered_param_bytes -= nbytes

    def comm_stats(self) -> dict[str, int]:
        return {
            "dp_allgather_calls": self.dp_allgather_calls,
            "dp_allgather_bytes": self.dp_allgather_bytes,
            "dp_reduce_scatter_calls": self.dp_reduce_scatter_calls,
            "dp_reduce_scatter_bytes": self.dp_reduce_scatter_bytes,
            "dp_allreduce_calls": self.dp_allreduce_calls,
            "dp_allreduce_bytes": self.dp_allreduce_bytes,
        }


class Pending:
    """An in-flight collective: `wait()` once, then `on_done` runs (accumulate, free a buffer, ...)."""

    def __init__(self, work, keep: tuple = (), on_done: Callable[[], None] | None = None) -> None:
        self.work = work
        self._keep = keep  # tensors that must stay alive until the collective is done
        self._on_done = on_done
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        if self.work is not None:
            self.work.wait()
        self.done = True
        cb, self._on_done, self._keep = self._on_done, None, ()
        if cb is not None:
            cb()

    def is_completed(self) -> bool:
        return self.done or self.work is None or self.work.is_completed()


def group_size(group) -> int:
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


def group_rank(group) -> int:
    return dist.get_rank(group) if group is not None and dist.is_initialized() else 0


def supports_avg(group) -> bool:
    """ReduceOp.AVG is an NCCL feature; gloo needs a sum followed by a division."""
    try:
        return dist.get_backend(group) == "nccl"
    except Exception:
        return False


def backend_device(group) -> torch.device:
    """The device `group`'s backend communicates on: the current CUDA device under NCCL, the CPU otherwise."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def modules_device(modules: Iterable[torch.nn.Module], group=None) -> torch.device:
    """The device of the first parameter of `modules`. A rank may hold none: the empty stages of a
    --pipeline-model-parallel-layout (`E||tt|ttL`: pipeline rank 1's first chunk; `Ett||ttL` at P = 3: all of
    rank 1) build modules without parameters; then the device `group`'s backend works on."""
    for module in modules:
        for p in module.parameters():
            return p.device
    return backend_device(group)


def _comm_stream(device: torch.device) -> "torch.cuda.Stream":
    s = _COMM_STREAMS.get(device)
    if s is None:
        s = torch.cuda.Stream(device=device)
        _COMM_STREAMS[device] = s
    return s


def _launch(fn: Callable[[], object], tensors: tuple[torch.Tensor, ...], unrecorded: tuple[torch.Tensor, ...] = ()):
    dev = tensors[0].device
    if dev.type != "cuda":
        return fn()
    stream = _comm_stream(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))  # inputs were produced on the compute stream
    with torch.cuda.stream(stream):
        work = fn()
    for t in tensors:
        if not any(t is u for u in unrecorded):
            t.record_stream(stream)
    return work


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_gather(out: torch.Tensor, inp: torch.Tensor, group, stats: RankStats | None,
               on_done: Callable[[], None] | None = None, unrecorded: tuple[torch.Tensor, ...] = ()) -> Pending:
    """Launch `out = concat over ranks of inp` (out may hold inp as this rank's slice: in-place)."""
    if group_size(group) == 1:
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp)
        return Pending(None, on_done=on_done)
    if stats is not None:
        stats.dp_allgather_calls += 1
        stats.dp_allgather_bytes += _nbytes(out)
    work = _launch(lambda: _all_gather(out, inp, group=group, async_op=True), (out, inp), unrecorded)
    return Pending(work, (out, inp), on_done)


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group, stats: RankStats | None, average: bool = False,
                   on_done: Callable[[], None] | None = None, unrecorded: tuple[torch.Tensor, ...] = ()) -> Pending:
    """Launch `out = this rank's slice of (sum, or mean if average) over ranks of inp`."""
    n = group_size(group)
    if n == 1:
        out.copy_(inp)
        return Pending(None, on_done=on_done)
    if stats is not None:
        stats.dp_reduce_scatter_calls += 1
        stats.dp_reduce_scatter_bytes += _nbytes(inp)
    op = dist.ReduceOp.SUM
    done = on_done
    if average:
        if supports_avg(group):
            op = dist.ReduceOp.AVG
        else:
            def done() -> None:
                out.div_(n)
                if on_done is not None:
                    on_done()
    work = _launch(lambda: _reduce_scatter(out, inp, op=op, group=group, async_op=True), (out, inp), unrecorded)
    return Pending(work, (out, inp), done)


def all_reduce(t: torch.Tensor, group, stats: RankStats | None, op=dist.ReduceOp.SUM,
               on_done: Callable[[], None] | None = None) -> Pending:
    """Launch an in-place all-reduce of `t` over `group`."""
    if group_size(group) == 1:
        return Pending(None, on_done=on_done)
    if stats is not None:
        stats.dp_allreduce_calls += 1
        stats.dp_allreduce_bytes += _nbytes(t)
    work = _launch(lambda: dist.all_reduce(t, op=op, group=group, async_op=True), (t,))
    return Pending(work, (t,), on_done)
