"""Uneven pipeline stages in the simulator: Megatron-LM's --decoder-first/last-pipeline-num-layers and
--account-for-embedding/loss-in-pipeline-split, checked against Megatron-Core's own layer counts."""

from __future__ import annotations

import itertools

import pytest

from megatron_bfpp.megatron.sim_cli import simulate_main
from megatron_bfpp.sim import Config, get_hardware, get_model, plan, predict
from megatron_bfpp.sim.model import EVEN_STAGES, ModelProfile, Partition, StageSplit, stage_layer_counts
from megatron_bfpp.sim.planner import SearchSpace
from megatron_bfpp.sim.predict import memory
from tests.support.sim_profiles import num_params
import tests.support.megatron_parser  # noqa: F401  (Megatron's parser: imported once, at collection)

GPT52 = get_model("gpt-52b")
A100 = get_hardware("dgx-a100")

SPLITS = [EVEN_STAGES, StageSplit(account_for_embedding=True), StageSplit(account_for_loss=True),
          StageSplit(account_for_embedding=True, account_for_loss=True), StageSplit(first_pipeline_num_layers=2),
          StageSplit(last_pipeline_num_layers=2), StageSplit(first_pipeline_num_layers=4),
          StageSplit(first_pipeline_num_layers=2, last_pipeline_num_layers=4)]


def _megatron_counts(num_layers: int, pp: int, vp: int, split: StageSplit) -> tuple[int, ...] | None:
    """Megatron-Core's layers per stage (None where its TransformerConfig refuses the split)."""
    import torch
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig

    try:
        config = TransformerConfig(
            num_layers=num_layers, hidden_size=8, num_attention_heads=2, pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vp if vp > 1 else None, pipeline_dtype=torch.float32,
            num_layers_in_first_pipeline_stage=split.first_pipeline_num_layers,
            num_layers_in_last_pipeline_stage=split.last_pipeline_num_layers,
            account_for_embedding_in_pipeline_split=split.account_for_embedding,
            account_for_loss_in_pipeline_split=split.account_for_loss)
        return tuple(get_num_layers_to_build(config, vp_stage=s // pp if vp > 1 else None, pp_rank=s % pp)
                     for s in range(pp * vp))
    except (ValueError, AssertionError):
        return None


@pytest.mark.parametrize("split", SPLITS, ids=str)
def test_stage_layer_counts_equal_megatron_cores(split: StageSplit) -> None:
    """For every L, P, V: the same layers per stage as Megatron-Core builds, and refused where it refuses (also
    where its config passes and its layer offsets divide by zero: first and last set, V > 1, no middle rank)."""
    checked = 0
    for num_layers, pp, vp in itertools.product(range(1, 13), range(1, 5), range(1, 5)):
        ends = split.first_pipeline_num_layers is not None or split.last_pipeline_num_layers is not None
        if (split.even and vp > 1 and num_layers % (pp * vp)) or (pp == 1 and (vp > 1 or ends)):
            continue  # Megatron-LM's argument validation refuses these before the config sees them
        want = _megatron_counts(num_layers, pp, vp, split)
        if want is not None and min(want) < 0:
            want = None  # more layers asked of the ends than there are: Megatron-Core fails building them
        both_ends = split.first_pipeline_num_layers is not None and split.last_pipeline_num_layers is not None
        if want is not None and both_ends and vp > 1 and pp == 2:
            want = None  # Megatron-Core's get_transformer_layer_offset fails there
        try:
            got = stage_layer_counts(num_layers, pp, vp, split)
        except ValueError:
            got = None
        assert got == want, f"L={num_layers} P={pp} V={vp} {split}: {got} != Megatron-Core's {want}"
        checked += got is not None
    assert checked >= 5, "too few valid layouts to compare"


def test_uneven_partition_places_embedding_and_head_on_their_stages() -> None:
    part = Partition(GPT52, 2, 2, 33, StageSplit(account_for_embedding=True, account_for_loss=True))
    assert part.layer_counts[0] == 0 and part.layer_counts[-1] == 0 and sum(part.layer_counts) == 64
    assert part.stage_params(0) == pytest.approx(GPT52.embedding_params() / 2)
    assert sum(part.rank_params(r) for r in range(2)) == pytest.approx(num_params(GPT52) / 2)
    with pytest.raises(ValueError, match="layers_per_stage|different layer counts"):
        part.layers_per_stage  # noqa: B018
    with pytest.raises(ValueError, match="--account-for-embedding/loss-in-pipeline-split"):
        Partition(GPT52, 2, 2, 32, StageSplit(account_for_embedding=True, account_for_loss=True))


def _cfg(split: StageSplit, vp: int, schedule: str = "interleaved-zb", zero: int = 2) -> Config:
    return Config(2, 2, vp, 128, 1, 2, schedule, zero, False, split=split)


def test_standalone_embedding_and_loss_stages_shorten_the_step_boundary() -> None:
    """52B, 512 A100, 1/2 sequence per GPU: the first stage holding only the embedding gathers and reduces less
    at the step boundary; the prediction accounts each stage's own layers, parameters and activations."""
    even = predict(GPT52, A100, _cfg(EVEN_STAGES, 32))
    split = predict(GPT52, A100, _cfg(StageSplit(account_for_embedding=True, account_for_loss=True), 33))
    assert split.exposed_dp_s < even.exposed_dp_s
    assert split.step_time_s < even.step_time_s
    assert split.memory_gib["grad_buffers"] < even.memory_gib["grad_buffers"]  # the largest stages are smaller
    assert split.to_dict()["config"]["account_for_embedding_in_pipeline_split"] is True


@pytest.mark.parametrize("schedule,zero", [("interleaved-zb", 2), ("breadth-first", 3), ("interleaved-1f1b", 1)])
def test_uneven_activation_memory_walks_each_stage(schedule: str, zero: int) -> None:
    """Stages of different sizes: each rank's activations are the peak of its own stages' bytes over its order
    (rank 0 holds fewer layers than rank 1 here, so it keeps less)."""
    split = StageSplit(first_pipeline_num_layers=16)
    cfg = Config(2, 2, 2, 128, 1, 4, schedule, zero, False, split=split)
    mem = memory(GPT52, cfg)
    assert Partition(GPT52, 2, 2, 2, split).layer_counts == (8, 24, 8, 24)
    assert 0 < mem[0]["activations"] < mem[1]["activations"]


def test_plan_searches_the_split_it_is_given() -> None:
    split = StageSplit(account_for_embedding=True, account_for_loss=True)
    res = plan(GPT52, A100, 512, 256, SearchSpace(split=split), top=3)
    assert res.candidates
    for p in res.candidates:
        assert p.config.split == split and (GPT52.num_layers + 2) % (p.config.pp * p.config.vp) == 0


def test_simulate_cli_takes_megatrons_uneven_flags(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--model", "gpt-52b", "--hardware", "dgx-a100", "--gpus", "512", "--global-batch-size", "256",
            "--micro-batch-size", "1", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
            "--pipeline-schedule", "interleaved-zb", "--zero-stage", "2"]
    flags = ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"]
    assert simulate_main(base + ["--num-virtual-stages-per-pipeline-rank", "33", *flags]) == 0
    table = capsys.readouterr().out
    assert "step time" in table and " V=33 " in table
    assert simulate_main(base + ["--num-virtual-stages-per-pipeline-rank", "32", *flags]) == 2
    assert "--account-for-embedding/loss-in-pipeline-split" in capsys.readouterr().err
    # Megatron counts the embedding and the loss as layers here too: 66 / (P = 2) / 1 = V = 33.
    assert simulate_main(base + ["--num-layers-per-virtual-pipeline-stage", "1", *flags]) == 0
    assert table == capsys.readouterr().out
    # ... but sets V of the first/last-rank split with --num-virtual-stages-per-pipeline-rank only (its own error).
    assert simulate_main(base + ["--num-layers-per-virtual-pipeline-stage", "1",
                                 "--decoder-first-pipeline-num-layers", "16"]) == 2
    assert "please use --num-virtual-stages-per-pipeline-rank" in capsys.readouterr().err


def _megatron_layouts(num_layers: int, split: StageSplit, pps: range) -> set[tuple[int, int]]:
    """Every (P, V) Megatron-Core builds for this split, found from its own layer counts (and Megatron-LM's
    argument checks above them), without the planner: the reference its search must cover."""
    ends = split.first_pipeline_num_layers is not None or split.last_pipeline_num_layers is not None
    both_ends = split.first_pipeline_num_layers is not None and split.last_pipeline_num_layers is not None
    out = set()
    for pp in pps:
        for vp in range(1, num_layers + 3):
            if (split.even and vp > 1 and num_layers % (pp * vp)) or (pp == 1 and (vp > 1 or ends)):
                continue  # Megatron-LM's argument validation refuses these
            if both_ends and vp > 1 and pp == 2:
                continue  # Megatron-Core's get_transformer_layer_offset divides by zero middle ranks
            counts = _megatron_counts(num_layers, pp, vp, split)
            if counts is not None and min(counts) >= 0:
                out.add((pp, vp))
    return out


def _planner_layouts(model, split: StageSplit) -> set[tuple[int, int]]:
    """The (P, V) the planner's enumeration reaches, on a machine where every P fits (GPUs and batch a common
    multiple of every P, one micro-batch per pipeline rank)."""
    from math import lcm

    from megatron_bfpp.sim.planner import enumerate_configs

    gpus = lcm(*range(1, model.num_layers + 3))
    space = SearchSpace(schedules=("1f1b", "breadth-first"), zero_stages=(0,), tp_sizes=(1,), micro_batch_sizes=(1,),
                        recompute=(False,), search_group_size=False, split=split, search_layouts=False)
    configs, _ = enumerate_configs(model, A100, gpus, gpus, space)
    return {(c.pp, c.vp) for c in configs}


@pytest.mark.parametrize("split", SPLITS, ids=str)
def test_planner_reaches_every_layout_megatron_builds(split: StageSplit) -> None:
    """14 layers, every P and V: the planner's candidate layouts under Megatron's split flags (free layouts not
    searched) are exactly those Megatron-Core builds."""
    model = ModelProfile("fourteen", 14, 256, 4)
    want = _megatron_layouts(model.num_layers, split, range(1, model.num_layers + 3))
    assert len(want) >= 4
    assert _planner_layouts(model, split) == want


def test_planner_reaches_52b_with_standalone_embedding_and_loss_stages() -> None:
    """52B at P = 2 with the embedding and the loss counted as layers: V = 1, 3, 11 and 33 (33 stages of 2 units,
    the first holding the embedding alone and the last the output layer alone)."""
    split = StageSplit(account_for_embedding=True, account_for_loss=True)
    want = _megatron_layouts(GPT52.num_layers, split, range(2, 3))
    assert want == {(2, 1), (2, 3), (2, 11), (2, 33)}
    assert {(p, v) for p, v in _planner_layouts(GPT52, split) if p == 2} == want


@pytest.mark.parametrize("split", [StageSplit(account_for_embedding=True, account_for_loss=True),
                                   StageSplit(first_pipeline_num_layers=4)], ids=str)
def test_plan_over_uneven_stages_is_exact(split: StageSplit) -> None:
    """The planner's bound stays a bound with uneven stages: its top K equal a brute-force search."""
    from megatron_bfpp.sim.planner import enumerate_configs

    model, hw = get_model("gpt-1.3b"), A100.replace(hbm_bytes=20e9)
    space = SearchSpace(micro_batch_sizes=(1, 2), zero_stages=(1, 3), tp_sizes=(1, 2), recompute=(False,),
                        split=split)
    res = plan(model, hw, 16, 32, space, top=3)
    configs, _ = enumerate_configs(model, hw, 16, 32, space)
    # The brute force covers every layout Megatron-Core builds on 16 GPUs (found without the planner).
    assert {(c.pp, c.vp) for c in configs} == {
        (p, v) for p, v in _megatron_layouts(model.num_layers, split, range(1, 17)) if 16 % p == 0}
    ref = sorted((p for p in (predict(model, hw, c) for c in configs) if p.fits), key=lambda p: -p.tflops_per_gpu)
    assert any(not p.config.partition(model).split.even for p in ref)
    assert [p.tflops_per_gpu for p in res.candidates] == pytest.approx([p.tflops_per_gpu for p in ref[:3]], rel=1e-12)
    assert res.simulated < len(ref)
