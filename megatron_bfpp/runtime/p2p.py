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


def channel_groups(pp_group: dist.ProcessGroup, timeout_s: float | None = None,
                   device: torch.device | None = None) -> dict[str, dist.ProcessGroup]:
    """{"activations": group, "gradients": group} over the ranks of `pp_group`, created once on every rank.

    `new_group` is collective over the whole world, so all pipeline groups' rank lists are exchanged first and
    every rank creates every pair in the same order. The groups take the given timeout (default:
    torch's; Megatron-LM's --distributed-timeout-minutes arrives through `runtime.set_wait_timeout`, set by
    `megatron_bfpp.megatron.install`) and the pipeline group's NCCL options (a fresh copy per group, with that
    timeout). One all-reduce on each new group
    initialises its communicator on all ranks (a collective and a coalesced p2p use the same one, keyed by device):
    torch requires every rank of a group to take part in its first batched p2p call (`batch_isend_irecv`'s
    docstring), which a schedule's batch between two of P ranks would not, and every post is one (`coalesced`).
    """
    mine = tuple(pipeline_ranks(pp_group))
    if mine in _CHANNEL_CACHE:
        return _CHANNEL_CACHE[mine]
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
            _CHANNEL_CACHE[mine] = pair
    dev = device
    if dev is None:  # the process group's backend decides: NCCL works on the current CUDA device
        dev = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    for group in _CHANNEL_CACHE[mine].values():
        dist.all_reduce(torch.zeros(1, device=dev), group=group)
    return _CHANNEL_CACHE[mine]


def forget_channel_groups() -> None:
    """Forget the cached channel groups (their process groups are being destroyed)."""
    _CHANNEL_CACHE.clear()


def coalesced(ops_in_post: int) -> bool:
    """Whether `PipelineP2P.post` posts a post of `ops_in_post` ops (one schedule action, or one batch) inside a
    coalescing group, i.e. as one `batch_isend_irecv`: always, a lone op too. The lowering batches per rank, so one
    transfer can be a batch on one end and alone on the other; with every post coalesced, both ends run it on the
    channel group's communicator (`nccl_communicator`), which is what `schedule/validate.py` assumes."""
    return True


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
        """Post the ops of one action or one batch of the schedule, in order, as one `batch_isend_irecv` call."""
        if coalesced(len(ops)):
            works = dist.batch_isend_irecv([op for op, _ in ops])
        else:  # outside a coalescing group: each op alone (see `coalesced`)
            works = [op.op(op.tensor, op.peer, group=op.group) for op, _ in ops]
        for k, (_, pending) in enumerate(ops):
            # NCCL returns one work for the whole coalesced group, gloo one per op.
            pending.work = works[k] if len(works) == len(ops) else works[-1]
