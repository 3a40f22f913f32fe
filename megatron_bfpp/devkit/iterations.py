"""Megatron-style iteration lines (Megatron-LM's and the trainer's, which prints the same) and the bf16 agreement of
a run's losses with a reference run's: shared by the device kit's legs and the GPU check (scripts/gpu_check.sh).
Pure Python."""

from __future__ import annotations

import math
import re

from .plan import ALL_ITERATIONS_RTOL, FIRST_ITERATION_RTOL

ITERATION_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|(.*)$")
LOSS_RE = re.compile(r"lm loss: ([0-9.eE+-]+)")
ELAPSED_RE = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")


def relative_differences(losses: list[float], ref: list[float]) -> list[float]:
    """|loss - reference| / |reference| at each iteration both runs have (inf against a zero reference)."""
    return [abs(a - b) / abs(b) if b else math.inf for a, b in zip(losses, ref)]


def losses_agree(losses: list[float], ref: list[float]) -> bool:
    """bf16 agreement with the reference: as many iterations, all finite, the relative difference within
    FIRST_ITERATION_RTOL at iteration 1 and ALL_ITERATIONS_RTOL at every iteration. The first iteration sees the
    same weights and data, so only reduction order differs (a few bf16 ulps, 2^-8 relative each); later iterations
    also carry the optimizer's different summation orders forward, and the lr warm-up lets them grow."""
    rel = relative_differences(losses, ref)
    return (bool(rel) and len(losses) == len(ref) and all(math.isfinite(x) for x in losses)
            and rel[0] <= FIRST_ITERATION_RTOL and max(rel) <= ALL_ITERATIONS_RTOL)
