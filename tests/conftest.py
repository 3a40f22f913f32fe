"""Test-session hygiene shared by every module.

Some modules open a one-process world in the pytest process (`megatron_bfpp.parallel.init_single_process`, for
Megatron's layers). Left open, it changes what later modules see (tests that need no process group skip or take
another path), so it is closed after each module, whichever module opened it.
"""

from __future__ import annotations

import sys

import pytest


@pytest.fixture(scope="module", autouse=True)
def _close_process_groups_after_module():
    yield
    if "torch.distributed" not in sys.modules:
        return
    import torch.distributed as dist

    if "megatron_bfpp.parallel" in sys.modules:
        sys.modules["megatron_bfpp.parallel"].destroy_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
