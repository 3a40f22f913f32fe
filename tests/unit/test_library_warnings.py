"""Library warnings in the trainer's output (megatron_bfpp.train.library_warnings): each kind once, on rank 0,
on one line; the package's own warnings and log lines, Megatron's INFO log, errors and `-W error` untouched."""

from __future__ import annotations

import io
import logging
import os
import warnings

import pytest

import megatron_bfpp
from megatron_bfpp.train import library_warnings as lw

pytestmark = pytest.mark.timeout(60)

LIB = "/venv/lib/python3.12/site-packages/megatron/core/optimizer/__init__.py"
OURS = os.path.join(os.path.dirname(megatron_bfpp.__file__), "train", "loop.py")
TE_1 = "Transformer Engine and Apex are not installed. Falling back to Torch optimizers."
TE_2 = "Transformer Engine and Apex are not installed. Falling back to local implementations of multi_tensor_scale"


def test_kind_and_line():
    assert lw.first_sentence(TE_1) == lw.first_sentence(TE_2) == "Transformer Engine and Apex are not installed."
    assert lw.first_sentence("Apex is not installed. Falling back to Torch Norm") == "Apex is not installed."
    assert lw.first_sentence("no sentence end\nsecond line") == "no sentence end"
    assert lw.first_sentence("torch>=1.7.0 needed") == "torch>=1.7.0 needed"  # a dot inside a word is no end
    assert lw.short_path(LIB) == "megatron/core/optimizer/__init__.py"
    assert lw.one_line("a  multi\n  line", UserWarning, LIB, 25) == \
        "warning: a multi line [UserWarning, megatron/core/optimizer/__init__.py:25]"
    assert lw.is_library_file(LIB) and not lw.is_library_file(OURS)


def _show(rank: int | None, *warns: tuple[str, str]) -> tuple[str, list[str]]:
    """What a process of `rank` prints for the given (message, filename) warnings: (stream, previous calls)."""
    out, previous = io.StringIO(), []
    show = lw.LibraryWarnings(lw.KindsSeen(rank), lambda m, c, f, n, file=None, line=None: previous.append(str(m)),
                              stream=out)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        for message, filename in warns:
            warnings.warn_explicit(message, UserWarning, filename, 25, module="m", registry={})
    return out.getvalue(), previous


def test_rank0_prints_each_library_kind_once_on_one_line():
    out, previous = _show(0, (TE_1, LIB), (TE_2, LIB), ("absl.logging is not installed. Using logging.", LIB),
                          (TE_1, LIB), ("ours", OURS))
    assert out.splitlines() == [
        f"warning: {TE_1} [UserWarning, megatron/core/optimizer/__init__.py:25]",
        "warning: absl.logging is not installed. Using logging. [UserWarning, megatron/core/optimizer/__init__.py:25]",
    ]
    assert previous == ["ours"]  # the package's own warning, as Python prints it


@pytest.mark.parametrize("rank", [1, None])
def test_other_ranks_and_the_launcher_print_no_library_warning(rank):
    out, previous = _show(rank, (TE_1, LIB), ("ours", OURS))
    assert out == "" and previous == ["ours"]


def test_warnings_turned_into_errors_still_raise():
    show = lw.LibraryWarnings(lw.KindsSeen(1), warnings.showwarning)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.showwarning = show
        with pytest.raises(UserWarning, match="not installed"):
            warnings.warn_explicit(TE_1, UserWarning, LIB, 25, module="m", registry={})


def _record(name: str, level: int, msg: str) -> logging.LogRecord:
    return logging.LogRecord(name, level, LIB, 1, msg, None, None)


def test_log_filter():
    dep = "GPTModel IS DEPRECATED. GPTModel is only accepting critical bug fixes"
    rank0, rank1 = lw.LibraryLogFilter(lw.KindsSeen(0)), lw.LibraryLogFilter(lw.KindsSeen(1))
    lib = "megatron.core.models.gpt.gpt_model"
    # rank 0: a library WARNING the first time of its kind only (one per model chunk before)
    assert rank0.filter(_record(lib, logging.WARNING, dep)) and not rank0.filter(_record(lib, logging.WARNING, dep))
    assert not rank1.filter(_record(lib, logging.WARNING, dep))
    for f in (rank0, rank1):
        assert f.filter(_record("megatron.core.datasets", logging.INFO, "> total number of samples: 10"))  # the log
        assert f.filter(_record("megatron.core.datasets", logging.INFO, "> total number of samples: 10"))
        assert f.filter(_record(lib, logging.ERROR, "a real error"))
        assert f.filter(_record(lib, logging.CRITICAL, "a real error"))
        assert f.filter(_record("megatron_bfpp.train", logging.WARNING, "ours"))  # the package's, every rank


def test_install_reaches_existing_and_later_loggers(monkeypatch):
    monkeypatch.delenv(lw.ENV, raising=False)
    before = logging.getLogger("bfpp_test.existing")
    show, logger_class = warnings.showwarning, logging.getLoggerClass()
    lw.install(1)
    try:
        later = logging.getLogger("bfpp_test.created_after_install")
        for logger in (before, later):
            assert not logger.filter(_record(logger.name, logging.WARNING, "a library notice"))
            assert logger.filter(_record(logger.name, logging.ERROR, "a library error"))
        assert isinstance(warnings.showwarning, lw.LibraryWarnings)
    finally:
        lw.uninstall()
    assert before.filter(_record(before.name, logging.WARNING, "a library notice"))
    assert warnings.showwarning is show and logging.getLoggerClass() is logger_class


def test_every_rank_prints_as_before_when_asked(monkeypatch):
    monkeypatch.setenv(lw.ENV, "all")
    show = warnings.showwarning
    lw.install(1)
    try:
        assert warnings.showwarning is show
        assert logging.getLogger("bfpp_test.all").filter(_record("bfpp_test.all", logging.WARNING, "notice"))
    finally:
        lw.uninstall()
