"""TransformerEngine quantized parameters (--fp8-param-gather, --fp4-param-gather) with --zero-stage are refused.

With either flag Megatron builds the layers' weights as TransformerEngine quantized tensors (Float8Tensor,
MXFP8Tensor, NVFP4Tensor: subclasses of its QuantizedTensor). The sharded wrapper's flat buffer makes every
parameter a view of one buffer (`view.copy_(p.data); p.data = view`); a quantized tensor re-quantizes into its
own storage instead of aliasing that view, so the optimizer's updates would never reach the weights the forward
reads, while losses and gradients look normal. The argument check refuses both flags with --zero-stage before
Megatron's own checks run (which would ask for --use-distributed-optimizer, which --zero-stage refuses), and
the flat buffer refuses any quantized parameter, for code that builds the wrapper itself.
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch

# Imported here, not in the tests: the unit tier counts the CPU time of a test's call, not its module's import.
from megatron.core.distributed import DistributedDataParallelConfig

import megatron_bfpp.megatron as bm
from megatron_bfpp.megatron import arg_hooks, check
from megatron_bfpp.megatron.check import parse_megatron_args
from megatron_bfpp.sharded import ShardedDataParallel, comm
from megatron_bfpp.sharded.buffers import FlatParamBuffer
from megatron_bfpp.sharded.quantized import (
    QuantizedParameterError, quantized_class, weight_copy_bytes, weight_copy_caches,
)
from tests.support.megatron_lm import CHECK

FP8_GATHER = ["--fp8-format", "hybrid", "--fp8-param-gather"]
FP4_GATHER = ["--fp4-format", "e2m1", "--fp4-param-gather"]


@pytest.mark.parametrize("zero", ["1", "2", "3"])
@pytest.mark.parametrize("flags, flag", [(FP8_GATHER, "--fp8-param-gather"), (FP4_GATHER, "--fp4-param-gather")],
                         ids=["fp8", "fp4"])
def test_quantized_param_gather_with_zero_stage_is_refused_before_megatron(zero: str, flags: list[str],
                                                                            flag: str) -> None:
    """One error, before Megatron's own (it would ask for --use-distributed-optimizer, or for TransformerEngine),
    naming the flag, --zero-stage and both ways out."""
    with pytest.raises(bm.ConfigError) as e:
        parse_megatron_args(CHECK + ["--zero-stage", zero, *flags], 2)
    msg = str(e.value)
    assert msg.startswith(f"{flag} with --zero-stage {zero}:"), msg
    assert f"drop {flag}" in msg and "--use-distributed-optimizer" in msg and "drop --zero-stage" in msg, msg


def test_fp8_param_gather_without_zero_stage_is_megatrons_business() -> None:
    """Without --zero-stage, Megatron's distributed optimizer gathers the FP8 parameters under the plugin's
    schedule: the plugin refuses nothing."""
    bm.validate_args(parse_megatron_args(CHECK + [*FP8_GATHER, "--use-distributed-optimizer"], 2))


def test_fp8_compute_with_zero_stage_is_accepted() -> None:
    """--fp8-format alone keeps high-precision parameters (TransformerEngine quantizes them per step)."""
    cfg = bm.validate_args(parse_megatron_args(CHECK + ["--zero-stage", "3", "--fp8-format", "hybrid"], 2))
    assert cfg.zero_stage == 3


def test_hooked_parse_args_refuses_fp4_param_gather_with_zero_stage(capsys: pytest.CaptureFixture) -> None:
    def parse(extra_args_provider=None, ignore_unknown_args=False):
        return argparse.Namespace(zero_stage=3, fp4_param_gather=True, fp4="e2m1")

    with pytest.raises(SystemExit):
        arg_hooks._wrap_parse_args(parse)()
    assert "megatron_bfpp: error: --fp4-param-gather with --zero-stage 3" in capsys.readouterr().err


def test_check_command_refuses_fp8_param_gather_with_zero_stage(capsys: pytest.CaptureFixture) -> None:
    assert check.main(["--world-size", "2", "--", *CHECK, "--zero-stage", "1", *FP8_GATHER]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megatron_bfpp: error: --fp8-param-gather with --zero-stage 1") and "Megatron" not in \
        err.split(":")[1], err


# ------------------------------------------------------------------------ the flat buffer's own refusal


class QuantizedTensor(torch.Tensor):
    """Named as TransformerEngine's base class of its quantized tensors (transformer_engine/pytorch/tensor/
    quantized_tensor.py), which is not installed here."""


class NVFP4Tensor(QuantizedTensor):
    pass


class Float8Tensor(torch.Tensor):  # by its own name alone
    pass


def _quantized_param(cls: type) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.ones(4, 4).as_subclass(cls))


@pytest.mark.parametrize("cls", [NVFP4Tensor, Float8Tensor])
def test_flat_buffer_refuses_a_quantized_parameter(cls: type) -> None:
    plain, quantized = torch.nn.Parameter(torch.ones(4)), _quantized_param(cls)
    assert quantized_class(quantized) == cls.__name__ and quantized_class(plain) is None
    with pytest.raises(QuantizedParameterError) as e:
        FlatParamBuffer([plain, quantized], ["bias", "linear.weight"], dp_size=1, dp_rank=0, sharded_at_rest=False)
    msg = str(e.value)
    assert f"'linear.weight' is a TransformerEngine {cls.__name__}" in msg, msg
    assert "--fp8-param-gather" in msg and "--fp4-param-gather" in msg and "drop --zero-stage" in msg, msg
    assert torch.equal(quantized.data, torch.ones(4, 4)), "the refused parameter was remapped"


def test_sharded_wrapper_names_the_quantized_parameter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(comm, "group_size", lambda group: 1)  # D = 1 without a process group
    monkeypatch.setattr(comm, "group_rank", lambda group: 0)
    module = torch.nn.Module()
    module.norm = torch.nn.Parameter(torch.ones(4))
    module.weight = _quantized_param(NVFP4Tensor)
    with pytest.raises(QuantizedParameterError, match="'weight' is a TransformerEngine NVFP4Tensor"):
        ShardedDataParallel(SimpleNamespace(calculate_per_token_loss=False), DistributedDataParallelConfig(), module,
                            pg_collection=SimpleNamespace(dp_cp="dp"), zero_stage=3, shard_align=1, param_align=1)


class Float8TensorStorage:
    """Named as TransformerEngine's storage of an FP8 tensor: its data and transpose (1 byte an element each) and
    its scale, as its get_metadata() lists them."""

    def __init__(self, rows: int, cols: int) -> None:
        self._data = torch.zeros(rows, cols, dtype=torch.uint8)
        self._transpose = torch.zeros(cols, rows, dtype=torch.uint8)
        self._scale_inv = torch.ones(1)

    def get_metadata(self) -> dict:
        return {"data": self._data, "fp8_scale_inv": self._scale_inv, "fp8_dtype": "E4M3",
                "data_transpose": self._transpose, "quantizer": None}


def test_quantized_weight_copies_count_data_transpose_and_scales() -> None:
    """About 2 bytes per weight under FP8 on Hopper (the copy and its transpose), counted from the caches TE's
    layers keep (`_fp8_workspaces`); plain tensors count by size."""
    layer = torch.nn.Linear(4, 8)
    layer._fp8_workspaces = {"weight": Float8TensorStorage(8, 4)}
    other = torch.nn.Linear(4, 4)
    other._fp8_workspaces = {"weight": torch.zeros(4, 4, dtype=torch.bfloat16)}
    caches = weight_copy_caches(torch.nn.Sequential(layer, torch.nn.ReLU(), other))
    assert len(caches) == 2
    assert weight_copy_bytes(caches) == (8 * 4 * 2 + 4) + 4 * 4 * 2
