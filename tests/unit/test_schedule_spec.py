"""`ScheduleSpec` (one value for every schedule setting) and the registry of schedule kinds (`schedule.kinds`).

The spec is the runtime's and the simulator's cache key and the runtime's handshake fingerprint; the registry
drives `build()`, the name tuples and every flag's choices, so a new kind or a new setting is added in one place.
"""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from megatron_bfpp.megatron import sim_cli
from megatron_bfpp.megatron.flags import PIPELINE_SCHEDULES, add_arguments
from megatron_bfpp.runtime import forward_backward as fb
from megatron_bfpp.runtime.executor import PipelineError
from megatron_bfpp.runtime.state import RuntimeState
from megatron_bfpp.schedule import (
    GROUPED_SCHEDULES, KINDS, SCHEDULE_NAMES, SPLIT_BACKWARD_SCHEDULES, Op, ScheduleError, ScheduleKind, ScheduleSpec,
    build, builders, make_schedule,
)
from megatron_bfpp.schedule import cli as schedule_cli
from megatron_bfpp.schedule.kinds import megatron_kind
from megatron_bfpp.sim import Config, check_config, get_hardware, get_model
from megatron_bfpp.sim.planner import _group_sizes
from megatron_bfpp.sim.predict import built_schedule, cached_schedule, config_dict, schedule_for
from megatron_bfpp.train.config import trainer_args_provider

SPEC = ScheduleSpec("breadth-first", 2, 2, 4, zero_stage=3)
# The handshake's names of the fields, in its order (its error says e.g. "M 4 vs 3").
LABELS = ("schedule", "P", "V", "M", "group size", "ZeRO stage", "forward-only", "weight buffers", "grad buffers",
          "W needs weights", "I writes gradients", "optimizer step", "pairing")


def _choices(parser: argparse.ArgumentParser, flag: str) -> set[str]:
    return set(parser._option_string_actions[flag].choices)


def _other(value: object) -> object:
    """A value of the same kind that differs from `value`."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, str):
        return value + "-other"
    return 1  # None


# ------------------------------------------------------------------------------------------- the spec

def test_equal_specs_are_one_cache_entry() -> None:
    twin = ScheduleSpec("breadth-first", 2, 2, 4, zero_stage=3)
    assert twin == SPEC and twin is not SPEC and hash(twin) == hash(SPEC)
    assert len({SPEC, twin, dataclasses.replace(SPEC, zero_stage=2)}) == 2
    for cache in (fb._cached_schedule, cached_schedule):
        cache.cache_clear()
        assert cache(SPEC) is cache(twin)
        assert (cache.cache_info().misses, cache.cache_info().hits) == (1, 1)
    # The kind's default group size written in: the same schedule, the same key.
    assert SPEC.resolved() == dataclasses.replace(SPEC, group_size=4) and SPEC.resolved().resolved() == SPEC.resolved()
    assert ScheduleSpec("gpipe", 2, 1, 4).resolved().group_size is None


def test_order_is_shared_by_every_lowering() -> None:
    built_schedule.cache_clear()
    for zero in (1, 2, 3):
        cached_schedule(dataclasses.replace(SPEC, zero_stage=zero, weight_buffers=zero))
    assert built_schedule.cache_info().misses == 1
    assert SPEC.order_spec() == ScheduleSpec("breadth-first", 2, 2, 4)
    assert dataclasses.replace(SPEC, forward_only=True).order_spec().forward_only  # the order reads forward_only


def test_build_validates_and_lowers_as_make_schedule() -> None:
    lowered = SPEC.build()
    assert lowered.lowered and lowered.zero_stage == 3 and lowered.group_size == 4
    assert lowered.to_text() == make_schedule("breadth-first", 2, 2, 4, zero_stage=3).to_text()
    order = SPEC.build(lowered=False)
    assert not order.lowered and all(a.op in (Op.F, Op.B) for acts in order.ranks for a in acts)
    assert SPEC.lower(SPEC.order()).to_text() == lowered.to_text()


def test_fingerprint_covers_every_field() -> None:
    fields = dataclasses.fields(ScheduleSpec)
    base = SPEC.fingerprint()
    assert tuple(label for label, _ in base) == LABELS and len(base) == len(fields)
    for i, f in enumerate(fields):
        changed = dataclasses.replace(SPEC, **{f.name: _other(getattr(SPEC, f.name))}).fingerprint()
        assert [j for j, (a, b) in enumerate(zip(base, changed)) if a != b] == [i], f.name
    with pytest.raises(TypeError, match="integer form"):
        dataclasses.replace(SPEC, pp=2.0).fingerprint()  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True)
class _SpecWithLag(ScheduleSpec):
    """A spec that grew a setting, as a future one would: declared once, compared by the handshake."""

    w_lag: int = dataclasses.field(default=0, metadata={"label": "W lag"})


def test_handshake_compares_every_field_of_the_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    mine = _SpecWithLag("breadth-first", 2, 2, 4, w_lag=1)
    theirs = dataclasses.replace(mine, **{f.name: _other(getattr(mine, f.name)) for f in dataclasses.fields(mine)})
    rows = torch.tensor([[v for _, v in mine.fingerprint()], [v for _, v in theirs.fingerprint()]]).flatten()
    monkeypatch.setattr(fb.dist, "get_process_group_ranks", lambda group: [0, 1])
    monkeypatch.setattr(fb.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(fb.dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(fb.dist, "all_gather_into_tensor", lambda out, inp, group=None: out.copy_(rows))
    with pytest.raises(PipelineError, match="pipeline-parallel rank 1 runs a different schedule") as e:
        RuntimeState().handshake(mine, {"pipeline": object()}, torch.device("cpu"))
    diff = str(e.value).split("(", 1)[1]
    for (label, a), (_, b) in zip(mine.fingerprint(), theirs.fingerprint()):
        assert f"{label} {a} vs {b}" in diff
    assert "W lag 1 vs 2" in diff and len(mine.fingerprint()) == len(dataclasses.fields(mine))


# ------------------------------------------------------------------------------------------- the registry

def test_registry_is_every_name_and_flag_choice() -> None:
    names = set(KINDS)
    assert SCHEDULE_NAMES == tuple(KINDS)
    assert set(SPLIT_BACKWARD_SCHEDULES) == {n for n, k in KINDS.items() if k.split_backward}
    assert set(GROUPED_SCHEDULES) == {n for n, k in KINDS.items() if k.takes_group_size}
    megatron = argparse.ArgumentParser()
    add_arguments(megatron)
    assert _choices(megatron, "--pipeline-schedule") == set(PIPELINE_SCHEDULES)
    assert set(PIPELINE_SCHEDULES) == {"default"} | {n for n, k in KINDS.items() if k.megatron_choice}
    assert _choices(trainer_args_provider(argparse.ArgumentParser()), "--pipeline-schedule") == names
    assert _choices(schedule_cli.parser(), "--schedule") == names
    assert _choices(sim_cli.plan_parser(), "--pipeline-schedule") == names | {"default"}  # simulate: Megatron's flag
    assert (megatron_kind(1), megatron_kind(2)) == ("1f1b", "interleaved-1f1b")


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_build_follows_each_kinds_entry(name: str) -> None:
    kind = KINDS[name]
    for vp in (1, 2, 3):
        if kind.fits_stages(vp):
            sched = build(name, 2, vp, 4)
            assert sched.name == name and sched.vp == vp
            assert any(a.op == Op.I for acts in sched.ranks for a in acts) == kind.split_backward
            assert sched.group_size == kind.group_size_for(2, 4, None)
        else:
            with pytest.raises(ScheduleError, match="one stage per rank" if not kind.virtual_stages else "V >= 2"):
                build(name, 2, vp, 4)
    vp = 2 if kind.virtual_stages else 1
    if kind.takes_group_size:
        assert build(name, 2, vp, 4, 2).group_size == 2
    else:
        with pytest.raises(ScheduleError, match="does not apply"):
            build(name, 2, vp, 4, 2)
    with pytest.raises(ScheduleError, match="choose one of " + ", ".join(SCHEDULE_NAMES)):
        build(name + "-nope", 2, vp, 4)


def test_a_new_kind_is_one_entry_and_its_builder(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kind added to the registry builds, lowers and validates through build(), ScheduleSpec, the simulator
    and the planner, with its rules and default group size enforced by the same path."""
    got = []

    def reversed_groups(pp: int, vp: int, m: int, group_size: int, forward_only: bool):
        got.append(group_size)  # resolved from the entry's default before the builder runs
        order = builders.breadth_first(pp, vp, m, group_size, forward_only)
        return dataclasses.replace(order, name="bf-copy")

    monkeypatch.setitem(KINDS, "bf-copy", ScheduleKind(
        "bf-copy", reversed_groups, split_backward=False, virtual_stages=True, other_stages="gpipe",
        default_group_size=lambda pp, m: pp, sequential_groups=True))
    spec = ScheduleSpec("bf-copy", 2, 2, 6, zero_stage=3)
    sched = spec.build()
    assert sched.name == "bf-copy" and sched.lowered and got == [2] and spec.resolved().group_size == 2
    with pytest.raises(ScheduleError, match="bf-copy needs virtual stages"):
        build("bf-copy", 2, 1, 6)
    cfg = Config(1, 2, 2, 1, 1, 6, "bf-copy", 3, False)
    model, hw = get_model("gpt-1.3b"), get_hardware("dgx-a100")
    check_config(model, hw, cfg)
    with pytest.raises(ValueError, match="bf-copy needs at least 2 virtual stages"):
        check_config(model, hw, dataclasses.replace(cfg, vp=1))
    with pytest.raises(ValueError, match=r"must lie in \[1, M=6\]"):  # the builder's own rule
        check_config(model, hw, dataclasses.replace(cfg, group_size=7))
    assert schedule_for(cfg).name == "bf-copy"
    assert config_dict(cfg)["microbatch_group_size_per_vp_stage"] == 2
    assert _group_sizes("bf-copy", 2, 6, search=True) == [2, 6]
