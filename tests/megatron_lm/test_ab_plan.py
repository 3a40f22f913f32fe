"""From plan to launch: `bfpp plan --json` on a tiny GPT, then `scripts/ab_megatron.py --plan` runs its top
candidate (ours) against stock Megatron at that layout, for real, on CPU (the driver's --cpu-smoke: gloo, fp32, the
test-only CPU shim) with Megatron-LM's unmodified `pretrain_gpt.py` (MEGATRON_LM_DIR, through the `mlm` fixture).
One short run each."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.support.paths import ROOT

# 4 layers at P = 2 (the search restricted to it: a model this small would run data-parallel), micro-batch 1,
# global batch 8 (M = 8): the plan's model, precision and batch; it searches the schedule, V, ZeRO and recomputation.
TINY_GPT = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--max-position-embeddings", "64", "--vocab-size", "128", "--tokenizer-type", "NullTokenizer", "--bf16",
            "--global-batch-size", "8", "--micro-batch-size", "1", "--pipeline-model-parallel-size", "2"]


def _megatron_arg(log: str, name: str) -> str:
    """A value from Megatron-LM's argument dump (`  name ........ value`)."""
    m = re.search(rf"^  {name} \.+ (\S+)$", log, re.M)
    assert m, f"{name} not in the log's arguments"
    return m.group(1)


def test_top_plan_launches_as_planned_against_stock(subprocesses, mlm, tmp_path: Path) -> None:
    env = dict(os.environ, MEGATRON_LM_DIR=str(mlm.original))
    r = subprocess.run([sys.executable, "-m", "megatron_bfpp.cli", "plan", "--hardware", "dgx-h100", "--gpus", "2",
                        "--top", "1", "--json", "--", *TINY_GPT], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    plan = tmp_path / "plan.json"
    plan.write_text(r.stdout)
    top = json.loads(r.stdout)["candidates"][0]
    c = top["config"]
    pp, vp, m, b = (c["pipeline_model_parallel_size"], c["virtual_pipeline_model_parallel_size"],
                    c["num_micro_batches"], c["micro_batch_size"])
    assert (pp, c["tensor_model_parallel_size"], c["data_parallel_size"]) == (2, 1, 1)  # a pipeline run on 2 ranks
    assert c["pipeline_schedule"] not in ("1f1b", "interleaved-1f1b"), c  # at M = 8 >= P one of ours wins

    out = tmp_path / "ab"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "ab_megatron.py"), "--plan", str(plan), "--cpu-smoke",
                        "--megatron-lm-dir", str(mlm.original), "--out", str(out), "--no-check",
                        "--stock-group-sizes", str(pp), "--iters", "3", "--warmup", "1"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = {row["variant"]: row for row in csv.DictReader((out / "ab_summary.csv").open())}
    assert list(rows) == ["stock", "ours"]
    assert all(row["status"] == "ok" and row["loss_check"] == "ok" for row in rows.values()), rows
    ours, stock = (out / "ours.rep1.log").read_text(), (out / "stock.rep1.log").read_text()
    # Both at the planned sizes and batch (stock interleaves over the same virtual stages: M >= P).
    for log in (ours, stock):
        assert (_megatron_arg(log, "pipeline_model_parallel_size"), _megatron_arg(log, "micro_batch_size"),
                _megatron_arg(log, "global_batch_size")) == (str(pp), str(b), str(b * m))
        assert _megatron_arg(log, "virtual_pipeline_model_parallel_size") == (str(vp) if vp > 1 else "None")
    # Ours ran the planned schedule through the plugin; stock ran Megatron's with its distributed optimizer.
    assert f"megatron_bfpp: installed pipeline schedule {c['pipeline_schedule']} (P={pp}, V={vp}, M={m}" in ours
    assert _megatron_arg(ours, "pipeline_schedule") == c["pipeline_schedule"]
    assert "megatron_bfpp" not in stock and _megatron_arg(stock, "use_distributed_optimizer") == "True"
    runs = json.loads((out / "ab_runs.json").read_text())["runs"]
    assert next(x for x in runs if x["variant"] == "ours")["command"][-len(top["megatron_args"]) - 2:-2] == \
        top["megatron_args"]  # the candidate's flags, then the timeline
    assert [x["variant"] for x in csv.DictReader((out / "ab_rounds.csv").open())] == ["stock", "ours"]
