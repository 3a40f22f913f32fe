"""A drop-in for Megatron-Core's `get_forward_backward_func()` result, running our schedules.

`get_forward_backward_func("breadth-first")` (or a `ScheduleSpec`) returns a function with the keyword signature
Megatron-LM's `train_step` / `evaluate` use. Each call completes the spec for the call (P, V, its number of
micro-batches, forward-only, the ZeRO stage and the split-backward settings of its model chunks), builds
(cached) and validates that lowered schedule, checks with the other pipeline and data-parallel ranks that they
run the same one (the spec's fingerprint), and executes it. What it keeps between calls lives on
`state.runtime_state`; the functions below are its public face.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..schedule import SCHEDULE_NAMES, Schedule, ScheduleSpec
from ..schedule.pairs import PAIRED_NOT_RUN
from ..sharded.comm import modules_device
from ..sharded.ddp import ShardedDataParallel
from ..sharded.driver import ShardedDriver
from .executor import ScheduleExecutor
from .hooks import DataParallelDriverProtocol, MegatronConfigDriver
from .recorder import ActionRecorder
from .split_backward import splits_by_deferral, writes_main_grad_at_input_grad
from .state import runtime_state


def set_recorder(recorder: ActionRecorder | None) -> None:
    """Record executed actions of the following calls into `recorder` (None: stop recording)."""
    runtime_state.recorder = recorder


def set_wait_timeout(seconds: float | None) -> None:
    """Bound every p2p wait (default: the process group's timeout, Megatron's --distributed-timeout-minutes)."""
    runtime_state.wait_timeout_s = seconds


def reset_runtime_groups() -> None:
    """Forget cached channel groups, transfer objects and agreed schedules (call when the process groups are
    destroyed)."""
    runtime_state.reset()


def last_schedule() -> Schedule | None:
    """The lowered schedule of the most recent call (for reports and tests)."""
    return runtime_state.last_schedule


def last_run_stats() -> dict:
    """Of the most recent call: `pp_send_bytes` and `peak_activation_bytes` (saved for backward)."""
    return dict(runtime_state.last_run)


# A memo of a pure function of the (frozen) spec, not state: nothing ever needs it forgotten.
@functools.lru_cache(maxsize=64)
def _cached_schedule(spec: ScheduleSpec) -> Schedule:
    if spec.pairing is not None:  # the order of merged actions is the simulator's; the runtime runs one at a time
        raise ValueError(PAIRED_NOT_RUN)
    return spec.build(lowered=True)


def _pp_group(pg_collection: Any) -> dist.ProcessGroup | None:
    if pg_collection is not None and getattr(pg_collection, "pp", None) is not None:
        return pg_collection.pp
    from megatron.core import parallel_state

    if dist.is_initialized() and parallel_state.model_parallel_is_initialized():
        return parallel_state.get_pipeline_model_parallel_group()
    return None


def _dp_group(pg_collection: Any) -> dist.ProcessGroup | None:
    for attr in ("dp_cp", "dp"):
        if pg_collection is not None and getattr(pg_collection, attr, None) is not None:
            return getattr(pg_collection, attr)
    from megatron.core import parallel_state

    if dist.is_initialized() and parallel_state.model_parallel_is_initialized():
        return parallel_state.get_data_parallel_group(with_context_parallel=True)
    return None


def _make_driver(model: Sequence[torch.nn.Module], config: Any) -> tuple[DataParallelDriverProtocol, int, bool]:
    """Our sharded wrapper brings its own driver, whose optimizer carries out the schedule's STEPs; anything else
    is driven through Megatron's config hooks, and stepped by Megatron's optimizer. Returns (driver, ZeRO stage
    to lower for, whether the schedule places the optimizer step)."""
    if isinstance(model[0], ShardedDataParallel):
        driver = ShardedDriver(list(model))
        return driver, driver.zero_stage, True
    return MegatronConfigDriver(model, config), 1, False


def get_forward_backward_func(
    schedule: ScheduleSpec | str = "breadth-first",
    microbatch_group_size: int | None = None,
    weight_buffers: int = 2,
    grad_buffers: int = 2,
) -> Callable:
    """Return a forward_backward function with Megatron-Core's signature that runs `schedule`: a spec, of which
    the kind, the group size (None: the kind's default) and the buffer counts are used (each call sets the rest),
    or a kind's name with those given here."""
    if isinstance(schedule, str):
        # P, V and M are placeholders: every call sets them.
        spec = ScheduleSpec(schedule, 1, 1, 1, microbatch_group_size, weight_buffers=weight_buffers,
                            grad_buffers=grad_buffers)
    elif (microbatch_group_size, weight_buffers, grad_buffers) != (None, 2, 2):
        raise ValueError("get_forward_backward_func: with a ScheduleSpec, give the group size and buffer counts "
                         "in the spec")
    else:
        spec = schedule
    pipeline_schedule = spec.kind
    if pipeline_schedule not in SCHEDULE_NAMES:
        raise ValueError(f"unknown --pipeline-schedule {pipeline_schedule!r}: choose one of {', '.join(SCHEDULE_NAMES)}")
    kind = spec.schedule_kind

    def forward_backward(
        *,
        forward_step_func: Callable,
        data_iterator: Any,
        model: torch.nn.Module | list[torch.nn.Module],
        num_microbatches: int,
        seq_length: int,
        micro_batch_size: int,
        decoder_seq_length: int | None = None,
        forward_only: bool = False,
        collect_non_loss_data: bool = False,
        first_val_step: bool | None = None,
        adjust_tensor_shapes_fn: Callable | None = None,
        force_all_reduce: bool | None = False,
        p2p_communicator: Any = None,
        pg_collection: Any = None,
    ) -> list:
        from megatron.core.utils import get_model_config

        if adjust_tensor_shapes_fn is not None:
            raise ValueError("adjust_tensor_shapes_fn is not supported by megatron_bfpp schedules (as in Megatron's "
                             "interleaved schedule)")
        chunks = model if isinstance(model, list) else [model]
        config = get_model_config(chunks[0])
        if getattr(config, "num_microbatches_with_partial_activation_checkpoints", None) is not None:
            raise ValueError(
                f"--num-microbatches-with-partial-activation-checkpoints is not supported with --pipeline-schedule "
                f"{pipeline_schedule}: remove it (recompute every micro-batch with --recompute-granularity, or none)")
        pp_group = _pp_group(pg_collection)
        pp = dist.get_world_size(pp_group) if pp_group is not None else 1
        pp_rank = dist.get_rank(pp_group) if pp_group is not None else 0
        vp = len(chunks)
        group = spec.group_size
        if group is None and kind.megatron_order and kind.takes_group_size:
            # Megatron's config carries the group size of its own order, defaulting to its P; a value below
            # the kind's default is that default, not a choice.
            default = kind.group_size_for(pp, num_microbatches, None)
            configured = getattr(config, "microbatch_group_size_per_vp_stage", None)
            group = configured if configured and configured >= default else default
        if group is not None:
            group = min(group, num_microbatches)  # evaluation and batch-size ramp-up run fewer micro-batches
        if not kind.takes_group_size:
            group = None
        driver, zero, steps_in_schedule = _make_driver(chunks, config)
        if forward_only:
            zero_for_schedule = 3 if zero == 3 else None  # ZeRO-3 still gathers; nothing to reduce
        else:
            zero_for_schedule = zero
        call = dataclasses.replace(
            spec, pp=pp, vp=vp, microbatches=num_microbatches, group_size=group, zero_stage=zero_for_schedule,
            forward_only=bool(forward_only), optimizer_step=spec.optimizer_step and steps_in_schedule,
            # A W that only runs deferred weight GEMMs reads kept activations, not weights (ZeRO-3 may release
            # them after the stage's last I); on chunks split on the autograd graph it may read them.
            w_needs_weights=not (kind.split_backward and all(splits_by_deferral(c) for c in chunks)),
            # Layers that run a fused backward whole at I write main_grad there: ZeRO-2/3 hold the buffer from
            # the I.
            i_writes_grads=kind.split_backward and any(writes_main_grad_at_input_grad(c, config) for c in chunks),
        ).resolved()  # the kind's default group size written in, as the schedule carries it
        schedule = _cached_schedule(call)
        runtime_state.last_schedule = schedule
        if hasattr(driver, "set_buffer_limits"):  # the sharded driver keeps the schedule's buffer bounds
            driver.set_buffer_limits(schedule.weight_buffers, schedule.grad_buffers)

        device = modules_device(chunks, pp_group)
        cp = 1
        tp = 1
        if pg_collection is not None and getattr(pg_collection, "cp", None) is not None:
            cp = dist.get_world_size(pg_collection.cp)
        if pg_collection is not None and getattr(pg_collection, "tp", None) is not None:
            tp = dist.get_world_size(pg_collection.tp)
        elif dist.is_initialized():
            from megatron.core import parallel_state

            if parallel_state.model_parallel_is_initialized():
                tp = parallel_state.get_tensor_model_parallel_world_size()
                cp = parallel_state.get_context_parallel_world_size()
        seq = seq_length // cp
        if getattr(config, "sequence_parallel", False):
            seq //= tp
        tensor_shape = (seq, micro_batch_size, config.hidden_size)

        if dist.is_initialized():
            runtime_state.handshake(call, {"pipeline": pp_group, "data": _dp_group(pg_collection)},
                                    device if device.type == "cuda" else torch.device("cpu"))
        p2p = runtime_state.p2p(pp_group, device)
        recorder = runtime_state.recorder
        if config.timers is not None:
            config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)
        executor = ScheduleExecutor(
            schedule=schedule, pp_rank=pp_rank, model=chunks, forward_step_func=forward_step_func,
            data_iterator=data_iterator, config=config, tensor_shape=tensor_shape, p2p=p2p, driver=driver,
            collect_non_loss_data=collect_non_loss_data, first_val_step=first_val_step, recorder=recorder,
            wait_timeout_s=runtime_state.wait_timeout_s, global_rank=dist.get_rank() if dist.is_initialized() else 0,
            cp_group_size=cp,
        )
        sent_before = p2p.sent_bytes
        store = executor.run()
        runtime_state.last_run = {"pp_send_bytes": p2p.sent_bytes - sent_before,
                              "peak_activation_bytes": executor.peak_activation_bytes}
        if config.finalize_model_grads_func is not None and not forward_only:
            config.finalize_model_grads_func(
                chunks,
                executor.total_num_tokens if config.calculate_per_token_loss else None,
                pg_collection=pg_collection,
                force_all_reduce=force_all_reduce,
            )
        if recorder is not None:
            recorder.flush()
        if config.timers is not None:
            config.timers("forward-backward").stop()
        return store

    forward_backward.pipeline_schedule = pipeline_schedule  # type: ignore[attr-defined]
    return forward_backward

