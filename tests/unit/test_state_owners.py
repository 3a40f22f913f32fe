"""The owners of the plugin's per-process state: the runtime's `RuntimeState` (recorder, wait timeout, p2p objects,
agreed handshakes, last call) beside `ChannelGroups`, and the Megatron-LM `Installation` (rebound names and
configuration).

The runtime's collectives are answered in this process (a two-rank pipeline seen from rank 0), so no process group
is created; the install runs on the installed megatron-core with Megatron-LM's own argument parsing.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import megatron_bfpp.megatron as bm
from megatron_bfpp import runtime
from megatron_bfpp.megatron import compat
from megatron_bfpp.megatron.check import parse_megatron_args
from megatron_bfpp.runtime import forward_backward as fb
from megatron_bfpp.runtime import state
from megatron_bfpp.runtime.p2p import channel_groups
from megatron_bfpp.schedule import ScheduleSpec
from tests.support.megatron_lm import P4_TINY as TINY
from tests.support.megatron_lm import P4_VIRTUAL as VIRTUAL
from tests.support.megatron_lm import P4_WORLD as WORLD

install_module = importlib.import_module("megatron_bfpp.megatron.install")  # `bm.install` is the function
CPU = torch.device("cpu")
SPEC = ScheduleSpec("breadth-first", 2, 2, 4)


# ------------------------------------------------------------------------------------------------- runtime

@pytest.fixture
def two_rank_pipeline(monkeypatch: pytest.MonkeyPatch):
    """A two-rank gloo pipeline group seen from rank 0 whose collectives this process answers: returns (group,
    counts of channel groups created and of handshake exchanges). Forgets the channel groups afterwards."""
    group = SimpleNamespace(name="pipeline")
    counts = {"channel groups": 0, "exchanges": 0}

    def new_group(ranks, **kwargs):
        counts["channel groups"] += 1
        return SimpleNamespace(ranks=ranks)

    def all_gather_into_tensor(out, inp, group=None):
        counts["exchanges"] += 1
        out.copy_(inp.repeat(2))  # both ranks run the same schedule

    monkeypatch.setattr(dist, "get_process_group_ranks", lambda g: [0, 1])
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(dist, "all_gather_object",
                        lambda out, obj, group=None: out.__setitem__(slice(None), [obj] * len(out)))
    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **kw: None)
    monkeypatch.setattr(dist, "all_gather_into_tensor", all_gather_into_tensor)
    yield group, counts
    channel_groups.forget()


def test_reset_forgets_p2p_objects_handshakes_and_channel_groups_together(two_rank_pipeline) -> None:
    group, counts = two_rank_pipeline
    owner = state.RuntimeState()
    owner.wait_timeout_s, owner.recorder, owner.last_run = 30.0, runtime.ActionRecorder(0), {"pp_send_bytes": 1}
    p2p = owner.p2p(group, CPU)
    assert owner.p2p(group, CPU) is p2p and channel_groups.created(group) is p2p.groups
    for _ in range(2):
        owner.handshake(SPEC, {"pipeline": group}, CPU)
    assert counts == {"channel groups": 2, "exchanges": 1}  # created once, agreed once

    owner.reset()
    assert channel_groups.created(group) is None
    fresh = owner.p2p(group, CPU)
    assert fresh is not p2p and fresh.groups is not p2p.groups and counts["channel groups"] == 4
    owner.handshake(SPEC, {"pipeline": group}, CPU)
    assert counts["exchanges"] == 2
    # The caller's settings and the last call's results outlive the process groups.
    assert owner.wait_timeout_s == 30.0 and owner.recorder is not None and owner.last_run == {"pp_send_bytes": 1}


def test_runtime_functions_use_the_process_owner(two_rank_pipeline, monkeypatch: pytest.MonkeyPatch) -> None:
    """`megatron_bfpp.runtime`'s functions read and write the one `runtime_state`, which the forward_backward
    functions use; `reset_runtime_groups` forgets its groups."""
    group, counts = two_rank_pipeline
    owner = state.runtime_state
    assert runtime.runtime_state is owner and fb.runtime_state is owner
    for attr in ("recorder", "wait_timeout_s", "last_schedule", "last_run"):
        monkeypatch.setattr(owner, attr, getattr(owner, attr))  # put back afterwards
    recorder = runtime.ActionRecorder(0)
    runtime.set_recorder(recorder)
    runtime.set_wait_timeout(12.0)
    assert (owner.recorder, owner.wait_timeout_s) == (recorder, 12.0)
    schedule = SPEC.build(lowered=True)
    owner.last_schedule, owner.last_run = schedule, {"pp_send_bytes": 3, "peak_activation_bytes": 4}
    assert runtime.last_schedule() is schedule
    stats = runtime.last_run_stats()
    stats["pp_send_bytes"] = 0  # a copy: the owner's stay
    assert runtime.last_run_stats() == {"pp_send_bytes": 3, "peak_activation_bytes": 4}

    p2p = owner.p2p(group, CPU)
    owner.handshake(SPEC, {"pipeline": group}, CPU)
    runtime.reset_runtime_groups()
    assert channel_groups.created(group) is None and owner.p2p(group, CPU) is not p2p
    owner.handshake(SPEC, {"pipeline": group}, CPU)
    assert counts["exchanges"] == 2
    runtime.reset_runtime_groups()


# ------------------------------------------------------------------------------------------------ install

def _args(*flags: str):
    return parse_megatron_args([*TINY, *VIRTUAL, "--global-batch-size", "16", *flags], WORLD)


# Taken once: a test adds a missing name to the install's own tables.
POINTS = compat.SCHEDULE_POINTS + compat.SHARDED_POINTS + compat.CHECKPOINT_POINTS + install_module.PARAM_READER_POINTS


def _rebindable() -> dict[tuple[int, str], tuple[object, object]]:
    """Every name an install can rebind on this megatron-core except the arguments' own: (id(module), attribute)
    -> (module, current value)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    found = {(id(mod), p.attr): (mod, getattr(mod, p.attr)) for mod, p in compat.resolve(POINTS)}
    found[(id(TransformerConfig), "__post_init__")] = (TransformerConfig, TransformerConfig.__post_init__)
    return found


@pytest.fixture
def megatron_names(monkeypatch: pytest.MonkeyPatch):
    """The rebindable names before the test (checked restored afterwards); a TransformerEngine recent enough to
    delay weight gradients, so a split schedule on its layers rebinds every kind of name."""
    monkeypatch.setattr(install_module, "_te_version", lambda: "2.8.0")
    monkeypatch.setattr(state.runtime_state, "wait_timeout_s", None)
    before = _rebindable()
    yield before
    bm.uninstall()
    assert _rebindable() == before


def _everything(minutes: str = "7"):
    """Arguments whose install rebinds every kind of name: the schedule, ZeRO-3's wrapper, optimizer, finalize,
    checkpoint and parameter readers, TransformerEngine's config check and the arguments' delay_wgrad_compute."""
    args = _args("--pipeline-schedule", "interleaved-zb", "--zero-stage", "3", "--distributed-timeout-minutes", minutes)
    args.transformer_impl = "transformer_engine"
    return args


def test_second_install_replaces_the_first_and_uninstall_restores_every_name(megatron_names) -> None:
    pytest.importorskip("megatron_bfpp.megatron.sharded_compat")
    before = megatron_names
    first_args = _everything()
    first = bm.install(first_args)
    rebound = install_module.installation.rebound()
    assert {(id(m), a) for m, a in rebound} == set(before) | {(id(first_args), "delay_wgrad_compute")}
    assert all(getattr(m, a) is not before[(id(m), a)][1] for m, a in rebound if m is not first_args)
    assert first_args.delay_wgrad_compute and state.runtime_state.wait_timeout_s == 7 * 60.0
    assert bm.installed_config() == first and bm.is_installed()

    second_args = _args("--pipeline-schedule", "breadth-first", "--distributed-timeout-minutes", "2")
    second = bm.install(second_args)
    now = _rebindable()
    (key, (training, getter)), = ((k, v) for k, v in now.items() if v[1] is not before[k][1])
    assert key[1] == "get_forward_backward_func" and getter.__wrapped__ is before[key][1]  # Megatron's, not ours
    assert getter.bfpp_config == second and bm.installed_config() == second
    assert not first_args.delay_wgrad_compute  # the first install's own arguments put back
    assert state.runtime_state.wait_timeout_s == 2 * 60.0

    bm.uninstall()
    assert _rebindable() == before and not bm.is_installed() and bm.installed_config() is None
    assert install_module.installation.rebound() == [] and state.runtime_state.wait_timeout_s is None


def test_failed_install_rebinds_nothing(megatron_names, monkeypatch: pytest.MonkeyPatch) -> None:
    """A name missing late in resolution (a checkpoint function, after the schedule and ZeRO's names resolved):
    the install fails with nothing rebound, and a previous install stays whole."""
    pytest.importorskip("megatron_bfpp.megatron.sharded_compat")
    before = megatron_names
    missing = compat.RebindPoint(compat.TRAINING, "bfpp_missing_checkpoint_function")
    monkeypatch.setattr(compat, "CHECKPOINT_POINTS", (*compat.CHECKPOINT_POINTS, missing))
    args = _everything()
    with pytest.raises(compat.UnsupportedMegatronError, match=missing.attr):
        bm.install(args)
    assert _rebindable() == before and not args.delay_wgrad_compute
    assert not bm.is_installed() and bm.installed_config() is None and state.runtime_state.wait_timeout_s is None

    previous = bm.install(_args("--pipeline-schedule", "breadth-first", "--distributed-timeout-minutes", "3"))
    installed = _rebindable()
    with pytest.raises(compat.UnsupportedMegatronError, match=missing.attr):
        bm.install(_everything())
    assert _rebindable() == installed and bm.installed_config() == previous
    assert state.runtime_state.wait_timeout_s == 3 * 60.0


def test_installation_restores_in_reverse_and_replaces() -> None:
    """The owner alone: a name rebound twice in one plan comes back to its original; a new plan first restores
    the previous one's names."""
    owner = install_module.Installation()
    mod = SimpleNamespace(a=1, b=2)
    owner.apply([(mod, "a", 10), (mod, "a", 11), (mod, "b", 20)], "first")
    assert (mod.a, mod.b, owner.config) == (11, 20, "first") and owner.rebinds(mod, "a")
    owner.apply([(mod, "b", 21)], "second")
    assert (mod.a, mod.b, owner.config) == (1, 21, "second") and not owner.rebinds(mod, "a")
    assert owner.remove() == "second" and (mod.a, mod.b) == (1, 2) and owner.config is None
    assert owner.remove() is None and owner.rebound() == []
