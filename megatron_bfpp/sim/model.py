"""GPT model profiles: parameters, FLOPs and activation memory per pipeline stage and micro-batch.

Conventions (Megatron-LM's GPT): pre-LayerNorm decoder layers with a 4h MLP, learned position embeddings,
word embedding on the first stage and an untied output layer plus the final LayerNorm on the last stage
(Megatron's `--untie-embeddings-and-output-weights`, so no embedding all-reduce between first and last stage).
Tensor parallelism T uses Megatron's sequence parallelism; everything returned is per GPU.

FLOPs (Narayanan et al., SC'21, eq. 3, 2 FLOPs per multiply-add): one layer's forward on b sequences of length
s is 24 b s h^2 + 4 b s^2 h; the backward is twice the forward; full activation recomputation adds one more
forward. The output layer costs 2 b s h vocab forward. Model FLOPs (for TFLOP/s and MFU) never count recompute.

Activations (Korthikanti et al., 2022, "Reducing Activation Recomputation in Large Transformer Models", Table 2):
with tensor + sequence parallelism and attention that keeps no s^2 tensors (selective recomputation or flash
attention) a layer keeps 34 s b h / T bytes; with full recomputation only its input, 2 s b h / T bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelProfile:
    """The layer sizes of a GPT model that the simulator's costs are computed from (not a model that runs)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    seq_length: int = 2048
    vocab_size: int = 51200  # GPT-2's 50257 padded to a multiple of 128 * 8 as Megatron does
    ffn_hidden_size: int | None = None  # default 4h

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    # --- parameters (whole model, before tensor parallelism) ---
    def layer_params(self) -> int:
        h, f = self.hidden_size, self.ffn
        return 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h  # QKV+proj, fc1+fc2, two LayerNorms

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size + self.seq_length * self.hidden_size

    def head_params(self) -> int:
        return self.vocab_size * self.hidden_size + 2 * self.hidden_size  # output layer + final LayerNorm

    # --- FLOPs per micro-batch of b sequences (whole model, before tensor parallelism) ---
    def layer_forward_flops(self, b: int) -> float:
        h, s, f = self.hidden_size, self.seq_length, self.ffn
        return 2 * b * s * (4 * h * h + 2 * h * f) + 4 * b * s * s * h

    def layer_backward_flops(self, b: int) -> tuple[float, float]:
        """(I, W) FLOPs of one layer's backward split into the gradient of its input and of its weights (Qi et
        al., "Zero Bubble Pipeline Parallelism", Table 1; with f = 4h: I = sbh(24h + 8s), W = 24sbh^2 against
        F = sbh(24h + 4s)). Every weight GEMM has one input-gradient and one weight-gradient GEMM of its own
        size; the attention matmuls have no weights, and their backward (twice their forward) is all I."""
        h, s, f = self.hidden_size, self.seq_length, self.ffn
        gemms = 2 * b * s * (4 * h * h + 2 * h * f)
        return gemms + 8 * b * s * s * h, gemms

    def head_forward_flops(self, b: int) -> float:
        return 2 * b * self.seq_length * self.hidden_size * self.vocab_size

    def model_flops_per_sequence(self) -> float:
        """Forward + backward FLOPs of one sequence, without recomputation (the MFU numerator)."""
        return 3 * (self.num_layers * self.layer_forward_flops(1) + self.head_forward_flops(1))


# Published shapes. GPT-3 paper (Brown et al., 2020, Table 2.1) for 1.3B, 13B and 175B; 52B is the 64-layer x
# 8192-hidden x 64-head shape used for that size by the breadth-first paper and by Megatron's scaling tables.
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


@dataclass(frozen=True)
class StageShape:
    """What one pipeline stage holds, per GPU (after tensor parallelism)."""

    stage: int
    layers: int
    first: bool  # holds the embeddings
    last: bool  # holds the final LayerNorm and output layer


@dataclass(frozen=True)
class StageSplit:
    """How Megatron-LM spreads the decoder layers over the pipeline, by its flags; the default is equal stages."""

    first_pipeline_num_layers: int | None = None  # --decoder-first-pipeline-num-layers (all of rank 0's stages)
    last_pipeline_num_layers: int | None = None  # --decoder-last-pipeline-num-layers (all of rank P-1's stages)
    account_for_embedding: bool = False  # --account-for-embedding-in-pipeline-split: the embedding is a layer
    account_for_loss: bool = False  # --account-for-loss-in-pipeline-split: the output layer and loss are one

    @property
    def even(self) -> bool:
        return self == EVEN_STAGES

    @classmethod
    def from_args(cls, args: Any) -> "StageSplit":
        """From Megatron-LM's parsed arguments (absent flags: equal stages)."""
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
    """A model cut into P * V stages (equal layer counts unless `split` says otherwise), with T-way tensor
    parallelism."""

    model: ModelProfile
    tp: int
    pp: int
    vp: int
    split: StageSplit = EVEN_STAGES
    layer_counts: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        m = self.model
        object.__setattr__(self, "layer_counts", stage_layer_counts(m.num_layers, self.pp, self.vp, self.split))
        if m.num_heads % self.tp or m.hidden_size % self.tp:
            raise ValueError(
                f"--tensor-model-parallel-size {self.tp} must divide the {m.num_heads} heads and hidden size "
                f"{m.hidden_size} of {m.name}"
            )

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
        return StageShape(s, self.layer_counts[s], s == 0, s == self.num_stages - 1)

    def stage_params(self, s: int) -> float:
        """Parameters of stage s held by one GPU (tensor-parallel shard)."""
        st, m = self.stage(s), self.model
        n = st.layers * m.layer_params()
        if st.first:
            n += m.embedding_params()
        if st.last:
            n += m.head_params()
        return n / self.tp

    def rank_params(self, rank: int) -> float:
        return sum(self.stage_params(rank + c * self.pp) for c in range(self.vp))

    def activation_bytes(self, s: int, b: int, recompute: bool) -> float:
        """Bytes kept from the forward of (stage s, one micro-batch) until its backward, per GPU."""
        st, m = self.stage(s), self.model
        sbh = m.seq_length * b * m.hidden_size
        per_layer = 2 * sbh if recompute else 34 * sbh
        n = st.layers * per_layer
        if st.last:
            # Final LayerNorm input/output (bf16) and the fp32 softmax kept by the vocab-parallel cross entropy.
            n += 4 * sbh + 4 * m.seq_length * b * m.vocab_size
        return n / self.tp

    def pending_weight_grad_bytes(self, s: int, b: int) -> float:
        """Bytes a (stage s, micro-batch) keeps between its I and its W, per GPU: the operands of the weight-
        gradient GEMMs. Per layer the inputs of QKV, projection, fc1, fc2 (2 + 2 + 2 + 8 sbh, bf16) and the
        gradients of their outputs (6 + 2 + 8 + 2 sbh): 32 sbh (with f = 4h); on the last stage also the
        output layer's input and the gradient of the logits (2 sbh + 2 s b vocab)."""
        st, m = self.stage(s), self.model
        sbh = m.seq_length * b * m.hidden_size
        per_layer = 2 * (3 * sbh + m.seq_length * b * m.ffn) + 2 * (5 * sbh + m.seq_length * b * m.ffn)
        n = st.layers * per_layer
        if st.last:
            n += 2 * sbh + 2 * m.seq_length * b * m.vocab_size
        return n / self.tp

    def working_bytes(self, s: int, b: int) -> float:
        """Transient bytes while one micro-batch runs through stage s: one layer's full activations (the layer
        being recomputed under full recomputation, or the live gradients/temporaries otherwise)."""
        m = self.model
        return 34 * m.seq_length * b * m.hidden_size / self.tp

    def p2p_bytes(self, b: int) -> float:
        """One activation (or its gradient) between stages: s b h bf16, scattered over the T ranks (sequence
        parallelism / Megatron's scatter-gather optimisation)."""
        m = self.model
        return 2 * m.seq_length * b * m.hidden_size / self.tp
