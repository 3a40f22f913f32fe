"""`pretrain_gpt.py` flags read into the simulator's model and configuration (megatron_bfpp/megatron/sim_flags.py):
each feature pinned with Megatron-LM's meanings and defaults, and the refusals (Megatron's own, the plugin's, what
the simulator does not model), each naming the flag."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_bfpp.megatron.presets import preset_flags, preset_names
from megatron_bfpp.megatron.sim_flags import FlagError, launch_flags, read_run
from megatron_bfpp.sim import get_hardware
from megatron_bfpp.sim.model import MODELS, StageSplit
import tests.support.megatron_parser  # noqa: F401  (Megatron's parser: imported once, at collection)

H100 = get_hardware("dgx-h100")
A100 = get_hardware("dgx-a100")
BASE = ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "2048",
        "--max-position-embeddings", "2048", "--micro-batch-size", "1", "--global-batch-size", "16", "--bf16",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "32000"]


def _read(*extra: str, gpus: int = 8, hw=H100):
    return read_run([*BASE, *" ".join(extra).split()], gpus, hw)


def test_megatron_defaults() -> None:
    """Megatron's defaults: tied embeddings, one query group per head, 4h GeLU MLP, learned positions, LayerNorm,
    biases, dropout 0.1; stock Megatron's 1F1B with its DDP (ZeRO-0, no overlap, optimizer after the schedule);
    no sequence parallelism, flash attention, bf16 GEMMs, no recomputation."""
    m, c = _read(gpus=8)
    assert (m.num_layers, m.hidden_size, m.num_heads, m.seq_length, m.vocab_size) == (8, 1024, 16, 2048, 32000)
    assert not m.untie_embeddings and m.num_query_groups is None and m.ffn == 4096 and not m.swiglu
    assert m.position_embedding == "learned_absolute" and not m.rms_norm and m.add_bias_linear
    assert (m.hidden_dropout, m.attention_dropout, m.make_vocab_size_divisible_by) == (0.1, 0.1, 128)
    assert not m.is_moe
    assert (c.tp, c.pp, c.vp, c.cp, c.ep, c.dp, c.micro_batch_size, c.microbatches) == (1, 1, 1, 1, 1, 8, 1, 2)
    assert c.schedule == "1f1b" and c.zero_stage == 0 and c.stock_optimizer and not c.dp_overlap and c.p2p_overlap
    assert not c.sequence_parallel and c.attention == "flash" and c.fp8 is None
    assert not c.recompute and not c.selective_recompute and c.recompute_num_layers is None


def test_grouped_query_attention_only_with_its_flag() -> None:
    assert _read("--num-query-groups 4")[0].num_query_groups is None  # Megatron ignores it without the flag
    m, _ = _read("--group-query-attention --num-query-groups 4 --kv-channels 128")
    assert m.num_query_groups == 4 and m.kv_size == 4 * 128 and m.q_size == 16 * 128


def test_swiglu_width_as_megatron_derives_it() -> None:
    m, _ = _read("--swiglu")
    assert m.swiglu and m.ffn == int(4 * 1024 * 2 / 3 / 64) * 64 == 2688 and m.mlp_matrices == 3
    assert _read("--swiglu --ffn-hidden-size 3000")[0].ffn == 3000
    assert _read("--squared-relu")[0].mlp_matrices == 2  # not gated


def test_model_shape_flags() -> None:
    m, _ = _read("--untie-embeddings-and-output-weights --position-embedding-type rope --normalization RMSNorm "
                 "--disable-bias-linear --hidden-dropout 0 --attention-dropout 0 --make-vocab-size-divisible-by 64")
    assert m.untie_embeddings and m.position_embedding == "rope" and m.rms_norm and not m.add_bias_linear
    assert (m.hidden_dropout, m.attention_dropout, m.make_vocab_size_divisible_by) == (0.0, 0.0, 64)
    gpt2 = read_run([f for f in BASE if f not in ("--tokenizer-type", "NullTokenizer", "--vocab-size", "32000")],
                    8, H100)[0]
    assert gpt2.vocab_size == 50257  # GPT2BPETokenizer's vocabulary, Megatron's default tokenizer here
    with pytest.raises(FlagError, match="--vocab-size"):
        read_run([f for f in BASE if f not in ("--vocab-size", "32000")], 8, H100)


def test_moe_pattern_from_moe_layer_freq() -> None:
    m, c = _read("--num-experts 8 --moe-router-topk 2 --moe-layer-freq 2")
    assert m.moe_layer_pattern == (1, 0, 1, 0, 1, 0, 1, 0) and m.num_moe_layers == 4
    assert m.expert_ffn == m.ffn and m.moe_router_topk == 2 and c.ep == 1
    m, _ = _read("--num-experts 8 --moe-layer-freq ([0]+[1]*3)*2 --moe-ffn-hidden-size 512 "
                 "--moe-shared-expert-intermediate-size 1024 --moe-router-topk 4")
    assert m.moe_layer_pattern == (0, 1, 1, 1, 0, 1, 1, 1) and m.expert_ffn == 512
    assert m.moe_shared_expert_size == 1024 and m.moe_router_topk == 4
    _, c = _read("--num-experts 8 --expert-model-parallel-size 4 --moe-token-dispatcher-type alltoall "
                 "--expert-tensor-parallel-size 1 --tensor-model-parallel-size 2 --sequence-parallel "
                 "--disable-bias-linear --overlap-moe-expert-parallel-comm", gpus=16)
    assert (c.tp, c.ep, c.etp, c.dp, c.moe_a2a_overlap) == (2, 4, 1, 8, True)
    with pytest.raises(FlagError, match="--moe-token-dispatcher-type alltoall"):
        _read("--num-experts 8 --expert-model-parallel-size 4")  # Megatron's default dispatcher is allgather


def test_fp8_format_with_its_recipe() -> None:
    assert _read("--fp8-format hybrid")[1].fp8 == "delayed"  # Megatron's default recipe
    assert _read("--fp8-format e4m3 --fp8-recipe tensorwise")[1].fp8 == "tensorwise"
    assert _read("--fp8-format hybrid --fp8-recipe mxfp8", hw=get_hardware("dgx-b200"))[1].fp8 == "mxfp8"
    assert _read("--fp8-recipe tensorwise")[1].fp8 is None  # a recipe without a format: bf16 GEMMs


def test_attention_kernel() -> None:
    for flags in ("--attention-backend unfused", "--transformer-impl local", "--attention-backend local --spec local"):
        assert _read(flags)[1].attention == "unfused", flags
    for flags in ("", "--attention-backend flash", "--attention-backend fused", "--attention-backend auto"):
        assert _read(flags)[1].attention == "flash", flags


@pytest.mark.parametrize("flags, full, layers, selective", [
    ("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1", True, None, False),
    ("--recompute-granularity full --recompute-method uniform --recompute-num-layers 2", True, None, False),
    ("--recompute-granularity full --recompute-method block --recompute-num-layers 3", True, 3, False),
    ("--recompute-granularity selective", False, None, True),
    ("--recompute-activations", False, None, True),  # Megatron's older spelling of selective
])
def test_recompute_variants(flags: str, full: bool, layers: int | None, selective: bool) -> None:
    c = _read(flags)[1]
    assert (c.recompute, c.recompute_num_layers, c.selective_recompute) == (full, layers, selective)


def test_stock_and_plugin_schedules_and_optimizers() -> None:
    pipe = "--pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 1"
    c = _read(pipe, "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather", gpus=16)[1]
    assert (c.schedule, c.vp, c.zero_stage, c.dp_overlap, c.stock_optimizer) == ("interleaved-1f1b", 2, 1, True, True)
    assert not c.optimizer_in_schedule and c.p2p_overlap
    c = _read(pipe, "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather "
                    "--overlap-param-gather-with-optimizer-step --ckpt-format torch --no-overlap-p2p-communication",
              gpus=16)[1]
    assert c.param_gather_with_optimizer and not c.p2p_overlap
    c = _read(pipe, "--pipeline-schedule breadth-first --zero-stage 3 --bfpp-weight-buffers 3", gpus=16)[1]
    assert (c.schedule, c.zero_stage, c.dp_overlap, c.stock_optimizer, c.weight_buffers) == (
        "breadth-first", 3, True, False, 3)
    assert c.optimizer_in_schedule
    c = _read(pipe, "--pipeline-schedule breadth-first-zb --microbatch-group-size-per-virtual-pipeline-stage 4",
              gpus=8)[1]
    assert (c.schedule, c.zero_stage, c.stock_optimizer, c.group_size, c.microbatches) == (
        "breadth-first-zb", 0, True, 4, 8)  # Megatron's DDP under the plugin's schedule


def test_parallel_sizes_and_features() -> None:
    c = _read("--tensor-model-parallel-size 2 --context-parallel-size 2 --pipeline-model-parallel-size 2 "
              "--sequence-parallel --tp-comm-overlap --decoder-first-pipeline-num-layers 2 "
              "--num-virtual-stages-per-pipeline-rank 2", gpus=32)[1]
    assert (c.tp, c.cp, c.pp, c.vp, c.dp, c.num_gpus) == (2, 2, 2, 2, 4, 32)
    assert c.sequence_parallel and c.tp_comm_overlap
    assert c.split == StageSplit(first_pipeline_num_layers=2)


def test_presets_are_the_models_of_before_and_published_ones() -> None:
    assert {"gpt-1.3b", "gpt-13b", "gpt-52b", "gpt-175b", "gpt3-175b", "llama3-8b", "llama3-70b", "llama3.1-405b",
            "nemotron4-340b", "mixtral-8x7b", "qwen3-30b-a3b", "qwen3-235b-a22b"} <= set(preset_names())
    batch = ["--micro-batch-size", "1", "--global-batch-size", "8"]
    for name, profile in MODELS.items():
        m, _ = read_run([*preset_flags(name), *batch], 8, A100, name)
        assert m == dataclasses.replace(profile, ffn_hidden_size=profile.ffn, kv_channels=profile.head_dim), name
    llama, _ = read_run([*preset_flags("llama3-70b"), *batch], 8, H100)
    assert (llama.num_query_groups, llama.ffn, llama.vocab_size, llama.seq_length) == (8, 28672, 128256, 8192)
    assert llama.swiglu and llama.rms_norm and llama.untie_embeddings and llama.position_embedding == "rope"
    qwen, _ = read_run([*preset_flags("qwen3-30b-a3b"), *batch], 8, H100)
    assert (qwen.num_experts, qwen.moe_router_topk, qwen.expert_ffn, qwen.head_dim) == (128, 8, 768, 128)
    assert qwen.num_moe_layers == 48
    with pytest.raises(ValueError, match="unknown --model 'gpt-7b'"):
        preset_flags("gpt-7b")


@pytest.mark.parametrize("extra, message", [
    ("--foo 3", "Megatron-LM rejects the flags: unrecognized arguments: --foo 3"),
    ("--overlap-param-gather", "Megatron-LM rejects the flags: --overlap-param-gather only supported with "
                               "distributed optimizer"),
    ("--pipeline-model-parallel-size 3", "Megatron-LM rejects the flags"),  # 8 layers over 3 ranks
    ("--tensor-model-parallel-size 2 --tp-comm-overlap", "sequence parallelism"),
    ("--recompute-granularity selective --recompute-method uniform", "Megatron-LM rejects the flags"),
    ("--pipeline-schedule breadth-first --zero-stage 3 --use-distributed-optimizer",
     "drop --use-distributed-optimizer"),  # the plugin's check
    ("--zero-stage 2", "--zero-stage needs megatron_bfpp's schedule runtime"),
    ("--global-batch-size 12", "Megatron-LM rejects the flags: eval_global_batch_size (12) must be divisible"),
])
def test_megatron_and_plugin_errors_name_the_flag(extra: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _read(extra, gpus=8)


def test_a_free_layout_is_read_stage_by_stage() -> None:
    """--pipeline-model-parallel-layout: stage s on rank s mod P, V from the stage count, the embedding alone on
    stage 0 and the loss alone on the last; its launch flags give it back."""
    from megatron_bfpp.megatron.sim_flags import launch_flags

    m, c = _read("--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout E|ttt|(tt|)*2t|L",
                 "--pipeline-schedule breadth-first --zero-stage 3")
    assert (c.pp, c.vp) == (2, 3) and c.split.layout == (0, 3, 2, 2, 1, 0)
    assert c.partition(m).layer_counts == (0, 3, 2, 2, 1, 0)
    flags = launch_flags(c, m)
    assert flags[flags.index("--pipeline-model-parallel-layout") + 1] == "E|ttt|(tt|)*2t|L"
    assert "--num-layers-per-virtual-pipeline-stage" not in flags
    with pytest.raises(ValueError, match="must be divisible by pipeline_model_parallel_size"):
        _read("--pipeline-model-parallel-size 4 --pipeline-model-parallel-layout E|ttt|(tt|)*2t|L")
    with pytest.raises(ValueError, match="^--pipeline-model-parallel-layout 'Et|m|t\\*6L': multi-token"):
        _read("--pipeline-model-parallel-size 3 --pipeline-model-parallel-layout Et|m|t*6L")


@pytest.mark.parametrize("extra, flag", [
    ("--multi-latent-attention", "--multi-latent-attention"),
    ("--mtp-num-layers 1", "--mtp-num-layers"),
    ("--fp4-format e2m1", "--fp4-format"),
    ("--hybrid-layer-pattern M*8", "--hybrid-layer-pattern"),
    ("--recompute-granularity selective --recompute-modules mlp", "--recompute-modules mlp"),
])
def test_what_the_simulator_does_not_model_is_refused_by_name(extra: str, flag: str) -> None:
    with pytest.raises(FlagError, match=f"^{flag}: the simulator does not model"):
        _read(extra)
    with pytest.raises(FlagError, match="^--bf16: "):
        read_run([f for f in BASE if f != "--bf16"], 8, H100)  # Megatron's fp32 training


def test_launch_flags_read_back_to_the_same_configuration() -> None:
    for extra, gpus in (("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
                         "--num-layers-per-virtual-pipeline-stage 2 --use-distributed-optimizer --overlap-grad-reduce "
                         "--overlap-param-gather --recompute-granularity full --recompute-method block "
                         "--recompute-num-layers 1", 16),
                        ("--pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 1 "
                         "--pipeline-schedule breadth-first-zb --zero-stage 2 "
                         "--microbatch-group-size-per-virtual-pipeline-stage 4 --context-parallel-size 2", 16)):
        model, cfg = _read(extra, gpus=gpus)
        back = read_run([*BASE, *launch_flags(cfg, model)], gpus, H100)[1]
        assert back == cfg, extra
