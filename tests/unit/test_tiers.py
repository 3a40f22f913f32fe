"""The test tiers hold: a unit test cannot start a process, and the markers follow the fixtures."""

from __future__ import annotations

import multiprocessing
import os
import subprocess

import pytest

from tests.conftest import TIER_OF_FIXTURE


def _noop() -> None:
    pass


def test_unit_test_cannot_start_a_subprocess() -> None:
    with pytest.raises(RuntimeError, match="is a unit test and started a process: request the `run_distributed`"):
        subprocess.run(["true"], check=True)
    with pytest.raises(RuntimeError, match="subprocesses"):
        os.system("true")


@pytest.mark.parametrize("method", ["spawn", "fork", "forkserver"])
def test_unit_test_cannot_start_a_multiprocessing_process(method: str) -> None:
    proc = multiprocessing.get_context(method).Process(target=_noop)
    with pytest.raises(RuntimeError, match="is a unit test and started a process"):
        proc.start()


def test_a_process_fixture_lifts_the_guard(subprocesses) -> None:
    assert subprocesses.run(["true"]).returncode == 0


def test_markers_follow_the_fixtures(request: pytest.FixtureRequest) -> None:
    assert request.node.get_closest_marker("unit") is not None
    assert request.node.get_closest_marker("distributed") is None
    assert set(TIER_OF_FIXTURE.values()) == {"distributed", "megatron_lm"}
