"""Cost model: time of every schedule action and memory per rank, from a hardware and a model profile.

Compute. Each GEMM of m x k x n costs `max(2mkn / (peak * gemm_efficiency), bytes / (HBM * memory_efficiency))
+ kernel_overhead`. The fixed overhead gives the achieved-efficiency curve

    efficiency(f) = gemm_efficiency * f / (f + f_half),   f_half = kernel_overhead * peak * gemm_efficiency,

which falls for small matrices (f = FLOPs of the GEMM) and is capped by memory bandwidth for thin ones; both
parameters are calibration values of the hardware profile. A layer is its four weight GEMMs (QKV, projection,
fc1, fc2 on the tensor-parallel shard), the attention matmuls (flash-style, same curve), elementwise work
(LayerNorm, GeLU, dropout, residual: about 38 bytes per token and hidden unit, bandwidth-bound) and, with
T > 1, the sequence-parallel all-gathers / reduce-scatters on NVLink (two of each per layer and direction,
not overlapped: Megatron's default). Backward = dgrad + wgrad GEMMs (twice the forward) plus the same
communication; full recomputation adds one forward to every backward.

Split backward (schedules with I and W ops). The backward time of a stage is shared between I (the gradient
of the stage input) and W (the weight gradients) by FLOPs, per Qi et al. (ICLR 2024) Table 1: per layer
I = sbh(24h + 8s), W = 24sbh^2 (`ModelProfile.layer_backward_flops`); the output layer and loss half and half;
a recomputed forward belongs to I (the input gradient cannot start without it). `Costs.input_grad_share`
carries I / (I + W) per stage. Two other costs of a W: `Config.w_at_input_grad` models layers that cannot
defer their weight GEMMs, as the runtime runs them on Megatron-Core chunks (TransformerEngine older than 2.3,
Megatron's own deferred embedding wgrad): I is the whole backward and W does nothing, so the split
schedules are their order with B at the I's. `Config.w_reruns_input_grad` models a split on the autograd graph
of layers that are one autograd Function (what the runtime does on chunks without Megatron-Core modules): W
re-runs the node's whole backward, so the input-gradient GEMMs are paid twice.

Communication. p2p: fixed overhead + link latency + bytes / achieved bandwidth, on NVLink when both pipeline
ranks share a node, else InfiniBand. Data-parallel collectives are hierarchical rings: a ring inside the node
over NVLink, then a ring across nodes over InfiniBand on 1/n_in of the data (n_in data-parallel peers per node,
each with its own NIC). Ranks are laid out as Megatron does: tensor-parallel fastest, then data-parallel,
then pipeline.

Memory per rank (bytes per parameter; mixed precision with fp32 gradients and Adam, as Megatron with bf16):
ZeRO-0 (plain DDP) 2 + 4 + 12; ZeRO-1 2 + 4 + 12/D; ZeRO-2 2 + 4/D + 12/D + gradient buffers for
`grad_buffers` stages; ZeRO-3 (2 + 4 + 12)/D + weight buffers for `weight_buffers` stages + gradient buffers.
Activations come from the schedule's own order (see `peak_activation_bytes`); an I frees a micro-batch's
activations except what its pending W keeps (`Partition.pending_weight_grad_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..schedule import COMPUTE_OPS, Op, Schedule
from ..schedule.ir import INPUT_GRAD_OPS
from ..schedule.kinds import SPLIT_BACKWARD_SCHEDULES
from .hardware import Hardware
from .model import EVEN_STAGES, ModelProfile, Partition, StageSplit

ELEMENTWISE_BYTES_PER_TOKEN_HIDDEN = 38  # LN in/out 4+4, GeLU on 4h 16, two dropout+residual 7+7 (bf16)
ELEMENTWISE_KERNELS_PER_LAYER = 8
ADAM_BYTES_PER_PARAM = 30  # read grad, master, m, v (16), write master, m, v (12), write bf16 weight (2)
GRAD_BYTES = 4  # fp32 gradient reduction (Megatron's default with bf16)
PARAM_BYTES = 2  # bf16 weights, as gathered


# ---------------------------------------------------------------- compute

def gemm_time(hw: Hardware, m: float, k: float, n: float, count: int = 1) -> float:
    """Seconds for `count` bf16 GEMMs of m x k x n (roofline with a fixed per-kernel overhead)."""
    flops = 2.0 * m * k * n
    nbytes = 2.0 * (m * k + k * n + m * n)
    t = max(flops / (hw.peak_flops * hw.gemm_efficiency), nbytes / (hw.hbm_bandwidth * hw.memory_efficiency))
    return count * (t + hw.kernel_overhead_s)


def ring_time(hw: Hardware, nbytes: float, n_in: int, n_out: int, kind: str) -> float:
    """Hierarchical ring all-gather / reduce-scatter / all-reduce of a tensor of `nbytes` (full size) over
    n_in ranks per node (NVLink) times n_out nodes (InfiniBand, 1/n_in of the data per NIC)."""
    if n_in * n_out <= 1 or nbytes <= 0:
        return 0.0
    t = hw.collective_overhead_s
    if n_in > 1:
        t += (n_in - 1) / n_in * nbytes / hw.nvlink_bw + (n_in - 1) * hw.nvlink_latency_s
    if n_out > 1:
        t += (n_out - 1) / n_out * (nbytes / n_in) / hw.ib_bw + (n_out - 1) * hw.ib_latency_s
    if kind == "all_reduce":  # reduce-scatter then all-gather
        return 2 * t
    if kind not in ("all_gather", "reduce_scatter"):
        raise ValueError(f"unknown collective {kind!r}")
    return t


def p2p_time(hw: Hardware, nbytes: float, inter_node: bool) -> float:
    if nbytes <= 0:
        return 0.0
    bw, lat = (hw.ib_bw, hw.ib_latency_s) if inter_node else (hw.nvlink_bw, hw.nvlink_latency_s)
    return hw.collective_overhead_s + lat + nbytes / bw


@dataclass(frozen=True)
class Placement:
    """Where the T x D x P GPUs sit (Megatron order: tensor-parallel fastest, then data-parallel, then pipeline)."""

    hw: Hardware
    tp: int
    dp: int
    pp: int

    def __post_init__(self) -> None:
        g = self.hw.gpus_per_node
        if self.tp > g or g % self.tp:
            raise ValueError(
                f"--tensor-model-parallel-size {self.tp} must divide the {g} GPUs of a {self.hw.name} node"
            )

    @property
    def dp_in_node(self) -> int:
        return min(self.dp, self.hw.gpus_per_node // self.tp)

    @property
    def dp_nodes(self) -> int:
        return self.dp // self.dp_in_node

    def pp_inter_node(self, src: int, dst: int) -> bool:
        """Whether pipeline ranks src and dst are on different nodes."""
        span, g = self.tp * self.dp, self.hw.gpus_per_node
        return (src * span) // g != (dst * span) // g


def layer_times(hw: Hardware, part: Partition, b: int) -> tuple[float, float]:
    """(forward, backward without recompute) seconds of one transformer layer on one micro-batch, per GPU."""
    fwd, bwd, _ = _layer_times(hw, part, b)
    return fwd, bwd


def layer_input_grad_share(part: Partition) -> float:
    """I / (I + W) of one transformer layer's backward, from FLOPs (independent of b and T)."""
    i, w = part.model.layer_backward_flops(1)
    return i / (i + w)


HEAD_INPUT_GRAD_SHARE = 0.5  # output layer: dX = dY W and dW = X^T dY are GEMMs of one size; the loss is tiny


def split_backward_times(hw: Hardware, part: Partition, b: int, w_reruns_input_grad: bool = False,
                         w_at_input_grad: bool = False) -> tuple[float, float, float, float]:
    """(layer I, layer W, head I, head W) seconds on one micro-batch, per GPU, without recompute.

    I + W equals the fused backward of `layer_times` / `head_times`, split by FLOPs; with
    `w_reruns_input_grad` W also pays the input-gradient GEMMs a second time (a split on the autograd graph
    of one-Function layers); with `w_at_input_grad` I is the whole backward and W nothing (layers that cannot
    defer their weight GEMMs)."""
    if w_reruns_input_grad and w_at_input_grad:
        raise ValueError("a W either re-runs the input-gradient GEMMs or runs at I, not both")
    _, lb, gemms = _layer_times(hw, part, b)
    if w_at_input_grad:
        _, hb = head_times(hw, part, b)
        return lb, 0.0, hb, 0.0
    li = lb * layer_input_grad_share(part)
    lw = lb - li
    _, hb = head_times(hw, part, b)
    hi = hb * HEAD_INPUT_GRAD_SHARE
    hw_ = hb - hi
    if w_reruns_input_grad:
        m = part.model
        lw += gemms
        hw_ += gemm_time(hw, b * m.seq_length, m.hidden_size, m.vocab_size / part.tp)
    return li, lw, hi, hw_


def _layer_times(hw: Hardware, part: Partition, b: int) -> tuple[float, float, float]:
    """(forward, backward, weight-GEMM forward time) of one layer."""
    m, t = part.model, part.tp
    tokens, h, f, s = b * m.seq_length, m.hidden_size, m.ffn, m.seq_length
    gemms = (gemm_time(hw, tokens, h, 3 * h / t) + gemm_time(hw, tokens, h / t, h)
             + gemm_time(hw, tokens, h, f / t) + gemm_time(hw, tokens, f / t, h))
    # attention scores and weighted sum: b * heads_local batched s x d x s matmuls, fused (flash-style)
    attn_flops = 4.0 * b * s * s * h / t
    attn = attn_flops / (hw.peak_flops * hw.gemm_efficiency) + hw.kernel_overhead_s
    elementwise = (ELEMENTWISE_BYTES_PER_TOKEN_HIDDEN * tokens * h / t / (hw.hbm_bandwidth * hw.memory_efficiency)
                   + ELEMENTWISE_KERNELS_PER_LAYER * hw.kernel_overhead_s)
    tp_comm = 0.0
    if t > 1:  # sequence parallel: all-gather before QKV and fc1, reduce-scatter after proj and fc2
        tp_comm = 4 * ring_time(hw, 2.0 * tokens * h, t, 1, "all_gather")
    fwd = gemms + attn + elementwise + tp_comm
    bwd = 2 * gemms + 2.5 * attn + 2 * elementwise + tp_comm  # flash-attention backward ~2.5x its forward
    return fwd, bwd, gemms


def head_times(hw: Hardware, part: Partition, b: int) -> tuple[float, float]:
    """(forward, backward) of the final LayerNorm, output layer and vocab-parallel cross entropy."""
    m, t = part.model, part.tp
    tokens = b * m.seq_length
    gemm = gemm_time(hw, tokens, m.hidden_size, m.vocab_size / t)
    ce = 12.0 * tokens * m.vocab_size / t / (hw.hbm_bandwidth * hw.memory_efficiency) + 4 * hw.kernel_overhead_s
    return gemm + ce, 2 * gemm + ce


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
        pp = len(self.optimizer)
        if not self.step and pp:
            per_rank = [sum(1 for s in range(n) if s % pp == r) for r in range(pp)]
            self.step = [self.optimizer[s % pp] / per_rank[s % pp] for s in range(n)]
        if len(self.param_sync_lead) != len(self.optimizer):
            raise ValueError(f"Costs.param_sync_lead has {len(self.param_sync_lead)} entries for "
                             f"{len(self.optimizer)} ranks")
        for name in ("backward", "send_forward", "send_backward", "gather", "reduce", "param_sync",
                     "reduce_buckets", "param_sync_buckets", "input_grad_share", "step"):
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
    # ... or W's work runs at I (layers that cannot defer, e.g. TransformerEngine older than 2.3).
    w_at_input_grad: bool = False
    split: StageSplit = EVEN_STAGES  # how Megatron-LM spreads the layers over the stages
    # Megatron's --overlap-param-gather-with-optimizer-step (its interleaved schedule with the distributed
    # optimizer): the first chunk's optimizer steps first and its all-gather runs during the other chunks' steps.
    param_gather_with_optimizer: bool = False
    # The optimizer is stock Megatron's, outside the schedule (its schedules and every Megatron baseline): the
    # step waits for the whole optimizer. Otherwise the schedule places it (STEP per stage at the step boundary).
    stock_optimizer: bool = False

    @property
    def optimizer_in_schedule(self) -> bool:
        """Whether the schedule carries the optimizer step (STEP actions): not for stock Megatron's optimizer,
        which --overlap-param-gather-with-optimizer-step also implies."""
        return not (self.stock_optimizer or self.param_gather_with_optimizer)

    def partition(self, model: ModelProfile) -> Partition:
        """The model cut into this configuration's stages."""
        return Partition(model, self.tp, self.pp, self.vp, self.split)

    @property
    def split_backward(self) -> bool:
        return self.schedule in SPLIT_BACKWARD_SCHEDULES

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.microbatches * self.dp


def analytic_costs(hw: Hardware, part: Partition, cfg: Config) -> Costs:
    """Costs of every action of `cfg` from the hardware and model profiles."""
    b, n_stages, pp = cfg.micro_batch_size, part.num_stages, cfg.pp
    lf, lb = layer_times(hw, part, b)
    hf, hb = head_times(hw, part, b)
    li, lw, hi, hw_ = split_backward_times(hw, part, b, cfg.split_backward and cfg.w_reruns_input_grad,
                                           cfg.split_backward and cfg.w_at_input_grad)
    place = Placement(hw, cfg.tp, cfg.dp, pp)
    fwd, bwd, sf, sb, ag, red, sync, rb, sbk, share = [], [], [], [], [], [], [], [], [], []
    for s in range(n_stages):
        st = part.stage(s)
        f = st.layers * lf + (hf if st.last else 0.0)
        recomputed = st.layers * lf if cfg.recompute else 0.0  # the head is not recomputed
        i = st.layers * li + (hi if st.last else 0.0) + recomputed  # I needs the recomputed forward
        w = st.layers * lw + (hw_ if st.last else 0.0)
        # A fused B is I + W; a split one may cost more (W re-running the input-gradient GEMMs).
        bk = i + w if cfg.split_backward else st.layers * lb + (hb if st.last else 0.0) + recomputed
        share.append(i / (i + w) if i + w > 0 else 0.5)  # used only by split schedules
        fwd.append(f)
        bwd.append(bk)
        r = s % pp
        msg = part.p2p_bytes(b)
        sf.append(p2p_time(hw, msg, place.pp_inter_node(r, (s + 1) % pp)) if pp > 1 and s < n_stages - 1 else 0.0)
        sb.append(p2p_time(hw, msg, place.pp_inter_node(r, (s - 1) % pp)) if pp > 1 and s > 0 else 0.0)
        params = part.stage_params(s)
        n_in, n_out = place.dp_in_node, place.dp_nodes
        gather = ring_time(hw, PARAM_BYTES * params, n_in, n_out, "all_gather")
        ag.append(gather if cfg.zero_stage == 3 else 0.0)
        kind = "all_reduce" if cfg.zero_stage == 0 else "reduce_scatter"
        red.append(ring_time(hw, GRAD_BYTES * params, n_in, n_out, kind))
        sync.append(gather if cfg.zero_stage in (1, 2) else 0.0)
        # Gradients: a stage's reduction starts after its last backward, all buckets at once: Megatron's default
        # (--align-grad-reduce: each chunk's start_grad_sync after its last backward) and the plugin's REDUCE.
        # Only Megatron's non-interleaved 1F1B lets the first pipeline stage's buckets go as its last backward
        # produces them (about one bucket per layer at these sizes).
        rb.append(st.layers if cfg.zero_stage <= 1 and cfg.vp == 1 and s == 0 else 1)
        # Parameters (ZeRO-0/1, Megatron's overlapped gather): a chunk's first forward waits bucket by bucket;
        # the sharded runtime (ZeRO-2/3) gathers a stage's flat buffer at once, and so does Megatron with
        # --overlap-param-gather-with-optimizer-step (which turns its bucketing off, training.py).
        sbk.append(st.layers if cfg.zero_stage <= 1 and not cfg.param_gather_with_optimizer else 1)
    opt = []
    for r in range(pp):
        phi = part.rank_params(r)
        shard = phi if cfg.zero_stage == 0 else phi / cfg.dp
        opt.append(ADAM_BYTES_PER_PARAM * shard / (hw.hbm_bandwidth * hw.memory_efficiency) + 10 * hw.kernel_overhead_s)
    lead = [0.0] * pp
    if cfg.param_gather_with_optimizer:
        # The first chunk (stage r) steps first, in time proportional to its parameters; its all-gather starts
        # then, while the other chunks step and the slowest rank finishes: that long before the next step.
        lead = [max(opt) - opt[r] * part.stage_params(r) / part.rank_params(r) for r in range(pp)]
    # A schedule-placed step: each stage's STEP takes the rank's optimizer time in proportion to its parameters.
    step = [opt[s % pp] * part.stage_params(s) / part.rank_params(s % pp) for s in range(n_stages)]
    # The gradient norm (clipping): one scalar all-reduce over every rank, modelled as latency alone, the
    # fixed cost of one collective.
    grad_norm = hw.collective_overhead_s if cfg.num_gpus > 1 else 0.0
    return Costs(fwd, bwd, sf, sb, ag, red, sync, opt, step=step, grad_norm=grad_norm, reduce_buckets=rb,
                 param_sync_buckets=sbk, param_sync_lead=lead, input_grad_share=share, dp_overlap=cfg.dp_overlap,
                 p2p_overlap=cfg.p2p_overlap)


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
    stages = [rank + c * cfg.pp for c in range(cfg.vp)]
    sizes = sorted((part.stage_params(s) for s in stages), reverse=True)
    d, z = cfg.dp, cfg.zero_stage
    wbuf = sum(sizes[: cfg.weight_buffers])  # buffers sized for the largest stages they may hold
    gbuf = sum(sizes[: cfg.grad_buffers])
    mem = {"weights": 0.0, "weight_buffers": 0.0, "gradients": 0.0, "grad_buffers": 0.0, "optimizer": 0.0}
    if z == 0:
        mem.update(weights=PARAM_BYTES * phi, gradients=GRAD_BYTES * phi, optimizer=12 * phi)
    elif z == 1:
        mem.update(weights=PARAM_BYTES * phi, gradients=GRAD_BYTES * phi, optimizer=12 * phi / d)
    elif z == 2:
        mem.update(weights=PARAM_BYTES * phi, gradients=GRAD_BYTES * phi / d, optimizer=12 * phi / d,
                   grad_buffers=GRAD_BYTES * gbuf)
    elif z == 3:
        mem.update(weights=PARAM_BYTES * phi / d, weight_buffers=PARAM_BYTES * wbuf,
                   gradients=GRAD_BYTES * phi / d, grad_buffers=GRAD_BYTES * gbuf, optimizer=12 * phi / d)
    else:
        raise ValueError(f"--zero-stage must be 0, 1, 2 or 3 (got {z})")
    mem["activations"] = activations
    mem["working"] = max(part.working_bytes(s, cfg.micro_batch_size) for s in stages)
    mem["total"] = sum(mem.values())
    return mem
