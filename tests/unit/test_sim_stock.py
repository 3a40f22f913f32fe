"""Stock Megatron at its best in the simulator and planner (`stock_space`, `STOCK`, `stock_schedule`, `bfpp plan
--stock`): only what stock Megatron-Core runs, its fallback to 1F1B at M < P, its parameter gather overlapped with
the optimizer step, and the benchmarks' "vs Megatron" ratios built on it. Small configurations: pure Python, fast."""

import dataclasses
import json
from fractions import Fraction

import pytest

from megatron_bfpp.megatron.sim_cli import plan_main
from megatron_bfpp.schedule import ScheduleSpec
from megatron_bfpp.sim import (
    STOCK, Config, Costs, SearchSpace, analytic_costs, check_config, get_hardware, get_model, plan, predict,
    simulate_schedule, stock_schedule, stock_space,
)
from megatron_bfpp.sim.planner import enumerate_configs
from tests.support.paths import load_script
import tests.support.megatron_parser  # noqa: F401  (Megatron's parser: imported once, at collection)

H200 = get_hardware("h200")
GPT13 = get_model("gpt-1.3b")


def _megatron_accepts_interleaving(pp: int, m: int, g: int) -> bool:
    """Megatron-Core's checks in forward_backward_pipelining_with_interleaving (schedules.py): the group size lies
    in [P, M], and the last group holds none or at least P micro-batches."""
    return pp <= g <= m and (m % g == 0 or m % g >= pp)


@pytest.mark.parametrize("batch", [8, 32, 128])
def test_stock_space_holds_only_what_stock_megatron_runs(batch: int) -> None:
    configs, bad = enumerate_configs(GPT13, H200, 16, batch, STOCK)
    assert configs
    kinds = {c.schedule for c in configs}
    assert kinds <= {"1f1b", "interleaved-1f1b"} and "1f1b" in kinds
    for c in configs:
        assert c.zero_stage == 1 and not c.split_backward  # distributed optimizer; no ZeRO-2/3, no split backward
        assert c.dp_overlap and c.p2p_overlap and not (c.w_at_input_grad or c.w_reruns_input_grad)
        if c.schedule == "1f1b":
            assert c.vp == 1 and not c.param_gather_with_optimizer  # Megatron's flag needs interleaving
        else:
            g = c.group_size if c.group_size is not None else c.pp
            assert c.vp >= 2 and c.microbatches >= c.pp and _megatron_accepts_interleaving(c.pp, c.microbatches, g)
    interleaved = [c for c in configs if c.schedule == "interleaved-1f1b"]
    if interleaved:  # tried with and without the optimizer-step overlap
        assert {c.param_gather_with_optimizer for c in interleaved} == {False, True}
    # Interleaved layouts at M < P are refused, each with its reason.
    assert all(c.schedule == "interleaved-1f1b" and c.microbatches < c.pp for c, why in bad
               if c is not None and "M >= P" in why)
    for c in configs[:: max(1, len(configs) // 12)]:
        check_config(GPT13, H200, c)  # builds the schedule: the kind's own rules hold


def test_stock_schedule_falls_back_to_1f1b_below_one_microbatch_per_rank() -> None:
    assert stock_schedule(4, 2, 2) == ("1f1b", 1)  # M < P: interleaving refused, 1F1B without virtual stages
    assert stock_schedule(8, 8, 4) == ("1f1b", 1)
    assert stock_schedule(4, 2, 4) == ("interleaved-1f1b", 2)
    assert stock_schedule(4, 2, 6) == ("interleaved-1f1b", 2)  # G = M = 6 is in [P, M]
    assert stock_schedule(4, 1, 2) == ("1f1b", 1)
    # A layout where every split into stages has M < P: stock plans 1F1B only, and says where it fell back.
    space = SearchSpace(tp_sizes=(1,), pp_sizes=(4,), micro_batch_sizes=(1,), recompute=(False,))
    stock = plan(GPT13, H200, 16, 8, stock_space(space), top=3)
    assert stock.candidates and all(p.config.schedule == "1f1b" and p.config.vp == 1 for p in stock.candidates)
    assert stock.stock and stock.stock_fallback == [(1, 4, 4, 1, 2)]
    assert any("M >= P" in r.reason for r in stock.rejected)
    ours = plan(GPT13, H200, 16, 8, space, top=3)
    assert not ours.stock and ours.stock_fallback == [(1, 4, 4, 1, 2)]
    looped = [c for c in ours.to_dict()["candidates"] if c["config"]["virtual_pipeline_model_parallel_size"] >= 2]
    assert looped and all(c["stock_at_layout"] == {"pipeline_schedule": "1f1b",
                                                   "virtual_pipeline_model_parallel_size": 1, "falls_back": True}
                          for c in looped)


def test_stock_space_keeps_other_restrictions_and_refuses_what_stock_cannot_run() -> None:
    narrowed = stock_space(SearchSpace(schedules=("1f1b", "breadth-first"), zero_stages=(1, 3), tp_sizes=(2,),
                                       dp_overlap=False, w_at_input_grad=True))
    assert narrowed.schedules == ("1f1b",) and narrowed.zero_stages == (1,) and narrowed.tp_sizes == (2,)
    assert narrowed.stock and narrowed.dp_overlap and not narrowed.w_at_input_grad
    with pytest.raises(ValueError, match="stock Megatron runs 1f1b and interleaved-1f1b"):
        stock_space(SearchSpace(schedules=("breadth-first", "interleaved-zb")))
    with pytest.raises(ValueError, match="distributed optimizer"):
        stock_space(SearchSpace(zero_stages=(2, 3)))
    assert STOCK == stock_space()


def test_param_gather_with_optimizer_step_waits_for_one_chunk() -> None:
    """Megatron's --overlap-param-gather-with-optimizer-step: the first chunk's all-gather starts during the other
    chunks' optimizer steps, so the first forward waits only for what is left of it; the other chunks' gathers
    follow from the step's start."""
    sched = ScheduleSpec("interleaved-1f1b", 2, 2, 4, zero_stage=1, optimizer_step=False).build()  # stock's optimizer
    gather, lead = 3.0, 2.0

    def first_forward_start(lead_s: float) -> tuple[float, float]:
        costs = Costs.uniform(4, 2, 1.0, 2.0, t_param_sync=gather, t_optimizer=2.5)
        costs.param_sync_lead = [lead_s, lead_s]
        res = simulate_schedule(sched, costs)
        f = next(e for e in res.events if e.rank == 0 and e.name == "F0:0")
        second = next(e for e in res.events if e.rank == 0 and e.stream == "dp" and e.name == "GATHER2")
        return f.start, second.start

    assert first_forward_start(0.0) == (gather, gather)
    assert first_forward_start(lead) == (gather - lead, gather - lead)
    assert first_forward_start(5.0) == (0.0, 0.0)  # wholly hidden: the next gather starts with the step


def test_param_gather_with_optimizer_step_costs_and_rules() -> None:
    cfg = Config(2, 2, 4, 4, 1, 4, "interleaved-1f1b", 1, False)  # 1.3B: 3 layers per stage
    on = Config(2, 2, 4, 4, 1, 4, "interleaved-1f1b", 1, False, param_gather_with_optimizer=True)
    part = cfg.partition(GPT13)
    off_costs, on_costs = analytic_costs(H200, part, cfg), analytic_costs(H200, part, on)
    assert off_costs.param_sync_lead == [0.0, 0.0] and max(off_costs.param_sync_buckets) == 3
    assert on_costs.param_sync_buckets == [1] * 8  # Megatron turns bucketing off with the flag
    opt = on_costs.optimizer
    for r in range(2):  # the rank's other chunks step after its first one, then the slowest rank finishes
        assert on_costs.param_sync_lead[r] == pytest.approx(
            max(opt) - opt[r] * part.stage_params(r) / part.rank_params(r))
        assert 0 < on_costs.param_sync_lead[r] < max(opt)
    assert predict(GPT13, H200, on).to_dict()["config"]["overlap_param_gather_with_optimizer_step"] is True
    for bad in (Config(2, 2, 4, 4, 1, 4, "breadth-first", 1, False, param_gather_with_optimizer=True),
                Config(2, 2, 4, 4, 1, 4, "interleaved-1f1b", 3, False, param_gather_with_optimizer=True),
                Config(2, 2, 4, 4, 1, 4, "interleaved-1f1b", 1, False, dp_overlap=False,
                       param_gather_with_optimizer=True),
                Config(2, 2, 1, 4, 1, 4, "1f1b", 1, False, param_gather_with_optimizer=True)):
        with pytest.raises(ValueError, match="--overlap-param-gather-with-optimizer-step"):
            check_config(GPT13, H200, bad)


def _plan_json(capsys: pytest.CaptureFixture, *argv: str, gpus: int = 16) -> tuple[int, dict]:
    code = plan_main(["--model", "gpt-1.3b", "--hardware", "h200", "--gpus", str(gpus), "--global-batch-size", "8",
                      "--json", *argv])
    return code, json.loads(capsys.readouterr().out)


def test_cli_stock_flag_reaches_the_stock_search(capsys: pytest.CaptureFixture) -> None:
    code, stock = _plan_json(capsys, "--stock")
    assert code == 0 and stock["stock"] is True
    configs = [c["config"] for c in stock["candidates"]]
    assert {c["pipeline_schedule"] for c in configs} <= {"1f1b", "interleaved-1f1b"}
    assert {c["zero_stage"] for c in configs} == {1}
    assert any(c["overlap_param_gather_with_optimizer_step"] for c in configs)  # only the stock search tries it
    fallback = stock["stock_fallback"]
    assert fallback["runs_instead"] == {"pipeline_schedule": "1f1b", "virtual_pipeline_model_parallel_size": 1}
    assert "[P, M]" in fallback["rule"] and {"pipeline_model_parallel_size": 4, "num_micro_batches": 2,
                                             "tensor_model_parallel_size": 1, "data_parallel_size": 4,
                                             "micro_batch_size": 1} in fallback["layouts"]
    assert all(0 < c["step_lower_bound_s"] <= c["step_time_s"] * (1 + 1e-12)  # equal where the bound is exact
               for c in stock["candidates"])
    for argv, message in ((("--pipeline-schedule", "breadth-first"), "drop --pipeline-schedule breadth-first"),
                          (("--zero-stage", "3"), "drop --zero-stage"),
                          (("--no-overlap-p2p-communication",), "every overlap on"),
                          (("--use-distributed-optimizer",), "every overlap on"),
                          (("--split-backward-w", "at-i"), "no split backward")):
        assert plan_main(["--model", "gpt-1.3b", "--hardware", "h200", "--gpus", "16", "--global-batch-size", "8",
                          "--stock", *argv]) == 2
        assert message in capsys.readouterr().err


def test_cli_plan_without_stock_searches_ours(capsys: pytest.CaptureFixture) -> None:
    code, ours = _plan_json(capsys, gpus=8)  # (8 GPUs: a smaller search than 16)
    assert code == 0 and ours["stock"] is False
    assert not any(c["config"]["overlap_param_gather_with_optimizer_step"] for c in ours["candidates"])
    # The JSON fields of before keep their names.
    assert {"candidates", "rejected", "searched", "simulated", "notes"} <= set(ours)
    assert {"config", "tflops_per_gpu", "step_time_s", "peak_memory_gib", "fits", "mfu", "bubble_fraction",
            "exposed_dp_s", "exposed_pp_s"} <= set(ours["candidates"][0])
    assert all(0 < c["step_lower_bound_s"] <= c["step_time_s"] * (1 + 1e-12)  # equal where the bound is exact
               for c in ours["candidates"])


def _bench(name: str):
    return load_script(f"bench/{name}.py", f"bench_{name}")


def test_benchmark_ratios_use_the_stock_search(tmp_path, monkeypatch) -> None:
    """The "vs Megatron" ratios of README.md and docs/simulator.md: bench/regime_table.py divides the planned best of
    ours by `bfpp plan --stock`'s best in the same space, and bench/paper_reproduction.py's "Megatron today" is that
    same search."""
    regime = _bench("regime_table")
    assert regime.sides_of(SearchSpace()) == {"ours": SearchSpace(), "stock": STOCK}
    # (on the balanced layouts, unrefined, as every method of the paper reproduction)
    assert _bench("paper_reproduction").METHODS["megatron_today"][1] == dataclasses.replace(STOCK,
                                                                                            refine_layouts=False)
    # Both searched at Megatron's default split here (free layouts: several times the configurations).
    sides = regime.sides_of(SearchSpace(search_layouts=False))
    assert sides["stock"] == dataclasses.replace(STOCK, search_layouts=False)
    row, = regime.regime_rows(GPT13, H200, 16, [Fraction(1, 2)], sides)
    ours = plan(GPT13, H200, 16, 8, sides["ours"], top=1).candidates[0]
    stock = plan(GPT13, H200, 16, 8, sides["stock"], top=1).candidates[0]
    assert row["stock_tflops_per_gpu"] == stock.tflops_per_gpu and row["stock_schedule"] == stock.config.schedule
    assert row["ratio"] == pytest.approx(ours.tflops_per_gpu / stock.tflops_per_gpu)
    # Each side's stage layout, memory, step and bound, and load.
    for side, p in (("ours", ours), ("stock", stock)):
        assert row[f"{side}_pipeline_model_parallel_layout"] == "even"
        assert row[f"{side}_peak_memory_gib"] == p.peak_memory_gib
        assert row[f"{side}_step_lower_bound_s"] == p.step_lower_bound_s <= p.step_time_s
        assert row[f"{side}_rank_load_max_over_mean"] == p.rank_load_max_over_mean
    assert row["what_if"] is None and set(row) <= set(regime.FIELDS)
    assert row["stock_can_interleave"] is True and "| 1/2 | 8 |" in regime.markdown([row])
    # The summary line reads the written table back.
    monkeypatch.setattr(regime, "RESULTS", tmp_path)
    regime.write_csv([row], tmp_path / "regime_small.csv")
    assert regime.summary(["small", "absent"]).splitlines()[-1] == (
        f"| small | {row['ratio']:.3f}x ({row['ratio_at_any_bound']:.3f}x) |")


def test_regime_tables_read_each_model_as_bfpp_plan_does() -> None:
    """bench/regime_table.py builds both sides from one `read_plan` of the preset's and the table's flags: what
    they fix (FP8, expert-tensor parallelism, sequence parallelism) holds for ours and for stock alike, and the
    what-if changes ours only."""
    regime = _bench("regime_table")
    h100 = get_hardware("dgx-h100")
    model, sides = regime.table_inputs("mixtral-8x7b", h100, 64, ["--sequence-parallel", "--fp8-format", "hybrid",
                                                                  "--fp8-recipe", "tensorwise",
                                                                  "--expert-tensor-parallel-size", "1"], 16)
    assert model.is_moe and model.num_experts == 8 and model.num_layers == 32
    assert sides["stock"] == stock_space(sides["ours"])
    for space in sides.values():
        assert space.fp8 == "tensorwise" and space.etp == 1 and space.sequence_parallel and space.search_layouts
        assert space.ep_choices(model) == (1, 2, 4, 8)
    # The named tables read (Megatron's parser and the plan's checks) and keep their models apart.
    for name, table in regime.TABLES.items():
        model, sides = regime.table_inputs(table.model, get_hardware(table.hardware), table.gpus, table.flags, 64)
        assert model.name == table.model and sides["stock"].stock, name
    _, fp8 = regime.table_inputs(*(lambda t: (t.model, get_hardware(t.hardware), t.gpus, t.flags))(
        regime.TABLES["llama3-70b-h100-fp8"]), 64)
    assert fp8["ours"].fp8 == fp8["stock"].fp8 == "tensorwise" and fp8["ours"].tp_comm_overlap
    what_if = regime.sides_of(SearchSpace(), ("output-layer-over-pipeline",))
    assert what_if["ours"] == SearchSpace(output_layer_over_pipeline=True) and what_if["stock"] == STOCK
    with pytest.raises(ValueError, match="--what-if"):
        regime.sides_of(SearchSpace(), ("no-such",))
