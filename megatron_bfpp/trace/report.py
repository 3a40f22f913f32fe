"""Side-by-side summary of trainer `--report-json` files (written by `run_report`): the A/B table users paste
into a discussion.

A report is a JSON object with at least "config", "losses", "iteration_times_s" and "tokens_per_s"; the
optional blocks "measured" (from `metrics.IterationMetrics.to_dict()`, plus per-rank "peak_memory_bytes"),
"memory", "comm" and "predicted" (the simulator's numbers for the same configuration) add rows. Any missing
key leaves its cell empty; a row empty for every run is left out.
"""

from __future__ import annotations

import csv
import io
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

FORMATS = ("text", "markdown", "csv")
REPORT_KEYS = ("config", "losses", "iteration_times_s", "tokens_per_s", "measured", "predicted")


class ReportError(ValueError):
    """A report file cannot be read; the message names the file."""


def load_report(path: str | Path) -> dict:
    p = Path(path)
    if not p.exists():
        raise ReportError(f"report file {p} does not exist (write one with the trainer's --report-json PATH)")
    try:
        d = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ReportError(f"{p} is not JSON: {e}") from None
    if not isinstance(d, dict):
        raise ReportError(f"{p}: expected a JSON object as written by --report-json")
    if not set(d) & set(REPORT_KEYS):
        raise ReportError(f"{p}: not a run report: it has none of {', '.join(REPORT_KEYS)} "
                          "(write one with the trainer's --report-json PATH)")
    return d


# ---- extracting values (None when absent) ----

def _get(d: object, *path: str) -> object:
    for k in path:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def _num(v: object) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _first(d: dict, *keys: str) -> object:
    return next((d[k] for k in keys if isinstance(d, dict) and d.get(k) is not None), None)


def _per_rank(block: object) -> list[dict]:
    if isinstance(block, dict):
        block = block.get("per_rank")
    return [r for r in block if isinstance(r, dict)] if isinstance(block, list) else []


def _peak_of(block: object) -> float | None:
    """A peak-memory figure (bytes) from a dict (first key naming a peak), its "per_rank" list, or a list of
    per-rank dicts (the maximum over ranks)."""
    if isinstance(block, list):
        block = {"per_rank": block}
    if not isinstance(block, dict):
        return None
    for k in ("peak_memory_bytes", "peak_bytes", "peak_allocated_bytes", "peak_reserved_bytes"):
        if _num(block.get(k)) is not None:
            return _num(block[k])
    if _num(block.get("peak_memory_gib")) is not None:
        return _num(block["peak_memory_gib"]) * 2**30  # type: ignore[operator]
    ranks = [_peak_of(r) for r in _per_rank(block)]
    ranks = [r for r in ranks if r is not None]
    return max(ranks) if ranks else None


def _measured(key: str) -> Callable[[dict], float | None]:
    def get(rep: dict) -> float | None:
        v = _num(_get(rep, "measured", key))
        if v is None:
            vals = [_num(r.get(key)) for r in _per_rank(rep.get("measured"))]
            vals = [x for x in vals if x is not None]
            v = sum(vals) / len(vals) if vals else None
        return v
    return get


def step_time(rep: dict) -> float | None:
    """Median iteration time, leaving out the first iteration (warm-up) when there are several."""
    times = [t for t in (_num(x) for x in (rep.get("iteration_times_s") or [])) if t is not None]
    if len(times) > 1:
        times = times[1:]
    if times:
        return statistics.median(times)
    return _num(_get(rep, "measured", "step_time_s"))


def final_loss(rep: dict) -> float | None:
    losses = rep.get("losses") or []
    if not isinstance(losses, list) or not losses:
        return None
    last = losses[-1]
    return _num(_first(last, "loss", "lm loss", "lm_loss")) if isinstance(last, dict) else _num(last)


def peak_memory(rep: dict) -> float | None:
    v = _peak_of(rep.get("measured"))
    return v if v is not None else _peak_of(rep.get("memory"))


def _cfg(*keys: str) -> Callable[[dict], object]:
    return lambda rep: _first(rep.get("config") or {}, *keys)


# ---- formatting ----

def fmt_bytes(v: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(v) >= scale:
            return f"{v / scale:.2f} {unit}"
    return f"{v:.0f} B"


def fmt_seconds(v: float) -> str:
    if abs(v) >= 1 or v == 0:
        return f"{v:.3f} s"
    if abs(v) >= 1e-3:
        return f"{v * 1e3:.2f} ms"
    return f"{v * 1e6:.1f} us"


def fmt_percent(v: float) -> str:
    return f"{100 * v:.1f}%"


def fmt_plain(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


@dataclass(frozen=True)
class Row:
    label: str
    get: Callable[[dict], object]
    fmt: Callable = fmt_plain
    ratio: bool = False  # show each run's value relative to the first run


ROWS: tuple[Row, ...] = (
    Row("schedule", _cfg("schedule", "pipeline_schedule")),
    Row("P (pipeline)", _cfg("pp", "pipeline_model_parallel_size")),
    Row("V (stages per rank)", _cfg("vp", "virtual_pipeline_model_parallel_size")),
    Row("D (data parallel)", _cfg("dp", "data_parallel_size")),
    Row("T (tensor parallel)", _cfg("tp", "tensor_model_parallel_size")),
    Row("ZeRO stage", _cfg("zero_stage")),
    Row("M (micro-batches)", _cfg("microbatches", "num_microbatches")),
    Row("group size", _cfg("group_size")),
    Row("micro-batch size", _cfg("micro_batch_size")),
    Row("sequence length", _cfg("seq_length", "sequence_length")),
    Row("global batch size", _cfg("global_batch_size")),
    Row("throughput (tokens/s)", lambda r: _num(r.get("tokens_per_s")), lambda v: f"{v:,.0f}", ratio=True),
    Row("step time", step_time, fmt_seconds),
    Row("bubble", _measured("bubble"), fmt_percent),
    Row("exposed dp wait", _measured("exposed_dp_wait_s"), fmt_seconds),
    Row("exposed p2p wait", _measured("exposed_p2p_wait_s"), fmt_seconds),
    Row("optimizer (STEPs)", _measured("optimizer_s"), fmt_seconds),
    Row("peak memory", peak_memory, fmt_bytes),
    Row("final loss", final_loss, lambda v: f"{v:.4f}"),
    Row("predicted throughput (tokens/s)", lambda r: _num(_get(r, "predicted", "tokens_per_s")),
        lambda v: f"{v:,.0f}"),
    Row("predicted step time", lambda r: _num(_get(r, "predicted", "step_time_s")), fmt_seconds),
    Row("predicted bubble", lambda r: _num(_get(r, "predicted", "bubble")), fmt_percent),
    # The simulator's own convention, bubble over compute time ((P-1)/(V M)); not comparable to "bubble".
    Row("predicted bubble / compute", lambda r: _num(_get(r, "predicted", "bubble_fraction")), fmt_percent),
    Row("predicted exposed dp", lambda r: _num(_get(r, "predicted", "exposed_dp_s")), fmt_seconds),
    Row("predicted exposed p2p", lambda r: _num(_get(r, "predicted", "exposed_pp_s")), fmt_seconds),
    Row("predicted optimizer", lambda r: _num(_get(r, "predicted", "optimizer_s")), fmt_seconds),
    # What of the optimizer the step waits for (the rest hides behind the first stage's all-gather and the fill).
    Row("predicted optimizer exposed", lambda r: _num(_get(r, "predicted", "optimizer_exposed_s")), fmt_seconds),
    Row("predicted TFLOP/s per GPU", lambda r: _num(_get(r, "predicted", "tflops_per_gpu")), lambda v: f"{v:.1f}"),
    Row("predicted peak memory", lambda r: _peak_of(r.get("predicted")), fmt_bytes),
)


def _comm_block(rep: dict) -> tuple[dict[str, float], str]:
    """Scalar entries of "comm": a dict as is, or a list of per-rank dicts as the mean over ranks."""
    comm = rep.get("comm")
    if isinstance(comm, dict):
        return {k: v for k, v in comm.items() if _num(v) is not None}, ""  # type: ignore[misc]
    if isinstance(comm, list):
        ranks = [c for c in comm if isinstance(c, dict)]
        keys = {k for c in ranks for k, v in c.items() if _num(v) is not None and k != "rank"}
        return {k: sum(_num(c.get(k)) or 0.0 for c in ranks) / len(ranks) for k in keys}, " (mean per rank)"
    return {}, ""


def _comm_rows(reports: Sequence[dict]) -> list[Row]:
    """One row per scalar entry of the "comm" blocks (e.g. all-gather counts, bytes moved)."""
    blocks = [_comm_block(rep) for rep in reports]
    rows = []
    for k in sorted({k for b, _ in blocks for k in b}):
        fmt = fmt_bytes if "bytes" in k else fmt_seconds if k.endswith("_s") else fmt_plain
        suffix = next((sfx for b, sfx in blocks if k in b and sfx), "")
        rows.append(Row(f"comm: {k}{suffix}", lambda r, k=k: _comm_block(r)[0].get(k), fmt))
    return rows


def table(reports: Sequence[dict], raw: bool = False) -> list[tuple[str, list[str]]]:
    """(row label, one cell per report); `raw` keeps numbers unformatted (CSV)."""
    rows = list(ROWS) + _comm_rows(reports)
    out = []
    for row in rows:
        values = [row.get(rep) for rep in reports]
        if all(v is None for v in values):
            continue
        cells = []
        for i, v in enumerate(values):
            if v is None:
                cells.append("")
            elif raw:
                cells.append(repr(v) if isinstance(v, float) else str(v))
            else:
                cell = row.fmt(v)
                base = values[0]
                if row.ratio and i > 0 and isinstance(base, float) and base > 0:
                    cell += f" ({v / base:.2f}x)"
                cells.append(cell)
        out.append((row.label, cells))
    return out


def column_labels(paths: Sequence[str | Path]) -> list[str]:
    """File names without extension; with the parent folder when two names collide."""
    stems = [Path(p).stem for p in paths]
    return [f"{Path(p).parent.name}/{s}" if stems.count(s) > 1 else s for p, s in zip(paths, stems)]


def render(reports: Sequence[dict], labels: Sequence[str], fmt: str = "text") -> str:
    if fmt not in FORMATS:
        raise ReportError(f"--format must be one of {', '.join(FORMATS)} (got {fmt!r})")
    if len(labels) != len(reports):
        raise ReportError(f"--labels gives {len(labels)} names for {len(reports)} reports")
    rows = table(reports, raw=fmt == "csv")
    header = ["", *labels]
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(["metric", *labels])
        for label, cells in rows:
            w.writerow([label, *cells])
        return buf.getvalue()
    if fmt == "markdown":
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" + "---:|" * len(labels)]
        lines += ["| " + " | ".join([label, *cells]) + " |" for label, cells in rows]
        return "\n".join(lines) + "\n"
    widths = [max(len(r[i]) for r in [header] + [[lb, *c] for lb, c in rows]) for i in range(len(header))]
    lines = ["  ".join(h.ljust(widths[0]) if i == 0 else h.rjust(widths[i]) for i, h in enumerate(header))]
    lines.append("  ".join("-" * w for w in widths))
    for label, cells in rows:
        lines.append("  ".join([label.ljust(widths[0])] + [c.rjust(widths[i + 1]) for i, c in enumerate(cells)]))
    return "\n".join(lines) + "\n"
