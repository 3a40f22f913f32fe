"""Drop-ins with Megatron-LM 0.19's exact call signatures, for rebinding in `megatron.training.training`.

- `DistributedDataParallel` (bind it as `training.DDP` and `models.dist_utils.DistributedDataParallel`):
  Megatron-LM builds it as `DP(config=..., ddp_config=..., module=chunk, disable_bucketing=...,
  [pg_collection=...], [full_param_layout=...])`. The ZeRO stage comes from `ddp_config.zero_stage`, or from
  a subclass that presets the `zero_stage` keyword (`with_zero_stage`).
- `get_megatron_optimizer(config, model_chunks, config_overrides=None, use_gloo_process_groups=True,
  pg_collection=None, dump_param_to_param_group_map=None)`: a `ShardedOptimizer` over the chunks when they
  are ShardedDataParallel, with Megatron's parameter groups (its standard overrides unless others are given);
  Megatron's own factory otherwise.
- `finalize_model_grads`: bind it as `training.finalize_model_grads` (train() installs it as the model
  config's `finalize_model_grads_func`).

Megatron-LM's save_checkpoint / load_checkpoint read and write the *unwrapped* model's parameters; under
ZeRO-3 wrap them in `ddp.gathered_params(model)` (`writeback=True` for loading).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from ..sharded.ddp import ShardedDataParallel, gathered_params
from ..sharded.finalize import finalize_model_grads
from ..sharded.optimizer import ShardedOptimizer

DistributedDataParallel = ShardedDataParallel


def with_zero_stage(zero_stage: int) -> type:
    """A ShardedDataParallel subclass whose constructor (Megatron's DDP signature) presets `zero_stage`."""
    if zero_stage not in (1, 2, 3):
        raise ValueError(f"--zero-stage must be 1, 2 or 3 (got {zero_stage!r})")

    def __init__(self, config, ddp_config, module, disable_bucketing: bool = False, pg_collection=None,
                 full_param_layout=None, **kwargs) -> None:
        kwargs.setdefault("zero_stage", zero_stage)
        ShardedDataParallel.__init__(self, config, ddp_config, module, disable_bucketing, pg_collection,
                                     full_param_layout, **kwargs)

    return type(f"ShardedDataParallelZeRO{zero_stage}", (ShardedDataParallel,),
                {"__init__": __init__, "__module__": __name__, "__doc__": ShardedDataParallel.__doc__})


def get_megatron_optimizer(
    config: Any,
    model_chunks: List[Any],
    config_overrides: Optional[Dict[Any, Any]] = None,
    use_gloo_process_groups: bool = True,
    pg_collection: Any = None,
    dump_param_to_param_group_map: Optional[str] = None,
):
    if not all(isinstance(c, ShardedDataParallel) for c in model_chunks):
        if any(isinstance(c, ShardedDataParallel) for c in model_chunks):
            raise TypeError("get_megatron_optimizer: either all model chunks are ShardedDataParallel or none")
        from megatron.core.optimizer import get_megatron_optimizer as megatron_factory

        return megatron_factory(config, model_chunks, config_overrides=config_overrides,
                                use_gloo_process_groups=use_gloo_process_groups, pg_collection=pg_collection,
                                dump_param_to_param_group_map=dump_param_to_param_group_map)
    from megatron.core.optimizer import _get_param_groups, get_standard_config_overrides

    if config_overrides is None:
        config_overrides = get_standard_config_overrides(config)
    groups = _get_param_groups(list(model_chunks), config, config_overrides)
    for g in groups:
        seen: set[int] = set()  # a tied parameter in two chunks of this rank is optimized once
        g["params"] = [p for p in g["params"] if not (id(p) in seen or seen.add(id(p)))]
    grad_stats_groups = None
    if pg_collection is not None:
        mp = getattr(pg_collection, "mp", None)
        grad_stats_groups = [getattr(pg_collection, "dp_cp", None) or model_chunks[0].dp_group] + (
            [mp] if mp is not None else [getattr(pg_collection, "tp", None), getattr(pg_collection, "pp", None)])
    if dump_param_to_param_group_map is not None:
        _dump_param_groups(model_chunks, groups, dump_param_to_param_group_map)
    return ShardedOptimizer(model_chunks, config, param_groups=groups, grad_stats_groups=grad_stats_groups)


def _dump_param_groups(model_chunks, groups, path: str) -> None:
    """As Megatron's factory: {global unique parameter name: group index} saved with torch.distributed.checkpoint."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.transformer.fsdp_dtensor_checkpoint import get_global_unique_param_name

    mapping = {get_global_unique_param_name(model_chunks, p): i for i, g in enumerate(groups) for p in g["params"]}
    dcp.save(state_dict=mapping, checkpoint_id=path)


__all__ = ["DistributedDataParallel", "ShardedOptimizer", "get_megatron_optimizer", "finalize_model_grads",
           "with_zero_stage", "gathered_params"]
