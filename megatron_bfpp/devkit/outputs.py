"""What a leg's output says: NCCL's WARN lines as NCCL prints them, whether NCCL refused at initialisation, the
workers' error lines (not torchrun's banner), how far the iterations got, which ranks had their process group up.
Pure Python.

NCCL 2.28's WARN line (src/debug.cc, ncclDebugLog): a newline, by default a timestamp ("[%F %T] ",
NCCL_DEBUG_TIMESTAMP_LEVELS holds WARN), "host:pid:tid ", "[cuda device] ", __FILE__:__LINE__ (a path under
src/, e.g. transport/net_socket.cc:565), newer versions a "(thread name) ", then "NCCL WARN " and the message.
torch repeats NCCL's last WARN after "Last error:" in its DistBackendError.
"""

from __future__ import annotations

import re

from .iterations import ITERATION_RE

RANK_PREFIX_RE = re.compile(r"^\[rank\d+\]:\s?")
NCCL_WARN_RE = re.compile(r"\[-?\d+\] \S+:\d+ (?:\([^)]*\) )?NCCL WARN (?P<msg>.*)$")
ITERATION_OF_RE = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|")
STARTUP_MARK = "[devkit] process group up:"
STARTUP_RE = re.compile(re.escape(STARTUP_MARK) + r" rank (\d+) of (\d+)")

# What NCCL says only while a communicator is being set up (src/ of NCCL 2.28.9): the set-up, not the code run.
INIT_REFUSALS = (
    "Duplicate GPU detected",                        # init.cc: two ranks with one host hash and bus id
    "Mismatched NCCL version detected",              # init.cc
    "Failed to determine intra proc ranks",          # init.cc: host hashes (NCCL_HOSTID) inconsistent
    "Failed to determine local ranks",               # init.cc
    "Bootstrap : no socket interface found",         # bootstrap.cc
    "No usable listening interface found",           # bootstrap.cc
    "verify NCCL_OOB_NET_IFNAME",                    # bootstrap.cc: no device matching the interface asked for
    "NET/Socket : no interface found",               # transport/net_socket.cc: plugin init
    "Failed to initialize any NET plugin",           # plugin/net.cc
    "Invalid NCCL_COMM_ID",                          # bootstrap.cc
    "Bootstrap Root : mismatch in info from procs",  # bootstrap.cc
)
# Invalid usage counts as a refusal only before any rank's first collective (the start-up barrier).
INVALID_USAGE = "ncclInvalidUsage"

# An error that a rank raises because another rank went first: named only when no first-hand error is there.
CONSEQUENCES = ("DistBackendError", "ncclRemoteError", "remote process exited", "connection closed by",
                "connection reset by peer", "broken pipe", "communicator was aborted", "watchdog caught",
                "timed out", "timeout", "sigterm", "signal 15", "socket closed", "connection refused")
ERROR_LINE_RE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)(?::\s.*|:?)$"
                           r"|^error: .+|.*\bfailed: .+")
# Lines that continue torch's NCCL error (their own `...Error:` prefix is not a second error).
NCCL_RESULT_RE = re.compile(r"^nccl\w+Error:")


def _lines(output: str) -> list[str]:
    return [RANK_PREFIX_RE.sub("", line.strip()) for line in output.splitlines()]


def nccl_warnings(output: str) -> list[str]:
    """NCCL's WARN messages, and torch's "Last error:" lines where no WARN line says the same (NCCL's own lines
    can be missing: a process killed before NCCL wrote them), deduplicated, in order."""
    warns: list[str] = []
    last: list[str] = []
    lines = _lines(output)
    for i, line in enumerate(lines):
        if line == "Last error:" and i + 1 < len(lines) and lines[i + 1]:
            if lines[i + 1] not in last:
                last.append(lines[i + 1])
        elif (m := NCCL_WARN_RE.search(line)) is not None and m.group("msg").strip() not in warns:
            warns.append(m.group("msg").strip())

    def said(text: str) -> bool:
        return any(w.startswith(text[:80]) or text.startswith(w[:80]) for w in warns)

    return warns + [f"Last error: {text}" for text in last if not said(text)]


def init_refusal(output: str, ranks_up: int) -> str | None:
    """NCCL's words when it refused the set-up while a communicator was being made, else None. `ranks_up`: the
    ranks that had passed their start-up barrier (invalid usage after that may be the code's own)."""
    words = nccl_warnings(output)
    for w in words:
        if any(pattern in w for pattern in INIT_REFUSALS):
            return w
    if ranks_up == 0 and INVALID_USAGE in output:
        return words[0] if words else INVALID_USAGE
    return None


def workers_output(output: str) -> list[str]:
    """The lines the leg's own processes printed: torchrun's elastic log lines and its closing banner (its
    traceback through ChildFailedError and the "Root Cause" block) removed, torch's rank prefixes stripped."""
    raw = output.splitlines()
    lines = _lines(output)
    end = next((i for i, line in enumerate(lines) if "ChildFailedError" in line), len(lines))
    if end < len(lines):  # torchrun's own traceback (no rank prefix) leads to it
        start = max((i for i in range(end) if raw[i].strip() == "Traceback (most recent call last):"), default=end)
        lines = lines[:start]
    return [line for line in lines if line and "torch/distributed/elastic/" not in line
            and "torch.distributed.elastic" not in line]


def error_lines(output: str) -> list[str]:
    """The workers' `...Error: ...` / `error: ...` / `... failed: ...` lines, deduplicated, in order (NCCL's WARN
    lines are reported on their own)."""
    found: list[str] = []
    for line in workers_output(output):
        if NCCL_RESULT_RE.match(line) or NCCL_WARN_RE.search(line) or not ERROR_LINE_RE.match(line):
            continue
        if line not in found:
            found.append(line)
    return found


def root_error(errors: list[str]) -> str | None:
    """The error to name: the first that is not a consequence of another rank's failure, else the last line."""
    for line in errors:
        if not any(c.lower() in line.lower() for c in CONSEQUENCES):
            return line
    return errors[-1] if errors else None


def last_lines(output: str, n: int = 3) -> str:
    """The workers' last `n` lines (warnings left out): where a run that printed no error stopped."""
    lines = [line for line in workers_output(output) if "Warning" not in line and "warnings.warn" not in line
             and not line.startswith(STARTUP_MARK)]
    return " | ".join(lines[-n:])[-600:]


def iterations_reached(output: str) -> tuple[int, int] | None:
    """(the last iteration printed, the run's iteration count) from Megatron-style iteration lines, or None."""
    found = None
    for line in output.splitlines():
        if ITERATION_RE.search(line) and (m := ITERATION_OF_RE.search(line)) is not None:
            found = (int(m.group(1)), int(m.group(2)))
    return found


def all_iterations_ran(output: str) -> bool:
    reached = iterations_reached(output)
    return reached is not None and reached[0] >= reached[1]


def ranks_up(output: str) -> set[int]:
    """The ranks that printed the start-up marker (their process group passed its first barrier)."""
    return {int(m.group(1)) for m in STARTUP_RE.finditer(output)}
