"""Test-only: NCCL-like rendezvous for the runtime's p2p on gloo.

gloo buffers sends, so a posting order that deadlocks under NCCL passes on CPU. `strict_p2p()` wraps
`PipelineP2P.post` so that, after posting one action or one batch, the rank's host waits until every op of it
has its partner posted on the peer (a send waits for its receive, a receive for its send): the host becomes
the rank's single queue of CUDA_DEVICE_MAX_CONNECTIONS=1 with rendezvous semantics. Partners are the k-th
send and the k-th receive of one (NCCL communicator, source, destination), announced through the job's store.

The communicator is the one NCCL would run the op on, given how the runtime handed it to torch: inside
`batch_isend_irecv` (a coalescing group) the channel group's own, otherwise a 2-rank communicator of the pair
(`nccl_communicator`, which cites torch). The context records which ops go through
`torch.distributed.batch_isend_irecv`, so a transfer posted alone on one end and in a batch on the other never
finds its partner. An order that would deadlock on NCCL ends in a store timeout naming the op that waited.
"""

from __future__ import annotations

import contextlib
import datetime
from typing import Iterator
from unittest import mock

import torch.distributed as dist

from megatron_bfpp.runtime.p2p import PipelineP2P


def nccl_communicator(channel: str, rank: int, peer: int, in_coalescing_group: bool) -> str:
    """Name of the NCCL communicator torch 2.14 runs one p2p op of `rank` with `peer` on, for a group created
    without a bound device (lazy initialisation, what Megatron-LM's `initialize` and `bfpp train` create).

    `batch_isend_irecv` (torch/distributed/distributed_c10d.py) issues its ops inside `_coalescing_manager`, which
    calls `ProcessGroupNCCL._start_coalescing` and so opens an NCCL group (a 1-op list too: there is no special
    case); `ProcessGroupNCCL::pointToPoint` (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp) inside a group
    keys the communicator by device, i.e. the group's own over all its ranks; a lone `isend`/`irecv` outside one
    is keyed by `getKeySendRecv` ("lowRank:highRank") and gets a 2-rank communicator of its own. The two
    ends of a transfer meet only when both run it on one communicator."""
    if in_coalescing_group:
        return channel
    return f"{channel}[{min(rank, peer)}:{max(rank, peer)}]"


@contextlib.contextmanager
def strict_p2p(timeout_s: float = 60.0, prefix: str = "strict",
               p2p_class: type[PipelineP2P] = PipelineP2P) -> Iterator[None]:
    """Within the context, posts of `p2p_class` (the runtime's, or a test's variant of it) wait for their
    partners. Every rank must enter it with the same `prefix`, unique among the contexts of one job (the store
    keys count messages from the context's start)."""
    counters: dict[tuple[str, int, int, str], int] = {}
    original_post = p2p_class.post
    original_batch = dist.batch_isend_irecv
    in_batch: set[int] = set()  # ids of the ops of the current post that went through batch_isend_irecv

    def batch_isend_irecv(p2p_op_list: list) -> list:
        in_batch.update(id(op) for op in p2p_op_list)
        return original_batch(p2p_op_list)

    def post(self: PipelineP2P, ops: list) -> None:
        in_batch.clear()
        original_post(self, ops)
        store = dist.distributed_c10d._get_default_store()
        me = dist.get_rank()
        waits = []
        for op, _ in ops:
            channel = next(name for name, g in self.groups.items() if g is op.group)
            comm = nccl_communicator(channel, me, op.peer, id(op) in in_batch)
            sending = op.op is dist.isend
            src, dst = (me, op.peer) if sending else (op.peer, me)
            kind = "send" if sending else "recv"
            k = counters.get((comm, src, dst, kind), 0)
            counters[(comm, src, dst, kind)] = k + 1
            store.set(f"{prefix}/{comm}/{src}->{dst}/{k}/{kind}", "1")
            waits.append(f"{prefix}/{comm}/{src}->{dst}/{k}/{'recv' if sending else 'send'}")
        try:
            store.wait(waits, datetime.timedelta(seconds=timeout_s))
        except Exception as e:
            raise TimeoutError(f"rank {me}: strict p2p: partners of {waits} not posted within {timeout_s:g} s "
                               f"(this posting order deadlocks under NCCL rendezvous, or the two ends of a "
                               f"transfer use different communicators): {e}") from e

    with mock.patch.object(p2p_class, "post", post), mock.patch.object(dist, "batch_isend_irecv", batch_isend_irecv):
        yield
