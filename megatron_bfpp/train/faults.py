"""Faults: the numerical check before each optimizer step, how a failing rank exits, and a test hook.

Numerical check (`--check-for-nan-in-loss-and-grad`, Megatron's flag, on by default; Megatron turns it off
for fp16 with dynamic loss scaling, where an overflow is the scaler's signal to skip the step): after the
schedule and before the optimizer step every rank tests its lm loss and its gradients for NaN/Inf and all
ranks agree through one small all-reduce, so that all stop together with one error naming the iteration and
the ranks where the values were found, before anything is applied.

Exit after a failure: a rank whose error was caused by another rank (a closed connection, a timed-out wait,
a NaN found elsewhere) reports it in one line and exits after a short grace period, so that torchrun sees
the rank that failed first and names it as the root cause. A configuration error (a bad flag or flag
combination found by the workers, e.g. when the data or the checkpoint is read: `TrainerConfigError`,
`CheckpointError`, Megatron-LM integration's `ConfigError`, or a `ValueError` whose message starts with the
flag it names) is printed once, as one `error: ...` line without a traceback, by the first rank that reports
it, and exits with status 2 (as a rejected command line); tracebacks are kept for unexpected errors.

Test hook (not for production use): `BFPP_FAULT_INJECT="rank=R,iteration=I,point=P"` makes global rank R
fail at iteration I. Points: `forward` / `backward` (SIGKILL during the first forward / a backward of the
step), `optimizer` (SIGKILL between the schedule and the optimizer step), `save` (SIGKILL after the
checkpoint's shards are written, before it is committed), `nan_loss` (the rank's forward outputs become
NaN), `nan_grad` (the gradient flowing out of its loss becomes NaN; the loss stays finite), `inf_grad`
(same with +Inf: for fp16 loss-scaling tests).
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from ..errors import TrainerConfigError

ENV = "BFPP_FAULT_INJECT"
KILL_POINTS = ("forward", "backward", "optimizer", "save")
VALUE_POINTS = ("nan_loss", "nan_grad", "inf_grad")
POINTS = KILL_POINTS + VALUE_POINTS
PEER_FAILURE_GRACE_S = float(os.environ.get("BFPP_PEER_FAILURE_GRACE_S", "3"))
_PEER_TEXT = ("connection closed by peer", "connection reset by peer", "broken pipe", "timed out", "timeout",
              "connection refused", "socket closed")


class NumericalFault(FloatingPointError):
    """NaN/Inf in the loss or the gradients (--check-for-nan-in-loss-and-grad); `origin_ranks` found them."""

    def __init__(self, message: str, origin_ranks: Iterable[int]) -> None:
        super().__init__(message)
        self.origin_ranks = frozenset(origin_ranks)


# --------------------------------------------------------------------------------------- numerical check
def _nonfinite(tensors: Iterable[torch.Tensor]) -> bool:
    return any(t.numel() and not bool(torch.isfinite(t).all()) for t in tensors)


def check_numerics(loss_values: Iterable[torch.Tensor], grads: Iterable[torch.Tensor], iteration: int) -> None:
    """Collective over all ranks: raise NumericalFault on every rank if any rank's loss or gradient is not
    finite. `loss_values`: this rank's per-micro-batch loss reports (empty off the last stage)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    flags = torch.zeros(2, world, dtype=torch.int32)
    flags[0, rank] = int(_nonfinite(loss_values))
    flags[1, rank] = int(_nonfinite(grads))
    if world > 1:
        dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
        t = flags.to(dev) if dev is not None else flags
        dist.all_reduce(t)
        flags = t.cpu()
    loss_ranks = [r for r in range(world) if flags[0, r]]
    grad_ranks = [r for r in range(world) if flags[1, r]]
    if not loss_ranks and not grad_ranks:
        return
    parts = []
    if loss_ranks:
        parts.append(f"NaN/Inf in lm loss on rank{'s' if len(loss_ranks) > 1 else ''} "
                     f"{', '.join(map(str, loss_ranks))}")
    if grad_ranks:
        parts.append(f"NaN/Inf in gradients on rank{'s' if len(grad_ranks) > 1 else ''} "
                     f"{', '.join(map(str, grad_ranks))}")
    raise NumericalFault(
        f"iteration {iteration}: {'; '.join(parts)} (seen from rank {rank}). Stopped before the optimizer step "
        "(--check-for-nan-in-loss-and-grad): lower --lr, check the data, or resume from the last checkpoint "
        "with --load", loss_ranks or grad_ranks)


# --------------------------------------------------------------------------------------- failing ranks
def _chain(e: BaseException) -> list[BaseException]:
    out, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def caused_by_peer(e: BaseException, rank: int) -> bool:
    """Whether `e` on `rank` reports another rank's failure rather than this rank's own."""
    for x in _chain(e):
        if isinstance(x, NumericalFault):
            return rank not in x.origin_ranks
        if isinstance(x, (getattr(dist, "DistBackendError", ()), getattr(dist, "DistNetworkError", ()))):
            return True
        if type(x).__name__ == "PipelineError":  # runtime p2p failures name the peer
            return True
        text = str(x).lower()
        if any(s in text for s in _PEER_TEXT):
            return True
    return False


CONFIG_ERROR_EXIT_CODE = 2  # as argparse and the trainer's own command-line checks
_REPORT_WINDOW_S = 300.0  # a marker older than this belongs to an earlier run


def is_config_error(e: BaseException) -> bool:
    """Whether `e` reports a bad configuration (the user's to fix from its message) rather than a bug."""
    from .checkpoint import CheckpointError
    from ..megatron.validation import ConfigError

    if isinstance(e, (TrainerConfigError, ConfigError)):
        return True
    if isinstance(e, CheckpointError):  # one that wraps an unexpected error keeps its traceback
        return e.__cause__ is None
    return type(e) is ValueError and str(e).startswith("--")  # the project's convention: the flag comes first


def _first_report_of_this_run() -> bool:
    """True on the first rank of this launch (on this host) to report a configuration error.

    The ranks of one launch share MASTER_ADDR/MASTER_PORT, the launcher's process (their parent) and, under
    torchrun, its run id and restart count: the first to create the marker file named by them prints."""
    if "MASTER_PORT" not in os.environ:
        return True  # a single process, no launcher
    key = "|".join(os.environ.get(k, "") for k in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                                                   "TORCHELASTIC_RESTART_COUNT")) + f"|{os.getppid()}"
    path = os.path.join(tempfile.gettempdir(), f"bfpp-config-error-{hashlib.sha1(key.encode()).hexdigest()[:16]}")
    for _ in range(2):
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            return True
        except FileExistsError:
            try:
                if time.time() - os.path.getmtime(path) < _REPORT_WINDOW_S:
                    return False
                os.unlink(path)  # stale: left by an earlier launch that reused the same port
            except OSError:
                return False
        except OSError:
            return True  # no usable temporary directory: better twice than never
    return True


def report_config_error(e: BaseException, rank: int) -> int:
    """Print a configuration error once per launch (first reporting rank), without a traceback; return 2."""
    if _first_report_of_this_run():
        print(f"error: {e}", file=sys.stderr, flush=True)
    return CONFIG_ERROR_EXIT_CODE


def report_failure(e: BaseException, rank: int, grace_s: float | None = None) -> int:
    """Print the failure of this rank and return the exit code (1; 2 for a configuration error, printed once
    by the first rank that reports it). A rank that only saw another rank's failure prints one line and waits
    `grace_s` first, so the launcher observes the failing rank first."""
    if is_config_error(e):
        return report_config_error(e, rank)
    grace = PEER_FAILURE_GRACE_S if grace_s is None else grace_s
    if caused_by_peer(e, rank):
        print(f"rank {rank}: failed because another rank failed: {type(e).__name__}: {e}", file=sys.stderr,
              flush=True)
        time.sleep(grace)
    else:
        print(f"rank {rank}: failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        traceback.print_exception(e, file=sys.stderr)
        sys.stderr.flush()
    return 1


# --------------------------------------------------------------------------------------- injection hook
@dataclass(frozen=True)
class FaultSpec:
    rank: int
    iteration: int
    point: str


def parse_fault_spec(text: str) -> FaultSpec:
    fields: dict[str, str] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"{ENV}={text!r}: expected rank=R,iteration=I,point=P")
        fields[key.strip()] = value.strip()
    missing = [k for k in ("rank", "iteration", "point") if k not in fields]
    if missing or set(fields) - {"rank", "iteration", "point"}:
        raise ValueError(f"{ENV}={text!r}: expected exactly rank=R,iteration=I,point=P")
    if fields["point"] not in POINTS:
        raise ValueError(f"{ENV}={text!r}: point must be one of {', '.join(POINTS)}")
    return FaultSpec(int(fields["rank"]), int(fields["iteration"]), fields["point"])


class FaultInjector:
    """Carries out BFPP_FAULT_INJECT on the targeted rank and iteration; inert everywhere else."""

    def __init__(self, spec: FaultSpec | None, rank: int) -> None:
        self.spec = spec if spec is not None and spec.rank == rank else None
        self.rank = rank

    @classmethod
    def from_env(cls, rank: int) -> "FaultInjector":
        text = os.environ.get(ENV, "").strip()
        return cls(parse_fault_spec(text) if text else None, rank)

    def armed(self, iteration: int, point: str) -> bool:
        return self.spec is not None and self.spec.iteration == iteration and self.spec.point == point

    def kill(self, iteration: int, point: str) -> None:
        print(f"fault injection: rank {self.rank} SIGKILLs itself at iteration {iteration} ({point}) "
              f"t={time.time():.3f}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    def at(self, iteration: int, point: str) -> None:
        """Kill here if armed for (iteration, point)."""
        if self.armed(iteration, point):
            self.kill(iteration, point)

    def wrap_forward_step(self, forward_step: Callable, iteration: int) -> Callable:
        """The forward step, or one that injects this iteration's forward/backward/value fault."""
        if self.spec is None or self.spec.iteration != iteration or self.spec.point in ("optimizer", "save"):
            return forward_step
        point = self.spec.point

        def faulty_forward_step(data_iterator: Any, model: Any):
            output, loss_func = forward_step(data_iterator, model)
            if point == "forward":
                self.kill(iteration, point)
            elif point == "backward" and output.requires_grad:
                output.register_hook(lambda g: self.kill(iteration, point))
            elif point == "nan_loss":
                output = output * float("nan")
            elif point in ("nan_grad", "inf_grad") and output.requires_grad:
                bad = float("nan") if point == "nan_grad" else float("inf")
                output.register_hook(lambda g: g * bad)
            return output, loss_func

        return faulty_forward_step
