"""The device kit (scripts/device_check.sh, megatron_bfpp/devkit): leg planning, budget arithmetic, the report's
shape, the 8-file limit and the grouping of logs, the loss comparison and NCCL refusal, the host-sync capture,
the memory verdict and the kit's packing, without starting a process; then the script's --dry-run."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import warnings
import zipfile
from pathlib import Path

import pytest

from megatron_bfpp.devkit import plan, prepare, run, workers
from megatron_bfpp.devkit.plan import Budget, Leg, LegResult

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "device_check.sh"


def _flag(flags, name):
    flags = list(flags)
    return flags[flags.index(name) + 1] if name in flags else None


# ------------------------------------------------------------------------------------------------ planning

@pytest.mark.parametrize("device", plan.DEVICES)
def test_legs_are_ordered_by_what_they_reveal_and_references_come_first(device) -> None:
    legs = plan.plan_legs(device)
    names = [leg.name for leg in legs]
    assert len(set(names)) == len(names)
    assert names[0] == "install" and legs[1].name == "bfpp-P1-reference"
    # The NCCL legs with several ranks sharing the device come right after the reference, P = 4 first.
    multi = [leg for leg in legs[2:8]]
    assert [leg.ranks for leg in multi] == [4, 4, 4, 2, 2, 2] and all(leg.kind == "bfpp" for leg in multi)
    assert {_flag(leg.flags, "--pipeline-schedule") for leg in multi} == {
        "breadth-first", "interleaved-zb", "breadth-first-zb"}
    for leg in legs:
        if leg.reference:  # a reference runs before what is compared with it, on the same tool and model
            ref = next(x for x in legs if x.name == leg.reference)
            assert names.index(ref.name) < names.index(leg.name) and ref.kind == leg.kind
            assert ref.impl == leg.impl and ref.requires == leg.requires
        for name in leg.inputs:
            assert names.index(name) < names.index(leg.name)
    # Megatron-LM legs: local layers against stock at P = 1 and P = 2; TransformerEngine legs last and optional.
    megatron = {leg.name: leg for leg in legs if leg.kind == "megatron" and not leg.requires}
    assert {(leg.ranks, _flag(leg.flags, "--pipeline-schedule")) for leg in megatron.values()} >= {
        (1, "default"), (2, "default"), (1, "1f1b"), (2, "breadth-first")}
    assert all(leg.impl == "local" for leg in megatron.values())
    te = [leg for leg in legs if leg.requires]
    assert te and all(leg.requires == "transformer_engine" and leg.impl == "transformer_engine" for leg in te)
    assert names[-len(te):] == [leg.name for leg in te]
    assert any(leg.kind == "sync" and leg.ranks == 2 for leg in legs)
    assert any(leg.kind == "memory" for leg in legs)


def test_split_legs_with_several_ranks_have_consecutive_ws() -> None:
    """The case only shared-device multi-rank legs show: a W after a W of the same chunk."""
    for device in plan.DEVICES:
        for leg in plan.plan_legs(device):
            cw = plan.consecutive_ws(leg, device)
            if leg.ranks > 1 and cw is not None:
                assert cw > 0, leg.name
            if _flag(leg.flags, "--pipeline-schedule") in ("breadth-first", "default", "1f1b"):
                assert cw is None


@pytest.mark.parametrize("device", plan.DEVICES)
def test_layouts_divide_the_model(device) -> None:
    shape = plan.SHAPES[device]
    for leg in plan.plan_legs(device):
        pp = int(_flag(leg.flags, "--pipeline-model-parallel-size") or 1)
        if leg.kind in ("bfpp", "megatron", "sync"):
            assert pp == leg.ranks  # D = 1: every rank is a pipeline rank
            lpv = _flag(leg.flags, "--num-layers-per-virtual-pipeline-stage")
            vp = shape.layers // pp // int(lpv) if lpv else 1
            assert shape.layers % (pp * vp) == 0 and (vp == 2) == (pp > 1)
            assert shape.global_batch >= 2 * pp  # M >= 2P


def test_trainer_accepts_the_bfpp_legs(subprocesses) -> None:
    """(Importing Megatron starts ldconfig: the distributed tier.)"""
    from megatron_bfpp.train.config import parse_trainer_args

    for device in plan.DEVICES:
        shape = plan.SHAPES[device]
        for leg in plan.plan_legs(device):
            if leg.kind in ("bfpp", "sync"):
                args = parse_trainer_args([*shape.model_flags(), *plan.TRAIN_FLAGS, *leg.flags, "--mock-data"],
                                          world_size=leg.ranks)
                assert args.bf16 and args.train_iters == shape.iters


# -------------------------------------------------------------------------------------------------- budget

class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_budget_gives_each_leg_its_timeout_or_what_is_left_and_refuses_a_leg_that_no_longer_fits() -> None:
    clock = Clock()
    b = Budget(480, reserve_s=10, clock=clock)
    leg = Leg("x", "bfpp", "x", "", {"cuda": 30, "cpu": 40})
    assert b.left() == 470 and leg.timeout("cuda") == 75 and leg.timeout("cpu") == 100
    assert b.limit_for(leg, "cuda") == 75
    clock.t += 420  # 50 s left
    assert b.left() == 50 and b.limit_for(leg, "cuda") == 50
    assert b.limit_for(leg, "cpu") == 50
    clock.t += 15  # 35 s left: under the cuda estimate
    assert b.limit_for(leg, "cuda") == 35 and b.limit_for(leg, "cpu") is None
    clock.t += 6  # 29 s left
    assert b.limit_for(leg, "cuda") is None
    clock.t += 1000
    assert b.left() == 0
    small = Leg("s", "memory", "s", "", {"cuda": 1, "cpu": 1})
    assert Budget(5, reserve_s=10, clock=clock).limit_for(small, "cpu") is None
    with pytest.raises(ValueError):
        Budget(0)


def test_budget_cpu_estimate_boundary() -> None:
    clock = Clock()
    b = Budget(60, reserve_s=10, clock=clock)  # 50 s left
    assert b.limit_for(Leg("a", "bfpp", "a", "", {"cuda": 50, "cpu": 50}), "cpu") == 50
    assert b.limit_for(Leg("b", "bfpp", "b", "", {"cuda": 51, "cpu": 51}), "cpu") is None


@pytest.mark.parametrize("device", plan.DEVICES)
def test_the_legs_every_machine_runs_fit_the_default_budget_with_the_install(device) -> None:
    legs = plan.plan_legs(device)
    core = [leg for leg in legs if not leg.requires]
    assert core[0].kind == "install" and core[0].estimate(device) > 0
    assert plan.plan_total(core, device) <= plan.DEFAULT_BUDGET_S
    assert plan.plan_total(core, device) == sum(leg.estimate(device) for leg in core) + plan.REPORT_RESERVE_S
    text, fits = plan.dry_run_text(device, plan.DEFAULT_BUDGET_S)
    assert fits and "fits" in text
    for leg in legs:
        assert leg.name in text
    assert not plan.dry_run_text(device, 100)[1]


# ------------------------------------------------------------------------------------------- logs and files

def _legs(groups: list[str]) -> list[Leg]:
    return [Leg(f"leg{i}", "bfpp", g, "", {"cuda": 1, "cpu": 1}) for i, g in enumerate(groups)]


def test_logs_one_per_leg_when_they_fit_else_grouped_within_the_file_limit() -> None:
    few = _legs(["a", "a", "b"])
    assert plan.group_logs(few) == {"leg0.log": ["leg0"], "leg1.log": ["leg1"], "leg2.log": ["leg2"]}
    many = _legs(["a", "a", "b", "c", "c", "d", "e", "f", "g", "h"])
    groups = plan.group_logs(many, max_logs=7)
    assert len(groups) <= 7
    assert sum(groups.values(), []) == [leg.name for leg in many]  # every leg once, in order
    assert groups["d+e.log"] == ["leg5", "leg6"]  # the adjacent groups with the fewest legs merged
    tight = plan.group_logs(many, max_logs=2)
    assert len(tight) == 2 and sum(tight.values(), []) == [leg.name for leg in many]
    assert list(plan.group_logs(many, max_logs=1)) == ["a+b+c+d+e+f+g+h.log"]
    with pytest.raises(ValueError):
        plan.group_logs(many, max_logs=0)
    # A leg of a group seen earlier joins it (no second file for one group).
    back = plan.group_logs(_legs(["a", "b", "a", "c", "d", "e", "f", "g", "h"]), max_logs=8)
    assert back["a.log"] == ["leg0", "leg2"]


@pytest.mark.parametrize("device", plan.DEVICES)
def test_the_run_writes_at_most_eight_files(device) -> None:
    legs = plan.plan_legs(device)
    groups = plan.group_logs(legs)
    assert len(groups) + 1 <= plan.MAX_RESULT_FILES  # the logs and the report
    assert plan.REPORT_NAME not in groups
    assert set(plan.log_of(groups)) == {leg.name for leg in legs}


# -------------------------------------------------------------------------------------------------- report

FACTS = {"torch": "2.11.0+cu130", "cuda": "13.0", "nccl": "2.27.7", "gpus": ["NVIDIA H200"], "modules": {}}


def test_report_has_exactly_the_agreed_shape() -> None:
    results = [LegResult("install", "pass", 12.34, "ok"), LegResult("a", "refused", 3, "NCCL refused: ..."),
               LegResult("b", "not-run", 0, "does not fit", extra={"losses": [1.0]})]
    report = plan.make_report(results, FACTS)
    assert set(report) == {"legs", "torch", "cuda", "nccl", "gpus"}
    assert report["legs"][0] == {"name": "install", "status": "pass", "seconds": 12.3, "detail": "ok"}
    assert all(set(leg) == {"name", "status", "seconds", "detail"} for leg in report["legs"])
    assert json.loads(json.dumps(report)) == report
    plan.validate_report(report)
    cpu = plan.make_report(results, {"torch": "2.14.1", "cuda": None, "nccl": None, "gpus": []})
    assert cpu["gpus"] == [] and cpu["nccl"] is None


@pytest.mark.parametrize("mutate", [
    lambda r: r.update(extra=1),
    lambda r: r.pop("nccl"),
    lambda r: r["legs"][0].update(status="passed"),
    lambda r: r["legs"][0].pop("detail"),
    lambda r: r["legs"][0].update(seconds=-1),
    lambda r: r["legs"].append(dict(r["legs"][0])),
    lambda r: r.update(gpus="H200"),
    lambda r: r.update(torch=2.11),
])
def test_report_validation_rejects_another_shape(mutate) -> None:
    report = plan.make_report([LegResult("install", "pass", 1, "")], FACTS)
    mutate(report)
    with pytest.raises(ValueError):
        plan.validate_report(report)
    with pytest.raises(ValueError):
        LegResult("x", "skipped").to_dict()


def test_exit_code() -> None:
    ok = LegResult("a", "pass")
    te = LegResult("te", "not-run", detail="transformer_engine does not import here")
    assert plan.exit_code([ok, te], {"te"}) == 0
    assert plan.exit_code([ok, te], set()) == 3
    assert plan.exit_code([ok, LegResult("b", "refused")], set()) == 3
    assert plan.exit_code([ok, LegResult("b", "refused"), LegResult("c", "fail")], set()) == 1


# ------------------------------------------------------------------------------------ judging a leg's output

def _iteration(i: int, loss: float, ms: float = 100.0) -> str:
    return (f" [2026-01-01 00:00:00] iteration {i:8d}/       3 | consumed samples: {8 * i} | elapsed time per "
            f"iteration (ms): {ms:.1f} | learning rate: 1.0E-04 | lm loss: {loss:.6E} | loss scale: 1.0 |")


def _driver(tmp_path, device="cuda") -> run.Driver:
    d = run.Driver(device, tmp_path / "out", 480, sys.executable, root=tmp_path)
    return d


def test_losses_compared_at_the_bf16_tolerance(tmp_path) -> None:
    ref_out = "\n".join(_iteration(i, 10.0 - i) for i in (1, 2, 3))
    assert run.leg_losses(ref_out) == ([9.0, 8.0, 7.0], [0.1, 0.1, 0.1])
    ok, text = run.compare_losses([9.0 * (1 + 1e-3), 8.0, 7.0 * (1 + 1e-2)], [9.0, 8.0, 7.0])
    assert ok and "1.0e-03 at iteration 1" in text
    assert not run.compare_losses([9.0 * (1 + 1e-2), 8.0, 7.0], [9.0, 8.0, 7.0])[0]  # iteration 1: 5e-3
    assert not run.compare_losses([9.0, 8.0, 7.0 * 1.03], [9.0, 8.0, 7.0])[0]
    assert not run.compare_losses([9.0, 8.0], [9.0, 8.0, 7.0])[0]
    assert not run.compare_losses([9.0, float("nan"), 7.0], [9.0, 8.0, 7.0])[0]
    assert not run.compare_losses([], [9.0])[0]

    d = _driver(tmp_path)
    legs = {leg.name: leg for leg in d.legs}
    ref = d.judge(legs["bfpp-P1-reference"], 0, ref_out, 5.0, 60)
    assert ref.status == "pass" and ref.extra["losses"] == [9.0, 8.0, 7.0]
    d.results[ref.name] = ref
    leg = legs["bfpp-P2-breadth-first-zb-zero2"]
    good = d.judge(leg, 0, "\n".join(_iteration(i, 10.0 - i) for i in (1, 2, 3)), 9.0, 60)
    assert good.status == "pass" and "consecutive W's" in good.detail and "2 ranks" in good.detail
    bad = d.judge(leg, 0, "\n".join(_iteration(i, 11.0 - i) for i in (1, 2, 3)), 9.0, 60)
    assert bad.status == "fail" and "relative difference" in bad.detail
    assert d.judge(leg, 0, "no iterations\n", 9.0, 60).status == "fail"
    killed = d.judge(leg, None, "starting\n", 60.0, 60)
    assert killed.status == "fail" and "killed at its 60 s limit" in killed.detail
    d.results[ref.name] = LegResult(ref.name, "fail", 1, "exit 1")
    assert "did not pass" in d.judge(leg, 0, ref_out, 9.0, 60).detail


NCCL_REFUSAL = """\
[rank1]:[W1204 10:00:00.000 ProcessGroupNCCL.cpp:1234] Warning: something unrelated
h200:123:456 [0] NCCL INFO Bootstrap : Using lo:127.0.0.1<0>
h200:123:456 [0] init.cc:1100 NCCL WARN Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1000
[rank1]: torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:2000, invalid usage (run with NCCL_DEBUG=WARN for details), NCCL version 2.27.7
[rank1]: ncclInvalidUsage: This usually reflects invalid usage of NCCL library.
[rank1]: Last error:
[rank1]: Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1000
"""


def test_nccl_refusal_carries_nccls_words(tmp_path) -> None:
    words = run.nccl_words(NCCL_REFUSAL)
    assert any("Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1000" in w for w in words)
    assert any(w.startswith("Last error: ") for w in words) and not any("NCCL INFO" in w for w in words)
    d = _driver(tmp_path)
    leg = next(leg for leg in d.legs if leg.ranks == 4)
    refused = d.judge(leg, 1, NCCL_REFUSAL, 8.0, 60)
    assert refused.status == "refused" and refused.detail.startswith("NCCL refused: ")
    assert "Duplicate GPU detected" in refused.detail
    # NCCL's words after iterations ran: a failure of the run, not a refusal of the set-up.
    assert d.judge(leg, 1, _iteration(1, 9.0) + "\n" + NCCL_REFUSAL, 8.0, 60).status == "fail"
    # On CPU there is no NCCL to refuse.
    assert _driver(tmp_path, "cpu").judge(leg, 1, NCCL_REFUSAL, 8.0, 60).status == "fail"


def test_a_leg_whose_requirement_does_not_import_is_not_run(tmp_path) -> None:
    d = _driver(tmp_path)
    d.optional_absent.add("transformer_engine")
    d.facts = {"transformer_engine": {"error": "ModuleNotFoundError: No module named 'transformer_engine'"}}
    te = next(leg for leg in d.legs if leg.requires)
    r = d.run_leg(te)
    assert r.status == "not-run" and "transformer_engine does not import here" in r.detail
    mem = next(leg for leg in d.legs if leg.kind == "memory")
    assert d.run_leg(mem).status == "not-run"  # its input reports are missing
    d.budget = Budget(1, reserve_s=0)
    big = next(leg for leg in d.legs if leg.kind == "bfpp")
    r = d.run_leg(big)
    assert r.status == "not-run" and "does not fit" in r.detail


def test_a_chosen_leg_brings_its_reference_and_inputs(tmp_path) -> None:
    d = run.Driver("cpu", tmp_path / "out", 480, sys.executable, root=tmp_path, only={"memory-vs-simulator",
                                                                                     "megatron-P1-1f1b-zero3"})
    assert [leg.name for leg in d.legs] == ["install", "bfpp-P1-reference", "bfpp-P4-breadth-first-zero3",
                                            "bfpp-P2-breadth-first-zero3", "memory-vs-simulator",
                                            "megatron-P1-default", "megatron-P1-1f1b-zero3"]


def test_commands_share_the_device_through_the_rank_wrapper(tmp_path) -> None:
    d = _driver(tmp_path)
    d.tree = tmp_path / "megatron-lm"
    for leg in d.legs:
        if leg.kind == "install":
            continue
        cmd, env = d.command(leg)
        if leg.kind == "memory":
            assert cmd[1:4] == ["-m", "megatron_bfpp.devkit.workers", "memory"]
            continue
        assert cmd[1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(leg.ranks)]
        assert ("shared_gpu_rank.sh" in " ".join(cmd)) == (leg.ranks > 1)
        assert env["PYTHONPATH"].split(os.pathsep)[0] == str(d.site) and env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
        if leg.kind == "megatron":
            i = cmd.index("megatron")
            assert cmd[i - 1] == "megatron_bfpp.devkit.workers" and cmd[i + 1].endswith("pretrain_gpt.py")
            assert _flag(cmd, "--transformer-impl") == leg.impl and "--distributed-backend" not in cmd
    cpu = _driver(tmp_path, "cpu")
    cpu.tree = tmp_path / "megatron-lm"
    leg = next(leg for leg in cpu.legs if leg.kind == "megatron")
    cmd, env = cpu.command(leg)
    assert _flag(cmd, "--distributed-backend") == "gloo" and env["BFPP_CPU_SHIM"] == "1"
    assert "cpu_shim" in env["PYTHONPATH"] and env["CUDA_VISIBLE_DEVICES"] == ""


# ---------------------------------------------------------------------------------------- sync and memory

def test_sync_capture_counts_and_locates_warnings_on_cpu_with_a_stub() -> None:
    roots = (str(ROOT / "tests"),)
    with workers.SyncCounter(applicable=False, roots=roots) as c:
        for _ in range(2):
            warnings.warn("called a synchronizing CUDA operation")  # what torch says in "warn" mode
        warnings.warn("something else")  # not counted
    assert c.count == 2
    (where, n), = c.summary()["where"].items()
    assert n == 2 and where.startswith("tests/unit/test_device_kit.py:")
    with workers.SyncCounter(applicable=False, roots=roots) as c:
        pass
    assert c.summary() == {"count": 0, "where": {}}
    result = {"applicable": False, "note": "not applicable on CPU", "ranks": [
        {"rank": 1, "steps": [{"count": 0, "where": {}}] * 2}, {"rank": 0, "steps": [{"count": 0, "where": {}}] * 2}]}
    text = workers.sync_detail(result)
    assert text.startswith("not applicable on CPU") and "counted 0 per step" in text and "rank 0: 0, 0" in text
    gpu = {"applicable": True, "note": None, "ranks": [
        {"rank": 0, "steps": [{"count": 5, "where": {"a.py:1 (f)": 5}}, {"count": 2, "where": {"a.py:1 (f)": 2}}]}]}
    assert workers.sync_detail(gpu).startswith("2 host syncs per step") and "a.py:1 (f) x2" in workers.sync_detail(gpu)


def _trainer_report(peaks: list[float]) -> dict:
    config = {"pipeline_schedule": "breadth-first", "pp": 2, "vp": 2, "dp": 1, "tp": 1, "zero_stage": 3,
              "microbatches": 8, "group_size": None, "num_layers": 8, "hidden_size": 1024,
              "num_attention_heads": 16, "seq_length": 1024, "micro_batch_size": 1, "global_batch_size": 8,
              "vocab_size": 50304, "recompute": None}
    return {"config": config, "memory": [{"rank": r, "peak_bytes": p} for r, p in enumerate(peaks)]}


def test_memory_against_the_simulator_per_pipeline_rank(tmp_path) -> None:
    predicted = workers.predicted_per_rank(_trainer_report([0, 0])["config"])
    assert len(predicted) == 2 and all(p > 0 for p in predicted)
    rows = workers.memory_rows(_trainer_report([predicted[0] * 1.2, predicted[1] * 0.9]))
    assert [round(r["ratio"], 6) for r in rows] == [1.2, 0.9] and [r["pp_rank"] for r in rows] == [0, 1]
    report = tmp_path / "bfpp-P2-breadth-first-zero3.json"
    report.write_text(json.dumps(_trainer_report([predicted[0] * 1.2, predicted[1] * 0.9])))
    out = tmp_path / "memory.json"
    assert workers.main(["memory", "--out", str(out), str(report)]) == 0
    ok, text = workers.memory_verdict(json.loads(out.read_text()), "torch.cuda.max_memory_allocated")
    assert ok and "bfpp-P2-breadth-first-zero3: r0" in text and "0.5-2x" in text
    report.write_text(json.dumps(_trainer_report([predicted[0] * 3, predicted[1]])))
    workers.main(["memory", "--out", str(out), str(report)])
    assert not workers.memory_verdict(json.loads(out.read_text()), "x")[0]


# ------------------------------------------------------------------------------------------------- the kit

def _fake_megatron_lm(path: Path, minor: int = 19) -> Path:
    (path / "megatron" / "core" / "datasets").mkdir(parents=True)
    (path / "megatron" / "core" / "package_info.py").write_text(f"MAJOR = 0\nMINOR = {minor}\nPATCH = 1\n")
    (path / "megatron" / "core" / "__pycache__").mkdir()
    (path / "megatron" / "core" / "__pycache__" / "x.pyc").write_bytes(b"x")
    for name in ("pretrain_gpt.py", "gpt_builders.py", "model_provider.py"):
        (path / name).write_text("# stand-in\n")
    return path


def _fake_core_wheel(path: Path) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("megatron/core/datasets/helpers_cpp.cpython-312-x86_64-linux-gnu.so", b"\x7fELF")
        z.writestr("megatron/core/__init__.py", "")
    return path


def test_megatron_lm_tarball_holds_what_pretrain_gpt_needs_and_the_prebuilt_helpers(tmp_path) -> None:
    src = _fake_megatron_lm(tmp_path / "mlm")
    info = prepare.pack_megatron_lm(src, _fake_core_wheel(tmp_path / "core.whl"), tmp_path)
    assert info["dir"] == "megatron-lm-0.19.1" and info["version"].startswith("0.19.1 (core_v0.19.0")
    with tarfile.open(tmp_path / info["file"]) as t:
        names = set(t.getnames())
    top = info["dir"]
    assert {f"{top}/pretrain_gpt.py", f"{top}/gpt_builders.py", f"{top}/model_provider.py",
            f"{top}/megatron/core/package_info.py",
            f"{top}/megatron/core/datasets/helpers_cpp.cpython-312-x86_64-linux-gnu.so"} <= names
    assert not any("__pycache__" in n for n in names)
    with pytest.raises(SystemExit, match="supported"):
        prepare.pack_megatron_lm(_fake_megatron_lm(tmp_path / "old", minor=12), tmp_path / "core.whl", tmp_path)


def test_prepare_fails_clearly_over_the_size_cap(tmp_path, monkeypatch, capsys) -> None:
    def download(python, dest):
        (dest / "numpy-2.0-cp312-x.whl").write_bytes(os.urandom(2 * 2**20))
        _fake_core_wheel(dest / "megatron_core-0.19.2-cp312-x.whl")
        return [{"project": "numpy", "module": "numpy", "file": "numpy-2.0-cp312-x.whl", "version": "2.0",
                 "accept": None},
                {"project": "megatron-core", "module": "megatron.core", "file": "megatron_core-0.19.2-cp312-x.whl",
                 "version": "0.19.2", "accept": "0.19."}]

    def project(python, dest):
        (dest / "megatron_bfpp-0.1.0-py3-none-any.whl").write_bytes(b"w")
        return {"project": "megatron_bfpp", "module": "megatron_bfpp", "file": "megatron_bfpp-0.1.0-py3-none-any.whl",
                "version": "0.1.0", "accept": None}

    monkeypatch.setattr(prepare, "download", download)
    monkeypatch.setattr(prepare, "build_project_wheel", project)
    src = _fake_megatron_lm(tmp_path / "mlm")
    manifest = prepare.prepare(sys.executable, src, 40, kit=tmp_path / "kit")
    assert 'carry: ["devkit/kit"]' in capsys.readouterr().out
    assert manifest["sources_sha256"] == run.sources_digest(ROOT) and manifest["total_bytes"] < 3 * 2**20
    saved = json.loads((tmp_path / "kit" / "manifest.json").read_text())
    assert [w["project"] for w in saved["wheels"]] == ["numpy", "megatron-core", "megatron_bfpp"]
    with pytest.raises(SystemExit, match=r"over the 1 MiB cap"):
        prepare.prepare(sys.executable, src, 1, kit=tmp_path / "kit")


# ---------------------------------------------------------------------------------------------- the script

def test_dry_run_lists_every_leg_with_its_estimate_and_the_total_against_the_budget(tmp_path, subprocesses) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHON"] = sys.executable
    r = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--out", str(tmp_path / "out")], capture_output=True,
                       text=True, cwd=ROOT, env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not (tmp_path / "out").exists()
    for leg in plan.plan_legs("cuda"):
        assert f" {leg.name} " in r.stdout
    assert "against a budget of 480 s: fits" in r.stdout
    r = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--device", "cpu", "--budget", "100"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert r.returncode == 3 and "DOES NOT FIT" in r.stdout
    r = subprocess.run(["bash", str(SCRIPT), "--legs", "nope"], capture_output=True, text=True, cwd=ROOT, env=env,
                       timeout=120)
    assert r.returncode == 2 and "unknown legs" in r.stderr
