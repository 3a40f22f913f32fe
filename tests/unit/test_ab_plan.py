"""The A/B driver and the SLURM scripts launching a `bfpp plan --json` candidate (megatron_bfpp/megatron/ab/plan_file.py
and the driver's --plan / --stock-plan), without starting a process: reading the file and its refusals, how a
candidate's flags divide, the conflicts with flags given beside it, and the commands of ours and stock. The real runs
(a plan produced by `bfpp plan`, launched on CPU) are tests/megatron_lm/test_ab_plan.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_bfpp.megatron.ab import cli, commands, plan_file
from megatron_bfpp.megatron.ab.commands import DIST_OPT, STOCK_INTERLEAVED

BASE = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64", "--vocab-size", "128", "--tokenizer-type", "NullTokenizer", "--bf16",
        "--init-method-std", "0.02"]


def _config(tp: int = 1, pp: int = 2, vp: int = 2, dp: int = 1, b: int = 1, m: int = 8, schedule: str = "breadth-first",
            zero: int = 3, recompute: bool = False) -> dict:
    """A candidate's `config` as `bfpp plan --json` writes it (the fields the launch reads)."""
    return {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
            "virtual_pipeline_model_parallel_size": vp, "data_parallel_size": dp, "micro_batch_size": b,
            "pipeline_schedule": schedule, "zero_stage": zero, "recompute": recompute, "num_micro_batches": m,
            "context_parallel_size": 1, "expert_model_parallel_size": 1}


OURS = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
        "--num-layers-per-virtual-pipeline-stage", "2", "--micro-batch-size", "1", "--global-batch-size", "8",
        "--pipeline-schedule", "breadth-first", "--zero-stage", "3", "--recompute-granularity", "full",
        "--recompute-method", "uniform", "--recompute-num-layers", "1"]
SECOND = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2", "--micro-batch-size", "1",
          "--global-batch-size", "8", "--pipeline-schedule", "1f1b", "--overlap-grad-reduce"]
STOCK = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]


def _write(tmp_path: Path, name: str = "plan.json", stock: bool = False, candidates: list | None = None) -> str:
    if candidates is None:
        candidates = ([{"config": _config(tp=2, pp=1, vp=1, b=2, m=4, schedule="1f1b", zero=1), "megatron_args": STOCK}]
                      if stock else
                      [{"config": _config(recompute=True), "megatron_args": OURS},
                       {"config": _config(vp=1, schedule="1f1b", zero=0), "megatron_args": SECOND}])
    path = tmp_path / name
    path.write_text(json.dumps({"megatron_base_args": BASE, "candidates": candidates, "stock": stock,
                                "rejected": [], "searched": 9, "simulated": 3, "notes": []}))
    return str(path)


def _options(*argv: str):
    """The driver's options, plans read and defaults applied, as main does."""
    a = cli.build_parser().parse_args(list(argv))
    ours, stock = cli.read_plans(a)
    cli.apply_defaults(a, ours)
    if ours is not None:
        cli.check_plan_options(a, ours, stock)
    return a, ours, stock


def _commands(*argv: str, impl: str = "local") -> tuple[list[str], dict[str, list[str]], dict]:
    """The flags every variant shares and each variant's own, as main builds them."""
    a, ours, stock = _options(*argv)
    lay = commands.plan_layout(a, ours, stock)
    flags = commands.common_flags(a, lay, impl)
    vs = commands.variants(a, lay, cli.stock_vp_at(lay))
    records = commands.plan(a, "/opt/mlm", Path("/out"), vs, flags)
    own = {}
    for r in records:
        after = r.command[r.command.index("/opt/mlm/pretrain_gpt.py") + 1:]
        assert after[: len(flags)] == flags, r.variant
        own[r.variant] = [f for f in after[len(flags):] if not f.endswith(".timeline.json") and f != "--timeline"]
        entry = r.command[: r.command.index("/opt/mlm/pretrain_gpt.py")]
        assert (entry[-2:] == ["-m", "megatron_bfpp.run_megatron_script"]) == next(v for v in vs
                                                                                   if v.name == r.variant).plugin
    return flags, own, lay


# ------------------------------------------------------------------------------------------------ the file

def test_read_plan_takes_the_candidate_and_its_flags(tmp_path: Path) -> None:
    path = _write(tmp_path)
    first = plan_file.read_plan(path)
    assert (first.number, first.stock, first.world, first.plugin) == (1, False, 2, True)
    assert first.base_args == tuple(BASE) and first.args == tuple(OURS)
    assert first.layout_args() == ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
                                   "--micro-batch-size", "1", "--global-batch-size", "8"]
    assert first.virtual_stage_args() == ["--num-layers-per-virtual-pipeline-stage", "2"]
    assert first.recompute_args() == OURS[-6:]
    assert first.own_args() == ["--pipeline-schedule", "breadth-first", "--zero-stage", "3"]
    assert first.summary() == "T=1 P=2 V=2 D=1 b=1 M=8 breadth-first ZeRO-3 recompute"
    second = plan_file.read_plan(path, 2)
    assert second.args == tuple(SECOND) and second.plugin and second.virtual_stage_args() == []
    stock = plan_file.read_plan(_write(tmp_path, "stock.json", stock=True), flag="--stock-plan", stock=True)
    assert not stock.plugin and stock.world == 2
    # Megatron's world size: T x CP x P x D (expert parallelism lies within D).
    wide = dict(_config(tp=2, pp=4, dp=4), context_parallel_size=2, expert_model_parallel_size=4)
    assert plan_file.PlannedRun("p", 1, False, (), (), wide).world == 64
    # Megatron's own schedule named outright is no plugin run either.
    assert not plan_file.PlannedRun("p", 1, False, (), ("--pipeline-schedule", "default"), {}).plugin


def test_flag_items_read_both_spellings_and_the_last_value_wins() -> None:
    flags = ["--a", "1", "--b=x y", "--switch", "--a", "2", "--c", "p", "q"]
    assert plan_file.flag_items(flags) == [("--a", ("1",)), ("--b", ("x y",)), ("--switch", ()), ("--a", ("2",)),
                                           ("--c", ("p", "q"))]
    assert plan_file.flag_values(flags)["--a"] == ("2",)
    assert plan_file.select(flags, ["--a", "--switch"]) == ["--a", "1", "--switch", "--a", "2"]
    assert plan_file.select(flags, ["--a", "--switch"], keep=False) == ["--b", "x y", "--c", "p", "q"]


@pytest.mark.parametrize("content, kwargs, message", [
    (None, {}, r"--plan {path}: no such file \(write one with `bfpp plan --json ... > FILE`\)"),
    ("{not json", {}, r"--plan {path}: not a `bfpp plan --json` output \("),
    ('{"candidates": []}', {}, r"--plan {path}: not a `bfpp plan --json` output \(no megatron_base_args"),
    ("stock", {}, r"--plan {path} is a `bfpp plan --stock` output .*: pass it as --stock-plan"),
    ("ours", {"flag": "--stock-plan", "stock": True}, r"--stock-plan {path} is not a `bfpp plan --stock` output"),
    ("ours", {"number": 3}, r"--candidate 3: {path} holds candidates 1 to 2"),
    ("ours", {"number": 0}, r"--candidate 0: {path} holds candidates 1 to 2"),
    ("empty", {}, r"--candidate 1: {path} holds no candidate \(nothing fit\)"),
    ("bare", {}, r"--plan {path}: candidate 1 has no megatron_args and config"),
    ("plugin-stock", {"flag": "--stock-plan", "stock": True},
     r"--stock-plan {path}: candidate 1 runs the plugin \(--pipeline-schedule breadth-first --zero-stage 3\)"),
], ids=["missing", "not-json", "not-a-plan", "stock-as-ours", "ours-as-stock", "no-such-candidate", "candidate-0",
        "empty", "no-megatron-args", "plugin-in-stock"])
def test_read_plan_refuses_naming_the_flag(tmp_path: Path, content: str | None, kwargs: dict, message: str) -> None:
    path = tmp_path / "p.json"
    if content == "stock":
        _write(tmp_path, "p.json", stock=True)
    elif content == "ours":
        _write(tmp_path, "p.json")
    elif content == "empty":
        _write(tmp_path, "p.json", candidates=[])
    elif content == "bare":
        _write(tmp_path, "p.json", candidates=[{"config": _config()}])
    elif content == "plugin-stock":
        _write(tmp_path, "p.json", stock=True, candidates=[{"config": _config(), "megatron_args": OURS}])
    elif content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit, match="^error: " + message.format(path=path)):
        plan_file.read_plan(str(path), **kwargs)


def test_conflicts_are_other_values_and_owned_flags_the_candidate_runs_without(tmp_path: Path) -> None:
    run = plan_file.read_plan(_write(tmp_path))
    assert plan_file.conflict(["--pipeline-model-parallel-size", "2", "--bf16", "--foo", "1"], run) is None
    assert plan_file.conflict(["--micro-batch-size=4"], run) == (
        "--micro-batch-size 4 against candidate 1's --micro-batch-size 1")
    assert plan_file.conflict(["--hidden-size", "128"], run) == (
        "--hidden-size 128 against candidate 1's --hidden-size 64")  # the base flags count too
    assert plan_file.conflict(["--use-distributed-optimizer"], run) == (
        "--use-distributed-optimizer, which candidate 1 runs without")
    assert plan_file.conflict(["--microbatch-group-size-per-virtual-pipeline-stage", "4"], run) == (
        "--microbatch-group-size-per-virtual-pipeline-stage 4, which candidate 1 runs without")
    with pytest.raises(SystemExit, match=r"candidate 1 runs on T x CP x P x D = 1 x 1 x 2 x 1 = 2 ranks, the launch "
                                         r"on 8 \(the job\): launch 2 ranks, or plan for 8 GPUs"):
        plan_file.check_world(run, 8, "--plan", "the job")
    plan_file.check_world(run, 2, "--plan", "the job")


# ------------------------------------------------------------------------------------------------ the driver

def test_ours_runs_the_candidate_and_stock_its_layout_at_its_best(tmp_path: Path) -> None:
    """Ours: exactly the candidate's flags through the script runner; stock: the unmodified script at the same sizes,
    virtual stages, batch and recomputation with the distributed optimizer and every overlap, per group size. Shared:
    the plan's base flags (the driver's training settings only where the plan sets none)."""
    flags, own, lay = _commands("--plan", _write(tmp_path), "--megatron-lm-dir", "/opt/mlm", "--gpus-per-node", "2")
    assert (lay["pp"], lay["vp"], lay["dp"], lay["m"], lay["gbs"], lay["seq"]) == (2, 2, 1, 8, 8, 64)
    assert list(own) == ["stock-g2", "stock-g4", "ours"]  # group sizes P and 2P where 2P divides M = 8
    assert own["ours"] == OURS
    layout = OURS[:4] + OURS[6:10]
    assert own["stock-g2"] == [*layout, *OURS[4:6], *DIST_OPT, *STOCK_INTERLEAVED,
                               "--microbatch-group-size-per-virtual-pipeline-stage", "2", *OURS[-6:]]
    assert own["stock-g4"][-7:-6] == ["4"]
    assert flags[flags.index("--num-layers"):][: len(BASE)] == BASE  # the plan's model, precision and features
    assert flags.count("--init-method-std") == 1 and flags[flags.index("--init-method-std") + 1] == "0.02"
    assert flags.count("--bf16") == 1 and flags.count("--tokenizer-type") == 1 and "--mock-data" in flags
    assert flags[flags.index("--transformer-impl") + 1] == "local" and flags[flags.index("--lr") + 1] == "1.5e-4"
    assert "--tensor-model-parallel-size" not in flags  # each variant carries its layout


def test_on_cpu_a_plan_runs_in_fp32_on_its_world_size(tmp_path: Path) -> None:
    flags, own, lay = _commands("--plan", _write(tmp_path), "--cpu-smoke", "--stock-group-sizes", "2")
    assert "--bf16" not in flags and flags[flags.index("--distributed-backend") + 1] == "gloo"
    assert list(own) == ["stock", "ours"] and lay["world"] == 2
    a, _, _ = _options("--plan", _write(tmp_path), "--cpu-smoke")
    assert (a.nnodes, a.gpus_per_node, a.iters, a.reps, a.variants) == (1, 2, 6, 1, "stock,ours")


def test_stock_plan_runs_its_candidate_exactly(tmp_path: Path) -> None:
    flags, own, lay = _commands("--plan", _write(tmp_path), "--stock-plan", _write(tmp_path, "s.json", stock=True),
                                "--gpus-per-node", "2")
    assert own == {"stock": STOCK, "ours": OURS}  # another layout (T = 2, P = 1) than ours: its own
    assert not cli.same_layers(lay, cli.stock_vp_at(lay))


def test_stock_falls_back_to_1f1b_under_a_plan_at_m_below_p(tmp_path: Path) -> None:
    layout = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "4", "--micro-batch-size", "1",
              "--global-batch-size", "2"]
    few = [{"config": _config(pp=4, vp=2, m=2),
            "megatron_args": [*layout, "--num-layers-per-virtual-pipeline-stage", "1", "--pipeline-schedule",
                              "breadth-first", "--zero-stage", "3"]}]
    flags, own, lay = _commands("--plan", _write(tmp_path, candidates=few), "--gpus-per-node", "4")
    assert lay["m"] < lay["pp"] and own["stock"] == [*layout, *DIST_OPT]  # 1F1B: no virtual stages
    laid = [{"config": _config(pp=4, vp=2, m=2),
             "megatron_args": ["--pipeline-model-parallel-size", "4", "--pipeline-model-parallel-layout",
                               "Et|t|t|t|t|t|t|tL", "--micro-batch-size", "1", "--global-batch-size", "2",
                               "--pipeline-schedule", "breadth-first"]}]
    with pytest.raises(SystemExit, match="stock cannot interleave at M = 2 < P = 4, and the candidate's "
                                         "--pipeline-model-parallel-layout places V = 2 stages per rank: give "
                                         "stock's own plan"):
        _commands("--plan", _write(tmp_path, "laid.json", candidates=laid), "--gpus-per-node", "4")


@pytest.mark.parametrize("argv, message", [
    (("--model", "13b"), "--model 13b with --plan {plan}: the plan's megatron_base_args are the model; drop --model"),
    (("--pp", "4"), "--pp 4 conflicts with --plan {plan}: --pipeline-model-parallel-size 4 against candidate 1's "
                    "--pipeline-model-parallel-size 2; drop --pp"),
    (("--layers-per-stage", "1"), "--layers-per-stage 1 conflicts with --plan {plan}: "
                                  "--num-layers-per-virtual-pipeline-stage 1 against candidate 1's"),
    (("--gpus-per-node", "4"), r"--plan {plan}: candidate 1 runs on T x CP x P x D = 1 x 1 x 2 x 1 = 2 ranks, the "
                               r"launch on 4 \(--nnodes 1 x --gpus-per-node 4\)"),
    (("--", "--zero-stage", "1"), "the flags after -- conflict with --plan {plan}: --zero-stage 1 against "
                                  "candidate 1's --zero-stage 3; drop them"),
    (("--variant-flags", "ours=--overlap-grad-reduce"), "--variant-flags ours=... conflicts with --plan {plan}: "
                                                        "--overlap-grad-reduce, which candidate 1 runs without"),
    (("--stock-plan", "{stock}", "--stock-group-sizes", "2"), "--stock-group-sizes with --stock-plan {stock}: stock "
                                                              "runs its candidate's own group size"),
    (("--stock-plan", "{stock}", "--variant-flags", "stock=--micro-batch-size 1"),
     "--variant-flags stock=... conflicts with --stock-plan {stock}: --micro-batch-size 1 against candidate 1's "
     "--micro-batch-size 2"),
    (("--cpu-pair", "p2m1"), "--cpu-pair p2m1 runs its own model and layout: drop --plan or --cpu-pair"),
], ids=["model", "pp", "layers-per-stage", "world", "extra", "variant-flags", "group-sizes", "stock-variant-flags",
        "cpu-pair"])
def test_the_driver_refuses_what_conflicts_with_the_plan(tmp_path: Path, argv: tuple[str, ...], message: str) -> None:
    plan, stock = _write(tmp_path), _write(tmp_path, "s.json", stock=True)
    argv = tuple(x.format(stock=stock) for x in argv)
    extra = argv[argv.index("--"):] if "--" in argv else ()
    head = argv[: len(argv) - len(extra)]
    if "--gpus-per-node" not in head:
        head += ("--gpus-per-node", "2")
    with pytest.raises(SystemExit, match="^error: " + message.format(plan=plan, stock=stock)):
        _options("--plan", plan, *head, *extra)
    _options("--plan", plan, "--gpus-per-node", "2", "--mbs", "1", "--pp", "2", "--", "--bf16")  # the same: fine


@pytest.mark.parametrize("argv, message", [
    (("--candidate", "2"), "--candidate needs --plan PLAN.json"),
    (("--stock-plan", "s.json"), "--stock-plan needs --plan PLAN.json"),
    (("--plan", "{plan}", "--stock-candidate", "2"), "--stock-candidate needs --stock-plan STOCK.json"),
    (("--pin-cores",), "--pin-cores pins the ranks of a CPU run: add --cpu-smoke"),
])
def test_options_that_need_another(tmp_path: Path, argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(SystemExit, match="^error: " + message):
        _options(*(x.format(plan=_write(tmp_path)) for x in argv))


# ------------------------------------------------------------------------------------------------ SLURM's reader

def test_the_slurm_reader_prints_the_flags_as_shell_assignments(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import shlex

    path = _write(tmp_path)
    assert plan_file.shell_main(["--plan", path, "--candidate", "2", "--world", "2", "--",
                                 "--pipeline-model-parallel-size", "2"]) == 0
    lines = dict(line.split("=", 1) for line in capsys.readouterr().out.splitlines())
    assert shlex.split(lines["plan_flags"].strip("()")) == [*BASE, *SECOND]
    assert (lines["plan_has_tokenizer"], lines["plan_has_impl"], lines["plan_name"]) == ("1", "0", "plan-plan-c2")
    assert shlex.split(lines["plan_summary"]) == [f"{path} candidate 2: T=1 P=2 V=1 D=1 b=1 M=8 1f1b ZeRO-0"]
    with pytest.raises(SystemExit, match=r"the job's settings conflict with it: --zero-stage 3, which candidate 2 runs "
                                         r"without \(given beside --plan: PP=4\)"):
        plan_file.shell_main(["--plan", path, "--candidate", "2", "--world", "2", "--launch-flags", "PP=4", "--",
                              "--zero-stage", "3"])
    with pytest.raises(SystemExit, match=r"= 2 ranks, the launch on 16 \(2 node\(s\)\)"):
        plan_file.shell_main(["--plan", path, "--world", "16", "--launch", "2 node(s)"])
