"""Our runtime equals stock Megatron-Core's interleaved schedule on the same GPT chunks (CPU, gloo, fp32).

On one set of Megatron-Core GPT chunks (hidden 16, 2 heads, seq 8, one layer per stage) and the same
micro-batches, at P = 4 and P = 2 (V = 2) and several (M, G):

- stock `forward_backward_pipelining_with_interleaving` (through tests/support/megatron_cpu_shim.py, with the p2p
  configuration Megatron-LM uses for interleaving: overlap_p2p_comm=True, batch_p2p_comm=False),
- our `interleaved-1f1b` with the same group size G,
- our `breadth-first` (all micro-batches as one group, and groups of G),
- and, with one chunk per rank (V = 1), stock `forward_backward_pipelining_without_interleaving` and our `1f1b`,

give the same per-micro-batch losses and every parameter gradient as a single-process run of the whole model
(fp32, rtol 1e-5, atol 1e-6), hence the same as each other.

The trap (docs/design.md §2): stock interleaving at P = 2 with ModelParallelConfig's defaults batch_p2p_comm=True,
overlap_p2p_comm=False silently gives wrong gradients (checked, with the mechanism, in
test_pp2_trap_stock_batch_p2p_vs_ours); our runtime (activations and gradients on separate process groups)
is exact in the same setting.

One spawn of 4 gloo processes serves every check (process start-up dominates the run time): first P = 4,
then P = 2 with two pipelines (D = 2, each replica on the same micro-batches, no gradient reduction), so
every rank's gradients are compared with the reference.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.distributed import run_distributed

HIDDEN, HEADS, SEQ, MBS, VOCAB, VP, SEED, WORLD = 16, 2, 8, 2, 64, 2, 7, 4
STOCK_P2P = {"overlap_p2p_comm": True, "batch_p2p_comm": False}  # Megatron-LM's setting for interleaving
TRAP_P2P = {"overlap_p2p_comm": False, "batch_p2p_comm": True}  # ModelParallelConfig's defaults
# Non-interleaved 1F1B refuses overlap_p2p_comm; Megatron-LM turns it off without virtual stages.
ONE_F_ONE_B_P2P = {"overlap_p2p_comm": False, "batch_p2p_comm": True}
TRAP_M = 4

# P -> [(M, G, tied)]: stock and our interleaved-1f1b run with group size G; breadth-first with G=None (one
# group of M) and with G. G = P is depth-first interleaving, G = M the breadth-first forward order.
CASES = {4: [(8, 4, True), (8, 8, False)], 2: [(4, 2, True), (4, 4, False), (6, 3, True)]}


def _runs(m: int, g: int) -> list[tuple[str, int | None]]:
    return [("stock", g), ("interleaved-1f1b", g), ("breadth-first", None), ("breadth-first", g)]


def _batches(m: int) -> list[dict]:
    from megatron_bfpp.train.data import causal_mask

    g = torch.Generator().manual_seed(1000 + m)
    out = []
    for _ in range(m):
        tokens = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=g)
        loss_mask = torch.ones(MBS, SEQ)
        loss_mask[0, : int(torch.randint(0, SEQ // 2, (1,), generator=g))] = 0.0  # unequal token counts
        out.append({"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
                    "loss_mask": loss_mask, "attention_mask": causal_mask(SEQ),
                    "position_ids": torch.arange(SEQ).repeat(MBS, 1)})
    return out


def _config(pp: int, vp: int = VP):
    from megatron_bfpp.train.model import make_transformer_config

    return make_transformer_config(num_layers=pp * vp, hidden_size=HIDDEN, num_attention_heads=HEADS,
                                   hidden_dropout=0.0, attention_dropout=0.0, pipeline_model_parallel_size=pp,
                                   virtual_pipeline_model_parallel_size=vp if vp > 1 else None)


def _reference(pp: int, m: int, tied: bool, vp: int = VP) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The whole model as one chunk in this process (a one-stage pipeline talking to nobody), plain autograd,
    Megatron's normalisation: each micro-batch's backward on loss_sum / num_tokens / M."""
    from megatron_bfpp.train.data import gpt_forward_step
    from megatron_bfpp.train.model import build_model_chunks, global_named_parameters

    (model,) = build_model_chunks(_config(pp, vp), vocab_size=VOCAB, max_sequence_length=SEQ, pp_rank=0, pp_size=1,
                                  share_embeddings_and_output_weights=tied, seed=SEED)
    losses = []
    for b in _batches(m):
        output, loss_fn = gpt_forward_step(iter([b]), model)
        loss_sum, num_tokens, _ = loss_fn(output)
        (loss_sum / num_tokens / m).backward()
        losses.append(float(loss_sum.detach()) / int(num_tokens))
    return losses, {n: p.grad.clone() for n, p in global_named_parameters([model], 0, 1).items()}


def _chunks(pp: int, tied: bool, vp: int = VP):
    from megatron.core import parallel_state as ps

    from megatron_bfpp.train.model import build_model_chunks

    return build_model_chunks(_config(pp, vp), vocab_size=VOCAB, max_sequence_length=SEQ,
                              pp_rank=ps.get_pipeline_model_parallel_rank(), pp_size=pp, vp_size=vp,
                              share_embeddings_and_output_weights=tied, seed=SEED)


def _run(pp: int, runner: str, m: int, g: int | None, tied: bool, p2p: dict | None = None, vp: int = VP):
    """One forward-backward of this rank's chunks; returns (per-micro-batch losses, {global name: grad}).
    Losses are empty on ranks without the last stage."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import schedules

    from megatron_bfpp.train.data import gpt_forward_step
    from megatron_bfpp.train.model import allreduce_tied_embedding_grads, global_named_parameters
    from megatron_bfpp.runtime import get_forward_backward_func
    from tests.support.megatron_cpu_shim import stock_schedules_on_cpu

    chunks = _chunks(pp, tied, vp)
    kwargs = dict(forward_step_func=gpt_forward_step, data_iterator=[iter(_batches(m)) for _ in chunks],
                  model=chunks, num_microbatches=m, seq_length=SEQ, micro_batch_size=MBS)
    if runner in ("stock", "stock-1f1b"):
        config = chunks[0].config  # get_model_config(model[0]): the schedule reads its knobs from here
        for key, value in {**(p2p or STOCK_P2P), "microbatch_group_size_per_vp_stage": g or pp}.items():
            setattr(config, key, value)
        stock = (schedules.forward_backward_pipelining_with_interleaving if runner == "stock" else
                 schedules.forward_backward_pipelining_without_interleaving)
        with stock_schedules_on_cpu():
            store = stock(**kwargs)
    else:
        store = get_forward_backward_func(runner, g)(**kwargs)
    if tied:
        allreduce_tied_embedding_grads(chunks)
    losses = [float(d["lm loss"][0] / d["lm loss"][1]) for d in store]
    pp_rank = ps.get_pipeline_model_parallel_rank()
    return losses, {n: p.grad.clone() for n, p in global_named_parameters(chunks, pp_rank, pp).items()}


def _unshimmed_failure(pp: int) -> str | None:
    """The Megatron source line where the stock schedule fails on CPU without the shim (None if it runs)."""
    import traceback

    from megatron.core.pipeline_parallel import schedules

    from megatron_bfpp.train.data import gpt_forward_step

    chunks = _chunks(pp, True)
    for key, value in STOCK_P2P.items():
        setattr(chunks[0].config, key, value)
    try:
        schedules.forward_backward_pipelining_with_interleaving(
            forward_step_func=gpt_forward_step, data_iterator=[iter(_batches(pp)) for _ in chunks], model=chunks,
            num_microbatches=pp, seq_length=SEQ, micro_batch_size=MBS)
    except Exception as e:  # noqa: BLE001 - where it fails is what is recorded
        frames = [f for f in traceback.extract_tb(e.__traceback__) if "megatron/core" in f.filename]
        return f"{frames[-1].filename}:{frames[-1].lineno}: {frames[-1].line}" if frames else repr(e)
    return None


def _worker(rank: int, world: int) -> dict:
    from megatron_bfpp.train import parallel
    from megatron_bfpp.runtime import set_wait_timeout

    set_wait_timeout(60)
    out: dict = {"runs": {}, "refs": {}}
    for pp in CASES:
        parallel.init_parallel(pp, VP, distributed_timeout_seconds=60)
        if pp == 4 and not torch.cuda.is_available():
            # Without the shim the stock schedule stops at its CUDA token counter, before any communication
            # (on a machine with CUDA it would get further with these CPU chunks, so it is not tried there).
            out["unshimmed"] = _unshimmed_failure(pp)
        for m, g, tied in CASES[pp]:
            if rank == 0:
                out["refs"][(pp, m, tied)] = _reference(pp, m, tied)
            for runner, group in _runs(m, g):
                out["runs"][(pp, runner, m, group, tied)] = _run(pp, runner, m, group, tied)
        # Non-interleaved 1F1B (V = 1): stock and ours.
        parallel.init_parallel(pp, None, distributed_timeout_seconds=60)
        m = CASES[pp][0][0]
        if rank == 0:
            out["refs"][(pp, "V1", m)] = _reference(pp, m, True, vp=1)
        for runner in ("stock-1f1b", "1f1b"):
            out["runs"][(pp, runner, m)] = _run(pp, runner, m, None, True, ONE_F_ONE_B_P2P, vp=1)
    # The trap, at P = 2.
    parallel.init_parallel(2, VP, distributed_timeout_seconds=60)
    if rank == 0:
        out["refs"][(2, TRAP_M, True)] = _reference(2, TRAP_M, True)
    out["runs"]["trap_stock"] = _run(2, "stock", TRAP_M, 2, True, TRAP_P2P)
    out["runs"]["trap_ours"] = _run(2, "interleaved-1f1b", TRAP_M, 2, True)
    return out


@pytest.fixture(scope="module")
def results(run_distributed) -> list[dict]:
    return run_distributed(_worker, WORLD, timeout=240)


def _errors(per_rank: list[dict], key, ref: tuple) -> tuple[list[list[float]], float]:
    """(losses of every rank that has them, max |grad - reference| over every rank's gradients)."""
    ref_losses, ref_grads = ref
    losses, err, seen = [], 0.0, set()
    for out in per_rank:
        run_losses, grads = out["runs"][key]
        if run_losses:
            losses.append(run_losses)
        for name, grad in grads.items():
            err = max(err, float((grad - ref_grads[name]).abs().max()))
            seen.add(name)
    assert seen == set(ref_grads), f"{key}: parameters not covered: {seen ^ set(ref_grads)}"
    return losses, err


def _assert_equal(per_rank: list[dict], key, ref: tuple) -> None:
    ref_losses, ref_grads = ref
    losses, _ = _errors(per_rank, key, ref)
    assert losses, f"{key}: no rank returned losses"
    for got in losses:
        assert got == pytest.approx(ref_losses, rel=1e-5, abs=1e-6), f"{key}: losses {got} != {ref_losses}"
    for out in per_rank:
        for name, grad in out["runs"][key][1].items():
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-6, msg=lambda s: f"{key} {name}: {s}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("pp", sorted(CASES))
def test_stock_interleaved_and_ours_equal_reference(results, pp):
    refs = results[0]["refs"]
    for m, g, tied in CASES[pp]:
        for runner, group in _runs(m, g):
            _assert_equal(results, (pp, runner, m, group, tied), refs[(pp, m, tied)])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("pp", sorted(CASES))
def test_stock_1f1b_and_ours_equal_reference(results, pp):
    m = CASES[pp][0][0]
    for runner in ("stock-1f1b", "1f1b"):
        _assert_equal(results, (pp, runner, m), results[0]["refs"][(pp, "V1", m)])


@pytest.mark.timeout(300)
def test_shim_is_needed_exactly_at_the_token_counter(results):
    if torch.cuda.is_available():
        pytest.skip("with CUDA present the unshimmed stock schedule is not run on CPU chunks")
    for out in results:
        assert out["unshimmed"] is not None and out["unshimmed"].endswith('device="cuda")'), out["unshimmed"]


@pytest.mark.timeout(300)
def test_pp2_trap_stock_batch_p2p_vs_ours(results):
    ref = results[0]["refs"][(2, TRAP_M, True)]
    _assert_equal(results, "trap_ours", ref)
    _, err = _errors(results, "trap_stock", ref)
    # Finding on megatron-core 0.19.2 / torch 2.14 / gloo: the stock schedule completes without an error or a
    # warning and its gradients are wrong (max error ~0.6 here, gradients of order 0.1-1). Mechanism: at P = 2
    # the previous and the next rank are the same peer; a steady-state call sends (to prev: a gradient, to
    # next: an activation) and posts (from prev: an activation, from next: a gradient) in one
    # batch_isend_irecv, and messages between one pair of ranks match in posting order, so the gradient lands
    # in the activation buffer and vice versa (same shape: nothing notices). Megatron-LM's argument checks
    # forbid this combination at P = 2 for that reason; Megatron-Core does not. If a later version fixes this,
    # this assertion fails: then update this finding and docs/design.md §2, not the threshold.
    assert err > 1e-3, (f"stock interleaved at P=2 with batch_p2p_comm=True, overlap_p2p_comm=False now matches "
                        f"the reference (max grad error {err:.3g}): the documented trap is gone in this version")


def test_shim_restores_modules():
    from megatron.core.pipeline_parallel import p2p_communication, schedules

    from tests.support.megatron_cpu_shim import is_active, stock_schedules_on_cpu

    before = (schedules.torch, p2p_communication.torch)
    with pytest.raises(KeyError):
        with stock_schedules_on_cpu():
            assert is_active()
            assert p2p_communication.torch.cuda.current_device() == torch.device("cpu")
            assert p2p_communication.torch.cuda.synchronize() is None
            assert schedules.torch.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
            assert schedules.torch.zeros(2, device="cpu").device.type == "cpu"
            assert schedules.torch.Tensor is torch.Tensor  # everything else is torch's own
            raise KeyError("body failed")
    assert (schedules.torch, p2p_communication.torch) == before and before[0] is torch
    assert not is_active()
