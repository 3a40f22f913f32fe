"""Cost model: time of every schedule action and memory per rank, from a hardware and a model profile.

Compute. Per-op kernel times of a decoder layer, the output layer and the embedding come from `layer_costs`
(GEMMs at measured rates with a per-kernel overhead, flash or unfused attention, elementwise traffic, tensor- and
context-parallel communication, MoE dispatch and experts, FP8 casts; its docstring gives each term). A stage's F is
the sum over its layers (dense and MoE layers differ), plus the embedding on the first stage and the output layer on
the last; its B the backward ops, plus the recomputed forward of its recomputed layers (full recomputation, all or
`recompute_num_layers` of them) or of its core attention (selective recomputation).

Split backward (schedules with I and W ops). W is the weight-gradient GEMMs of the stage's ops, I the rest of the
backward (the input-gradient GEMMs, attention, elementwise, communication) plus any recomputed forward (the input
gradient cannot start without it); `Costs.input_grad_share` carries I / (I + W) per stage. For a GPT layer this is
Qi et al.'s (ICLR 2024, Table 1) split by FLOPs: I = sbh(24h + 8s), W = 24sbh^2. Two other costs of a W:
`Config.w_at_input_grad` models layers that cannot defer their weight GEMMs (TransformerEngine older than 2.7,
Megatron's own deferred embedding wgrad): I is the whole backward and W does nothing, so the split schedules are
their order with B at the I's. `Config.w_reruns_input_grad` models a split on the autograd graph of layers that
are one autograd Function: W re-runs the node's whole backward, so the input-gradient GEMMs are paid twice.

Communication. p2p: fixed overhead + link latency + bytes / achieved bandwidth, on NVLink when both pipeline
ranks share a node, else InfiniBand. Data-parallel collectives are hierarchical rings: a ring inside the node
over NVLink, then a ring across nodes over InfiniBand on 1/n_in of the data (n_in data-parallel peers per node,
each with its own NIC); gradients go over the data- x context-parallel ranks (Megatron's dp-cp group), routed
experts' over the expert-data-parallel ranks. Ranks are laid out as Megatron does (`tp-cp-ep-dp-pp`): tensor-parallel
fastest, then context-, data-parallel, then pipeline; an expert-parallel group spans ETP x EP consecutive ranks.

Memory per rank (bytes per parameter; mixed precision with fp32 gradients and Adam, as Megatron with bf16):
ZeRO-0 (plain DDP) 2 + 4 + 12; ZeRO-1 2 + 4 + 12/D; ZeRO-2 2 + 4/D + 12/D + gradient buffers for
`grad_buffers` stages; ZeRO-3 (2 + 4 + 12)/D + weight buffers for `weight_buffers` stages + gradient buffers; D is
the data- x context-parallel size for dense parameters and the expert-data-parallel size for routed experts. With
FP8, TransformerEngine's quantized weight copies (2 bytes per decoder-layer parameter) stay resident all step.
Activations come from the schedule's own order (see `peak_activation_bytes`); an I frees a micro-batch's
activations except what its pending W keeps (`Partition.pending_weight_grad_bytes`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..schedule import COMPUTE_OPS, Op, Schedule
from ..schedule.ir import INPUT_GRAD_OPS
from ..schedule.kinds import SPLIT_BACKWARD_SCHEDULES
from ..schedule.pairs import COMBINED_1F1B, PAIRED
from .hardware import Hardware
from .layer_costs import (ADAM_BYTES_PER_PARAM, GRAD_BYTES, PARAM_BYTES, all_to_all_time, embedding_ops, gemm_time,
                          group_span, head_ops, layer_ops, p2p_time, ring_time)
from .model import EVEN_STAGES, ModelProfile, Partition, StageSplit

MOE_FIELDS = ("moe_a2a_forward", "moe_a2a_backward", "moe_a2a_recomputed", "moe_cover_forward", "moe_cover_backward")
FP8_WEIGHT_COPY_BYTES = 2  # TransformerEngine's FP8 weight copy and its transpose (Hopper), per parameter



# ---------------------------------------------------------------- placement

@dataclass(frozen=True)
class Placement:
    """Where the GPUs sit (Megatron order `tp-cp-ep-dp-pp`: tensor-parallel fastest, then context-, data-parallel,
    then pipeline; expert groups ETP x EP consecutive ranks)."""

    hw: Hardware
    tp: int
    dp: int
    pp: int
    cp: int = 1
    ep: int = 1
    etp: int | None = None

    def __post_init__(self) -> None:
        g = self.hw.gpus_per_node
        if self.tp > g or g % self.tp:
            raise ValueError(
                f"--tensor-model-parallel-size {self.tp} must divide the {g} GPUs of a {self.hw.name} node"
            )
        span = self.tp * self.cp * self.dp
        if span % (self.ep * (self.etp or self.tp)):
            raise ValueError(
                f"--expert-model-parallel-size {self.ep} x --expert-tensor-parallel-size {self.etp or self.tp} must "
                f"divide the T x CP x D = {span} ranks of a pipeline stage")

    @property
    def grad_group(self) -> tuple[int, int]:
        """(ranks per node, nodes) of the data- x context-parallel group that reduces dense gradients."""
        return group_span(self.hw, self.dp * self.cp, self.tp)

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: the ranks holding the same routed-expert shard."""
        return self.tp * self.cp * self.dp // (self.ep * (self.etp or self.tp))

    @property
    def expert_grad_group(self) -> tuple[int, int]:
        return group_span(self.hw, self.edp, self.ep * (self.etp or self.tp))

    @property
    def dp_in_node(self) -> int:
        return self.grad_group[0]

    @property
    def dp_nodes(self) -> int:
        return self.grad_group[1]

    def pp_inter_node(self, src: int, dst: int) -> bool:
        """Whether pipeline ranks src and dst are on different nodes."""
        span, g = self.tp * self.cp * self.dp, self.hw.gpus_per_node
        return (src * span) // g != (dst * span) // g


# ---------------------------------------------------------------- compute per layer and per stage

def layer_times(hw: Hardware, part: Partition, b: int, layer: int = 0) -> tuple[float, float]:
    """(forward, backward without recompute) seconds of decoder layer `layer` on one micro-batch, per GPU."""
    ops = layer_ops(hw, part, b, layer)
    return ops.forward, ops.backward


def head_times(hw: Hardware, part: Partition, b: int) -> tuple[float, float]:
    """(forward, backward) of the final norm, output layer and vocab-parallel cross entropy."""
    ops = head_ops(hw, part, b)
    return ops.forward, ops.backward


def layer_input_grad_share(part: Partition) -> float:
    """I / (I + W) of one (dense) transformer layer's backward by FLOPs (independent of b and T)."""
    i, w = part.model.layer_backward_flops(1)
    return i / (i + w)


def split_backward_times(hw: Hardware, part: Partition, b: int, w_reruns_input_grad: bool = False,
                         w_at_input_grad: bool = False, layer: int = 0) -> tuple[float, float, float, float]:
    """(layer I, layer W, head I, head W) seconds on one micro-batch, per GPU, without recompute.

    W is the weight-gradient GEMMs, I the rest of the backward; with `w_reruns_input_grad` W also pays the
    input-gradient GEMMs a second time (a split on the autograd graph of one-Function layers); with
    `w_at_input_grad` I is the whole backward and W nothing (layers that cannot defer their weight GEMMs)."""
    if w_reruns_input_grad and w_at_input_grad:
        raise ValueError("a W either re-runs the input-gradient GEMMs or runs at I, not both")
    lo, ho = layer_ops(hw, part, b, layer), head_ops(hw, part, b)
    if w_at_input_grad:
        return lo.backward, 0.0, ho.backward, 0.0
    lw, hw_ = lo.weight_grad, ho.weight_grad
    li, hi = lo.backward - lw, ho.backward - hw_
    if w_reruns_input_grad:  # the input-gradient GEMMs (each the size of its weight-gradient GEMM) again
        lw, hw_ = 2 * lw, 2 * hw_
    return li, lw, hi, hw_


@dataclass(frozen=True)
class StageTimes:
    """Per stage, seconds of its F, its fused B, and its I and W (split backward), one micro-batch, per GPU."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    input_grad: tuple[float, ...]
    weight_grad: tuple[float, ...]


@functools.lru_cache(maxsize=4096)
def stage_times(hw: Hardware, part: Partition, b: int, recompute: bool = False, split_backward: bool = False,
                w_reruns_input_grad: bool = False, w_at_input_grad: bool = False,
                recompute_num_layers: int | None = None, selective_recompute: bool = False) -> StageTimes:
    """Every stage's compute: its layers (dense and MoE op tables, each computed once), the embedding on the
    first stage and the output layer on the last; recomputation as `Config` says."""
    ops_of: dict[bool, tuple[float, float, float, float]] = {}

    def layer(i: int) -> tuple[float, float, float, float]:
        """(F, B, W, recomputed part of F under selective recomputation) of layer i."""
        moe = part.model.is_moe_layer(i)
        if moe not in ops_of:
            o = layer_ops(hw, part, b, i)
            ops_of[moe] = (o.forward, o.backward, o.weight_grad, o.fwd.get("attention", 0.0))
        return ops_of[moe]

    head, emb = head_ops(hw, part, b), embedding_ops(hw, part, b)
    fwd, bwd, inp, wgt = [], [], [], []
    for s in range(part.num_stages):
        st = part.stage(s)
        f = b_ = w = rc = 0.0
        for n, i in enumerate(part.stage_layers(s)):
            lf, lb, lw, attn = layer(i)
            f, b_, w = f + lf, b_ + lb, w + lw
            if recompute and (recompute_num_layers is None or n < recompute_num_layers):
                rc += lf
            elif selective_recompute and part.attention == "unfused":
                rc += attn  # the core attention is recomputed, its s^2 activations not kept
        for extra, share in ((emb, 1.0 if st.first else 0.0), (head, part.head_share(s))):
            if share:
                f, b_, w = f + share * extra.forward, b_ + share * extra.backward, w + share * extra.weight_grad
        if split_backward and w_at_input_grad:
            i_, w = b_ + rc, 0.0
        else:
            i_ = b_ - w + rc
            if split_backward and w_reruns_input_grad:
                w = 2 * w
        fwd.append(f)
        bwd.append(i_ + w if split_backward else b_ + rc)
        inp.append(i_)
        wgt.append(w)
    return StageTimes(tuple(fwd), tuple(bwd), tuple(inp), tuple(wgt))


@dataclass(frozen=True)
class StageA2A:
    """Per stage, for one micro-batch: the seconds of expert-parallel all-to-all inside its F and its backward (B,
    or I where split: W has none) that a merged partner can hide, those of the backward's recomputed forwards
    (never hidden: a conservative choice), and the compute of its MoE layers behind which a partner's all-to-all
    can run (`OpTimes.a2a_cover`; an I's without the weight-gradient GEMMs it leaves to W)."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    recomputed: tuple[float, ...]
    cover_forward: tuple[float, ...]
    cover_backward: tuple[float, ...]


@functools.lru_cache(maxsize=4096)
def stage_a2a_times(hw: Hardware, part: Partition, b: int, recompute: bool = False,
                    recompute_num_layers: int | None = None, input_grad_only: bool = False) -> StageA2A:
    """Every stage's all-to-all and the compute that may cover a partner's (`StageA2A`), summed over its MoE
    layers; `input_grad_only`: the backward is split and its I pairs."""
    per_layer: tuple[float, float, float, float] | None = None
    cols: tuple[list[float], ...] = ([], [], [], [], [])
    for s in range(part.num_stages):
        f = bw = rc = cf = cb = 0.0
        for n, i in enumerate(part.stage_layers(s)):
            if not part.model.is_moe_layer(i):
                continue
            if per_layer is None:  # every MoE layer costs the same
                ops = layer_ops(hw, part, b, i)
                cover_f, cover_b, cover_w = ops.a2a_cover
                per_layer = (ops.fwd.get("moe_a2a", 0.0), ops.bwd.get("moe_a2a", 0.0), cover_f,
                             cover_b - cover_w if input_grad_only else cover_b)
            lf, lb, lcf, lcb = per_layer
            f, bw, cf, cb = f + lf, bw + lb, cf + lcf, cb + lcb
            if recompute and (recompute_num_layers is None or n < recompute_num_layers):
                rc += lf
        for col, v in zip(cols, (f, bw, rc, cf, cb)):
            col.append(v)
    return StageA2A(*(tuple(c) for c in cols))


def config_a2a_times(hw: Hardware, part: Partition, cfg: "Config") -> StageA2A:
    """`stage_a2a_times` of `cfg`: its recomputation and split backward."""
    return stage_a2a_times(hw, part, cfg.micro_batch_size, cfg.recompute,
                           cfg.recompute_num_layers if cfg.recompute else None,
                           cfg.split_backward and not cfg.w_at_input_grad)


def most_hidden(pairing: str | None, a2a_forward: Sequence[float], a2a_backward: Sequence[float],
                cover_forward: Sequence[float], cover_backward: Sequence[float]) -> tuple[list[float], list[float]]:
    """Per stage, the most of one F's and one backward's all-to-all that a partner hides under `pairing`
    (`schedule.pairs`): its all-to-all up to the partner's cover, the partner an action of the same op and stage
    (the paired order) or, in Megatron's combined 1F1B, a backward (forward) of any stage."""
    n = len(a2a_forward)
    if pairing is None:
        return [0.0] * n, [0.0] * n
    if pairing == COMBINED_1F1B:
        cover_f, cover_b = [max(cover_backward, default=0.0)] * n, [max(cover_forward, default=0.0)] * n
    else:
        cover_f, cover_b = list(cover_forward), list(cover_backward)
    return ([min(a, c) for a, c in zip(a2a_forward, cover_f)], [min(a, c) for a, c in zip(a2a_backward, cover_b)])


def least_stage_times(hw: Hardware, part: Partition, cfg: "Config") -> StageTimes:
    """`stage_times` of `cfg`, less the most a partner hides of each F, B and I's all-to-all under its pairing:
    the least each takes in any order (what the planner's throughput bound needs)."""
    t = stage_times(hw, part, cfg.micro_batch_size, cfg.recompute, cfg.split_backward, cfg.w_reruns_input_grad,
                    cfg.w_at_input_grad, cfg.recompute_num_layers, cfg.selective_recompute)
    if cfg.pairing is None:
        return t
    a = config_a2a_times(hw, part, cfg)
    hf, hb = most_hidden(cfg.pairing, a.forward, a.backward, a.cover_forward, a.cover_backward)
    return StageTimes(tuple(x - h for x, h in zip(t.forward, hf)), tuple(x - h for x, h in zip(t.backward, hb)),
                      tuple(x - h for x, h in zip(t.input_grad, hb)), t.weight_grad)


# ---------------------------------------------------------------- costs table consumed by the engine

@dataclass
class Costs:
    """Seconds per action, by stage (and per rank for the optimizer). Built by `analytic_costs` from profiles,
    by `unit_costs` for drawing, or directly from measurements (`from_measurements`)."""

    forward: list[float]  # F of stage s on one micro-batch (includes nothing else)
    backward: list[float]  # B of stage s (includes the recomputed forward when recomputing)
    send_forward: list[float]  # transfer of stage s's output to stage s + 1
    send_backward: list[float]  # transfer of stage s's input gradient to stage s - 1
    gather: list[float]  # ZeRO-3 all-gather of stage s's parameters
    reduce: list[float]  # reduce-scatter (ZeRO >= 1) or all-reduce (ZeRO-0) of stage s's gradients
    param_sync: list[float]  # ZeRO-1/2: post-optimizer all-gather of stage s's parameters (0 otherwise)
    optimizer: list[float]  # per pipeline rank
    # Per stage: its STEP (the optimizer step of its parameter shard), in schedules that place the optimizer;
    # default: each rank's `optimizer` split evenly over its stages (stage s on rank s % P).
    step: list[float] = field(default_factory=list)
    # The gradient norm's all-reduce (clipping) before the first STEP of every rank: latency only.
    grad_norm: float = 0.0
    reduce_buckets: list[int] = field(default_factory=list)  # >1: reduce overlaps the stage's last backward
    param_sync_buckets: list[int] = field(default_factory=list)  # >1: first forward starts after one bucket
    # Per rank: how long before the step starts its first stage's post-optimizer all-gather is issued (Megatron's
    # --overlap-param-gather-with-optimizer-step: during the optimizer steps of the rank's other chunks); 0 otherwise.
    param_sync_lead: list[float] = field(default_factory=list)
    # Split backward: I (input gradient) takes this share of `backward`, W (weight gradients) the rest.
    input_grad_share: list[float] = field(default_factory=list)
    # Expert-parallel all-to-all (MoE) per stage, included in `forward` / `backward`: the seconds of it inside one
    # F and one backward (B, or I where split) that a merged partner can hide, and of a backward's recomputed
    # forwards (never hidden); the compute of each behind which a partner's can run (`StageA2A`). A schedule
    # with a pairing (`schedule.pairs`) hides min(all-to-all, partner's cover) of each action of a pair.
    moe_a2a_forward: list[float] = field(default_factory=list)
    moe_a2a_backward: list[float] = field(default_factory=list)
    moe_a2a_recomputed: list[float] = field(default_factory=list)
    moe_cover_forward: list[float] = field(default_factory=list)
    moe_cover_backward: list[float] = field(default_factory=list)
    dp_overlap: bool = True
    p2p_overlap: bool = True

    def __post_init__(self) -> None:
        n = len(self.forward)
        if not self.reduce_buckets:
            self.reduce_buckets = [1] * n
        if not self.param_sync_buckets:
            self.param_sync_buckets = [1] * n
        if not self.input_grad_share:
            self.input_grad_share = [0.5] * n
        if not self.param_sync_lead:
            self.param_sync_lead = [0.0] * len(self.optimizer)
        for name in MOE_FIELDS:
            if not getattr(self, name):
                setattr(self, name, [0.0] * n)
        pp = len(self.optimizer)
        if not self.step and pp:
            per_rank = [sum(1 for s in range(n) if s % pp == r) for r in range(pp)]
            self.step = [self.optimizer[s % pp] / per_rank[s % pp] for s in range(n)]
        if len(self.param_sync_lead) != len(self.optimizer):
            raise ValueError(f"Costs.param_sync_lead has {len(self.param_sync_lead)} entries for "
                             f"{len(self.optimizer)} ranks")
        for name in ("backward", "send_forward", "send_backward", "gather", "reduce", "param_sync",
                     "reduce_buckets", "param_sync_buckets", "input_grad_share", "step", *MOE_FIELDS):
            if len(getattr(self, name)) != n:
                raise ValueError(f"Costs.{name} has {len(getattr(self, name))} entries for {n} stages")

    @property
    def num_stages(self) -> int:
        return len(self.forward)

    @staticmethod
    def uniform(num_stages: int, pp: int, t_forward: float, t_backward: float, t_send: float = 0.0,
                t_gather: float = 0.0, t_reduce: float = 0.0, t_param_sync: float = 0.0,
                t_optimizer: float = 0.0, dp_overlap: bool = True, p2p_overlap: bool = True,
                t_grad_norm: float = 0.0) -> "Costs":
        """Every stage alike; `t_optimizer` is a rank's whole optimizer step, each STEP its share (1/V)."""
        n = num_stages
        return Costs([t_forward] * n, [t_backward] * n, [t_send] * n, [t_send] * n, [t_gather] * n,
                     [t_reduce] * n, [t_param_sync] * n, [t_optimizer] * pp, grad_norm=t_grad_norm,
                     dp_overlap=dp_overlap, p2p_overlap=p2p_overlap)

    @staticmethod
    def from_measurements(num_stages: int, pp: int, forward: float | list[float], backward: float | list[float],
                          p2p_bytes: float, p2p_bandwidth: float, p2p_latency: float,
                          stage_param_bytes: float | list[float], dp: int, gather_bandwidth: float,
                          reduce_bandwidth: float, collective_latency: float, zero_stage: int,
                          optimizer: float = 0.0, dp_overlap: bool = True, p2p_overlap: bool = True,
                          stage_grad_bytes: float | list[float] | None = None) -> "Costs":
        """Costs from measured per-stage F/B seconds and measured bandwidths (bytes/s, as a flat ring reaches
        them over the D data-parallel ranks). `stage_param_bytes` are the bytes each stage's parameters
        occupy as gathered, `stage_grad_bytes` as reduced (default: fp32 gradients of bf16 weights, twice).
        `optimizer` is a rank's whole optimizer step; each stage's STEP takes the share of its parameters, and the
        gradient norm's all-reduce costs `collective_latency`."""
        def per_stage(v: float | list[float]) -> list[float]:
            return list(v) if isinstance(v, list) else [float(v)] * num_stages

        fwd, bwd, wbytes = per_stage(forward), per_stage(backward), per_stage(stage_param_bytes)
        gbytes = per_stage(stage_grad_bytes) if stage_grad_bytes is not None else [
            w * GRAD_BYTES / PARAM_BYTES for w in wbytes]
        send = [p2p_latency + p2p_bytes / p2p_bandwidth if pp > 1 else 0.0] * num_stages
        frac = (dp - 1) / dp if dp > 1 else 0.0
        lat = collective_latency if dp > 1 else 0.0
        ag = [lat + frac * w / gather_bandwidth for w in wbytes]
        grad = [lat + frac * g / reduce_bandwidth for g in gbytes]
        if zero_stage == 0:
            grad = [2 * g for g in grad]
        rank_bytes = [sum(wbytes[s] for s in range(r, num_stages, pp)) for r in range(pp)]
        step = [optimizer * wbytes[s] / rank_bytes[s % pp] if rank_bytes[s % pp] > 0
                else optimizer * pp / num_stages for s in range(num_stages)]
        return Costs(fwd, bwd, list(send), list(send), ag if zero_stage == 3 else [0.0] * num_stages, grad,
                     ag if zero_stage in (1, 2) else [0.0] * num_stages, [optimizer] * pp, step=step,
                     grad_norm=collective_latency if dp * pp > 1 else 0.0, dp_overlap=dp_overlap,
                     p2p_overlap=p2p_overlap)


def unit_costs(schedule: Schedule, t_forward: float = 1.0, t_backward: float = 2.0) -> Costs:
    """t_F = 1, t_B = 2, free communication: lays out any schedule for drawing and for bubble analysis."""
    return Costs.uniform(schedule.num_stages, schedule.pp, t_forward, t_backward)


@dataclass(frozen=True)
class Config:
    """One training configuration as the simulator and planner see it."""

    tp: int
    pp: int
    vp: int
    dp: int
    micro_batch_size: int
    microbatches: int  # per data-parallel rank per step
    schedule: str
    zero_stage: int  # 0 = plain DDP all-reduce, 1-3 = ZeRO stage
    recompute: bool
    group_size: int | None = None
    dp_overlap: bool = True
    p2p_overlap: bool = True
    weight_buffers: int = 2
    grad_buffers: int = 2
    # Split-backward schedules only: W re-runs the input-gradient GEMMs too (a split on the autograd graph of
    # one-Function layers) ...
    w_reruns_input_grad: bool = False
    # ... or W's work runs at I (layers that cannot defer, e.g. TransformerEngine older than 2.7).
    w_at_input_grad: bool = False
    split: StageSplit = EVEN_STAGES  # how Megatron-LM spreads the layers over the stages
    # Megatron's --overlap-param-gather-with-optimizer-step (its interleaved schedule with the distributed
    # optimizer): the first chunk's optimizer steps first and its all-gather runs during the other chunks' steps.
    param_gather_with_optimizer: bool = False
    # The optimizer is stock Megatron's, outside the schedule (its schedules and every Megatron baseline): the
    # step waits for the whole optimizer. Otherwise the schedule places it (STEP per stage at the step boundary).
    stock_optimizer: bool = False
    # --- how the layers run (Megatron-LM's flags of the same names)
    cp: int = 1  # --context-parallel-size
    ep: int = 1  # --expert-model-parallel-size
    etp: int | None = None  # --expert-tensor-parallel-size (default T)
    sequence_parallel: bool = True  # --sequence-parallel (at T > 1)
    attention: str = "flash"  # "unfused": --attention-backend local (scores materialised)
    fp8: str | None = None  # --fp8-format with this --fp8-recipe; None: bf16 GEMMs
    tp_comm_overlap: bool = False  # --tp-comm-overlap
    moe_a2a_overlap: bool = False  # --overlap-moe-expert-parallel-comm (Megatron's combined 1F1B)
    # --paired-moe-a2a-overlap: the plugin's paired order (`schedule.pairs`), simulated only: two actions of the
    # same op and stage that the schedule runs back to back run merged, each hiding the other's all-to-all.
    paired_moe_a2a_overlap: bool = False
    recompute_num_layers: int | None = None  # full recomputation of only the first N layers of a stage (block)
    selective_recompute: bool = False  # --recompute-granularity selective (core attention)
    grad_reduce_bf16: bool = False  # --grad-reduce-in-bf16: gradient buffers and their reduction in bf16
    output_layer_over_pipeline: bool = False  # what-if, no flag runs it: `Partition.output_layer_over_pipeline`

    @property
    def grad_bytes(self) -> int:
        """Bytes per gradient element as reduced and buffered (Megatron's main_grad dtype)."""
        return 2 if self.grad_reduce_bf16 else GRAD_BYTES

    @property
    def optimizer_in_schedule(self) -> bool:
        """Whether the schedule carries the optimizer step (STEP actions): not for stock Megatron's optimizer,
        which --overlap-param-gather-with-optimizer-step also implies."""
        return not (self.stock_optimizer or self.param_gather_with_optimizer)

    def partition(self, model: ModelProfile) -> Partition:
        """The model cut into this configuration's stages."""
        return _partition(model, self.tp, self.pp, self.vp, self.split, self.cp, self.ep, self.etp,
                          self.sequence_parallel, self.attention, self.fp8, self.tp_comm_overlap,
                          self.output_layer_over_pipeline)

    def placement(self, hw: Hardware) -> Placement:
        return Placement(hw, self.tp, self.dp, self.pp, self.cp, self.ep, self.etp)

    @property
    def split_backward(self) -> bool:
        return self.schedule in SPLIT_BACKWARD_SCHEDULES

    @property
    def pairing(self) -> str | None:
        """How the schedule merges actions two at a time so that their expert all-to-alls hide (`schedule.pairs`):
        Megatron's combined 1F1B, the plugin's paired order, or none (also at EP = 1: nothing to hide)."""
        if self.ep <= 1:
            return None
        return COMBINED_1F1B if self.moe_a2a_overlap else PAIRED if self.paired_moe_a2a_overlap else None

    @property
    def num_gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.microbatches * self.dp


@functools.lru_cache(maxsize=4096)
def _partition(model: ModelProfile, tp: int, pp: int, vp: int, split: StageSplit, cp: int, ep: int, etp: int | None,
               sequence_parallel: bool, attention: str, fp8: str | None, tp_comm_overlap: bool,
               output_layer_over_pipeline: bool = False) -> Partition:
    """One Partition per distinct cut (the planner asks for the same one for every schedule and ZeRO stage)."""
    return Partition(model, tp, pp, vp, split, cp=cp, ep=ep, etp=etp, sequence_parallel=sequence_parallel,
                     attention=attention, fp8=fp8, tp_comm_overlap=tp_comm_overlap,
                     output_layer_over_pipeline=output_layer_over_pipeline)


def analytic_costs(hw: Hardware, part: Partition, cfg: Config) -> Costs:
    """Costs of every action of `cfg` from the hardware and model profiles."""
    b, n_stages, pp = cfg.micro_batch_size, part.num_stages, cfg.pp
    times = stage_times(hw, part, b, cfg.recompute, cfg.split_backward, cfg.w_reruns_input_grad,
                        cfg.w_at_input_grad, cfg.recompute_num_layers, cfg.selective_recompute)
    place = cfg.placement(hw)
    sf, sb, ag, red, sync, rb, sbk, share = [], [], [], [], [], [], [], []
    for s in range(n_stages):
        st = part.stage(s)
        i, w = times.input_grad[s], times.weight_grad[s]
        share.append(i / (i + w) if i + w > 0 else 0.5)  # used only by split schedules
        r = s % pp
        msg = part.p2p_bytes(b)
        sf.append(p2p_time(hw, msg, place.pp_inter_node(r, (s + 1) % pp)) if pp > 1 and s < n_stages - 1 else 0.0)
        sb.append(p2p_time(hw, msg, place.pp_inter_node(r, (s - 1) % pp)) if pp > 1 and s > 0 else 0.0)
        experts = part.stage_expert_params(s)
        dense = part.stage_params(s) - experts
        kind = "all_reduce" if cfg.zero_stage == 0 else "reduce_scatter"
        gather = (ring_time(hw, PARAM_BYTES * dense, *place.grad_group, "all_gather")
                  + ring_time(hw, PARAM_BYTES * experts, *place.expert_grad_group, "all_gather"))
        reduce = (ring_time(hw, cfg.grad_bytes * dense, *place.grad_group, kind)
                  + ring_time(hw, cfg.grad_bytes * experts, *place.expert_grad_group, kind))
        if st.last and not st.first and not part.model.untie_embeddings:
            # Tied embeddings on a pipeline: the word-embedding gradient is all-reduced between the first and the
            # last stage (Megatron's embedding group) before the data-parallel reduction.
            emb = cfg.grad_bytes * part.padded_vocab * part.model.hidden_size / part.tp
            reduce += ring_time(hw, emb, 1, 2, "all_reduce") if place.pp_inter_node(0, r) else \
                ring_time(hw, emb, 2, 1, "all_reduce")
        ag.append(gather if cfg.zero_stage == 3 else 0.0)
        red.append(reduce)
        sync.append(gather if cfg.zero_stage in (1, 2) else 0.0)
        # Gradients: a stage's reduction starts after its last backward, all buckets at once: Megatron's default
        # (--align-grad-reduce: each chunk's start_grad_sync after its last backward) and the plugin's REDUCE.
        # Only Megatron's non-interleaved 1F1B lets the first pipeline stage's buckets go as its last backward
        # produces them (about one bucket per layer at these sizes).
        rb.append(st.layers if cfg.zero_stage <= 1 and cfg.vp == 1 and s == 0 and st.layers else 1)
        # Parameters (ZeRO-0/1, Megatron's overlapped gather): a chunk's first forward waits bucket by bucket;
        # the sharded runtime (ZeRO-2/3) gathers a stage's flat buffer at once, and so does Megatron with
        # --overlap-param-gather-with-optimizer-step (which turns its bucketing off, training.py).
        sbk.append(st.layers if cfg.zero_stage <= 1 and not cfg.param_gather_with_optimizer and st.layers else 1)
    opt = []
    for r in range(pp):
        shard = sharded_params(part, cfg, r) if cfg.zero_stage else part.rank_params(r)
        opt.append(ADAM_BYTES_PER_PARAM * shard / hw.memory_bw + 10 * hw.kernel_overhead_s)
    lead = [0.0] * pp
    if cfg.param_gather_with_optimizer:
        # The first chunk (stage r) steps first, in time proportional to its parameters; its all-gather starts
        # then, while the other chunks step and the slowest rank finishes: that long before the next step.
        lead = [max(opt) - opt[r] * part.stage_params(r) / part.rank_params(r) for r in range(pp)]
    # A schedule-placed step: each stage's STEP takes the rank's optimizer time in proportion to its parameters.
    step = [opt[s % pp] * part.stage_params(s) / part.rank_params(s % pp) if part.rank_params(s % pp) else 0.0
            for s in range(n_stages)]
    # The gradient norm (clipping): one scalar all-reduce over every rank, modelled as latency alone, the
    # fixed cost of one collective.
    grad_norm = hw.collective_overhead_s if cfg.num_gpus > 1 else 0.0
    a2a = config_a2a_times(hw, part, cfg)
    return Costs(list(times.forward), list(times.backward), sf, sb, ag, red, sync, opt, step=step,
                 grad_norm=grad_norm, reduce_buckets=rb, param_sync_buckets=sbk, param_sync_lead=lead,
                 input_grad_share=share, moe_a2a_forward=list(a2a.forward), moe_a2a_backward=list(a2a.backward),
                 moe_a2a_recomputed=list(a2a.recomputed), moe_cover_forward=list(a2a.cover_forward),
                 moe_cover_backward=list(a2a.cover_backward), dp_overlap=cfg.dp_overlap, p2p_overlap=cfg.p2p_overlap)


def sharded_params(part: Partition, cfg: Config, rank: int) -> float:
    """Parameters of pipeline rank `rank` whose optimizer state one GPU holds under ZeRO >= 1: dense ones over the
    data- x context-parallel ranks, routed experts over the expert-data-parallel ranks."""
    experts = sum(part.stage_expert_params(s) for s in range(rank, part.num_stages, cfg.pp))
    dense = part.rank_params(rank) - experts
    edp = part.tp * cfg.cp * cfg.dp // (cfg.ep * part.expert_tp)
    return dense / (cfg.dp * cfg.cp) + experts / max(1, edp)


# ---------------------------------------------------------------- memory

def peak_activation_bytes(schedule: Schedule, rank: int, stage_bytes: Callable[[int], float],
                          pending_w_bytes: Callable[[int], float] | None = None) -> float:
    """Largest sum of kept activations over the rank's program order: F adds its stage's bytes, B frees them;
    an I frees them but keeps `pending_w_bytes` (the weight-GEMM inputs) until its W."""
    alive = peak = 0.0
    for a in schedule.ranks[rank]:
        if a.op == Op.F:
            alive += stage_bytes(a.stage)
        elif a.op in INPUT_GRAD_OPS:
            alive -= stage_bytes(a.stage)
            if a.op == Op.I and pending_w_bytes is not None:
                alive += pending_w_bytes(a.stage)
        elif a.op == Op.W and pending_w_bytes is not None:
            alive -= pending_w_bytes(a.stage)
        peak = max(peak, alive)
    if schedule.forward_only:
        return max((stage_bytes(a.stage) for a in schedule.ranks[rank] if a.op in COMPUTE_OPS), default=0.0)
    return peak


def memory_breakdown(part: Partition, cfg: Config, rank: int, activations: float) -> dict[str, float]:
    """Bytes per category on one GPU of pipeline rank `rank` (`activations` from `peak_activation_bytes`)."""
    phi = part.rank_params(rank)
    shard = sharded_params(part, cfg, rank)
    stages = [rank + c * cfg.pp for c in range(cfg.vp)]
    sizes = sorted((part.stage_params(s) for s in stages), reverse=True)
    z, g = cfg.zero_stage, cfg.grad_bytes
    wbuf = sum(sizes[: cfg.weight_buffers])  # buffers sized for the largest stages they may hold
    gbuf = sum(sizes[: cfg.grad_buffers])
    mem = {"weights": 0.0, "weight_buffers": 0.0, "gradients": 0.0, "grad_buffers": 0.0, "optimizer": 0.0}
    if z == 0:
        mem.update(weights=PARAM_BYTES * phi, gradients=g * phi, optimizer=12 * phi)
    elif z == 1:
        mem.update(weights=PARAM_BYTES * phi, gradients=g * phi, optimizer=12 * shard)
    elif z == 2:
        mem.update(weights=PARAM_BYTES * phi, gradients=g * shard, optimizer=12 * shard,
                   grad_buffers=g * gbuf)
    elif z == 3:
        mem.update(weights=PARAM_BYTES * shard, weight_buffers=PARAM_BYTES * wbuf,
                   gradients=g * shard, grad_buffers=g * gbuf, optimizer=12 * shard)
    else:
        raise ValueError(f"--zero-stage must be 0, 1, 2 or 3 (got {z})")
    if cfg.fp8 is not None:
        # TransformerEngine keeps each FP8 layer's quantized weight (and on Hopper its transpose) from micro-batch 0
        # to the end of the step, through ZeRO-3's releases: about 2 bytes per decoder-layer parameter.
        mem["fp8_weight_copies"] = FP8_WEIGHT_COPY_BYTES * sum(part.stage_layer_params(s) for s in stages)
    mem["activations"] = activations
    mem["working"] = max(part.working_bytes(s, cfg.micro_batch_size) for s in stages)
    if (cfg.moe_a2a_overlap or cfg.paired_moe_a2a_overlap) and cfg.ep > 1 and any(
            part.model.is_moe_layer(i) for s in stages for i in part.stage_layers(s)):
        mem["working"] *= 2  # both overlaps run two micro-batches of a layer at once
    mem["total"] = sum(mem.values())
    return mem
