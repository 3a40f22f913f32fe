"""The trainer: a Megatron-Core GPT trained with megatron_bfpp's schedules and sharded data parallelism.

Run under torchrun (`torchrun --nproc-per-node 4 -m megatron_bfpp.train ...`) or through `bfpp train
--nproc-per-node 4 ...`. Flags are Megatron-LM's (parsed by `megatron.training.arguments`) plus the plugin's
(`--pipeline-schedule`, `--zero-stage`, ...) and the trainer's (`--report-json`, `--timeline-iterations`, ...).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from . import library_warnings, report
from .faults import FaultInjector
from .config import TrainerConfigError, parse_trainer_args

if TYPE_CHECKING:
    from ..schedule import Schedule
    from .machine import CpuClock


def _log(msg: str) -> None:
    print(msg, flush=True)


class Trainer:
    """Builds model, data, optimizer and schedule from parsed args; runs iterations; hands what it recorded to
    `report` (run report, timeline)."""

    def __init__(self, args: argparse.Namespace) -> None:
        from megatron.core import parallel_state as ps

        from . import parallel
        from ..runtime import get_forward_backward_func, set_wait_timeout

        self.args = args
        parallel.init_parallel(
            args.pipeline_model_parallel_size,
            args.virtual_pipeline_model_parallel_size,
            args.tensor_model_parallel_size,
            distributed_timeout_minutes=args.distributed_timeout_minutes,
            distributed_timeout_seconds=args.distributed_timeout_seconds,
        )
        parallel.set_seed(args.seed)
        set_wait_timeout(args.distributed_timeout_seconds or args.distributed_timeout_minutes * 60)
        self.rank = dist.get_rank()
        self.pp_rank, self.pp = parallel.pp_rank(), parallel.pp_size()
        self.dp_rank, self.dp = parallel.dp_rank(), parallel.dp_size()
        self.vp = args.virtual_pipeline_model_parallel_size or 1
        self.num_microbatches = args.global_batch_size // (args.micro_batch_size * self.dp)
        self.is_last_stage = self.pp_rank == self.pp - 1
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.config, self.model, self.optimizer = self._build_model_and_optimizer()
        self.scheduler = self._build_lr_scheduler()
        self.faults = FaultInjector.from_env(self.rank)
        # Resume (--load) before the data iterators exist: they start at the checkpoint's data position.
        self.iteration, self.consumed_samples = self._load_checkpoint()
        self.data_iterators = self._build_data()
        self.forward_backward = get_forward_backward_func(args.schedule_spec)
        self.losses: list[float] = []
        self.skipped_iterations: list[int] = []
        self.loss_scales: list[float] = []
        self.iteration_times: list[float] = []
        self.ps = ps

    # -- building ---------------------------------------------------------------------------------------------

    def _build_model_and_optimizer(self):
        from . import model as model_lib
        from ..sharded.ddp import ShardedDataParallel
        from ..sharded.finalize import finalize_model_grads
        from ..sharded.optimizer import ShardedOptimizer

        a = self.args
        dtype = "bf16" if a.bf16 else "fp16" if a.fp16 else "fp32"
        config = model_lib.make_transformer_config(
            num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
            ffn_hidden_size=a.ffn_hidden_size, num_query_groups=a.num_query_groups if a.group_query_attention else None,
            kv_channels=a.kv_channels, hidden_dropout=a.hidden_dropout, attention_dropout=a.attention_dropout,
            params_dtype=dtype, init_method_std=a.init_method_std, normalization=a.normalization,
            layernorm_epsilon=a.layernorm_epsilon, add_bias_linear=a.add_bias_linear,
            recompute_granularity=a.recompute_granularity, recompute_method=a.recompute_method,
            recompute_num_layers=a.recompute_num_layers, pipeline_model_parallel_size=self.pp,
            virtual_pipeline_model_parallel_size=self.vp if self.vp > 1 else None,
            tensor_model_parallel_size=a.tensor_model_parallel_size,
        )
        chunks = model_lib.build_model_chunks(
            config, vocab_size=a.padded_vocab_size, max_sequence_length=a.max_position_embeddings,
            pp_rank=self.pp_rank, pp_size=self.pp, vp_size=self.vp,
            share_embeddings_and_output_weights=not a.untie_embeddings_and_output_weights, seed=a.seed,
            device=self.device, position_embedding_type=a.position_embedding_type,
        )
        from megatron.core.utils import get_model_config
        from megatron.training.training import get_megatron_ddp_config, get_megatron_optimizer_config

        if a.bf16 or a.fp16:
            chunks = model_lib.float16_chunks(chunks)  # as Megatron-LM's get_model
        config = get_model_config(chunks[0])  # the config the chunks share: the runtime reads hooks from it

        ddp_config = get_megatron_ddp_config(a)
        # train_step checks loss and gradients itself, on every rank (one error naming the ranks), instead of
        # Megatron's per-bucket check through the rerun state machine (sharded.finalize.check_grads).
        ddp_config.check_for_nan_in_grad = False
        # The schedule's buffer bounds, also held by the chunks so that they hold whoever drives them.
        wrapped = [ShardedDataParallel(config, ddp_config, c, zero_stage=a.zero_stage,
                                       weight_buffers=a.bfpp_weight_buffers or 2,
                                       grad_buffers=a.bfpp_grad_buffers or 2) for c in chunks]
        config.finalize_model_grads_func = finalize_model_grads
        optimizer = ShardedOptimizer(wrapped, get_megatron_optimizer_config(a)[0])
        config.grad_scale_func = optimizer.scale_loss  # as Megatron-LM's setup_model_and_optimizer
        return config, wrapped, optimizer

    def _build_lr_scheduler(self):
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        a = self.args
        decay_iters = a.lr_decay_iters or a.train_iters
        return OptimizerParamScheduler(
            self.optimizer, init_lr=a.lr_warmup_init, max_lr=a.lr, min_lr=a.min_lr,
            lr_warmup_steps=a.lr_warmup_iters * a.global_batch_size,
            lr_decay_steps=decay_iters * a.global_batch_size, lr_decay_style=a.lr_decay_style,
            start_wd=a.weight_decay, end_wd=a.weight_decay, wd_incr_steps=a.train_iters * a.global_batch_size,
            wd_incr_style="constant",
        )

    def _build_data(self):
        from .data import make_microbatch_iterators

        a = self.args
        return make_microbatch_iterators(
            seq_length=a.seq_length, vocab_size=a.padded_vocab_size, global_batch_size=a.global_batch_size,
            micro_batch_size=a.micro_batch_size, dp_rank=self.dp_rank, dp_size=self.dp, seed=a.seed,
            train_iters=a.train_iters, data_path=a.data_path or None, num_chunks=self.vp,
            data_cache_path=a.data_cache_path, consumed_samples=self.consumed_samples,
        )

    # -- checkpoints (megatron_bfpp.train.checkpoint) ----------------------------------------------------------------

    def _load_checkpoint(self) -> tuple[int, int]:
        if not self.args.load:
            return 0, 0
        from .checkpoint import load_checkpoint

        log = _log if self.rank == 0 else (lambda msg: None)
        return load_checkpoint(self.args.load, args=self.args, model=self.model, optimizer=self.optimizer,
                               scheduler=self.scheduler, log=log)

    def save_checkpoint(self) -> None:
        from .checkpoint import save_checkpoint

        t0 = time.perf_counter()
        path = save_checkpoint(self.args.save, self.iteration, args=self.args, model=self.model,
                               optimizer=self.optimizer, scheduler=self.scheduler,
                               consumed_samples=self.consumed_samples,
                               before_commit=lambda: self.faults.at(self.iteration, "save"))
        if self.rank == 0:
            _log(f"saved checkpoint {path} (iteration {self.iteration}) in {time.perf_counter() - t0:.2f} s")

    # -- training ---------------------------------------------------------------------------------------------

    def train_step(self) -> tuple[float, bool, float | None]:
        """One iteration, as Megatron-LM's train_step: zero grads, schedule, optimizer step. Returns
        (global-batch lm loss, update_successful, grad_norm)."""
        from .data import gpt_forward_step

        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        store = self.forward_backward(
            forward_step_func=self.faults.wrap_forward_step(gpt_forward_step, self.iteration),
            data_iterator=self.data_iterators, model=self.model,
            num_microbatches=self.num_microbatches, seq_length=self.args.seq_length,
            micro_batch_size=self.args.micro_batch_size, forward_only=False,
        )
        if self.args.check_for_nan_in_loss_and_grad:  # Megatron's semantics: stop before the update
            from .faults import check_numerics

            check_numerics([item["lm loss"] for item in store], self.optimizer._all_main_grads(), self.iteration)
        self.faults.at(self.iteration, "optimizer")
        update_successful, grad_norm, _ = self.optimizer.step()
        if update_successful:
            self.scheduler.step(increment=self.args.global_batch_size)
        return self._global_batch_loss(store), update_successful, grad_norm

    def _model_device(self) -> torch.device:
        """Where the collectives' tensors live: the model's device (CUDA under NCCL, CPU under gloo)."""
        return next(self.model[0].parameters()).device

    def _global_batch_loss(self, store: list[dict]) -> float:
        """lm loss over the global batch (token-weighted, as Megatron's train_step reduces it), on every rank.

        Summed on the model's device (the data- and pipeline-parallel groups are NCCL groups on GPU), read
        back once."""
        total = torch.zeros(2, dtype=torch.float64, device=self._model_device())
        for item in store:
            total += item["lm loss"].detach().to(total.device, torch.float64)
        if self.is_last_stage and self.dp > 1:
            dist.all_reduce(total, group=self.ps.get_data_parallel_group())
        # Everyone in the pipeline learns the loss from the last stage.
        src = dist.get_process_group_ranks(self.ps.get_pipeline_model_parallel_group())[-1]
        dist.broadcast(total, src=src, group=self.ps.get_pipeline_model_parallel_group())
        loss_sum, tokens = total.tolist()
        return loss_sum / tokens if tokens > 0 else float("nan")

    def run(self) -> dict:
        from ..runtime import ActionRecorder, last_schedule, set_recorder
        from . import machine, measured_prediction

        a = self.args
        first = self.iteration + 1
        calibration = measured_prediction.calibration_iterations(first, a.train_iters)
        record_iters = set(a.timeline_iterations) | {a.train_iters} | set(calibration)
        recorder = ActionRecorder(self.rank)
        clock = machine.CpuClock()
        set_recorder(recorder)
        tokens_per_iter = a.global_batch_size * a.seq_length
        if self.iteration >= a.train_iters and self.rank == 0:
            _log(f"nothing to do: the checkpoint is at iteration {self.iteration} >= --train-iters {a.train_iters}")
        saved = True
        while self.iteration < a.train_iters:
            self.iteration += 1
            recorder.enabled = self.iteration in record_iters
            recorder.iteration = self.iteration
            clock.start()
            t0 = time.perf_counter()
            loss, ok, grad_norm = self.train_step()
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            clock.stop()
            self.consumed_samples += a.global_batch_size
            self.losses.append(loss)
            self.iteration_times.append(dt)
            scale = self.optimizer.get_loss_scale()
            self.loss_scales.append(float(scale.item() if torch.is_tensor(scale) else scale))
            if not ok:
                self.skipped_iterations.append(self.iteration)
            if self.rank == 0 and (self.iteration % a.log_interval == 0 or self.iteration == a.train_iters
                                   or not ok):
                _log(self._log_line(loss, dt, tokens_per_iter, grad_norm, ok))
            saved = False
            if a.save and a.save_interval and self.iteration % a.save_interval == 0:
                self.save_checkpoint()
                saved = True
            if a.exit_interval and self.iteration % a.exit_interval == 0:
                if self.rank == 0:
                    _log(f"exiting at iteration {self.iteration} (--exit-interval {a.exit_interval})")
                break
        if a.save and not saved:  # as Megatron-LM: the last iteration is always saved
            self.save_checkpoint()
        set_recorder(None)
        recorder.enabled = False
        recorder.flush()  # the last iteration's step boundary, recorded by the optimizer after the schedule's flush
        if not self.losses:  # resumed at or past --train-iters
            return {}
        sched = last_schedule()
        calibration = [i for i in calibration if i <= self.iteration]  # --exit-interval may stop sooner
        machine_stats = self._machine_stats(clock, calibration, first, sched) if calibration else None
        per_rank = report.gather_rank_stats(self.model, self.optimizer, recorder.events, self.device, a.zero_stage,
                                            machine=machine_stats)
        if self.rank != 0:
            return {}
        return report.publish_run_report(
            a, per_rank, schedule=sched.name if sched else a.pipeline_schedule,
            config=report.run_config(a, pp=self.pp, vp=self.vp, dp=self.dp, microbatches=self.num_microbatches),
            losses=self.losses, first_iteration=first, skipped_iterations=self.skipped_iterations,
            loss_scales=self.loss_scales, iteration_times=self.iteration_times, log=_log,
            ran=sched, calibration=calibration,
        )

    def _machine_stats(self, clock: CpuClock, calibration: list[int], first: int,
                       sched: Schedule | None) -> dict | None:
        """This rank's measurements for the measured prediction (collective): None on every rank where a
        profiled GPU's cost model predicts instead."""
        from ..runtime.forward_backward import last_run_stats
        from ..sim.predict import hardware_for_device
        from ..schedule import Op
        from . import machine

        if hardware_for_device() is not None or sched is None:
            return None
        sends = sum(1 for x in sched.ranks[self.pp_rank] if x.op in (Op.SEND_F, Op.SEND_B))
        pp_ranks = dist.get_process_group_ranks(self.ps.get_pipeline_model_parallel_group())
        return machine.rank_stats(
            self.model, clock=clock, iterations=calibration, first_iteration=first, pp_rank=self.pp_rank,
            pp=self.pp, pp_ranks=pp_ranks, dp_group=self.ps.get_data_parallel_group(), dp_size=self.dp,
            p2p_bytes=last_run_stats().get("pp_send_bytes", 0) / sends if sends else 0.0,
            device=self._model_device())

    def _log_line(self, loss: float, dt: float, tokens: int, grad_norm: float | None, ok: bool) -> str:
        a = self.args
        lr = self.optimizer.param_groups[0]["lr"]
        parts = [
            f" [{time.strftime('%Y-%m-%d %H:%M:%S')}] iteration {self.iteration:8d}/{a.train_iters:8d}",
            f"consumed samples: {self.iteration * a.global_batch_size:12d}",
            f"elapsed time per iteration (ms): {dt * 1e3:.1f}",
            f"throughput (tokens/s): {tokens / dt:.1f}",
            f"learning rate: {lr:.6E}",
            f"global batch size: {a.global_batch_size:5d}",
            f"lm loss: {loss:.6E}",
            f"loss scale: {self.optimizer.get_loss_scale().item() if torch.is_tensor(self.optimizer.get_loss_scale()) else self.optimizer.get_loss_scale():.1f}",
        ]
        if grad_norm is not None:
            parts.append(f"grad norm: {grad_norm:.3f}")
        parts.append(f"number of skipped iterations: {0 if ok else 1:3d}")
        return " | ".join(parts) + " |"

def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rank = int(os.environ.get("RANK", "0"))
    library_warnings.install(rank)  # before Megatron's imports: their warnings once, on rank 0
    try:
        return _main(argv, rank)
    finally:  # an in-process caller (tests) gets the warnings as they were
        library_warnings.uninstall()


def _main(argv: list[str], rank: int) -> int:
    try:
        args = parse_trainer_args(argv)
    except TrainerConfigError as e:  # every rank checks the same flags: the first to report prints
        from .faults import report_config_error

        return report_config_error(e, rank)
    from . import parallel
    from .faults import report_failure

    try:
        Trainer(args).run()
    except Exception as e:  # a failure on any rank: report it, exit non-zero, never hang in teardown
        return report_failure(e, dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0)))
    parallel.destroy_parallel()
    return 0

if __name__ == "__main__":
    sys.exit(main())
