"""`finalize_model_grads` for `ShardedDataParallel` chunks, with Megatron's signature.

The runtime calls `config.finalize_model_grads_func` once after a training schedule run. Here it:
1. finishes data-parallel reduction: any gradient not reduced yet is reduce-scattered, every outstanding
   reduce is waited for, and replicated (tied) parameters' gradients are averaged over data parallelism;
   then, as Megatron's `_ParamAndGradBucketGroup.check_grads` under `--check-for-nan-in-loss-and-grad` /
   `--check-for-large-grads`, validates each bucket's gradient norm through Megatron's rerun state machine;
2. sums over tensor-parallel ranks the gradients Megatron sums there (sequence-parallel and qk-layernorm
   parameters; `average_gradients_across_tp_domain` ones are averaged), on the gradient shards;
3. sums tied-embedding gradients over the embedding group (first and last pipeline stage);
4. updates the MoE routers' per-step state as Megatron does (expert bias, quantile-balancing bias, reset);
5. divides by the global number of tokens when `num_tokens` is given (per-token loss).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from . import comm
from .ddp import ShardedDataParallel


def finalize_model_grads(
    model: Sequence[torch.nn.Module],
    num_tokens: torch.Tensor | None = None,
    pg_collection: Any = None,
    force_all_reduce: bool | None = False,
) -> None:
    chunks = list(model)
    if not all(isinstance(c, ShardedDataParallel) for c in chunks):
        if any(isinstance(c, ShardedDataParallel) for c in chunks):
            raise TypeError("finalize_model_grads: either all model chunks are ShardedDataParallel or none")
        from megatron.core.distributed import finalize_model_grads as megatron_finalize

        return megatron_finalize(model, num_tokens=num_tokens, pg_collection=pg_collection,
                                 force_all_reduce=force_all_reduce)
    first = chunks[0]
    tp_group, pp_group, embd_group, dp_group = first.tp_group, first.pp_group, first.embd_group, first.dp_group
    if pg_collection is not None:
        tp_group = getattr(pg_collection, "tp", None) or tp_group
        pp_group = getattr(pg_collection, "pp", None) or pp_group
        embd_group = getattr(pg_collection, "embd", None) or embd_group
        dp_group = getattr(pg_collection, "dp_cp", None) or dp_group

    for c in chunks:
        c.finish_grad_sync(force_all_reduce=force_all_reduce)
    check_grads(chunks)
    _allreduce_tensor_parallel_replicated_grads(chunks, tp_group)
    _allreduce_tied_embedding_grads(chunks, embd_group)
    _update_moe_routers(chunks, first.config, dp_group)

    if num_tokens is not None:
        if pp_group is not None and comm.group_size(pp_group) > 1:
            from megatron.core.pipeline_parallel.utils import get_pp_last_rank

            dist.broadcast(num_tokens, src=get_pp_last_rank(pp_group), group=pp_group)
        if comm.group_size(dp_group) > 1:
            dist.all_reduce(num_tokens, group=dp_group)
        scaling = 1.0 / torch.clamp(num_tokens, min=1)
        for c in chunks:
            c.scale_gradients(scaling)


def check_grads(chunks: Sequence[ShardedDataParallel]) -> None:
    """Megatron's gradient check (`_ParamAndGradBucketGroup.check_grads`, megatron/core/distributed/
    param_and_grad_buffer.py), on what this rank owns once the data-parallel reduction has landed: each flat
    buffer's fp32 gradient shard, and the chunk's replicated (tied) gradients as one more bucket.

    Megatron checks each rank's local bucket before its collective; here the gradients are reduce-scattered at
    the schedule's REDUCE actions, several per step, so the check waits for the step's last one and runs once
    per bucket at finish (a NaN or Inf in any rank's contribution reaches the shard that owns the element), as
    Megatron's does once per bucket group. Same rerun-state-machine calls, messages, tolerance and fatality:
    with `--rerun-mode validate_results` (Megatron's default) the step is re-run and the job saves and exits
    instead of applying the update; with `--rerun-mode disabled` a RuntimeError is raised."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    for c in chunks:
        nan_or_inf = bool(getattr(c.ddp_config, "check_for_nan_in_grad", False))
        large = bool(getattr(c.ddp_config, "check_for_large_grads", False))
        if not (nan_or_inf or large):
            continue
        rerun_state_machine = get_rerun_state_machine()
        norms = [b.gbuf.main_grad_shard.norm(p=2) for b in c.flat_buffers]
        if c.owned_replicated_params:
            norms.append(torch.stack([p.main_grad.norm(p=2) for p in c.owned_replicated_params]).norm(p=2))
        for i, grad_norm in enumerate(norms):
            where = f"bucket #{i} in backward pass after the data-parallel reduction"
            if nan_or_inf:
                rerun_state_machine.validate_result(
                    result=grad_norm, rejection_func=torch.isnan,
                    message=f"found NaN in local grad norm for {where}",
                    tolerance=0.001, fatal=True,
                )
                rerun_state_machine.validate_result(
                    result=grad_norm, rejection_func=torch.isinf,
                    message=f"found Inf in local grad norm for {where}",
                    tolerance=0.001, fatal=True,
                )
            if large:
                rerun_state_machine.validate_result(
                    result=grad_norm,
                    rejection_func=partial(rerun_state_machine.is_unexpectedly_large, threshold=10, context="grads"),
                    message=f"found unexpected large grads in {where}",
                    tolerance=0.001, fatal=False,
                )


def _update_moe_routers(chunks: Sequence[ShardedDataParallel], config: Any, dp_group) -> None:
    """The MoE router updates of Megatron's finalize_model_grads (megatron/core/distributed/
    finalize_model_grads.py), through its own helpers: the aux-loss-free expert bias (tokens per expert summed
    over tensor x data parallelism, its groups from parallel_state as there without a pg_collection), the
    quantile-balancing bias (0.19; averaged over data parallelism) and the reset of the routers' per-step
    tensors. They read router buffers, not gradients, so the sharded buffers change nothing."""
    import importlib

    if not getattr(config, "num_moe_experts", None):
        return  # no router (and a config that need not be a TransformerConfig)
    megatron_finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    if getattr(config, "moe_router_enable_expert_bias", False):
        megatron_finalize._update_router_expert_bias(chunks, config)
    if getattr(config, "moe_router_load_balancing_type", None) == "quantile_balancing":
        megatron_finalize._update_router_qb_beta(chunks, config, dp_cp_group=dp_group)
    reset = getattr(megatron_finalize, "reset_model_temporary_tensors", None)
    if reset is not None:
        reset(config, chunks)


def _needs_tp_reduction(param: torch.nn.Parameter, name: str, config: Any) -> str | None:
    """'sum' / 'avg' / None, exactly as Megatron's _allreduce_non_tensor_model_parallel_grads decides."""
    if getattr(param, "average_gradients_across_tp_domain", False):
        return "avg"
    if (getattr(config, "sequence_parallel", False) and getattr(param, "sequence_parallel", False)) or (
        getattr(config, "qk_layernorm", False) and ("q_layernorm" in name or "k_layernorm" in name)
    ):
        return "sum"
    return None


def _allreduce_tensor_parallel_replicated_grads(chunks: Sequence[ShardedDataParallel], tp_group) -> None:
    """Every TP rank has the same buffer layout, so the shard slices of these parameters line up."""
    n = comm.group_size(tp_group)
    if n <= 1:
        return
    grads: dict[str, list[torch.Tensor]] = {"sum": [], "avg": []}
    for c in chunks:
        for b in c.flat_buffers:
            for piece in b.pbuf.layout.pieces(b.rank):
                p = b.pbuf.params[piece.slot.index]
                kind = _needs_tp_reduction(p, c.param_names[p], c.config)
                if kind:
                    grads[kind].append(b.gbuf.main_grad_shard[piece.shard_lo : piece.shard_hi])
        for p in c.owned_replicated_params:
            kind = _needs_tp_reduction(p, c.param_names[p], c.config)
            if kind:
                grads[kind].append(p.main_grad)
    for kind, gs in grads.items():
        if not gs:
            continue
        flat = _flatten_dense_tensors(gs)
        dist.all_reduce(flat, group=tp_group)
        if kind == "avg":
            flat.div_(n)
        for g, synced in zip(gs, _unflatten_dense_tensors(flat, gs)):
            g.copy_(synced)


def _allreduce_tied_embedding_grads(chunks: Sequence[ShardedDataParallel], embd_group) -> None:
    if embd_group is None or comm.group_size(embd_group) <= 1:
        return
    if dist.get_rank() not in dist.get_process_group_ranks(embd_group):
        return
    grads = [p.main_grad for c in chunks for p in c.owned_replicated_params if getattr(p, "shared_embedding", False)]
    if not grads:
        return
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=embd_group)
    for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)
