"""Checkpoints move between stock Megatron-LM and the plugin's --zero-stage with their optimizer state.

Through Megatron-LM's own `pretrain_gpt.py` on CPU (tests/support/megatron_lm.py's Runner), `--ckpt-format
torch_dist`, P = 2, V = 2, 6 iterations. A stock run saving every 2 iterations is also the uninterrupted reference; the
plugin resumes from its iteration-2 checkpoint (and saves at 4, and stock resumes from that). Every resumed
iteration equals the uninterrupted run (lm loss, grad norm, params norm; rtol 1e-5): the first resumed
iteration checks the weights, the second the Adam moments and step, the bf16 runs the fp32 master weights
(which differ from the bf16 weights in the checkpoint).

- fp32, V = 2: plain optimizer (FP32Optimizer) -> breadth-first ZeRO-3 -> plain optimizer
- fp32, V = 2: breadth-first ZeRO-3 from scratch -> plain optimizer (the parameter groups it saves are all its own)
- fp32, V = 2, untied embeddings: distributed optimizer (--dist-ckpt-optim-fully-reshardable) -> interleaved-zb
  ZeRO-3 (whose checkpoint is checked against the distributed optimizer's format), and -> breadth-first ZeRO-1
- bf16, V = 2: plain optimizer (Float16OptimizerWithFloat16Params) -> interleaved-zb ZeRO-2 -> plain optimizer
  (ZeRO-2's saved masters and moments against stock's to fp32 rounding; stock's continuation to bf16 rounding)
- Megatron's default (bucket-space) distributed-optimizer format: refused with the way out"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest

from tests.support.megatron_lm import (
    P2V2,
    RTOL,
    TINY,
    Run,
    Runner,
    _tail,
    assert_same_training,
    needs_checkout,
)

# Stock's own `fully_reshardable` save at V = 2 writes, for a word embedding tied to the output layer, an optimizer
# state that is not its model weight's (core_v0.19.0, CPU: the master differs from the saved weight), so the
# distributed-optimizer cases untie them.
UNTIED = P2V2 + ["--untie-embeddings-and-output-weights"]
SIX = ["--train-iters", "6"]
DISTOPT = ["--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable"]
BF16 = ["--bf16"]


def _every_2(ckpt: Path) -> list[str]:
    return ["--save", str(ckpt), "--save-interval", "2"]


def _stock(mlm: Runner, ckpts: Path, name: str, flags: list[str]) -> Run:
    """Stock, 6 iterations, saving every 2: the uninterrupted reference and the checkpoints to start from."""
    run = mlm.run("stock", TINY + flags + SIX + _every_2(ckpts / name))
    assert run.iterations() == [1, 2, 3, 4, 5, 6], _tail(run.output)
    assert (ckpts / name / "iter_0000002").is_dir()
    return run


def _at_2(ckpts: Path, name: str) -> Path:
    """A copy of the stock run's iteration-2 checkpoint, as the newest of its directory (where the plugin
    takes over)."""
    dst = ckpts / f"{name}-at-2"
    if not dst.exists():
        dst.mkdir()
        shutil.copytree(ckpts / name / "iter_0000002", dst / "iter_0000002")
        (dst / "latest_checkpointed_iteration.txt").write_text("2")
    return dst


def _resume(mlm: Runner, mode: str, flags: list[str], load: Path, iterations: list[int],
            save: Path | None = None) -> Run:
    """TINY + flags, 6 iterations, resuming from `load`'s newest checkpoint and stopping after `iterations`."""
    extra = ["--load", str(load), "--exit-interval", str(iterations[-1])]
    if save is not None:
        extra += _every_2(save)
    run = mlm.run(mode, TINY + flags + SIX + extra)
    assert sorted(run.by_iteration()) == iterations, _tail(run.output)
    return run


def _assert_resumed(run: Run, ref: Run, iterations: list[int]) -> None:
    # Megatron's log line after the first resumed iteration averages it with the next (its own accounting at a
    # resume, stock included): compare that line for the first iteration only, the full-precision records for all.
    assert_same_training(run, ref, iterations=iterations, logged=iterations[:1])


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ckpts")


def _read(ckpt: Path) -> dict:
    """Every tensor of a torch_dist checkpoint directory by key, read with torch's own checkpoint reader (no
    process group)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = ckpt.parent / (ckpt.name + ".pt")
    if not out.exists():
        dcp_to_torch_save(str(ckpt), str(out))
    return torch.load(out, weights_only=False)


@needs_checkout
@pytest.mark.timeout(900)
def test_stock_plain_optimizer_zero3_stock_round_trip(mlm: Runner, ckpts: Path) -> None:
    """Stock (FP32Optimizer) saves at 2; breadth-first ZeRO-3 resumes (iterations 3-4) and saves at 4; stock
    resumes (5-6): all equal the uninterrupted stock run."""
    ref = _stock(mlm, ckpts, "plain", P2V2)
    zero3 = _resume(mlm, "patched", P2V2 + ["--pipeline-schedule", "breadth-first", "--zero-stage", "3"],
                    _at_2(ckpts, "plain"), [3, 4], save=ckpts / "plain-zero3")
    assert "megatron_bfpp: installed pipeline schedule breadth-first" in zero3.output
    _assert_resumed(zero3, ref, [3, 4])
    back = _resume(mlm, "stock", P2V2, ckpts / "plain-zero3", [5, 6])
    _assert_resumed(back, ref, [5, 6])


@needs_checkout
@pytest.mark.timeout(900)
def test_zero3_from_scratch_checkpoint_resumes_in_stock(mlm: Runner, ckpts: Path) -> None:
    """Breadth-first ZeRO-3 trains from scratch (iterations 1-2 equal the uninterrupted stock run) and saves at 2;
    stock (FP32Optimizer) resumes from it (3-4) with the uninterrupted run's iterations. Nothing in that
    checkpoint came from stock: its parameter groups must carry every hyper-parameter of the Adam stock builds
    (without them stock's first step fails with KeyError: 'betas')."""
    ref = _stock(mlm, ckpts, "plain", P2V2)
    save = ckpts / "zero3-from-scratch"
    zero3 = mlm.run("patched", TINY + P2V2 + ["--pipeline-schedule", "breadth-first", "--zero-stage", "3"] + SIX
                    + ["--exit-interval", "2"] + _every_2(save))
    assert "megatron_bfpp: installed pipeline schedule breadth-first" in zero3.output
    assert_same_training(zero3, ref, iterations=[1, 2])
    assert (save / "iter_0000002").is_dir(), _tail(zero3.output)
    back = _resume(mlm, "stock", P2V2, save, [3, 4])
    _assert_resumed(back, ref, [3, 4])


@needs_checkout
@pytest.mark.timeout(900)
@pytest.mark.parametrize("schedule,zero", [("interleaved-zb", "3"), ("breadth-first", "1")])
def test_stock_distributed_optimizer_to_zero(mlm: Runner, ckpts: Path, schedule: str, zero: str) -> None:
    """Stock's distributed optimizer (`fully_reshardable`) saves at 2; ZeRO-3 under interleaved-zb and ZeRO-1
    under breadth-first resume with the uninterrupted run's iterations 3-4. ZeRO-3's iteration-4 checkpoint is
    what stock's distributed optimizer reads: content metadata `fully_reshardable`, Adam's step in every
    parameter group, per parameter `param` (the weight itself in fp32), `exp_avg` and `exp_avg_sq` of its shape.
    (Stock's distributed optimizer cannot load a torch_dist checkpoint on CPU at all: without apex or
    TransformerEngine its `state_dict()` asserts on the empty torch Adam state it has before a first step.
    Stock's plain optimizer loads the same layout in the test above.)"""
    ref = _stock(mlm, ckpts, "distopt", UNTIED + DISTOPT)
    save = ckpts / "distopt-zero3" if zero == "3" else None
    run = _resume(mlm, "patched", UNTIED + ["--pipeline-schedule", schedule, "--zero-stage", zero],
                  _at_2(ckpts, "distopt"), [3, 4], save=save)
    assert f"megatron_bfpp: installed pipeline schedule {schedule}" in run.output
    _assert_resumed(run, ref, [3, 4])
    if save is None:
        return
    import torch
    from megatron.core import dist_checkpointing

    path = save / "iter_0000004"
    assert dist_checkpointing.load_content_metadata(path)["distrib_optim_sharding_type"] == "fully_reshardable"
    common = dist_checkpointing.load_common_state_dict(path)["optimizer"]
    assert common["param_state_sharding_type"] == "fully_reshardable"
    assert [g["step"] for g in common["optimizer"]["param_groups"]] == [4] * len(common["optimizer"]["param_groups"])
    tensors = _read(path)
    weights = [k for k in tensors if not k.startswith("optimizer.") and k.endswith(("weight", "bias"))]
    assert weights
    for key in weights:
        torch.testing.assert_close(tensors[f"optimizer.state.param.{key}"], tensors[key], rtol=0, atol=0, msg=key)
        for state in ("exp_avg", "exp_avg_sq"):
            assert tensors[f"optimizer.state.{state}.{key}"].shape == tensors[key].shape, (state, key)


@needs_checkout
@pytest.mark.timeout(900)
def test_bf16_stock_zero2_stock_round_trip_restores_master_weights(mlm: Runner, ckpts: Path) -> None:
    """--bf16: Megatron's plain mixed-precision optimizer saves fp32 master weights beside the bf16 weights;
    interleaved-zb ZeRO-2 resumes from them (3-4) and writes them back for stock (5-6). Rounding the masters to
    the bf16 weights at a load would change every iteration after the first resumed one, and leave ZeRO-2's
    masters a bf16 rounding (~1e-3) from stock's at iteration 4, where they agree to fp32's rounding here.
    Stock's continuation from ZeRO-2's checkpoint: the params norm (of the masters) to rtol 1e-5, losses and
    grad norms to bf16's rounding (rtol 1e-3, as tests/megatron_lm/test_pretrain_gpt_optimizer.py): where a
    master ends an fp32 ulp away from stock's across a bf16 rounding boundary, its bf16 weight is a bf16 ulp
    away (two weights of 210k here, 1e-5 of the loss and 3e-4 of the grad norm at iteration 5)."""
    import torch

    ref = _stock(mlm, ckpts, "bf16", P2V2 + BF16)
    start = _at_2(ckpts, "bf16")
    tensors = _read(start / "iter_0000002")
    prefix = "optimizer.state.fp32_param."
    masters = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
    assert masters and all(tensors[k].dtype == torch.bfloat16 and m.dtype == torch.float32
                           for k, m in masters.items())
    same = [k for k, m in masters.items() if torch.equal(m, tensors[k].float())]
    assert not same, f"masters equal to the bf16 weights: {same}"
    zero2 = _resume(mlm, "patched", P2V2 + BF16 + ["--pipeline-schedule", "interleaved-zb", "--zero-stage", "2"],
                    start, [3, 4], save=ckpts / "bf16-zero2")
    _assert_resumed(zero2, ref, [3, 4])
    ours, stocks = _read(ckpts / "bf16-zero2" / "iter_0000004"), _read(ckpts / "bf16" / "iter_0000004")
    for key in masters:
        for state in ("fp32_param", "exp_avg", "exp_avg_sq"):
            name = f"optimizer.state.{state}.{key}"
            torch.testing.assert_close(ours[name], stocks[name], rtol=1e-6, atol=1e-9, msg=name)
    back = _resume(mlm, "stock", P2V2 + BF16, ckpts / "bf16-zero2", [5, 6])
    assert_same_training(back, ref, iterations=[5, 6], logged=[], rtol=1e-3, params_norm=False)
    for it in (5, 6):
        got, want = back.by_iteration()[it]["params_norm"], ref.by_iteration()[it]["params_norm"]
        assert math.isclose(got, want, rel_tol=RTOL), f"iteration {it}: params norm {got} != {want}"


def test_bucket_space_distributed_optimizer_checkpoint_is_refused_with_the_way_out() -> None:
    """Megatron's default distributed-optimizer format follows its own gradient buckets: one error, before any
    state is touched, naming the flag that re-saves it in model space and the one that skips it."""
    from megatron_bfpp.sharded.checkpoint import OptimizerCheckpointError, loading_sharded_state_dict

    for fmt in ("dp_reshardable", "dp_zero_gather_scatter"):
        with pytest.raises(OptimizerCheckpointError) as e:
            loading_sharded_state_dict([], {}, {}, {"distrib_optim_sharding_type": fmt})
        msg = str(e.value)
        assert fmt in msg and "--dist-ckpt-optim-fully-reshardable" in msg and "--no-load-optim" in msg, msg
