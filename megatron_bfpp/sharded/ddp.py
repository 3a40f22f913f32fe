"""`ShardedDataParallel`: ZeRO-1/2/3 over flat per-chunk buffers, wrapping ONE model chunk like Megatron's DDP.

The wrapper owns the chunk's flat parameter and gradient buffers (one pair per dtype) and the collectives
on them; *when* those collectives run is decided by the schedule (GATHER / RELEASE / REDUCE actions, see
`driver.ShardedDriver`), never by the wrapper itself.

- ZeRO-1: full parameters and full gradients resident. REDUCE reduce-scatters the full gradient buffer into
  this rank's fp32 gradient shard; after the optimizer updated the shard the parameters are all-gathered.
- ZeRO-2: as ZeRO-1, but the full gradient buffer only exists between the first backward that needs it
  (zeroed at `before_backward`) and the completion of its REDUCE; later REDUCEs accumulate into the shard.
- ZeRO-3: additionally the parameters are sharded at rest. GATHER re-allocates the full parameter buffer
  and launches its all-gather, `wait_params` waits for it, RELEASE frees the storage (the parameter tensors
  stay, as views of an empty storage, so autograd graphs that saved them stay valid).

Bounded buffers: the chunks of a rank share a `BufferBudget` (linked by the driver or the optimizer). A full
gradient buffer whose reduce-scatter is in flight is still live memory until that reduce is waited on, so
before a new full gradient buffer is allocated the oldest in-flight reduces are waited on until at most
`grad_buffers` chunks hold one (the schedule's REDUCE placement guarantees the un-reduced ones fit). Under
NCCL that wait only orders the compute stream after the communication stream; the host does not block.

Gradients reach the buffers Megatron-style: each parameter's `main_grad` is a view into the full gradient
buffer and a post-accumulate-grad hook adds `param.grad` into it, so Megatron's `forward_step` /
`backward_step` run unchanged on the wrapped chunk (layers that accumulate into `main_grad` themselves set
`grad_added_to_main_grad`, as with Megatron's DDP).

Tied embeddings (`shared_embedding = True`, possibly the same Parameter in two chunks of one rank) stay
outside the flat buffers, replicated, with a persistent fp32 `main_grad`; `finish_grad_sync` averages them
over data parallelism with an all-reduce and `finalize.finalize_model_grads` sums them over the embedding
group.

Expert-parallel (MoE) parameters (Megatron marks them `allreduce = False`) differ between expert-parallel
ranks, so, as in Megatron's DDP (`expert_parallel_buffers`), they get flat buffers of their own, sharded over
the expert-data-parallel group; the gradients are pre-scaled so that the reduced result is the average over
the whole data-parallel group (each expert saw the tokens of every rank of its expert-parallel group). Both
kinds of buffer of a chunk are gathered, released and reduced at the same schedule actions.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any, Iterator

import torch
import torch.distributed as dist

from megatron.core.distributed import DistributedDataParallel
from megatron.core.distributed.data_parallel_base import _BaseDataParallel

from . import comm
from .buffers import (
    DEFAULT_PARAM_ALIGN,
    DEFAULT_SHARD_ALIGN,
    FlatGradBuffer,
    FlatParamBuffer,
    LiveBufferCounter,
)
from .comm import Pending, RankStats
from .quantized import weight_copy_bytes, weight_copy_caches

ZERO_STAGES = (1, 2, 3)

# Which wrapper owns a parameter (a weak reference in this attribute of the parameter): a parameter lives in
# exactly one flat buffer, and a replicated (tied) parameter has exactly one gradient hook and one
# data-parallel all-reduce, however many chunks hold it.
_OWNER_ATTR = "_bfpp_sharded_owner"


def _delayed_wgrad_owners(module: torch.nn.Module) -> dict[torch.nn.Parameter, torch.nn.Module]:
    """Parameters whose gradients a layer sets itself after a delayed weight-gradient GEMM (TransformerEngine
    marks them `skip_backward_post_hook`), with that layer."""
    owners: dict[torch.nn.Parameter, torch.nn.Module] = {}
    for m in module.modules():
        if callable(getattr(m, "register_wgrad_accumulation_and_reduce_hooks", None)):
            for p in m.parameters():
                if getattr(p, "skip_backward_post_hook", False):
                    owners.setdefault(p, m)
    return owners


def resolve_zero_stage(zero_stage: int | None, ddp_config: Any) -> int:
    z = zero_stage if zero_stage is not None else getattr(ddp_config, "zero_stage", None)
    z = 1 if z is None else z
    if z not in ZERO_STAGES:
        raise ValueError(f"--zero-stage must be 1, 2 or 3 (got {z!r})")
    return int(z)


def resolve_groups(pg_collection: Any) -> dict[str, Any]:
    """dp / tp / pp / mp / embd process groups, and the expert-parallel parameters' expt_dp / expt_tp (None when
    not set up), from a ProcessGroupCollection or Megatron's parallel_state."""
    if pg_collection is not None:
        dp = getattr(pg_collection, "dp_cp", None) or getattr(pg_collection, "dp", None)
        if dp is None:
            raise ValueError("pg_collection needs a data-parallel group: set pg_collection.dp_cp (or .dp)")
        return {
            "dp": dp,
            "tp": getattr(pg_collection, "tp", None),
            "pp": getattr(pg_collection, "pp", None),
            "mp": getattr(pg_collection, "mp", None),
            "embd": getattr(pg_collection, "embd", None),
            "expt_dp": getattr(pg_collection, "expt_dp", None),
            "expt_tp": getattr(pg_collection, "expt_tp", None),
        }
    from megatron.core import parallel_state as ps

    if not (dist.is_initialized() and ps.model_parallel_is_initialized()):
        raise RuntimeError(
            "ShardedDataParallel needs process groups: initialize Megatron's parallel_state "
            "(megatron.core.parallel_state.initialize_model_parallel) or pass "
            "pg_collection=ProcessGroupCollection(dp_cp=<data-parallel group>, ...)"
        )
    return {
        "dp": ps.get_data_parallel_group(with_context_parallel=True),
        "tp": ps.get_tensor_model_parallel_group(),
        "pp": ps.get_pipeline_model_parallel_group(),
        "mp": ps.get_model_parallel_group(),
        "embd": ps.get_embedding_group(check_initialized=False),
        "expt_dp": ps.get_expert_data_parallel_group(check_initialized=False),
        "expt_tp": ps.get_expert_tensor_parallel_group(check_initialized=False),
    }


def is_expert_parallel(param: torch.nn.Parameter) -> bool:
    """Megatron's marker of an expert-parallel (MoE) parameter: it is not all-reduced over data parallelism
    (`allreduce = False`), but over the expert-data-parallel group."""
    return not getattr(param, "allreduce", True)


@contextlib.contextmanager
def gathered_params(chunks, writeback: bool = False) -> Iterator[None]:
    """`full_params` over several chunks: wrap Megatron-LM's save_checkpoint / load_checkpoint with it
    (they read and write the unwrapped model's parameters directly); `writeback=True` for loading."""
    with contextlib.ExitStack() as stack:
        for c in chunks:
            if isinstance(c, ShardedDataParallel):
                stack.enter_context(c.full_params(writeback=writeback))
        yield


class BufferBudget:
    """The live full-size buffers of one rank's chunks, and the bounds the schedule sets on them.

    `weights` counts chunks holding gathered parameters, `grads` chunks holding a full gradient buffer (both
    read from the buffers as they allocate and free). `make_room_for_grads` keeps `grads` within its limit by
    waiting on the oldest in-flight reduce-scatters, whose completion frees their buffers.
    """

    def __init__(self, weight_buffers: int | None = None, grad_buffers: int | None = None) -> None:
        self.weights = LiveBufferCounter(weight_buffers)
        self.grads = LiveBufferCounter(grad_buffers)
        self._inflight: list[tuple["ShardedDataParallel", "_Bucket"]] = []  # oldest first

    def set_limits(self, weight_buffers: int | None, grad_buffers: int | None) -> None:
        self.weights.limit = weight_buffers
        self.grads.limit = grad_buffers

    def on_reduce_launched(self, chunk: "ShardedDataParallel", bucket: "_Bucket") -> None:
        self._inflight.append((chunk, bucket))

    def make_room_for_grads(self, chunk: "ShardedDataParallel") -> None:
        """Before `chunk` allocates a full gradient buffer: wait on the oldest in-flight reduces until the
        new buffer fits in the limit (no wait at all while it fits)."""
        limit = self.grads.limit
        if limit is None:
            return
        # The chunk's own live buffers do not take another slot.
        while self._inflight and self.grads.live - int(self.grads.holds(chunk)) >= limit:
            owner, bucket = self._inflight.pop(0)
            owner._wait_reduces(bucket)

    def forget(self, bucket: "_Bucket") -> None:
        """`bucket`'s reduces were waited on elsewhere: drop it from the in-flight list."""
        self._inflight = [(c, b) for c, b in self._inflight if b is not bucket]

    def merge(self, other: "BufferBudget") -> None:
        self.weights.merge(other.weights)
        self.grads.merge(other.grads)
        self._inflight += other._inflight

    def reset_peaks(self) -> None:
        self.weights.reset_peak()
        self.grads.reset_peak()

    def stats(self) -> dict[str, int | None]:
        """High-water marks in chunks (this step and since construction) and the limits."""
        return {
            "live_weight_buffers": self.weights.live,
            "peak_weight_buffers": self.weights.peak,
            "max_weight_buffers": self.weights.max_peak,
            "weight_buffers_limit": self.weights.limit,
            "live_grad_buffers": self.grads.live,
            "peak_grad_buffers": self.grads.peak,
            "max_grad_buffers": self.grads.max_peak,
            "grad_buffers_limit": self.grads.limit,
            "peak_full_grad_bytes": self.grads.peak_bytes,
        }


class _Bucket:
    """Flat parameter + gradient buffer of one dtype (and kind: dense or expert-parallel) of the chunk, the
    data-parallel group it is sharded over, and the collectives in flight on it."""

    def __init__(self, pbuf: FlatParamBuffer, gbuf: FlatGradBuffer, group: Any, gradient_scaling_factor: float) -> None:
        self.pbuf = pbuf
        self.gbuf = gbuf
        self.group = group  # data-parallel group (expert-data-parallel for expert-parallel parameters)
        self.rank = pbuf.dp_rank  # this rank's shard index in `group`
        self.size = pbuf.layout.dp_size
        self.gradient_scaling_factor = gradient_scaling_factor  # applied to the full buffer before its reduce
        self.gather: Pending | None = None
        self.params_stale = False  # the shard was updated after the last gather
        self.reduces: list[Pending] = []
        # Gradients an I computed while the full gradient buffer was not allocated (see the grad hook).
        self.waiting: dict[torch.nn.Parameter, torch.Tensor] = {}
        self.grad_ready = gbuf.allocated  # full grad buffer allocated, zeroed and accumulating
        self.grads_unreduced = False  # backward wrote into the full buffer since its last reduce
        self.main_grad_has_data = False  # the fp32 shard holds reduced gradients of this step


class ShardedDataParallel(DistributedDataParallel):
    """ZeRO-1/2/3 data-parallel wrapper of one model chunk, constructor-compatible with Megatron's DDP.

    Subclasses Megatron's `DistributedDataParallel` only so that Megatron's `isinstance` checks
    (`unwrap_model`, `train()` wiring the sync hooks) treat it as a DDP; none of the base class's buffers
    are built. `zero_stage` comes from the keyword, else from `ddp_config.zero_stage`, else 1.
    `weight_buffers` / `grad_buffers` bound the rank's live gathered parameter buffers (ZeRO-3) and full
    gradient buffers (ZeRO-2/3), in chunks; the runtime's driver sets them from the schedule too. None: the
    gradient buffers are not bounded by waiting (Megatron's own schedules reduce everything at the end).
    """

    def __init__(
        self,
        config: Any,
        ddp_config: Any,
        module: torch.nn.Module,
        disable_bucketing: bool = False,
        pg_collection: Any = None,
        full_param_layout: Any = None,  # accepted for Megatron-LM's wrap_model_chunks_with_ddp; unused
        *,
        zero_stage: int | None = None,
        shard_align: int = DEFAULT_SHARD_ALIGN,
        param_align: int = DEFAULT_PARAM_ALIGN,
        weight_buffers: int | None = None,
        grad_buffers: int | None = None,
    ) -> None:
        _BaseDataParallel.__init__(self, config=config, module=module)
        self.ddp_config = ddp_config
        self.zero_stage = resolve_zero_stage(zero_stage, ddp_config)
        groups = resolve_groups(pg_collection)
        self.dp_group = groups["dp"]
        self.tp_group = groups["tp"]
        self.pp_group = groups["pp"]
        self.mp_group = groups["mp"]
        self.embd_group = groups["embd"]
        self.expt_dp_group = groups["expt_dp"]
        self.expt_tp_group = groups["expt_tp"]
        self.dp_size = comm.group_size(self.dp_group)
        self.dp_rank = comm.group_rank(self.dp_group)
        self.stats = RankStats()
        # The step boundary the last training run of the schedule placed (driver.StepPlan), shared by the rank's
        # chunks; the optimizer's next step carries it out.
        self.step_plan: Any = None
        if self.zero_stage < 3:
            weight_buffers = None  # parameters are resident: nothing to bound
        if self.zero_stage < 2:
            grad_buffers = None
        self.budget = BufferBudget(weight_buffers, grad_buffers)
        # Set by the driver around an I whose weight GEMMs are deferred (ShardedDriver.input_grad).
        self.holding_grads_for_w = False

        # Attributes Megatron-LM reads on any DDP instance.
        self.force_all_reduce = False
        self.buffers: list = []  # Megatron's _ParamAndGradBuffer lists (none here; see flat_buffers)
        self.expert_parallel_buffers: list = []
        self.bucket_groups: list = []
        self.expert_parallel_bucket_groups: list = []
        self.param_to_bucket_group: dict = {}
        self.use_forward_hook = False
        self.remove_forward_pre_hook_handles: dict = {}
        self.overlap_param_gather_with_optimizer_step = False

        # Gradient averaging over data parallelism, as Megatron's DDP: with average_in_collective off the
        # gradients are pre-scaled by 1/D and summed; per-token losses are scaled later by 1/num_tokens.
        per_token = bool(getattr(config, "calculate_per_token_loss", False))
        self.average_in_collective = bool(getattr(ddp_config, "average_in_collective", False)) and not per_token
        self.gradient_scaling_factor = 1.0 if (per_token or self.average_in_collective) else 1.0 / self.dp_size

        grad_reduce_in_fp32 = bool(getattr(ddp_config, "grad_reduce_in_fp32", False))
        # (dtype, expert-parallel) -> parameters: Megatron's DDP groups its buffers the same way.
        by_key: dict[tuple[torch.dtype, bool], list[tuple[str, torch.nn.Parameter]]] = {}
        self.replicated_params: list[torch.nn.Parameter] = []  # tied params in this chunk (owned or not)
        self.owned_replicated_params: list[torch.nn.Parameter] = []
        self.params_with_grad: list[torch.nn.Parameter] = []
        self.param_names: dict[torch.nn.Parameter, str] = {}
        for name, p in self.module.named_parameters():
            if not p.requires_grad:
                continue
            self.params_with_grad.append(p)
            self.param_names[p] = name
            p.grad_added_to_main_grad = False
            owner_ref = getattr(p, _OWNER_ATTR, None)
            owner = owner_ref() if owner_ref is not None else None
            replicated = bool(getattr(p, "shared_embedding", False))
            if owner is not None and owner is not self:
                if not replicated:
                    raise ValueError(
                        f"parameter {name!r} is already held by another ShardedDataParallel chunk; a parameter "
                        "shared between model chunks must be marked `shared_embedding = True` (Megatron's tied "
                        "embedding marker) so it stays replicated outside the sharded buffers"
                    )
                self.replicated_params.append(p)
                continue
            setattr(p, _OWNER_ATTR, weakref.ref(self))
            if replicated and is_expert_parallel(p):
                raise ValueError(f"parameter {name!r} is both a tied embedding (shared_embedding) and "
                                 "expert-parallel (allreduce = False): it cannot be replicated over data parallelism")
            if replicated:
                self.replicated_params.append(p)
                self.owned_replicated_params.append(p)
            else:
                by_key.setdefault((p.dtype, is_expert_parallel(p)), []).append((name, p))

        self.flat_buffers: list[_Bucket] = []
        self._bucket_of: dict[torch.nn.Parameter, _Bucket] = {}
        for (dtype, expert), named in by_key.items():
            group, scaling = self.dp_group, self.gradient_scaling_factor
            if expert:
                group, scaling = self._expert_group_and_scaling(named[0][0], per_token)
            pbuf = FlatParamBuffer(
                [p for _, p in named], [n for n, _ in named], comm.group_size(group), comm.group_rank(group),
                sharded_at_rest=self.zero_stage == 3, shard_align=shard_align, param_align=param_align,
            )
            grad_dtype = torch.float32 if grad_reduce_in_fp32 else dtype
            gbuf = FlatGradBuffer(pbuf, grad_dtype, resident=self.zero_stage == 1)
            pbuf.attach_counter(self.budget.weights, self)
            gbuf.attach_counter(self.budget.grads, self)
            bucket = _Bucket(pbuf, gbuf, group, scaling)
            self.flat_buffers.append(bucket)
            if pbuf.gathered:  # ZeRO-1/2: full parameters are resident for good
                self.stats.on_gathered(pbuf.full_bytes)
            for _, p in named:
                self._bucket_of[p] = bucket
        for p in self.owned_replicated_params:
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)

        # TransformerEngine's caches of quantized (FP8 / FP4) weight copies, made at a step's first micro-batch.
        self._weight_copy_caches = weight_copy_caches(self.module)

        self._hook_handles = []
        delayed_by = _delayed_wgrad_owners(self.module)
        for p in list(self._bucket_of) + self.owned_replicated_params:
            hook = self._make_grad_hook(p)
            if p in delayed_by:
                # TransformerEngine with delay_wgrad_compute sets these gradients in its backward_dw(), outside
                # autograd, and calls the hooks registered here (as Megatron's DDP registers its own).
                delayed_by[p].register_wgrad_accumulation_and_reduce_hooks(functools.partial(hook, p))
            else:
                self._hook_handles.append(p.register_post_accumulate_grad_hook(hook))

    def _expert_group_and_scaling(self, name: str, per_token: bool) -> tuple[Any, float]:
        """The expert-data-parallel group and the gradient pre-scaling of expert-parallel parameters, as in
        Megatron's DDP: the reduced gradient must be the average over the whole data-parallel group D (each
        expert saw the tokens of the E = D / E_dp ranks of its expert-parallel group), so either pre-scale by 1/D
        and sum over E_dp, or pre-scale by E_dp / D and average over E_dp."""
        group = self.expt_dp_group
        if group is None:
            raise ValueError(
                f"parameter {name!r} is expert-parallel (allreduce = False) but no expert-data-parallel group is "
                "set up: initialize Megatron's parallel_state with --expert-model-parallel-size, or pass "
                "pg_collection.expt_dp"
            )
        if per_token:
            return group, 1.0
        if self.average_in_collective:
            return group, comm.group_size(group) / self.dp_size
        return group, 1.0 / self.dp_size

    # -- gradient accumulation --------------------------------------------------------------------------------

    def _make_grad_hook(self, param: torch.nn.Parameter):
        bucket = self._bucket_of.get(param)

        def hook(p: torch.nn.Parameter) -> None:
            if p.grad is None:
                return
            layer_added = p.grad_added_to_main_grad and not getattr(p, "zero_out_wgrad", False)
            if bucket is not None and not bucket.grad_ready and self.holding_grads_for_w:
                # An I (split backward) computing the gradients it does not defer (norms, biases, the
                # embedding): they wait beside the parameter, accumulated in the buffer's dtype as main_grad
                # would, and the stage's gradient buffer is taken only by its W. A placeholder from a layer
                # that accumulates into main_grad itself (at its W) carries nothing.
                if not layer_added:
                    g = p.grad.to(bucket.gbuf.dtype)
                    waiting = bucket.waiting.get(p)
                    bucket.waiting[p] = g if waiting is None else waiting.add_(g)
                p.grad = None
                return
            if bucket is not None:
                self._prepare_grad_buffer(bucket)  # no-op when before_backward already did it
                bucket.grads_unreduced = True
            if not layer_added:
                p.main_grad.add_(p.grad)
            p.grad = None

        return hook

    def _prepare_grad_buffer(self, b: _Bucket) -> None:
        if b.grad_ready:
            return
        self._wait_reduces(b)  # its memory is still being read by a reduce-scatter
        if self.zero_stage >= 2:
            self.budget.make_room_for_grads(self)
            b.gbuf.alloc_full(zero=True)
        else:
            b.gbuf.full.zero_()  # ZeRO-1: the previous contents were already reduced into the shard
        b.grad_ready = True
        for p, g in b.waiting.items():  # gradients an I left waiting (see the grad hook)
            p.main_grad.add_(g)
            b.grads_unreduced = True
        b.waiting.clear()

    # -- schedule hooks (called through driver.ShardedDriver) ------------------------------------------------

    def before_backward(self) -> None:
        """Before every B on this chunk: a zeroed full-size gradient buffer must exist to accumulate into."""
        for b in self.flat_buffers:
            self._prepare_grad_buffer(b)
            b.grads_unreduced = True

    def start_param_gather(self) -> None:
        """GATHER: (re)allocate the full parameter buffers and launch their all-gather; does not block."""
        for b in self.flat_buffers:
            if b.gather is not None:
                continue
            if b.pbuf.gathered and not b.params_stale:
                continue
            if not b.pbuf.gathered:
                b.pbuf.alloc_full()
                self.stats.on_gathered(b.pbuf.full_bytes)
            b.params_stale = False
            # Freed only after a wait (wait_params, release_params, full_params): no record_stream needed.
            b.gather = comm.all_gather(b.pbuf.full, b.pbuf.shard, b.group, self.stats,
                                       unrecorded=(b.pbuf.full,))

    def wait_params(self) -> None:
        """Before every F/B: block until the parameters are usable (gathering now if nobody asked before)."""
        for b in self.flat_buffers:
            if b.gather is None and (not b.pbuf.gathered or b.params_stale):
                self.start_param_gather()
            if b.gather is not None:
                b.gather.wait()
                b.gather = None

    finish_param_sync = wait_params

    def release_params(self, last_in_run: bool = False) -> None:
        """RELEASE: free the gathered parameter storage (ZeRO-3; no-op for ZeRO-1/2). `last_in_run`: nothing of
        this chunk runs again in this schedule run, so TransformerEngine's quantized weight copies go too
        (`drop_weight_copies`)."""
        if self.zero_stage != 3:
            return
        for b in self.flat_buffers:
            if b.gather is not None:  # gathered but never used: it must land before its memory goes
                b.gather.wait()
                b.gather = None
            if b.pbuf.gathered:
                b.pbuf.free_full()
                self.stats.on_released(b.pbuf.full_bytes)
        if last_in_run:
            self.drop_weight_copies()

    def weight_copy_bytes(self) -> int:
        """Bytes of the quantized (FP8 / FP4) weight copies TransformerEngine's layers of this chunk hold now."""
        return weight_copy_bytes(self._weight_copy_caches)

    def drop_weight_copies(self) -> None:
        """Empty TransformerEngine's caches of quantized weight copies (ZeRO-3, at a stage's last RELEASE of a
        run). They outlive RELEASE otherwise, about 2 bytes per parameter under FP8 (the copy, and on Hopper its
        transpose), until the next step's first micro-batch re-quantizes them. Safe because that is all a copy
        serves: TransformerEngine's get_weight_workspace (module/base.py, 2.8 ... 2.14) builds a missing entry
        from the current weights, as it does itself after a recipe change or for an entry of the wrong usage
        (it deletes them); a backward still running holds its own reference to the copy it saved; and the next
        forward of the stage is micro-batch 0 of a run (schedule/validate.py check_first_microbatch), which
        re-quantizes the weights anyway, the optimizer having changed them. CUDA graphs, which would keep the
        copy's address, are refused under ZeRO-3."""
        for cache in self._weight_copy_caches:
            cache.clear()

    def start_grad_sync(self, *unused) -> None:
        """REDUCE: launch the reduce-scatter of every gradient buffer with new gradients; does not block."""
        for b in self.flat_buffers:
            if not b.grads_unreduced:
                continue
            g = b.gbuf.full
            if b.gradient_scaling_factor != 1.0:
                g.mul_(b.gradient_scaling_factor)
            shard = b.gbuf.main_grad_shard
            if not b.main_grad_has_data and g.dtype == torch.float32:
                out, accumulate = shard, False  # first reduce of the step lands directly in the shard
            else:
                out, accumulate = torch.empty(shard.shape, dtype=g.dtype, device=g.device), True
            b.main_grad_has_data = True
            b.grads_unreduced = False
            b.grad_ready = False
            b.reduces.append(
                # The full buffer is freed in on_done, after the wait: no record_stream (see comm).
                comm.reduce_scatter(out, g, b.group, self.stats, average=self.average_in_collective,
                                    on_done=self._reduce_done(b, out, accumulate), unrecorded=(g,))
            )
            if self.zero_stage >= 2:
                self.budget.on_reduce_launched(self, b)

    def _reduce_done(self, b: _Bucket, out: torch.Tensor, accumulate: bool):
        def done() -> None:
            if accumulate:
                b.gbuf.main_grad_shard.add_(out)
            if self.zero_stage >= 2:
                b.gbuf.free_full()

        return done

    def _wait_reduces(self, b: _Bucket) -> None:
        if not b.reduces:
            return
        while b.reduces:
            b.reduces.pop(0).wait()
        if self.zero_stage >= 2:
            self.budget.forget(b)

    def wait_all(self) -> None:
        """Wait for every collective in flight on this chunk (the end of a schedule run)."""
        for b in self.flat_buffers:
            self._wait_reduces(b)
            if b.gather is not None:
                b.gather.wait()
                b.gather = None

    # -- Megatron DDP surface --------------------------------------------------------------------------------

    def forward(self, *inputs, **kwargs):
        self.wait_params()
        return self.module(*inputs, **kwargs)

    def set_is_first_microbatch(self) -> None:
        """Forwarded to the chunk (Megatron's forward_step calls it on the first micro-batch)."""
        f = getattr(self.module, "set_is_first_microbatch", None)
        if f is not None:
            f()

    def __getattr__(self, name: str):
        # Attributes the wrapper lacks (set_input_tensor, pre_process, shared_embedding_or_output_weight, ...)
        # come from the wrapped chunk, so forward_step functions written for the bare model keep working.
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None:
                raise
            return getattr(module, name)

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient reduction only ever happens at REDUCE (or finish_grad_sync): nothing to turn off."""
        yield

    def finish_grad_sync(self, force_all_reduce: bool | None = False) -> None:
        """Reduce whatever was not reduced yet, wait for all reduces, average replicated grads over DP.

        `force_all_reduce` (Megatron's debugging path that keeps full reduced gradients) is not supported:
        gradients end up sharded whatever it says.
        """
        self.start_grad_sync()
        self.wait_all()
        self._allreduce_replicated_grads()

    def _allreduce_replicated_grads(self) -> None:
        grads = [p.main_grad for p in self.owned_replicated_params]
        if not grads or self.dp_size == 1:
            return
        flat = torch._utils._flatten_dense_tensors(grads)
        if self.gradient_scaling_factor != 1.0:
            flat.mul_(self.gradient_scaling_factor)
        op = dist.ReduceOp.SUM
        comm.all_reduce(flat, self.dp_group, self.stats, op).wait()
        if self.average_in_collective:
            flat.div_(self.dp_size)
        for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(synced)

    def scale_gradients(self, scaling_factor: float) -> None:
        """Scale all gradients (the fp32 shards, unreduced full buffers, replicated grads) by a factor."""
        for b in self.flat_buffers:
            self._wait_reduces(b)
            b.gbuf.main_grad_shard.mul_(scaling_factor)
            if b.grads_unreduced and b.gbuf.allocated:
                b.gbuf.full.mul_(scaling_factor)
        for p in self.owned_replicated_params:
            p.main_grad.mul_(scaling_factor)

    def zero_grad_buffer(self) -> None:
        """Start of a training step: zero every gradient, free ZeRO-2/3 full gradient buffers, reset stats.

        A parameter all-gather still in flight (overlap_param_gather) is left to the next wait_params."""
        for b in self.flat_buffers:
            self._wait_reduces(b)
        for p in self.params_with_grad:
            p.grad_added_to_main_grad = False
        for b in self.flat_buffers:
            if self.zero_stage == 1:
                b.gbuf.full.zero_()
                b.grad_ready = True
            else:
                b.gbuf.free_full()
                b.grad_ready = False
            b.gbuf.main_grad_shard.zero_()
            b.main_grad_has_data = False
            b.grads_unreduced = False
            b.waiting.clear()
        for p in self.owned_replicated_params:
            p.main_grad.zero_()
        self.stats.reset()
        self.budget.reset_peaks()

    def start_param_sync(self, *unused, force_sync: bool = False, force_dispatch: bool = False) -> None:
        """All-gather parameters whose shard changed (after the optimizer step); ZeRO-3: gather everything.

        Waits unless `ddp_config.overlap_param_gather` (then the next `wait_params` / forward waits).
        """
        self.start_param_gather()
        if force_sync or not getattr(self.ddp_config, "overlap_param_gather", False):
            self.wait_params()

    def on_shards_updated(self) -> None:
        """The optimizer wrote new values into the parameter shards: gathered copies are stale."""
        for b in self.flat_buffers:
            if b.gather is not None:
                b.gather.wait()
                b.gather = None
            b.params_stale = True

    def broadcast_params(self) -> None:
        """Make every data-parallel rank hold data-parallel rank 0's parameters.

        ZeRO-3 parameters exist once, spread over the ranks, so they are consistent by construction; only
        replicated parameters and ZeRO-1/2 buffers are broadcast.
        """
        if self.zero_stage != 3:
            self.wait_all()
            for b in self.flat_buffers:
                if b.size > 1:
                    dist.broadcast(b.pbuf.full, src=dist.get_global_rank(b.group, 0), group=b.group)
        if self.dp_size == 1:
            return
        src = dist.get_global_rank(self.dp_group, 0)
        for p in self.owned_replicated_params:
            dist.broadcast(p.data, src=src, group=self.dp_group)

    def enable_forward_pre_hook(self) -> None:
        """Megatron toggles its param-gather pre-hooks around evaluation; `forward` always waits here."""

    def disable_forward_pre_hook(self, param_sync: bool = True) -> None:
        if param_sync:
            self.start_param_sync(force_sync=True)

    def reset_param_sync_dispatch_state(self) -> None:
        pass

    def free_overlap_buffers(self) -> None:
        pass

    # -- full parameters on demand (checkpointing, evaluation outside a schedule) ---------------------------

    @contextlib.contextmanager
    def full_params(self, writeback: bool = False) -> Iterator[None]:
        """Within the block every parameter is gathered; ZeRO-3 buffers gathered here are freed after it.

        With `writeback`, values written into the parameters inside the block (a checkpoint load) are
        copied into this rank's shard first; the optimizer's fp32 master copies must then be refreshed
        (ShardedOptimizer.reload_model_params, or loading the optimizer state).
        """
        was = [b.pbuf.gathered and not b.params_stale for b in self.flat_buffers]
        self.wait_params()
        try:
            yield
        finally:
            if writeback and self.zero_stage == 3:
                for b in self.flat_buffers:
                    lo, hi = b.pbuf.layout.shard_range(b.rank)
                    b.pbuf.shard.copy_(b.pbuf.full[lo:hi])
            if self.zero_stage == 3:
                for b, keep in zip(self.flat_buffers, was):
                    if not keep and b.pbuf.gathered:
                        b.pbuf.free_full()
                        self.stats.on_released(b.pbuf.full_bytes)

    def state_dict(self, prefix: str = "", keep_vars: bool = False, destination=None):
        if self.zero_stage != 3:
            return self.module.state_dict(prefix=prefix, keep_vars=keep_vars, destination=destination)
        with self.full_params():
            sd = self.module.state_dict(prefix=prefix, keep_vars=False)
            sd = type(sd)((k, v.clone() if torch.is_tensor(v) else v) for k, v in sd.items())
        if destination is not None:
            destination.update(sd)
            return destination
        return sd

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False):
        if self.zero_stage != 3:
            return self.module.state_dict_for_save_checkpoint(prefix=prefix, keep_vars=keep_vars)
        with self.full_params():
            sd = self.module.state_dict_for_save_checkpoint(prefix=prefix, keep_vars=False)
            return {k: v.clone() if torch.is_tensor(v) else v for k, v in sd.items()}

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Megatron's sharded state dict of the chunk; under ZeRO-3 its tensors are gathered copies.

        Each copy keeps a reference to its parameter (`_bfpp_param`) so that the optimizer can still find
        the parameter behind every ShardedTensor.
        """
        sd = super().sharded_state_dict(prefix=prefix, sharded_offsets=sharded_offsets, metadata=metadata)
        if self.zero_stage != 3:
            return sd
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        with self.full_params():
            for sh in nested_values(sd):
                if isinstance(sh, ShardedTensor) and isinstance(sh.data, torch.nn.Parameter) \
                        and sh.data in self._bucket_of:
                    param = sh.data
                    sh.data = param.detach().clone()
                    sh.data._bfpp_param = param
        return sd

    def load_state_dict(self, state_dict, strict: bool = True):
        with self.full_params(writeback=True):
            return self.module.load_state_dict(state_dict, strict=strict)

    # -- accounting ------------------------------------------------------------------------------------------

    def memory_stats(self) -> dict[str, int]:
        """Bytes resident now: parameters, gradients (full buffers, fp32 shards, replicated main_grads), and
        TransformerEngine's quantized weight copies (`fp8_weight_copy_bytes`)."""
        param_bytes = grad_bytes = 0
        for b in self.flat_buffers:
            if b.pbuf.gathered:
                param_bytes += b.pbuf.full_bytes
            if self.zero_stage == 3:
                param_bytes += b.pbuf.shard_bytes
            if b.gbuf.allocated:
                grad_bytes += b.gbuf.full_bytes
            grad_bytes += b.gbuf.shard_bytes
        for p in self.owned_replicated_params:
            param_bytes += p.numel() * p.element_size()
            grad_bytes += p.main_grad.numel() * p.main_grad.element_size()
        return {"param_bytes": param_bytes, "grad_bytes": grad_bytes, "fp8_weight_copy_bytes": self.weight_copy_bytes()}
