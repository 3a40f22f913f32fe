"""GPT model profiles: parameters, FLOPs and activation memory per pipeline stage and micro-batch.

A `ModelProfile` holds what Megatron-LM's `pretrain_gpt.py` flags say of a GPT model (Megatron-Core's
`TransformerConfig` meanings): pre-norm decoder layers with grouped-query attention (`num_query_groups`, one
group per head by default), an MLP of `ffn_hidden_size` (4h by default; SwiGLU stacks a gate, so its first matrix
is twice as wide), learned absolute positions or RoPE, the output layer tied to the word embedding or not, the
vocabulary padded as Megatron pads it (`--make-vocab-size-divisible-by` times T), and mixture-of-experts layers
(`num_experts` routed experts of `moe_ffn_hidden_size`, `moe_router_topk` per token, a shared expert, MoE layers
where `moe_layer_pattern` says). A `Partition` is that model cut into P * V stages and laid over T (tensor), CP
(context), EP / ETP (expert) ranks, with or without sequence parallelism; everything it returns is per GPU.

FLOPs. `megatron_flops_per_sequence` is Megatron-LM's own count (`num_floating_point_operations` in
megatron/training/training.py, core_v0.19): 3 x 2 x (weight GEMM multiply-adds) per token plus the causal core
attention counted at half the s^2 products; what TFLOP/s and MFU are reported with. What the GPU executes is
`layer_forward_flops` (full s^2 attention, as unfused attention runs it; a causal flash kernel skips the masked
half, which the cost model applies).

Activations (Korthikanti et al., 2022, "Reducing Activation Recomputation in Large Transformer Models", Sec. 4,
generalised to grouped-query attention and gated MLPs): per layer and micro-batch the inputs each backward needs,
bf16: the norm outputs feeding QKV and fc1 (2sbh each), Q, K, V and the attention output (2sb(q + 2kv + q)), fc1's
output and the activation's output (2sb f_out + 2sb f), the two norm inputs (4sbh), one-byte dropout masks
(sbh each) when dropout is on; unfused attention also keeps the softmax output (2 b a s^2), with attention dropout
its mask and output (3 b a s^2). Tensor parallelism divides the sharded terms by T, and with sequence parallelism
the rest too; context parallelism divides everything by CP. Full recomputation keeps only a layer's input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

POSITION_EMBEDDINGS = ("learned_absolute", "rope", "none")
ATTENTION_KERNELS = ("flash", "unfused")
FP8_RECIPES = ("delayed", "tensorwise", "mxfp8", "blockwise")


@dataclass(frozen=True)
class ModelProfile:
    """The layer sizes of a GPT model that the simulator's costs are computed from (not a model that runs)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    seq_length: int = 2048
    vocab_size: int = 51200  # the tokenizer's vocabulary, padded by `padded_vocab_size`
    ffn_hidden_size: int | None = None  # default 4h
    num_query_groups: int | None = None  # grouped-query attention; None: one group per head
    kv_channels: int | None = None  # head dimension; default h / heads
    swiglu: bool = False  # gated MLP: fc1 is 2 x ffn wide, three matrices
    position_embedding: str = "learned_absolute"
    untie_embeddings: bool = True  # a separate output layer (--untie-embeddings-and-output-weights)
    make_vocab_size_divisible_by: int = 128
    rms_norm: bool = False  # RMSNorm (no bias) instead of LayerNorm
    add_bias_linear: bool = True
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    # Mixture of experts
    num_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None  # default ffn_hidden_size
    moe_shared_expert_size: int = 0  # --moe-shared-expert-intermediate-size
    moe_layer_pattern: tuple[int, ...] | None = None  # 1 = MoE layer; None: every layer is MoE when experts

    def __post_init__(self) -> None:
        if self.position_embedding not in POSITION_EMBEDDINGS:
            raise ValueError(f"--position-embedding-type {self.position_embedding!r}: one of {POSITION_EMBEDDINGS}")
        if self.num_heads % self.query_groups:
            raise ValueError(f"--num-query-groups {self.query_groups} must divide the {self.num_heads} heads")
        if self.moe_layer_pattern is not None and len(self.moe_layer_pattern) != self.num_layers:
            raise ValueError(f"--moe-layer-freq gives {len(self.moe_layer_pattern)} layers for --num-layers "
                             f"{self.num_layers}")
        if self.num_experts is not None and not 1 <= self.moe_router_topk <= self.num_experts:
            raise ValueError(f"--moe-router-topk {self.moe_router_topk} must be in [1, --num-experts "
                             f"{self.num_experts}]")

    # --- shapes ---
    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_heads

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_heads

    @property
    def q_size(self) -> int:
        """Width of Q (and of the attention output): heads x head dimension."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of K (and of V): query groups x head dimension."""
        return self.query_groups * self.head_dim

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices of an MLP of the model's kind, counted in units of h x ffn: 3 with SwiGLU, else 2."""
        return 3 if self.swiglu else 2

    @property
    def expert_ffn(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` (0-based, in model order) has routed experts."""
        if not self.is_moe:
            return False
        return bool(self.moe_layer_pattern[layer]) if self.moe_layer_pattern is not None else True

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    def padded_vocab_size(self, tp: int = 1) -> int:
        """The vocabulary as Megatron pads it: a multiple of --make-vocab-size-divisible-by x T."""
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple

    # --- parameters (whole model, before tensor or expert parallelism) ---
    def _norm_params(self) -> int:
        return self.hidden_size * (1 if self.rms_norm else 2)

    def attention_params(self) -> int:
        h, q, kv = self.hidden_size, self.q_size, self.kv_size
        bias = (q + 2 * kv + h) if self.add_bias_linear else 0
        return h * (q + 2 * kv) + q * h + bias + self._norm_params()

    def mlp_params(self, ffn: int) -> int:
        """One MLP (a dense layer's, an expert's or the shared expert's) of width `ffn`."""
        fc1_out = 2 * ffn if self.swiglu else ffn
        bias = (fc1_out + self.hidden_size) if self.add_bias_linear else 0
        return self.hidden_size * fc1_out + ffn * self.hidden_size + bias

    def layer_params(self, layer: int = 0) -> int:
        """Parameters of decoder layer `layer`, experts included."""
        return self.layer_dense_params(layer) + self.layer_expert_params(layer)

    def layer_dense_params(self, layer: int = 0) -> int:
        """What tensor parallelism shards in layer `layer` (all but the routed experts): attention, norms, and
        the dense MLP, or the router and shared expert of an MoE layer."""
        n = self.attention_params() + self._norm_params()
        if not self.is_moe_layer(layer):
            return n + self.mlp_params(self.ffn)
        n += self.hidden_size * self.num_experts  # router
        if self.moe_shared_expert_size:
            n += self.mlp_params(self.moe_shared_expert_size)
        return n

    def layer_expert_params(self, layer: int = 0) -> int:
        """Routed experts' parameters of layer `layer` (expert parallelism shards them)."""
        return self.num_experts * self.mlp_params(self.expert_ffn) if self.is_moe_layer(layer) else 0

    def embedding_params(self, tp: int = 1) -> int:
        pos = self.seq_length * self.hidden_size if self.position_embedding == "learned_absolute" else 0
        return self.padded_vocab_size(tp) * self.hidden_size + pos

    def head_params(self, tp: int = 1, pipelined: bool = True) -> int:
        """Output layer + final norm. A tied output layer reuses the word embedding; on a pipeline its last
        stage holds a copy (Megatron's shared embedding, all-reduced with the first stage's)."""
        out = self.padded_vocab_size(tp) * self.hidden_size if (self.untie_embeddings or pipelined) else 0
        return out + self._norm_params()

    def num_parameters(self, tp: int = 1) -> int:
        """Distinct parameters of the model (a tied output layer counted once)."""
        return (sum(self.layer_params(i) for i in range(self.num_layers)) + self.embedding_params(tp)
                + self.head_params(tp, pipelined=False))

    # --- FLOPs as executed per micro-batch of b sequences (whole model, before any parallelism) ---
    def attention_gemm_flops(self, b: int) -> float:
        h, s = self.hidden_size, self.seq_length
        return 2 * b * s * (h * (self.q_size + 2 * self.kv_size) + self.q_size * h)

    def core_attention_flops(self, b: int) -> float:
        """Q K^T and the probabilities times V over the full s x s scores (a causal kernel can skip half)."""
        return 4 * b * self.seq_length ** 2 * self.q_size

    def mlp_gemm_flops(self, b: int, layer: int = 0) -> float:
        """Weight GEMMs of layer `layer`'s MLP or MoE block (routed experts at top-k tokens, shared expert,
        router)."""
        h, s = self.hidden_size, self.seq_length
        if not self.is_moe_layer(layer):
            return 2 * b * s * self.mlp_matrices * h * self.ffn
        routed = 2 * b * s * self.moe_router_topk * self.mlp_matrices * h * self.expert_ffn
        shared = 2 * b * s * self.mlp_matrices * h * self.moe_shared_expert_size
        return routed + shared + 2 * b * s * h * self.num_experts

    def layer_forward_flops(self, b: int, layer: int = 0) -> float:
        return self.attention_gemm_flops(b) + self.core_attention_flops(b) + self.mlp_gemm_flops(b, layer)

    def layer_backward_flops(self, b: int, layer: int = 0) -> tuple[float, float]:
        """(I, W) FLOPs of one layer's backward split into the gradient of its input and of its weights (Qi et
        al., "Zero Bubble Pipeline Parallelism", Table 1; for GPT with f = 4h: I = sbh(24h + 8s), W = 24sbh^2
        against F = sbh(24h + 4s)). Every weight GEMM has one input-gradient and one weight-gradient GEMM of its
        own size; the attention matmuls have no weights, and their backward (twice their forward) is all I."""
        gemms = self.attention_gemm_flops(b) + self.mlp_gemm_flops(b, layer)
        return gemms + 2 * self.core_attention_flops(b), gemms

    def head_forward_flops(self, b: int, tp: int = 1) -> float:
        return 2 * b * self.seq_length * self.hidden_size * self.padded_vocab_size(tp)

    # --- Megatron's own count (reported TFLOP/s, MFU) ---
    def megatron_flops_per_sequence(self, tp: int = 1) -> float:
        """Megatron-LM's `num_floating_point_operations(args, 1)` (core_v0.19, standard transformer, no MTP):
        forward + backward, model FLOPs (no recomputation), causal core attention at half its s^2 products,
        the router not counted, the vocabulary as padded at tensor-parallel size `tp`."""
        h, s = self.hidden_size, self.seq_length
        attn = 6 * (h * (self.q_size + 2 * self.kv_size) + self.q_size * h)
        mlp = 0.0
        for i in range(self.num_layers):
            if self.is_moe_layer(i):
                mlp += 6 * h * self.mlp_matrices * (self.expert_ffn * self.moe_router_topk
                                                    + self.moe_shared_expert_size)
            else:
                mlp += 6 * h * self.mlp_matrices * self.ffn
        per_token = mlp + self.num_layers * attn + 6 * h * self.padded_vocab_size(tp)
        return s * per_token + s * s * self.num_layers * 6 * self.q_size

    def model_flops_per_sequence(self, tp: int = 1) -> float:
        """The MFU numerator per sequence: Megatron's own count (`megatron_flops_per_sequence`)."""
        return self.megatron_flops_per_sequence(tp)


# Published shapes. GPT-3 paper (Brown et al., 2020, Table 2.1) for 1.3B, 13B and 175B; 52B is the 64-layer x
# 8192-hidden x 64-head shape used for that size by the breadth-first paper and by Megatron's scaling tables.
# Named flag sets for these and today's models ship as presets (`megatron_bfpp/presets/`).
MODELS: dict[str, ModelProfile] = {
    "gpt-1.3b": ModelProfile("gpt-1.3b", 24, 2048, 16),
    "gpt-13b": ModelProfile("gpt-13b", 40, 5120, 40),
    "gpt-52b": ModelProfile("gpt-52b", 64, 8192, 64),
    "gpt-175b": ModelProfile("gpt-175b", 96, 12288, 96),
}


def get_model(name: str) -> ModelProfile:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown --model {name!r}: choose one of {', '.join(MODELS)}") from None


def resolve_model(spec: str) -> ModelProfile:
    """A model by name (gpt-52b, ...) or a one-layer shape `HIDDEN:HEADS:SEQ` (the device kit's small layers)."""
    if spec.count(":") == 2:
        h, heads, seq = (int(x) for x in spec.split(":"))
        return ModelProfile(spec, 1, h, heads, seq)
    return get_model(spec)


@dataclass(frozen=True)
class StageShape:
    """What one pipeline stage holds, per GPU (after tensor parallelism)."""

    stage: int
    layers: int
    first: bool  # holds the embeddings
    last: bool  # holds the final LayerNorm and output layer
    first_layer: int = 0  # model index of its first decoder layer


@dataclass(frozen=True)
class StageSplit:
    """How Megatron-LM spreads the decoder layers over the pipeline, by its flags; the default is equal stages."""

    first_pipeline_num_layers: int | None = None  # --decoder-first-pipeline-num-layers (all of rank 0's stages)
    last_pipeline_num_layers: int | None = None  # --decoder-last-pipeline-num-layers (all of rank P-1's stages)
    account_for_embedding: bool = False  # --account-for-embedding-in-pipeline-split: the embedding is a layer
    account_for_loss: bool = False  # --account-for-loss-in-pipeline-split: the output layer and loss are one
    # --pipeline-model-parallel-layout: each stage's decoder layers, in stage order (sim/layouts.py)
    layout: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        others = (self.first_pipeline_num_layers, self.last_pipeline_num_layers, self.account_for_embedding or None,
                  self.account_for_loss or None)
        if self.layout is not None and any(x is not None for x in others):
            raise ValueError("--pipeline-model-parallel-layout places every layer itself: drop "
                             "--decoder-first/last-pipeline-num-layers and --account-for-embedding/loss-in-pipeline-split")

    @property
    def even(self) -> bool:
        return self == EVEN_STAGES

    @classmethod
    def from_args(cls, args: Any) -> "StageSplit":
        """From Megatron-LM's parsed arguments (absent flags: equal stages)."""
        from .layouts import parse_layout

        layout = getattr(args, "pipeline_model_parallel_layout", None)
        if layout is not None:
            return cls(layout=parse_layout(str(layout)))
        return cls(getattr(args, "decoder_first_pipeline_num_layers", None),
                   getattr(args, "decoder_last_pipeline_num_layers", None),
                   bool(getattr(args, "account_for_embedding_in_pipeline_split", False)),
                   bool(getattr(args, "account_for_loss_in_pipeline_split", False)))


EVEN_STAGES = StageSplit()


def stage_layer_counts(num_layers: int, pp: int, vp: int, split: StageSplit = EVEN_STAGES) -> tuple[int, ...]:
    """Decoder layers of each of the P*V stages (stage s: rank s mod P, its chunk s // P) as Megatron-Core builds
    them (`get_num_layers_to_build`); ValueError naming the flags when Megatron-LM refuses the split."""
    n = pp * vp
    first, last = split.first_pipeline_num_layers, split.last_pipeline_num_layers
    if split.layout is not None:
        if len(split.layout) != n or sum(split.layout) != num_layers or min(split.layout) < 0:
            raise ValueError(f"--pipeline-model-parallel-layout places {sum(split.layout)} decoder layers on "
                             f"{len(split.layout)} stages; the model has {num_layers} layers on P*V = {pp}*{vp} = {n}")
        return split.layout
    if split.even:
        if num_layers % n:
            raise ValueError(
                f"--num-layers-per-virtual-pipeline-stage / --pipeline-model-parallel-size: {num_layers} layers do "
                f"not split into P*V = {pp}*{vp} = {n} equal stages; choose P*V dividing {num_layers}, or an uneven "
                "split (--decoder-first/last-pipeline-num-layers, --account-for-embedding/loss-in-pipeline-split)")
        return (num_layers // n,) * n
    if (first is not None or last is not None) and (split.account_for_embedding or split.account_for_loss):
        raise ValueError("--decoder-first/last-pipeline-num-layers and --account-for-embedding/loss-in-pipeline-split "
                         "cannot be combined (Megatron-Core refuses it): choose one way to split unevenly")
    if first is not None or last is not None:
        per_rank = [None] * pp
        middle_layers, middle_ranks = num_layers, pp
        for rank, count, flag in ((0, first, "first"), (pp - 1, last, "last")):
            if count is None:
                continue
            if count < 1 or count % vp or pp < 2:
                raise ValueError(f"--decoder-{flag}-pipeline-num-layers {count} must be >= 1, a multiple of the V = "
                                 f"{vp} stages per rank, with --pipeline-model-parallel-size >= 2")
            per_rank[rank] = count
            middle_layers -= count
            middle_ranks -= 1
        if (middle_layers != 0) != (middle_ranks != 0) or (middle_ranks and middle_layers % (middle_ranks * vp)) \
                or middle_layers < 0:
            raise ValueError(f"--decoder-first/last-pipeline-num-layers leave {middle_layers} of {num_layers} layers "
                             f"for {middle_ranks} middle pipeline ranks: they must split evenly into V = {vp} stages "
                             "on each")
        if vp > 1 and middle_ranks == 0 and first is not None and last is not None:
            raise ValueError("--decoder-first-pipeline-num-layers with --decoder-last-pipeline-num-layers and virtual "
                             "stages needs a middle pipeline rank (Megatron-Core's layer offsets divide by their "
                             "count): raise --pipeline-model-parallel-size or drop one of them")
        middle = middle_layers // middle_ranks if middle_ranks else 0
        per_rank = [middle if c is None else c for c in per_rank]
        return tuple(per_rank[s % pp] // vp for s in range(n))
    units = num_layers + split.account_for_embedding + split.account_for_loss
    if units % n:
        raise ValueError(
            f"--account-for-embedding/loss-in-pipeline-split: {num_layers} layers plus the embedding/loss make "
            f"{units}, which P*V = {pp}*{vp} = {n} stages must divide")
    counts = [units // n] * n
    counts[0] -= split.account_for_embedding
    counts[-1] -= split.account_for_loss
    return tuple(counts)


@dataclass(frozen=True)
class Partition:
    """A model cut into P * V stages (equal layer counts unless `split` says otherwise) and laid over T-way tensor,
    CP-way context and EP-way expert parallelism (ETP-way tensor parallelism inside an expert, default T), with
    Megatron's sequence parallelism on or off; and how its kernels run (attention kernel, FP8)."""

    model: ModelProfile
    tp: int
    pp: int
    vp: int
    split: StageSplit = EVEN_STAGES
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    sequence_parallel: bool = True  # only meaningful at T > 1
    attention: str = "flash"  # "unfused": Megatron's local attention (scores materialised, fused softmax)
    fp8: str | None = None  # None (bf16 GEMMs) or a recipe of FP8_RECIPES
    tp_comm_overlap: bool = False  # --tp-comm-overlap (TransformerEngine userbuffers)
    # What-if, no Megatron-LM flag runs it: the output layer, final norm and loss spread over the P pipeline ranks,
    # each rank's last stage holding 1/P of their compute, parameters and activations (`head_share`).
    output_layer_over_pipeline: bool = False
    layer_counts: tuple[int, ...] = field(init=False, repr=False, compare=False)
    # Per stage, parameters on one GPU: (all, routed experts, decoder layers)
    _params: tuple[tuple[float, float, float], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        m = self.model
        object.__setattr__(self, "layer_counts", stage_layer_counts(m.num_layers, self.pp, self.vp, self.split))
        if m.num_heads % self.tp or m.hidden_size % self.tp or m.query_groups % self.tp:
            raise ValueError(
                f"--tensor-model-parallel-size {self.tp} must divide the {m.num_heads} heads, the "
                f"{m.query_groups} query groups and hidden size {m.hidden_size} of {m.name}")
        if self.cp < 1 or m.seq_length % (2 * self.cp if self.cp > 1 else 1):
            raise ValueError(f"--context-parallel-size {self.cp}: the sequence length {m.seq_length} must split "
                             f"into 2 x CP chunks (Megatron's causal load balancing)")
        if self.ep > 1 and not m.is_moe:
            raise ValueError(f"--expert-model-parallel-size {self.ep} needs a model with experts (--num-experts)")
        if m.is_moe and m.num_experts % self.ep:
            raise ValueError(f"--expert-model-parallel-size {self.ep} must divide --num-experts {m.num_experts}")
        if self.attention not in ATTENTION_KERNELS:
            raise ValueError(f"attention kernel {self.attention!r}: one of {ATTENTION_KERNELS}")
        if self.fp8 is not None and self.fp8 not in FP8_RECIPES:
            raise ValueError(f"--fp8-recipe {self.fp8!r}: one of {FP8_RECIPES}")
        object.__setattr__(self, "_params", tuple(self._count_params(s) for s in range(self.num_stages)))

    def _count_params(self, s: int) -> tuple[float, float, float]:
        """(all, routed-expert, decoder-layer) parameters of stage s on one GPU; computed once per partition."""
        m, st = self.model, self.stage(s)
        per_kind: dict[bool, tuple[float, float]] = {}
        total = experts = 0.0
        for i in self.stage_layers(s):
            moe = m.is_moe_layer(i)
            if moe not in per_kind:
                e = m.layer_expert_params(i) / (self.ep * self.expert_tp)
                per_kind[moe] = (m.layer_dense_params(i) / self.tp + e, e)
            total, experts = total + per_kind[moe][0], experts + per_kind[moe][1]
        layers = total
        if st.first:
            total += m.embedding_params(self.tp) / self.tp
        share = self.head_share(s)
        if share:
            pipelined = self.num_stages > 1 and (self.output_layer_over_pipeline or not st.first)
            total += share * m.head_params(self.tp, pipelined=pipelined) / self.tp
        return total, experts, layers

    def head_share(self, s: int) -> float:
        """The share of the output layer, final norm and loss that stage s holds: all of it on the last stage, or
        under the `output_layer_over_pipeline` what-if 1/P on each rank's last stage."""
        if self.output_layer_over_pipeline:
            return 1.0 / self.pp if s >= self.num_stages - self.pp else 0.0
        return 1.0 if s == self.num_stages - 1 else 0.0

    @property
    def expert_tp(self) -> int:
        return self.etp or self.tp

    @property
    def sp(self) -> bool:
        """Sequence parallelism in effect (it needs T > 1)."""
        return self.sequence_parallel and self.tp > 1

    @property
    def num_stages(self) -> int:
        return self.pp * self.vp

    @property
    def layers_per_stage(self) -> int:
        """The layer count of a stage when all are equal (ValueError otherwise: use `layer_counts`)."""
        if len(set(self.layer_counts)) != 1:
            raise ValueError(f"stages hold different layer counts {self.layer_counts}")
        return self.layer_counts[0]

    def rank_layers(self, rank: int) -> int:
        return sum(self.layer_counts[rank + c * self.pp] for c in range(self.vp))

    def stage(self, s: int) -> StageShape:
        return StageShape(s, self.layer_counts[s], s == 0, s == self.num_stages - 1, sum(self.layer_counts[:s]))

    def stage_layers(self, s: int) -> range:
        """Model indices of stage s's decoder layers (stage s = chunk s // P on rank s % P, in model order)."""
        first = sum(self.layer_counts[:s])
        return range(first, first + self.layer_counts[s])

    @property
    def padded_vocab(self) -> int:
        return self.model.padded_vocab_size(self.tp)

    def stage_expert_params(self, s: int) -> float:
        """Routed experts' parameters of stage s on one GPU (reduced over the expert-data-parallel group)."""
        return self._params[s][1]

    def stage_params(self, s: int) -> float:
        """Parameters of stage s held by one GPU (tensor- and expert-parallel shard)."""
        return self._params[s][0]

    def stage_layer_params(self, s: int) -> float:
        """Parameters of stage s's decoder layers on one GPU (no embedding, output layer or final norm)."""
        return self._params[s][2]

    def rank_params(self, rank: int) -> float:
        return sum(self.stage_params(rank + c * self.pp) for c in range(self.vp))

    # --- activations ---
    def tokens(self, b: int) -> float:
        """Tokens of one micro-batch on one GPU's sequence shard (context parallelism splits the sequence)."""
        return b * self.model.seq_length / self.cp

    def _replicated_div(self) -> int:
        """What divides the tensors tensor parallelism does not shard (norms, residual, dropout masks): T with
        sequence parallelism, else nothing."""
        return self.tp if self.sp else 1

    def layer_activation_bytes(self, b: int, layer: int, recompute: bool, selective: bool = False) -> float:
        """Bytes one decoder layer keeps from its forward to its backward, one micro-batch, per GPU (`selective`:
        the core attention is recomputed, so unfused attention keeps no s^2 tensors)."""
        m, sb = self.model, self.tokens(b)
        h = m.hidden_size
        if recompute:
            return 2 * sb * h / self._replicated_div()
        drop = 1 if m.hidden_dropout > 0 else 0
        replicated = sb * h * (2 + 2 + 4 + 2 * drop)  # QKV and fc1 inputs, the two norm inputs, dropout masks
        attn = 2 * sb * (2 * m.q_size + 2 * m.kv_size)  # Q, K, V, attention output
        if self.attention == "unfused" and not selective:  # softmax output (+ dropout mask and output): b a s^2 per CP shard
            per = 2 + (3 if m.attention_dropout > 0 else 0)
            attn += per * b * m.num_heads * m.seq_length * m.seq_length / self.cp
        if m.is_moe_layer(layer):
            k = m.moe_router_topk
            fc1_out = (2 if m.swiglu else 1) * m.expert_ffn
            experts = k * sb * (2 * h + 2 * fc1_out + 2 * m.expert_ffn + 2 * h)  # permuted in, fc1, act, out
            shared_f = m.moe_shared_expert_size
            shared = sb * (2 * (2 if m.swiglu else 1) * shared_f + 2 * shared_f) if shared_f else 0.0
            # Megatron runs MoE with T > 1 only under sequence parallelism: at ETP = 1 a GPU's experts get its
            # 1/T of the tokens (times k, balanced routing), at ETP = T all of them on 1/T of the width.
            mlp = (experts + shared) / self.tp
            return replicated / self._replicated_div() + attn / self.tp + mlp
        fc1_out = (2 if m.swiglu else 1) * m.ffn
        mlp = 2 * sb * fc1_out + 2 * sb * m.ffn
        return replicated / self._replicated_div() + (attn + mlp) / self.tp

    def activation_bytes(self, s: int, b: int, recompute: bool, recompute_num_layers: int | None = None,
                         selective: bool = False) -> float:
        """Bytes kept from the forward of (stage s, one micro-batch) until its backward, per GPU. Full
        recomputation keeps each recomputed layer's input (all layers, or the first `recompute_num_layers` of the
        stage); `selective` recomputes the core attention."""
        m = self.model
        n = sum(self.layer_activation_bytes(
                    b, i, recompute and (recompute_num_layers is None or k < recompute_num_layers), selective)
                for k, i in enumerate(self.stage_layers(s)))
        share = self.head_share(s)
        if share:
            sb = self.tokens(b)
            # Final norm input/output (bf16) and the fp32 softmax kept by the vocab-parallel cross entropy.
            n += share * (4 * sb * m.hidden_size / self._replicated_div() + 4 * sb * self.padded_vocab / self.tp)
        return n

    def pending_weight_grad_bytes(self, s: int, b: int) -> float:
        """Bytes a (stage s, micro-batch) keeps between its I and its W, per GPU: the operands of the weight-
        gradient GEMMs, bf16: the inputs of QKV, projection, fc1, fc2 (2sbh, 2sbq, 2sbh, 2sbf) and the gradients of
        their outputs (2sb(q + 2kv), 2sbh, 2sb f_out, 2sbh); with f = 4h and no GQA 32 sbh. On the last stage also
        the output layer's input and the gradient of the logits (2 sbh + 2 s b vocab)."""
        m = self.model
        sb, h = self.tokens(b), m.hidden_size
        n = 0.0
        for i in self.stage_layers(s):
            if m.is_moe_layer(i):
                f, width = m.expert_ffn, m.moe_router_topk
            else:
                f, width = m.ffn, 1
            fc1_out = (2 if m.swiglu else 1) * f
            attn = 2 * sb * (h + m.q_size) + 2 * sb * (m.q_size + 2 * m.kv_size + h)
            mlp = width * (2 * sb * (h + f) + 2 * sb * (fc1_out + h))
            n += (attn + mlp) / self.tp
        n += self.head_share(s) * (2 * sb * h + 2 * sb * self.padded_vocab) / self.tp
        return n

    def working_bytes(self, s: int, b: int) -> float:
        """Transient bytes while one micro-batch runs through stage s: its largest layer's full activations (the
        layer being recomputed under full recomputation, or the live gradients/temporaries otherwise)."""
        layers = self.stage_layers(s)
        return max((self.layer_activation_bytes(b, i, False) for i in layers),
                   default=self.layer_activation_bytes(b, 0, False))

    def p2p_bytes(self, b: int) -> float:
        """One activation (or its gradient) between stages: s b h bf16 per CP shard, and with sequence
        parallelism scattered over the T ranks (Megatron-Core sends the full tensor without it)."""
        return 2 * self.tokens(b) * self.model.hidden_size / (self.tp if self.sp else 1)
