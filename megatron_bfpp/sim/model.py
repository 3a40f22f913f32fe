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

from dataclasses import dataclass


@dataclass(frozen=True)
class GPTModel:
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

    def num_params(self) -> int:
        return self.num_layers * self.layer_params() + self.embedding_params() + self.head_params()

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
MODELS: dict[str, GPTModel] = {
    "gpt-1.3b": GPTModel("gpt-1.3b", 24, 2048, 16),
    "gpt-13b": GPTModel("gpt-13b", 40, 5120, 40),
    "gpt-52b": GPTModel("gpt-52b", 64, 8192, 64),
    "gpt-175b": GPTModel("gpt-175b", 96, 12288, 96),
}


def get_model(name: str) -> GPTModel:
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
class Partition:
    """A model cut into P * V stages of equal layer counts, with T-way tensor parallelism."""

    model: GPTModel
    tp: int
    pp: int
    vp: int

    def __post_init__(self) -> None:
        m, s = self.model, self.pp * self.vp
        if m.num_layers % s:
            raise ValueError(
                f"--num-layers-per-virtual-pipeline-stage / --pipeline-model-parallel-size: {m.num_layers} layers "
                f"of {m.name} do not split into P*V = {self.pp}*{self.vp} = {s} equal stages; choose P*V dividing "
                f"{m.num_layers}"
            )
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
        return self.model.num_layers // self.num_stages

    def stage(self, s: int) -> StageShape:
        return StageShape(s, self.layers_per_stage, s == 0, s == self.num_stages - 1)

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

    def stage_forward_flops(self, s: int, b: int) -> float:
        """Forward FLOPs of stage s on one micro-batch, per GPU."""
        st = self.stage(s)
        f = st.layers * self.model.layer_forward_flops(b)
        if st.last:
            f += self.model.head_forward_flops(b)
        return f / self.tp

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
