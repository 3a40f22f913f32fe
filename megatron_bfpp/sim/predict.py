"""One configuration end to end: check it, build its schedule, time it with the engine, size its memory."""

from __future__ import annotations

import functools
import sys
from dataclasses import asdict, dataclass, field

from ..schedule import Op, Schedule, ScheduleError, ScheduleSpec, validate
from ..schedule.ir import INPUT_GRAD_OPS
from ..schedule.kinds import KINDS, megatron_kind, schedule_kind
from ..schedule.validate import peak_pending_weight_grads
from ..schedule.events import TimelineEvent
from .costs import Config, analytic_costs, memory_breakdown, peak_activation_bytes
from .engine import EngineResult, simulate_schedule, step_lower_bound_s
from .hardware import GIB, Hardware
from .layouts import layout_string
from .model import ModelProfile, StageSplit

def check_config(model: ModelProfile, hw: Hardware, cfg: Config) -> None:
    """Raise ValueError (one line, naming the flag) for a configuration that cannot run."""
    cfg.placement(hw)
    cfg.partition(model)
    if cfg.fp8 is not None:
        hw.gemm_flops(fp8=True)  # refused where the hardware has no FP8 tensor cores
    if model.is_moe and cfg.tp > 1 and not cfg.sequence_parallel:
        raise ValueError("--sequence-parallel: Megatron runs MoE layers with tensor parallelism only under sequence "
                         "parallelism; add --sequence-parallel")
    if cfg.moe_a2a_overlap and not (model.is_moe and cfg.ep > 1):
        raise ValueError("--overlap-moe-expert-parallel-comm needs an MoE model with --expert-model-parallel-size > 1")
    if cfg.paired_moe_a2a_overlap:
        if not model.is_moe:
            raise ValueError("--paired-moe-a2a-overlap hides the expert-parallel all-to-all: it needs an MoE model "
                             "(--num-experts)")
        if cfg.moe_a2a_overlap:
            raise ValueError("--paired-moe-a2a-overlap with --overlap-moe-expert-parallel-comm: the first is the "
                             "plugin's schedules' paired order, the second Megatron's combined 1F1B; give one")
    if cfg.recompute_num_layers is not None and not cfg.recompute:
        raise ValueError("--recompute-num-layers applies to full recomputation (--recompute-granularity full)")
    if cfg.zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"--zero-stage must be 0, 1, 2 or 3 (got {cfg.zero_stage})")
    try:
        kind = schedule_kind(cfg.schedule)
    except ScheduleError as e:
        raise ValueError(str(e)) from None
    if cfg.moe_a2a_overlap and not (kind.megatron_order and cfg.stock_optimizer):
        # Megatron-Core builds its combined 1F1B only inside its own schedule functions; the plugin's runtime
        # refuses the flag (validation.py), and its schedules' order is the paired one.
        raise ValueError(f"--overlap-moe-expert-parallel-comm runs Megatron's combined 1F1B, inside its own schedule "
                         f"with its own optimizer (--pipeline-schedule default), not {cfg.schedule} with ZeRO-"
                         f"{cfg.zero_stage} of the plugin; for the plugin's schedules use --paired-moe-a2a-overlap")
    if not kind.fits_stages(cfg.vp):
        if kind.virtual_stages:
            raise ValueError(
                f"--pipeline-schedule {cfg.schedule} needs at least 2 virtual stages per rank: set "
                "--num-layers-per-virtual-pipeline-stage to at most half of layers / P"
            )
        looped = ", ".join(name for name, k in KINDS.items() if k.virtual_stages)
        raise ValueError(
            f"--pipeline-schedule {cfg.schedule} runs one stage per rank: drop "
            f"--num-layers-per-virtual-pipeline-stage or use a looped schedule ({looped})"
        )
    if cfg.group_size is not None and not kind.takes_group_size:
        raise ValueError(f"--microbatch-group-size-per-virtual-pipeline-stage does not apply to {cfg.schedule}: drop it")
    # Megatron-LM's own check (arguments.py) asks for V > 1, the distributed optimizer and --overlap-param-gather;
    # the simulator models it on Megatron's interleaved order only.
    if cfg.param_gather_with_optimizer and not (kind.megatron_order and kind.virtual_stages and cfg.zero_stage == 1
                                                and cfg.dp_overlap):
        raise ValueError("--overlap-param-gather-with-optimizer-step is modelled for Megatron's interleaved schedule "
                         "with its distributed optimizer and overlapped gathers: it needs --pipeline-schedule "
                         "interleaved-1f1b, --zero-stage 1 and --dp-overlap on")
    try:
        built_schedule(schedule_spec(cfg).order_spec())  # the kind's own rules on M and the group size
    except ScheduleError as e:
        raise ValueError(str(e)) from None


def schedule_spec(cfg: Config) -> ScheduleSpec:
    """The schedule `cfg` runs, lowered as the runtime lowers it, with the kind's default group size written in."""
    return ScheduleSpec(
        cfg.schedule, cfg.pp, cfg.vp, cfg.microbatches, cfg.group_size,
        zero_stage=max(cfg.zero_stage, 1),  # ZeRO-0 reduces (all-reduces) where ZeRO-1 reduce-scatters
        weight_buffers=cfg.weight_buffers, grad_buffers=cfg.grad_buffers,
        # A W of weight-gradient GEMMs alone reads kept activations, not weights (as the runtime's deferred W).
        w_needs_weights=not cfg.split_backward or cfg.w_reruns_input_grad,
        # Layers that cannot defer run their backward whole at I, with GPU's default gradient-accumulation
        # fusion into main_grad: ZeRO-2/3 then hold a stage's gradient buffer from its first I, as the runtime
        # does.
        i_writes_grads=cfg.split_backward and cfg.w_at_input_grad,
        # The plugin's optimizer steps stage by stage at the step boundary (STEP actions); stock Megatron's
        # runs outside the schedule.
        optimizer_step=cfg.optimizer_in_schedule,
        # Actions merged two at a time to hide the expert all-to-all (none at EP = 1: nothing to hide).
        pairing=cfg.pairing,
    ).resolved()


@functools.lru_cache(maxsize=512)
def cached_schedule(spec: ScheduleSpec, check: bool = False) -> Schedule:
    """The lowered schedule of `spec` (shared by every configuration with the same pipeline shape); `check`
    also validates it."""
    sched = spec.lower(built_schedule(spec.order_spec()))
    if check:
        validate(sched)
    return sched


def schedule_for(cfg: Config, check: bool = False) -> Schedule:
    return cached_schedule(schedule_spec(cfg), check)


@dataclass
class Prediction:
    config: Config
    model: str
    hardware: str
    step_time_s: float
    tflops_per_gpu: float
    mfu: float
    bubble_fraction: float
    exposed_dp_s: float
    exposed_pp_s: float
    optimizer_s: float  # the slowest rank's optimizer work (the step waits for all of it without STEPs)
    compute_s: float  # mean F/B busy time per rank
    peak_memory_gib: float
    memory_gib: dict[str, float]  # categories of the rank with the highest peak
    fits: bool
    per_rank: list[dict]
    dp_collectives: dict[str, list[int]]
    # Split-backward schedules: per rank, the most (stage, micro-batch) whose I ran and W did not yet (0 with
    # fused backwards); their bytes are in the activations of `memory_gib`.
    peak_pending_weight_grads: list[int] = field(default_factory=list)
    # Of the optimizer (and gradient norm), what the step waits for: the most over ranks (`EngineResult`);
    # equal to `optimizer_s` when the optimizer is outside the schedule.
    optimizer_exposed_s: float = 0.0
    # No order of this layout's stages steps faster (`engine.step_lower_bound_s`): the first stage's last
    # backward and reduction, or a rank's compute or data-parallel stream, each action no earlier than it can
    # start in any order.
    step_lower_bound_s: float = 0.0
    # The busiest rank's F/B time over the mean rank's: 1 when the layout balances the work exactly.
    rank_load_max_over_mean: float = 1.0
    # MoE: the mean over pipeline ranks of the expert all-to-all seconds their compute stream waits for (part of
    # `compute_s`), and how many actions ran paired (`--paired-moe-a2a-overlap`), summed over ranks.
    exposed_moe_a2a_s: float = 0.0
    paired_actions: int = 0
    events: list[TimelineEvent] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("events")
        d["config"] = config_dict(self.config)
        return d


def config_dict(cfg: Config) -> dict:
    """The configuration under the field names of the planner's JSON contract (plus the extras)."""
    return {
        "tensor_model_parallel_size": cfg.tp,
        "pipeline_model_parallel_size": cfg.pp,
        "virtual_pipeline_model_parallel_size": cfg.vp,
        "data_parallel_size": cfg.dp,
        "micro_batch_size": cfg.micro_batch_size,
        "pipeline_schedule": cfg.schedule,
        "zero_stage": cfg.zero_stage,
        "recompute": cfg.recompute,
        "num_micro_batches": cfg.microbatches,
        "microbatch_group_size_per_vp_stage": schedule_kind(cfg.schedule).group_size_for(
            cfg.pp, cfg.microbatches, cfg.group_size),
        "dp_overlap": cfg.dp_overlap,
        "p2p_overlap": cfg.p2p_overlap,
        "w_reruns_input_grad": cfg.w_reruns_input_grad,
        "w_at_input_grad": cfg.w_at_input_grad,
        "decoder_first_pipeline_num_layers": cfg.split.first_pipeline_num_layers,
        "decoder_last_pipeline_num_layers": cfg.split.last_pipeline_num_layers,
        "account_for_embedding_in_pipeline_split": cfg.split.account_for_embedding,
        "account_for_loss_in_pipeline_split": cfg.split.account_for_loss,
        "pipeline_model_parallel_layout": None if cfg.split.layout is None else layout_string(cfg.split.layout),
        "overlap_param_gather_with_optimizer_step": cfg.param_gather_with_optimizer,
        "optimizer_in_schedule": cfg.optimizer_in_schedule,
        # How the layers run: context, expert and expert-tensor parallelism, sequence parallelism, attention kernel,
        # FP8 recipe, overlaps, recomputation, gradient precision.
        "context_parallel_size": cfg.cp,
        "expert_model_parallel_size": cfg.ep,
        "expert_tensor_parallel_size": cfg.etp or cfg.tp,
        "sequence_parallel": cfg.sequence_parallel and cfg.tp > 1,
        "attention": cfg.attention,
        "fp8_recipe": cfg.fp8,
        "tp_comm_overlap": cfg.tp_comm_overlap,
        "overlap_moe_expert_parallel_comm": cfg.moe_a2a_overlap,
        "paired_moe_a2a_overlap": cfg.paired_moe_a2a_overlap,
        "recompute_granularity": "full" if cfg.recompute else "selective" if cfg.selective_recompute else None,
        "recompute_num_layers": cfg.recompute_num_layers,
        "grad_reduce_in_bf16": cfg.grad_reduce_bf16,
    }


@functools.lru_cache(maxsize=2048)
def built_schedule(order: ScheduleSpec) -> Schedule:
    """The F/B order of `order`, a spec without lowering settings (`ScheduleSpec.order_spec()`, so that every
    lowering of it shares the entry): enough for activation memory, cheaper than lowering."""
    return order.order()


@functools.lru_cache(maxsize=2048)
def activation_frontier(order: ScheduleSpec) -> tuple[tuple[tuple[int, int, int, int], ...], ...]:
    """Per rank, the Pareto-maximal counts (full activations of other stages, of the last stage, pending W's
    of other stages, of the last stage) kept at once over its order: an F adds a full activation, a B frees
    it, an I turns it into a pending W (which keeps only the weight-GEMM operands) and the W frees that.

    Every stage but the last keeps the same bytes per micro-batch, so the peak bytes of a rank is the
    largest dot product of these points with the four per-item sizes: exact, and independent of b, T and
    recompute."""
    sched = built_schedule(order)
    last = order.pp * order.vp - 1
    out = []
    for acts in sched.ranks:
        c = [0, 0, 0, 0]
        points: set[tuple[int, int, int, int]] = {(0, 0, 0, 0)}
        for a in acts:
            k = 1 if a.stage == last else 0
            if a.op == Op.F:
                c[k] += 1
            elif a.op in INPUT_GRAD_OPS:
                c[k] -= 1
                if a.op == Op.I:
                    c[2 + k] += 1
            elif a.op == Op.W:
                c[2 + k] -= 1
            points.add(tuple(c))  # type: ignore[arg-type]
        out.append(tuple(p for p in points
                         if not any(q != p and all(x >= y for x, y in zip(q, p)) for q in points)))
    return tuple(out)


def memory(model: ModelProfile, cfg: Config) -> list[dict[str, float]]:
    """Per pipeline rank, bytes by category (see `costs.memory_breakdown`), activations from the schedule's order."""
    part = cfg.partition(model)
    b = cfg.micro_batch_size
    order = schedule_spec(cfg).order_spec()
    n_st = part.num_stages

    def kept(s: int) -> float:
        return part.activation_bytes(s, b, cfg.recompute, cfg.recompute_num_layers, cfg.selective_recompute)

    inner = {(kept(s), part.pending_weight_grad_bytes(s, b)) for s in range(n_st - 1)}
    if len(inner) > 1:  # stages that keep different bytes: walk the order with each stage's own bytes
        sched = built_schedule(order)
        pending = None if cfg.w_at_input_grad else (lambda s: part.pending_weight_grad_bytes(s, b))
        return [memory_breakdown(part, cfg, r, peak_activation_bytes(sched, r, kept, pending))
                for r in range(cfg.pp)]
    frontier = activation_frontier(order)
    sizes = (kept(0) if n_st > 1 else 0.0,
             kept(n_st - 1),
             part.pending_weight_grad_bytes(0, b) if n_st > 1 and not cfg.w_at_input_grad else 0.0,
             0.0 if cfg.w_at_input_grad else part.pending_weight_grad_bytes(n_st - 1, b))
    return [memory_breakdown(part, cfg, r, max(sum(x * y for x, y in zip(p, sizes)) for p in frontier[r]))
            for r in range(cfg.pp)]


def predict(model: ModelProfile, hw: Hardware, cfg: Config, record_events: bool = False,
            check: bool = False) -> Prediction:
    """Simulate one step of `cfg`; `check` also validates the schedule (slower, for one-off use)."""
    check_config(model, hw, cfg)
    part = cfg.partition(model)
    sched = schedule_for(cfg, check)
    costs = analytic_costs(hw, part, cfg)
    res = simulate_schedule(sched, costs, record_events=record_events)
    return _prediction(model, hw, cfg, sched, res, step_lower_bound_s(sched, costs))


def _prediction(model: ModelProfile, hw: Hardware, cfg: Config, sched: Schedule, res: EngineResult,
                lower_bound_s: float) -> Prediction:
    mem = memory(model, cfg)
    peak_rank = max(range(cfg.pp), key=lambda r: mem[r]["total"])
    flops = model.model_flops_per_sequence(cfg.tp) * cfg.global_batch_size
    tflops = flops / res.step_time_s / cfg.num_gpus / 1e12
    pp = cfg.pp
    pending = peak_pending_weight_grads(sched)
    per_rank = [
        {"rank": r, "compute_s": res.compute_s[r], "bubble_s": res.bubble_s[r], "exposed_pp_s": res.exposed_pp_s[r],
         "exposed_dp_s": res.exposed_dp_s[r], "bubble_fraction": res.bubble_fraction_per_rank[r],
         "peak_memory_gib": mem[r]["total"] / GIB, "peak_pending_weight_grads": pending[r],
         "optimizer_s": res.optimizer_rank_s[r], "optimizer_exposed_s": res.optimizer_exposed_s[r]}
        for r in range(pp)
    ]
    return Prediction(
        config=cfg, model=model.name, hardware=hw.name,
        step_time_s=res.step_time_s,
        tflops_per_gpu=tflops,
        mfu=tflops * 1e12 / hw.dense_peak(cfg.fp8 is not None),
        bubble_fraction=res.bubble_fraction,
        exposed_dp_s=res.mean_exposed_dp_s,
        exposed_pp_s=res.mean_exposed_pp_s,
        optimizer_s=res.optimizer_s,
        compute_s=sum(res.compute_s) / pp,
        peak_memory_gib=mem[peak_rank]["total"] / GIB,
        memory_gib={k: v / GIB for k, v in mem[peak_rank].items()},
        fits=mem[peak_rank]["total"] <= hw.usable_memory_bytes,
        per_rank=per_rank,
        dp_collectives=res.dp_traffic,
        peak_pending_weight_grads=pending,
        optimizer_exposed_s=res.max_optimizer_exposed_s,
        step_lower_bound_s=lower_bound_s,
        rank_load_max_over_mean=max(res.compute_s) * pp / sum(res.compute_s) if sum(res.compute_s) > 0 else 1.0,
        exposed_moe_a2a_s=res.mean_exposed_moe_a2a_s,
        paired_actions=sum(res.paired_actions),
        events=res.events,
    )


# ---------------------------------------------------------------- the trainer's "predicted" report block

_DEVICE_PROFILES = (("H200", "h200"), ("H100", "dgx-h100"), ("A100", "dgx-a100"))


def hardware_for_device() -> Hardware | None:
    """The profile matching this process's CUDA device, if any (CPU runs have none). Only looks when torch
    is already loaded (the trainer's case): the simulator itself never needs torch."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if not torch.cuda.is_available():
            return None
        name = torch.cuda.get_device_name()
    except Exception:  # no usable CUDA runtime: treat as CPU
        return None
    from .hardware import get_hardware

    for key, profile in _DEVICE_PROFILES:
        if key in name:
            return get_hardware(profile)
    return None


def trainer_config(args) -> tuple[ModelProfile, Config]:
    """Model and configuration of a trainer run from its Megatron-style parsed arguments."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    vp = getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
    dp = getattr(args, "data_parallel_size", None) or args.world_size // (tp * pp)
    m = args.global_batch_size // (args.micro_batch_size * dp)
    sched = getattr(args, "pipeline_schedule", "default") or "default"
    if sched == "default":
        sched = megatron_kind(vp)
    zero = getattr(args, "zero_stage", None)
    if zero is None:
        zero = 1 if getattr(args, "use_distributed_optimizer", False) else 0
    model = ModelProfile(
        "trainer", args.num_layers, args.hidden_size, args.num_attention_heads, args.seq_length,
        getattr(args, "padded_vocab_size", None) or args.vocab_size, getattr(args, "ffn_hidden_size", None),
    )
    cfg = Config(tp, pp, vp, dp, args.micro_batch_size, m, sched, zero,
                 getattr(args, "recompute_granularity", None) == "full",
                 getattr(args, "microbatch_group_size_per_vp_stage", None),
                 weight_buffers=getattr(args, "bfpp_weight_buffers", None) or 2,
                 grad_buffers=getattr(args, "bfpp_grad_buffers", None) or 2, split=StageSplit.from_args(args))
    return model, cfg


def predict_for_trainer(args, iteration_times: list[float] | None = None) -> dict | None:
    """The simulator's numbers for a trainer run: a full prediction on a profiled GPU, otherwise what does not
    depend on the machine (bubble under unit costs, collectives per step, kept activations per rank).
    Never raises: a report must still be written when the configuration is outside the cost model."""
    from ..schedule import peak_activations
    from .costs import unit_costs

    try:
        model, cfg = trainer_config(args)
        cfg.partition(model)  # a split Megatron builds, T dividing the heads
        sched = schedule_for(cfg)
        hw = hardware_for_device()
        if hw is not None:
            p = predict(model, hw, cfg)
            out = {k: v for k, v in p.to_dict().items() if k not in ("per_rank",)}
            out["tokens_per_s"] = cfg.global_batch_size * model.seq_length / p.step_time_s
            out["basis"] = f"cost model for {hw.name}"
            return out
        res = simulate_schedule(sched, unit_costs(sched), record_events=False)
        return {
            "basis": "unit costs (t_F = 1, t_B = 2, free communication): no hardware profile for this device",
            "config": config_dict(cfg),
            "bubble_fraction": res.bubble_fraction,
            "dp_collectives": res.dp_traffic,
            "peak_activations": peak_activations(sched),
            "peak_pending_weight_grads": peak_pending_weight_grads(sched),
        }
    except Exception as e:  # outside the cost model (e.g. uneven stages): say why instead of failing the run
        return {"error": f"no prediction: {e}"}
