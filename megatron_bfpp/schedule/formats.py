"""JSON and CSV forms of a schedule (the text form lives on `Schedule`). Users can load hand-written ones."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from .ir import Action, Schedule, ScheduleError, _schedule_from_parts
from .validate import peak_activations


def to_json_dict(schedule: Schedule) -> dict:
    """The JSON contract of `bfpp schedule --format json`."""
    return {
        "schedule": schedule.name,
        "pp": schedule.pp,
        "vp": schedule.vp,
        "microbatches": schedule.microbatches,
        "group_size": schedule.group_size,
        "zero_stage": schedule.zero_stage,
        "ranks": [[a.to_dict() for a in acts] for acts in schedule.ranks],
        "peak_activations": peak_activations(schedule),
    } | ({} if schedule.w_needs_weights else {"w_needs_weights": False}) | (
        {"i_writes_grads": True} if schedule.i_writes_grads else {}) | ({"pairing": schedule.pairing} if schedule.pairing else {})


def to_json(schedule: Schedule) -> str:
    return json.dumps(to_json_dict(schedule))


def from_json_dict(d: dict) -> Schedule:
    try:
        ranks = {r: [Action.from_dict(a) for a in acts] for r, acts in enumerate(d["ranks"])}
    except (KeyError, TypeError, ValueError) as e:
        raise ScheduleError(f"bad schedule JSON: {e}: expected {{'ranks': [[{{'op','stage','microbatch'}}]]}}")
    header = {k: d[k] for k in ("pp", "vp", "microbatches", "group_size", "zero_stage", "w_needs_weights",
                                   "i_writes_grads", "pairing") if k in d}
    if "schedule" in d:
        header["schedule"] = d["schedule"]
    return _schedule_from_parts(header, ranks)


def from_json(text: str) -> Schedule:
    return from_json_dict(json.loads(text))


CSV_FIELDS = ("rank", "step", "op", "stage", "microbatch")
CSV_OPTIONAL_FIELDS = ("batch", "channel")  # p2p posting groups and channels; empty when not set or the default


def to_csv(schedule: Schedule) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_FIELDS + CSV_OPTIONAL_FIELDS)
    for r, acts in enumerate(schedule.ranks):
        for i, a in enumerate(acts):
            w.writerow([r, i, a.op.value, a.stage, "" if a.microbatch is None else a.microbatch,
                        "" if a.batch is None else a.batch, a.serialized_channel or ""])
    return buf.getvalue()


def from_csv(text: str, **header: object) -> Schedule:
    """Rows (rank, step, op, stage, microbatch[, batch, channel]), ordered by step within a rank; header fills
    pp/vp/M."""
    rows = list(csv.DictReader(io.StringIO(text)))
    if rows and set(CSV_FIELDS) - set(rows[0]):
        raise ScheduleError(f"schedule CSV needs columns {', '.join(CSV_FIELDS)}")
    ranks: dict[int, list[tuple[int, Action]]] = {}
    for row in rows:
        ranks.setdefault(int(row["rank"]), []).append((int(row["step"]), Action.from_dict(row)))
    ordered = {r: [a for _, a in sorted(v, key=lambda t: t[0])] for r, v in ranks.items()}
    return _schedule_from_parts(dict(header), ordered)


def load(path: str | Path) -> Schedule:
    """Load a schedule from .json, .csv or text form (by extension)."""
    p = Path(path)
    if not p.exists():
        raise ScheduleError(f"schedule file {p} does not exist")
    text = p.read_text()
    if p.suffix == ".json":
        return from_json(text)
    if p.suffix == ".csv":
        return from_csv(text)
    return Schedule.from_text(text)
