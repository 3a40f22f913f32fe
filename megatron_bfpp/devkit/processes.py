"""A leg's processes: started with their output going straight to the leg's log, waited for with a deadline, and
ended all together, whatever they do with SIGTERM. Standard library only (Linux /proc and prctl).

Why it takes more than killing a process group: torchrun starts every worker in a session of its own (its
subprocess handler passes `start_new_session=True`), so a signal to torchrun's group misses them, and a worker
whose torchrun died keeps running, orphaned. So every process of a leg carries a token in its environment
(`BFPP_DEVKIT_LEG`, inherited through fork and exec), by which the kit finds each of them in /proc, orphans
included; each gets SIGTERM (with its process group), then SIGKILL after a short grace. The kit is also a
child subreaper (orphans of its legs become its children, which it reaps), and the kit's workers end with their
parent (`die_with_parent`), so even a kit killed with SIGKILL takes its legs' processes with it: torchrun ends
with the kit (set when the kit starts it), each worker with its torchrun.

Output goes to the log file itself, not through a pipe: nothing a leftover process holds can block the kit, and a
kit killed mid-leg leaves what the leg printed so far.
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

TOKEN_VAR = "BFPP_DEVKIT_LEG"
TERM_GRACE_S = 5.0      # SIGTERM -> SIGKILL
KILL_WAIT_S = 5.0       # SIGKILL -> giving up on a process (it is stuck in the kernel)
EXIT_GRACE_S = 20.0     # after a leg's last iteration line, its processes have this long to exit
POLL_S = 0.25
TAIL_BYTES = 1 << 16    # of a running leg's output, what `finished` is shown

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


@dataclass
class Outcome:
    """How a leg's processes ended. `ended`: "exit" (the root process exited by itself), "limit" (ended by the
    kit at the leg's time limit), "exit-hang" (every iteration ran, then ended by the kit when the processes did
    not exit within EXIT_GRACE_S), "stopped" (ended because the kit itself was asked to stop).
    `rc` is the root process's exit code when it exited by itself, else None. `left_behind`: processes of the leg
    still alive after its root process exited or was ended, which the kit ended; `survivors`: those that not even
    SIGKILL ended within KILL_WAIT_S."""

    rc: int | None
    output: str
    seconds: float
    limit: float
    ended: str = "exit"
    left_behind: int = 0
    survivors: list[int] = field(default_factory=list)


def _prctl(option: int, value: int) -> bool:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux
        return False


def become_subreaper() -> bool:
    """Orphans among this process's descendants become its children (and are reaped by `reap_orphans`)."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def die_with_parent() -> None:
    """SIGKILL this process when its parent ends (for a leg's workers: their torchrun; for torchrun: the kit).
    If the parent is already gone (it ended before the call), end now."""
    parent = os.getppid()
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def _die_with_kit() -> None:  # preexec_fn of a leg's root process: it ends with the kit
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process, None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return fields[0], int(fields[1])


def leg_pids(token: str) -> set[int]:
    """The live (not zombie) processes carrying `token` in their environment."""
    needle = f"{TOKEN_VAR}={token}\0".encode()
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:  # gone, or not ours
            continue
        if needle in environ + b"\0":
            st = _stat(int(entry))
            if st is not None and st[0] != "Z":
                found.add(int(entry))
    return found


def reap_orphans(keep: set[int] = frozenset()) -> None:
    """Reap exited children of this process (orphans a subreaper inherited), except those in `keep` (children
    whose exit status a Popen still wants)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in keep:
            continue
        st = _stat(int(entry))
        if st is not None and st[0] == "Z" and st[1] == os.getpid():
            try:
                os.waitpid(int(entry), os.WNOHANG)
            except ChildProcessError:
                pass


def _signal_all(pids: set[int], sig: int) -> None:
    own_group = os.getpgrp()
    for pid in pids:
        for kill, target in ((os.killpg, _pgid(pid)), (os.kill, pid)):
            if target is None or (kill is os.killpg and target in (own_group, 0)):
                continue
            try:
                kill(target, sig)
            except OSError as e:
                if e.errno not in (errno.ESRCH, errno.EPERM):
                    raise


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def end_processes(token: str, root: subprocess.Popen | None = None, grace_s: float = TERM_GRACE_S,
                  kill_wait_s: float = KILL_WAIT_S) -> tuple[int, list[int]]:
    """End every process of a leg: SIGTERM to each (and its process group), SIGKILL to what is left after
    `grace_s`. Returns (how many were alive, those still alive `kill_wait_s` after SIGKILL). Bounded: at most
    grace_s + kill_wait_s seconds."""
    keep = {root.pid} if root is not None else set()

    def alive() -> set[int]:
        if root is not None:
            root.poll()
        reap_orphans(keep)
        pids = leg_pids(token)
        if root is not None and root.returncode is None:
            pids.add(root.pid)
        return pids

    pids = alive()
    count = len(pids)
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, kill_wait_s)):
        if not pids:
            break
        _signal_all(pids, sig)
        deadline = time.monotonic() + wait_s
        while (pids := alive()) and time.monotonic() < deadline:
            time.sleep(0.05)
    if root is not None:
        try:
            root.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            pass
    return count, sorted(pids)


def run_leg_process(cmd: list[str], env: dict[str, str], cwd: Path, log: Path, limit: float, token: str,
                    finished: Callable[[str], bool] = lambda text: False,
                    exit_grace_s: float = EXIT_GRACE_S) -> Outcome:
    """Run `cmd` with its output appended to `log` as it is written, for at most `limit` seconds; once
    `finished(the output's last TAIL_BYTES)` holds (every iteration ran), its processes have `exit_grace_s` more
    to exit. Then every process of the leg is ended (`end_processes`). Returns the Outcome with the leg's part of
    the log.
    An exception inside (the kit being stopped by a signal) ends the leg's processes before it propagates."""
    env = dict(env, **{TOKEN_VAR: token})
    start = log.stat().st_size if log.exists() else 0
    t0 = time.monotonic()
    with open(log, "ab", buffering=0) as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=cwd, start_new_session=True, preexec_fn=_die_with_kit)
    ended, deadline = "limit", t0 + limit
    try:
        with open(log, "rb") as f:
            f.seek(start)
            seen = b""
            while True:
                if proc.poll() is not None:
                    ended = "exit"
                    break
                now = time.monotonic()
                if now >= deadline:
                    break
                chunk = f.read()
                seen = (seen + chunk)[-TAIL_BYTES:]  # the last iteration line is near the end
                if chunk and ended != "exit-hang" and finished(seen.decode(errors="replace")):
                    ended, deadline = "exit-hang", min(deadline, now + exit_grace_s)
                time.sleep(POLL_S)
    finally:  # on every way out, the stop of the kit included: nothing of the leg outlives it
        left, survivors = end_processes(token, proc)
    rc = proc.returncode if ended == "exit" else None
    with open(log, "rb") as f:
        f.seek(start)
        output = f.read().decode(errors="replace")
    # After a root that exited by itself, whatever was still alive had been left behind by it.
    return Outcome(rc, output, time.monotonic() - t0, limit, ended, left if ended == "exit" else 0, survivors)
