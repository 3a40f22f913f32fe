#!/usr/bin/env python3
"""A/B: stock Megatron-LM against megatron_bfpp on the same model, layout and batch.

- stock:  Megatron's interleaved 1F1B (virtual stages) with --use-distributed-optimizer --overlap-grad-reduce
          --overlap-param-gather, running the unmodified pretrain_gpt.py;
- plugin: the same script through `python -m megatron_bfpp.launch` with --pipeline-schedule breadth-first and
          --zero-stage 3 (configurable).

Both runs log every iteration (--log-interval 1 --log-throughput) and GPU memory; this script parses Megatron's
iteration lines ("elapsed time per iteration (ms)", "throughput per GPU (TFLOP/s/GPU)", "lm loss") and memory
lines ("[Rank R] (after N iterations) memory (MB) | allocated: ... | max allocated: ..."), and writes
ab_iterations.csv, ab_memory.csv, ab_summary.csv (medians after warm-up, ratios plugin/stock) and ab_megatron.png.

    python scripts/ab_megatron.py --megatron-lm-dir ~/Megatron-LM --model 1.3b --gpus-per-node 8 --dry-run
    python scripts/ab_megatron.py --megatron-lm-dir ~/Megatron-LM --model 1.3b --gpus-per-node 8 --out ab-1.3b
    python scripts/ab_megatron.py --parse-only --out ab-1.3b          # re-analyse existing logs
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import shlex
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

# name -> (layers, hidden, heads, seq, tp, pp, layers per virtual stage, global batch); shapes as scripts/slurm/.
MODELS: dict[str, tuple[int, int, int, int, int, int, int, int]] = {
    "tiny": (8, 512, 8, 1024, 1, 4, 1, 16),
    "1.3b": (24, 2048, 16, 2048, 1, 4, 2, 64),
    "13b": (40, 5120, 40, 2048, 2, 8, 1, 128),
    "52b": (64, 8192, 64, 2048, 8, 8, 2, 128),
}
STOCK_FLAGS = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]

ITERATION_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|(.*)$")
FIELD_RE = {
    "elapsed_ms": re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)"),
    "tflops_per_gpu": re.compile(r"throughput per GPU \(TFLOP/s/GPU\): ([0-9.]+)"),
    "global_batch_size": re.compile(r"global batch size:\s*(\d+)"),
    "lm_loss": re.compile(r"lm loss: ([0-9.eE+-]+)"),
}
MEMORY_RE = re.compile(
    r"\[Rank (\d+)\] \(after (\d+) iterations\) memory \(MB\) \| allocated: ([0-9.]+) \| max allocated: ([0-9.]+)"
    r"(?: \| reserved: ([0-9.]+) \| max reserved: ([0-9.]+))?"
)


@dataclass
class RunLog:
    variant: str
    iterations: list[dict] = field(default_factory=list)
    memory: list[dict] = field(default_factory=list)


def parse_log(text: str, variant: str, seq_length: int) -> RunLog:
    """Iteration and memory records from a Megatron-LM training log."""
    run = RunLog(variant)
    for line in text.splitlines():
        m = ITERATION_RE.search(line)
        if m and "elapsed time per iteration" in line:
            rec: dict = {"variant": variant, "iteration": int(m.group(1))}
            for key, rx in FIELD_RE.items():
                f = rx.search(m.group(2))
                rec[key] = float(f.group(1)) if f else None
            if rec["elapsed_ms"] and rec["global_batch_size"]:
                rec["tokens_per_s"] = rec["global_batch_size"] * seq_length / (rec["elapsed_ms"] / 1e3)
            else:
                rec["tokens_per_s"] = None
            run.iterations.append(rec)
            continue
        m = MEMORY_RE.search(line)
        if m:
            run.memory.append({
                "variant": variant, "rank": int(m.group(1)), "iteration": int(m.group(2)),
                "allocated_mb": float(m.group(3)), "max_allocated_mb": float(m.group(4)),
                "max_reserved_mb": float(m.group(6)) if m.group(6) else None,
            })
    return run


def summarize(run: RunLog, warmup: int) -> dict:
    """Medians over the iterations after `warmup`, and the peak memory over ranks."""
    steady = [r for r in run.iterations if r["iteration"] > warmup] or run.iterations

    def med(key: str) -> float | None:
        vals = [r[key] for r in steady if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    peak = max((m["max_allocated_mb"] for m in run.memory), default=None)
    peak_reserved = max((m["max_reserved_mb"] for m in run.memory if m["max_reserved_mb"] is not None), default=None)
    return {"variant": run.variant, "iterations": len(steady), "median_elapsed_ms": med("elapsed_ms"),
            "median_tokens_per_s": med("tokens_per_s"), "median_tflops_per_gpu": med("tflops_per_gpu"),
            "peak_max_allocated_mb": peak, "peak_max_reserved_mb": peak_reserved,
            "last_lm_loss": steady[-1]["lm_loss"] if steady else None}


def add_ratios(rows: list[dict], baseline: str = "stock") -> None:
    """ratio_* = value / baseline's value, measured side by side (throughput > 1 and memory < 1 favour a variant)."""
    base = next((r for r in rows if r["variant"] == baseline), None)
    for r in rows:
        for key in ("median_tokens_per_s", "peak_max_allocated_mb"):
            b = base.get(key) if base else None
            r[f"ratio_{key}"] = (r[key] / b) if (b and r.get(key) is not None) else None


def write_csv(path: Path, rows: list[dict]) -> None:
    if not rows:
        return
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def plot(runs: list[RunLog], summary: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.2))
    for run in runs:
        pts = [(r["iteration"], r["tokens_per_s"]) for r in run.iterations if r["tokens_per_s"]]
        if pts:
            ax_t.plot(*zip(*pts), marker=".", label=run.variant)
    ax_t.set_xlabel("iteration")
    ax_t.set_ylabel("tokens / s")
    ax_t.set_title("throughput")
    ax_t.legend()
    ax_t.grid(alpha=0.3)
    names = [s["variant"] for s in summary]
    peaks = [(s["peak_max_allocated_mb"] or 0.0) / 1024 for s in summary]
    bars = ax_m.bar(names, peaks, color=["tab:blue", "tab:orange", "tab:green", "tab:red"][: len(names)])
    for bar, s in zip(bars, summary):
        r = s.get("ratio_peak_max_allocated_mb")
        if r is not None and s["variant"] != "stock":
            ax_m.annotate(f"x{r:.2f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                          va="bottom")
    ax_m.set_ylabel("GiB")
    ax_m.set_title("peak GPU memory (max allocated, max over ranks)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--megatron-lm-dir", default=os.environ.get("MEGATRON_LM_DIR"),
                   help="Megatron-LM checkout (default: $MEGATRON_LM_DIR)")
    p.add_argument("--model", choices=sorted(MODELS), default="1.3b")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--tp", type=int, help="tensor-parallel size (default: the model's)")
    p.add_argument("--pp", type=int, help="pipeline-parallel size (default: the model's)")
    p.add_argument("--layers-per-stage", type=int, help="layers per virtual stage (default: the model's)")
    p.add_argument("--mbs", type=int, default=1, help="micro-batch size")
    p.add_argument("--gbs", type=int, help="global batch size (default: the model's)")
    p.add_argument("--iters", type=int, default=30, help="training iterations per run")
    p.add_argument("--warmup", type=int, default=5, help="iterations left out of the medians")
    p.add_argument("--schedule", default="breadth-first", help="plugin variant's --pipeline-schedule")
    p.add_argument("--zero-stage", type=int, choices=(1, 2, 3), default=3, help="plugin variant's --zero-stage")
    p.add_argument("--group-size", type=int, help="--microbatch-group-size-per-virtual-pipeline-stage for both")
    p.add_argument("--launcher", choices=("torchrun", "srun"), default="torchrun",
                   help="torchrun on this node, or srun + torchrun inside a SLURM allocation")
    p.add_argument("--master-port", type=int, default=29500)
    p.add_argument("--variants", default="stock,plugin", help="comma-separated subset of stock,plugin")
    p.add_argument("--out", default="ab-megatron", help="output directory (logs, CSVs, PNG)")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--parse-only", action="store_true", help="only parse the logs already in --out")
    p.add_argument("extra", nargs="*", help="extra Megatron flags for both runs (after --)")
    return p


def megatron_flags(a: argparse.Namespace) -> tuple[list[str], int]:
    layers, hidden, heads, seq, tp, pp, lps, gbs = MODELS[a.model]
    flags = [
        "--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
        "--seq-length", str(seq), "--max-position-embeddings", str(seq),
        "--tensor-model-parallel-size", str(a.tp or tp), "--pipeline-model-parallel-size", str(a.pp or pp),
        "--num-layers-per-virtual-pipeline-stage", str(a.layers_per_stage or lps),
        "--micro-batch-size", str(a.mbs), "--global-batch-size", str(a.gbs or gbs),
        "--bf16", "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
        "--lr", "1.5e-4", "--min-lr", "1.5e-5", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
        "--weight-decay", "0.1", "--clip-grad", "1.0", "--init-method-std", "0.006",
        "--train-iters", str(a.iters), "--eval-iters", "0", "--eval-interval", str(a.iters + 1),
        "--log-interval", "1", "--log-throughput", "--log-memory-interval", "1",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "50257", "--seed", "1234",
    ]
    if a.group_size:
        flags += ["--microbatch-group-size-per-virtual-pipeline-stage", str(a.group_size)]
    return flags + list(a.extra), seq


def commands(a: argparse.Namespace) -> dict[str, list[str]]:
    script = str(Path(a.megatron_lm_dir or "MEGATRON_LM_DIR") / "pretrain_gpt.py")
    flags, _ = megatron_flags(a)
    if a.launcher == "srun":
        master = "$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1)"
        prefix = ["srun", "--nodes", str(a.nnodes), "--ntasks-per-node", "1", "--kill-on-bad-exit=1",
                  "torchrun", "--nnodes", str(a.nnodes), "--nproc-per-node", str(a.gpus_per_node),
                  "--rdzv-id", "${SLURM_JOB_ID}", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{master}:{a.master_port}"]
    else:
        prefix = ["torchrun", "--nnodes", "1", "--nproc-per-node", str(a.gpus_per_node),
                  "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{a.master_port}"]
    plugin = ["--pipeline-schedule", a.schedule, "--zero-stage", str(a.zero_stage)]
    cmds = {
        "stock": prefix + [script] + flags + STOCK_FLAGS,
        "plugin": prefix + ["-m", "megatron_bfpp.launch", script] + flags + plugin,
    }
    wanted = [v.strip() for v in a.variants.split(",") if v.strip()]
    unknown = [v for v in wanted if v not in cmds]
    if unknown:
        raise SystemExit(f"error: --variants {','.join(unknown)} unknown: choose from stock,plugin")
    return {v: cmds[v] for v in wanted}


def shell_line(cmd: list[str]) -> str:
    # $(...) and ${...} are left for the shell of the SLURM allocation to expand.
    return " ".join(c if c.startswith(("$(", "${")) or "$(" in c else shlex.quote(c) for c in cmd)


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    out = Path(a.out)
    cmds = commands(a)
    _, seq = megatron_flags(a)
    if a.dry_run:
        env = "CUDA_DEVICE_MAX_CONNECTIONS=1 TORCH_NCCL_ASYNC_ERROR_HANDLING=1"
        for variant, cmd in cmds.items():
            print(f"# {variant}: log -> {out / (variant + '.log')}")
            print(f"{env} {shell_line(cmd)}")
        return 0
    if not a.parse_only:
        if not a.megatron_lm_dir or not (Path(a.megatron_lm_dir) / "pretrain_gpt.py").is_file():
            print("error: --megatron-lm-dir (or $MEGATRON_LM_DIR) must point at a Megatron-LM checkout with "
                  "pretrain_gpt.py", file=sys.stderr)
            return 2
        out.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1", TORCH_NCCL_ASYNC_ERROR_HANDLING="1")
        for variant, cmd in cmds.items():
            log = out / f"{variant}.log"
            print(f"running {variant} -> {log}", flush=True)
            with log.open("w") as f:
                f.write(f"# {shell_line(cmd)}\n")
                f.flush()
                rc = subprocess.run(shell_line(cmd), shell=True, stdout=f, stderr=subprocess.STDOUT, env=env,
                                    cwd=a.megatron_lm_dir).returncode
            if rc != 0:
                print(f"warning: {variant} exited with {rc}; see {log}", file=sys.stderr)
    runs = []
    for variant in cmds:
        log = out / f"{variant}.log"
        if not log.is_file():
            print(f"error: no log {log}", file=sys.stderr)
            return 2
        run = parse_log(log.read_text(errors="replace"), variant, seq)
        if not run.iterations:
            print(f"error: {log} holds no Megatron iteration lines (did the run fail? see the log)", file=sys.stderr)
            return 2
        runs.append(run)
    summary = [summarize(r, a.warmup) for r in runs]
    add_ratios(summary)
    write_csv(out / "ab_iterations.csv", [r for run in runs for r in run.iterations])
    write_csv(out / "ab_memory.csv", [m for run in runs for m in run.memory])
    write_csv(out / "ab_summary.csv", summary)
    plot(runs, summary, out / "ab_megatron.png", f"GPT {a.model}: stock Megatron vs megatron_bfpp ({a.schedule}, ZeRO-{a.zero_stage})")
    for s in summary:
        print(", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in s.items()))
    print(f"wrote {out}/ab_summary.csv, ab_iterations.csv, ab_memory.csv, ab_megatron.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
