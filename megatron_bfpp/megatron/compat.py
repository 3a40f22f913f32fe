"""Which megatron-core versions the plugin knows, and the names in Megatron-LM's training loop it rebinds.

Rebinding points (checked at install time; a missing one is a loud error, never a silent no-op):
- `megatron.training.training.get_forward_backward_func`: the only name train() and evaluate() reach the
  pipeline schedule through (0.16: called without arguments; 0.19: with `schedule_pg_collection=`).
- --zero-stage 1/2/3 (the plugin's own data-parallel wrapper and sharded optimizer):
  `megatron.training.training.DDP` (get_model's wrapper class and train()'s isinstance checks),
  `megatron.training.models.dist_utils.DistributedDataParallel` (0.19's model-builder path; optional),
  `megatron.training.training.get_megatron_optimizer`, `megatron.training.training.finalize_model_grads`.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

# (major, minor) -> how it is supported. Other versions install only if every rebinding point is present.
SUPPORTED_VERSIONS: dict[tuple[int, int], str] = {
    (0, 19): "tested: megatron-core 0.19.x wheel and Megatron-LM core_v0.19.0",
    (0, 16): "Megatron-LM core_v0.16.1 patch series; same rebinding points, checked against its source",
}

TRAINING = "megatron.training.training"
DIST_UTILS = "megatron.training.models.dist_utils"

# The parameters Megatron-LM's get_forward_backward_func takes (0.16: the first two; 0.19: all three).
FORWARD_BACKWARD_GETTER_PARAMS = ("pp_size", "vp_size", "schedule_pg_collection")


class UnsupportedMegatronError(RuntimeError):
    """The installed megatron-core lacks a name the plugin must rebind."""


@dataclass(frozen=True)
class RebindPoint:
    module: str
    attr: str
    required: bool = True

    @property
    def name(self) -> str:
        return f"{self.module}.{self.attr}"


SCHEDULE_POINTS = (RebindPoint(TRAINING, "get_forward_backward_func"),)
SHARDED_POINTS = (
    RebindPoint(TRAINING, "DDP"),
    RebindPoint(DIST_UTILS, "DistributedDataParallel", required=False),
    RebindPoint(TRAINING, "get_megatron_optimizer"),
    RebindPoint(TRAINING, "finalize_model_grads"),
)
# ZeRO-3 keeps parameters sharded at rest; Megatron-LM's checkpointing reads and writes them directly.
CHECKPOINT_POINTS = (
    RebindPoint(TRAINING, "save_checkpoint"),
    RebindPoint(TRAINING, "load_checkpoint"),
)


def megatron_core_version() -> str:
    """The imported megatron-core's version string ('unknown' if it does not say)."""
    try:
        from megatron.core.package_info import __version__
    except ImportError:
        return "unknown"
    return str(__version__)


def version_tuple(version: str) -> tuple[int, int] | None:
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def is_supported(version: str | None = None) -> bool:
    return version_tuple(version or megatron_core_version()) in SUPPORTED_VERSIONS


def _import(module: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def resolve(points: tuple[RebindPoint, ...]) -> list[tuple[object, RebindPoint]]:
    """(module object, point) for every point present; raise UnsupportedMegatronError on a missing required one."""
    found, missing = [], []
    for point in points:
        mod = _import(point.module)
        if mod is not None and hasattr(mod, point.attr):
            found.append((mod, point))
        elif point.required:
            missing.append(point.name)
    if missing:
        version = megatron_core_version()
        known = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED_VERSIONS)
        raise UnsupportedMegatronError(
            f"megatron-core {version} lacks {', '.join(missing)}, which megatron_bfpp must rebind to take over "
            f"Megatron-LM's training loop; supported versions: {known}. Install one of them (pip install "
            f"'megatron-core>=0.19.2,<0.20') or run a Megatron-LM checkout of a supported tag"
        )
    return found


def check_forward_backward_getter(getter) -> None:
    """Megatron's get_forward_backward_func must take no parameter the replacement does not accept."""
    try:
        params = inspect.signature(getter).parameters
    except (TypeError, ValueError):
        return
    extra = [p for p in params if p not in FORWARD_BACKWARD_GETTER_PARAMS]
    if extra:
        raise UnsupportedMegatronError(
            f"megatron-core {megatron_core_version()}'s get_forward_backward_func takes {', '.join(extra)}, which "
            f"megatron_bfpp's replacement does not accept (it takes {', '.join(FORWARD_BACKWARD_GETTER_PARAMS)}); "
            f"use a supported megatron-core ({', '.join(f'{a}.{b}.x' for a, b in SUPPORTED_VERSIONS)})"
        )
