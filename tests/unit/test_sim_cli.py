"""`bfpp simulate` and `bfpp plan` (megatron_bfpp/megatron/sim_cli.py): a run given as `pretrain_gpt.py` flags after
`--`, presets as named flag sets, the JSON and table contracts, Megatron's own errors before any search, every
preset simulated and planned on its published hardware, and a model no preset names planned from flags alone."""

from __future__ import annotations

import json
import sys

import pytest

from megatron_bfpp.megatron import sim_cli
from megatron_bfpp.megatron.presets import preset_names
from megatron_bfpp.megatron.sim_cli import plan_main, simulate_main, split_argv
import tests.support.megatron_parser  # noqa: F401  (Megatron's parser: imported once, at collection)

# The old command lines keep working: the preset, then Megatron's own flag names before `--`.
SIM = ["--model", "gpt-52b", "--hardware", "dgx-a100", "--gpus", "256", "--global-batch-size", "64",
       "--micro-batch-size", "1", "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "4",
       "--num-layers-per-virtual-pipeline-stage", "8", "--pipeline-schedule", "breadth-first", "--zero-stage", "3"]
FULL_RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
DISTOPT = "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather"

# Each preset on its published hardware at a layout of the kind its recipe uses (Megatron-Bridge / NeMo recipes,
# the breadth-first paper's 52B on A100), with the global batch kept small for speed.
PUBLISHED = {
    "gpt-1.3b": ("dgx-a100", 64, "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 "
                                 "--num-virtual-stages-per-pipeline-rank 1 --global-batch-size 128"),
    "gpt-13b": ("dgx-a100", 128, "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 4 "
                                 "--num-layers-per-virtual-pipeline-stage 2 --sequence-parallel --global-batch-size 64"),
    "gpt-52b": ("dgx-a100", 512, "--tensor-model-parallel-size 4 --pipeline-model-parallel-size 4 "
                                 "--num-layers-per-virtual-pipeline-stage 1 --sequence-parallel --global-batch-size 128"),
    "gpt-175b": ("dgx-a100", 1024, "--tensor-model-parallel-size 8 --pipeline-model-parallel-size 8 "
                                   "--num-layers-per-virtual-pipeline-stage 2 --sequence-parallel "
                                   "--global-batch-size 256"),
    "gpt3-175b": ("dgx-h100", 512, "--tensor-model-parallel-size 4 --pipeline-model-parallel-size 8 "
                                   "--num-layers-per-virtual-pipeline-stage 2 --sequence-parallel --tp-comm-overlap "
                                   "--global-batch-size 256"),
    "llama3-8b": ("dgx-h100", 8, "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 "
                                 "--context-parallel-size 2 --sequence-parallel "
                                 "--fp8-format hybrid --fp8-recipe tensorwise --global-batch-size 32"),
    "llama3-70b": ("dgx-h100", 64, "--tensor-model-parallel-size 4 --pipeline-model-parallel-size 4 "
                                   "--num-layers-per-virtual-pipeline-stage 5 --context-parallel-size 2 "
                                   "--sequence-parallel --global-batch-size 32"),
    "llama3.1-405b": ("dgx-h100", 512, "--tensor-model-parallel-size 8 --pipeline-model-parallel-size 8 "
                                       "--num-layers-per-virtual-pipeline-stage 8 "
                                       "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split "
                                       "--context-parallel-size 4 --sequence-parallel --global-batch-size 16"),
    "nemotron4-340b": ("dgx-h100", 768, "--tensor-model-parallel-size 8 --pipeline-model-parallel-size 12 "
                                        "--num-layers-per-virtual-pipeline-stage 1 --sequence-parallel "
                                        "--global-batch-size 96"),
    "mixtral-8x7b": ("dgx-h100", 64, "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 "
                                     "--num-layers-per-virtual-pipeline-stage 1 --expert-model-parallel-size 8 "
                                     "--global-batch-size 64"),
    "qwen3-30b-a3b": ("dgx-h100", 8, "--tensor-model-parallel-size 4 --pipeline-model-parallel-size 2 "
                                     "--num-virtual-stages-per-pipeline-rank 1 --expert-model-parallel-size 4 --expert-tensor-parallel-size 1 --sequence-parallel "
                                     "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 "
                                     "--micro-batch-size 2 --global-batch-size 32"),
    "qwen3-235b-a22b": ("dgx-h100", 128, "--tensor-model-parallel-size 4 --pipeline-model-parallel-size 16 "
                                         "--num-virtual-stages-per-pipeline-rank 1 "
                                         "--account-for-embedding-in-pipeline-split "
                                         "--account-for-loss-in-pipeline-split --context-parallel-size 2 "
                                         "--expert-model-parallel-size 8 --expert-tensor-parallel-size 1 "
                                         "--sequence-parallel --global-batch-size 32"),
}


def _json(capsys: pytest.CaptureFixture, main, argv: list[str]) -> tuple[int, dict]:
    code = main(argv)
    out = capsys.readouterr().out
    return code, json.loads(out) if out.strip() else {}


def _published(name: str, *options: str) -> list[str]:
    hw, gpus, flags = PUBLISHED[name]
    batch = [] if "--micro-batch-size" in flags else ["--micro-batch-size", "1"]
    return ["--model", name, "--hardware", hw, "--gpus", str(gpus), *options, "--", *flags.split(), *batch,
            *DISTOPT.split()]


def test_every_preset_has_its_published_layout() -> None:
    assert set(PUBLISHED) == set(preset_names())


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_every_preset_simulates_on_its_published_hardware(name: str, capsys: pytest.CaptureFixture) -> None:
    code, d = _json(capsys, simulate_main, _published(name, "--json"))
    assert code == 0 and d["model"] == name and d["hardware"] == PUBLISHED[name][0]
    assert d["fits"] and 0 < d["mfu"] < 1 and d["tflops_per_gpu"] > 0 and d["step_time_s"] > 0
    c = d["config"]
    assert c["pipeline_schedule"] in ("1f1b", "interleaved-1f1b") and c["zero_stage"] == 1  # stock Megatron's
    assert not c["optimizer_in_schedule"] and c["dp_overlap"]


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_every_preset_plans_on_its_published_hardware(name: str, capsys: pytest.CaptureFixture) -> None:
    """Restricted to the published layout and Megatron's own schedule, the plan finds exactly the run that
    `simulate` predicts."""
    argv = _published(name, "--pipeline-schedule", "default", "--group-size-search", "off", "--layout-search", "off",
                      "--top", "1", "--json")
    code, d = _json(capsys, plan_main, argv)
    assert code == 0 and len(d["candidates"]) == 1, d.get("notes")
    best = d["candidates"][0]
    _, sim = _json(capsys, simulate_main, _published(name, "--json"))
    assert best["step_time_s"] == pytest.approx(sim["step_time_s"], rel=1e-9)
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
                "context_parallel_size", "expert_model_parallel_size", "data_parallel_size", "micro_batch_size",
                "sequence_parallel", "fp8_recipe", "recompute"):
        assert best["config"][key] == sim["config"][key], key


def test_simulate_json_keeps_its_fields_and_megatrons_overlap_flags_count(capsys: pytest.CaptureFixture) -> None:
    code, d = _json(capsys, simulate_main, [*SIM, *FULL_RECOMPUTE, "--json"])
    assert code == 0
    for k in ("step_time_s", "tflops_per_gpu", "mfu", "bubble_fraction", "exposed_dp_s", "exposed_pp_s",
              "peak_memory_gib", "fits", "step_lower_bound_s", "memory_gib", "per_rank"):
        assert k in d
    assert d["config"]["virtual_pipeline_model_parallel_size"] == 2 and d["config"]["recompute"] is True
    assert d["mfu"] == pytest.approx(d["tflops_per_gpu"] * 1e12 / 312e12)  # A100's dense bf16 peak
    # Stock Megatron at the same layout: its overlap flags hide the data-parallel and p2p communication.
    stock = SIM[:-4]  # without --pipeline-schedule and --zero-stage
    on = _json(capsys, simulate_main, [*stock, *DISTOPT.split(), "--json"])[1]
    off = _json(capsys, simulate_main, [*stock, "--use-distributed-optimizer", "--no-overlap-p2p-communication",
                                        "--json"])[1]
    assert on["config"]["dp_overlap"] is True and off["config"]["dp_overlap"] is False
    assert on["config"]["p2p_overlap"] is True and off["config"]["p2p_overlap"] is False
    assert off["exposed_dp_s"] > on["exposed_dp_s"] and off["exposed_pp_s"] > on["exposed_pp_s"]
    assert off["step_time_s"] > on["step_time_s"] * 1.05


def test_simulate_table_group_size_and_trace(capsys: pytest.CaptureFixture, tmp_path) -> None:
    trace = tmp_path / "sim.json"
    code, d = _json(capsys, simulate_main, [*SIM, "--microbatch-group-size-per-virtual-pipeline-stage", "4",
                                            "--json", "--trace", str(trace)])
    assert code == 0
    assert d["config"]["microbatch_group_size_per_vp_stage"] == 4 and d["config"]["num_micro_batches"] == 8
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("name") == "F0:0" for e in events) and any(e.get("name", "").startswith("GATHER") for e in events)
    assert simulate_main([*SIM, "--", "--fp8-format", "hybrid"]) == 2  # A100: no FP8 tensor cores
    assert "--fp8-format" in capsys.readouterr().err
    assert simulate_main(SIM) == 0
    table = capsys.readouterr().out
    assert table.startswith("gpt-52b on 256 x dgx-a100: T=8 P=4 V=2 D=8 b=1 M=8 breadth-first (group 8) ZeRO-3")
    assert "step time" in table and "MFU" in table and "peak memory" in table


@pytest.mark.parametrize("change, flag", [
    (["--gpus", "250"], "--gpus"),
    (["--global-batch-size", "100"], "global_batch_size"),
    (["--num-layers-per-virtual-pipeline-stage", "3"], "num_layers_per_virtual_pipeline_stage"),
    (["--gpus", "320", "--pipeline-model-parallel-size", "5"], "pipeline_model_parallel_size"),
    (["--tensor-model-parallel-size", "16"], "--tensor-model-parallel-size"),
    (["--microbatch-group-size-per-virtual-pipeline-stage", "9"], "--microbatch-group-size-per-virtual-pipeline-stage"),
    (["--hardware", "tpu-v4"], "--hardware"),
    (["--model", "gpt-7b"], "--model"),
])
def test_errors_are_one_line_naming_the_flag(change: list[str], flag: str, capsys: pytest.CaptureFixture) -> None:
    argv = list(SIM)
    for k, v in zip(change[::2], change[1::2]):
        if k in argv:
            argv[argv.index(k) + 1] = v
        else:
            argv += [k, v]
    assert simulate_main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0] and lines[0].startswith("bfpp simulate: error: ")


def test_preset_first_then_the_flags_before_and_after_the_separator() -> None:
    opts, flags = split_argv(sim_cli.simulate_parser(), ["--model", "gpt-52b", "--hardware", "h200", "--gpus", "8",
                                                         "--seq-length", "4096", "--json", "--", "--bf16"])
    assert opts.json and opts.hardware == "h200" and opts.gpus == 8
    assert flags[:6] == ["--num-layers", "64", "--hidden-size", "8192", "--num-attention-heads", "64"]
    assert flags[-3:] == ["--seq-length", "4096", "--bf16"]
    from megatron_bfpp.megatron.sim_flags import read_run
    from megatron_bfpp.sim import get_hardware

    model, _ = read_run([*flags, "--max-position-embeddings", "4096", "--micro-batch-size", "1"], 8,
                        get_hardware("h200"), "gpt-52b")
    assert model.seq_length == 4096  # the user's flag overrides the preset's


def test_plan_json_keeps_its_fields_and_gives_the_launch_flags(capsys: pytest.CaptureFixture) -> None:
    code, d = _json(capsys, plan_main, ["--model", "gpt-1.3b", "--hardware", "h200", "--gpus", "16",
                                        "--global-batch-size", "32", "--pipeline-schedule", "breadth-first",
                                        "--zero-stage", "3", "--top", "3", "--json"])
    assert code == 0
    cands = d["candidates"]
    assert 1 <= len(cands) <= 3 and {"candidates", "rejected", "searched", "simulated", "notes", "stock"} <= set(d)
    keys = {"tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
            "data_parallel_size", "micro_batch_size", "pipeline_schedule", "zero_stage", "recompute"}
    for c in cands:
        assert keys <= set(c["config"]) and {"tflops_per_gpu", "step_time_s", "peak_memory_gib", "fits", "mfu"} <= set(c)
        assert c["config"]["pipeline_schedule"] == "breadth-first" and c["config"]["zero_stage"] == 3 and c["fits"]
    assert [c["tflops_per_gpu"] for c in cands] == sorted((c["tflops_per_gpu"] for c in cands), reverse=True)
    # The best candidate's launch flags (the plan's base flags, the preset's included, and the candidate's), given
    # to simulate, predict the same step; and Megatron-LM with the plugin accepts them on that many ranks.
    argv = [*d["megatron_base_args"], *cands[0]["megatron_args"]]
    code, sim = _json(capsys, simulate_main, ["--hardware", "h200", "--gpus", "16", "--json", "--", *argv])
    assert code == 0 and sim["step_time_s"] == pytest.approx(cands[0]["step_time_s"], rel=1e-9)
    from megatron_bfpp.megatron.check import check

    assert check(argv, 16).schedule.kind == "breadth-first"


def test_plan_for_a_model_no_preset_names(capsys: pytest.CaptureFixture) -> None:
    """A 16-layer GQA / SwiGLU / RoPE model with 8 experts on every other layer, from flags alone: the plan
    searches T, P, V, EP and b with the flags' features in every candidate."""
    flags = ["--num-layers", "16", "--hidden-size", "2048", "--num-attention-heads", "16", "--group-query-attention",
             "--num-query-groups", "4", "--swiglu", "--position-embedding-type", "rope", "--normalization", "RMSNorm",
             "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--seq-length", "4096",
             "--max-position-embeddings", "4096", "--tokenizer-type", "NullTokenizer", "--vocab-size", "50000",
             "--num-experts", "8", "--moe-layer-freq", "2", "--moe-token-dispatcher-type", "alltoall",
             "--sequence-parallel", "--fp8-format", "hybrid", "--bf16", "--global-batch-size", "64"]
    code, d = _json(capsys, plan_main, ["--hardware", "dgx-h100", "--gpus", "16", "--top", "3", "--json",
                                        "--pipeline-schedule", "interleaved-1f1b", "--pipeline-schedule", "1f1b",
                                        "--pipeline-schedule", "breadth-first-zb", "--zero-stage", "1",
                                        "--", *flags, "--micro-batch-size", "1", "--micro-batch-size", "2"])
    assert code == 0 and d["candidates"]
    for c in d["candidates"]:
        cfg = c["config"]
        assert cfg["fp8_recipe"] == "delayed" and cfg["attention"] == "flash"
        assert cfg["sequence_parallel"] == (cfg["tensor_model_parallel_size"] > 1)
        assert cfg["micro_batch_size"] in (1, 2) and 8 % cfg["expert_model_parallel_size"] == 0
    assert any(c["config"]["expert_model_parallel_size"] > 1 for c in d["candidates"] + d["rejected"])
    assert plan_main(["--hardware", "dgx-h100", "--gpus", "16", "--pipeline-schedule", "1f1b", "--zero-stage", "1",
                      "--", *flags]) == 0
    table = capsys.readouterr().out
    assert table.startswith("GPT 16x2048, 8 experts on 16 x dgx-h100, global batch 64:") and "#1 launches with:" in table


@pytest.mark.parametrize("flags, message", [
    (["--overlap-param-gather"], "Megatron-LM rejects the flags: --overlap-param-gather only supported with "
                                 "distributed optimizer"),
    (["--no-such-flag"], "Megatron-LM rejects the flags: unrecognized arguments: --no-such-flag"),
    (["--fp8-format", "hybrid", "--fp8-recipe", "weird"], "Megatron-LM rejects the flags: argument --fp8-recipe"),
    (["--use-distributed-optimizer", "--zero-stage", "2"], "drop --use-distributed-optimizer"),
    (["--multi-latent-attention"], "--multi-latent-attention: the simulator does not model"),
])
def test_plan_gives_megatrons_error_before_any_search(flags: list[str], message: str, capsys: pytest.CaptureFixture,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    def no_search(*args, **kwargs):
        raise AssertionError("searched")

    monkeypatch.setattr(sim_cli, "plan", no_search)
    assert plan_main(["--model", "gpt-1.3b", "--hardware", "h200", "--gpus", "16", "--", "--global-batch-size", "8",
                      *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bfpp plan: error: ") and message in err and len(err.strip().splitlines()) == 1


def test_bfpp_command_dispatches_to_the_commands(subprocesses) -> None:
    out = subprocesses.run([sys.executable, "-m", "megatron_bfpp.cli", "simulate", *SIM, "--json"],
                           capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["config"]["pipeline_schedule"] == "breadth-first"
    out = subprocesses.run([sys.executable, "-m", "megatron_bfpp.cli", "plan", "--help"], capture_output=True,
                           text=True, timeout=300)
    assert out.returncode == 0 and "pretrain_gpt.py" in out.stdout


def test_hardware_report_gives_the_devices_rates(capsys: pytest.CaptureFixture, tmp_path) -> None:
    """The device kit's layer table (one 4096-wide layer, its GEMMs at 300 TFLOP/s on an H100) replaces the
    profile's rates: the same run predicts slower, on a profile named after the device."""
    n, h, f = 2048, 4096, 16384
    rows = [{"op": op, "fwd_measured_ms": 2 * n * k * o / 300e12 * 1e3, "bwd_measured_ms": 4 * n * k * o / 300e12 * 1e3}
            for op, (k, o) in {"qkv": (h, 3 * h), "proj": (h, h), "fc1": (h, f), "fc2": (f, h)}.items()]
    attn = 4 * n * n * h / 2
    rows += [{"op": "attention", "fwd_measured_ms": attn / 300e12 * 1e3, "bwd_measured_ms": 2.5 * attn / 200e12 * 1e3},
             {"op": "elementwise", "fwd_measured_ms": 0.5, "bwd_measured_ms": 1.0}]
    report = tmp_path / "layer.json"
    report.write_text(json.dumps({"model": "4096:32:2048", "micro_batch_size": 1, "ops": rows, "device": "H100 SXM"}))
    run = ["--model", "gpt-13b", "--hardware", "dgx-h100", "--gpus", "64", "--json", "--",
           "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "4", "--micro-batch-size", "1",
           "--global-batch-size", "64", "--sequence-parallel"]
    _, profile = _json(capsys, simulate_main, run)
    code, measured = _json(capsys, simulate_main, ["--hardware-report", str(report), *run])
    assert code == 0 and measured["hardware"] == "dgx-h100 (measured: H100 SXM)"
    assert measured["step_time_s"] > profile["step_time_s"]
    assert simulate_main(["--hardware-report", str(tmp_path / "none.json"), *run]) == 2
    assert "--hardware-report" in capsys.readouterr().err
