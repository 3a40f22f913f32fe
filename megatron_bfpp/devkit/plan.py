"""The device kit's legs, budget, log grouping and report shape (pure Python: nothing here imports torch).

A leg is one run (or one computation over earlier runs) and what it can reveal. The legs are ordered by what
they show that nothing on CPU can: first NCCL with several ranks sharing the GPU (the communicators, the
posting and pairing of p2p ops, the ZeRO collectives on two data-parallel ranks, consecutive W's on a chunk),
then Megatron-LM's own script, the host synchronisations in the schedule's hot path, peak memory against the
simulator, and last the one-rank and TransformerEngine legs. Each training leg's bf16 losses are compared with a
reference run on the same device (the tolerances of scripts/gpu_check.sh).

The quick plan (QUICK_LEGS, `--quick`, and the plan whenever the budget is under the full plan's estimate) is the
first call on a machine lent for a short time: the legs most likely to show a fault, within QUICK_BUDGET_S, so
that a second, full call still fits the machine's time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

DEVICES = ("cuda", "cpu")
STATUSES = ("pass", "fail", "not-run", "refused")
REPORT_NAME = "device_report.json"
MAX_RESULT_FILES = 8               # files that come back from the device machine: the report and the logs
DEFAULT_BUDGET_S = 480             # install, legs and report in one call (a command may run 10 minutes)
QUICK_BUDGET_S = 240               # the first, short call (the machine is lent for about 15 minutes in all)
REPORT_RESERVE_S = 10              # kept for the report after the last leg
MIN_LEG_TIMEOUT_S = 60             # a leg may take this long at least (when the budget allows) ...
LEG_TIMEOUT_FACTOR = 2.5           # ... or this many times its estimate

# bf16 loss tolerance (as scripts/gpu_check.py): relative difference per iteration.
FIRST_ITERATION_RTOL = 5e-3
ALL_ITERATIONS_RTOL = 2e-2
# Peak memory per rank against the simulator's prediction: the band a leg passes in.
MEMORY_RATIO_BAND = (0.5, 2.0)


@dataclass(frozen=True)
class Shape:
    """The model and run length of the training legs on one device kind."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    iters: int
    global_batch: int = 8

    def model_flags(self) -> list[str]:
        return ["--num-layers", str(self.layers), "--hidden-size", str(self.hidden),
                "--num-attention-heads", str(self.heads), "--seq-length", str(self.seq),
                "--max-position-embeddings", str(self.seq), "--vocab-size", str(self.vocab),
                "--micro-batch-size", "1", "--global-batch-size", str(self.global_batch),
                "--train-iters", str(self.iters)]


# GPU: big enough that model state, not allocator workspaces, sets peak memory; CPU: tiny (2 shared cores).
SHAPES = {
    "cuda": Shape(layers=8, hidden=1024, heads=16, seq=1024, vocab=50257, iters=8),
    "cpu": Shape(layers=8, hidden=64, heads=4, seq=32, vocab=256, iters=3),
}

# Trainer and Megatron-LM flags every training leg shares (Megatron's names). Dropout off: losses are compared.
TRAIN_FLAGS = ["--lr", "1.5e-4", "--min-lr", "1.5e-5", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
               "--weight-decay", "0.1", "--clip-grad", "1.0", "--init-method-std", "0.006", "--hidden-dropout", "0",
               "--attention-dropout", "0", "--seed", "1234", "--bf16", "--untie-embeddings-and-output-weights",
               "--log-interval", "1"]
# Megatron-LM's pretrain_gpt.py: mock data, its local layers, no fused kernels (no apex, no TransformerEngine).
MEGATRON_FLAGS = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--eval-iters", "0", "--eval-interval",
                  "1000000", "--num-workers", "0", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
                  "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion", "--no-persist-layer-norm"]


@dataclass(frozen=True)
class Leg:
    """One leg: `kind` install | bfpp | megatron | sync | memory; `ranks` processes (several share the one GPU);
    `flags` the training flags beyond the shape's and TRAIN_FLAGS; `reference` the leg whose losses it is
    compared with; `requires` what must import for it to run; `inputs` the legs whose reports it reads;
    `data_parallel` the data-parallel size D (ranks = P x D): with D > 1 the leg must show its ZeRO collectives
    (all-gather, reduce-scatter) running on D-rank groups."""

    name: str
    kind: str
    log: str
    what: str
    est_s: dict[str, float]
    ranks: int = 1
    flags: tuple[str, ...] = ()
    reference: str | None = None
    requires: str | None = None
    inputs: tuple[str, ...] = ()
    impl: str = "local"
    data_parallel: int = 1

    def estimate(self, device: str) -> float:
        return float(self.est_s[device])

    def timeout(self, device: str) -> float:
        return max(MIN_LEG_TIMEOUT_S, LEG_TIMEOUT_FACTOR * self.estimate(device))


def _vp_flags(shape: Shape, pp: int, vp: int) -> list[str]:
    flags = ["--pipeline-model-parallel-size", str(pp)]
    if vp > 1:
        flags += ["--num-layers-per-virtual-pipeline-stage", str(shape.layers // (pp * vp))]
    return flags


def plan_legs(device: str) -> list[Leg]:
    """The legs in the order they run (see the module docstring)."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES} (got {device!r})")
    shape = SHAPES[device]
    legs = [Leg("install", "install", "setup", "the kit installs offline next to the machine's torch (never touching "
                "it) and Megatron-LM's source unpacks", {"cuda": 25, "cpu": 30})]
    legs.append(Leg("bfpp-P1-reference", "bfpp", "setup", "bfpp train on one rank (1f1b, ZeRO-1): the trainer's "
                    "reference losses", {"cuda": 20, "cpu": 15},
                    flags=(*_vp_flags(shape, 1, 1), "--pipeline-schedule", "1f1b", "--zero-stage", "1")))
    multi = (("breadth-first", "3", "breadth-first ZeRO-3"),
             ("interleaved-zb", "3", "interleaved-zb ZeRO-3 (consecutive W's on a chunk)"),
             ("breadth-first-zb", "2", "breadth-first-zb ZeRO-2 (consecutive W's on a chunk)"))
    for pp, est in ((4, {"cuda": 32, "cpu": 30}), (2, {"cuda": 24, "cpu": 20})):
        for schedule, zero, what in multi:
            legs.append(Leg(f"bfpp-P{pp}-{schedule}-zero{zero}", "bfpp", f"bfpp-P{pp}",
                            f"bfpp train, {pp} ranks sharing the device (V=2, M={shape.global_batch}, D=1), {what}: "
                            f"NCCL communicators, p2p posting and pairing (with D=1, ZeRO's all-gathers and "
                            f"reduce-scatters are local copies: no communication)", est, ranks=pp,
                            flags=(*_vp_flags(shape, pp, 2), "--pipeline-schedule", schedule, "--zero-stage", zero),
                            reference="bfpp-P1-reference"))
    # Right after the first P = 4 leg: the one leg whose ZeRO collectives communicate.
    first_p4 = next(i for i, leg in enumerate(legs) if leg.name == "bfpp-P4-breadth-first-zero3")
    legs.insert(first_p4 + 1, Leg(
        "bfpp-P2xD2-breadth-first-zero3", "bfpp", "bfpp-P4", f"bfpp train, 4 ranks sharing the device as P=2 x D=2 "
        f"(V=2, M={shape.global_batch // 2} per data-parallel rank), breadth-first ZeRO-3: the all-gathers and "
        f"reduce-scatters run on 2-rank NCCL groups beside the pipeline's p2p", {"cuda": 35, "cpu": 30}, ranks=4,
        flags=(*_vp_flags(shape, 2, 2), "--pipeline-schedule", "breadth-first", "--zero-stage", "3"),
        reference="bfpp-P1-reference", data_parallel=2))
    p2 = _vp_flags(shape, 2, 2)
    legs += [
        Leg("megatron-P2-default", "megatron", "megatron-P2", "Megatron-LM pretrain_gpt.py, 2 ranks sharing the "
            "device, stock interleaved 1F1B (--pipeline-schedule default): the reference", {"cuda": 35, "cpu": 25},
            ranks=2, flags=(*p2, "--pipeline-schedule", "default")),
        Leg("megatron-P2-breadth-first-zero3", "megatron", "megatron-P2", "Megatron-LM pretrain_gpt.py through the "
            "script runner, 2 ranks sharing the device, breadth-first ZeRO-3", {"cuda": 35, "cpu": 25}, ranks=2,
            flags=(*p2, "--pipeline-schedule", "breadth-first", "--zero-stage", "3"), reference="megatron-P2-default"),
        Leg("megatron-P2-breadth-first-zb-ddp", "megatron", "megatron-P2", "Megatron-LM, 2 ranks, breadth-first-zb "
            "with Megatron's own DDP and --overlap-grad-reduce (its gradient hooks under a split schedule)",
            {"cuda": 35, "cpu": 25}, ranks=2,
            flags=(*p2, "--pipeline-schedule", "breadth-first-zb", "--overlap-grad-reduce"),
            reference="megatron-P2-default"),
        Leg("sync-P2-breadth-first-zero3", "sync", "sync-memory", "host synchronisations inside the schedule's "
            "execution of each step (torch.cuda.set_sync_debug_mode 'warn'), counted per step and located, 2 ranks",
            {"cuda": 25, "cpu": 25}, ranks=2,
            flags=(*p2, "--pipeline-schedule", "breadth-first", "--zero-stage", "3")),
        Leg("memory-vs-simulator", "memory", "sync-memory", "peak memory per rank (torch.cuda.max_memory_allocated; "
            "on CPU the runtime's own count) against the simulator's per-rank prediction",
            {"cuda": 5, "cpu": 3}, inputs=("bfpp-P4-breadth-first-zero3", "bfpp-P2-breadth-first-zero3")),
        Leg("megatron-P1-default", "megatron", "megatron-P1", "Megatron-LM pretrain_gpt.py on one rank, stock 1F1B: "
            "the reference", {"cuda": 30, "cpu": 20}, flags=(*_vp_flags(shape, 1, 1), "--pipeline-schedule",
                                                             "default")),
        Leg("megatron-P1-1f1b-zero3", "megatron", "megatron-P1", "Megatron-LM on one rank, the plugin's 1f1b with "
            "ZeRO-3", {"cuda": 30, "cpu": 20},
            flags=(*_vp_flags(shape, 1, 1), "--pipeline-schedule", "1f1b", "--zero-stage", "3"),
            reference="megatron-P1-default"),
        Leg("te-megatron-P1-default", "megatron", "transformer-engine", "Megatron-LM on one rank with "
            "TransformerEngine layers, stock 1F1B: the reference", {"cuda": 40, "cpu": 40},
            flags=(*_vp_flags(shape, 1, 1), "--pipeline-schedule", "default"), requires="transformer_engine",
            impl="transformer_engine"),
        Leg("te-megatron-P1-zb-h1-zero2", "megatron", "transformer-engine", "Megatron-LM on one rank with "
            "TransformerEngine layers, zb-h1 ZeRO-2 (delayed weight gradients)", {"cuda": 40, "cpu": 40},
            flags=(*_vp_flags(shape, 1, 1), "--pipeline-schedule", "zb-h1", "--zero-stage", "2"),
            reference="te-megatron-P1-default", requires="transformer_engine", impl="transformer_engine"),
    ]
    return legs


def select_legs(legs: list[Leg], only: set[str] | None) -> list[Leg]:
    """The legs named in `only` (all when None) in plan order, with the install, and with every leg a chosen
    one needs: its reference and the legs whose reports it reads."""
    if only is None:
        return list(legs)
    chosen = set(only) | {"install"}
    by_name = {leg.name: leg for leg in legs}
    todo = list(chosen)
    while todo:
        leg = by_name[todo.pop()]
        for name in ([leg.reference] if leg.reference else []) + list(leg.inputs):
            if name not in chosen:
                chosen.add(name)
                todo.append(name)
    return [leg for leg in legs if leg.name in chosen]


# The quick plan: the p2p protocol at P = 4, the ZeRO collectives at D = 2, consecutive W's at P = 4, and
# Megatron-LM's own script with the plugin at P = 2 against stock (what a CPU cannot show, most revealing first).
QUICK_LEGS = ("install", "bfpp-P1-reference", "bfpp-P4-breadth-first-zero3", "bfpp-P2xD2-breadth-first-zero3",
              "bfpp-P4-interleaved-zb-zero3", "megatron-P2-default", "megatron-P2-breadth-first-zero3")


def quick_legs(device: str) -> list[Leg]:
    """The quick plan's legs, in the full plan's order."""
    return [leg for leg in plan_legs(device) if leg.name in QUICK_LEGS]


def consecutive_ws(leg: Leg, device: str) -> int | None:
    """How many times a W follows a W of the same stage on a rank in a split-backward leg's schedule (the case
    TransformerEngine's delayed weight gradients and Megatron's DDP hooks must get right); None otherwise."""
    from ..schedule import SPLIT_BACKWARD_SCHEDULES, build
    from ..schedule.ir import Op

    flags = list(leg.flags)
    schedule = _flag(flags, "--pipeline-schedule")
    if schedule not in SPLIT_BACKWARD_SCHEDULES:
        return None

    shape = SHAPES[device]
    pp = int(_flag(flags, "--pipeline-model-parallel-size") or 1)
    lpv = _flag(flags, "--num-layers-per-virtual-pipeline-stage")
    vp = shape.layers // pp // int(lpv) if lpv else 1
    s = build(schedule, pp, vp, shape.global_batch // leg.data_parallel)
    return sum(a.op == b.op == Op.W and a.stage == b.stage
               for r in range(pp) for a, b in zip(s.compute_actions(r), s.compute_actions(r)[1:]))


def _flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


# ---------------------------------------------------------------------------------------------------- budget

class Budget:
    """Seconds left for legs: the total minus what has run minus the report's reserve. A leg fits when what is
    left covers its estimate; it is then given its timeout or what is left, whichever is smaller."""

    def __init__(self, total_s: float, reserve_s: float = REPORT_RESERVE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if total_s <= 0:
            raise ValueError(f"the budget must be positive (got {total_s})")
        self.total_s, self.reserve_s, self.clock = float(total_s), float(reserve_s), clock
        self.start = clock()

    def elapsed(self) -> float:
        return self.clock() - self.start

    def left(self) -> float:
        return max(0.0, self.total_s - self.elapsed() - self.reserve_s)

    def limit_for(self, leg: Leg, device: str) -> float | None:
        """The seconds `leg` may run now, or None when it no longer fits."""
        left = self.left()
        if left < leg.estimate(device):
            return None
        return min(leg.timeout(device), left)


def plan_total(legs: Iterable[Leg], device: str, reserve_s: float = REPORT_RESERVE_S) -> float:
    """Estimated seconds of a whole run: every leg (install included) and the report's reserve."""
    return sum(leg.estimate(device) for leg in legs) + reserve_s


# ------------------------------------------------------------------------------------------------------ logs

def group_logs(legs: list[Leg], max_logs: int = MAX_RESULT_FILES - 1) -> dict[str, list[str]]:
    """{log file name: [leg names]} in leg order, at most `max_logs` files. One file per leg when they fit; else
    the legs' own `log` groups; when even those are too many, the two adjacent groups with the fewest legs
    between them merge (their names joined with '+') until the count fits."""
    if max_logs < 1:
        raise ValueError("at least one log file is needed")
    if len(legs) <= max_logs:
        return {f"{leg.name}.log": [leg.name] for leg in legs}
    groups: list[tuple[str, list[str]]] = []
    for leg in legs:
        if groups and groups[-1][0] == leg.log:
            groups[-1][1].append(leg.name)
        elif any(g == leg.log for g, _ in groups):  # a group seen earlier: the leg joins it
            next(names for g, names in groups if g == leg.log).append(leg.name)
        else:
            groups.append((leg.log, [leg.name]))
    while len(groups) > max_logs:
        i = min(range(len(groups) - 1), key=lambda k: (len(groups[k][1]) + len(groups[k + 1][1]), k))
        (a, na), (b, nb) = groups[i], groups[i + 1]
        groups[i:i + 2] = [(f"{a}+{b}", na + nb)]
    return {f"{g}.log": names for g, names in groups}


def log_of(groups: dict[str, list[str]]) -> dict[str, str]:
    """{leg name: its log file}."""
    return {name: log for log, names in groups.items() for name in names}


# ---------------------------------------------------------------------------------------------------- report

@dataclass
class LegResult:
    name: str
    status: str
    seconds: float = 0.0
    detail: str = ""
    extra: dict[str, Any] = field(default_factory=dict)  # kept by the driver, not written to the report

    def to_dict(self) -> dict[str, Any]:
        if self.status not in STATUSES:
            raise ValueError(f"leg {self.name}: status {self.status!r} is not one of {STATUSES}")
        return {"name": self.name, "status": self.status, "seconds": round(float(self.seconds), 1),
                "detail": self.detail}


def make_report(results: list[LegResult], facts: dict[str, Any]) -> dict[str, Any]:
    """The report: {"legs": [{"name", "status", "seconds", "detail"}], "torch", "cuda", "nccl", "gpus"}."""
    report = {"legs": [r.to_dict() for r in results], "torch": facts.get("torch"), "cuda": facts.get("cuda"),
              "nccl": facts.get("nccl"), "gpus": list(facts.get("gpus") or [])}
    validate_report(report)
    return report


NOT_REACHED = "not reached yet when this report was written (the run was still going, or was killed before it)"


def progress_results(legs: list[Leg], results: dict[str, LegResult], running: str | None = None,
                     running_since: float = 0.0, log: str = "") -> list[LegResult]:
    """Every leg in plan order: its result when it has one, else not-run, saying whether it was running (since
    `running_since` seconds into the run, its output so far in `log`) or not reached: the report written after
    each leg, which a killed run leaves behind."""
    out = []
    for leg in legs:
        if leg.name in results:
            out.append(results[leg.name])
        elif leg.name == running:
            out.append(LegResult(leg.name, "not-run", 0.0, f"running when this report was written (started "
                                 f"{running_since:.0f} s into the run; its output so far: {log})"))
        else:
            out.append(LegResult(leg.name, "not-run", 0.0, NOT_REACHED))
    return out


def validate_report(report: Any) -> None:
    """Raise ValueError unless `report` has exactly the report's shape."""
    if not isinstance(report, dict) or set(report) != {"legs", "torch", "cuda", "nccl", "gpus"}:
        raise ValueError(f"report keys must be legs, torch, cuda, nccl, gpus (got {sorted(report)})"
                         if isinstance(report, dict) else "the report must be a JSON object")
    if not isinstance(report["legs"], list) or not isinstance(report["gpus"], list):
        raise ValueError("legs and gpus must be lists")
    for key in ("torch", "cuda", "nccl"):
        if report[key] is not None and not isinstance(report[key], str):
            raise ValueError(f"{key} must be a string or null")
    names = set()
    for leg in report["legs"]:
        if not isinstance(leg, dict) or set(leg) != {"name", "status", "seconds", "detail"}:
            raise ValueError(f"a leg must have exactly name, status, seconds, detail (got {leg!r})")
        if leg["status"] not in STATUSES:
            raise ValueError(f"leg {leg['name']}: status {leg['status']!r} is not one of {STATUSES}")
        if not isinstance(leg["seconds"], (int, float)) or leg["seconds"] < 0:
            raise ValueError(f"leg {leg['name']}: seconds must be a non-negative number")
        if not isinstance(leg["name"], str) or not isinstance(leg["detail"], str) or leg["name"] in names:
            raise ValueError(f"leg {leg['name']!r}: name and detail must be strings, names unique")
        names.add(leg["name"])


def exit_code(results: list[LegResult], optional_not_run: set[str]) -> int:
    """0: every leg passed, or did not run only for lack of an optional component (TransformerEngine);
    1: a leg failed; 3: a leg was refused by NCCL or left out by the budget."""
    if any(r.status == "fail" for r in results):
        return 1
    if any(r.status == "refused" or (r.status == "not-run" and r.name not in optional_not_run) for r in results):
        return 3
    return 0


# -------------------------------------------------------------------------------------------------- dry run

def dry_run_text(device: str, budget_s: float, legs: list[Leg] | None = None, quick: bool = False
                 ) -> tuple[str, bool]:
    """The dry run's listing: each leg with its estimate, log file and reference, and the total against the
    budget. Returns (text, fits)."""
    legs = plan_legs(device) if legs is None else legs
    groups = group_logs(legs)
    logs = log_of(groups)
    lines = [f"device kit, {device}{' (quick plan)' if quick else ''}: {len(legs)} legs, {len(groups)} log(s) + "
             f"{REPORT_NAME} (at most {MAX_RESULT_FILES} files)", ""]
    w = max(len(leg.name) for leg in legs)
    for i, leg in enumerate(legs, 1):
        extra = []
        if leg.reference:
            extra.append(f"vs {leg.reference}")
        if leg.requires:
            extra.append(f"only where {leg.requires} imports")
        cw = consecutive_ws(leg, device)
        if cw is not None:
            extra.append(f"{cw} consecutive W's")
        lines.append(f"{i:2d}. {leg.name:<{w}} ~{leg.estimate(device):4.0f} s  [{logs[leg.name]}]"
                     f"{'  (' + '; '.join(extra) + ')' if extra else ''}")
        lines.append(f"      {leg.what}")
    core = [leg for leg in legs if not leg.requires]
    total = plan_total(core, device)
    fits = total <= budget_s
    lines += ["", f"total: ~{total:.0f} s estimated for the legs every machine runs (install and "
              f"{REPORT_RESERVE_S} s report reserve included) against a budget of {budget_s:.0f} s: "
              f"{'fits' if fits else 'DOES NOT FIT'}"]
    optional = [leg for leg in legs if leg.requires]
    if optional:
        more = sum(leg.estimate(device) for leg in optional)
        lines.append(f"       + ~{more:.0f} s where {', '.join(sorted({leg.requires for leg in optional}))} imports "
                     f"(those legs run last, in what the budget has left: ~{total + more:.0f} s in all)")
    return "\n".join(lines), fits
