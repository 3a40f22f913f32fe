"""The sharded wrapper's gradient check, expert-parallel scaling and grad-norm filtering, and the optimizer
checkpoint's parameter-group matching: single-process unit tests (no process group; group sizes and ranks of
fake groups where a property needs D, T > 1).

- `finalize_model_grads` runs Megatron's gradient check on every bucket this rank owns after the data-parallel
  reduction: each flat buffer (dense and expert-parallel) and the replicated (tied) gradients, for NaN and Inf.
- Expert-parallel gradients are pre-scaled as Megatron's DDP pre-scales them, with and without
  `--ddp-average-in-collective` (compared with Megatron's own DDP built on the same fake groups).
- The grad-norm duplicates of expert-parallel parameters are filtered over the expert-tensor-parallel group.
- An optimizer checkpoint's parameter groups are matched by their hyper-parameters, not by position.
"""

from __future__ import annotations

import importlib
import math
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

# Imported here, not in the tests: the unit tier counts the CPU time of a test's call, not its module's import.
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig

import megatron.core.distributed.param_and_grad_buffer as megatron_buffers
from megatron_bfpp.sharded import ShardedDataParallel, ShardedOptimizer, comm
from megatron_bfpp.sharded.checkpoint import OptimizerCheckpointError, load_megatron_state
from megatron_bfpp.sharded.finalize import finalize_model_grads
from tests.support.megatron_ddp_cpu_shim import PATCH_POINTS, megatron_ddp_on_cpu

for _module in PATCH_POINTS:  # what megatron_ddp_on_cpu patches, imported once
    importlib.import_module(_module)


def _no_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("torch.distributed is initialized in this process")


class FakeGroup:
    """A process group of a given size in which this process has a given rank; nothing is ever sent. Read by the
    sharded wrapper through `comm.group_size` / `comm.group_rank` (patched by `fake_groups`) and by Megatron's
    DDP through `size()` / `rank()`."""

    def __init__(self, size: int = 1, rank: int = 0) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


@pytest.fixture
def fake_groups(monkeypatch):
    _no_process_group()
    monkeypatch.setattr(comm, "group_size", lambda g: g.size() if isinstance(g, FakeGroup) else 1)
    monkeypatch.setattr(comm, "group_rank", lambda g: g.rank() if isinstance(g, FakeGroup) else 0)


def _mark_expert(module: torch.nn.Module) -> torch.nn.Module:
    for p in module.parameters():
        p.allreduce = False  # Megatron's marker of expert-parallel parameters
    return module


# ----------------------------------------------------------------------------- gradient check after reduction


class _Chunk(torch.nn.Module):
    """A dense linear, an expert-parallel linear (a flat buffer of its own) and a tied embedding-like weight
    (replicated, outside the flat buffers)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dense = torch.nn.Linear(3, 3)
        self.expert = _mark_expert(torch.nn.Linear(3, 3))
        self.tied = torch.nn.Parameter(torch.randn(3, 3))
        self.tied.shared_embedding = True

    def forward(self, x):
        return self.expert(self.dense(x)) @ self.tied


class _Rejected(Exception):
    pass


class _RecordingRerunStateMachine:
    """Megatron's rerun state machine as the check sees it: records every validated result and whether it was
    rejected; a fatal rejection stops the step (as the real one does, through a rerun or an exception)."""

    def __init__(self) -> None:
        self.checked: list[tuple[str, float, bool]] = []

    def validate_result(self, result, rejection_func, message, tolerance, fatal, **_):
        rejected = bool(rejection_func(result))
        self.checked.append((message, float(result), rejected))
        if rejected and fatal:
            raise _Rejected(message)

    def is_unexpectedly_large(self, *args, **kwargs):
        return False


def _step_with_gradient(target: str | None, value: float, monkeypatch) -> _RecordingRerunStateMachine:
    """One backward through a ZeRO-1 D = 1 wrapper with `value` put into the first element of `target`'s gradient,
    then finalize_model_grads with --check-for-nan-in-loss-and-grad."""
    _no_process_group()
    machine = _RecordingRerunStateMachine()
    monkeypatch.setattr("megatron.core.rerun_state_machine.get_rerun_state_machine", lambda: machine)
    module = _Chunk()
    group = object()  # D = 1: no process group
    chunk = ShardedDataParallel(SimpleNamespace(calculate_per_token_loss=False),
                                DistributedDataParallelConfig(check_for_nan_in_grad=True), module,
                                pg_collection=SimpleNamespace(dp_cp=group, expt_dp=group), zero_stage=1,
                                shard_align=1, param_align=1)
    # What this is for: two flat buffers, the expert one second, and a replicated parameter.
    assert [any(p is module.expert.weight for p in b.pbuf.params) for b in chunk.flat_buffers] == [False, True]
    assert chunk.owned_replicated_params == [module.tied]
    if target is not None:
        param = dict(module.named_parameters())[target]

        def inject(grad):
            grad = grad.clone()
            grad.view(-1)[0] = value
            return grad

        param.register_hook(inject)
    chunk.zero_grad_buffer()
    chunk(torch.randn(2, 3)).sum().backward()
    finalize_model_grads([chunk])
    return machine


def test_gradient_check_sees_every_bucket_of_a_clean_step(monkeypatch):
    """Without a bad value: NaN and Inf checked on three buckets (dense buffer, expert buffer, replicated
    gradients), none rejected."""
    machine = _step_with_gradient(None, 0.0, monkeypatch)
    messages = [m for m, _, _ in machine.checked]
    for i in range(3):
        for kind in ("NaN", "Inf"):
            assert f"found {kind} in local grad norm for bucket #{i} " in " ".join(messages), messages
    assert not any(rejected for _, _, rejected in machine.checked)


@pytest.mark.parametrize("target,value,bucket", [
    ("dense.weight", math.inf, 0), ("dense.bias", -math.inf, 0), ("dense.weight", math.nan, 0),
    ("expert.weight", math.nan, 1), ("expert.bias", math.inf, 1),
    ("tied", math.nan, 2), ("tied", math.inf, 2),
])
def test_gradient_check_rejects_nan_and_inf_in_every_bucket(monkeypatch, target, value, bucket):
    """A NaN or an Inf in any gradient stops the step before the optimizer: in the dense flat buffer, in the
    expert-parallel flat buffer (the chunk's second) and in the replicated (tied) gradients, which are
    all-reduced beside the buffers, not reduce-scattered with them."""
    kind = "NaN" if math.isnan(value) else "Inf"
    with pytest.raises(_Rejected) as e:
        _step_with_gradient(target, value, monkeypatch)
    assert str(e.value).startswith(f"found {kind} in local grad norm for bucket #{bucket} "), str(e.value)


# ------------------------------------------------------------------------- expert gradients' pre-scaling


def _megatron_ddp_scaling(module, average_in_collective: bool, dp: FakeGroup, expt_dp: FakeGroup) -> dict:
    """Megatron's own DDP (megatron/core/distributed/distributed_data_parallel.py) built on fake groups: the
    gradient scaling factor of its dense and expert-parallel buffers."""
    groups = dict(dp_group=dp, dp_cp_group=dp, intra_dp_cp_group=dp, expt_dp_group=expt_dp,
                  intra_expt_dp_group=expt_dp, tp_group=FakeGroup(), pp_group=FakeGroup(), ep_group=FakeGroup(),
                  gtp_remat_group=None, expt_gtp_remat_group=None, inter_dist_opt_group=None,
                  intra_dist_opt_group=None)
    config = TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1)
    with megatron_ddp_on_cpu(), \
            mock.patch.object(ProcessGroupCollection, "setup_process_groups_for_ddp", lambda *a: groups), \
            mock.patch.object(megatron_buffers, "log_on_each_pipeline_stage", lambda *a, **k: None):
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(average_in_collective=average_in_collective),
                                      module)
    assert len(ddp.buffers) == len(ddp.expert_parallel_buffers) == 1
    return {"dense": ddp.buffers[0].gradient_scaling_factor,
            "expert": ddp.expert_parallel_buffers[0].gradient_scaling_factor}


@pytest.mark.parametrize("average_in_collective", [False, True])
def test_expert_gradients_are_pre_scaled_as_megatrons_ddp(fake_groups, average_in_collective):
    """D = 4, expert-data-parallel size 2 (E = 2): Megatron's DDP pre-scales dense gradients by 1/D (1 when the
    collective averages) and expert gradients by 1/D (E_dp / D when the collective averages over E_dp): every
    reduced gradient is the average over the D ranks. The sharded wrapper's buffers carry the same factors, and
    its collectives average over the group each buffer is sharded over exactly when Megatron's do."""
    dp, expt_dp = FakeGroup(4), FakeGroup(2)

    def model():
        torch.manual_seed(0)
        m = torch.nn.Module()
        m.dense = torch.nn.Linear(4, 4)
        m.expert = _mark_expert(torch.nn.Linear(4, 4))
        return m

    want = _megatron_ddp_scaling(model(), average_in_collective, dp, expt_dp)
    chunk = ShardedDataParallel(SimpleNamespace(calculate_per_token_loss=False),
                                DistributedDataParallelConfig(average_in_collective=average_in_collective), model(),
                                pg_collection=SimpleNamespace(dp_cp=dp, expt_dp=expt_dp), zero_stage=1,
                                shard_align=1, param_align=1)
    dense, expert = chunk.flat_buffers
    assert (dense.group, expert.group) == (dp, expt_dp)
    assert {"dense": dense.gradient_scaling_factor, "expert": expert.gradient_scaling_factor} == pytest.approx(want)
    assert chunk.average_in_collective == average_in_collective
    for b in (dense, expert):  # the reduced gradient: pre-scaled, summed over the group, averaged or not
        reduced = b.gradient_scaling_factor / (b.size if average_in_collective else 1)
        assert reduced == pytest.approx(1 / 4), (b.group.size(), reduced)


# ------------------------------------------------------------------------------ grad-norm duplicate filter


def test_expert_norm_duplicates_are_filtered_over_the_expert_tensor_parallel_group(fake_groups):
    """T = 2 (this process is tensor-parallel rank 1), expert T = 1 (rank 0 of its expert-tensor-parallel group):
    a dense parameter that is not split over tensor parallelism (a norm) is T's duplicate here and counted on
    rank 0 only; a split one counts on every rank; an expert parameter, whatever its split, is filtered over the
    expert-tensor-parallel group, where this rank is rank 0: it counts. The grad norm and the zero count read
    the same segments."""
    torch.manual_seed(0)
    module = torch.nn.Module()
    module.norm = torch.nn.Parameter(torch.ones(4))  # replicated over T: a duplicate on T rank 1
    module.split = torch.nn.Parameter(torch.ones(4))
    module.split.tensor_model_parallel = True
    module.expert = _mark_expert(torch.nn.Linear(4, 4, bias=False))  # not split: expert T = 1
    tp, expt_tp = FakeGroup(2, rank=1), FakeGroup(1, rank=0)
    group = FakeGroup()
    chunk = ShardedDataParallel(SimpleNamespace(calculate_per_token_loss=False), DistributedDataParallelConfig(),
                                module, pg_collection=SimpleNamespace(dp_cp=group, expt_dp=group, tp=tp,
                                                                      expt_tp=expt_tp),
                                zero_stage=1, shard_align=1, param_align=1)
    opt = ShardedOptimizer([chunk], OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.0),
                           param_groups=[{"params": list(module.parameters())}], grad_stats_groups=[])
    counted = {chunk.param_names[s.param]: s.counts_in_norm for s in opt._all_segments()}
    assert counted == {"norm": False, "split": True, "expert.weight": True}
    chunk.before_backward()
    for name, p in module.named_parameters():
        p.main_grad.fill_({"norm": 1.0, "split": 2.0, "expert.weight": 3.0}[name])
    chunk.finish_grad_sync()
    assert opt.get_grad_norm() == pytest.approx(math.sqrt(4 * 2.0 ** 2 + 16 * 3.0 ** 2))


# -------------------------------------------------------------------- checkpoint parameter-group matching


def _groups(order: list[int], lrs: dict[int, float]) -> list[dict]:
    """Megatron's parameter groups by weight-decay multiplier (0: biases and norms, 1: the rest), in `order`."""
    out = []
    for wd_mult in order:
        out.append({"params": [], "wd_mult": float(wd_mult), "lr_mult": 1.0, "is_expert_parallel": False,
                    "is_decoupled_lr": False, "max_lr": 1e-3, "min_lr": 0.0, "lr": lrs[wd_mult],
                    "weight_decay": 0.1 * wd_mult, "step": 7})
    return out


@pytest.mark.parametrize("fmt", ["distributed", "plain"])
def test_checkpoint_parameter_groups_are_matched_by_their_hyper_parameters(fmt):
    """A checkpoint whose parameter groups come in another order than this run's (another optimizer or model
    built them): each group takes the saved state of the group with its identifying hyper-parameters
    (Megatron's param_group_identifier_keys), not the one at its position; a checkpoint with another number of
    groups is refused."""
    saved = _groups([1, 0], {1: 0.5, 0: 0.25})
    for g in saved:
        del g["params"]
    if fmt == "distributed":
        state = {"param_state_sharding_type": "fully_reshardable", "optimizer": {"param_groups": saved},
                 "param_state": {}}
    else:
        state = {"optimizer": {"param_groups": saved, "state": {"common_step": torch.tensor(7.0)}},
                 "param_state": {}}
    mine = _groups([0, 1], {0: 0.0, 1: 0.0})
    step, _ = load_megatron_state([], {}, mine, state)
    assert step == 7
    assert [(g["wd_mult"], g["lr"], g["weight_decay"]) for g in mine] == [(0.0, 0.25, 0.0), (1.0, 0.5, 0.1)]

    with pytest.raises(OptimizerCheckpointError, match="parameter groups"):
        load_megatron_state([], {}, _groups([0, 1], {0: 0.0, 1: 0.0})[:1], state)
