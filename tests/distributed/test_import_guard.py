"""The tests' subprocesses import `megatron_bfpp` from the clone under test, never from another clone."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support.paths import IMPORT_GUARD, ROOT, subprocess_pythonpath

SHIM = ROOT / "tests" / "support" / "cpu_shim"
_WHERE = "import megatron_bfpp, os; print(os.path.dirname(megatron_bfpp.__file__))"


def _python(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _WHERE], capture_output=True, text=True, env=env, cwd="/",
                          timeout=60)


def test_subprocesses_import_this_clone(subprocesses) -> None:
    for extra in ((), (str(SHIM),)):
        r = _python(dict(os.environ, PYTHONPATH=subprocess_pythonpath(*extra)))
        assert r.returncode == 0, r.stderr
        assert os.path.realpath(r.stdout.strip()) == os.path.realpath(ROOT / "megatron_bfpp")
    assert os.environ["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT)  # what plain subprocesses inherit


def test_a_process_importing_another_clone_stops(subprocesses, tmp_path) -> None:
    other = tmp_path / "other_clone"
    (other / "megatron_bfpp").mkdir(parents=True)
    (other / "megatron_bfpp" / "__init__.py").write_text("")
    for guard in (str(IMPORT_GUARD), str(SHIM)):  # the guard alone, and run from the CPU shim's sitecustomize
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(other), guard]))
        r = _python(env)
        assert r.returncode == 3, (guard, r.stdout, r.stderr)
        assert "not from the clone under test" in r.stderr
