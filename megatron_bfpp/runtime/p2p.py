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

from ..sharded.comm import backend_device

# The channels a schedule's p2p actions name (`Action.channel`), one process group each.
CHANNELS = ("activations", "gradients")


def pipeline_ranks(pp_group: dist.ProcessGroup | None) -> list[int]:
    """Global ranks of the pipeline group, ordered by pipeline rank."""
    if pp_group is None:
        return [dist.get_rank()] if dist.is_initialized() else [0]
    return dist.get_process_group_ranks(pp_group)


# NCCL communicator settings (ProcessGroupNCCL.NCCLConfig in torch 2.14) that Megatron's
# --nccl-communicator-config-path sets (megatron/core/parallel_state.py get_nccl_options: cga_cluster_size,
# max_ctas, min_ctas, net_name) and NCCL's other tuning fields. Not copied: `blocking` (torch sets it from
# TORCH_NCCL_USE_COMM_NONBLOCKING), `comm_name` and `split_share` (per communicator).
NCCL_CONFIG_FIELDS = ("cga_cluster_size", "max_ctas", "min_ctas", "cta_policy", "nvls_ctas", "collnet_enable",
                      "max_p2p_peers", "traffic_class", "net_name")


def fresh_nccl_options(live: object, options_type: type | None = None,
                       timeout: datetime.timedelta | None = None) -> object:
    """New NCCL options carrying the stream priority and the communicator settings of `live`, the options of an
    existing group, and `timeout` (when given) as their `_timeout`. A group's own options object cannot be reused:
    torch's `new_group` (distributed_c10d.py `_create_nccl_process_group`) writes the new group's `_timeout`,
    `group_name`, `global_ranks_in_group` and `split_from` into the object it is given. It also warns ("
    backend_options._timeout was specified, but timeout kwarg has a default value that will always override it")
    whenever the options' `_timeout` differs from the timeout `new_group` resolved (its `timeout` argument, or
    torch's NCCL default without one): give the options the timeout the group is created with."""
    if options_type is None:
        options_type = dist.ProcessGroupNCCL.Options
    fresh = options_type(is_high_priority_stream=live.is_high_priority_stream)
    for field in NCCL_CONFIG_FIELDS:
        value = getattr(live.config, field, None)
        if value is not None and hasattr(fresh.config, field):  # None: unset name; absent: older torch
            setattr(fresh.config, field, value)
    if timeout is not None:
        fresh._timeout = timeout
    return fresh


def _pipeline_pg_options(pp_group: dist.ProcessGroup, timeout: datetime.timedelta | None) -> object | None:
    """Fresh NCCL options with the pipeline group's settings (Megatron's --nccl-communicator-config-path) and
    `timeout`, so the channel groups get the same; None on other backends or when torch does not expose them."""
    if dist.get_backend(pp_group) != "nccl":
        return None
    try:
        live = pp_group._get_backend(torch.device("cuda")).options
    except Exception:  # private API: fall back to defaults rather than fail
        return None
    return fresh_nccl_options(live, timeout=timeout)


class ChannelGroups:
    """The owner of the channel process groups: per pipeline (its global ranks), {"activations": group,
    "gradients": group}, created on the first request and kept until `forget` (when the process groups are
    destroyed). The process has one, `channel_groups`: the runtime's p2p and the trainer's eager creation share it,
    so each pipeline's pair is created once."""

    def __init__(self) -> None:
        self._pairs: dict[tuple[int, ...], dict[str, dist.ProcessGroup]] = {}

    def get(self, pp_group: dist.ProcessGroup, timeout_s: float | None = None,
            device: torch.device | None = None) -> dict[str, dist.ProcessGroup]:
        """{"activations": group, "gradients": group} over the ranks of `pp_group`, created once on every rank.

        `new_group` is collective over the whole world, so all pipeline groups' rank lists are exchanged first and
        every rank creates every pair in the same order. The groups take the given timeout (default:
        torch's; Megatron-LM's --distributed-timeout-minutes arrives through `runtime.set_wait_timeout`, set by
        `megatron_bfpp.megatron.install`) and the pipeline group's NCCL options (a fresh copy per group, with that
        timeout). One all-reduce on each new group initialises its communicator on all ranks (a collective and a
        coalesced p2p use the same one, keyed by device): torch requires every rank of a group to take part in its
        first batched p2p call (`batch_isend_irecv`'s docstring), which a schedule's batch between two of P ranks
        would not, and every post is one (`PipelineP2P.post`).
        """
        mine = tuple(pipeline_ranks(pp_group))
        if mine in self._pairs:
            return self._pairs[mine]
        all_lists: list = [None] * dist.get_world_size()
        dist.all_gather_object(all_lists, mine)
        timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)

        def group_kwargs() -> dict:
            """new_group's options for one group: its own fresh NCCL options object (torch writes the group's name
            and ranks into it), whose timeout agrees with the group's (torch warns on every rank for each group
            otherwise): the given one in both, or else the options' default (torch's NCCL default) passed on."""
            kwargs: dict = {} if timeout is None else {"timeout": timeout}
            options = _pipeline_pg_options(pp_group, timeout)
            if options is not None:
                kwargs["pg_options"] = options
                kwargs.setdefault("timeout", options._timeout)
            return kwargs

        backend = dist.get_backend(pp_group)
        for ranks in sorted(set(all_lists)):
            pair = {name: dist.new_group(list(ranks), backend=backend, **group_kwargs()) for name in CHANNELS}
            if ranks == mine:
                self._pairs[mine] = pair
        dev = device if device is not None else backend_device(pp_group)
        for group in self._pairs[mine].values():
            dist.all_reduce(torch.zeros(1, device=dev), group=group)
        return self._pairs[mine]

    def created(self, pp_group: dist.ProcessGroup) -> dict[str, dist.ProcessGroup] | None:
        """The pair over the ranks of `pp_group` if it has been created, else None (no collective)."""
        return self._pairs.get(tuple(pipeline_ranks(pp_group)))

    def forget(self) -> None:
        """Drop every pair (their process groups are being destroyed)."""
        self._pairs.clear()


channel_groups = ChannelGroups()


@dataclass
class PendingTransfer:
    work: dist.Work | None
    tensor: torch.Tensor
    peer: int  # global rank


class PipelineP2P:
    """isend/irecv of activations and gradients to neighbour pipeline ranks, each post one coalesced batch."""

    def __init__(self, pp_group: dist.ProcessGroup | None, device: torch.device, timeout_s: float | None = None):
        self.ranks = pipeline_ranks(pp_group)
        self.size = len(self.ranks)
        self.device = device
        self.groups = channel_groups.get(pp_group, timeout_s, device) if self.size > 1 else {}
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
            raise ValueError(f"schedule names channel {channel!r}; this runtime has {', '.join(CHANNELS)}")
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
        """Post the ops of one action or one batch of the schedule, in order, as one `batch_isend_irecv` call, a
        lone op too. The lowering batches per rank, so one transfer can be a batch on one end and alone on the
        other: under NCCL's lazy initialisation torch runs a batch on the channel group's own communicator but a
        lone isend/irecv on a 2-rank one of the pair, where the two ends would never meet. Coalesced, both ends use
        the group's, which is what `schedule/validate.py` assumes."""
        works = dist.batch_isend_irecv([op for op, _ in ops])
        for k, (_, pending) in enumerate(ops):
            # NCCL returns one work for the whole coalesced group, gloo one per op.
            pending.work = works[k] if len(works) == len(ops) else works[-1]
