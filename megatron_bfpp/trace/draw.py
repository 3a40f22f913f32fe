"""PNG Gantt charts of timelines (matplotlib, Agg backend).

One row per (rank, stream): compute, pipeline p2p and data-parallel work each get their own row, so the
communication is visible next to the compute it feeds. Compute is coloured by micro-batch; forwards are
plain, backwards darker and hatched. Blocking waits are light red; GATHER / REDUCE / RELEASE are greys; the
optimizer (a stage's STEP at the step boundary, or the whole OPTIMIZER outside the schedule) is olive on the
compute row.
Several timelines (e.g. simulated and measured) can be stacked one above the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import to_rgb  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from ..schedule.events import STREAMS, TimelineEvent  # noqa: E402
from .metrics import iteration_metrics, select_iteration  # noqa: E402

STREAM_LABELS = {"compute": "compute", "p2p": "p2p", "dp": "data-par."}
WAIT_COLOUR = "#f4a6a6"
DP_COLOURS = {"GATHER": "#525252", "REDUCE": "#111111", "RELEASE": "#bdbdbd"}
DP_LABELS = {"GATHER": "G", "REDUCE": "RS", "RELEASE": "rel"}
P2P_COLOUR = "#7f7f7f"
OTHER_COMPUTE_COLOUR = "#c7b299"
OPTIMIZER_COLOUR = "#8c8c3c"  # STEP (per stage) and OPTIMIZER: optimizer time, not F/B compute


@dataclass
class Panel:
    """One timeline to draw: its events (one iteration), a title and the x-axis unit."""

    events: list[TimelineEvent]
    title: str
    unit: str = "s"  # "s" for seconds (scaled to ms/us when short), or a label such as "t_F"


def microbatch_colours(n: int) -> list[tuple[float, float, float]]:
    """Distinct colours for n micro-batches (tab10 when it suffices, else evenly spaced on a wide colormap)."""
    if n <= 10:
        return [to_rgb(c) for c in plt.get_cmap("tab10").colors[:max(n, 1)]]  # type: ignore[attr-defined]
    cmap = plt.get_cmap("turbo")
    return [tuple(cmap(0.05 + 0.9 * i / (n - 1))[:3]) for i in range(n)]  # type: ignore[misc]


def _darker(c: tuple[float, float, float], f: float = 0.6) -> tuple[float, float, float]:
    return (c[0] * f, c[1] * f, c[2] * f)


def _time_scale(span: float, unit: str) -> tuple[float, str]:
    if unit != "s":
        return 1.0, f"time ({unit})"
    if span < 1e-3:
        return 1e6, "time (us)"
    if span < 1.0:
        return 1e3, "time (ms)"
    return 1.0, "time (s)"


def _rows(events: Sequence[TimelineEvent]) -> list[tuple[int, str]]:
    present = {(e.rank, e.stream) for e in events}
    return [(r, s) for r in sorted({e.rank for e in events}) for s in STREAMS if (r, s) in present]


def _label_fits(text: str, width_data: float, span: float, axes_px: float, fontsize: float, dpi: float) -> bool:
    char_px = 0.62 * fontsize * dpi / 72.0
    return width_data / span * axes_px >= len(text) * char_px + 2


def bar_style(e: TimelineEvent, colour_of: dict) -> tuple[dict, float, str | None]:
    """(barh keywords, bar height, label or None) of one event; `colour_of` maps micro-batch -> colour."""
    kw: dict = {"edgecolor": "white", "linewidth": 0.4}
    if e.op == "WAIT":
        kw.update(color=WAIT_COLOUR, edgecolor="#c0392b", hatch="xx")
        return kw, 0.5, None
    if e.op in ("F", "B", "I", "W"):
        c = colour_of.get(e.microbatch, (0.5, 0.5, 0.5))
        hatch = {"F": None, "B": "///", "I": "\\\\", "W": ".."}[e.op]
        kw.update(color=c if e.op == "F" else _darker(c), hatch=hatch)
        return kw, 0.8, f"{e.stage}:{e.microbatch}"
    if e.op == "STEP":
        kw.update(color=OPTIMIZER_COLOUR, hatch="--")
        return kw, 0.8, f"S{e.stage}"
    if e.op == "OPTIMIZER":
        kw.update(color=OPTIMIZER_COLOUR)
        return kw, 0.8, e.name
    if e.stream == "compute":  # other work on the compute track
        kw.update(color=OTHER_COMPUTE_COLOUR)
        return kw, 0.8, e.name
    if e.op in DP_COLOURS:
        kw.update(color=DP_COLOURS[e.op])
        return kw, 0.6, f"{DP_LABELS[e.op]}{e.stage}"
    # sends and receives: thin, tinted by micro-batch
    c = colour_of.get(e.microbatch, to_rgb(P2P_COLOUR))
    kw.update(color=c if e.op.endswith("_F") else _darker(c), linewidth=0)
    return kw, 0.35 if e.op.startswith("SEND") else 0.6, None


def _draw_panel(ax, panel: Panel, normalize: bool, axes_px: float, dpi: float, fontsize: float) -> str:
    evs = panel.events
    t0 = min(e.start for e in evs)
    span = max(e.end for e in evs) - t0
    span = span if span > 0 else 1.0
    if normalize:
        scale, xlabel = 1.0 / span, "fraction of step time"
    else:
        scale, xlabel = _time_scale(span, panel.unit)
    rows = _rows(evs)
    y_of = {row: i for i, row in enumerate(rows)}
    mbs = sorted({e.microbatch for e in evs if e.microbatch is not None})
    colours = microbatch_colours(len(mbs))
    colour_of = {m: colours[i] for i, m in enumerate(mbs)}
    min_w = 0.003 * span  # zero-length actions (free communication, GATHER launches) stay visible

    for e in evs:
        if e.op == "IDLE":  # idle time is drawn as what it is: nothing
            continue
        y = y_of[(e.rank, e.stream)]
        left = (e.start - t0) * scale
        width = max(e.end - e.start, min_w) * scale
        left = min(left, span * scale - width)  # a zero-length action at the very end stays inside the axes
        kw, height, label = bar_style(e, colour_of)
        ax.barh(y, width, left=left, height=height, **kw)
        if label and _label_fits(label, (e.end - e.start), span, axes_px, fontsize - 1, dpi):
            ax.text(left + width / 2, y, label, ha="center", va="center", fontsize=fontsize - 1,
                    color="white" if e.op in ("B", "GATHER", "REDUCE", "STEP", "OPTIMIZER") else "black",
                    clip_on=True)

    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {r} {STREAM_LABELS[s]}" for r, s in rows], fontsize=fontsize + 1)
    ax.set_ylim(len(rows) - 0.5, -0.5)  # rank 0 on top
    ax.set_xlim(0, span * scale)
    ax.set_xlabel(xlabel, fontsize=fontsize + 1)
    ax.grid(axis="x", linestyle=":", linewidth=0.5, alpha=0.6)
    for i, (r, s) in enumerate(rows):  # a faint line between ranks
        if i and rows[i - 1][0] != r:
            ax.axhline(i - 0.5, color="#999999", linewidth=0.6)
    m = iteration_metrics(evs)
    it = evs[0].iteration
    step = f"{m.step_time_s * scale:.4g}" + ("" if normalize else f" {xlabel[6:-1]}")
    ax.set_title(f"{panel.title} — iteration {it}, step {step}, bubble {100 * m.bubble:.1f}%",
                 fontsize=fontsize + 2, loc="left")
    return xlabel


def _legend_handles(ops: set[str], n_microbatches: int) -> list[Patch]:
    """Legend entries for the kinds of events present (ops) and the micro-batch colours."""
    grey = (0.55, 0.55, 0.55)
    kinds = [
        ("F", Patch(facecolor=grey, edgecolor="white", label="forward F (micro-batch colour)")),
        ("B", Patch(facecolor=_darker(grey), edgecolor="white", hatch="///", label="backward B (darker, hatched)")),
        ("WAIT", Patch(facecolor=WAIT_COLOUR, edgecolor="#c0392b", hatch="xx", label="blocking wait")),
        ("p2p", Patch(facecolor=P2P_COLOUR, label="send / receive (thin)")),
        ("STEP", Patch(facecolor=OPTIMIZER_COLOUR, edgecolor="white", hatch="--", label="optimizer step of a stage (S)")),
        ("OPTIMIZER", Patch(facecolor=OPTIMIZER_COLOUR, label="optimizer / gradient norm")),
    ] + [(op, Patch(facecolor=c, label=f"{op} ({DP_LABELS[op]})")) for op, c in DP_COLOURS.items()]
    p2p = any(op.startswith(("SEND", "RECV")) for op in ops)
    handles = [h for k, h in kinds if k in ops or (k == "p2p" and p2p)]
    if n_microbatches <= 16:
        handles += [Patch(facecolor=c, label=f"micro-batch {m}")
                    for m, c in enumerate(microbatch_colours(n_microbatches))]
    return handles


def draw_panels(panels: Sequence[Panel], path: str | Path, normalize: bool = False, width_in: float = 15.0,
                dpi: int = 100, fontsize: float = 7.0) -> tuple[int, int]:
    """Draw the panels one above the other into a PNG; returns its (width, height) in pixels."""
    if not panels:
        raise ValueError("nothing to draw")
    for p in panels:
        if not p.events:
            raise ValueError(f"timeline {p.title!r} has no events to draw")
    n_rows = [len(_rows(p.events)) for p in panels]
    heights = [0.28 * n + 1.1 for n in n_rows]
    legend_w = 2.4  # inches kept on the right for the legend
    fig = plt.figure(figsize=(width_in, sum(heights) + 0.3), dpi=dpi)
    try:
        gs = fig.add_gridspec(len(panels), 1, height_ratios=heights, left=1.3 / width_in,
                              right=1 - legend_w / width_in, top=1 - 0.35 / fig.get_figheight(),
                              bottom=0.55 / fig.get_figheight(), hspace=0.9 / max(1, sum(heights) / len(panels)))
        axes_px = (width_in - 1.3 - legend_w) * dpi
        units = {("norm" if normalize else p.unit) for p in panels}
        first = None
        for i, panel in enumerate(panels):
            share = first if (len(units) == 1 and first is not None) else None
            ax = fig.add_subplot(gs[i, 0], sharex=share)
            first = first or ax
            _draw_panel(ax, panel, normalize, axes_px, dpi, fontsize)
        n_mb = len({e.microbatch for p in panels for e in p.events if e.microbatch is not None})
        ops = {e.op for p in panels for e in p.events}
        fig.legend(handles=_legend_handles(ops, n_mb), loc="upper right", fontsize=fontsize, frameon=False,
                   bbox_to_anchor=(1.0, 1 - 0.35 / fig.get_figheight()))
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=dpi)
        w, h = fig.get_size_inches() * dpi
        return int(round(w)), int(round(h))
    finally:
        plt.close(fig)


def panel_for(events: Sequence[TimelineEvent], title: str, unit: str = "s", iteration: int | None = None) -> Panel:
    """A panel of one iteration of `events` (None: the last recorded iteration)."""
    _, evs = select_iteration(events, iteration)
    return Panel(evs, title, unit)
