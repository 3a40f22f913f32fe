"""Test-session hygiene shared by every module, and the test tiers.

Tiers (markers registered in pyproject.toml) follow from the fixtures a test uses, never from hand-written marks:
a test that uses `run_distributed` (gloo jobs) or `subprocesses` (torchrun, CLI and script runs) is `distributed`;
one that uses a Megatron-LM checkout (`mlm`, `mlm016`, `megatron_lm_checkout`) is `megatron_lm`; every other test is
`unit`. The folders show what a module mostly needs (tests/unit, tests/distributed, tests/megatron_lm; shared code
in tests/support); the markers are exact, test by test. A unit test
cannot start a process: the guard below fails it, naming the fixture to use, so the tiers cannot drift. The unit
tier also fails a test whose call uses more than BFPP_UNIT_TEST_SECONDS CPU seconds (default 5).

Some modules open a one-process world in the pytest process (`megatron_bfpp.train.parallel.init_single_process`, for
Megatron's layers). Left open, it changes what later modules see (tests that need no process group skip or take
another path), so it is closed after each module, whichever module opened it.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from tests.support.paths import IMPORT_GUARD, ROOT

# Every process the tests start imports this clone's `megatron_bfpp` (a shared venv's editable install may
# point at another clone): the clone goes first on PYTHONPATH, and `tests/support/import_guard` stops any process that
# would import it from elsewhere.
os.environ["MEGATRON_BFPP_TEST_ROOT"] = str(ROOT)
_rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in (str(ROOT), str(IMPORT_GUARD))]
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(IMPORT_GUARD), *_rest])
# Every process the tests start imports torch, Megatron (the checkout's sources too) and this package: their
# bytecode is written once to a cache outside the clone and the checkouts (which stay untouched), and read by every
# later process, even where the environment turns bytecode writing off.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
os.environ.setdefault("PYTHONPYCACHEPREFIX", str(Path(os.environ.get("BFPP_VENV_CACHE",
                                                                     Path.home() / ".cache" / "megatron_bfpp"))
                                                  / "pycache"))


def pytest_sessionstart(session) -> None:
    import megatron_bfpp

    found = Path(megatron_bfpp.__file__).resolve().parent
    if found != ROOT / "megatron_bfpp":
        raise pytest.UsageError(f"megatron_bfpp imported from {found}, not from the clone under test ({ROOT})")


def pytest_sessionfinish(session, exitstatus) -> None:
    if "tests.support.distributed" in sys.modules:
        sys.modules["tests.support.distributed"].close_servers()


@pytest.fixture(scope="module", autouse=True)
def _close_process_groups_after_module():
    yield
    if "torch.distributed" not in sys.modules:
        return
    import torch.distributed as dist

    if "megatron_bfpp.train.parallel" in sys.modules:
        sys.modules["megatron_bfpp.train.parallel"].destroy_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------ test tiers

# Fixture -> tier marker. A fixture reached through another fixture counts (pytest's closure of the test).
TIER_OF_FIXTURE = {
    "run_distributed": "distributed",
    "subprocesses": "distributed",
    "mlm": "megatron_lm",
    "mlm016": "megatron_lm",
    "megatron_lm_checkout": "megatron_lm",
}
UNIT_SECONDS = float(os.environ.get("BFPP_UNIT_TEST_SECONDS", "5"))
_CPU_SECONDS = pytest.StashKey[float]()


@pytest.fixture(scope="session")
def run_distributed():
    """Runs fn(rank, world, *args) on `world` spawned gloo processes (tests.support.distributed.run_distributed)."""
    from tests.support.distributed import run_distributed as run

    return run


@pytest.fixture(scope="session")
def subprocesses():
    """The `subprocess` module, for tests that run torchrun, the CLI or a script: using it puts the test in
    the distributed tier."""
    import subprocess

    return subprocess


@pytest.fixture(scope="session")
def mlm(subprocesses, tmp_path_factory: pytest.TempPathFactory):
    """One patched copy of MEGATRON_LM_DIR per test session, and one cache of its runs (stock references
    included) shared by every Megatron-LM test module."""
    from tests.support.megatron_lm import MEGATRON_LM_DIR, _missing_module, make_runner

    if not MEGATRON_LM_DIR or not Path(MEGATRON_LM_DIR, "pretrain_gpt.py").is_file():
        pytest.skip("MEGATRON_LM_DIR is not set to a Megatron-LM checkout")
    original = Path(MEGATRON_LM_DIR).resolve()
    missing = _missing_module(original)
    if missing:
        pytest.skip(f"Megatron-LM at {original} cannot be imported here: it needs {missing!r}")
    runner = make_runner(original, tmp_path_factory.mktemp("pretrain_gpt"))
    yield runner
    runner.close()
    print(f"\n[pretrain_gpt] {runner.count} runs, logs in {runner.workdir}")


@pytest.fixture(scope="session")
def mlm016(subprocesses, tmp_path_factory: pytest.TempPathFactory):
    """The same for Megatron-LM core_v0.16.1 ($MEGATRON_LM_DIR_016, else beside MEGATRON_LM_DIR)."""
    from tests.support.megatron_lm import _checkout_016, _missing_module, make_runner

    original = _checkout_016()
    if original is None:
        pytest.skip("no Megatron-LM core_v0.16.1 checkout: set MEGATRON_LM_DIR_016 (or keep core_v0.16.1 beside "
                    "MEGATRON_LM_DIR)")
    missing = _missing_module(original)
    if missing:
        pytest.skip(f"Megatron-LM core_v0.16.1 cannot be imported here: it needs {missing!r} "
                    "(requirements.txt installs six, regex, pyyaml and pydantic for it)")
    runner = make_runner(original, tmp_path_factory.mktemp("pretrain_gpt_016"))
    yield runner
    runner.close()


def tiers_of(item: pytest.Item) -> set[str]:
    names = set(getattr(item, "fixturenames", ()))
    return {tier for fixture, tier in TIER_OF_FIXTURE.items() if fixture in names} or {"unit"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for tier in sorted(tiers_of(item)):
            item.add_marker(getattr(pytest.mark, tier))


class _ProcessGuard:
    """Makes every way of starting a process raise while a unit test runs (subprocess, multiprocessing's spawn
    and fork contexts, os.system / posix_spawn): a unit test that starts one fails, naming the fixture to use."""

    def __init__(self, nodeid: str) -> None:
        self.nodeid = nodeid
        self.saved: list[tuple[object, str, object]] = []

    def _guarded(self, original):
        def refuse(*args, **kwargs):
            # A library's first import may run a lookup (megatron.core's package_info asks git, ctypes.util's
            # find_library asks ldconfig): that is not a test starting a process.
            # Walked from the innermost frame up to the test harness (pytest, pluggy).
            frame = sys._getframe(1)
            while frame is not None:
                code = frame.f_code
                if "_pytest" in code.co_filename or "pluggy" in code.co_filename:
                    break
                if code.co_name == "<module>" or code.co_filename.endswith(os.path.join("ctypes", "util.py")):
                    return original(*args, **kwargs)
                frame = frame.f_back
            raise RuntimeError(f"{self.nodeid} is a unit test and started a process: request the `run_distributed` "
                               "(gloo jobs) or `subprocesses` (torchrun, CLI, scripts) fixture, which moves it to "
                               "the distributed tier")

        return refuse

    def __enter__(self) -> "_ProcessGuard":
        import _posixsubprocess
        import multiprocessing.popen_forkserver
        import subprocess

        # subprocess binds fork_exec at import; multiprocessing's spawn looks it up on _posixsubprocess.
        # A forkserver already running forks for us without this process calling fork: its launch is guarded too.
        for module, name in ((subprocess, "_fork_exec"), (_posixsubprocess, "fork_exec"), (os, "fork"),
                             (multiprocessing.popen_forkserver.Popen, "_launch"), (os, "system"), (os, "posix_spawn"),
                             (os, "posix_spawnp")):
            if hasattr(module, name):
                original = getattr(module, name)
                self.saved.append((module, name, original))
                setattr(module, name, self._guarded(original))
        return self

    def __exit__(self, *exc) -> None:
        for module, name, original in reversed(self.saved):
            setattr(module, name, original)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    if tiers_of(item) == {"unit"}:
        with _ProcessGuard(item.nodeid):
            yield
    else:
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    # CPU seconds of this process, not wall time: a shared machine's load does not fail a unit test.
    start = time.process_time()
    yield
    item.stash[_CPU_SECONDS] = time.process_time() - start


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    outcome = yield
    report = outcome.get_result()
    seconds = item.stash.get(_CPU_SECONDS, 0.0)
    if call.when == "call" and report.passed and tiers_of(item) == {"unit"} and seconds > UNIT_SECONDS:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid}: a unit test used {seconds:.1f} CPU seconds (> {UNIT_SECONDS:g}, "
                           "BFPP_UNIT_TEST_SECONDS): make it faster or move it to a slower tier")
