"""Installing the package never changes the torch already there (README: `pip install -e .` into a venv, or
`pip install --no-build-isolation -e .` in NVIDIA's PyTorch container), given a torch at or above pyproject's floor.

The check asks pip itself, offline: `pip install --dry-run --report --no-index --no-build-isolation -e` of a copy
of the project's metadata (pyproject.toml, README.md, an empty package) with this interpreter. With no index, pip
can only keep what is installed: a dependency the environment does not satisfy fails the resolution, and the
report lists everything pip would (re)install. A negative control raises the floor above the installed torch and
checks the same command then fails or plans a torch, so the check cannot pass vacuously.
"""

from __future__ import annotations

import json
import os
import re
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.version import Version

from tests.support.paths import ROOT
from tests.unit.test_torch_floor import _torch_requirement


def _project_copy(dest: Path, pyproject_text: str) -> Path:
    """The project's install metadata without its sources: what pip resolves is pyproject's requirements."""
    dest.mkdir()
    (dest / "pyproject.toml").write_text(pyproject_text)
    (dest / "README.md").write_text((ROOT / "README.md").read_text())
    (dest / "megatron_bfpp").mkdir()
    (dest / "megatron_bfpp" / "__init__.py").write_text("")
    return dest


def _dry_run(subprocesses, project: Path, report: Path):
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    env.pop("PIP_FIND_LINKS", None)
    return subprocesses.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report), "--no-index",
         "--no-build-isolation", "-e", str(project)],
        capture_output=True, text=True, env=env, timeout=300)


def _planned(report: Path) -> dict[str, str]:
    data = json.loads(report.read_text())
    return {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in data["install"]}


def test_installing_the_package_keeps_the_installed_torch(subprocesses, tmp_path: Path) -> None:
    r = subprocesses.run([sys.executable, "-m", "pip", "--version"], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"pip cannot run in this environment ({sys.executable} -m pip: {r.stderr.strip()[-300:]})")
    m = re.match(r"pip (\d+)\.(\d+)", r.stdout)
    if m is None or (int(m[1]), int(m[2])) < (22, 2):
        pytest.skip(f"pip {r.stdout.split()[1:2]} has no `install --report` (pip >= 22.2)")
    try:
        import setuptools  # noqa: F401  (--no-build-isolation builds the metadata with the installed one)
    except ImportError:
        pytest.skip("setuptools is not installed (pyproject's build backend, needed with --no-build-isolation)")

    installed = Version(metadata.version("torch"))
    text = (ROOT / "pyproject.toml").read_text()
    spec = _torch_requirement(text).specifier
    assert spec.contains(installed, prereleases=True), (
        f"this environment's torch {installed} is below pyproject's torch{spec}: the check needs a torch at or "
        "above the floor")

    report = tmp_path / "report.json"
    r = _dry_run(subprocesses, _project_copy(tmp_path / "project", text), report)
    assert r.returncode == 0, (
        f"pip could not install the package with only what is installed (torch {installed}):\n{r.stderr[-3000:]}")
    planned = _planned(report)
    assert "torch" not in planned, f"installing the package would change torch {installed}: {planned}"
    assert {name.replace("_", "-") for name in planned} == {"megatron-bfpp"}, (
        f"installing the package would (re)install more than itself: {planned}")

    # Negative control: a floor above the installed torch must make the same command fail or plan a torch.
    above = f"{installed.major}.{installed.minor + 1}"
    raised = re.sub(r'"torch>=[^"]*"', f'"torch>={above}"', text, count=1)
    assert raised != text, "pyproject's dependencies have no `\"torch>=...\"` entry to raise"
    report2 = tmp_path / "report_raised.json"
    r2 = _dry_run(subprocesses, _project_copy(tmp_path / "raised", raised), report2)
    assert r2.returncode != 0 or "torch" in _planned(report2), (
        f"the check would not notice a floor (torch>={above}) above the installed torch {installed}")
