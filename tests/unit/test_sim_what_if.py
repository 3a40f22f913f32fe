"""The simulator's what-if of the output layer spread over the pipeline ranks (`output_layer_over_pipeline`): it
moves the output layer's, final norm's and loss's compute, parameters and activations from the last stage to 1/P
on each rank's last stage, and changes nothing else; no flag launches it."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_bfpp.megatron.sim_flags import launch_flags
from megatron_bfpp.sim import Config, SearchSpace, get_hardware, plan
from megatron_bfpp.sim.costs import memory_breakdown, stage_times
from megatron_bfpp.sim.layer_costs import head_ops
from megatron_bfpp.sim.model import ModelProfile
from megatron_bfpp.sim.planner import enumerate_configs

H100 = get_hardware("dgx-h100")
# A large vocabulary against a small layer: the output layer weighs like several decoder layers.
MODEL = ModelProfile("vocab-heavy", 8, 1024, 16, 2048, vocab_size=128000, swiglu=True, rms_norm=True,
                     add_bias_linear=False, position_embedding="rope", hidden_dropout=0.0, attention_dropout=0.0)
CFG = Config(2, 4, 2, 2, 1, 8, "breadth-first-zb", 1, False)
SPREAD = dataclasses.replace(CFG, output_layer_over_pipeline=True)


def test_the_head_moves_from_the_last_stage_to_each_ranks_last_stage() -> None:
    base, spread = CFG.partition(MODEL), SPREAD.partition(MODEL)
    pp, n = CFG.pp, base.num_stages
    last_chunk = range(n - pp, n)
    assert [spread.head_share(s) for s in range(n)] == [0.0] * (n - pp) + [1 / pp] * pp
    head = head_ops(H100, base, 1)
    head_params = MODEL.head_params(CFG.tp) / CFG.tp
    b0, b1 = stage_times(H100, base, 1, split_backward=True), stage_times(H100, spread, 1, split_backward=True)
    for s in range(n):
        # What the last stage holds of the head before, and what the stage holds now.
        before = 1.0 if s == n - 1 else 0.0
        now = 1 / pp if s in last_chunk else 0.0
        moved = now - before
        for got, ref, part in ((b1.forward, b0.forward, head.forward), (b1.input_grad, b0.input_grad,
                                                                         head.backward - head.weight_grad),
                               (b1.weight_grad, b0.weight_grad, head.weight_grad)):
            assert got[s] == pytest.approx(ref[s] + moved * part, rel=1e-12, abs=1e-15)
        assert spread.stage_params(s) == pytest.approx(base.stage_params(s) + moved * head_params, rel=1e-12)
        assert spread.stage_layer_params(s) == base.stage_layer_params(s)
        sb = 1 * MODEL.seq_length
        kept = 4 * sb * MODEL.hidden_size / CFG.tp + 4 * sb * base.padded_vocab / CFG.tp  # norm and fp32 softmax
        assert spread.activation_bytes(s, 1, False) == pytest.approx(base.activation_bytes(s, 1, False)
                                                                     + moved * kept, rel=1e-12)
        pending = (2 * sb * MODEL.hidden_size + 2 * sb * base.padded_vocab) / CFG.tp
        assert spread.pending_weight_grad_bytes(s, 1) == pytest.approx(base.pending_weight_grad_bytes(s, 1)
                                                                       + moved * pending, rel=1e-12)
        assert spread.p2p_bytes(1) == base.p2p_bytes(1)
    # Nothing is created or lost: the whole model's compute and parameters stay.
    assert sum(b1.forward) == pytest.approx(sum(b0.forward), rel=1e-12)
    assert sum(map(spread.stage_params, range(n))) == pytest.approx(sum(map(base.stage_params, range(n))), rel=1e-12)
    # The rank holding the output layer sheds (1 - 1/P) of its parameters' state, the others gain 1/P.
    mem0, mem1 = (memory_breakdown(p, c, pp - 1, 0.0) for p, c in ((base, CFG), (spread, SPREAD)))
    assert mem1["weights"] < mem0["weights"]
    assert memory_breakdown(spread, SPREAD, 1, 0.0)["weights"] > memory_breakdown(base, CFG, 1, 0.0)["weights"]


def test_off_by_default_and_only_where_asked() -> None:
    assert not SearchSpace().output_layer_over_pipeline and not CFG.output_layer_over_pipeline
    space = SearchSpace(micro_batch_sizes=(1,), recompute=(False,), zero_stages=(1,), tp_sizes=(2,), pp_sizes=(4,),
                        schedules=("breadth-first",), search_layouts=False)
    for on in (False, True):
        configs, _ = enumerate_configs(MODEL, H100, 16, 16, dataclasses.replace(space, output_layer_over_pipeline=on))
        assert configs and all(c.output_layer_over_pipeline is on for c in configs)
    # With free layouts, the what-if tries every layout the default cost model does, and those that balance the
    # embedding alone.
    free = dataclasses.replace(space, search_layouts=True)
    splits = [{c.split for c in enumerate_configs(MODEL, H100, 16, 16, dataclasses.replace(
        free, output_layer_over_pipeline=on))[0]} for on in (False, True)]
    assert splits[0] < splits[1]
    # Spreading the vocabulary-heavy head over 4 ranks unloads the busiest one.
    base = plan(MODEL, H100, 16, 16, space, top=1).candidates[0]
    spread = plan(MODEL, H100, 16, 16, dataclasses.replace(space, output_layer_over_pipeline=True),
                  top=1).candidates[0]
    assert spread.rank_load_max_over_mean < base.rank_load_max_over_mean
    assert spread.step_time_s < base.step_time_s


def test_no_flag_launches_the_what_if() -> None:
    assert launch_flags(CFG, MODEL)
    with pytest.raises(ValueError, match="what-if of the simulator"):
        launch_flags(SPREAD, MODEL)
