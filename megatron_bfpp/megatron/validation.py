"""Check a parsed Megatron-LM argument namespace against the plugin's flags, before any process group exists.

Every rejection is one `ConfigError` whose message names the offending flags (Megatron's spelling) and the fix.
Schedule-shape rules are not restated here: the schedule builders own them, and their messages are translated
to Megatron flag names.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import re
from dataclasses import dataclass

from megatron_bfpp.schedule import ScheduleError, ScheduleSpec
from megatron_bfpp.schedule.kinds import SPLIT_BACKWARD_SCHEDULES, megatron_kind, schedule_kind
from megatron_bfpp.schedule.pairs import PAIRED_NOT_RUN

from .flags import DEFAULT_BUFFERS, PIPELINE_SCHEDULES
from .layout import layout_problem, layout_stage_count_problem


class ConfigError(ValueError):
    """A bad combination of Megatron-LM and megatron_bfpp flags; the message says which flags and the fix."""


# What `bfpp check` prints of a PluginConfig (its repr), in this order.
_REPORTED = ("pipeline_schedule", "zero_stage", "weight_buffers", "grad_buffers", "timeline", "pp", "vp",
             "microbatch_group_size", "train_microbatches", "eval_microbatches")


@dataclass(frozen=True, repr=False)
class PluginConfig:
    """What `install()` needs, resolved from the arguments."""

    pipeline_schedule: str  # one of PIPELINE_SCHEDULES
    # The schedule the flags name, with the largest training M (each call of the runtime sets its own M); under
    # "default" Megatron's own order for V, which Megatron runs itself.
    schedule: ScheduleSpec
    timeline: str | None
    train_microbatches: tuple[int, ...]  # every M the training loop can run with (batch-size schedules)
    eval_microbatches: int | None

    def __repr__(self) -> str:
        return f"PluginConfig({', '.join(f'{k}={getattr(self, k)!r}' for k in _REPORTED)})"

    @property
    def zero_stage(self) -> int | None:
        return self.schedule.zero_stage

    @property
    def weight_buffers(self) -> int:
        return self.schedule.weight_buffers

    @property
    def grad_buffers(self) -> int:
        return self.schedule.grad_buffers

    @property
    def pp(self) -> int:
        """P: pipeline-parallel size."""
        return self.schedule.pp

    @property
    def vp(self) -> int:
        """V: stages per pipeline rank (1 without virtual stages)."""
        return self.schedule.vp

    @property
    def microbatch_group_size(self) -> int | None:
        """G; None: the schedule's default (P interleaved, M breadth-first)."""
        return self.schedule.group_size

    @property
    def uses_runtime(self) -> bool:
        """Whether the plugin's schedule runtime replaces Megatron's forward_backward function."""
        return self.pipeline_schedule != "default"

    @property
    def shards_model_state(self) -> bool:
        """--zero-stage 1/2/3: the plugin's data-parallel wrapper and sharded optimizer replace Megatron's."""
        return self.zero_stage is not None


# ScheduleError texts use the `bfpp schedule` flags; say the same in Megatron's. Order matters (longest first).
_FLAG_NAMES = [
    ("--schedule (--pipeline-schedule)", "--pipeline-schedule"),
    ("--group-size (--microbatch-group-size-per-virtual-pipeline-stage)",
     "--microbatch-group-size-per-virtual-pipeline-stage"),
    ("--group-size", "--microbatch-group-size-per-virtual-pipeline-stage"),
    ("set --vp (or --num-layers-per-virtual-pipeline-stage)",
     "set --num-layers-per-virtual-pipeline-stage (or --num-virtual-stages-per-pipeline-rank)"),
    ("--vp", "--num-virtual-stages-per-pipeline-rank"),
    ("--pp (--pipeline-model-parallel-size)", "--pipeline-model-parallel-size"),
    ("--weight-buffers", "--bfpp-weight-buffers"),
    ("--grad-buffers", "--bfpp-grad-buffers"),
    ("--microbatches", "the micro-batch count (--global-batch-size / (--micro-batch-size x data-parallel size))"),
    ("raise the global batch size or lower the micro-batch size", "raise --global-batch-size or lower --micro-batch-size"),
    ("or use gpipe for V = 1", "or use --pipeline-schedule 1f1b for V = 1"),
    ("or use 1f1b for V = 1", "or use --pipeline-schedule 1f1b for V = 1"),
    ("or use breadth-first", "or use --pipeline-schedule breadth-first"),
    ("use interleaved-1f1b or breadth-first", "use --pipeline-schedule interleaved-1f1b or breadth-first"),
]


def megatron_flag_text(message: str) -> str:
    """Rewrite a ScheduleError message with Megatron-LM's flag names."""
    for old, new in _FLAG_NAMES:
        message = re.sub(r"(?<![\w-])" + re.escape(old) + r"(?![\w-])", new, message)
    return message


def _dp_size(args: argparse.Namespace) -> int:
    # Megatron 0.19 counts the GTP weight-remat axis outside data_parallel_size; each of its peers takes a
    # distinct micro-batch (see its num-microbatches calculator).
    return int(args.data_parallel_size) * int(getattr(args, "gtp_weight_remat_size", 1) or 1)


def _megatron_ramps_up() -> bool:
    """Whether this megatron-core runs a batch-size ramp-up from --rampup-batch-size. Up to 0.16 its
    num-microbatches calculator builder takes `rampup_batch_size` and builds a ramp-up calculator; from 0.19
    the flag is deprecated and ignored (megatron/core/num_microbatches_calculator.py: the builder has no such
    parameter, and Megatron-LM's global_vars no longer passes it), so every step runs --global-batch-size.
    Without megatron-core, count the ramp-up's sizes too (a refusal there is at worst too strict)."""
    try:
        from megatron.core import num_microbatches_calculator as calculators
    except ImportError:
        return True
    builder = getattr(calculators, "_build_num_microbatches_calculator", None)
    return builder is None or "rampup_batch_size" in inspect.signature(builder).parameters


def _global_batch_sizes(args: argparse.Namespace) -> list[int]:
    """Every global batch size training can use: the target plus batch-size ramp-up / step schedule entries."""
    steps = getattr(args, "step_batch_size_schedule", None)  # 0.19: "THRESHOLD:BS THRESHOLD:BS ..."
    if steps:  # Megatron then leaves --global-batch-size at a placeholder: the schedule has every size
        return sorted({int(item.split(":")[1]) for item in str(steps).split()})
    sizes = [int(args.global_batch_size)]
    rampup = getattr(args, "rampup_batch_size", None)  # 0.16: [start, increment, samples]
    if rampup and _megatron_ramps_up():
        start, increment = int(rampup[0]), int(rampup[1])
        sizes += list(range(start, int(args.global_batch_size), max(increment, 1)))
    return sorted(set(sizes))


def _microbatch_counts(args: argparse.Namespace) -> tuple[tuple[int, ...], int | None]:
    per_step = int(args.micro_batch_size) * _dp_size(args)
    train = tuple(sorted({max(gbs // per_step, 1) for gbs in _global_batch_sizes(args)}))
    eval_gbs = getattr(args, "eval_global_batch_size", None)
    eval_mbs = getattr(args, "eval_micro_batch_size", None)
    evals = None
    if eval_gbs and eval_mbs:
        evals = max(int(eval_gbs) // (int(eval_mbs) * _dp_size(args)), 1)
    return train, evals


def _check_schedule(cfg: PluginConfig, args: argparse.Namespace) -> None:
    """Build (and lower) the schedule for every micro-batch count the run can see; translate the errors."""

    def where(m: int, what: str) -> str:
        return (
            f" [{what}: P={cfg.pp} pipeline stages (--pipeline-model-parallel-size), V={cfg.vp} virtual stages per "
            f"rank, M={m} micro-batches = global batch / (--micro-batch-size {args.micro_batch_size} x "
            f"data-parallel size {_dp_size(args)})]"
        )

    runs = [(m, False, "training") for m in cfg.train_microbatches]
    if cfg.eval_microbatches is not None:
        runs.append((cfg.eval_microbatches, True, "evaluation, --eval-global-batch-size"))
    for m, forward_only, what in runs:
        spec = dataclasses.replace(cfg.schedule, microbatches=m, forward_only=forward_only)
        try:
            order = spec.order()
            if spec.zero_stage is not None and not forward_only:
                spec.lower(order)
        except ScheduleError as e:
            raise ConfigError(megatron_flag_text(str(e)) + where(m, what)) from None


def _flag(args: argparse.Namespace, name: str, default=None):
    return getattr(args, name, default)


def _per_layer_graphs(args: argparse.Namespace) -> str | None:
    """The flag that turns on per-layer CUDA graphs (as the user spelled it), or None."""
    graphs = _flag(args, "cuda_graph_impl", "none")
    for name, flag, impl in (("enable_cuda_graph", "--enable-cuda-graph", "local"),
                             ("external_cuda_graph", "--external-cuda-graph", "transformer_engine")):
        if _flag(args, name, False):  # 0.16 keeps the deprecated flags; 0.19 maps them to --cuda-graph-impl
            return flag if graphs in (None, "none") or graphs == impl else None
    return None if graphs in (None, "none", "full_iteration") else f"--cuda-graph-impl {graphs}"


def _megatron_graph_capture_order(pp: int, rank: int, vp: int, microbatches: int, group: int) -> list[str]:
    """The order in which Megatron-LM captures the TransformerEngine per-layer graphs of pipeline rank `rank`, as
    `F<chunk>:<micro-batch>` / `B<chunk>:<micro-batch>` (local chunk index). Computed with Megatron's own code, as
    `TECudaGraphHelper._get_cuda_graph_input_data` (megatron/core/transformer/cuda_graphs.py) does:
    `get_pp_rank_microbatches` (warm-up count), `get_schedule_table` and `convert_schedule_table_to_order`
    (+c: forward of chunk c - 1, -c: backward of chunk c - 1). The k-th forward (backward) of a chunk is its
    graph for micro-batch k. At P = 1 Megatron captures one micro-batch and replays that graph for every
    micro-batch (`current_microbatch % len(cuda_graphs)`, megatron/core/transformer/module.py), which is the
    same order repeated: F, B per micro-batch."""
    from types import SimpleNamespace

    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches, get_schedule_table
    from megatron.core.transformer.cuda_graphs import convert_schedule_table_to_order

    # What get_pp_rank_microbatches reads from its P2PCommunicator: the pipeline group's size and rank, and
    # the config's virtual size (None without virtual stages: the non-interleaved 1F1B warm-up).
    comm = SimpleNamespace(pp_group=SimpleNamespace(size=lambda: pp, rank=lambda: rank),
                           virtual_pipeline_model_parallel_size=vp if vp > 1 else None)
    _, _, warmup, _ = get_pp_rank_microbatches(microbatches, vp, group, forward_only=False, p2p_communicator=comm)
    order = convert_schedule_table_to_order(warmup, vp, get_schedule_table(microbatches, vp, group))
    seen: dict[int, int] = {}
    steps = []
    for c_id in order:
        seen[c_id] = seen.get(c_id, 0) + 1
        steps.append(f"{'F' if c_id > 0 else 'B'}{abs(c_id) - 1}:{seen[c_id] - 1}")
    return steps


def _check_transformer_engine_graph_order(cfg: PluginConfig, args: argparse.Namespace, graph_flag: str) -> None:
    """TransformerEngine's per-layer graphs are captured in Megatron's schedule order (training.py builds the
    TECudaGraphHelper whatever the forward_backward function is) into one memory pool, and since TE 2.7 with
    graph input/output buffers reused along that order (`make_graphed_callables(_order=...,
    _reuse_graph_input_output_buffers=True)`, transformer_engine/pytorch/graph.py `_make_graphed_callables`).
    A replay in another order overwrites buffers a later backward still reads: allowed only where the plugin's
    per-rank order of F and B equals Megatron's."""
    group = int(_flag(args, "microbatch_group_size_per_vp_stage") or cfg.pp)
    for m in cfg.train_microbatches:
        sched = dataclasses.replace(cfg.schedule, microbatches=m).order()
        for rank in range(cfg.pp):
            ours = [f"{a.op.value}{a.stage // cfg.pp}:{a.microbatch}" for a in sched.compute_actions(rank)]
            theirs = _megatron_graph_capture_order(cfg.pp, rank, cfg.vp, m, group)
            if ours == theirs:
                continue
            k = next((i for i, (x, y) in enumerate(zip(ours, theirs)) if x != y), min(len(ours), len(theirs)))
            same = megatron_kind(cfg.vp)
            raise ConfigError(
                f"{graph_flag} (TransformerEngine per-layer CUDA graphs) with --pipeline-schedule "
                f"{cfg.pipeline_schedule}: Megatron captures the graphs in its own schedule's order into one memory "
                f"pool and TransformerEngine requires them to be replayed in that order, but on pipeline rank {rank} "
                f"(P={cfg.pp}, V={cfg.vp}, M={m}) compute step {k + 1} runs {_step(ours, k)} where Megatron "
                f"captured {_step(theirs, k)} (F/B<chunk>:<micro-batch>); drop {graph_flag.split()[0]} (use "
                f"--cuda-graph-impl none), or use --pipeline-schedule {same} (Megatron's order) or default"
            )


def _step(steps: list[str], k: int) -> str:
    return steps[k] if k < len(steps) else "nothing"


def _check_zero_stage_readers(args: argparse.Namespace, zero: int) -> None:
    """Megatron-LM features that read or write parameters, `main_grad` or `.grad` outside the schedule, where
    --zero-stage frees or shards that storage between uses (ZeRO-2: full gradients; ZeRO-3: weights too)."""
    graph_flag = _per_layer_graphs(args)
    if zero in (2, 3) and graph_flag is not None:
        what = "parameters and full gradients" if zero == 3 else "full gradients (main_grad)"
        raise ConfigError(
            f"{graph_flag} (per-layer CUDA graphs) with --zero-stage {zero}: the graphs capture fixed tensor "
            f"addresses, and --zero-stage {zero} frees and reallocates the {what} between uses; drop "
            f"{graph_flag.split()[0]} (use --cuda-graph-impl none) or use --zero-stage 1"
        )
    if _flag(args, "save_wgrads_interval") is not None:
        raise ConfigError(
            f"--save-wgrads-interval with --zero-stage {zero}: it saves every parameter's main_grad after a forced "
            f"all-reduce, and --zero-stage reduce-scatters gradients into shards (each rank holds only its part); "
            "drop --save-wgrads-interval or drop --zero-stage"
        )
    if zero == 3 and _flag(args, "save_params_interval") is not None:
        raise ConfigError(
            "--save-params-interval with --zero-stage 3: it saves param.data outside the schedule, where "
            "--zero-stage 3 keeps only this rank's shard; drop --save-params-interval, save a checkpoint "
            "(--save/--save-interval, written with gathered weights), or use --zero-stage 2"
        )
    if _flag(args, "qk_clip", False):
        raise ConfigError(
            f"--qk-clip with --zero-stage {zero}: it rescales the attention weights in place after the optimizer "
            "step, bypassing the sharded optimizer's fp32 master weights (and, at stage 3, the weights are "
            "sharded); drop --qk-clip or drop --zero-stage"
        )
    optimizer = _flag(args, "optimizer", "adam")
    if optimizer not in (None, "adam"):
        raise ConfigError(
            f"--optimizer {optimizer} with --zero-stage {zero}: the sharded optimizer is Adam/AdamW only; use "
            "--optimizer adam or drop --zero-stage"
        )


def _check_queued_weight_gradients(cfg: PluginConfig, args: argparse.Namespace) -> None:
    """Megatron-LM features that run TransformerEngine's queued weight-gradient GEMMs themselves, where the plugin's
    schedule runs every queued GEMM of a TransformerEngine layer itself: its W (split-backward schedules), or
    right after a B, calls `backward_dw()` on each layer whose weight gradients are queued
    (`runtime/split_backward.py` `run_delayed_wgrads`), and TransformerEngine's `WeightGradStore.pop`
    (module/_common.py) raises "Pop empty queue" when that layer's queue is empty. (The refusal that depends on the
    installed TransformerEngine, --use-transformer-engine-op-fuser, is install.check_transformer_engine_flags.)"""
    schedule = cfg.pipeline_schedule
    if _flag(args, "overlap_dispatch_backward_with_experts_wgrad", False):
        # Megatron queues the experts' weight GEMMs for this flag alone (TEGroupedLinear.__init__:
        # `delay_wgrad_compute = config.delay_wgrad_compute or config.overlap_dispatch_backward_with_experts_wgrad`,
        # megatron/core/extensions/transformer_engine.py) and runs them inside the backward's autograd pass:
        # MoELayer.dispatch wraps its input in _RegisterDelayedWgradForExperts, whose backward calls
        # `module.backward_dw(routed_experts=True, ...)` (megatron/core/transformer/moe/moe_layer.py). The plugin's
        # W, or the backward_dw after a B, pops the same queue again. Megatron's own TransformerConfig.__post_init__
        # check (megatron/core/transformer/transformer_config.py: "delay_wgrad_compute and
        # overlap_dispatch_backward_with_experts_wgrad are mutually exclusive") is kept under the plugin's
        # install (install.delayed_wgrad_post_init), but it sees only the model's config, after the process
        # groups exist; without the plugin's delay (fused schedules, TransformerEngine < 2.7) the runtime's
        # check of the experts' config (split_backward.delayed_wgrad_modules) fails at the first step instead.
        split = (" (split-backward schedules defer the experts' weight gradients to W themselves, with "
                 "TransformerEngine >= 2.7)" if schedule in SPLIT_BACKWARD_SCHEDULES else "")
        raise ConfigError(
            f"--overlap-dispatch-backward-with-experts-wgrad with --pipeline-schedule {schedule}: Megatron then runs "
            "the experts' queued weight-gradient GEMMs inside the backward pass (_RegisterDelayedWgradForExperts), "
            "and the plugin's schedule runs every queued GEMM of a TransformerEngine layer itself (at W, or right "
            "after a B), so TransformerEngine's queue is popped twice (\"Pop empty queue\"); drop "
            f"--overlap-dispatch-backward-with-experts-wgrad{split}, or use --pipeline-schedule default"
        )


def _check_quantized_param_gather(args: argparse.Namespace, zero: int | None) -> None:
    """--fp8-param-gather / --fp4-param-gather with --zero-stage. Megatron then builds the layers' weights as
    TransformerEngine quantized tensors (Float8Tensor / MXFP8Tensor / NVFP4Tensor), which re-quantize into
    their own storage instead of aliasing the flat buffer's view (sharded/quantized.py): the optimizer's updates
    would never reach the weights. Megatron's own checks, which run later, would instead ask for
    --use-distributed-optimizer (fp8), which --zero-stage refuses, or for TransformerEngine (fp4).
    Supporting FP8 parameter all-gathers in the sharded wrapper (half the gather bytes at ZeRO-3) would take
    quantized shards, their transposes and the scales' reduction: refused until it exists."""
    if zero is None:
        return
    for name, flag, compute in (("fp8_param_gather", "--fp8-param-gather", "--fp8-format"),
                                ("fp4_param_gather", "--fp4-param-gather", "--fp4-format")):
        if _flag(args, name, False):
            raise ConfigError(
                f"{flag} with --zero-stage {zero}: it makes the layers' weights TransformerEngine quantized "
                "tensors, which do not live in the sharded wrapper's flat parameter buffer (they re-quantize into "
                "their own storage, so the optimizer's updates would never reach the weights the forward reads); "
                f"drop {flag} ({compute} still computes in low precision from the high-precision weights, "
                f"re-quantized at each step's first micro-batch), or drop --zero-stage and use "
                f"--use-distributed-optimizer (Megatron's distributed optimizer gathers quantized parameters)"
            )


def check_before_megatron(args: argparse.Namespace) -> None:
    """Conflicts of the plugin's flags with Megatron-LM flags whose own check in Megatron's `validate_args` would
    fire first, with a fix that leads away from the plugin: run on the parsed arguments before it."""
    zero = _flag(args, "zero_stage")
    _check_quantized_param_gather(args, zero)
    if zero is not None and _flag(args, "overlap_param_gather_with_optimizer_step", False):
        raise ConfigError(
            f"--overlap-param-gather-with-optimizer-step with --zero-stage {zero}: the schedule already steps the "
            "optimizer stage by stage, in the order the next forward needs the stages, and launches each stage's "
            "parameter all-gather right after its step (its STEP actions); drop "
            "--overlap-param-gather-with-optimizer-step (it configures Megatron's distributed optimizer, which "
            f"--zero-stage {zero} replaces)"
        )


def validate_args(args: argparse.Namespace, simulated: bool = False) -> PluginConfig:
    """Validate Megatron-LM's parsed and validated `args` (after Megatron's own `validate_args`) with the plugin's
    flags; return the resolved configuration or raise one `ConfigError` naming the flags and the fix.
    `simulated`: the flags describe a run for the simulator, which also models --paired-moe-a2a-overlap."""
    if not hasattr(args, "pipeline_schedule"):
        raise ConfigError(
            "the arguments lack --pipeline-schedule: parse them with "
            "extra_args_provider=megatron_bfpp.megatron.add_arguments (or run the script through "
            "python -m megatron_bfpp.run_megatron_script)"
        )
    if getattr(args, "data_parallel_size", None) is None:
        raise ConfigError(
            "args.data_parallel_size is unset: validate the arguments with Megatron's validate_args first "
            "(megatron.training.arguments.parse_and_validate_args does)"
        )
    schedule = args.pipeline_schedule
    if schedule not in PIPELINE_SCHEDULES:
        raise ConfigError(f"--pipeline-schedule {schedule!r} is not one of {', '.join(PIPELINE_SCHEDULES)}")
    check_before_megatron(args)
    zero = _flag(args, "zero_stage")
    wbuf, gbuf = _flag(args, "bfpp_weight_buffers"), _flag(args, "bfpp_grad_buffers")
    timeline = _flag(args, "timeline")
    runtime = schedule != "default"

    if _flag(args, "paired_moe_a2a_overlap", False):
        if not runtime:
            raise ConfigError(
                "--paired-moe-a2a-overlap is the paired order of the plugin's schedules: add --pipeline-schedule "
                "breadth-first (or another of the plugin's), or use --overlap-moe-expert-parallel-comm (Megatron's "
                "combined 1F1B) under --pipeline-schedule default")
        if not simulated:
            raise ConfigError(PAIRED_NOT_RUN)
    if not runtime:
        for value, flag in ((zero, "--zero-stage"), (timeline, "--timeline")):
            if value is not None:
                raise ConfigError(
                    f"{flag} needs megatron_bfpp's schedule runtime: add --pipeline-schedule breadth-first (or "
                    "interleaved-1f1b / 1f1b), or drop it"
                )
    if zero is not None and zero not in (1, 2, 3):
        raise ConfigError(f"--zero-stage must be 1, 2 or 3 (got {zero})")
    if wbuf is not None and zero != 3:
        raise ConfigError("--bfpp-weight-buffers applies to --zero-stage 3 only (gathered weights): drop it or use --zero-stage 3")
    if gbuf is not None and zero not in (2, 3):
        raise ConfigError("--bfpp-grad-buffers applies to --zero-stage 2 and 3 only (sharded gradients): drop it or raise --zero-stage")
    for value, flag in ((wbuf, "--bfpp-weight-buffers"), (gbuf, "--bfpp-grad-buffers")):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be >= 1 (got {value})")

    distopt = bool(_flag(args, "use_distributed_optimizer", False))
    mfsdp = bool(_flag(args, "use_megatron_fsdp", False)) or bool(_flag(args, "use_custom_fsdp", False))
    tfsdp = bool(_flag(args, "use_torch_fsdp2", False))
    if runtime and (mfsdp or tfsdp):
        flag = "--use-megatron-fsdp" if mfsdp else "--use-torch-fsdp2"
        raise ConfigError(
            f"{flag} cannot run under --pipeline-schedule {schedule} (FSDP re-gathers weights on every micro-batch "
            f"and is not pipeline-aware): drop {flag} and use --zero-stage 3 for schedule-placed weight sharding"
        )
    if zero == 3 and _flag(args, "async_save", False):
        raise ConfigError(
            "--async-save with --zero-stage 3: weights are gathered only for the duration of a synchronous save; "
            "drop --async-save (or use --zero-stage 2)"
        )
    if zero is not None:
        if distopt:
            raise ConfigError(
                f"--zero-stage {zero} brings megatron_bfpp's sharded optimizer: drop --use-distributed-optimizer, "
                "or drop --zero-stage to keep Megatron's distributed optimizer under the plugin's schedule"
            )
        for name, flag in (("overlap_grad_reduce", "--overlap-grad-reduce"),
                           ("overlap_param_gather", "--overlap-param-gather")):
            if _flag(args, name, False):
                raise ConfigError(
                    f"--zero-stage {zero} places gradient reduce-scatters and weight all-gathers in the schedule: "
                    f"drop {flag} (it configures Megatron's own DDP, which --zero-stage {zero} replaces)"
                )
    if zero is not None:
        _check_zero_stage_readers(args, zero)
    if _flag(args, "fp16", False):
        scale = _flag(args, "loss_scale")
        if scale is not None and float(scale) <= 1.0:
            raise ConfigError(
                f"--fp16 with --loss-scale {scale} trains without loss scaling and fp16 gradients underflow: drop "
                "--loss-scale for dynamic scaling, set a constant --loss-scale > 1, or use --bf16"
            )
    if runtime:
        graph_flag = _per_layer_graphs(args)
        if graph_flag in ("--cuda-graph-impl local", "--enable-cuda-graph"):
            # Megatron builds these graphs in create_cudagraphs() (megatron/core/transformer/cuda_graphs.py),
            # which only its own schedule functions call (pipeline_parallel/schedules.py, at their end): under the
            # plugin's runtime the layers run eagerly, and at P > 1 CudaGraphManager.get_cudagraph_runner adds a
            # runner and a recording per micro-batch of every step. (The capture order would be the running
            # schedule's own: _CudagraphGlobalRecord records the first step as it runs.)
            raise ConfigError(
                f"{graph_flag} (Megatron's local per-layer CUDA graphs) with --pipeline-schedule {schedule}: "
                "Megatron builds these graphs only at the end of its own schedule functions, so under the "
                "plugin's schedule they are never built (the layers run eagerly, and at P > 1 each micro-batch "
                f"of every step leaves a new recording behind); drop {graph_flag.split()[0]} (use "
                "--cuda-graph-impl none), or use --pipeline-schedule default"
            )
        if schedule in SPLIT_BACKWARD_SCHEDULES and graph_flag is not None:
            raise ConfigError(
                f"{graph_flag} (per-layer CUDA graphs) with --pipeline-schedule {schedule}: a layer's graph "
                f"replays its whole backward, which the split backward (I now, W later) divides in two; drop "
                f"{graph_flag.split()[0]} (use --cuda-graph-impl none) or use --pipeline-schedule interleaved-1f1b "
                "(1f1b at V = 1), whose order is Megatron's"
            )
        if _flag(args, "cuda_graph_impl", "none") == "full_iteration":
            per_layer = ("--cuda-graph-impl transformer_engine (per-layer, with --pipeline-schedule interleaved-1f1b "
                         "or 1f1b), " if zero in (None, 1) else "")
            raise ConfigError(
                f"--cuda-graph-impl full_iteration captures Megatron's own schedule; it cannot capture "
                f"--pipeline-schedule {schedule}: use --cuda-graph-impl none, {per_layer}or --pipeline-schedule default"
            )
        if _flag(args, "overlap_moe_expert_parallel_comm", False):
            raise ConfigError(
                f"--overlap-moe-expert-parallel-comm runs Megatron's combined 1F1B schedule: drop it or use "
                f"--pipeline-schedule default (not {schedule})"
            )
        if timeline:
            parent = os.path.dirname(os.path.abspath(timeline))
            if not os.path.isdir(parent):
                raise ConfigError(f"--timeline {timeline}: directory {parent} does not exist; create it first")

    pp = int(args.pipeline_model_parallel_size)
    # Megatron sets V from --num-layers-per-virtual-pipeline-stage, --num-virtual-stages-per-pipeline-rank or the
    # number of stages of --pipeline-model-parallel-layout (layout.py)
    vp = int(_flag(args, "virtual_pipeline_model_parallel_size") or 1)
    problem = layout_problem(args, runtime)
    if problem is None and runtime:
        problem = layout_stage_count_problem(args, schedule_kind(schedule), vp)
    if problem is not None:
        raise ConfigError(problem)
    group = _flag(args, "microbatch_group_size_per_vp_stage")
    train_m, eval_m = _microbatch_counts(args)
    cfg = PluginConfig(
        pipeline_schedule=schedule,
        schedule=ScheduleSpec(
            schedule if runtime else megatron_kind(vp), pp, vp, train_m[-1],
            int(group) if group is not None else None, zero_stage=zero,
            weight_buffers=wbuf if wbuf is not None else DEFAULT_BUFFERS,
            grad_buffers=gbuf if gbuf is not None else DEFAULT_BUFFERS,
        ),
        timeline=timeline,
        train_microbatches=train_m,
        eval_microbatches=eval_m,
    )
    if runtime:
        _check_schedule(cfg, args)
        _check_queued_weight_gradients(cfg, args)
        graph_flag = _per_layer_graphs(args)
        if graph_flag is not None:  # only TransformerEngine's are left: local and split schedules are refused above
            _check_transformer_engine_graph_order(cfg, args, graph_flag)
    return cfg
