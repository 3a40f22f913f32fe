"""The trainer's side of its run reports: what only the live run knows (this rank's communication and memory
counters and recorded events, gathered to rank 0; the run's configuration; the simulator's prediction), handed
as plain data to `trace.run_report`, which builds the report, its console lines and its files."""

from __future__ import annotations

import argparse
import statistics
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..schedule import Schedule
from ..schedule.events import TimelineEvent
from ..trace.run_report import (
    build_run_report, done_line, measured_line, prediction_line, rank_events, write_json_atomic, write_timeline,
)
from . import measured_prediction, timeline_costs

if TYPE_CHECKING:
    from ..sharded.ddp import ShardedDataParallel
    from ..sharded.optimizer import ShardedOptimizer


def comm_stats(model: Sequence[ShardedDataParallel], rank: int) -> dict:
    """This rank's data-parallel collectives (the sharded driver's counters) and pipeline bytes sent."""
    from ..runtime.forward_backward import last_run_stats
    from ..sharded.driver import link_stats

    stats = link_stats(model).comm_stats()
    stats["pp_send_bytes"] = last_run_stats().get("pp_send_bytes", 0)
    stats["rank"] = rank
    return stats


def memory_stats(model: Sequence[ShardedDataParallel], optimizer: ShardedOptimizer, rank: int,
                 device: torch.device, zero_stage: int) -> dict:
    """This rank's model-state bytes and its peak: the allocator's on CUDA, the runtime's own account on CPU."""
    from ..runtime.forward_backward import last_run_stats
    from ..sharded.driver import memory_stats as sharded_memory_stats

    mem: dict[str, Any] = dict(sharded_memory_stats(model, optimizer))
    mem["rank"] = rank
    mem["peak_activation_bytes"] = last_run_stats().get("peak_activation_bytes", 0)
    if device.type == "cuda":
        mem["peak_bytes"] = torch.cuda.max_memory_allocated()
    else:  # what the runtime holds: resident model state, gathered weights and gradients, saved activations
        full_grads = mem["peak_full_grad_bytes"] if zero_stage >= 2 else 0  # ZeRO-1: in grad_bytes
        # (the full buffers gathered now are part of the step's peak of gathered ones: counted once)
        mem["peak_bytes"] = int(mem["param_bytes"] - mem["gathered_param_bytes"] + mem["grad_bytes"]
                                + mem["optimizer_bytes"]
                                + mem["peak_gathered_param_bytes"] + full_grads + mem["peak_activation_bytes"])
    return mem


def gather_rank_stats(model: Sequence[ShardedDataParallel], optimizer: ShardedOptimizer,
                      events: Sequence[TimelineEvent], device: torch.device, zero_stage: int,
                      machine: dict | None = None) -> list[dict]:
    """Every rank's {"comm", "memory", "events", "machine"} in rank order, on every rank (a collective: all ranks
    call it). `events`: this rank's recorded TimelineEvents; `machine`: its `machine.rank_stats`, or None."""
    rank = dist.get_rank()
    mine = {
        "comm": comm_stats(model, rank),
        "memory": memory_stats(model, optimizer, rank, device, zero_stage),
        "events": [e.to_dict() for e in events],
        "machine": machine,
    }
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered


def run_config(args: argparse.Namespace, *, pp: int, vp: int, dp: int, microbatches: int) -> dict:
    """The report's "config" block (also the timeline's metadata)."""
    a = args
    return {
        "pipeline_schedule": a.pipeline_schedule, "pp": pp, "vp": vp, "dp": dp,
        "tp": a.tensor_model_parallel_size, "zero_stage": a.zero_stage, "microbatches": microbatches,
        "group_size": a.microbatch_group_size_per_vp_stage, "num_layers": a.num_layers,
        "hidden_size": a.hidden_size, "num_attention_heads": a.num_attention_heads, "seq_length": a.seq_length,
        "micro_batch_size": a.micro_batch_size, "global_batch_size": a.global_batch_size,
        "train_iters": a.train_iters, "lr": a.lr, "seed": a.seed, "vocab_size": a.padded_vocab_size,
        "tied_embeddings": not a.untie_embeddings_and_output_weights, "recompute": a.recompute_granularity,
        "dtype": "bf16" if a.bf16 else "fp16" if a.fp16 else "fp32", "world_size": dist.get_world_size(),
        "data": a.data_path or "mock",
    }


def prediction(args: argparse.Namespace, iteration_times: list[float], *, first_iteration: int = 1,
               per_rank: Sequence[dict] = (), events: Sequence[TimelineEvent] = (), ran: Schedule | None = None,
               calibration: Sequence[int] = ()) -> dict | None:
    """The simulator's numbers for this run; None when the simulator cannot be imported. A profiled GPU: its
    cost model; otherwise, when the ranks measured the machine (`per_rank`'s "machine"), the schedule that `ran`
    timed with the costs measured over the `calibration` iterations (`measured_prediction`), else what does not
    depend on the machine (unit costs). With a predicted step time, the measured one beside it: the median of
    the iterations after the warm-up."""
    try:
        from ..sim.predict import predict_for_trainer
    except ImportError:
        return None
    out = predict_for_trainer(args, iteration_times)
    if out is None:
        return None
    if "step_time_s" not in out and ran is not None and calibration and per_rank \
            and all(s.get("machine") for s in per_rank):
        try:
            measured = measured_prediction_for(args, per_rank, events, ran, calibration)
            measured["tokens_per_s"] = args.global_batch_size * args.seq_length / measured["step_time_s"]
            # over the unit-cost block: its figures that do not depend on the machine stay
            out = {**{k: v for k, v in out.items() if k != "error"}, **measured}
        except Exception as e:  # a report is still written; say why the measured costs gave no prediction
            out = {**out, "measured_costs_error": f"{type(e).__name__}: {e}"}
    steady = measured_prediction.steady_iterations(first_iteration, len(iteration_times))
    if isinstance(out.get("step_time_s"), float) and steady:
        out["measured_step_time_s"] = statistics.median(iteration_times[i - first_iteration] for i in steady)
        out["measured_iterations"] = [steady[0], steady[-1]]
    return out


def measured_prediction_for(args: argparse.Namespace, per_rank: Sequence[dict], events: Sequence[TimelineEvent],
                            ran: Schedule, calibration: Sequence[int]) -> dict:
    """`measured_prediction.predict` of the schedule that ran, from the ranks' gathered measurements."""
    costs = timeline_costs.action_costs(events, calibration)
    mc = measured_prediction.machine_costs(ran, costs, [s["machine"] for s in per_rank], calibration,
                                           dp=getattr(args, "data_parallel_size", None)
                                           or args.world_size // (ran.pp * args.tensor_model_parallel_size),
                                           zero_stage=args.zero_stage)
    return measured_prediction.predict(ran, mc)


def publish_run_report(args: argparse.Namespace, per_rank: Sequence[dict], *, schedule: str, config: dict,
                       losses: list[float], first_iteration: int, skipped_iterations: list[int],
                       loss_scales: list[float], iteration_times: list[float], log: Callable[[str], None],
                       ran: Schedule | None = None, calibration: Sequence[int] = ()) -> dict:
    """Rank 0's part: build the report from the gathered `per_rank` stats, print the measured line (and the
    predicted one, with a predicted step time), write the timeline (`--timeline`) and the report
    (`--report-json`), print the done line naming `schedule` (the one that ran). `ran`: the lowered schedule
    that ran, `calibration`: the iterations whose actions were timed for the prediction. Returns the report."""
    events = rank_events(per_rank)
    predicted = prediction(args, iteration_times, first_iteration=first_iteration, per_rank=per_rank,
                           events=events, ran=ran, calibration=calibration)
    report = build_run_report(
        config=config, losses=losses, first_iteration=first_iteration, skipped_iterations=skipped_iterations,
        loss_scales=loss_scales, iteration_times_s=iteration_times,
        tokens_per_iteration=args.global_batch_size * args.seq_length, per_rank=per_rank, events=events,
        measured_iteration=args.train_iters, predicted=predicted,
    )
    side_by_side = prediction_line(report["predicted"], report.get("measured"))
    if "measured" in report:
        log(measured_line(report["measured"], {} if side_by_side else report["predicted"] or {}))
    if side_by_side:
        log(side_by_side)
    if args.timeline:
        write_timeline(events, args.timeline, set(args.timeline_iterations) or {args.train_iters}, report["config"])
        log(f"timeline written to {args.timeline}")
    if args.report_json:
        write_json_atomic(args.report_json, report)
        log(f"report written to {args.report_json}")
    log(done_line(args.train_iters, schedule, losses[-1], report["tokens_per_s"]))
    return report
