"""Library warnings in the trainer's output: each kind once, on rank 0, on one line.

Every rank imports the same libraries (Megatron-Core, torch) and so prints the same warnings:
TransformerEngine or Apex not installed, absl missing, deprecations (Python warnings, two lines each), and a
few WARNING records of their loggers (torch's "No CUDA runtime is found", Megatron's deprecation notices). With
N ranks, and the launcher checking the flags first, each came N + 1 times. Here:

- a Python warning raised in a library (its file is outside this package) is printed by rank 0 only, the
  first of its kind (category and first sentence), as one line `warning: ... [Category, path:line]`;
- a library logger's WARNING record (WARNING <= level < ERROR, logger outside this package) likewise: rank 0
  only, the first of its kind, in its handler's own format;
- everything else is left as it was: this package's warnings and log lines on every rank, Megatron's log
  below WARNING (its INFO lines), ERROR records and above, exceptions and their tracebacks (they never pass
  through here), and warnings that the filters turn into errors (`-W error`: the filters are not touched).

The launcher's flag check (rank None) prints no library warning: rank 0 prints them when it starts.
`BFPP_LIBRARY_WARNINGS=all` leaves every rank's warnings as Python and the libraries print them.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from typing import Any, Callable

ENV = "BFPP_LIBRARY_WARNINGS"
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PACKAGE_LOGGER = __name__.split(".")[0]


def is_library_file(filename: str) -> bool:
    """Whether a warning raised at `filename` comes from a library rather than this package."""
    return not os.path.abspath(filename).startswith(_PACKAGE_DIR + os.sep)


def first_sentence(text: str) -> str:
    """The text up to its first sentence end or line break: what tells one kind of warning from another
    ("Transformer Engine and Apex are not installed." for its five fallbacks)."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    m = re.search(r"[.!?](\s|$)", line)
    return line[: m.start() + 1] if m else line


def short_path(filename: str) -> str:
    """`filename` from the package root it belongs to (after site-packages or dist-packages), else as given."""
    parts = re.split(r"[/\\](?:site|dist)-packages[/\\]", filename)
    return parts[-1]


def one_line(message: Any, category: type[Warning], filename: str, lineno: int) -> str:
    text = " ".join(str(message).split())
    return f"warning: {text} [{category.__name__}, {short_path(filename)}:{lineno}]"


class KindsSeen:
    """The kinds of library warnings shown so far in this process, and whether this process shows any."""

    def __init__(self, rank: int | None) -> None:
        self.shows = rank == 0
        self.seen: set[tuple[str, str]] = set()

    def first(self, category: str, text: str) -> bool:
        """True the first time a kind is seen by a process that shows library warnings."""
        if not self.shows:
            return False
        kind = (category, first_sentence(text))
        if kind in self.seen:
            return False
        self.seen.add(kind)
        return True


class LibraryWarnings:
    """`warnings.formatwarning` for the trainer's processes: a library warning as one line the first time of its
    kind on a process that shows them, else as nothing (Python then writes nothing); this package's through the
    previous `formatwarning`, unchanged. Formatting only: the filters still decide which warnings are shown or
    raised, and a recording `catch_warnings` (pytest's) still records them all."""

    def __init__(self, kinds: KindsSeen, previous: Callable[..., str]) -> None:
        self.kinds = kinds
        self.previous = previous

    def __call__(self, message: Any, category: type[Warning], filename: str, lineno: int,
                 line: str | None = None) -> str:
        if not is_library_file(filename):
            return self.previous(message, category, filename, lineno, line)
        if self.kinds.first(category.__name__, str(message)):
            return one_line(message, category, filename, lineno) + "\n"
        return ""


class LibraryLogFilter(logging.Filter):
    """Logger filter: a library logger's WARNING record passes on rank 0 the first time of its kind; every
    other record passes."""

    def __init__(self, kinds: KindsSeen) -> None:
        super().__init__()
        self.kinds = kinds

    def filter(self, record: logging.LogRecord) -> bool:
        if not logging.WARNING <= record.levelno < logging.ERROR:
            return True
        if record.name == _PACKAGE_LOGGER or record.name.startswith(_PACKAGE_LOGGER + "."):
            return True
        try:
            text = record.getMessage()
        except Exception:  # a malformed record: let its handler report it as it would
            return True
        return self.kinds.first(f"log {record.levelname}", text)


_installed: LibraryLogFilter | None = None
_previous_logger_class: type[logging.Logger] | None = None


def install(rank: int | None) -> None:
    """Route this process's library warnings as the module docstring says (`rank` None: the launcher's flag
    check, which shows none). The log filter goes on every logger, those that exist now and those created
    later (the logger class), not on handlers: Megatron's handler replaces the handlers' filtering with its
    own."""
    global _installed, _previous_logger_class
    if _installed is not None or os.environ.get(ENV, "").lower() == "all":
        return
    kinds = KindsSeen(rank)
    warnings.formatwarning = LibraryWarnings(kinds, warnings.formatwarning)
    flt = _installed = LibraryLogFilter(kinds)
    for logger in _all_loggers():
        logger.addFilter(flt)
    _previous_logger_class = base = logging.getLoggerClass()

    class FilteredLogger(base):  # type: ignore[valid-type, misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.addFilter(flt)

    logging.setLoggerClass(FilteredLogger)


def uninstall() -> None:
    """Undo `install` (the launcher, once its flag check is done, and tests)."""
    global _installed, _previous_logger_class
    if isinstance(warnings.formatwarning, LibraryWarnings):
        warnings.formatwarning = warnings.formatwarning.previous
    if _installed is not None:
        for logger in _all_loggers():
            logger.removeFilter(_installed)
    if _previous_logger_class is not None:
        logging.setLoggerClass(_previous_logger_class)
    _installed = _previous_logger_class = None


def _all_loggers() -> list[logging.Logger]:
    return [logging.getLogger()] + [lg for lg in logging.root.manager.loggerDict.values()
                                    if isinstance(lg, logging.Logger)]
