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


def _show(rank: int | None, *warns: tuple[str, str]) -> str:
    """What a process of `rank` writes for the given (message, filename) warnings."""
    out = io.StringIO()
    fmt = lw.LibraryWarnings(lw.KindsSeen(rank), lambda m, c, f, n, line=None: f"as before: {m}\n")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.formatwarning = fmt
        warnings.showwarning = lambda m, c, f, n, file=None, line=None: out.write(warnings.formatwarning(m, c, f, n))
        for message, filename in warns:
            warnings.warn_explicit(message, UserWarning, filename, 25, module="m", registry={})
    return out.getvalue()


def test_rank0_prints_each_library_kind_once_on_one_line():
    out = _show(0, (TE_1, LIB), (TE_2, LIB), ("absl.logging is not installed. Using logging.", LIB), (TE_1, LIB),
                ("ours", OURS))
    assert out.splitlines() == [
        f"warning: {TE_1} [UserWarning, megatron/core/optimizer/__init__.py:25]",
        "warning: absl.logging is not installed. Using logging. [UserWarning, megatron/core/optimizer/__init__.py:25]",
        "as before: ours",  # the package's own warning, as Python prints it
    ]


@pytest.mark.parametrize("rank", [1, None])
def test_other_ranks_and_the_launcher_print_no_library_warning(rank):
    assert _show(rank, (TE_1, LIB), ("ours", OURS)) == "as before: ours\n"


def test_warnings_turned_into_errors_still_raise_and_recorders_still_record():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.formatwarning = lw.LibraryWarnings(lw.KindsSeen(1), warnings.formatwarning)
        with pytest.raises(UserWarning, match="not installed"):
            warnings.warn_explicit(TE_1, UserWarning, LIB, 25, module="m", registry={})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        warnings.formatwarning = lw.LibraryWarnings(lw.KindsSeen(1), warnings.formatwarning)
        warnings.warn_explicit(TE_1, UserWarning, LIB, 25, module="m", registry={})
    assert [str(w.message) for w in seen] == [TE_1]


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
    fmt, logger_class = warnings.formatwarning, logging.getLoggerClass()
    lw.install(1)
    try:
        later = logging.getLogger("bfpp_test.created_after_install")
        for logger in (before, later):
            assert not logger.filter(_record(logger.name, logging.WARNING, "a library notice"))
            assert logger.filter(_record(logger.name, logging.ERROR, "a library error"))
        assert isinstance(warnings.formatwarning, lw.LibraryWarnings)
    finally:
        lw.uninstall()
    assert before.filter(_record(before.name, logging.WARNING, "a library notice"))
    assert warnings.formatwarning is fmt and logging.getLoggerClass() is logger_class


def test_every_rank_prints_as_before_when_asked(monkeypatch):
    monkeypatch.setenv(lw.ENV, "all")
    fmt = warnings.formatwarning
    lw.install(1)
    try:
        assert warnings.formatwarning is fmt
        assert logging.getLogger("bfpp_test.all").filter(_record("bfpp_test.all", logging.WARNING, "notice"))
    finally:
        lw.uninstall()


def test_the_launchers_flag_check_prints_none_and_leaves_them_as_they_were(capfd):
    """`bfpp train` checks the flags in its own process first: the libraries' warnings are rank 0's to print."""
    from megatron_bfpp.train.launcher import check_flags

    fmt, logger_class = warnings.formatwarning, logging.getLoggerClass()
    argv = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "16",
            "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "1", "--lr", "1e-3",
            "--pipeline-schedule", "gpipe"]
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        assert check_flags(argv, 1) is None
        assert check_flags(argv + ["--hidden-size", "15"], 1) is not None
    assert "warning:" not in capfd.readouterr().err
    assert warnings.formatwarning is fmt and logging.getLoggerClass() is logger_class
