"""Reshardable optimizer checkpoints for Megatron's dist_checkpointing.

The state is written in model space: for every parameter, fp32 tensors `fp32_param`, `exp_avg` and
`exp_avg_sq` of the parameter's (tensor-parallel local) shape, keyed `optimizer.state.<name>.<model key>`
and carrying the parameter's own ShardedTensor offsets and replica id. Nothing in the checkpoint depends on
the data-parallel size, the flat-buffer layout or the pipeline placement, so it loads at another D, P or V.

Saving all-gathers each flat buffer's shard states over data parallelism (dist_checkpointing only accepts
rectangular shards, and a flat shard cuts parameters anywhere), the same cost as Megatron's
`fully_reshardable` distributed-optimizer format; only the main replica (data-parallel rank 0, as the model
parameter's replica id says) is written. Loading reads full parameter-shaped tensors and keeps this rank's
slice of each.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from . import comm

if TYPE_CHECKING:
    from .ddp import ShardedDataParallel

STATE_KEYS = ("fp32_param", "exp_avg", "exp_avg_sq")
_INTERNAL = {"fp32_param": "main_param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
SHARDING_TYPE = "bfpp_model_space"


def _param_to_sharded_metadata(model_sharded_state_dict) -> dict:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    sharded, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    out = {}
    for sh in nested_values(sharded):
        # ZeRO-3 chunks hand out gathered copies that remember their parameter.
        out[getattr(sh.data, "_bfpp_param", sh.data)] = sh
    return out


@torch.no_grad()
def _gather_bucket_states(chunks: Sequence[ShardedDataParallel], bucket_state) -> dict[str, torch.Tensor]:
    """Full flat fp32 state buffers of one bucket (all ranks' shards)."""
    ci, b, st = bucket_state
    group = chunks[ci].dp_group
    full = {}
    for key in STATE_KEYS:
        shard = st[_INTERNAL[key]].float()
        out = torch.empty(b.pbuf.layout.padded_numel, dtype=torch.float32, device=shard.device)
        comm.all_gather(out, shard, group, stats=None).wait()
        full[key] = out
    return full


def model_space_sharded_state_dict(params: list[torch.nn.Parameter], param_loc: dict, bucket_states: list[tuple],
                                   chunks: Sequence[ShardedDataParallel], model_sharded_state_dict,
                                   is_loading: bool) -> dict:
    """The per-parameter states of the sharded optimizer (its parameters, where each one's state lives, its
    buckets' states and its chunks) as dist_checkpointing tensors; the optimizer adds its step, groups and
    scaler."""
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    meta = _param_to_sharded_metadata(model_sharded_state_dict)
    gathered: dict[int, dict[str, torch.Tensor]] = {}
    if not is_loading:
        for bs in bucket_states:
            gathered[id(bs[1])] = _gather_bucket_states(chunks, bs)
    param_state = {}
    for idx, p in enumerate(params):
        sh = meta.get(p)
        if sh is None:
            raise ValueError(
                f"parameter of shape {tuple(p.shape)} is missing from the model's sharded state dict; build it "
                "with keep_vars=True so its tensors are the parameters themselves"
            )
        loc = param_loc.get(p)
        if loc is None:  # a tied parameter owned (and checkpointed) through another chunk of this rank
            continue
        tensors = {}
        for key in STATE_KEYS:
            if is_loading:
                t = torch.empty(p.shape, dtype=torch.float32, device=p.device)
            elif loc[0] == "shard":
                slot, b = loc[3], loc[5]
                t = gathered[id(b)][key][slot.start : slot.end].view(slot.shape)
            else:
                t = loc[1][_INTERNAL[key]].detach().float().view(p.shape)
            tensors[key] = make_sharded_optimizer_tensor(sh, t, prefix=f"optimizer.state.{key}")
        param_state[idx] = tensors
    return {"param_state": param_state, "param_state_sharding_type": SHARDING_TYPE}


@torch.no_grad()
def load_model_space_state(params: list[torch.nn.Parameter], param_loc: dict, chunks: Sequence[ShardedDataParallel],
                           state_dict: dict) -> None:
    """Load the per-parameter states from the output of dist_checkpointing.load on
    `model_space_sharded_state_dict(..., is_loading=True)` (the optimizer loads its step, groups and scaler)."""
    if state_dict.get("param_state_sharding_type") != SHARDING_TYPE:
        raise ValueError(
            f"optimizer checkpoint format {state_dict.get('param_state_sharding_type')!r} is not "
            f"{SHARDING_TYPE!r}: it was not written by ShardedOptimizer"
        )
    for idx, tensors in state_dict["param_state"].items():
        p = params[int(idx)]
        loc = param_loc[p]
        for key in STATE_KEYS:
            full = tensors[key]
            if not torch.is_tensor(full):  # a ShardedTensor left unloaded would be a bug upstream
                raise ValueError(f"optimizer state {key} of parameter {idx} was not loaded")
            if loc[0] == "replicated":
                loc[1][_INTERNAL[key]].copy_(full.view(p.shape))
                continue
            _, ci, _, slot, st, b = loc
            piece = b.pbuf.layout.piece(slot, chunks[ci].dp_rank)
            if piece is not None:
                flat = full.reshape(-1)
                st[_INTERNAL[key]][piece.shard_lo : piece.shard_hi].copy_(flat[piece.param_lo : piece.param_hi])
