"""Run Megatron-Core's stock pipeline schedules on CPU under gloo (tests and benchmarks only).

`forward_backward_pipelining_with_interleaving` and `forward_backward_pipelining_without_interleaving`
(megatron-core 0.19) are device-agnostic except for three hard-coded CUDA calls:

- `megatron.core.pipeline_parallel.schedules`: the per-step token counter
  `torch.zeros([], dtype=torch.int, device="cuda")`;
- `megatron.core.pipeline_parallel.p2p_communication` (P2PCommunicator): receive buffers and shape tensors
  allocated on `torch.cuda.current_device()`, and `torch.cuda.synchronize()` after batched p2p.

`stock_schedules_on_cpu()` replaces the name `torch` inside those two modules only (not torch itself, not any
other module) by a thin proxy that forwards every attribute to torch except exactly these points:
`zeros(device="cuda")` allocates on the CPU, `cuda.current_device()` is the CPU device, and
`cuda.synchronize()` does nothing (gloo's p2p is synchronous with respect to the host once waited on).
Everything is restored on exit, also when the body raises. The schedule logic itself runs unmodified.

Never import this from the package: on GPU, Megatron runs as it is.
"""

from __future__ import annotations

import contextlib
import inspect
from types import ModuleType
from typing import Any, Iterator

import torch

# The module-level `torch` names the shim replaces, and the CUDA-bound source each one must still contain (so
# a Megatron upgrade that moves them is reported instead of silently leaving a CUDA call behind).
PATCH_POINTS: dict[str, tuple[str, ...]] = {
    "megatron.core.pipeline_parallel.schedules": ('device="cuda"',),
    "megatron.core.pipeline_parallel.p2p_communication": ("torch.cuda.current_device()",
                                                         "torch.cuda.synchronize()"),
}

_CPU = torch.device("cpu")


def _is_cuda(device: Any) -> bool:
    if device is None:
        return False
    if isinstance(device, int):  # a bare ordinal means a CUDA device to torch
        return True
    return torch.device(device).type == "cuda"


class _CudaOnCPU:
    """`torch.cuda` as seen by P2PCommunicator: the current device is the CPU and synchronize is a no-op."""

    def current_device(self) -> torch.device:
        return _CPU

    def synchronize(self, device: Any = None) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _TorchOnCPU(ModuleType):
    """The `torch` module as seen by the patched modules: every attribute is torch's own, except `cuda`
    (see _CudaOnCPU) and `zeros`, whose device="cuda" becomes the CPU."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CudaOnCPU()

    @staticmethod
    def zeros(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*args, device=_CPU if _is_cuda(device) else device, **kwargs)

    def __getattr__(self, name: str) -> Any:  # only reached for names not set above
        return getattr(torch, name)


def _module(name: str) -> ModuleType:
    import importlib

    return importlib.import_module(name)


def check_patch_points() -> None:
    """Raise if a patched module no longer holds `torch` or the CUDA-bound code the shim exists for."""
    for name, snippets in PATCH_POINTS.items():
        mod = _module(name)
        if getattr(mod, "torch", None) is not torch and not isinstance(getattr(mod, "torch", None), _TorchOnCPU):
            raise RuntimeError(f"{name} no longer imports torch as `torch`: update tests/support/megatron_cpu_shim.py")
        source = inspect.getsource(mod)
        missing = [s for s in snippets if s not in source]
        if missing:
            raise RuntimeError(f"{name} no longer contains {missing}: the installed megatron-core changed its "
                               "CUDA-bound code; update tests/support/megatron_cpu_shim.py.PATCH_POINTS")


@contextlib.contextmanager
def stock_schedules_on_cpu() -> Iterator[None]:
    """Within the context, Megatron-Core's stock pipeline schedules and P2PCommunicator run on CPU tensors.

    Model chunks and micro-batches must be on the CPU and torch.distributed initialised with gloo. The
    p2p configuration is the caller's (config.batch_p2p_comm / overlap_p2p_comm); the shim changes no
    behaviour of the schedule, only where three tensors are allocated and one synchronize.
    """
    check_patch_points()
    patched: list[tuple[ModuleType, Any]] = []
    try:
        for name in PATCH_POINTS:
            mod = _module(name)
            patched.append((mod, mod.torch))
            mod.torch = _TorchOnCPU()
        yield
    finally:
        for mod, original in reversed(patched):
            mod.torch = original


def is_active() -> bool:
    """True while stock_schedules_on_cpu() is in effect (for tests of the shim itself)."""
    return any(isinstance(_module(name).torch, _TorchOnCPU) for name in PATCH_POINTS)
