"""The runtime executes every schedule exactly: losses and gradients equal a single-process reference."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.support.distributed import run_distributed
from tests.support import toy_pipeline as toy
from tests.support.strict_p2p import strict_p2p

CASES = [  # (schedule, P, V, M, group size)
    ("gpipe", 2, 1, 4, None), ("1f1b", 2, 1, 3, None), ("interleaved-1f1b", 2, 2, 4, None),
    ("interleaved-1f1b", 2, 3, 6, 3), ("breadth-first", 2, 2, 4, None), ("breadth-first", 2, 3, 6, 2),
    ("breadth-first", 2, 2, 1, None), ("interleaved-1f1b", 2, 2, 5, 3),
    ("breadth-first-zb", 2, 2, 4, None), ("breadth-first-zb", 2, 3, 1, None), ("interleaved-zb", 2, 2, 4, None),
    ("zb-h1", 2, 1, 4, None), ("interleaved-zb", 2, 3, 1, None),
]
CASES_P4 = [("interleaved-1f1b", 4, 2, 8, 4), ("breadth-first", 4, 2, 8, None), ("breadth-first", 4, 2, 6, 3),
            ("1f1b", 4, 1, 6, None), ("interleaved-zb", 4, 2, 8, None), ("breadth-first-zb", 4, 2, 2, None),
            ("zb-h1", 4, 1, 4, None), ("interleaved-zb", 4, 2, 2, None), ("zb-h1", 4, 1, 2, None)]
CASES_P1 = [("breadth-first", 1, 3, 4, None), ("interleaved-1f1b", 1, 2, 3, 1), ("gpipe", 1, 1, 2, None)]


def _pipeline_worker(rank: int, world: int, cases) -> list:
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    with strict_p2p():  # sends complete only once their receive is posted, as NCCL's may
        return _run_cases(rank, world, cases)


def _run_cases(rank: int, world: int, cases) -> list:
    import torch.distributed as dist

    from megatron_bfpp.runtime import get_forward_backward_func, set_wait_timeout

    set_wait_timeout(60)
    pg = SimpleNamespace(pp=dist.new_group(list(range(world))), dp=None)
    results = []
    for name, pp, vp, m, g in cases:
        cfg = toy.make_config()
        stages = [rank + c * pp for c in range(vp)]
        chunks = [toy.ToyStage(cfg, s, pp * vp) for s in stages]
        batches = toy.make_batches(m)
        iters = [iter(batches) for _ in chunks]
        fb = get_forward_backward_func(name, g)
        store = fb(forward_step_func=toy.forward_step, data_iterator=iters, model=chunks, num_microbatches=m,
                   seq_length=toy.SEQ, micro_batch_size=toy.MBS, pg_collection=pg)
        losses = [float(d["lm loss"][0] / d["lm loss"][1]) for d in store]
        grads = {s: (c.linear.weight.grad.clone(), c.linear.bias.grad.clone()) for s, c in zip(stages, chunks)}
        # Evaluation: forward-only with another number of micro-batches.
        for c in chunks:
            c.zero_grad()
        eval_m = max(1, m - 1) if name not in ("interleaved-1f1b", "interleaved-zb", "zb-h1") else m
        eval_store = fb(forward_step_func=toy.forward_step, data_iterator=[iter(batches) for _ in chunks],
                        model=chunks, num_microbatches=eval_m, seq_length=toy.SEQ, micro_batch_size=toy.MBS,
                        forward_only=True, pg_collection=pg)
        eval_losses = [float(d["lm loss"][0] / d["lm loss"][1]) for d in eval_store]
        no_grads = all(c.linear.weight.grad is None or not c.linear.weight.grad.any() for c in chunks)
        results.append((losses, grads, eval_losses, no_grads))
    return results


def _check(cases, results_per_rank, pp):
    for i, (name, _, vp, m, _) in enumerate(cases):
        ref_losses, ref_grads = toy.reference(pp * vp, toy.make_batches(m))
        last_rank = (pp * vp - 1) % pp
        losses, _, eval_losses, _ = results_per_rank[last_rank][i]
        assert losses == pytest.approx(ref_losses, rel=1e-6), name
        n_eval = len(eval_losses)
        assert eval_losses == pytest.approx(ref_losses[:n_eval], rel=1e-6), name
        for r in range(pp):
            _, grads, _, no_grads = results_per_rank[r][i]
            assert no_grads, f"{name}: forward-only run touched gradients"
            for s, (w, b) in grads.items():
                torch.testing.assert_close(w, ref_grads[s][0], rtol=1e-5, atol=1e-6, msg=f"{name} stage {s}")
                torch.testing.assert_close(b, ref_grads[s][1], rtol=1e-5, atol=1e-6, msg=f"{name} stage {s}")


@pytest.mark.timeout(300)
def test_all_schedules_match_reference_p2(run_distributed):
    _check(CASES, run_distributed(_pipeline_worker, 2, CASES), 2)


@pytest.mark.timeout(300)
def test_all_schedules_match_reference_p4(run_distributed):
    _check(CASES_P4, run_distributed(_pipeline_worker, 4, CASES_P4), 4)


@pytest.mark.timeout(300)
def test_single_rank_several_chunks(run_distributed):
    _check(CASES_P1, run_distributed(_pipeline_worker, 1, CASES_P1), 1)


SELF_ACCUMULATING = [("interleaved-zb", 2, 2, 4, None), ("breadth-first-zb", 2, 2, 4, None)]


def _self_accumulating_worker(rank: int, world: int, cases) -> list:
    import torch.distributed as dist

    from megatron_bfpp.runtime import get_forward_backward_func, set_wait_timeout

    dist.init_process_group("gloo", rank=rank, world_size=world)
    set_wait_timeout(60)
    pg = SimpleNamespace(pp=dist.new_group(list(range(world))), dp=None)
    results = []
    for name, pp, vp, m, g in cases:
        stages = [rank + c * pp for c in range(vp)]
        chunks = [toy.SelfAccumulatingToyStage(toy.make_transformer_config(), s, pp * vp) for s in stages]
        fb = get_forward_backward_func(name, g)
        with strict_p2p():
            fb(forward_step_func=toy.forward_step, data_iterator=[iter(toy.make_batches(m)) for _ in chunks],
               model=chunks, num_microbatches=m, seq_length=toy.SEQ, micro_batch_size=toy.MBS, pg_collection=pg)
        results.append({s: (c.linear.weight.main_grad.clone(), c.linear.bias.grad.clone())
                        for s, c in zip(stages, chunks)})
    return results


@pytest.mark.timeout(300)
def test_split_backward_runs_self_accumulating_layers_once(run_distributed):
    """Megatron-Core chunks whose layers add their weight gradient into main_grad in their own backward
    (TransformerEngine's, fused gradient accumulation) run it whole at I, once: a split on the autograd graph
    would run that backward again at W and double the weight gradient."""
    per_rank = run_distributed(_self_accumulating_worker, 2, SELF_ACCUMULATING)
    for i, (name, pp, vp, m, _) in enumerate(SELF_ACCUMULATING):
        _, ref_grads = toy.reference(pp * vp, toy.make_batches(m))
        for r in range(pp):
            for s, (w, b) in per_rank[r][i].items():
                torch.testing.assert_close(w, ref_grads[s][0], rtol=1e-5, atol=1e-6, msg=f"{name} stage {s}")
                torch.testing.assert_close(b, ref_grads[s][1], rtol=1e-5, atol=1e-6, msg=f"{name} stage {s}")


# (schedule, ZeRO stage, layer kind[, gradient buffers]); one gradient buffer for two chunks makes ZeRO-2/3
# reduce a stage between an I and its W and take the buffer again at the W.
FUSED_ACCUMULATION = [("interleaved-zb", 1, "self-accumulating"), ("breadth-first-zb", 1, "self-accumulating"),
                      ("interleaved-zb", 2, "self-accumulating"), ("breadth-first-zb", 3, "self-accumulating"),
                      ("interleaved-zb", 2, "self-accumulating", 1)]
DELAYED_WGRAD = [("interleaved-zb", 1, "delayed"), ("interleaved-zb", 2, "delayed"), ("breadth-first-zb", 3, "delayed"),
                 ("zb-h1", 2, "delayed"), ("interleaved-zb", 1, "delayed-fused"), ("breadth-first", 2, "delayed"),
                 ("breadth-first", 1, "delayed-fused"), ("interleaved-zb", 2, "delayed-fused"),
                 ("breadth-first-zb", 3, "delayed-fused", 1)]


def _sharded_toy_worker(rank: int, world: int, cases) -> list:
    """Toy stages of a kind (see tests/support/toy_pipeline.py) in the sharded wrapper at D = 1, P = world."""
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_bfpp.runtime import get_forward_backward_func, set_wait_timeout
    from megatron_bfpp.sharded import ShardedDataParallel

    dist.init_process_group("gloo", rank=rank, world_size=world)
    set_wait_timeout(60)
    dp_groups = [dist.new_group([r]) for r in range(world)]
    pg = SimpleNamespace(pp=dist.new_group(list(range(world))), dp=dp_groups[rank])
    pp, m = world, 4
    results = []
    for name, zero, kind, *grad_buffers in cases:
        vp = 1 if name == "zb-h1" else 2
        cfg = toy.make_transformer_config()
        cfg.gradient_accumulation_fusion = kind in ("self-accumulating", "delayed-fused")
        stages = [rank + c * pp for c in range(vp)]
        if kind == "self-accumulating":
            modules = [toy.SelfAccumulatingToyStage(cfg, s, pp * vp) for s in stages]
        else:
            modules = [toy.DelayedWgradToyStage(cfg, s, pp * vp, fuse_wgrad_accumulation=kind == "delayed-fused")
                       for s in stages]
        chunks = [ShardedDataParallel(cfg, DistributedDataParallelConfig(), mod, pg_collection=pg, zero_stage=zero,
                                      shard_align=1, param_align=1) for mod in modules]
        for ch in chunks:
            ch.zero_grad_buffer()
        with strict_p2p():
            get_forward_backward_func(name, grad_buffers=grad_buffers[0] if grad_buffers else 2)(
                forward_step_func=toy.forward_step, data_iterator=[iter(toy.make_batches(m)) for _ in chunks],
                model=chunks, num_microbatches=m, seq_length=toy.SEQ, micro_batch_size=toy.MBS, pg_collection=pg)
        grads = {}
        for s, ch, mod in zip(stages, chunks, modules):
            b = ch.flat_buffers[0]  # D = 1: the shard is the whole gradient
            grads[s] = {sl.name: b.gbuf.main_grad_shard[sl.start : sl.end].view(sl.shape).clone()
                        for sl in b.pbuf.layout.slots}
            if kind != "self-accumulating":
                grads[s]["backward_dw_calls"] = mod.linear.backward_dw_calls
                grads[s]["left_queued"] = mod.linear.wgrad_store.context.qsize()
        results.append(grads)
    return results


def _check_sharded_toy(cases, per_rank, pp: int) -> None:
    for r in range(pp):
        for (name, zero, kind, *grad_buffers), got in zip(cases, per_rank[r]):
            vp = 1 if name == "zb-h1" else 2
            _, ref_grads = toy.reference(pp * vp, toy.make_batches(4))
            what = f"{name} ZeRO-{zero} {kind} {grad_buffers}"
            for s, grads in got.items():
                torch.testing.assert_close(grads["linear.weight"], ref_grads[s][0], rtol=1e-5, atol=1e-6,
                                           msg=f"{what} stage {s}")
                torch.testing.assert_close(grads["linear.bias"], ref_grads[s][1], rtol=1e-5, atol=1e-6,
                                           msg=f"{what} stage {s}")
                if kind != "self-accumulating":  # one backward_dw per micro-batch (at its W, or after its B)
                    assert (grads["backward_dw_calls"], grads["left_queued"]) == (4, 0), (what, s, grads)


@pytest.mark.timeout(300)
def test_split_backward_with_fused_gradient_accumulation(run_distributed):
    """Layers that write main_grad in the I's backward (gradient-accumulation fusion) need the stage's gradient
    buffer there: ZeRO-1's is resident all step, ZeRO-2/3 take it at the stage's first I (the schedule is
    lowered with i_writes_grads), also when it is reduced and taken again between an I and its W. Exact."""
    _check_sharded_toy(FUSED_ACCUMULATION, run_distributed(_sharded_toy_worker, 2, FUSED_ACCUMULATION), 2)


@pytest.mark.timeout(300)
def test_transformer_engine_delayed_wgrads_run_at_w(run_distributed):
    """Layers that queue their weight-gradient GEMMs as TransformerEngine's do with delay_wgrad_compute: W runs
    each I's (backward_dw), B runs its own right after its backward, the layer's hooks hand the gradients to the
    sharded wrapper (ZeRO-1/2/3; fused into main_grad under ZeRO-1), and the gradients equal the reference."""
    _check_sharded_toy(DELAYED_WGRAD, run_distributed(_sharded_toy_worker, 2, DELAYED_WGRAD), 2)


def _unsafe_order_worker(rank: int, world: int) -> str:
    """Both ranks post a receive ahead of the send the other needs: fine on gloo, a deadlock on NCCL."""
    import torch.distributed as dist

    from megatron_bfpp.runtime.p2p import PipelineP2P

    dist.init_process_group("gloo", rank=rank, world_size=world)
    p2p = PipelineP2P(dist.new_group([0, 1]), torch.device("cpu"))
    peer = 1 - rank
    with strict_p2p(timeout_s=3):
        try:
            p2p.post([p2p.recv_op((2,), torch.float32, peer, "activations")])
            p2p.post([p2p.send_op(torch.ones(2), peer, "activations")])
        except TimeoutError as e:
            return str(e)
    return "completed"


@pytest.mark.timeout(120)
def test_strict_p2p_catches_an_nccl_unsafe_order(run_distributed):
    """The strict mode the runtime tests run under would fail on an order that deadlocks under NCCL."""
    out = run_distributed(_unsafe_order_worker, 2)
    assert all("deadlocks under NCCL" in o for o in out), out


def test_saved_bytes_hook_skips_wrapper_subclasses():
    """FP8/quantized tensors are wrapper subclasses without a plain storage: counted as nothing, not an error."""
    from megatron_bfpp.runtime.executor import SavedBytesCounter

    class Wrapper(torch.Tensor):
        @staticmethod
        def __new__(cls, inner):
            return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            raise NotImplementedError(func)

    w = Wrapper(torch.zeros(4))
    with pytest.raises(Exception):
        w.untyped_storage().data_ptr()  # what a storage-counting hook would call
    counter = SavedBytesCounter()
    assert counter.pack(w) is w and counter.nbytes == 0
    plain = torch.zeros(4)
    out = counter.pack(plain)
    assert counter.nbytes == 16 and out is not plain and out.data_ptr() == plain.data_ptr()


class _Work:
    def __init__(self):
        self.calls = []

    def wait(self, *args):
        self.calls.append(args)
        return True


@pytest.mark.parametrize("host_blocking", [True, False])
def test_waits_take_a_timeout_only_where_they_block_the_host(host_blocking):
    """gloo: bounded host wait. NCCL: `wait()` only orders the streams (no per-action host sync); the process
    group's timeout and watchdog bound it."""
    import datetime

    from megatron_bfpp.runtime.executor import ScheduleExecutor
    from megatron_bfpp.runtime.p2p import PendingTransfer
    from megatron_bfpp.schedule import Action, Op

    ex = ScheduleExecutor.__new__(ScheduleExecutor)
    ex.recorder, ex.timeout = None, datetime.timedelta(seconds=5)
    ex.p2p = SimpleNamespace(host_blocking_waits=host_blocking)
    work = _Work()
    ex._wait(PendingTransfer(work, torch.zeros(1), 1), Action(Op.RECV_F, 1, 0), "receive")
    assert work.calls == ([(ex.timeout,)] if host_blocking else [()])


def _handshake_worker(rank: int, world: int) -> int:
    import torch.distributed as dist

    from megatron_bfpp.runtime import runtime_state
    from megatron_bfpp.schedule import ScheduleSpec

    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.new_group([0, 1])
    calls = []
    original = dist.all_gather_into_tensor

    def counting(*a, **k):
        calls.append(1)
        return original(*a, **k)

    dist.all_gather_into_tensor = counting
    try:
        a, b = ScheduleSpec("breadth-first", 2, 2, 4), ScheduleSpec("breadth-first", 2, 2, 2)
        for s in (a, a, a, b, b, a):
            runtime_state.handshake(s, {"pipeline": group}, torch.device("cpu"))
    finally:
        dist.all_gather_into_tensor = original
    return len(calls)


@pytest.mark.timeout(120)
def test_schedule_handshake_runs_once_per_distinct_schedule(run_distributed):
    assert run_distributed(_handshake_worker, 2) == [2, 2]
