"""`install(args)`: validate, then rebind the names Megatron-LM's training loop reaches the schedule, the
data-parallel wrapper and the optimizer through; `uninstall()` restores them.

Nothing is rebound until every check passed and every replacement imported, so a failed install leaves
Megatron untouched.

A split-backward schedule with TransformerEngine layers (recent enough, see `te_delayed_wgrad_blocker`) also
sets `args.delay_wgrad_compute` (read by Megatron-LM into the model and DDP configs) and lets
`TransformerConfig.__post_init__` accept it on dense models, so the layers queue their weight-gradient GEMMs
for the schedule's W's.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import os
import sys
import warnings
from typing import Any, Callable

from . import compat
from ..schedule.kinds import SPLIT_BACKWARD_SCHEDULES
from .validation import PluginConfig, validate_args


class Installation:
    """What `install` put in place: the names it rebound, each with its original value, and its configuration.
    The process has one, `installation`; `install`, `uninstall`, `installed_config` and `is_installed` use it."""

    def __init__(self) -> None:
        # (module object, attribute, original value) for everything rebound, in order; restored in reverse.
        self._rebound: list[tuple[Any, str, Any]] = []
        self.config: PluginConfig | None = None

    def apply(self, plan: list[tuple[Any, str, Any]], cfg: PluginConfig) -> None:
        """Rebind each (module, attribute) of `plan` to its value and remember `cfg`, in place of any previous
        installation. `plan` is resolved in full beforehand: setting the names cannot fail halfway."""
        self.remove()
        for mod, attr, value in plan:
            self._rebound.append((mod, attr, getattr(mod, attr, None)))
            setattr(mod, attr, value)
        self.config = cfg

    def remove(self) -> PluginConfig | None:
        """Restore every rebound name and forget the configuration; returns the configuration removed."""
        while self._rebound:
            mod, attr, original = self._rebound.pop()
            setattr(mod, attr, original)
        cfg, self.config = self.config, None
        return cfg

    def rebinds(self, mod: Any, attr: str) -> bool:
        """Whether this installation set `attr` of `mod`."""
        return any(m is mod and a == attr for m, a, _ in self._rebound)

    def rebound(self) -> list[tuple[Any, str]]:
        """(module, attribute) of every rebound name, in the order they were set."""
        return [(m, a) for m, a, _ in self._rebound]


installation = Installation()


def installed_config() -> PluginConfig | None:
    """The configuration of the current install, or None."""
    return installation.config


def _log(message: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"megatron_bfpp: {message}", flush=True)


def _accepted(func: Callable, **kwargs: Any) -> dict[str, Any]:
    """The subset of `kwargs` that `func` takes (the runtime may grow options; pass what it understands)."""
    params = inspect.signature(func).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def _te_version() -> str | None:
    """The installed TransformerEngine's version, or None."""
    try:
        from megatron.core.utils import get_te_version

        version = get_te_version()
    except ImportError:
        return None
    return None if str(version) == "0.0.0" else str(version)  # Megatron's answer when it is not importable


# TransformerEngine before 2.7 (2.3-2.6) can queue weight GEMMs but has no wgrad_accumulation_and_reduce_hooks and
# marks no parameter skip_backward_post_hook: the gradients its backward_dw() sets (biases; unfused weights) never
# reach main_grad, so they would silently never train.
TE_MIN_DELAYED_WGRAD = "2.7.0"


def te_delayed_wgrad_blocker(args: argparse.Namespace) -> str | None:
    """Why TransformerEngine layers cannot delay their weight gradients to W with these arguments (None: they
    can): >= 2.7 (TE_MIN_DELAYED_WGRAD), and Megatron-LM's own requirement of >= 2.8 with overlap_grad_reduce."""
    needed = TE_MIN_DELAYED_WGRAD
    if getattr(args, "overlap_grad_reduce", False):
        needed = "2.8.0"  # Megatron-LM's requirement for their gradient hooks with the overlapped reduce
    from packaging.version import Version  # a megatron-core dependency

    version = _te_version()
    if version is None or Version(version) < Version(needed):
        return f"delayed weight gradients need TransformerEngine >= {needed} here (found {version or 'none'})"
    if getattr(args, "tp_comm_overlap", False):
        return "TransformerEngine cannot delay weight gradients with --tp-comm-overlap (userbuffers)"
    return None


def check_requested_delay(args: argparse.Namespace, cfg: PluginConfig) -> None:
    """--delay-wgrad-compute given on the command line under the plugin's schedules: refused where the
    TransformerEngine layers cannot delay correctly (ConfigError naming the flag and the fix)."""
    from .validation import ConfigError

    ours = installation.rebinds(args, "delay_wgrad_compute")  # set by our install
    if not cfg.uses_runtime or not getattr(args, "delay_wgrad_compute", False) or ours:
        return
    blocker = te_delayed_wgrad_blocker(args)
    if blocker is None:
        return
    from packaging.version import Version

    version = _te_version()
    why = ""
    if version is not None and Version(version) < Version(TE_MIN_DELAYED_WGRAD):
        why = (" (TransformerEngine 2.3-2.6 has no weight-gradient hooks: the gradients its backward_dw() sets would "
               "never reach main_grad, and those parameters would not train)")
    raise ConfigError(
        f"--delay-wgrad-compute: {blocker}{why}. Upgrade TransformerEngine, or drop --delay-wgrad-compute (the "
        "plugin sets it itself for split-backward schedules wherever TransformerEngine can delay)")


def delays_te_wgrads(args: argparse.Namespace, cfg: PluginConfig) -> bool:
    """Whether the install builds TransformerEngine layers with delay_wgrad_compute (split schedules only)."""
    return (cfg.pipeline_schedule in SPLIT_BACKWARD_SCHEDULES
            and getattr(args, "transformer_impl", "local") == "transformer_engine"
            and te_delayed_wgrad_blocker(args) is None)


def check_transformer_engine_flags(args: argparse.Namespace, cfg: PluginConfig) -> None:
    """Megatron-LM flags refused where the plugin builds TransformerEngine layers with delay_wgrad_compute (it
    depends on the installed TransformerEngine, so it is checked here, by `install` and by the check command,
    after `validate_args`): --use-transformer-engine-op-fuser under the split-backward schedules. ConfigError
    naming the flag and the fix."""
    from .validation import ConfigError

    if getattr(args, "use_transformer_engine_op_fuser", False) and delays_te_wgrads(args, cfg):
        # The plugin builds every TransformerEngine layer with delay_wgrad_compute here. Megatron's TEFusedMLP
        # (megatron/core/extensions/transformer_engine.py) runs its MLP through te.pytorch.ops.Sequential built from
        # the weights of linear_fc1 / linear_fc2, whose own forward never runs: their queues stay empty and the
        # W's backward_dw() on them fails (TransformerEngine's WeightGradStore.pop, "Pop empty queue"); the fused
        # ops' weight gradients come at I to parameters marked skip_backward_post_hook, whose hooks only
        # backward_dw() fires. The same holds for MoE experts under the flag (TEGroupedMLP in
        # megatron/core/transformer/moe/experts.py: `_with_fused_impl = config.use_transformer_engine_op_fuser`;
        # its fused ops, kept out of the module tree, queue the GEMMs, and linear_fc1 / linear_fc2 never run).
        raise ConfigError(
            f"--use-transformer-engine-op-fuser with --pipeline-schedule {cfg.pipeline_schedule}: the split backward "
            "builds TransformerEngine layers with delay_wgrad_compute and runs their queued weight-gradient GEMMs at "
            "W, but the op fuser's MLP (TEFusedMLP) never runs the forward of its linear_fc1 / linear_fc2, so their "
            "queues stay empty and W fails in TransformerEngine (\"Pop empty queue\"); drop "
            "--use-transformer-engine-op-fuser, or use a schedule without split backward: --pipeline-schedule "
            "breadth-first, interleaved-1f1b (1f1b at V = 1) or default"
        )


def split_backward_note(args: argparse.Namespace, cfg: PluginConfig) -> str | None:
    """What a split-backward schedule does with these layers, when TransformerEngine's are involved."""
    if cfg.pipeline_schedule not in SPLIT_BACKWARD_SCHEDULES:
        return None
    if getattr(args, "transformer_impl", "local") != "transformer_engine":
        return None
    blocker = te_delayed_wgrad_blocker(args)
    if blocker is None:
        return (f"--pipeline-schedule {cfg.pipeline_schedule}: TransformerEngine layers are built with "
                "delay_wgrad_compute; their weight-gradient GEMMs run at W (backward_dw)")
    held = (f"; under ZeRO-{cfg.zero_stage} each stage's gradients wait from its first I to its first W beside "
            "the gradient buffers" if cfg.zero_stage in (2, 3) else "")
    return (f"note: --pipeline-schedule {cfg.pipeline_schedule} with --transformer-impl transformer_engine: "
            f"{blocker}, so TransformerEngine layers run their whole backward at I, W's carry no work and the "
            f"schedule runs as its fused order{held}. --transformer-impl local defers the weight GEMMs; "
            "interleaved-1f1b or breadth-first need no split")


def weight_copies_note(args: argparse.Namespace, cfg: PluginConfig) -> str | None:
    """What ZeRO-3 leaves resident under FP8 / FP4 compute: TransformerEngine's quantized weight copies, made at
    a step's first micro-batch and kept beside the shards through every RELEASE (its `_fp8_workspaces`), which
    the sharded wrapper drops only at each stage's last RELEASE of the step (ddp.ShardedDataParallel
    drop_weight_copies). FP8: the copy and, on Hopper, its transpose (Blackwell's MXFP8: row- and column-wise
    copies); NVFP4: half a byte an element each way, plus scales."""
    if cfg.zero_stage != 3:
        return None
    if getattr(args, "fp8", None):
        fmt, size = "--fp8-format", "about 2 bytes"
    elif getattr(args, "fp4", None):
        fmt, size = "--fp4-format", "about 1 byte"
    else:
        return None
    return (f"note: {fmt} with --zero-stage 3: TransformerEngine keeps a quantized copy of each layer's weights "
            f"(and of its transpose), {size} per parameter of its layers, from a step's first micro-batch through "
            "every RELEASE until the stage's last RELEASE of the step, where the plugin drops it (the next step's "
            "first micro-batch re-quantizes the weights); the memory stats count it apart "
            "(fp8_weight_copy_bytes, peak_fp8_weight_copy_bytes)")


def delayed_wgrad_post_init(original: Callable) -> Callable:
    """TransformerConfig.__post_init__ that accepts delay_wgrad_compute on any model: Megatron's check ties the
    flag to MoE expert-parallel overlap (its own user of it); the split schedules use it for every layer.

    Hiding the flag from Megatron's checks would also skip their other refusal of it, which stays: Megatron-Core
    0.19's TransformerConfig.__post_init__ (megatron/core/transformer/transformer_config.py, "Check
    delay_wgrad_compute compatibility") asserts `not self.delay_wgrad_compute` under
    overlap_dispatch_backward_with_experts_wgrad. That flag makes MoELayer run the experts' queued weight GEMMs
    itself inside the backward (_RegisterDelayedWgradForExperts.backward calls `module.backward_dw(...)`,
    megatron/core/transformer/moe/moe_layer.py), and the split schedule's W would pop TransformerEngine's queue
    a second time ("Pop empty queue"). Argument validation refuses the flag earlier, by its Megatron-LM name."""

    @functools.wraps(original)
    def __post_init__(self) -> None:
        delayed = getattr(self, "delay_wgrad_compute", False)
        if delayed and getattr(self, "overlap_dispatch_backward_with_experts_wgrad", False):
            raise AssertionError(  # Megatron's own assertion and text
                "delay_wgrad_compute and overlap_dispatch_backward_with_experts_wgrad are mutually exclusive; use "
                "only one (megatron_bfpp: split-backward schedules set delay_wgrad_compute; drop "
                "overlap_dispatch_backward_with_experts_wgrad)")
        self.delay_wgrad_compute = False
        try:
            original(self)
        finally:
            self.delay_wgrad_compute = delayed

    __post_init__._bfpp_original = original  # type: ignore[attr-defined]
    return __post_init__


def make_forward_backward_getter(cfg: PluginConfig, factory: Callable, original: Callable) -> Callable:
    """The replacement for Megatron's `get_forward_backward_func`: same parameters (0.16 and 0.19), our schedule."""
    options = _accepted(factory, schedule=cfg.schedule)
    recorder = None
    if cfg.timeline:
        from .timeline import TimelineRecorder

        recorder = TimelineRecorder(cfg.timeline)

    def get_forward_backward_func(pp_size=None, vp_size=None, schedule_pg_collection=None):
        multi = _multi_module_collection()
        if multi is not None and isinstance(schedule_pg_collection, multi):
            raise NotImplementedError(
                f"--pipeline-schedule {cfg.pipeline_schedule} does not run multi-module (cross-grid) pipelines; "
                "use --pipeline-schedule default for them"
            )
        forward_backward = factory(**options)
        return recorder.wrap(forward_backward) if recorder is not None else forward_backward

    get_forward_backward_func.__wrapped__ = original  # type: ignore[attr-defined]
    get_forward_backward_func.bfpp_config = cfg  # type: ignore[attr-defined]
    return get_forward_backward_func


def _multi_module_collection():
    try:
        from megatron.core.process_groups_config import MultiModuleProcessGroupCollection
    except ImportError:  # 0.16 has no multi-module pipelines
        return None
    return MultiModuleProcessGroupCollection


def _runtime_factory() -> Callable:
    from ..runtime import get_forward_backward_func

    return get_forward_backward_func


def bind_zero_stage(ddp_class: type, zero_stage: int) -> type:
    """`ddp_class` with `zero_stage` preset when its constructor takes that keyword (Megatron builds the
    wrapper with DDP's own arguments only); the class itself otherwise."""
    try:
        takes = "zero_stage" in inspect.signature(ddp_class.__init__).parameters
    except (TypeError, ValueError):
        takes = False
    if not takes:
        return ddp_class

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("zero_stage", zero_stage)
        ddp_class.__init__(self, *args, **kwargs)

    return type(ddp_class.__name__, (ddp_class,), {"__init__": __init__, "__module__": ddp_class.__module__,
                                                   "__doc__": ddp_class.__doc__, "bfpp_zero_stage": zero_stage})


def _sharded_replacements(zero_stage: int) -> dict[str, Any]:
    """--zero-stage replacements: wrapper class, optimizer factory, gradient finalisation."""
    from ..sharded.finalize import finalize_model_grads
    from . import sharded_compat

    ddp = bind_zero_stage(sharded_compat.DistributedDataParallel, zero_stage)
    return {
        "DDP": ddp,
        "DistributedDataParallel": ddp,
        "get_megatron_optimizer": sharded_compat.get_megatron_optimizer,
        "finalize_model_grads": finalize_model_grads,
    }


# ZeRO-3 keeps parameters sharded at rest; these functions of Megatron-LM's loop read every parameter's data
# outside the schedule (train(): --log-params-norm, --check-weight-hash-across-dp-replicas-interval), so they
# run with the weights gathered. Optional: a version without one has nothing to wrap.
PARAM_READER_POINTS = (
    compat.RebindPoint(compat.TRAINING, "calc_params_l2_norm", required=False),
    compat.RebindPoint(compat.TRAINING, "check_param_hashes_across_dp_replicas", required=False),
)


def with_gathered_params(checkpoint_fn: Callable, writeback: bool, position: int | None = None) -> Callable:
    """Megatron-LM's save_checkpoint(iteration, model, ...) / load_checkpoint(model, ...) (or any function taking
    the model at argument `position`) run with every ZeRO-3 parameter gathered (empty at rest otherwise);
    loading writes the loaded values back into the shards."""
    if position is None:
        position = 0 if writeback else 1  # load_checkpoint(ddp_model, ...) / save_checkpoint(iteration, model, ...)

    @functools.wraps(checkpoint_fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        from megatron_bfpp.sharded.ddp import gathered_params

        model = kwargs.get("ddp_model", kwargs.get("model"))
        if model is None and len(args) > position:
            model = args[position]
        chunks = model if isinstance(model, (list, tuple)) else [model]
        with gathered_params(chunks, writeback=writeback):
            return checkpoint_fn(*args, **kwargs)

    return call


def install(args: argparse.Namespace) -> PluginConfig:
    """Validate `args` (Megatron-LM's, parsed with `add_arguments` and validated by Megatron) and take over the
    pieces of Megatron-LM's training loop the flags ask for. Call it after argument parsing, before the model and
    optimizer are built (before `pretrain(...)`). Raises `ConfigError` for a bad flag combination and
    `UnsupportedMegatronError` when this megatron-core lacks a name to rebind. Installing again replaces the
    previous install."""
    cfg = validate_args(args)
    check_requested_delay(args, cfg)
    check_transformer_engine_flags(args, cfg)
    # Resolve everything before touching Megatron: a failure below leaves it as it was.
    plan: list[tuple[Any, str, Any]] = []
    if cfg.uses_runtime:
        (training, point), = compat.resolve(compat.SCHEDULE_POINTS)
        original = getattr(training, point.attr)
        original = getattr(original, "__wrapped__", original)  # re-install: check Megatron's, not ours
        compat.check_forward_backward_getter(original)
        plan.append((training, point.attr, make_forward_backward_getter(cfg, _runtime_factory(), original)))
    if cfg.shards_model_state:
        replacements = _sharded_replacements(cfg.zero_stage)
        for mod, point in compat.resolve(compat.SHARDED_POINTS):
            plan.append((mod, point.attr, replacements[point.attr]))
    if cfg.zero_stage == 3:
        for mod, point in compat.resolve(compat.CHECKPOINT_POINTS):
            original = getattr(mod, point.attr)
            original = getattr(original, "__wrapped__", original)
            plan.append((mod, point.attr, with_gathered_params(original, writeback=point.attr == "load_checkpoint")))
        for mod, point in compat.resolve(PARAM_READER_POINTS):
            original = getattr(mod, point.attr)
            original = getattr(original, "__wrapped__", original)
            plan.append((mod, point.attr, with_gathered_params(original, writeback=False, position=0)))
    if cfg.uses_runtime and delays_te_wgrads(args, cfg):
        # TransformerEngine layers queue their weight-gradient GEMMs for W (backward_dw); Megatron's DDP and the
        # sharded wrapper take their gradients through the layers' hooks (the DDP config reads the same flag).
        from megatron.core.transformer.transformer_config import TransformerConfig

        post_init = TransformerConfig.__post_init__
        post_init = getattr(post_init, "_bfpp_original", post_init)
        plan.append((TransformerConfig, "__post_init__", delayed_wgrad_post_init(post_init)))
        plan.append((args, "delay_wgrad_compute", True))
    version = compat.megatron_core_version()
    if plan and not compat.is_supported(version):
        warnings.warn(f"megatron_bfpp: megatron-core {version} is not a tested version "
                      f"({', '.join(f'{a}.{b}.x' for a, b in compat.SUPPORTED_VERSIONS)}); its rebinding points exist, "
                      "continuing", stacklevel=2)

    uninstall()  # also resets the wait timeout the previous install set
    installation.apply(plan, cfg)
    if cfg.uses_runtime:
        # Every p2p wait and channel group bounded by Megatron's --distributed-timeout-minutes.
        from ..runtime import set_wait_timeout

        minutes = getattr(args, "distributed_timeout_minutes", None)
        set_wait_timeout(60.0 * minutes if minutes else None)
        what = f"pipeline schedule {cfg.pipeline_schedule} (P={cfg.pp}, V={cfg.vp}, M={'/'.join(map(str, cfg.train_microbatches))}"
        what += f", group size {cfg.microbatch_group_size})" if cfg.microbatch_group_size else ")"
        if cfg.zero_stage is not None:
            what += f", ZeRO-{cfg.zero_stage}"
        rebound = sorted({f'{m.__name__}.{a}' for m, a, _ in plan if hasattr(m, "__name__")})
        _log(f"installed {what} on megatron-core {version}; rebound {', '.join(rebound)}")
        for note in (split_backward_note(args, cfg), weight_copies_note(args, cfg)):
            if note:
                _log(note)
    else:
        _log("--pipeline-schedule default: Megatron-LM runs unchanged")
    return cfg


def uninstall() -> None:
    """Restore every name `install` rebound (no-op when nothing is installed)."""
    if installation.remove() is not None and "megatron_bfpp.runtime" in sys.modules:
        sys.modules["megatron_bfpp.runtime"].set_wait_timeout(None)


def is_installed() -> bool:
    """Whether the current install rebound any name (the default schedule installs without rebinding)."""
    return bool(installation.rebound())


def install_or_exit(args: argparse.Namespace) -> PluginConfig:
    """`install(args)` for command-line entry points: a configuration error exits with one clear message."""
    return _or_exit(install, args)


def check_before_megatron_or_exit(args: argparse.Namespace) -> None:
    """`validation.check_before_megatron(args)` for command-line entry points, on the parsed arguments before
    Megatron validates them."""
    from .validation import check_before_megatron

    _or_exit(check_before_megatron, args)


def _or_exit(fn: Callable[[argparse.Namespace], Any], args: argparse.Namespace) -> Any:
    from .compat import UnsupportedMegatronError
    from .validation import ConfigError

    try:
        return fn(args)
    except (ConfigError, UnsupportedMegatronError) as e:
        print(f"megatron_bfpp: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
