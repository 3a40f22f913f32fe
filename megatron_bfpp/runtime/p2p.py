"""Device-agnostic point-to-point transfers between pipeline ranks.

Activations and gradients use two separate process groups over the same pipeline ranks, so each direction is
matched first-in first-out on its own (with one shared channel, the relative order of activation and gradient
messages between two ranks would have to agree on both ends, which interleaved schedules at P = 2 break).
Receive buffers are allocated on the device of the model (CPU under gloo, the current CUDA device under NCCL).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

_CHANNEL_CACHE: dict[tuple[int, ...], tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}


def pipeline_ranks(pp_group: dist.ProcessGroup | None) -> list[int]:
    """Global ranks of the pipeline group, ordered by pipeline rank."""
    if pp_group is None:
        return [dist.get_rank()] if dist.is_initialized() else [0]
    return dist.get_process_group_ranks(pp_group)


def channel_groups(pp_group: dist.ProcessGroup, timeout_s: float | None = None) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(activation group, gradient group) over the ranks of `pp_group`, created once on every rank.

    `new_group` is collective over the whole world, so all pipeline groups' rank lists are exchanged first and
    every rank creates every pair in the same order.
    """
    mine = tuple(pipeline_ranks(pp_group))
    if mine in _CHANNEL_CACHE:
        return _CHANNEL_CACHE[mine]
    all_lists: list = [None] * dist.get_world_size()
    dist.all_gather_object(all_lists, mine)
    kwargs = {}
    if timeout_s is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
    backend = dist.get_backend(pp_group)
    for ranks in sorted(set(all_lists)):
        pair = (dist.new_group(list(ranks), backend=backend, **kwargs),
                dist.new_group(list(ranks), backend=backend, **kwargs))
        if ranks == mine:
            _CHANNEL_CACHE[mine] = pair
    return _CHANNEL_CACHE[mine]


def reset_runtime_groups() -> None:
    """Forget cached channel groups and transfer objects (call when the process groups are destroyed)."""
    _CHANNEL_CACHE.clear()
    from .forward_backward import _state

    _state["p2p"].clear()


@dataclass
class PendingTransfer:
    work: dist.Work | None
    tensor: torch.Tensor
    peer: int  # global rank


class PipelineP2P:
    """isend/irecv of activations and gradients to neighbour pipeline ranks."""

    def __init__(self, pp_group: dist.ProcessGroup | None, device: torch.device, timeout_s: float | None = None):
        self.ranks = pipeline_ranks(pp_group)
        self.size = len(self.ranks)
        self.device = device
        self.groups = channel_groups(pp_group, timeout_s) if self.size > 1 else (None, None)
        self.sent_bytes = 0

    def peer(self, pipeline_rank: int) -> int:
        return self.ranks[pipeline_rank % self.size]

    def isend(self, tensor: torch.Tensor, to_pipeline_rank: int, gradient: bool) -> PendingTransfer:
        peer = self.peer(to_pipeline_rank)
        tensor = tensor.contiguous()
        group = self.groups[1 if gradient else 0]
        self.sent_bytes += tensor.numel() * tensor.element_size()
        return PendingTransfer(dist.isend(tensor, dst=peer, group=group), tensor, peer)

    def irecv(self, shape: tuple[int, ...], dtype: torch.dtype, from_pipeline_rank: int,
              gradient: bool) -> PendingTransfer:
        peer = self.peer(from_pipeline_rank)
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        group = self.groups[1 if gradient else 0]
        return PendingTransfer(dist.irecv(buf, src=peer, group=group), buf, peer)
