"""Executes lowered schedules on Megatron-Core model chunks (gloo on CPU, NCCL on GPU)."""

from .executor import PipelineError, ScheduleExecutor
from .forward_backward import (
    get_forward_backward_func, last_run_stats, last_schedule, reset_runtime_groups, set_recorder, set_wait_timeout,
)
from .hooks import DataParallelDriverProtocol, MegatronConfigDriver, NullDriver
from .p2p import ChannelGroups, channel_groups
from .recorder import ActionRecorder
from .state import RuntimeState, runtime_state

__all__ = ["get_forward_backward_func", "set_recorder", "set_wait_timeout", "last_schedule", "last_run_stats",
           "reset_runtime_groups", "RuntimeState", "runtime_state", "ChannelGroups", "channel_groups", "PipelineError",
           "ScheduleExecutor", "DataParallelDriverProtocol", "MegatronConfigDriver", "NullDriver", "ActionRecorder"]
