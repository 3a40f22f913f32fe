"""Pairings: which compute actions of a rank's list run merged, two at a time, so that each one's expert-parallel
all-to-all runs while the other computes.

Two pairings exist (`Schedule.pairing`):

- `PAIRED` ("paired"), the plugin's paired order: two actions that the rank runs back to back on the same stage
  with the same op (two forwards, two backwards or two input-gradient backwards of consecutive micro-batches, as
  breadth-first runs a stage's micro-batches one after the other). Within a run of such actions the pairs are
  taken in order, first with second, third with fourth, ...; the last action of a run of odd length, and any
  action alone in its run, runs unpaired. A W (weight gradients, no all-to-all) never pairs.
- `COMBINED_1F1B` ("combined-1f1b"), Megatron-Core's combined 1F1B (--overlap-moe-expert-parallel-comm): each
  forward of its 1F1B steady state with the backward it runs next (another micro-batch), on the order Megatron
  runs then (one more warm-up forward, `builders.combined_1f1b`); with one stage per rank and no pipeline,
  each backward with the next forward. Warm-up forwards and cool-down backwards run alone.

Actions between two computations that are not computations (sends, receives, data-parallel collectives) do not
separate them. A schedule with a pairing posts a pair's two inputs before it and its two outputs after it
(`lower.add_p2p`); the simulator runs a pair merged where it hides an all-to-all (`sim.engine`). The runtime
runs neither (`PAIRED_NOT_RUN`; Megatron's own schedule runs the combined 1F1B itself).
"""

from __future__ import annotations

from typing import Sequence

from .builders import interleaved_warmup
from .ir import COMPUTE_OPS, Action, Op, Schedule, ScheduleError

PAIRED = "paired"
COMBINED_1F1B = "combined-1f1b"
PAIRINGS = (PAIRED, COMBINED_1F1B)
PAIRABLE_OPS = frozenset({Op.F, Op.B, Op.I})  # the ops that carry an expert all-to-all

# Why a launch refuses the paired order: what the runtime lacks.
PAIRED_NOT_RUN = (
    "--paired-moe-a2a-overlap is simulated only (bfpp simulate, bfpp plan): the plugin's runtime does not run the "
    "paired order. It would need a merged execution of two micro-batches of one stage, their layers interleaved "
    "so that each one's expert dispatch and combine all-to-all runs on a communication stream while the other "
    "computes (what Megatron-Core's combined 1F1B, TransformerLayerSchedulePlan, does for a forward and a "
    "backward), and the runtime runs one micro-batch per F, B or I action; drop --paired-moe-a2a-overlap")


def back_to_back_pairs(actions: Sequence[Action]) -> dict[int, int]:
    """`PAIRED`: index of the first action of each pair in `actions` -> index of its partner."""
    pairs: dict[int, int] = {}
    open_at: int | None = None  # index of an action waiting for its partner (the odd one of its run so far)
    for i, a in enumerate(actions):
        if a.op not in COMPUTE_OPS:
            continue
        if open_at is not None and (a.op, a.stage) == (actions[open_at].op, actions[open_at].stage):
            pairs[open_at] = i
            open_at = None
            continue
        open_at = i if a.op in PAIRABLE_OPS else None
    return pairs


def combined_1f1b_pairs(schedule: Schedule, rank: int, actions: Sequence[Action]) -> dict[int, int]:
    """`COMBINED_1F1B` on `rank` of `schedule` (Megatron's order): index of the first action of each pair -> index
    of its partner. Interleaved: each forward after the rank's warm-up with the backward after it (the warm-up one
    longer than its interleaved 1F1B's, capped by its V x M forwards: Megatron's `get_pp_rank_microbatches`);
    without a pipeline, each backward with the next forward."""
    idx = [i for i, a in enumerate(actions) if a.op in COMPUTE_OPS]
    if schedule.vp == 1:
        return {idx[k]: idx[k + 1] for k in range(1, len(idx) - 1, 2)}  # F0 | B0 F1 | B1 F2 | ... | B(M-1)
    total = schedule.vp * schedule.microbatches
    warmup = min(interleaved_warmup(schedule.pp, rank, schedule.vp, schedule.microbatches,
                                    schedule.group_size or schedule.pp) + 1, total)
    return {idx[warmup + 2 * k]: idx[warmup + 2 * k + 1] for k in range(total - warmup)}


def pairs_of(schedule: Schedule, rank: int, actions: Sequence[Action] | None = None) -> dict[int, int]:
    """The pairs of `rank`'s `actions` (default: its list in `schedule`) under the schedule's pairing (none
    without one)."""
    actions = schedule.ranks[rank] if actions is None else actions
    if schedule.pairing is None:
        return {}
    if schedule.pairing == PAIRED:
        return back_to_back_pairs(actions)
    if schedule.pairing == COMBINED_1F1B:
        return combined_1f1b_pairs(schedule, rank, actions)
    raise ScheduleError(f"unknown pairing {schedule.pairing!r}: one of {', '.join(PAIRINGS)}")
