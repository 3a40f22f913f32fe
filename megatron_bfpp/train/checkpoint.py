"""Trainer checkpoints through Megatron's dist_checkpointing: atomic, and loadable at another layout.

Layout on disk (Megatron-LM's): `DIR/iter_0000042/` holds a torch_dist checkpoint, `DIR/
latest_checkpointed_iteration.txt` names the newest complete one. The state dict is the one Megatron-LM's
`generate_state_dict` builds: `model` / `model0..V-1` (each chunk's `sharded_state_dict()`: global layer
keys, so any P and V can read it), `optimizer` (ShardedOptimizer's state in Megatron's distributed-optimizer
`fully_reshardable` format, named in the checkpoint's content metadata: any D, P, V, ZeRO stage; stock
Megatron reads it too), `opt_param_scheduler`, `rng_state` (a ShardedObject per pipeline rank), `iteration`, `args`,
plus `bfpp` (consumed samples, the layout and model shape that wrote it).

Atomic save: every rank writes into `iter_XXXXXXX.tmp`, rank 0 fsyncs the files, renames the directory and
then replaces the tracker file (write, fsync, rename). A crash at any point leaves the tracker naming the
previous complete checkpoint; a stale `.tmp` is removed by the next save.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

TRACKER = "latest_checkpointed_iteration.txt"
FORMAT_VERSION = 2  # 2: the optimizer state in Megatron's fully_reshardable format (1: an own format)

# Flags that fix the shapes of the model's tensors: a checkpoint loads only where they agree.
MODEL_SHAPE_FLAGS = (
    ("--num-layers", "num_layers"),
    ("--hidden-size", "hidden_size"),
    ("--ffn-hidden-size", "ffn_hidden_size"),
    ("--num-attention-heads", "num_attention_heads"),
    ("--num-query-groups", "num_query_groups"),
    ("--kv-channels", "kv_channels"),
    ("--vocab-size (padded)", "padded_vocab_size"),
    ("--max-position-embeddings", "max_position_embeddings"),
    ("--position-embedding-type", "position_embedding_type"),
    ("--normalization", "normalization"),
    ("--swiglu", "swiglu"),
    ("--disable-bias-linear", "add_bias_linear"),
    ("--untie-embeddings-and-output-weights", "untie_embeddings_and_output_weights"),
)


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or loaded; the message names the directory, the flag and the fix."""


# ------------------------------------------------------------------------------------------------ paths
def iteration_dir(root: str, iteration: int) -> str:
    """Megatron-LM's directory name for a checkpoint iteration: ROOT/iter_0000042."""
    from megatron.training.checkpointing import get_checkpoint_name

    return get_checkpoint_name(root, iteration, return_base_dir=True)


def tracker_path(root: str) -> str:
    return os.path.join(root, TRACKER)


def read_tracker(root: str) -> int | None:
    """The iteration named by ROOT's tracker file, or None when there is none. No process group needed."""
    path = tracker_path(root)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    try:
        it = int(text)
    except ValueError:
        raise CheckpointError(f"--load {root}: {path} holds {text!r}, not an iteration number; fix or delete it "
                              "(release checkpoints are not supported by the trainer)") from None
    if it < 0:
        raise CheckpointError(f"--load {root}: {path} names iteration {it}")
    return it


def resolve_load_dir(root: str, step: int | None = None) -> tuple[int, str] | None:
    """(iteration, directory) to load from ROOT (`step` = --ckpt-step), or None when ROOT holds no checkpoint."""
    it = step if step is not None else read_tracker(root)
    if it is None:
        return None
    path = iteration_dir(root, it)
    if not os.path.isdir(path) and os.path.isdir(path + ".old"):
        path += ".old"  # a re-save of this iteration was interrupted between its two renames
    if not os.path.isfile(os.path.join(path, "metadata.json")):
        which = f"--ckpt-step {step}" if step is not None else f"{tracker_path(root)}"
        raise CheckpointError(f"--load {root}: {which} names iteration {it} but {path} is not a complete "
                              "checkpoint (no metadata.json); pass --ckpt-step with an iteration that exists")
    return it, path


def check_load_args(a: argparse.Namespace) -> None:
    """Checks of --load / --save / --ckpt-step that need no process group (called by check_trainer_args)."""
    if a.load is None:
        if a.ckpt_step is not None:
            raise CheckpointError("--ckpt-step needs --load DIR")
        return
    if not os.path.isdir(a.load):
        if a.save and os.path.abspath(a.save) == os.path.abspath(a.load) and not a.exit_on_missing_checkpoint:
            return  # restartable job (--save DIR --load DIR): the first run starts from scratch
        raise CheckpointError(f"--load {a.load}: no such directory; pass the --save directory of an earlier run "
                              "(or drop --load to train from scratch)")
    found = resolve_load_dir(a.load, a.ckpt_step)
    if found is None and a.exit_on_missing_checkpoint:
        raise CheckpointError(f"--load {a.load}: no checkpoint there ({TRACKER} missing) and "
                              "--exit-on-missing-checkpoint is set")
    if found is None and not (a.save and os.path.abspath(a.save) == os.path.abspath(a.load)):
        raise CheckpointError(f"--load {a.load}: no checkpoint there ({TRACKER} missing); pass the --save "
                              "directory of an earlier run, or drop --load (--save DIR --load DIR starts from "
                              "scratch when empty)")


# ------------------------------------------------------------------------------------------------ state
def model_shape(a: argparse.Namespace) -> dict[str, Any]:
    shape = {attr: getattr(a, attr, None) for _, attr in MODEL_SHAPE_FLAGS}
    if not getattr(a, "group_query_attention", False):
        shape["num_query_groups"] = None  # Megatron leaves a meaningless default there
    return shape


def _rng_state() -> dict[str, Any]:
    """Megatron-LM's RNG state keys (CUDA entries only where CUDA is)."""
    state: dict[str, Any] = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        from megatron.core import tensor_parallel

        state["cuda_rng_state"] = torch.cuda.get_rng_state()
        state["rng_tracker_states"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if torch.cuda.is_available() and "cuda_rng_state" in state:
        from megatron.core import tensor_parallel

        torch.cuda.set_rng_state(state["cuda_rng_state"])
        tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def _rng_sharded_object(state: dict | None):
    """One RNG state per (pipeline, tensor) rank, data-parallel replicas deduplicated, as Megatron-LM."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject(
        "rng_state", [state],
        (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()),
        (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
        replica_id=ps.get_data_parallel_rank(with_context_parallel=True),
    )


def _one_sharded_tensor_per_param(model_sds: list) -> list:
    """The model's ShardedTensors, one per parameter, preferring the main replica.

    At P = 1 with tied embeddings the last chunk's output layer *is* the first chunk's embedding Parameter and
    Megatron describes it twice (the output-layer copy as a non-main replica); the optimizer state of that
    parameter must carry the main replica's description or no rank would write it.
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica

    chosen: dict[int, ShardedTensor] = {}
    for sh in nested_values(model_sds):
        if not isinstance(sh, ShardedTensor):
            continue
        key = id(getattr(sh.data, "_bfpp_param", sh.data))
        if key not in chosen or (is_main_replica(sh.replica_id) and not is_main_replica(chosen[key].replica_id)):
            chosen[key] = sh
    return list(chosen.values())


def _model_key(i: int, n: int) -> str:
    return "model" if n == 1 else f"model{i}"


def _sharded_metadata() -> dict:
    """What Megatron-LM passes to sharded_state_dict and saves as the checkpoint's content metadata; the
    optimizer state is always in the distributed optimizer's model-space format."""
    from megatron.core import parallel_state as ps

    from ..sharded.checkpoint import FULLY_RESHARDABLE

    return {"distrib_optim_sharding_type": FULLY_RESHARDABLE,
            "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}


def _content_metadata(metadata: dict) -> dict:
    return {k: v for k, v in metadata.items() if k != "dp_cp_group"}  # a process group is no file content


def _layout(a: argparse.Namespace, model: Sequence[torch.nn.Module]) -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    return {
        "pp": ps.get_pipeline_model_parallel_world_size(), "vp": len(model),
        "dp": ps.get_data_parallel_world_size(), "tp": ps.get_tensor_model_parallel_world_size(),
        "zero_stage": a.zero_stage, "pipeline_schedule": a.pipeline_schedule,
    }


def build_state_dict(
    a: argparse.Namespace, model: Sequence[torch.nn.Module], optimizer: Any, scheduler: Any, iteration: int,
    consumed_samples: int, *, loading: bool = False, include_rng: bool = True, metadata: dict | None = None,
) -> dict:
    """The sharded state dict Megatron-LM's generate_state_dict builds (for saving, or as the load template).
    `optimizer` None leaves the optimizer out (--no-save-optim, --no-load-optim)."""
    metadata = _sharded_metadata() if metadata is None else metadata
    sd: dict[str, Any] = {"checkpoint_version": 3.0, "iteration": iteration}
    for i, chunk in enumerate(model):
        sd[_model_key(i, len(model))] = chunk.sharded_state_dict(metadata=metadata)
    if optimizer is not None:
        model_sd = {"model": _one_sharded_tensor_per_param([sd[_model_key(i, len(model))] for i in range(len(model))])}
        sd["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=loading, metadata=metadata)
    if include_rng:
        sd["rng_state"] = _rng_sharded_object(None if loading else _rng_state())
    if not loading:
        a.consumed_train_samples = consumed_samples
        sd["args"] = a
        if scheduler is not None:
            sd["opt_param_scheduler"] = scheduler.state_dict()
        sd["bfpp"] = {"format": FORMAT_VERSION, "consumed_train_samples": consumed_samples,
                      "layout": _layout(a, model), "model_shape": model_shape(a)}
    return sd


def _save_strategy():
    """Megatron's torch_dist writer on GPU; on CPU the same format written by torch.distributed.checkpoint's
    FileSystemWriter (Megatron's writer calls torch.cuda.synchronize / current_device and psutil)."""
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    if torch.cuda.is_available():
        return TorchDistSaveShardedStrategy()

    class SyncTorchDistSaveStrategy(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir):
            import torch.distributed.checkpoint as dcp
            from megatron.core.dist_checkpointing.strategies.torch import (
                MCoreSavePlanner,
                _replace_state_dict_keys_with_sharded_keys,
                mcore_to_pyt_state_dict,
            )

            sharded, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict,
                                                                       self.keep_only_main_replica)
            dcp.save(
                mcore_to_pyt_state_dict(sharded, False),
                storage_writer=dcp.FileSystemWriter(str(checkpoint_dir), sync_files=True, thread_count=1),
                planner=MCoreSavePlanner(dedup_replicated_tensors=not self.keep_only_main_replica,
                                         flatten_state_dict=False, flatten_sharded_tensors=False),
            )

    return SyncTorchDistSaveStrategy()


def _drop_rank_specific(common: dict) -> dict:
    # args hold per-rank values (rank, local_rank): not a consistency problem.
    return {k: v for k, v in common.items() if k != "args"}


# ------------------------------------------------------------------------------------------------ save
def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: str) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            _fsync_path(os.path.join(dirpath, name))
        _fsync_path(dirpath)


def write_tracker(root: str, iteration: int) -> None:
    """Replace ROOT's tracker atomically: a reader sees the old or the new iteration, never a torn file."""
    tmp = tracker_path(root) + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, tracker_path(root))
    _fsync_path(root)


def save_checkpoint(
    root: str, iteration: int, *, args: argparse.Namespace, model: Sequence[torch.nn.Module], optimizer: Any,
    scheduler: Any, consumed_samples: int, before_commit: Callable[[], None] | None = None,
) -> str:
    """Collective: write iteration's checkpoint under ROOT atomically and point the tracker at it."""
    from megatron.core import dist_checkpointing

    final = iteration_dir(root, iteration)
    tmp = final + ".tmp"
    rank0 = dist.get_rank() == 0
    if rank0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crashed save
        os.makedirs(tmp)
    dist.barrier()
    metadata = _sharded_metadata()
    sd = build_state_dict(args, model, None if args.no_save_optim else optimizer, scheduler, iteration,
                          consumed_samples, include_rng=not args.no_save_rng, metadata=metadata)
    dist_checkpointing.save(sd, tmp, sharded_strategy=_save_strategy(), validate_access_integrity=True,
                            preprocess_common_before_consistancy_check=_drop_rank_specific,
                            content_metadata=_content_metadata(metadata))
    if before_commit is not None:
        before_commit()  # fault-injection point: the shards are written, nothing is committed
    dist.barrier()
    if rank0:
        _fsync_tree(tmp)
        old = None
        if os.path.exists(final):  # re-saving an iteration (e.g. after --ckpt-step): keep it until committed
            old = final + ".old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_path(root)
        write_tracker(root, iteration)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


# ------------------------------------------------------------------------------------------------ load
def check_model_shape(saved: dict[str, Any], a: argparse.Namespace, where: str) -> None:
    """One error naming the first flag whose value differs from the checkpoint's."""
    mine = model_shape(a)
    for flag, attr in MODEL_SHAPE_FLAGS:
        if attr in saved and saved[attr] != mine[attr]:
            raise CheckpointError(
                f"--load {where}: the checkpoint was saved with {flag} {saved[attr]!r}, this run has "
                f"{mine[attr]!r}: use the checkpoint's value (model shapes must match to load)")


def read_saved_shape(path: str) -> dict[str, Any]:
    """The model shape a checkpoint directory was written with (no process group needed)."""
    from megatron.core import dist_checkpointing

    try:
        common = dist_checkpointing.load_common_state_dict(path)
    except Exception as e:
        raise CheckpointError(f"--load: cannot read {path}: {type(e).__name__}: {e}") from None
    return _saved_shape(common)


def _saved_shape(common: dict) -> dict[str, Any]:
    bfpp = common.get("bfpp") or {}
    if "model_shape" in bfpp:
        return bfpp["model_shape"]
    args = common.get("args")  # a Megatron-LM checkpoint
    if args is None:
        return {}
    return {attr: getattr(args, attr) for _, attr in MODEL_SHAPE_FLAGS if hasattr(args, attr)}


def load_checkpoint(
    root: str, *, args: argparse.Namespace, model: Sequence[torch.nn.Module], optimizer: Any, scheduler: Any,
    log: Callable[[str], None] = print,
) -> tuple[int, int]:
    """Collective: load ROOT's latest (or --ckpt-step) checkpoint into model, optimizer, scheduler and RNGs.

    Returns (iteration, consumed samples); (0, 0) when ROOT holds no checkpoint yet (--save DIR --load DIR).
    The optimizer state is resharded to this run's layout by dist_checkpointing; the RNG state is restored
    when the pipeline and tensor sizes match the checkpoint's (Megatron-LM does the same).
    """
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    found = resolve_load_dir(root, args.ckpt_step) if os.path.isdir(root) else None
    if found is None:
        check_load_args(args)  # raises unless this is the empty --save DIR --load DIR case
        log(f"no checkpoint in {root} yet: training from scratch")
        return 0, 0
    iteration, path = found
    common = dist_checkpointing.load_common_state_dict(path)
    check_model_shape(_saved_shape(common), args, root)
    finetune = bool(args.finetune)
    bfpp = common.get("bfpp") or {}
    layout = bfpp.get("layout", {})
    load_optim = not (finetune or args.no_load_optim)
    same_rng_grid = (layout.get("pp"), layout.get("tp")) == (ps.get_pipeline_model_parallel_world_size(),
                                                           ps.get_tensor_model_parallel_world_size())
    saved_args = common.get("args")
    load_rng = (not (finetune or args.no_load_rng) and same_rng_grid
                and not getattr(saved_args, "no_save_rng", False))
    if load_optim and "optimizer" not in common:  # its non-sharded part (step, groups) is always common
        raise CheckpointError(f"--load {root}: iteration {iteration} was saved with --no-save-optim; pass "
                              "--no-load-optim (or --finetune) to load the model only")
    if load_optim and bfpp.get("format", FORMAT_VERSION) != FORMAT_VERSION:
        raise CheckpointError(f"--load {root}: iteration {iteration} holds optimizer state in megatron_bfpp's "
                              f"checkpoint format {bfpp.get('format')} (this version reads {FORMAT_VERSION}); "
                              "pass --no-load-optim to load the model only")
    # The optimizer state's format as the checkpoint names it (a stock Megatron checkpoint: its own).
    metadata = {**(dist_checkpointing.load_content_metadata(path) or {}),
                "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
    template = build_state_dict(args, model, optimizer if load_optim else None, scheduler, iteration, 0,
                                loading=True, include_rng=load_rng, metadata=metadata)
    try:
        loaded = dist_checkpointing.load(template, path)
    except Exception as e:  # CheckpointingException and torch DCP errors: name the directory
        raise CheckpointError(f"--load {root}: loading iteration {iteration} from {path} failed: {e}") from e
    for i, chunk in enumerate(model):
        chunk.load_state_dict(_module_keys(loaded[_model_key(i, len(model))], chunk))  # strict: every tensor
    if load_optim:
        optimizer.load_state_dict(loaded["optimizer"])
    else:
        optimizer.reload_model_params()
    if scheduler is not None and not finetune and "opt_param_scheduler" in common:
        scheduler.override_opt_param_scheduler = bool(args.override_opt_param_scheduler)
        scheduler.use_checkpoint_opt_param_scheduler = bool(args.use_checkpoint_opt_param_scheduler)
        try:
            scheduler.load_state_dict(common["opt_param_scheduler"])
        except AssertionError as e:
            raise CheckpointError(f"--load {root}: {e}; pass --override-opt-param-scheduler to use this run's "
                                  "values or --use-checkpoint-opt_param-scheduler to keep the checkpoint's") from None
    if load_rng:
        _set_rng_state(loaded["rng_state"][0])
    elif getattr(saved_args, "no_save_rng", False):
        log("RNG state not restored: the checkpoint has none (--no-save-rng)")
    elif not (finetune or args.no_load_rng):
        log(f"RNG state not restored: the checkpoint was written at P={layout.get('pp')} T={layout.get('tp')}")
    if finetune:
        return 0, 0
    consumed = int(bfpp.get("consumed_train_samples", getattr(saved_args, "consumed_train_samples", 0)))
    log(f"loaded checkpoint {path} (iteration {iteration}, {consumed} samples consumed; written at "
        f"{_layout_text(layout)})")
    return iteration, consumed


def _module_keys(state: dict, chunk: torch.nn.Module) -> dict:
    """The loaded model state in the keys `chunk.load_state_dict` takes.

    ShardedDataParallel names its sharded tensors from the wrapper ("module." + the model's keys) but, like
    Megatron's DDP, loads the wrapped model's own keys.
    """
    prefix = "module."
    if hasattr(chunk, "module") and state and all(k.startswith(prefix) for k in state):
        return {k[len(prefix):]: v for k, v in state.items()}
    return state


def _layout_text(layout: dict) -> str:
    if not layout:
        return "an unknown layout"
    return (f"P={layout['pp']} V={layout['vp']} D={layout['dp']} T={layout['tp']}, ZeRO-{layout['zero_stage']}, "
            f"{layout['pipeline_schedule']}")

