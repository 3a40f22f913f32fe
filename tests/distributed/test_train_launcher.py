"""`bfpp train` as a user meets it: the default schedule at P = 1, and configuration errors printed once.

- P = 1 without virtual stages under the default schedule (breadth-first) runs GPipe, which is what
  breadth-first is with one stage per rank, and says so in one log line.
- A bad flag is refused by the launcher before any worker starts: one `error:` line, exit status 2.
- A configuration error found inside the workers (here: the data holds token ids above --vocab-size, seen
  only when the workers read it) is printed once, without a traceback, exit status 2; an unexpected error
  keeps its traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.paths import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "16",
         "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-3",
         "--log-interval", "1", "--distributed-timeout-seconds", "60"]


def _bfpp_train(*argv: str, nproc: int = 2) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("BFPP_FAULT_INJECT", None)
    return subprocess.run([sys.executable, "-W", "ignore", "-m", "megatron_bfpp.cli", "train", "--nproc-per-node",
                           str(nproc), *argv], env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.timeout(900)
def test_default_schedule_at_p1_runs_gpipe_and_says_so_once(subprocesses):
    p = _bfpp_train(*MODEL)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert out.count("is GPipe: running gpipe") == 1, out[-4000:]
    assert "iteration        2/       2" in out and "schedule gpipe" in out, out[-4000:]


@pytest.mark.timeout(300)
def test_bad_flag_is_one_line_before_any_worker_starts(subprocesses):
    p = _bfpp_train(*MODEL, "--hidden-size", "15")
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert p.returncode == 2, p.stderr[-4000:]
    assert len(errors) == 1 and "--hidden-size 15" in errors[0], p.stderr[-4000:]
    assert "Traceback" not in p.stderr and "ChildFailedError" not in p.stderr, p.stderr[-4000:]
    assert "torch.distributed.elastic" not in p.stderr  # no worker was started


@pytest.fixture(scope="module")
def small_vocab_data(tmp_path_factory) -> str:
    t2m = load_script("scripts/text_to_megatron.py", "text_to_megatron")
    prefix = str(tmp_path_factory.mktemp("data") / "tiny")
    assert t2m.main([os.path.join(ROOT, "tests", "support", "data", "tiny_corpus.txt"), prefix]) == 0  # byte ids up to 256
    return prefix


@pytest.mark.timeout(900)
def test_configuration_error_in_the_workers_is_printed_once(subprocesses, small_vocab_data):
    # The flags pass the launcher's check; both workers find ids >= --vocab-size when they read the data.
    p = _bfpp_train(*MODEL, "--data-path", small_vocab_data, "--vocab-size", "64",
                    "--make-vocab-size-divisible-by", "1", "--pipeline-schedule", "gpipe")
    out = p.stdout + p.stderr
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert p.returncode == 2, out[-4000:]
    assert len(errors) == 1 and errors[0].startswith("error: --data-path ") and small_vocab_data in errors[0] \
        and ">= --vocab-size 64" in errors[0], out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    assert "bfpp train: stopped by the configuration error above" in out, out[-4000:]


_REPORT = """
import os, sys
from megatron_bfpp.train.faults import report_config_error, report_failure
from megatron_bfpp.train.config import TrainerConfigError
kind = sys.argv[1]
if kind == "config":
    sys.exit(report_config_error(TrainerConfigError("--flag X: fix it"), int(os.environ["RANK"])))
try:
    raise RuntimeError("something unexpected")
except RuntimeError as e:
    sys.exit(report_failure(e, int(os.environ["RANK"])))
"""


def test_report_prints_config_errors_once_and_keeps_tracebacks_for_the_rest(subprocesses, tmp_path):
    """Three ranks of one launch (same master address and port, same parent) report the same configuration
    error: one prints it; an unexpected error prints its traceback on each rank."""
    from tests.support.distributed import free_port

    def launch(kind: str) -> list[subprocess.CompletedProcess]:
        port = str(free_port())
        procs = [subprocess.Popen([sys.executable, "-W", "ignore", "-c", _REPORT, kind], text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                                       "RANK": str(r), "WORLD_SIZE": "3"}) for r in range(3)]
        return [(p.wait(timeout=120), p.stderr.read()) for p in procs]

    results = launch("config")
    assert [rc for rc, _ in results] == [2, 2, 2]
    printed = [err for _, err in results if "error: --flag X: fix it" in err]
    assert len(printed) == 1 and all("Traceback" not in err for _, err in results), results
    results = launch("unexpected")
    assert [rc for rc, _ in results] == [1, 1, 1]
    assert all("Traceback" in err and "something unexpected" in err for _, err in results), results
