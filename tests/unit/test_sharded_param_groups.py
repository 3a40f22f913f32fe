"""The parameter groups a --zero-stage optimizer saves are those of the optimizer stock Megatron builds for the same
run: Megatron's keys (`wd_mult`, `max_lr`, ...) and every hyper-parameter its torch (or TransformerEngine / Apex)
Adam adds to a group (`betas`, `eps`, `amsgrad`, `foreach`, ...). Stock Megatron loading the checkpoint hands the
saved groups to its own Adam as they are: a group without `betas` fails stock's first step (KeyError: 'betas').

Megatron's side is built in this process with Megatron's own factory (`_get_megatron_optimizer_based_on_param_groups`
on `_get_param_groups`, as `get_megatron_optimizer` calls them) on a tiny GPT, one process (P = T = D = 1). What
Megatron saves of its groups is its inner torch optimizer's (FP32Optimizer and Float16OptimizerWithFloat16Params
save the inner state dict, the distributed optimizer the same groups without `params` and with `step`): the
inner optimizer is taken unwrapped (`skip_megatron_wrapping`), as Float16OptimizerWithFloat16Params refuses CPU
tensors. Both optimizers are driven by an OptimizerParamScheduler, as in training (it sets `lr` and
`weight_decay` of every group).
"""

from __future__ import annotations

import pytest
import torch

# Imported here, not in the tests: the unit tier counts the CPU time of a test's call, not its module's import.
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import (
    OptimizerConfig,
    _get_megatron_optimizer_based_on_param_groups,
    _get_param_groups,
    get_standard_config_overrides,
)
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_bfpp.train import model as mm, parallel
from megatron_bfpp.sharded import ShardedDataParallel, ShardedOptimizer

NOT_HYPER_PARAMETERS = ("params", "step")  # the parameters' indices; Adam's step (Megatron adds it at a save)


@pytest.fixture(scope="module", autouse=True)
def one_process_world():
    parallel.init_single_process()
    yield


def _chunks(bf16: bool) -> list[torch.nn.Module]:
    cfg = mm.make_transformer_config(num_layers=1, hidden_size=16, num_attention_heads=2, hidden_dropout=0.0,
                                     attention_dropout=0.0, params_dtype="bf16" if bf16 else "fp32")
    chunks = mm.build_model_chunks(cfg, vocab_size=32, max_sequence_length=8, pp_rank=0, pp_size=1, vp_size=1,
                                   device="cpu")
    return mm.float16_chunks(chunks) if bf16 else chunks


def _schedule(optimizer) -> None:
    OptimizerParamScheduler(optimizer, init_lr=1e-5, max_lr=3e-4, min_lr=3e-5, lr_warmup_steps=8,
                            lr_decay_steps=64, lr_decay_style="cosine", start_wd=0.05, end_wd=0.05,
                            wd_incr_steps=64, wd_incr_style="constant")


def _hyper_parameters(groups: list[dict]) -> list[dict]:
    return [{k: v for k, v in g.items() if k not in NOT_HYPER_PARAMETERS} for g in groups]


def _megatron_groups(chunks: list[torch.nn.Module], config: OptimizerConfig) -> list[dict]:
    """The parameter groups stock Megatron's Adam would save for `chunks` under `config`."""
    groups = _get_param_groups(chunks, config, get_standard_config_overrides(config))
    inner, _ = _get_megatron_optimizer_based_on_param_groups(config, chunks, groups, skip_megatron_wrapping=True)
    _schedule(inner)
    return _hyper_parameters(inner.state_dict()["param_groups"])


@pytest.mark.parametrize("zero", [1, 2, 3])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
def test_saved_parameter_groups_are_those_of_megatrons_adam(zero: int, dtype: str, decoupled: bool) -> None:
    """Every format the sharded optimizer saves its groups in (dist_checkpointing's, for the distributed optimizer
    and for the plain ones, and its own local state dict) carries exactly the keys and values of the groups of
    the Adam (AdamW with decoupled weight decay) stock Megatron builds for the same model and config."""
    bf16 = dtype == "bf16"
    config = OptimizerConfig(optimizer="adam", lr=3e-4, min_lr=3e-5, weight_decay=0.05, adam_beta1=0.8,
                             adam_beta2=0.95, adam_eps=1e-6, decoupled_weight_decay=decoupled, bf16=bf16,
                             clip_grad=1.0)
    expected = _megatron_groups(_chunks(bf16), config)
    assert len(expected) == 2 and all("betas" in g and "eps" in g for g in expected)  # what this is about

    chunks = [ShardedDataParallel(c.config, DistributedDataParallelConfig(), c, zero_stage=zero) for c in _chunks(bf16)]
    opt = ShardedOptimizer(chunks, config)
    _schedule(opt)
    model_sd = {}
    for i, c in enumerate(chunks):
        model_sd.update(c.sharded_state_dict(prefix=f"chunk{i}."))
    saved = opt.sharded_state_dict(model_sd, metadata={})

    distributed = saved["optimizer"]["param_groups"]
    assert [g["step"] for g in distributed] == [0, 0]
    assert _hyper_parameters(distributed) == expected
    assert _hyper_parameters(saved["param_groups"]) == expected
    assert _hyper_parameters(opt.state_dict()["param_groups"]) == expected
