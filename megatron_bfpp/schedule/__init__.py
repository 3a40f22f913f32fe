"""Pipeline schedules as data (pure Python, no torch): IR, builders, lowering passes, validation, formats."""

from .builders import build
from .formats import from_csv, from_json, load, to_csv, to_json, to_json_dict
from .ir import COMPUTE_OPS, DP_OPS, P2P_OPS, SCHEDULE_NAMES, Action, Op, Schedule, ScheduleError
from .lower import accumulation_group, add_data_parallel, add_p2p, lower
from .validate import peak_activations, peak_pending_weight_grads, simulate_nccl, simulate_order, validate


def make_schedule(
    name: str,
    pp: int,
    vp: int,
    microbatches: int,
    group_size: int | None = None,
    zero_stage: int | None = None,
    lowered: bool = True,
    forward_only: bool = False,
    weight_buffers: int = 2,
    grad_buffers: int = 2,
    w_needs_weights: bool = True,
    i_writes_grads: bool = False,
) -> Schedule:
    """Build, lower (p2p, and data-parallel when `zero_stage` is given) and validate a schedule."""
    sched = build(name, pp, vp, microbatches, group_size, forward_only)
    validate(sched)
    if lowered:
        sched = lower(sched, zero_stage, weight_buffers, grad_buffers, w_needs_weights, i_writes_grads)
        validate(sched)
    return sched


__all__ = [
    "Action", "Op", "Schedule", "ScheduleError", "COMPUTE_OPS", "P2P_OPS", "DP_OPS", "SCHEDULE_NAMES",
    "build", "lower", "add_p2p", "add_data_parallel", "accumulation_group", "validate", "simulate_order", "simulate_nccl",
    "peak_activations", "peak_pending_weight_grads", "make_schedule", "to_json", "to_json_dict", "from_json", "to_csv", "from_csv", "load",
]
