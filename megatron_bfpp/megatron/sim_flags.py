"""A run as it is launched: Megatron-LM's `pretrain_gpt.py` flags read into the simulator's model and configuration.

`read_run(flags, gpus, hw)` parses the flags with Megatron-LM's own parser and `validate_args` (with the plugin's
flags, as `pretrain_gpt.py` does under the plugin) on `gpus` ranks of `hw`, runs the plugin's checks, and returns
the `sim.model.ModelProfile` and `sim.costs.Config` they describe, with Megatron's meanings and defaults:

- the model: layers, hidden size, heads; grouped-query attention only with --group-query-attention; the FFN width
  Megatron derives (4h, or 8h/3 rounded down to 64 with --swiglu); tied embeddings unless
  --untie-embeddings-and-output-weights; the tokenizer's vocabulary (--vocab-size; 50257 for GPT2BPETokenizer)
  padded by --make-vocab-size-divisible-by; MoE layers where --moe-layer-freq puts them;
- how it runs: T, P, V, CP, EP, ETP, D = N / (T P CP), b, M = B / (D b); the schedule: stock Megatron's own (1F1B,
  or interleaved 1F1B with virtual stages) unless --pipeline-schedule names one of the plugin's; data parallelism:
  the plugin's --zero-stage (its sharded optimizer inside the schedule, communication overlapped), else Megatron's
  DDP or --use-distributed-optimizer (ZeRO-0 / ZeRO-1, its optimizer after the schedule) with its communication
  overlapped only with --overlap-grad-reduce; --no-overlap-p2p-communication; --sequence-parallel; flash attention
  unless --attention-backend local/unfused or --transformer-impl local; --fp8-format with its --fp8-recipe;
  --recompute-granularity full (--recompute-method block: the first --recompute-num-layers layers of each stage;
  uniform: all) or selective (core attention); --tp-comm-overlap; --overlap-moe-expert-parallel-comm.

Mixed precision is what the simulator models (bf16 or fp16 weights and activations, fp32 gradients and Adam
state), so --bf16 (or --fp16) is required. Flags describing what it does not model (multi-latent attention,
hybrid Mamba layers, multi-token prediction, FP4, offloading, FSDP, ...) get one error
naming the flag. Megatron's own rejections come back as `FlagError("Megatron-LM rejects the flags: ...")`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import traceback
import warnings
from typing import Iterator, Sequence

from ..schedule.kinds import megatron_kind
from ..sim.costs import Config
from ..sim.hardware import Hardware
from ..sim.layouts import layout_string
from ..sim.model import ModelProfile, StageSplit

# Megatron's argument checks ask the GPU's major architecture: the hardware profiles' GPUs.
GPU_ARCH = {"dgx-a100": 8, "dgx-a100-40gb": 8, "dgx-h100": 9, "h200": 9, "dgx-b200": 10}
# The launch environment Megatron-LM asks for with tensor or context parallelism before Blackwell.
LAUNCH_ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
GPT2_BPE_VOCAB = 50257  # GPT2BPETokenizer's vocabulary file (gpt2-vocab.json)


class FlagError(ValueError):
    """Flags the simulator cannot take; the message names the flag and the fix."""


def given_flags(flags: Sequence[str]) -> set[str]:
    """The option names written in `flags` (Megatron's parser takes no abbreviations, so these are exact)."""
    return {f.split("=", 1)[0] for f in flags if f.startswith("--")}


# ------------------------------------------------------------------------------------------------ parsing

@contextlib.contextmanager
def _quiet() -> Iterator[io.StringIO]:
    """Megatron's import and argument checks print and warn a lot; keep what they say for an error message."""
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)  # "No CUDA runtime is found"
    sink = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stderr(sink), contextlib.redirect_stdout(sink):
        warnings.simplefilter("ignore")
        yield sink


@contextlib.contextmanager
def _cluster_transformer_engine() -> Iterator[None]:
    """Megatron's argument checks ask the installed TransformerEngine's version (`is_te_min_version`); the run
    simulated is on the cluster, whose TransformerEngine is the one its flags were written for, not this machine's:
    answer that it is recent enough."""
    from megatron.training import arguments

    original = arguments.is_te_min_version
    arguments.is_te_min_version = lambda *args, **kwargs: True
    try:
        yield
    finally:
        arguments.is_te_min_version = original


def parse_flags(flags: Sequence[str], world_size: int, hw: Hardware) -> argparse.Namespace:
    """Megatron-LM's parse_args + validate_args on `flags` for `world_size` ranks of `hw`; FlagError carrying
    Megatron's own message when it rejects them (the plugin's ConfigError as it is). (Megatron-Core's
    TransformerConfig checks are not run: they also ask what this machine has installed, TransformerEngine's fused
    kernels among them, which says nothing of the machine simulated.)"""
    from .check import parse_megatron_args
    from .validation import ConfigError

    # A measured profile is named after its base ("dgx-h100 (measured: ...)"); an unknown one is taken as Hopper.
    arch = next((a for name, a in GPU_ARCH.items() if hw.name == name or hw.name.startswith(name + " ")), 9)
    with _quiet() as said, _cluster_transformer_engine():
        try:
            args = parse_megatron_args(list(flags), world_size, gpu_arch=arch, env=LAUNCH_ENV)
        except ConfigError:
            raise
        except SystemExit:  # argparse: unknown flag, bad value; its message is the last "error:" line it printed
            lines = [ln for ln in said.getvalue().splitlines() if "error:" in ln]
            message = lines[-1].split("error:", 1)[1].strip() if lines else "the flags do not parse"
            raise FlagError(f"Megatron-LM rejects the flags: {message}") from None
        except (AssertionError, ValueError, RuntimeError, TypeError, KeyError) as e:
            raise FlagError(f"Megatron-LM rejects the flags: {_megatron_message(e)}") from None
    return args


def _megatron_message(e: BaseException) -> str:
    """Megatron's message with the check that raised it (an `assert`'s condition names the arguments; a check that
    failed before saying anything, a TypeError, its line), and the world size called by our flag's name."""
    text = str(e).strip()
    frame = traceback.extract_tb(e.__traceback__)[-1]
    line = (frame.line or "").strip()
    if line.startswith("assert "):
        condition = line[len("assert "):]
        for cut in (", '", ', "', ", f'", ', f"', ", (", ",\\", ", \\"):
            condition = condition.split(cut)[0]
        where = f"assert {condition.rstrip(', ')}"
    elif isinstance(e, (ValueError, RuntimeError)) and text:
        where = ""
    else:
        where = f"{line} ({frame.filename.rsplit('megatron/', 1)[-1]}:{frame.lineno})"
    message = f"{text} ({where})" if text and where else text or where
    if "world_size" in message or "world size" in message:
        message += " [the world size is --gpus]"
    return message


# ------------------------------------------------------------------------------------------------ refusals

# Flags whose mere presence asks for what the simulator does not model: refused before Megatron parses (whose
# own checks of some of them ask what this machine has installed), naming the flag.
UNMODELLED_FLAGS = {
    "--multi-latent-attention": "multi-latent attention",
    "--mtp-num-layers": "multi-token prediction layers",
    "--hybrid-layer-pattern": "hybrid (Mamba) layers",
    "--hybrid-override-pattern": "hybrid (Mamba) layers",
    "--is-hybrid-model": "hybrid (Mamba) layers",
    "--fp4-format": "FP4 GEMMs",
    "--experimental-attention-variant": "gated delta net / sparse attention",
    "--linear-attention-freq": "linear attention layers",
    "--heterogeneous-layers-config-path": "layers of different shapes",
    "--heterogeneous-layers-config-encoded-json": "layers of different shapes",
    "--moe-latent-size": "latent MoE projections",
    "--window-size": "sliding-window attention",
    "--use-megatron-fsdp": "FSDP (the plugin's --zero-stage 3 is the schedule-placed form)",
    "--use-torch-fsdp2": "FSDP (the plugin's --zero-stage 3 is the schedule-placed form)",
    "--fine-grained-activation-offloading": "activation offloading",
    "--optimizer-cpu-offload": "optimizer offloading",
    "--distribute-saved-activations": "recomputation inputs spread over the tensor-parallel ranks",
    "--moe-layer-recompute": "recomputation of MoE layers alone",
}


def _refusal(flag: str, what: str) -> FlagError:
    return FlagError(f"{flag}: the simulator does not model {what}; drop it to simulate the run without it")


def refuse_unmodelled_flags(given: set[str]) -> None:
    """Before parsing: one FlagError for the first flag of `given` that asks for what the simulator does not model."""
    for flag, what in UNMODELLED_FLAGS.items():
        if flag in given:
            raise _refusal(flag, what)


def _unmodelled_values(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(flag, what) for parsed values outside the cost model (flags that are fine with other values)."""
    a = lambda name, default=None: getattr(args, name, default)  # noqa: E731
    checks = [
        (a("fp8") and a("fp8_recipe") == "custom", "--fp8-recipe custom", "a custom FP8 quantizer"),
        (a("position_embedding_type") == "relative", "--position-embedding-type relative",
         "relative position biases"),
        (a("cpu_offloading_num_layers", 0), "--cpu-offloading-num-layers", "activation offloading"),
        (a("mtp_num_layers"), "--mtp-num-layers", "multi-token prediction layers"),
        (a("multi_latent_attention", False), "--multi-latent-attention", "multi-latent attention"),
        (a("transformer_impl") == "inference_optimized", "--transformer-impl inference_optimized", "inference layers"),
        (a("spec") not in (None, ["local"]), "--spec", "a custom layer spec"),
        (any(str(a(n, "fp32")).removeprefix("torch.") not in ("fp32", "float32")
             for n in ("main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")),
         "--main-grads-dtype / --exp-avg-dtype / --exp-avg-sq-dtype", "optimizer state other than fp32"),
    ]
    if a("recompute_granularity") == "selective":
        modules = set(a("recompute_modules") or ["core_attn"]) - {"core_attn"}
        checks.append((modules, f"--recompute-modules {' '.join(sorted(modules))}",
                       "selective recomputation of modules other than core_attn"))
    return [(flag, what) for on, flag, what in checks if on]


def refuse_unmodelled(args: argparse.Namespace) -> None:
    """After parsing: one FlagError for the first value the simulator does not model, or for training outside
    mixed precision."""
    found = _unmodelled_values(args)
    if found:
        raise _refusal(*found[0])
    if not (getattr(args, "bf16", False) or getattr(args, "fp16", False)):
        raise FlagError("--bf16: the simulator models mixed-precision training (bf16 or fp16 weights and "
                        "activations, fp32 gradients and Adam state); without --bf16 or --fp16 Megatron-LM trains "
                        "in fp32: add --bf16")


# ------------------------------------------------------------------------------------------------ the model

def _vocabulary(args: argparse.Namespace) -> tuple[int, int]:
    """(the tokenizer's vocabulary, Megatron's padding multiple per tensor-parallel rank)."""
    if getattr(args, "padded_vocab_size", None):
        return int(args.padded_vocab_size), 1  # given padded: Megatron pads no further
    divisible = int(args.make_vocab_size_divisible_by) if getattr(args, "pad_vocab_size", True) else 1
    if args.vocab_size:
        return int(args.vocab_size), divisible
    if args.tokenizer_type == "GPT2BPETokenizer":
        return GPT2_BPE_VOCAB, divisible
    raise FlagError(f"--vocab-size: the simulator cannot read the vocabulary of --tokenizer-type {args.tokenizer_type} "
                    "(its tokenizer files): add --vocab-size N, the tokenizer's vocabulary before padding")


def moe_layer_pattern(args: argparse.Namespace) -> tuple[int, ...] | None:
    """1 per MoE layer as Megatron-Core reads --moe-layer-freq (an int k: every k-th layer from the first; a list:
    the pattern itself), or None for a dense model."""
    if not args.num_experts:
        return None
    freq = args.moe_layer_freq
    if isinstance(freq, int):
        return tuple(1 if i % freq == 0 else 0 for i in range(args.num_layers))
    return tuple(int(bool(x)) for x in freq)


def model_profile(args: argparse.Namespace, name: str | None = None) -> ModelProfile:
    """The model Megatron-LM builds from validated `args`."""
    vocab, divisible = _vocabulary(args)
    position = {"learned_absolute": "learned_absolute", "none": "none"}.get(args.position_embedding_type, "rope")
    label = name or f"GPT {args.num_layers}x{args.hidden_size}" + (f", {args.num_experts} experts"
                                                                   if args.num_experts else "")
    return ModelProfile(
        label, args.num_layers, args.hidden_size, args.num_attention_heads,
        seq_length=args.seq_length, vocab_size=vocab, ffn_hidden_size=args.ffn_hidden_size,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        kv_channels=args.kv_channels,
        swiglu=bool(args.swiglu or getattr(args, "quick_geglu", False)),  # gated: fc1 twice as wide
        position_embedding=position,
        untie_embeddings=bool(args.untie_embeddings_and_output_weights),
        make_vocab_size_divisible_by=divisible,
        rms_norm=args.normalization == "RMSNorm",
        add_bias_linear=bool(args.add_bias_linear),
        hidden_dropout=float(args.hidden_dropout), attention_dropout=float(args.attention_dropout),
        num_experts=args.num_experts or None,
        moe_router_topk=int(args.moe_router_topk),
        moe_ffn_hidden_size=args.moe_ffn_hidden_size if args.num_experts else None,
        moe_shared_expert_size=int(args.moe_shared_expert_intermediate_size or 0),
        moe_layer_pattern=moe_layer_pattern(args),
    )


# ------------------------------------------------------------------------------------------------ how it runs

def attention_kernel(args: argparse.Namespace) -> str:
    """"unfused" for Megatron's local attention (--attention-backend local/unfused, --transformer-impl local or
    --spec local), else "flash" (TransformerEngine's fused attention, what auto picks on these GPUs)."""
    backend = getattr(args.attention_backend, "name", str(args.attention_backend))
    if backend in ("local", "unfused") or args.transformer_impl == "local" or getattr(args, "spec", None) == ["local"]:
        return "unfused"
    return "flash"


def layer_settings(args: argparse.Namespace, given: set[str]) -> dict:
    """The Config fields that say how the layers run (everything but the parallel sizes and the schedule)."""
    full = args.recompute_granularity == "full"
    return dict(
        etp=args.expert_tensor_parallel_size if args.num_experts and
        args.expert_tensor_parallel_size != args.tensor_model_parallel_size else None,
        # Read as written: Megatron turns it off at T = 1, where it means nothing.
        sequence_parallel="--sequence-parallel" in given or bool(args.sequence_parallel),
        attention=attention_kernel(args),
        fp8=args.fp8_recipe if args.fp8 else None,
        tp_comm_overlap="--tp-comm-overlap" in given,
        moe_a2a_overlap=bool(getattr(args, "overlap_moe_expert_parallel_comm", False)),
        paired_moe_a2a_overlap=bool(getattr(args, "paired_moe_a2a_overlap", False)),
        # block: the first N layers of each stage; uniform: every layer (groups of N share one kept input).
        recompute_num_layers=args.recompute_num_layers if full and args.recompute_method == "block" else None,
        selective_recompute=args.recompute_granularity == "selective",
        grad_reduce_bf16=bool(getattr(args, "grad_reduce_in_bf16", False)),
    )


def check_dispatcher(args: argparse.Namespace, ep: int) -> None:
    """The token dispatch the simulator models at EP > 1 (all-to-all), and Megatron-Core's own rules for
    --overlap-moe-expert-parallel-comm (TransformerConfig's checks, which `parse_flags` does not run)."""
    if args.num_experts and ep > 1 and args.moe_token_dispatcher_type == "allgather":
        raise FlagError("--moe-token-dispatcher-type allgather (Megatron's default) with --expert-model-parallel-size "
                        f"{ep}: the simulator models the all-to-all dispatch; add --moe-token-dispatcher-type alltoall")
    if getattr(args, "overlap_moe_expert_parallel_comm", False):
        if args.moe_token_dispatcher_type not in ("alltoall", "flex"):
            raise FlagError("--overlap-moe-expert-parallel-comm: Megatron-Core supports it with the alltoall/flex "
                            "token dispatcher; add --moe-token-dispatcher-type alltoall")
        if args.recompute_granularity == "full":
            raise FlagError("--overlap-moe-expert-parallel-comm with --recompute-granularity full: Megatron-Core "
                            "refuses it (disable full recomputation when enabling overlap_moe_expert_parallel_comm)")


def data_parallel_settings(args: argparse.Namespace) -> tuple[int, bool, bool]:
    """(ZeRO stage, communication overlapped, optimizer outside the schedule): the plugin's --zero-stage, or
    Megatron's DDP / distributed optimizer (ZeRO-0 / ZeRO-1) as its flags say."""
    if args.zero_stage is not None:
        return int(args.zero_stage), True, False
    return (1 if args.use_distributed_optimizer else 0), bool(args.overlap_grad_reduce), True


def run_config(args: argparse.Namespace, given: set[str]) -> Config:
    """The configuration of validated `args` (one data-parallel rank's micro-batches from the global batch)."""
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    vp = args.virtual_pipeline_model_parallel_size or 1
    dp, b, gbs = args.data_parallel_size, args.micro_batch_size, args.global_batch_size
    if gbs % (b * dp):
        raise FlagError(f"--global-batch-size {gbs} is not a multiple of --micro-batch-size {b} x data-parallel size "
                        f"{dp} (N / (T x P x CP)): Megatron-LM's micro-batch calculator refuses it")
    check_dispatcher(args, args.expert_model_parallel_size)
    zero, dp_overlap, stock_optimizer = data_parallel_settings(args)
    schedule = args.pipeline_schedule if args.pipeline_schedule != "default" else megatron_kind(vp)
    full = args.recompute_granularity == "full"
    return Config(
        tp, pp, vp, dp, b, gbs // (b * dp), schedule, zero, full, args.microbatch_group_size_per_vp_stage,
        dp_overlap=dp_overlap, p2p_overlap="--no-overlap-p2p-communication" not in given,
        weight_buffers=args.bfpp_weight_buffers or 2, grad_buffers=args.bfpp_grad_buffers or 2,
        split=StageSplit.from_args(args),
        param_gather_with_optimizer=bool(args.overlap_param_gather_with_optimizer_step),
        stock_optimizer=stock_optimizer, cp=cp, ep=args.expert_model_parallel_size,
        **layer_settings(args, given),
    )


def read_run(flags: Sequence[str], gpus: int, hw: Hardware, name: str | None = None) -> tuple[ModelProfile, Config]:
    """The model and configuration of `pretrain_gpt.py flags` launched on `gpus` GPUs of `hw` (Megatron's errors,
    the plugin's and the simulator's refusals as one ValueError naming the flag)."""
    from .validation import validate_args

    refuse_unmodelled_flags(given_flags(flags))
    args = parse_flags(flags, gpus, hw)
    refuse_unmodelled(args)
    validate_args(args, simulated=True)  # the plugin's checks: --zero-stage with Megatron's optimizer flags, ...
    return model_profile(args, name), run_config(args, given_flags(flags))


# ------------------------------------------------------------------------------------------------ the way back

def launch_flags(cfg: Config, model: ModelProfile) -> list[str]:
    """The `pretrain_gpt.py` flags that launch `cfg`'s layout, schedule, data parallelism and recomputation (to add
    to the model's and features' flags): what `bfpp plan` searched, written as Megatron-LM and the plugin read it."""
    if cfg.output_layer_over_pipeline:
        raise ValueError("the output layer spread over the pipeline ranks is a what-if of the simulator: no "
                         "pretrain_gpt.py flag runs it; plan without --what-if output-layer-over-pipeline")
    out = ["--tensor-model-parallel-size", str(cfg.tp), "--pipeline-model-parallel-size", str(cfg.pp)]
    split = cfg.split
    for flag, count in (("--decoder-first-pipeline-num-layers", split.first_pipeline_num_layers),
                        ("--decoder-last-pipeline-num-layers", split.last_pipeline_num_layers)):
        if count is not None:
            out += [flag, str(count)]
    out += [flag for flag, on in (("--account-for-embedding-in-pipeline-split", split.account_for_embedding),
                                  ("--account-for-loss-in-pipeline-split", split.account_for_loss)) if on]
    if split.layout is not None:  # it sets V itself
        out += ["--pipeline-model-parallel-layout", layout_string(split.layout)]
    elif cfg.vp > 1:
        if split.first_pipeline_num_layers is not None or split.last_pipeline_num_layers is not None:
            out += ["--num-virtual-stages-per-pipeline-rank", str(cfg.vp)]
        else:
            units = model.num_layers + split.account_for_embedding + split.account_for_loss
            out += ["--num-layers-per-virtual-pipeline-stage", str(units // (cfg.pp * cfg.vp))]
    for flag, value in (("--context-parallel-size", cfg.cp), ("--expert-model-parallel-size", cfg.ep)):
        if value > 1:
            out += [flag, str(value)]
    out += ["--micro-batch-size", str(cfg.micro_batch_size), "--global-batch-size", str(cfg.global_batch_size)]
    stock_order = cfg.schedule == megatron_kind(cfg.vp)
    if cfg.stock_optimizer or cfg.zero_stage == 0:  # Megatron's DDP / distributed optimizer
        if not (stock_order and cfg.stock_optimizer):
            out += ["--pipeline-schedule", cfg.schedule]
        if cfg.zero_stage == 1:
            out.append("--use-distributed-optimizer")
        if cfg.dp_overlap:
            out += ["--overlap-grad-reduce"] + (["--overlap-param-gather"] if cfg.zero_stage == 1 else [])
        if cfg.param_gather_with_optimizer:  # Megatron refuses it with distributed checkpoints
            out += ["--overlap-param-gather-with-optimizer-step", "--ckpt-format", "torch"]
    else:
        out += ["--pipeline-schedule", cfg.schedule, "--zero-stage", str(cfg.zero_stage)]
        if cfg.zero_stage == 3 and cfg.weight_buffers != 2:
            out += ["--bfpp-weight-buffers", str(cfg.weight_buffers)]
        if cfg.zero_stage >= 2 and cfg.grad_buffers != 2:
            out += ["--bfpp-grad-buffers", str(cfg.grad_buffers)]
    if cfg.group_size is not None:
        out += ["--microbatch-group-size-per-virtual-pipeline-stage", str(cfg.group_size)]
    if cfg.recompute:
        out += ["--recompute-granularity", "full"] + (
            ["--recompute-method", "block", "--recompute-num-layers", str(cfg.recompute_num_layers)]
            if cfg.recompute_num_layers is not None else ["--recompute-method", "uniform", "--recompute-num-layers", "1"])
    elif cfg.selective_recompute:
        out += ["--recompute-granularity", "selective"]
    return out
