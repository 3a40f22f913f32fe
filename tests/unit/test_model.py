"""Model chunks, identical init across layouts, tied embeddings, SDPA core, process groups, the reference."""

from __future__ import annotations

import math
import os
import pickle
import tempfile
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from megatron_bfpp.train import data, model as mm, parallel
from tests.support.reference import ReferenceModel, run_reference
from tests.support.distributed import free_port

VOCAB, SEQ, SEED = 64, 16, 11


@pytest.fixture(scope="module", autouse=True)
def one_process_world():
    parallel.init_single_process()
    yield


def config(num_layers=4, **kw):
    kw.setdefault("hidden_dropout", 0.0)
    kw.setdefault("attention_dropout", 0.0)
    return mm.make_transformer_config(num_layers=num_layers, hidden_size=32, num_attention_heads=4, **kw)


def build(cfg, P, V, r, tied=True, seed=SEED):
    return mm.build_model_chunks(cfg, vocab_size=VOCAB, max_sequence_length=SEQ, pp_rank=r, pp_size=P, vp_size=V,
                                 share_embeddings_and_output_weights=tied, seed=seed, device="cpu")


def layout(cfg, P, V, tied=True):
    """All ranks' chunks of a (P, V) layout, built in this process."""
    return [build(cfg, P, V, r, tied) for r in range(P)]


def stages(ranks):
    P, V = len(ranks), len(ranks[0])
    return [ranks[s % P][s // P] for s in range(P * V)]


def batch(b=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"tokens": torch.randint(0, VOCAB, (b, SEQ), generator=g),
            "labels": torch.randint(0, VOCAB, (b, SEQ), generator=g),
            "loss_mask": torch.ones(b, SEQ), "attention_mask": data.causal_mask(SEQ),
            "position_ids": torch.arange(SEQ).expand(b, SEQ)}


def pipeline_forward(chunks, mb):
    """Run the stages in order by hand, feeding each stage's output into the next (graph kept connected)."""
    x = None
    for s, c in enumerate(chunks):
        if s > 0:
            c.set_input_tensor(x)
        x = c(mb["tokens"] if s == 0 else None, mb["position_ids"] if s == 0 else None, mb["attention_mask"],
              labels=mb["labels"] if s == len(chunks) - 1 else None)
    return x


def union_params(ranks):
    """{global name: [params]} over all ranks of a layout (the tied copy appears once per end)."""
    out: dict[str, list[torch.nn.Parameter]] = {}
    for r, chunks in enumerate(ranks):
        for name, p in mm.global_named_parameters(chunks, r, len(ranks)).items():
            out.setdefault(name, []).append(p)
    return out


# ---------------------------------------------------------------------------------------------- layout math
def test_layer_split_errors_name_the_flags():
    assert mm.layers_per_stage(8, 2, 2) == 2
    with pytest.raises(ValueError, match="--num-layers 6.*--pipeline-model-parallel-size 2"):
        mm.layers_per_stage(6, 2, 2)
    with pytest.raises(ValueError, match="--num-layers-per-virtual-pipeline-stage"):
        mm.vp_size_from_layers_per_virtual_stage(8, 2, 3)
    assert mm.vp_size_from_layers_per_virtual_stage(8, 2, 2) == 2
    assert mm.vp_size_from_layers_per_virtual_stage(8, 2, None) == 1
    with pytest.raises(ValueError, match="--num-layers"):
        build(config(num_layers=4), 3, 1, 0)


def test_chunks_share_the_callers_config_when_it_fits():
    cfg = config(num_layers=4, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    chunks = build(cfg, 2, 2, 1)
    assert all(c.config is cfg for c in chunks)  # hooks set on the caller's config reach every chunk
    other = build(config(num_layers=4), 2, 2, 1)  # a P = 1 config: one shared copy with the sizes fixed
    assert other[0].config is other[1].config
    assert (other[0].config.pipeline_model_parallel_size, other[0].config.virtual_pipeline_model_parallel_size) == (2, 2)


def test_chunks_hold_the_global_layers_of_their_stage():
    cfg = config(num_layers=8)
    ranks = layout(cfg, 2, 2)
    for s, c in enumerate(stages(ranks)):
        assert (c.pre_process, c.post_process) == (s == 0, s == 3)
        assert [layer.layer_number for layer in c.decoder.layers] == [2 * s + 1, 2 * s + 2]  # Megatron's 1-based
        assert c.vp_stage == s // 2
    names = union_params(ranks)
    assert {n.split(".")[2] for n in names if n.startswith("decoder.layers.")} == {str(i) for i in range(8)}


# ---------------------------------------------------------------------------------------- identical init
@pytest.mark.parametrize("tied", [True, False])
def test_identical_init_whatever_the_layout(tied):
    cfg = config(num_layers=4)
    single = union_params(layout(cfg, 1, 1, tied))
    for P, V in [(2, 2), (1, 2), (4, 1), (2, 1)]:
        other = union_params(layout(cfg, P, V, tied))
        assert set(other) == set(single), (P, V)
        for name, params in other.items():
            for p in params:  # both ends of a tied embedding start equal to the single model's
                assert torch.equal(p, single[name][0]), (P, V, name)
    assert ("output_layer.weight" in single) == (not tied)
    if not tied:  # an untied output layer has its own init, not the embedding's
        assert not torch.equal(single["output_layer.weight"][0], single["embedding.word_embeddings.weight"][0])


def test_init_follows_megatron_rules_and_depends_on_seed_and_name():
    cfg = mm.make_transformer_config(num_layers=4, hidden_size=64, num_attention_heads=4, init_method_std=0.02)
    (m,) = build(cfg, 1, 1, 0)
    p = mm.global_named_parameters([m], 0, 1)
    std = lambda n: p[n].std().item()  # noqa: E731
    assert std("decoder.layers.1.mlp.linear_fc1.weight") == pytest.approx(0.02, rel=0.05)
    assert std("decoder.layers.1.self_attention.linear_qkv.weight") == pytest.approx(0.02, rel=0.05)
    scaled = 0.02 / math.sqrt(2 * 4)  # Megatron's scaled init for output projections
    assert std("decoder.layers.1.mlp.linear_fc2.weight") == pytest.approx(scaled, rel=0.05)
    assert std("decoder.layers.1.self_attention.linear_proj.weight") == pytest.approx(scaled, rel=0.1)
    assert std("embedding.word_embeddings.weight") == pytest.approx(0.02, rel=0.1)
    for n, t in p.items():
        if n.endswith("bias"):
            assert torch.count_nonzero(t) == 0, n
        elif t.dim() == 1:
            assert torch.all(t == 1), n
    a, b = p["decoder.layers.0.mlp.linear_fc1.weight"], p["decoder.layers.1.mlp.linear_fc1.weight"]
    assert not torch.equal(a, b)
    (m2,) = build(cfg, 1, 1, 0, seed=SEED + 1)
    assert not torch.equal(a, mm.global_named_parameters([m2], 0, 1)["decoder.layers.0.mlp.linear_fc1.weight"])
    # init does not disturb the caller's RNG stream
    torch.manual_seed(5)
    expect = torch.rand(3)
    torch.manual_seed(5)
    build(cfg, 1, 1, 0)
    assert torch.equal(torch.rand(3), expect)


@pytest.mark.parametrize("P,V", [(1, 1), (1, 2)])
def test_bf16_params_are_the_rounded_fp32_init(P, V):
    p32 = mm.global_named_parameters(build(config(), P, V, 0), 0, P)
    chunks = mm.float16_chunks(build(config(params_dtype="bf16"), P, V, 0))  # as Megatron-LM's get_model
    p16 = mm.global_named_parameters(chunks, 0, P)
    assert set(p16) == set(p32)
    for n, t in p16.items():
        assert t.dtype == torch.bfloat16
        assert torch.equal(t, p32[n].to(torch.bfloat16)), n
    out = pipeline_forward(chunks, batch())
    assert out.dtype == torch.float32 and torch.isfinite(out).all()  # Float16Module returns fp32 at the end
    if V > 1:
        assert chunks[-1].module.output_layer.weight is chunks[0].module.embedding.word_embeddings.weight


# ----------------------------------------------------------------------------- forward/backward equivalence
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("P,V", [(2, 2), (1, 2)])
def test_chunked_forward_backward_equals_single_chunk(P, V, tied):
    cfg = config(num_layers=4)
    (single,) = build(cfg, 1, 1, 0, tied)
    ranks = layout(cfg, P, V, tied)
    mb = batch()
    ref = single(mb["tokens"], mb["position_ids"], mb["attention_mask"], labels=mb["labels"])
    out = pipeline_forward(stages(ranks), mb)
    assert out.shape == (2, SEQ)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    w = torch.rand(out.shape, generator=torch.Generator().manual_seed(1))  # a non-uniform upstream gradient
    (ref * w).sum().backward()
    (out * w).sum().backward()
    ref_grads = {n: p.grad for n, p in mm.global_named_parameters([single], 0, 1).items()}
    grads: dict[str, torch.Tensor] = {}
    for name, params in union_params(ranks).items():
        # the tied copies' gradients add up, as allreduce_tied_embedding_grads does across ranks
        grads[name] = sum(p.grad for p in params)
    assert set(grads) == set(ref_grads)
    for n in ref_grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-5, atol=1e-6, msg=n)


def test_one_rank_with_several_chunks_shares_one_tied_parameter():
    chunks = build(config(num_layers=4), 1, 2, 0, tied=True)
    emb = chunks[0].embedding.word_embeddings.weight
    assert chunks[-1].output_layer.weight is emb
    assert emb.shared_embedding and not getattr(emb, "shared", False)  # counted once in grad norms
    assert list(mm.global_named_parameters(chunks, 0, 1)).count("embedding.word_embeddings.weight") == 1
    assert mm.shared_embedding_parameters(chunks) == [emb]


def test_tied_ends_are_marked_on_both_stages():
    first, last = layout(config(num_layers=4), 2, 1, tied=True)
    a, b = first[0].embedding.word_embeddings.weight, last[0].output_layer.weight
    assert a is not b and a.shared_embedding and b.shared_embedding
    assert mm.shared_embedding_parameters(first) == [a] and mm.shared_embedding_parameters(last) == [b]
    untied_first, untied_last = layout(config(num_layers=4), 2, 1, tied=False)
    assert not mm.shared_embedding_parameters(untied_first) and not mm.shared_embedding_parameters(untied_last)
    mm.allreduce_tied_embedding_grads(first)  # P = 1 world: no embedding group, a no-op


def cpu_rng_shim(monkeypatch):
    """Test-only: let Megatron's activation checkpointing run on CPU (it saves/restores the CUDA RNG state)."""
    from megatron.core.tensor_parallel import random as mrandom

    calls = []
    monkeypatch.setattr(mrandom, "_get_cuda_rng_state", lambda *a, **k: calls.append(1) or torch.zeros(1))
    monkeypatch.setattr(mrandom, "_set_cuda_rng_state", lambda *a, **k: None)
    return calls


def test_recompute_on_cpu_is_refused_with_a_clear_error():
    if mm.megatron_recompute_available():
        pytest.skip("Megatron's checkpointing works in this process")
    with pytest.raises(RuntimeError, match="--recompute-granularity full needs CUDA"):
        build(config(num_layers=2, recompute_granularity="full"), 1, 1, 0)


@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_megatron_recompute_gives_the_same_gradients(monkeypatch, granularity):
    calls = cpu_rng_shim(monkeypatch)
    assert mm.megatron_recompute_available()
    mb = batch()
    grads = []
    for rc in (None, granularity):
        (m,) = build(config(num_layers=2, recompute_granularity=rc), 1, 1, 0)
        calls.clear()
        m(mb["tokens"], mb["position_ids"], mb["attention_mask"], labels=mb["labels"]).sum().backward()
        assert bool(calls) == (rc is not None)  # Megatron's checkpoint ran (and only when asked for)
        grads.append({n: p.grad for n, p in mm.global_named_parameters([m], 0, 1).items()})
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-5, atol=1e-6, msg=n)


def test_megatron_default_dropout_runs_on_cpu():
    cfg = mm.make_transformer_config(num_layers=2, hidden_size=32, num_attention_heads=4)  # dropout 0.1 both
    (m,) = build(cfg, 1, 1, 0)
    mb = batch()
    run = lambda: m(mb["tokens"], mb["position_ids"], mb["attention_mask"], labels=mb["labels"])  # noqa: E731
    a, b = run(), run()
    assert not torch.equal(a, b)  # dropout is active in training mode
    a.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)
    m.eval()
    with torch.no_grad():
        assert torch.equal(run(), run())


# ---------------------------------------------------------------------------------------------- attention
def naive_attention(q, k, v, masked, scale):
    """[s, b, h, d] inputs; masked: [s, s] bool, True = masked out."""
    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    scores = qb @ kb.transpose(-1, -2) * scale
    scores = scores.masked_fill(masked, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ vb
    return out.permute(2, 0, 1, 3).reshape(q.shape[0], q.shape[1], -1)


@pytest.mark.parametrize("groups", [4, 2])
def test_sdpa_core_equals_naive_attention(groups):
    cfg = mm.make_transformer_config(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=groups,
                                     attention_dropout=0.0)
    core = mm.SDPACoreAttention(cfg, 1, mm.AttnMaskType.causal, "self")
    g = torch.Generator().manual_seed(3)
    s, b, d = 7, 3, cfg.kv_channels
    q = torch.randn(s, b, 4, d, generator=g)
    k, v = torch.randn(s, b, groups, d, generator=g), torch.randn(s, b, groups, d, generator=g)
    rep = 4 // groups
    kk, vv = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)
    expect = naive_attention(q, kk, vv, causal, 1 / math.sqrt(d))
    torch.testing.assert_close(core(q, k, v, None), expect, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(core(q, k, v, causal[None, None]), expect, rtol=1e-5, atol=1e-6)
    # an explicit non-causal mask is honoured too (Megatron convention: True = masked)
    odd = torch.zeros(s, s, dtype=torch.bool)
    odd[:, 1::2] = True
    torch.testing.assert_close(core(q, k, v, odd[None, None]), naive_attention(q, kk, vv, odd, 1 / math.sqrt(d)),
                               rtol=1e-5, atol=1e-6)
    assert core(q, k, v, None).shape == (s, b, 4 * d)


def test_cpu_spec_uses_sdpa_core():
    spec = mm.layer_spec("cpu")
    assert spec.submodules.self_attention.submodules.core_attention is mm.SDPACoreAttention


def _signature_checked(monkeypatch, module, name: str) -> list:
    """Replace `module.name` by a stand-in that binds its arguments to the real function's signature (a
    TypeError exactly where the real call would raise one) and records the call."""
    import inspect

    real = getattr(module, name)
    sig = inspect.signature(real)
    calls = []

    def checked(*args, **kwargs):
        sig.bind(*args, **kwargs)
        calls.append(kwargs)
        return real(*args, **kwargs) if name == "get_gpt_layer_local_spec" else ("te spec", args, kwargs)

    monkeypatch.setattr(module, name, checked)
    return calls


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_gpu_spec_calls_match_megatron_signatures(monkeypatch, normalization):
    """The CUDA branch of layer_spec, on CPU: TransformerEngine made to look importable, and Megatron's spec
    functions checked against their real signatures (megatron-core 0.19's TE spec takes no `normalization`:
    TENorm reads config.normalization)."""
    from megatron.core.models.gpt import gpt_layer_specs

    te_calls = _signature_checked(monkeypatch, gpt_layer_specs, "get_gpt_layer_with_transformer_engine_spec")
    local_calls = _signature_checked(monkeypatch, gpt_layer_specs, "get_gpt_layer_local_spec")
    monkeypatch.setattr(mm, "get_gpt_layer_local_spec", gpt_layer_specs.get_gpt_layer_local_spec)

    monkeypatch.setattr(mm, "have_transformer_engine", lambda: True)
    assert mm.layer_spec("cuda", normalization)[0] == "te spec"
    assert len(te_calls) == 1

    monkeypatch.setattr(mm, "have_transformer_engine", lambda: False)
    spec = mm.layer_spec("cuda", normalization)  # Megatron's local spec, its own core attention
    assert local_calls == [{"normalization": normalization}]
    assert spec.submodules.self_attention.submodules.core_attention is not mm.SDPACoreAttention


# ------------------------------------------------------------------------------------------------ reference
def test_reference_normalises_like_megatron_schedules():
    cfg = config(num_layers=2)
    mbs = [batch(seed=i) for i in range(3)]
    mbs[1]["loss_mask"][:, ::3] = 0  # uneven token counts: each micro-batch is averaged over its own tokens
    ref = ReferenceModel(cfg, vocab_size=VOCAB, max_sequence_length=SEQ, seed=SEED)
    whole = ref.forward_backward(mbs)
    parts = []
    for mb in mbs:
        ref.zero_grad()
        parts.append(ref.forward_backward([mb]))
    for n, g in whole.grads.items():
        torch.testing.assert_close(g, sum(p.grads[n] for p in parts) / 3, rtol=1e-5, atol=1e-6, msg=n)
    assert whole.num_tokens == [int(mb["loss_mask"].sum()) for mb in mbs]
    assert whole.lm_loss == pytest.approx(sum(whole.loss_sums) / sum(whole.num_tokens))
    assert whole.microbatch_losses == pytest.approx([p.lm_loss for p in parts], rel=1e-6)


@pytest.mark.parametrize("opt_name,wd,clip", [("adam", 0.0, None), ("adamw", 0.1, 0.05)])
def test_reference_adam_steps_match_a_hand_rolled_loop(opt_name, wd, clip):
    cfg = config(num_layers=2)
    iters = [[batch(seed=2 * i), batch(seed=2 * i + 1)] for i in range(3)]
    run = run_reference(cfg, iters, vocab_size=VOCAB, max_sequence_length=SEQ, seed=SEED, lr=1e-2,
                        optimizer=opt_name, weight_decay=wd, clip_grad=clip)
    (m,) = build(cfg, 1, 1, 0)
    named = mm.global_named_parameters([m], 0, 1)
    decay = [p for n, p in named.items() if p.dim() > 1]  # Megatron: no decay on biases and norm scales
    rest = [p for n, p in named.items() if p.dim() == 1]
    cls = torch.optim.AdamW if opt_name == "adamw" else torch.optim.Adam
    opt = cls([{"params": decay, "weight_decay": wd}, {"params": rest, "weight_decay": 0.0}], lr=1e-2)
    for it, step in zip(iters, run.steps):
        opt.zero_grad()
        losses = []
        for mb in it:
            out = m(mb["tokens"], mb["position_ids"], mb["attention_mask"], labels=mb["labels"])
            losses.append(out.mean())
            (out.mean() / len(it)).backward()
        assert step.lm_loss == pytest.approx(float(sum(losses) / len(it)), rel=1e-5)
        for n, p in named.items():
            torch.testing.assert_close(step.grads[n], p.grad, rtol=1e-5, atol=1e-6)
        if clip:
            assert torch.nn.utils.clip_grad_norm_(list(named.values()), clip) > clip  # clipping is exercised
        opt.step()
    for n, p in named.items():
        torch.testing.assert_close(run.params[n], p.detach(), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------- process groups (4 ranks)
def _rank_main(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        result = ("ok", _groups_check())
    except BaseException:
        result = ("error", traceback.format_exc())
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    parallel.destroy_parallel()


def _groups_check() -> dict:
    import torch.distributed as dist

    parallel.init_parallel(2, 2, distributed_timeout_seconds=60)
    act, grad = parallel.pp_p2p_groups()
    ranks = dist.get_process_group_ranks
    emb = parallel.embedding_group()
    res = {
        "pp": (parallel.pp_rank(), parallel.pp_size()), "dp": (parallel.dp_rank(), parallel.dp_size()),
        "pp_group": ranks(parallel.pp_group()), "dp_group": ranks(parallel.dp_group()),
        "emb_group": ranks(emb) if emb is not None else None,
        "p2p": (ranks(act), ranks(grad)), "p2p_distinct": len({id(act), id(grad), id(parallel.pp_group())}) == 3,
        "p2p_cached": parallel.pp_p2p_groups() == (act, grad),
    }
    # both channels carry traffic between the two pipeline ranks
    peer = [r for r in ranks(act) if r != dist.get_rank()][0]
    for g, tag in ((act, 1.0), (grad, 2.0)):
        t = torch.full((3,), tag * (dist.get_rank() + 1))
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, t, peer, g),
                                       dist.P2POp(dist.irecv, buf := torch.empty(3), peer, g)])
        for r in reqs:
            r.wait()
        assert torch.all(buf == tag * (peer + 1))
    # chunks built with the real groups carry the same init as the one-process build
    cfg = config(num_layers=4)
    chunks = mm.build_model_chunks(cfg, vocab_size=VOCAB, max_sequence_length=SEQ, pp_rank=parallel.pp_rank(),
                                   pp_size=2, vp_size=2, seed=SEED, device="cpu")
    named = mm.global_named_parameters(chunks, parallel.pp_rank(), 2)
    res["init_ok"] = all(torch.equal(p, mm.init_value(n, p.shape, SEED, cfg)) for n, p in named.items())
    # tied-gradient all-reduce: sums over the embedding group, into main_grad when present
    (shared,) = mm.shared_embedding_parameters(chunks)
    shared.grad = torch.full_like(shared, float(dist.get_rank() + 1))
    mm.allreduce_tied_embedding_grads(chunks)
    res["tied_grad"] = float(shared.grad[0, 0])
    shared.main_grad = torch.full_like(shared, 10.0 * (dist.get_rank() + 1))
    mm.allreduce_tied_embedding_grads(chunks)
    res["tied_main_grad"] = float(shared.main_grad[0, 0])
    return res


@pytest.mark.timeout(240)
def test_groups_on_four_gloo_processes(run_distributed):  # its own forkserver job: the fixture sets the tier
    world, port = 4, free_port()
    # forkserver with this module preloaded: Megatron is imported once, not by each of the 4 ranks
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    with tempfile.TemporaryDirectory() as out:
        procs = [ctx.Process(target=_rank_main, args=(r, world, port, out)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(200)
        for p in procs:
            if p.is_alive():
                p.kill()
        results = []
        for r in range(world):
            path = os.path.join(out, f"{r}.pkl")
            assert os.path.exists(path), f"rank {r} gave no result (exit code {procs[r].exitcode})"
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            assert status == "ok", f"rank {r}:\n{value}"
            results.append(value)
    # Megatron's order tp-cp-ep-dp-pp: rank = pp_rank * D + dp_rank
    for rank, res in enumerate(results):
        pp, dp = divmod(rank, 2)
        assert res["pp"] == (pp, 2) and res["dp"] == (dp, 2)
        assert res["pp_group"] == [dp, dp + 2]
        assert res["dp_group"] == [2 * pp, 2 * pp + 1]
        assert res["emb_group"] == [dp, dp + 2]  # both ends of a 2-stage pipeline
        assert res["p2p"] == ([dp, dp + 2], [dp, dp + 2]) and res["p2p_distinct"] and res["p2p_cached"]
        assert res["init_ok"]
        assert res["tied_grad"] == (dp + 1) + (dp + 3)
        assert res["tied_main_grad"] == 10 * ((dp + 1) + (dp + 3))


def test_init_parallel_rejects_a_world_that_does_not_divide():
    with pytest.raises(ValueError, match="--pipeline-model-parallel-size"):
        parallel.init_parallel(2)
    assert parallel.pp_size() == 1  # the one-process groups are untouched
