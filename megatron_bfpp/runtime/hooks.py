"""What the runtime calls when it reaches a data-parallel action of the schedule.

The runtime interprets GATHER / RELEASE / REDUCE actions by calling a driver, an object implementing
`DataParallelDriverProtocol`; it never decides by itself when to communicate. The drivers:
`megatron_bfpp.sharded.ShardedDriver` (ZeRO-1/2/3 on the flat per-chunk buffers of `ShardedDataParallel`),
`MegatronConfigDriver` below (stock Megatron DDP / distributed optimizer, through the `config.*_sync_func` hooks
that Megatron-LM's `train()` wires) and `NullDriver` (nothing to drive).

`chunk` is the local model-chunk index on this pipeline rank (stage // P).
"""

from __future__ import annotations

import contextlib
from typing import ContextManager, Protocol, Sequence

import torch

from ..schedule.ir import Action
from .recorder import ActionRecorder


class DataParallelDriverProtocol(Protocol):
    """What the runtime calls on a driver, at the points of the schedule named below."""

    def start_step(self, forward_only: bool) -> None:
        """Called once before the first action of a schedule run (zero/prepare gradient state if needed)."""

    def gather(self, chunk: int) -> None:
        """GATHER: launch the asynchronous all-gather of the chunk's parameters (ZeRO-3). Must not block."""

    def wait_params(self, chunk: int) -> None:
        """Called before every F/B on `chunk`: block until its parameters are usable (cheap when they are)."""

    def release(self, chunk: int, last_in_run: bool = False) -> None:
        """RELEASE: free the gathered copy of the chunk's parameters (ZeRO-3). `last_in_run`: no compute of the
        chunk follows in this schedule run (what outlives RELEASE until the next run may go too)."""

    def before_backward(self, chunk: int) -> None:
        """Called before every B on `chunk`: make sure a full-size gradient buffer exists to accumulate into."""

    def input_grad(self, chunk: int) -> ContextManager[None]:
        """Entered around an I on `chunk` whose weight GEMMs are deferred to W: the gradients the I computes
        (norms, biases, embeddings) may be held aside until the W takes the gradient buffer."""

    def reduce(self, chunk: int) -> None:
        """REDUCE: launch the asynchronous reduce-scatter of the chunk's gradients. Must not block."""

    def finish_step(self) -> None:
        """Called after the last action: wait for every outstanding collective of this schedule run."""

    def plan_step(self, boundary: Sequence[tuple[Action, int]], recorder: ActionRecorder | None) -> None:
        """The rank's step boundary, (action, chunk) in order (STEPs and the all-gathers after them), handed over
        after `finish_step` of a training run: the optimizer's step carries it out, recording it on `recorder`."""


class NullDriver:
    """No data parallelism handled by the runtime (D = 1, or gradients synchronised elsewhere)."""

    def start_step(self, forward_only: bool) -> None: ...
    def gather(self, chunk: int) -> None: ...
    def wait_params(self, chunk: int) -> None: ...
    def release(self, chunk: int, last_in_run: bool = False) -> None: ...
    def before_backward(self, chunk: int) -> None: ...
    def input_grad(self, chunk: int) -> ContextManager[None]: return contextlib.nullcontext()
    def reduce(self, chunk: int) -> None: ...
    def finish_step(self) -> None: ...

    def plan_step(self, boundary: Sequence[tuple[Action, int]], recorder: ActionRecorder | None) -> None:
        if boundary:
            raise ValueError("this schedule places optimizer steps, but no sharded optimizer (--zero-stage) "
                             "carries them out")


class MegatronConfigDriver(NullDriver):
    """Drives stock Megatron DDP through the model config's hooks, at the points the schedule places them.

    - `no_sync_func`: entered for the whole run, so gradient reduction only happens where REDUCE says;
    - `grad_sync_func(chunk params)`: at REDUCE (Megatron launches its bucketed reduce-scatter/all-reduce);
    - `param_sync_func(chunk params)`: before the first forward of each chunk (overlapped param all-gather of
      the distributed optimizer).
    """

    def __init__(self, model: Sequence[torch.nn.Module], config) -> None:
        self.model = list(model)
        self.config = config
        self._no_sync_ctx: list | None = None
        self._param_synced: set[int] = set()
        self._forward_only = False

    def start_step(self, forward_only: bool) -> None:
        self._param_synced.clear()
        self._forward_only = forward_only
        self._no_sync_ctx = []
        if forward_only:  # as Megatron: no gradient or parameter synchronisation in evaluation
            return
        no_sync = self.config.no_sync_func
        if isinstance(no_sync, list):  # one per chunk in Megatron-LM's train()
            self._no_sync_ctx = [f() for f in no_sync]
        elif no_sync is not None:
            self._no_sync_ctx = [no_sync()]
        else:
            self._no_sync_ctx = []
        for ctx in self._no_sync_ctx:
            ctx.__enter__()

    def wait_params(self, chunk: int) -> None:
        if self._forward_only or chunk in self._param_synced or self.config.param_sync_func is None:
            return
        self._param_synced.add(chunk)
        f = self.config.param_sync_func
        (f[chunk] if isinstance(f, list) else f)(self.model[chunk].parameters())

    def reduce(self, chunk: int) -> None:
        f = self.config.grad_sync_func
        if f is not None:
            (f[chunk] if isinstance(f, list) else f)(self.model[chunk].parameters())

    def finish_step(self) -> None:
        for ctx in reversed(self._no_sync_ctx or []):
            ctx.__exit__(None, None, None)
        self._no_sync_ctx = None
