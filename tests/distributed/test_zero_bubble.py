"""Split-backward (zero-bubble) schedules train exactly the single-process model.

Megatron-Core GPT chunks through the trainer, D = 2, P = 2, fp32: breadth-first-zb (V = 2, whole and
in groups of 2 micro-batches) and interleaved-zb (V = 2) under ZeRO-1/2/3, zb-h1 (V = 1) under ZeRO-3, and
both looped ones under ZeRO-3 with one weight buffer, where a W runs after its stage's weights were released
(the deferred weight GEMMs read kept activations only).
The losses of 3 Adam steps, the clipped global gradient norm of each step, and the final parameters equal the
reference's (the I/W split must accumulate every weight gradient into main_grad exactly once).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.support.distributed import run_distributed
from tests.distributed.test_train_equivalence import BASE, LOOPED, _all_full, _assert_params_close, _reference_worker

RUNS = ([("breadth-first-zb", z, ()) for z in (1, 2, 3)] + [("interleaved-zb", z, ()) for z in (1, 3)]
        + [("zb-h1", 3, ()), ("breadth-first-zb", 3, ("--microbatch-group-size-per-virtual-pipeline-stage", "2"))]
        + [(s, 3, ("--bfpp-weight-buffers", "1")) for s in ("breadth-first-zb", "interleaved-zb")])


def _ws_after_release(schedule) -> int:
    """How many W's of this schedule run while their stage's weights are released (ZeRO-3)."""
    from megatron_bfpp.schedule import Op

    count = 0
    for acts in schedule.ranks:
        held: set[int] = set()
        for a in acts:
            if a.op == Op.GATHER:
                held.add(a.stage)
            elif a.op == Op.RELEASE:
                held.discard(a.stage)
            elif a.op == Op.W and a.stage not in held:
                count += 1
    return count


def _watch_grad_buffers_at_i() -> dict[str, int]:
    """Count, over the I's that run before their stage's first W of the step, those that found the stage's
    full gradient buffer allocated (ZeRO-2/3 must take it only at the first W)."""
    from megatron_bfpp.runtime.executor import ScheduleExecutor
    from megatron_bfpp.schedule import Op

    counts = {"i_before_w": 0, "buffer_at_i": 0}
    do_i = ScheduleExecutor._do_I

    def watched_i(self, a):
        do_i(self, a)
        chunk = self.model[self.schedule.chunk_of(a.stage)]
        first_w = next(b for b in self.actions if b.op == Op.W and b.stage == a.stage)
        if getattr(self.driver, "zero_stage", 0) >= 2 and self.actions.index(a) < self.actions.index(first_w):
            counts["i_before_w"] += 1
            counts["buffer_at_i"] += any(b.gbuf.allocated for b in chunk.flat_buffers)

    ScheduleExecutor._do_I = watched_i
    return counts


def _worker(rank: int, world: int, runs) -> list:
    import torch.distributed as dist

    from megatron_bfpp.train import parallel
    from megatron_bfpp.train.model import global_named_parameters
    from megatron_bfpp.runtime.forward_backward import last_schedule
    from megatron_bfpp.train import Trainer
    from megatron_bfpp.train.config import parse_trainer_args

    dist.init_process_group("gloo", rank=rank, world_size=world)
    early = _watch_grad_buffers_at_i()
    results = []
    for schedule, zero, extra in runs:
        flags = BASE + ["--pipeline-schedule", schedule, "--zero-stage", str(zero), *extra]
        if schedule != "zb-h1":
            flags += LOOPED
        trainer = Trainer(parse_trainer_args(flags, world_size=world))
        norms = []
        step = trainer.train_step

        def recording_step():
            loss, ok, norm = step()
            norms.append(norm)
            return loss, ok, norm

        trainer.train_step = recording_step
        trainer.run()
        with _all_full(trainer.model):
            params = {n: p.detach().clone() for n, p in
                      global_named_parameters(trainer.model, trainer.pp_rank, trainer.pp).items()}
        results.append({"losses": trainer.losses, "grad_norms": norms, "params": params,
                        "ws_after_release": _ws_after_release(last_schedule()), **early})
        early.update(i_before_w=0, buffer_at_i=0)
        parallel.destroy_parallel()
    return results


@pytest.fixture(scope="module")
def runs(run_distributed):
    ref = run_distributed(_reference_worker, 1)[0]
    return ref, run_distributed(_worker, 4, RUNS, timeout=900)


@pytest.mark.timeout(1000)
@pytest.mark.parametrize("index", range(len(RUNS)), ids=[f"{s}-zero{z}{''.join(e[::2])}" for s, z, e in RUNS])
def test_zero_bubble_matches_single_process(runs, index):
    ref, per_rank = runs
    for r in range(4):
        got = per_rank[r][index]
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5), RUNS[index]
        assert got["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-5), RUNS[index]
        for name, value in got["params"].items():
            _assert_params_close(value, ref["params"][name], name, f"{RUNS[index]} rank {r} {name}")
    assert set().union(*(per_rank[r][index]["params"] for r in range(4))) == set(ref["params"])
    if RUNS[index][1] >= 2:  # ZeRO-2/3: gradients an I computes wait for the W to take the buffer
        assert all(per_rank[r][index]["i_before_w"] > 0 for r in range(4)), RUNS[index]
        assert [per_rank[r][index]["buffer_at_i"] for r in range(4)] == [0] * 4, RUNS[index]
    if "--bfpp-weight-buffers" in RUNS[index][2]:
        assert per_rank[0][index]["ws_after_release"] > 0  # the case this run is here for


def test_split_backward_does_the_fused_backward_work_once():
    """On a Megatron-Core GPT chunk (local spec), I + W compute the same gradients as one fused backward with the
    same matmul FLOPs: with the deferring linears, the weight-gradient GEMMs run at W only and everything else
    at I. The graph split alone (PyTorch pipelining's, what a chunk without adaptable layers gets) runs
    Megatron's linear Function's whole backward at I and again at W: more FLOPs, which this test also shows."""
    from megatron_bfpp.train import parallel

    from megatron_bfpp.train.model import build_model_chunks

    parallel.init_single_process()
    try:
        chunk = build_model_chunks(_split_config(1), vocab_size=64, max_sequence_length=16, pp_rank=0, pp_size=1,
                                   vp_size=2, seed=3)[1]  # a stage with an input tensor
        _check_deferred_split(chunk, tensor_parallel=1)
    finally:
        parallel.destroy_parallel()


def test_split_backward_defers_tensor_parallel_linears(run_distributed):
    """At T = 2 (2 processes) every linear of the chunk defers, column-parallel ones included (their input
    gradient is summed over the tensor-parallel group at I, as Megatron's linear does), with the fused
    backward's gradients and FLOPs."""
    assert run_distributed(_tensor_parallel_worker, 2) == [True, True]


def _tensor_parallel_worker(rank: int, world: int) -> bool:
    import torch.distributed as dist

    from megatron_bfpp.train import parallel

    import torch
    from megatron.core.models.gpt import GPTModel

    from megatron_bfpp.train.model import layer_spec

    dist.init_process_group("gloo", rank=rank, world_size=world)
    parallel.init_parallel(1, tensor_model_parallel_size=world, distributed_timeout_seconds=120)
    try:
        config = _split_config(world)
        chunk = GPTModel(config=config, transformer_layer_spec=layer_spec(torch.device("cpu"), config.normalization),
                         vocab_size=64, max_sequence_length=16, pre_process=False, post_process=True,
                         share_embeddings_and_output_weights=False)  # a last stage with an input tensor
        gen = torch.Generator().manual_seed(3)  # any values: fused and split backward see the same ones
        with torch.no_grad():
            for p in chunk.parameters():
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        _check_deferred_split(chunk, tensor_parallel=world)
    finally:
        parallel.destroy_parallel()
    return True


def _split_config(tensor_parallel: int):
    from megatron_bfpp.train.model import make_transformer_config

    return make_transformer_config(num_layers=2, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0,
                                   attention_dropout=0.0, tensor_model_parallel_size=tensor_parallel)


def _check_deferred_split(chunk, tensor_parallel: int) -> None:
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from megatron_bfpp.train.data import causal_mask
    from megatron_bfpp.runtime.split_backward import (PendingWeightGrad, backward_input, backward_weight,
                                                       deferring_weight_grads, split_friendly_linears)

    weights = [p for p in chunk.parameters() if p.requires_grad]
    linears = [m for m in chunk.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    x = torch.randn(16, 2, 32, generator=torch.Generator().manual_seed(0))  # the same on every T rank
    g = torch.randn(2, 16, 64 // tensor_parallel, generator=torch.Generator().manual_seed(1))
    mask = causal_mask(16)

    def forward():
        for p in weights:
            p.grad = None
        inp = x.clone().requires_grad_()
        chunk.set_input_tensor(inp)
        return inp, chunk(None, None, mask)

    def flops(fn) -> int:
        with FlopCounterMode(display=False) as counter:
            fn()
        return counter.get_total_flops()

    inp, out = forward()
    fused = flops(lambda: out.backward(g))
    ref = ([p.grad.clone() for p in weights], inp.grad.clone())
    assert all(t.isfinite().all() for t in (*ref[0], ref[1]))

    def graph_split() -> int:
        inp, out = forward()
        box = {}
        n = flops(lambda: box.update(zip(("dx", "w"), backward_input(inp, out, g, weights, chunk.config))))
        return n + flops(lambda: backward_weight(box["w"]))

    def deferred_split() -> tuple[int, int, list, torch.Tensor, set]:
        with deferring_weight_grads():
            inp, out = forward()
        with deferring_weight_grads() as deferred:
            n_i = flops(lambda: out.backward(g))
        dx = inp.grad.clone()
        assert all(p.grad is None for p in weights if any(p is d.weight for d in deferred))
        deferred_weights = {id(d.weight) for d in deferred}
        n_w = flops(lambda: backward_weight(PendingWeightGrad([], deferred=deferred)))
        return n_i, n_w, [p.grad.clone() for p in weights], dx, deferred_weights

    unadapted = graph_split()
    assert split_friendly_linears(chunk) == len(linears) > 0
    assert split_friendly_linears(chunk) == split_friendly_linears(chunk)
    n_i, n_w, grads, dx, deferred_weights = deferred_split()
    assert deferred_weights == {id(m.weight) for m in linears}  # every linear deferred, at any T
    assert n_i + n_w == fused < unadapted and 0 < n_w < fused
    torch.testing.assert_close(dx, ref[1], rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, ref[0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # Outside an I, a deferring node refuses to lose its weight gradient.
    with deferring_weight_grads():
        inp, out = forward()
    with pytest.raises(RuntimeError, match="outside an I"):
        out.backward(g)


def test_pending_w_counts_only_its_gemm_operands():
    """The runtime's activation accounting: after an I on a deferring chunk the stage's saved bytes are freed
    and only the deferred GEMMs' operands count until the W (less than the F saved); it returns to 0."""
    import torch

    from megatron_bfpp.train import parallel
    from megatron_bfpp.train.data import gpt_forward_step
    from megatron_bfpp.train.model import build_model_chunks
    from megatron_bfpp.runtime import get_forward_backward_func
    from megatron_bfpp.runtime.executor import ScheduleExecutor
    from megatron_bfpp.runtime.forward_backward import last_run_stats
    from tests.distributed.test_gpt_pipeline import SEQ, _batches

    seen: list[tuple[int, int, int]] = []  # (bytes the F saved, bytes kept after the I, accounted total change)
    do_i = ScheduleExecutor._do_I

    def watched_i(self, a):
        before_total, before_pair = self.activation_bytes, self.saved_bytes[(a.stage, a.microbatch)]
        do_i(self, a)
        kept = self.saved_bytes[(a.stage, a.microbatch)]
        seen.append((before_pair, kept, self.activation_bytes - before_total))

    parallel.init_single_process()
    ScheduleExecutor._do_I = watched_i
    try:
        chunks = build_model_chunks(_split_config(1), vocab_size=64, max_sequence_length=SEQ, pp_rank=0, pp_size=1,
                                    vp_size=2, seed=3)
        fb = get_forward_backward_func("interleaved-zb")
        fb(forward_step_func=gpt_forward_step, data_iterator=[iter(_batches(3, 0)) for _ in chunks], model=chunks,
           num_microbatches=3, seq_length=SEQ, micro_batch_size=2)
        assert len(seen) == 6
        for saved, kept, change in seen:
            assert 0 < kept < saved and change == kept - saved
        assert last_run_stats()["peak_activation_bytes"] > 0
    finally:
        ScheduleExecutor._do_I = do_i
        parallel.destroy_parallel()


@pytest.mark.parametrize("batch_numel", [1, 1 << 30])
def test_w_hands_weight_gradients_to_autograd_in_bounded_batches(monkeypatch, batch_numel):
    """A W passes its deferred gradients to autograd in batches of at most W_BATCH_NUMEL elements (one engine
    call for small layers; one weight at a time above the bound, as a fused backward materialises them): the
    same gradients either way, a weight deferred twice gets the sum (its hook runs once per call carrying it)."""
    import torch

    from megatron_bfpp.runtime import split_backward as sb

    monkeypatch.setattr(sb, "W_BATCH_NUMEL", batch_numel)
    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.zeros(3, 4)), torch.nn.Parameter(torch.zeros(5, 3))]
    hook_calls = {id(w): 0 for w in weights}
    for w in weights:
        w.register_post_accumulate_grad_hook(lambda p: hook_calls.__setitem__(id(p), hook_calls[id(p)] + 1))
    items = [sb.DeferredWeightGrad(weights[0], torch.randn(2, 4), torch.randn(2, 3)),
             sb.DeferredWeightGrad(weights[1], torch.randn(2, 3), torch.randn(2, 5)),
             sb.DeferredWeightGrad(weights[0], torch.randn(2, 4), torch.randn(2, 3))]
    expected = [items[0].compute() + items[2].compute(), items[1].compute()]
    calls: list[int] = []  # weights per autograd call
    hand_off = sb._HandOff.apply
    monkeypatch.setattr(sb._HandOff, "apply", lambda grads, *w: (calls.append(len(w)), hand_off(grads, *w))[1])
    sb.backward_weight(sb.PendingWeightGrad([], deferred=items))
    torch.testing.assert_close(weights[0].grad, expected[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(weights[1].grad, expected[1], rtol=1e-6, atol=1e-7)
    assert items == []  # the W consumed its GEMMs
    assert calls == ([1, 1, 1] if batch_numel == 1 else [3])
    assert sorted(hook_calls.values()) == ([1, 2] if batch_numel == 1 else [1, 1])


def test_fused_w_gives_watched_weights_the_cached_placeholder_and_others_none(monkeypatch):
    """Gradient-accumulation fusion at W, as Megatron's linear backward: a weight a data-parallel wrapper watches
    (it carries grad_added_to_main_grad) gets the flag and the placeholder gradient, one cached tensor per shape,
    dtype and device that autograd takes as the weight's gradient without copying it (no weight-sized tensor per
    W); a weight without the flag gets none (Megatron returns None) and no autograd call; main_grad gets the
    GEMMs either way."""
    import torch
    from megatron.core.tensor_parallel import layers

    from megatron_bfpp.runtime import split_backward as sb

    monkeypatch.setattr(layers, "fused_weight_gradient_mlp_cuda", _wgrad_kernel_stand_in([]), raising=False)
    watched, plain = torch.nn.Parameter(torch.zeros(3, 4)), torch.nn.Parameter(torch.zeros(3, 4))
    for w in (watched, plain):
        w.main_grad = torch.zeros(3, 4)
    watched.grad_added_to_main_grad = False
    seen = []

    def hook(p):  # as a wrapper's: record, then clear the gradient
        seen.append((p is watched, p.grad.untyped_storage().data_ptr()))
        p.grad = None

    for w in (watched, plain):
        w.register_post_accumulate_grad_hook(hook)
    torch.manual_seed(0)
    x, g = torch.randn(2, 4), torch.randn(2, 3)
    for _ in range(2):
        sb.backward_weight(sb.PendingWeightGrad([], deferred=[sb.DeferredWeightGrad(w, x, g, fused=True)
                                                              for w in (watched, plain)]))
    cached = sb.placeholder_wgrad([3, 4], torch.float32, torch.device("cpu")).untyped_storage().data_ptr()
    assert seen == [(True, cached)] * 2, (seen, cached)
    assert watched.grad_added_to_main_grad and not hasattr(plain, "grad_added_to_main_grad") and plain.grad is None
    for w in (watched, plain):
        torch.testing.assert_close(w.main_grad, 2 * g.t() @ x, rtol=1e-6, atol=1e-7)


def _wgrad_kernel_stand_in(calls: list):
    """apex's fused_weight_gradient_mlp_cuda, on CPU: main_grad += grad_output^T @ input (2-D operands)."""
    from types import SimpleNamespace

    def accumulate(total_input, grad_output, main_grad):
        calls.append(main_grad.shape)
        main_grad.add_(grad_output.t().matmul(total_input).to(main_grad.dtype))

    return SimpleNamespace(wgrad_gemm_accum_fp32=accumulate, wgrad_gemm_accum_fp16=accumulate)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_split_backward_defers_linears_with_fused_gradient_accumulation(monkeypatch, zero: int):
    """Megatron-Core local linears with gradient-accumulation fusion (apex's kernel; a CPU stand-in here) defer
    too: W runs the fused accumulation into main_grad, I none of it, and the sharded wrapper's gradients under
    ZeRO-1/2/3 (2/3: the buffer taken at the first I) equal those of breadth-first's fused B, which runs
    Megatron's own fused linear backward."""
    import torch
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.tensor_parallel import layers

    from megatron_bfpp.train import parallel
    from megatron_bfpp.train.data import gpt_forward_step
    from megatron_bfpp.train.model import build_model_chunks, make_transformer_config
    from megatron_bfpp.runtime import get_forward_backward_func
    from megatron_bfpp.runtime.executor import ScheduleExecutor
    from megatron_bfpp.sharded import ShardedDataParallel
    from tests.distributed.test_gpt_pipeline import SEQ, _batches

    calls: list = []
    monkeypatch.setattr(layers, "fused_weight_gradient_mlp_cuda", _wgrad_kernel_stand_in(calls), raising=False)
    monkeypatch.setattr(layers, "_grad_accum_fusion_available", True)
    in_i: list[int] = []  # kernel calls made during the I's
    do_i = ScheduleExecutor._do_I

    def watched_i(self, a):
        before = len(calls)
        do_i(self, a)
        in_i.append(len(calls) - before)

    monkeypatch.setattr(ScheduleExecutor, "_do_I", watched_i)
    parallel.init_single_process()
    try:
        grads = {}
        runs = [(zero, "breadth-first"), (zero, "interleaved-zb")] + ([(1, "breadth-first")] if zero != 1 else [])
        for run_zero, name in runs:
            config = make_transformer_config(num_layers=2, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0,
                                             attention_dropout=0.0, gradient_accumulation_fusion=True)
            modules = build_model_chunks(config, vocab_size=64, max_sequence_length=SEQ, pp_rank=0, pp_size=1,
                                         vp_size=2, seed=3)
            chunks = [ShardedDataParallel(config, DistributedDataParallelConfig(), m, zero_stage=run_zero,
                                          shard_align=1, param_align=1) for m in modules]
            for c in chunks:
                c.zero_grad_buffer()
            calls.clear()
            in_i.clear()
            get_forward_backward_func(name)(
                forward_step_func=gpt_forward_step, data_iterator=[iter(_batches(3, 0)) for _ in chunks],
                model=chunks, num_microbatches=3, seq_length=SEQ, micro_batch_size=2)
            for c in chunks:
                c.finish_grad_sync()
            linears = sum(isinstance(m, (layers.ColumnParallelLinear, layers.RowParallelLinear))
                          for c in modules for m in c.modules())
            assert len(calls) == 3 * linears > 0, (run_zero, name)  # every linear fused, once per micro-batch
            if name == "interleaved-zb":
                assert len(in_i) == 6 and sum(in_i) == 0, (run_zero, in_i)  # all of it at W
            grads[(run_zero, name)] = [b.gbuf.main_grad_shard.clone() for c in chunks for b in c.flat_buffers]
        for got, ref in zip(grads[(zero, "interleaved-zb")], grads[(zero, "breadth-first")]):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6, msg=f"ZeRO-{zero}")
        for got, ref in zip(grads[(zero, "breadth-first")], grads[(1, "breadth-first")]):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6, msg=f"ZeRO-{zero}")
    finally:
        parallel.destroy_parallel()


def _sequence_parallel_worker(rank: int, world: int) -> bool:
    """A column-parallel linear with sequence parallelism at T = world, deferred, against the same layer without
    sequence parallelism on the gathered input (Megatron's own SP backward needs CUDA buffers)."""
    import torch
    import torch.distributed as dist
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    from megatron_bfpp.train import parallel
    from megatron_bfpp.train.model import make_transformer_config
    from megatron_bfpp.runtime.split_backward import (PendingWeightGrad, backward_weight, deferring_weight_grads,
                                                       split_friendly_linears)

    dist.init_process_group("gloo", rank=rank, world_size=world)
    parallel.init_parallel(1, tensor_model_parallel_size=world, distributed_timeout_seconds=120)
    try:
        layers = {}
        for sp in (False, True):
            config = make_transformer_config(num_layers=1, hidden_size=16, num_attention_heads=2,
                                             tensor_model_parallel_size=world, sequence_parallel=sp)
            layer = ColumnParallelLinear(16, 24, config=config, init_method=torch.nn.init.normal_, bias=True,
                                         gather_output=False)
            torch.manual_seed(5 + rank)  # each rank's partition of the weight differs; both layers agree
            with torch.no_grad():
                layer.weight.copy_(torch.randn(layer.weight.shape))
                layer.bias.copy_(torch.randn(layer.bias.shape))
            split_friendly_linears(layer)
            layers[sp] = layer
        gen = torch.Generator().manual_seed(0)
        full = torch.randn(8, 2, 16, generator=gen)  # [s, b, h], the same on every rank
        g = torch.randn(8, 2, 24 // world, generator=gen)
        seq = slice(rank * 8 // world, (rank + 1) * 8 // world)

        ref_in = full.clone().requires_grad_()
        out, _ = layers[False](ref_in)
        out.backward(g)

        local = full[seq].clone().requires_grad_()
        with deferring_weight_grads():
            sp_out, _ = layers[True](local)
        torch.testing.assert_close(sp_out, out.detach(), rtol=1e-6, atol=1e-6)
        with deferring_weight_grads() as deferred:
            sp_out.backward(g)
        assert [d.weight for d in deferred] == [layers[True].weight] and layers[True].weight.grad is None
        assert deferred[0].input.shape == full.shape  # the W keeps the gathered input
        torch.testing.assert_close(local.grad, ref_in.grad[seq], rtol=1e-5, atol=1e-6)
        backward_weight(PendingWeightGrad([], deferred=deferred))
        for name in ("weight", "bias"):
            torch.testing.assert_close(getattr(layers[True], name).grad, getattr(layers[False], name).grad,
                                       rtol=1e-5, atol=1e-6)
    finally:
        parallel.destroy_parallel()
    return True


def test_split_backward_defers_sequence_parallel_linears(run_distributed):
    """With sequence parallelism (T = 2) a column-parallel linear defers too: I gathers the sequence for its W and
    reduce-scatters the input gradient; output, input gradient and weight gradients equal Megatron's."""
    assert run_distributed(_sequence_parallel_worker, 2) == [True, True]


def test_which_chunks_write_main_grad_at_input_grad():
    """ZeRO-2/3 take a stage's gradient buffer at its first I only where an I can write main_grad: gradient-
    accumulation fusion on a layer that runs its backward whole at I (TransformerEngine without delayed weight
    gradients, Megatron's own embedding-wgrad deferral); not for deferring or delaying layers, nor unfused."""
    from types import SimpleNamespace

    from megatron_bfpp.runtime.split_backward import writes_main_grad_at_input_grad
    from tests.support import toy_pipeline as toy

    cfg = toy.make_transformer_config()
    fused, unfused = SimpleNamespace(gradient_accumulation_fusion=True), SimpleNamespace(gradient_accumulation_fusion=False)
    whole_at_i = toy.SelfAccumulatingToyStage(cfg, 1, 2)  # carries fuse_wgrad_accumulation, no delay
    delaying = toy.DelayedWgradToyStage(cfg, 1, 2, fuse_wgrad_accumulation=True)
    plain = toy.ToyStage(cfg, 1, 2)
    assert writes_main_grad_at_input_grad(whole_at_i, fused)
    assert not writes_main_grad_at_input_grad(whole_at_i, unfused)
    assert not writes_main_grad_at_input_grad(delaying, fused)
    assert not writes_main_grad_at_input_grad(plain, fused)
    assert writes_main_grad_at_input_grad(plain, SimpleNamespace(gradient_accumulation_fusion=True,
                                                                 defer_embedding_wgrad_compute=True))


def test_deferral_report_counts_each_weight_gemm_of_a_delaying_module():
    """A TransformerEngine module with two weight GEMMs (LayerNormMLP's fc1 and fc2, its `weight_names`) counts
    as two linear layers in rank 0's note, so a chunk whose every GEMM defers is not reported as partial."""
    import torch

    from megatron_bfpp.runtime.split_backward import delayed_linears, report_deferral

    class Mlp(torch.nn.Module):  # TransformerEngine's surface: queued GEMMs, weight_names
        weight_names = ["fc1_weight", "fc2_weight"]

        def need_backward_dw(self) -> bool:
            return True

        def backward_dw(self) -> None:
            pass

    class Chunk(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = Mlp()

    assert delayed_linears([Mlp(), torch.nn.Module()]) == 3
    assert report_deferral(Chunk(), 2, "c", show=False) == "megatron_bfpp: c: 2 linear layers defer their weight GEMMs to W"
    partial = report_deferral(Chunk(), 1, "c", show=False)
    assert partial is not None and "cannot defer" in partial


# TransformerEngine delayed weight gradients (tests/support/toy_pipeline.py's stand-in, per version band) on every split
# schedule, P = 2, M = 4, where a chunk runs W after W (or after B) with no I between: the first W hands the
# gradients the I's gave autograd (biases under FP8 / return_bias, the fused weights' placeholder) to the hooks,
# which clear them; the next W must still give TransformerEngine a bias gradient and Megatron's DDP hook
# (overlap_grad_reduce) a weight gradient. (schedule, wrapper, band, fused, bias: "gemm" = computed in the wgrad
# GEMM at W, "return" = te_return_bias, "fp8" = at I under FP8.)
CONSECUTIVE_W = [("zb-h1", "megatron-ddp", "2.8", True, "return"),
                 ("interleaved-zb", "megatron-ddp", "2.10", True, "gemm"),
                 ("breadth-first-zb", "megatron-ddp", "2.10", False, "fp8"),
                 ("zb-h1", "zero-1", "2.7", False, "return"),
                 ("interleaved-zb", "zero-2", "2.8", True, "fp8"),
                 ("breadth-first-zb", "zero-3", "2.7", True, "return")]


def _ws_without_i_since_last_w_or_b(schedule, rank: int) -> int:
    """W's of this rank that follow a W or B of their stage with no I of it in between."""
    from megatron_bfpp.schedule import Op

    last: dict[int, Op] = {}
    count = 0
    for a in schedule.ranks[rank]:
        if a.op in (Op.I, Op.W, Op.B):
            count += a.op == Op.W and last.get(a.stage) in (Op.W, Op.B)
            last[a.stage] = a.op
    return count


def _te_stand_in_worker(rank: int, world: int, cases) -> list:
    import torch
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_bfpp.train import parallel
    from megatron_bfpp.runtime import get_forward_backward_func, set_wait_timeout
    from megatron_bfpp.runtime.forward_backward import last_schedule
    from megatron_bfpp.sharded import ShardedDataParallel
    from tests.support import toy_pipeline as toy
    from tests.support.megatron_ddp_cpu_shim import megatron_ddp_on_cpu
    from tests.support.strict_p2p import strict_p2p

    dist.init_process_group("gloo", rank=rank, world_size=world)
    set_wait_timeout(60)
    pp, m = world, 4
    results = []
    for name, wrapper, band, fused, bias in cases:
        vp = 1 if name == "zb-h1" else 2
        parallel.init_parallel(pp, vp)
        cfg = toy.make_transformer_config()
        cfg.gradient_accumulation_fusion = fused
        stages = [rank + c * pp for c in range(vp)]
        modules = [toy.DelayedWgradToyStage(cfg, s, pp * vp, fuse_wgrad_accumulation=fused, version=band,
                                            return_bias=bias == "return", fp8=bias == "fp8") for s in stages]
        with megatron_ddp_on_cpu():
            if wrapper == "megatron-ddp":
                ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=True, delay_wgrad_compute=True)
                chunks = [DistributedDataParallel(cfg, ddp_config, mod, disable_bucketing=i > 0)
                          for i, mod in enumerate(modules)]
                cfg.no_sync_func = [ch.no_sync for ch in chunks]  # as Megatron-LM's train() wires them
                cfg.grad_sync_func = [ch.start_grad_sync for ch in chunks]
            else:
                pg = SimpleNamespace(pp=parallel.pp_group(), dp=parallel.dp_group())
                chunks = [ShardedDataParallel(cfg, DistributedDataParallelConfig(), mod, pg_collection=pg,
                                              zero_stage=int(wrapper[-1]), shard_align=1, param_align=1)
                          for mod in modules]
            for ch in chunks:
                ch.zero_grad_buffer()
            with strict_p2p():
                get_forward_backward_func(name)(
                    forward_step_func=toy.forward_step, data_iterator=[iter(toy.make_batches(m)) for _ in chunks],
                    model=chunks, num_microbatches=m, seq_length=toy.SEQ, micro_batch_size=toy.MBS)
            if wrapper == "megatron-ddp":
                for ch in chunks:  # as finalize_model_grads does
                    ch.finish_grad_sync()
        grads = {}
        for s, ch, mod in zip(stages, chunks, modules):
            if wrapper == "megatron-ddp":
                grads[s] = {n: p.main_grad.detach().clone() for n, p in mod.linear.named_parameters()}
            else:
                b = ch.flat_buffers[0]  # D = 1: the shard is the whole gradient
                grads[s] = {sl.name.removeprefix("linear."): b.gbuf.main_grad_shard[sl.start:sl.end].view(sl.shape)
                            .clone() for sl in b.pbuf.layout.slots}
            grads[s]["left_queued"] = mod.linear.wgrad_store.context.qsize()
            grads[s]["backward_dw_calls"] = mod.linear.backward_dw_calls
        results.append({"grads": grads,
                        "consecutive_ws": _ws_without_i_since_last_w_or_b(last_schedule(), rank)})
        parallel.destroy_parallel()
    return results


@pytest.fixture(scope="module")
def te_stand_in_runs(run_distributed):
    return run_distributed(_te_stand_in_worker, 2, CONSECUTIVE_W, timeout=600)


@pytest.mark.timeout(700)
@pytest.mark.parametrize("index", range(len(CONSECUTIVE_W)),
                         ids=["-".join(str(x) for x in c) for c in CONSECUTIVE_W])
def test_transformer_engine_delayed_wgrads_with_consecutive_ws(te_stand_in_runs, index):
    """TransformerEngine layers (stand-in at its version band) with delay_wgrad_compute, under Megatron's own DDP
    with overlap_grad_reduce and gradient-accumulation fusion or under the sharded wrapper: a W after another W
    or B on the same chunk runs (TransformerEngine's backward_dw would fail on a bias whose gradient came at I,
    Megatron's hook on a fused weight's missing placeholder), every queued GEMM runs once, and main_grad equals
    the single-process reference."""
    from tests.support import toy_pipeline as toy

    case = CONSECUTIVE_W[index]
    vp = 1 if case[0] == "zb-h1" else 2
    _, ref = toy.reference(2 * vp, toy.make_batches(4))
    assert sum(per_rank[index]["consecutive_ws"] for per_rank in te_stand_in_runs) > 0, case  # what this is for
    for r, per_rank in enumerate(te_stand_in_runs):
        got = per_rank[index]
        for s, grads in got["grads"].items():
            assert (grads["backward_dw_calls"], grads["left_queued"]) == (4, 0), (case, s, grads)
            torch.testing.assert_close(grads["weight"], ref[s][0], rtol=1e-5, atol=1e-6, msg=f"{case} stage {s}")
            torch.testing.assert_close(grads["bias"], ref[s][1], rtol=1e-5, atol=1e-6, msg=f"{case} stage {s}")
