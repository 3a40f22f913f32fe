"""Megatron-LM flags whose TransformerEngine weight-gradient handling clashes with the plugin's schedule are refused
at argument validation (before any process group exists: `install()`, which Megatron-LM's validate_args reaches
through the argument hooks) and by `python -m megatron_bfpp.megatron.check`, each with one message naming the flag
and the fix:

- --use-transformer-engine-op-fuser under the split-backward schedules, where the plugin builds TransformerEngine
  (>= 2.7) layers with delay_wgrad_compute: the op fuser's MLP never runs the forward of the layers whose queued
  GEMMs W pops ("Pop empty queue").
- --overlap-dispatch-backward-with-experts-wgrad under the plugin's schedules: Megatron pops the experts' queue
  inside the backward, and the plugin's W (or the backward_dw after a B) pops it again. Megatron's own refusal of
  this flag beside delay_wgrad_compute (TransformerConfig.__post_init__) survives the plugin's install, which
  hides delay_wgrad_compute from Megatron's other check of it.
"""

from __future__ import annotations

import importlib

import megatron.training.arguments  # noqa: F401  at collection: importing it can start a process (a unit test may not)
import pytest

import megatron_bfpp.megatron as bm
from megatron_bfpp.megatron import check
from megatron_bfpp.megatron.check import parse_megatron_args
from megatron_bfpp.megatron.validation import ConfigError
from megatron_bfpp.schedule.kinds import SPLIT_BACKWARD_SCHEDULES

install = importlib.import_module("megatron_bfpp.megatron.install")

TINY = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "1", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "128", "--train-iters", "10", "--lr", "1e-3", "--mock-data",
        "--pipeline-model-parallel-size", "4", "--global-batch-size", "16"]
WORLD = 8  # P = 4, data-parallel size 2: M = 8
OP_FUSER = "--use-transformer-engine-op-fuser"
OVERLAP = "--overlap-dispatch-backward-with-experts-wgrad"


def _layout(schedule: str) -> list[str]:
    """V = 2 (8 layers / P = 4, one per virtual stage) except for the V = 1 schedules."""
    return [] if schedule in ("zb-h1", "1f1b", "gpipe", "default") else ["--num-layers-per-virtual-pipeline-stage", "1"]


def _flags(schedule: str, *extra: str) -> list[str]:
    return [*TINY, *_layout(schedule), "--pipeline-schedule", schedule, *extra]


@pytest.fixture
def te(monkeypatch):
    """The TransformerEngine version the plugin sees (none is installed here)."""

    def set_version(version: str | None) -> None:
        monkeypatch.setattr(install, "_te_version", lambda: version)

    set_version("2.8.0")
    yield set_version
    bm.uninstall()


@pytest.mark.parametrize("schedule", SPLIT_BACKWARD_SCHEDULES)
def test_op_fuser_refused_under_split_backward_with_delayed_te_layers(te, schedule, capsys) -> None:
    """TransformerEngine >= 2.7 (layers built with delay_wgrad_compute): one error naming the flag and the fix,
    from install (nothing rebound) and from the check command."""
    flags = _flags(schedule, OP_FUSER)
    args = parse_megatron_args(flags, WORLD)
    assert args.transformer_impl == "transformer_engine"
    with pytest.raises(ConfigError) as e:
        bm.install(args)
    assert not bm.is_installed() and not args.delay_wgrad_compute
    msg = str(e.value)
    assert msg.startswith(f"{OP_FUSER} with --pipeline-schedule {schedule}: "), msg
    assert "Pop empty queue" in msg and f"drop {OP_FUSER}" in msg, msg
    assert "breadth-first" in msg and "interleaved-1f1b" in msg, msg
    assert check.main(["--world-size", str(WORLD), "--", *flags]) == 2
    err = capsys.readouterr().err
    assert f"megatron_bfpp: error: {OP_FUSER} with --pipeline-schedule {schedule}" in err, err


@pytest.mark.parametrize("schedule, version, impl", [
    ("breadth-first", "2.8.0", "transformer_engine"),  # no split backward: no delay
    ("interleaved-1f1b", "2.10.0", "transformer_engine"),
    ("interleaved-zb", "2.6.0", "transformer_engine"),  # TransformerEngine too old to delay: W has no TE work
    ("interleaved-zb", None, "transformer_engine"),
    ("breadth-first-zb", "2.8.0", "local"),  # no TransformerEngine layers to delay
    ("default", "2.8.0", "transformer_engine"),
])
def test_op_fuser_accepted_where_nothing_is_delayed(te, schedule, version, impl) -> None:
    te(version)
    flags = _flags(schedule, OP_FUSER, "--transformer-impl", impl)
    assert check.check(flags, WORLD).pipeline_schedule == schedule
    bm.install(parse_megatron_args(flags, WORLD))


@pytest.mark.parametrize("schedule, version", [(s, "2.8.0") for s in SPLIT_BACKWARD_SCHEDULES]
                         + [("interleaved-zb", "2.6.0"), ("breadth-first", "2.8.0"), ("interleaved-1f1b", "2.8.0")])
def test_overlap_dispatch_backward_with_experts_wgrad_refused_under_the_plugins_schedules(te, schedule, version,
                                                                                          capsys) -> None:
    """Megatron pops the experts' queued GEMMs inside the backward (the flag alone makes TEGroupedLinear queue
    them), and every plugin schedule pops each TransformerEngine layer's queue itself: refused by name, with the
    fix, before anything is rebound; the check command reports it."""
    te(version)
    flags = _flags(schedule, OVERLAP)
    args = parse_megatron_args(flags, WORLD)
    with pytest.raises(ConfigError) as e:
        bm.install(args)
    msg = str(e.value)
    assert msg.startswith(f"{OVERLAP} with --pipeline-schedule {schedule}: "), msg
    assert "Pop empty queue" in msg and f"drop {OVERLAP}" in msg and "--pipeline-schedule default" in msg, msg
    assert not bm.is_installed() and not args.delay_wgrad_compute
    assert check.main(["--world-size", str(WORLD), "--", *flags]) == 2
    assert f"megatron_bfpp: error: {OVERLAP}" in capsys.readouterr().err


def test_overlap_dispatch_backward_with_experts_wgrad_accepted_under_default(te) -> None:
    assert not bm.validate_args(parse_megatron_args(_flags("default", OVERLAP), WORLD)).uses_runtime


def test_install_keeps_megatrons_refusal_of_delay_beside_overlap_dispatch(te, monkeypatch) -> None:
    """The installed TransformerConfig.__post_init__ hides delay_wgrad_compute from Megatron's checks (which tie
    it to overlap_moe_expert_parallel_comm), but still refuses it beside
    overlap_dispatch_backward_with_experts_wgrad, as Megatron's own check does."""
    from megatron.core.transformer import transformer_config
    from megatron.core.transformer.transformer_config import TransformerConfig

    monkeypatch.setattr(transformer_config, "is_te_min_version", lambda *a, **k: True)  # the flag needs TE >= 2.3

    def config(**kw) -> TransformerConfig:
        return TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=1, **kw)

    both = dict(delay_wgrad_compute=True, overlap_dispatch_backward_with_experts_wgrad=True)
    with pytest.raises(AssertionError, match="overlap_moe_expert_parallel_comm must be enabled"):
        config(**both)  # Megatron: its first check of delay_wgrad_compute
    args = parse_megatron_args(_flags("interleaved-zb"), WORLD)
    bm.install(args)
    assert args.delay_wgrad_compute and hasattr(TransformerConfig.__post_init__, "_bfpp_original")
    assert config(delay_wgrad_compute=True).delay_wgrad_compute  # the plugin's lift
    assert config(overlap_dispatch_backward_with_experts_wgrad=True).overlap_dispatch_backward_with_experts_wgrad
    with pytest.raises(AssertionError, match="delay_wgrad_compute and overlap_dispatch_backward_with_experts_wgrad "
                                             "are mutually exclusive"):
        config(**both)
