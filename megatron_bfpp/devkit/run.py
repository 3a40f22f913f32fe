"""The device kit's run: install the kit offline, run the legs within the budget, write the report and logs.

    python -m megatron_bfpp.devkit.run [--device cuda|cpu] [--out DIR] [--budget S] [--dry-run] [--legs A,B]

Run from the repository root (scripts/device_check.sh does). Standard library only in this process: every leg,
the install's checks included, runs in a subprocess of the python given (`--python`, default this one), which
must already have torch; the kit's wheels install with `pip install --no-index --no-deps --target
devkit/site` (the environment itself, torch first of all, is never modified; a system python that refuses
installs under PEP 668 is no obstacle), and only the packages that do not already import at a suitable version.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path
from typing import Any

from .iterations import ELAPSED_RE, ITERATION_RE, LOSS_RE, losses_agree, relative_differences
from .plan import (ALL_ITERATIONS_RTOL, DEFAULT_BUDGET_S, DEVICES, FIRST_ITERATION_RTOL, MAX_RESULT_FILES,
                   MEGATRON_FLAGS, REPORT_NAME, SHAPES, TRAIN_FLAGS, Budget, Leg, LegResult, dry_run_text,
                   exit_code, group_logs, log_of, make_report, plan_legs)

ROOT = Path(__file__).resolve().parents[2]
KIT = "devkit/kit"             # what --prepare builds and the device machine receives (carried)
SITE = "devkit/site"           # where the kit installs (not carried; rebuilt each run)
WORK = "devkit/work"           # Megatron-LM's unpacked tree, the runs' reports and results (not carried)
MANIFEST = "manifest.json"
LEG_LOG_TAIL_BYTES = 400_000   # a leg's output kept in its log (head and tail beyond that)

NCCL_WORDS_RE = re.compile(r"(NCCL WARN.*|.*NCCL error.*|.*Duplicate GPU detected.*|.*ncclInvalidUsage.*|"
                           r".*ncclSystemError.*|.*ncclInternalError.*|.*ncclUnhandledCudaError.*)")


# ------------------------------------------------------------------------------------------------- helpers

def leg_losses(output: str) -> tuple[list[float], list[float]]:
    """lm losses and per-iteration seconds of Megatron-style iteration lines (the trainer prints the same)."""
    losses, times = [], []
    for line in output.splitlines():
        if ITERATION_RE.search(line) and "lm loss" in line:
            if (m := LOSS_RE.search(line)) is not None:
                losses.append(float(m.group(1)))
            if (e := ELAPSED_RE.search(line)) is not None:
                times.append(float(e.group(1)) / 1e3)
    return losses, times


def compare_losses(losses: list[float], ref: list[float]) -> tuple[bool, str]:
    """bf16 agreement with the reference: relative difference within FIRST_ITERATION_RTOL at iteration 1 and
    ALL_ITERATIONS_RTOL at every iteration, same number of iterations, all finite."""
    if not losses or not ref:
        return False, "no losses to compare" if not losses else "the reference has no losses"
    rel = relative_differences(losses, ref)
    return losses_agree(losses, ref), (
        f"losses {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} iterations; relative difference to the "
        f"reference {rel[0]:.1e} at iteration 1 (<= {FIRST_ITERATION_RTOL:g}), max {max(rel):.1e} "
        f"(<= {ALL_ITERATIONS_RTOL:g})" + ("" if len(losses) == len(ref) else
                                          f"; {len(losses)} iterations against {len(ref)}"))


def nccl_words(output: str) -> list[str]:
    """NCCL's own messages in a run's output (without torch's rank prefix, deduplicated, in order)."""
    seen: list[str] = []
    lines = [re.sub(r"^\[rank\d+\]:\s*", "", line.strip()) for line in output.splitlines()]
    for i, text in enumerate(lines):
        if text == "Last error:" and i + 1 < len(lines):
            text = f"Last error: {lines[i + 1]}"
        elif not NCCL_WORDS_RE.fullmatch(text):
            continue
        if text not in seen:
            seen.append(text)
    return seen


def _tail_lines(output: str, n: int = 3) -> str:
    lines = [ln.strip() for ln in output.splitlines() if ln.strip() and "Warning" not in ln
             and "warnings.warn" not in ln]
    return " | ".join(lines[-n:])[-600:]


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
        legs = plan_legs(device)
        if only is not None:  # a leg brings its reference and the legs whose reports it reads
            only = set(only) | {"install"}
            by_name = {leg.name: leg for leg in legs}
            todo = list(only)
            while todo:
                leg = by_name[todo.pop()]
                for name in ([leg.reference] if leg.reference else []) + list(leg.inputs):
                    if name not in only:
                        only.add(name)
                        todo.append(name)
        self.legs = [leg for leg in legs if only is None or leg.name in only]
        self.groups = group_logs(self.legs)
        self.logs = log_of(self.groups)
        assert len(self.groups) + 1 <= MAX_RESULT_FILES
        self.budget = Budget(budget_s)
        self.results: dict[str, LegResult] = {}
        self.facts: dict[str, Any] = {}
        self.optional_absent: set[str] = set()
        self.tree: Path | None = None

    # -- running one process ------------------------------------------------------------------------------

    def env(self, megatron: bool = False) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "TORCHELASTIC", "BFPP_"))}
        paths = [str(self.site)]
        # Megatron-LM's training loop on CPU: the test shim (tests/support/cpu_shim)
        if megatron and self.device == "cpu":
            paths.append(str(self.root / "tests" / "support" / "cpu_shim"))
            env["BFPP_CPU_SHIM"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(paths)
        env.update(CUDA_DEVICE_MAX_CONNECTIONS="1", NCCL_DEBUG="WARN",
                   TORCH_NCCL_ASYNC_ERROR_HANDLING="1")
        if self.device == "cpu":
            env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
        return env

    def launch(self, ranks: int, module_args: list[str]) -> list[str]:
        """torchrun for `ranks` processes on this machine, each through scripts/shared_gpu_rank.sh when several
        (every rank on device 0, its own NCCL host over sockets; on CPU the same wrapper, gloo ignores it)."""
        cmd = [self.python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
        if ranks > 1:
            cmd += ["--no-python", str(self.root / "scripts" / "shared_gpu_rank.sh"), self.python]
        else:
            cmd += ["--no-python", self.python]
        return cmd + module_args

    def execute(self, leg: Leg, cmd: list[str], limit: float, env: dict[str, str]) -> tuple[int | None, str, float]:
        """Run `cmd` (its own process group, killed whole at `limit` seconds); its output goes to the leg's log.
        Returns (exit code or None when killed, output, seconds)."""
        log = self.out / self.logs[leg.name]
        t0 = time.monotonic()
        with open(log, "a") as f:
            f.write(f"\n== {leg.name} (limit {limit:.0f} s)\n+ {' '.join(cmd)}\n")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=self.work,
                                start_new_session=True)
        try:
            raw, _ = proc.communicate(timeout=limit)
            rc: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                raw, _ = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                raw, _ = proc.communicate()
            rc = None
        seconds = time.monotonic() - t0
        output = raw.decode(errors="replace")
        kept = output if len(output) <= LEG_LOG_TAIL_BYTES else (
            output[:LEG_LOG_TAIL_BYTES // 4] + "\n[... cut ...]\n" + output[-3 * LEG_LOG_TAIL_BYTES // 4:])
        with open(log, "a") as f:
            f.write(kept)
            f.write(f"\n== {leg.name}: {'killed at the limit' if rc is None else f'exit {rc}'} after {seconds:.1f} s\n")
        return rc, output, seconds

    # -- install ------------------------------------------------------------------------------------------

    def probe(self, pythonpath: str) -> dict[str, Any]:
        env = dict(os.environ, PYTHONPATH=pythonpath)
        if self.device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        r = subprocess.run([self.python, str(self.root / "megatron_bfpp" / "devkit" / "probe.py"), "--device",
                            self.device], capture_output=True, text=True, env=env, cwd=self.work, timeout=180)
        if r.returncode != 0:
            raise RuntimeError(f"the environment probe failed: {_tail_lines(r.stderr)}")
        return json.loads(r.stdout.strip().splitlines()[-1])

    def install(self, leg: Leg) -> LegResult:
        t0 = time.monotonic()
        log = self.out / self.logs[leg.name]
        notes: list[str] = []

        def say(msg: str) -> None:
            with open(log, "a") as f:
                f.write(msg + "\n")

        say(f"== {leg.name}")
        manifest_path = self.kit / MANIFEST
        if not manifest_path.exists():
            return LegResult(leg.name, "fail", time.monotonic() - t0,
                             f"no kit at {KIT}: run scripts/device_check.sh --prepare on a machine with the registry")
        manifest = json.loads(manifest_path.read_text())
        self.work.mkdir(parents=True, exist_ok=True)
        before = self.probe("")
        say("before: " + json.dumps(before))
        if not before.get("torch"):
            return LegResult(leg.name, "fail", time.monotonic() - t0,
                             f"{self.python} has no torch ({before['errors'].get('torch')}): the kit needs a python "
                             f"with torch")
        wanted = []
        for wheel in manifest["wheels"]:
            module, version = wheel["module"], wheel["version"]
            have = before["modules"].get(module)
            if module != "megatron_bfpp" and have and _suitable(module, have, wheel.get("accept")):
                notes.append(f"{wheel['project']} {have} already present")
                continue
            wanted.append(wheel)
        shutil.rmtree(self.site, ignore_errors=True)
        self.site.mkdir(parents=True)
        files = [str(self.kit / "wheels" / w["file"]) for w in wanted]
        pip = subprocess.run([self.python, "-m", "pip", "--version"], capture_output=True, text=True)
        if pip.returncode == 0:
            cmd = [self.python, "-m", "pip", "install", "--no-index", "--no-deps",
                   "--disable-pip-version-check", "--target", str(self.site), *files]
            say("+ " + " ".join(cmd))
            r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PIP_NO_INDEX="1"),
                               timeout=max(30.0, self.budget.left()))
            say(r.stdout + r.stderr)
            if r.returncode != 0:
                return LegResult(leg.name, "fail", time.monotonic() - t0,
                                 f"pip install --no-index failed: {_tail_lines(r.stdout + r.stderr)}")
            how = "pip install --no-index --no-deps --target " + SITE
        else:  # no pip next to this torch: a wheel is a zip of its installed files
            for f in files:
                with zipfile.ZipFile(f) as z:
                    z.extractall(self.site)
            how = f"wheels unpacked into {SITE} (no pip: {_tail_lines(pip.stderr, 1)})"
        after = self.probe(str(self.site))
        say("after: " + json.dumps(after))
        self.facts = after
        broken = [m for m in ("numpy", "packaging", "megatron.core", "megatron_bfpp") if not after["modules"].get(m)]
        if broken:
            return LegResult(leg.name, "fail", time.monotonic() - t0,
                             "does not import after the install: " + "; ".join(f"{m}: {after['errors'].get(m)}"
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
        detail = (f"{how}: {installed}" + (f"; {'; '.join(notes)}" if notes else "")
                  + f"; Megatron-LM {manifest['megatron_lm']['version']} unpacked; TransformerEngine: "
                  + (te["version"] if "version" in te else f"absent ({te.get('error')})"))
        if stale:
            return LegResult(leg.name, "fail", time.monotonic() - t0, "the kit's project wheel was built from "
                             "other sources than this checkout's megatron_bfpp/: run --prepare again; " + detail)
        return LegResult(leg.name, "pass", time.monotonic() - t0, detail)

    # -- legs ---------------------------------------------------------------------------------------------

    def command(self, leg: Leg) -> tuple[list[str], dict[str, str]]:
        shape = SHAPES[self.device]
        flags = [*shape.model_flags(), *TRAIN_FLAGS, *leg.flags]
        if leg.kind == "bfpp":
            report = self.work / f"{leg.name}.json"
            return self.launch(leg.ranks, ["-m", "megatron_bfpp.train", *flags, "--mock-data", "--report-json",
                                           str(report)]), self.env()
        if leg.kind == "sync":
            return self.launch(leg.ranks, ["-m", "megatron_bfpp.devkit.workers", "sync", "--out",
                                           str(self.work / f"{leg.name}.json"), "--", *flags, "--mock-data"]), self.env()
        if leg.kind == "megatron":
            assert self.tree is not None
            extra = [*MEGATRON_FLAGS, "--transformer-impl", leg.impl]
            if self.device == "cpu":
                extra += ["--distributed-backend", "gloo"]
            return self.launch(leg.ranks, ["-m", "megatron_bfpp.devkit.workers", "megatron",
                                           str(self.tree / "pretrain_gpt.py"), *flags, *extra]), self.env(megatron=True)
        if leg.kind == "memory":
            reports = [str(self.work / f"{name}.json") for name in leg.inputs]
            return [self.python, "-m", "megatron_bfpp.devkit.workers", "memory", "--out",
                    str(self.work / f"{leg.name}.json"), *reports], self.env()
        raise ValueError(f"unknown leg kind {leg.kind}")

    def run_leg(self, leg: Leg) -> LegResult:
        if leg.requires and leg.requires in self.optional_absent:
            te = self.facts.get(leg.requires, {})
            return LegResult(leg.name, "not-run", 0.0, f"{leg.requires} does not import here ({te.get('error')})")
        missing = [name for name in leg.inputs if self.results.get(name) is None
                   or not (self.work / f"{name}.json").exists()]
        if missing:
            return LegResult(leg.name, "not-run", 0.0, f"no report from {', '.join(missing)}")
        limit = self.budget.limit_for(leg, self.device)
        if limit is None:
            return LegResult(leg.name, "not-run", 0.0,
                             f"does not fit: {self.budget.left():.0f} s left of the budget, estimate "
                             f"{leg.estimate(self.device):.0f} s")
        cmd, env = self.command(leg)
        for name in (f"{leg.name}.json",):
            (self.work / name).unlink(missing_ok=True)
        rc, output, seconds = self.execute(leg, cmd, limit, env)
        return self.judge(leg, rc, output, seconds, limit)

    def judge(self, leg: Leg, rc: int | None, output: str, seconds: float, limit: float) -> LegResult:
        losses, times = leg_losses(output)
        if rc != 0:
            words = nccl_words(output) if self.device == "cuda" else []
            if words and not losses:  # NCCL said no before any iteration ran: the set-up, not our code
                return LegResult(leg.name, "refused", seconds, "NCCL refused: " + " | ".join(words[:4])[:900])
            why = f"killed at its {limit:.0f} s limit" if rc is None else f"exit {rc}"
            return LegResult(leg.name, "fail", seconds, f"{why}: {_tail_lines(output)}"
                             + (f" | NCCL: {' | '.join(words[:2])}" if words else ""), {"losses": losses})
        result = LegResult(leg.name, "pass", seconds, "", {"losses": losses, "times": times})
        if leg.kind in ("bfpp", "megatron"):
            if not losses:
                return LegResult(leg.name, "fail", seconds, "no iteration with an lm loss in the output")
            step = sorted(times[1:] or times)[len(times[1:] or times) // 2] if times else None
            parts = [f"{len(losses)} iterations, lm loss {losses[0]:.4f} -> {losses[-1]:.4f}"]
            if step is not None:
                parts.append(f"median step {step * 1e3:.0f} ms")
            if leg.reference:
                ref = self.results.get(leg.reference)
                if ref is None or ref.status != "pass":
                    result.status = "fail"
                    parts = [f"the reference {leg.reference} did not pass: nothing to compare with"] + parts
                else:
                    ok, text = compare_losses(losses, ref.extra.get("losses", []))
                    result.status = "pass" if ok else "fail"
                    parts = [text] + parts[1:]
            from .plan import consecutive_ws

            cw = consecutive_ws(leg, self.device)
            if cw is not None:
                parts.append(f"{cw} consecutive W's on a chunk in the schedule")
            if leg.ranks > 1:
                parts.append(f"{leg.ranks} ranks sharing the {'GPU over NCCL sockets' if self.device == 'cuda' else 'CPU over gloo'}")
            result.detail = "; ".join(parts)
        elif leg.kind == "sync":
            from .workers import sync_detail  # stdlib-only at import: torch is imported inside its functions

            path = self.work / f"{leg.name}.json"
            if not path.exists():
                return LegResult(leg.name, "fail", seconds, "the sync worker wrote no result")
            result.detail = sync_detail(json.loads(path.read_text()))
        elif leg.kind == "memory":
            from .workers import memory_verdict

            path = self.work / f"{leg.name}.json"
            if not path.exists():
                return LegResult(leg.name, "fail", seconds, "the memory worker wrote no result")
            ok, text = memory_verdict(json.loads(path.read_text()),
                                      "torch.cuda.max_memory_allocated" if self.device == "cuda"
                                      else "CPU: the runtime's own count of what it holds")
            result.status, result.detail = ("pass" if ok else "fail"), text
        return result

    # -- the whole run ------------------------------------------------------------------------------------

    def run(self) -> int:
        self.out.mkdir(parents=True, exist_ok=True)
        for log in self.groups:
            (self.out / log).write_text(f"device kit, {self.device}: {', '.join(self.groups[log])}\n")
        (self.out / REPORT_NAME).unlink(missing_ok=True)
        self.work.mkdir(parents=True, exist_ok=True)
        ordered: list[LegResult] = []
        for leg in self.legs:
            t0 = time.monotonic()
            try:
                if leg.kind == "install":
                    res = self.install(leg)
                elif self.tree is None:
                    res = LegResult(leg.name, "not-run", 0.0, "the install failed (see the install leg)")
                else:
                    res = self.run_leg(leg)
            except Exception as e:  # the kit's own fault: reported on the leg, the run goes on
                res = LegResult(leg.name, "fail", time.monotonic() - t0, f"device kit error: {type(e).__name__}: {e}")
            self.results[leg.name] = res
            ordered.append(res)
            print(f"[{self.budget.elapsed():5.0f} s] {res.name}: {res.status} ({res.seconds:.0f} s) {res.detail}",
                  flush=True)
        report = make_report(ordered, self.facts)
        (self.out / REPORT_NAME).write_text(json.dumps(report, indent=1) + "\n")
        files = sorted(p.name for p in self.out.iterdir())
        print(f"device kit: {len(files)} files in {self.out} ({', '.join(files)}); "
              f"{self.budget.elapsed():.0f} s of a {self.budget.total_s:.0f} s budget")
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
    p.add_argument("--out", default=str(ROOT / "runs" / "device_check"))
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S)
    p.add_argument("--python", default=sys.executable, help="the python with torch the legs run under")
    p.add_argument("--dry-run", action="store_true", help="print the legs, their estimates and the total")
    p.add_argument("--legs", help="comma-separated leg names to run (the install always runs)")
    a = p.parse_args(argv)
    if a.budget <= 0:
        p.error("--budget must be positive")
    if a.dry_run:
        text, fits = dry_run_text(a.device, a.budget)
        print(text)
        return 0 if fits else 3
    a.python = shutil.which(a.python) or a.python
    only = set(a.legs.split(",")) if a.legs else None
    if only:
        unknown = only - {leg.name for leg in plan_legs(a.device)}
        if unknown:
            p.error(f"--legs: unknown legs {sorted(unknown)}")
    return Driver(a.device, Path(a.out).resolve(), a.budget, a.python, only=only).run()


if __name__ == "__main__":
    sys.exit(main())
