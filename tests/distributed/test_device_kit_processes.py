"""The device kit's processes (scripts/device_check.sh, megatron_bfpp/devkit): a leg whose workers ignore SIGTERM
and hold its output cannot keep the kit past its budget and leaves nothing behind; a kit killed while a leg runs
still leaves its report and the leg's output so far; a leg whose iterations all ran but whose processes do not exit
is ended and reported as such; `--device cuda` without a usable CUDA fails at once with the facts; the dry runs.
The legs are stand-ins under the real torchrun (tests/support/devkit_fake_run.py)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.support.paths import ROOT

FAKE_RUN = ROOT / "tests" / "support" / "devkit_fake_run.py"
SCRIPT = ROOT / "scripts" / "device_check.sh"


def _alive_with(marker: str) -> list[int]:
    """Processes (not zombies) whose command line holds `marker`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path("/proc", entry, "cmdline").read_bytes()
            state = Path("/proc", entry, "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in cmdline and state != "Z":
            found.append(int(entry))
    return found


def _wait_gone(marker: str, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while (left := _alive_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _start(subprocesses, worker: str, out: Path, budget: float, marker: str):
    log = open(out.parent / "kit.out", "wb")
    return subprocesses.Popen([sys.executable, str(FAKE_RUN), worker, str(out), str(budget), marker], stdout=log,
                              stderr=subprocesses.STDOUT, cwd=ROOT, start_new_session=True)


def _report(out: Path) -> dict[str, dict]:
    return {leg["name"]: leg for leg in json.loads((out / "device_report.json").read_text())["legs"]}


def test_a_worker_ignoring_sigterm_cannot_keep_the_kit_past_its_budget(tmp_path, subprocesses) -> None:
    marker = f"bfpp-kit-test-{uuid.uuid4().hex}"
    out, budget = tmp_path / "out", 25.0
    t0 = time.monotonic()
    proc = _start(subprocesses, "stubborn", out, budget, marker)
    try:
        rc = proc.wait(timeout=budget + 30)
    except subprocesses.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        _kill_all(_alive_with(marker))
        pytest.fail(f"the kit ran past its {budget:.0f} s budget plus 30 s: "
                    f"{(tmp_path / 'kit.out').read_text()[-2000:]}")
    seconds = time.monotonic() - t0
    left = _wait_gone(marker, 2)
    _kill_all(left)
    assert not left, f"processes of the leg outlived the kit: {left}"
    assert rc == 1 and seconds <= budget + 30
    leg = _report(out)["stand-in-P2"]
    assert leg["status"] == "fail" and "killed at its" in leg["detail"], leg
    assert "stand-in worker up" in (out / "stand-in-P2.log").read_text()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_kit_killed_while_a_leg_runs_leaves_its_report_and_the_legs_output(tmp_path, subprocesses, sig) -> None:
    marker = f"bfpp-kit-test-{uuid.uuid4().hex}"
    out = tmp_path / "out"
    proc = _start(subprocesses, "dies-with-parent", out, 120.0, marker)
    log = out / "stand-in-P2.log"
    try:
        deadline = time.monotonic() + 60
        while not (log.exists() and log.read_text().splitlines().count("stand-in worker up") == 2):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "kit.out").read_text()[-2000:]
            time.sleep(0.2)
        os.kill(proc.pid, sig)
        proc.wait(timeout=30)
        left = _wait_gone(marker, 10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        _kill_all(_alive_with(marker))
    assert not left, f"processes of the leg outlived the kit: {left}"
    legs = _report(out)
    assert legs["install"]["status"] == "pass"
    assert legs["stand-in-P2"]["status"] == "not-run"
    assert ("running when this report was written" if sig == signal.SIGKILL else "stopped by SIGTERM") in \
        legs["stand-in-P2"]["detail"], legs
    assert "stand-in worker up" in log.read_text()


def test_a_leg_that_hangs_at_exit_after_its_iterations_is_ended_and_reported_as_such(tmp_path,
                                                                                    subprocesses) -> None:
    marker = f"bfpp-kit-test-{uuid.uuid4().hex}"
    out, budget = tmp_path / "out", 100.0
    proc = _start(subprocesses, "exit-hang", out, budget, marker)
    try:
        proc.wait(timeout=budget + 30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        left = _wait_gone(marker, 2)
        _kill_all(left)
    assert not left
    leg = _report(out)["stand-in-P2"]
    assert leg["status"] == "fail" and "all 3 iterations ran" in leg["detail"] and "hung at exit" in leg["detail"]
    assert leg["seconds"] < 60, leg  # ended soon after its last iteration, not at the leg's limit


def test_device_cuda_without_cuda_fails_at_once_with_the_facts(tmp_path, subprocesses) -> None:
    """This machine has no usable CUDA: the kit says so before installing anything, and records torch's facts.
    Without --out the report goes to $OUT (what the device machine returns)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHON=sys.executable, OUT=str(tmp_path / "device_out"))
    t0 = time.monotonic()
    r = subprocesses.run(["bash", str(SCRIPT), "--device", "cuda"], capture_output=True, text=True, cwd=ROOT,
                         env=env, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    assert time.monotonic() - t0 < 120
    report = json.loads((tmp_path / "device_out" / "device_report.json").read_text())
    import torch

    assert report["torch"] == torch.__version__
    install, *rest = report["legs"]
    assert install["status"] == "fail" and "CUDA is not usable" in install["detail"], install
    assert "torch.cuda.is_available() is False" in install["detail"] and "--device cpu" in install["detail"]
    assert rest and all(leg["status"] == "not-run" for leg in rest)


@pytest.mark.parametrize("args, budget", [(["--quick"], 240), ([], 480)])
def test_the_dry_runs_fit_their_budgets(subprocesses, args, budget) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHON"] = sys.executable
    r = subprocesses.run(["bash", str(SCRIPT), *args, "--dry-run"], capture_output=True, text=True, cwd=ROOT,
                         env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"against a budget of {budget} s: fits" in r.stdout
