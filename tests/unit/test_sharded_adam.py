"""The sharded Adam steps with the run's hyper-parameters, those of LLM runs (Adam beta2 0.95, eps 1e-5, weight
decay 0.1, global-norm clipping at 1.0), equal to torch.optim.AdamW on the same model: an update that used
torch's defaults (betas 0.9 / 0.999, eps 1e-8) instead would differ from the second step on (beta2 in the
second-moment average; eps in every element whose gradient is small). D = 1 in this process, ZeRO-1 and ZeRO-3,
fp32, no process group.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

# Imported here, not in the tests: the unit tier counts the CPU time of a test's call, not its module's import.
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig

from megatron_bfpp.sharded import ShardedDataParallel, ShardedOptimizer, comm

H, STEPS, MICROBATCHES = 8, 4, 2
LR, BETA1, BETA2, EPS, WD, CLIP = 1e-2, 0.9, 0.95, 1e-5, 0.1, 1.0  # what LLM runs use


def _stages(seed: int = 0) -> list[torch.nn.Module]:
    """Two chunks: LayerNorm -> Linear -> tanh, small weights so that some gradients are small (eps matters)."""
    g = torch.Generator().manual_seed(seed)
    stages = []
    for _ in range(2):
        stage = torch.nn.Sequential(torch.nn.LayerNorm(H), torch.nn.Linear(H, H), torch.nn.Tanh())
        with torch.no_grad():
            for p in stage.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if p.ndim == 1 and p is stage[0].weight else 0))
        stages.append(stage)
    return stages


def _batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(4, H, generator=g), torch.randn(4, H, generator=g)) for _ in range(MICROBATCHES)]


def _loss(stages: list[torch.nn.Module], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    for s in stages:
        x = s(x)
    return 4.0 * torch.nn.functional.mse_loss(x, y) / MICROBATCHES  # x4: the norm exceeds CLIP in some steps


def _reference() -> tuple[list[dict], list[float]]:
    stages = _stages()
    params = [p for s in stages for p in s.parameters()]
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim > 1], "weight_decay": WD},
                             {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}],
                            lr=LR, betas=(BETA1, BETA2), eps=EPS)
    norms = []
    for step in range(STEPS):
        opt.zero_grad()
        for x, y in _batches(step):
            _loss(stages, x, y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, CLIP)))
        opt.step()
    return [{k: v.detach().clone() for k, v in s.state_dict().items()} for s in stages], norms


@pytest.mark.parametrize("zero", [1, 3])
def test_sharded_adam_takes_the_runs_hyper_parameters(monkeypatch: pytest.MonkeyPatch, zero: int) -> None:
    monkeypatch.setattr(comm, "group_size", lambda group: 1)  # D = 1 without a process group
    monkeypatch.setattr(comm, "group_rank", lambda group: 0)
    stages = _stages()
    chunks = [ShardedDataParallel(SimpleNamespace(calculate_per_token_loss=False), DistributedDataParallelConfig(),
                                  s, pg_collection=SimpleNamespace(dp_cp="dp"), zero_stage=zero, shard_align=4,
                                  param_align=2) for s in stages]
    decay = [p for c in chunks for p in c.parameters() if p.ndim > 1]
    no_decay = [p for c in chunks for p in c.parameters() if p.ndim <= 1]
    config = OptimizerConfig(optimizer="adam", lr=LR, min_lr=LR, weight_decay=WD, adam_beta1=BETA1,
                             adam_beta2=BETA2, adam_eps=EPS, clip_grad=CLIP)
    opt = ShardedOptimizer(chunks, config, grad_stats_groups=[], param_groups=[
        {"params": decay, "wd_mult": 1.0}, {"params": no_decay, "wd_mult": 0.0}])
    norms = []
    for step in range(STEPS):
        for c in chunks:
            c.zero_grad_buffer()
            c.before_backward()
        for x, y in _batches(step):
            _loss(chunks, x, y).backward()
        for c in chunks:
            c.finish_grad_sync()
        ok, norm, _ = opt.step()
        assert ok
        norms.append(norm)
    want, want_norms = _reference()
    assert any(n > CLIP for n in want_norms), f"clipping never engages: {want_norms}"
    assert norms == pytest.approx(want_norms, rel=1e-5)
    for c, ref in zip(chunks, want):
        with c.full_params():
            got = {k: v.detach().clone() for k, v in c.module.state_dict().items()}
        for name, value in ref.items():
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
