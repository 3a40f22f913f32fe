"""Datasets, micro-batch order, the text script, the forward step and loss, training on text."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from megatron_bfpp.train import data, model as mm, parallel
from tests.support.paths import load_script
from tests.support.reference import run_reference

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORPUS = os.path.join(ROOT, "tests", "support", "data", "tiny_corpus.txt")
VOCAB = 257  # the script's default: 256 bytes + end-of-document
SEQ = 32


t2m = load_script("scripts/text_to_megatron.py", "text_to_megatron")


@pytest.fixture(scope="module", autouse=True)
def one_process_world():
    parallel.init_single_process()
    yield
    parallel.destroy_parallel()  # later modules expect no process group in this process


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    prefix = str(tmp_path_factory.mktemp("corpus") / "tiny")
    assert t2m.main([CORPUS, prefix]) == 0
    return prefix


def iterators(prefix, *, b=2, d=0, D=1, G=8, chunks=1, iters=4, vocab=VOCAB, seed=3):
    return data.make_microbatch_iterators(
        seq_length=SEQ, vocab_size=vocab, global_batch_size=G, micro_batch_size=b, dp_rank=d, dp_size=D, seed=seed,
        train_iters=iters, data_path=prefix, num_chunks=chunks,
        data_cache_path=os.path.join(os.path.dirname(prefix), "cache"))  # Megatron's index cache, kept in tmp


def samples(mbs):
    """Rows (tokens followed by the last label) of a list of micro-batches, in order."""
    return [torch.cat([t, l[-1:]]).tolist() for mb in mbs for t, l in zip(mb["tokens"], mb["labels"])]


# ---------------------------------------------------------------------------------------------- text script
def test_text_script_round_trips(corpus):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    with open(CORPUS, encoding="utf-8") as f:
        docs = t2m.documents(f.read())
    ds = IndexedDataset(corpus)
    assert len(ds) == len(docs) > 10
    for i, doc in enumerate(docs):
        ids = ds[i].tolist()
        assert ids[-1] == VOCAB - 1 and VOCAB - 1 not in ids[:-1]  # one end-of-document token, at the end
        assert t2m.decode(ids, VOCAB) == [doc]
    assert "\n\n" not in "".join(docs) and "river" in docs[0]


def test_text_script_checks_the_vocab_size(tmp_path, capsys):
    src = tmp_path / "u.txt"
    src.write_text("caf\u00e9\n\nna\u00efve\n", encoding="utf-8")  # bytes up to 0xC3 = 195
    assert t2m.main([str(src), str(tmp_path / "small"), "--vocab-size", "128"]) == 2
    assert "--vocab-size 197" in capsys.readouterr().err
    assert not (tmp_path / "small.bin").exists()
    assert t2m.main([str(src), str(tmp_path / "ok"), "--vocab-size", "197"]) == 0
    ascii_only = tmp_path / "a.txt"
    ascii_only.write_text("only ascii here\n", encoding="utf-8")
    assert t2m.main([str(ascii_only), str(tmp_path / "a"), "--vocab-size", "129"]) == 0


# ----------------------------------------------------------------------------------------- indexed dataset
def test_indexed_microbatches_are_windows_of_the_text(corpus):
    (it,) = iterators(corpus)
    mbs = data.global_batch_microbatches(it, 4)
    with open(CORPUS, encoding="utf-8") as f:
        docs = t2m.documents(f.read())
    for mb in mbs:
        assert mb["tokens"].shape == mb["labels"].shape == mb["loss_mask"].shape == mb["position_ids"].shape == (2, SEQ)
        assert mb["tokens"].dtype == torch.int64 and mb["loss_mask"].dtype == torch.float32
        assert torch.equal(mb["labels"][:, :-1], mb["tokens"][:, 1:])  # next-token labels
        assert torch.all(mb["loss_mask"] == 1)
        assert torch.equal(mb["position_ids"], torch.arange(SEQ).expand(2, SEQ))
        assert torch.equal(mb["attention_mask"], torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None])
    for row in samples(mbs):
        # a window of the shuffled document stream: every piece between end-of-document ids is text of a document
        pieces = t2m.decode(row, VOCAB)
        assert pieces and all(any(p in d for d in docs) for p in pieces if p), pieces


def test_same_global_batches_whatever_layout(corpus):
    G, iters = 8, 2
    one = samples(data.global_batch_microbatches(iterators(corpus, b=2)[0], iters * G // 2))
    # micro-batch size 1 and several chunk iterators: the same sample stream
    a, b = iterators(corpus, b=1, chunks=2)
    assert samples(data.global_batch_microbatches(a, iters * G)) == one
    assert samples(data.global_batch_microbatches(b, iters * G)) == one
    # D = 2: rank d's micro-batch j of iteration i is the one-rank run's micro-batch j*D + d of that iteration
    M = G // (2 * 2)
    per_rank = [data.global_batch_microbatches(iterators(corpus, b=2, d=d, D=2)[0], iters * M) for d in range(2)]
    single = data.global_batch_microbatches(iterators(corpus, b=2)[0], iters * G // 2)
    for i in range(iters):
        for j in range(M):
            for d in range(2):
                assert samples([per_rank[d][i * M + j]]) == samples([single[i * 2 * M + j * 2 + d]])
    # another seed shuffles differently
    assert samples(data.global_batch_microbatches(iterators(corpus, b=2, seed=4)[0], iters * G // 2)) != one


def test_data_errors_name_the_flags(corpus, tmp_path):
    with pytest.raises(FileNotFoundError, match="--data-path .*nothing.*missing"):
        iterators(str(tmp_path / "nothing"))
    with pytest.raises(ValueError, match="--global-batch-size 6 .*--micro-batch-size 4"):
        iterators(corpus, b=4, G=6)
    (it,) = iterators(corpus, vocab=100)  # the text has bytes >= 100
    with pytest.raises(ValueError, match="--vocab-size 100"):
        data.global_batch_microbatches(it, 4)


# ------------------------------------------------------------------------------------------------ mock data
def test_mock_microbatches_follow_megatron_mock_documents(tmp_path):
    V = 64
    its = data.make_microbatch_iterators(seq_length=SEQ, vocab_size=V, global_batch_size=4, micro_batch_size=2,
                                         dp_rank=0, dp_size=1, seed=5, train_iters=2, num_chunks=2)
    a = data.global_batch_microbatches(its[0], 4)
    b = data.global_batch_microbatches(its[1], 4)
    assert samples(a) == samples(b)
    for mb in a:
        assert torch.equal(mb["labels"][:, :-1], mb["tokens"][:, 1:])
        assert torch.all(mb["loss_mask"] == 1) and mb["attention_mask"].shape == (1, 1, SEQ, SEQ)
    # MockGPTLowLevelDataset documents are 1, 2, 3, ... (mod V) ended by V - 1: each id follows its predecessor
    # by +1 mod V, except at and after an end-of-document id
    for row in samples(a):
        for x, y in zip(row, row[1:]):
            assert y == (x + 1) % V or x == V - 1 or y == V - 1, (x, y)
    assert len({tuple(r) for r in samples(a)}) > 1


# ------------------------------------------------------------------------------------ forward step and loss
def test_forward_step_and_loss_func_match_cross_entropy():
    cfg = mm.make_transformer_config(num_layers=2, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0,
                                     attention_dropout=0.0)
    (m,) = mm.build_model_chunks(cfg, vocab_size=VOCAB, max_sequence_length=SEQ, pp_rank=0, pp_size=1, seed=1,
                                 device="cpu")
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=g)
    mb = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(2, SEQ),
          "attention_mask": data.causal_mask(SEQ), "position_ids": torch.arange(SEQ).expand(2, SEQ)}
    mb["loss_mask"][0, :5] = 0
    out, loss_fn = data.gpt_forward_step(iter([mb]), m)
    loss_sum, num_tokens, report = loss_fn(out)
    logits = m(mb["tokens"], mb["position_ids"], mb["attention_mask"])  # [b, s, V] without labels
    ce = F.cross_entropy(logits.reshape(-1, VOCAB).float(), mb["labels"].reshape(-1), reduction="none")
    expect = (ce * mb["loss_mask"].reshape(-1)).sum()
    torch.testing.assert_close(loss_sum, expect, rtol=1e-5, atol=1e-6)
    assert int(num_tokens) == 2 * SEQ - 5 and num_tokens.dtype == torch.int32
    assert torch.equal(report["lm loss"], torch.stack([loss_sum.detach(), num_tokens.float()]))


def test_forward_step_reads_data_only_at_the_pipeline_ends():
    cfg = mm.make_transformer_config(num_layers=3, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0,
                                     attention_dropout=0.0)
    chunks = mm.build_model_chunks(cfg, vocab_size=VOCAB, max_sequence_length=SEQ, pp_rank=0, pp_size=1, vp_size=3,
                                   seed=1, device="cpu")
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=g)
    mb = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(2, SEQ),
          "attention_mask": data.causal_mask(SEQ), "position_ids": torch.arange(SEQ).expand(2, SEQ)}
    with pytest.raises(ValueError, match="data iterator"):
        data.gpt_forward_step(None, chunks[0])
    x, _ = data.gpt_forward_step(iter([mb]), chunks[0])
    chunks[1].set_input_tensor(x)
    x, _ = data.gpt_forward_step(None, chunks[1])  # a middle stage takes no batch
    chunks[2].set_input_tensor(x)
    last = iter([mb])
    out, loss_fn = data.gpt_forward_step(last, chunks[2])
    assert next(last, None) is None  # the last stage consumed its micro-batch
    loss_sum, n, _ = loss_fn(out)
    assert int(n) == 2 * SEQ and torch.isfinite(loss_sum)


# -------------------------------------------------------------------------------------------- training text
def test_reference_loss_falls_on_the_text(corpus):
    (it,) = iterators(corpus, b=4, G=8, iters=8)
    iterations = [data.global_batch_microbatches(it, 2) for _ in range(8)]
    cfg = mm.make_transformer_config(num_layers=2, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0,
                                     attention_dropout=0.0)
    run = run_reference(cfg, iterations, vocab_size=VOCAB, max_sequence_length=SEQ, seed=1, lr=1e-2,
                        keep_grads=False)
    losses = run.losses
    assert losses[0] == pytest.approx(torch.log(torch.tensor(float(VOCAB))).item(), rel=0.05)  # ~uniform at init
    assert losses[-1] < 0.7 * losses[0], losses
    assert sum(losses[-3:]) < sum(losses[:3]), losses
