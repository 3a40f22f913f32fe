"""`python -m megatron_bfpp.train ...`: one trainer process (torchrun starts one per rank)."""

import sys

from .loop import main

sys.exit(main())
