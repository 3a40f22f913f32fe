"""Chrome trace JSON (Perfetto / chrome://tracing) for timelines, and merging of per-rank event files.

Layout: one process per rank ("rank R"), one thread per stream (compute, pipeline p2p, data-parallel), one
complete ("X") event per action with microsecond timestamps, named by the action's text form and carrying
args {"op", "stage", "microbatch", "iteration"} (the keys of `bfpp schedule --format json` plus iteration).
Timestamps count from the earliest event (recorders use seconds since the epoch, which Perfetto would show as
huge offsets and which lose sub-microsecond precision in microseconds); the origin is kept in
otherData["time_origin_s"] so that reading the file back restores the recorded times.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Sequence

from ..schedule.events import STREAMS, TimelineEvent

# Stream -> (thread id, track name shown in Perfetto). Thread ids are fixed so tracks keep the same order.
TRACKS: dict[str, tuple[int, str]] = {
    "compute": (0, "compute"),
    "p2p": (1, "pipeline p2p"),
    "dp": (2, "data-parallel"),
}
_STREAM_OF_TID = {tid: stream for stream, (tid, _) in TRACKS.items()}
_US = 1e6  # Chrome traces count microseconds; events count seconds
ORIGIN_KEY = "time_origin_s"


class TraceFormatError(ValueError):
    """A timeline file is not in a form this package reads; the message names the file and what was expected."""


def chrome_trace_dict(events: Iterable[TimelineEvent], metadata: dict | None = None,
                      origin: float | None = None) -> dict:
    """The Chrome trace (JSON object format) of `events`; `metadata` is kept under "otherData".

    `origin` (seconds) is subtracted from every time; None uses the earliest event start.
    """
    events = list(events)
    if origin is None:
        origin = min((e.start for e in events), default=0.0)
    trace: list[dict] = []
    for rank in sorted({e.rank for e in events}):
        trace.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        trace.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        for stream in STREAMS:
            tid, label = TRACKS[stream]
            trace.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": label}})
            trace.append({"name": "thread_sort_index", "ph": "M", "pid": rank, "tid": tid,
                          "args": {"sort_index": tid}})
    for e in events:
        if e.stream not in TRACKS:
            raise TraceFormatError(f"event {e.name!r} on rank {e.rank} has stream {e.stream!r}; "
                                   f"expected one of {', '.join(STREAMS)}")
        trace.append({
            "name": e.name,
            "cat": e.stream,
            "ph": "X",
            "ts": (e.start - origin) * _US,
            "dur": max(0.0, e.end - e.start) * _US,
            "pid": e.rank,
            "tid": TRACKS[e.stream][0],
            "args": {"op": e.op, "stage": e.stage, "microbatch": e.microbatch, "iteration": e.iteration},
        })
    return {"traceEvents": trace, "displayTimeUnit": "ms", "otherData": {**(metadata or {}), ORIGIN_KEY: origin}}


def write_chrome_trace(events: Iterable[TimelineEvent], path: str | Path, metadata: dict | None = None,
                       origin: float | None = None) -> Path:
    """Write `events` as one Chrome trace JSON file (opens in https://ui.perfetto.dev or chrome://tracing)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(chrome_trace_dict(events, metadata, origin)))
    return p


def events_from_chrome_dict(d: dict, source: str = "trace") -> list[TimelineEvent]:
    """TimelineEvents back from a Chrome trace written by `write_chrome_trace` (metadata events skipped)."""
    if not isinstance(d, dict) or not isinstance(d.get("traceEvents"), list):
        raise TraceFormatError(f"{source}: not a Chrome trace (expected a JSON object with a 'traceEvents' list)")
    origin = float((d.get("otherData") or {}).get(ORIGIN_KEY, 0.0))
    out: list[TimelineEvent] = []
    for ev in d["traceEvents"]:
        if ev.get("ph") != "X":
            continue
        args = ev.get("args") or {}
        stream = ev.get("cat") if ev.get("cat") in TRACKS else _STREAM_OF_TID.get(ev.get("tid"))
        if stream is None or "op" not in args:
            raise TraceFormatError(f"{source}: event {ev.get('name')!r} lacks a stream (cat/tid) or args.op; "
                                   "only traces written by megatron_bfpp can be read back")
        start = origin + float(ev["ts"]) / _US
        out.append(TimelineEvent(
            rank=int(ev["pid"]), stream=stream, name=str(ev["name"]), op=str(args["op"]),
            stage=args.get("stage"), microbatch=args.get("microbatch"),
            start=start, end=origin + (float(ev["ts"]) + float(ev.get("dur", 0.0))) / _US,
            iteration=int(args.get("iteration") or 0),
        ))
    return out


def load_chrome_trace(path: str | Path) -> list[TimelineEvent]:
    """Read a Chrome trace written by `write_chrome_trace` back into TimelineEvents."""
    p = Path(path)
    return events_from_chrome_dict(_read_json(p), str(p))


def chrome_trace_metadata(path: str | Path) -> dict:
    """The metadata stored in a Chrome trace ("otherData" without the time origin), or {}."""
    d = _read_json(Path(path))
    meta = dict(d.get("otherData") or {}) if isinstance(d, dict) else {}
    meta.pop(ORIGIN_KEY, None)
    return meta


def events_from_list(items: object, source: str = "events") -> list[TimelineEvent]:
    """TimelineEvents from a JSON list of `TimelineEvent.to_dict()` dicts (what each rank dumps)."""
    if not isinstance(items, list):
        raise TraceFormatError(f"{source}: expected a JSON list of timeline events")
    out = []
    for i, d in enumerate(items):
        missing = [k for k in ("rank", "stream", "name", "op", "start", "end") if not isinstance(d, dict) or k not in d]
        if missing:
            raise TraceFormatError(f"{source}: event {i} lacks {', '.join(missing)}")
        ev = TimelineEvent.from_dict(d)
        if ev.iteration is None:
            ev.iteration = 0
        if ev.stream not in TRACKS:
            raise TraceFormatError(f"{source}: event {i} has stream {ev.stream!r}; "
                                   f"expected one of {', '.join(STREAMS)}")
        out.append(ev)
    return out


def write_rank_file(events: Iterable[TimelineEvent], path: str | Path) -> Path:
    """Dump one rank's events as a JSON list of dicts (the input of `merge_rank_files`)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps([e.to_dict() for e in events]))
    return p


def merge_rank_files(paths: Sequence[str | Path]) -> list[TimelineEvent]:
    """Merge per-rank event files into one timeline, ordered by (iteration, start, rank).

    The runtime must record all ranks against a common time origin; merging does not shift clocks. A rank
    found in two files is an error (two processes wrote the same rank's file, or a file was passed twice).
    """
    if not paths:
        raise TraceFormatError("merge_rank_files: no files given")
    owner: dict[int, Path] = {}
    merged: list[TimelineEvent] = []
    for path in paths:
        p = Path(path)
        events = events_from_list(_read_json(p), str(p))
        for rank in {e.rank for e in events}:
            if rank in owner:
                raise TraceFormatError(f"rank {rank} appears in both {owner[rank]} and {p}")
            owner[rank] = p
        merged += events
    return sort_events(merged)


def sort_events(events: Iterable[TimelineEvent]) -> list[TimelineEvent]:
    """Stable order by (iteration, start, rank): a rank's events recorded at the same time keep their order."""
    return sorted(events, key=lambda e: (e.iteration, e.start, e.rank))


def _read_json(p: Path) -> object:
    if not p.exists():
        raise TraceFormatError(f"timeline file {p} does not exist")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise TraceFormatError(f"{p} is not JSON: {e}") from None
