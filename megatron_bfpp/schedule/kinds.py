"""The registry of schedule kinds, and `build()`, which dispatches through it.

One `ScheduleKind` per `--schedule` / `--pipeline-schedule` value: its builder and what the rest of the package
asks about it (split backward, the rule on virtual stages, the micro-batch group size and its default). The
name tuples, the flags' choices, the simulator's and planner's per-kind rules and the runtime's group-size
default all derive from `KINDS`: a new kind is one entry here and its builder.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable

from . import builders
from .ir import Schedule, ScheduleError
from .pairs import COMBINED_1F1B, PAIRINGS

# (P, V, M, group size, forward-only) -> the kind's compute order; see `builders`.
Builder = Callable[[int, int, int, Any, bool], Schedule]

# The errors of a kind's V rule and of a group size it does not take ({name}, {vp}, {other}: `other_stages`).
ONE_STAGE_ERROR = ("--schedule (--pipeline-schedule) {name} runs one stage per rank (V = 1, got V = {vp}): use "
                   "{other} for virtual stages")
VIRTUAL_STAGES_ERROR = ("--schedule (--pipeline-schedule) {name} needs virtual stages: set --vp (or "
                        "--num-layers-per-virtual-pipeline-stage) so that V >= 2, or use {other} for V = 1")
NO_GROUP_ERROR = "--group-size does not apply to --schedule (--pipeline-schedule) {name}: drop it"
_ROUNDS_NO_GROUP_ERROR = ("--group-size does not apply to --pipeline-schedule {name} (its rounds follow from M and "
                          "P): drop it")


@dataclass(frozen=True)
class ScheduleKind:
    """One schedule kind: its builder and the facts about it that the flags, the simulator and the runtime use."""

    name: str
    builder: Builder
    split_backward: bool  # each backward split into I (input gradient) and W (weight gradients)
    virtual_stages: bool  # True: needs V >= 2 stages per rank; False: runs one stage per rank (V = 1)
    other_stages: str  # the kind(s) to use on the other side of that rule, which its error names
    # (P, M) -> the micro-batch group size when none is given; None: the kind takes no group size.
    default_group_size: Callable[[int, int], int] | None = None
    sequential_groups: bool = False  # groups run one after the other, each accumulating its own gradients
    megatron_order: bool = False  # Megatron-Core's own order for its V (what `--pipeline-schedule default` runs)
    megatron_choice: bool = True  # offered by the Megatron-LM flag --pipeline-schedule
    # The errors' wording where this kind's differs from the common one above.
    stage_error: str | None = None
    group_error: str | None = None

    @property
    def takes_group_size(self) -> bool:
        return self.default_group_size is not None

    def fits_stages(self, vp: int) -> bool:
        """Whether V stages per rank satisfy the kind's rule."""
        return vp >= 2 if self.virtual_stages else vp == 1

    def group_size_for(self, pp: int, microbatches: int, group_size: int | None) -> int | None:
        """The group size a build uses: the one given, else the kind's default (None for kinds without)."""
        if group_size is not None or self.default_group_size is None:
            return group_size
        return self.default_group_size(pp, microbatches)

    def check(self, vp: int, group_size: int | None) -> None:
        """Raise ScheduleError when V breaks the kind's rule or a group size is given to a kind without one."""
        if not self.fits_stages(vp):
            template = self.stage_error or (VIRTUAL_STAGES_ERROR if self.virtual_stages else ONE_STAGE_ERROR)
            raise ScheduleError(template.format(name=self.name, vp=vp, other=self.other_stages))
        if group_size is not None and not self.takes_group_size:
            raise ScheduleError((self.group_error or NO_GROUP_ERROR).format(name=self.name))


def _per_rank(pp: int, microbatches: int) -> int:
    return pp  # Megatron's default: one micro-batch per pipeline rank in a group


def _all(pp: int, microbatches: int) -> int:
    return microbatches  # one group of every micro-batch


KINDS: dict[str, ScheduleKind] = {k.name: k for k in (
    ScheduleKind("gpipe", builders.gpipe, split_backward=False, virtual_stages=False,
                 other_stages="interleaved-1f1b or breadth-first", megatron_choice=False),
    ScheduleKind("1f1b", builders.one_f_one_b, split_backward=False, virtual_stages=False,
                 other_stages="interleaved-1f1b or breadth-first", megatron_order=True),
    ScheduleKind("interleaved-1f1b", builders.interleaved_1f1b, split_backward=False, virtual_stages=True,
                 other_stages="1f1b", default_group_size=_per_rank, megatron_order=True),
    ScheduleKind("breadth-first", builders.breadth_first, split_backward=False, virtual_stages=True,
                 other_stages="gpipe", default_group_size=_all, sequential_groups=True),
    # Its order and rules are breadth-first's (the backward then split), and so is the name in its V error.
    ScheduleKind("breadth-first-zb", builders.breadth_first_zero_bubble, split_backward=True, virtual_stages=True,
                 other_stages="gpipe", default_group_size=_all, sequential_groups=True,
                 stage_error=VIRTUAL_STAGES_ERROR.replace("{name}", "breadth-first")),
    ScheduleKind("interleaved-zb", functools.partial(builders.zero_bubble, name="interleaved-zb"),
                 split_backward=True, virtual_stages=True, other_stages="zb-h1",
                 stage_error="--pipeline-schedule {name} needs virtual stages (V >= 2): use {other} for V = 1",
                 group_error=_ROUNDS_NO_GROUP_ERROR),
    ScheduleKind("zb-h1", functools.partial(builders.zero_bubble, name="zb-h1"),
                 split_backward=True, virtual_stages=False, other_stages="interleaved-zb",
                 stage_error=ONE_STAGE_ERROR.replace("--schedule (--pipeline-schedule)", "--pipeline-schedule"),
                 group_error=_ROUNDS_NO_GROUP_ERROR),
)}

SCHEDULE_NAMES = tuple(KINDS)
SPLIT_BACKWARD_SCHEDULES = tuple(n for n, k in KINDS.items() if k.split_backward)
GROUPED_SCHEDULES = tuple(n for n, k in KINDS.items() if k.takes_group_size)  # take a micro-batch group size


def schedule_kind(name: str) -> ScheduleKind:
    """The registry entry of kind `name`; ScheduleError naming the choices for an unknown one."""
    kind = KINDS.get(name)
    if kind is None:
        raise ScheduleError(f"unknown --schedule (--pipeline-schedule) {name!r}: choose one of "
                            f"{', '.join(KINDS)}")
    return kind


def megatron_kind(vp: int) -> str:
    """The kind whose order Megatron-Core runs itself with V stages per rank (`--pipeline-schedule default`)."""
    return next(k.name for k in KINDS.values() if k.megatron_order and k.fits_stages(vp))


def build(
    name: str,
    pp: int,
    vp: int,
    microbatches: int,
    group_size: int | None = None,
    forward_only: bool = False,
    pairing: str | None = None,
) -> Schedule:
    """Build the F/B order of schedule `name` for P = pp ranks, V = vp stages per rank, M micro-batches, its
    actions merged two at a time as `pairing` says (`pairs.PAIRINGS`; a training order only)."""
    kind = schedule_kind(name)
    builders.check_common(pp, vp, microbatches)
    kind.check(vp, group_size)
    group = kind.group_size_for(pp, microbatches, group_size)
    if pairing is not None and pairing not in PAIRINGS:
        raise ScheduleError(f"unknown pairing {pairing!r}: one of {', '.join(PAIRINGS)}")
    if pairing == COMBINED_1F1B and not forward_only:
        if not kind.megatron_order:
            raise ScheduleError(f"--overlap-moe-expert-parallel-comm runs Megatron-Core's combined 1F1B, which only its "
                                f"own schedules have (1f1b, interleaved-1f1b), not {name}")
        return dataclasses.replace(builders.combined_1f1b(pp, vp, microbatches, group), pairing=pairing)
    sched = kind.builder(pp, vp, microbatches, group, forward_only)
    return dataclasses.replace(sched, pairing=pairing) if pairing is not None and not forward_only else sched
