"""The CSV form of a benchmark's result rows, shared by the bench scripts (each run as `python bench/X.py`, which
puts this folder on sys.path)."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Sequence


def write_csv(rows: list[dict], path: Path, fields: Sequence[str]) -> None:
    """`rows` under the header `fields`; floats to 6 significant digits, so reruns diff only where a number moved."""
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(fields))
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})
