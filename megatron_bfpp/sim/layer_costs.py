"""Seconds of one decoder layer, the output layer and the embedding on one micro-batch, per GPU, op by op.

Kernels. A GEMM of m x k x n costs `max(2mkn / achieved GEMM rate, bytes / achieved HBM bandwidth) + kernel
overhead` (`Hardware.gemm_flops`: bf16, or FP8 with one-byte operands); the fixed overhead makes small matrices
slow and the byte term makes thin ones (an expert's few tokens) memory-bound. Elementwise kernels move bytes at the
achieved HBM bandwidth. Collectives and p2p messages: latency + bytes / achieved link bandwidth (`ring_time`,
`p2p_time`, `all_to_all_time`).

A layer (per GPU, tokens n = b s / CP of its context shard; T tensor-parallel ranks):
- weight GEMMs: QKV (h -> q + 2 kv, grouped-query attention), projection (q -> h), fc1 (h -> f, 2f with SwiGLU),
  fc2 (f -> h), each 1/T wide; backward = dgrad + wgrad of the same sizes.
- core attention: flash (causal: half the s^2 products, at the measured flash-attention forward / backward rates)
  or unfused (Megatron's local attention: batched s x d x s GEMMs over the full scores, a fused scale-mask-softmax
  and the attention dropout streaming b a s^2 elements).
- elementwise: two norms, two bias-dropout-add, the activation (GeLU or SwiGLU), RoPE on Q and K; the norms and
  residual run on 1/T of the tokens with sequence parallelism and on all of them without.
- tensor parallelism: with sequence parallelism all-gather before QKV and fc1, reduce-scatter after the projection
  and fc2; in the backward the two all-gathers of the output gradients are exposed and the input re-gather and the
  input-gradient reduce-scatter of QKV and fc1 overlap their dgrad / wgrad GEMMs (Megatron's
  LinearWithGradAccumulationAndAsyncCommunication). Without sequence parallelism an all-reduce after the projection
  and fc2, and in the backward the input-gradient all-reduces overlapping wgrad. `--tp-comm-overlap` hides each
  forward collective behind its GEMM (TransformerEngine's userbuffers pipelining), exposing only the excess.
- context parallelism: ring attention sends K and V around the CP ranks (CP - 1 steps; the backward sends them and
  their gradients), each step overlapping one chunk's attention; the causal load balance of Megatron's 2 x CP
  chunking gives every rank an equal share.
- MoE layers: router GEMM, token permutation / unpermutation, dispatch and combine all-to-alls over the EP ranks
  (twice more in the backward), the routed experts as grouped GEMMs at the tokens each local expert gets (balanced
  routing: n/T x k x EP / E), and the shared expert as a dense MLP. What of the all-to-alls runs behind another
  micro-batch's compute (Megatron's combined 1F1B, `--overlap-moe-expert-parallel-comm`; the plugin's paired order,
  `--paired-moe-a2a-overlap`) is the engine's, per pair of actions the schedule merges, up to the partner's
  compute of the layer (`OpTimes.a2a_cover`).
- FP8: every decoder-layer GEMM (TransformerEngine's layers; the output layer stays bf16) at the FP8 rate with
  one-byte operands, plus the casts: each GEMM input is quantised with a transposed copy for the weight gradient
  (read 2 bytes, write 2 bytes per element; `cast_transpose`), and each output gradient likewise; per-tensor
  current scaling (`tensorwise`) reads each tensor once more for its amax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .hardware import Hardware
from .model import ModelProfile, Partition

ADAM_BYTES_PER_PARAM = 30  # read grad, master, m, v (16), write master, m, v (12), write bf16 weight (2)
GRAD_BYTES = 4  # fp32 gradient reduction (Megatron's default with bf16)
PARAM_BYTES = 2  # bf16 weights, as gathered
LAYER_ELEMENTWISE_KERNELS = 10  # two norms, two bias-dropout-add, activation, RoPE on Q and K, copies
FLASH_BACKWARD_FLOPS = 2.5  # flash attention's backward runs 5 matmuls to the forward's 2 (Dao, 2023)


# ---------------------------------------------------------------- kernels and messages

GEMM_TILE = (256, 128)  # output tile of cuBLAS's large tensor-core kernels (NVIDIA, "Matrix Multiplication Background")


def wave_efficiency(hw: Hardware, m: float, n: float) -> float:
    """Fraction of the SMs' time doing useful work when the m x n output is cut into
    256 x 128 tiles that run in waves of one tile per SM: the last wave is partial ("wave quantization", NVIDIA Deep
    Learning Performance Guide, Matrix Multiplication Background). The better of the two orientations."""
    if hw.sm_count <= 0:
        return 1.0
    best = 0.0
    for a, b in ((m, n), (n, m)):
        tiles = math.ceil(a / GEMM_TILE[0]) * math.ceil(b / GEMM_TILE[1])
        useful = a * b / (GEMM_TILE[0] * GEMM_TILE[1])  # tiles at the edges are partly empty
        waves = math.ceil(tiles / hw.sm_count)
        best = max(best, useful / (waves * hw.sm_count))
    return min(1.0, best)


def gemm_time(hw: Hardware, m: float, k: float, n: float, count: int = 1, fp8: bool = False) -> float:
    """Seconds for `count` GEMMs of m x k x n: the measured large-GEMM rate derated by wave quantization, or the
    bytes at the achieved HBM bandwidth when slower, plus a fixed per-kernel overhead."""
    if m <= 0 or k <= 0 or n <= 0:
        return 0.0
    flops = 2.0 * m * k * n
    width = 1.0 if fp8 else 2.0
    nbytes = width * (m * k + k * n) + 2.0 * m * n  # outputs in bf16
    t = max(flops / (hw.gemm_flops(fp8) * wave_efficiency(hw, m, n)), nbytes / hw.memory_bw)
    return count * (t + hw.kernel_overhead_s)


def grouped_gemm_time(hw: Hardware, groups: float, m: float, k: float, n: float, fp8: bool = False) -> float:
    """One grouped GEMM kernel over `groups` problems of m x k x n each (the experts of a GPU): every group's
    weights are read whatever its token count, so few tokens per expert make it memory-bound."""
    if groups <= 0 or m <= 0:
        return 0.0
    return groups * (gemm_time(hw, m, k, n, fp8=fp8) - hw.kernel_overhead_s) + hw.kernel_overhead_s


def stream_time(hw: Hardware, nbytes: float, kernels: int = 1) -> float:
    """Memory-bound kernels moving `nbytes` in all."""
    return nbytes / hw.memory_bw + kernels * hw.kernel_overhead_s


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


def all_to_all_time(hw: Hardware, nbytes: float, n_in: int, n_out: int) -> float:
    """All-to-all where each GPU holds `nbytes` spread evenly over n_in x n_out peers (n_in in its node), at the
    measured all-to-all bus bandwidth: over NVLink inside one node, at the GPU's NIC rate when the group spans
    nodes (NCCL's measured inter-node all-to-all runs at about one NIC's rate per GPU); one message per peer."""
    peers = n_in * n_out
    if peers <= 1 or nbytes <= 0:
        return 0.0
    if n_out > 1:  # across nodes the GPU's NIC sets the pace for all of it (measured all-to-all bus bandwidth)
        t = nbytes * (peers - 1) / peers / (hw.ib_bandwidth * hw.a2a_ib_efficiency)
        return hw.collective_overhead_s + t + (peers - n_in) * hw.ib_latency_s
    intra = nbytes * (n_in - 1) / peers / (hw.nvlink_bandwidth * hw.a2a_nvlink_efficiency)
    inter = 0.0
    lat = (n_in - 1) * hw.nvlink_latency_s + (peers - n_in) * hw.ib_latency_s
    return hw.collective_overhead_s + max(intra, inter) + lat


def group_span(hw: Hardware, size: int, stride: int) -> tuple[int, int]:
    """(ranks per node, nodes) of a group of `size` ranks `stride` apart in Megatron's rank order."""
    if size <= 1:
        return 1, 1
    g = hw.gpus_per_node
    n_in = max(1, min(size, g // stride)) if stride <= g else 1
    return n_in, -(-size // n_in)


# ---------------------------------------------------------------- one layer, op by op

@dataclass
class OpTimes:
    """Forward and backward seconds of each op of a layer; `wgrad` is the weight-gradient part of `bwd`."""

    fwd: dict[str, float] = field(default_factory=dict)
    bwd: dict[str, float] = field(default_factory=dict)
    wgrad: dict[str, float] = field(default_factory=dict)
    # MoE layers: the compute behind which another micro-batch's expert all-to-all of the same layer can run
    # (forward, backward, and the weight-gradient part of that backward): attention, router, permutation and
    # experts, communication excluded (the shared expert and the layer's norms left out: a conservative bound).
    a2a_cover: tuple[float, float, float] = (0.0, 0.0, 0.0)

    def add(self, op: str, fwd: float, bwd: float, wgrad: float = 0.0) -> None:
        self.fwd[op] = self.fwd.get(op, 0.0) + fwd
        self.bwd[op] = self.bwd.get(op, 0.0) + bwd
        self.wgrad[op] = self.wgrad.get(op, 0.0) + wgrad

    @property
    def forward(self) -> float:
        return sum(self.fwd.values())

    @property
    def backward(self) -> float:
        return sum(self.bwd.values())

    @property
    def weight_grad(self) -> float:
        return sum(self.wgrad.values())


def _tp_collective(hw: Hardware, part: Partition, nbytes: float) -> float:
    """One all-gather or reduce-scatter of a full-size activation of `nbytes` over the T ranks (in a node)."""
    return ring_time(hw, nbytes, part.tp, 1, "all_gather") if part.tp > 1 else 0.0


def _linear(hw: Hardware, part: Partition, ops: OpTimes, name: str, n: float, k: float, out: float,
            fp8: bool, column: bool) -> None:
    """A tensor-parallel linear of n tokens, k -> out (already per GPU), with its communication and FP8 casts.
    `column`: column-parallel (gathers its input under SP); else row-parallel (reduce-scatters / all-reduces)."""
    g = gemm_time(hw, n, k, out, fp8=fp8)
    ops.add(name, g, 2 * g, g)
    if fp8:  # cast + transpose of the input (forward) and of the output gradient (backward)
        extra = 2 if part.fp8 == "tensorwise" else 0
        ops.add("fp8_casts", stream_time(hw, (4 + extra) * n * k), stream_time(hw, (4 + extra) * n * out))
    if part.tp <= 1:
        return
    full = 2.0 * n * part.model.hidden_size  # the h-wide activation the collective moves, all tokens
    c = _tp_collective(hw, part, full)
    if part.sp:
        fwd = max(0.0, c - g) if part.tp_comm_overlap else c
        # Backward: a column-parallel layer re-gathers its input (overlapping dgrad) and reduce-scatters its input
        # gradient (overlapping wgrad); a row-parallel layer all-gathers its output gradient before its GEMMs.
        bwd = 2 * max(0.0, c - g) if column else c
    else:
        fwd = 0.0 if column else (max(0.0, 2 * c - g) if part.tp_comm_overlap else 2 * c)  # all-reduce after row
        bwd = max(0.0, 2 * c - g) if column else 0.0  # input-gradient all-reduce overlapping wgrad
    ops.add("tp_comm", fwd, bwd)


def layer_ops(hw: Hardware, part: Partition, b: int, layer: int = 0) -> OpTimes:
    """Per-op forward/backward seconds of decoder layer `layer` on one micro-batch of b sequences, per GPU,
    without recomputation."""
    m, t = part.model, part.tp
    n, h = part.tokens(b), m.hidden_size
    fp8 = part.fp8 is not None
    rep = t if part.sp else 1  # what divides the norms, residual and dropout
    ops = OpTimes()
    # --- attention block
    _linear(hw, part, ops, "qkv", n, h, (m.q_size + 2 * m.kv_size) / t, fp8, column=True)
    _linear(hw, part, ops, "proj", n, m.q_size / t, h, fp8, column=False)
    s, heads = m.seq_length, m.num_heads / t
    if part.attention == "flash":
        flops = m.core_attention_flops(b) / (t * part.cp) / 2  # causal: the masked half is skipped
        fwd = flops / hw.attention_flops() + hw.kernel_overhead_s
        bwd = FLASH_BACKWARD_FLOPS * flops / hw.attention_flops(backward=True) + hw.kernel_overhead_s
    else:  # scores and context as batched GEMMs over the full s x s, softmax and dropout streaming the scores
        batches = b * heads
        sq = s / part.cp
        gemms = 2 * grouped_gemm_time(hw, batches, sq, m.head_dim, s)  # scores and context, one kernel each
        scores = batches * sq * s
        drop = m.attention_dropout > 0
        fwd = gemms + stream_time(hw, scores * (4 + (5 if drop else 0)), 2 if drop else 1)
        bwd = 2 * gemms + stream_time(hw, scores * (6 + (5 if drop else 0)), 2 if drop else 1)
    ops.add("attention", fwd, bwd)
    if part.cp > 1:  # ring attention: K and V chunks pass around the CP ranks, each step overlapping a chunk
        kv_bytes = 2 * 2.0 * n * m.kv_size / t
        inter = t * part.cp > hw.gpus_per_node
        step = p2p_time(hw, kv_bytes, inter)
        steps = part.cp - 1
        ops.add("cp_comm", steps * max(0.0, step - fwd / part.cp), steps * max(0.0, 2 * step - bwd / part.cp))
    # --- MLP or MoE block
    if m.is_moe_layer(layer):
        _moe_block(hw, part, ops, n, fp8)
    else:
        f_out = (2 if m.swiglu else 1) * m.ffn
        _linear(hw, part, ops, "fc1", n, h, f_out / t, fp8, column=True)
        _linear(hw, part, ops, "fc2", n, m.ffn / t, h, fp8, column=False)
        act = (6 if m.swiglu else 4) * n * m.ffn / t
        ops.add("elementwise", stream_time(hw, act, 1), stream_time(hw, 2 * act, 1))
    # --- norms, bias-dropout-add, RoPE
    drop = 1 if m.hidden_dropout > 0 else 0
    per_token = 2 * 4 * h + 2 * (6 + drop) * h  # norms in/out, residual adds (+ masks)
    nbytes = n * per_token / rep
    if m.position_embedding == "rope":
        nbytes += 4 * n * (m.q_size + m.kv_size) / t
    ops.add("elementwise", stream_time(hw, nbytes, LAYER_ELEMENTWISE_KERNELS),
            stream_time(hw, 2 * nbytes, LAYER_ELEMENTWISE_KERNELS))
    return ops


def _moe_block(hw: Hardware, part: Partition, ops: OpTimes, n: float, fp8: bool) -> None:
    """Router, dispatch, experts, combine and shared expert of an MoE layer on n tokens (per TP group)."""
    m, t, ep, etp = part.model, part.tp, part.ep, part.expert_tp
    h, k, e = m.hidden_size, m.moe_router_topk, m.num_experts
    local = n / t  # sequence parallelism (Megatron requires it for MoE with T > 1): a GPU routes its 1/T
    router = gemm_time(hw, local, h, e)
    ops.add("router", router + stream_time(hw, 8 * local * e, 2), 2 * router + stream_time(hw, 8 * local * e, 2),
            router)
    # Tokens a GPU's experts see: its share of the routed copies (balanced routing), gathered over the ETP ranks.
    routed = local * k * etp
    per_expert = routed * ep / e
    f_out = (2 if m.swiglu else 1) * m.expert_ffn
    g1 = grouped_gemm_time(hw, e // ep, per_expert, h, f_out / etp, fp8)
    g2 = grouped_gemm_time(hw, e // ep, per_expert, m.expert_ffn / etp, h, fp8)
    ops.add("experts", g1 + g2, 2 * (g1 + g2), g1 + g2)
    if fp8:
        extra = 2 if part.fp8 == "tensorwise" else 0
        ops.add("fp8_casts", stream_time(hw, (4 + extra) * routed * (h + m.expert_ffn / etp), 2),
                stream_time(hw, (4 + extra) * routed * (f_out / etp + h), 2))
    act = (6 if m.swiglu else 4) * routed * m.expert_ffn / etp
    permute = 2 * 2 * 2 * routed * h  # permute and unpermute: read and write each copy, bf16
    ops.add("elementwise", stream_time(hw, act + permute, 3), stream_time(hw, 2 * act + permute, 3))
    if etp > 1:  # tokens all-gathered over the expert-tensor-parallel ranks, outputs reduce-scattered
        c = ring_time(hw, 2.0 * local * k * etp * h, etp, 1, "all_gather")
        ops.add("tp_comm", 2 * c, 2 * c)
    # Dispatch and combine: each GPU sends its routed copies to the EP ranks holding their experts (EP ranks are
    # ETP apart in Megatron's expert rank order); the backward runs both again.
    n_in, n_out = group_span(hw, ep, etp)
    a2a = 2 * all_to_all_time(hw, 2.0 * local * k * h, n_in, n_out)
    compute_f = ops.forward - ops.fwd.get("tp_comm", 0.0) - ops.fwd.get("cp_comm", 0.0)
    compute_b = ops.backward - ops.bwd.get("tp_comm", 0.0) - ops.bwd.get("cp_comm", 0.0)
    ops.a2a_cover = (compute_f, compute_b, ops.weight_grad)
    ops.add("moe_a2a", a2a, a2a)
    if m.moe_shared_expert_size:
        sf = (2 if m.swiglu else 1) * m.moe_shared_expert_size
        _linear(hw, part, ops, "shared_expert", n, h, sf / t, fp8, column=True)
        _linear(hw, part, ops, "shared_expert", n, m.moe_shared_expert_size / t, h, fp8, column=False)


def head_ops(hw: Hardware, part: Partition, b: int) -> OpTimes:
    """Final norm, output layer (bf16: Megatron's own ColumnParallelLinear) and vocab-parallel cross entropy."""
    m, t = part.model, part.tp
    n, v = part.tokens(b), part.padded_vocab / t
    ops = OpTimes()
    g = gemm_time(hw, n, m.hidden_size, v)
    ops.add("output_layer", g, 2 * g, g)
    ce = stream_time(hw, 12.0 * n * v, 4)  # logits read for max, exp-sum and gradient; fp32 softmax kept
    ops.add("cross_entropy", ce, ce)
    norm = stream_time(hw, 4 * n * m.hidden_size / (t if part.sp else 1))
    ops.add("elementwise", norm, 2 * norm)
    if t > 1:  # the output layer gathers its input (SP) and its input gradient is reduced
        c = _tp_collective(hw, part, 2.0 * n * m.hidden_size)
        ops.add("tp_comm", c if part.sp else 0.0, c if part.sp else 2 * c)
    return ops


def embedding_ops(hw: Hardware, part: Partition, b: int) -> OpTimes:
    """Word (and learned position) embedding lookup, its vocab-parallel reduction, and its gradient."""
    m, t = part.model, part.tp
    n = part.tokens(b)
    ops = OpTimes()
    look = stream_time(hw, 6.0 * n * m.hidden_size, 2)
    ops.add("embedding", look, 2 * look)
    if t > 1:  # vocab-parallel lookup: reduce-scatter (SP) or all-reduce of the partial embeddings
        c = _tp_collective(hw, part, 2.0 * n * m.hidden_size)
        ops.add("tp_comm", c if part.sp else 2 * c, c if part.sp else 0.0)
    return ops


# ---------------------------------------------------------------- a profile from a device's own layer timings

def measured_profile(base: Hardware, layer_report: dict, model: ModelProfile) -> Hardware:
    """`base` with its achieved rates replaced by a device's measured ones, from the device kit's layer table
    (`gpu_check layer --json`: one layer of `model` at T = 1, its four weight GEMMs, core attention and the rest
    timed forward and backward): the GEMM rate is their FLOPs over their measured time (the measurement is in a
    layer's setting, so the in-layer fraction becomes 1), the attention rates likewise, and the memory rate is the
    cost model's elementwise bytes over the measured rest of the layer."""
    b = int(layer_report["micro_batch_size"])
    rows = {r["op"]: r for r in layer_report["ops"]}
    missing = [op for op in ("qkv", "proj", "fc1", "fc2", "attention", "elementwise")
               if rows.get(op, {}).get("fwd_measured_ms") is None]
    if missing:
        raise ValueError(f"the layer report has no measured {', '.join(missing)}: run the device kit's layer check "
                         "without --sim-only")
    n, h = b * model.seq_length, model.hidden_size
    f_out = (2 if model.swiglu else 1) * model.ffn
    shapes = {"qkv": (h, model.q_size + 2 * model.kv_size), "proj": (model.q_size, h), "fc1": (h, f_out),
              "fc2": (model.ffn, h)}
    gemm_flops = sum(3 * 2.0 * n * k * out for k, out in shapes.values())  # forward, dgrad, wgrad
    gemm_s = sum((rows[op]["fwd_measured_ms"] + rows[op]["bwd_measured_ms"]) / 1e3 for op in shapes)
    attn = model.core_attention_flops(b) / 2  # causal
    part = Partition(model, 1, 1, 1)
    modelled = layer_ops(base, part, b)
    elementwise_s = modelled.fwd.get("elementwise", 0.0) + modelled.bwd.get("elementwise", 0.0)
    measured_rest = (rows["elementwise"]["fwd_measured_ms"] + rows["elementwise"]["bwd_measured_ms"]) / 1e3
    memory = base.memory_bw * elementwise_s / measured_rest if measured_rest > 0 else base.memory_bw
    return base.replace(
        name=f"{base.name} (measured: {layer_report.get('device', 'device')})",
        gemm_efficiency=gemm_flops / gemm_s / base.peak_flops, in_layer_fraction=1.0,
        memory_efficiency=memory / base.hbm_bandwidth,
        attention_fwd_efficiency=attn / (rows["attention"]["fwd_measured_ms"] / 1e3) / base.peak_flops,
        attention_bwd_efficiency=FLASH_BACKWARD_FLOPS * attn / (rows["attention"]["bwd_measured_ms"] / 1e3)
        / base.peak_flops)
