#!/usr/bin/env python3
"""Python side of scripts/gpu_check.sh: `probe`, `layer`, `summary` (`--help`; megatron_bfpp/devkit/gpu_check/)."""

import sys
from pathlib import Path

# This checkout's package, whether or not it is installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_bfpp.devkit.gpu_check.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
