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

# The communicators a schedule's p2p actions name (`Action.comm`).
CHANNELS = ("activations", "gradients")
_CHANNEL_CACHE: dict[tuple[int, ...], dict[str, dist.ProcessGroup]] = {}


def pipeline_ranks(pp_group: dist.ProcessGroup | None) -> list[int]:
    """Global ranks of the pipeline group, ordered by pipeline rank."""
    if pp_group is None:
        return [dist.get_rank()] if dist.is_initialized() else [0]
    return dist.get_process_group_ranks(pp_group)


def _pipeline_pg_options(pp_group: dist.ProcessGroup) -> object | None:
    """The NCCL options the pipeline group was created with (Megatron's --nccl-communicator-config-path), so the
    channel groups get the same; None on other backends or when torch does not expose them."""
    try:
        if dist.get_backend(pp_group) != "nccl":
            return None
        return pp_group._get_backend(torch.device("cuda")).options
    except Exception:  # private API: fall back to defaults rather than fail
        return None


def default_timeout_s() -> float | None:
    """Megatron-LM's --distributed-timeout-minutes when Megatron's arguments are set, else None (torch's)."""
    try:
        from megatron.training.global_vars import get_args

        minutes = getattr(get_args(), "distributed_timeout_minutes", None)
    except Exception:  # Megatron-LM's globals not initialised: standalone use of megatron-core
        return None
    return None if minutes is None else 60.0 * minutes


def channel_groups(pp_group: dist.ProcessGroup, timeout_s: float | None = None,
                   device: torch.device | None = None) -> dict[str, dist.ProcessGroup]:
    """{"activations": group, "gradients": group} over the ranks of `pp_group`, created once on every rank.

    `new_group` is collective over the whole world, so all pipeline groups' rank lists are exchanged first and
    every rank creates every pair in the same order. The groups take the given timeout (default:
    --distributed-timeout-minutes) and the pipeline group's NCCL options. One all-reduce on each new group
    initialises its communicator on all ranks: NCCL requires every rank of a group to take part in its first
    batched p2p call, which a schedule's batch between two of P ranks would not.
    """
    mine = tuple(pipeline_ranks(pp_group))
    if mine in _CHANNEL_CACHE:
        return _CHANNEL_CACHE[mine]
    all_lists: list = [None] * dist.get_world_size()
    dist.all_gather_object(all_lists, mine)
    kwargs: dict = {}
    timeout_s = default_timeout_s() if timeout_s is None else timeout_s
    if timeout_s is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
    options = _pipeline_pg_options(pp_group)
    if options is not None:
        kwargs["pg_options"] = options
    backend = dist.get_backend(pp_group)
    for ranks in sorted(set(all_lists)):
        pair = {name: dist.new_group(list(ranks), backend=backend, **kwargs) for name in CHANNELS}
        if ranks == mine:
            _CHANNEL_CACHE[mine] = pair
    dev = device
    if dev is None:  # the process group's backend decides: NCCL works on the current CUDA device
        dev = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    for group in _CHANNEL_CACHE[mine].values():
        dist.all_reduce(torch.zeros(1, device=dev), group=group)
    return _CHANNEL_CACHE[mine]


def reset_runtime_groups() -> None:
    """Forget cached channel groups and transfer objects (call when the process groups are destroyed)."""
    _CHANNEL_CACHE.clear()
    from .forward_backward import _state

    _state["p2p"].clear()
    _state["agreed"].clear()


@dataclass
class PendingTransfer:
    work: dist.Work | None
    tensor: torch.Tensor
    peer: int  # global rank


class PipelineP2P:
    """isend/irecv of activations and gradients to neighbour pipeline ranks, alone or as one batch."""

    def __init__(self, pp_group: dist.ProcessGroup | None, device: torch.device, timeout_s: float | None = None):
        self.ranks = pipeline_ranks(pp_group)
        self.size = len(self.ranks)
        self.device = device
        self.groups = channel_groups(pp_group, timeout_s, device) if self.size > 1 else {}
        self.backend = dist.get_backend(pp_group) if self.size > 1 else None
        self.sent_bytes = 0

    @property
    def host_blocking_waits(self) -> bool:
        """gloo's wait blocks the host (and takes a timeout); NCCL's only orders the streams: there the process
        group's timeout and watchdog bound a wait."""
        return self.backend != "nccl"

    def peer(self, pipeline_rank: int) -> int:
        return self.ranks[pipeline_rank % self.size]

    def _group(self, channel: str) -> dist.ProcessGroup:
        if channel not in self.groups:
            raise ValueError(f"schedule names communicator {channel!r}; this runtime has {', '.join(CHANNELS)}")
        return self.groups[channel]

    def send_op(self, tensor: torch.Tensor, to_pipeline_rank: int, channel: str) -> tuple[dist.P2POp, PendingTransfer]:
        peer = self.peer(to_pipeline_rank)
        tensor = tensor.contiguous()
        self.sent_bytes += tensor.numel() * tensor.element_size()
        return dist.P2POp(dist.isend, tensor, peer, self._group(channel)), PendingTransfer(None, tensor, peer)

    def recv_op(self, shape: tuple[int, ...], dtype: torch.dtype, from_pipeline_rank: int,
                channel: str) -> tuple[dist.P2POp, PendingTransfer]:
        peer = self.peer(from_pipeline_rank)
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        return dist.P2POp(dist.irecv, buf, peer, self._group(channel)), PendingTransfer(None, buf, peer)

    def post(self, ops: list[tuple[dist.P2POp, PendingTransfer]]) -> None:
        """Post the ops in order: one alone, several as one `batch_isend_irecv` group (one NCCL group call)."""
        if len(ops) == 1:
            op, pending = ops[0]
            pending.work = op.op(op.tensor, op.peer, group=op.group)
            return
        works = dist.batch_isend_irecv([op for op, _ in ops])
        for k, (_, pending) in enumerate(ops):
            # NCCL returns one work for the whole coalesced group, gloo one per op.
            pending.work = works[k] if len(works) == len(ops) else works[-1]
