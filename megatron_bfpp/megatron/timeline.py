"""`--timeline PATH` under Megatron-LM: each rank records the plugin runtime's actions of the first training
iterations into its own event file; `python -m megatron_bfpp.megatron.timeline PATH` merges them into one
Chrome trace (https://ui.perfetto.dev, or `bfpp draw PATH -o timeline.png`).
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
from pathlib import Path
from typing import Callable

RECORDED_ITERATIONS = 4  # enough to see the steady state after the first (warm-up) step; files stay small


def rank_file(path: str | Path, rank: int) -> Path:
    """Where rank `rank` writes its events: PATH with `.rank<R>` before the extension."""
    p = Path(path)
    return p.with_name(f"{p.stem}.rank{rank}{p.suffix or '.json'}")


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))


class TimelineRecorder:
    """Wraps a forward_backward function: records its first training calls and rewrites the rank's event file."""

    def __init__(self, path: str, iterations: int = RECORDED_ITERATIONS):
        self.path = path
        self.iterations = iterations
        self.calls = 0
        self._recorder = None

    def wrap(self, forward_backward: Callable) -> Callable:
        from megatron_bfpp.runtime import ActionRecorder, set_recorder
        from megatron_bfpp.trace.chrome import write_rank_file

        def write() -> None:
            rec = self._recorder
            rec.flush()
            write_rank_file(rec.events, rank_file(self.path, rec.rank))

        def recorded(*args, **kwargs):
            rec = self._recorder
            if rec is not None and rec.enabled:
                # The previous recorded iteration is over: its step boundary, which the optimizer records after
                # the schedule, is in (the file written after the schedule is rewritten with it).
                rec.enabled = False
                write()
            if kwargs.get("forward_only") or self.calls >= self.iterations:
                return forward_backward(*args, **kwargs)
            if rec is None:
                rec = self._recorder = ActionRecorder(_global_rank())
            rec.enabled, rec.iteration = True, self.calls
            set_recorder(rec)
            try:
                return forward_backward(*args, **kwargs)
            finally:
                set_recorder(None)  # only the optimizer's step boundary records into `rec` until the next call
                self.calls += 1
                write()

        recorded.__wrapped__ = forward_backward  # type: ignore[attr-defined]
        return recorded


def merge(path: str | Path) -> tuple[Path, int]:
    """Merge every rank file of `path` into one Chrome trace at `path`; returns (path, number of rank files)."""
    from megatron_bfpp.trace.chrome import merge_rank_files, write_chrome_trace

    p = Path(path)
    files = sorted(glob.glob(str(p.with_name(f"{glob.escape(p.stem)}.rank*{p.suffix or '.json'}"))))
    if not files:
        raise FileNotFoundError(f"no rank files {rank_file(p, 0).name.replace('rank0', 'rank*')} next to {p}")
    write_chrome_trace(merge_rank_files(files), p, metadata={"title": f"megatron_bfpp timeline ({len(files)} ranks)"})
    return p, len(files)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_bfpp.megatron.timeline",
        description="Merge the per-rank files written under --timeline PATH into one Chrome trace at PATH.",
    )
    parser.add_argument("path", help="the --timeline PATH given to the training run")
    args = parser.parse_args(argv)
    try:
        out, n = merge(args.path)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({n} ranks)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
