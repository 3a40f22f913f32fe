"""Test-session hygiene shared by every module.

Some modules open a one-process world in the pytest process (`megatron_bfpp.parallel.init_single_process`, for
Megatron's layers). Left open, it changes what later modules see (tests that need no process group skip or take
another path), so it is closed after each module, whichever module opened it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.paths import IMPORT_GUARD, ROOT

# Every process the tests start imports this clone's `megatron_bfpp` (a shared venv's editable install may
# point at another clone): the clone goes first on PYTHONPATH, and `tests/import_guard` stops any process that
# would import it from elsewhere.
os.environ["MEGATRON_BFPP_TEST_ROOT"] = str(ROOT)
_rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in (str(ROOT), str(IMPORT_GUARD))]
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(IMPORT_GUARD), *_rest])


def pytest_sessionstart(session) -> None:
    import megatron_bfpp

    found = Path(megatron_bfpp.__file__).resolve().parent
    if found != ROOT / "megatron_bfpp":
        raise pytest.UsageError(f"megatron_bfpp imported from {found}, not from the clone under test ({ROOT})")


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
