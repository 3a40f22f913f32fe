"""bench/ab_schedules.py's pure helpers, without starting a process: the exposed step boundary computed from a
rank's compute intervals, and the options of the step-boundary comparison."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from megatron_bfpp.schedule.events import TimelineEvent

BENCH = Path(__file__).resolve().parents[2] / "bench" / "ab_schedules.py"


@pytest.fixture(scope="module")
def ab():
    spec = importlib.util.spec_from_file_location("bench_ab_schedules", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def _event(rank, op, start, end, iteration, stream="compute"):
    return TimelineEvent(rank=rank, stream=stream, name=f"{op}", op=op, stage=0, microbatch=0, start=start, end=end,
                         iteration=iteration)


def test_boundary_is_last_compute_end_to_next_first_compute_start(ab):
    # Step 0: computes end at 5.0 (the W), step 1 starts computing at 7.5; step 2 at 12.25 after step 1's 10.0.
    intervals = [(0, 1.0, 2.0), (0, 2.0, 4.0), (0, 4.5, 5.0), (1, 7.5, 8.0), (1, 8.0, 10.0), (2, 12.25, 13.0)]
    assert ab.step_boundaries(intervals) == [2.5, 2.25]


def test_boundary_order_of_intervals_does_not_matter_and_gaps_in_iterations_are_skipped(ab):
    intervals = [(1, 8.0, 10.0), (0, 4.5, 5.0), (1, 7.5, 8.0), (0, 1.0, 2.0), (3, 20.0, 21.0)]
    assert ab.step_boundaries(intervals) == [2.5]  # no step 2: no boundary 1 -> 2 nor 2 -> 3
    assert ab.step_boundaries([(0, 1.0, 2.0)]) == []
    assert ab.step_boundaries([]) == []


def test_zero_length_marks_give_the_same_boundary(ab):
    # The hooks' marks (stock variants) are zero-length intervals at the first forward and the last gradient.
    assert ab.step_boundaries([(0, 1.0, 1.0), (0, 5.0, 5.0), (1, 7.5, 7.5), (1, 9.0, 9.0)]) == [2.5]


def test_compute_intervals_keep_this_ranks_compute_actions_only(ab):
    events = [
        _event(0, "F", 1.0, 2.0, 0), _event(0, "I", 2.0, 3.0, 0), _event(0, "W", 3.0, 4.0, 0),
        _event(0, "STEP", 4.0, 6.0, 0),  # the optimizer's STEP is the boundary, not compute
        _event(0, "GATHER", 6.0, 6.5, 0, stream="dp"), _event(0, "WAIT", 6.5, 7.0, 1),
        _event(0, "B", 7.0, 8.0, 1), _event(0, "F", 8.0, 9.0, 1),
        _event(1, "F", 0.0, 9.5, 1),  # another rank
    ]
    got = ab.compute_intervals(events, 0)
    assert got == [(0, 1.0, 2.0), (0, 2.0, 3.0), (0, 3.0, 4.0), (1, 7.0, 8.0), (1, 8.0, 9.0)]
    assert ab.step_boundaries(got) == [3.0]


def test_step_boundary_options(ab):
    a = ab.parse_args(["--layouts", "2x2", "--microbatches", "2", "--boundary-rounds", "5", "--stock-base",
                       "stock-G=P-distopt", "--variants",
                       "ours-interleaved-zb-z1,ours-interleaved-zb-z1-nostep,stock-G=P-distopt"])
    assert a.boundary_rounds == 5 and a.stock_base == "stock-G=P-distopt"
    assert ab.SHARDED == {"ours-interleaved-zb-z1": True, "ours-interleaved-zb-z1-nostep": False}
    assert {"step_boundary_ms_ranks", "step_boundary_ms_max", "boundary_rounds"} <= set(ab.CSV_FIELDS)
    with pytest.raises(SystemExit):
        ab.parse_args(["--variants", "ours-nonesuch"])
