"""Per-layer CUDA graphs under the plugin's schedules, refused at argument validation where they would be wrong.

- TransformerEngine's graphs (`--cuda-graph-impl transformer_engine`) are captured by Megatron-LM's training loop
  in Megatron's own schedule order into one memory pool, and replayed in the order the running schedule calls the
  layers: allowed only where the plugin's per-rank order of F and B equals Megatron's (interleaved-1f1b, 1f1b).
- Megatron's local graphs (`--cuda-graph-impl local`) are built only by Megatron's own schedule functions:
  refused under every plugin schedule.

Megatron's side of the comparison comes from Megatron's own functions (validation.py); these tests pin what the
comparison must find for the plugin's builders.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import megatron_bfpp.megatron as bm
from megatron_bfpp.megatron.check import parse_megatron_args
from tests.support.paths import subprocess_pythonpath

BASE = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "1", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "128", "--train-iters", "4", "--lr", "1e-3", "--mock-data"]
TE = ["--cuda-graph-impl", "transformer_engine"]


def _flags(schedule: str, pp: int, layers_per_virtual: int | None, gbs: int, *extra: str) -> list[str]:
    flags = [*BASE, "--pipeline-model-parallel-size", str(pp), "--global-batch-size", str(gbs),
             "--pipeline-schedule", schedule, *extra]
    if layers_per_virtual:
        flags += ["--num-layers-per-virtual-pipeline-stage", str(layers_per_virtual)]
    return flags


# Megatron's order: interleaved 1F1B with its group size (default P), or 1F1B at V = 1 (and at P = 1).
SAME_ORDER = [
    ("interleaved-1f1b", 2, 2, 8, ()),
    ("interleaved-1f1b", 4, 1, 8, ()),
    ("interleaved-1f1b", 2, 2, 12, ("--microbatch-group-size-per-virtual-pipeline-stage", "3")),
    ("1f1b", 4, None, 8, ()),
    ("1f1b", 3, None, 2, ("--num-layers", "6")),  # M < P: every rank warms up with all of its micro-batches
    ("1f1b", 1, None, 4, ()),
]


@pytest.mark.parametrize("schedule, pp, lpv, gbs, extra", SAME_ORDER,
                         ids=["interleaved-P2-M8", "interleaved-P4-M8", "interleaved-P2-M12-G3", "1f1b-P4-M8",
                              "1f1b-P3-M2", "1f1b-P1-M4"])
def test_transformer_engine_graphs_accepted_in_megatrons_order(schedule, pp, lpv, gbs, extra) -> None:
    cfg = bm.validate_args(parse_megatron_args(_flags(schedule, pp, lpv, gbs, *extra, *TE), pp))
    assert cfg.pipeline_schedule == schedule


OTHER_ORDER = [
    ("breadth-first", 2, 2, 8, (), 0),  # rank 0: all forwards of chunk 0 before chunk 1's; Megatron interleaves at P
    ("breadth-first", 2, 2, 2, (), 1),  # rank 0 warms up with everything in both; rank 1 does not
    ("breadth-first", 4, 1, 16, ("--microbatch-group-size-per-virtual-pipeline-stage", "4"), 0),
]


@pytest.mark.parametrize("schedule, pp, lpv, gbs, extra, rank", OTHER_ORDER,
                         ids=["breadth-first-P2-M8", "breadth-first-P2-M2", "breadth-first-P4-M16-G4"])
def test_transformer_engine_graphs_refused_in_another_order(schedule, pp, lpv, gbs, extra, rank) -> None:
    with pytest.raises(bm.ConfigError) as e:
        bm.validate_args(parse_megatron_args(_flags(schedule, pp, lpv, gbs, *extra, *TE), pp))
    msg = str(e.value)
    assert msg.startswith("--cuda-graph-impl transformer_engine (TransformerEngine per-layer CUDA graphs) with "
                          f"--pipeline-schedule {schedule}"), msg
    assert f"on pipeline rank {rank} " in msg and "use --cuda-graph-impl none" in msg, msg
    assert "--pipeline-schedule interleaved-1f1b (Megatron's order)" in msg, msg
    # Without the graphs the same configuration is fine: the refusal is the graphs' order, nothing else.
    bm.validate_args(parse_megatron_args(_flags(schedule, pp, lpv, gbs, *extra), pp))


@pytest.mark.parametrize("schedule, pp, lpv, sharding", [
    ("breadth-first", 2, 2, ("--zero-stage", "1")),
    ("interleaved-1f1b", 2, 2, ()),
    ("1f1b", 2, None, ()),
    ("1f1b", 1, None, ()),
], ids=["breadth-first-zero1", "interleaved-1f1b", "1f1b-P2", "1f1b-P1"])
def test_local_graphs_refused_under_the_plugins_schedules(schedule, pp, lpv, sharding) -> None:
    with pytest.raises(bm.ConfigError) as e:
        bm.validate_args(parse_megatron_args(_flags(schedule, pp, lpv, 8, *sharding, "--cuda-graph-impl", "local"),
                                             pp))
    msg = str(e.value)
    assert msg.startswith(f"--cuda-graph-impl local (Megatron's local per-layer CUDA graphs) with "
                          f"--pipeline-schedule {schedule}"), msg
    assert "never built" in msg and "use --cuda-graph-impl none" in msg and "--pipeline-schedule default" in msg


def test_graphs_accepted_under_megatrons_own_schedule() -> None:
    for impl in ("local", "transformer_engine"):
        cfg = bm.validate_args(parse_megatron_args(_flags("default", 2, 2, 8, "--cuda-graph-impl", impl), 2))
        assert not cfg.uses_runtime


def test_check_tool_refuses_before_any_process_group(subprocesses) -> None:
    """`python -m megatron_bfpp.megatron.check` (no GPU, no process group): exit 2 and the one message."""
    flags = _flags("breadth-first", 2, 2, 8, *TE)
    r = subprocess.run([sys.executable, "-m", "megatron_bfpp.megatron.check", "--world-size", "2", "--", *flags],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": subprocess_pythonpath()})
    assert r.returncode == 2, r.stdout + r.stderr
    assert "megatron_bfpp: error: --cuda-graph-impl transformer_engine (TransformerEngine per-layer" in r.stderr
