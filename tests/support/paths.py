"""Where the clone under test is, and the PYTHONPATH its subprocesses get (the clone first)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
IMPORT_GUARD = ROOT / "tests" / "support" / "import_guard"


def subprocess_pythonpath(*extra: str) -> str:
    """A PYTHONPATH for a subprocess that needs `extra` entries (a shim, a checkout): the clone comes first, and
    the import guard last (a shim's `sitecustomize` shadows the guard's and runs it)."""
    return os.pathsep.join([str(ROOT), *extra, str(IMPORT_GUARD)])


def megatron_lm_dir() -> str | None:
    """The Megatron-LM checkout for the checkout tests: $MEGATRON_LM_DIR, else ../shared/megatron-lm/core_v0.19.0
    beside the clone when it holds pretrain_gpt.py (what scripts/test.sh and .ci/run export), else None."""
    explicit = os.environ.get("MEGATRON_LM_DIR")
    if explicit:
        return explicit
    beside = ROOT.parent / "shared" / "megatron-lm" / "core_v0.19.0"
    return str(beside) if (beside / "pretrain_gpt.py").is_file() else None


def load_script(relative: str, name: str) -> ModuleType:
    """A script of the clone that is not a package module (bench/*.py, scripts/*.py), imported from its path with its
    folder first on sys.path while it loads, as `python <script>` has it (bench/results_csv.py is found so)."""
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module
