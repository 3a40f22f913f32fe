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
from megatron_bfpp.devkit.processes import Outcome

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
    # The NCCL legs with several ranks sharing the device come right after the reference, P = 4 first, then
    # P = 2 x D = 2 (ZeRO's collectives on two data-parallel ranks).
    multi = [leg for leg in legs[2:9]]
    assert [leg.ranks for leg in multi] == [4, 4, 4, 4, 2, 2, 2] and all(leg.kind == "bfpp" for leg in multi)
    assert [leg.data_parallel for leg in multi] == [1, 2, 1, 1, 1, 1, 1]
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
            assert pp * leg.data_parallel == leg.ranks
            lpv = _flag(leg.flags, "--num-layers-per-virtual-pipeline-stage")
            vp = shape.layers // pp // int(lpv) if lpv else 1
            assert shape.layers % (pp * vp) == 0 and (vp == 2) == (pp > 1)
            assert shape.global_batch // leg.data_parallel >= 2 * pp  # M >= 2P per data-parallel rank


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


def _judge(d: run.Driver, leg: Leg, rc, output: str, seconds: float = 8.0, limit: float = 60,
           ended: str | None = None) -> LegResult:
    """The verdict on `output` from processes that exited with `rc` (None: ended by the kit at the limit)."""
    return d.judge(leg, Outcome(rc, output, seconds, limit, ended or ("limit" if rc is None else "exit")))


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
    ref = _judge(d, legs["bfpp-P1-reference"], 0, ref_out, 5.0, 60)
    assert ref.status == "pass" and ref.extra["losses"] == [9.0, 8.0, 7.0]
    d.results[ref.name] = ref
    leg = legs["bfpp-P2-breadth-first-zb-zero2"]
    good = _judge(d, leg, 0, "\n".join(_iteration(i, 10.0 - i) for i in (1, 2, 3)), 9.0, 60)
    assert good.status == "pass" and "consecutive W's" in good.detail and "2 ranks" in good.detail
    bad = _judge(d, leg, 0, "\n".join(_iteration(i, 11.0 - i) for i in (1, 2, 3)), 9.0, 60)
    assert bad.status == "fail" and "relative difference" in bad.detail
    assert _judge(d, leg, 0, "no iterations\n", 9.0, 60).status == "fail"
    up = "".join(f"[devkit] process group up: rank {r} of 2 (gloo) in 1.0 s\n" for r in (0, 1))
    killed = _judge(d, leg, None, up + "starting\n", 60.0, 60)
    assert killed.status == "fail" and "killed at its 60 s limit" in killed.detail
    assert "all 2 ranks had their process group up" in killed.detail and "last output: starting" in killed.detail
    d.results[ref.name] = LegResult(ref.name, "fail", 1, "exit 1")
    assert "did not run all its iterations" in _judge(d, leg, 0, ref_out, 9.0, 60).detail


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
    assert words == ["Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1000"]  # said once
    # torch's repeat of NCCL's last error stands in for NCCL's own line when that is missing.
    assert run.nccl_words(NCCL_REFUSAL.replace("NCCL WARN", "NCCL INFO")) == [
        "Last error: Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1000"]
    d = _driver(tmp_path)
    leg = next(leg for leg in d.legs if leg.ranks == 4)
    refused = _judge(d, leg, 1, NCCL_REFUSAL, 8.0, 60)
    assert refused.status == "refused" and refused.detail.startswith("NCCL refused the set-up at initialisation: ")
    assert "Duplicate GPU detected" in refused.detail
    # NCCL's words after iterations ran: a failure of the run, not a refusal of the set-up.
    assert _judge(d, leg, 1, _iteration(1, 9.0) + "\n" + NCCL_REFUSAL, 8.0, 60).status == "fail"
    # On CPU there is no NCCL to refuse.
    assert _judge(_driver(tmp_path, "cpu"), leg, 1, NCCL_REFUSAL).status == "fail"


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
        assert cmd[1:8] == ["-m", "torch.distributed.run", "--standalone", "--local-addr", "127.0.0.1",
                            "--nproc-per-node", str(leg.ranks)]
        assert ("shared_gpu_rank.sh" in " ".join(cmd)) == (leg.ranks > 1)
        i = cmd.index("megatron_bfpp.devkit.workers")
        assert cmd[i + 1] == {"bfpp": "train", "megatron": "megatron", "sync": "sync"}[leg.kind]
        assert env["PYTHONPATH"].split(os.pathsep)[0] == str(d.site) and env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
        if leg.kind == "megatron":
            assert cmd[i + 2].endswith("pretrain_gpt.py")
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


# ------------------------------------------------------------------ what a failed leg's output says (CPU fakes)

# torchrun's own lines after a worker failed (torch.distributed.elastic): the banner every failed leg ends with.
TORCHRUN_BANNER = """\
W0101 10:00:05.000000 1000 torch/distributed/elastic/multiprocessing/api.py:908] Sending process 1002 closing signal SIGTERM
E0101 10:00:05.100000 1000 torch/distributed/elastic/multiprocessing/api.py:882] failed (exitcode: 1) local_rank: 0 (pid: 1001) of binary: /usr/bin/python3
Traceback (most recent call last):
  File "/usr/lib/python3.12/site-packages/torch/distributed/run.py", line 940, in <module>
    main()
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: 
============================================================
/opt/megatron_bfpp/scripts/shared_gpu_rank.sh FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-01-01_10:00:05
  host      : h100
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 1001)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""

# NCCL 2.28's WARN line (src/debug.cc): a leading newline, the timestamp NCCL_DEBUG_TIMESTAMP_LEVELS puts on WARNs by
# default, host:pid:tid, [cuda device], __FILE__:__LINE__; then torch's DistBackendError carrying NCCL's last error.
TRUNCATED = """\
[2026-01-01 10:00:04] h100:1001:1077 [0] transport/net_socket.cc:565 NCCL WARN NET/Socket : peer 127.0.0.1<41234> message truncated : receiving 1048576 bytes instead of 524288. If you believe your socket network is in a healthy state, there may be a mismatch in collective sizes or environment settings (e.g. NCCL_PROTO, NCCL_ALGO) between ranks
h100:1001:1077 [0] NCCL INFO transport/net.cc:1400 -> 3
[rank0]: Traceback (most recent call last):
[rank0]:   File "/opt/megatron_bfpp/megatron_bfpp/runtime/p2p.py", line 190, in post
[rank0]:     work.wait()
[rank0]: torch.distributed.DistBackendError: NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:2150, remote process exited or there was a network error, NCCL version 2.28.9
[rank0]: ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely.
[rank0]: Last error:
[rank0]: NET/Socket : peer 127.0.0.1<41234> message truncated : receiving 1048576 bytes instead of 524288.
"""

# One rank's own error; the other rank, whose peer died, raises DistBackendError in the same iteration.
CRASH_ON_ONE_RANK = """\
[rank1]: Traceback (most recent call last):
[rank1]:   File "/opt/megatron_bfpp/megatron_bfpp/runtime/engine.py", line 300, in run_action
[rank1]:     assert buffer.shape == expected, (buffer.shape, expected)
[rank1]: AssertionError: (torch.Size([1, 32, 64]), torch.Size([1, 16, 64]))
[2026-01-01 10:00:04] h100:1002:1080 [0] misc/socket.cc:71 NCCL WARN socketProgress: Connection closed by remote peer h100<41234>
[rank0]: Traceback (most recent call last):
[rank0]:   File "/opt/megatron_bfpp/megatron_bfpp/runtime/p2p.py", line 190, in post
[rank0]: torch.distributed.DistBackendError: NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:2150, remote process exited or there was a network error, NCCL version 2.28.9
[rank0]: ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely.
[rank0]: Last error:
[rank0]: socketProgress: Connection closed by remote peer h100<41234>
"""


def test_nccl_warn_lines_are_read_as_nccl_prints_them() -> None:
    words = run.nccl_words(TRUNCATED)
    assert any(w.startswith("NET/Socket : peer 127.0.0.1<41234> message truncated : receiving 1048576 bytes")
               for w in words), words
    assert not any("NCCL INFO" in w for w in words)


@pytest.mark.parametrize("output", [TRUNCATED, CRASH_ON_ONE_RANK], ids=["message-truncated", "crash-on-one-rank"])
def test_our_bugs_are_failures_not_nccl_refusals(tmp_path, output) -> None:
    """A p2p pair of the wrong size and a crash on one rank: NCCL's words with no iteration line, but our fault."""
    d = _driver(tmp_path)
    leg = next(leg for leg in d.legs if leg.ranks == 2 and leg.kind == "bfpp")
    r = _judge(d, leg, 1, output + TORCHRUN_BANNER)
    assert r.status == "fail", r
    assert "error_file" not in r.detail and "traceback :" not in r.detail and "=====" not in r.detail
    if output is TRUNCATED:
        assert "message truncated : receiving 1048576 bytes instead of 524288" in r.detail
        assert "DistBackendError: NCCL error in" in r.detail
    else:  # the rank that failed first, not the peer that saw it go
        assert "AssertionError: (torch.Size([1, 32, 64]), torch.Size([1, 16, 64]))" in r.detail


def test_a_duplicate_gpu_at_initialisation_is_refused_as_nccl_prints_it(tmp_path) -> None:
    output = ("[2026-01-01 10:00:02] h100:1001:1001 [0] init.cc:904 NCCL WARN Duplicate GPU detected : rank 1 and "
              "rank 0 both on CUDA device 1a000\n" + NCCL_REFUSAL.split("\n", 3)[3] + TORCHRUN_BANNER)
    d = _driver(tmp_path)
    leg = next(leg for leg in d.legs if leg.ranks == 4)
    r = _judge(d, leg, 1, output)
    assert r.status == "refused" and "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1a000" in r.detail


def test_nccl_errors_after_the_iteration_lines_fail_the_leg_against_a_passing_reference(tmp_path) -> None:
    """The iterations agree with a reference that passed; the leg still exited non-zero with NCCL's errors."""
    d = _driver(tmp_path)
    legs = {leg.name: leg for leg in d.legs}
    ref_out = "\n".join(_iteration(i, 10.0 - i) for i in (1, 2, 3))
    ref = _judge(d, legs["bfpp-P1-reference"], 0, ref_out)
    assert ref.status == "pass"
    d.results[ref.name] = ref
    leg = legs["bfpp-P2-breadth-first-zb-zero2"]
    assert _judge(d, leg, 0, ref_out).status == "pass"  # the same output with exit 0 passes
    r = _judge(d, leg, 1, ref_out + "\n" + TRUNCATED + TORCHRUN_BANNER)
    assert r.status == "fail" and r.detail.startswith("exit 1"), r
    assert "DistBackendError: NCCL error in" in r.detail and "message truncated" in r.detail


def test_megatron_legs_run_with_dynamo_off_on_cuda_as_on_cpu(tmp_path) -> None:
    """pretrain() warms up torch.compile'd fusions whatever the --no-*-fusion flags say: no Inductor compile in
    the ranks at once against the legs' estimates."""
    for device in plan.DEVICES:
        d = _driver(tmp_path, device)
        d.tree = tmp_path / "megatron-lm"
        for leg in d.legs:
            if leg.kind in ("megatron", "bfpp", "sync"):
                assert d.command(leg)[1].get("TORCHDYNAMO_DISABLE") == "1", (device, leg.name)


def test_torchrun_binds_the_loopback_address(tmp_path) -> None:
    """--standalone alone resolves socket.getfqdn() for the rendezvous (a VM without DNS can stall)."""
    cmd = _driver(tmp_path).launch(2, ["-m", "x"])
    assert _flag(cmd, "--local-addr") == "127.0.0.1"


def test_a_leg_runs_zero_collectives_on_two_data_parallel_ranks(tmp_path) -> None:
    for device in plan.DEVICES:
        legs = [leg for leg in plan.plan_legs(device) if leg.kind == "bfpp" and leg.ranks == 4
                and _flag(leg.flags, "--pipeline-model-parallel-size") == "2"]
        assert len(legs) == 1 and _flag(legs[0].flags, "--zero-stage") == "3"


def test_default_output_folder_is_out_when_set(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("OUT", str(tmp_path / "device-out"))
    assert run.default_out() == tmp_path / "device-out"
    monkeypatch.delenv("OUT")
    assert run.default_out() == ROOT / "runs" / "device_check"


def _up(ranks: int, of: int) -> str:
    return "".join(f"[devkit] process group up: rank {r} of {of} (nccl) in 2.0 s\n" for r in range(ranks))


def test_a_multi_rank_leg_hung_at_start_up_is_refused_and_spares_the_budget_of_the_others(tmp_path,
                                                                                         monkeypatch) -> None:
    """The first multi-rank leg hangs before every rank has its process group: the set-up hung. The remaining
    multi-rank legs are not run (they would hang the same way, each for its whole limit); one-rank legs run."""
    d = _driver(tmp_path)
    d.tree = tmp_path / "megatron-lm"
    ran = []

    def execute(leg, cmd, limit, env):
        ran.append(leg.name)
        if leg.ranks > 1:
            return Outcome(None, _up(1, leg.ranks) + "NCCL INFO Bootstrap\n", limit, limit, "limit")
        return Outcome(0, _up(1, 1) + "\n".join(_iteration(i, 10.0 - i) for i in (1, 2, 3)), 5.0, limit)

    monkeypatch.setattr(d, "execute", execute)
    for leg in d.legs[1:]:
        if not leg.requires:
            d.results[leg.name] = d.run_leg(leg)
    first = next(leg for leg in d.legs if leg.ranks > 1)
    r = d.results[first.name]
    assert r.status == "refused" and r.detail.startswith("hung at start-up: 1 of 4 ranks had their process group up")
    others = [leg for leg in d.legs if leg.ranks > 1 and leg is not first]
    assert others and all(d.results[leg.name].status == "not-run" and
                          d.results[leg.name].detail.startswith("same set-up hung") for leg in others)
    assert [name for name in ran if name != first.name] == [
        leg.name for leg in d.legs[1:] if leg.ranks == 1 and leg.kind != "memory" and not leg.requires]
    assert d.results["megatron-P1-1f1b-zero3"].status == "pass"


def test_a_leg_whose_iterations_all_ran_but_that_hung_at_exit_says_so(tmp_path) -> None:
    d = _driver(tmp_path)
    legs = {leg.name: leg for leg in d.legs}
    ref_out = "\n".join(_iteration(i, 10.0 - i) for i in (1, 2, 3))
    d.results["bfpp-P1-reference"] = _judge(d, legs["bfpp-P1-reference"], None, ref_out, ended="exit-hang")
    r = d.results["bfpp-P1-reference"]
    assert r.status == "fail" and r.detail.startswith("all 3 iterations ran, then the processes hung at exit")
    assert "killed at" not in r.detail
    # Its losses still serve as the reference: they are all there.
    leg = legs["bfpp-P2-breadth-first-zero3"]
    ok = _judge(d, leg, 0, _up(2, 2) + ref_out)
    assert ok.status == "pass" and "relative difference to the reference 0.0e+00" in ok.detail
    # Killed before the last iteration: a plain failure at the limit.
    partial = _judge(d, leg, None, _up(2, 2) + _iteration(1, 9.0))
    assert partial.status == "fail" and "killed at its 60 s limit" in partial.detail
    assert "iteration 1 of 3 printed" in partial.detail


def test_the_report_is_written_before_and_after_every_leg(tmp_path, monkeypatch) -> None:
    """A command killed at its limit (or for memory) still returns what ran: the report on disk always holds
    every finished leg, the running one, and the rest as not reached."""
    d = run.Driver("cpu", tmp_path / "out", 480, sys.executable, root=tmp_path,
                   only={"bfpp-P4-breadth-first-zero3"})
    seen = []

    def read() -> dict:
        return {leg["name"]: leg for leg in json.loads((d.out / plan.REPORT_NAME).read_text())["legs"]}

    def install(leg):
        seen.append(read())
        d.tree = tmp_path
        d.facts = {"torch": "2.14.1", "cuda": None}
        return LegResult(leg.name, "pass", 1.0, "stand-in")

    def run_leg(leg):
        seen.append(read())
        return LegResult(leg.name, "pass", 1.0, "ok")

    monkeypatch.setattr(d, "install", install)
    monkeypatch.setattr(d, "run_leg", run_leg)
    assert d.run() == 0
    assert [leg.name for leg in d.legs] == ["install", "bfpp-P1-reference", "bfpp-P4-breadth-first-zero3"]
    first, second, third = seen
    assert first["install"]["status"] == "not-run" and "running when this report was written" in \
        first["install"]["detail"] and first["bfpp-P1-reference"]["detail"] == plan.NOT_REACHED
    assert second["install"]["status"] == "pass" and "running" in second["bfpp-P1-reference"]["detail"]
    assert third["bfpp-P1-reference"]["status"] == "pass"
    final = json.loads((d.out / plan.REPORT_NAME).read_text())
    assert final["torch"] == "2.14.1" and all(leg["status"] == "pass" for leg in final["legs"])
    assert not list(d.out.glob(".*"))  # no temporary file left beside it


def _facts(**over) -> dict:
    facts = {"python": "3.12.3", "torch": "2.11.0+cu130", "cuda": "13.0", "nccl": "2.28.9", "gpus": ["NVIDIA H100"],
             "modules": {}, "errors": {}, "transformer_engine": {"error": "absent"},
             "compute_mode": {"mode": "DEFAULT", "source": "libcuda"},
             "cuda_check": {"available": True, "device_count": 1, "visible": None, "driver": "NVRM 580",
                            "context": "opened", "nccl_available": True}}
    for key, value in over.items():
        facts[key] = {**facts[key], **value} if isinstance(value, dict) and key in facts else value
    return facts


def test_device_cuda_without_a_usable_cuda_fails_at_once_and_records_the_facts(tmp_path, monkeypatch) -> None:
    d = _driver(tmp_path)
    facts = _facts(torch="2.14.1+cpu", cuda=None, nccl=None, gpus=[], compute_mode={"error": "libcuda: not found"},
                   cuda_check={"available": False, "device_count": 0, "context": None, "nccl_available": False,
                               "driver": None, "error": "AssertionError: Torch not compiled with CUDA enabled"})
    monkeypatch.setattr(d, "probe", lambda *a: facts)
    (d.out).mkdir(parents=True)
    r = d.install(d.legs[0])
    assert r.status == "fail" and r.detail.startswith("CUDA is not usable: torch.cuda.is_available() is False")
    assert "torch 2.14.1+cpu (built for CUDA none: a CPU build)" in r.detail and "Torch not compiled" in r.detail
    assert "--device cpu" in r.detail and d.tree is None
    report = plan.make_report(plan.progress_results(d.legs, {r.name: r}), d.facts)
    assert report["torch"] == "2.14.1+cpu"
    # A context that does not open, a PROHIBITED GPU, a torch without NCCL: the same, each with its reason.
    for over, words in ((dict(cuda_check={"context": None, "error": "RuntimeError: CUDA error: all CUDA-capable "
                                          "devices are busy or unavailable"}), "a CUDA context does not open"),
                        (dict(compute_mode={"mode": "PROHIBITED"}), "compute mode is PROHIBITED"),
                        (dict(cuda_check={"nccl_available": False}), "torch has no NCCL")):
        monkeypatch.setattr(d, "probe", lambda *a, f=_facts(**over): f)
        assert words in d.install(d.legs[0]).detail


def test_an_exclusive_gpu_runs_only_the_one_rank_legs(tmp_path, monkeypatch) -> None:
    d = _driver(tmp_path)
    monkeypatch.setattr(d, "probe", lambda *a: _facts(compute_mode={"mode": "EXCLUSIVE_PROCESS"}))
    d.out.mkdir(parents=True)
    assert "no kit at devkit/kit" in d.install(d.legs[0]).detail  # probed before the kit is looked at
    d.tree = tmp_path
    r = d.run_leg(next(leg for leg in d.legs if leg.ranks > 1))
    assert r.status == "not-run" and "compute mode is EXCLUSIVE_PROCESS" in r.detail


def test_another_python_than_the_kits_fails_before_installing(tmp_path, monkeypatch) -> None:
    d = _driver(tmp_path, "cpu")
    (tmp_path / "devkit" / "kit").mkdir(parents=True)
    (tmp_path / "devkit" / "kit" / "manifest.json").write_text(json.dumps({"python": "3.12", "wheels": [
        {"project": "megatron-core", "module": "megatron.core", "version": "0.19.2", "accept": "0.19.",
         "file": "megatron_core-0.19.2-cp312-cp312-manylinux_2_28_x86_64.whl"},
        {"project": "packaging", "module": "packaging", "version": "25.0", "accept": None,
         "file": "packaging-25.0-py3-none-any.whl"}]}))
    monkeypatch.setattr(d, "probe", lambda *a: _facts(python="3.11.9"))
    d.out.mkdir(parents=True)
    r = d.install(d.legs[0])
    assert r.status == "fail" and r.detail.startswith("python 3.11.9")
    assert "megatron-core 0.19.2" in r.detail and "packaging" not in r.detail and "Python 3.12" in r.detail
    assert run.wheel_fits("numpy-2.3.0-cp312-cp312-manylinux_2_28_x86_64.whl", (3, 12))
    assert run.wheel_fits("packaging-25.0-py3-none-any.whl", (3, 11))
    assert not run.wheel_fits("numpy-2.3.0-cp312-cp312-manylinux_2_28_x86_64.whl", (3, 13))


def _collectives(work: Path, leg: str, calls: dict) -> None:
    folder = work / f"{leg}.collectives"
    folder.mkdir(parents=True)
    for rank in range(4):
        (folder / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "calls": calls}))


def test_the_data_parallel_leg_passes_only_when_zeros_collectives_ran_on_two_ranks(tmp_path) -> None:
    d = _driver(tmp_path)
    legs = {leg.name: leg for leg in d.legs}
    ref_out = "\n".join(_iteration(i, 10.0 - i) for i in (1, 2, 3))
    d.results["bfpp-P1-reference"] = _judge(d, legs["bfpp-P1-reference"], 0, ref_out)
    leg = legs["bfpp-P2xD2-breadth-first-zero3"]
    _collectives(d.work, leg.name, {"all_gather_into_tensor": {"2": 12}, "reduce_scatter_tensor": {"2": 6},
                                    "batch_isend_irecv": {"2": 20}, "all_reduce": {"4": 3, "1": 2}})
    r = _judge(d, leg, 0, _up(4, 4) + ref_out)
    assert r.status == "pass", r
    assert ("torch.distributed calls over 4 ranks: all-gather 48x on 2 ranks; all-reduce 8x on 1 rank, 12x on 4 "
            "ranks; p2p 80x on 2 ranks; reduce-scatter 24x on 2 ranks") in r.detail
    import shutil

    shutil.rmtree(d.work / f"{leg.name}.collectives")
    _collectives(d.work, leg.name, {"all_gather_into_tensor": {"1": 12}, "reduce_scatter_tensor": {"1": 6}})
    r = _judge(d, leg, 0, _up(4, 4) + ref_out)
    assert r.status == "fail" and r.detail.startswith(
        "ZeRO's all-gather and reduce-scatter did not run on 2-rank data-parallel groups")


def test_the_quick_plan_is_the_most_revealing_legs_within_its_budget(capsys) -> None:
    for device in plan.DEVICES:
        quick = plan.quick_legs(device)
        assert [leg.name for leg in quick] == list(plan.QUICK_LEGS)
        assert plan.select_legs(plan.plan_legs(device), set(plan.QUICK_LEGS)) == quick  # references included
        assert {leg.data_parallel for leg in quick} == {1, 2} and max(leg.ranks for leg in quick) == 4
        assert any(leg.kind == "megatron" for leg in quick)
    assert plan.plan_total(plan.quick_legs("cuda"), "cuda") <= plan.QUICK_BUDGET_S
    assert run.main(["--quick", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "(quick plan)" in out and f"against a budget of {plan.QUICK_BUDGET_S} s: fits" in out
    # A budget under the full plan's estimate gets the quick plan.
    assert run.main(["--dry-run", "--budget", "300"]) == 0
    assert "the quick plan (--quick)" in capsys.readouterr().out
