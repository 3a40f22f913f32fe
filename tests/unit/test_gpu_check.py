"""The GPU check's Python side (megatron_bfpp/devkit/gpu_check; scripts/gpu_check.py probe|layer|summary), in
process: the environment probe, the layer benchmark against the simulator, reading the runs (the trainer's report,
Megatron-LM's log lines), the comparison with each reference at the bf16 tolerance, the planner's memory and the
summary. scripts/gpu_check.sh's legs and commands are tested in tests/distributed/test_gpu_check.py."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from megatron_bfpp.devkit import iterations
from megatron_bfpp.devkit.gpu_check import cli, layer, summary

ROOT = Path(__file__).resolve().parents[2]
STANDINS = ROOT / "tests" / "support" / "standins"


# ------------------------------------------------------------------------------------------------------ probe

def test_probe_reports_transformer_engine_only_when_its_pytorch_layers_import(monkeypatch, tmp_path) -> None:
    """te_version is TransformerEngine's version when `transformer_engine.pytorch` imports, empty when it does not
    (not installed, or built against another torch): the check's Megatron-LM legs then use the local layers."""
    for name, pytorch, want in (("good", "", "2.8.0"), ("broken", "raise ImportError('undefined symbol')", "")):
        package = tmp_path / name / "transformer_engine"
        package.mkdir(parents=True)
        (package / "__init__.py").write_text("__version__ = '2.8.0'\n")
        (package / "pytorch.py").write_text(pytorch + "\n")
        monkeypatch.syspath_prepend(str(tmp_path / name))
        for module in ("transformer_engine", "transformer_engine.pytorch"):
            monkeypatch.delitem(sys.modules, module, raising=False)
        assert cli.probe()["te_version"] == want
        monkeypatch.undo()
    for module in ("transformer_engine", "transformer_engine.pytorch"):
        sys.modules.pop(module, None)


def test_probe_reports_apex_as_megatron_imports_it(monkeypatch) -> None:
    for apex, want in ((True, "1"), (False, "0")):
        monkeypatch.syspath_prepend(str(STANDINS / ("apex_present" if apex else "apex_absent")))
        sys.modules.pop("fused_weight_gradient_mlp_cuda", None)
        assert cli.probe()["apex_fused_wgrad"] == want
        sys.modules.pop("fused_weight_gradient_mlp_cuda", None)
        monkeypatch.undo()



# ------------------------------------------------------------------------------------------------------ layer

def test_simulated_ops_add_up_to_the_simulators_layer() -> None:
    ops = layer.simulated_ops("gpt-52b", "h200", 1)
    for k in ("fwd", "bwd"):
        parts = sum(ops[op][k] for op in ("qkv", "proj", "fc1", "fc2", "attention", "elementwise"))
        assert parts == pytest.approx(ops["layer"][k], rel=1e-9)


def test_layer_benchmark_runs_on_cpu(tmp_path) -> None:
    """The measured side on a tiny shape (CPU, local spec): every op timed, ratios computed, JSON written."""
    out = tmp_path / "layer.json"
    assert cli.main(["layer", "--model", "32:4:16", "--device", "cpu", "--iters", "1", "--warmup", "0",
                     "--json", str(out)]) == 0
    rows = {r["op"]: r for r in json.loads(out.read_text())["ops"]}
    assert set(rows) == {"qkv", "proj", "fc1", "fc2", "attention", "elementwise", "layer"}
    for r in rows.values():
        assert r["fwd_measured_ms"] >= 0 and r["fwd_sim_ms"] > 0 and r["fwd_ratio"] is not None


def test_layer_rows_put_each_measurement_next_to_the_simulator() -> None:
    sim = {op: {"fwd": 2e-3, "bwd": 4e-3} for op in layer.OPS}
    sim["elementwise"] = {"fwd": 0.0, "bwd": 1e-3}
    meas = {"qkv": {"fwd": 3e-3, "bwd": 2e-3}, "elementwise": {"fwd": 1e-3, "bwd": 1e-3}}
    rows = {r["op"]: r for r in layer.layer_rows(sim, meas)}
    assert list(rows) == list(layer.OPS)
    assert rows["qkv"] == {"op": "qkv", "fwd_sim_ms": 2.0, "fwd_measured_ms": 3.0, "fwd_ratio": pytest.approx(1.5),
                           "bwd_sim_ms": 4.0, "bwd_measured_ms": 2.0, "bwd_ratio": pytest.approx(0.5)}
    assert rows["proj"] == {"op": "proj", "fwd_sim_ms": 2.0, "bwd_sim_ms": 4.0}  # not measured (--sim-only)
    assert rows["elementwise"]["fwd_ratio"] is None and rows["elementwise"]["bwd_ratio"] == pytest.approx(1.0)
    table = layer.layer_table(list(rows.values()), "gpt-52b", "h200").splitlines()
    assert table[0] == "per-layer times, gpt-52b shape, T=1 (measured / simulator 'h200' profile):"
    assert table[2].split() == ["qkv", "3.000", "2.000", "1.50", "2.000", "4.000", "0.50"]
    assert table[3].split() == ["proj", "-", "2.000", "-", "-", "4.000", "-"]


# ------------------------------------------------------------------------------------------- reading the runs

MODEL = ["--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "128",
         "--global-batch-size", "16"]


def test_run_config_reads_tool_shape_schedule_and_sharding_from_the_command() -> None:
    shared = ["torchrun", "--standalone", "--nproc-per-node", "4", "--no-python", "shared_gpu_rank.sh", "python"]
    trainer = summary.run_config([*shared, "-m", "megatron_bfpp.train", *MODEL, "--pipeline-model-parallel-size",
                                  "2", "--num-layers-per-virtual-pipeline-stage", "2"])
    assert trainer == {"tool": "bfpp train", "num_layers": 8, "hidden_size": 256, "num_attention_heads": 4,
                       "seq_length": 128, "vocab_size": 50304, "micro_batch_size": 1, "global_batch_size": 16,
                       "pp": 2, "vp": 2, "dp": 2, "schedule": "breadth-first", "zero_stage": 1}
    bfpp = summary.run_config(["/venv/bin/bfpp", "train", "--nproc-per-node", "2", *MODEL,
                               "--pipeline-schedule", "1f1b", "--zero-stage", "3", "--micro-batch-size", "2"])
    assert (bfpp["tool"], bfpp["schedule"], bfpp["zero_stage"], bfpp["dp"], bfpp["vp"], bfpp["micro_batch_size"]) == (
        "bfpp train", "1f1b", 3, 2, 1, 2)
    stock = summary.run_config(["torchrun", "--nproc-per-node", "1", "mlm/pretrain_gpt.py", *MODEL, "--vocab-size",
                                "1000", "--make-vocab-size-divisible-by", "64"])
    assert (stock["tool"], stock["schedule"], stock["zero_stage"], stock["vocab_size"]) == (
        "pretrain_gpt.py", "default", 0, 1024)  # stock Megatron: plain DDP, vocabulary padded as Megatron pads it
    distopt = summary.run_config(["pretrain_gpt.py", *MODEL, "--use-distributed-optimizer"])
    assert distopt["zero_stage"] == 1


def _iteration(i: int, n: int, ms: float, loss: float | None) -> str:
    """A Megatron-LM training_log line, as core_v0.19.0 prints it (no lm loss on a skipped iteration)."""
    return (f" [2026-12-03 09:00:00] iteration {i:8d}/{n:8d} | consumed samples: {8 * i} | elapsed time per "
            f"iteration (ms): {ms:.1f} | learning rate: 1.0E-04 | global batch size:     8 |"
            + (f" lm loss: {loss:.6E} |" if loss is not None else "") + " loss scale: 1.0 |")


def test_log_metrics_reads_losses_step_times_and_peak_memory() -> None:
    text = "\n".join([
        "Traceback-free preamble: building GPT model ...",
        _iteration(1, 3, 300.0, 10.5),
        "[Rank 0] (after 1 iterations) memory (MB) | allocated: 100.0 | max allocated: 4096.50 | reserved: 5000.0 | "
        "max reserved: 5000.0",
        _iteration(2, 3, 100.0, None),
        "[Rank 1] (after 2 iterations) memory (MB) | allocated: 100.0 | max allocated: 2048.00",
        " iteration 3/ 3 | consumed samples: 24 | lm loss: 9.9 |",  # no step time: not an iteration record
        _iteration(3, 3, 120.0, 10.25),
    ])
    losses, seconds, peak = summary.log_metrics(text)
    assert losses == [10.5, 10.25] and seconds == pytest.approx([0.3, 0.1, 0.12])
    assert peak == 4096.5 * 2**20
    assert summary.log_metrics(_iteration(1, 1, 1.0, 1.0))[2] is None  # no memory line


def test_read_run_prefers_the_trainers_report_over_the_log(tmp_path) -> None:
    (tmp_path / "r.cmd").write_text("\n".join(["bfpp", "train", *MODEL]) + "\n\n")
    (tmp_path / "r.log").write_text(_iteration(1, 1, 100.0, 3.0))
    (tmp_path / "r.json").write_text(json.dumps({"losses": [2.0, 1.5], "iteration_times_s": [0.2, 0.1], "memory": [
        {"rank": 0, "peak_bytes": 10}, {"rank": 1, "peak_bytes": 30}, {"rank": 2}]}))
    run = summary.read_run(tmp_path, "r")
    assert run["command"] == ["bfpp", "train", *MODEL] and run["config"]["tool"] == "bfpp train"
    assert (run["losses"], run["iteration_s"], run["peak_bytes"]) == ([2.0, 1.5], [0.2, 0.1], 30)
    (tmp_path / "r.json").unlink()
    assert summary.read_run(tmp_path, "r")["losses"] == [3.0]
    missing = summary.read_run(tmp_path, "none")
    assert missing == {"name": "none", "command": [], "losses": [], "iteration_s": [], "peak_bytes": None}


# ------------------------------------------------------------------------------------------------ comparing

@pytest.mark.parametrize("losses, ok", [
    ([10.0, 9.0, 8.0], True),
    ([10.0 * (1 + 5e-3), 9.0, 8.0], True),          # at the first-iteration tolerance
    ([10.0 * (1 + 6e-3), 9.0, 8.0], False),         # beyond it
    ([10.0, 9.0, 8.0 * (1 + 1.9e-2)], True),        # later iterations: the looser tolerance
    ([10.0, 9.0, 8.0 * (1 + 2.5e-2)], False),
    ([10.0, 9.0], False),                            # fewer iterations than the reference
    ([10.0, math.nan, 8.0], False),
    ([], False),
])
def test_compare_losses_at_the_bf16_tolerance(losses: list[float], ok: bool) -> None:
    c = summary.compare({"losses": losses, "iteration_s": []}, {"losses": [10.0, 9.0, 8.0], "iteration_s": []})
    assert c["losses_ok"] is ok and c["iterations"] == min(len(losses), 3)
    assert (c["first_rel_diff"] is None) == (not losses)


def test_compare_step_times_leave_the_warmup_out() -> None:
    run = {"losses": [1.0] * 5, "iteration_s": [5.0, 2.0, 0.2, 0.3, 0.2]}
    ref = {"losses": [1.0] * 5, "iteration_s": [9.0, 9.0, 0.1, 0.1, 0.1]}
    c = summary.compare(run, ref)
    assert (c["step_s"], c["ref_step_s"], c["step_time_ratio"]) == (0.2, 0.1, pytest.approx(2.0))
    short = summary.compare({"losses": [1.0], "iteration_s": [0.4, 0.2]}, {"losses": [1.0], "iteration_s": []})
    assert short["step_s"] == pytest.approx(0.3) and short["ref_step_s"] is None and short["step_time_ratio"] is None


def test_loss_agreement_shared_with_the_device_kit() -> None:
    assert iterations.relative_differences([1.0, 2.0, 5.0], [1.0, 0.0]) == [0.0, math.inf]
    assert not iterations.losses_agree([1.0, 2.0], [1.0, 0.0])  # a zero reference never agrees
    assert iterations.losses_agree([2.0 * (1 + iterations.FIRST_ITERATION_RTOL)], [2.0])


def test_predicted_memory_is_the_planners_for_the_runs_shape() -> None:
    """The planner's per-GPU total of the largest pipeline rank, at the run's micro-batches per data-parallel rank;
    Megatron's default schedule is its interleaved 1F1B with virtual stages, 1F1B without."""
    from megatron_bfpp.sim.costs import Config
    from megatron_bfpp.sim.model import ModelProfile
    from megatron_bfpp.sim.predict import memory

    # Breadth-first holds every micro-batch's activations: its prediction grows with M (8 here: 16 over D = 2).
    for lpvs, flags, schedule in (("2", [], "interleaved-1f1b"), (None, [], "1f1b"),
                                  ("2", ["--pipeline-schedule", "breadth-first"], "breadth-first")):
        cmd = ["torchrun", "--nproc-per-node", "4", "pretrain_gpt.py", *MODEL, "--pipeline-model-parallel-size", "2",
               *(["--num-layers-per-virtual-pipeline-stage", lpvs] if lpvs else []), "--zero-stage", "3", *flags]
        cfg = summary.run_config(cmd)
        model = ModelProfile("m", 8, 256, 4, 128, 50304)
        want = max(r["total"] for r in memory(model, Config(1, 2, cfg["vp"], 2, 1, 8, schedule, 3, False)))
        assert summary.predicted_peak_bytes(cfg) == want


# ---------------------------------------------------------------------------------------------------- summary


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
    rc = cli.main(["summary", "--out", str(tmp_path), "--pair", "bfpp_bf=bfpp_ref",
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
    assert cli.main(["summary", "--out", str(tmp_path), "--pair", "bf=ref"]) == 1
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
    rc = cli.main(["summary", "--out", str(tmp_path), "--pair", "megatron-bf=megatron-ref",
                   "--pair", "megatron-zb=megatron-ref", "--not-run", "megatron-zb"])
    text = capsys.readouterr().out
    assert rc == 0 and "NOT RUN: megatron-zb" in text and "FAILED" not in text
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["not_run"] == ["megatron-zb"]
    config = {r["name"]: r for r in result["runs"]}["megatron-bf"]["config"]
    assert (config["pp"], config["vp"], config["dp"]) == (4, 2, 2)


def test_summary_leaves_out_a_pair_whose_reference_did_not_run(tmp_path) -> None:
    _bfpp_run(tmp_path, "bf", [3.0, 2.0], 0.1, ["bfpp", "train", *MODEL])
    result = summary.summarize(tmp_path, ["bf=ref"], ["ref"], "h200")
    assert result["pairs"] == [{"run": "bf", "reference": "ref", "not_run": True}]
    assert result["runs"] == [] and result["failures"] == [] and result["not_run"] == ["ref"]
    assert "bf             ref            not run (the check's time budget was spent)" in summary.summary_table(result)
