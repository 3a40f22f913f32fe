"""Run Megatron-Core's own DistributedDataParallel and optimizers (FP32Optimizer, DistributedOptimizer) on CPU
under gloo (tests only).

Megatron-Core 0.19's DDP, gradient buffers, optimizers and gradient clipping are device-agnostic except for
hard-coded CUDA calls: buffers and scalars allocated with `device="cuda"` / `torch.cuda.current_device()`,
the communication stream (`torch.cuda.Stream`, `torch.cuda.stream`, `current_stream().wait_stream`),
`torch.cuda.synchronize()` / `empty_cache()`, and the distributed optimizer's parameter type check
(`param.type() == 'torch.cuda.FloatTensor'`).

`megatron_ddp_on_cpu()` replaces the name `torch` inside the modules listed in PATCH_POINTS only (not torch
itself) by a proxy that forwards every attribute to torch except: tensor factories given a CUDA device
allocate on the CPU, `torch.cuda.current_device()` is the CPU device, streams are inert (gloo collectives are
waited on their work objects, as Megatron does), and synchronize / empty_cache do nothing. For the type check
it makes `Tensor.type()` (no argument) of a CPU tensor report the CUDA type name, for the duration of the
context. Everything is restored on exit. The DDP and optimizer logic runs unmodified.

Never import this from the package: on GPU, Megatron runs as it is.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from types import ModuleType
from typing import Any, Iterator

import torch

# Module -> CUDA-bound source it must still contain (a Megatron upgrade that moves these is reported).
PATCH_POINTS: dict[str, tuple[str, ...]] = {
    "megatron.core.distributed.distributed_data_parallel": ("torch.cuda.current_device()",),
    "megatron.core.distributed.param_and_grad_buffer": ("torch.cuda.current_device()",),
    "megatron.core.distributed.finalize_model_grads": (),
    "megatron.core.optimizer.optimizer": ("device='cuda'",),
    "megatron.core.optimizer.distrib_optimizer": ("torch.cuda.current_device()",),
    "megatron.core.optimizer.clip_grads": ("device='cuda'",),
    "megatron.core.utils": ('device="cuda"',),  # local_multi_tensor_l2_norm (no apex / TransformerEngine)
}

_CPU = torch.device("cpu")
_FACTORIES = ("zeros", "ones", "empty", "tensor", "full", "zeros_like", "empty_like", "arange")


def _is_cuda(device: Any) -> bool:
    if device is None:
        return False
    if isinstance(device, int):
        return True
    return torch.device(device).type == "cuda"


class _Stream:
    """An inert stream: work is ordered by waiting on the collectives' work objects."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def record_event(self, *args: Any, **kwargs: Any) -> None:
        return None


class _CudaOnCPU:
    Stream = _Stream

    def current_device(self) -> torch.device:
        return _CPU

    def current_stream(self, *args: Any) -> _Stream:
        return _Stream()

    def stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def synchronize(self, *args: Any) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


def _on_cpu(factory):
    def make(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return factory(*args, device=_CPU if _is_cuda(device) else device, **kwargs)

    return make


class _TorchOnCPU(ModuleType):
    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CudaOnCPU()
        for name in _FACTORIES:
            setattr(self, name, _on_cpu(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def check_patch_points() -> None:
    for name, snippets in PATCH_POINTS.items():
        mod = importlib.import_module(name)
        if not isinstance(getattr(mod, "torch", None), (ModuleType, _TorchOnCPU)):
            raise RuntimeError(f"{name} no longer imports torch as `torch`: update tests/support/megatron_ddp_cpu_shim.py")
        source = inspect.getsource(mod)
        missing = [s for s in snippets if s not in source]
        if missing:
            raise RuntimeError(f"{name} no longer contains {missing}: update tests/support/megatron_ddp_cpu_shim.py")


@contextlib.contextmanager
def megatron_ddp_on_cpu() -> Iterator[None]:
    check_patch_points()
    patched: list[tuple[ModuleType, Any]] = []
    original_type = torch.Tensor.type

    def cuda_type_name(self, *args: Any, **kwargs: Any):
        name = original_type(self, *args, **kwargs)
        if not args and not kwargs and self.device.type == "cpu" and name.startswith("torch."):
            return "torch.cuda." + name[len("torch."):]
        return name

    try:
        for name in PATCH_POINTS:
            mod = importlib.import_module(name)
            patched.append((mod, mod.torch))
            mod.torch = _TorchOnCPU()
        torch.Tensor.type = cuda_type_name
        yield
    finally:
        torch.Tensor.type = original_type
        for mod, original in reversed(patched):
            mod.torch = original
