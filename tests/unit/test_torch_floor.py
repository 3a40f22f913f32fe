"""pyproject.toml's torch floor (`torch>=<floor>`, the lowest torch the code supports) is stated once: CI's floor venv
pins the same version (requirements-floor.txt; .ci/run runs `scripts/test.sh --floor` in it)."""

from __future__ import annotations

import re
import tomllib

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from tests.support.paths import ROOT


def _torch_requirement(pyproject_text: str) -> Requirement:
    deps = [Requirement(d) for d in tomllib.loads(pyproject_text)["project"]["dependencies"]]
    (torch,) = [r for r in deps if r.name == "torch"]
    return torch


def _floor(spec: SpecifierSet) -> Version:
    lower = [Version(s.version) for s in spec if s.operator == ">="]
    assert len(lower) == 1 and all(s.operator in (">=", "<", "!=") for s in spec), (
        f"pyproject's torch requirement should be a floor `torch>=X` (an upper bound at most): {spec}")
    return lower[0]


def test_floor_is_stated_once_and_pinned_for_ci() -> None:
    """pyproject's torch floor is requirements-floor.txt's pin (the CI floor venv; the floor may be the pin's a0),
    and NVIDIA containers' builds of the floor release and later (pre-releases with a local part, e.g.
    2.10.0a0+gitXXXX) satisfy it, as pip sees an installed torch (pre-releases allowed): installing the package
    in such a container keeps its torch."""
    spec = _torch_requirement((ROOT / "pyproject.toml").read_text()).specifier
    floor = _floor(spec)
    pins = re.findall(r"^torch==(\S+)", (ROOT / "requirements-floor.txt").read_text(), flags=re.M)
    assert [Version(p).release for p in pins] == [floor.release], (
        f"requirements-floor.txt pins torch {pins}, pyproject's floor is torch>={floor}")
    assert spec.contains(f"{floor.major}.{floor.minor}.0a0+gitb4e6d37", prereleases=True)
    assert spec.contains(f"{floor.major}.{floor.minor + 1}.0a0+gitb4e6d37", prereleases=True)
    assert spec.contains(f"{floor.major}.{floor.minor}.0", prereleases=False)
