"""Pipeline schedules as data (pure Python, no torch): IR, kinds and builders, lowering passes, validation,
formats, and `ScheduleSpec`, the one value that names a schedule."""

from typing import Any

from .formats import from_csv, from_json, load, to_csv, to_json, to_json_dict
from .ir import COMPUTE_OPS, DP_OPS, P2P_OPS, Action, Op, Schedule, ScheduleError
from .kinds import GROUPED_SCHEDULES, KINDS, SCHEDULE_NAMES, SPLIT_BACKWARD_SCHEDULES, ScheduleKind, build
from .lower import accumulation_group, add_data_parallel, add_p2p, lower
from .pairs import back_to_back_pairs
from .spec import ScheduleSpec
from .validate import peak_activations, peak_pending_weight_grads, simulate_nccl, simulate_order, validate


def make_schedule(name: str, pp: int, vp: int, microbatches: int, group_size: int | None = None,
                  lowered: bool = True, **settings: Any) -> Schedule:
    """`ScheduleSpec(name, pp, vp, microbatches, group_size, **settings).build(lowered)`: the validated order
    and, with `lowered`, its validated lowering (p2p, and data-parallel when `zero_stage` is given). `settings`
    are the spec's other fields (zero_stage, forward_only, weight_buffers, ...)."""
    return ScheduleSpec(name, pp, vp, microbatches, group_size, **settings).build(lowered)


__all__ = [
    "Action", "Op", "Schedule", "ScheduleError", "COMPUTE_OPS", "P2P_OPS", "DP_OPS", "SCHEDULE_NAMES",
    "SPLIT_BACKWARD_SCHEDULES", "GROUPED_SCHEDULES", "KINDS", "ScheduleKind", "ScheduleSpec",
    "build", "back_to_back_pairs", "lower", "add_p2p", "add_data_parallel", "accumulation_group", "validate", "simulate_order", "simulate_nccl",
    "peak_activations", "peak_pending_weight_grads", "make_schedule", "to_json", "to_json_dict", "from_json", "to_csv", "from_csv", "load",
]
