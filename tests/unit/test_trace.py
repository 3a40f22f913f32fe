"""Timelines: Chrome trace round trip and layout, metrics, checks against a schedule, drawing, run reports."""

import contextlib
import csv
import io
import json
import struct

import pytest

from megatron_bfpp import cli
from megatron_bfpp.schedule import make_schedule
from megatron_bfpp.trace.chrome import (
    TRACKS, TraceFormatError, chrome_trace_metadata, load_chrome_trace, merge_rank_files, write_chrome_trace,
    write_rank_file,
)
from megatron_bfpp.schedule.events import TimelineEvent
from megatron_bfpp.trace.inputs import simulated_unit_timeline as unit_timeline
from megatron_bfpp.trace.metrics import check_against_schedule, compute_overlaps, iteration_metrics
from megatron_bfpp.trace.report import load_report, render

pytestmark = pytest.mark.timeout(60)


def ev(rank, stream, name, op, stage, mb, start, end, it=0, peer=None):
    return TimelineEvent(rank, stream, name, op, stage, mb, start, end, it, peer)


def run_cli(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(argv)
    return rc, out.getvalue(), err.getvalue()


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def two_iterations():
    """A ZeRO-3 breadth-first schedule laid out twice (iterations 0 and 1), with data-parallel waits added."""
    s = make_schedule("breadth-first", 2, 2, 3, zero_stage=3)
    events = unit_timeline(s, 0.25, 0.5, iteration=0)
    step = max(e.end for e in events)
    events += [ev(e.rank, e.stream, e.name, e.op, e.stage, e.microbatch, e.start + step + 1, e.end + step + 1, 1)
               for e in unit_timeline(s, 0.25, 0.5)]
    events.append(ev(1, "dp", "wait GATHER1", "WAIT", 1, None, 0.0, 0.125, 1))
    return s, events


# ---- Chrome trace ----

@pytest.mark.parametrize("epoch", [0.0, 1.7e9])
def test_chrome_trace_round_trip(tmp_path, epoch):
    """Recorders time in seconds since the epoch: the file counts from the first event, reading restores it."""
    _, events = two_iterations()
    events = [ev(e.rank, e.stream, e.name, e.op, e.stage, e.microbatch, e.start * 1e-3 + epoch,
                 e.end * 1e-3 + epoch, e.iteration) for e in events]
    path = write_chrome_trace(events, tmp_path / "t.json", metadata={"config": {"schedule": "breadth-first"}})
    assert min(x["ts"] for x in json.loads(path.read_text())["traceEvents"] if x["ph"] == "X") == 0.0
    back = load_chrome_trace(path)
    assert len(back) == len(events)
    for a, b in zip(events, back):
        assert (a.rank, a.stream, a.name, a.op, a.stage, a.microbatch, a.iteration) == (
            b.rank, b.stream, b.name, b.op, b.stage, b.microbatch, b.iteration)
        assert b.start == pytest.approx(a.start, rel=0, abs=1e-9)  # well under a microsecond
        assert b.end - b.start == pytest.approx(a.end - a.start, rel=0, abs=1e-9)
    assert chrome_trace_metadata(path) == {"config": {"schedule": "breadth-first"}}


def test_chrome_trace_layout(tmp_path):
    events = [ev(0, "compute", "F0:1", "F", 0, 1, 0.5, 0.75), ev(1, "p2p", "SEND_B1:0", "SEND_B", 1, 0, 1.0, 1.5),
              ev(1, "dp", "REDUCE1", "REDUCE", 1, None, 2.0, 2.25, 3)]
    d = json.loads(write_chrome_trace(events, tmp_path / "t.json").read_text())
    assert d["otherData"] == {"time_origin_s": 0.5}
    meta = [e for e in d["traceEvents"] if e["ph"] == "M"]
    procs = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert procs == {0: "rank 0", 1: "rank 1"}
    tracks = [(0, "compute"), (1, "pipeline p2p"), (2, "data-parallel")]
    assert threads == {(r, t): n for r in (0, 1) for t, n in tracks}
    xs = [e for e in d["traceEvents"] if e["ph"] == "X"]
    assert [(x["name"], x["pid"], x["tid"]) for x in xs] == [("F0:1", 0, 0), ("SEND_B1:0", 1, 1), ("REDUCE1", 1, 2)]
    assert [(x["ts"], x["dur"]) for x in xs] == [(0.0, 250000.0), (5e5, 5e5), (1.5e6, 250000.0)]
    assert xs[0]["args"] == {"op": "F", "stage": 0, "microbatch": 1, "iteration": 0}
    assert xs[2]["args"] == {"op": "REDUCE", "stage": 1, "microbatch": None, "iteration": 3}
    assert {s: TRACKS[s][0] for s in ("compute", "p2p", "dp")} == {"compute": 0, "p2p": 1, "dp": 2}


def test_merge_rank_files(tmp_path):
    _, events = two_iterations()
    paths = [write_rank_file([e for e in events if e.rank == r], tmp_path / f"rank{r}.json") for r in (1, 0)]
    merged = merge_rank_files(paths)
    assert sorted(map(str, merged)) == sorted(map(str, events))
    keys = [(e.iteration, e.start, e.rank) for e in merged]
    assert keys == sorted(keys)
    with pytest.raises(TraceFormatError, match="rank 0 appears in both"):
        merge_rank_files([paths[1], paths[1]])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"rank": 0, "stream": "compute", "name": "F0:0"}]))
    with pytest.raises(TraceFormatError, match="lacks op, start, end"):
        merge_rank_files([bad])


# ---- metrics ----

def test_metrics_hand_made():
    """Each rank's window splits into compute, bubble, exposed p2p / dp, optimizer and other; a receive's wait
    is bubble until its sender posted the send, exposed p2p after."""
    events = [
        ev(0, "compute", "F0:0", "F", 0, 0, 0.0, 1.0),
        ev(0, "p2p", "SEND_F0:0", "SEND_F", 0, 0, 1.0, 1.0),
        ev(0, "p2p", "wait RECV_B0:0", "WAIT", 0, 0, 1.0, 2.5, peer=1),
        ev(0, "compute", "B0:0", "B", 0, 0, 2.5, 4.5),
        ev(0, "dp", "wait REDUCE0", "WAIT", 0, None, 4.5, 5.0),
        ev(0, "dp", "REDUCE0", "REDUCE", 0, None, 4.5, 5.0),
        ev(1, "dp", "wait GATHER1", "WAIT", 1, None, 0.0, 0.5),
        ev(1, "p2p", "wait RECV_F1:0", "WAIT", 1, 0, 0.5, 1.0, peer=0),
        ev(1, "compute", "F1:0", "F", 1, 0, 1.0, 1.5),
        ev(1, "compute", "B1:0", "B", 1, 0, 1.5, 2.2),
        ev(1, "p2p", "SEND_B1:0", "SEND_B", 1, 0, 2.2, 2.3),
    ]
    m = iteration_metrics(events)
    assert m.iteration == 0 and m.consistent and m.step_time_s == 5.0
    r0, r1 = m.ranks
    parts = lambda r: tuple(round(x, 9) for x in (r.compute_s, r.bubble_s, r.exposed_p2p_wait_s,  # noqa: E731
                                                   r.exposed_dp_wait_s, r.optimizer_s, r.other_s))
    # rank 0 waits 1.2 s for rank 1 to produce the gradient (bubble), then 0.3 s for the transfer.
    assert parts(r0) == (3.0, 1.2, 0.3, 0.5, 0.0, 0.0)
    # rank 1: the activation was sent the moment its wait ended (all bubble); idle after its last event.
    assert parts(r1) == (1.2, 0.5 + 2.7, 0.0, 0.5, 0.0, 0.1)
    for r in m.ranks:
        assert r.accounted_s == pytest.approx(r.step_time_s)
        assert r.bubble == pytest.approx(r.bubble_s / r.step_time_s)
    assert (r0.span_s, r1.span_s) == (5.0, 2.3)
    assert m.bubble == pytest.approx((1.2 + 3.2) / 10)
    # Without the sender's events, a receive's wait is exposed p2p.
    alone = iteration_metrics([e for e in events if e.rank == 0])
    assert alone.ranks[0].bubble_s == 0.0 and alone.ranks[0].exposed_p2p_wait_s == 1.5
    # A rank's own window (e.g. its measured step) replaces the global one.
    m1 = iteration_metrics(events, windows={1: (0.0, 2.5)})
    assert m1.ranks[1].bubble == pytest.approx(0.7 / 2.5) and m1.ranks[1].accounted_s == pytest.approx(2.5)
    # The optimizer step is its own part.
    opt = iteration_metrics(events + [ev(1, "dp", "wait REDUCE", "WAIT", None, None, 2.3, 4.0),
                                      ev(1, "compute", "OPTIMIZER", "OPTIMIZER", None, None, 4.0, 5.0)])
    assert parts(opt.ranks[1]) == (1.2, 0.5, 0.0, 2.2, 1.0, 0.1)
    d = m.to_dict()
    assert d["per_rank"][0]["bubble"] == pytest.approx(0.24) and d["consistent"] is True
    assert d["exposed_p2p_wait_s"] == pytest.approx(0.15)


def test_overlap_detection():
    ok = [ev(0, "compute", "F0:0", "F", 0, 0, 0.0, 1.0), ev(0, "compute", "F0:1", "F", 0, 1, 1.0, 2.0),
          ev(1, "compute", "F1:0", "F", 1, 0, 0.5, 1.5), ev(0, "dp", "GATHER0", "GATHER", 0, None, 0.2, 1.8)]
    assert compute_overlaps(ok) == []
    bad = ok + [ev(0, "compute", "B0:0", "B", 0, 0, 1.9, 3.0), ev(1, "compute", "B1:0", "B", 1, 0, 2.0, 1.0)]
    problems = compute_overlaps(bad)
    assert len(problems) == 2
    assert any(p.startswith("rank 0") and "B0:0 starts at 1.9 before F0:1 ends at 2" in p for p in problems)
    assert any(p.startswith("rank 1") and "B1:0 ends before it starts" in p for p in problems)
    assert not iteration_metrics(bad).consistent


@pytest.mark.parametrize("name,pp,vp,m", [
    ("breadth-first", 4, 2, 8), ("interleaved-1f1b", 4, 2, 8), ("1f1b", 4, 1, 6), ("gpipe", 3, 1, 5),
    ("breadth-first", 8, 4, 4), ("breadth-first", 4, 3, 2),
])
def test_unit_layout_bubble_matches_closed_form(name, pp, vp, m):
    """The simulator's unit-cost layout (what `bfpp draw` uses for schedules), measured by `metrics`, against
    the closed forms. With t_B = 2 t_F and free communication: bubble/ideal = (P-1)/(V M) for M >= P; breadth-first with
    M < P: [(V-1) max(M,P) + M + P - 1]/(V M) - 1 (the design brief's closed forms)."""
    ev_ = unit_timeline(make_schedule(name, pp, vp, m, zero_stage=3))
    over = (pp - 1) / (vp * m) if m >= pp else ((vp - 1) * max(m, pp) + m + pp - 1) / (vp * m) - 1
    metrics = iteration_metrics(ev_)
    assert metrics.step_time_s == pytest.approx(3 * vp * m * (1 + over))
    for r in metrics.ranks:
        assert r.bubble == pytest.approx(over / (1 + over), rel=1e-12)
    assert metrics.consistent


def test_check_against_schedule():
    s, events = two_iterations()
    assert check_against_schedule(events, s, iteration=0) == []
    assert check_against_schedule(events, s, iteration=1) == []
    it0 = [e for e in events if e.iteration == 0]
    # Two compute events of rank 0 swapped in time: out of the schedule's order.
    f = [i for i, e in enumerate(it0) if e.rank == 0 and e.op == "F"][:2]
    swapped = list(it0)
    a, b = swapped[f[0]], swapped[f[1]]
    swapped[f[0]] = ev(0, a.stream, a.name, a.op, a.stage, a.microbatch, b.start, b.end)
    swapped[f[1]] = ev(0, b.stream, b.name, b.op, b.stage, b.microbatch, a.start, a.end)
    assert any("first difference at position 0: ran F0:1, scheduled F0:0" in p
               for p in check_against_schedule(swapped, s))
    missing = [e for e in it0 if e.name != "B2:1"]
    want = "11 compute events, schedule has 12; first difference at position 7: ran B2:2, scheduled B2:1"
    assert any(want in p for p in check_against_schedule(missing, s))
    # A GATHER recorded after the compute that needs it.
    f2 = next(e for e in it0 if e.rank == 0 and e.name == "F2:0")
    late = [ev(e.rank, e.stream, e.name, e.op, e.stage, e.microbatch, f2.start + 0.1, f2.start + 0.1)
            if e.rank == 0 and e.name == "GATHER2" else e for e in it0]
    assert any(f"F2:0 at {f2.start:g} runs before a GATHER of stage 2" in p for p in check_against_schedule(late, s))
    # The stage the step boundary gathers (0 on rank 0) is gathered from the start: its first GATHER is a no-op
    # the runtime need not record, and the boundary's own may come at the iteration's end (as the optimizer
    # records it).
    assert check_against_schedule([e for e in it0 if not (e.rank == 0 and e.name == "GATHER0")], s) == []
    # Data parallelism: ranks 2, 3 are replicas of pipeline ranks 0, 1.
    replicas = it0 + [ev(e.rank + 2, e.stream, e.name, e.op, e.stage, e.microbatch, e.start, e.end) for e in it0]
    with pytest.raises(ValueError, match="pass pp_rank_of"):
        check_against_schedule(replicas, s)
    assert check_against_schedule(replicas, s, pp_rank_of={0: 0, 1: 1, 2: 0, 3: 1}) == []


# ---- drawing ----

def test_draw_schedule_from_bfpp_schedule(tmp_path):
    rc, out, _ = run_cli(["schedule", "--schedule", "breadth-first", "--pp", "4", "--vp", "2", "--microbatches",
                          "8", "--zero-stage", "3", "--format", "json"])
    assert rc == 0
    sched = tmp_path / "bf.json"
    sched.write_text(out)
    png = tmp_path / "bf.png"
    rc, out, err = run_cli(["draw", str(sched), "-o", str(png), "--chrome", str(tmp_path / "bf.trace.json")])
    assert rc == 0, err
    w, h = png_size(png)
    assert f"({w}x{h} px)" in out and w == 1500 and h > 300
    # Ranks x streams rows are drawn in colour: the eight micro-batch colours and more.
    import matplotlib.image as mpimg
    import numpy as np
    img = mpimg.imread(png)
    assert img.shape[:2] == (h, w)
    colours = {tuple(c) for c in np.round(img[..., :3].reshape(-1, 3), 2)}
    assert len(colours) > 20
    # The Chrome trace of the drawn layout is a valid timeline of the schedule.
    s = make_schedule("breadth-first", 4, 2, 8, zero_stage=3)
    assert check_against_schedule(load_chrome_trace(tmp_path / "bf.trace.json"), s) == []
    # Compare mode stacks two panels: taller, same width.
    rc, df_json, _ = run_cli(["schedule", "--schedule", "interleaved-1f1b", "--pp", "4", "--vp", "2",
                              "--microbatches", "8", "--zero-stage", "3", "--format", "json"])
    df = tmp_path / "df.json"
    df.write_text(df_json)
    rc, _, err = run_cli(["draw", "--compare", str(sched), str(df), "-o", str(tmp_path / "cmp.png")])
    assert rc == 0, err
    w2, h2 = png_size(tmp_path / "cmp.png")
    assert w2 == w and h2 > 1.8 * h
    rc, _, err = run_cli(["draw", str(sched), "--t-forward", "0", "-o", str(tmp_path / "x.png")])
    assert rc == 2 and "--t-forward and --t-backward must be > 0" in err


def test_titles_from_each_config_convention():
    from megatron_bfpp.trace.inputs import describe_config
    ours = {"schedule": "breadth-first", "pp": 4, "vp": 2, "microbatches": 8, "dp": 2, "zero_stage": 3}
    megatron = {"pipeline_schedule": "breadth-first", "pipeline_model_parallel_size": 4,
                "virtual_pipeline_model_parallel_size": 2, "num_micro_batches": 8, "data_parallel_size": 2,
                "zero_stage": 3}
    assert describe_config(ours) == describe_config(megatron) == "breadth-first P=4 V=2 M=8 D=2 ZeRO-3"


def test_bar_styles_distinguish_kinds():
    from megatron_bfpp.trace.draw import bar_style, microbatch_colours
    colours = dict(enumerate(microbatch_colours(3)))
    assert len(set(colours.values())) == 3
    f0, _, lf = bar_style(ev(0, "compute", "F2:0", "F", 2, 0, 0, 1), colours)
    b0, _, lb = bar_style(ev(0, "compute", "B2:0", "B", 2, 0, 1, 3), colours)
    f1, _, _ = bar_style(ev(0, "compute", "F2:1", "F", 2, 1, 3, 4), colours)
    w, _, _ = bar_style(ev(0, "p2p", "wait RECV_B2:0", "WAIT", 2, 0, 1, 2), colours)
    assert f0["color"] != f1["color"]  # colour by micro-batch
    assert f0["color"] != b0["color"] and f0["hatch"] is None and b0["hatch"]  # backward darker and hatched
    assert w["color"] not in {f0["color"], b0["color"], f1["color"]} and w["hatch"]
    assert (lf, lb) == ("2:0", "2:0")


def test_draw_trace_and_simulation_inputs(tmp_path):
    s, events = two_iterations()
    trace = write_chrome_trace(events, tmp_path / "run.json", metadata={"config": {"schedule": "breadth-first"}})
    sim = tmp_path / "sim.json"
    sim.write_text(json.dumps({"config": {"schedule": "breadth-first", "pp": 2},
                               "events": [e.to_dict() for e in events if e.iteration == 0]}))
    rc, out, err = run_cli(["draw", "--compare", str(sim), str(trace), "--iteration", "1", "-o",
                            str(tmp_path / "c.png")])
    assert rc != 0 and "--iteration 1 is not in the timeline; recorded iterations: 0" in err
    rc, out, err = run_cli(["draw", str(trace), "--iteration", "1", "-o", str(tmp_path / "t.png")])
    assert rc == 0, err
    assert png_size(tmp_path / "t.png")[0] == 1500
    rc, out, err = run_cli(["draw", "--compare", str(sim), str(trace), "-o", str(tmp_path / "c.png")])
    assert rc == 0, err
    rc, _, err = run_cli(["draw", str(tmp_path / "missing.json"), "-o", str(tmp_path / "x.png")])
    assert rc == 2 and "does not exist" in err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"hello": 1}))
    rc, _, err = run_cli(["draw", str(bad), "-o", str(tmp_path / "x.png")])
    assert rc == 2 and "not a timeline" in err
    rc, _, err = run_cli(["draw", str(tmp_path / "run.json"), "--compare", str(sim), str(trace), "-o", "x.png"])
    assert rc == 2 and "not both" in err
    rc, _, err = run_cli(["draw", "-o", str(tmp_path / "x.png")])
    assert rc == 2 and "--compare" in err


# ---- reports ----

def fake_reports(tmp_path):
    a = {
        "config": {"schedule": "breadth-first", "pp": 4, "vp": 2, "dp": 2, "zero_stage": 3, "microbatches": 8},
        "losses": [10.5, 9.25, 8.125],
        "iteration_times_s": [9.0, 0.5, 0.25, 0.75],
        "tokens_per_s": 12000.0,
        "measured": {"bubble": 0.158, "exposed_dp_wait_s": 0.002, "exposed_p2p_wait_s": 0.0125,
                     "per_rank": [{"rank": 0, "peak_memory_bytes": 1.5 * 2**30},
                                  {"rank": 1, "peak_memory_bytes": 2**30}]},
        "predicted": {"step_time_s": 0.45, "bubble": 0.1579, "tokens_per_s": 13000.0},
        "comm": {"all_gathers": 14, "reduce_scatters": 8},
    }
    b = {
        "config": {"schedule": "interleaved-1f1b", "pp": 4, "vp": 2, "dp": 2, "microbatches": 8},
        "losses": [{"iteration": 1, "loss": 10.5}, {"iteration": 2, "loss": 8.5}],
        "iteration_times_s": [0.8],
        "tokens_per_s": 8000.0,
        "memory": {"peak_allocated_bytes": 3 * 2**20},
    }
    pa, pb = tmp_path / "bf.json", tmp_path / "df.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    return pa, pb


def test_report_text_side_by_side(tmp_path):
    pa, pb = fake_reports(tmp_path)
    rc, out, err = run_cli(["report", str(pa), str(pb)])
    assert rc == 0, err
    lines = {line.split("  ")[0].strip(): line for line in out.splitlines()}
    assert lines[""].split() == ["bf", "df"]
    assert lines["schedule"].split()[1:] == ["breadth-first", "interleaved-1f1b"]
    assert lines["throughput (tokens/s)"].split()[2:] == ["12,000", "8,000", "(0.67x)"]
    assert lines["step time"].split()[2:] == ["500.00", "ms", "800.00", "ms"]  # median after the warm-up iteration
    assert lines["bubble"].split()[1:] == ["15.8%"]
    assert lines["peak memory"].split()[2:] == ["1.50", "GiB", "3.00", "MiB"]
    assert lines["final loss"].split()[2:] == ["8.1250", "8.5000"]
    assert lines["ZeRO stage"].split()[2:] == ["3"]
    assert lines["predicted bubble"].split()[2:] == ["15.8%"]
    assert lines["comm: all_gathers"].split()[2:] == ["14"]
    assert "T (tensor parallel)" not in out  # no run has it


def test_report_per_rank_blocks_and_simulator_prediction(tmp_path):
    """Per-rank lists for "memory" and "comm", and a prediction in the simulator's own field names."""
    r = {
        "config": {"pipeline_schedule": "breadth-first", "pp": 2, "global_batch_size": 16},
        "iteration_times_s": [2.0, 1.0],
        "memory": [{"rank": 0, "peak_bytes": 5 * 2**20}, {"rank": 1, "peak_bytes": 7 * 2**20}],
        "comm": [{"rank": 0, "dp_allgather_calls": 4, "pp_send_bytes": 1024},
                 {"rank": 1, "dp_allgather_calls": 6, "pp_send_bytes": 3072}],
        "predicted": {"step_time_s": 0.9, "bubble_fraction": 0.25, "exposed_pp_s": 0.01, "peak_memory_gib": 2.0},
    }
    path = tmp_path / "run.json"
    path.write_text(json.dumps(r))
    rc, out, err = run_cli(["report", str(path)])
    assert rc == 0, err
    lines = {line.split("  ")[0].strip(): line.split("  ")[-1].strip() for line in out.splitlines()}
    assert lines["schedule"] == "breadth-first" and lines["global batch size"] == "16"
    assert lines["step time"] == "1.000 s"
    assert lines["peak memory"] == "7.00 MiB"  # the maximum over ranks
    assert lines["comm: dp_allgather_calls (mean per rank)"] == "5"
    assert lines["comm: pp_send_bytes (mean per rank)"] == "2.00 KiB"
    assert lines["predicted bubble / compute"] == "25.0%" and "predicted bubble" not in lines
    assert lines["predicted exposed p2p"] == "10.00 ms" and lines["predicted peak memory"] == "2.00 GiB"


def test_report_markdown_and_csv(tmp_path):
    pa, pb = fake_reports(tmp_path)
    rc, md, _ = run_cli(["report", str(pa), str(pb), "--format", "markdown", "--labels", "BF,DF"])
    assert rc == 0
    rows = md.strip().splitlines()
    assert rows[0] == "|  | BF | DF |" and rows[1] == "|---|---:|---:|"
    assert "| throughput (tokens/s) | 12,000 | 8,000 (0.67x) |" in rows
    rc, text, _ = run_cli(["report", str(pa), str(pb), "--format", "csv"])
    table = {r[0]: r[1:] for r in csv.reader(io.StringIO(text))}
    assert table["metric"] == ["bf", "df"]
    assert table["throughput (tokens/s)"] == ["12000.0", "8000.0"]
    assert table["bubble"] == ["0.158", ""]
    assert float(table["peak memory"][1]) == 3 * 2**20


def test_report_errors(tmp_path):
    lst = tmp_path / "list.json"
    lst.write_text("[1, 2]")
    rc, _, err = run_cli(["report", str(lst)])
    assert rc == 2 and "expected a JSON object as written by --report-json" in err
    sched = tmp_path / "schedule.json"
    sched.write_text(json.dumps({"schedule": "gpipe", "ranks": [[]]}))
    rc, _, err = run_cli(["report", str(sched)])
    assert rc == 2 and "schedule.json: not a run report: it has none of config, losses" in err
    pa, pb = fake_reports(tmp_path)
    rc, _, err = run_cli(["report", str(pa), str(pb), "--labels", "only-one"])
    assert rc == 2 and "--labels gives 1 names for 2 reports" in err
    assert render([load_report(pa)], ["x"]).count("\n") > 10
