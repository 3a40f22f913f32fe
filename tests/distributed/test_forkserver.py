"""The fork servers that start the ranks of the tests' jobs (tests/support/forkserver.py) give each rank what a
torchrun rank has: its own environment, directory, argv, string-hash seed and a fresh torch generator; and they
end a job as torchrun does (the others stopped once one rank failed; all of them at the deadline)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.support.forkserver import TORCH_DEFAULT_SEED, ForkServers, Job

PROBE = """
import json, os, sys, torch
rank = int(os.environ["RANK"])
out = {"argv": sys.argv[1:], "cwd": os.getcwd(), "hash": hash("a string"), "env": os.environ.get("PROBE"),
       "seed": torch.initial_seed(), "draw": torch.rand(1).item(), "path0": sys.path[0]}
torch.manual_seed(99)  # must not reach the next job's ranks
json.dump(out, open(f"probe{rank}.json", "w"))
sys.exit(int(os.environ.get("EXIT", "0")) if rank == 1 else 0)
"""


@pytest.fixture
def servers(subprocesses):
    s = ForkServers(["torch"])
    yield s
    s.close()


def _jobs(tmp_path: Path, n: int, **env: str) -> list[Job]:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    return [Job(env={"RANK": str(r), "PROBE": "yes", **env}, cwd=str(tmp_path), log=str(tmp_path / f"{r}.log"),
                argv=[str(script), "--flag", str(r)]) for r in range(n)]


def test_each_rank_is_its_own_process(servers, tmp_path: Path) -> None:
    for _ in range(2):  # a second job on the same servers starts as fresh as the first
        assert servers.run(_jobs(tmp_path, 3), timeout=60) == [0, 0, 0]
        got = [json.loads((tmp_path / f"probe{r}.json").read_text()) for r in range(3)]
        assert [g["argv"] for g in got] == [["--flag", str(r)] for r in range(3)]
        assert {g["cwd"] for g in got} == {str(tmp_path)} and {g["env"] for g in got} == {"yes"}
        assert {g["path0"] for g in got} == {str(tmp_path)}  # the script's directory, as `python script.py`
        assert len({g["hash"] for g in got}) == 3, "ranks share a string-hash seed"
        assert {g["seed"] for g in got} == {TORCH_DEFAULT_SEED} and len({g["draw"] for g in got}) == 1


def test_a_failed_rank_stops_the_job(servers, tmp_path: Path) -> None:
    jobs = _jobs(tmp_path, 3, EXIT="7")
    jobs[2] = Job(env={}, cwd=str(tmp_path), log=str(tmp_path / "2.log"),
                  call=(__import__("time").sleep, (600,)))
    assert servers.run(jobs, timeout=120, fail_grace=1.0) == [0, 7, -9]


def test_the_deadline_kills_what_still_runs(servers, tmp_path: Path) -> None:
    job = Job(env={}, cwd=str(tmp_path), log=str(tmp_path / "0.log"), call=(__import__("time").sleep, (600,)))
    assert servers.run([job], timeout=1.0) == [None]


def test_an_exception_is_logged_and_exits_1(servers, tmp_path: Path) -> None:
    job = Job(env={}, cwd=str(tmp_path), log=str(tmp_path / "0.log"), call=(int, ("not a number",)))
    assert servers.run([job], timeout=60) == [1]
    assert "ValueError: invalid literal for int()" in (tmp_path / "0.log").read_text()


def test_a_preload_that_fails_is_reported(subprocesses) -> None:
    with pytest.raises(RuntimeError, match="no_such_module"):
        ForkServers(["no_such_module"]).run([Job(env={}, cwd="/", log="/dev/null", call=(print, ()))], timeout=10)
    assert sys.modules.get("no_such_module") is None
