"""The trainer's run report (`--report-json`), its console lines and files, built from given inputs
(megatron_bfpp.trace.run_report), and the order in which the trainer's side publishes them (train/report.py)."""

import json
import types

import pytest

from megatron_bfpp.schedule.events import TimelineEvent
from megatron_bfpp.trace.chrome import chrome_trace_metadata, load_chrome_trace
from megatron_bfpp.trace.run_report import (
    build_run_report, done_line, measured_line, rank_events, with_step_bubble, write_json_atomic, write_timeline,
)

pytestmark = pytest.mark.timeout(60)
MiB = 2**20


def two_ranks(it: int, shift: float = 0.0) -> list[TimelineEvent]:
    """One iteration of two pipeline ranks (tests/unit/test_trace.py's metrics example): bubble 44%."""
    def ev(rank, stream, name, op, stage, mb, start, end, peer=None):
        return TimelineEvent(rank, stream, name, op, stage, mb, start + shift, end + shift, it, peer)
    return [
        ev(0, "compute", "F0:0", "F", 0, 0, 0.0, 1.0), ev(0, "p2p", "SEND_F0:0", "SEND_F", 0, 0, 1.0, 1.0),
        ev(0, "p2p", "wait RECV_B0:0", "WAIT", 0, 0, 1.0, 2.5, peer=1), ev(0, "compute", "B0:0", "B", 0, 0, 2.5, 4.5),
        ev(0, "dp", "wait REDUCE0", "WAIT", 0, None, 4.5, 5.0), ev(0, "dp", "REDUCE0", "REDUCE", 0, None, 4.5, 5.0),
        ev(1, "dp", "wait GATHER1", "WAIT", 1, None, 0.0, 0.5),
        ev(1, "p2p", "wait RECV_F1:0", "WAIT", 1, 0, 0.5, 1.0, peer=0),
        ev(1, "compute", "F1:0", "F", 1, 0, 1.0, 1.5), ev(1, "compute", "B1:0", "B", 1, 0, 1.5, 2.2),
        ev(1, "p2p", "SEND_B1:0", "SEND_B", 1, 0, 2.2, 2.3),
    ]


def per_rank_stats() -> list[dict]:
    return [{"comm": {"rank": r, "dp_allgather_calls": 4 + r}, "memory": {"rank": r, "peak_bytes": (5 + 2 * r) * MiB},
             "events": [e.to_dict() for e in two_ranks(2, shift=100.0) + two_ranks(3) if e.rank == r]}
            for r in (0, 1)]


def report_of(times=(9.0, 1.0, 4.0, 2.0), predicted=None, measured_iteration=3) -> dict:
    per_rank = per_rank_stats()
    return build_run_report(
        config={"pp": 2}, losses=[3.0, 2.5, 2.0, 1.5], first_iteration=1, skipped_iterations=[2],
        loss_scales=[1.0] * 4, iteration_times_s=list(times), tokens_per_iteration=32, per_rank=per_rank,
        events=rank_events(per_rank), measured_iteration=measured_iteration, predicted=predicted,
    )


def test_report_from_given_inputs():
    predicted = {"bubble_fraction": 0.25, "basis": "unit costs"}
    rep = report_of(predicted=predicted)
    assert list(rep) == ["config", "losses", "first_iteration", "skipped_iterations", "loss_scales",
                         "iteration_times_s", "tokens_per_s", "comm", "memory", "measured", "predicted"]
    assert rep["losses"] == [3.0, 2.5, 2.0, 1.5] and rep["skipped_iterations"] == [2]
    assert rep["comm"] == [{"rank": 0, "dp_allgather_calls": 4}, {"rank": 1, "dp_allgather_calls": 5}]
    assert [m["peak_bytes"] for m in rep["memory"]] == [5 * MiB, 7 * MiB]
    # Steady state: the median of 1, 4, 2 s (the 9 s warm-up left out).
    assert rep["tokens_per_s"] == 32 / 2.0
    # Two steady iterations: the upper of the two middle times, not their mean.
    assert report_of(times=(9.0, 1.0, 4.0))["tokens_per_s"] == 32 / 4.0
    assert report_of(times=(4.0,))["tokens_per_s"] == 32 / 4.0
    # "measured": the last iteration's events only (iteration 2's are shifted and would change the step time).
    measured = rep["measured"]
    assert measured["iteration"] == 3 and measured["step_time_s"] == 5.0
    assert measured["bubble"] == pytest.approx((1.2 + 3.2) / 10)
    # Each rank's peak memory merged into its measured metrics; the report's peak is the maximum.
    assert [(r["rank"], r["peak_memory_bytes"]) for r in measured["per_rank"]] == [(0, 5 * MiB), (1, 7 * MiB)]
    assert measured["peak_memory_bytes"] == 7 * MiB
    # The simulator's bubble over compute, b = 0.25, as bubble over step time: b / (1 + b).
    assert rep["predicted"] == {"bubble_fraction": 0.25, "basis": "unit costs", "bubble": pytest.approx(0.2)}
    assert "bubble" not in predicted  # the caller's prediction is left as it was


def test_report_without_measurement_or_prediction():
    rep = report_of(measured_iteration=4)  # no event of iteration 4 recorded
    assert "measured" not in rep and rep["predicted"] is None
    assert list(rep)[-1] == "predicted"
    assert with_step_bubble({"error": "no prediction: uneven stages"}) == {"error": "no prediction: uneven stages"}


def test_measured_line_format():
    measured = report_of()["measured"]
    line = measured_line(measured, {})
    assert line == ("measured (iteration 3): bubble 44.0%, exposed dp wait 500.0 ms, exposed p2p wait 150.0 ms, "
                    "peak memory 7.0 MiB | per rank bubble/dp/p2p/peak: r0=24%/500ms/300ms/5.0MiB "
                    "r1=64%/500ms/0ms/7.0MiB")
    with_prediction = measured_line(measured, {"bubble": 0.2, "basis": "unit costs"})
    assert with_prediction == line + " | predicted bubble 20.0% (unit costs)"
    assert measured_line(measured, {"bubble": 0.2}).endswith(" | predicted bubble 20.0% (simulator)")
    # A rank without a peak (its memory not gathered) shows 0.
    measured["per_rank"][1]["peak_memory_bytes"] = None
    assert "r1=64%/500ms/0ms/0.0MiB" in measured_line(measured, {})


def test_done_line():
    assert done_line(3, "breadth-first", 4.84671, 285.84) == \
        "done: 3 iterations, schedule breadth-first, final lm loss 4.8467, 285.8 tokens/s"


def test_report_files(tmp_path):
    path = str(tmp_path / "report.json")
    write_json_atomic(path, {"a": 1})
    with pytest.raises(TypeError):  # fails half-way through the dump: the old report stays whole
        write_json_atomic(path, {"a": 2, "b": object()})
    assert json.loads(open(path).read()) == {"a": 1}
    rep = report_of()
    write_json_atomic(path, rep)
    assert json.loads(open(path).read()) == json.loads(json.dumps(rep))
    timeline = str(tmp_path / "timeline.json")
    events = rank_events(per_rank_stats())
    write_timeline(events, timeline, {3}, rep["config"])
    key = lambda e: (e.rank, e.start, e.name, e.iteration)  # noqa: E731 (the trace keeps no peers)
    assert sorted(map(key, load_chrome_trace(timeline))) == sorted(key(e) for e in events if e.iteration == 3)
    assert chrome_trace_metadata(timeline)["config"] == {"pp": 2}


def test_trainer_publishes_in_order(tmp_path, monkeypatch):
    """The trainer's side: measured line, timeline, report, done line; the files hold what it returns."""
    from megatron_bfpp.train import report as collector

    monkeypatch.setattr(collector, "prediction", lambda args, times, **_: {"bubble_fraction": 0.25, "basis": "b"})
    args = types.SimpleNamespace(global_batch_size=4, seq_length=8, train_iters=3, timeline_iterations=[],
                                 timeline=str(tmp_path / "t.json"), report_json=str(tmp_path / "r.json"))
    lines: list[str] = []
    rep = collector.publish_run_report(args, per_rank_stats(), schedule="gpipe", config={"pp": 2},
                                       losses=[2.0, 1.23456], first_iteration=2, skipped_iterations=[],
                                       loss_scales=[1.0, 1.0], iteration_times=[1.0, 0.5], log=lines.append)
    assert lines == [measured_line(rep["measured"], rep["predicted"]), f"timeline written to {args.timeline}",
                     f"report written to {args.report_json}",
                     "done: 3 iterations, schedule gpipe, final lm loss 1.2346, 64.0 tokens/s"]
    assert rep["measured"]["iteration"] == 3  # --train-iters: the last iteration
    assert rep["predicted"]["bubble"] == pytest.approx(0.2) and rep["first_iteration"] == 2
    assert json.loads(open(args.report_json).read()) == json.loads(json.dumps(rep))
    assert {e.iteration for e in load_chrome_trace(args.timeline)} == {3}  # default: the last iteration


def test_trainer_prints_the_predicted_step_time_beside_the_measured_one(tmp_path, monkeypatch):
    """With a predicted step time the measured line leaves the prediction to its own line, right after it."""
    from megatron_bfpp.train import report as collector

    predicted = {"bubble_fraction": 0.25, "basis": "costs measured on this machine: ...", "step_time_s": 0.5,
                 "measured_step_time_s": 0.4, "measured_iterations": [3, 3]}
    monkeypatch.setattr(collector, "prediction", lambda args, times, **_: dict(predicted))
    args = types.SimpleNamespace(global_batch_size=4, seq_length=8, train_iters=3, timeline_iterations=[],
                                 timeline=None, report_json=None)
    lines: list[str] = []
    rep = collector.publish_run_report(args, per_rank_stats(), schedule="gpipe", config={"pp": 2},
                                       losses=[2.0, 1.5, 1.0], first_iteration=1, skipped_iterations=[],
                                       loss_scales=[1.0] * 3, iteration_times=[1.0, 0.5, 0.4], log=lines.append)
    assert lines[:2] == [measured_line(rep["measured"], {}),
                         "predicted (costs measured on this machine): step time 500.0 ms vs measured 400.0 ms "
                         "(median of iterations 3-3), +25.0% | bubble 20.0% vs measured 44.0% (iteration 3)"]
    assert lines[2].startswith("done: 3 iterations")
