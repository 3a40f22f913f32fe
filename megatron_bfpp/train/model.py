"""Megatron-Core GPT models split into pipeline chunks, initialised identically whatever the layout.

Placement: chunk k on pipeline rank r is global stage s = k*P + r and holds decoder layers [s*L, (s+1)*L) with
L = num_layers / (P*V); stage 0 owns the embedding, stage P*V-1 the final norm and output layer.

Identical init: after Megatron has built a chunk, every parameter is overwritten from a generator keyed by
(seed, global parameter name), using the config's own init methods (init_method for weights,
output_layer_init_method for the attention and MLP output projections, embedding_init_method for the
embeddings, zeros for biases, ones for norm weights). The global name uses the global layer index
("decoder.layers.5.mlp.linear_fc1.weight"), so a parameter gets the same values under every (P, V).

CPU: Megatron's DotProductAttention is CUDA-bound (global memory buffer, CUDA RNG tracker), so the local
spec's core attention is replaced by `SDPACoreAttention`. GPU: the stock spec (TransformerEngine when
importable, else Megatron's local spec).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import math
import re
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16}
_OUTPUT_PROJECTIONS = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
_TIED_NAME = "embedding.word_embeddings.weight"
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.")


# ----------------------------------------------------------------------------------------------- attention
class SDPACoreAttention(MegatronModule):
    """Core attention over `torch.nn.functional.scaled_dot_product_attention`, a drop-in for Megatron's
    DotProductAttention: query/key/value [s, b, heads (or groups), d] -> context [s, b, heads*d].

    `attention_mask` follows Megatron's convention (bool, True = masked out, broadcastable to [b, h, s, s]);
    None means causal. Grouped-query attention repeats key/value heads as DotProductAttention does.
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPACoreAttention supports --context-parallel-size 1 only")
        if getattr(config, "window_size", None) is not None:
            raise ValueError("SDPACoreAttention does not implement sliding-window attention (--window-size)")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(f"SDPACoreAttention supports softmax_type 'vanilla' only, got {config.softmax_type!r}")
        tp = pg_collection.tp.size() if pg_collection is not None and getattr(pg_collection, "tp", None) else 1
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.heads = config.num_attention_heads // tp
        self.groups = (config.num_query_groups or config.num_attention_heads) // tp
        self.head_dim = config.kv_channels
        # Same default as DotProductAttention: 1/sqrt(d) (its query-key layer scaling cancels out).
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: AttnMaskType | None = None,
                attention_bias: torch.Tensor | None = None, packed_seq_params: Any = None,
                **unused: Any) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPACoreAttention supports neither packed sequences nor attention bias")
        if self.heads != self.groups:
            key = key.repeat_interleave(self.heads // self.groups, dim=2)
            value = value.repeat_interleave(self.heads // self.groups, dim=2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
        dropout = self.dropout_p if self.training else 0.0
        if attention_mask is None:
            ctx = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=self.softmax_scale)
        else:
            # SDPA's boolean mask means "may attend": the opposite of Megatron's.
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask.to(torch.bool),
                                                 dropout_p=dropout, scale=self.softmax_scale)
        sq, b = ctx.shape[2], ctx.shape[0]
        return ctx.permute(2, 0, 1, 3).reshape(sq, b, self.heads * self.head_dim)


def have_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # ImportError, or a broken install that fails while importing
        return False
    return True


def layer_spec(device: torch.device | str | None = None, normalization: str = "LayerNorm") -> ModuleSpec:
    """The transformer-layer spec for `device`: on CPU Megatron's local spec with `SDPACoreAttention`; on CUDA
    the TransformerEngine spec when importable, else the local spec with Megatron's DotProductAttention.

    `normalization` selects the local spec's norm class; the TransformerEngine spec takes no such argument
    (its TENorm and fused layernorm-linear read `config.normalization` when the layer is built), as in
    Megatron-LM's `gpt_builders`."""
    device = torch.device(device) if device is not None else _default_device()
    if device.type == "cuda":
        if have_transformer_engine():
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

            return get_gpt_layer_with_transformer_engine_spec()
        return get_gpt_layer_local_spec(normalization=normalization)
    spec = get_gpt_layer_local_spec(normalization=normalization)
    spec = copy.deepcopy(spec)
    spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return spec


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


# -------------------------------------------------------------------------------------------------- config
def layers_per_stage(num_layers: int, pp_size: int, vp_size: int = 1) -> int:
    """L = num_layers / (P*V), with one clear error when it does not divide."""
    if pp_size < 1 or vp_size < 1:
        raise ValueError(f"pipeline sizes must be >= 1 (P={pp_size}, V={vp_size})")
    if num_layers % (pp_size * vp_size):
        raise ValueError(
            f"--num-layers {num_layers} must be divisible by --pipeline-model-parallel-size {pp_size} x "
            f"virtual stages {vp_size} (= --num-layers / (P x --num-layers-per-virtual-pipeline-stage)); "
            "change one of them")
    return num_layers // (pp_size * vp_size)


def vp_size_from_layers_per_virtual_stage(num_layers: int, pp_size: int, layers_per_virtual_stage: int | None) -> int:
    """Megatron-LM's --num-layers-per-virtual-pipeline-stage -> V (1 when the flag is unset)."""
    if layers_per_virtual_stage is None:
        return 1
    if layers_per_virtual_stage < 1 or num_layers % (pp_size * layers_per_virtual_stage):
        raise ValueError(
            f"--num-layers {num_layers} must be divisible by --pipeline-model-parallel-size {pp_size} x "
            f"--num-layers-per-virtual-pipeline-stage {layers_per_virtual_stage}; change one of them")
    return num_layers // (pp_size * layers_per_virtual_stage)


def make_transformer_config(
    *,
    num_layers: int,
    hidden_size: int,
    num_attention_heads: int,
    ffn_hidden_size: int | None = None,
    num_query_groups: int | None = None,
    kv_channels: int | None = None,
    hidden_dropout: float = 0.1,
    attention_dropout: float = 0.1,
    params_dtype: str | torch.dtype = "fp32",
    init_method_std: float = 0.02,
    normalization: str = "LayerNorm",
    layernorm_epsilon: float = 1e-5,
    add_bias_linear: bool = True,
    recompute_granularity: str | None = None,
    recompute_method: str | None = None,
    recompute_num_layers: int | None = None,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    tensor_model_parallel_size: int = 1,
    deallocate_pipeline_outputs: bool = True,
    use_cpu_initialization: bool | None = None,
    **extra: Any,
) -> TransformerConfig:
    """A TransformerConfig from Megatron-LM's flag meanings (defaults as Megatron-LM's: dropout 0.1, std 0.02).

    Dropout may be 0 (needed for layout-equivalence checks: dropout masks differ between layouts).
    Full recomputation defaults to method "uniform", 1 layer per unit, as a usable --recompute-granularity full.
    `extra` goes to TransformerConfig unchanged.
    """
    dtype = _DTYPES.get(params_dtype, None) if isinstance(params_dtype, str) else params_dtype
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"params dtype {params_dtype!r} not supported: use fp32, bf16 or fp16 (--bf16 / --fp16)")
    vp = virtual_pipeline_model_parallel_size
    layers_per_stage(num_layers, pipeline_model_parallel_size, vp or 1)
    if recompute_granularity not in (None, "full", "selective"):
        raise ValueError(f"--recompute-granularity must be 'full' or 'selective', got {recompute_granularity!r}")
    if recompute_granularity == "full":
        recompute_method = recompute_method or "uniform"
        recompute_num_layers = recompute_num_layers or 1
    if use_cpu_initialization is None:
        use_cpu_initialization = not torch.cuda.is_available()
    return TransformerConfig(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        ffn_hidden_size=ffn_hidden_size,  # TransformerConfig's own default: 4 * hidden_size
        num_query_groups=num_query_groups,
        kv_channels=kv_channels,
        hidden_dropout=hidden_dropout,
        attention_dropout=attention_dropout,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        init_method_std=init_method_std,
        normalization=normalization,
        layernorm_epsilon=layernorm_epsilon,
        add_bias_linear=add_bias_linear,
        recompute_granularity=recompute_granularity,
        recompute_method=recompute_method,
        recompute_num_layers=recompute_num_layers,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=vp if vp and vp > 1 else None,
        tensor_model_parallel_size=tensor_model_parallel_size,
        deallocate_pipeline_outputs=deallocate_pipeline_outputs,
        use_cpu_initialization=use_cpu_initialization,
        # Every parameter is overwritten by our keyed init, so Megatron's own (RNG-consuming) init is skipped.
        perform_initialization=False,
        **extra,
    )


# ------------------------------------------------------------------------------------------- process groups
class PipelinePosition:
    """Stands in for a pipeline process group where only a position is needed: Megatron's layer arithmetic
    reads `rank()` and `size()` of `pg_collection.pp` while building. Used to build another rank's chunks in
    one process (layout comparisons) and for P = 1 with several chunks (see build_model_chunks)."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def __repr__(self) -> str:
        return f"PipelinePosition(rank={self._rank}, size={self._size})"


def _process_groups(pp_rank: int, pp_size: int, force_position: bool) -> ProcessGroupCollection:
    if not (dist.is_initialized() and ps.model_parallel_is_initialized()):
        raise RuntimeError("Megatron's process groups are needed to build model chunks: call "
                           "megatron_bfpp.train.parallel.init_parallel() (or init_single_process()) first")
    pgc = ProcessGroupCollection.use_mpu_process_groups()
    real = ps.get_pipeline_model_parallel_group()
    if not force_position and real.size() == pp_size:
        if real.rank() != pp_rank:
            raise ValueError(f"pp_rank {pp_rank} differs from this process's pipeline rank {real.rank()}")
    else:
        pgc.pp = PipelinePosition(pp_rank, pp_size)
    # No embedding groups: Megatron would all-reduce the tied weight at construction (through .cuda());
    # our keyed init makes both copies equal without communication.
    pgc.embd = None
    pgc.pos_embd = None
    return pgc


# -------------------------------------------------------------------------------------------------- chunks
def build_model_chunks(
    config: TransformerConfig,
    *,
    vocab_size: int,
    max_sequence_length: int,
    pp_rank: int,
    pp_size: int,
    vp_size: int = 1,
    share_embeddings_and_output_weights: bool = True,
    seed: int = 1234,
    device: torch.device | str | None = None,
    position_embedding_type: str = "learned_absolute",
    transformer_layer_spec: ModuleSpec | None = None,
) -> list[GPTModel]:
    """This pipeline rank's V chunks of a GPTModel, chunk k being global stage s = k*P + r.

    All chunks share one config whose pipeline sizes are (P, V) (the given config, or one copy of it when its
    sizes differ). Megatron's layer arithmetic has no case for P = 1 with V > 1: there chunk k is built as
    stage k of a V-stage pipeline (its config copy says pipeline size V, no virtual stages) and the tied
    output layer of the last chunk is the first chunk's embedding Parameter itself.
    """
    vp_size = vp_size or 1
    L = layers_per_stage(config.num_layers, pp_size, vp_size)
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank {pp_rank} outside [0, {pp_size})")
    if config.tensor_model_parallel_size != 1:
        raise ValueError("--tensor-model-parallel-size > 1 is not supported by megatron_bfpp's model builder yet")
    device = torch.device(device) if device is not None else _default_device()
    if config.recompute_granularity is not None and not megatron_recompute_available():
        raise RuntimeError(
            f"--recompute-granularity {config.recompute_granularity} needs CUDA here: Megatron's activation "
            "checkpointing (tensor_parallel.checkpoint) saves and restores the CUDA RNG state. Drop the flag on CPU.")
    spec = transformer_layer_spec or layer_spec(device, config.normalization)
    single_rank_loop = pp_size == 1 and vp_size > 1
    if single_rank_loop:
        cfg = _chunk_config(config, vp_size, None, device)
    else:
        cfg = _chunk_config(config, pp_size, vp_size if vp_size > 1 else None, device)

    chunks: list[GPTModel] = []
    for k in range(vp_size):
        s = k * pp_size + pp_rank
        if single_rank_loop:
            pgc, vp_stage = _process_groups(k, vp_size, force_position=True), None
        else:
            pgc, vp_stage = _process_groups(pp_rank, pp_size, force_position=False), (k if vp_size > 1 else None)
        # Construction draws from the default RNGs (torch.nn.Embedding's own init); keep the caller's streams.
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
            model = GPTModel(
                config=cfg, transformer_layer_spec=spec, vocab_size=vocab_size,
                max_sequence_length=max_sequence_length, pre_process=s == 0, post_process=s == pp_size * vp_size - 1,
                share_embeddings_and_output_weights=share_embeddings_and_output_weights,
                position_embedding_type=position_embedding_type, pg_collection=pgc, vp_stage=vp_stage)
        if len(model.decoder.layers) != L:  # guards against a Megatron layer-arithmetic change
            raise RuntimeError(f"stage {s}: Megatron built {len(model.decoder.layers)} layers, expected {L}")
        chunks.append(model.to(device))

    if share_embeddings_and_output_weights:
        _tie(chunks, pp_size)
    init_parameters(chunks, pp_rank=pp_rank, pp_size=pp_size, seed=seed, config=config)
    return chunks


def megatron_recompute_available() -> bool:
    """Whether Megatron's activation checkpointing can run in this process (it reads the CUDA RNG state)."""
    try:
        from megatron.core.tensor_parallel.random import _get_all_rng_states

        _get_all_rng_states()
    except Exception:  # no CUDA driver / torch without CUDA: RuntimeError or AssertionError
        return False
    return True


def float16_chunks(chunks: Sequence[GPTModel]) -> list[torch.nn.Module]:
    """Wrap chunks in Megatron's Float16Module for --bf16 / --fp16, as Megatron-LM's get_model does: it casts
    every parameter (Megatron builds some, e.g. position embeddings, in fp32) and the first/last stage's I/O."""
    from megatron.core.transformer.module import Float16Module

    if not all(c.config.bf16 or c.config.fp16 for c in chunks):
        raise ValueError("float16_chunks needs a config with bf16 or fp16 set (--bf16 / --fp16)")
    return [Float16Module(c.config, c) for c in chunks]


def _chunk_config(config: TransformerConfig, pp: int, vp: int | None, device: torch.device) -> TransformerConfig:
    """The config the chunks share: the caller's own object when it already fits (so hooks set on it reach
    every chunk), else one copy with the pipeline sizes (and, on CPU, CPU initialisation) fixed."""
    kwargs: dict[str, Any] = {}
    if config.pipeline_model_parallel_size != pp or config.virtual_pipeline_model_parallel_size != vp:
        kwargs.update(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp)
        if pp > 1 and config.pipeline_dtype is None:
            kwargs["pipeline_dtype"] = config.params_dtype
    if device.type == "cpu" and not config.use_cpu_initialization:
        kwargs["use_cpu_initialization"] = True  # else Megatron allocates parameters on the current CUDA device
    return dataclasses.replace(config, **kwargs) if kwargs else config


def _tie(chunks: list[GPTModel], pp_size: int) -> None:
    first = [c for c in chunks if c.pre_process]
    last = [c for c in chunks if c.post_process]
    if first and last and first[0] is not last[0]:
        # P = 1, several chunks: both ends live here, so make them one Parameter (its gradient then sums both
        # uses by itself, as in the single-chunk model).
        shared = first[0].embedding.word_embeddings.weight
        last[0].output_layer.weight = shared
        # Not `.shared` (Megatron's "counted on another stage" flag for grad norms): this is the only copy.
        shared.shared_embedding = True
    elif pp_size > 1 and first:
        first[0].embedding.word_embeddings.weight.shared_embedding = True
    elif pp_size > 1 and last:
        last[0].output_layer.weight.shared_embedding = True


def _stage_offset(chunk_index: int, pp_rank: int, pp_size: int, layers: int) -> int:
    return (chunk_index * pp_size + pp_rank) * layers


def _is_tied_output_copy(chunk: GPTModel, local_name: str) -> bool:
    return (local_name == "output_layer.weight" and chunk.share_embeddings_and_output_weights
            and chunk.post_process)


def global_name(local_name: str, chunk_index: int, pp_rank: int, pp_size: int, layers_per_chunk: int) -> str:
    """Local parameter name in chunk `chunk_index` of rank `pp_rank` -> its name in the whole model."""
    m = _LAYER_RE.match(local_name)
    if m is None:
        return local_name
    g = int(m.group(1)) + _stage_offset(chunk_index, pp_rank, pp_size, layers_per_chunk)
    return f"decoder.layers.{g}.{local_name[m.end():]}"


def global_named_parameters(chunks: Sequence[torch.nn.Module], pp_rank: int, pp_size: int) -> dict[str, torch.nn.Parameter]:
    """{global name: local Parameter} for this rank's chunks (a Parameter used by two chunks appears once).

    The last stage's copy of a tied output weight is named after the word embedding it mirrors
    ("embedding.word_embeddings.weight"): it is the same logical parameter, initialised equal, and after
    `allreduce_tied_embedding_grads` its gradient equals the single-chunk model's embedding gradient.
    """
    out: dict[str, torch.nn.Parameter] = {}
    seen: set[int] = set()
    for k, chunk in enumerate(chunks):
        model = _unwrap(chunk)
        L = len(model.decoder.layers)
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            g = _TIED_NAME if _is_tied_output_copy(model, name) else global_name(name, k, pp_rank, pp_size, L)
            if g in out:
                raise RuntimeError(f"two local parameters map to {g!r}")
            out[g] = p
    return out


def _unwrap(module: torch.nn.Module) -> GPTModel:
    while not isinstance(module, GPTModel) and hasattr(module, "module"):
        module = module.module
    if not isinstance(module, GPTModel):
        raise TypeError(f"expected a GPTModel chunk (possibly wrapped), got {type(module).__name__}")
    return module


# ---------------------------------------------------------------------------------------------------- init
def _key(seed: int, name: str) -> int:
    digest = hashlib.blake2b(f"{seed}\0{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _init_method_for(name: str, config: TransformerConfig):
    if name.startswith("embedding."):
        return config.embedding_init_method
    if name.endswith(_OUTPUT_PROJECTIONS):
        return config.output_layer_init_method
    return config.init_method


def init_value(name: str, shape: Sequence[int], seed: int, config: TransformerConfig) -> torch.Tensor:
    """The fp32 CPU initial value of the global parameter `name` (depends on (seed, name, shape) only)."""
    leaf = name.rsplit(".", 1)[-1]
    if len(shape) == 1:
        # Host values by design: drawn on the CPU generator, then copied to each parameter's device.
        if leaf.endswith("bias"):
            return torch.zeros(shape, device="cpu")
        if leaf.endswith("weight"):  # 1-D weights are norm scales (local: *norm.weight; TE: layer_norm_weight)
            zero = config.layernorm_zero_centered_gamma
            return torch.zeros(shape, device="cpu") if zero else torch.ones(shape, device="cpu")
    elif len(shape) >= 2 and leaf.endswith("weight"):
        value = torch.empty(tuple(shape), dtype=torch.float32, device="cpu")
        # Megatron's init methods draw from the default CPU generator: seed it per parameter, then restore it.
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(_key(seed, name))
            _init_method_for(name, config)(value)
        return value
    raise ValueError(f"no initialisation rule for parameter {name!r} of shape {tuple(shape)}")


@torch.no_grad()
def init_parameters(chunks: Sequence[torch.nn.Module], *, pp_rank: int, pp_size: int, seed: int,
                    config: TransformerConfig) -> None:
    """Overwrite every parameter with `init_value(global name)`; `config` supplies the init methods (its
    num_layers is the whole model's, so the scaled output init is the same in every layout)."""
    for name, p in global_named_parameters(chunks, pp_rank, pp_size).items():
        p.copy_(init_value(name, p.shape, seed, config).to(dtype=p.dtype, device=p.device))


# ---------------------------------------------------------------------------------------- tied embeddings
def shared_embedding_parameters(chunks: Iterable[torch.nn.Module]) -> list[torch.nn.Parameter]:
    seen: dict[int, torch.nn.Parameter] = {}
    for chunk in chunks:
        for p in chunk.parameters():
            if getattr(p, "shared_embedding", False):
                seen.setdefault(id(p), p)
    return list(seen.values())


def allreduce_tied_embedding_grads(chunks: Sequence[torch.nn.Module], group: Any = "default") -> None:
    """Sum the gradients of the tied word-embedding copies (first and last pipeline stage) over the
    embedding group, as Megatron's `_allreduce_word_embedding_grads`: `.main_grad` when the parameter has
    one (Megatron DDP), else `.grad`. A no-op where the group is None (P = 1: one Parameter; middle ranks)."""
    if group == "default":
        from megatron_bfpp.train.parallel import embedding_group

        group = embedding_group()
    if group is None or dist.get_world_size(group) == 1:
        return
    params = [p for p in shared_embedding_parameters(chunks)]
    if len(params) != 1:
        raise RuntimeError(f"expected one tied embedding parameter on this rank of the embedding group, "
                           f"found {len(params)} (untied model? then do not call allreduce_tied_embedding_grads)")
    p = params[0]
    attr = "main_grad" if hasattr(p, "main_grad") else "grad"
    grad = getattr(p, attr)
    if grad is None:  # this end saw no gradient; still take part, or the peer would wait forever
        grad = torch.zeros_like(p)
        setattr(p, attr, grad)
    dist.all_reduce(grad, group=group)
