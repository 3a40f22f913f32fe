"""Megatron's optimizer promises under `--zero-stage`, through Megatron-LM's own `pretrain_gpt.py` on CPU (the
shim and runner of tests/support/megatron_lm.py), against stock Megatron on the same flags:

- a NaN gradient is caught before the update (`--check-for-nan-in-loss-and-grad`, Megatron's default), through
  Megatron's rerun state machine, with the same messages, exit code and saved checkpoint as stock;
- `--log-params-norm` under `--bf16` reports the norm of the fp32 master weights, as stock does.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from tests.support.megatron_lm import P2V2, RTOL, TINY, Run, Runner, _tail, needs_checkout

# ------------------------------------------------------------------------------------- NaN gradient at step 2

# The last stage's final LayerNorm weight: its gradient comes from plain autograd under every schedule (split
# backward included), on one rank. Iteration 2: Megatron's rerun state machine validates from the second on.
NAN_AT_2 = {"BFPP_PRETRAIN_NAN_GRAD": "2:decoder.final_layernorm.weight"}
NAN_MESSAGE = re.compile(r"Unexpected result nan on rank (\d+) at iteration #\d+ invocation #\d+ "
                         r"\(message='found NaN in local grad norm for bucket #\d+")
EXIT_CODE = re.compile(r"exitcode\s*:\s*(\d+)")


def _nan_run(mlm: Runner, mode: str, extra: list[str], ckpt: Path) -> Run:
    # torch format: Megatron's per-rank files, written in milliseconds here (torch_dist takes ~20 s on CPU)
    args = TINY + P2V2 + extra + ["--save", str(ckpt), "--save-interval", "100", "--ckpt-format", "torch"]
    return mlm.run(mode, args, expect_ok=False, extra_env=NAN_AT_2)


def _model_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every model tensor of the checkpoint's latest iteration, by pipeline rank, chunk and name."""
    it = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    out = {}
    for rank_dir in sorted((ckpt / f"iter_{it:07d}").iterdir()):
        sd = torch.load(rank_dir / "model_optim_rng.pt", weights_only=False, map_location="cpu")
        for chunk in sorted(k for k in sd if k.startswith("model")):
            for name, v in sd[chunk].items():
                if isinstance(v, torch.Tensor) and v.is_floating_point():
                    out[f"{rank_dir.name}/{chunk}/{name}"] = v
    return out


def _nan_outcome(run: Run) -> tuple:
    """What a user sees: where the NaN was reported, the exit code, the iterations logged."""
    ranks = sorted({int(m) for m in NAN_MESSAGE.findall(run.output)})
    codes = sorted({int(c) for c in EXIT_CODE.findall(run.output)})
    return ranks, codes, sorted(run.by_iteration()), "Saving a checkpoint and exiting now" in run.output


@needs_checkout
@pytest.mark.timeout(900)
@pytest.mark.parametrize("schedule", ["breadth-first", "interleaved-zb"])
def test_nan_gradient_is_caught_like_stock(mlm: Runner, schedule: str) -> None:
    """A NaN in one gradient at iteration 2: stock reports it from its gradient check ("found NaN in local grad
    norm for bucket ..."), reruns the step through the rerun state machine, finds it again, saves a checkpoint
    of the weights before the step and exits 16 (EXIT_CODE_RESUME_TO_DISAMBIGUATE). ZeRO-1/2/3 under the
    plugin's schedule do the same: same report, same exit, no iteration 2 logged, and a checkpoint with the
    same (finite) weights as stock's."""
    ref = _nan_run(mlm, "stock", [], mlm.workdir / "nan-stock")  # one path: the run is cached for both cases
    want = _nan_outcome(ref)
    assert want == ([1], [16], [1], True), f"stock: {want}\n{_tail(ref.output)}"
    assert ref.returncode != 0
    ref_weights = _model_weights(mlm.workdir / "nan-stock")
    assert ref_weights and all(torch.isfinite(v).all() for v in ref_weights.values())
    for zero in ("1", "2", "3"):
        ckpt = mlm.workdir / f"nan-{schedule}-zero{zero}"
        run = _nan_run(mlm, "patched", ["--pipeline-schedule", schedule, "--zero-stage", zero], ckpt)
        assert f"installed pipeline schedule {schedule}" in run.output, _tail(run.output)
        got = _nan_outcome(run)
        assert got == want, f"ZeRO-{zero}: {got} != stock's {want}\n{_tail(run.output)}"
        assert run.returncode != 0
        assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
        weights = _model_weights(ckpt)
        common = sorted(set(weights) & set(ref_weights))
        assert common and len(common) == len(ref_weights), (sorted(weights), sorted(ref_weights))
        for k in common:
            assert torch.isfinite(weights[k]).all(), f"ZeRO-{zero}: {k} has non-finite values"
            torch.testing.assert_close(weights[k], ref_weights[k], rtol=RTOL, atol=1e-6, msg=k)


# ------------------------------------------------------------------------------ params norm of the fp32 masters

BF16 = ["--bf16"]


@needs_checkout
@pytest.mark.timeout(600)
@pytest.mark.parametrize("schedule,zero,nproc", [
    ("breadth-first", "1", 2), ("breadth-first", "2", 2), ("breadth-first", "3", 2), ("interleaved-zb", "3", 4),
])
def test_bf16_params_norm_matches_stock(mlm: Runner, schedule: str, zero: str, nproc: int) -> None:
    """--bf16 --log-params-norm: Megatron-LM's calc_params_l2_norm reads the fp32 master weights (`main_param`)
    where the optimizer has them, the bf16 weights otherwise (~1e-3 apart after a few steps). The norm the
    plugin's ZeRO-1/2/3 report equals stock's at rtol 1e-5 at every iteration (full precision and the printed
    value), at D = 1 (each master whole on its rank) and D = 2 (4 ranks: the masters sharded, each rank's
    pieces summed over data parallelism). Losses and grad norms agree to bf16's rounding (rtol 1e-3: the
    plugin sums some gradients in another order, and a master weight a few ulps apart can round to another
    bf16 weight)."""
    ref = mlm.run("stock", TINY + P2V2 + BF16, nproc=nproc)
    run = mlm.run("patched", TINY + P2V2 + BF16 + ["--pipeline-schedule", schedule, "--zero-stage", zero],
                  nproc=nproc)
    assert f"installed pipeline schedule {schedule}" in run.output, _tail(run.output)
    got, want = run.by_iteration(), ref.by_iteration()
    assert sorted(got) == sorted(want) == [1, 2, 3, 4], (sorted(got), sorted(want))
    for it in want:
        g, w = got[it], want[it]
        assert g["params_norm"] is not None and math.isclose(g["params_norm"], w["params_norm"], rel_tol=RTOL), \
            f"iteration {it}: params norm {g['params_norm']} != stock's {w['params_norm']}"
        assert math.isclose(run.log[it]["params norm"], ref.log[it]["params norm"], rel_tol=RTOL), \
            f"iteration {it}: printed params norm {run.log[it]['params norm']} != {ref.log[it]['params norm']}"
        assert math.isclose(g["grad_norm"], w["grad_norm"], rel_tol=1e-3), f"iteration {it}: grad norm"
        for key, loss in w["losses"].items():
            assert math.isclose(g["losses"][key], loss, rel_tol=1e-3), f"iteration {it}: {key}"


# --------------------------------------------------------------- batch-size ramp-up: the batches Megatron runs

def _interleaved_with_rampup():
    from megatron_bfpp.megatron.check import parse_megatron_args
    from tests.support.megatron_lm import CHECK

    flags = ["interleaved-1f1b" if f == "breadth-first" else f for f in CHECK]
    return parse_megatron_args(flags + ["--rampup-batch-size", "1", "1", "100"], 2)  # ramps through M = 1 < P


def test_rampup_is_counted_only_where_megatron_ramps_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """--rampup-batch-size: megatron-core 0.19 ignores it (deprecated; its calculator builder takes no ramp-up
    and Megatron-LM no longer passes one), so every step runs the target batch, M = 8 here, which
    interleaved-1f1b runs: accepted. Where the calculator builds a ramp-up (0.16's builder signature, from
    core_v0.16.1's megatron/core/num_microbatches_calculator.py), the ramp's M = 1 < P = 2 is refused."""
    import megatron.core.num_microbatches_calculator as calculators

    import megatron_bfpp.megatron as bm

    assert "rampup_batch_size" not in __import__("inspect").signature(
        calculators._build_num_microbatches_calculator).parameters, "not megatron-core 0.19's calculator"
    assert bm.validate_args(_interleaved_with_rampup()).train_microbatches == (8,)

    def builder_016(rank, rampup_batch_size, global_batch_size, micro_batch_size, data_parallel_size,
                    decrease_batch_size_if_needed):
        raise AssertionError("validation only reads the signature")

    monkeypatch.setattr(calculators, "_build_num_microbatches_calculator", builder_016)
    with pytest.raises(bm.ConfigError) as e:
        bm.validate_args(_interleaved_with_rampup())
    assert "(got M=1)" in str(e.value), str(e.value)
