"""Trainer arguments: Megatron-LM's parser and validation, plus the plugin's and the trainer's flags.

Every configuration is checked here, before any process group exists; each problem is one
`TrainerConfigError` whose message names the flags and the fix.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys

from ..errors import TrainerConfigError
from ..megatron.flags import DEFAULT_BUFFERS
from ..megatron.validation import megatron_flag_text
from ..schedule import SCHEDULE_NAMES, ScheduleError, ScheduleSpec
from ..schedule.kinds import schedule_kind

SUPPORTED_MEGATRON_CORE = ((0, 19),)
DEFAULT_MOCK_VOCAB = 1024
TEXT_VOCAB = 257  # byte-level tokens + end-of-document, as scripts/text_to_megatron.py writes them


def _iteration_list(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated iteration numbers, got {text!r}") from None


def _escape_bare_percent_in_help(parser: argparse.ArgumentParser) -> None:
    """Some Megatron help texts carry a bare '%' that makes argparse's --help raise; print them literally."""
    for action in parser._actions:
        if action.help and "%" in action.help:
            try:
                action.help % {k: "" for k in ("default", "prog", "type", "choices", "dest", "metavar")}
            except (ValueError, TypeError, KeyError):
                action.help = action.help.replace("%", "%%")


def trainer_args_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The plugin's flags (as in the Megatron-LM integration) with trainer defaults, plus trainer-only flags."""
    from ..megatron.flags import add_arguments

    add_arguments(parser)
    _escape_bare_percent_in_help(parser)
    # The trainer always runs our runtime (no stock schedule to fall back to) and our sharded optimizer.
    parser._option_string_actions["--pipeline-schedule"].choices = SCHEDULE_NAMES
    parser.set_defaults(pipeline_schedule="breadth-first", zero_stage=1)
    g = parser.add_argument_group(title="megatron_bfpp trainer")
    g.add_argument("--report-json", metavar="PATH", default=None,
                   help="write losses, iteration times, throughput, communication and memory per rank, measured "
                        "bubble and the simulator's prediction to PATH")
    g.add_argument("--timeline-iterations", type=_iteration_list, default=[],
                   help="iterations recorded by --timeline (comma-separated; default: the last)")
    g.add_argument("--distributed-timeout-seconds", type=float, default=None,
                   help="overrides --distributed-timeout-minutes with a seconds-level bound (tests, debugging)")
    return parser


def _megatron_core_version() -> tuple[int, int]:
    import megatron.core

    version = getattr(megatron.core, "__version__", "0.0")
    major, minor = (int(x) for x in version.split(".")[:2])
    return major, minor


def check_version() -> None:
    v = _megatron_core_version()
    if v not in SUPPORTED_MEGATRON_CORE:
        supported = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED_MEGATRON_CORE)
        raise TrainerConfigError(
            f"megatron-core {v[0]}.{v[1]} is not supported (supported: {supported}): "
            "pip install 'megatron-core==0.19.2' (see requirements.txt)"
        )


def _stage_shape(a: argparse.Namespace, pp: int) -> int:
    """V from Megatron's virtual-stage flags, checked (with the layers per stage) by the model builder's rules."""
    from .model import layers_per_stage, vp_size_from_layers_per_virtual_stage

    try:
        vp = a.num_virtual_stages_per_pipeline_rank or vp_size_from_layers_per_virtual_stage(
            a.num_layers, pp, a.num_layers_per_virtual_pipeline_stage)
        layers_per_stage(a.num_layers, pp, vp)
    except ValueError as e:
        raise TrainerConfigError(str(e)) from None
    return vp


def check_trainer_args(a: argparse.Namespace, world_size: int) -> None:
    """All checks that need no process group. Sets a.virtual_pipeline_model_parallel_size and a.schedule_spec
    (the schedule the flags name, which the trainer runs) on success."""
    check_version()
    pp, tp = a.pipeline_model_parallel_size, a.tensor_model_parallel_size
    if pp < 1 or tp < 1:
        raise TrainerConfigError("--pipeline-model-parallel-size and --tensor-model-parallel-size must be >= 1")
    if getattr(a, "context_parallel_size", 1) != 1:
        raise TrainerConfigError("--context-parallel-size > 1 is not supported by the trainer: use 1")
    if world_size % (pp * tp):
        raise TrainerConfigError(
            f"world size {world_size} (--nproc-per-node x nodes) must be a multiple of "
            f"--pipeline-model-parallel-size {pp} x --tensor-model-parallel-size {tp}"
        )
    dp = world_size // (pp * tp)
    for flag, value in (("--num-layers", a.num_layers), ("--hidden-size", a.hidden_size),
                        ("--num-attention-heads", a.num_attention_heads), ("--seq-length", a.seq_length),
                        ("--micro-batch-size", a.micro_batch_size), ("--train-iters", a.train_iters)):
        if value is None or value < 1:
            raise TrainerConfigError(f"{flag} must be set to a positive integer (got {value})")
    if a.hidden_size % a.num_attention_heads:
        raise TrainerConfigError(f"--hidden-size {a.hidden_size} must be divisible by --num-attention-heads "
                                 f"{a.num_attention_heads}")
    if a.num_attention_heads % tp:
        raise TrainerConfigError(f"--num-attention-heads {a.num_attention_heads} must be divisible by "
                                 f"--tensor-model-parallel-size {tp}")
    if tp != 1:
        raise TrainerConfigError("--tensor-model-parallel-size > 1 is not supported by the trainer yet: use 1 "
                                 "(run tensor parallelism through Megatron-LM with megatron_bfpp.megatron)")
    if a.group_query_attention and (a.num_query_groups < 1 or a.num_attention_heads % a.num_query_groups):
        raise TrainerConfigError(f"--num-query-groups {a.num_query_groups} must divide --num-attention-heads "
                                 f"{a.num_attention_heads}")
    if a.max_position_embeddings is not None and a.seq_length > a.max_position_embeddings:
        raise TrainerConfigError(f"--seq-length {a.seq_length} exceeds --max-position-embeddings "
                                 f"{a.max_position_embeddings}: raise the latter")
    vp = _stage_shape(a, pp)
    gbs = a.global_batch_size or a.micro_batch_size * dp
    if gbs % (a.micro_batch_size * dp):
        raise TrainerConfigError(
            f"--global-batch-size {gbs} must be a multiple of --micro-batch-size {a.micro_batch_size} x "
            f"data-parallel size {dp} (world {world_size} / P {pp} / T {tp})"
        )
    m = gbs // (a.micro_batch_size * dp)
    a.schedule_note = None
    if a.pipeline_schedule == "breadth-first" and vp == 1 and (a.microbatch_group_size_per_vp_stage or m) >= m:
        # Breadth-first with one stage per rank runs every forward, then every backward: that is GPipe.
        a.pipeline_schedule = "gpipe"
        a.microbatch_group_size_per_vp_stage = None
        a.schedule_note = ("--pipeline-schedule breadth-first with one stage per rank (V = 1, no "
                           "--num-layers-per-virtual-pipeline-stage) is GPipe: running gpipe")
    try:
        takes_group = schedule_kind(a.pipeline_schedule).takes_group_size
        a.schedule_spec = ScheduleSpec(
            a.pipeline_schedule, pp, vp, m, a.microbatch_group_size_per_vp_stage if takes_group else None,
            zero_stage=a.zero_stage, weight_buffers=a.bfpp_weight_buffers or DEFAULT_BUFFERS,
            grad_buffers=a.bfpp_grad_buffers or DEFAULT_BUFFERS)
        a.schedule_spec.order()
    except ScheduleError as e:
        raise TrainerConfigError(f"{megatron_flag_text(str(e))} (M = {m} micro-batches per step = "
                                 f"--global-batch-size / (--micro-batch-size x data-parallel size))") from None
    if a.fp16 and a.bf16:
        raise TrainerConfigError("--fp16 and --bf16 are exclusive: choose one")
    if a.fp16 and a.loss_scale is not None and a.loss_scale <= 1.0:
        raise TrainerConfigError("--fp16 needs loss scaling: drop --loss-scale (dynamic scaling) or set it > 1")
    if a.use_distributed_optimizer:
        raise TrainerConfigError("--use-distributed-optimizer: the trainer's --zero-stage 1 is the sharded "
                                 "(distributed) optimizer already: drop the flag")
    if a.bfpp_weight_buffers is not None and a.zero_stage != 3:
        raise TrainerConfigError("--bfpp-weight-buffers applies to --zero-stage 3 only: drop it or use --zero-stage 3")
    if a.bfpp_grad_buffers is not None and a.zero_stage not in (2, 3):
        raise TrainerConfigError("--bfpp-grad-buffers applies to --zero-stage 2 and 3 only")
    if a.data_path:
        for prefix in (p for p in a.data_path if not _is_number(p)):
            for ext in (".bin", ".idx"):
                if not os.path.exists(prefix + ext):
                    raise TrainerConfigError(
                        f"--data-path {prefix}: {prefix + ext} does not exist; build it with "
                        f"scripts/text_to_megatron.py INPUT.txt {prefix}, or use --mock-data"
                    )
    for it in a.timeline_iterations:
        if not 1 <= it <= a.train_iters:
            raise TrainerConfigError(f"--timeline-iterations {it} outside [1, --train-iters {a.train_iters}]")
    if a.timeline_iterations and not a.timeline:
        raise TrainerConfigError("--timeline-iterations needs --timeline PATH")
    _check_fault_handling_args(a)
    a.virtual_pipeline_model_parallel_size = vp if vp > 1 else None
    a.global_batch_size = gbs


def _check_fault_handling_args(a: argparse.Namespace) -> None:
    """Checkpoint, timeout and fault-injection settings (megatron_bfpp.train.checkpoint, megatron_bfpp.train.faults)."""
    from .checkpoint import CheckpointError, check_load_args
    from .faults import ENV, parse_fault_spec

    for flag, value in (("--distributed-timeout-minutes", a.distributed_timeout_minutes),
                        ("--distributed-timeout-seconds", a.distributed_timeout_seconds)):
        if value is not None and value <= 0:
            raise TrainerConfigError(f"{flag} must be > 0 (got {value}): every wait is bounded by it")
    if a.save_interval is not None and not a.save:
        raise TrainerConfigError("--save-interval needs --save DIR (where to write the checkpoints)")
    for flag, value in (("--save-interval", a.save_interval), ("--exit-interval", a.exit_interval)):
        if value is not None and value < 1:
            raise TrainerConfigError(f"{flag} must be >= 1 iteration (got {value})")
    if (a.save or a.load) and a.ckpt_format != "torch_dist":
        raise TrainerConfigError(f"--ckpt-format {a.ckpt_format} is not supported by the trainer: use torch_dist "
                                 "(reshardable; loads at another D, P, V or ZeRO stage)")
    if a.async_save:
        raise TrainerConfigError("--async-save is not supported by the trainer: drop it (saves are synchronous)")
    if a.recompute_granularity is not None:
        from .model import megatron_recompute_available

        if not megatron_recompute_available():
            raise TrainerConfigError(f"--recompute-granularity {a.recompute_granularity} needs CUDA here (Megatron's "
                                     "activation checkpointing saves the CUDA RNG state): drop the flag on CPU")
    try:
        check_load_args(a)
    except CheckpointError as e:
        raise TrainerConfigError(str(e)) from None
    spec = os.environ.get(ENV, "").strip()
    if spec:
        try:
            parse_fault_spec(spec)
        except ValueError as e:
            raise TrainerConfigError(str(e)) from None


def _check_checkpoint_shape(a: argparse.Namespace) -> None:
    """--load: the checkpoint's model shape must be this run's (read from its common state, no process group)."""
    from .checkpoint import CheckpointError, check_model_shape, read_saved_shape, resolve_load_dir

    found = resolve_load_dir(a.load, a.ckpt_step) if os.path.isdir(a.load) else None
    if found is None:
        return
    try:
        check_model_shape(read_saved_shape(found[1]), a, a.load)
    except CheckpointError as e:
        raise TrainerConfigError(str(e)) from None


def _is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def _log_on_rank_0(msg: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(msg, flush=True)


def parse_trainer_args(argv: list[str], world_size: int | None = None, log=_log_on_rank_0) -> argparse.Namespace:
    """Parse with Megatron-LM's parser, check (no process group needed), then run Megatron's validate_args.

    `log(msg)` receives the notes about what was resolved (default: printed by rank 0; None: silent)."""
    from megatron.training.arguments import parse_args, validate_args

    world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    saved = sys.argv
    try:
        sys.argv = ["megatron_bfpp.train", *argv]
        args = parse_args(extra_args_provider=trainer_args_provider)
    finally:
        sys.argv = saved
    if args.tokenizer_type is None:
        args.tokenizer_type = "NullTokenizer"
    if not args.data_path:
        args.mock_data = True
    if args.vocab_size is None:
        args.vocab_size = DEFAULT_MOCK_VOCAB if not args.data_path else TEXT_VOCAB  # scripts/text_to_megatron.py
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    args.transformer_impl = "local"
    check_trainer_args(args, world_size)
    args.world_size = world_size  # Megatron's parse_args read WORLD_SIZE from the environment (default 1)
    os.environ.setdefault("WORLD_SIZE", str(world_size))
    os.environ.setdefault("RANK", "0")
    # Megatron's own interleaved schedule needs P > 1 (validate_args asserts it); ours also loops V chunks on
    # one rank (P = 1), so Megatron checks that case without the virtual-stage flags.
    vp = args.virtual_pipeline_model_parallel_size
    looped_single_rank = args.pipeline_model_parallel_size == 1 and (vp or 1) > 1
    hidden = {k: getattr(args, k) for k in ("num_layers_per_virtual_pipeline_stage",
                                            "num_virtual_stages_per_pipeline_rank")} if looped_single_rank else {}
    for k in hidden:
        setattr(args, k, None)
    quiet = io.StringIO()
    try:
        with contextlib.redirect_stdout(quiet):  # Megatron prints every argument
            validate_args(args)
    except AssertionError as e:
        raise TrainerConfigError(f"Megatron-LM rejected the arguments: {e}") from None
    for k, v in hidden.items():
        setattr(args, k, v)
    if looped_single_rank:
        args.virtual_pipeline_model_parallel_size = vp
    divisible = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    args.padded_vocab_size = -(-args.vocab_size // divisible) * divisible
    if args.load:
        _check_checkpoint_shape(args)
    args.virtual_pipeline_model_parallel_size = (args.virtual_pipeline_model_parallel_size
                                                 if (args.virtual_pipeline_model_parallel_size or 1) > 1 else None)
    if args.schedule_note and log is not None:
        log(args.schedule_note)
    return args
