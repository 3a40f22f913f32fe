"""`--pipeline-model-parallel-layout` stages through Megatron-LM's own `pretrain_gpt.py` (CPU, the shim and the runner
of tests/support/megatron_lm.py), each plugin run against stock Megatron on the same layout: lm loss, grad norm and
params norm per iteration, validation loss (fp32, rtol 1e-5).

The layouts put the embedding alone on stage 0 (`E|`), the loss alone on the last stage (`|L`), different decoder
layer counts on the stages, and a stage holding nothing (pipeline rank 1's first chunk of `E||ttt|tL`, a chunk
without parameters; at P = 3, `Ett||ttL` leaves rank 1 without any), V taken from the layout's stage count
(3 and 2 stages per rank). The ZeRO buffers are sized per stage, and a chunk without parameters has none.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.megatron_lm import RTOL, TINY, Run, Runner, _tail, assert_same_training, assert_same_validation, needs_checkout

# layout -> (decoder layers, P, V)
LAYOUTS = {
    "E|tt|t|t|t|L": (5, 2, 3),  # E alone on stage 0, L alone on stage 5, 2/1/1/1 decoder layers between
    "E||ttt|tL": (4, 2, 2),  # E alone, then an empty stage (rank 1's first chunk), 3 and 1 decoder layers
    "Ett||ttL": (4, 3, 1),  # pipeline rank 1 holds no parameters at all (its optimizer has no gradient)
}
CASES = [
    ("E|tt|t|t|t|L", "breadth-first", "3"),
    ("E|tt|t|t|t|L", "interleaved-zb", "2"),
    ("E||ttt|tL", "breadth-first", "3"),
    ("E||ttt|tL", "interleaved-zb", None),  # Megatron's DDP under the split backward, with a parameterless chunk
    ("Ett||ttL", "1f1b", "3"),
]


def _layout_args(layout: str) -> list[str]:
    num_layers, pp, _ = LAYOUTS[layout]
    tiny = list(TINY)
    tiny[tiny.index("--num-layers") + 1] = str(num_layers)
    return tiny + ["--pipeline-model-parallel-size", str(pp), "--pipeline-model-parallel-layout", layout]


def _stock(mlm: Runner, layout: str) -> Run:
    ref = mlm.run("stock", _layout_args(layout), nproc=LAYOUTS[layout][1])
    assert ref.iterations() == [1, 2, 3, 4], _tail(ref.output)
    return ref


def _plugin(mlm: Runner, layout: str, schedule: str, zero: str | None, extra: list[str] | None = None) -> Run:
    sharding = ["--zero-stage", zero] if zero else []
    return mlm.run("patched", _layout_args(layout) + ["--pipeline-schedule", schedule, *sharding, *(extra or [])],
                   nproc=LAYOUTS[layout][1])


@needs_checkout
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout,schedule,zero", CASES, ids=[f"{c[0]}-{c[1]}-zero{c[2]}" for c in CASES])
def test_layout_matches_stock(mlm: Runner, layout: str, schedule: str, zero: str | None) -> None:
    """The plugin's schedule on the layout's stages == stock Megatron on the same layout."""
    _, pp, vp = LAYOUTS[layout]
    run = _plugin(mlm, layout, schedule, zero)
    assert f"installed pipeline schedule {schedule} (P={pp}, V={vp}, M=8" in run.output, _tail(run.output)
    ref = _stock(mlm, layout)
    assert_same_training(run, ref)
    assert_same_validation(run, ref)


@needs_checkout
@pytest.mark.timeout(900)
def test_layout_zero3_save_load_resume(mlm: Runner, tmp_path: Path) -> None:
    """Breadth-first ZeRO-3 on `E||ttt|tL` saves at iteration 2 (torch_dist) and exits; resumed from it, iterations
    3-4 equal the uninterrupted run (itself equal to stock); stock Megatron on the same layout loads the
    checkpoint with --no-load-optim and computes the same iteration 3 (same weights, same data)."""
    layout = "E||ttt|tL"
    straight = _plugin(mlm, layout, "breadth-first", "3")
    ckpt = tmp_path / "ckpt"
    first = _plugin(mlm, layout, "breadth-first", "3", ["--save", str(ckpt), "--save-interval", "2",
                                                          "--exit-interval", "2"])
    assert sorted(first.by_iteration()) == [1, 2], _tail(first.output)
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    resumed = _plugin(mlm, layout, "breadth-first", "3", ["--load", str(ckpt)])
    assert sorted(resumed.by_iteration()) == [3, 4], _tail(resumed.output)
    # Megatron's log line after the first resumed iteration averages it with the next (its own accounting at a
    # resume, stock included): compare that line for iteration 3 only, the full-precision records for both.
    assert_same_training(resumed, straight, iterations=[3, 4], logged=[3])
    assert resumed.validation[4] == pytest.approx(straight.validation[4], rel=RTOL)
    stock = mlm.run("stock", _layout_args(layout) + ["--load", str(ckpt), "--no-load-optim"])
    assert sorted(stock.by_iteration()) == [3, 4], _tail(stock.output)
    assert_same_training(stock, straight, iterations=[3], params_norm=False)
