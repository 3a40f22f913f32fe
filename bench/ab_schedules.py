#!/usr/bin/env python3
"""A/B/C: step time of pipeline schedules on the same Megatron-Core GPT, measured side by side in one run.

Variants (every one on its own copy of the same model, identically initialised, on the same micro-batches):

  ours-bf            megatron_bfpp breadth-first (one group of all M micro-batches)
  ours-interleaved   megatron_bfpp interleaved-1f1b with G = P (isolates runtime overhead from schedule order)
  ours-bf-zb         megatron_bfpp breadth-first-zb (breadth-first, backward split into I and W, W deferred
                     into idle slots; one group, so at most M W's pending)
  ours-interleaved-zb  megatron_bfpp interleaved-zb (PyTorch's ScheduleInterleavedZeroBubble order)
  stock-G=M          Megatron-Core forward_backward_pipelining_with_interleaving, microbatch group size G = M
  stock-G=P          the same with G = P (Megatron's default, depth-first)
  torch-loopedbfs    torch.distributed.pipelining.ScheduleLoopedBFS over the very same GPT chunks, each wrapped
                     in an nn.Module taking one tensor (tokens on the first stage, hidden states [s, b, h]
                     after it) and returning one (hidden states, or logits [b, s, vocab] on the last stage),
                     with a masked per-micro-batch cross-entropy as loss_fn (Megatron's normalisation)

With the optimizer inside the comparison (not in the default set; D > 1 makes it data-parallel):

  ours-interleaved-zb-z1         interleaved-zb on the plugin's ShardedDataParallel (ZeRO-1) + ShardedOptimizer:
                                 the schedule places the optimizer step (its step boundary: STEP a chunk, all-gather
                                 its parameters, in the order the next forward needs them)
  ours-interleaved-zb-z1-nostep  the same with ScheduleSpec(optimizer_step=False): every chunk stepped, then
                                 all-gathered, in chunk order
  stock-G=P-distopt              stock-G=P on Megatron's DistributedDataParallel + DistributedOptimizer with the
                                 overlap flags Megatron-LM sets (--overlap-grad-reduce --overlap-param-gather, both
                                 aligned; forward pre-hooks from the second step on), on CPU through
                                 tests/support/megatron_ddp_cpu_shim.py
  These three step with Megatron's Adam configuration (OptimizerConfig: Adam, gradient clipping at 1.0), the other
  variants with torch's Adam (--optimizer).

Stock Megatron runs on CPU through tests/support/megatron_cpu_shim.py (test/benchmark only) with the p2p
configuration Megatron-LM uses for interleaving (overlap_p2p_comm=True, batch_p2p_comm=False).

A step is: zero grads, the schedule's forward-backward over M micro-batches, the tied-embedding gradient
all-reduce, the data-parallel gradient all-reduce (D > 1), an Adam step (torch's fused CPU Adam by default, as
Megatron steps with a fused multi-tensor Adam on GPU; --optimizer for-loop for torch's per-parameter loop, which
adds a fixed cost to every variant's step); timed between two barriers on
every rank (the three variants above: zero the gradient buffers, the schedule, whose finalize reduces the
gradients, the optimizer's step). Repetitions are interleaved (A B C D E A B C D E ...) so drift hits every variant alike; the
first --warmup rounds are dropped. Reported per variant: median wall time per step with quartiles; its ratio
to ours-bf's median; the paired ratio (each round's time over ours-bf's time in the same round: median and
quartiles over rounds, the drift-cancelling figure), and the same paired ratio against stock-G=P (Megatron's
default interleaved order) when it runs; and the CPU time per step summed over all ranks (the
work done, without the waiting, so much less sensitive to other load on the machine). The run first checks
that all variants computed the same per-micro-batch losses in their first step (same model, same data: a
failed check means the comparison is void).

Measured bubble (our runtime's variants): after the timed rounds, --record-rounds more rounds of each of our
variants run with the runtime's action recorder on; megatron_bfpp.trace.metrics splits each rank's window
(first to last recorded action of the step, all ranks) into compute, bubble, exposed p2p / dp and other, and
the report gives the median over rounds of the mean over ranks. Recorded rounds are not timed rounds (the
recorder costs a little per action, and the stock and torch variants have no recorder).

Step boundary (--boundary-rounds B): B + 1 more steps of each variant back to back, without the timing barriers
between them, as a training loop runs them. A rank's exposed step boundary is the time from the end of its last
compute (F, B, I or W) of step k to the start of its first compute of step k + 1, minus nothing: zeroing the
gradients, the gradient norm, the optimizer, the parameter all-gathers it waits for, and any wait for the previous
pipeline rank's first output all count. Our variants read it from the runtime's recorder (compute actions'
intervals); stock and torch variants from hooks: the first forward of a module with parameters (after Megatron's
forward pre-hook, which waits for that module's parameter all-gather) and the last gradient accumulated into a
parameter (after Megatron's DDP hook). Reported per rank: the median over the B boundaries.

On CPU with gloo and tiny models this measures schedule and runtime overheads (Python dispatch, p2p
latency, bubbles at CPU speed), not GPU performance.

    python bench/ab_schedules.py                        # 4 processes: P=4 V=2 (D=1), then P=2 V=2 (D=2)
    python bench/ab_schedules.py --layouts 2x2 --reps 30 --hidden-size 128
    python bench/ab_schedules.py --nproc 2 --layouts 2x2,2x4 --microbatches 2,4,8 --hidden-size 256 \
        --num-attention-heads 8 --seq-length 128 \
        --variants ours-bf,ours-bf-zb,ours-interleaved-zb,stock-G=P     # the split-backward comparison
    torchrun --nproc-per-node 4 bench/ab_schedules.py   # same, launched by torchrun
"""

from __future__ import annotations

import argparse
import csv
import logging
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # tests/support/megatron_cpu_shim.py lives in the repository, not in the package
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

VARIANTS = ("ours-bf", "ours-interleaved", "stock-G=M", "stock-G=P", "torch-loopedbfs", "ours-bf-zb",
            "ours-interleaved-zb", "ours-interleaved-zb-z1", "ours-interleaved-zb-z1-nostep", "stock-G=P-distopt")
OURS = {"ours-bf": "breadth-first", "ours-interleaved": "interleaved-1f1b", "ours-bf-zb": "breadth-first-zb",
        "ours-interleaved-zb": "interleaved-zb", "ours-interleaved-zb-z1": "interleaved-zb",
        "ours-interleaved-zb-z1-nostep": "interleaved-zb"}
SHARDED = {"ours-interleaved-zb-z1": True, "ours-interleaved-zb-z1-nostep": False}  # name -> optimizer_step
COMPUTE_OPS = ("F", "B", "I", "W")
DEFAULT_VARIANTS = VARIANTS[:5]
STOCK_BASE = "stock-G=P"
STOCK_P2P = {"overlap_p2p_comm": True, "batch_p2p_comm": False}
CSV_FIELDS = ("P", "V", "D", "M", "micro_batch_size", "num_layers", "hidden_size", "seq_length", "variant",
              "group_size", "median_ms", "p25_ms", "p75_ms", "ratio_to_ours_bf", "paired_ratio_median",
              "paired_ratio_p25", "paired_ratio_p75", "cpu_ms_all_ranks", "cpu_ratio_to_ours_bf", "reps",
              "step0_loss", "paired_ratio_to_stock_median", "paired_ratio_to_stock_p25", "paired_ratio_to_stock_p75",
              "measured_bubble", "measured_bubble_ms", "measured_compute_ms", "measured_exposed_p2p_ms",
              "measured_window_ms", "record_rounds", "optimizer", "stock_base", "boundary_rounds",
              "step_boundary_ms_ranks", "step_boundary_ms_max")


# --------------------------------------------------------------------------------------------------- args
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", default="4x2,2x2",
                   help="comma-separated PxV pipeline layouts (P = pipeline size, V = chunks per rank)")
    p.add_argument("--nproc", type=int, default=4, help="processes to spawn when not under torchrun")
    p.add_argument("--microbatches", default="8",
                   help="M, micro-batches per step per pipeline; comma-separated for several (e.g. 2,4,8)")
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--layers-per-stage", type=int, default=1)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--reps", type=int, default=15, help="timed rounds (each runs every variant once)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"subset of {','.join(VARIANTS)} (default {','.join(DEFAULT_VARIANTS)})")
    p.add_argument("--record-rounds", type=int, default=3,
                   help="extra rounds of our variants with the action recorder on, for the measured bubble "
                        "(0: none)")
    p.add_argument("--optimizer", choices=("fused", "for-loop"), default="fused",
                   help="torch's Adam implementation for the variants that use it (default: fused)")
    p.add_argument("--boundary-rounds", type=int, default=0,
                   help="B: B + 1 back-to-back steps of every variant after the timed rounds, for the exposed step "
                        "boundary per rank (median over the B boundaries; 0: none)")
    p.add_argument("--stock-base", default=STOCK_BASE,
                   help=f"the variant the paired_ratio_to_stock columns divide by (default {STOCK_BASE})")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "ab_schedules.csv"))
    args = p.parse_args(argv)
    try:
        args.layouts = [tuple(int(x) for x in item.lower().split("x")) for item in args.layouts.split(",")]
        assert all(len(lv) == 2 and lv[0] >= 2 and lv[1] >= 2 for lv in args.layouts)
    except (ValueError, AssertionError):
        p.error(f"--layouts {args.layouts!r}: give PxV pairs with P >= 2 and V >= 2, e.g. 4x2,2x2")
    args.variants = [v for v in args.variants.split(",") if v]
    unknown = set(args.variants) - set(VARIANTS)
    if unknown or not args.variants:
        p.error(f"--variants: unknown {sorted(unknown)} or none; choose from {','.join(VARIANTS)} (the ratio "
                f"columns to ours-bf are empty without it)")
    try:
        args.microbatches = [int(x) for x in str(args.microbatches).split(",") if x]
        assert args.microbatches and min(args.microbatches) >= 1
    except (ValueError, AssertionError):
        p.error(f"--microbatches {args.microbatches!r}: give positive integers, e.g. 8 or 2,4,8")
    for pp, _ in args.layouts:
        if min(args.microbatches) < pp:
            p.error(f"--microbatches {min(args.microbatches)} < P={pp}: stock interleaving needs M >= P")
    if args.reps < 1 or args.warmup < 1:
        p.error("--reps and --warmup must be >= 1 (the first round also checks the losses)")
    return args


# -------------------------------------------------------------------------------------------------- model
def _config(args: argparse.Namespace, pp: int, vp: int):
    from megatron_bfpp.train.model import make_transformer_config

    return make_transformer_config(num_layers=pp * vp * args.layers_per_stage, hidden_size=args.hidden_size,
                                   num_attention_heads=args.num_attention_heads, hidden_dropout=0.0,
                                   attention_dropout=0.0, pipeline_model_parallel_size=pp,
                                   virtual_pipeline_model_parallel_size=vp, use_cpu_initialization=True)


def _chunks(args: argparse.Namespace, pp: int, vp: int) -> list[torch.nn.Module]:
    from megatron.core import parallel_state as ps

    from megatron_bfpp.train.model import build_model_chunks

    return build_model_chunks(_config(args, pp, vp), vocab_size=args.vocab_size,
                              max_sequence_length=args.seq_length, pp_rank=ps.get_pipeline_model_parallel_rank(),
                              pp_size=pp, vp_size=vp, seed=args.seed, device="cpu")


class StageModule(torch.nn.Module):
    """One Megatron GPT chunk as a one-tensor-in, one-tensor-out module for torch.distributed.pipelining."""

    def __init__(self, chunk: torch.nn.Module, seq_length: int) -> None:
        super().__init__()
        from megatron_bfpp.train.data import causal_mask

        self.chunk = chunk
        self.mask = causal_mask(seq_length)
        self.positions = torch.arange(seq_length)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.chunk.pre_process:  # x: tokens [b, s]
            return self.chunk(x, self.positions.expand(x.shape[0], -1), self.mask)
        self.chunk.set_input_tensor(x)  # x: hidden states [s, b, h], as Megatron's schedules pass them
        return self.chunk(None, None, self.mask)


def masked_ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-micro-batch loss_sum / num_tokens (Megatron's normalisation); target = stack(labels, loss_mask)."""
    labels, mask = target[:, 0], target[:, 1].float()
    ce = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
    return (ce * mask.flatten()).sum() / mask.sum().clamp(min=1)


# ------------------------------------------------------------------------------------------------ variants
@dataclass
class Variant:
    name: str
    group_size: int | None
    chunks: list[torch.nn.Module]
    step: Callable[[list[dict]], list[float]]  # micro-batches -> per-micro-batch losses (last stage, else [])


def _dp_allreduce(params: list[torch.nn.Parameter]) -> None:
    from megatron.core import parallel_state as ps

    group = ps.get_data_parallel_group()
    if torch.distributed.get_world_size(group) == 1:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    torch.distributed.all_reduce(flat, group=group)
    flat /= torch.distributed.get_world_size(group)
    offset = 0
    for p, g in zip(params, grads):
        p.grad = flat[offset:offset + g.numel()].view_as(g)
        offset += g.numel()


def _adam(args, chunks: list[torch.nn.Module]) -> torch.optim.Optimizer:
    return torch.optim.Adam([p for c in chunks for p in c.parameters()], lr=1e-4,
                            fused=args.optimizer == "fused")


def _finish(chunks: list[torch.nn.Module], opt: torch.optim.Optimizer) -> None:
    from megatron_bfpp.train.model import allreduce_tied_embedding_grads

    allreduce_tied_embedding_grads(chunks)
    _dp_allreduce([p for c in chunks for p in c.parameters()])
    opt.step()


def _megatron_variant(args, pp: int, vp: int, m: int, name: str) -> Variant:
    from megatron.core.pipeline_parallel import schedules

    from megatron_bfpp.train.data import gpt_forward_step
    from megatron_bfpp.runtime import get_forward_backward_func
    from tests.support.megatron_cpu_shim import stock_schedules_on_cpu

    chunks = _chunks(args, pp, vp)
    opt = _adam(args, chunks)
    group = {"ours-bf": None, "ours-interleaved": pp, "stock-G=M": m, "stock-G=P": pp, "ours-bf-zb": None,
             "ours-interleaved-zb": None}[name]
    if name.startswith("stock"):
        for key, value in {**STOCK_P2P, "microbatch_group_size_per_vp_stage": group}.items():
            setattr(chunks[0].config, key, value)

        def fb(**kw: Any):
            with stock_schedules_on_cpu():
                return schedules.forward_backward_pipelining_with_interleaving(**kw)
    else:
        fb = get_forward_backward_func(OURS[name], group)

    def step(batches: list[dict]) -> list[float]:
        opt.zero_grad()
        store = fb(forward_step_func=gpt_forward_step, data_iterator=[iter(batches) for _ in chunks],
                   model=chunks, num_microbatches=m, seq_length=args.seq_length,
                   micro_batch_size=args.micro_batch_size)
        _finish(chunks, opt)
        return [float(d["lm loss"][0] / d["lm loss"][1]) for d in store]

    return Variant(name, group, chunks, step)


def _megatron_optimizer_config(distributed: bool):
    """The optimizer configuration of the variants that step with Megatron's optimizer surface (both sides the
    same: Adam, Megatron's default gradient clipping and weight decay)."""
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(optimizer="adam", lr=1e-4, min_lr=1e-4, clip_grad=1.0,
                           use_distributed_optimizer=distributed)


def _ddp_config():
    """Megatron-LM's DDP settings for --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
    (align_grad_reduce / align_param_gather are its defaults)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=True,
                                         use_distributed_optimizer=True, overlap_param_gather=True,
                                         align_param_gather=True)


def _sharded_variant(args, pp: int, vp: int, m: int, name: str) -> Variant:
    """interleaved-zb on ShardedDataParallel (ZeRO-1) + ShardedOptimizer; the step boundary placed by the
    schedule (optimizer_step=True) or the optimizer's default order (False)."""
    from megatron.core.utils import get_model_config

    from megatron_bfpp.runtime import get_forward_backward_func
    from megatron_bfpp.schedule import ScheduleSpec
    from megatron_bfpp.sharded import ShardedDataParallel, ShardedOptimizer, finalize_model_grads
    from megatron_bfpp.train.data import gpt_forward_step

    chunks = _chunks(args, pp, vp)
    config = get_model_config(chunks[0])
    model = [ShardedDataParallel(config, _ddp_config(), c, zero_stage=1) for c in chunks]
    config.finalize_model_grads_func = finalize_model_grads
    opt = ShardedOptimizer(model, _megatron_optimizer_config(True))
    config.grad_scale_func = opt.scale_loss
    # P, V, M are placeholders: each call sets them.
    fb = get_forward_backward_func(ScheduleSpec(OURS[name], 1, 1, 1, optimizer_step=SHARDED[name]))

    def step(batches: list[dict]) -> list[float]:
        for c in model:
            c.zero_grad_buffer()
        opt.zero_grad()
        store = fb(forward_step_func=gpt_forward_step, data_iterator=[iter(batches) for _ in model], model=model,
                   num_microbatches=m, seq_length=args.seq_length, micro_batch_size=args.micro_batch_size)
        opt.step()
        return [float(d["lm loss"][0] / d["lm loss"][1]) for d in store]

    return Variant(name, None, model, step)


def _stock_distopt_variant(args, pp: int, vp: int, m: int) -> Variant:
    """Megatron-Core's interleaved schedule (G = P) on Megatron's DDP + DistributedOptimizer, wired as Megatron-LM's
    train() wires them; Megatron's CUDA-only calls run on the CPU through the test-support shims."""
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.utils import get_model_config

    from megatron_bfpp.train.data import gpt_forward_step
    from tests.support.megatron_cpu_shim import stock_schedules_on_cpu
    from tests.support.megatron_ddp_cpu_shim import megatron_ddp_on_cpu

    chunks = _chunks(args, pp, vp)
    config = get_model_config(chunks[0])
    for key, value in {**STOCK_P2P, "microbatch_group_size_per_vp_stage": pp}.items():
        setattr(config, key, value)
    with megatron_ddp_on_cpu():
        model = [DistributedDataParallel(config, _ddp_config(), c, disable_bucketing=i > 0)
                 for i, c in enumerate(chunks)]
        opt = get_megatron_optimizer(_megatron_optimizer_config(True), model)
        # Megatron-LM's train(): no parameter sync function and no forward pre-hooks in the first iteration.
        for c in model:
            c.disable_forward_pre_hook(param_sync=False)
    config.no_sync_func = [c.no_sync for c in model]
    config.grad_sync_func = [c.start_grad_sync for c in model]
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = opt.scale_loss
    config.param_sync_func = None
    steps = [0]

    def step(batches: list[dict]) -> list[float]:
        with megatron_ddp_on_cpu(), stock_schedules_on_cpu():
            if steps[0] == 1:  # from the second iteration on, as Megatron-LM's train()
                for c in model:
                    c.enable_forward_pre_hook()
                config.param_sync_func = [c.start_param_sync for c in model]
            for c in model:
                c.zero_grad_buffer()
            opt.zero_grad()
            store = schedules.forward_backward_pipelining_with_interleaving(
                forward_step_func=gpt_forward_step, data_iterator=[iter(batches) for _ in model], model=model,
                num_microbatches=m, seq_length=args.seq_length, micro_batch_size=args.micro_batch_size)
            opt.step()
        steps[0] += 1
        return [float(d["lm loss"][0] / d["lm loss"][1]) for d in store]

    return Variant("stock-G=P-distopt", pp, model, step)


def _variant(args, pp: int, vp: int, m: int, name: str) -> Variant:
    if name == "torch-loopedbfs":
        return _torch_variant(args, pp, vp, m)
    if name in SHARDED:
        return _sharded_variant(args, pp, vp, m, name)
    if name == "stock-G=P-distopt":
        return _stock_distopt_variant(args, pp, vp, m)
    return _megatron_variant(args, pp, vp, m, name)


def _torch_variant(args, pp: int, vp: int, m: int) -> Variant:
    from megatron.core import parallel_state as ps
    from torch.distributed.pipelining import PipelineStage, ScheduleLoopedBFS

    chunks = _chunks(args, pp, vp)
    rank, group = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_group()
    stages = [PipelineStage(StageModule(c, args.seq_length), k * pp + rank, pp * vp, torch.device("cpu"),
                            group=group) for k, c in enumerate(chunks)]
    schedule = ScheduleLoopedBFS(stages, m, loss_fn=masked_ce)
    opt = _adam(args, chunks)
    first, last = any(c.pre_process for c in chunks), any(c.post_process for c in chunks)

    def step(batches: list[dict]) -> list[float]:
        opt.zero_grad()
        inputs = (torch.cat([b["tokens"] for b in batches]),) if first else ()
        kwargs: dict[str, Any] = {}
        losses: list[torch.Tensor] = []
        if last:
            kwargs = {"target": torch.cat([torch.stack([b["labels"], b["loss_mask"].long()], 1) for b in batches]),
                      "losses": losses}
        schedule.step(*inputs, **kwargs)
        _finish(chunks, opt)
        return [float(x.detach()) for x in losses]

    return Variant("torch-loopedbfs", None, chunks, step)


# ------------------------------------------------------------------------------------------------ running
def _microbatches(args, m: int, count: int) -> list[list[dict]]:
    """`count` global batches of Megatron's mock GPT data, this data-parallel rank's M micro-batches each."""
    from megatron.core import parallel_state as ps

    from megatron_bfpp.train.data import global_batch_microbatches, make_microbatch_iterators

    d = ps.get_data_parallel_world_size()
    (it,) = make_microbatch_iterators(seq_length=args.seq_length, vocab_size=args.vocab_size,
                                      global_batch_size=m * args.micro_batch_size * d,
                                      micro_batch_size=args.micro_batch_size, dp_rank=ps.get_data_parallel_rank(),
                                      dp_size=d, seed=args.seed, train_iters=count)
    return [global_batch_microbatches(it, m) for _ in range(count)]


def _timed(step: Callable[[list[dict]], list[float]], batches: list[dict]) -> tuple[float, float, list[float]]:
    """(wall seconds, this rank's CPU seconds, losses) of one step. Wall time runs from a barrier to a barrier:
    the step ends when the slowest rank ends."""
    torch.distributed.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    losses = step(batches)
    c1 = time.process_time()
    torch.distributed.barrier()
    return time.perf_counter() - t0, c1 - c0, losses


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return q[0], statistics.median(values), q[2]


def run_layout(args, pp: int, vp: int) -> list[dict]:
    from megatron.core import parallel_state as ps

    from megatron_bfpp.train import parallel

    parallel.init_parallel(pp, vp, distributed_timeout_seconds=300)
    rows = []
    for m in args.microbatches:
        rows += run_case(args, pp, vp, m)
    ps.destroy_model_parallel()
    return rows


def _measure_bubble(args, variants: list[Variant], data: list[list[dict]]) -> dict[str, dict[str, float]]:
    """Median over --record-rounds recorded rounds of the mean-over-ranks timeline parts, per variant of ours."""
    from megatron_bfpp.runtime import ActionRecorder, set_recorder
    from megatron_bfpp.trace.metrics import iteration_metrics

    out: dict[str, dict[str, float]] = {}
    if args.record_rounds < 1:
        return out
    rank = torch.distributed.get_rank()
    for v in variants:
        if v.name not in OURS:
            continue
        rec = ActionRecorder(rank, use_cuda=False)
        set_recorder(rec)
        rec.enabled = True
        for rnd in range(args.record_rounds):
            rec.iteration = rnd
            _timed(v.step, data[rnd % len(data)])
        set_recorder(None)
        rec.flush()
        gathered: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, [e for e in rec.events])
        events = [e for evs in gathered for e in evs]
        parts: dict[str, list[float]] = {k: [] for k in ("bubble", "bubble_s", "compute_s", "p2p_s", "window_s")}
        for rnd in range(args.record_rounds):
            im = iteration_metrics(events, rnd)
            n = len(im.ranks)
            parts["bubble"].append(im.bubble)
            parts["bubble_s"].append(sum(r.bubble_s for r in im.ranks) / n)
            parts["compute_s"].append(sum(r.compute_s for r in im.ranks) / n)
            parts["p2p_s"].append(im.exposed_p2p_wait_s)
            parts["window_s"].append(im.step_time_s)
        out[v.name] = {k: statistics.median(x) for k, x in parts.items()}
    return out


# ------------------------------------------------------------------------------------------- step boundary
def compute_intervals(events: list[Any], rank: int) -> list[tuple[int, float, float]]:
    """(iteration, start, end) of `rank`'s compute actions (F, B, I, W) among recorded TimelineEvents."""
    return [(e.iteration, e.start, e.end) for e in events if e.rank == rank and e.op in COMPUTE_OPS]


def step_boundaries(intervals: list[tuple[int, float, float]]) -> list[float]:
    """One rank's exposed step boundaries, in seconds: for each step k whose successor k + 1 is recorded, the
    start of the rank's first compute of step k + 1 minus the end of its last compute of step k. `intervals`:
    (iteration, start, end) of the rank's compute intervals."""
    last_end: dict[int, float] = {}
    first_start: dict[int, float] = {}
    for it, start, end in intervals:
        last_end[it] = max(end, last_end.get(it, end))
        first_start[it] = min(start, first_start.get(it, start))
    return [first_start[k + 1] - last_end[k] for k in sorted(last_end) if k + 1 in first_start]


class _ComputeMarks:
    """Compute intervals of a model without the runtime's recorder (stock and torch variants): a zero-length mark
    at the start of every forward of a module with parameters of its own (hooks registered after Megatron's
    DDP's, so after its pre-hook waited for the module's parameter all-gather) and one after every gradient
    accumulated into a parameter (after Megatron's DDP hook on the accumulation node). Their first and last per
    step are the start of the step's first compute and the end of its last."""

    def __init__(self, chunks: list[torch.nn.Module]) -> None:
        self.iteration = 0
        self.marks: list[tuple[int, float, float]] = []
        self._handles: list[Any] = []
        self._nodes: list[Any] = []  # the accumulation nodes must live as long as their hooks
        seen: set[int] = set()
        for c in chunks:
            for mod in c.modules():
                if any(True for _ in mod.parameters(recurse=False)):
                    self._handles.append(mod.register_forward_pre_hook(self._mark))
            for prm in c.parameters():
                if id(prm) in seen or not prm.requires_grad:
                    continue
                seen.add(id(prm))
                node = prm.expand_as(prm).grad_fn.next_functions[0][0]
                self._nodes.append(node)
                self._handles.append(node.register_hook(self._mark))

    def _mark(self, *unused: Any) -> None:
        t = time.time()
        self.marks.append((self.iteration, t, t))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles, self._nodes = [], []


def _measure_boundary(args, variants: list[Variant], data: list[list[dict]]) -> dict[str, list[float]]:
    """Per variant, every rank's median exposed step boundary (seconds) over --boundary-rounds boundaries of
    back-to-back steps (no barrier between them). Returns name -> [rank 0, rank 1, ...] (on every rank)."""
    from megatron_bfpp.runtime import ActionRecorder, set_recorder

    out: dict[str, list[float]] = {}
    if args.boundary_rounds < 1:
        return out
    rank = torch.distributed.get_rank()
    for v in variants:
        ours = v.name in OURS
        rec = ActionRecorder(rank, use_cuda=False) if ours else None
        marks = None if ours else _ComputeMarks(v.chunks)
        if rec is not None:
            set_recorder(rec)
            rec.enabled = True
        torch.distributed.barrier()
        for rnd in range(args.boundary_rounds + 1):
            if rec is not None:
                rec.iteration = rnd
            else:
                marks.iteration = rnd
            v.step(data[rnd % len(data)])
        torch.distributed.barrier()
        if rec is not None:
            set_recorder(None)
            rec.flush()
            intervals = compute_intervals(rec.events, rank)
        else:
            marks.remove()
            intervals = marks.marks
        bounds = step_boundaries(intervals)
        mine = statistics.median(bounds) if bounds else float("nan")
        gathered: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, mine)
        out[v.name] = gathered
    return out


def _optimizer_label(args, name: str) -> str:
    """What steps the variant: Megatron's optimizer surface (ours sharded, stock distributed) or torch's Adam."""
    if name in SHARDED:
        return "sharded-adam"
    if name == "stock-G=P-distopt":
        return "megatron-distopt-adam"
    return args.optimizer


def run_case(args, pp: int, vp: int, m: int) -> list[dict]:
    from megatron.core import parallel_state as ps

    data = _microbatches(args, m, 4)
    variants = [_variant(args, pp, vp, m, name) for name in args.variants]
    wall = torch.zeros(len(variants), args.reps, dtype=torch.float64)
    cpu = torch.zeros(len(variants), args.reps, dtype=torch.float64)
    step0: dict[str, list[float]] = {}
    for rnd in range(args.warmup + args.reps):
        for i, v in enumerate(variants):  # A B C ... in every round: drift is shared by all
            dt, dc, losses = _timed(v.step, data[rnd % len(data)])
            if rnd == 0:
                step0[v.name] = losses
            if rnd >= args.warmup:
                wall[i, rnd - args.warmup], cpu[i, rnd - args.warmup] = dt, dc
    torch.distributed.all_reduce(cpu)  # CPU seconds of all ranks together: the work, without the waiting
    # Step-0 losses from the last stage of the first pipeline (data-parallel rank 0).
    holder = ps.get_data_parallel_rank() == 0 and ps.get_pipeline_model_parallel_rank() == (pp * vp - 1) % pp
    gathered: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, step0 if holder else None)
    losses0 = next(g for g in gathered if g is not None)
    measured = _measure_bubble(args, variants, data)
    boundary = _measure_boundary(args, variants, data)
    names = [v.name for v in variants]
    base = names.index("ours-bf") if "ours-bf" in names else None
    stock = names.index(args.stock_base) if args.stock_base in names else None
    rows = []
    for i, v in enumerate(variants):
        w25, w50, w75 = _quartiles(wall[i].tolist())
        # Paired: each round's time over ours-bf's time in the same round, so drift between rounds cancels.
        r25, r50, r75 = _quartiles((wall[i] / wall[base]).tolist()) if base is not None else ("", "", "")
        s25, s50, s75 = _quartiles((wall[i] / wall[stock]).tolist()) if stock is not None else ("", "", "")
        mb = measured.get(v.name)
        sb = boundary.get(v.name)
        rows.append({"P": pp, "V": vp, "D": ps.get_data_parallel_world_size(), "M": m,
                     "micro_batch_size": args.micro_batch_size, "num_layers": pp * vp * args.layers_per_stage,
                     "hidden_size": args.hidden_size, "seq_length": args.seq_length, "variant": v.name,
                     "group_size": v.group_size if v.group_size is not None else m,
                     "median_ms": 1e3 * w50, "p25_ms": 1e3 * w25, "p75_ms": 1e3 * w75,
                     "ratio_to_ours_bf": w50 / statistics.median(wall[base].tolist()) if base is not None else "",
                     "paired_ratio_median": r50, "paired_ratio_p25": r25, "paired_ratio_p75": r75,
                     "cpu_ms_all_ranks": 1e3 * statistics.median(cpu[i].tolist()),
                     "cpu_ratio_to_ours_bf": (statistics.median(cpu[i].tolist()) / statistics.median(cpu[base].tolist())
                                              if base is not None else ""),
                     "reps": args.reps, "optimizer": _optimizer_label(args, v.name), "step0_loss": statistics.fmean(losses0[v.name]),
                     "step0_losses": losses0[v.name],
                     "paired_ratio_to_stock_median": s50, "paired_ratio_to_stock_p25": s25,
                     "paired_ratio_to_stock_p75": s75,
                     "measured_bubble": mb["bubble"] if mb else "",
                     "measured_bubble_ms": 1e3 * mb["bubble_s"] if mb else "",
                     "measured_compute_ms": 1e3 * mb["compute_s"] if mb else "",
                     "measured_exposed_p2p_ms": 1e3 * mb["p2p_s"] if mb else "",
                     "measured_window_ms": 1e3 * mb["window_s"] if mb else "",
                     "record_rounds": args.record_rounds if mb else 0,
                     "stock_base": args.stock_base if stock is not None else "",
                     "boundary_rounds": args.boundary_rounds if sb else 0,
                     "step_boundary_ms_ranks": ";".join(f"{1e3 * x:.2f}" for x in sb) if sb else "",
                     "step_boundary_ms_max": 1e3 * max(sb) if sb else ""})
    return rows


def check_losses(rows: list[dict], rtol: float = 1e-5) -> tuple[float, list[str]]:
    """Every variant of a layout must compute the same per-micro-batch losses in its first step (same weights,
    same data). Returns the largest relative difference seen and the disagreements beyond rtol."""
    problems, worst = [], 0.0
    for key in sorted({(r["P"], r["V"], r["M"]) for r in rows}):
        group = [r for r in rows if (r["P"], r["V"], r["M"]) == key]
        ref = group[0]["step0_losses"]
        for r in group:
            got = r["step0_losses"]
            if len(got) != len(ref):
                problems.append(f"P={key[0]} V={key[1]}: {r['variant']} returned {len(got)} losses, not {len(ref)}")
                continue
            diff = max((abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, ref)), default=0.0)
            worst = max(worst, diff)
            if diff > rtol:
                problems.append(f"P={key[0]} V={key[1]}: {r['variant']} differs from {group[0]['variant']} "
                                f"by {diff:.2e} (relative) in its first-step losses")
    return worst, problems


def _fmt(value: Any, spec: str = ".2f") -> str:
    return "-" if value == "" else format(value, spec)


def markdown_table(rows: list[dict]) -> str:
    stock_base = next((r["stock_base"] for r in rows if r.get("stock_base")), STOCK_BASE)
    lines = ["| P | V | D | M | variant | G | median step (ms) | p25-p75 (ms) | ratio to ours-bf | "
             f"paired ratio, median [p25-p75] | paired ratio to {stock_base} | CPU ms/step, all ranks | CPU ratio | "
             "measured bubble (of window) | bubble / compute ms | step boundary ms per rank |",
             "|---|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        stock = (f"{r['paired_ratio_to_stock_median']:.2f} [{r['paired_ratio_to_stock_p25']:.2f}-"
                 f"{r['paired_ratio_to_stock_p75']:.2f}]" if r["paired_ratio_to_stock_median"] != "" else "-")
        paired = (f"{r['paired_ratio_median']:.2f} [{r['paired_ratio_p25']:.2f}-{r['paired_ratio_p75']:.2f}]"
                  if r["paired_ratio_median"] != "" else "-")
        bub = f"{r['measured_bubble']:.3f}" if r["measured_bubble"] != "" else "-"
        bc = (f"{r['measured_bubble_ms']:.0f} / {r['measured_compute_ms']:.0f}" if r["measured_bubble"] != ""
              else "-")
        sb = r["step_boundary_ms_ranks"].replace(";", " / ") if r["step_boundary_ms_ranks"] else "-"
        lines.append(f"| {r['P']} | {r['V']} | {r['D']} | {r['M']} | {r['variant']} | {r['group_size']} | "
                     f"{r['median_ms']:.1f} | {r['p25_ms']:.1f}-{r['p75_ms']:.1f} | {_fmt(r['ratio_to_ours_bf'])} | "
                     f"{paired} | {stock} | {r['cpu_ms_all_ranks']:.1f} | {_fmt(r['cpu_ratio_to_ours_bf'])} | {bub} | "
                     f"{bc} | {sb} |")
    return "\n".join(lines)


def worker(args: argparse.Namespace) -> None:
    from megatron_bfpp.train import parallel
    from megatron_bfpp.runtime import set_wait_timeout

    torch.set_num_threads(1)
    set_wait_timeout(300)
    logging.getLogger("megatron").setLevel(logging.ERROR)  # dataset-builder and deprecation chatter
    if not torch.distributed.is_initialized():
        # A CPU benchmark by design (the stock schedule runs through the CPU shim): gloo even where CUDA exists,
        # which init_parallel would otherwise answer with NCCL.
        torch.distributed.init_process_group("gloo", timeout=timedelta(seconds=300))
    warnings.filterwarnings("ignore")
    rows: list[dict] = []
    for pp, vp in args.layouts:
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() % pp:
            raise SystemExit(f"--layouts {pp}x{vp}: world size {torch.distributed.get_world_size()} is not a "
                             f"multiple of P={pp}; change --nproc or --layouts")
        rows += run_layout(args, pp, vp)
    if torch.distributed.get_rank() == 0:
        print(markdown_table(rows))
        worst, problems = check_losses(rows)
        print("first-step per-micro-batch losses: " + (
            f"all variants agree (max relative difference {worst:.1e}): same model, same data" if not problems
            else "DISAGREE, the comparison is void:\n  " + "\n  ".join(problems)))
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
            w.writeheader()
            for r in rows:
                w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items() if k in CSV_FIELDS})
        print(f"wrote {out}")
    parallel.destroy_parallel()
    if torch.distributed.is_initialized():  # the default group created above
        torch.distributed.destroy_process_group()


def _spawned(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    worker(args)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if "RANK" in os.environ:  # under torchrun
        worker(args)
        return 0
    import socket

    import torch.multiprocessing as mp

    for pp, vp in args.layouts:
        if args.nproc % pp:
            raise SystemExit(f"--nproc {args.nproc} is not a multiple of P={pp} (--layouts {pp}x{vp})")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_spawned, args=(args.nproc, port, args), nprocs=args.nproc, start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
