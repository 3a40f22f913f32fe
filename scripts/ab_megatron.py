#!/usr/bin/env python3
"""A/B: stock Megatron-LM at its best against megatron_bfpp (`--help`; the driver is megatron_bfpp/megatron/ab/)."""

import sys
from pathlib import Path

# This checkout's package, whether or not it is installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_bfpp.megatron.ab.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
