"""Stand-ins for SLURM's sbatch, srun, scontrol and squeue, for the script tests (tests/distributed/test_scripts.py).

Each call is appended as one JSON line {"tool", "argv", "cwd", "env"} to $FAKE_SLURM_LOG. The stand-ins act like
SLURM where the scripts depend on it:

- sbatch copies the batch script into a spool directory ($FAKE_SLURM_SPOOL) and runs that copy with bash, from
  the submitting directory, with SLURM_JOB_ID, SLURM_SUBMIT_DIR, SLURM_JOB_NUM_NODES (from -N/--nodes or the
  script's #SBATCH --nodes) and SLURM_JOB_NODELIST set; its exit status is the script's.
- scontrol: `show hostnames A,B` prints one name a line; `show job ID` prints the submitted script's absolute
  path as `Command=`; `requeue ID` is only recorded.
- squeue -o %L prints $FAKE_SLURM_TIME_LEFT (default 3:59:00).
- srun: the TransformerEngine probe (`python -c "import transformer_engine..."`) succeeds when FAKE_TE=1; the
  flag check (`python -m megatron_bfpp.megatron.check`) runs for real when FAKE_SRUN_CHECK=run (else succeeds);
  the training step (node_launch.sh) exits with $FAKE_SRUN_RC (default 0), first writing Megatron's
  latest_checkpointed_iteration.txt = $FAKE_SRUN_ITERATION into the --save directory when that is set.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

RECORDED_ENV = ("PYTHONPATH", "CUDA_DEVICE_MAX_CONNECTIONS", "NCCL_IB_HCA", "SLURM_JOB_ID", "SLURM_SUBMIT_DIR")
# srun options that take their value as the next word (when not written --opt=value).
SRUN_VALUE_OPTS = {"-N", "-n", "-o", "-e", "-D", "--nodes", "--ntasks", "--ntasks-per-node", "--output", "--error",
                   "--chdir", "--container-image", "--container-mounts", "--container-workdir", "--container-name",
                   "--mpi", "--gpus-per-node", "--cpus-per-task", "--export", "--account", "--partition", "-A", "-p"}


def record(tool: str, argv: list[str]) -> None:
    log = os.environ.get("FAKE_SLURM_LOG")
    if log:
        with open(log, "a") as f:
            f.write(json.dumps({"tool": tool, "argv": argv, "cwd": os.getcwd(),
                                "env": {k: os.environ[k] for k in RECORDED_ENV if k in os.environ}}) + "\n")


def sbatch(argv: list[str]) -> int:
    nodes, i = None, 0
    while i < len(argv) and argv[i].startswith("-"):
        a = argv[i]
        if a in ("-N", "--nodes"):
            nodes, i = argv[i + 1], i + 2
            continue
        if a.startswith("--nodes="):
            nodes = a.split("=", 1)[1]
        i += 1
    script, args = Path(argv[i]), argv[i + 1:]
    text = script.read_text()
    if nodes is None:
        nodes = next((ln.split("=", 1)[1].strip() for ln in text.splitlines() if ln.startswith("#SBATCH --nodes=")), "1")
    spool = Path(os.environ.get("FAKE_SLURM_SPOOL") or "/tmp/fake-slurm-spool")
    spool.mkdir(parents=True, exist_ok=True)
    shutil.copy(script, spool / "slurm_script")
    (spool / "command").write_text(str(script.resolve()))
    env = dict(os.environ, SLURM_JOB_ID="4242", SLURM_SUBMIT_DIR=os.getcwd(), SLURM_JOB_NUM_NODES=str(nodes),
               SLURM_JOB_NODELIST=",".join(f"node{k:03d}" for k in range(1, int(nodes) + 1)))
    return subprocess.run(["bash", str(spool / "slurm_script"), *args], env=env).returncode


def scontrol(argv: list[str]) -> int:
    if argv[:2] == ["show", "hostnames"]:
        print("\n".join((argv[2] if len(argv) > 2 else os.environ.get("SLURM_JOB_NODELIST", "")).split(",")))
    elif argv[:2] == ["show", "job"]:
        spool = Path(os.environ.get("FAKE_SLURM_SPOOL") or "/tmp/fake-slurm-spool")
        print(f"JobId={argv[2]} JobName=fake\n   UserId=user(1000) GroupId=user(1000)\n"
              f"   Command={(spool / 'command').read_text()}\n   WorkDir={os.environ.get('SLURM_SUBMIT_DIR', '')}")
    return 0


def srun(argv: list[str]) -> int:
    i = 0
    chdir = None
    while i < len(argv) and argv[i].startswith("-"):
        a = argv[i]
        if a.startswith("--chdir="):
            chdir = a.split("=", 1)[1]
        if a in SRUN_VALUE_OPTS:
            i += 1
        i += 1
    command = argv[i:]
    joined = " ".join(command)
    if "import transformer_engine" in joined:
        return 0 if os.environ.get("FAKE_TE") == "1" else 1
    if "megatron_bfpp.megatron.check" in joined:
        if os.environ.get("FAKE_SRUN_CHECK") == "run":
            return subprocess.run(command, cwd=chdir).returncode
        return 0
    if any(c.endswith("node_launch.sh") for c in command):
        it = os.environ.get("FAKE_SRUN_ITERATION")
        if it and "--save" in command:
            save = Path(command[command.index("--save") + 1])
            save.mkdir(parents=True, exist_ok=True)
            (save / "latest_checkpointed_iteration.txt").write_text(it)
        return int(os.environ.get("FAKE_SRUN_RC", "0"))
    return subprocess.run(command, cwd=chdir).returncode


def main() -> int:
    tool, argv = sys.argv[1], sys.argv[2:]
    record(tool, argv)
    if tool == "squeue":
        print(os.environ.get("FAKE_SLURM_TIME_LEFT", "3:59:00"))
        return 0
    return {"sbatch": sbatch, "scontrol": scontrol, "srun": srun}[tool](argv)


if __name__ == "__main__":
    sys.exit(main())
