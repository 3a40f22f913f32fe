"""Test-only: NCCL-like rendezvous for the runtime's p2p on gloo.

gloo buffers sends, so a posting order that deadlocks under NCCL passes on CPU. `strict_p2p()` wraps
`PipelineP2P.post` so that, after posting one action or one batch, the rank's host waits until every op of it
has its partner posted on the peer (a send waits for its receive, a receive for its send): the host becomes
the rank's single queue of CUDA_DEVICE_MAX_CONNECTIONS=1 with rendezvous semantics. Partners are the k-th
send and the k-th receive of one (communicator, source, destination), announced through the job's store. An
order that would deadlock on NCCL ends in a store timeout naming the op that waited.
"""

from __future__ import annotations

import contextlib
import datetime
from typing import Iterator

import torch.distributed as dist

from megatron_bfpp.runtime.p2p import PipelineP2P


@contextlib.contextmanager
def strict_p2p(timeout_s: float = 60.0, prefix: str = "strict") -> Iterator[None]:
    """Within the context, p2p posts wait for their partners. Every rank must enter it with the same `prefix`,
    unique among the contexts of one job (the store keys count messages from the context's start)."""
    counters: dict[tuple[str, int, int, str], int] = {}
    original = PipelineP2P.post

    def post(self: PipelineP2P, ops: list) -> None:
        original(self, ops)
        store = dist.distributed_c10d._get_default_store()
        me = dist.get_rank()
        waits = []
        for op, _ in ops:
            channel = next(name for name, g in self.groups.items() if g is op.group)
            sending = op.op is dist.isend
            src, dst = (me, op.peer) if sending else (op.peer, me)
            kind = "send" if sending else "recv"
            k = counters.get((channel, src, dst, kind), 0)
            counters[(channel, src, dst, kind)] = k + 1
            store.set(f"{prefix}/{channel}/{src}->{dst}/{k}/{kind}", "1")
            waits.append(f"{prefix}/{channel}/{src}->{dst}/{k}/{'recv' if sending else 'send'}")
        try:
            store.wait(waits, datetime.timedelta(seconds=timeout_s))
        except Exception as e:
            raise TimeoutError(f"rank {me}: strict p2p: partners of {waits} not posted within {timeout_s:g} s "
                               f"(this posting order deadlocks under NCCL rendezvous): {e}") from e

    PipelineP2P.post = post  # type: ignore[method-assign]
    try:
        yield
    finally:
        PipelineP2P.post = original  # type: ignore[method-assign]
