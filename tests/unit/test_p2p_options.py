"""The channel groups' fresh NCCL options carry the timeout the groups are created with.

torch's `_create_nccl_process_group` (torch/distributed/distributed_c10d.py, the NCCL backend creator
`new_group` reaches) warns "backend_options._timeout was specified, but timeout kwarg has a default value that
will always override it" whenever the options' `_timeout` differs from the group's timeout; fresh options carry
torch's NCCL default (10 minutes), so a channel group created with another timeout (Megatron-LM's
--distributed-timeout-minutes, the plugin trainer's 30 minutes) warned once per group on every rank.

These tests run `ChannelGroups.get` in this process with torch's own `ProcessGroupNCCL.Options` and hand what it
passes to `new_group` to torch's own backend creator (its process-group class replaced by a recorder: no NCCL
communicator, no GPU).
"""

from __future__ import annotations

import datetime
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from megatron_bfpp.runtime import p2p

pytestmark = pytest.mark.skipif(not dist.is_nccl_available() or not hasattr(c10d, "_create_nccl_process_group"),
                                reason="torch built without NCCL, or without this backend creator")


class _RecordingNCCL:
    """Stands in for ProcessGroupNCCL in torch's backend creator: its Options are torch's; constructing records
    the options instead of opening a communicator."""

    Options = dist.ProcessGroupNCCL.Options

    def __init__(self, store, rank, size, options) -> None:
        self.options = options


def _torch_creates(kwargs: dict) -> tuple[object, list[str]]:
    """What torch's NCCL backend creator makes of new_group's keyword arguments: (options it passes on, warnings)."""
    opts = c10d._DistributedBackendOptions()
    opts.timeout = kwargs.get("timeout") or c10d._get_default_timeout("nccl")  # as new_group resolves it
    opts.group_rank, opts.group_size, opts.global_ranks_in_group, opts.group_id = 0, 2, [0, 1], "channel"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backend = c10d._create_nccl_process_group(opts, kwargs.get("pg_options"))
    return backend.options, [str(w.message) for w in caught]


@pytest.fixture
def nccl_pipeline(monkeypatch):
    """A two-rank NCCL pipeline group seen from rank 0 of a two-rank world, whose new_group records its
    arguments: returns (pipeline group, its live options, recorded new_group kwargs)."""
    live = dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)
    live.config.max_ctas = 16
    pp_group = SimpleNamespace(_get_backend=lambda device: SimpleNamespace(options=live))
    calls: list[dict] = []
    monkeypatch.setattr(c10d, "ProcessGroupNCCL", _RecordingNCCL)
    monkeypatch.setattr(p2p, "pipeline_ranks", lambda group: [0, 1])
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_gather_object",
                        lambda out, obj, group=None: out.__setitem__(slice(None), [obj] * len(out)))
    monkeypatch.setattr(dist, "new_group", lambda ranks, **kw: calls.append(kw) or SimpleNamespace(ranks=ranks))
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **kw: None)
    return pp_group, live, calls


@pytest.mark.parametrize("timeout_s", [1800.0, 90.0, None])
def test_channel_groups_options_carry_the_groups_timeout(nccl_pipeline, timeout_s) -> None:
    """Each channel group gets fresh options (the pipeline group's settings) whose _timeout is the group's, so
    torch's creator does not warn; without a timeout, torch's NCCL default in both."""
    pp_group, live, calls = nccl_pipeline
    groups = p2p.ChannelGroups().get(pp_group, timeout_s=timeout_s, device=torch.device("cpu"))
    assert set(groups) == set(p2p.CHANNELS) and len(calls) == len(p2p.CHANNELS)
    want = datetime.timedelta(seconds=timeout_s) if timeout_s is not None else c10d._get_default_timeout("nccl")
    for kwargs in calls:
        options = kwargs["pg_options"]
        assert isinstance(options, dist.ProcessGroupNCCL.Options) and options is not live
        assert options.is_high_priority_stream and options.config.max_ctas == 16
        created, warned = _torch_creates(kwargs)
        assert not [w for w in warned if "_timeout" in w], warned
        assert options._timeout == want and kwargs.get("timeout", want) == want
        assert created is options and created._timeout == want
    assert len({id(kw["pg_options"]) for kw in calls}) == len(calls)  # one object per group (torch writes into it)


def test_torchs_creator_warns_on_a_timeout_mismatch() -> None:
    """What the test above guards against, with torch's own creator: options left at the default 10 minutes for a
    group created with 30 warn."""
    options = p2p.fresh_nccl_options(dist.ProcessGroupNCCL.Options())
    assert options._timeout == c10d._get_default_timeout("nccl")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(c10d, "ProcessGroupNCCL", _RecordingNCCL)
        _, warned = _torch_creates({"timeout": datetime.timedelta(minutes=30), "pg_options": options})
    assert any("backend_options._timeout was specified" in w for w in warned), warned


def test_fresh_nccl_options_take_the_timeout() -> None:
    live = dist.ProcessGroupNCCL.Options()
    live._timeout = datetime.timedelta(minutes=3)  # the live group's own: not what a new group is created with
    fresh = p2p.fresh_nccl_options(live, timeout=datetime.timedelta(minutes=45))
    assert fresh._timeout == datetime.timedelta(minutes=45)
    assert p2p.fresh_nccl_options(live)._timeout == c10d._get_default_timeout("nccl")  # torch's default
