"""Shell and driver scripts: shellcheck, SLURM --dry-run commands (checked by Megatron's own argument validation
and the plugin's for the job's world size), the patch-apply script's errors, and the A/B driver's commands and
log parsing."""

from __future__ import annotations

import csv
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SLURM = sorted((ROOT / "scripts" / "slurm").glob("pretrain_*.sbatch"))
SHELL_SCRIPTS = [ROOT / "scripts" / "apply_megatron_patches.sh", ROOT / "scripts" / "slurm" / "common.sh", *SLURM]
SHAPES = {  # paper-like GPT shapes: layers, hidden, heads (sequence 2048)
    "pretrain_1.3b.sbatch": (24, 2048, 16),
    "pretrain_13b.sbatch": (40, 5120, 40),
    "pretrain_52b.sbatch": (64, 8192, 64),
}


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "BFPP_", "NNODES", "MEGATRON_LM_DIR"))}
    env.update(extra)
    return env


def _run(cmd: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=_clean_env(**env), timeout=60, cwd=ROOT)


def _flags_after_script(command: list[str]) -> list[str]:
    i = next(k for k, x in enumerate(command) if x.endswith("pretrain_gpt.py"))
    return command[i + 1 :]


def _flag(flags: list[str], name: str) -> str:
    return flags[flags.index(name) + 1]


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed (apt-get install shellcheck)")
@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: p.name)
def test_shellcheck(script: Path) -> None:
    r = subprocess.run(["shellcheck", "-x", "-P", str(ROOT), str(script)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


def test_three_model_sizes_exist() -> None:
    assert sorted(p.name for p in SLURM) == sorted(SHAPES)


@pytest.mark.parametrize("script", SLURM, ids=lambda p: p.name)
def test_slurm_dry_run_is_a_valid_megatron_job(script: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    r = _run(["bash", str(script), "--dry-run"], MEGATRON_LM_DIR="/opt/Megatron-LM")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    exports = dict(line[len("export "):].split("=", 1) for line in lines if line.startswith("export "))
    assert exports["CUDA_DEVICE_MAX_CONNECTIONS"] == "1" and "NCCL_IB_TIMEOUT" in exports
    assert any(line.startswith("mkdir -p ") and "checkpoints" in line for line in lines)
    cmd = shlex.split(lines[-1])
    srun_end = cmd.index("torchrun")
    assert cmd[0] == "srun" and "--ntasks-per-node" in cmd[:srun_end]
    nnodes = int(_flag(cmd, "--nnodes"))
    gpus = int(_flag(cmd, "--nproc-per-node"))
    assert _flag(cmd[:srun_end], "--nodes") == str(nnodes)
    assert _flag(cmd, "--rdzv-backend") == "c10d" and _flag(cmd, "--rdzv-endpoint").endswith(":29500")
    assert cmd[cmd.index("-m") + 1 : cmd.index("-m") + 3] == ["megatron_bfpp.launch", "/opt/Megatron-LM/pretrain_gpt.py"]
    flags = _flags_after_script(cmd)
    layers, hidden, heads = SHAPES[script.name]
    assert (_flag(flags, "--num-layers"), _flag(flags, "--hidden-size"), _flag(flags, "--num-attention-heads")) == (
        str(layers), str(hidden), str(heads))
    assert _flag(flags, "--seq-length") == "2048" and _flag(flags, "--pipeline-schedule") == "breadth-first"
    ckpt = _flag(flags, "--save")
    assert _flag(flags, "--load") == ckpt and ckpt.endswith("checkpoints")

    # The printed job passes Megatron's argument validation and the plugin's at its world size.
    from megatron_bfpp.megatron.check import check

    for k, v in exports.items():
        monkeypatch.setenv(k, v)
    cfg = check(flags, world_size=nnodes * gpus)
    assert cfg.pipeline_schedule == "breadth-first" and cfg.zero_stage == 3 and cfg.vp >= 2
    assert min(cfg.train_microbatches) >= cfg.pp  # breadth-first wants M >= P (no extra bubble)


def test_slurm_overrides_patch_mode_and_extra_flags() -> None:
    script = ROOT / "scripts" / "slurm" / "pretrain_1.3b.sbatch"
    r = _run(["bash", str(script), "--dry-run", "--eval-iters", "0"], USE_PATCH="1", NNODES="4", ZERO_STAGE="",
             SCHEDULE="interleaved-1f1b", MEGATRON_LM_DIR="/opt/mlm", NCCL_IB_HCA="mlx5_0,mlx5_1")
    assert r.returncode == 0, r.stderr
    assert "export NCCL_IB_HCA=mlx5_0\\,mlx5_1" in r.stdout or "export NCCL_IB_HCA=mlx5_0,mlx5_1" in r.stdout
    cmd = shlex.split(r.stdout.strip().splitlines()[-1])
    assert "-m" not in cmd and "/opt/mlm/pretrain_gpt.py" in cmd  # the patched script runs directly
    flags = _flags_after_script(cmd)
    assert _flag(cmd, "--nnodes") == "4" and "--zero-stage" not in flags
    assert _flag(flags, "--pipeline-schedule") == "interleaved-1f1b" and flags[-2:] == ["--eval-iters", "0"]


def test_slurm_refuses_to_run_outside_a_job() -> None:
    r = _run(["bash", str(ROOT / "scripts" / "slurm" / "pretrain_1.3b.sbatch")])
    assert r.returncode != 0 and "not inside a SLURM job" in r.stderr


def test_apply_script_errors(tmp_path: Path) -> None:
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
    assert "core_v0.19.0" in r.stderr and "megatron_bfpp.launch" in r.stderr
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

sys.path.insert(0, str(ROOT / "scripts"))
import ab_megatron  # noqa: E402


def _ab_dry_run(*extra: str) -> dict[str, list[str]]:
    r = _run([sys.executable, str(ROOT / "scripts" / "ab_megatron.py"), "--megatron-lm-dir", "/opt/mlm", "--dry-run",
              *extra])
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    out = {}
    for head, cmd in zip(lines[::2], lines[1::2]):
        assert head.startswith("# ")
        out[head[2:].split(":")[0]] = shlex.split(cmd)
    return out


def test_ab_dry_run_same_model_and_batch() -> None:
    cmds = _ab_dry_run("--model", "13b", "--gpus-per-node", "8", "--nnodes", "8", "--launcher", "srun")
    stock, plugin = cmds["stock"], cmds["plugin"]
    assert stock[0].startswith("CUDA_DEVICE_MAX_CONNECTIONS=1") and "srun" in stock
    assert "megatron_bfpp.launch" not in stock and plugin[plugin.index("-m") + 1] == "megatron_bfpp.launch"
    fs, fp = _flags_after_script(stock), _flags_after_script(plugin)
    stock_only = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
    plugin_only = ["--pipeline-schedule", "breadth-first", "--zero-stage", "3"]
    assert fs[-3:] == stock_only and fp[-4:] == plugin_only
    assert fs[:-3] == fp[:-4]  # identical model, layout, batch, iterations, logging
    assert _flag(fs, "--num-layers-per-virtual-pipeline-stage") == "1"  # stock runs interleaved 1F1B


def test_ab_commands_pass_megatron_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_bfpp.megatron.check import check, parse_megatron_args

    cmds = _ab_dry_run("--model", "tiny", "--gpus-per-node", "8")
    cfg = check(_flags_after_script(cmds["plugin"]), world_size=8)
    assert (cfg.pipeline_schedule, cfg.pp, cfg.vp, cfg.zero_stage) == ("breadth-first", 4, 2, 3)
    args = parse_megatron_args(_flags_after_script(cmds["stock"]), world_size=8)
    assert args.use_distributed_optimizer and args.overlap_param_gather and args.virtual_pipeline_model_parallel_size == 2
    assert args.pipeline_schedule == "default"


def _iteration_line(it: int, ms: float, tflops: float, gbs: int, loss: float) -> str:
    # Megatron-LM 0.19 training_log() format (megatron/training/training.py).
    return (f" [2026-01-01 00:00:00.000000] iteration {it:8d}/{30:8d} | consumed samples: {it * gbs:12d} |"
            f" elapsed time per iteration (ms): {ms:.1f} | throughput per GPU (TFLOP/s/GPU): {tflops:.1f} |"
            f" learning rate: {1.5e-4:.6E} | global batch size: {gbs:5d} | lm loss: {loss:.6E} |"
            f" loss scale: 1.0 | grad norm: 1.234 | number of skipped iterations:   0 | number of nan iterations:   0 |")


def _memory_line(rank: int, it: int, alloc: float, peak: float) -> str:
    # report_memory() format (megatron/training/utils/common_utils.py).
    return (f"[Rank {rank}] (after {it} iterations) memory (MB) | allocated: {alloc:.2f} | max allocated: {peak:.2f}"
            f" | reserved: {peak + 100:.2f} | max reserved: {peak + 200:.2f}")


def test_ab_parse_summary_csv_png(tmp_path: Path) -> None:
    seq, gbs = 1024, 16
    stock_ms = [2000.0, 1000.0, 1010.0, 990.0]
    plugin_ms = [2500.0, 800.0, 810.0, 790.0]
    for name, ms, peak in (("stock", stock_ms, 4000.0), ("plugin", plugin_ms, 3000.0)):
        lines = ["noise before", "WARNING: something"]
        for i, t in enumerate(ms, start=1):
            lines.append(_iteration_line(i, t, 100.0 * 1000 / t, gbs, 10.0 - i))
            lines += [_memory_line(r, i, peak / 2, peak - 10 * r) for r in (0, 4)]
        (tmp_path / f"{name}.log").write_text("\n".join(lines) + "\n")
    assert ab_megatron.main(["--parse-only", "--out", str(tmp_path), "--model", "tiny", "--warmup", "1"]) == 0
    rows = {r["variant"]: r for r in csv.DictReader((tmp_path / "ab_summary.csv").open())}
    assert float(rows["stock"]["median_elapsed_ms"]) == 1000.0 and float(rows["plugin"]["median_elapsed_ms"]) == 800.0
    assert float(rows["stock"]["median_tokens_per_s"]) == pytest.approx(gbs * seq / 1.0)
    assert float(rows["plugin"]["ratio_median_tokens_per_s"]) == pytest.approx(1000 / 800)
    assert float(rows["plugin"]["peak_max_allocated_mb"]) == 3000.0
    assert float(rows["plugin"]["ratio_peak_max_allocated_mb"]) == pytest.approx(0.75)
    assert float(rows["plugin"]["last_lm_loss"]) == pytest.approx(6.0)
    its = list(csv.DictReader((tmp_path / "ab_iterations.csv").open()))
    assert len(its) == 8 and {r["variant"] for r in its} == {"stock", "plugin"}
    mem = list(csv.DictReader((tmp_path / "ab_memory.csv").open()))
    assert len(mem) == 16 and {r["rank"] for r in mem} == {"0", "4"}
    png = (tmp_path / "ab_megatron.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_ab_parse_rejects_failed_run(tmp_path: Path) -> None:
    (tmp_path / "stock.log").write_text("Traceback (most recent call last):\nAssertionError: Megatron requires CUDA.\n")
    (tmp_path / "plugin.log").write_text(_iteration_line(1, 1.0, 1.0, 1, 1.0) + "\n")
    assert ab_megatron.main(["--parse-only", "--out", str(tmp_path)]) == 2
