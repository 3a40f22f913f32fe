"""Read anything that can be drawn as a timeline, recognised by content:

- a Chrome trace written by `write_chrome_trace` (a run's `--timeline` file):
  {"traceEvents": [...], "otherData": {...}};
- a list of `TimelineEvent.to_dict()` dicts (one rank's dump);
- a simulation (or any) JSON object with an "events" list of such dicts, and optional "config" / "title";
- a schedule from `bfpp schedule` (JSON with "ranks", or the text / CSV forms), laid out by the simulator
  with unit costs (t_F = 1, t_B = 2, free communication).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..schedule import Schedule, ScheduleError, load
from ..schedule.formats import from_json_dict
from .chrome import ORIGIN_KEY, TraceFormatError, events_from_chrome_dict, events_from_list
from ..schedule.events import TimelineEvent


@dataclass
class Timeline:
    events: list[TimelineEvent]
    title: str
    kind: str  # "trace", "events", "simulation" or "schedule"
    meta: dict = field(default_factory=dict)
    schedule: Schedule | None = None  # set for kind == "schedule"


def describe_config(cfg: dict) -> str:
    """'breadth-first T=8 P=4 V=2 M=8 D=2 ZeRO-3' from whatever of those keys a config dict has (the names of
    `bfpp schedule`, the trainer's report and Megatron's flags are all recognised)."""
    parts = [str(cfg[k]) for k in ("schedule", "pipeline_schedule", "name") if cfg.get(k)][:1]
    for label, keys in (("T", ("tp", "tensor_model_parallel_size")), ("P", ("pp", "pipeline_model_parallel_size")),
                        ("V", ("vp", "virtual_pipeline_model_parallel_size")),
                        ("M", ("microbatches", "num_microbatches", "num_micro_batches")),
                        ("D", ("dp", "data_parallel_size")),
                        ("G", ("group_size", "microbatch_group_size_per_vp_stage"))):
        v = next((cfg[k] for k in keys if cfg.get(k) is not None), None)
        if v is not None:
            parts.append(f"{label}={v}")
    if cfg.get("zero_stage") is not None:
        parts.append(f"ZeRO-{cfg['zero_stage']}")
    return " ".join(parts)


def simulated_unit_timeline(schedule: Schedule, t_forward: float = 1.0, t_backward: float = 2.0,
                            iteration: int = 0) -> list[TimelineEvent]:
    """Events of `schedule` simulated with unit costs: F = t_forward, B = t_backward, free communication."""
    if t_forward <= 0 or t_backward <= 0:
        raise ScheduleError(f"--t-forward and --t-backward must be > 0 (got {t_forward}, {t_backward})")
    from ..sim import simulate_schedule, unit_costs  # the cost model is only needed to lay out schedules

    return simulate_schedule(schedule, unit_costs(schedule, t_forward, t_backward), iteration=iteration).events


def schedule_timeline(schedule: Schedule, t_forward: float = 1.0, t_backward: float = 2.0) -> Timeline:
    cfg = {"schedule": schedule.name, "pp": schedule.pp, "vp": schedule.vp, "microbatches": schedule.microbatches,
           "zero_stage": schedule.zero_stage}
    if schedule.group_size is not None:
        cfg["group_size"] = schedule.group_size
    title = f"{describe_config(cfg)} (unit times: F={t_forward:g}, B={t_backward:g}, free communication)"
    return Timeline(simulated_unit_timeline(schedule, t_forward, t_backward), title, "schedule", cfg, schedule)


def load_timeline(path: str | Path, t_forward: float = 1.0, t_backward: float = 2.0) -> Timeline:
    """Events and a title from any supported file (see the module docstring)."""
    p = Path(path)
    if not p.exists():
        raise TraceFormatError(f"{p} does not exist")
    if p.suffix != ".json":
        try:
            return schedule_timeline(load(p), t_forward, t_backward)
        except ScheduleError as e:
            raise TraceFormatError(f"{p}: not a schedule in text or CSV form ({e}); timelines must be .json")
    return timeline_from_text(p.read_text(), str(p), t_forward, t_backward)


def timeline_from_text(text: str, source: str, t_forward: float = 1.0, t_backward: float = 2.0) -> Timeline:
    """Like `load_timeline` for JSON text already read (e.g. from standard input)."""
    p = Path(source)
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceFormatError(f"{source} is not JSON: {e}") from None
    if isinstance(d, list):
        return Timeline(events_from_list(d, source), p.stem, "events")
    if isinstance(d, dict) and "traceEvents" in d:
        meta = {k: v for k, v in (d.get("otherData") or {}).items() if k != ORIGIN_KEY}
        return Timeline(events_from_chrome_dict(d, source), _title(meta, p), "trace", meta)
    if isinstance(d, dict) and isinstance(d.get("events"), list):
        meta = {k: v for k, v in d.items() if k != "events"}
        return Timeline(events_from_list(d["events"], source), _title(meta, p), "simulation", meta)
    if isinstance(d, dict) and "ranks" in d:
        return schedule_timeline(from_json_dict(d), t_forward, t_backward)
    raise TraceFormatError(
        f"{source}: not a timeline: expected a Chrome trace ('traceEvents'), a list of timeline events, an object with "
        "an 'events' list (simulation), or a schedule from `bfpp schedule --format json` ('ranks')"
    )


def _title(meta: dict, p: Path) -> str:
    if meta.get("title"):
        return str(meta["title"])
    cfg = meta.get("config") if isinstance(meta.get("config"), dict) else meta
    return describe_config(cfg) or p.stem
