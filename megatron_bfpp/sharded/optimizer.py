"""`ShardedOptimizer`: Adam/AdamW on this rank's fp32 shards of the flat buffers, with Megatron's surface.

Each rank updates only its shard of every chunk's flat buffer (fp32 master weights, fp32 gradients, fp32
Adam moments), using torch's own functional Adam so the numerics are torch's. Tied (replicated) parameters
are updated in full on every rank from their all-reduced gradients. After the update, the master shard is
written back into the model's parameter shard and, for ZeRO-1/2, the parameters are all-gathered.

`step()` follows Megatron's MixedPrecisionOptimizer: unscale and check for inf/nan (fp16; a step with an
overflow is skipped and the loss scale lowered), global gradient-norm clipping across data-, pipeline- and
tensor-parallel ranks, zero counting, update; returns (update_successful, grad_norm, num_zeros_in_grad).
Parameter groups are Megatron's (`wd_mult`, `lr_mult`, `max_lr`, `min_lr`, ... ; no weight decay on biases
and 1-D parameters), so `OptimizerParamScheduler` drives `param_groups[i]['lr' / 'weight_decay']`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch.optim.adam import adam as functional_adam

from megatron.core.optimizer.optimizer import MegatronOptimizer

from . import comm
from .checkpoint import load_megatron_state, loading_sharded_state_dict, saving_sharded_state_dict
from .ddp import ShardedDataParallel, _Bucket, is_expert_parallel
from .driver import StepPlan, link_stats, memory_stats
from .grad_scaler import ConstantGradScaler, make_grad_scaler

_GROUP_KEYS_NOT_SAVED = ("params",)


@dataclass
class _Segment:
    """One parameter's part of this rank's shard (or a whole replicated parameter): what Adam updates."""

    param: torch.nn.Parameter
    chunk: int  # index of the model chunk holding the parameter (what one STEP updates)
    main_param: torch.Tensor  # fp32
    grad: torch.Tensor  # fp32
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    counts_in_norm: bool  # this rank contributes it to the global gradient norm / zero count


class _OptimizerView:
    """What Megatron code reaches through `optimizer.optimizer`: `param_groups` and `state`."""

    def __init__(self, param_groups: list[dict]) -> None:
        self.param_groups = param_groups
        self.state: dict = {}


def default_param_groups(chunks: Sequence[torch.nn.Module], config: Any) -> list[dict]:
    """Megatron's parameter groups for `chunks` (`_get_param_groups` with its standard overrides: no weight
    decay on biases and 1-D parameters, decoupled LR for embeddings when configured)."""
    from megatron.core.optimizer import _get_param_groups, get_standard_config_overrides

    groups = _get_param_groups(list(chunks), config, get_standard_config_overrides(config))
    for g in groups:  # a parameter shared by two chunks of this rank is listed once
        seen: set[int] = set()
        g["params"] = [p for p in g["params"] if not (id(p) in seen or seen.add(id(p)))]
    return groups


def megatron_adam_group_defaults(config: Any, device: torch.device | str = "cpu") -> dict:
    """The hyper-parameters the Adam stock Megatron builds for `config` puts into every parameter group
    (megatron/core/optimizer/__init__.py, `_get_megatron_optimizer_based_on_param_groups`): torch's AdamW, or
    Adam without --decoupled-weight-decay, where TransformerEngine and Apex are missing, else their FusedAdam
    (`adam_w_mode`), built with Megatron's arguments on a placeholder parameter, so that the keys and values are
    those of the installed optimizer (torch's `lr`, `betas`, `eps`, `weight_decay`, `amsgrad`, `maximize`,
    `foreach`, `capturable`, `differentiable`, `fused`, `decoupled_weight_decay`, as its version has them).
    Saved with the groups, they are what stock's Adam reads at its first step after loading the checkpoint."""
    from megatron.core import optimizer as megatron_optimizer

    decoupled = getattr(config, "decoupled_weight_decay", True)
    kwargs: dict[str, Any] = {
        "lr": config.lr,
        "weight_decay": config.weight_decay,
        "betas": (getattr(config, "adam_beta1", 0.9), getattr(config, "adam_beta2", 0.999)),
        "eps": getattr(config, "adam_eps", 1e-8),
    }
    if hasattr(config, "optimizer_cuda_graph"):
        kwargs["capturable"] = config.optimizer_cuda_graph
    if getattr(megatron_optimizer, "USING_PYTORCH_OPTIMIZER", True):
        adam_cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    else:
        adam_cls = megatron_optimizer.Adam
        kwargs["adam_w_mode"] = decoupled
    placeholder = torch.nn.Parameter(torch.zeros(1, device=device))
    group = adam_cls([placeholder], **kwargs).param_groups[0]
    return {k: v for k, v in group.items() if k not in _GROUP_KEYS_NOT_SAVED}


def _is_tp_duplicate(p: torch.nn.Parameter, tp_group, expert_tp_group=None) -> bool:
    """Megatron's `param_is_not_tensor_parallel_duplicate`, negated: expert-parallel parameters are filtered over
    the expert-tensor-parallel group."""
    if getattr(p, "tensor_model_parallel", False):
        return False
    if is_expert_parallel(p) and expert_tp_group is not None:
        tp_group = expert_tp_group
    return comm.group_rank(tp_group) != 0


def _expose_main_param(param: torch.nn.Parameter, main_param: torch.Tensor | None, sharded: bool) -> None:
    """Point a 16-bit parameter at its fp32 master weights the way Megatron's optimizers do, so that what reads
    them (Megatron-LM's `calc_params_l2_norm` under --bf16, megatron/training/utils/common_utils.py
    `_get_param_data`) sees the masters: `main_param` is this rank's piece of the master (None where it
    holds none) with `main_param_sharded` (the norm is then summed over data parallelism), as
    `DistributedOptimizer` sets them (megatron/core/optimizer/distrib_optimizer.py); a replicated
    parameter's whole master, unsharded, as `Float16OptimizerWithFloat16Params`. fp32 parameters are their
    own masters and get nothing, as in Megatron."""
    if param.dtype not in (torch.float16, torch.bfloat16):
        return
    param.main_param = main_param
    param.main_param_sharded = sharded


class ShardedOptimizer(MegatronOptimizer):
    """Mixed-precision sharded Adam/AdamW over `ShardedDataParallel` chunks (one rank's model chunks)."""

    def __init__(
        self,
        chunks: Sequence[ShardedDataParallel],
        config: Any,
        param_groups: list[dict] | None = None,
        grad_stats_groups: Sequence[Any] | None = None,
    ) -> None:
        self.chunks = list(chunks)
        if not self.chunks:
            raise ValueError("ShardedOptimizer needs at least one model chunk")
        for i, c in enumerate(self.chunks):
            if not isinstance(c, ShardedDataParallel):
                raise TypeError(f"model chunk {i} is a {type(c).__name__}: wrap it in ShardedDataParallel first")
        if getattr(config, "optimizer", "adam") != "adam":
            raise ValueError(f"--optimizer {config.optimizer!r} is not supported with --zero-stage: use adam")
        groups = default_param_groups(self.chunks, config) if param_groups is None else param_groups
        for g in groups:
            g.setdefault("wd_mult", 1.0)
            g.setdefault("lr_mult", 1.0)
            g.setdefault("is_decoupled_lr", False)
            g.setdefault("max_lr", config.lr)
            g.setdefault("min_lr", getattr(config, "min_lr", None))
            g.setdefault("lr", g["max_lr"] if g["max_lr"] is not None else config.lr)
            g.setdefault("weight_decay", config.weight_decay * g["wd_mult"])
        self.device = comm.modules_device(self.chunks, self.chunks[0].dp_group)
        # The rest of what the groups of stock Megatron's Adam hold (`betas`, `eps`, ...): saved with them, so that
        # stock Megatron resumes from a checkpoint of a run that started here.
        adam_defaults = megatron_adam_group_defaults(config, self.device)
        for g in groups:
            for k, v in adam_defaults.items():
                g.setdefault(k, v)
        super().__init__(_OptimizerView(groups), config)
        self.is_stub_optimizer = False
        self.stats = link_stats(self.chunks)
        self.grad_scaler: ConstantGradScaler | None = make_grad_scaler(config, self.device)
        self._scale_one = torch.ones(1, dtype=torch.float32, device=self.device)
        first = self.chunks[0]
        self.dp_group = first.dp_group
        self.dp_rank = first.dp_rank
        self.tp_group = first.tp_group
        if grad_stats_groups is None:
            # data parallel x model parallel; without a model-parallel group, tensor x pipeline parallel
            grad_stats_groups = [first.dp_group] + (
                [first.mp_group] if first.mp_group is not None else [first.tp_group, first.pp_group])
        self.grad_stats_groups = [g for g in grad_stats_groups if g is not None and comm.group_size(g) > 1]
        self._step = 0
        self._build_state(groups)

    # -- state layout ----------------------------------------------------------------------------------------

    def _build_state(self, groups: list[dict]) -> None:
        group_of: dict[torch.nn.Parameter, int] = {}
        for gi, g in enumerate(groups):
            for p in g["params"]:
                group_of[p] = gi
        self._segments: list[list[_Segment]] = [[] for _ in groups]
        self._bucket_state: list[tuple[int, _Bucket, dict[str, torch.Tensor]]] = []
        # Where each optimized parameter lives: ("shard", chunk, bucket index, slot) or ("replicated", state).
        self._param_loc: dict[torch.nn.Parameter, tuple] = {}
        for ci, c in enumerate(self.chunks):
            for bi, b in enumerate(c.flat_buffers):
                n = b.pbuf.layout.shard_numel
                st = {
                    "main_param": b.pbuf.make_main_param(),
                    "exp_avg": torch.zeros(n, dtype=torch.float32, device=b.pbuf.device),
                    "exp_avg_sq": torch.zeros(n, dtype=torch.float32, device=b.pbuf.device),
                }
                self._bucket_state.append((ci, b, st))
                for slot in b.pbuf.layout.slots:
                    p = b.pbuf.params[slot.index]
                    self._param_loc[p] = ("shard", ci, bi, slot, st, b)
                    _expose_main_param(p, None, sharded=True)  # replaced below where this rank holds a piece
                # Shards partition each buffer over its own group (expert-data-parallel for expert-parallel
                # parameters); the norm's sum over data x model parallelism then counts every element once.
                for piece in b.pbuf.layout.pieces(b.rank):
                    p = b.pbuf.params[piece.slot.index]
                    if p not in group_of:
                        raise ValueError(f"parameter {c.param_names[p]!r} is in no optimizer parameter group")
                    sl = slice(piece.shard_lo, piece.shard_hi)
                    _expose_main_param(p, st["main_param"][sl], sharded=True)
                    self._segments[group_of[p]].append(_Segment(
                        p, ci, st["main_param"][sl], b.gbuf.main_grad_shard[sl], st["exp_avg"][sl], st["exp_avg_sq"][sl],
                        counts_in_norm=not _is_tp_duplicate(p, self.tp_group, c.expt_tp_group),
                    ))
            for p in c.owned_replicated_params:
                if p not in group_of:
                    raise ValueError(f"parameter {c.param_names[p]!r} is in no optimizer parameter group")
                master = p.data if p.dtype == torch.float32 else p.data.detach().to(torch.float32)
                st = {"main_param": master, "exp_avg": torch.zeros_like(master),
                      "exp_avg_sq": torch.zeros_like(master)}
                self._param_loc[p] = ("replicated", st)
                _expose_main_param(p, master, sharded=False)
                # Counted once: on data-parallel rank 0, not for Megatron's duplicate copy (`shared`).
                counts = (self.dp_rank == 0 and not getattr(p, "shared", False)
                          and not _is_tp_duplicate(p, self.tp_group))
                self._segments[group_of[p]].append(_Segment(
                    p, ci, master.view(-1), p.main_grad.view(-1), st["exp_avg"].view(-1), st["exp_avg_sq"].view(-1),
                    counts_in_norm=counts,
                ))
        # Per chunk, per parameter group: the non-empty segments one STEP of that chunk updates.
        self._segments_by_chunk = [[[s for s in segs if s.chunk == ci and s.main_param.numel()]
                                    for segs in self._segments] for ci in range(len(self.chunks))]

    def _all_segments(self) -> list[_Segment]:
        return [s for segs in self._segments for s in segs]

    def _all_main_grads(self) -> list[torch.Tensor]:
        """Every fp32 gradient this rank owns, whole (shards including padding, replicated grads)."""
        grads = [b.gbuf.main_grad_shard for _, b, _ in self._bucket_state]
        grads += [p.main_grad for c in self.chunks for p in c.owned_replicated_params]
        return grads

    # -- Megatron optimizer surface --------------------------------------------------------------------------

    def get_parameters(self) -> list[torch.nn.Parameter]:
        seen: set[int] = set()
        out = []
        for g in self.param_groups:
            for p in g["params"]:
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients live in the chunks' buffers (zeroed by zero_grad_buffer); drop stray `.grad`s."""
        for p in self.get_parameters():
            p.grad = None

    def get_loss_scale(self) -> torch.Tensor:
        return self._scale_one if self.grad_scaler is None else self.grad_scaler.scale

    def _allreduce_stat(self, t: torch.Tensor, op) -> torch.Tensor:
        for g in self.grad_stats_groups:
            dist.all_reduce(t, op=op, group=g)
        return t

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """fp16: unscale the gradients and report whether any rank found inf/nan (updating the scale)."""
        for c in self.chunks:  # the step's reduces must have landed (finalize waits for them already)
            c.wait_all()
        if self.grad_scaler is None:
            return False
        found_inf = torch.zeros(1, dtype=torch.float32, device=self.device)
        grads = self._all_main_grads()
        if grads:  # torch's foreach ops refuse an empty list: a rank of empty layout stages owns no gradient
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, self.grad_scaler.inv_scale)
        self._allreduce_stat(found_inf, dist.ReduceOp.MAX)
        found = bool(found_inf.item() > 0)
        self.grad_scaler.update(found)
        return found

    @torch.no_grad()
    def get_grad_norm(self) -> float:
        """L2 norm of the whole model's gradient (every element counted once across DP/TP/PP ranks)."""
        sq = torch.zeros(1, dtype=torch.float32, device=self.device)
        for s in self._all_segments():
            if s.counts_in_norm and s.grad.numel():
                sq += torch.sum(s.grad.float() ** 2)
        self._allreduce_stat(sq, dist.ReduceOp.SUM)
        return math.sqrt(sq.item())

    @torch.no_grad()
    def clip_grad_norm(self, clip_grad: float) -> float:
        """Clip like torch.nn.utils.clip_grad_norm_ (coefficient max_norm / (norm + 1e-6), only if < 1)."""
        norm = self.get_grad_norm()
        if clip_grad > 0.0:
            coeff = clip_grad / (norm + 1.0e-6)
            grads = self._all_main_grads()
            if coeff < 1.0 and grads:
                torch._foreach_mul_(grads, coeff)
        return norm

    @torch.no_grad()
    def count_zeros(self) -> int:
        z = torch.zeros(1, dtype=torch.float64, device=self.device)
        for s in self._all_segments():
            if s.counts_in_norm:
                z += s.grad.numel() - torch.count_nonzero(s.grad)
        self._allreduce_stat(z, dist.ReduceOp.SUM)
        return int(z.item())

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        """Update every chunk from its (unscaled, clipped) gradients: the step boundary of the schedule's last
        training run, in its order (STEP a chunk, all-gather its updated parameters, ...), or every chunk in
        order without one."""
        plan = self._take_step_plan()
        self._step += 1
        for kind, chunk, action in plan.entries:
            t = plan.recorder.start() if plan.recorder is not None and action is not None else None
            if kind == "step":
                self._step_chunk(chunk)
            else:
                self._gather_chunk(chunk)
            if t is not None:
                plan.recorder.stop(t, action)
        return True

    def _take_step_plan(self) -> StepPlan:
        """The plan the schedule's last training run placed (used once), or the default order."""
        plan = self.chunks[0].step_plan
        for c in self.chunks:
            c.step_plan = None
        if plan is None:
            return StepPlan.default(self.chunks)
        stepped = sorted(chunk for kind, chunk, _ in plan.entries if kind == "step")
        if stepped != list(range(len(self.chunks))):
            raise ValueError(f"the schedule's step boundary steps model chunks {stepped} of {len(self.chunks)}: "
                             "every chunk must be stepped once")
        return plan

    def _step_chunk(self, chunk: int) -> None:
        """Adam on the chunk's part of every parameter group, then its shards written into the model (STEP)."""
        beta1 = getattr(self.config, "adam_beta1", 0.9)
        beta2 = getattr(self.config, "adam_beta2", 0.999)
        decoupled = bool(getattr(self.config, "decoupled_weight_decay", True))
        foreach = self.device.type == "cuda"
        for g, segs in zip(self.param_groups, self._segments_by_chunk[chunk]):
            if not segs:
                continue
            betas = g.get("betas", (beta1, beta2))
            functional_adam(
                [s.main_param for s in segs], [s.grad for s in segs], [s.exp_avg for s in segs],
                [s.exp_avg_sq for s in segs], [],
                [torch.tensor(float(self._step - 1)) for _ in segs],  # functional Adam increments them
                foreach=foreach, decoupled_weight_decay=decoupled, amsgrad=False,
                beta1=betas[0], beta2=betas[1], lr=g["lr"], weight_decay=g["weight_decay"],
                eps=g.get("eps", getattr(self.config, "adam_eps", 1e-8)), maximize=False,
            )
        self._copy_main_params_to_model_params(chunk)

    def _gather_chunk(self, chunk: int) -> None:
        """All-gather the chunk's updated parameters (GATHER after its STEP): ZeRO-1/2 into the resident buffers
        (waited for by its next forward under --overlap-param-gather, here otherwise); ZeRO-3 into a gathered
        copy kept for the next iteration's first GATHER of it."""
        c = self.chunks[chunk]
        if c.zero_stage == 3:
            c.start_param_gather()
        else:
            c.start_param_sync()

    def _copy_main_params_to_model_params(self, chunk: int) -> None:
        c = self.chunks[chunk]
        for ci, b, st in self._bucket_state:
            if ci == chunk and st["main_param"] is not b.pbuf.shard:
                b.pbuf.shard.copy_(st["main_param"])
        for p in c.owned_replicated_params:
            master = self._param_loc[p][1]["main_param"]
            if master is not p.data:
                p.data.copy_(master)
        c.on_shards_updated()

    @torch.no_grad()
    def step(self):
        found_inf = self.prepare_grads()
        if found_inf:
            self._take_step_plan()  # a skipped step carries nothing out
            return False, None, None
        grad_norm = self.clip_grad_norm(getattr(self.config, "clip_grad", 0.0))
        num_zeros = self.count_zeros() if getattr(self.config, "log_num_zeros_in_grad", False) else None
        ok = self.step_with_ready_grads()
        return ok, grad_norm, num_zeros

    @torch.no_grad()
    def reload_model_params(self, state_dict=None) -> None:
        """The model parameters were changed outside the optimizer: refresh the fp32 master copies."""
        for ci, b, st in self._bucket_state:
            if st["main_param"] is not b.pbuf.shard:
                st["main_param"].copy_(b.pbuf.shard)
        for c in self.chunks:
            for p in c.owned_replicated_params:
                master = self._param_loc[p][1]["main_param"]
                if master is not p.data:
                    master.copy_(p.data)

    # -- state -----------------------------------------------------------------------------------------------

    def _group_hparams(self) -> list[dict]:
        return [{k: v for k, v in g.items() if k not in _GROUP_KEYS_NOT_SAVED} for g in self.param_groups]

    def state_dict(self) -> dict:
        """This rank's optimizer state (loadable at the same data-parallel size and layout only)."""
        return {
            "format": "bfpp-sharded-adam",
            "step": self._step,
            "param_groups": self._group_hparams(),
            "grad_scaler": None if self.grad_scaler is None else self.grad_scaler.state_dict(),
            "dp_size": comm.group_size(self.dp_group),
            "buckets": [
                {"shard_numel": b.pbuf.layout.shard_numel, **{k: v for k, v in st.items()}}
                for _, b, st in self._bucket_state
            ],
            "replicated": [
                self._param_loc[p][1] for c in self.chunks for p in c.owned_replicated_params
            ],
        }

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        if "param_state" in state_dict:  # dist_checkpointing: any of Megatron's Adam formats
            self._step, scaler = load_megatron_state(self.get_parameters(), self._param_loc, self.param_groups,
                                                     state_dict)
            if self.grad_scaler is not None and scaler:
                self.grad_scaler.load_state_dict(scaler)
        else:
            self._load_local_state(state_dict)
        for chunk in range(len(self.chunks)):
            self._copy_main_params_to_model_params(chunk)
        # The all-gathers an update makes without a schedule's plan (ZeRO-3 gathers at its next GATHER).
        for kind, chunk, _ in StepPlan.default(self.chunks).entries:
            if kind == "gather":
                self._gather_chunk(chunk)

    def _load_local_state(self, sd: dict) -> None:
        if sd.get("format") != "bfpp-sharded-adam":
            raise ValueError("not a ShardedOptimizer state dict (expected format 'bfpp-sharded-adam')")
        dp = comm.group_size(self.dp_group)
        if sd["dp_size"] != dp or len(sd["buckets"]) != len(self._bucket_state):
            raise ValueError(
                f"optimizer state was saved at data-parallel size {sd['dp_size']} with {len(sd['buckets'])} "
                f"buffers; this run has {dp} and {len(self._bucket_state)}. Use the distributed checkpoint "
                "format (--ckpt-format torch_dist, i.e. sharded_state_dict) to load at another size"
            )
        for (_, b, st), saved in zip(self._bucket_state, sd["buckets"]):
            if saved["shard_numel"] != b.pbuf.layout.shard_numel:
                raise ValueError("optimizer state shard sizes differ from this model's buffers: "
                                 "use the distributed checkpoint format (sharded_state_dict)")
            for k in ("main_param", "exp_avg", "exp_avg_sq"):
                st[k].copy_(saved[k])
        owned = [p for c in self.chunks for p in c.owned_replicated_params]
        for p, saved in zip(owned, sd["replicated"]):
            for k, v in self._param_loc[p][1].items():
                v.copy_(saved[k])
        self._load_common(sd)

    def _load_common(self, sd: dict) -> None:
        self._step = int(sd["step"])
        saved_groups = sd["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"optimizer state has {len(saved_groups)} parameter groups, this run "
                             f"{len(self.param_groups)}: the weight-decay / LR overrides must match")
        for g, saved in zip(self.param_groups, saved_groups):
            for k, v in saved.items():
                if k not in _GROUP_KEYS_NOT_SAVED:
                    g[k] = v
        if self.grad_scaler is not None and sd.get("grad_scaler"):
            self.grad_scaler.load_state_dict(sd["grad_scaler"])

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, metadata=None, **kwargs):
        """Optimizer state for Megatron's dist_checkpointing in Megatron's own formats (sharded/checkpoint.py):
        saved as its distributed optimizer's `fully_reshardable` model-space state, loadable by stock Megatron
        with or without --use-distributed-optimizer; loaded from that or from stock's plain Adam optimizers, at
        any data-parallel size, P, V and ZeRO stage."""
        if is_loading:
            return loading_sharded_state_dict(self.get_parameters(), self._param_loc, model_sharded_state_dict,
                                              metadata)
        return saving_sharded_state_dict(
            self.get_parameters(), self._param_loc, self._bucket_state, self._step, self._group_hparams(),
            None if self.grad_scaler is None else self.grad_scaler.state_dict(), model_sharded_state_dict, metadata)

    # -- accounting ------------------------------------------------------------------------------------------

    def state_bytes(self) -> int:
        """Bytes of optimizer state held by this rank: Adam moments and separate fp32 master weights."""
        n = 0
        for _, b, st in self._bucket_state:
            n += st["exp_avg"].numel() * 4 + st["exp_avg_sq"].numel() * 4 + b.pbuf.main_param_bytes
        for c in self.chunks:
            for p in c.owned_replicated_params:
                st = self._param_loc[p][1]
                n += st["exp_avg"].numel() * 8
                if st["main_param"] is not p.data:
                    n += st["main_param"].numel() * 4
        return n

    def comm_stats(self) -> dict[str, int]:
        return self.stats.comm_stats()

    def memory_stats(self) -> dict[str, int]:
        return memory_stats(self.chunks, self)

