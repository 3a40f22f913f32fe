"""A real Megatron-LM checkout (MEGATRON_LM_DIR, copied): the patch series applies and wires its flags, and both
the patched script and the script runner on the unpatched one install the plugin."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_bfpp.megatron import compat
from tests.support.megatron_lm import P4_TINY as TINY
from tests.support.megatron_lm import P4_VIRTUAL as VIRTUAL
from tests.support.megatron_lm import P4_WORLD as WORLD
from tests.support.paths import ROOT, subprocess_pythonpath

# -------------------------------------------------------------------- a real Megatron-LM checkout (optional)

MEGATRON_LM_DIR = os.environ.get("MEGATRON_LM_DIR")
needs_checkout = pytest.mark.skipif(
    not MEGATRON_LM_DIR or not Path(MEGATRON_LM_DIR, "pretrain_gpt.py").is_file(),
    reason="set MEGATRON_LM_DIR to a Megatron-LM checkout of a supported tag (core_v0.19.0, core_v0.16.1)",
)


@pytest.fixture(scope="module")
def megatron_lm_checkout(subprocesses, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private copy of MEGATRON_LM_DIR (the patches are applied to it, never to the original)."""
    src = Path(MEGATRON_LM_DIR)  # type: ignore[arg-type]
    dst = tmp_path_factory.mktemp("mlm") / "Megatron-LM"
    if (src / ".git").exists():
        subprocess.run(["git", "-c", "advice.detachedHead=false", "clone", "-q", "--shared", str(src), str(dst)],
                       check=True, timeout=120)
        head = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
        subprocess.run(["git", "-C", str(dst), "-c", "advice.detachedHead=false", "checkout", "-q", head.strip()],
                       check=True)
        dirty = subprocess.run(["git", "-C", str(src), "diff", "HEAD"], capture_output=True, text=True).stdout
        if dirty:  # carry local changes, as the apply script would see them in place
            subprocess.run(["git", "-C", str(dst), "apply"], input=dirty, text=True, check=True)
    else:
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.pyc", "__pycache__"))
    return dst


def _megatron_version(path: Path) -> tuple[int, int]:
    info = (path / "megatron" / "core" / "package_info.py").read_text()
    return int(re.search(r"^MAJOR = (\d+)", info, re.M).group(1)), int(re.search(r"^MINOR = (\d+)", info, re.M).group(1))


def _run_checkout_script(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, WORLD_SIZE=str(WORLD), RANK="0", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = subprocess_pythonpath()  # the clone and the import guard, nothing else
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=180)
    missing = re.search(r"ModuleNotFoundError: No module named '([\w.]+)'", r.stderr)
    if missing and not missing.group(1).startswith("megatron"):
        pytest.skip(f"the checkout needs Python package {missing.group(1)!r}, not in this environment")
    return r


def _expect_installed_then_cuda(r: subprocess.CompletedProcess) -> None:
    out = r.stdout + r.stderr
    assert "megatron_bfpp: installed pipeline schedule breadth-first (P=4, V=2, M=4)" in out, out[-3000:]
    # On a CPU-only machine Megatron stops at its CUDA requirement, after the plugin was installed.
    import torch

    if not torch.cuda.is_available():
        assert "Megatron requires CUDA." in out


@needs_checkout
@pytest.mark.timeout(240)
def test_script_runner_on_unpatched_checkout(subprocesses, megatron_lm_checkout: Path) -> None:
    r = _run_checkout_script([sys.executable, "-m", "megatron_bfpp.run_megatron_script",
                              str(megatron_lm_checkout / "pretrain_gpt.py"), *TINY,
                              *VIRTUAL, "--global-batch-size", "8", "--pipeline-schedule", "breadth-first"], ROOT)
    _expect_installed_then_cuda(r)


@needs_checkout
@pytest.mark.timeout(240)
def test_patch_series_applies_and_wires_arguments(subprocesses, megatron_lm_checkout: Path) -> None:
    apply = ["bash", str(ROOT / "scripts" / "apply_megatron_patches.sh")]
    r = subprocess.run([*apply, "--dry-run", str(megatron_lm_checkout)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    tag = re.search(r"series (core_v[\d.]+)", r.stdout).group(1)
    assert compat.version_tuple(tag[len("core_v"):]) == _megatron_version(megatron_lm_checkout)
    r = subprocess.run([*apply, str(megatron_lm_checkout)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "applied:" in r.stdout, r.stdout + r.stderr
    r = subprocess.run([*apply, str(megatron_lm_checkout)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "already applied" in r.stdout
    patched = (megatron_lm_checkout / "pretrain_gpt.py").read_text()
    assert "import megatron_bfpp.megatron" in patched and "megatron_bfpp.megatron.extra_args_provider(" in patched
    compile(patched, "pretrain_gpt.py", "exec")


@needs_checkout
@pytest.mark.timeout(240)
def test_patched_script_installs_the_plugin(subprocesses, megatron_lm_checkout: Path) -> None:
    r = subprocess.run(["bash", str(ROOT / "scripts" / "apply_megatron_patches.sh"), str(megatron_lm_checkout)],
                       capture_output=True, text=True, timeout=60)  # applied by the test above, or now
    assert r.returncode == 0, r.stderr
    r = _run_checkout_script([sys.executable, str(megatron_lm_checkout / "pretrain_gpt.py"), *TINY, *VIRTUAL,
                              "--global-batch-size", "8", "--pipeline-schedule", "breadth-first"], megatron_lm_checkout)
    _expect_installed_then_cuda(r)
    r = _run_checkout_script([sys.executable, str(megatron_lm_checkout / "pretrain_gpt.py"), *TINY,
                              "--global-batch-size", "8", "--pipeline-schedule", "breadth-first"],
                             megatron_lm_checkout)
    assert r.returncode == 2 and "megatron_bfpp: error: --pipeline-schedule breadth-first needs virtual stages" in r.stderr
