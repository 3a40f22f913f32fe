"""`ScheduleSpec`: every setting that determines a lowered schedule, as one frozen, hashable value.

The flags (`bfpp schedule`, Megatron-LM's `--pipeline-schedule` and its companions, the trainer's) turn into
one; the runtime and the simulator key their schedule caches on it, and the runtime's ranks compare its
`fingerprint()` before running a schedule together. A field added here is part of all of them.
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass, field

from .ir import Schedule
from .kinds import ScheduleKind, build, schedule_kind
from .lower import lower
from .validate import validate


def _setting(label: str, default: object = dataclasses.MISSING, lowering: bool = False) -> object:
    """A spec field: `label` names it in the handshake's errors (default: the field's name); `lowering` marks
    what only lowering reads (reset by `order_spec`)."""
    return field(default=default, metadata={"label": label, "lowering": lowering})


@dataclass(frozen=True)
class ScheduleSpec:
    """A schedule kind with its shape (P, V, M, group size) and the settings its lowering reads."""

    kind: str = _setting("schedule")  # a name of the registry, `kinds.KINDS`
    pp: int = _setting("P")
    vp: int = _setting("V")
    microbatches: int = _setting("M")
    group_size: int | None = _setting("group size", None)  # None: the kind's default
    _: dataclasses.KW_ONLY  # the settings below are passed by name
    zero_stage: int | None = _setting("ZeRO stage", None, lowering=True)  # None: no data-parallel actions
    forward_only: bool = _setting("forward-only", False)
    weight_buffers: int = _setting("weight buffers", 2, lowering=True)  # ZeRO-3: stages gathered at once
    grad_buffers: int = _setting("grad buffers", 2, lowering=True)  # ZeRO-2/3: full gradient buffers
    # False when a W computes weight gradients from kept activations alone: ZeRO-3 may release a stage's
    # weights after its last F/B/I (see `Schedule.w_needs_weights`).
    w_needs_weights: bool = _setting("W needs weights", True, lowering=True)
    # True when an I writes its stage's gradient buffer: ZeRO-2/3 hold it from the first I.
    i_writes_grads: bool = _setting("I writes gradients", False, lowering=True)
    # The optimizer step as STEP actions at the end of a training schedule with data-parallel actions (the
    # plugin's sharded optimizer); False for an optimizer outside the schedule (stock Megatron's, simulated).
    optimizer_step: bool = _setting("optimizer step", True, lowering=True)
    # Actions run merged two at a time (`pairs.PAIRINGS`: the plugin's paired order, simulated only, or the order
    # of Megatron's combined 1F1B); None: one at a time.
    pairing: str | None = _setting("pairing", None)

    @property
    def schedule_kind(self) -> ScheduleKind:
        """The registry entry of `kind` (ScheduleError for an unknown one)."""
        return schedule_kind(self.kind)

    def resolved(self) -> ScheduleSpec:
        """This spec with the kind's default group size written in: specs of the same schedule become equal."""
        return dataclasses.replace(
            self, group_size=self.schedule_kind.group_size_for(self.pp, self.microbatches, self.group_size))

    def order_spec(self) -> ScheduleSpec:
        """This spec with its lowering settings at their defaults: the key of its F/B order, which every
        lowering of it shares."""
        return dataclasses.replace(self, **{f.name: f.default for f in dataclasses.fields(self)
                                            if f.metadata.get("lowering")})

    def order(self) -> Schedule:
        """The kind's order of compute actions (its builder's checks; not validated)."""
        return build(self.kind, self.pp, self.vp, self.microbatches, self.group_size, self.forward_only,
                     self.pairing)

    def lower(self, order: Schedule) -> Schedule:
        """`order` (this spec's) with p2p actions, and data-parallel ones when `zero_stage` is set."""
        return lower(order, self.zero_stage, self.weight_buffers, self.grad_buffers, self.w_needs_weights,
                     self.i_writes_grads, self.optimizer_step)

    def build(self, lowered: bool = True) -> Schedule:
        """The validated order, and with `lowered` its validated lowering (p2p, and data-parallel actions when
        `zero_stage` is set)."""
        sched = self.order()
        validate(sched)
        if lowered:
            sched = self.lower(sched)
            validate(sched)
        return sched

    def fingerprint(self) -> tuple[tuple[str, int], ...]:
        """(label, integer) of every field, in field order: what ranks exchange to check that they run the same
        schedule. The kind travels as its CRC-32, None as 0, booleans as 0/1."""
        return tuple((f.metadata.get("label", f.name), _as_int(getattr(self, f.name)))
                     for f in dataclasses.fields(self))


def _as_int(value: object) -> int:
    if isinstance(value, str):
        return zlib.crc32(value.encode())
    if value is None:
        return 0
    if isinstance(value, int):  # bool included
        return int(value)
    raise TypeError(f"a ScheduleSpec field holds {value!r}: give its type an integer form in spec._as_int")
