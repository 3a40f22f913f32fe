"""Optimizer checkpoints in Megatron-LM's own dist_checkpointing formats, so they move to and from stock Megatron.

Writing: Megatron's distributed optimizer's `fully_reshardable` format (megatron/core/optimizer/
distrib_optimizer.py, `sharded_param_state_fully_reshardable`): per parameter, fp32 tensors of the parameter's
(tensor-parallel local) shape keyed `optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>`, carrying the
parameter's own ShardedTensor offsets and replica id (only the main replica, data-parallel rank 0, is written).
Nothing depends on the data-parallel size, the flat-buffer layout or the pipeline placement. The non-tensor part
is written so that each of Megatron's Adam optimizers loads it (dist_checkpointing.load rebuilds a dict from the
checkpoint's common part plus the tensors its own template asks for):
- DistributedOptimizer: `optimizer.param_groups` with `step` in each group, `param_state_sharding_type`,
  `grad_scaler`; the checkpoint's content metadata says `distrib_optim_sharding_type: fully_reshardable`;
- Float16OptimizerWithFloat16Params (--bf16/--fp16 without the distributed optimizer): `optimizer.state.
  common_step`, and the master weights of 16-bit parameters also under `optimizer.state.fp32_param.<key>`;
- FP32Optimizer: `state.common_step` and `param_groups` at the top (its master weights are the model's).

Reading: what the checkpoint's content metadata says it holds: `fully_reshardable` (stock distributed optimizer
or this module) or no distributed-optimizer type (stock without --use-distributed-optimizer). The moments, and
the master weights of 16-bit parameters (`param`, or `fp32_param` for the plain optimizer); an fp32 parameter is
its own master in every Megatron optimizer, so its master is the model weight just loaded. Megatron's
bucket-space formats (`dp_reshardable`, its default) follow the layout of Megatron's own gradient buffers, which
--zero-stage does not build: refused, naming the flag that re-saves them in model space.

Saving all-gathers each flat buffer's shard states over data parallelism (dist_checkpointing only accepts
rectangular shards, and a flat shard cuts parameters anywhere), the cost of Megatron's `fully_reshardable`
save. Loading reads whole parameter-shaped tensors and keeps this rank's slice of each.
"""

from __future__ import annotations

from typing import Any

import torch

from . import comm

FULLY_RESHARDABLE = "fully_reshardable"
MASTER = "param"  # the distributed optimizer's key of the fp32 master weights
FP16_MASTER = "fp32_param"  # Float16OptimizerWithFloat16Params' key of the same
MOMENTS = ("exp_avg", "exp_avg_sq")
_INTERNAL = {MASTER: "main_param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
_GROUP_KEYS_NOT_LOADED = ("params", "step")


class OptimizerCheckpointError(ValueError):
    """An optimizer checkpoint this optimizer cannot read; the message names the flag and the way out."""


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
def _gather_bucket_states(bucket_state: tuple) -> dict[str, torch.Tensor]:
    """Full flat fp32 state buffers of one bucket (all ranks' shards)."""
    _, b, st = bucket_state
    full = {}
    for key, internal in _INTERNAL.items():
        shard = st[internal].float()
        out = torch.empty(b.pbuf.layout.padded_numel, dtype=torch.float32, device=shard.device)
        comm.all_gather(out, shard, b.group, stats=None).wait()  # the group the buffer is sharded over
        full[key] = out
    return full


def _sharded_params(params: list[torch.nn.Parameter], param_loc: dict, model_sharded_state_dict):
    """(index, parameter, its ShardedTensor, where the optimizer keeps its state) for every parameter this rank
    checkpoints (a tied parameter owned through another chunk of this rank is skipped)."""
    meta = _param_to_sharded_metadata(model_sharded_state_dict)
    for idx, p in enumerate(params):
        sh = meta.get(p)
        if sh is None:
            raise ValueError(
                f"parameter of shape {tuple(p.shape)} is missing from the model's sharded state dict; build it "
                "with keep_vars=True so its tensors are the parameters themselves"
            )
        loc = param_loc.get(p)
        if loc is not None:
            yield idx, p, sh, loc


def saving_sharded_state_dict(params: list[torch.nn.Parameter], param_loc: dict, bucket_states: list[tuple],
                              step: int, groups: list[dict], grad_scaler: dict | None, model_sharded_state_dict,
                              metadata: dict | None) -> dict:
    """The sharded optimizer's state to save: its parameters, where each one's state lives, its buckets'
    states, Adam's step, the parameter groups' hyper-parameters and the loss scaler's state."""
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    if metadata is not None:
        # Megatron saves this dict as the checkpoint's content metadata; its readers (stock's distributed
        # optimizer, and `loading_sharded_state_dict`) pick the format from it.
        metadata["distrib_optim_sharding_type"] = FULLY_RESHARDABLE
    gathered = {id(bs[1]): _gather_bucket_states(bs) for bs in bucket_states}
    param_state = {}
    for idx, p, sh, loc in _sharded_params(params, param_loc, model_sharded_state_dict):
        tensors = {}
        for key, internal in _INTERNAL.items():
            if loc[0] == "shard":
                slot, b = loc[3], loc[5]
                t = gathered[id(b)][key][slot.start : slot.end].view(slot.shape)
            else:
                t = loc[1][internal].detach().float().view(p.shape)
            tensors[key] = make_sharded_optimizer_tensor(sh, t, prefix=f"optimizer.state.{key}")
        if p.dtype != torch.float32:
            tensors[FP16_MASTER] = make_sharded_optimizer_tensor(sh, tensors[MASTER].data,
                                                                 prefix=f"optimizer.state.{FP16_MASTER}")
        param_state[idx] = tensors
    common_step = torch.tensor(float(step))
    sd: dict[str, Any] = {
        # DistributedOptimizer (and Float16OptimizerWithFloat16Params: `optimizer.state`).
        "optimizer": {"param_groups": [{**g, "step": step} for g in groups],
                      "state": {"common_step": common_step}},
        "param_state": param_state,
        "param_state_sharding_type": FULLY_RESHARDABLE,
        # FP32Optimizer (a torch optimizer's own state dict).
        "state": {"common_step": common_step.clone()},
        "param_groups": groups,
    }
    if grad_scaler is not None:
        sd["grad_scaler"] = grad_scaler
    return sd


def loading_sharded_state_dict(params: list[torch.nn.Parameter], param_loc: dict, model_sharded_state_dict,
                               metadata: dict | None) -> dict:
    """The template dist_checkpointing.load fills for a checkpoint whose content metadata is `metadata`."""
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    # Without metadata (a direct call, not Megatron's checkpointing) the checkpoint is one this module wrote.
    sharding = FULLY_RESHARDABLE if metadata is None else metadata.get("distrib_optim_sharding_type")
    if sharding not in (None, FULLY_RESHARDABLE):
        raise OptimizerCheckpointError(
            f"--load: the checkpoint holds Megatron's distributed-optimizer state in its {sharding!r} format, "
            "laid out in Megatron's own gradient buckets, which --zero-stage does not build. Re-save it in model "
            "space with stock Megatron and --dist-ckpt-optim-fully-reshardable (--load it, --save with "
            "--train-iters at its iteration), or pass --no-load-optim to load the weights and restart Adam"
        )
    param_state = {}
    for idx, p, sh, _ in _sharded_params(params, param_loc, model_sharded_state_dict):
        # An fp32 parameter is its own master in every Megatron optimizer (the distributed optimizer's fp32
        # master shards are views of the weights): it comes from the model weights, loaded just before.
        if p.dtype == torch.float32:
            master: tuple[str, ...] = ()
        else:
            master = (MASTER,) if sharding == FULLY_RESHARDABLE else (FP16_MASTER,)
        param_state[idx] = {
            key: make_sharded_optimizer_tensor(sh, torch.empty(p.shape, dtype=torch.float32, device=p.device),
                                               prefix=f"optimizer.state.{key}")
            for key in (*master, *MOMENTS)
        }
    return {"param_state": param_state}


def _saved_step_and_groups(state_dict: dict) -> tuple[int, list[dict]]:
    """Adam's step and the parameter groups' hyper-parameters, from any of Megatron's optimizer formats."""
    if state_dict.get("param_state_sharding_type") == FULLY_RESHARDABLE:  # distributed optimizer, or ours
        groups = state_dict["optimizer"]["param_groups"]
        steps = {int(g["step"]) for g in groups if g.get("step") is not None}
        if len(steps) > 1:
            raise OptimizerCheckpointError(f"--load: the checkpoint's parameter groups disagree on Adam's step "
                                           f"({sorted(steps)})")
        return (steps.pop() if steps else 0), groups
    inner = state_dict["optimizer"] if "optimizer" in state_dict else state_dict  # Float16 / FP32Optimizer
    step = inner.get("state", {}).get("common_step")  # Megatron saves it only once nonzero
    return (0 if step is None else int(step)), inner["param_groups"]


def _match_groups(mine: list[dict], saved: list[dict]) -> list[dict]:
    """The saved group of each of this optimizer's groups, matched as Megatron matches them (by the keys that
    identify a group, `param_group_identifier_keys`), not by position."""
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    def ident(g: dict) -> tuple:
        # As Megatron, a missing key reads as None; an unset flag (False) too, whoever built the groups.
        values = (g.get(k, g.get(f"pre_{k}")) for k in param_group_identifier_keys)
        return tuple(None if v is False else v for v in values)

    by_ident = {ident(g): g for g in saved}
    out = []
    for g in mine:
        if ident(g) not in by_ident:
            raise OptimizerCheckpointError(
                f"--load: the checkpoint has no parameter group {dict(zip(param_group_identifier_keys, ident(g)))} "
                "(its groups: " + "; ".join(str(k) for k in by_ident) + "); the weight-decay / learning-rate "
                "overrides (--decoupled-lr, ...) must match the run that saved it, or pass --no-load-optim")
        out.append(by_ident[ident(g)])
    return out


@torch.no_grad()
def load_megatron_state(params: list[torch.nn.Parameter], param_loc: dict, param_groups: list[dict],
                        state_dict: dict) -> tuple[int, dict | None]:
    """Load what dist_checkpointing.load returned for `loading_sharded_state_dict`'s template into the states
    `param_loc` locates and the hyper-parameters of `param_groups`; returns Adam's step and the loss scaler's
    state (or None) for the optimizer to take."""
    step, saved_groups = _saved_step_and_groups(state_dict)
    if len(saved_groups) != len(param_groups):
        raise OptimizerCheckpointError(
            f"--load: the checkpoint's optimizer has {len(saved_groups)} parameter groups, this run "
            f"{len(param_groups)}: the weight-decay / learning-rate overrides must match, or pass --no-load-optim")
    saved_groups = _match_groups(param_groups, saved_groups)
    for idx, tensors in state_dict["param_state"].items():
        p = params[int(idx)]
        loc = param_loc[p]
        for key, t in tensors.items():
            if not torch.is_tensor(t):  # a ShardedTensor left unloaded would be a bug upstream
                raise ValueError(f"optimizer state {key} of parameter {idx} was not loaded")
        full = {k: tensors[k] for k in MOMENTS}
        master = tensors.get(MASTER, tensors.get(FP16_MASTER))
        if master is not None:  # 16-bit parameters; an fp32 one's master is the weight storage, loaded already
            full[MASTER] = master
        for key, value in full.items():
            internal = _INTERNAL[key]
            value = value.float()
            if loc[0] == "replicated":
                loc[1][internal].copy_(value.view(p.shape))
                continue
            _, _, _, slot, st, b = loc
            piece = b.pbuf.layout.piece(slot, b.rank)
            if piece is not None:
                st[internal][piece.shard_lo : piece.shard_hi].copy_(value.reshape(-1)[piece.param_lo : piece.param_hi])
    for g, saved in zip(param_groups, saved_groups):
        g.update({k: v for k, v in saved.items() if k not in _GROUP_KEYS_NOT_LOADED})
    return step, state_dict.get("grad_scaler") or None
