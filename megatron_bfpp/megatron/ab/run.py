"""What the A/B driver starts: the TransformerEngine probe where the ranks run, the allocation's first node, the
project's flag check on every variant, and the runs themselves (one log each, the record of what ran)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

from .commands import FIRST_NODE, RunRecord, Variant, run_env, shell_line, site_srun_args


def detect_transformer_impl(a: argparse.Namespace) -> str:
    """--transformer-impl, or for auto whether TransformerEngine imports where the ranks run (a note when not)."""
    if a.transformer_impl != "auto":
        return a.transformer_impl
    probe = ["python", "-c", "import transformer_engine.pytorch"]
    if a.launcher == "srun" and not a.dry_run:
        probe = ["srun", "--nodes=1", "--ntasks=1", *site_srun_args(), *probe]
    try:
        ok = subprocess.run(probe, capture_output=True, timeout=300).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    if not ok:
        print("note: TransformerEngine is not importable where the ranks run: every variant runs with "
              "--transformer-impl local (README, GPU environment)", file=sys.stderr)
    return "transformer_engine" if ok else "local"


def first_node(a: argparse.Namespace) -> str:
    """The rendezvous host of srun runs: the allocation's first node (scontrol), a placeholder in a dry run or
    outside an allocation."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST")
    if a.launcher != "srun" or not nodelist or a.dry_run:
        return FIRST_NODE
    return subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True).stdout.split()[0]


def check_flags(a: argparse.Namespace, mlm: str, vs: list[Variant], flags: list[str], world: int) -> list[str]:
    """The project's check (Megatron's parser and validate_args, then the plugin's) on every variant's flags, in
    one process with the Megatron-LM checkout first on the path; returns one verdict line per variant."""
    code = (
        "import json, sys\n"
        "from megatron_bfpp.megatron.check import check\n"
        "bad = 0\n"
        "for name, flags in json.load(sys.stdin):\n"
        "    try:\n"
        "        print(f'{name}: ok: {check(flags, world_size=" + str(world) + ")}')\n"
        "    except SystemExit as e:\n"
        "        bad = 1; print(f'{name}: Megatron-LM rejects the arguments (argparse exit {e.code})')\n"
        "    except Exception as e:\n"
        "        bad = 1; print(f'{name}: rejected: {type(e).__name__}: {e}')\n"
        "sys.exit(bad)\n"
    )
    payload = json.dumps([[v.name, flags + v.flags] for v in vs])
    env = run_env(a, mlm)
    env.pop("BFPP_CPU_SHIM", None)
    r = subprocess.run([sys.executable, "-c", code], input=payload, capture_output=True, text=True, env=env,
                       cwd=mlm if Path(mlm).is_dir() else None, timeout=600)
    lines = [ln for ln in r.stdout.splitlines() if ": ok: " in ln or ": rejected" in ln or "rejects" in ln]
    if r.returncode != 0:
        errs = [ln for ln in r.stderr.splitlines() if "error" in ln.lower() and "warn" not in ln.lower()]
        detail = "\n".join(lines + errs[-5:]) or r.stderr.strip()[-2000:]
        raise SystemExit(f"error: the project's flag check rejects a variant:\n{detail}\n"
                         f"(python -m megatron_bfpp.megatron.check --world-size {world} -- FLAGS for details)")
    return lines



def run_all(records: list[RunRecord], mlm: str, env: dict[str, str], reps: int, manifest: dict,
            manifest_path: Path) -> None:
    """Run every record in order (its command on the log's first line, its output below); each exit status is
    kept in the record and the manifest is rewritten after each run, so --parse-only can read a partial A/B."""
    for r in records:
        print(f"running {r.variant} (repetition {r.rep}/{reps}) -> {r.log}", flush=True)
        with open(r.log, "w") as f:
            f.write(f"# cd {shlex.quote(mlm)} && {shell_line(r.command)}\n")
            f.flush()
            try:
                r.returncode = subprocess.run(r.command, stdout=f, stderr=subprocess.STDOUT, cwd=mlm,
                                              env=dict(env, BFPP_AB_VARIANT=r.variant, BFPP_AB_REP=str(r.rep))).returncode
            except OSError as e:
                f.write(f"\ncould not start: {e}\n")
                r.returncode = 127
        if r.returncode != 0:
            print(f"warning: {r.variant} (repetition {r.rep}) exited with {r.returncode}; see {r.log}", file=sys.stderr)
        manifest["runs"].append(asdict(r))
        manifest_path.write_text(json.dumps(manifest, indent=1))
