"""TransformerEngine's quantized tensors, recognised and counted without importing TransformerEngine.

TransformerEngine (2.x) represents FP8 / MXFP8 / NVFP4 data as subclasses of its `QuantizedTensor`
(transformer_engine/pytorch/tensor/quantized_tensor.py: Float8Tensor, MXFP8Tensor, Float8BlockwiseQTensor,
NVFP4Tensor) over storage classes (`QuantizedTensorStorage`, named `QuantizedTensorBase` up to 2.9). They are
recognised here by the names of their classes, and by TransformerEngine's own base class when some other code
already imported it: the plugin never imports TransformerEngine itself (it is optional, and importing it
initialises CUDA). The quantized weight copies its layers cache between micro-batches are found and counted
here too (the sharded wrapper reports them, and drops them under ZeRO-3: see ddp.ShardedDataParallel).
"""

from __future__ import annotations

import sys

import torch

# Class names of TransformerEngine's quantized tensors and their storage bases, 2.8 ... 2.14.
_QUANTIZED_CLASS_NAMES = frozenset({
    "QuantizedTensor", "QuantizedTensorStorage", "QuantizedTensorBase",
    "Float8Tensor", "Float8TensorStorage", "Float8TensorBase",
    "MXFP8Tensor", "MXFP8TensorStorage", "MXFP8TensorBase",
    "Float8BlockwiseQTensor", "Float8BlockwiseQTensorStorage", "Float8BlockwiseQTensorBase",
    "NVFP4Tensor", "NVFP4TensorStorage", "NVFP4TensorBase",
})


class QuantizedParameterError(TypeError):
    """A TransformerEngine quantized parameter where the sharded wrapper needs a plain tensor."""


def _te_quantized_base() -> type | None:
    """TransformerEngine's QuantizedTensor when TransformerEngine is already imported, else None."""
    module = sys.modules.get("transformer_engine.pytorch.tensor.quantized_tensor")
    return getattr(module, "QuantizedTensor", None) if module is not None else None


def quantized_class(t: object) -> str | None:
    """The class name of `t` when it is a TransformerEngine quantized tensor (a parameter or its data), else None."""
    base = _te_quantized_base()
    if base is not None and isinstance(t, base):
        return type(t).__name__
    if any(cls.__name__ in _QUANTIZED_CLASS_NAMES for cls in type(t).__mro__):
        return type(t).__name__
    return None


def check_plain_parameter(param: torch.Tensor, name: str) -> None:
    """Refuse a TransformerEngine quantized parameter (QuantizedParameterError naming it and the fix): the flat
    buffer remaps each parameter with `param.data = view`, which a quantized tensor does not follow (it
    re-quantizes into storage of its own), so the optimizer's updates would never reach the weights."""
    kind = quantized_class(param) or quantized_class(param.data)
    if kind is None:
        return
    raise QuantizedParameterError(
        f"parameter {name!r} is a TransformerEngine {kind} (a quantized parameter: Megatron builds them for "
        "--fp8-param-gather / --fp4-param-gather). The sharded wrapper's flat buffer makes every parameter a view "
        "of one buffer, which a quantized tensor does not follow (it re-quantizes into its own storage): the "
        "optimizer's updates would never reach the weights the forward reads. Drop --fp8-param-gather / "
        "--fp4-param-gather (--fp8-format / --fp4-format still compute in low precision from high-precision "
        "weights), or drop --zero-stage and use --use-distributed-optimizer"
    )


def quantized_nbytes(t: torch.Tensor) -> int:
    """Bytes held by a TransformerEngine quantized tensor (its data, transpose or column-wise data, and scales, as
    its `get_metadata()` lists them), or by a plain tensor."""
    get_metadata = getattr(t, "get_metadata", None)
    if quantized_class(t) is None or not callable(get_metadata):
        return t.numel() * t.element_size()
    parts = [v for v in get_metadata().values() if isinstance(v, torch.Tensor)]
    return sum(p.numel() * p.element_size() for p in parts)


def weight_copy_caches(module: torch.nn.Module) -> list[dict]:
    """The caches in which TransformerEngine's layers keep the quantized copies of their weights between
    micro-batches (`TransformerEngineBaseModule._fp8_workspaces`, module/base.py: filled by get_weight_workspace
    at a step's first micro-batch under FP8, read by the later ones)."""
    caches = (getattr(m, "_fp8_workspaces", None) for m in module.modules())
    return [c for c in caches if isinstance(c, dict)]


def weight_copy_bytes(caches: list[dict]) -> int:
    """Bytes of the quantized weight copies held in `caches` now."""
    return sum(quantized_nbytes(t) for c in caches for t in c.values()
               if isinstance(t, torch.Tensor) or callable(getattr(t, "get_metadata", None)))
