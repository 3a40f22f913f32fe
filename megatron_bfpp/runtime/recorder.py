"""Records executed actions as timeline events (wall clock on CPU, CUDA events on GPU)."""

from __future__ import annotations

import time

import torch

from ..schedule.ir import Action
from ..schedule.events import Stream, TimelineEvent, stream_of


class ActionRecorder:
    """Collects TimelineEvents for the iterations it is enabled for.

    Times are seconds since the epoch, so ranks of one job share an origin. On GPU, compute is asynchronous:
    each interval is bracketed by CUDA events on the current stream and converted when flushed, relative to the
    first event, whose wall-clock time is taken right after a synchronisation.
    """

    def __init__(self, rank: int, use_cuda: bool | None = None):
        self.rank = rank
        self.use_cuda = torch.cuda.is_available() if use_cuda is None else use_cuda
        self.enabled = False
        self.iteration = 0
        self.events: list[TimelineEvent] = []
        self._pending: list[tuple[object, object, str, str, str, int | None, int | None, int, int | None]] = []
        self._origin_wall = 0.0
        self._origin_cuda = None

    def _now(self):
        if self.use_cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            if self._origin_cuda is None:
                torch.cuda.synchronize()
                self._origin_wall = time.time()
                self._origin_cuda = ev
            return ev
        return time.time()

    def start(self):
        return self._now() if self.enabled else None

    def stop(self, started, action: Action, stream: Stream | None = None, wait: bool = False,
             peer: int | None = None) -> None:
        """End the interval begun by `start()`: the action itself, or with `wait` a blocking wait for it (a
        receive's wait names the sending rank as `peer`)."""
        if not self.enabled or started is None:
            return
        end = self._now()
        op = "WAIT" if wait else action.op.value
        name = f"wait {action.key}" if wait else action.key
        self._pending.append((started, end, stream or stream_of(action.op), name, op, action.stage,
                              action.microbatch, self.iteration, peer))

    def flush(self) -> None:
        """Resolve pending intervals into events (synchronises the GPU when CUDA events were used)."""
        if not self._pending:
            return
        if self.use_cuda:
            torch.cuda.synchronize()
        for start, end, stream, name, op, stage, mb, it, peer in self._pending:
            if self.use_cuda:
                s = self._origin_wall + self._origin_cuda.elapsed_time(start) / 1e3  # type: ignore[union-attr]
                e = self._origin_wall + self._origin_cuda.elapsed_time(end) / 1e3  # type: ignore[union-attr]
            else:
                s, e = float(start), float(end)  # type: ignore[arg-type]
            self.events.append(TimelineEvent(self.rank, stream, name, op, stage, mb, s, e, it, peer))  # type: ignore[arg-type]
        self._pending.clear()
