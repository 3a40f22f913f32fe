"""`bfpp draw` (timeline PNG) and `bfpp report` (side-by-side run summary)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..schedule import ScheduleError
from .chrome import TraceFormatError, write_chrome_trace


def draw_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bfpp draw",
        description="Draw a schedule (`bfpp schedule --format json`, laid out with unit times), a simulation JSON "
                    "or a recorded timeline (Chrome trace / event list) as a PNG Gantt chart.",
    )
    p.add_argument("input", nargs="?", help="timeline, simulation or schedule file ('-' reads JSON from stdin)")
    p.add_argument("--compare", nargs=2, metavar=("SIM", "MEASURED"),
                   help="stack two timelines of the same configuration, the first above the second")
    p.add_argument("-o", "--output", required=True, help="PNG file to write")
    p.add_argument("--iteration", type=int, default=None,
                   help="iteration to draw (default: the last one recorded)")
    p.add_argument("--t-forward", type=float, default=1.0, help="schedule inputs: duration of F (default 1)")
    p.add_argument("--t-backward", type=float, default=2.0, help="schedule inputs: duration of B (default 2)")
    p.add_argument("--normalize", action="store_true", help="x axis in fractions of each timeline's step time")
    p.add_argument("--title", action="append", default=None,
                   help="panel title (repeat once per panel with --compare)")
    p.add_argument("--chrome", metavar="PATH", help="also write the drawn timeline as a Chrome trace (single input)")
    p.add_argument("--width", type=float, default=15.0, help="figure width in inches (default 15)")
    p.add_argument("--dpi", type=int, default=100)
    return p


def draw_main(argv: list[str] | None = None) -> int:
    args = draw_parser().parse_args(argv)
    from .draw import draw_panels, panel_for  # matplotlib only when drawing
    from .inputs import load_timeline, timeline_from_text

    if (args.input is None) == (args.compare is None):
        print("bfpp draw: error: give one input file, or --compare SIM MEASURED (not both)", file=sys.stderr)
        return 2
    sources = [args.input] if args.input is not None else list(args.compare)
    if args.title is not None and len(args.title) != len(sources):
        print(f"bfpp draw: error: --title given {len(args.title)} times for {len(sources)} panel(s)", file=sys.stderr)
        return 2
    if args.chrome and len(sources) != 1:
        print("bfpp draw: error: --chrome writes one timeline; use it without --compare", file=sys.stderr)
        return 2
    try:
        panels = []
        for i, src in enumerate(sources):
            if src == "-":
                tl = timeline_from_text(sys.stdin.read(), "stdin", args.t_forward, args.t_backward)
            else:
                tl = load_timeline(src, args.t_forward, args.t_backward)
            unit = "t_F" if tl.kind == "schedule" and args.t_forward == 1.0 else (
                "units" if tl.kind == "schedule" else "s")
            title = args.title[i] if args.title else tl.title
            panel = panel_for(tl.events, title, unit, args.iteration)
            panels.append(panel)
            if args.chrome:
                write_chrome_trace(panel.events, args.chrome, metadata={"title": title, **tl.meta})
        w, h = draw_panels(panels, args.output, normalize=args.normalize, width_in=args.width, dpi=args.dpi)
    except (TraceFormatError, ScheduleError, ValueError) as e:
        print(f"bfpp draw: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.output} ({w}x{h} px)" + (f" and {args.chrome}" if args.chrome else ""))
    return 0


def report_parser() -> argparse.ArgumentParser:
    from .report import FORMATS

    p = argparse.ArgumentParser(
        prog="bfpp report",
        description="Side-by-side summary (throughput, step time, bubble, exposed communication, memory, loss) "
                    "of one or more trainer --report-json files.",
    )
    p.add_argument("reports", nargs="+", help="report JSON files, one column each")
    p.add_argument("--format", choices=FORMATS, default="text")
    p.add_argument("--labels", default=None, help="comma-separated column names (default: file names)")
    p.add_argument("-o", "--output", default=None, help="write the table to this file instead of stdout")
    return p


def report_main(argv: list[str] | None = None) -> int:
    from .report import ReportError, column_labels, load_report, render

    args = report_parser().parse_args(argv)
    try:
        reports = [load_report(p) for p in args.reports]
        labels = [s.strip() for s in args.labels.split(",")] if args.labels else column_labels(args.reports)
        text = render(reports, labels, args.format)
    except ReportError as e:
        print(f"bfpp report: error: {e}", file=sys.stderr)
        return 2
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0
