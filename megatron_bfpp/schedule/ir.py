"""The schedule IR: actions, per-rank action lists, and the compact text form.

An action is (op, stage, microbatch). Stage s lives on pipeline rank s mod P (Megatron's interleaved
placement); its local model-chunk index on that rank is s // P.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field, replace


class Op(str, enum.Enum):
    F = "F"  # forward of one (stage, microbatch)
    B = "B"  # backward of one (stage, microbatch): input and weight gradients together
    I = "I"  # noqa: E741  # split backward, part 1: the gradient w.r.t. the stage input (what stage - 1 waits for)
    W = "W"  # split backward, part 2: the weight gradients (nothing downstream waits for them)
    SEND_F = "SEND_F"  # send stage's forward output to stage + 1
    RECV_F = "RECV_F"  # receive stage's forward input from stage - 1
    SEND_B = "SEND_B"  # send gradient of stage's input to stage - 1
    RECV_B = "RECV_B"  # receive gradient of stage's output from stage + 1
    GATHER = "GATHER"  # all-gather a stage's parameters (ZeRO-3)
    RELEASE = "RELEASE"  # free the gathered copy of a stage's parameters
    REDUCE = "REDUCE"  # reduce-scatter a stage's gradients into the local shard
    STEP = "STEP"  # optimizer step of a stage's parameter shard (at the step boundary, after the gradient norm)

    def __str__(self) -> str:
        return self.value


COMPUTE_OPS = frozenset({Op.F, Op.B, Op.I, Op.W})
BACKWARD_OPS = frozenset({Op.B, Op.I, Op.W})  # ops that touch a stage's gradients
INPUT_GRAD_OPS = frozenset({Op.B, Op.I})  # ops that produce the gradient of the stage input
P2P_OPS = frozenset({Op.SEND_F, Op.RECV_F, Op.SEND_B, Op.RECV_B})
DP_OPS = frozenset({Op.GATHER, Op.RELEASE, Op.REDUCE})
STAGE_OPS = DP_OPS | {Op.STEP}  # actions on a whole stage: they carry no micro-batch


def weight_ops(w_needs_weights: bool) -> frozenset[Op]:
    """Compute ops that read their stage's weights: all of them, or all but W when a W computes weight
    gradients from kept activations alone."""
    return COMPUTE_OPS if w_needs_weights else COMPUTE_OPS - {Op.W}


def grad_write_ops(i_writes_grads: bool) -> frozenset[Op]:
    """Compute ops that write their stage's gradient buffer: B and W, and I as well when layers accumulate
    into main_grad inside the input-gradient backward (fused accumulation in layers that cannot defer)."""
    return frozenset({Op.B, Op.I, Op.W}) if i_writes_grads else frozenset({Op.B, Op.W})


class ScheduleError(ValueError):
    """A schedule (or its configuration) is invalid. The message names the flag or the rank/step/action."""


# Default channel of each p2p op: activations and gradients travel on separate process groups.
DEFAULT_CHANNEL = {"SEND_F": "activations", "RECV_F": "activations", "SEND_B": "gradients", "RECV_B": "gradients"}


@dataclass(frozen=True, order=True)
class Action:
    """One step of a rank's list. For p2p ops the list order is the order the rank posts them in.

    `batch`: p2p actions posted together as one `batch_isend_irecv` group are consecutive and share a value
    (None: posted alone, which the runtime does as a `batch_isend_irecv` of one op). `channel`: the channel (one
    process group of the runtime) a p2p action is posted on, the op's default (`DEFAULT_CHANNEL`) unless given;
    None for other actions. Neither takes part in equality: an action is identified by (op, stage, microbatch).
    """

    op: Op
    stage: int
    microbatch: int | None = None
    batch: int | None = field(default=None, compare=False)
    channel: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.op, Op):
            object.__setattr__(self, "op", Op(self.op))
        if self.op in STAGE_OPS and self.microbatch is not None:
            raise ScheduleError(f"{self.op} carries no microbatch (got {self.microbatch})")
        if self.op not in STAGE_OPS and self.microbatch is None:
            raise ScheduleError(f"{self.op} needs a microbatch")
        if self.op not in P2P_OPS and (self.batch is not None or self.channel is not None):
            raise ScheduleError(f"{self.op} is not a p2p action: it takes no batch or channel")
        if self.op in P2P_OPS and self.channel is None:
            object.__setattr__(self, "channel", DEFAULT_CHANNEL[self.op.value])

    @property
    def serialized_channel(self) -> str | None:
        """`channel` as the text, JSON and CSV forms carry it: None when it is the op's default."""
        return None if self.channel == DEFAULT_CHANNEL.get(self.op.value) else self.channel

    @property
    def text(self) -> str:
        """Compact form: `F4:0` (op, stage, microbatch), `GATHER4`, `STEP4` (whole-stage ops); p2p actions may add
        `@batch` and `/channel` (when not the op's default), e.g. `SEND_F0:1@3`."""
        base = f"{self.op.value}{self.stage}" if self.microbatch is None else f"{self.op.value}{self.stage}:{self.microbatch}"
        if self.batch is not None:
            base += f"@{self.batch}"
        if self.serialized_channel is not None:
            base += f"/{self.serialized_channel}"
        return base

    @property
    def key(self) -> str:
        """`text` without batch and channel."""
        return replace(self, batch=None, channel=None).text

    def __str__(self) -> str:
        return self.text

    def to_dict(self) -> dict:
        d: dict = {"op": self.op.value, "stage": self.stage, "microbatch": self.microbatch}
        if self.op in P2P_OPS:
            d["batch"] = self.batch
            if self.serialized_channel is not None:
                d["channel"] = self.serialized_channel
        return d

    @staticmethod
    def from_dict(d: dict) -> "Action":
        mb, batch, channel = d.get("microbatch"), d.get("batch"), d.get("channel")
        return Action(Op(d["op"]), int(d["stage"]), None if mb is None or mb == "" else int(mb),
                      None if batch is None or batch == "" else int(batch), channel or None)

    @staticmethod
    def parse(text: str) -> "Action":
        m = _ACTION_RE.fullmatch(text.strip())
        if not m:
            raise ScheduleError(f"cannot parse action {text!r}: expected e.g. 'F4:0', 'SEND_B3:1@2' or 'GATHER2'")
        op, stage, mb, batch, channel = m.group(1), int(m.group(2)), m.group(3), m.group(4), m.group(5)
        return Action(Op(op), stage, None if mb is None else int(mb), None if batch is None else int(batch),
                      channel)


_ACTION_RE = re.compile(
    r"(SEND_F|RECV_F|SEND_B|RECV_B|GATHER|RELEASE|REDUCE|STEP|F|B|I|W)(\d+)(?::(\d+))?(?:@(\d+))?(?:/([A-Za-z_][\w-]*))?"
)


@dataclass
class Schedule:
    """Per-rank action lists plus the configuration they were built for."""

    name: str
    pp: int
    vp: int
    microbatches: int
    group_size: int | None
    ranks: list[list[Action]]
    zero_stage: int | None = None  # set once data-parallel actions are lowered in
    lowered: bool = False  # p2p actions present
    forward_only: bool = False
    weight_buffers: int = 2
    grad_buffers: int = 2
    # False when a W computes weight gradients from kept activations alone (deferred weight GEMMs): ZeRO-3
    # then releases a stage's weights after its last F/B/I, and a W may run with them released.
    w_needs_weights: bool = True
    # True when an I writes its stage's gradient buffer (fused accumulation into main_grad): ZeRO-2/3 then
    # hold a stage's gradient buffer from its first I, not its first W.
    i_writes_grads: bool = False
    # How actions run merged two at a time (`pairs.PAIRINGS`; None: one at a time): the p2p lowering posts a
    # pair's two inputs before it and its two outputs after it.
    pairing: str | None = None
    meta: dict = field(default_factory=dict)

    @property
    def num_stages(self) -> int:
        return self.pp * self.vp

    def rank_of(self, stage: int) -> int:
        return stage % self.pp

    def chunk_of(self, stage: int) -> int:
        return stage // self.pp

    def stages_of(self, rank: int) -> list[int]:
        return [rank + c * self.pp for c in range(self.vp)]

    @property
    def weight_ops(self) -> frozenset[Op]:
        """Compute ops of this schedule that read their stage's weights (ZeRO-3: they run gathered)."""
        return weight_ops(self.w_needs_weights)

    @property
    def grad_write_ops(self) -> frozenset[Op]:
        """Compute ops of this schedule that write their stage's gradient buffer (ZeRO-2/3: it must exist)."""
        return grad_write_ops(self.i_writes_grads)

    def split_pairs(self, rank: int | None = None) -> set[tuple[int, int]]:
        """(stage, micro-batch) pairs whose backward is split into I and W, on `rank` (default: all ranks)."""
        ranks = self.ranks if rank is None else [self.ranks[rank]]
        return {(a.stage, a.microbatch) for actions in ranks for a in actions if a.op == Op.I}

    def step_boundary(self, rank: int) -> int | None:
        """Index of the rank's first STEP: where the optimizer's part of the list begins (None: no STEP)."""
        return next((i for i, a in enumerate(self.ranks[rank]) if a.op == Op.STEP), None)

    def step_tail(self, rank: int) -> list[Action]:
        """The rank's actions from its first STEP on (STEPs and the parameter all-gathers they launch)."""
        i = self.step_boundary(rank)
        return [] if i is None else self.ranks[rank][i:]

    def compute_actions(self, rank: int) -> list[Action]:
        return [a for a in self.ranks[rank] if a.op in COMPUTE_OPS]

    def last_releases(self, rank: int) -> set[int]:
        """Indices of the rank's RELEASEs after which no compute of their stage follows: each stage's last of a
        run (ZeRO-3), where what only that stage's computes use may go until the next run."""
        out: set[int] = set()
        computed_later: set[int] = set()
        for i in range(len(self.ranks[rank]) - 1, -1, -1):
            a = self.ranks[rank][i]
            if a.op in COMPUTE_OPS:
                computed_later.add(a.stage)
            elif a.op == Op.RELEASE and a.stage not in computed_later:
                out.add(i)
                computed_later.add(a.stage)  # earlier RELEASEs of the stage are not its last
        return out

    def count(self, rank: int, op: Op) -> int:
        return sum(1 for a in self.ranks[rank] if a.op == op)

    def header(self) -> str:
        return (
            f"# schedule={self.name} pp={self.pp} vp={self.vp} microbatches={self.microbatches} "
            f"group_size={self.group_size} zero_stage={self.zero_stage} lowered={int(self.lowered)} "
            f"forward_only={int(self.forward_only)} weight_buffers={self.weight_buffers} "
            f"grad_buffers={self.grad_buffers}" + ("" if self.w_needs_weights else " w_needs_weights=0")
            + (" i_writes_grads=1" if self.i_writes_grads else "") + (f" pairing={self.pairing}" if self.pairing else "")
        )

    def to_text(self) -> str:
        lines = [self.header()]
        for r, actions in enumerate(self.ranks):
            lines.append(f"rank {r}: " + " ".join(a.text for a in actions))
        return "\n".join(lines) + "\n"

    @staticmethod
    def from_text(text: str) -> "Schedule":
        header: dict[str, str] = {}
        ranks: dict[int, list[Action]] = {}
        for line in text.splitlines():
            line = line.strip()
            if not line:
                continue
            if line.startswith("#"):
                for tok in line[1:].split():
                    if "=" in tok:
                        k, v = tok.split("=", 1)
                        header[k] = v
                continue
            m = re.fullmatch(r"rank\s+(\d+)\s*:(.*)", line)
            if not m:
                raise ScheduleError(f"cannot parse schedule line {line!r}: expected 'rank R: F0:0 B0:0 ...'")
            ranks[int(m.group(1))] = [Action.parse(t) for t in m.group(2).split()]
        return _schedule_from_parts(header, ranks)


def _opt_int(v: object) -> int | None:
    return None if v in (None, "None", "null", "") else int(v)  # type: ignore[arg-type]


def _schedule_from_parts(header: dict, ranks: dict[int, list[Action]]) -> Schedule:
    if not ranks:
        raise ScheduleError("schedule has no ranks")
    if sorted(ranks) != list(range(len(ranks))):
        raise ScheduleError(f"schedule ranks must be 0..{len(ranks) - 1}, got {sorted(ranks)}")
    pp = int(header.get("pp", len(ranks)))
    if pp != len(ranks):
        raise ScheduleError(f"schedule declares pp={pp} but lists {len(ranks)} ranks")
    all_actions = [a for acts in ranks.values() for a in acts]
    stages = {a.stage for a in all_actions}
    mbs = {a.microbatch for a in all_actions if a.microbatch is not None}
    vp = int(header.get("vp", (max(stages) // pp + 1) if stages else 1))
    m = int(header.get("microbatches", (max(mbs) + 1) if mbs else 0))
    ops = {a.op for a in all_actions}
    return Schedule(
        name=str(header.get("schedule", "custom")),
        pp=pp,
        vp=vp,
        microbatches=m,
        group_size=_opt_int(header.get("group_size")),
        ranks=[ranks[r] for r in range(len(ranks))],
        zero_stage=_opt_int(header.get("zero_stage")),
        lowered=bool(int(header.get("lowered", int(bool(ops & P2P_OPS))))),
        forward_only=bool(int(header.get("forward_only", int(not ops & BACKWARD_OPS)))),
        weight_buffers=int(header.get("weight_buffers", 2)),
        grad_buffers=int(header.get("grad_buffers", 2)),
        w_needs_weights=str(header.get("w_needs_weights", 1)).lower() not in ("0", "false"),
        i_writes_grads=str(header.get("i_writes_grads", 0)).lower() in ("1", "true"),
        pairing=header.get("pairing") or None,
    )
