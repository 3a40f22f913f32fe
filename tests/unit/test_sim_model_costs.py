"""The cost terms of today's models, each pinned against a hand computation: grouped-query attention, SwiGLU,
vocabulary padding, tied embeddings, Megatron's own FLOP count, MoE parameters, all-to-all bytes and expert GEMMs,
context parallelism's ring, FP8 rates and casts, sequence parallelism off, unfused attention's activations.
Pure Python (Megatron is imported once, for its FLOP count)."""

from __future__ import annotations

import argparse
import math

import pytest

from megatron_bfpp.sim import Config, Partition, analytic_costs, get_hardware, predict
from megatron_bfpp.sim.layer_costs import (
    all_to_all_time, gemm_time, group_span, layer_ops, p2p_time, ring_time, stream_time, wave_efficiency,
)
from megatron_bfpp.sim.model import ModelProfile

A100 = get_hardware("dgx-a100")
H100 = get_hardware("dgx-h100")
# Llama-3-70B's shape (80 layers, h 8192, 64 heads in 8 query groups, SwiGLU 28672, 128256 vocabulary, RoPE).
LLAMA70 = ModelProfile("llama3-70b", 80, 8192, 64, 8192, 128256, 28672, num_query_groups=8, swiglu=True,
                       position_embedding="rope", rms_norm=True, add_bias_linear=False, hidden_dropout=0.0,
                       attention_dropout=0.0)
# A small MoE: 8 layers, every other one with 16 experts (top-4, expert ffn 512) and a 1024-wide shared expert.
MOE = ModelProfile("moe", 8, 1024, 16, 2048, 32000, 4096, num_query_groups=4, swiglu=True, position_embedding="rope",
                   add_bias_linear=False, num_experts=16, moe_router_topk=4, moe_ffn_hidden_size=512,
                   moe_shared_expert_size=1024, moe_layer_pattern=(0, 1) * 4)


# ------------------------------------------------------------------ shapes and parameters

def test_grouped_query_attention_shrinks_k_and_v():
    h, q, kv = 8192, 64 * 128, 8 * 128
    assert (LLAMA70.q_size, LLAMA70.kv_size) == (q, kv)
    assert LLAMA70.attention_params() == h * (q + 2 * kv) + q * h + h  # no biases, one RMSNorm weight
    part = Partition(LLAMA70, 8, 1, 1)
    n = 8192  # tokens of one micro-batch
    ops = layer_ops(H100, part, 1)
    assert ops.fwd["qkv"] == pytest.approx(gemm_time(H100, n, h, (q + 2 * kv) / 8))
    mha = ModelProfile("mha", 80, 8192, 64, 8192, 128256, 28672, swiglu=True)
    assert layer_ops(H100, Partition(mha, 8, 1, 1), 1).fwd["qkv"] > ops.fwd["qkv"]
    with pytest.raises(ValueError, match="--tensor-model-parallel-size 16 must divide .* 8 query groups"):
        Partition(LLAMA70, 16, 1, 1)


def test_swiglu_has_three_matrices_and_a_double_width_fc1():
    h, f = 8192, 28672
    assert LLAMA70.mlp_params(f) == 3 * h * f
    assert LLAMA70.layer_params() == LLAMA70.attention_params() + 3 * h * f + h
    part = Partition(LLAMA70, 4, 1, 1)
    ops = layer_ops(H100, part, 1)
    n = 8192
    assert ops.fwd["fc1"] == pytest.approx(gemm_time(H100, n, h, 2 * f / 4))
    assert ops.fwd["fc2"] == pytest.approx(gemm_time(H100, n, f / 4, h))
    # Llama-3-70B: 70.6e9 parameters (80 x 856e6 per layer + two 1.05e9 embeddings).
    assert LLAMA70.num_parameters() == pytest.approx(70.55e9, rel=0.005)


def test_vocabulary_padded_as_megatron_pads_it():
    gpt = ModelProfile("gpt", 2, 256, 4, 128, 50257)
    assert [gpt.padded_vocab_size(t) for t in (1, 2, 8)] == [50304, 50432, 51200]  # multiples of 128 T
    assert LLAMA70.padded_vocab_size(4) == 128512  # 128256 -> a multiple of 512


def test_tied_embeddings_copy_the_output_layer_to_the_last_stage_and_all_reduce_it():
    tied = ModelProfile("tied", 8, 1024, 16, 2048, 32000, untie_embeddings=False)
    untied = ModelProfile("untied", 8, 1024, 16, 2048, 32000)
    assert untied.num_parameters() - tied.num_parameters() == 32000 * 1024
    part = Partition(tied, 1, 2, 1)
    assert part.stage_params(1) == pytest.approx(4 * tied.layer_params() + 32000 * 1024 + 2 * 1024)
    cfg = Config(1, 2, 1, 4, 1, 4, "1f1b", 1, False)
    cost_t, cost_u = analytic_costs(A100, part, cfg), analytic_costs(A100, Partition(untied, 1, 2, 1), cfg)
    # The last stage's reduction adds the embedding gradient's all-reduce over the two end stages (same node).
    emb = ring_time(A100, 4 * 32000 * 1024, 2, 1, "all_reduce")
    assert cost_t.reduce[1] - cost_u.reduce[1] == pytest.approx(emb, rel=1e-9)


def _megatron_args(m: ModelProfile, tp: int) -> argparse.Namespace:
    pattern = list(m.moe_layer_pattern) if m.moe_layer_pattern else 1
    return argparse.Namespace(
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_heads,
        seq_length=m.seq_length, padded_vocab_size=m.padded_vocab_size(tp), ffn_hidden_size=m.ffn,
        group_query_attention=m.num_query_groups is not None, num_query_groups=m.query_groups,
        kv_channels=m.head_dim, swiglu=m.swiglu, num_experts=m.num_experts, moe_layer_freq=pattern,
        moe_router_topk=m.moe_router_topk, moe_ffn_hidden_size=m.moe_ffn_hidden_size, moe_latent_size=None,
        moe_shared_expert_intermediate_size=m.moe_shared_expert_size or None, mtp_num_layers=None,
        multi_latent_attention=False, attention_output_gate=False, experimental_attention_variant=None,
        hybrid_layer_pattern=None, hybrid_override_pattern=None, is_hybrid_model=False)


@pytest.fixture(scope="module")
def megatron_training():
    """megatron.training.training, imported once outside the tests' timed calls (it pulls in torch and more)."""
    from megatron.training import training

    return training


@pytest.mark.parametrize("model", [ModelProfile("gpt-52b", 64, 8192, 64), LLAMA70, MOE], ids=lambda m: m.name)
def test_model_flops_are_megatrons_own_count(model, megatron_training):
    training = megatron_training
    for tp in (1, 8) if model.num_heads % 8 == 0 else (1,):
        ours = model.megatron_flops_per_sequence(tp) * 3
        theirs = training.num_floating_point_operations(_megatron_args(model, tp), 3)
        assert ours == pytest.approx(theirs, rel=1e-12)


# ------------------------------------------------------------------ MoE

def test_moe_parameters_split_into_dense_and_expert_parts():
    h, e, fe = 1024, 16, 512
    router, shared, experts = h * e, 3 * h * 1024, e * 3 * h * fe
    assert MOE.layer_expert_params(1) == experts and MOE.layer_expert_params(0) == 0
    # attention_params holds the attention's LayerNorm (weight and bias); the MLP's LayerNorm is 2h more.
    assert MOE.layer_dense_params(1) == MOE.attention_params() + 2 * h + router + shared
    part = Partition(MOE, 2, 1, 1, ep=4)  # expert tensor parallelism defaults to T, as Megatron's
    dense = sum(MOE.layer_dense_params(i) for i in range(8))
    want = (dense + MOE.embedding_params(2) + MOE.head_params(2, pipelined=False)) / 2 + 4 * experts / (4 * 2)
    assert part.stage_params(0) == pytest.approx(want)
    assert part.stage_expert_params(0) == pytest.approx(4 * experts / 8)


def test_moe_dispatch_and_combine_move_k_copies_of_each_token():
    """Each GPU sends its 1/T of the tokens, k copies, h wide, bf16, to the EP ranks: twice in the forward
    (dispatch, combine) and twice in the backward; across nodes at the NIC's measured all-to-all rate."""
    n = 2048  # one sequence of one micro-batch
    for ep, hw in ((4, H100), (16, H100)):
        part = Partition(MOE, 2, 1, 1, ep=ep)
        ops = layer_ops(hw, part, 1, layer=1)
        nbytes = 2 * (n / 2) * 4 * 1024
        n_in, n_out = group_span(hw, ep, 2)  # EP ranks are ETP (= T) apart
        assert (n_in, n_out) == ((ep, 1) if ep * 2 <= 8 else (4, ep // 4))
        if n_out == 1:
            one = hw.collective_overhead_s + nbytes * (ep - 1) / ep / (450e9 * 320 / 450) + (ep - 1) * 2e-6
        else:
            one = hw.collective_overhead_s + nbytes * (ep - 1) / ep / (50e9 * 48 / 50) + (ep - n_in) * 5e-6
        assert all_to_all_time(hw, nbytes, n_in, n_out) == pytest.approx(one)
        assert ops.fwd["moe_a2a"] == pytest.approx(2 * one) and ops.bwd["moe_a2a"] == pytest.approx(2 * one)
    assert "moe_a2a" not in layer_ops(H100, Partition(MOE, 2, 1, 1, ep=4), 1, layer=0).fwd  # a dense layer
    # What another micro-batch's all-to-all may run behind (the engine's pairs): the layer's compute before its
    # all-to-all, communication excluded, and the weight-gradient part of its backward.
    ops = layer_ops(H100, Partition(MOE, 2, 1, 1, ep=4), 1, layer=1)
    comm = ("tp_comm", "moe_a2a")
    for side, cover in ((ops.fwd, ops.a2a_cover[0]), (ops.bwd, ops.a2a_cover[1])):
        core = sum(side[k] for k in ("qkv", "proj", "attention", "router", "experts"))
        assert core < cover < sum(v for k, v in side.items() if k not in comm)  # the layer's norms come after
    assert 0 < ops.a2a_cover[2] < ops.weight_grad  # the shared expert's come after
    assert layer_ops(H100, Partition(MOE, 2, 1, 1, ep=4), 1, layer=0).a2a_cover == (0.0, 0.0, 0.0)  # dense


def test_expert_gemms_at_the_tokens_each_expert_gets():
    """Balanced routing: a GPU's 1/T of the tokens, k copies each, spread over E experts of which it holds E/EP; at
    ETP > 1 the ETP ranks' tokens are gathered and each expert is 1/ETP wide. One grouped kernel each for fc1, fc2."""
    o = H100.kernel_overhead_s
    for etp, per_expert in ((1, (2048 / 2) * 4 * 4 / 16), (2, (2048 / 2) * 2 * 4 * 4 / 16)):
        ops = layer_ops(H100, Partition(MOE, 2, 1, 1, ep=4, etp=etp), 1, layer=1)
        local = 16 // 4
        fc1 = local * (gemm_time(H100, per_expert, 1024, 2 * 512 / etp) - o) + o
        fc2 = local * (gemm_time(H100, per_expert, 512 / etp, 1024) - o) + o
        assert ops.fwd["experts"] == pytest.approx(fc1 + fc2)


# ------------------------------------------------------------------ context parallelism

def test_ring_attention_sends_kv_chunks_around_the_cp_ranks():
    """CP - 1 steps, each a K and a V chunk (2 x tokens/CP x kv width/T, bf16), exposed beyond one chunk's
    attention; the backward sends them and their gradients."""
    m = ModelProfile("cp", 2, 1024, 8, 8192, 32000, num_query_groups=8)  # little attention work: exposed ring
    for cp in (2, 4):
        part = Partition(m, 1, 1, 1, cp=cp)
        ops = layer_ops(H100, part, 1)
        tokens = 8192 / cp
        step = p2p_time(H100, 2 * 2 * tokens * m.kv_size, inter_node=False)
        f, b = ops.fwd["attention"], ops.bwd["attention"]
        assert ops.fwd["cp_comm"] == pytest.approx((cp - 1) * max(0.0, step - f / cp))
        assert ops.bwd["cp_comm"] == pytest.approx((cp - 1) * max(0.0, 2 * step - b / cp))
        # Each rank computes 1/CP of the causal attention (Megatron's load-balanced 2 x CP chunks).
        flops = 4 * 8192 ** 2 * m.q_size / cp / 2
        assert f == pytest.approx(flops / H100.attention_flops() + H100.kernel_overhead_s)
    with pytest.raises(ValueError, match="--context-parallel-size 3"):
        Partition(ModelProfile("odd", 2, 1024, 8, 1000), 1, 1, 1, cp=3)


# ------------------------------------------------------------------ FP8

def test_fp8_gemms_at_the_fp8_rate_with_one_byte_operands_and_casts():
    m, k, n = 8192, 8192, 8192
    wave = wave_efficiency(H100, m, n)
    assert gemm_time(H100, m, k, n, fp8=True) == pytest.approx(
        2 * m * k * n / (1402.6e12 * 0.858 * wave) + 5e-6)  # maximum achievable FP8 matmul rate, H100 SXM
    assert gemm_time(H100, m, k, n, fp8=True) < 0.6 * gemm_time(H100, m, k, n)
    part, fp8 = Partition(LLAMA70, 8, 1, 1), Partition(LLAMA70, 8, 1, 1, fp8="delayed")
    bf, f8 = layer_ops(H100, part, 1), layer_ops(H100, fp8, 1)
    h, q, kv, f = 8192, 8192, 1024, 28672
    tokens = 8192
    assert f8.fwd["qkv"] == pytest.approx(gemm_time(H100, tokens, h, (q + 2 * kv) / 8, fp8=True))
    # Casts: each GEMM input read (2 bytes) and written twice (1 byte, and 1 transposed) with delayed scaling.
    inputs = tokens * (h + q / 8 + h + f / 8)
    want = sum(stream_time(H100, 4 * tokens * k_) for k_ in (h, q / 8, h, f / 8))
    assert f8.fwd["fp8_casts"] == pytest.approx(want) and inputs > 0
    current = layer_ops(H100, Partition(LLAMA70, 8, 1, 1, fp8="tensorwise"), 1)
    assert current.fwd["fp8_casts"] == pytest.approx(sum(stream_time(H100, 6 * tokens * k_)
                                                         for k_ in (h, q / 8, h, f / 8)))  # + an amax read
    assert "fp8_casts" not in bf.fwd and f8.forward < bf.forward
    cfg = Config(8, 1, 1, 1, 1, 1, "1f1b", 1, False, fp8="delayed")
    with pytest.raises(ValueError, match="--fp8-format: dgx-a100 has no FP8 tensor cores"):
        predict(LLAMA70, A100, cfg)
    assert predict(LLAMA70, H100, cfg).mfu == pytest.approx(
        predict(LLAMA70, H100, cfg).tflops_per_gpu * 1e12 / 1979e12)  # MFU against the FP8 dense peak


# ------------------------------------------------------------------ sequence parallelism and attention kernels

def test_without_sequence_parallelism_two_all_reduces_and_full_size_norms():
    m = ModelProfile("gpt", 2, 4096, 32, 2048)
    sp, no = layer_ops(A100, Partition(m, 8, 1, 1), 1), layer_ops(A100, Partition(m, 8, 1, 1, sequence_parallel=False), 1)
    c = ring_time(A100, 2 * 2048 * 4096, 8, 1, "all_gather")
    assert sp.fwd["tp_comm"] == pytest.approx(4 * c)  # all-gather, all-gather, reduce-scatter, reduce-scatter
    assert no.fwd["tp_comm"] == pytest.approx(2 * 2 * c)  # an all-reduce after the projection and after fc2
    # Norms, residual adds and dropout run on all tokens on every tensor-parallel rank without SP.
    assert no.fwd["elementwise"] > sp.fwd["elementwise"]
    assert Partition(m, 8, 1, 1, sequence_parallel=False).p2p_bytes(1) == 2 * 2048 * 4096
    assert Partition(m, 8, 1, 1).p2p_bytes(1) == 2 * 2048 * 4096 / 8


def test_unfused_attention_keeps_the_scores_and_selective_recomputation_drops_them():
    m = ModelProfile("gpt", 2, 4096, 32, 2048)
    flash, unfused = Partition(m, 8, 1, 1), Partition(m, 8, 1, 1, attention="unfused")
    sbh = 2048 * 4096
    assert flash.layer_activation_bytes(1, 0, False) == pytest.approx(34 * sbh / 8)  # Korthikanti et al., Table 2
    # + 5 a s^2 b / T: softmax output, dropout mask and output (Korthikanti et al.'s 5as/h term).
    assert unfused.layer_activation_bytes(1, 0, False) == pytest.approx(34 * sbh / 8 + 5 * 32 * 2048 ** 2 / 8)
    assert unfused.layer_activation_bytes(1, 0, False, selective=True) == pytest.approx(34 * sbh / 8)
    assert layer_ops(A100, unfused, 1).fwd["attention"] > layer_ops(A100, flash, 1).fwd["attention"]


def test_wave_quantization():
    # 8192 x 2304 outputs: 32 x 18 = 576 tiles of 256 x 128 on 108 SMs: 6 waves, 5.33 of them useful.
    assert wave_efficiency(A100, 8192, 2304) == pytest.approx(576 / (6 * 108))
    assert wave_efficiency(A100, 8192, 8192) == pytest.approx(2048 / (19 * 108))
    assert math.isclose(wave_efficiency(A100.replace(sm_count=0), 8192, 2304), 1.0)


# ------------------------------------------------------------------ a profile from the device kit's layer table

def test_measured_profile_takes_the_devices_rates():
    """A layer table whose GEMMs ran at 500 TFLOP/s and attention at 400 / 250 forward / backward gives a profile
    with those rates (the in-layer fraction then 1: the GEMMs were timed in a layer's setting)."""
    from megatron_bfpp.sim.layer_costs import measured_profile

    m = ModelProfile("gpt", 1, 4096, 32, 2048)
    n, h, f = 2048, 4096, 16384
    gemms = {"qkv": (h, 3 * h), "proj": (h, h), "fc1": (h, f), "fc2": (f, h)}
    rows = [{"op": op, "fwd_measured_ms": 2 * n * k * o / 500e12 * 1e3, "bwd_measured_ms": 4 * n * k * o / 500e12 * 1e3}
            for op, (k, o) in gemms.items()]
    attn = 4 * n * n * h / 2
    rows.append({"op": "attention", "fwd_measured_ms": attn / 400e12 * 1e3, "bwd_measured_ms": 2.5 * attn / 250e12 * 1e3})
    rows.append({"op": "elementwise", "fwd_measured_ms": 0.1, "bwd_measured_ms": 0.2})
    hw = measured_profile(H100, {"micro_batch_size": 1, "ops": rows, "device": "H100"}, m)
    assert hw.gemm_flops() == pytest.approx(500e12) and hw.in_layer_fraction == 1.0
    assert hw.attention_flops() == pytest.approx(400e12)
    assert hw.attention_flops(backward=True) == pytest.approx(250e12)
    with pytest.raises(ValueError, match="no measured attention"):
        measured_profile(H100, {"micro_batch_size": 1, "ops": rows[:4]}, m)


def test_fp8_weight_copies_stay_resident():
    """TransformerEngine keeps an FP8 copy and its transpose of every decoder-layer weight all step (through ZeRO-3's
    releases): 2 bytes per layer parameter on the GPU, not the embedding's or the output layer's."""
    from megatron_bfpp.sim.costs import memory_breakdown

    cfg = Config(8, 4, 2, 8, 1, 8, "breadth-first", 3, False, fp8="delayed")
    part = cfg.partition(LLAMA70)
    mem = memory_breakdown(part, cfg, 1, 0.0)  # rank 1: middle stages 1 and 5, layers only
    assert mem["fp8_weight_copies"] == pytest.approx(2 * (part.stage_params(1) + part.stage_params(5)))
    first = memory_breakdown(part, cfg, 0, 0.0)
    assert first["fp8_weight_copies"] == pytest.approx(
        2 * (part.stage_params(0) + part.stage_params(4) - LLAMA70.embedding_params(8) / 8))
    assert "fp8_weight_copies" not in memory_breakdown(part, Config(8, 4, 2, 8, 1, 8, "breadth-first", 3, False), 1, 0.0)


def test_gradients_reduced_in_bf16_halve_the_reduction_and_the_buffers():
    """--grad-reduce-in-bf16: Megatron's gradient buffers, and so their reduce-scatter, in bf16 (2 bytes)."""
    from megatron_bfpp.sim.costs import memory_breakdown

    base = Config(8, 4, 2, 8, 1, 8, "interleaved-1f1b", 1, False, stock_optimizer=True)
    bf16 = Config(8, 4, 2, 8, 1, 8, "interleaved-1f1b", 1, False, stock_optimizer=True, grad_reduce_bf16=True)
    part = base.partition(LLAMA70)
    place = base.placement(H100)
    dense = part.stage_params(1)
    assert analytic_costs(H100, part, bf16).reduce[1] == pytest.approx(
        ring_time(H100, 2 * dense, *place.grad_group, "reduce_scatter"))
    assert analytic_costs(H100, part, base).reduce[1] == pytest.approx(
        ring_time(H100, 4 * dense, *place.grad_group, "reduce_scatter"))
    assert memory_breakdown(part, bf16, 1, 0.0)["gradients"] == pytest.approx(
        memory_breakdown(part, base, 1, 0.0)["gradients"] / 2)
