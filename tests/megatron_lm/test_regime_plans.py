"""Every plan of the regime tables (bench/results/regime_*.csv, ours and stock, what-ifs included) launches:

- its `megatron_args`, rebuilt from the row as `bfpp plan --json` writes them (`launch_flags` of the candidate's
  configuration, after the table's base flags), pass `python -m megatron_bfpp.megatron.check` at the table's world
  size (unit tier, no process); ours planned under a what-if is refused by `launch_flags`, which no flag runs;
- its stage layout, scaled down with the same pattern (`sim.layouts.scale_down_layout`: E or L alone, the first
  and last stage's kind, the order of the layer counts, runs and lone stages, a rank holding nothing; the even
  split as P = 2 with one layer per stage), trains through Megatron-LM's own `pretrain_gpt.py` on CPU: ours'
  schedule and ZeRO stage under the plugin equal stock Megatron on the same scaled layout (lm loss, grad norm,
  params norm, validation loss, fp32, rtol 1e-5), and stock's own plans are that stock run.

The runs are deduplicated by (scaled layout, schedule, ZeRO stage); each case's id names the table rows it stands
for (`table@batch-per-GPU`, `+wi` for the what-if table). The scaled runs use the tiny GPT of the other Megatron-LM
tests for 2 iterations at M = 4, not the plan's M, group size or tensor / context / expert parallelism.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from typing import NamedTuple

import pytest

import tests.support.megatron_parser  # noqa: F401  (Megatron's parser: imported once, at collection)
from megatron_bfpp.megatron import check
from megatron_bfpp.megatron.sim_flags import GPU_ARCH
from megatron_bfpp.sim import get_hardware
from megatron_bfpp.sim.layouts import ScaledLayout, parse_layout, scale_down_even, scale_down_layout
from megatron_bfpp.sim.predict import config_dict
from tests.support.megatron_lm import TINY, Run, Runner, _tail, assert_same_training, assert_same_validation, \
    needs_checkout
from tests.support.paths import load_script

regime = load_script("bench/regime_table.py", "bench_regime_table")


class Row(NamedTuple):
    table: str  # a key of regime.TABLES
    what_if: tuple[str, ...]
    values: dict  # the CSV row as read_csv reads it

    @property
    def label(self) -> str:
        return f"{self.table}{'+wi' if self.what_if else ''}@{self.values['batch_per_gpu']}"

    def planned(self, side: str) -> bool:
        """Whether `side` has a plan in this row (not "nothing fits")."""
        return bool(self.values[f"{side}_schedule"])


def _rows() -> list[Row]:
    rows = []
    for name in regime.TABLES:
        for what_if in ((), *((w,) for w in regime.WHAT_IFS)):
            path = regime.RESULTS / f"regime_{'-'.join((name, *what_if))}.csv"
            if path.is_file():
                rows += [Row(name, what_if, r) for r in regime.read_csv(path)]
    return rows


ROWS = _rows()


# ------------------------------------------------------------------------------------------------ megatron_args

@functools.cache
def _inputs(table: str, what_if: tuple[str, ...]):
    t = regime.TABLES[table]
    return regime.table_inputs(t.model, get_hardware(t.hardware), t.gpus, t.flags, 64, what_if)


def test_every_table_is_read() -> None:
    assert {r.table for r in ROWS} == set(regime.TABLES) and any(r.what_if for r in ROWS)
    assert len({r.label for r in ROWS}) == len(ROWS)
    assert sum(len(rows) for rows in PLUGIN_CASES.values()) == sum(r.planned("ours") for r in ROWS) >= 40


@pytest.mark.parametrize("row", ROWS, ids=[r.label for r in ROWS])
def test_plan_megatron_args_pass_the_check(row: Row, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture) -> None:
    """Each side's configuration rebuilt from the row is the one the table wrote (every configuration column), and
    its launch flags pass the check command at the table's world size and GPU."""
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # Megatron asks for it at T > 1 (the launch sets it)
    table = regime.TABLES[row.table]
    model, sides = _inputs(row.table, row.what_if)
    for side in (s for s in ("ours", "stock") if row.planned(s)):
        cfg = regime.row_config(row.values, side, sides[side])
        rebuilt = config_dict(cfg)
        rebuilt["pipeline_model_parallel_layout"] = rebuilt["pipeline_model_parallel_layout"] or "even"
        written = {k: row.values[f"{side}_{k}"] for k in rebuilt if f"{side}_{k}" in regime.FIELDS}
        assert len(written) >= 14
        assert {k: "" if rebuilt[k] is None else str(rebuilt[k]) for k in written} == written
        assert row.values[f"{side}_schedule"] == cfg.schedule
        if side == "ours" and row.what_if:
            with pytest.raises(ValueError, match="what-if of the simulator: no pretrain_gpt.py flag runs it"):
                regime.row_launch_args(table, row.values, side, model, sides[side])
            continue
        flags = regime.row_launch_args(table, row.values, side, model, sides[side])
        code = check.main(["--world-size", str(table.gpus), "--gpu-arch", str(GPU_ARCH[table.hardware]), "--",
                           *flags])
        out = capsys.readouterr()
        assert code == 0, f"{side}: {' '.join(flags)}\n{out.err[-2000:]}"
        assert f"pp={cfg.pp}, vp={cfg.vp}," in out.out, out.out


# ------------------------------------------------------------------------------------------------ scaled runs

def _scaled(row: Row, side: str) -> ScaledLayout:
    v = row.values
    layout = v[f"{side}_pipeline_model_parallel_layout"]
    if layout == "even":
        return scale_down_even(int(v[f"{side}_virtual_pipeline_model_parallel_size"]))
    return scale_down_layout(parse_layout(layout), int(v[f"{side}_pipeline_model_parallel_size"]))


def _labels(rows: list[Row]) -> str:
    """`table@b1,b2+table2@b3`: the rows, grouped by table."""
    by_table: dict[str, list[str]] = defaultdict(list)
    for r in rows:
        by_table[r.label.split("@")[0]].append(r.values["batch_per_gpu"])
    return "+".join(f"{t}@{','.join(b)}" for t, b in by_table.items())


def _name(s: ScaledLayout) -> str:
    return s.layout or f"even-P{s.pp}V{s.vp}"


def _plugin_cases() -> dict[tuple[ScaledLayout, str, str | None], list[Row]]:
    """(scaled layout, ours' schedule, ZeRO stage or None for Megatron's DDP) -> the rows planning it."""
    cases: dict[tuple[ScaledLayout, str, str | None], list[Row]] = defaultdict(list)
    for row in (r for r in ROWS if r.planned("ours")):
        zero = row.values["ours_zero_stage"]
        cases[(_scaled(row, "ours"), row.values["ours_schedule"], None if zero == "0" else zero)].append(row)
    return dict(cases)


def _stock_cases() -> dict[ScaledLayout, list[Row]]:
    cases: dict[ScaledLayout, list[Row]] = defaultdict(list)
    for row in (r for r in ROWS if r.planned("stock")):
        cases[_scaled(row, "stock")].append(row)
    return dict(cases)


PLUGIN_CASES = _plugin_cases()
STOCK_CASES = _stock_cases()


# The tiny GPT of the other Megatron-LM tests, 2 iterations of M = 4 (validation at the second): a run costs about
# its start and end, and there are many.
SHORT = {"--train-iters": "2", "--global-batch-size": "4"}


def _args(s: ScaledLayout) -> list[str]:
    """The tiny GPT (SHORT) on the scaled layout (the even split: one layer per stage)."""
    tiny = list(TINY)
    for flag, value in {**SHORT, "--num-layers": str(s.num_layers)}.items():
        tiny[tiny.index(flag) + 1] = value
    split = (["--pipeline-model-parallel-layout", s.layout] if s.layout else
             ["--num-layers-per-virtual-pipeline-stage", "1"] if s.vp > 1 else [])
    return tiny + ["--pipeline-model-parallel-size", str(s.pp), *split]


def _plugin_args(s: ScaledLayout, schedule: str, zero: str | None) -> list[str]:
    return _args(s) + ["--pipeline-schedule", schedule, *(["--zero-stage", zero] if zero else [])]


@pytest.mark.parametrize("scaled,schedule,zero", list(PLUGIN_CASES),
                         ids=[f"{_name(s)}-{sched}-zero{z or 0}" for s, sched, z in PLUGIN_CASES])
def test_scaled_cases_pass_the_check(scaled: ScaledLayout, schedule: str, zero: str | None,
                                     capsys: pytest.CaptureFixture) -> None:
    """The scaled runs' flags, stock's and the plugin's, pass the check command (before any run: no checkout)."""
    for flags in (_args(scaled), _plugin_args(scaled, schedule, zero)):
        code = check.main(["--world-size", str(scaled.pp), "--", *flags])
        out = capsys.readouterr()
        assert code == 0, f"{' '.join(flags)}\n{out.err[-2000:]}"
        assert f"pp={scaled.pp}, vp={scaled.vp}," in out.out, out.out


def _stock(mlm: Runner, s: ScaledLayout) -> Run:
    ref = mlm.run("stock", _args(s), nproc=s.pp)
    assert ref.iterations() == [1, 2] and sorted(ref.validation) == [2], _tail(ref.output)
    return ref


@needs_checkout
@pytest.mark.timeout(600)
@pytest.mark.parametrize("scaled,schedule,zero", list(PLUGIN_CASES),
                         ids=[f"{_name(s)}-{sched}-zero{z or 0}[{_labels(rows)}]"
                              for (s, sched, z), rows in PLUGIN_CASES.items()])
def test_ours_plan_scaled_matches_stock(mlm: Runner, scaled: ScaledLayout, schedule: str, zero: str | None) -> None:
    """Ours' schedule and ZeRO stage on the scaled layout == stock Megatron on the same layout."""
    run = mlm.run("patched", _plugin_args(scaled, schedule, zero), nproc=scaled.pp)
    assert f"installed pipeline schedule {schedule} (P={scaled.pp}, V={scaled.vp}, M=4" in run.output, \
        _tail(run.output)
    ref = _stock(mlm, scaled)
    assert_same_training(run, ref)
    assert_same_validation(run, ref)


@needs_checkout
@pytest.mark.timeout(600)
@pytest.mark.parametrize("scaled", list(STOCK_CASES),
                         ids=[f"{_name(s)}[{_labels(rows)}]" for s, rows in STOCK_CASES.items()])
def test_stock_plan_scaled_runs(mlm: Runner, scaled: ScaledLayout) -> None:
    """Stock Megatron trains on the scaled layout of its plan (the reference of ours' cases on the same layout:
    run once)."""
    _stock(mlm, scaled)
