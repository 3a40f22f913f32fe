"""Interprets one rank's lowered schedule over its model chunks.

Every decision about order comes from the schedule; this module only carries actions out: compute through
Megatron-Core's own `forward_step` / `backward_step` (same loss scaling, same output deallocation), p2p through
`PipelineP2P`, data-parallel actions through a `DataParallelDriverProtocol`.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
from typing import Any, Callable, Sequence

import torch
from megatron.core.pipeline_parallel.schedules import (
    backward_step,
    check_first_val_step,
    deallocate_output_tensor,
    forward_step,
)

from ..schedule.ir import COMPUTE_OPS, P2P_OPS, Action, Op, Schedule
from .hooks import DataParallelDriverProtocol
from .p2p import PendingTransfer, PipelineP2P
from .recorder import ActionRecorder
from .split_backward import (PendingWeightGrad, backward_input, backward_weight, deferring_weight_grads,
                             delayed_linears, delayed_wgrad_modules, kept_bytes, report_deferral,
                             run_delayed_wgrads, splits_by_deferral)


# Megatron-Core before 0.17 (e.g. the one in Megatron-LM core_v0.16.1) takes the model type before the config.
_BACKWARD_STEP_MODEL_TYPE: tuple = ()
if "model_type" in inspect.signature(backward_step).parameters:
    from megatron.core.enums import ModelType

    _BACKWARD_STEP_MODEL_TYPE = (ModelType.encoder_or_decoder,)


class PipelineError(RuntimeError):
    """A distributed failure while executing a schedule; the message names the rank, step, action and peer."""


class SavedBytesCounter:
    """A saved-tensor pack hook counting the bytes autograd keeps for backward (parameters excluded)."""

    def __init__(self) -> None:
        self.nbytes = 0
        self._seen: set[int] = set()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.is_leaf and t.requires_grad:  # a parameter: not an activation
            return t
        if type(t) is not torch.Tensor:  # wrapper subclasses (e.g. FP8 tensors) have no plain storage to count
            return t
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self._seen:
            self._seen.add(ptr)
            self.nbytes += t.untyped_storage().nbytes()
        # A new alias of the same storage, as autograd saves outputs: Megatron's pseudo-deallocation of a
        # pipeline output (`out.data = ...`) must not reach the copy saved for backward.
        return t.detach()


class ScheduleExecutor:
    def __init__(
        self,
        *,
        schedule: Schedule,
        pp_rank: int,
        model: Sequence[torch.nn.Module],
        forward_step_func: Callable,
        data_iterator: Any,
        config: Any,
        tensor_shape: tuple[int, ...],
        p2p: PipelineP2P,
        driver: DataParallelDriverProtocol,
        collect_non_loss_data: bool = False,
        first_val_step: bool | None = None,
        recorder: ActionRecorder | None = None,
        wait_timeout_s: float | None = None,
        global_rank: int = 0,
        cp_group_size: int = 1,
    ) -> None:
        self.schedule = schedule
        self.actions = schedule.ranks[pp_rank]
        self.pp_rank = pp_rank
        self.model = list(model)
        self.forward_step_func = forward_step_func
        self.data_iterators = self._per_chunk_iterators(data_iterator)
        self.config = config
        self.tensor_shape = tensor_shape
        self.dtype = config.pipeline_dtype or torch.float32
        self.p2p = p2p
        self.driver = driver
        self.collect_non_loss_data = collect_non_loss_data
        self.first_val_step = first_val_step
        self.recorder = recorder
        self.timeout = None if wait_timeout_s is None else datetime.timedelta(seconds=wait_timeout_s)
        self.global_rank = global_rank
        self.cp_group_size = cp_group_size
        self.forward_only = schedule.forward_only
        self.split_backward = any(a.op == Op.I for a in self.actions)
        self.pending_weight_grads: dict[tuple[int, int], PendingWeightGrad] = {}
        # Chunks whose linear layers defer their weight GEMMs to W (the others split on the autograd graph),
        # and the (stage, micro-batch) pairs whose backward is split, whose forwards build deferring nodes.
        self.defers_weight_grads = [self.split_backward and splits_by_deferral(chunk) for chunk in self.model]
        self.split_pairs = schedule.split_pairs(pp_rank)
        # Layers that queue their own weight-gradient GEMMs (TransformerEngine's delay_wgrad_compute): a W runs
        # them, and so does every B on their chunk, right after its backward.
        self.delayed_wgrads = [[] if self.forward_only else delayed_wgrad_modules(chunk) for chunk in self.model]
        # Megatron's pseudo-deallocation of sent outputs, except where the graph split runs (its autograd
        # calls check the output's shape): there outputs stay allocated until their I.
        self.deallocate_by_chunk = [bool(config.deallocate_pipeline_outputs) and (not self.split_backward or d)
                                    for d in self.defers_weight_grads]
        self.last_stage = schedule.num_stages - 1
        self.last_releases = schedule.last_releases(pp_rank)
        self.forward_data_store: list = []
        # On the model's device: the loss function's token count lives there, and finalize reduces it.
        self.total_num_tokens = torch.zeros([], dtype=torch.int, device=p2p.device)
        # (stage, microbatch) -> tensors kept between F and B
        self.inputs: dict[tuple[int, int], torch.Tensor | None] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.input_grads: dict[tuple[int, int], torch.Tensor | None] = {}
        self.local_activation: dict[tuple[int, int], torch.Tensor] = {}  # P = 1 hand-off to stage + 1
        self.receives: dict[Action, PendingTransfer] = {}
        self.sends: dict[Action, PendingTransfer] = {}
        self.step = 0
        # Bytes saved for backward per (stage, microbatch), measured through autograd's saved-tensor hooks
        # (parameters excluded): what the schedule keeps alive between an F and its B.
        self.saved_bytes: dict[tuple[int, int], int] = {}
        self.activation_bytes = 0
        self.peak_activation_bytes = 0

    def _per_chunk_iterators(self, data_iterator: Any) -> list:
        n = len(self.model)
        if isinstance(data_iterator, (list, tuple)):
            if len(data_iterator) != n:
                raise ValueError(f"got {len(data_iterator)} data iterators for {n} model chunks: pass one per chunk")
            return list(data_iterator)
        if n > 1:
            raise ValueError(
                "with several model chunks per rank pass a list with one data iterator per chunk (as Megatron-LM "
                "does for virtual pipeline stages)"
            )
        return [data_iterator]

    # -- helpers -----------------------------------------------------------------------------------------------

    def _fail(self, action: Action, peer: int | None, what: str, err: Exception) -> PipelineError:
        peer_txt = f" from/to rank {peer}" if peer is not None else ""
        return PipelineError(
            f"rank {self.global_rank} (pipeline rank {self.pp_rank}) at step {self.step} {action.text} of "
            f"{self.schedule.name}: {what}{peer_txt} failed: {err}. Check that rank's log: it may have died, "
            "timed out, or be running a different schedule."
        )

    def _wait(self, pending: PendingTransfer, action: Action, what: str) -> None:
        if pending.work is None:
            return
        t = self.recorder.start() if self.recorder else None
        try:
            if self.timeout is not None and self.p2p.host_blocking_waits:
                ok = pending.work.wait(self.timeout)
                if ok is False:
                    raise TimeoutError(f"no completion within {self.timeout.total_seconds():g} s")
            else:
                pending.work.wait()
        except Exception as e:  # gloo/NCCL raise RuntimeError or DistBackendError on timeout or dead peer
            raise self._fail(action, pending.peer, what, e) from e
        pending.work = None
        if self.recorder:
            self.recorder.stop(t, action, wait=True, peer=pending.peer if action.op in (Op.RECV_F, Op.RECV_B) else None)

    def _post(self, group: list[Action]) -> None:
        """Post one p2p action, or one batch of them, exactly as the schedule lists them."""
        ops = []
        for a in group:
            if a.op == Op.SEND_F:
                key, dst = (a.stage, a.microbatch), self.schedule.rank_of(a.stage + 1)
                tensor = self.outputs[key] if not self.forward_only else self.local_activation.pop(key)
                ops.append((a, dst, self.p2p.send_op(tensor, dst, a.channel)))
            elif a.op == Op.SEND_B:
                dst = self.schedule.rank_of(a.stage - 1)
                ops.append((a, dst, self.p2p.send_op(self.input_grads.pop((a.stage, a.microbatch)), dst, a.channel)))
            else:
                src = self.schedule.rank_of(a.stage + 1 if a.op == Op.RECV_B else a.stage - 1)
                ops.append((a, src, self.p2p.recv_op(self.tensor_shape, self.dtype, src, a.channel)))
        try:
            self.p2p.post([op for _, _, op in ops])
        except Exception as e:
            a, peer, _ = ops[0]
            raise self._fail(a, self.p2p.peer(peer), "posting " + " ".join(b.text for b, _, _ in ops), e) from e
        for a, _, (_, pending) in ops:
            (self.receives if a.op in (Op.RECV_F, Op.RECV_B) else self.sends)[a] = pending

    def _reap_sends(self, block: bool = False) -> None:
        """Free pipeline outputs whose sends completed (Megatron deallocates an output once it is sent)."""
        for a in list(self.sends):
            pending = self.sends[a]
            if pending.work is not None and not block and not pending.work.is_completed():
                continue
            self._wait(pending, a, "send")
            del self.sends[a]
            if a.op == Op.SEND_F and not self.forward_only:
                out = self.outputs.get((a.stage, a.microbatch))
                if out is not None:
                    deallocate_output_tensor(out, self.deallocate_by_chunk[self.schedule.chunk_of(a.stage)])

    # -- actions -----------------------------------------------------------------------------------------------

    def run(self) -> list:
        self.driver.start_step(self.forward_only)
        # The step boundary (STEP and the all-gathers it allows) is carried out by the optimizer's step, after
        # the gradient norm: the driver hands it over.
        boundary = self.schedule.step_boundary(self.pp_rank)
        body = self.actions if boundary is None else self.actions[:boundary]
        i = 0
        while i < len(body):
            action = self.actions[i]
            self.step = i
            if action.op in P2P_OPS:
                end = i + 1
                while action.batch is not None and end < len(body) and self.actions[end].batch == action.batch:
                    end += 1
                self._post(self.actions[i:end])
                t = self.recorder.start() if self.recorder else None
                for posted in self.actions[i:end] if self.recorder else ():
                    self.recorder.stop(t, posted)  # when it was posted (metrics split a peer's wait there)
                i = end
                continue
            if action.op in COMPUTE_OPS:
                self._reap_sends()
                getattr(self, "_do_" + action.op.value)(action)  # records its waits and its compute apart
            else:
                t = self.recorder.start() if self.recorder else None
                getattr(self, "_do_" + action.op.value)(action)
                if self.recorder:
                    self.recorder.stop(t, action)
            i += 1
        self.step = len(body)
        self._reap_sends(block=True)
        t = self.recorder.start() if self.recorder else None
        self.driver.finish_step()
        if self.recorder and not self.forward_only:
            self.recorder.stop(t, Action(Op.REDUCE, self.schedule.stages_of(self.pp_rank)[0]), wait=True)
        if boundary is not None:
            self.driver.plan_step([(a, self.schedule.chunk_of(a.stage)) for a in self.actions[boundary:]],
                                  self.recorder)
        if self.inputs or self.outputs or self.receives or self.pending_weight_grads:
            raise PipelineError(
                f"rank {self.global_rank}: schedule {self.schedule.name} left {len(self.outputs)} activations, "
                f"{len(self.receives)} receives and {len(self.pending_weight_grads)} weight gradients unconsumed"
            )
        return self.forward_data_store

    def _wait_params(self, stage: int) -> None:
        """The stage's parameter all-gather must be complete: a data-parallel wait, recorded as one."""
        t = self.recorder.start() if self.recorder else None
        self.driver.wait_params(self.schedule.chunk_of(stage))
        if self.recorder:
            self.recorder.stop(t, Action(Op.GATHER, stage), wait=True)

    def _grad_buffer(self, stage: int) -> None:
        """The stage's gradient buffer must exist (it may wait for an earlier reduce): a data-parallel wait."""
        t = self.recorder.start() if self.recorder else None
        self.driver.before_backward(self.schedule.chunk_of(stage))
        if self.recorder:
            self.recorder.stop(t, Action(Op.REDUCE, stage), wait=True)

    def _do_F(self, a: Action) -> None:
        s, m = a.stage, a.microbatch
        chunk = self.schedule.chunk_of(s)
        self._wait_params(s)
        if s == 0:
            input_tensor = None
        elif self.schedule.pp == 1:
            input_tensor = self.local_activation.pop((s - 1, m)).detach().requires_grad_(not self.forward_only)
        else:
            recv = Action(Op.RECV_F, s, m)
            pending = self.receives.pop(recv)
            self._wait(pending, recv, "receive activation")
            input_tensor = pending.tensor.requires_grad_(not self.forward_only)
        is_first = check_first_val_step(self.first_val_step, self.forward_only, m == 0)
        counter = SavedBytesCounter()
        defer = self.defers_weight_grads[chunk] and (s, m) in self.split_pairs
        t = self.recorder.start() if self.recorder else None
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t), \
                (deferring_weight_grads() if defer else contextlib.nullcontext()):
            output, num_tokens = forward_step(
                self.forward_step_func, self.data_iterators[chunk], self.model[chunk], self.schedule.microbatches,
                input_tensor, self.forward_data_store, self.config, self.cp_group_size, self.collect_non_loss_data,
                None, is_first,
                current_microbatch=m, vp_stage=chunk, is_last_stage=(s == self.last_stage),
            )
        if self.recorder:
            self.recorder.stop(t, a)
        if not self.forward_only:
            self.saved_bytes[(s, m)] = counter.nbytes
            self.activation_bytes += counter.nbytes
            self.peak_activation_bytes = max(self.peak_activation_bytes, self.activation_bytes)
        self.total_num_tokens += num_tokens
        if s < self.last_stage and (self.forward_only or self.schedule.pp == 1):
            # Hand-off to the next stage (same rank) or to the send: a detached alias of the output.
            self.local_activation[(s, m)] = output.detach()
        if not self.forward_only:
            self.inputs[(s, m)] = input_tensor
            self.outputs[(s, m)] = output
            if self.schedule.pp == 1 and s < self.last_stage:
                # Only the output's grad_fn is needed from here on (Megatron's pseudo-deallocation).
                deallocate_output_tensor(output, self.deallocate_by_chunk[chunk])

    def _backward_operands(self, a: Action) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """(input, output, output gradient) of a B or an I, once the output was sent and its gradient came."""
        s, m = a.stage, a.microbatch
        send = Action(Op.SEND_F, s, m)
        if send in self.sends:  # our output must be sent (and freed) before its backward
            self._wait(self.sends.pop(send), send, "send")
            deallocate_output_tensor(self.outputs[(s, m)], self.deallocate_by_chunk[self.schedule.chunk_of(s)])
        if s == self.last_stage:
            output_grad = None
        elif self.schedule.pp == 1:
            output_grad = self.input_grads.pop((s + 1, m))
        else:
            recv = Action(Op.RECV_B, s, m)
            pending = self.receives.pop(recv)
            self._wait(pending, recv, "receive gradient")
            output_grad = pending.tensor
        return self.inputs.pop((s, m)), self.outputs.pop((s, m)), output_grad

    def _do_B(self, a: Action) -> None:
        s, m = a.stage, a.microbatch
        self._wait_params(s)
        self._grad_buffer(s)
        input_tensor, output, output_grad = self._backward_operands(a)
        t = self.recorder.start() if self.recorder else None
        input_grad = backward_step(input_tensor, output, output_grad, *_BACKWARD_STEP_MODEL_TYPE, self.config)
        run_delayed_wgrads(self.delayed_wgrads[self.schedule.chunk_of(s)])
        if self.recorder:
            self.recorder.stop(t, a)
        self.activation_bytes -= self.saved_bytes.pop((s, m), 0)
        if s > 0:
            self.input_grads[(s, m)] = input_grad

    def _do_I(self, a: Action) -> None:
        """Split backward, part 1: the input gradient (what stage - 1 waits for); the graph is kept for W."""
        s, m = a.stage, a.microbatch
        chunk = self.schedule.chunk_of(s)
        self._wait_params(s)
        if Op.I in self.schedule.grad_write_ops:  # fused accumulation writes main_grad inside this backward
            self._grad_buffer(s)
        input_tensor, output, output_grad = self._backward_operands(a)
        t = self.recorder.start() if self.recorder else None
        if self.defers_weight_grads[chunk]:
            with deferring_weight_grads() as deferred, self.driver.input_grad(chunk):
                input_grad = backward_step(input_tensor, output, output_grad, *_BACKWARD_STEP_MODEL_TYPE,
                                           self.config)
            pending = PendingWeightGrad([], deferred=deferred)
        else:
            weights = [p for p in self.model[chunk].parameters() if p.requires_grad]
            input_grad, pending = backward_input(input_tensor, output, output_grad, weights, self.config)
        if self.recorder:
            self.recorder.stop(t, a)
        if pending.deferred is not None:
            if not self.delayed_wgrads[chunk]:
                # The I freed the stage's graph; what stays until the W is its deferred GEMMs' operands. (What
                # TransformerEngine's queues keep is not visible: there the F's bytes count until the W.)
                self.activation_bytes -= self.saved_bytes.pop((s, m), 0)
                self.saved_bytes[(s, m)] = kept_bytes(pending.deferred)
                self.activation_bytes += self.saved_bytes[(s, m)]
            report_deferral(self.model[chunk], len(pending.deferred) + delayed_linears(self.delayed_wgrads[chunk]),
                            f"{self.schedule.name}, model chunk {chunk}", show=self.global_rank == 0)
        self.pending_weight_grads[(s, m)] = pending
        if s > 0:
            self.input_grads[(s, m)] = input_grad

    def _do_W(self, a: Action) -> None:
        """Split backward, part 2: the weight gradients, accumulated into main_grad as a B would."""
        s, m = a.stage, a.microbatch
        if Op.W in self.schedule.weight_ops:
            self._wait_params(s)
        self._grad_buffer(s)
        pending = self.pending_weight_grads.pop((s, m))
        t = self.recorder.start() if self.recorder else None
        backward_weight(pending)
        run_delayed_wgrads(self.delayed_wgrads[self.schedule.chunk_of(s)])
        if self.recorder:
            self.recorder.stop(t, a)
        self.activation_bytes -= self.saved_bytes.pop((s, m), 0)

    def _do_GATHER(self, a: Action) -> None:
        self.driver.gather(self.schedule.chunk_of(a.stage))

    def _do_RELEASE(self, a: Action) -> None:
        self.driver.release(self.schedule.chunk_of(a.stage), last_in_run=self.step in self.last_releases)

    def _do_REDUCE(self, a: Action) -> None:
        self.driver.reduce(self.schedule.chunk_of(a.stage))

