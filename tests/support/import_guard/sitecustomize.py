"""Test-only: every Python process the tests start imports `megatron_bfpp` from the clone under test.

`tests/conftest.py` puts the clone first on PYTHONPATH and names it in MEGATRON_BFPP_TEST_ROOT; a shared venv's
editable install may point at another clone, and a subprocess that lost the path would test that one silently.
This file runs at interpreter start (as `sitecustomize`, or from the CPU shim's) and stops the process when
`megatron_bfpp` would come from anywhere else.
"""

from __future__ import annotations

import importlib.util
import os
import sys


def check_import_root() -> None:
    root = os.environ.get("MEGATRON_BFPP_TEST_ROOT")
    if not root:
        return
    spec = importlib.util.find_spec("megatron_bfpp")
    found = os.path.dirname(spec.origin) if spec is not None and spec.origin else "<not importable>"
    expected = os.path.join(root, "megatron_bfpp")
    if os.path.realpath(found) != os.path.realpath(expected):
        sys.stderr.write(f"error: megatron_bfpp would be imported from {found}, not from the clone under test "
                         f"({expected}); put {root} first on PYTHONPATH\n")
        sys.stderr.flush()
        os._exit(3)


check_import_root()
