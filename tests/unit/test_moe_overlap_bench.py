"""bench/moe_overlap.py on a small MoE model: each side is the plan it says (stock the better of its search with and
without Megatron's combined 1F1B, ours paired the better of ours with and without the paired order), and the
tables and CSV carry them."""

from __future__ import annotations

import csv
from fractions import Fraction

from megatron_bfpp.megatron.plan_flags import SearchOptions
from megatron_bfpp.sim import get_hardware
from tests.support.paths import load_script
import tests.support.megatron_parser  # noqa: F401  (Megatron's parser: imported once, at collection)

bench = load_script("bench/moe_overlap.py", "bench_moe_overlap")
H100 = get_hardware("dgx-h100")
FLAGS = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "2048",
         "--max-position-embeddings", "2048", "--bf16", "--tokenizer-type", "NullTokenizer", "--vocab-size", "32000",
         "--num-experts", "8", "--moe-token-dispatcher-type", "alltoall", "--disable-bias-linear", "--swiglu"]
RESTRICT = ["--expert-model-parallel-size", "4", "--micro-batch-size", "1", "--pipeline-model-parallel-size", "2"]


def test_sides_are_the_plans_they_name(tmp_path) -> None:
    row, = bench.moe_rows(FLAGS, "small", H100, 8, [Fraction(4)], RESTRICT)
    flags = [*FLAGS, *RESTRICT, "--global-batch-size", "32"]
    stock = [bench.best_plan(f, H100, 8, SearchOptions(recompute="off", stock=True))
             for f in (flags, [*flags, bench.STOCK_OVERLAP])]
    ours = bench.best_plan(flags, H100, 8, SearchOptions(recompute="off"))
    paired = bench.best_plan([*flags, bench.PAIRED], H100, 8, SearchOptions(recompute="off"))
    assert row["stock_step_time_s"] == min(p.step_time_s for p in stock)
    assert row["ours_step_time_s"] == ours.step_time_s and row["ours_merged_actions"] == 0
    assert row["paired_step_time_s"] == min(ours.step_time_s, paired.step_time_s)
    assert paired.config.paired_moe_a2a_overlap and paired.paired_actions > 0
    assert row["recovered_share"] == (ours.step_time_s - row["paired_step_time_s"]) / ours.exposed_moe_a2a_s
    assert row["ours_exposed_a2a_share"] == ours.exposed_moe_a2a_s / ours.step_time_s > 0
    text = bench.markdown([row])
    assert "**small**" in text and "| 4 | 32 |" in text and "ours, paired order available" in text
    assert "small: ours' exposed all-to-all" in bench.findings([row])
    bench.write_csv([row], tmp_path / "rows.csv")
    read, = csv.DictReader((tmp_path / "rows.csv").open())
    assert list(read) == bench.FIELDS and float(read["paired_step_time_s"]) > 0
