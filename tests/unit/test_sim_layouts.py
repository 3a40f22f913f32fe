"""Free stage layouts (--pipeline-model-parallel-layout): written and read as Megatron-Core does, balanced over the
ranks, searched by the planner for ours and for stock."""

from __future__ import annotations

import dataclasses
import random
from typing import Iterator

import pytest

from megatron_bfpp.sim import STOCK, SearchSpace, get_hardware, plan
from megatron_bfpp.sim.layouts import ScaledLayout, balanced_layouts, climb_layout, layer_moves, layout_string, \
    parse_layout, scale_down_even, scale_down_layout
from megatron_bfpp.sim.model import ModelProfile, Partition, StageSplit, stage_layer_counts
from megatron_bfpp.sim.planner import enumerate_configs

H100 = get_hardware("dgx-h100")


from megatron.core.transformer.enums import LayerType  # noqa: E402  (imported at collection: it is slow)
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout  # noqa: E402


def _megatron_counts(text: str) -> tuple[int, ...]:
    return tuple(stage.count(LayerType.decoder) for stage in PipelineParallelLayerLayout.parse_str_to_list(text))


@pytest.mark.parametrize("text", ["Et*3|(tt|)*29,tt|L", "E|tt|tt|t,L", "EttL", "Et|t|t|tL", "E|(t|)*4L",
                                  "Ettttt|t*5|(ttt|)*2,t*2L"])
def test_parse_reads_what_megatron_reads(text: str) -> None:
    assert parse_layout(text) == _megatron_counts(text)


def test_written_layouts_read_back_through_megatrons_parser() -> None:
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 24)
        counts = tuple(rng.choice((0, 1, 2, 2, 3, 5, 9)) if s in (0, n - 1) else rng.randint(1, 6) for s in range(n))
        text = layout_string(counts)
        assert _megatron_counts(text) == counts == parse_layout(text), text


@pytest.mark.parametrize("text, what", [("Et|m|tL", "multi-token"), ("tE|tL", "must open the first stage"),
                                        ("Et|tL|t", "close the last"), ("Etx|tL", "characters 'x'")])
def test_parse_refuses_what_megatron_or_the_simulator_cannot_run(text: str, what: str) -> None:
    with pytest.raises(ValueError, match=f"^--pipeline-model-parallel-layout '{text.replace('|', '[|]')}': .*{what}"):
        parse_layout(text)


def _compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    if parts == 1:
        yield (total,)
        return
    for first in range(total + 1):
        for rest in _compositions(total - first, parts - 1):
            yield (first, *rest)


def _rank_loads(counts, pp, layer, emb, head):
    n = len(counts)
    stage = [layer * c + (emb if s == 0 else 0) + (head if s == n - 1 else 0) for s, c in enumerate(counts)]
    return [sum(stage[r::pp]) for r in range(pp)], stage


@pytest.mark.parametrize("num_layers, pp, vp, head", [(16, 4, 1, 2.4), (10, 2, 3, 1.3), (12, 3, 2, 0.4),
                                                      (9, 4, 2, 3.0), (7, 1, 3, 2.0), (6, 2, 2, 1.0)])
def test_balanced_layout_is_the_best_split_over_ranks(num_layers: int, pp: int, vp: int, head: float) -> None:
    """Against every split with a layer on each stage between the ends: the first layout has the smallest busiest
    rank, and among those the smallest busiest stage; every layout keeps the stage rules."""
    layer, emb = 1.0, 0.1
    found = balanced_layouts(num_layers, pp, vp, layer, emb, head)
    assert found
    n = pp * vp
    best = None
    for counts in _compositions(num_layers, n):
        if any(c < 1 for c in counts[1:-1]):
            continue
        ranks, stages = _rank_loads(counts, pp, layer, emb, head)
        key = (round(max(ranks), 9), round(max(stages), 9))
        best = key if best is None else min(best, key)
    ranks, stages = _rank_loads(found[0], pp, layer, emb, head)
    assert (round(max(ranks), 9), round(max(stages), 9)) == best
    for counts in found:
        assert len(counts) == n and sum(counts) == num_layers and all(c >= 1 for c in counts[1:-1])
    assert len(set(found)) == len(found)


def test_a_heavy_output_layer_gets_a_stage_of_its_own() -> None:
    """The output layer worth 2.4 layers, 16 layers on P = 4, V = 4: the last stage holds the loss alone."""
    counts = balanced_layouts(16, 4, 4, 1.0, 0.05, 2.4)[0]
    assert counts[-1] == 0 and layout_string(counts).endswith("|L")
    assert balanced_layouts(3, 4, 2, 1.0, 0.0, 1.0) == []  # 8 stages, 6 between the ends: too few layers


def test_a_layout_fixes_the_stages_and_refuses_what_does_not_match() -> None:
    model = ModelProfile("six", 6, 256, 4)
    split = StageSplit(layout=(0, 3, 2, 1))
    assert stage_layer_counts(6, 2, 2, split) == (0, 3, 2, 1)
    part = Partition(model, 1, 2, 2, split)
    assert [part.stage_layers(s) for s in range(4)] == [range(0, 0), range(0, 3), range(3, 5), range(5, 6)]
    assert part.rank_layers(0) == 2 and part.rank_layers(1) == 4
    with pytest.raises(ValueError, match="places 6 decoder layers on 4 stages; the model has 6 layers on P.V = 1.3"):
        stage_layer_counts(6, 1, 3, split)
    with pytest.raises(ValueError, match="--pipeline-model-parallel-layout places every layer itself"):
        StageSplit(layout=(3, 3), account_for_loss=True)


# A Llama-3-8B-like shape at 8 layers: its 128256-entry output layer is worth about two layers' work.
BIG_VOCAB = ModelProfile("big-vocab", 8, 4096, 32, 8192, 128256, 14336, num_query_groups=8, swiglu=True,
                         position_embedding="rope", rms_norm=True, add_bias_linear=False, hidden_dropout=0.0,
                         attention_dropout=0.0)


def test_the_planner_balances_a_large_vocabulary_for_ours_and_for_stock() -> None:
    """At P = 4 the even split leaves the last rank the output layer on top of two layers; the search gives it
    fewer layers, and both sides gain from it (stock at its best gets the same freedom)."""
    space = SearchSpace(tp_sizes=(8,), pp_sizes=(4,), micro_batch_sizes=(1,), zero_stages=(1,), recompute=(False,),
                        cp_sizes=(1,), schedules=("1f1b", "interleaved-1f1b", "breadth-first"))
    for side in (space, STOCK):
        side = dataclasses.replace(side, tp_sizes=(8,), pp_sizes=(4,), micro_batch_sizes=(1,), recompute=(False,),
                                   cp_sizes=(1,))
        even = plan(BIG_VOCAB, H100, 64, 32, dataclasses.replace(side, search_layouts=False), top=1).candidates[0]
        free = plan(BIG_VOCAB, H100, 64, 32, side, top=1).candidates[0]
        assert free.config.split.layout is not None
        part = free.config.partition(BIG_VOCAB)
        assert part.rank_layers(3) < part.rank_layers(0)  # the output layer's rank holds fewer layers
        assert free.tflops_per_gpu > 1.03 * even.tflops_per_gpu
        assert free.rank_load_max_over_mean < even.rank_load_max_over_mean
        assert even.rank_load_max_over_mean > 1.1


def test_free_layouts_reach_every_p_and_v_that_fills_its_stages() -> None:
    """P need not divide the layers, nor P * V: 8 layers reach P = 3 and P = 10 (the embedding and the loss each
    alone on a stage), and P * V stages never exceed the layers plus those two."""
    space = SearchSpace(schedules=("1f1b", "breadth-first"), zero_stages=(0,), tp_sizes=(1,), micro_batch_sizes=(1,),
                        recompute=(False,), search_group_size=False)
    configs, _ = enumerate_configs(BIG_VOCAB, H100, 2520, 2520, space)
    shapes = {(c.pp, c.vp) for c in configs}
    assert (3, 1) in shapes and (10, 1) in shapes and (3, 2) in shapes
    assert all(c.pp * c.vp <= 10 for c in configs)
    assert not any(c.pp == 11 for c in configs)


@pytest.mark.parametrize("counts", [(1, 1, 1, 1), (0, 2, 1, 3, 0), (2, 1, 1, 2), (0, 1, 1, 0), (5,)])
def test_layer_moves_move_one_layer_and_keep_the_stage_rules(counts: tuple[int, ...]) -> None:
    n = len(counts)
    moves = layer_moves(counts)
    sources = [s for s in range(n) if counts[s] > (0 if s in (0, n - 1) else 1)]
    assert len(moves) == len(sources) * (n - 1) == len(set(moves))
    for moved in moves:
        diff = [b - a for a, b in zip(counts, moved)]
        assert sum(moved) == sum(counts) and sorted(d for d in diff if d) == [-1, 1]
        assert all(c >= 1 for c in moved[1:-1]) and min(moved) >= 0


def test_climb_layout_takes_the_first_better_move_until_none_is_and_keeps_to_its_budget() -> None:
    """Scored by the sum of squares (lowest: layers spread evenly), a climb from everything on stage 0 ends
    spread out; layouts scored None (cannot run) cost nothing; the budget stops it."""
    def spread(counts: tuple[int, ...]) -> float | None:
        return None if counts[1] > 3 else float(sum(c * c for c in counts))

    start = (8, 1, 1, 0)
    counts, score, spent = climb_layout(start, spread, spread(start), budget=10_000)
    assert sorted(counts) == [2, 3, 3, 3] or sorted(counts) == [2, 2, 3, 3]  # no single move lowers it further
    assert score == spread(counts) and counts[1] <= 3
    assert all(spread(m) is None or spread(m) >= score for m in layer_moves(counts))
    assert climb_layout(start, spread, spread(start), budget=2)[2] == 2


def test_refined_layout_beats_the_balanced_ones_for_the_52b_at_one_eighth() -> None:
    """The 52B on 512 A100 at 64 sequences (T/P/V = 8/4/16, M = 4, interleaved-zb): equal stages step in 0.554 s;
    moving single layers finds the embedding alone on stage 0, its layer on rank 0's last stage, 2% faster."""
    from megatron_bfpp.megatron.presets import preset_flags
    from megatron_bfpp.megatron.sim_flags import read_run
    from megatron_bfpp.sim.planner import refine_layout
    from megatron_bfpp.sim.predict import predict

    a100 = get_hardware("dgx-a100")
    model, cfg = read_run([*preset_flags("gpt-52b"), "--sequence-parallel", "--global-batch-size", "64",
                           "--micro-batch-size", "1", "--tensor-model-parallel-size", "8",
                           "--pipeline-model-parallel-size", "4", "--num-layers-per-virtual-pipeline-stage", "1",
                           "--pipeline-schedule", "interleaved-zb", "--zero-stage", "1"], 512, a100)
    even = predict(model, a100, cfg)
    refined, spent = refine_layout(model, a100, even, budget=100)  # the move is the 60th tried
    assert refined.step_time_s < 0.98 * even.step_time_s and 0 < spent <= 100
    assert layout_string(refined.config.split.layout) == "E|(t|)*59tt|(t|)*2tL"
    assert refined.step_time_s == predict(model, a100, refined.config).step_time_s


def test_the_planner_refines_the_best_layouts_for_ours_and_for_stock() -> None:
    """BIG_VOCAB at T/P = 8/4, 16 sequences (M = 4 = P): the balanced layouts leave the step to the fill and the
    turn; moving single layers finds a layout 9% faster, for ours and stock alike, that no balanced one is."""
    for side in (SearchSpace(schedules=("1f1b", "interleaved-1f1b", "breadth-first", "interleaved-zb")), STOCK):
        side = dataclasses.replace(side, tp_sizes=(8,), pp_sizes=(4,), micro_batch_sizes=(1,), zero_stages=(1,),
                                   recompute=(False,), cp_sizes=(1,))
        balanced = plan(BIG_VOCAB, H100, 64, 16, dataclasses.replace(side, refine_layouts=False), top=5)
        refined = plan(BIG_VOCAB, H100, 64, 16, side, top=5)
        best = refined.candidates[0]
        assert best.step_time_s < 0.95 * balanced.candidates[0].step_time_s and best.fits
        assert best.config not in {p.config for p in balanced.candidates}
        assert refined.simulated > balanced.simulated  # the refinement's simulations are counted
        steps = [p.step_time_s for p in refined.candidates]
        assert steps == sorted(steps) and len({p.config for p in refined.candidates}) == len(steps)


# ------------------------------------------------------------------------------------------------ scaled down

# The regime tables' layouts (bench/results/regime_*.csv) and a few more, at their P -> (scaled layout, P, V).
SCALED = [
    ("E|(t|)*54tt|(t|)*7tL", 8, "E|(t|)*3tt|(t|)*2tL", 2, 4),  # the longest run grows to fill P * V
    ("Et|(t|)*77tt|L", 4, "Et|(t|)*3tt|L", 2, 3),
    ("Ett|ttt|tt|(ttt|)*24tL", 2, "Ett|ttt|tt|(ttt|)*2tL", 2, 3),
    ("Et*10|(t*10|)*4(t*11|)*2t*8L", 8, "Ett|(tt|)*2(ttt|)*2tL", 2, 3),  # {8, 10, 11} -> {1, 2, 3}
    ("Ett|(tt|)*12(ttt|)*18L", 32, "Et|(t|)*2(tt|)*2L", 2, 3),
    ("E|(t|)*78ttL", 4, "E|(t|)*2ttL", 2, 2),
    ("Ett|(tt|)*36ttt|tt|tL", 2, "Ett|(tt|)*2ttt|tt|tL", 2, 3),
    ("Et|(t|)*76tt|t|L", 2, "Et|(t|)*2tt|t|L", 2, 3),
    ("Ett|tt|(ttt|)*25tL", 4, "Ett|tt|(ttt|)*3tL", 2, 3),
    ("E||ttt|tL", 2, "E||tt|tL", 2, 2),  # an empty stage stays empty
    ("Ett||ttL", 3, "Et||tL", 3, 1),  # rank 1 holds nothing: P = 2 cannot keep that
    ("E|tt|tt|L", 4, "E|(t|)*2L", 2, 2),  # ranks holding E or L alone have parameters: P = 2 will do
    ("Et*5|t*5L", 2, "Et|tL", 2, 1),
]


@pytest.mark.parametrize("text, pp, scaled, small_pp, small_vp", SCALED, ids=[c[0] for c in SCALED])
def test_scale_down_keeps_the_pattern(text: str, pp: int, scaled: str, small_pp: int, small_vp: int) -> None:
    s = scale_down_layout(parse_layout(text), pp)
    assert (s.layout, s.pp, s.vp) == (scaled, small_pp, small_vp)
    assert s.num_layers == sum(s.counts) and _megatron_counts(scaled) == s.counts
    PipelineParallelLayerLayout(scaled, s.pp).validate_layer_layout(num_layers=s.num_layers, mtp_num_layers=None)


def _runs(counts) -> list[tuple[int, int]]:
    """(layer count, length) of each run of equal stages between the first and the last."""
    out: list[list[int]] = []
    for c in counts[1:-1]:
        if out and out[-1][0] == c:
            out[-1][1] += 1
        else:
            out.append([c, 1])
    return [tuple(r) for r in out]


def test_scaled_layouts_keep_every_feature_of_random_layouts() -> None:
    """Against random layouts: E or L alone stays alone, the layer counts keep their order (0 stays 0), the runs
    and lone stages between the ends keep their order, a run keeps at least two stages and at most two but the
    one grown to fill P * V, a rank holding nothing stays, Megatron reads and accepts the layout, and a scaled
    layout scales to itself."""
    rng = random.Random(1)
    for _ in range(300):
        pp = rng.choice((2, 3, 4, 8))
        n = pp * rng.randint(1, 6)
        counts = tuple(rng.choice((0, 1, 2, 9)) if s in (0, n - 1) else
                       rng.choice((1, 1, 1, 2, 3)) if rng.random() < 0.9 else 0 for s in range(n))
        s = scale_down_layout(counts, pp)
        text = layout_string(counts)
        assert len(s.counts) == s.pp * s.vp and s.num_layers == sum(s.counts), text
        assert (s.counts[0] == 0, s.counts[-1] == 0) == (counts[0] == 0, counts[-1] == 0), text
        runs, small_runs = _runs(counts), _runs(s.counts)
        assert len(runs) == len(small_runs), text
        # The layer counts of the first stage, the last and each run, mapped: 0 to 0, in order, onto 1, 2, ...
        pairs = {(counts[0], s.counts[0]), (counts[-1], s.counts[-1]), *((a, b) for (a, _), (b, _) in
                                                                           zip(runs, small_runs))}
        assert {a: b for a, b in pairs} == {a: sorted({0, *(x for x, _ in pairs)}).index(a) for a, _ in pairs}, text
        grown = [(a, b) for (_, a), (_, b) in zip(runs, small_runs) if b != min(a, 2)]
        assert len(grown) <= 1 and all(a >= 2 and b > 2 for a, b in grown), text
        empty = lambda c, p: any(all(c[i] == 0 and i not in (0, len(c) - 1) for i in range(r, len(c), p))  # noqa: E731
                                 for r in range(p))
        assert empty(counts, pp) == empty(s.counts, s.pp), text
        assert _megatron_counts(s.layout) == s.counts, text
        PipelineParallelLayerLayout(s.layout, s.pp).validate_layer_layout(num_layers=s.num_layers, mtp_num_layers=None)
        assert scale_down_layout(s.counts, s.pp) == s, text


def test_scale_down_the_even_split_and_refusals() -> None:
    assert scale_down_even(16) == ScaledLayout(None, 2, 2) and scale_down_even(2).num_layers == 4
    assert scale_down_even(1) == ScaledLayout(None, 2, 1) and scale_down_even(1).layout is None
    with pytest.raises(ValueError, match="V = 0"):
        scale_down_even(0)
    with pytest.raises(ValueError, match="3 stages of .* do not split over P = 2"):
        scale_down_layout((1, 2, 1), 2)


def test_the_next_configurations_take_a_refined_layout_where_it_is_faster() -> None:
    """`_refine_best`: the best three refined, then each of the next 20 moved to a refined layout of its shape
    only where that simulates faster (BIG_VOCAB at T/P = 8/2, M = 8: of the 10 that could take one, 1 is faster
    with it and 9 are not), best first, each configuration once."""
    from megatron_bfpp.sim.planner import REFINED_CANDIDATES, TRANSFER_CANDIDATES, _Bounds, _refine_best, \
        refine_layout

    space = SearchSpace(tp_sizes=(8,), pp_sizes=(2,), micro_batch_sizes=(1,), recompute=(False,), cp_sizes=(1,),
                        refine_layouts=False)
    fitting = plan(BIG_VOCAB, H100, 64, 32, space, top=30).candidates
    bounds = _Bounds(BIG_VOCAB, H100)
    out, spent = _refine_best(BIG_VOCAB, H100, fitting, bounds)
    refined = [refine_layout(BIG_VOCAB, H100, p, bounds)[0] for p in fitting[:REFINED_CANDIDATES]]
    layouts = {p.config.split.layout for p in refined}
    by_config = {p.config: p for p in out}
    assert all(by_config[p.config].step_time_s == p.step_time_s for p in refined)
    moved = 0
    for p in fitting[REFINED_CANDIDATES:REFINED_CANDIDATES + TRANSFER_CANDIDATES]:
        if p.config in by_config:
            continue
        moved += 1
        q = by_config[dataclasses.replace(p.config, split=StageSplit(layout=next(
            lay for lay in layouts if dataclasses.replace(p.config, split=StageSplit(layout=lay)) in by_config)))]
        assert q.step_time_s < p.step_time_s
    assert moved >= 1 and spent > 0
    steps = [p.step_time_s for p in out]  # best first (ties as the planner breaks them)
    assert all(a <= b * (1 + 1e-9) for a, b in zip(steps, steps[1:])) and len(by_config) == len(out)
