"""Process groups: torch.distributed from torchrun's environment, then Megatron's parallel_state on top.

Megatron's getters (pipeline / data / embedding / tensor groups and ranks) work on CPU (gloo) as on GPU
(NCCL) once `init_parallel` has run. Ranks are laid out as Megatron lays them out (order "tp-cp-ep-dp-pp"):
with T = 1, global rank = pp_rank * D + dp_rank.

Besides Megatron's groups, `init_parallel` creates two extra groups over every pipeline's ranks, one for
activations and one for gradients, so the two p2p channels never share a communicator (on NCCL each group
has its own stream). They are created eagerly, collectively and in the same order on all ranks, in the
runtime's `channel_groups`, which owns them.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from ..runtime import channel_groups, reset_runtime_groups

_ENV_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class _Ownership:
    """What this module created, and so `destroy_parallel` tears down: Megatron's groups always; the default
    group only when `init_parallel` or `init_single_process` started it."""

    default_group: bool = False


_OWNED = _Ownership()


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _timeout(minutes: float, seconds: float | None) -> timedelta:
    return timedelta(seconds=seconds) if seconds is not None else timedelta(minutes=minutes)


def _init_default_group(timeout: timedelta) -> None:
    missing = [v for v in _ENV_VARS if v not in os.environ]
    if missing:
        raise RuntimeError(
            f"torch.distributed is not initialised and {', '.join(missing)} not set: launch under torchrun "
            "(or `bfpp train --nproc-per-node N`), or call megatron_bfpp.train.parallel.init_single_process() "
            "for a one-process run")
    backend = default_backend()
    if backend == "nccl":
        # The device must be chosen before the first NCCL call, from torchrun's LOCAL_RANK.
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, timeout=timeout)
    _OWNED.default_group = True


def init_parallel(
    pipeline_model_parallel_size: int,
    virtual_pipeline_model_parallel_size: int | None = None,
    tensor_model_parallel_size: int = 1,
    distributed_timeout_minutes: float = 30,
    distributed_timeout_seconds: float | None = None,
) -> None:
    """Initialise torch.distributed (if not yet) from torchrun's env vars, then Megatron's model-parallel groups.

    gloo on CPU, NCCL on GPU (device set from LOCAL_RANK). `distributed_timeout_seconds`, when given, overrides
    the minutes (tests use short timeouts so that a bug fails instead of hanging).
    """
    timeout = _timeout(distributed_timeout_minutes, distributed_timeout_seconds)
    if not dist.is_initialized():
        _init_default_group(timeout)
    world = dist.get_world_size()
    pp, tp = int(pipeline_model_parallel_size), int(tensor_model_parallel_size)
    if pp < 1 or tp < 1 or world % (pp * tp):
        raise ValueError(
            f"world size {world} is not a multiple of --pipeline-model-parallel-size ({pp}) x "
            f"--tensor-model-parallel-size ({tp}): launch a multiple of {pp * tp} processes or change them")
    vp = virtual_pipeline_model_parallel_size
    if vp is not None and vp < 1:
        raise ValueError(f"virtual pipeline size must be >= 1, got {vp} (check --num-layers-per-virtual-pipeline-stage)")
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        # Megatron's groups know no virtual stages at P = 1; the model builder handles that case itself.
        virtual_pipeline_model_parallel_size=vp if vp and vp > 1 and pp > 1 else None,
        # Megatron multiplies by timedelta(minutes=...); a float keeps sub-minute test timeouts.
        distributed_timeout_minutes=timeout.total_seconds() / 60,
    )
    # The runtime's activation/gradient channels, created now (collectively, same order on every rank).
    channel_groups.get(ps.get_pipeline_model_parallel_group(), timeout.total_seconds())


def init_single_process(distributed_timeout_seconds: float = 300) -> None:
    """One-process world (in-memory store, gloo, no port) with Megatron's groups at P = T = 1.

    For references and tools that run without torchrun; Megatron's layers need its groups to exist.
    """
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timedelta(seconds=distributed_timeout_seconds))
        _OWNED.default_group = True
    elif dist.get_world_size() != 1:
        raise RuntimeError("init_single_process() called inside a multi-process world; use init_parallel()")
    if not ps.model_parallel_is_initialized():
        init_parallel(1, distributed_timeout_seconds=distributed_timeout_seconds)


def destroy_parallel() -> None:
    """Tear down Megatron's groups, our p2p groups, and the default group if init_parallel created it."""
    reset_runtime_groups()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if _OWNED.default_group and dist.is_initialized():
        dist.destroy_process_group()
    _OWNED.default_group = False


def is_initialized() -> bool:
    return dist.is_initialized() and ps.model_parallel_is_initialized()


def _check() -> None:
    if not is_initialized():
        raise RuntimeError("parallel groups not initialised: call megatron_bfpp.train.parallel.init_parallel() first")


def pp_rank() -> int:
    _check()
    return ps.get_pipeline_model_parallel_rank()


def pp_size() -> int:
    _check()
    return ps.get_pipeline_model_parallel_world_size()


def dp_rank() -> int:
    _check()
    return ps.get_data_parallel_rank()


def dp_size() -> int:
    _check()
    return ps.get_data_parallel_world_size()


def pp_group() -> dist.ProcessGroup:
    _check()
    return ps.get_pipeline_model_parallel_group()


def dp_group() -> dist.ProcessGroup:
    _check()
    return ps.get_data_parallel_group()


def embedding_group() -> dist.ProcessGroup | None:
    """Megatron's group of the first and last pipeline ranks (tied-embedding gradients); None when P = 1 or
    when this rank holds neither end of its pipeline."""
    _check()
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return None
    return ps.get_embedding_group(check_initialized=False)


def pp_p2p_groups() -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(activation_group, gradient_group): two groups over this rank's pipeline, created by init_parallel."""
    _check()
    groups = channel_groups.created(ps.get_pipeline_model_parallel_group())
    if groups is None:
        raise RuntimeError("p2p groups missing: Megatron's groups were initialised without "
                           "megatron_bfpp.train.parallel.init_parallel(); call it instead")
    return groups["activations"], groups["gradients"]


def set_seed(seed: int) -> None:
    """Seed Python, numpy and torch; on GPU also Megatron's CUDA RNG tracker (its dropout regions need it)."""
    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if torch.cuda.is_available() and is_initialized():
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)
