"""What the device kit's legs run: the trainer and Megatron-LM's script, instrumented, and their checks.

    torchrun ... -m megatron_bfpp.devkit.workers train [trainer flags]        the trainer (bfpp train's worker)
    torchrun ... -m megatron_bfpp.devkit.workers megatron SCRIPT.py [flags]   Megatron-LM's script, script runner
    torchrun ... -m megatron_bfpp.devkit.workers sync --out JSON -- [trainer flags]
    python -m megatron_bfpp.devkit.workers memory --out JSON REPORT.json...

Every worker ends with its parent (its torchrun, or the kit), so no rank outlives the kit; train, megatron and
sync count their torch.distributed calls by group size and mark their start-up (collectives.py) before anything
else imports torch.distributed's functions.

train: `megatron_bfpp.train`'s main, unchanged.

megatron: the kit's Megatron-LM tarball carries the dataset helpers' extension built into the megatron-core
wheel (`helpers_cpp`), so Megatron's start-up compile (`make` with pybind11 in megatron/core/datasets; the
device machine may have neither) is skipped when that extension imports; then the unmodified script runs
through `megatron_bfpp.run_megatron_script`, and its process groups are destroyed after it (pretrain() leaves
them, and NCCL's teardown at interpreter exit can hang).

sync: the trainer's steps, with the schedule's execution of each step (the forward_backward call: p2p, ZeRO
collectives, forward and backward of every micro-batch) under `torch.cuda.set_sync_debug_mode("warn")`; each
warning is counted with the innermost frame of this package or of Megatron that led to it. On CPU the mode does
not exist: the same capture runs with no warnings to see (a stub count of 0), and the result says so.

memory: per rank, the trainer report's peak bytes against the simulator's prediction for that pipeline rank
(`megatron_bfpp.sim.predict.memory`, without the profile's fixed reserve, which the allocator's figure does not
include either).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings
from collections import Counter
from typing import Any

SYNC_MESSAGE = "synchroniz"  # torch: "called a synchronizing CUDA operation"


# ------------------------------------------------------------------------------------------------- megatron

def megatron_main(argv: list[str]) -> int:
    if not argv or not argv[0].endswith(".py"):
        print("usage: python -m megatron_bfpp.devkit.workers megatron SCRIPT.py [flags]", file=sys.stderr)
        return 2
    script_dir = os.path.dirname(os.path.abspath(argv[0]))
    sys.path.insert(0, script_dir)  # the checkout's `megatron`, as the script runner puts it
    try:
        import megatron.core.datasets.helpers_cpp  # noqa: F401  (the wheel's build, carried in the tarball)
        import megatron.core.datasets.utils as dataset_utils

        dataset_utils.compile_helpers = lambda: None  # Megatron imports it inside _compile_dependencies
        print("[devkit] dataset helpers: the kit's prebuilt helpers_cpp (Megatron's make step skipped)", flush=True)
    except ImportError as e:
        print(f"[devkit] dataset helpers: none prebuilt ({e}); Megatron compiles them", flush=True)
    from megatron_bfpp.run_megatron_script import main as run_script

    rc = run_script(argv)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()  # every group, Megatron's included
    return rc


def train_main(argv: list[str]) -> int:
    from megatron_bfpp.train.loop import main as train

    return train(argv)


# ----------------------------------------------------------------------------------------------------- sync

class SyncCounter:
    """Counts host synchronisations inside a `with` block: torch's sync debug mode set to "warn" (CUDA only) and
    every warning it raises recorded with where it came from. `applicable` False (CPU): nothing is set, the same
    capture runs and sees no warnings (a stub count of 0)."""

    def __init__(self, applicable: bool, roots: tuple[str, ...] = ()) -> None:
        self.applicable = applicable
        self.roots = roots or _code_roots()
        self.where: Counter[str] = Counter()
        self.count = 0

    def __enter__(self) -> "SyncCounter":
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("always")
        self._show = warnings.showwarning
        warnings.showwarning = self._record
        self._previous = None
        if self.applicable:
            import torch

            self._previous = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.applicable:
            import torch

            torch.cuda.set_sync_debug_mode(self._previous or 0)
        warnings.showwarning = self._show
        self._catch.__exit__(*exc)

    def _record(self, message, category, filename, lineno, file=None, line=None) -> None:
        if SYNC_MESSAGE not in str(message):
            return  # another warning: not counted (catch_warnings drops it)
        self.count += 1
        self.where[self.locate(traceback.extract_stack()[:-1], f"{filename}:{lineno}")] += 1

    def locate(self, stack: list[traceback.FrameSummary], fallback: str) -> str:
        """The innermost frame in this package or Megatron (not the kit itself), as path:line (function)."""
        for frame in reversed(stack):
            path = os.path.abspath(frame.filename)
            if "devkit" in path.split(os.sep):
                continue
            for root in self.roots:
                if path.startswith(root + os.sep):
                    return f"{os.path.relpath(path, os.path.dirname(root))}:{frame.lineno} ({frame.name})"
        return fallback

    def summary(self) -> dict[str, Any]:
        return {"count": self.count, "where": dict(self.where.most_common())}


def _code_roots() -> tuple[str, ...]:
    import megatron_bfpp

    roots = [os.path.dirname(os.path.abspath(megatron_bfpp.__file__))]
    try:
        import megatron.core

        roots.append(os.path.dirname(os.path.dirname(os.path.abspath(megatron.core.__file__))))
    except ImportError:
        pass
    return tuple(roots)


def sync_main(argv: list[str]) -> int:
    out = argv[argv.index("--out") + 1]
    trainer_argv = argv[argv.index("--") + 1:]
    import torch.distributed as dist

    from megatron_bfpp.train import parallel
    from megatron_bfpp.train import Trainer
    from megatron_bfpp.train.config import parse_trainer_args

    args = parse_trainer_args(trainer_argv)
    trainer = Trainer(args)
    applicable = trainer.device.type == "cuda"
    steps: list[dict[str, Any]] = []
    inner = trainer.forward_backward

    def counted(**kwargs):
        with SyncCounter(applicable) as counter:
            result = inner(**kwargs)
        steps.append(counter.summary())
        return result

    trainer.forward_backward = counted
    losses = []
    while trainer.iteration < args.train_iters:
        trainer.iteration += 1
        losses.append(trainer.train_step()[0])
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"rank": dist.get_rank(), "steps": steps})
    if dist.get_rank() == 0:
        result = {"applicable": applicable, "ranks": gathered, "losses": losses,
                  "note": None if applicable else "not applicable on CPU: torch.cuda.set_sync_debug_mode needs CUDA; "
                                                  "the capture ran with a stub count of 0"}
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"[devkit] sync counts per rank and step: {[[s['count'] for s in g['steps']] for g in gathered]}",
              flush=True)
    parallel.destroy_parallel()
    return 0


def sync_detail(result: dict[str, Any]) -> str:
    """One line of the report: syncs per step (the first step, with its one-off set-up, and the steady last one)
    per rank, and the busiest locations of the last step."""
    ranks = sorted(result["ranks"], key=lambda g: g["rank"])
    per = "; ".join(f"rank {g['rank']}: " + ", ".join(str(s["count"]) for s in g["steps"]) for g in ranks)
    last: Counter[str] = Counter()
    for g in ranks:
        if g["steps"]:
            last.update(g["steps"][-1]["where"])
    where = ", ".join(f"{loc} x{n}" for loc, n in last.most_common(4)) or "none"
    steady = max((g["steps"][-1]["count"] for g in ranks if g["steps"]), default=0)
    head = (f"{steady} host syncs per step in the schedule's execution (steady step, most on one rank)"
            if result["applicable"] else f"{result['note']}; counted {steady} per step")
    return f"{head}; per rank and step: {per}; where (last step): {where}"


# --------------------------------------------------------------------------------------------------- memory

def predicted_per_rank(config: dict[str, Any]) -> list[float]:
    """The simulator's bytes per pipeline rank for a trainer report's `config` block."""
    from megatron_bfpp.sim.costs import Config
    from megatron_bfpp.sim.model import ModelProfile
    from megatron_bfpp.sim.predict import memory

    model = ModelProfile("devkit", config["num_layers"], config["hidden_size"], config["num_attention_heads"],
                     config["seq_length"], config["vocab_size"])
    cfg = Config(config.get("tp", 1), config["pp"], config["vp"], config["dp"], config["micro_batch_size"],
                 config["microbatches"], config["pipeline_schedule"], config["zero_stage"],
                 bool(config.get("recompute")), config.get("group_size"))
    return [r["total"] for r in memory(model, cfg)]


def memory_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per rank: measured peak bytes, predicted bytes (its pipeline rank) and their ratio."""
    config = report["config"]
    predicted = predicted_per_rank(config)
    pp, dp = config["pp"], config["dp"]
    rows = []
    for m in sorted(report.get("memory", []), key=lambda m: m["rank"]):
        # Megatron's rank order: data-parallel fastest (T = 1), so the pipeline rank is rank // D.
        pp_rank = (m["rank"] // dp) % pp
        peak = m.get("peak_bytes")
        rows.append({"rank": m["rank"], "pp_rank": pp_rank, "peak_bytes": peak, "predicted_bytes": predicted[pp_rank],
                     "ratio": peak / predicted[pp_rank] if peak and predicted[pp_rank] else None})
    return rows


def memory_main(argv: list[str]) -> int:
    from .plan import MEMORY_RATIO_BAND

    out = argv[argv.index("--out") + 1]
    reports = [a for a in argv if a.endswith(".json") and a != out]
    result: dict[str, Any] = {"band": list(MEMORY_RATIO_BAND), "runs": []}
    for path in reports:
        with open(path) as f:
            report = json.load(f)
        rows = memory_rows(report)
        result["runs"].append({"report": os.path.basename(path), "rows": rows})
        for r in rows:
            print(f"[devkit] {os.path.basename(path)} rank {r['rank']} (pipeline rank {r['pp_rank']}): peak "
                  f"{(r['peak_bytes'] or 0) / 2**20:.1f} MiB, predicted {r['predicted_bytes'] / 2**20:.1f} MiB, "
                  f"ratio {r['ratio'] if r['ratio'] is None else round(r['ratio'], 2)}", flush=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


def memory_verdict(result: dict[str, Any], measured_by: str) -> tuple[bool, str]:
    """(within the band on every rank, one line of the report)."""
    lo, hi = result["band"]
    ok, parts = True, []
    for run in result["runs"]:
        ratios = [r["ratio"] for r in run["rows"]]
        ok = ok and bool(ratios) and all(x is not None and lo <= x <= hi for x in ratios)
        cells = ", ".join(f"r{r['rank']} {(r['peak_bytes'] or 0) / 2**20:.0f}/{r['predicted_bytes'] / 2**20:.0f} MiB"
                          for r in run["rows"])
        parts.append(f"{run['report'].removesuffix('.json')}: {cells}")
    return ok, (f"peak/predicted per rank ({measured_by}; pass within {lo:g}-{hi:g}x): " + "; ".join(parts))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"train": train_main, "megatron": megatron_main, "sync": sync_main, "memory": memory_main}
    if not argv or argv[0] not in commands:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    if argv[0] != "memory":  # before anything imports torch.distributed's functions by name
        from .collectives import instrument

        instrument()
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    from megatron_bfpp.devkit.processes import die_with_parent

    die_with_parent()  # a worker process of the kit: it ends with its torchrun (or the kit)
    sys.exit(main())
