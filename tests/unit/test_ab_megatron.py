"""The A/B driver's logic (megatron_bfpp/megatron/ab), without starting a process: the commands of stock and plugin
runs, Megatron-LM's log lines, which runs count, the per-variant summary and its same-model check. Its command
line (dry runs, fake and CPU runs) is tested in tests/distributed/test_scripts.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_bfpp.megatron.ab import cli, commands, logs, report
from megatron_bfpp.megatron.ab.commands import RunRecord


def _options(*argv: str):
    """The driver's options as its command line parses them (the defaults, --cpu-pair's and --cpu-smoke's settings
    applied, as main does)."""
    a = cli.build_parser().parse_args(list(argv))
    cli.apply_defaults(a)
    return a


def _flag(flags: list[str], name: str) -> str | None:
    return flags[flags.index(name) + 1] if name in flags else None


def _after_script(cmd: list[str]) -> list[str]:
    return cmd[next(i for i, x in enumerate(cmd) if x.endswith("pretrain_gpt.py")) + 1:]


def _variants(a) -> list[commands.Variant]:
    lay = commands.layout(a)
    return commands.variants(a, lay, cli.stock_vp_at(lay))


def _planned(*argv: str, impl: str = "local", host: str = commands.FIRST_NODE) -> tuple[list[str], list[RunRecord]]:
    a = _options(*argv)
    flags = commands.common_flags(a, commands.layout(a), impl)
    return flags, commands.plan(a, "/opt/mlm", Path("/out"), _variants(a), flags, host)


# ------------------------------------------------------------------------------------------------ commands

def test_stock_and_plugin_runs_get_the_same_megatron_flags() -> None:
    """Every run of every variant starts with the same model, layout, batch, data, seed and logging flags; only
    its own flags follow (the schedule, the data-parallel flags, the plugin's timeline), and only the plugin's
    runs go through the script runner."""
    flags, records = _planned("--model", "13b", "--nnodes", "8", "--launcher", "srun", "--reps", "2",
                              "--variant-flags", "plugin-bf-zero3=--recompute-granularity selective", host="node-a")
    names = ["stock-g8", "stock-g16", "plugin-bf-distopt", "plugin-bf-zero3"]
    assert [(r.variant, r.rep) for r in records] == [(v, k) for k in (1, 2) for v in names]  # A B C A B C
    own = {}
    for r in records:
        after = _after_script(r.command)
        assert after[: len(flags)] == flags, r.variant
        own[r.variant] = after[len(flags):]
        entry = r.command[: r.command.index("/opt/mlm/pretrain_gpt.py")]
        assert (entry[-2:] == ["-m", "megatron_bfpp.run_megatron_script"]) == r.variant.startswith("plugin")
        assert (r.timeline is not None) == r.variant.startswith("plugin")
        assert r.log == f"/out/{r.variant}.rep{r.rep}.log"
    dist_opt = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
    vs = ["--num-layers-per-virtual-pipeline-stage", "1"]  # 13b: V = 5 on every variant
    # Stock at its best when it interleaves: also the parameter gather overlapped with its optimizer step.
    assert own["stock-g8"] == [*vs, *dist_opt, "--overlap-param-gather-with-optimizer-step", "--ckpt-format", "torch",
                               "--microbatch-group-size-per-virtual-pipeline-stage", "8"]
    assert own["stock-g16"][-1] == "16"
    assert own["plugin-bf-distopt"] == [*vs, "--pipeline-schedule", "breadth-first", *dist_opt, "--timeline",
                                        "/out/plugin-bf-distopt.rep2.timeline.json"]
    assert own["plugin-bf-zero3"][:8] == [*vs, "--pipeline-schedule", "breadth-first", "--zero-stage", "3",
                                          "--recompute-granularity", "selective"]  # per variant only
    # One rendezvous port per run; srun's rendezvous on the allocation's first node.
    ports = [int(r.command[r.command.index("--rdzv-endpoint") + 1].split(":")[1]) for r in records]
    assert ports == list(range(29500, 29500 + len(records)))
    assert all(r.command[0] == "srun" and "--nodes=8" in r.command and
               r.command[r.command.index("--rdzv-endpoint") + 1].startswith("node-a:") for r in records)


def test_common_flags_follow_the_layout_precision_and_data() -> None:
    flags, _ = _planned("--model", "13b", "--nnodes", "2", "--no-check", "--", "--foo", "1")
    assert _flag(flags, "--tensor-model-parallel-size") == "2" and "--sequence-parallel" in flags
    assert "--tp-comm-overlap" not in flags  # local layers: no TransformerEngine overlap
    assert "--bf16" in flags and "--mock-data" in flags and _flag(flags, "--vocab-size") == "50257"
    assert flags[-2:] == ["--foo", "1"]  # flags after -- go to every variant, last
    assert _flag(flags, "--seed") == "1234" and _flag(_planned("--seed", "7")[0], "--seed") == "7"
    te, _ = _planned("--model", "13b", "--nnodes", "2", impl="transformer_engine")
    assert "--tp-comm-overlap" in te and _flag(te, "--transformer-impl") == "transformer_engine"
    off, _ = _planned("--model", "13b", "--nnodes", "2", "--no-tp-comm-overlap", impl="transformer_engine")
    assert "--tp-comm-overlap" not in off
    one, _ = _planned("--model", "1.3b")  # T = 1: no sequence parallelism
    assert "--sequence-parallel" not in one
    cpu, _ = _planned("--cpu-smoke")
    assert "--bf16" not in cpu and _flag(cpu, "--distributed-backend") == "gloo" and _flag(cpu, "--vocab-size") == "128"
    assert _flag(cpu, "--train-iters") == "6" and _flag(cpu, "--eval-interval") == "7"
    data, _ = _planned("--data-path", "corpus", "--vocab-file", "v.json", "--merge-file", "m.txt")
    assert _flag(data, "--tokenizer-type") == "GPT2BPETokenizer" and Path(_flag(data, "--data-path")).is_absolute()
    assert "--mock-data" not in data
    with pytest.raises(SystemExit, match="--data-path needs --vocab-file and --merge-file"):
        _planned("--data-path", "corpus")


def test_layout_and_stock_group_sizes() -> None:
    lay = commands.layout(_options("--model", "1.3b", "--gpus-per-node", "8"))
    assert (lay["world"], lay["dp"], lay["m"], lay["vp"]) == (8, 2, 32, 3)
    assert commands.stock_group_sizes(_options("--model", "1.3b"), lay, 3) == [4, 8]  # P and 2P: 2P divides M
    small = commands.layout(_options("--model", "1.3b", "--gbs", "24"))
    assert small["m"] == 12 and commands.stock_group_sizes(_options(), small, 3) == [4]  # 8 does not divide 12
    assert commands.stock_group_sizes(_options("--stock-group-sizes", "2, 6,"), lay, 3) == [2, 6]
    assert commands.stock_group_sizes(_options(), lay, 1) == []  # 1F1B takes none
    with pytest.raises(SystemExit, match=r"1 node\(s\) x 3 = 3 ranks is not a multiple of TP x PP = 4"):
        commands.layout(_options("--model", "1.3b", "--gpus-per-node", "3"))
    with pytest.raises(SystemExit, match=r"4 layer\(s\) per virtual stage do not divide the 6 layers"):
        commands.layout(_options("--model", "1.3b", "--layers-per-stage", "4"))


def test_variants_added_extended_and_refused() -> None:
    a = _options("--variants", "stock,zb", "--stock-group-sizes", "8", "--add-variant",
                 "zb=plugin:--pipeline-schedule interleaved-1f1b --foo 'a b'", "--variant-flags", "stock=--x 1",
                 "--variant-flags", "stock=--y")
    vs = {v.name: v for v in _variants(a)}
    assert list(vs) == ["stock", "zb"]  # one group size: plain "stock"
    assert vs["zb"].plugin and vs["zb"].flags == ["--num-layers-per-virtual-pipeline-stage", "2", "--pipeline-schedule",
                                                  "interleaved-1f1b", "--foo", "a b"]  # the layout's V, then its own
    assert not vs["stock"].plugin and vs["stock"].flags[-3:] == ["--x", "1", "--y"]
    both = _options("--variant-flags", "stock=--x 1")  # "stock" reaches every stock-g<G>
    assert all(v.flags[-2:] == ["--x", "1"] for v in _variants(both) if v.name.startswith("stock"))
    for argv, message in ((("--variants", "stock,nope"), "--variants nope unknown"),
                          (("--variant-flags", "nope=--foo"), "no such variant"),
                          (("--add-variant", "bad"), "use NAME=stock")):
        with pytest.raises(SystemExit, match=message):
            _variants(_options(*argv))


@pytest.mark.parametrize("argv, procs", [
    (("--cpu-smoke", "--model", "cpu-p4-m2"), 4),  # P = 4, V = 2, M = 2 on 4 gloo processes
    (("--model", "13b", "--nnodes", "8", "--gbs", "16"), 8),  # P = 8, V = 5, D = 4, M = 4
], ids=["cpu-p4-m2", "13b-gbs16"])
def test_stock_runs_1f1b_without_virtual_stages_at_m_below_p(argv: tuple[str, ...], procs: int) -> None:
    """M < P: Megatron-Core's interleaved schedule refuses every group size, so stock at its best is 1F1B with the
    distributed optimizer and its overlaps (the planner's rule); our variants run the layout's virtual stages. Every
    variant keeps the same model, layout, batch, data and seed flags."""
    a = _options(*argv, "--variants", "stock,plugin-bf-distopt,plugin-izb-distopt")
    lay = commands.layout(a)
    assert lay["m"] < lay["pp"] and lay["vp"] >= 2 and cli.stock_vp_at(lay) == 1
    flags, records = _planned(*argv, "--variants", "stock,plugin-bf-distopt,plugin-izb-distopt")
    own = {r.variant: _after_script(r.command)[len(flags):] for r in records}
    assert list(own) == ["stock", "plugin-bf-distopt", "plugin-izb-distopt"]
    dist_opt = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
    assert own["stock"] == dist_opt  # no virtual stages, no group size, no optimizer-step overlap (needs V > 1)
    vs = ["--num-layers-per-virtual-pipeline-stage", str(lay["lps"])]
    assert own["plugin-bf-distopt"][:5] == [*vs, "--pipeline-schedule", "breadth-first", dist_opt[0]]
    assert own["plugin-izb-distopt"][:5] == [*vs, "--pipeline-schedule", "interleaved-zb", dist_opt[0]]
    assert all(_after_script(r.command)[: len(flags)] == flags for r in records)
    assert "--num-layers-per-virtual-pipeline-stage" not in flags
    assert all(_flag(r.command, "--nproc-per-node") == str(procs) for r in records)
    with pytest.raises(SystemExit, match="stock runs 1F1B without virtual stages here"):
        _variants(_options(*argv, "--stock-group-sizes", "4"))


def test_launch_prefix_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/site")
    monkeypatch.setenv("BFPP_SRUN_ARGS", "--container-image=x --mpi=pmix")
    local = commands.launch_prefix(_options("--gpus-per-node", "4"), 29600, "stock-1")
    assert local == ["torchrun", "--nnodes", "1", "--nproc-per-node", "4", "--rdzv-backend", "c10d",
                     "--rdzv-endpoint", "localhost:29600"]
    srun = commands.launch_prefix(_options("--launcher", "srun", "--nnodes", "2"), 29600, "stock-1", "n1")
    assert srun[:6] == ["srun", "--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--container-image=x",
                        "--mpi=pmix"] and srun[-1] == "n1:29600"
    env = commands.run_env(_options(), "/opt/mlm")
    assert env["PYTHONPATH"] == f"{commands.ROOT}:/opt/mlm:/site" and env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert "BFPP_CPU_SHIM" not in env
    cpu = commands.run_env(_options("--cpu-smoke"), "/opt/mlm")
    assert cpu["PYTHONPATH"].split(":")[0] == str(commands.CPU_SHIM) and cpu["BFPP_CPU_SHIM"] == "1"
    assert (commands.ROOT / "megatron_bfpp" / "megatron" / "ab" / "commands.py").is_file()


def test_cpu_smoke_settings_keep_what_the_command_line_gives() -> None:
    a = _options("--cpu-smoke")
    assert (a.model, a.gpus_per_node, a.iters, a.warmup, a.reps, a.transformer_impl) == ("cpu-smoke", 2, 6, 2, 1,
                                                                                          "local")
    assert _options("--cpu-smoke", "--model", "13b").model == "cpu-smoke"  # a GPU model is not run on CPU
    deep = _options("--cpu-smoke", "--model", "cpu-p4-m2")
    assert (deep.model, deep.gpus_per_node) == ("cpu-p4-m2", 4)  # one process per pipeline rank, D = 1
    given = _options("--cpu-smoke", "--iters", "4", "--reps", "2", "--loss-rtol", "0.1")
    assert (given.iters, given.reps, given.loss_rtol) == (4, 2, 0.1)


def test_same_model_tolerances_follow_precision_and_layer_placement() -> None:
    """fp32's on CPU where every variant builds each layer on the same pipeline rank; bf16's on GPU, and where stock
    runs without the layout's virtual stages (M < P), since Megatron seeds each pipeline rank's weights apart."""
    for argv, same, rtol in ((("--cpu-smoke",), True, report.FP32_RTOL), (("--cpu-smoke", "--model", "cpu-p4-m2"),
                                                                           False, report.BF16_RTOL),
                             ((), True, report.BF16_RTOL),
                             (("--model", "13b", "--nnodes", "8", "--gbs", "16"), False, report.BF16_RTOL)):
        a = _options(*argv)
        lay = commands.layout(a)
        assert (cli.stock_vp_at(lay) == lay["vp"]) is same
        cli.apply_tolerances(a, same)
        assert (a.loss_rtol, a.loss_rtol_all) == (rtol["first"], rtol["all"]), argv
    given = _options("--cpu-smoke", "--loss-rtol", "0.1")
    cli.apply_tolerances(given, False)
    assert (given.loss_rtol, given.loss_rtol_all) == (0.1, report.BF16_RTOL["all"])


# ----------------------------------------------------------------------------------------------------- logs

def _iteration(it: int, iters: int = 10, ms: float = 1000.0, loss: float = 10.5, gnorm: float | None = 1.234,
               gbs: int = 16) -> str:
    """A Megatron-LM training_log line (--log-throughput), as core_v0.19.0 prints it."""
    return (f" [2026-01-01 00:00:00.000000] iteration {it:8d}/{iters:8d} | consumed samples: {it * gbs:12d} |"
            f" elapsed time per iteration (ms): {ms:.1f} | throughput per GPU (TFLOP/s/GPU): {1e5 / ms:.1f} |"
            f" learning rate: 1.500000E-04 | global batch size: {gbs:5d} | lm loss: {loss:.6E} | loss scale: 1.0 |"
            + (f" grad norm: {gnorm:.3f} |" if gnorm is not None else "")
            + " number of skipped iterations:   0 | number of nan iterations:   0 |")


def _memory(it: int, rank: int, peak: float, reserved: bool = True) -> str:
    return (f"[Rank {rank}] (after {it} iterations) memory (MB) | allocated: {peak / 2:.2f} | max allocated: "
            f"{peak:.2f}" + (f" | reserved: {peak + 100:.2f} | max reserved: {peak + 200:.2f}" if reserved else ""))


def test_parse_log_reads_iterations_memory_and_deferrals() -> None:
    text = "\n".join([
        "fake torchrun: ...",
        _iteration(1, ms=3000.0, loss=10.5),
        _memory(1, 0, 4000.0), _memory(1, 4, 3900.0, reserved=False),
        " [2026-01-01] iteration 2/10 | consumed samples: 32 | skipped",  # no elapsed time: not an iteration record
        _iteration(3, ms=800.0, loss=10.3, gnorm=None),
    ])
    run = logs.parse_log(text, "v", 1024)
    assert [r["iteration"] for r in run.iterations] == [1, 3]
    first, third = run.iterations
    assert first == {"variant": "v", "iteration": 1, "elapsed_ms": 3000.0, "tflops_per_gpu": pytest.approx(33.3),
                     "global_batch_size": 16.0, "lm_loss": 10.5, "grad_norm": 1.234,
                     "tokens_per_s": pytest.approx(16 * 1024 / 3.0)}
    assert third["grad_norm"] is None and third["tokens_per_s"] == pytest.approx(16 * 1024 / 0.8)
    assert run.memory == [
        {"variant": "v", "rank": 0, "iteration": 1, "allocated_mb": 2000.0, "max_allocated_mb": 4000.0,
         "max_reserved_mb": 4200.0},
        {"variant": "v", "rank": 4, "iteration": 1, "allocated_mb": 1950.0, "max_allocated_mb": 3900.0,
         "max_reserved_mb": None}]
    assert run.deferred_linears is None


def test_log_records_how_many_linear_layers_deferred() -> None:
    """A split-backward variant's log says per chunk how many linear layers deferred their weight GEMMs; the
    summary's deferred_linears sums them (0: W has no work), None for a fused schedule."""
    lines = ["megatron_bfpp: interleaved-zb, model chunk 0: 4 linear layers defer their weight GEMMs to W",
             "megatron_bfpp: interleaved-zb, model chunk 1: 5 linear layers defer their weight GEMMs to W"]
    assert logs.parse_log("\n".join(lines), "zb", 128).deferred_linears == 9
    none = ("megatron_bfpp: interleaved-zb, model chunk 0: 0 linear layers defer their weight GEMMs to W; layers "
            "that cannot defer (TransformerEngine without delay_wgrad_compute) run their whole backward at I")
    assert logs.parse_log(none, "zb", 128).deferred_linears == 0
    assert logs.parse_log("iteration 1/ 2 |", "bf", 128).deferred_linears is None


# --------------------------------------------------------------------------------------------------- report

def _log(variant: str, iters: int = 10, ms: float = 1000.0, loss: float = 10.5, drift: float = 0.0,
         gnorm: float = 1.234, peak: float = 4000.0, stop: int | None = None) -> logs.RunLog:
    lines = []
    for it in range(1, (stop or iters) + 1):
        lines += [_iteration(it, iters, ms * (3 if it == 1 else 1), loss + (drift - 0.1) * (it - 1), gnorm),
                  _memory(it, 0, peak), _memory(it, 4, peak - 4)]
    return logs.parse_log("\n".join(lines), variant, 1024)


def _record(variant: str, rep: int = 1, returncode: int | None = 0, iters: int = 10) -> RunRecord:
    return RunRecord(variant, rep, f"/out/{variant}.rep{rep}.log", ["torchrun", "pretrain_gpt.py", "--train-iters",
                                                                     str(iters)], returncode)


def test_run_failure_names_why_a_run_does_not_count() -> None:
    good = _log("v")
    assert report.run_failure(_record("v"), good, 2) is None
    assert report.run_failure(_record("v", returncode=None), good, 2) == (
        "no exit status recorded (the run did not finish) after 10 logged iteration(s)")
    assert report.run_failure(_record("v", returncode=1), _log("v", stop=7), 2) == (
        "exited with status 1 after 7 logged iteration(s)")
    assert report.run_failure(_record("v"), None, 2) == "no log"
    assert report.run_failure(_record("v"), logs.RunLog("v"), 2) == "no Megatron iteration lines in the log"
    assert report.run_failure(_record("v"), _log("v", stop=2), 2).startswith(
        "only 2 iteration(s) logged, none after the 2 warm-up iteration(s)")
    assert report.run_failure(_record("v"), _log("v", stop=9), 2) == (
        "exited 0 after logging 9 of its 10 iterations (a partial log)")
    assert report.planned_iterations(RunRecord("v", 1, "l", ["x", "--train-iters"])) is None


def test_run_metrics_leave_the_warmup_out() -> None:
    m = report.run_metrics(_log("v", ms=500.0), warmup=2)
    assert m["iterations"] == 8 and m["elapsed_ms"] == 500.0  # iteration 1 (3x slower) left out
    assert m["tokens_per_s"] == pytest.approx(16 * 1024 / 0.5) and m["tflops_per_gpu"] == pytest.approx(200.0)


def _summary(runs: dict[tuple[str, int], logs.RunLog | None], records: list[RunRecord] | None = None):
    records = records or [_record(v, rep) for v, rep in runs]
    names = list(dict.fromkeys(v for v, _ in runs))
    return report.summarize(names, records, runs, 2, report.BF16_RTOL["first"], report.BF16_RTOL["all"])


def test_summary_baseline_ratios_and_spread() -> None:
    """The fastest stock variant is the baseline of every ratio; medians are over the repetitions' medians."""
    runs = {("stock-g4", 1): _log("stock-g4", ms=1000.0), ("stock-g4", 2): _log("stock-g4", ms=1000.0),
            ("stock-g8", 1): _log("stock-g8", ms=1100.0), ("stock-g8", 2): _log("stock-g8", ms=1100.0),
            ("plugin-bf-zero3", 1): _log("plugin-bf-zero3", ms=800.0, peak=3000.0),
            ("plugin-bf-zero3", 2): _log("plugin-bf-zero3", ms=700.0, peak=3000.0)}
    rows, errors = _summary(runs)
    assert errors == []
    by = {r["variant"]: r for r in rows}
    assert [r["variant"] for r in rows] == ["stock-g4", "stock-g8", "plugin-bf-zero3"]
    assert all(r["baseline"] == "stock-g4" and r["loss_check"] == "ok" and r["status"] == "ok" for r in rows)
    z3 = by["plugin-bf-zero3"]
    assert z3["median_elapsed_ms"] == 750.0 and (z3["min_elapsed_ms"], z3["max_elapsed_ms"]) == (700.0, 800.0)
    assert z3["ratio_median_tokens_per_s"] == pytest.approx((1 / 0.8 + 1 / 0.7) / 2)  # the repetitions' tokens/s
    assert z3["ratio_peak_max_allocated_mb"] == pytest.approx(0.75) and z3["peak_max_reserved_mb"] == 3200.0
    assert by["stock-g8"]["ratio_median_tokens_per_s"] == pytest.approx(1000 / 1100)
    assert z3["first_iteration"] == 1 and z3["first_lm_loss"] == 10.5 and z3["deferred_linears"] is None
    assert z3["bubble"] is None  # no timeline recorded


def test_summary_marks_failed_variants_without_numbers() -> None:
    runs = {("stock", 1): _log("stock"), ("plugin-bf-zero3", 1): _log("plugin-bf-zero3"),
            ("plugin-bf-zero3", 2): _log("plugin-bf-zero3", stop=7)}
    records = [_record("stock"), _record("plugin-bf-zero3"), _record("plugin-bf-zero3", 2, returncode=1)]
    rows, errors = _summary(runs, records)
    bad = rows[1]
    assert bad["status"] == "failed" and "median_tokens_per_s" not in bad and bad["loss_check"] == ""
    assert bad["error"] == ("repetition 2: exited with status 1 after 7 logged iteration(s); "
                            "see /out/plugin-bf-zero3.rep2.log")
    assert bad["ratio_median_tokens_per_s"] is None
    assert errors == [f"variant plugin-bf-zero3 failed: {bad['error']}"]
    rows, errors = report.summarize(["stock", "ghost"], [_record("stock")], {("stock", 1): _log("stock")}, 2,
                                    5e-3, 2e-2)
    assert rows[1]["error"] == "did not run" and errors == ["variant ghost failed: did not run"]


@pytest.mark.parametrize("ours, problem", [
    ({"loss": 10.9}, "lm loss 10.9 vs 10.5 at iteration 1 (beyond --loss-rtol 0.005)"),
    ({"drift": 0.05}, "lm loss 10.25 vs 10 at iteration 6 (beyond --loss-rtol-all 0.02)"),
    ({"gnorm": 1.5}, "grad norm 1.5 vs 1.234 at iteration 1 (beyond --loss-rtol 0.005)"),
], ids=["first-loss", "loss-curve", "grad-norm"])
def test_summary_same_model_check(ours: dict, problem: str) -> None:
    rows, errors = _summary({("stock", 1): _log("stock"), ("plugin", 1): _log("plugin", **ours)})
    assert rows[1]["loss_check"] == f"mismatch: {problem} (stock)"
    assert errors == [f"variant plugin: {problem} against stock: the variants did not train the same model; "
                      f"see /out/plugin.rep1.log"]


def test_grad_norm_compares_as_printed_with_three_decimals() -> None:
    """Megatron-LM prints the grad norm with three decimals: one unit of the last digit apart is no mismatch, even at
    fp32's tolerance; more is."""
    base = _log("stock", gnorm=1.843)
    fp32 = (report.FP32_RTOL["first"], report.FP32_RTOL["all"])
    assert report.same_model_problem(_log("p", gnorm=1.842), base, *fp32) is None
    assert report.same_model_problem(_log("p", gnorm=1.841), base, *fp32) == (
        "grad norm 1.841 vs 1.843 at iteration 1 (beyond --loss-rtol 0.0001)")


def test_same_model_within_bf16_noise_and_without_losses() -> None:
    base = _log("stock")
    assert report.same_model_problem(_log("p", loss=10.52, drift=0.005, gnorm=1.236), base, 5e-3, 2e-2) is None
    no_gnorm = logs.parse_log("\n".join(_iteration(i, gnorm=None) for i in range(1, 4)), "p", 1024)
    assert report.same_model_problem(no_gnorm, base, 5e-3, 2e-2) is None  # grad norm not logged: not compared
    other = logs.parse_log(_iteration(11, iters=20), "p", 1024)
    assert report.same_model_problem(other, base, 5e-3, 2e-2) == (
        "no lm loss in the iteration lines both runs logged")
    # In the summary: said on the variant's row and an error (the driver exits 1), not a mismatch.
    no_loss = logs.parse_log("\n".join(_iteration(i).replace("lm loss", "loss") for i in range(1, 11)), "p", 1024)
    rows, errors = _summary({("stock", 1): base, ("p", 1): no_loss})
    assert rows[1]["loss_check"] == "no lm loss in the iteration lines both runs logged"
    assert errors == ["variant p: no lm loss in the iteration lines both runs logged; see /out/p.rep1.log"]


def test_memory_per_rank_is_the_peak_over_repetitions() -> None:
    runs = {("v", 1): _log("v", peak=3500.0), ("v", 2): _log("v", peak=3000.0), ("w", 1): _log("w", peak=100.0)}
    records = [_record("v"), _record("v", 2), _record("w")]
    assert report.memory_per_rank(["v", "w"], records, runs) == [
        {"variant": "v", "rank": 0, "peak_max_allocated_mb": 3500.0, "peak_max_reserved_mb": 3700.0},
        {"variant": "v", "rank": 4, "peak_max_allocated_mb": 3496.0, "peak_max_reserved_mb": 3696.0},
        {"variant": "w", "rank": 0, "peak_max_allocated_mb": 100.0, "peak_max_reserved_mb": 300.0},
        {"variant": "w", "rank": 4, "peak_max_allocated_mb": 96.0, "peak_max_reserved_mb": 296.0}]


def test_parse_only_needs_the_run_record(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["--parse-only", "--out", str(tmp_path)]) == 2
    assert "ab_runs.json not found: run the driver first" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ the measured CPU pair

def test_cpu_pair_p2m1_runs_stock_1f1b_against_both_split_backward_schedules_at_v2() -> None:
    """--cpu-pair p2m1: 8 layers, hidden 384, sequence 256, P = 2, one micro-batch of 4 (M = 1 < P): stock runs 1F1B
    without virtual stages, ours interleaved-zb and breadth-first-zb at V = 2, all with Megatron's distributed
    optimizer; three rounds, one core per rank; what the command line gives stands."""
    a = _options("--cpu-pair", "p2m1")
    assert (a.cpu_smoke, a.pin_cores, a.model, a.mbs, a.reps, a.iters, a.warmup, a.gpus_per_node) == (
        True, True, "cpu-p2-m1", 4, 3, 10, 3, 2)
    lay = commands.layout(a)
    assert (lay["layers"], lay["hidden"], lay["seq"], lay["pp"], lay["vp"], lay["m"], lay["gbs"]) == (
        8, 384, 256, 2, 2, 1, 4)
    flags, records = _planned("--cpu-pair", "p2m1")
    assert [(r.variant, r.rep) for r in records] == [(v, k) for k in (1, 2, 3)
                                                     for v in ("stock", "plugin-izb-distopt", "plugin-bfzb-distopt")]
    own = {r.variant: _after_script(r.command)[len(flags):] for r in records}
    dist_opt = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
    vs = ["--num-layers-per-virtual-pipeline-stage", "2"]
    assert own["stock"] == dist_opt
    assert own["plugin-izb-distopt"][:6] == [*vs, "--pipeline-schedule", "interleaved-zb", *dist_opt[:2]]
    assert own["plugin-bfzb-distopt"][:6] == [*vs, "--pipeline-schedule", "breadth-first-zb", *dist_opt[:2]]
    assert _flag(flags, "--micro-batch-size") == "4" and _flag(flags, "--global-batch-size") == "4"
    given = _options("--cpu-pair", "p2m1", "--reps", "1", "--iters", "4", "--variants", "stock,plugin-izb-distopt")
    assert (given.reps, given.iters, given.variants) == (1, 4, "stock,plugin-izb-distopt")
    with pytest.raises(SystemExit, match="--cpu-pair p2m1 runs --model cpu-p2-m1: drop --model cpu-p4-m2"):
        _options("--cpu-pair", "p2m1", "--model", "cpu-p4-m2")


def test_pinning_gives_each_rank_a_core_of_its_own() -> None:
    assert commands.pin_cores(2, [5, 3, 1], "--cpu-pair p2m1") == [1, 3]
    with pytest.raises(SystemExit, match=r"--cpu-pair p2m1 pins each of its 2 ranks to a core of its own, and this "
                                         r"process may run on 1 core\(s\) \(0\): run it where 2 cores are free"):
        commands.pin_cores(2, [0], "--cpu-pair p2m1")
    a = _options("--cpu-smoke", "--pin-cores")
    a.cores = [0, 1]
    assert commands.run_env(a, "/opt/mlm")["BFPP_CPU_CORES"] == "0,1"
    assert "BFPP_CPU_CORES" not in commands.run_env(_options("--cpu-smoke"), "/opt/mlm")


def test_round_ratios_pair_each_run_with_the_baseline_of_its_round() -> None:
    """Round k's ratio is a variant's tokens/s over the baseline's in round k (not over the median): drift between
    rounds cancels. A failed run has no round; the summary gets each variant's range, ab_rounds.md the table."""
    ms = {("stock", 1): 1000.0, ("a", 1): 900.0, ("b", 1): 800.0,
          ("stock", 2): 2000.0, ("a", 2): 1600.0, ("b", 2): 1000.0}
    runs = {key: _log(key[0], ms=v) for key, v in ms.items()}
    records = [_record(v, rep, returncode=1 if (v, rep) == ("b", 2) else 0) for v, rep in ms]
    rounds = report.round_ratios(records, runs, "stock", 2)
    got = {(x["variant"], x["round"]): x["ratio_tokens_per_s"] for x in rounds}
    assert got == {("stock", 1): 1.0, ("a", 1): pytest.approx(1000 / 900), ("b", 1): pytest.approx(1000 / 800),
                   ("stock", 2): 1.0, ("a", 2): pytest.approx(2000 / 1600)}
    rows, _ = _summary(runs, records)
    report.with_round_ranges(rows, rounds)
    a = next(r for r in rows if r["variant"] == "a")
    assert (a["round_ratio_min"], a["round_ratio_max"]) == (pytest.approx(1000 / 900), pytest.approx(1.25))
    text = report.rounds_markdown("T", rows, rounds, {"command": "python scripts/ab_megatron.py --cpu-pair p2m1",
                                                      "descriptions": {"a": "schedule A"}, "iterations": 10,
                                                      "warmup": 3, "cores": [0, 1], "load_before": [0.5, 0.4, 0.3]})
    assert "| variant | what runs | round 1 | round 2 | range |" in text
    assert "| stock |  | 16384 tok/s | 8192 tok/s | 1.00 |" in text
    assert "| a | schedule A | 1.111 | 1.250 | 1.111-1.250 |" in text and "| b |  | failed | failed | failed |" in text
    assert "`python scripts/ab_megatron.py --cpu-pair p2m1`" in text and "load average before: 0.50 0.40 0.30" in text


def test_layers_placed_apart_compare_the_grad_norm_at_the_first_iteration_only() -> None:
    """Stock without the layout's virtual stages initialises some layers from other seeds: the loss curve must agree,
    the grad norm only before the first update."""
    base = _log("stock")
    later = _log("p")
    later.iterations[3]["grad_norm"] *= 1.1
    assert report.same_model_problem(later, base, 5e-3, 2e-2, placed_alike=False) is None
    assert report.same_model_problem(later, base, 5e-3, 2e-2).startswith("grad norm 1.3574 vs 1.234 at iteration 4")
    assert report.same_model_problem(_log("p", gnorm=1.5), base, 5e-3, 2e-2, placed_alike=False).startswith(
        "grad norm 1.5 vs 1.234 at iteration 1")
    assert report.same_model_problem(_log("p", drift=0.05), base, 5e-3, 2e-2, placed_alike=False).startswith(
        "lm loss")
