"""`--pipeline-model-parallel-layout` in `python -m megatron_bfpp.megatron.check` (Megatron-LM's own parse_args and
validate_args, then the plugin's checks; no process group): the layouts Megatron builds run under every plugin
schedule whose rule on V the layout's stage count meets; a layout Megatron-Core would refuse only once it builds
the model, one whose `E` / `L` is not where Megatron builds the embedding / loss, a standalone MTP stage, or a
stage count the schedule cannot run get one error naming the flag and the fix."""

from __future__ import annotations

import megatron.training.arguments  # noqa: F401  imported at collection, not in the first test's CPU time
import pytest

from megatron_bfpp.megatron import check
from tests.support.megatron_lm import CHECK


def _flags(layout: str, schedule: str, num_layers: int, extra: tuple[str, ...] = ()) -> list[str]:
    """CHECK (P = 2) with the layout in place of --num-layers-per-virtual-pipeline-stage."""
    flags = list(CHECK)
    i = flags.index("--num-layers-per-virtual-pipeline-stage")
    del flags[i:i + 2]
    flags[flags.index("--num-layers") + 1] = str(num_layers)
    flags[flags.index("--pipeline-schedule") + 1] = schedule
    return flags + ["--pipeline-model-parallel-layout", layout, *extra]


def _check(capsys: pytest.CaptureFixture, flags: list[str]) -> tuple[int, str]:
    code = check.main(["--world-size", "2", "--", *flags])
    out = capsys.readouterr()
    return code, out.out + out.err


ACCEPTED = [
    ("E|tt|t|t|t|L", "breadth-first", 5, ("--zero-stage", "3"), 3),
    ("E|tt|t|t|t|L", "interleaved-zb", 5, (), 3),
    ("E||ttt|tL", "breadth-first-zb", 4, ("--zero-stage", "2"), 2),
    ("E||ttt|tL", "interleaved-1f1b", 4, (), 2),
    ("Ettt|tL", "zb-h1", 4, (), 1),
    ("E|ttttL", "1f1b", 4, ("--zero-stage", "3"), 1),
    ("|Ett|t|t|t|L", "default", 5, (), 3),  # Megatron runs it as E|tt|t|t|t|L, unchanged by the plugin
]


@pytest.mark.parametrize("layout,schedule,num_layers,extra,vp", ACCEPTED,
                         ids=[f"{c[0]}-{c[1]}" for c in ACCEPTED])
def test_check_accepts_layouts(capsys: pytest.CaptureFixture, layout: str, schedule: str, num_layers: int,
                               extra: tuple[str, ...], vp: int) -> None:
    code, out = _check(capsys, _flags(layout, schedule, num_layers, extra))
    assert code == 0, out
    assert f"pipeline_schedule='{schedule}'" in out and f"pp=2, vp={vp}," in out, out


REFUSED = [
    ("decoder-count", "E|tt|t|t|tt|L", "breadth-first", 5, (),
     "places 6 decoder layers ('t') and --num-layers is 5: give the layout exactly 5 't' or set --num-layers 6"),
    ("decoder-count-default", "E|tt|t|t|tt|L", "default", 5, (), "give the layout exactly 5 't'"),
    ("megatron-first-layer", "tE|t|t|t|t|L", "interleaved-zb", 5, (),
     "Megatron-Core refuses it when it builds the model: The first layer must be embedding"),
    ("with-decoder-first-pipeline-num-layers", "E|tt|t|t|t|L", "breadth-first", 5,
     ("--decoder-first-pipeline-num-layers", "2"),
     "with --decoder-first-pipeline-num-layers: Megatron-Core refuses them together", "drop "
     "--decoder-first-pipeline-num-layers"),
    ("empty-first-stage", "|Ett|t|t|t|L", "interleaved-zb", 5, (),
     "'E' must open the first stage and 'L' close the last (6 stages)", "write 'E|tt|t|t|t|L'"),
    ("empty-last-stage", "Ett|t|t|t|L|", "breadth-first", 5, (), "write 'Ett|t|t|t||L'"),
    ("one-stage-per-rank-for-breadth-first", "Ettt|tL", "breadth-first", 4, (),
     "--pipeline-schedule breadth-first needs virtual stages: --pipeline-model-parallel-layout 'Ettt|tL' has 2 "
     "stages for P=2 (V = 1); split it into a multiple of 2 stages, at least 4, or use --pipeline-schedule 1f1b "
     "at V = 1"),
    ("virtual-stages-for-zb-h1", "E|tt|t|tL", "zb-h1", 4, (),
     "--pipeline-schedule zb-h1 runs one stage per rank: --pipeline-model-parallel-layout 'E|tt|t|tL' has 4 "
     "stages for P=2 (V = 2); give it 2 stages, or use --pipeline-schedule breadth-first-zb or interleaved-zb at "
     "V = 2"),
    ("standalone-mtp", "Ett|tt|m|L", "breadth-first", 4, ("--mtp-num-layers", "1", "--position-embedding-type",
                                                          "rope"),
     "(standalone MTP)", "put the 'm' in the last stage, before its 'L', or use --pipeline-schedule default"),
]


@pytest.mark.parametrize("layout,schedule,num_layers,extra,needles", [(*c[1:5], c[5:]) for c in REFUSED],
                         ids=[c[0] for c in REFUSED])
def test_check_refuses_layouts_with_the_fix(capsys: pytest.CaptureFixture, layout: str, schedule: str,
                                            num_layers: int, extra: tuple[str, ...], needles: tuple[str, ...]) -> None:
    code, out = _check(capsys, _flags(layout, schedule, num_layers, extra))
    assert code == 2, out
    error = [line for line in out.splitlines() if line.startswith("megatron_bfpp: error: ")]
    assert len(error) == 1 and f"--pipeline-model-parallel-layout '{layout}'" in error[0], out
    for needle in needles:
        assert needle in error[0], error[0]
