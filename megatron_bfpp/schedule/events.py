"""The timeline event: one executed (or simulated) action on one rank and stream.

Shared by the runtime recorder, the simulator and the trace writers/plotters, so that a measured and a
predicted timeline of the same configuration have the same shape.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

from .ir import COMPUTE_OPS, DP_OPS, Op

Stream = Literal["compute", "p2p", "dp"]
STREAMS: tuple[Stream, ...] = ("compute", "p2p", "dp")


@dataclass
class TimelineEvent:
    rank: int  # global rank (simulations: pipeline rank)
    stream: Stream  # "compute", "p2p" (pipeline send/recv) or "dp" (data-parallel collectives)
    name: str  # the action's text form, e.g. "F4:0", "GATHER2"; waits are named "wait RECV_F4:0" etc.
    op: str  # "F", "B", "SEND_F", ..., "GATHER", or "WAIT" for a blocking wait
    stage: int | None
    microbatch: int | None
    start: float  # seconds, from a common origin within one timeline
    end: float
    iteration: int = 0
    peer: int | None = None  # receive waits: the sending rank (global), to split bubble from exposed p2p

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> "TimelineEvent":
        return TimelineEvent(**{k: d.get(k) for k in TimelineEvent.__dataclass_fields__})  # type: ignore[arg-type]


def stream_of(op: Op) -> Stream:
    if op in COMPUTE_OPS or op == Op.STEP:  # the optimizer step runs on the compute stream
        return "compute"
    if op in DP_OPS:
        return "dp"
    return "p2p"
