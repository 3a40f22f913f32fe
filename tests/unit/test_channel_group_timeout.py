"""The runtime's channel groups on gloo (CPU) take the configured timeout, as on NCCL (tests/unit/test_p2p_options.py).

A gloo channel group created without it would take torch's default (30 minutes) whatever
--distributed-timeout-minutes says, so a dead peer would hold every p2p wait that long. Real gloo groups in this
process (a one-rank world on an in-memory store): their timeout is read back from torch's backend.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from megatron_bfpp.runtime import p2p
from megatron_bfpp.train import parallel


@pytest.fixture
def gloo_world():
    if dist.is_initialized():
        pytest.skip("torch.distributed is initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        parallel.destroy_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def _timeout(group: dist.ProcessGroup) -> datetime.timedelta:
    return group._get_backend(torch.device("cpu")).options._timeout


@pytest.mark.parametrize("timeout_s", [77.0, 600.0])
def test_gloo_channel_groups_take_the_given_timeout(gloo_world, timeout_s: float) -> None:
    groups = p2p.ChannelGroups().get(gloo_world, timeout_s=timeout_s, device=torch.device("cpu"))
    assert set(groups) == set(p2p.CHANNELS)
    for name, group in groups.items():
        assert _timeout(group) == datetime.timedelta(seconds=timeout_s), name


def test_trainer_creates_gloo_channel_groups_with_its_distributed_timeout(gloo_world) -> None:
    """The trainer's process groups (`init_parallel`, from --distributed-timeout-minutes) create the channel
    groups eagerly with the same timeout."""
    parallel.init_parallel(1, distributed_timeout_seconds=95)
    groups = p2p.channel_groups.created(parallel.pp_group())
    assert groups is not None and set(groups) == set(p2p.CHANNELS)
    for name, group in groups.items():
        assert _timeout(group) == datetime.timedelta(seconds=95), name
