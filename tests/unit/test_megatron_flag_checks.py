"""The argument check refuses what --zero-stage and the split-backward schedules cannot run, with one error that
names the flag, and accepts the rest (Megatron-LM's own parse_args + validate_args on the flags, no process)."""

from __future__ import annotations

import pytest

import megatron_bfpp.megatron as bm
from megatron_bfpp.megatron.check import parse_megatron_args
from tests.support.megatron_lm import CHECK

# ---------------------------------------------------- flags that read weights / gradients outside the schedule

REFUSED = [
    ("save-wgrads-zero1", ["--zero-stage", "1", "--save-wgrads-interval", "2"], "--save-wgrads-interval"),
    ("save-wgrads-zero2", ["--zero-stage", "2", "--save-wgrads-interval", "2"], "--save-wgrads-interval"),
    ("save-wgrads-zero3", ["--zero-stage", "3", "--save-wgrads-interval", "2"], "--save-wgrads-interval"),
    ("save-params-zero3", ["--zero-stage", "3", "--save-params-interval", "2"], "--save-params-interval"),
    ("cuda-graph-local-zero2", ["--zero-stage", "2", "--cuda-graph-impl", "local"], "--cuda-graph-impl local"),
    ("cuda-graph-te-zero3", ["--zero-stage", "3", "--cuda-graph-impl", "transformer_engine"],
     "--cuda-graph-impl transformer_engine"),
    ("enable-cuda-graph-zero3", ["--zero-stage", "3", "--enable-cuda-graph"], "--cuda-graph-impl local"),
    ("qk-clip-zero1", ["--zero-stage", "1", "--qk-clip"], "--qk-clip"),
    ("sgd-zero2", ["--zero-stage", "2", "--optimizer", "sgd"], "--optimizer sgd"),
]


@pytest.mark.parametrize("flags, needle", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_zero_stage_refuses_flags_that_read_freed_storage(flags: list[str], needle: str) -> None:
    after = {}
    if "--qk-clip" in flags:  # Megatron's own validation wants TransformerEngine >= 2.9 for it
        flags, after = [f for f in flags if f != "--qk-clip"], {"qk_clip": True}
    args = parse_megatron_args(CHECK + flags, 2)
    vars(args).update(after)
    with pytest.raises(bm.ConfigError) as e:
        bm.validate_args(args)
    msg = str(e.value)
    assert needle in msg and "--zero-stage" in msg and ("drop" in msg or "use" in msg), msg


@pytest.mark.parametrize("zero", ["1", "2", "3"])
def test_zero_stage_refuses_megatrons_param_gather_in_the_optimizer_step_before_megatron_does(zero: str) -> None:
    """Megatron's own check would ask for --use-distributed-optimizer, which --zero-stage replaces: the plugin's
    message comes first and says the schedule already does it."""
    flags = CHECK + ["--pipeline-schedule", "interleaved-1f1b", "--zero-stage", zero,
                     "--overlap-param-gather-with-optimizer-step"]
    with pytest.raises(bm.ConfigError, match="STEP actions.*drop --overlap-param-gather-with-optimizer-step"):
        parse_megatron_args(flags, 2)


def test_hooked_parse_args_checks_before_megatron_validates() -> None:
    from megatron_bfpp.megatron import arg_hooks

    def parse(extra_args_provider=None, ignore_unknown_args=False):
        import argparse

        return argparse.Namespace(zero_stage=2, overlap_param_gather_with_optimizer_step=True)

    with pytest.raises(SystemExit):
        arg_hooks._wrap_parse_args(parse)()


@pytest.mark.parametrize("flags", [
    ["--zero-stage", "1", "--cuda-graph-impl", "transformer_engine", "--pipeline-schedule", "interleaved-1f1b"],
    ["--zero-stage", "2", "--save-params-interval", "2"],
    ["--zero-stage", "3", "--log-params-norm", "--check-weight-hash-across-dp-replicas-interval", "2"],
    ["--save-wgrads-interval", "2"],
], ids=["cuda-graph-te-zero1", "save-params-zero2", "params-norm-weight-hash-zero3", "save-wgrads-no-zero"])
def test_zero_stage_accepts(flags: list[str]) -> None:
    bm.validate_args(parse_megatron_args(CHECK + flags, 2))


@pytest.mark.parametrize("schedule", ["interleaved-zb", "breadth-first-zb"])
@pytest.mark.parametrize("sharding", [[], ["--zero-stage", "1"]], ids=["megatron-ddp", "zero1"])
def test_split_backward_refuses_per_layer_cuda_graphs(schedule: str, sharding: list[str]) -> None:
    """A layer's CUDA graph replays its whole backward; the split backward runs it in two parts."""
    flags = [f for f in CHECK if f != "breadth-first"] + [schedule, *sharding, "--cuda-graph-impl", "transformer_engine"]
    with pytest.raises(bm.ConfigError) as e:
        bm.validate_args(parse_megatron_args(flags, 2))
    msg = str(e.value)
    assert "--cuda-graph-impl transformer_engine" in msg and schedule in msg and "split backward" in msg, msg
    bm.validate_args(parse_megatron_args([f for f in flags if f not in ("--cuda-graph-impl", "transformer_engine")], 2))


@pytest.mark.parametrize("zero", ["2", "3"])
def test_split_backward_under_zero23_accepts_gradient_accumulation_fusion(zero: str) -> None:
    """Fused layers write main_grad inside the I's backward; the runtime lowers the schedule so that ZeRO-2/3
    hold the stage's gradient buffer from its first I (tests/distributed/test_runtime.py runs it), so Megatron-LM's default
    passes validation. (Its fused kernel needs CUDA: the CPU runs here pass --no-gradient-accumulation-fusion.)"""
    flags = [f for f in CHECK if f != "breadth-first"] + ["interleaved-zb", "--zero-stage", zero]
    args = parse_megatron_args(flags, 2)
    assert args.gradient_accumulation_fusion  # Megatron-LM's default
    bm.validate_args(args)


def test_full_iteration_graphs_message_suggests_per_layer_only_where_allowed() -> None:
    for zero, per_layer in (("1", True), ("3", False)):
        with pytest.raises(bm.ConfigError) as e:
            bm.validate_args(parse_megatron_args(CHECK + ["--zero-stage", zero, "--cuda-graph-impl",
                                                          "full_iteration", "--no-check-for-nan-in-loss-and-grad"],
                                                         2))
        assert ("per-layer" in str(e.value)) is per_layer, str(e.value)
