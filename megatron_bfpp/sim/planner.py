"""Configuration planner: search T, P, V, CP, EP, D, b, schedule, group size, ZeRO stage and recomputation, rank the
configurations that fit in memory by simulated throughput, and say why the most promising others failed. What the
search does not vary (how the layers run: sequence parallelism, attention kernel, FP8, overlaps, expert-tensor
parallelism, selective or partial recomputation) is the same in every candidate, as `SearchSpace` fixes it.

The search is exact for the top K and fast: every configuration first gets an upper bound on its throughput
(from compute alone: the busiest rank's F/B time, the P-1 stage forwards before it can start and backwards
after it ends, and the optimizer step; no communication),
candidates are visited best bound first, and the search stops once the K-th best simulated throughput beats
the next bound. Schedules are built once per pipeline shape and shared across configurations.

`stock_space()` (`bfpp plan --stock`) is stock Megatron-Core at its best, the denominator of every "vs Megatron"
ratio the benchmarks report; `stock_schedule` is what stock runs at a given layout.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

from ..schedule import SCHEDULE_NAMES, ScheduleError
from ..schedule.kinds import KINDS, megatron_kind
from .costs import ADAM_BYTES_PER_PARAM, Config, head_times, layer_times, least_stage_times, memory_breakdown, \
    sharded_params
from .hardware import GIB, Hardware
from .layer_costs import embedding_ops
from .layouts import balanced_layouts, climb_layout
from .model import EVEN_STAGES, ModelProfile, Partition, StageSplit, stage_layer_counts
from .predict import Prediction, check_config, config_dict, memory, predict

ZERO_STAGES = (0, 1, 2, 3)
# Context parallelism is searched for long sequences: CP = 2, 4, ... while each CP rank keeps at least this many
# tokens of a sequence (Megatron's recipes use CP = 2 at 8k, more only beyond).
MIN_CP_TOKENS = 4096
STOCK_SCHEDULES = tuple(n for n, k in KINDS.items() if k.megatron_order)  # 1F1B at V = 1, interleaved at V >= 2
STOCK_ZERO_STAGE = 1  # Megatron's distributed optimizer
# Layout refinement (`refine_layout`): the best simulated configurations whose layouts it refines, and the
# simulations it spends on each at most (a climb step on 64 stages tries up to a few hundred moves).
REFINED_CANDIDATES = 3
REFINE_SIMULATIONS = 600
# The next configurations, by simulated step, that try the refined layouts of their pipeline shape.
TRANSFER_CANDIDATES = 20


@dataclass(frozen=True)
class SearchSpace:
    schedules: tuple[str, ...] = SCHEDULE_NAMES
    zero_stages: tuple[int, ...] = ZERO_STAGES
    tp_sizes: tuple[int, ...] | None = None  # None: 1, 2, 4, ... up to a node
    pp_sizes: tuple[int, ...] | None = None  # None: every divisor of the layer count
    vp_sizes: tuple[int, ...] | None = None  # None: every V >= 2 dividing layers / P (looped schedules)
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16)
    recompute: tuple[bool, ...] = (False, True)
    search_group_size: bool = True  # interleaved: P, 2P, 4P, ..., M; breadth-first: M and its divisors kP
    dp_overlap: bool = True
    p2p_overlap: bool = True
    max_microbatches: int = 256  # bounds simulation cost; larger M is reached through larger micro-batches
    w_reruns_input_grad: bool = False  # split-backward cost: see `Config.w_reruns_input_grad`
    w_at_input_grad: bool = False  # and `Config.w_at_input_grad`
    split: StageSplit = EVEN_STAGES  # Megatron-LM's uneven-split flags, for every configuration
    # With the default split: also free layouts (--pipeline-model-parallel-layout) that give the ranks holding the
    # embedding and the output layer fewer decoder layers (`layouts.balanced_layouts`), at any P and V they fill.
    search_layouts: bool = True
    # ... and the best few simulated configurations' layouts refined by moving single layers (`refine_layout`).
    refine_layouts: bool = True
    # Stock Megatron (`stock_space`): its interleaved configurations are also tried with the parameter gather
    # overlapped with the optimizer step. Implies `stock_optimizer`.
    stock: bool = False
    # The optimizer is stock Megatron's, outside the schedule (`Config.stock_optimizer`): `stock_space` and the
    # benchmarks' other Megatron baselines.
    stock_optimizer: bool = False
    cp_sizes: tuple[int, ...] | None = None  # None: 1, 2, 4, ... down to MIN_CP_TOKENS tokens per CP rank
    ep_sizes: tuple[int, ...] | None = None  # None: every divisor of the expert count (MoE), else 1
    layers_per_virtual_stage: tuple[int, ...] | None = None  # --num-layers-per-virtual-pipeline-stage restriction
    # --- fixed in every candidate: how the layers run (`Config`'s fields of the same names)
    etp: int | None = None
    sequence_parallel: bool = True
    attention: str = "flash"
    fp8: str | None = None
    tp_comm_overlap: bool = False
    moe_a2a_overlap: bool = False
    paired_moe_a2a_overlap: bool = False
    recompute_num_layers: int | None = None
    selective_recompute: bool = False
    grad_reduce_bf16: bool = False
    weight_buffers: int = 2
    grad_buffers: int = 2
    # What-if of the cost model, no Megatron-LM flag runs it (the benchmarks' `--what-if output-layer-over-pipeline`):
    # the output layer and loss spread over the P pipeline ranks (`Partition.output_layer_over_pipeline`).
    output_layer_over_pipeline: bool = False

    def __post_init__(self) -> None:
        if self.stock and not self.stock_optimizer:
            object.__setattr__(self, "stock_optimizer", True)  # stock Megatron steps with its own optimizer

    def layer_settings(self) -> dict:
        """The Config fields every candidate shares."""
        return dict(etp=self.etp, sequence_parallel=self.sequence_parallel, attention=self.attention, fp8=self.fp8,
                    tp_comm_overlap=self.tp_comm_overlap, moe_a2a_overlap=self.moe_a2a_overlap,
                    paired_moe_a2a_overlap=self.paired_moe_a2a_overlap,
                    recompute_num_layers=self.recompute_num_layers, selective_recompute=self.selective_recompute,
                    grad_reduce_bf16=self.grad_reduce_bf16, weight_buffers=self.weight_buffers,
                    grad_buffers=self.grad_buffers, output_layer_over_pipeline=self.output_layer_over_pipeline)

    @functools.cached_property
    def _fixed(self) -> dict:
        return self.layer_settings()  # once per space: `config` runs for every candidate enumerated

    def config(self, tp: int, pp: int, vp: int, dp: int, micro_batch_size: int, microbatches: int, schedule: str,
               zero_stage: int, recompute: bool, split: StageSplit, cp: int = 1, ep: int = 1) -> Config:
        """The candidate of this space at these sizes, schedule, ZeRO stage, recomputation and split: everything
        else as the space fixes it (the group size the schedule's default)."""
        fixed = self._fixed
        return Config(tp, pp, vp, dp, micro_batch_size, microbatches, schedule, zero_stage, recompute, None,
                      self.dp_overlap, self.p2p_overlap, w_reruns_input_grad=self.w_reruns_input_grad,
                      w_at_input_grad=self.w_at_input_grad, split=split, stock_optimizer=self.stock_optimizer,
                      cp=cp, ep=ep, **{**fixed, "recompute_num_layers": fixed["recompute_num_layers"] if recompute
                                       else None})

    def cp_choices(self, model: ModelProfile) -> tuple[int, ...]:
        if self.cp_sizes is not None:
            return self.cp_sizes
        out, cp = [1], 2
        while model.seq_length // cp >= MIN_CP_TOKENS and model.seq_length % (2 * cp) == 0:
            out.append(cp)
            cp *= 2
        return tuple(out)

    def ep_choices(self, model: ModelProfile) -> tuple[int, ...]:
        if self.ep_sizes is not None:
            return self.ep_sizes
        return tuple(_divisors(model.num_experts)) if model.is_moe else (1,)


def stock_space(space: SearchSpace = SearchSpace()) -> SearchSpace:
    """`space` narrowed to stock Megatron-Core at its best: its own schedules (1F1B at V = 1, interleaved 1F1B at
    V >= 2 with a micro-batch group size in [P, M], so at M < P only 1F1B: `stock_schedule`), the distributed
    optimizer (ZeRO-1) with overlapped gradient reduce-scatter and parameter all-gather, non-blocking p2p, and
    for the interleaved schedule --overlap-param-gather-with-optimizer-step tried on and off; no ZeRO-2/3, no
    split backward. ValueError when `space` leaves none of it."""
    schedules = tuple(s for s in space.schedules if s in STOCK_SCHEDULES)
    if not schedules:
        raise ValueError(f"stock Megatron runs {' and '.join(STOCK_SCHEDULES)}, none of the schedules searched "
                         f"({', '.join(space.schedules)})")
    if STOCK_ZERO_STAGE not in space.zero_stages:
        raise ValueError(f"stock Megatron at its best uses its distributed optimizer (ZeRO-{STOCK_ZERO_STAGE}), "
                         f"not among the ZeRO stages searched ({', '.join(map(str, space.zero_stages))})")
    return dataclasses.replace(space, schedules=schedules, zero_stages=(STOCK_ZERO_STAGE,), dp_overlap=True,
                               p2p_overlap=True, w_reruns_input_grad=False, w_at_input_grad=False, stock=True,
                               paired_moe_a2a_overlap=False)  # the plugin's paired order is not stock's


STOCK = stock_space()


def stock_schedule(pp: int, vp: int, microbatches: int) -> tuple[str, int]:
    """(schedule, V) that stock Megatron-Core runs on P ranks with M micro-batches where a layout has V stages per
    rank: its own order for V, except that its interleaved schedule refuses a group size outside [P, M]
    (`forward_backward_pipelining_with_interleaving` in megatron/core/pipeline_parallel/schedules.py raises
    "should range in [PP=..., M=...]"), so at M < P it falls back to 1F1B with V = 1."""
    kind = megatron_kind(vp)
    if _group_sizes(kind, pp, microbatches, True):
        return kind, vp
    return megatron_kind(1), 1


@dataclass
class Rejection:
    config: Config
    reason: str
    tflops_upper_bound: float

    def to_dict(self) -> dict:
        return {"config": config_dict(self.config), "reason": self.reason,
                "tflops_per_gpu_upper_bound": self.tflops_upper_bound}


@dataclass
class PlanResult:
    candidates: list[Prediction]  # fitting, best first
    rejected: list[Rejection]  # most promising rejected configurations first
    searched: int
    simulated: int
    notes: list[str] = field(default_factory=list)
    stock: bool = False  # the search was `stock_space`'s
    # (T, P, D, b, M) of the searched layouts where stock cannot interleave (M < P; `stock_schedule`).
    stock_fallback: list[tuple[int, int, int, int, int]] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "candidates": [_candidate_dict(p) for p in self.candidates],
            "rejected": [r.to_dict() for r in self.rejected],
            "searched": self.searched,
            "simulated": self.simulated,
            "notes": self.notes,
            "stock": self.stock,
            "stock_fallback": {
                "rule": STOCK_FALLBACK_RULE,
                "runs_instead": {"pipeline_schedule": megatron_kind(1), "virtual_pipeline_model_parallel_size": 1},
                "layouts": [dict(zip(_LAYOUT_KEYS, lay)) for lay in self.stock_fallback],
            },
        }


STOCK_FALLBACK_RULE = ("Megatron-Core's interleaved schedule needs a micro-batch group size in [P, M] "
                       "(megatron/core/pipeline_parallel/schedules.py), so at M < P stock runs 1F1B with V = 1")
_LAYOUT_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size",
                "micro_batch_size", "num_micro_batches")


def _candidate_dict(p: Prediction) -> dict:
    c = p.config
    stock_kind, stock_vp = stock_schedule(c.pp, c.vp, c.microbatches)
    return {
        "config": config_dict(p.config),
        "tflops_per_gpu": p.tflops_per_gpu,
        "step_time_s": p.step_time_s,
        "step_lower_bound_s": p.step_lower_bound_s,
        # What the layout leaves: the busiest rank's F/B work over the mean rank's, and the step above its bound.
        "rank_load_max_over_mean": p.rank_load_max_over_mean,
        "gap_to_lower_bound_s": p.step_time_s - p.step_lower_bound_s,
        "peak_memory_gib": p.peak_memory_gib,
        "fits": p.fits,
        "mfu": p.mfu,
        "bubble_fraction": p.bubble_fraction,
        "exposed_dp_s": p.exposed_dp_s,
        "exposed_pp_s": p.exposed_pp_s,
        # What stock Megatron-Core runs at this candidate's T, P, D, b and M.
        "stock_at_layout": {"pipeline_schedule": stock_kind, "virtual_pipeline_model_parallel_size": stock_vp,
                            "falls_back": stock_vp != c.vp},
    }


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def stated_group_size(schedule: str, pp: int, m: int, group_size: int | None) -> int | None:
    """The group size a candidate states (`Config.group_size`, a launch's flag): None where it is the schedule's
    default at P and M."""
    return None if group_size == KINDS[schedule].group_size_for(pp, m, None) else group_size


def _group_sizes(schedule: str, pp: int, m: int, search: bool) -> list[int | None]:
    """The group sizes to try: the kind's default alone without `search`; else P, 2P, 4P, ... below M, and M."""
    kind = KINDS[schedule]
    if not kind.takes_group_size:
        return [None]
    # Groups run one after the other are tried at equal sizes (breadth-first-zb: the size also bounds the W lag);
    # Megatron's interleaved groups hold at least P micro-batches and leave a last group of none or at least P.
    if not kind.sequential_groups and m < pp:
        return []
    if not search:
        return [kind.group_size_for(pp, m, None)]
    out, g = [], pp
    while g < m:
        if m % g == 0 or (not kind.sequential_groups and m % g >= pp):
            out.append(g)
        g *= 2
    return out + [m]


class _Bounds:
    """Cheap per-configuration quantities: compute-only step-time bound and memory without activations."""

    def __init__(self, model: ModelProfile, hw: Hardware) -> None:
        self.model, self.hw = model, hw

    def step_lower_bound(self, cfg: Config, part: Partition) -> float:
        """From the stage profiles alone, no schedule built: the computation that any order of `cfg` runs (per
        rank, the last rank's fill, one micro-batch's chain) and an optimizer outside the schedule. Cheap enough
        to rank every configuration before simulating; `engine.step_lower_bound_s` is the tighter bound of a
        built schedule under its full costs (hops and collectives too)."""
        t = least_stage_times(self.hw, part, cfg)  # what the paired order hides of an action taken off
        pp, n = cfg.pp, part.num_stages
        work = [cfg.microbatches * sum(t.forward[s] + t.backward[s] for s in range(r, n, pp)) for r in range(pp)]
        # The last rank cannot start before the forwards of stages 0 .. P-2 ran upstream, and after its last
        # backward theirs still follow downstream: whatever the schedule. With a split backward the rank's own
        # W's may run during that drain, so only the fill counts.
        fill_drain = sum(t.forward[s] + (0.0 if cfg.split_backward else t.backward[s]) for s in range(pp - 1))
        chain = sum(t.forward[s] + t.input_grad[s] for s in range(n))  # one micro-batch through every stage
        if not cfg.optimizer_in_schedule:  # the step waits for the whole optimizer
            shard = max(sharded_params(part, cfg, r) if cfg.zero_stage else part.rank_params(r) for r in range(pp))
            opt = ADAM_BYTES_PER_PARAM * shard / self.hw.memory_bw
        else:  # STEPs may hide behind other work: only the computation is certain
            opt = 0.0
        return max(work[-1] + fill_drain, max(work), chain) + opt

    def static_memory(self, cfg: Config, part: Partition) -> float:
        ranks = range(cfg.pp) if not part.split.even else {0, cfg.pp - 1}  # equal stages: the ends hold the most
        return max(memory_breakdown(part, cfg, r, 0.0)["total"] for r in ranks)


def enumerate_configs(model: ModelProfile, hw: Hardware, gpus: int, global_batch: int,
                      space: SearchSpace) -> tuple[list[Config], list[tuple[Config | None, str]]]:
    """Every configuration of the search space that can run, and (config, reason) for those that cannot."""
    out: list[Config] = []
    bad: list[tuple[Config | None, str]] = []
    g = hw.gpus_per_node
    tps = space.tp_sizes or tuple(t for t in (1, 2, 4, 8, 16) if t <= g)
    split = space.split
    free = free_layouts(space)
    if split.layout is not None:  # the layout's stages, P * V of them
        pps = space.pp_sizes or tuple(_divisors(len(split.layout)))
    elif split.first_pipeline_num_layers is not None or split.last_pipeline_num_layers is not None:
        pps = space.pp_sizes or tuple(range(2, model.num_layers + 1))  # the middle ranks decide: try each P
    elif free:  # a stage per rank at least, the first and last may hold the embedding or the loss alone
        pps = space.pp_sizes or tuple(range(1, model.num_layers + 3))
    else:  # P divides the layers, the embedding and the loss counted where the flags say
        pps = space.pp_sizes or tuple(_divisors(model.num_layers + split.account_for_embedding
                                                + split.account_for_loss))
    vp_sizes = {pp: _vp_sizes(model, pp, split, space.layers_per_virtual_stage, free) for pp in pps}
    fixed = space.layer_settings()
    etp = space.etp
    for tp in tps:
        if g % tp or model.num_heads % tp or model.query_groups % tp or model.hidden_size % tp or gpus % tp:
            bad.append((None, f"T={tp} must divide the {g} GPUs per node, the {model.num_heads} heads, the "
                              f"{model.query_groups} query groups, hidden size {model.hidden_size} and --gpus {gpus}"))
            continue
        for cp in space.cp_choices(model):
            if cp < 1 or model.seq_length % (2 * cp if cp > 1 else 1) or gpus % (tp * cp):
                bad.append((None, f"CP={cp} must split the sequence of {model.seq_length} into 2 x CP chunks and T*CP="
                                  f"{tp * cp} divide --gpus {gpus}"))
                continue
            for pp in pps:
                splits = vp_sizes[pp]
                if gpus % (tp * cp * pp) or not splits:
                    bad.append((None, f"T*CP*P={tp * cp * pp} must divide --gpus {gpus}, and P the {model.num_layers} "
                                      f"layers ({'equally' if space.split.even else 'as the uneven-split flags ask'})"))
                    continue
                dp = gpus // (tp * cp * pp)
                if global_batch % dp:
                    bad.append((None, f"--global-batch-size {global_batch} is not a multiple of D={dp} (T={tp}, "
                                      f"CP={cp}, P={pp})"))
                    continue
                for ep in space.ep_choices(model):
                    if model.is_moe and (model.num_experts % ep or (tp * cp * dp) % (ep * (etp or tp))):
                        bad.append((None, f"EP={ep} must divide the {model.num_experts} experts, and EP x ETP = "
                                          f"{ep * (etp or tp)} the T*CP*D = {tp * cp * dp} ranks of a stage"))
                        continue
                    if not model.is_moe and ep != 1:
                        continue
                    stage_splits = _StageSplits(model, hw, space, fixed, tp, cp, ep) if free else None
                    _layouts(out, bad, model, space, tp, cp, pp, dp, ep, global_batch // dp, splits,
                             stage_splits)
    return out, bad


def free_layouts(space: SearchSpace) -> bool:
    """Whether the search tries free layouts beside Megatron's default split (none fixed by the flags)."""
    return space.search_layouts and space.split.even and space.layers_per_virtual_stage is None


class _StageSplits:
    """The splits tried at one T, CP, EP: Megatron's default (equal stages) where it divides, and the layouts that
    balance the embedding and the output layer at these costs (per b and recomputation; computed once each)."""

    def __init__(self, model: ModelProfile, hw: Hardware, space: SearchSpace, fixed: dict, tp: int, cp: int,
                 ep: int) -> None:
        self.model, self.hw, self.space = model, hw, space
        self.part = Partition(model, tp, 1, 1, EVEN_STAGES, cp=cp, ep=ep, etp=fixed["etp"],
                              sequence_parallel=fixed["sequence_parallel"], attention=fixed["attention"],
                              fp8=fixed["fp8"], tp_comm_overlap=fixed["tp_comm_overlap"])
        self._costs: dict[tuple[int, bool], tuple[float, float, float]] = {}
        self._splits: dict[tuple[int, int, int, bool], list[StageSplit]] = {}

    def costs(self, b: int, recompute: bool) -> tuple[float, float, float]:
        """(mean decoder layer, embedding, output layer and loss): F + B of one micro-batch, a recomputed layer's
        forward included."""
        key = (b, recompute)
        if key not in self._costs:
            m, part = self.model, self.part
            kinds = {m.is_moe_layer(i): i for i in range(m.num_layers)}
            per_kind = {moe: layer_times(self.hw, part, b, i) for moe, i in kinds.items()}
            layer = sum(sum(per_kind[m.is_moe_layer(i)]) + (per_kind[m.is_moe_layer(i)][0] if recompute else 0.0)
                        for i in range(m.num_layers)) / m.num_layers
            emb = embedding_ops(self.hw, part, b)
            self._costs[key] = (layer, emb.forward + emb.backward, sum(head_times(self.hw, part, b)))
        return self._costs[key]

    def splits(self, pp: int, vp: int, b: int, recompute: bool) -> list[StageSplit]:
        key = (pp, vp, b, recompute)
        if key not in self._splits:
            self._splits[key] = self._compute(pp, vp, b, recompute)
        return self._splits[key]

    def _compute(self, pp: int, vp: int, b: int, recompute: bool) -> list[StageSplit]:
        out = []
        try:
            even = stage_layer_counts(self.model.num_layers, pp, vp)
            out.append(EVEN_STAGES)
        except ValueError:
            even = None
        layer, embedding, head = self.costs(b, recompute)
        # Under the what-if every rank holds 1/P of the output layer: the layouts that balance the embedding alone
        # are tried too.
        heads = (head, 0.0) if self.space.output_layer_over_pipeline else (head,)
        for counts in (c for h in heads for c in balanced_layouts(self.model.num_layers, pp, vp, layer, embedding, h)):
            if counts != even and StageSplit(layout=counts) not in out:
                out.append(StageSplit(layout=counts))
        return out


def _layouts(out: list[Config], bad: list[tuple[Config | None, str]], model: ModelProfile, space: SearchSpace,
             tp: int, cp: int, pp: int, dp: int, ep: int, per_dp: int, splits: list[int],
             stage_splits: _StageSplits | None = None) -> None:
    """The configurations of one T, CP, P, D, EP layout: every b, schedule, V, group size, ZeRO stage,
    recomputation and (with `stage_splits`) stage split the space allows."""
    for b in space.micro_batch_sizes:
        if per_dp % b:
            continue
        m = per_dp // b
        for sched in space.schedules:
            if pp == 1 and sched != "1f1b":
                continue  # without a pipeline every schedule is 1F1B
            if not KINDS[sched].virtual_stages:
                vps = [1] if 1 in splits else []
            else:
                vps = [v for v in splits if v >= 2 and (space.vp_sizes is None or v in space.vp_sizes)]
            for vp in vps:
                groups = _group_sizes(sched, pp, m, space.search_group_size)
                for zero in space.zero_stages:
                    # Stock tries Megatron's optimizer-step overlap where its check allows it.
                    gather_options = (False, True) if (space.stock and sched in STOCK_SCHEDULES
                                                       and KINDS[sched].virtual_stages and zero == 1
                                                       and space.dp_overlap) else (False,)
                    for rc, split in ((rc, split) for rc in space.recompute for split in (
                            stage_splits.splits(pp, vp, b, rc) if stage_splits else [space.split])):
                        base = space.config(tp, pp, vp, dp, b, m, sched, zero, rc, split, cp, ep)
                        if m > space.max_microbatches:
                            bad.append((base, f"M={m} micro-batches per step exceeds the search limit "
                                              f"{space.max_microbatches}; a larger micro-batch size covers it"))
                            continue
                        if not groups:
                            bad.append((base, f"{sched} needs M >= P micro-batches (M={m}, P={pp})"))
                            continue
                        for gs in groups:
                            for with_opt in gather_options:
                                out.append(dataclasses.replace(base, group_size=stated_group_size(sched, pp, m, gs),
                                                               param_gather_with_optimizer=with_opt))


def stock_fallback_layouts(configs: list[Config]) -> list[tuple[int, int, int, int, int]]:
    """(T, P, D, b, M) of the layouts among `configs` that split into V >= 2 stages per rank and where stock
    Megatron-Core still runs 1F1B with V = 1 (`stock_schedule`: M < P)."""
    return sorted({(c.tp, c.pp, c.dp, c.micro_batch_size, c.microbatches) for c in configs
                   if c.vp >= 2 and stock_schedule(c.pp, c.vp, c.microbatches)[1] == 1})


def _vp_sizes(model: ModelProfile, pp: int, split: StageSplit,
              layers_per_stage: tuple[int, ...] | None = None, free: bool = False) -> list[int]:
    """Every V for which Megatron-LM splits the layers over P * V stages under these split flags (with
    `layers_per_stage`, only those whose stages hold that many layers, as --num-layers-per-virtual-pipeline-stage
    sets V: layers, the embedding and the loss counted as the flags say, over P * V); with `free` layouts, every V
    whose stages between the first and the last get a layer each."""
    if split.layout is not None:
        return [len(split.layout) // pp] if len(split.layout) % pp == 0 else []
    if free:
        # Per largest stage size k (decoder layers), the fewest stages that hold them: more stages of the same k
        # add hops and leave stages short of k without making the largest smaller. V dividing them evenly too.
        even = set(_vp_sizes(model, pp, split, layers_per_stage))
        fewest = {}
        for v in range(1, (model.num_layers + 2) // pp + 1):
            fewest.setdefault(-(-model.num_layers // (pp * v)), v)
        return sorted(even | set(fewest.values()))
    units = model.num_layers + split.account_for_embedding + split.account_for_loss
    out = []
    for v in range(1, model.num_layers // pp + 2):
        if layers_per_stage is not None and (units % (pp * v) or units // (pp * v) not in layers_per_stage):
            continue
        try:
            stage_layer_counts(model.num_layers, pp, v, split)
        except ValueError:
            continue
        out.append(v)
    return out


def refine_layout(model: ModelProfile, hw: Hardware, best: Prediction, bounds: "_Bounds | None" = None,
                  budget: int = REFINE_SIMULATIONS) -> tuple[Prediction, int]:
    """`best` with its stage layout improved by local search (`layouts.climb_layout` from its layout, equal stages
    written out where it has none: one decoder layer moved at a time while the configuration fits and simulates a
    shorter step), and the simulations spent. The balanced layouts even out each rank's work; where the step is
    decided by the pipeline's fill, the turn and the first stage's collectives at the step boundary (short stages,
    M <= P) the simulator finds better ones (the 52B at 1/8 sequence per GPU: the embedding alone on stage 0 and
    its layer on rank 0's last stage, 2% faster than equal stages)."""
    cfg = best.config
    found = {tuple(cfg.split.layout or stage_layer_counts(model.num_layers, cfg.pp, cfg.vp, cfg.split)): best}

    def step(counts: tuple[int, ...]) -> float | None:
        trial = dataclasses.replace(cfg, split=StageSplit(layout=counts))
        if unfit_reason(model, hw, trial, bounds) is not None:
            return None
        found[counts] = predict(model, hw, trial)
        return found[counts].step_time_s

    counts, _, spent = climb_layout(next(iter(found)), step, best.step_time_s, budget)
    return found[counts], spent


def _refine_best(model: ModelProfile, hw: Hardware, fitting: list[Prediction],
                 bounds: "_Bounds") -> tuple[list[Prediction], int]:
    """`fitting` (best first) with the best `REFINED_CANDIDATES` layouts refined (`refine_layout`) and the next
    `TRANSFER_CANDIDATES` configurations moved to a refined layout of their P and stage count where it simulates
    faster (a layout found for one schedule, ZeRO stage or micro-batch group often suits another), best first
    again; and the simulations spent."""
    spent = 0
    refined = []
    for p in fitting[:REFINED_CANDIDATES]:
        better, used = refine_layout(model, hw, p, bounds)
        refined.append(better)
        spent += used
    found = {(p.config.pp, p.config.split.layout) for p in refined if p.config.split.layout is not None}
    moved = []
    for p in fitting[REFINED_CANDIDATES:REFINED_CANDIDATES + TRANSFER_CANDIDATES]:
        for pp, layout in found:
            if pp != p.config.pp or len(layout) != pp * p.config.vp or layout == p.config.split.layout:
                continue
            trial = dataclasses.replace(p.config, split=StageSplit(layout=layout))
            if unfit_reason(model, hw, trial, bounds) is not None:
                continue
            spent += 1
            q = predict(model, hw, trial)
            if q.step_time_s < p.step_time_s:
                p = q
        moved.append(p)
    out = refined + moved + fitting[REFINED_CANDIDATES + TRANSFER_CANDIDATES:]
    out = list({p.config: p for p in reversed(out)}.values())[::-1]  # two may end at the same configuration
    out.sort(key=plan_rank)
    return out, spent


def plan_rank(p: Prediction) -> tuple[float, bool]:
    """The order of a plan's candidates: fastest first; ties go to the fused schedule, since a split one that
    predicts no more has only extra actions to offer."""
    return -round(p.tflops_per_gpu, 6), p.config.split_backward


def unfit_reason(model: ModelProfile, hw: Hardware, cfg: Config, bounds: _Bounds | None = None) -> str | None:
    """Why `cfg` cannot run on `hw` (its model state or its peak memory exceeds the usable memory, or the
    configuration is refused), or None when it fits. `bounds`: a shared `_Bounds` (its caches) when checking many."""
    usable = hw.usable_memory_bytes
    part = cfg.partition(model)
    static = (bounds or _Bounds(model, hw)).static_memory(cfg, part)
    if static > usable:
        return f"model state alone needs {static / GIB:.1f} GiB > {usable / GIB:.1f} GiB usable on {hw.name}"
    try:
        check_config(model, hw, cfg)
        mem = memory(model, cfg)
    except (ValueError, ScheduleError) as e:
        return str(e)
    peak = max(m["total"] for m in mem)
    if peak > usable:
        worst = max(mem, key=lambda m: m["total"])
        return (f"needs {peak / GIB:.1f} GiB > {usable / GIB:.1f} GiB usable on {hw.name} "
                f"(activations {worst['activations'] / GIB:.1f}, model state "
                f"{(worst['total'] - worst['activations'] - worst['working']) / GIB:.1f})")
    return None


def plan(model: ModelProfile, hw: Hardware, gpus: int, global_batch: int, space: SearchSpace = SearchSpace(),
         top: int = 5) -> PlanResult:
    """The `top` fastest fitting configurations, best first, and the most promising rejected ones."""
    if gpus < 1 or global_batch < 1:
        raise ValueError("--gpus and --global-batch-size must be >= 1")
    if top < 1:
        raise ValueError(f"--top must be >= 1 (got {top})")
    configs, bad = enumerate_configs(model, hw, gpus, global_batch, space)
    fallback = stock_fallback_layouts(configs + [c for c, _ in bad if c is not None])
    bounds = _Bounds(model, hw)
    flops_at = functools.lru_cache(maxsize=None)(lambda tp: model.model_flops_per_sequence(tp) * global_batch)

    def ub(cfg: Config) -> float:
        return flops_at(cfg.tp) / bounds.step_lower_bound(cfg, cfg.partition(model)) / gpus / 1e12

    ranked = sorted(((ub(c), i, c) for i, c in enumerate(configs)), key=lambda x: (-x[0], x[1]))
    rejected = [Rejection(c, why, ub(c)) for c, why in bad if c is not None]
    fitting: list[Prediction] = []
    simulated = 0
    for bound, _, cfg in ranked:
        if len(fitting) >= top and bound < fitting[top - 1].tflops_per_gpu:
            break
        why = unfit_reason(model, hw, cfg, bounds)
        if why is not None:
            rejected.append(Rejection(cfg, why, bound))
            continue
        p = predict(model, hw, cfg)
        simulated += 1
        fitting.append(p)
        fitting.sort(key=plan_rank)
    if free_layouts(space) and space.refine_layouts:
        fitting, spent = _refine_best(model, hw, fitting, bounds)
        simulated += spent
    best = fitting[0].tflops_per_gpu if fitting else 0.0
    rejected.sort(key=lambda r: -r.tflops_upper_bound)
    seen: set[str] = set()  # one entry per distinct reason (e.g. "M >= P" is the same for every ZeRO stage)
    rejected = [r for r in rejected if not (r.reason in seen or seen.add(r.reason))]
    promising = [r for r in rejected if r.tflops_upper_bound > best][:top] or rejected[:top]
    notes = []
    if not fitting:
        # The most promising configurations' reasons first; layout-level reasons only when nothing got that far.
        reasons = list(dict.fromkeys(r.reason for r in rejected))[:3]
        if not reasons:
            reasons = list(dict.fromkeys(why for _, why in bad))[:3]
        notes.append("no configuration fits: " + "; ".join(reasons or ["the search space is empty"]))
    return PlanResult(fitting[:top], promising, len(configs), simulated, notes, space.stock, fallback)


def smallest_lower_bound(model: ModelProfile, hw: Hardware, gpus: int, global_batch: int,
                         space: SearchSpace = SearchSpace()) -> tuple[float, Config] | None:
    """The smallest step lower bound over every configuration of `space` that fits (None if none does): no
    layout searched and no order of its stages steps faster under the cost model. Each configuration's bound is
    the larger of the profile bound (`_Bounds.step_lower_bound`) and the built schedule's
    (`engine.step_lower_bound_s`), both lower bounds of its step; configurations are visited by profile bound, so
    the search stops, exactly, once that passes the smallest found. Where the planner refines layouts, the
    layout of the configuration found is then refined as `plan` refines its candidates', by its bound."""
    from .costs import analytic_costs
    from .engine import step_lower_bound_s
    from .predict import schedule_for

    bounds = _Bounds(model, hw)

    def bound_of(cfg: Config, cheap: float | None = None) -> float:
        part = cfg.partition(model)
        cheap = bounds.step_lower_bound(cfg, part) if cheap is None else cheap
        return max(cheap, step_lower_bound_s(schedule_for(cfg), analytic_costs(hw, part, cfg)))

    configs, _ = enumerate_configs(model, hw, gpus, global_batch, space)
    ranked = sorted(((bounds.step_lower_bound(c, c.partition(model)), i, c) for i, c in enumerate(configs)),
                    key=lambda x: (x[0], x[1]))
    best: tuple[float, Config] | None = None
    for cheap, _, cfg in ranked:
        if best is not None and cheap >= best[0]:
            break
        if unfit_reason(model, hw, cfg, bounds) is not None:
            continue
        bound = bound_of(cfg, cheap)
        if best is None or bound < best[0]:
            best = (bound, cfg)
    if best is not None and free_layouts(space) and space.refine_layouts:
        cfg = best[1]

        def layout_bound(counts: tuple[int, ...]) -> float | None:
            trial = dataclasses.replace(cfg, split=StageSplit(layout=counts))
            return None if unfit_reason(model, hw, trial, bounds) is not None else bound_of(trial)

        start = cfg.split.layout or stage_layer_counts(model.num_layers, cfg.pp, cfg.vp, cfg.split)
        counts, bound, _ = climb_layout(start, layout_bound, best[0], REFINE_SIMULATIONS)
        if counts != tuple(start):
            best = (bound, dataclasses.replace(cfg, split=StageSplit(layout=counts)))
    return best
