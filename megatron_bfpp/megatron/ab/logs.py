"""Megatron-LM's training log, as the A/B driver reads it: iteration lines, memory lines and the plugin's count of
linear layers that defer their weight GEMMs."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

ITERATION_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|(.*)$")
FIELD_RE = {
    "elapsed_ms": re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)"),
    "tflops_per_gpu": re.compile(r"throughput per GPU \(TFLOP/s/GPU\): ([0-9.]+)"),
    "global_batch_size": re.compile(r"global batch size:\s*(\d+)"),
    "lm_loss": re.compile(r"lm loss: ([0-9.eE+-]+)"),
    "grad_norm": re.compile(r"grad norm: ([0-9.eE+-]+)"),
}
# The plugin's line, once per model chunk on rank 0, for split-backward schedules.
DEFERRAL_RE = re.compile(r"model chunk \d+: (\d+) linear layers defer their weight GEMMs to W")
MEMORY_RE = re.compile(
    r"\[Rank (\d+)\] \(after (\d+) iterations\) memory \(MB\) \| allocated: ([0-9.]+) \| max allocated: ([0-9.]+)"
    r"(?: \| reserved: ([0-9.]+) \| max reserved: ([0-9.]+))?"
)


@dataclass
class RunLog:
    variant: str
    iterations: list[dict] = field(default_factory=list)
    memory: list[dict] = field(default_factory=list)
    deferred_linears: int | None = None  # split backward: rank 0's linear layers whose W has work (None: no split)


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
        m = DEFERRAL_RE.search(line)
        if m:
            run.deferred_linears = (run.deferred_linears or 0) + int(m.group(1))
            continue
        m = MEMORY_RE.search(line)
        if m:
            run.memory.append({
                "variant": variant, "rank": int(m.group(1)), "iteration": int(m.group(2)),
                "allocated_mb": float(m.group(3)), "max_allocated_mb": float(m.group(4)),
                "max_reserved_mb": float(m.group(6)) if m.group(6) else None,
            })
    return run
