"""Sharded data parallelism (ZeRO-1/2/3) on flat per-chunk buffers, driven by the schedule's
GATHER / RELEASE / REDUCE actions, and a sharded mixed-precision Adam with Megatron's optimizer surface."""

from .buffers import FlatGradBuffer, FlatLayout, FlatParamBuffer, ParamSlot, ShardPiece
from .comm import RankStats
from .ddp import ShardedDataParallel
from .driver import ShardedDriver, memory_stats
from .finalize import finalize_model_grads
from .optimizer import ShardedOptimizer, default_param_groups

__all__ = [
    "FlatLayout", "FlatParamBuffer", "FlatGradBuffer", "ParamSlot", "ShardPiece", "RankStats",
    "ShardedDataParallel", "ShardedDriver", "ShardedOptimizer", "default_param_groups", "finalize_model_grads",
    "memory_stats",
]
