"""Timelines of real and simulated runs: Chrome traces, metrics, PNG drawings (`bfpp draw`), the trainer's run
reports (`run_report`) and their side-by-side summary (`bfpp report`). Importing the package does not import
matplotlib; `trace.draw` does."""

from .chrome import load_chrome_trace, merge_rank_files, write_chrome_trace, write_rank_file
from ..schedule.events import STREAMS, TimelineEvent
from .metrics import check_against_schedule, iteration_metrics

__all__ = [
    "TimelineEvent", "STREAMS", "write_chrome_trace", "load_chrome_trace", "merge_rank_files",
    "write_rank_file", "iteration_metrics", "check_against_schedule",
]
