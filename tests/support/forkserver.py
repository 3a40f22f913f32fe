"""Test helper: start a test job's processes by forking servers that have already imported torch, Megatron and
this package, instead of starting each rank as a fresh interpreter.

A fresh rank spends about 5 CPU seconds importing torch and Megatron before it does anything (the tests' tiny
models then train in about one); a job of four ranks under torchrun spends 25. A `ForkServers` holds one
server per rank index, each a Python process that imported the heavy modules once (the "zygote" pattern); rank r
of every job is forked from server r, so a job starts in milliseconds and still has what each torchrun rank has:

- its own environment (the caller's, plus RANK, LOCAL_RANK, WORLD_SIZE, ... as torchrun sets them), working
  directory, `sys.path` and `sys.argv`, and stdout/stderr in a log file;
- its own string-hash seed (server r runs with PYTHONHASHSEED=r + 1): code whose order depends on hashing
  differs between ranks as it does under torchrun, where every rank draws its own seed;
- a fresh torch generator (seeded as a new interpreter's is) and the default signal handlers; it exits through
  the interpreter's normal shutdown (atexit handlers run).

What the servers preload is fixed when they start (the module list, PYTHONPATH, PYTHONWARNINGS): a job whose
imports differ in anything but the per-run environment needs its own `ForkServers`. Tests that are about the
launcher itself keep running torchrun (`subprocesses`).

The protocol is pickled messages over the server's stdin/stdout; the server forks on `start` and reaps on
`wait`, killing the process group of every child still alive at the deadline (or, torchrun's rule, the others
once one rank failed and a grace period passed).
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_HEADER = struct.Struct("!Q")
TORCH_DEFAULT_SEED = 67280421310721  # torch's default CPU generator seed in a new interpreter (c10 default_rng_seed_val)


def _send(fd: int, message: Any) -> None:
    data = pickle.dumps(message)
    _write_all(fd, _HEADER.pack(len(data)) + data)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes | None:
    chunks, left = [], n
    while left:
        if deadline is not None:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError("fork server did not answer in time")
        chunk = os.read(fd, left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _recv(fd: int, deadline: float | None = None) -> Any:
    header = _read_exact(fd, _HEADER.size, deadline)
    if header is None:
        raise EOFError("fork server closed its pipe")
    body = _read_exact(fd, _HEADER.unpack(header)[0], deadline)
    if body is None:
        raise EOFError("fork server closed its pipe")
    return pickle.loads(body)


@dataclass(frozen=True)
class Job:
    """What one forked process runs: a script as `__main__` (argv[0] is the script) or `call` = (fn, args)."""

    env: dict[str, str]
    cwd: str
    log: str
    sys_path: list[str] | None = None  # None: the server's (its PYTHONPATH, then what it was started with)
    argv: list[str] | None = None
    call: tuple | None = None


class _Server:
    def __init__(self, index: int, preload: list[str], env: dict[str, str], path_prepend: list[str]) -> None:
        env = dict(env, PYTHONHASHSEED=str(index + 1))
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env)
        self.to_server, self.from_server = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        _send(self.to_server, {"preload": preload, "path_prepend": path_prepend})
        reply = _recv(self.from_server, time.monotonic() + 600)
        if reply != "ready":
            self.close()
            raise RuntimeError(f"fork server {index} could not preload {preload}:\n{reply}")

    def request(self, message: dict, timeout: float) -> Any:
        _send(self.to_server, message)
        return _recv(self.from_server, time.monotonic() + timeout)

    def close(self) -> None:
        # Nothing in a server is worth a graceful exit (its children were reaped by `run`): stop it at once.
        self.proc.kill()
        self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()


class ForkServers:
    """One preloaded server per rank index, started on first use."""

    def __init__(self, preload: list[str], env: dict[str, str] | None = None,
                 path_prepend: list[str] | None = None) -> None:
        self.preload = list(preload)
        self.env = dict(os.environ if env is None else env)
        self.path_prepend = list(path_prepend or [])
        self.servers: list[_Server] = []

    def _server(self, index: int) -> _Server:
        while len(self.servers) <= index:
            self.servers.append(_Server(len(self.servers), self.preload, self.env, self.path_prepend))
        return self.servers[index]

    def run(self, jobs: list[Job], timeout: float, fail_grace: float = 30.0) -> list[int | None]:
        """Run job r on server r; return each exit code (negative: killed by that signal) once every job
        ended, or None for a job still running at `timeout` (then killed). Once one job failed, the others get
        `fail_grace` seconds to end before they are killed (torchrun stops the other ranks the same way)."""
        pids = [self._server(r).request({"op": "start", "job": job}, 60) for r, job in enumerate(jobs)]
        deadline = time.monotonic() + timeout
        codes: list[int | None] = [None] * len(jobs)
        failed_at = None
        while True:
            for r, pid in enumerate(pids):
                if codes[r] is None:
                    codes[r] = self._server(r).request({"op": "poll", "pid": pid}, 60)
            if all(c is not None for c in codes):
                return codes
            now = time.monotonic()
            if failed_at is None and any(c not in (None, 0) for c in codes):
                failed_at = now
            if now >= deadline or (failed_at is not None and now - failed_at >= fail_grace):
                for r, pid in enumerate(pids):
                    if codes[r] is None:
                        code = self._server(r).request({"op": "kill", "pid": pid}, 60)
                        # A job killed at the deadline reports None; one stopped after another failed, its signal.
                        codes[r] = None if now >= deadline else code
                return codes
            time.sleep(0.05)

    def close(self) -> None:
        for server in self.servers:
            server.close()
        self.servers = []


# ------------------------------------------------------------------------------------------------ the server

def _serve(to_client: int, from_client: int) -> Job | None:
    """The server loop; returns the Job in a forked child, None when the client has gone."""
    children: set[int] = set()
    while True:
        try:
            message = _recv(from_client)
        except EOFError:
            for pid in children:
                _kill_group(pid)
            return None
        op = message["op"]
        if op == "start":
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                os.close(to_client)
                os.close(from_client)
                return message["job"]
            children.add(pid)
            _send(to_client, pid)
        elif op == "poll":
            pid = message["pid"]
            done, status = os.waitpid(pid, os.WNOHANG)
            code = os.waitstatus_to_exitcode(status) if done else None
            if done:
                children.discard(pid)
            _send(to_client, code)
        elif op == "kill":
            pid = message["pid"]
            _kill_group(pid)
            _, status = os.waitpid(pid, 0)
            children.discard(pid)
            _send(to_client, os.waitstatus_to_exitcode(status))


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _run_job(job: Job) -> int:
    """In the forked child: become the process the job describes, run it, return its exit code."""
    os.setsid()  # its own process group: a kill reaches whatever it started
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL)
    log = os.open(job.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    os.chdir(job.cwd)
    os.environ.clear()
    os.environ.update(job.env)
    if job.sys_path is not None:
        sys.path[:] = job.sys_path
    import torch

    torch.manual_seed(TORCH_DEFAULT_SEED)
    try:
        if job.argv is not None:
            import runpy

            sys.argv = list(job.argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(job.argv[0])))  # as `python script.py` does
            runpy.run_path(job.argv[0], run_name="__main__")
        else:
            fn, args = job.call
            fn(*args)
    except SystemExit as e:
        if e.code is None:
            return 0
        if isinstance(e.code, int):
            return e.code
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        import traceback

        traceback.print_exc()
        return 1
    return 0


def main() -> None:
    # The protocol keeps the pipes it was started with; fd 1 becomes stderr so that a module printing while it
    # is preloaded cannot corrupt it.
    to_client, from_client = os.dup(1), os.dup(0)
    os.dup2(2, 1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    setup = _recv(from_client)
    sys.path[:0] = setup["path_prepend"]
    try:
        import importlib

        for name in setup["preload"]:
            importlib.import_module(name)
    except BaseException:
        import traceback

        _send(to_client, traceback.format_exc())
        sys.exit(1)
    _send(to_client, "ready")
    job = _serve(to_client, from_client)
    if job is None:
        sys.exit(0)
    sys.exit(_run_job(job))


if __name__ == "__main__":
    # Run as a script, this module's directory leads sys.path: the server imports what the job's sys.path names.
    sys.path.pop(0)
    main()
