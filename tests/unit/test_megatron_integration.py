"""Megatron-LM integration: flags through Megatron's own parser and validation, the plugin's checks (one clear
error per bad combination, in Megatron's flag names), install()/uninstall() rebinding on the installed
megatron-core, argument hooks and the no-patch script runner, and (with MEGATRON_LM_DIR) the patch series on a
real Megatron-LM checkout.

Megatron's argument validation runs on CPU: WORLD_SIZE/RANK come from the environment (set per case by
`parse_megatron_args`) and the GPU architecture query (tensor/context parallelism) is answered without a GPU.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import megatron_bfpp.megatron as bm
from megatron_bfpp.megatron import compat
from megatron_bfpp.megatron.check import parse_megatron_args
from tests.support.megatron_lm import P4_TINY as TINY
from tests.support.megatron_lm import P4_VIRTUAL as VIRTUAL
from tests.support.megatron_lm import P4_WORLD as WORLD

ROOT = Path(__file__).resolve().parents[2]
# Flags of the `bfpp schedule` command, which must never leak into Megatron-facing messages.
FOREIGN_FLAGS = re.compile(r"(?<![\w-])--(vp|pp|group-size|schedule|microbatches|weight-buffers|grad-buffers)\b")


def plugin_config(*flags: str, world: int = WORLD) -> bm.PluginConfig:
    return bm.validate_args(parse_megatron_args([*TINY, *flags], world))


@pytest.fixture
def restore():
    """Leave Megatron as found, whatever a test installed or hooked."""
    from megatron.training import arguments, training

    before = {n: getattr(training, n) for n in ("get_forward_backward_func", "DDP", "get_megatron_optimizer",
                                                  "finalize_model_grads")}
    before_args = {n: getattr(arguments, n) for n in ("parse_args", "validate_args")}
    yield training
    bm.unhook_argument_parsing()
    bm.uninstall()
    for n, v in before.items():
        assert getattr(training, n) is v, f"megatron.training.training.{n} not restored"
    for n, v in before_args.items():
        assert getattr(arguments, n) is v, f"megatron.training.arguments.{n} not restored"


# ------------------------------------------------------------------------------------------------ flags

def test_add_arguments_is_idempotent_and_chains() -> None:
    def other(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        parser.add_argument("--other-flag", type=int, default=0)
        return parser

    parser = argparse.ArgumentParser()
    parser = bm.extra_args_provider(other)(parser)
    parser = bm.add_arguments(parser)  # patch + script runner together must not conflict
    a = parser.parse_args(["--other-flag", "3", "--pipeline-schedule", "breadth-first", "--zero-stage", "3",
                           "--bfpp-weight-buffers", "1", "--timeline", "t.json"])
    assert (a.other_flag, a.pipeline_schedule, a.zero_stage, a.bfpp_weight_buffers, a.timeline) == (
        3, "breadth-first", 3, 1, "t.json")
    d = parser.parse_args([])
    assert (d.pipeline_schedule, d.zero_stage, d.bfpp_weight_buffers, d.bfpp_grad_buffers) == ("default", None, None, None)
    for bad in (["--pipeline-schedule", "zigzag"], ["--zero-stage", "4"], ["--bfpp-grad-buffers", "0"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


def test_parse_and_validate_args_accepts_breadth_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """Megatron-LM's own entry point, exactly as pretrain_gpt.py calls it, with the plugin's provider."""
    from megatron.training.arguments import parse_and_validate_args
    from megatron.training.global_vars import unset_global_variables

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *TINY, *VIRTUAL, "--global-batch-size", "16",
                                      "--pipeline-schedule", "breadth-first", "--zero-stage", "3"])
    monkeypatch.setenv("WORLD_SIZE", str(WORLD))
    monkeypatch.setenv("RANK", "0")
    try:
        args = parse_and_validate_args(extra_args_provider=bm.add_arguments,
                                       args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    finally:
        unset_global_variables()
    assert args.pipeline_schedule == "breadth-first" and args.zero_stage == 3
    assert args.virtual_pipeline_model_parallel_size == 2 and args.data_parallel_size == 2
    cfg = bm.validate_args(args)
    assert (cfg.pp, cfg.vp, cfg.train_microbatches, cfg.eval_microbatches, cfg.zero_stage) == (4, 2, (8,), 8, 3)
    assert cfg.uses_runtime and cfg.shards_model_state and cfg.microbatch_group_size is None


@pytest.mark.parametrize("flags, expect", [
    ((*VIRTUAL, "--global-batch-size", "8", "--pipeline-schedule", "breadth-first"),
     dict(pipeline_schedule="breadth-first", pp=4, vp=2, train_microbatches=(4,))),
    # Breadth-first runs below one micro-batch per pipeline stage, where interleaved cannot.
    ((*VIRTUAL, "--global-batch-size", "4", "--pipeline-schedule", "breadth-first"),
     dict(train_microbatches=(2,))),
    ((*VIRTUAL, "--global-batch-size", "16", "--pipeline-schedule", "breadth-first",
      "--microbatch-group-size-per-virtual-pipeline-stage", "4", "--zero-stage", "3", "--bfpp-weight-buffers", "1",
      "--bfpp-grad-buffers", "3"),
     dict(microbatch_group_size=4, zero_stage=3, weight_buffers=1, grad_buffers=3)),
    ((*VIRTUAL, "--global-batch-size", "16", "--pipeline-schedule", "interleaved-1f1b",
      "--microbatch-group-size-per-virtual-pipeline-stage", "8", "--zero-stage", "1"),
     dict(pipeline_schedule="interleaved-1f1b", microbatch_group_size=8, zero_stage=1)),
    # Without --zero-stage, Megatron's own DDP and distributed optimizer run under the plugin's schedule.
    ((*VIRTUAL, "--global-batch-size", "8", "--pipeline-schedule", "breadth-first", "--use-distributed-optimizer",
      "--overlap-grad-reduce"),
     dict(pipeline_schedule="breadth-first", zero_stage=None)),
    (("--global-batch-size", "8", "--pipeline-schedule", "1f1b", "--zero-stage", "2"),
     dict(pipeline_schedule="1f1b", vp=1, zero_stage=2)),
    ((*VIRTUAL, "--global-batch-size", "8"), dict(pipeline_schedule="default", zero_stage=None)),
    ((*VIRTUAL, "--global-batch-size", "16", "--eval-micro-batch-size", "4", "--pipeline-schedule", "breadth-first"),
     dict(train_microbatches=(8,), eval_microbatches=2)),
])
def test_valid_combinations(flags: tuple[str, ...], expect: dict) -> None:
    cfg = plugin_config(*flags)
    for k, v in expect.items():
        assert getattr(cfg, k) == v, k
    assert cfg.uses_runtime == (cfg.pipeline_schedule != "default")


BAD = [
    ("bf-without-virtual", ("--global-batch-size", "8", "--pipeline-schedule", "breadth-first"),
     ["--pipeline-schedule breadth-first needs virtual stages", "--num-layers-per-virtual-pipeline-stage",
      "--num-virtual-stages-per-pipeline-rank"]),
    ("interleaved-without-virtual", ("--global-batch-size", "8", "--pipeline-schedule", "interleaved-1f1b"),
     ["--pipeline-schedule interleaved-1f1b needs virtual stages"]),
    ("interleaved-M<P", (*VIRTUAL, "--global-batch-size", "4", "--pipeline-schedule", "interleaved-1f1b"),
     ["needs at least P=4 micro-batches (got M=2)", "raise --global-batch-size or lower --micro-batch-size",
      "--pipeline-schedule breadth-first", "data-parallel size 2"]),
    ("interleaved-M<P-in-batch-ramp", (*VIRTUAL, "--step-batch-size-schedule", "0:4 1K:16",
                                       "--pipeline-schedule", "interleaved-1f1b"),
     ["needs at least P=4 micro-batches (got M=2)"]),
    ("interleaved-eval-M<P", (*VIRTUAL, "--global-batch-size", "16", "--eval-global-batch-size", "4",
                              "--pipeline-schedule", "interleaved-1f1b"),
     ["(got M=2)", "evaluation, --eval-global-batch-size"]),
    ("interleaved-group<P", (*VIRTUAL, "--global-batch-size", "16", "--pipeline-schedule", "interleaved-1f1b",
                             "--microbatch-group-size-per-virtual-pipeline-stage", "3"),
     ["--microbatch-group-size-per-virtual-pipeline-stage must lie in [P=4, M=8]"]),
    ("bf-group>M", (*VIRTUAL, "--global-batch-size", "16", "--pipeline-schedule", "breadth-first",
                    "--microbatch-group-size-per-virtual-pipeline-stage", "9"),
     ["--microbatch-group-size-per-virtual-pipeline-stage must lie in [1, M=8]"]),
    ("1f1b-with-virtual", (*VIRTUAL, "--global-batch-size", "8", "--pipeline-schedule", "1f1b"),
     ["--pipeline-schedule 1f1b runs one stage per rank", "--pipeline-schedule interleaved-1f1b or breadth-first"]),
    ("zero3+distopt", (*VIRTUAL, "--global-batch-size", "8", "--pipeline-schedule", "breadth-first",
                       "--zero-stage", "3", "--use-distributed-optimizer"),
     ["--zero-stage 3 brings megatron_bfpp's sharded optimizer", "drop --use-distributed-optimizer",
      "or drop --zero-stage"]),
    ("zero2+overlap-grad", (*VIRTUAL, "--global-batch-size", "8", "--pipeline-schedule", "breadth-first",
                            "--zero-stage", "2", "--overlap-grad-reduce"),
     ["drop --overlap-grad-reduce"]),
    ("zero3+megatron-fsdp", (*VIRTUAL, "--global-batch-size", "8", "--pipeline-schedule", "breadth-first",
                             "--zero-stage", "3", "--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"),
     ["--use-megatron-fsdp cannot run under --pipeline-schedule breadth-first", "--zero-stage 3"]),
    ("zero1+distopt", (*VIRTUAL, "--global-batch-size", "8", "--pipeline-schedule", "breadth-first",
                       "--zero-stage", "1", "--use-distributed-optimizer"),
     ["--zero-stage 1 brings megatron_bfpp's sharded optimizer", "drop --use-distributed-optimizer"]),
    ("zero-with-default", (*VIRTUAL, "--global-batch-size", "8", "--zero-stage", "3"),
     ["--zero-stage needs megatron_bfpp's schedule runtime", "--pipeline-schedule breadth-first"]),
    ("timeline-with-default", (*VIRTUAL, "--global-batch-size", "8", "--timeline", "t.json"),
     ["--timeline needs megatron_bfpp's schedule runtime"]),
    ("weight-buffers-zero2", (*VIRTUAL, "--global-batch-size", "8", "--pipeline-schedule", "breadth-first",
                              "--zero-stage", "2", "--bfpp-weight-buffers", "1"),
     ["--bfpp-weight-buffers applies to --zero-stage 3 only"]),
    ("grad-buffers-no-zero", (*VIRTUAL, "--global-batch-size", "8", "--pipeline-schedule", "breadth-first",
                              "--bfpp-grad-buffers", "1"),
     ["--bfpp-grad-buffers applies to --zero-stage 2 and 3 only"]),
    ("fp16-no-loss-scaling", (*VIRTUAL, "--global-batch-size", "8", "--pipeline-schedule", "breadth-first",
                              "--fp16", "--loss-scale", "1"),
     ["--fp16 with --loss-scale 1.0 trains without loss scaling", "--bf16"]),
    ("timeline-dir-missing", (*VIRTUAL, "--global-batch-size", "8", "--pipeline-schedule", "breadth-first",
                              "--timeline", "/nonexistent-dir/t.json"),
     ["--timeline /nonexistent-dir/t.json: directory /nonexistent-dir does not exist"]),
]


@pytest.mark.parametrize("flags, needles", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_combinations_one_clear_error(flags: tuple[str, ...], needles: list[str]) -> None:
    with pytest.raises(bm.ConfigError) as e:
        plugin_config(*flags)
    msg = str(e.value)
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    assert not FOREIGN_FLAGS.search(msg), f"message uses `bfpp schedule` flags: {msg}"
    assert "\n" not in msg


def test_tensor_parallel_validation_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Megatron's TP checks read the GPU architecture and CUDA_DEVICE_MAX_CONNECTIONS."""
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    cfg = plugin_config(*VIRTUAL, "--global-batch-size", "8", "--tensor-model-parallel-size", "2",
                        "--pipeline-schedule", "breadth-first", world=16)
    assert (cfg.pp, cfg.vp, cfg.train_microbatches) == (4, 2, (4,))


def test_messages_use_megatron_flag_names() -> None:
    from megatron_bfpp.schedule import ScheduleError, build

    for args in [("breadth-first", 4, 1, 8, None), ("interleaved-1f1b", 4, 2, 2, None),
                 ("interleaved-1f1b", 4, 2, 8, 3), ("breadth-first", 4, 2, 8, 9), ("1f1b", 4, 2, 8, None),
                 ("1f1b", 4, 1, 8, 2)]:
        with pytest.raises(ScheduleError) as e:
            build(*args)
        assert not FOREIGN_FLAGS.search(bm.megatron_flag_text(str(e.value))), str(e.value)


def test_validate_requires_plugin_flags_and_megatron_validation() -> None:
    with pytest.raises(bm.ConfigError, match="extra_args_provider=megatron_bfpp.megatron.add_arguments"):
        bm.validate_args(argparse.Namespace(pipeline_model_parallel_size=2))
    with pytest.raises(bm.ConfigError, match="validate_args first"):
        bm.validate_args(argparse.Namespace(pipeline_schedule="breadth-first", data_parallel_size=None))


# ---------------------------------------------------------------------------------------------- install

def _args(*flags: str) -> argparse.Namespace:
    return parse_megatron_args([*TINY, *flags], WORLD)


class FakeFactory:
    """Stands in for megatron_bfpp.runtime.get_forward_backward_func and records the options it got."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, schedule):
        self.calls.append(dict(pipeline_schedule=schedule.kind, microbatch_group_size=schedule.group_size,
                               weight_buffers=schedule.weight_buffers, grad_buffers=schedule.grad_buffers))
        return lambda **kw: ("ran", kw)


def test_install_rebinds_schedule_and_uninstall_restores(restore, monkeypatch: pytest.MonkeyPatch) -> None:
    training = restore
    original = training.get_forward_backward_func
    fake = FakeFactory()
    monkeypatch.setattr("megatron_bfpp.runtime.get_forward_backward_func", fake)
    cfg = bm.install(_args(*VIRTUAL, "--global-batch-size", "16", "--pipeline-schedule", "breadth-first",
                           "--microbatch-group-size-per-virtual-pipeline-stage", "4"))
    assert bm.is_installed() and bm.installed_config() == cfg
    getter = training.get_forward_backward_func
    assert getter is not original and getter.__wrapped__ is original
    fb = getter(schedule_pg_collection=None)  # 0.19 train()/evaluate()
    assert fb(num_microbatches=3)[0] == "ran"
    getter()  # 0.16 train()/evaluate()
    getter(pp_size=4, vp_size=2)
    assert fake.calls == [dict(pipeline_schedule="breadth-first", microbatch_group_size=4, weight_buffers=2,
                               grad_buffers=2)] * 3
    assert training.DDP is restore.DDP  # no ZeRO-2/3: Megatron's own DDP and optimizer stay
    bm.install(_args(*VIRTUAL, "--global-batch-size", "16", "--pipeline-schedule", "interleaved-1f1b"))
    assert training.get_forward_backward_func.__wrapped__ is original  # re-install replaces, never stacks
    bm.uninstall()
    assert training.get_forward_backward_func is original and not bm.is_installed()


def test_split_schedule_on_transformer_engine_layers_without_delay_says_w_has_no_work(restore, capsys) -> None:
    """Without a TransformerEngine that can delay weight gradients (none here) its layers run their whole
    backward at I: installing a split-backward schedule with them says so, why, and what ZeRO-2/3 then hold;
    local layers and fused schedules get no note."""
    from types import SimpleNamespace

    from megatron_bfpp.megatron.install import split_backward_note

    args = _args(*VIRTUAL, "--global-batch-size", "16", "--pipeline-schedule", "interleaved-zb")
    args.transformer_impl = "transformer_engine"
    bm.install(args)
    out = capsys.readouterr().out
    assert "W's carry no work" in out and "TransformerEngine >= 2.7.0" in out and "found none" in out, out
    assert "ZeRO" not in out and "--transformer-impl local" in out and not args.delay_wgrad_compute
    assert "under ZeRO-2" in split_backward_note(args, SimpleNamespace(pipeline_schedule="interleaved-zb",
                                                                       zero_stage=2))
    args.transformer_impl = "local"
    assert split_backward_note(args, bm.install(args)) is None
    args.transformer_impl = "transformer_engine"
    args.pipeline_schedule = "breadth-first"
    assert split_backward_note(args, bm.install(args)) is None


@pytest.mark.parametrize("zero, flags, noted", [
    ("3", ["--fp8-format", "hybrid"], "about 2 bytes"), ("3", ["--fp4-format", "e2m1"], "about 1 byte"),
    ("2", ["--fp8-format", "hybrid"], None), ("3", [], None)])
def test_zero3_with_fp8_says_transformer_engine_keeps_weight_copies(restore, monkeypatch, capsys, zero: str,
                                                                   flags: list[str], noted: str | None) -> None:
    """ZeRO-3 under FP8 / FP4: the start-up message says TransformerEngine keeps quantized weight copies beside the
    shards, how much, until when, and where the memory stats count them; ZeRO-1/2 (resident weights, copies as
    in stock) and bf16 say nothing."""
    from megatron.training import arguments

    monkeypatch.setattr(arguments, "is_te_min_version", lambda version: True)  # --fp4-format checks for TE
    bm.install(_args(*VIRTUAL, "--global-batch-size", "16", "--pipeline-schedule", "breadth-first", "--zero-stage", zero,
                     *flags))
    out = capsys.readouterr().out
    if noted is None:
        assert "weight cop" not in out, out
        return
    fmt = flags[0]
    assert f"note: {fmt} with --zero-stage 3: TransformerEngine keeps" in out and noted in out, out
    assert "last RELEASE" in out and "fp8_weight_copy_bytes" in out, out


@pytest.mark.parametrize("version, flags, blocked", [
    ("2.7.0", {}, None), ("2.3.0", {}, ">= 2.7.0"), ("2.6.0", {"gradient_accumulation_fusion": True}, ">= 2.7.0"),
    ("2.6.0", {"gradient_accumulation_fusion": False}, ">= 2.7.0"),
    ("2.7.1", {"overlap_grad_reduce": True}, ">= 2.8.0"), ("2.10.0", {"tp_comm_overlap": True}, "--tp-comm-overlap"),
    ("2.10.0", {"overlap_grad_reduce": True, "gradient_accumulation_fusion": False}, None),
])
def test_transformer_engine_delayed_wgrad_requirements(monkeypatch, version, flags, blocked) -> None:
    """TransformerEngine >= 2.7 for delay_wgrad_compute, fused or not (2.3-2.6 have no weight-gradient hooks:
    biases would never reach main_grad), and Megatron-LM's own >= 2.8 with overlap_grad_reduce."""
    install = importlib.import_module("megatron_bfpp.megatron.install")

    monkeypatch.setattr(install, "_te_version", lambda: version)
    args = _args(*VIRTUAL, "--global-batch-size", "16", "--pipeline-schedule", "interleaved-zb")
    vars(args).update(transformer_impl="transformer_engine", **flags)
    reason = install.te_delayed_wgrad_blocker(args)
    assert (reason is None) if blocked is None else (blocked in reason), reason


def test_install_refuses_delayed_wgrads_on_transformer_engine_before_2_7(restore, monkeypatch, capsys) -> None:
    """TransformerEngine 2.3-2.6 with gradient-accumulation fusion: a split schedule does not build its layers with
    delay_wgrad_compute (their biases would never train), and --delay-wgrad-compute given by hand is refused with
    one error naming the flag and the fix, before anything is rebound."""
    from megatron_bfpp.megatron.validation import ConfigError

    install = importlib.import_module("megatron_bfpp.megatron.install")

    monkeypatch.setattr(install, "_te_version", lambda: "2.6.0")
    args = _args(*VIRTUAL, "--global-batch-size", "16", "--pipeline-schedule", "interleaved-zb")
    vars(args).update(transformer_impl="transformer_engine", gradient_accumulation_fusion=True)
    bm.install(args)
    assert not args.delay_wgrad_compute and "TransformerEngine >= 2.7.0" in capsys.readouterr().out
    bm.uninstall()
    args.delay_wgrad_compute = True
    with pytest.raises(ConfigError, match=r"--delay-wgrad-compute: .*>= 2\.7\.0.*Upgrade TransformerEngine, or drop "
                                          r"--delay-wgrad-compute"):
        bm.install(args)
    assert not bm.is_installed()
    monkeypatch.setattr(install, "_te_version", lambda: "2.7.0")
    bm.install(args)  # recent enough: the flag stands
    assert args.delay_wgrad_compute


def test_split_schedule_builds_transformer_engine_layers_with_delayed_wgrads(restore, monkeypatch, capsys) -> None:
    """With a TransformerEngine that can delay them, the install sets delay_wgrad_compute for the model and DDP
    configs Megatron-LM builds from args (Megatron's dense-model check on the flag is lifted while installed);
    uninstall puts both back. Fused schedules and local layers leave them alone."""
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.training.training import get_megatron_ddp_config

    install = importlib.import_module("megatron_bfpp.megatron.install")

    monkeypatch.setattr(install, "_te_version", lambda: "2.8.0")

    def dense_config() -> TransformerConfig:
        return TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=1, delay_wgrad_compute=True)

    with pytest.raises(AssertionError, match="overlap_moe_expert_parallel_comm"):
        dense_config()
    args = _args(*VIRTUAL, "--global-batch-size", "16", "--pipeline-schedule", "interleaved-zb")
    args.transformer_impl = "transformer_engine"
    bm.install(args)
    assert "built with delay_wgrad_compute" in capsys.readouterr().out
    assert args.delay_wgrad_compute and get_megatron_ddp_config(args).delay_wgrad_compute
    assert dense_config().delay_wgrad_compute
    bm.install(args)  # installing again wraps Megatron's check once, not the previous wrapper
    assert TransformerConfig.__post_init__._bfpp_original.__qualname__ == "TransformerConfig.__post_init__"
    bm.uninstall()
    assert not args.delay_wgrad_compute
    with pytest.raises(AssertionError, match="overlap_moe_expert_parallel_comm"):
        dense_config()
    for impl, schedule in (("local", "interleaved-zb"), ("transformer_engine", "breadth-first")):
        vars(args).update(transformer_impl=impl, pipeline_schedule=schedule)
        bm.install(args)
        assert not args.delay_wgrad_compute and not hasattr(TransformerConfig.__post_init__, "_bfpp_original")
        bm.uninstall()


def test_install_uses_the_real_runtime(restore) -> None:
    """The rebound getter returns the plugin runtime's function, with Megatron-Core's keyword signature."""
    import inspect

    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    bm.install(_args(*VIRTUAL, "--global-batch-size", "16", "--pipeline-schedule", "breadth-first"))
    fb = restore.get_forward_backward_func(schedule_pg_collection=None)
    ours = inspect.signature(fb).parameters
    megatrons = inspect.signature(forward_backward_no_pipelining).parameters
    assert set(megatrons) <= set(ours), set(megatrons) - set(ours)


def test_install_default_schedule_rebinds_nothing(restore) -> None:
    cfg = bm.install(_args(*VIRTUAL, "--global-batch-size", "8"))
    assert not cfg.uses_runtime and not bm.is_installed()


def test_install_is_atomic_when_a_replacement_is_missing(restore, monkeypatch: pytest.MonkeyPatch) -> None:
    training = restore
    original = training.get_forward_backward_func
    monkeypatch.setitem(sys.modules, "megatron_bfpp.megatron.sharded_compat", None)  # import fails
    monkeypatch.delattr(bm, "sharded_compat", raising=False)  # also when an earlier test imported it
    with pytest.raises(ImportError, match="megatron_bfpp.megatron.sharded_compat"):
        bm.install(_args(*VIRTUAL, "--global-batch-size", "8", "--pipeline-schedule", "breadth-first",
                         "--zero-stage", "3"))
    assert training.get_forward_backward_func is original and not bm.is_installed()


def test_install_zero3_rebinds_wrapper_optimizer_finalize(restore) -> None:
    compat_mod = pytest.importorskip("megatron_bfpp.megatron.sharded_compat")
    from megatron.training.models import dist_utils

    from megatron_bfpp.sharded.finalize import finalize_model_grads

    training = restore
    before_dist = dist_utils.DistributedDataParallel
    bm.install(_args(*VIRTUAL, "--global-batch-size", "8", "--pipeline-schedule", "breadth-first", "--zero-stage", "3"))
    assert issubclass(training.DDP, compat_mod.DistributedDataParallel)
    assert dist_utils.DistributedDataParallel is training.DDP
    assert training.get_megatron_optimizer is compat_mod.get_megatron_optimizer
    assert training.finalize_model_grads is finalize_model_grads
    bm.uninstall()
    assert dist_utils.DistributedDataParallel is before_dist


def test_bind_zero_stage() -> None:
    from megatron_bfpp.megatron.install import bind_zero_stage

    class Takes:
        def __init__(self, config, ddp_config, module, *, zero_stage=None):
            self.zero_stage = zero_stage

    class Ignores:
        def __init__(self, config, ddp_config, module):
            pass

    bound = bind_zero_stage(Takes, 3)
    assert bound(None, None, None).zero_stage == 3 and bound(None, None, None, zero_stage=2).zero_stage == 2
    assert isinstance(bound(None, None, None), Takes) and bound.__name__ == "Takes"
    assert bind_zero_stage(Ignores, 3) is Ignores


def test_unsupported_megatron_fails_loudly(restore, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(restore, "get_forward_backward_func")
    with pytest.raises(compat.UnsupportedMegatronError) as e:
        bm.install(_args(*VIRTUAL, "--global-batch-size", "8", "--pipeline-schedule", "breadth-first"))
    assert "lacks megatron.training.training.get_forward_backward_func" in str(e.value)
    assert "0.19.x" in str(e.value) and not bm.is_installed()
    monkeypatch.undo()

    def newer_getter(pp_size=None, vp_size=None, schedule_pg_collection=None, new_option=None):
        return None

    with pytest.raises(compat.UnsupportedMegatronError, match="takes new_option"):
        compat.check_forward_backward_getter(newer_getter)


def test_supported_version_detected() -> None:
    version = bm.megatron_core_version()
    assert compat.version_tuple(version) == (0, 19) and compat.is_supported(version)
    assert not compat.is_supported("0.12.0") and compat.is_supported("0.16.1")


def test_multi_module_pipelines_refused(restore, monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.core.process_groups_config import MultiModuleProcessGroupCollection

    monkeypatch.setattr("megatron_bfpp.runtime.get_forward_backward_func", FakeFactory())
    bm.install(_args(*VIRTUAL, "--global-batch-size", "8", "--pipeline-schedule", "breadth-first"))
    with pytest.raises(NotImplementedError, match="multi-module"):
        restore.get_forward_backward_func(schedule_pg_collection=MultiModuleProcessGroupCollection.__new__(
            MultiModuleProcessGroupCollection))


# ----------------------------------------------------------------------------- argument hooks and script runner

def test_hooked_parsing_accepts_flags_and_installs(restore, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from megatron.training import arguments
    from megatron.training.global_vars import unset_global_variables

    names = bm.hook_argument_parsing()
    assert {"megatron.training.arguments.parse_args", "megatron.training.arguments.validate_args"} <= set(names)
    monkeypatch.setenv("WORLD_SIZE", str(WORLD))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *TINY, *VIRTUAL, "--global-batch-size", "8",
                                      "--pipeline-schedule", "breadth-first"])
    try:
        args = arguments.parse_and_validate_args()  # the unmodified script passes no plugin provider
    finally:
        unset_global_variables()
    assert args.pipeline_schedule == "breadth-first" and bm.installed_config().vp == 2
    assert restore.get_forward_backward_func.bfpp_config.pipeline_schedule == "breadth-first"
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *TINY, "--global-batch-size", "8",
                                      "--pipeline-schedule", "breadth-first"])
    with pytest.raises(SystemExit) as e:
        try:
            arguments.parse_and_validate_args()
        finally:
            unset_global_variables()
    assert e.value.code == 2
    assert "megatron_bfpp: error: --pipeline-schedule breadth-first needs virtual stages" in capsys.readouterr().err


def test_install_after_validation_for_scripts_with_their_own_provider(restore, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the core_v0.16.1 patch uses: only validation is hooked; the script passes the provider itself."""
    from megatron.training import arguments
    from megatron.training.global_vars import unset_global_variables

    parse_before = arguments.parse_args
    names = bm.install_after_validation()
    assert "megatron.training.arguments.validate_args" in names and arguments.parse_args is parse_before
    monkeypatch.setenv("WORLD_SIZE", str(WORLD))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *TINY, *VIRTUAL, "--global-batch-size", "16",
                                      "--pipeline-schedule", "interleaved-1f1b"])
    try:
        arguments.parse_and_validate_args(extra_args_provider=bm.extra_args_provider(None))
    finally:
        unset_global_variables()
    cfg = bm.installed_config()
    assert (cfg.pipeline_schedule, cfg.train_microbatches) == ("interleaved-1f1b", (8,))


FAKE_SCRIPT = '''
from helper_next_to_script import MARK  # the script runner puts the script's directory on sys.path
from megatron.training.arguments import parse_and_validate_args
from megatron.training import training
args = parse_and_validate_args(args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
print("SCRIPT", __name__, MARK, training.get_forward_backward_func.bfpp_config.pipeline_schedule, args.zero_stage)
'''


def _launch(script: Path, *flags: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, WORLD_SIZE=str(WORLD), RANK="0", PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "megatron_bfpp.run_megatron_script", str(script), *flags],
                          capture_output=True, text=True, env=env, cwd=cwd, timeout=120)


@pytest.mark.timeout(150)
def test_script_runner_runs_unmodified_script(subprocesses, tmp_path: Path) -> None:
    (tmp_path / "helper_next_to_script.py").write_text("MARK = 'helper-ok'\n")
    script = tmp_path / "pretrain_fake.py"
    script.write_text(FAKE_SCRIPT)
    r = _launch(script, *TINY, *VIRTUAL, "--global-batch-size", "8", "--pipeline-schedule", "breadth-first",
                "--use-distributed-optimizer", cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "SCRIPT __main__ helper-ok breadth-first None" in r.stdout
    assert "megatron_bfpp: installed pipeline schedule breadth-first (P=4, V=2, M=4) on megatron-core" in r.stdout


def test_script_runner_usage_errors(tmp_path: Path) -> None:
    from megatron_bfpp import run_megatron_script

    assert run_megatron_script.main([]) == 2
    assert run_megatron_script.main([str(tmp_path / "missing.py")]) == 2
    assert run_megatron_script.main(["--help"]) == 0


# ------------------------------------------------- Megatron-LM's train_step driving the plugin (4 gloo ranks)

E2E = ("--num-layers 4 --hidden-size 16 --num-attention-heads 2 --seq-length 16 --max-position-embeddings 16 "
       "--micro-batch-size 1 --global-batch-size 8 --train-iters 3 --lr 1e-2 --lr-decay-style constant "
       "--weight-decay 0 --hidden-dropout 0 --attention-dropout 0 --seed 11 --vocab-size 128 --mock-data "
       "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 --log-interval 100 "
       "--pipeline-schedule breadth-first --zero-stage 3").split()
E2E_ITERS = 3


def _cpu_model_parallel_reductions(training):
    """train_step's two model-parallel reductions allocate on torch.cuda.current_device(); the same on CPU.
    (Test-only; on GPU Megatron runs unmodified.)"""
    import torch
    import torch.distributed as dist

    def reduce_max_stat(stat, group=None):
        t = torch.tensor([-1.0 if stat is None else stat], dtype=torch.float32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return None if t.item() == -1.0 else t.item()

    def logical_and(value, group=None):
        t = torch.tensor([1 if value is True else 0], dtype=torch.int)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        return bool(t.item())

    for name, fn in (("reduce_max_stat_across_model_parallel_group", reduce_max_stat),
                     ("logical_and_across_model_parallel_group", logical_and)):
        assert "torch.cuda.current_device()" in __import__("inspect").getsource(getattr(training, name)), name
        setattr(training, name, fn)


def _full_params(trainer) -> dict:
    import contextlib

    from megatron_bfpp.train.model import global_named_parameters

    with contextlib.ExitStack() as stack:
        for c in trainer.model:
            stack.enter_context(c.full_params())
        return {n: p.detach().clone() for n, p in global_named_parameters(trainer.model, trainer.pp_rank, trainer.pp).items()}


def _train_step_worker(rank: int, world: int, timeline: str) -> dict:
    import copy

    import torch.distributed as dist

    from megatron_bfpp.train import parallel
    from megatron_bfpp.train.data import gpt_forward_step
    from megatron_bfpp.train import Trainer
    from megatron_bfpp.train.config import parse_trainer_args

    dist.init_process_group("gloo", rank=rank, world_size=world)
    args = parse_trainer_args(E2E, world_size=world)

    # The plugin's own path: its trainer's step (runtime + ShardedDataParallel ZeRO-3 + sharded Adam).
    own = Trainer(args)
    own_losses = [own.train_step()[0] for _ in range(E2E_ITERS)]
    own_params = _full_params(own)
    parallel.destroy_parallel()

    # Megatron-LM's path: the same model, data and optimizer (same seeds), stepped by Megatron's train_step
    # through the name install() rebinds.
    from megatron.training import global_vars, training

    mine = Trainer(args)
    global_vars.set_global_variables(args, build_tokenizer=False)  # get_args/get_timers/get_num_microbatches
    _cpu_model_parallel_reductions(training)
    # The wrappers and optimizer are built above (as Megatron's get_model/get_megatron_optimizer would with
    # --zero-stage); install() here rebinds the schedule, with --timeline recording.
    schedule_args = copy.copy(args)
    schedule_args.zero_stage, schedule_args.timeline = None, timeline
    from megatron_bfpp.megatron import install, uninstall

    install(schedule_args)
    try:
        forward_backward = training.get_forward_backward_func(schedule_pg_collection=None)
        megatron_losses, grad_norms = [], []
        for it in range(E2E_ITERS):
            out = training.train_step(gpt_forward_step, mine.data_iterators, mine.model, mine.optimizer,
                                      mine.scheduler, mine.config, forward_backward, iteration=it)
            loss_dict, skipped, _, should_exit, _, grad_norm = out[:6]
            assert skipped == 0 and not should_exit
            megatron_losses.append(float(loss_dict["lm loss"]) if loss_dict else None)
            grad_norms.append(grad_norm)
    finally:
        uninstall()
        global_vars.unset_global_variables()
    return {"rank": rank, "pp_rank": mine.pp_rank, "last_stage": mine.is_last_stage, "own_losses": own_losses,
            "megatron_losses": megatron_losses, "grad_norms": grad_norms, "own_params": own_params,
            "megatron_params": _full_params(mine)}


@pytest.mark.timeout(600)
def test_megatron_train_step_matches_plugin_trainer(run_distributed, tmp_path: Path) -> None:
    """P = 2, V = 2, D = 2, breadth-first, ZeRO-3: three iterations of Megatron-LM's own train_step over the
    plugin's schedule and sharded optimizer give the losses and parameters of the plugin's trainer."""
    import torch

    from megatron_bfpp.megatron.timeline import merge
    from tests.support.distributed import run_distributed

    timeline = tmp_path / "timeline.json"
    results = run_distributed(_train_step_worker, 4, str(timeline), timeout=540)
    last = [r for r in results if r["last_stage"]]
    assert len(last) == 2  # D = 2 last-stage ranks report the loss
    for r in results:
        assert all(g is not None and g > 0 for g in r["grad_norms"])
        if r["last_stage"]:
            assert torch.allclose(torch.tensor(r["megatron_losses"], dtype=torch.float64),
                                  torch.tensor(r["own_losses"], dtype=torch.float64), rtol=1e-5, atol=1e-6), r
            assert r["own_losses"][-1] < r["own_losses"][0]  # it trains
        else:
            assert r["megatron_losses"] == [None] * E2E_ITERS
        assert r["own_params"].keys() == r["megatron_params"].keys()
        for name, p in r["own_params"].items():
            torch.testing.assert_close(r["megatron_params"][name], p, rtol=1e-5, atol=1e-6, msg=name)
    # --timeline: every rank recorded the training iterations; merged into one Chrome trace.
    path, n = merge(timeline)
    assert n == 4
    from megatron_bfpp.trace.chrome import load_chrome_trace

    events = load_chrome_trace(path)
    assert {e.rank for e in events} == {0, 1, 2, 3}
    assert {e.iteration for e in events} == set(range(E2E_ITERS))
    assert {"F", "B", "GATHER", "REDUCE", "STEP"} <= {e.op for e in events}
    # The optimizer records each iteration's step boundary after the schedule (Megatron's optimizer.step()); the
    # rank file is rewritten with it at the next forward_backward call, so every iteration but the last has it.
    steps = {(e.rank, e.iteration) for e in events if e.op == "STEP"}
    assert {(r, i) for r in range(4) for i in range(E2E_ITERS - 1)} <= steps


def test_timeline_recorder_records_training_calls_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_bfpp.megatron.timeline import TimelineRecorder, merge, rank_file
    from megatron_bfpp.runtime import runtime_state

    monkeypatch.setenv("RANK", "3")
    # Other tests may leave a one-process group initialised in this interpreter: take the rank from RANK.
    monkeypatch.setattr("megatron_bfpp.megatron.timeline._global_rank", lambda: 3)
    seen = []

    def fake_forward_backward(**kwargs):
        rec = runtime_state.recorder
        seen.append((kwargs.get("forward_only", False), None if rec is None else rec.iteration))
        return []

    path = tmp_path / "tl.json"
    wrapped = TimelineRecorder(str(path), iterations=2).wrap(fake_forward_backward)
    for forward_only in (False, True, False, False):
        wrapped(forward_only=forward_only)
    assert seen == [(False, 0), (True, None), (False, 1), (False, None)]  # evaluation and later steps unrecorded
    assert rank_file(path, 3) == tmp_path / "tl.rank3.json" and rank_file(path, 3).is_file()
    assert runtime_state.recorder is None
    with pytest.raises(FileNotFoundError, match="no rank files"):
        merge(tmp_path / "other.json")


def _gathered_checkpoint_worker(rank: int, world: int) -> dict:
    """ZeRO-3 chunk on a one-rank world: Megatron-LM's save/load, as rebound by install(), see full weights."""
    import torch
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallelConfig
    from types import SimpleNamespace

    from megatron_bfpp.megatron.install import with_gathered_params
    from megatron_bfpp.sharded import ShardedDataParallel

    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 3)
    expected = {k: v.detach().clone() for k, v in module.state_dict().items()}
    chunk = ShardedDataParallel(SimpleNamespace(), DistributedDataParallelConfig(), module,
                                pg_collection=SimpleNamespace(dp_cp=dist.new_group([0])), zero_stage=3)
    seen = {}

    def save_checkpoint(iteration, model, optimizer, scheduler):
        seen["saved"] = {k: v.detach().clone() for k, v in model[0].module.state_dict().items()}

    def load_checkpoint(ddp_model, optimizer, scheduler):
        with torch.no_grad():
            ddp_model[0].module.weight.fill_(2.0)
        return 7, 0

    at_rest = module.weight.untyped_storage().size()
    with_gathered_params(save_checkpoint, writeback=False)(1, [chunk], None, None)
    assert with_gathered_params(load_checkpoint, writeback=True)([chunk], None, None) == (7, 0)
    after_rest = module.weight.untyped_storage().size()
    with chunk.full_params():
        loaded = module.weight.detach().clone()
    return {"expected": expected, "saved": seen["saved"], "at_rest": at_rest, "after_rest": after_rest,
            "loaded": loaded}


def test_zero3_checkpoint_calls_see_gathered_weights_and_load_writes_back(run_distributed):
    import torch

    from tests.support.distributed import run_distributed

    out = run_distributed(_gathered_checkpoint_worker, 1)[0]
    assert out["at_rest"] == 0 and out["after_rest"] == 0  # sharded at rest before and after
    for k, v in out["expected"].items():
        torch.testing.assert_close(out["saved"][k], v)
    assert torch.equal(out["loaded"], torch.full((3, 4), 2.0))
