"""Stage layouts: how many decoder layers each of the P*V pipeline stages holds, the embedding on stage 0 and the
output layer and loss on the last (stage s on rank s mod P, its chunk s // P), as Megatron-Core's
`--pipeline-model-parallel-layout` writes them (`E`, `t` per decoder layer, `L`, `|` between stages; parsed by
`PipelineParallelLayerLayout.parse_str_to_list` in megatron/core/transformer/pipeline_parallel_layer_layout.py).

`balanced_layouts` proposes the layouts the planner tries beside equal stages: the embedding and above all the
output layer of today's vocabularies (Llama-3's 128256 x 8192 output layer costs about 1.2 of its decoder layers)
make equal layer counts unequal work, so the ranks holding them get fewer layers, down to a stage holding the
output layer alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Sequence

# Megatron's unrolling, in its order: `(...)*n` first, then `x*n` (parse_str_to_list).
_UNROLL = (re.compile(r"\(([^)]+)\)\*(\d+)"), re.compile(r"(.)\*(\d+)"))


def layout_string(counts: Sequence[int]) -> str:
    """The `--pipeline-model-parallel-layout` of these per-stage decoder-layer counts, runs of equal stages
    written `(tt|)*n` and long stages `t*n`, as Megatron's parser unrolls them."""
    if not counts:
        raise ValueError("a layout needs at least one stage")
    stages = []
    for s, n in enumerate(counts):
        body = ("t" * n) if n <= 3 else f"t*{n}"
        stages.append(("E" if s == 0 else "") + body + ("L" if s == len(counts) - 1 else ""))
    out, s = [], 0
    while s < len(stages):
        run = 1
        while s + run < len(stages) and stages[s + run] == stages[s]:
            run += 1
        # A run is never the last stage (it alone holds L), so `(x|)*n` is always followed by a stage.
        out.append(f"({stages[s]}|)*{run}" if run > 1 else stages[s] + ("|" if s + 1 < len(stages) else ""))
        s += run
    return "".join(out)


def parse_layout(text: str) -> tuple[int, ...]:
    """Each stage's decoder layers in a `--pipeline-model-parallel-layout` (Megatron's grammar: commas are cosmetic,
    `(...)*n` and `x*n` repeat); ValueError naming the flag for what Megatron refuses or the simulator does not
    model (`m`: multi-token prediction layers)."""
    flat = text.replace(",", "")
    for pattern in _UNROLL:
        flat = pattern.sub(lambda x: x.group(1) * int(x.group(2)), flat)
    stages = flat.split("|")
    bad = set(flat) - set("EtL|")
    if bad:
        what = "multi-token prediction layers (m), which the simulator does not model" if bad == {"m"} else \
            f"characters {''.join(sorted(bad))!r} (Megatron knows E, t, L, m)"
        raise ValueError(f"--pipeline-model-parallel-layout {text!r}: {what}")
    if flat.count("E") != 1 or flat.count("L") != 1 or not stages[0].startswith("E") or not stages[-1].endswith("L") \
            or any(c != "t" for c in flat[1:-1].replace("|", "")):
        raise ValueError(f"--pipeline-model-parallel-layout {text!r}: the embedding E must open the first stage and the "
                         "loss L close the last, once each, with only decoder layers t between")
    return tuple(st.count("t") for st in stages)


def _fill(minimum: list[int], fixed: list[float], unit: float, total: int) -> list[int] | None:
    """`total` units over the bins, each at least its minimum, minimising the largest load fixed + unit x count
    (adding one at a time to the least loaded bin is optimal for this min-max); None when the minimums exceed it.
    Ties go to the later bin: toward the end of the pipeline, whose backward starts first."""
    counts = list(minimum)
    left = total - sum(counts)
    if left < 0:
        return None
    for _ in range(left):
        i = min(range(len(counts)), key=lambda j: (fixed[j] + unit * (counts[j] + 1), -j))
        counts[i] += 1
    return counts


def balanced_layouts(num_layers: int, pp: int, vp: int, layer: float, embedding: float,
                     head: float) -> list[tuple[int, ...]]:
    """Layouts of `num_layers` decoder layers over P*V stages that even out the work per rank, then per stage,
    when a decoder layer costs `layer`, the embedding `embedding` and the output layer and loss `head` (any unit:
    F + B of one micro-batch). Every stage but the first and the last holds a layer (an empty stage would be a
    hop for nothing); the first may hold the embedding alone and the last the output layer alone. Besides the
    balanced layout, the ones giving the output layer's rank one layer more or fewer (the simulator decides
    between them: the pipeline's fill and drain weigh too). Empty when P*V stages cannot be filled so."""
    n = pp * vp
    if n < 1 or num_layers < max(0, n - 2) or layer <= 0:
        return []
    stage_fixed = [0.0] * n
    stage_fixed[0] += embedding
    stage_fixed[-1] += head
    stage_min = [0 if s in (0, n - 1) else 1 for s in range(n)]
    rank_fixed = [sum(stage_fixed[r::pp]) for r in range(pp)]
    rank_min = [sum(stage_min[r::pp]) for r in range(pp)]
    balanced = _fill(rank_min, rank_fixed, layer, num_layers)
    if balanced is None:
        return []
    rank_totals = [balanced]
    if pp > 1:
        for delta in (-1, 1):
            last = balanced[-1] + delta
            if last < rank_min[-1]:
                continue
            others = _fill(rank_min[:-1], rank_fixed[:-1], layer, num_layers - last)
            if others is not None:
                rank_totals.append(others + [last])
    out: list[tuple[int, ...]] = []
    for totals in rank_totals:
        counts = [0] * n
        for r in range(pp):
            per_stage = _fill(stage_min[r::pp], stage_fixed[r::pp], layer, totals[r])
            if per_stage is None:
                break
            for v, c in enumerate(per_stage):
                counts[r + v * pp] = c
        else:
            if tuple(counts) not in out:
                out.append(tuple(counts))
    return out


def layer_moves(counts: Sequence[int]) -> list[tuple[int, ...]]:
    """Every layout one decoder layer away from `counts`: a layer of the first stage, of the last stage or of a
    stage holding two or more moved to any other stage, so that the stages between the first and the last keep
    one each (the rule of `balanced_layouts`). In stage order of the layer's source, then of its destination."""
    n = len(counts)
    out = []
    for src in range(n):
        if counts[src] == 0 or (0 < src < n - 1 and counts[src] < 2):
            continue
        for dst in range(n):
            if dst != src:
                moved = list(counts)
                moved[src] -= 1
                moved[dst] += 1
                out.append(tuple(moved))
    return out


def climb_layout(counts: Sequence[int], score: Callable[[tuple[int, ...]], float | None], start: float,
                 budget: int) -> tuple[tuple[int, ...], float, int]:
    """Local search from `counts` (scoring `start`): take the first of `layer_moves` that `score`s lower (None: a
    layout that cannot run, not counted), until none does or `budget` scores are spent. Returns the layout, its
    score and the scores spent."""
    best, best_score, spent = tuple(counts), start, 0
    improved = True
    while improved and spent < budget:
        improved = False
        for moved in layer_moves(best):
            if spent >= budget:
                break
            value = score(moved)
            if value is None:
                continue
            spent += 1
            if value < best_score * (1 - 1e-9):
                best, best_score, improved = moved, value, True
                break
    return best, best_score, spent


@dataclass(frozen=True)
class ScaledLayout:
    """A small run with a layout's pattern: each stage's decoder layers (None: Megatron's default even split, no
    layout flag, one layer per stage), P and V = stages / P."""

    counts: tuple[int, ...] | None
    pp: int
    vp: int

    @property
    def num_layers(self) -> int:
        return self.pp * self.vp if self.counts is None else sum(self.counts)

    @property
    def layout(self) -> str | None:
        """The `--pipeline-model-parallel-layout` (None for the even split)."""
        return None if self.counts is None else layout_string(self.counts)


def _empty_rank(counts: Sequence[int], pp: int) -> bool:
    """Whether some pipeline rank holds nothing at all: no decoder layer, nor the embedding, nor the output layer."""
    n = len(counts)
    return any(all(counts[s] == 0 and s not in (0, n - 1) for s in range(r, n, pp)) for r in range(pp))


def scale_down_layout(counts: Sequence[int], pp: int) -> ScaledLayout:
    """The layout `counts` (each of its P * V stages' decoder layers, as `parse_layout` reads them) at a size a
    CPU runs, with the same pattern: the distinct layer counts mapped in order to 1, 2, 3, ... (0 stays 0: an `E`
    or `L` alone, an empty stage), the first and last stage kept as they are (with `E` and `L`), each run of
    identical stages between them shortened to two (a lone stage keeps its place between the runs), and the
    stages made a multiple of the smallest P >= 2 that keeps whether a rank holds nothing at all (a rank without
    parameters), by lengthening the longest run (V = stages / P). ValueError when no P up to the stage count can."""
    n = len(counts)
    if n == 0 or pp < 1 or n % pp or any(c < 0 for c in counts):
        raise ValueError(f"{n} stages of {list(counts)} do not split over P = {pp} pipeline ranks")
    small = {c: i for i, c in enumerate(sorted(set(counts) | {0}))}  # 0 first: it stays 0
    mapped = [small[c] for c in counts]
    if n == 1:
        return ScaledLayout(tuple(mapped), 1, 1)
    runs: list[list[int]] = []  # [layer count, stages] of each run of identical stages between the first and last
    for c in mapped[1:-1]:
        if runs and runs[-1][0] == c:
            runs[-1][1] += 1
        else:
            runs.append([c, 1])
    longest = max(range(len(runs)), key=lambda i: (runs[i][1], -i), default=None)
    kept = [min(length, 2) for _, length in runs]
    empty = _empty_rank(counts, pp)
    for p in range(2, n + 1):
        need = -(2 + sum(kept)) % p
        if need and (longest is None or runs[longest][1] < 2):
            continue  # only a run may grow: a lone stage would become a run
        lengths = [k + (need if i == longest else 0) for i, k in enumerate(kept)]
        scaled = (mapped[0], *(c for (c, _), k in zip(runs, lengths) for _ in range(k)), mapped[-1])
        if _empty_rank(scaled, p) == empty:
            return ScaledLayout(scaled, p, len(scaled) // p)
    raise ValueError(f"no P up to {n} keeps the pattern of {layout_string(counts)!r} at P = {pp}")


def scale_down_even(vp: int) -> ScaledLayout:
    """Megatron's default split (equal stages, no layout flag) at V stages per rank, at a size a CPU runs: one
    decoder layer per stage on P = 2, with V = 2 for any V >= 2 (V = 1 stays)."""
    if vp < 1:
        raise ValueError(f"V = {vp}: at least one stage per rank")
    return ScaledLayout(None, 2, 2 if vp >= 2 else 1)
