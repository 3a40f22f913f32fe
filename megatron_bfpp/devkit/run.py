"""The device kit's run: install the kit offline, run the legs within the budget, write the report and logs.

    python -m megatron_bfpp.devkit.run [--device cuda|cpu] [--quick] [--out DIR] [--budget S] [--dry-run]
                                       [--legs A,B]

Run from the repository root (scripts/device_check.sh does). Standard library only in this process: every leg,
the install's checks included, runs in a subprocess of the python given (`--python`, default this one), which
must already have torch; the kit's wheels install with `pip install --no-index --no-deps --target
devkit/site` (the environment itself, torch first of all, is never modified; a system python that refuses
installs under PEP 668 is no obstacle), and only the packages that do not already import at a suitable version.

What the run guarantees, whatever the legs do: the report is rewritten before and after every leg (a command
killed at its limit still returns what ran), each leg's output reaches its log as it is printed, every wait has
a deadline, and no process a leg started outlives the leg (processes.py); SIGTERM, SIGINT or SIGHUP to the kit
ends the running leg and writes the report.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import uuid
import zipfile
from pathlib import Path
from typing import Any

from .judge import compare_losses, judge, leg_losses  # noqa: F401  (leg_losses, compare_losses: the kit's API)
from .outputs import all_iterations_ran, last_lines, nccl_warnings
from .plan import (DEFAULT_BUDGET_S, DEVICES, MAX_RESULT_FILES, MEGATRON_FLAGS, QUICK_BUDGET_S, QUICK_LEGS,
                   REPORT_NAME, SHAPES, TRAIN_FLAGS, Budget, Leg, LegResult, dry_run_text, exit_code, group_logs,
                   log_of, make_report, plan_legs, plan_total, progress_results, select_legs)
from .probe import cuda_problem, shared_gpu_problem
from .processes import Outcome, become_subreaper, end_processes, run_leg_process

ROOT = Path(__file__).resolve().parents[2]
KIT = "devkit/kit"             # what --prepare builds and the device machine receives (carried)
SITE = "devkit/site"           # where the kit installs (not carried; rebuilt each run)
WORK = "devkit/work"           # Megatron-LM's unpacked tree, the runs' reports and results (not carried)
MANIFEST = "manifest.json"
LEG_LOG_TAIL_BYTES = 400_000   # a leg's output kept in its log (head and tail beyond that)
PROBE_TIMEOUT_S = 180          # the environment probe (imports torch, opens a CUDA context)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Stopped(Exception):
    """The kit was asked to stop (a signal): the running leg is ended and the report written."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.name = signal.Signals(signum).name


def _stop(signum: int, frame: Any) -> None:
    for sig in STOP_SIGNALS:  # the teardown and the report that follow are not interrupted again
        signal.signal(sig, signal.SIG_IGN)
    raise Stopped(signum)


# ------------------------------------------------------------------------------------------------- helpers

def nccl_words(output: str) -> list[str]:
    """NCCL's WARN messages and torch's "Last error:" repeats of them (outputs.nccl_warnings)."""
    return nccl_warnings(output)


def default_out() -> Path:
    """$OUT when set (the device machine returns only what lies under it), else runs/device_check."""
    return Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "runs" / "device_check"


def wheel_fits(file: str, version: tuple[int, int]) -> bool:
    """Whether a wheel's python tag admits this interpreter version (cp312, py3, py312, ...)."""
    tags = file.split("-")[-3].split(".")
    v = f"{version[0]}{version[1]}"
    return any(t in (f"py{version[0]}", f"py{v}", f"cp{v}") for t in tags)


def sources_digest(root: Path) -> str:
    """sha256 over the package's files (path and content), as the kit's project wheel was built from."""
    import hashlib

    h = hashlib.sha256()
    pkg = root / "megatron_bfpp"
    for path in sorted(pkg.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix not in (".pyc",):
            h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


# -------------------------------------------------------------------------------------------------- driver

class Driver:
    def __init__(self, device: str, out: Path, budget_s: float, python: str, root: Path = ROOT,
                 only: set[str] | None = None) -> None:
        self.device, self.out, self.python, self.root = device, out, python, root
        self.kit, self.site, self.work = root / KIT, root / SITE, root / WORK
        self.legs = select_legs(plan_legs(device), only)
        self.groups = group_logs(self.legs)
        self.logs = log_of(self.groups)
        assert len(self.groups) + 1 <= MAX_RESULT_FILES
        self.budget = Budget(budget_s)
        self.results: dict[str, LegResult] = {}
        self.facts: dict[str, Any] = {}
        self.optional_absent: set[str] = set()
        self.tree: Path | None = None
        self.fatal: str | None = None         # why no leg can run here (CUDA not usable)
        self.no_sharing: str | None = None    # why several ranks cannot share the GPU (its compute mode)
        self.setup_hung: str | None = None    # the multi-rank leg that hung at start-up
        self.token: str | None = None         # the running leg's process token

    # -- running one process ------------------------------------------------------------------------------

    def env(self, megatron: bool = False) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "TORCHELASTIC", "BFPP_"))}
        paths = [str(self.site)]
        # Megatron-LM's training loop on CPU: the test shim (tests/support/cpu_shim)
        if megatron and self.device == "cpu":
            paths.append(str(self.root / "tests" / "support" / "cpu_shim"))
            env["BFPP_CPU_SHIM"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(paths)
        # Dynamo off on every device: pretrain() warms up Megatron's torch.compile'd fusions (jit_fuser) on CUDA
        # whatever the --no-*-fusion flags say, and an Inductor + Triton cold compile in every rank at once
        # would eat a leg's time; the legs check schedules and communication, not Inductor.
        env.update(CUDA_DEVICE_MAX_CONNECTIONS="1", NCCL_DEBUG="WARN", TORCH_NCCL_ASYNC_ERROR_HANDLING="1",
                   TORCHDYNAMO_DISABLE="1", PYTHONUNBUFFERED="1")
        if self.device == "cpu":
            env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
        return env

    def launch(self, ranks: int, module_args: list[str]) -> list[str]:
        """torchrun for `ranks` processes on this machine, each through scripts/shared_gpu_rank.sh when several
        (every rank on device 0, its own NCCL host over sockets; on CPU the same wrapper, gloo ignores it). The
        rendezvous binds the loopback address: --standalone alone looks up socket.getfqdn(), which can stall on
        a machine without DNS."""
        cmd = [self.python, "-m", "torch.distributed.run", "--standalone", "--local-addr", "127.0.0.1",
               "--nproc-per-node", str(ranks)]
        if ranks > 1:
            cmd += ["--no-python", str(self.root / "scripts" / "shared_gpu_rank.sh"), self.python]
        else:
            cmd += ["--no-python", self.python]
        return cmd + module_args

    def execute(self, leg: Leg, cmd: list[str], limit: float, env: dict[str, str]) -> Outcome:
        """Run `cmd` for at most `limit` seconds with its output going to the leg's log as it is printed (NCCL's
        own lines through NCCL_DEBUG_FILE, line-buffered, appended after), then end every process it started."""
        log = self.out / self.logs[leg.name]
        nccl_dir = self.work / "nccl" / leg.name
        shutil.rmtree(nccl_dir, ignore_errors=True)
        nccl_dir.mkdir(parents=True)
        env = dict(env, NCCL_DEBUG_FILE=str(nccl_dir / "%h.%p.log"),
                   BFPP_DEVKIT_COLLECTIVES=str(self.work / f"{leg.name}.collectives"))
        with open(log, "a") as f:
            f.write(f"\n== {leg.name} (limit {limit:.0f} s)\n+ {' '.join(cmd)}\n")
        start = log.stat().st_size
        self.token = f"{leg.name}-{uuid.uuid4().hex[:12]}"
        o = run_leg_process(cmd, env, self.work, log, limit, self.token, finished=all_iterations_ran)
        self.token = None
        nccl = "".join(f"\n== NCCL's log {p.name}\n{p.read_text(errors='replace')}" for p in sorted(
            nccl_dir.glob("*.log")) if p.stat().st_size)
        o.output += nccl
        kept = o.output if len(o.output) <= LEG_LOG_TAIL_BYTES else (
            o.output[:LEG_LOG_TAIL_BYTES // 4] + "\n[... cut ...]\n" + o.output[-3 * LEG_LOG_TAIL_BYTES // 4:])
        with open(log, "r+b") as f:  # the leg's part of the log, NCCL's lines included, within the size cap
            f.truncate(start)
            f.seek(start)
            f.write(kept.encode())
        ended = {"exit": f"exit {o.rc}", "limit": "killed at the limit",
                 "exit-hang": "every iteration ran, then ended by the kit: the processes did not exit"}[o.ended]
        with open(log, "a") as f:
            f.write(f"\n== {leg.name}: {ended} after {o.seconds:.1f} s"
                    + (f"; {o.left_behind} process(es) left behind, ended" if o.left_behind else "") + "\n")
        return o

    # -- install ------------------------------------------------------------------------------------------

    def probe(self, pythonpath: str, device: str | None = None) -> dict[str, Any]:
        env = dict(os.environ, PYTHONPATH=pythonpath)
        device = device or self.device
        if device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        timeout = max(30.0, min(PROBE_TIMEOUT_S, self.budget.left()))
        try:
            r = subprocess.run([self.python, str(self.root / "megatron_bfpp" / "devkit" / "probe.py"), "--device",
                                device], capture_output=True, text=True, env=env, cwd=self.work, timeout=timeout,
                               stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the environment probe ({self.python}, importing torch"
                               f"{' and opening a CUDA context' if device == 'cuda' else ''}) did not answer within "
                               f"{timeout:.0f} s") from None
        if r.returncode != 0:
            raise RuntimeError(f"the environment probe failed: {last_lines(r.stderr)}")
        return json.loads(r.stdout.strip().splitlines()[-1])

    def install(self, leg: Leg) -> LegResult:
        t0 = time.monotonic()
        log = self.out / self.logs[leg.name]
        notes: list[str] = []

        def say(msg: str) -> None:
            with open(log, "a") as f:
                f.write(msg + "\n")

        def fail(why: str) -> LegResult:
            say("FAILED: " + why)
            return LegResult(leg.name, "fail", time.monotonic() - t0, why)

        say(f"== {leg.name}")
        self.work.mkdir(parents=True, exist_ok=True)
        # First what the environment is: Python, torch, the GPU's compute mode, whether CUDA and NCCL work.
        before = self.probe("")
        self.facts = before
        say("before: " + json.dumps(before))
        if not before.get("torch"):
            return fail(f"{self.python} has no torch ({before['errors'].get('torch')}): the kit needs a python with "
                        f"torch (PYTHON=... scripts/device_check.sh)")
        if self.device == "cuda":
            self.fatal = cuda_problem(before)
            if self.fatal:
                return fail(self.fatal)
            self.no_sharing = shared_gpu_problem(before)
        manifest_path = self.kit / MANIFEST
        if not manifest_path.exists():
            return fail(f"no kit at {KIT}: run scripts/device_check.sh --prepare on a machine with the registry")
        manifest = json.loads(manifest_path.read_text())
        wanted = []
        for wheel in manifest["wheels"]:
            module, version = wheel["module"], wheel["version"]
            have = before["modules"].get(module)
            if module != "megatron_bfpp" and have and _suitable(module, have, wheel.get("accept")):
                notes.append(f"{wheel['project']} {have} already present")
                continue
            wanted.append(wheel)
        py = tuple(int(x) for x in before["python"].split(".")[:2])
        unfit = [f"{w['project']} {w['version']} ({w['file']})" for w in wanted if not wheel_fits(w["file"], py)]
        if unfit:
            return fail(f"python {before['python']} ({self.python}) cannot install the kit's wheels built for "
                        f"CPython {manifest.get('python', '3.12')}: {', '.join(unfit)}; run with a Python "
                        f"{manifest.get('python', '3.12')} that has torch (PYTHON=python3.12 "
                        f"scripts/device_check.sh), or --prepare a kit for this Python")
        shutil.rmtree(self.site, ignore_errors=True)
        self.site.mkdir(parents=True)
        files = [str(self.kit / "wheels" / w["file"]) for w in wanted]
        pip = subprocess.run([self.python, "-m", "pip", "--version"], capture_output=True, text=True, timeout=60,
                             stdin=subprocess.DEVNULL)
        if pip.returncode == 0:
            cmd = [self.python, "-m", "pip", "install", "--no-index", "--no-deps",
                   "--disable-pip-version-check", "--target", str(self.site), *files]
            say("+ " + " ".join(cmd))
            r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PIP_NO_INDEX="1"),
                               timeout=max(30.0, self.budget.left()), stdin=subprocess.DEVNULL)
            say(r.stdout + r.stderr)
            if r.returncode != 0:
                return fail(f"pip install --no-index failed: {last_lines(r.stdout + r.stderr)}")
            how = "pip install --no-index --no-deps --target " + SITE
        else:  # no pip next to this torch: a wheel is a zip of its installed files
            for f in files:
                with zipfile.ZipFile(f) as z:
                    z.extractall(self.site)
            how = f"wheels unpacked into {SITE} (no pip: {last_lines(pip.stderr, 1)})"
        after = self.probe(str(self.site), "cpu")  # the CUDA facts are before's
        say("after: " + json.dumps(after))
        self.facts = {**after, **{k: before[k] for k in ("gpus", "nccl", "compute_mode", "cuda_check")
                                  if k in before}}
        broken = [m for m in ("numpy", "packaging", "megatron.core", "megatron_bfpp") if not after["modules"].get(m)]
        if broken:
            return fail("does not import after the install: " + "; ".join(f"{m}: {after['errors'].get(m)}"
                                                                          for m in broken))
        # The Megatron-LM tree.
        tree = self.work / "megatron-lm"
        shutil.rmtree(tree, ignore_errors=True)
        with tarfile.open(self.kit / manifest["megatron_lm"]["file"]) as t:
            t.extractall(self.work, filter="data")
        self.tree = self.work / manifest["megatron_lm"]["dir"]
        te = after.get("transformer_engine", {})
        if "version" not in te:
            self.optional_absent.add("transformer_engine")
        stale = manifest.get("sources_sha256") != sources_digest(self.root)
        installed = ", ".join(f"{w['project']} {w['version']}" for w in wanted)
        detail = (f"python {before['python']}; {how}: {installed}" + (f"; {'; '.join(notes)}" if notes else "")
                  + f"; Megatron-LM {manifest['megatron_lm']['version']} unpacked; TransformerEngine: "
                  + (te["version"] if "version" in te else f"absent ({te.get('error')})"))
        if self.device == "cuda":
            detail += (f"; GPU compute mode {(before.get('compute_mode') or {}).get('mode', 'unknown')}"
                       + (f" ({self.no_sharing})" if self.no_sharing else ""))
        if stale:
            return fail("the kit's project wheel was built from other sources than this checkout's megatron_bfpp/: "
                        "run --prepare again; " + detail)
        return LegResult(leg.name, "pass", time.monotonic() - t0, detail)

    # -- legs ---------------------------------------------------------------------------------------------

    def command(self, leg: Leg) -> tuple[list[str], dict[str, str]]:
        shape = SHAPES[self.device]
        flags = [*shape.model_flags(), *TRAIN_FLAGS, *leg.flags]
        workers = ["-m", "megatron_bfpp.devkit.workers"]
        if leg.kind == "bfpp":
            report = self.work / f"{leg.name}.json"
            return self.launch(leg.ranks, [*workers, "train", *flags, "--mock-data", "--report-json",
                                           str(report)]), self.env()
        if leg.kind == "sync":
            return self.launch(leg.ranks, [*workers, "sync", "--out", str(self.work / f"{leg.name}.json"), "--",
                                           *flags, "--mock-data"]), self.env()
        if leg.kind == "megatron":
            assert self.tree is not None
            extra = [*MEGATRON_FLAGS, "--transformer-impl", leg.impl]
            if self.device == "cpu":
                extra += ["--distributed-backend", "gloo"]
            return self.launch(leg.ranks, [*workers, "megatron", str(self.tree / "pretrain_gpt.py"), *flags,
                                           *extra]), self.env(megatron=True)
        if leg.kind == "memory":
            reports = [str(self.work / f"{name}.json") for name in leg.inputs]
            return [self.python, *workers, "memory", "--out", str(self.work / f"{leg.name}.json"), *reports], self.env()
        raise ValueError(f"unknown leg kind {leg.kind}")

    def run_leg(self, leg: Leg) -> LegResult:
        if leg.requires and leg.requires in self.optional_absent:
            te = self.facts.get(leg.requires, {})
            return LegResult(leg.name, "not-run", 0.0, f"{leg.requires} does not import here ({te.get('error')})")
        missing = [name for name in leg.inputs if self.results.get(name) is None
                   or not (self.work / f"{name}.json").exists()]
        if missing:
            return LegResult(leg.name, "not-run", 0.0, f"no report from {', '.join(missing)}")
        if leg.ranks > 1 and self.no_sharing:
            return LegResult(leg.name, "not-run", 0.0, self.no_sharing)
        if leg.ranks > 1 and self.setup_hung:
            return LegResult(leg.name, "not-run", 0.0, f"same set-up hung: {self.setup_hung} hung at start-up with "
                             f"several ranks on one device; the one-rank legs still run")
        limit = self.budget.limit_for(leg, self.device)
        if limit is None:
            return LegResult(leg.name, "not-run", 0.0,
                             f"does not fit: {self.budget.left():.0f} s left of the budget, estimate "
                             f"{leg.estimate(self.device):.0f} s")
        cmd, env = self.command(leg)
        (self.work / f"{leg.name}.json").unlink(missing_ok=True)
        shutil.rmtree(self.work / f"{leg.name}.collectives", ignore_errors=True)
        result = self.judge(leg, self.execute(leg, cmd, limit, env))
        if result.extra.get("startup_hang") and leg.ranks > 1:
            self.setup_hung = leg.name
        return result

    def judge(self, leg: Leg, outcome: Outcome) -> LegResult:
        return judge(leg, outcome, self.device, self.results, self.work)

    # -- the whole run ------------------------------------------------------------------------------------

    def write_report(self, running: Leg | None = None) -> None:
        """The report as things stand (legs not run yet: not-run), written whole or not at all."""
        results = progress_results(self.legs, self.results, running.name if running else None,
                                   self.budget.elapsed(), self.logs[running.name] if running else "")
        tmp = self.out / f".{REPORT_NAME}.tmp"
        tmp.write_text(json.dumps(make_report(results, self.facts), indent=1) + "\n")
        os.replace(tmp, self.out / REPORT_NAME)

    def _not_run_why(self) -> str:
        if self.fatal:
            return self.fatal.split(":")[0] + " (see the install leg)"
        return "the install failed (see the install leg)"

    def run(self) -> int:
        self.out.mkdir(parents=True, exist_ok=True)
        for old in self.out.glob("*.log"):  # an earlier run's logs (the kit's own, by their first line)
            with open(old, errors="replace") as f:
                if f.readline().startswith("device kit, "):
                    old.unlink()
        (self.out / REPORT_NAME).unlink(missing_ok=True)
        for log in self.groups:
            (self.out / log).write_text(f"device kit, {self.device}: {', '.join(self.groups[log])}\n")
        self.work.mkdir(parents=True, exist_ok=True)
        previous = {sig: signal.signal(sig, _stop) for sig in STOP_SIGNALS}
        stopped: str | None = None
        running: Leg | None = None
        try:
            self.write_report()
            for leg in self.legs:
                t0 = time.monotonic()
                running = leg
                self.write_report(running=leg)
                try:
                    if leg.kind == "install":
                        res = self.install(leg)
                    elif self.tree is None:
                        res = LegResult(leg.name, "not-run", 0.0, self._not_run_why())
                    else:
                        res = self.run_leg(leg)
                except Stopped:
                    raise
                except Exception as e:  # the kit's own fault: reported on the leg, the run goes on
                    res = LegResult(leg.name, "fail", time.monotonic() - t0,
                                    f"device kit error: {type(e).__name__}: {e}")
                self.results[leg.name] = res
                running = None
                self.write_report()
                print(f"[{self.budget.elapsed():5.0f} s] {res.name}: {res.status} ({res.seconds:.0f} s) {res.detail}",
                      flush=True)
        except Stopped as e:
            stopped = e.name
            if self.token:
                end_processes(self.token)
            if running is not None:
                self.results[running.name] = LegResult(
                    running.name, "not-run", 0.0, f"stopped by {e.name} {self.budget.elapsed():.0f} s into the run, "
                    f"while this leg ran (its processes were ended; its output so far is in "
                    f"{self.logs[running.name]})")
            self.write_report()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        ordered = progress_results(self.legs, self.results)
        files = sorted(p.name for p in self.out.iterdir() if not p.name.startswith("."))
        print(f"device kit: {len(files)} files in {self.out} ({', '.join(files)}); "
              f"{self.budget.elapsed():.0f} s of a {self.budget.total_s:.0f} s budget")
        if stopped:
            print(f"device kit: stopped by {stopped}; the report holds what ran")
            return 3
        rc = exit_code(ordered, {leg.name for leg in self.legs if leg.requires in self.optional_absent})
        print({0: "device kit: every leg passed", 1: "device kit: FAILED legs: " + ", ".join(
            r.name for r in ordered if r.status == "fail"), 3: "device kit: incomplete: " + ", ".join(
            f"{r.name} ({r.status})" for r in ordered if r.status in ("not-run", "refused"))}[rc])
        return rc


def _suitable(module: str, have: str, accept: str | None) -> bool:
    """Whether an importable version is good enough: `accept` a version prefix ("0.19.") or None for any."""
    return accept is None or have.startswith(accept)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/device_check.sh", description="the device kit's run (see "
                                "megatron_bfpp/devkit/run.py)")
    p.add_argument("--device", choices=DEVICES, default="cuda")
    p.add_argument("--out", default=None, help="where the report and logs go (default $OUT when set, else "
                   "runs/device_check)")
    p.add_argument("--budget", type=float, default=None, help=f"seconds for the whole run (default "
                   f"{DEFAULT_BUDGET_S}; {QUICK_BUDGET_S} with --quick)")
    p.add_argument("--quick", action="store_true", help=f"the short first call: the most revealing legs within "
                   f"{QUICK_BUDGET_S} s (also the plan when --budget is under the full plan's estimate)")
    p.add_argument("--python", default=sys.executable, help="the python with torch the legs run under")
    p.add_argument("--dry-run", action="store_true", help="print the legs, their estimates and the total")
    p.add_argument("--legs", help="comma-separated leg names to run (the install always runs)")
    a = p.parse_args(argv)
    if a.budget is not None and a.budget <= 0:
        p.error("--budget must be positive")
    if a.quick and a.legs:
        p.error("--quick and --legs choose the legs both: give one")
    budget = a.budget if a.budget is not None else (QUICK_BUDGET_S if a.quick else DEFAULT_BUDGET_S)
    full = [leg for leg in plan_legs(a.device) if not leg.requires]
    quick = a.quick or (not a.legs and plan_total(full, a.device) > budget)
    if quick and not a.quick:
        print(f"device kit: the budget ({budget:.0f} s) is under the full plan's estimate "
              f"({plan_total(full, a.device):.0f} s): the quick plan (--quick)", flush=True)
    only = set(QUICK_LEGS) if quick else (set(a.legs.split(",")) if a.legs else None)
    if a.legs:
        unknown = set(a.legs.split(",")) - {leg.name for leg in plan_legs(a.device)}
        if unknown:
            p.error(f"--legs: unknown legs {sorted(unknown)}")
    if a.dry_run:
        legs = select_legs(plan_legs(a.device), only)
        text, fits = dry_run_text(a.device, budget, legs, quick=quick)
        print(text)
        return 0 if fits else 3
    a.python = shutil.which(a.python) or a.python
    out = Path(a.out).resolve() if a.out else default_out().resolve()
    become_subreaper()  # orphans of the legs' processes become the kit's, which reaps them
    return Driver(a.device, out, budget, a.python, only=only).run()


if __name__ == "__main__":
    sys.exit(main())
