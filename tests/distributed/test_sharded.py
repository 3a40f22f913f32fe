"""Sharded data parallelism (ZeRO-1/2/3) against a single-process torch reference.

One 4-process job (gloo, CPU) runs every case once: D=2 cases on two pairs of ranks (all ZeRO stages under
breadth-first and interleaved-1f1b, fp32/bf16/fp16, clipping, state-dict round trip, distributed-checkpoint
save, the runtime's Megatron forward/backward steps), then D=4 cases on all four (ZeRO-3, memory, loading the
D=2 checkpoint at another data-parallel size, stage and alignment). Each rank executes the lowered schedule of `make_schedule(..., zero_stage=Z)` for
P=1 by hand, calling the driver exactly where the runtime does. The test functions compare the recorded
results with `torch.optim.AdamW` on the same global batch in this process.
"""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
import torch


H, B = 8, 2  # hidden size, samples per micro-batch
# The optimizer's hyper-parameters are those LLM runs use, not torch's defaults (betas 0.9 / 0.999, eps 1e-8): an
# update that took torch's instead of the run's would match the reference otherwise.
LR, WD, BETAS, EPS, CLIP = 1e-2, 0.1, (0.9, 0.95), 1e-5, 1.0
SMALL_ALIGN = {"shard_align": 8, "param_align": 4}  # parameters straddle shard boundaries


# -- model, data and reference ----------------------------------------------------------------------------


class Stage(torch.nn.Module):
    """LayerNorm -> Linear -> tanh; with `emb`, stage 0 multiplies its input by it and the last stage by its
    transpose (a tied embedding: the same Parameter object in two chunks)."""

    def __init__(self, s: int, n: int, emb: torch.nn.Parameter | None, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(100 * seed + s)
        self.s, self.n = s, n
        self.norm = torch.nn.LayerNorm(H)
        self.linear = torch.nn.Linear(H, H)
        with torch.no_grad():
            self.norm.weight.copy_(1 + 0.1 * torch.randn(H, generator=g))
            self.norm.bias.copy_(0.1 * torch.randn(H, generator=g))
            self.linear.weight.copy_(torch.randn(H, H, generator=g) / H**0.5)
            self.linear.bias.copy_(0.1 * torch.randn(H, generator=g))
        self.emb = emb if emb is not None and s in (0, n - 1) else None

    def forward(self, x):
        if self.emb is not None and self.s == 0:
            x = x @ self.emb
        h = torch.tanh(self.linear(self.norm(x)))
        if self.emb is not None and self.s == self.n - 1:
            h = h @ self.emb.t()
        return h


def make_model(v: int, tied: bool, seed: int = 0) -> list[Stage]:
    emb = None
    if tied:
        g = torch.Generator().manual_seed(999 + seed)
        emb = torch.nn.Parameter(torch.eye(H) + 0.1 * torch.randn(H, H, generator=g))
        emb.shared_embedding = True  # Megatron's tied-embedding marker
    return [Stage(s, v, emb, seed) for s in range(v)]


def global_batch(n: int, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + step)
    return [(torch.randn(B, H, generator=g), torch.randn(B, H, generator=g)) for _ in range(n)]


def reference(v: int, tied: bool, n_mb: int, steps: int, clip: float = CLIP, seed: int = 0, start: int = 0):
    """torch.optim.AdamW on the whole model and global batch: per-step losses, grad norms, final params
    (steps `start` .. `steps - 1` of the data)."""
    stages = make_model(v, tied, seed)
    params = list(dict.fromkeys(p for s in stages for p in s.parameters()))
    decay = [p for p in params if p.ndim > 1]  # Megatron: no weight decay on biases and 1-D parameters
    no_decay = [p for p in params if p.ndim <= 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, betas=BETAS, eps=EPS)
    losses, norms = [], []
    for step in range(start, steps):
        opt.zero_grad()
        total = 0.0
        for x, y in global_batch(n_mb, step):
            h = x
            for s in stages:
                h = s(h)
            loss = torch.nn.functional.mse_loss(h, y) / n_mb
            loss.backward()
            total += float(loss)
        losses.append(total)
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))))
        opt.step()
    return losses, norms, [{k: v.detach().clone() for k, v in s.state_dict().items()} for s in stages]


# -- one data-parallel rank ---------------------------------------------------------------------------------


def _build(v, tied, zero, dtype, dp, align, opt_kw=None, seed=0):
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from megatron_bfpp.sharded import ShardedDataParallel, ShardedDriver, ShardedOptimizer

    stages = make_model(v, tied, seed)
    for s in stages:
        s.to(dtype)
    config = SimpleNamespace(calculate_per_token_loss=False)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=dtype != torch.float32)
    pg = SimpleNamespace(dp_cp=dp)
    chunks = [ShardedDataParallel(config, ddp_config, s, pg_collection=pg, zero_stage=zero, **align) for s in stages]
    kw = dict(optimizer="adam", lr=LR, weight_decay=WD, adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_eps=EPS,
              clip_grad=CLIP, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)
    kw.update(opt_kw or {})
    # Megatron's _get_param_groups all-gathers over the whole world, so the pairs running D=2 cases pass
    # the same grouping rule themselves (the D=4 cases use Megatron's; test_param_groups_are_megatrons).
    groups = None if dp is _world() and dp is not None else _megatron_rule_groups(chunks, LR)
    opt = ShardedOptimizer(chunks, OptimizerConfig(**kw), param_groups=groups)
    return chunks, ShardedDriver(chunks), opt


def _megatron_rule_groups(chunks, lr) -> list[dict]:
    """Megatron's standard rule: no weight decay on biases and 1-D parameters."""
    params = list(dict.fromkeys(p for c in chunks for p in c.parameters()))
    names = {p: n for c in chunks for n, p in c.named_parameters()}
    no_wd = [p for p in params if p.ndim == 1 or names[p].endswith(".bias")]
    wd = [p for p in params if not (p.ndim == 1 or names[p].endswith(".bias"))]
    return [{"params": wd, "wd_mult": 1.0, "max_lr": lr, "min_lr": None},
            {"params": no_wd, "wd_mult": 0.0, "max_lr": lr, "min_lr": None}]


class _TraceRecorder:
    """Records the step boundary's actions as the optimizer carries them out, with the collectives counted
    after each."""

    def __init__(self, trace: list, driver) -> None:
        self.trace, self.driver = trace, driver

    def start(self):
        return True

    def stop(self, started, action) -> None:
        self.trace.append((action.text, dict(self.driver.comm_stats())))


def _train_step(chunks, driver, opt, sched, batch, dtype, dp, trace=None):
    """Execute rank 0's action list of a P=1 lowered schedule up to its step boundary, hand the boundary to the
    optimizer as the runtime does, then finalize and step. `trace` gets (action, collectives counted before it)
    for the body and (action, collectives counted after it) for the boundary."""
    import torch.distributed as dist

    from megatron_bfpp.schedule import Op
    from megatron_bfpp.sharded import finalize_model_grads
    from megatron_bfpp.sharded.comm import group_size

    last = len(chunks) - 1
    m_count = len(batch)
    for c in chunks:
        c.zero_grad_buffer()
    opt.zero_grad()
    ins, outs, in_grads, total = {}, {}, {}, 0.0
    boundary = sched.step_boundary(0)
    for a in sched.ranks[0][:boundary]:
        c, m = a.stage, a.microbatch
        if trace is not None:
            trace.append((a.text, dict(driver.comm_stats())))
        if a.op == Op.F:
            driver.wait_params(c)
            x = batch[m][0].to(dtype) if c == 0 else outs[(c - 1, m)].detach().to(dtype).requires_grad_()
            out = chunks[c](x)
            ins[(c, m)] = x
            if c == last:
                loss = torch.nn.functional.mse_loss(out.float(), batch[m][1]) / m_count
                total += float(loss)
                out = opt.scale_loss(loss)
            outs[(c, m)] = out
        elif a.op == Op.B:
            driver.wait_params(c)
            driver.before_backward(c)
            out = outs.pop((c, m))
            if c == last:
                out.backward()
            else:
                out.backward(in_grads.pop((c + 1, m)))
            x = ins.pop((c, m))
            if c > 0:
                in_grads[(c, m)] = x.grad
        elif a.op == Op.GATHER:
            driver.gather(c)
        elif a.op == Op.RELEASE:
            driver.release(c)
        elif a.op == Op.REDUCE:
            driver.reduce(c)
    driver.finish_step()
    driver.plan_step([(a, a.stage) for a in sched.step_tail(0)],
                     None if trace is None else _TraceRecorder(trace, driver))
    finalize_model_grads(chunks)
    ok, norm, zeros = opt.step()
    t = torch.tensor([total], dtype=torch.float64)
    if group_size(dp) > 1:
        dist.all_reduce(t, group=dp)
    return float(t) / group_size(dp), ok, norm


def _full_params(chunks) -> list[dict]:
    out = []
    for c in chunks:
        with c.full_params():
            out.append({k: v.detach().float().clone() for k, v in c.module.state_dict().items()})
    return out


def _model_sharded_sd(chunks, replica_group):
    """Megatron's sharded state dict of every chunk, keyed by stage (P=1: chunk index = stage). Replica ids
    come from `replica_group`: the whole world, so only global rank 0 writes each tensor."""
    return {f"chunk{i}": c.sharded_state_dict(prefix=f"stage{i}.", metadata={"dp_cp_group": replica_group})
            for i, c in enumerate(chunks)}


def _optimizer_states(opt, chunks, dp) -> dict[str, torch.Tensor]:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    sd = opt.sharded_state_dict(_model_sharded_sd(chunks, _world()))
    return {sh.key: sh.data.clone() for sh in nested_values(sd["param_state"]) if isinstance(sh, ShardedTensor)}


def _cpu_dist_checkpointing_shim() -> None:
    """Megatron's torch_dist checkpoint writer calls CUDA (and psutil) unconditionally: test-only shim."""
    import megatron.core.dist_checkpointing.strategies.filesystem_async as fa

    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda *a, **k: None
        torch.cuda.current_device = lambda: "cpu"
    fa._process_memory = lambda: 0


def _case_train(rank, dp, c):
    from megatron_bfpp.schedule import make_schedule

    chunks, driver, opt = _build(c["v"], c["tied"], c["zero"], c["dtype"], dp, c["align"], c.get("opt"))
    d = dp.size()
    sched = make_schedule(c["sched"], 1, c["v"], c["m"], zero_stage=c["zero"])
    losses, oks, norms, comm, trace = [], [], [], [], []
    for step in range(c["steps"]):
        batch = global_batch(d * c["m"], step)[rank * c["m"] : (rank + 1) * c["m"]]
        if c.get("poison_first") and step == 0:  # targets so far off that the scaled fp16 gradients overflow
            batch = [(x, y * 1e4) for x, y in batch]
        loss, ok, norm = _train_step(chunks, driver, opt, sched, batch, c["dtype"], dp,
                                     trace if step == c["steps"] - 1 else None)
        losses.append(loss)
        oks.append(ok)
        norms.append(norm)
        comm.append(driver.comm_stats())
        if c.get("record_scale"):
            oks[-1] = (ok, float(opt.get_loss_scale()))
    return {
        "losses": losses, "oks": oks, "norms": norms, "comm": comm, "memory": driver.memory_stats(opt),
        "params": _full_params(chunks), "gathers": sched.count(0, _op("GATHER")),
        "reduces": sched.count(0, _op("REDUCE")), "trace": trace,
        "shard_bytes": [b.pbuf.shard_bytes for ch in chunks for b in ch.flat_buffers],
        "full_bytes": [b.pbuf.full_bytes for ch in chunks for b in ch.flat_buffers],
    }


def _op(name):
    from megatron_bfpp.schedule import Op

    return Op(name)


def _rank_batch(rank: int, dp, c: dict, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This data-parallel rank's micro-batches of the global batch of `step`."""
    return global_batch(dp.size() * c["m"], step)[rank * c["m"] : (rank + 1) * c["m"]]


def _trained_two_steps(rank: int, dp, c: dict):
    """The case's schedule, and a fp32 model and optimizer after two training steps (what the checkpoint cases
    save): (schedule, chunks, driver, optimizer)."""
    from megatron_bfpp.schedule import make_schedule

    sched = make_schedule(c["sched"], 1, c["v"], c["m"], zero_stage=c["zero"])
    chunks, driver, opt = _build(c["v"], c["tied"], c["zero"], torch.float32, dp, c["align"])
    for step in range(2):
        _train_step(chunks, driver, opt, sched, _rank_batch(rank, dp, c, step), torch.float32, dp)
    return sched, chunks, driver, opt


def _case_roundtrip(rank, dp, c):
    """Two steps, save model + optimizer state_dicts, rebuild from scratch, load, third step."""
    sched, chunks, driver, opt = _trained_two_steps(rank, dp, c)
    buf = io.BytesIO()
    torch.save({"model": [ch.state_dict() for ch in chunks], "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    chunks2, driver2, opt2 = _build(c["v"], c["tied"], c["zero"], torch.float32, dp, c["align"], seed=7)
    for ch, sd in zip(chunks2, saved["model"]):
        ch.load_state_dict(sd)
    opt2.load_state_dict(saved["opt"])
    loss, _, _ = _train_step(chunks2, driver2, opt2, sched, _rank_batch(rank, dp, c, 2), torch.float32, dp)
    return {"loss": loss, "params": _full_params(chunks2)}


def _case_ckpt_save(rank, dp, c):
    from megatron.core import dist_checkpointing

    _cpu_dist_checkpointing_shim()
    sched, chunks, driver, opt = _trained_two_steps(rank, dp, c)
    model_sd = _model_sharded_sd(chunks, _world())
    dist_checkpointing.save({"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd)}, c["dir"])
    states, step = _optimizer_states(opt, chunks, dp), opt._step
    loss, _, _ = _train_step(chunks, driver, opt, sched, _rank_batch(rank, dp, c, 2), torch.float32, dp)
    return {"states": states, "step": step, "loss": loss, "params": _full_params(chunks)}


def _case_ckpt_load(rank, dp, c):
    from megatron.core import dist_checkpointing

    from megatron_bfpp.schedule import make_schedule

    _cpu_dist_checkpointing_shim()
    sched = make_schedule(c["sched"], 1, c["v"], c["m"], zero_stage=c["zero"])
    chunks, driver, opt = _build(c["v"], c["tied"], c["zero"], torch.float32, dp, c["align"], seed=5)
    model_sd = _model_sharded_sd(chunks, _world())
    loaded = dist_checkpointing.load({"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, is_loading=True)},
                                     c["dir"])
    for i, ch in enumerate(chunks):  # keys of the wrapper's sharded state dict: "stage<i>.module.<name>"
        ch.load_state_dict({k.removeprefix(f"stage{i}.module."): v for k, v in loaded["model"][f"chunk{i}"].items()})
    opt.load_state_dict(loaded["optimizer"])
    states, step = _optimizer_states(opt, chunks, dp), opt._step
    loss, _, _ = _train_step(chunks, driver, opt, sched, _rank_batch(rank, dp, c, 2), torch.float32, dp)
    return {"states": states, "step": step, "loss": loss, "params": _full_params(chunks)}


def _case_runtime(rank, dp, c):
    """The runtime's executor (Megatron's forward_step / backward_step) on wrapped chunks, with our driver."""
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_bfpp.runtime import get_forward_backward_func
    from megatron_bfpp.sharded import ShardedDataParallel, finalize_model_grads
    from tests.support import toy_pipeline as toy

    pg = SimpleNamespace(pp=_GROUPS["self"], dp=dp)
    cfg = toy.make_config()
    # With P=1 the runtime pseudo-frees stage outputs that tanh saved for its backward; keep them here.
    cfg.deallocate_pipeline_outputs = False
    cfg.finalize_model_grads_func = finalize_model_grads
    chunks = [ShardedDataParallel(cfg, DistributedDataParallelConfig(), toy.ToyStage(cfg, s, c["v"]),
                                  pg_collection=pg, zero_stage=c["zero"], **SMALL_ALIGN) for s in range(c["v"])]
    batches = toy.make_batches(c["m"])
    for ch in chunks:
        ch.zero_grad_buffer()
    fb = get_forward_backward_func(c["sched"])
    fb(forward_step_func=toy.forward_step, data_iterator=[iter(batches) for _ in chunks], model=chunks,
       num_microbatches=c["m"], seq_length=toy.SEQ, micro_batch_size=toy.MBS, pg_collection=pg)
    grads = {}
    for s, ch in enumerate(chunks):
        b = ch.flat_buffers[0]
        full = torch.empty(b.pbuf.layout.padded_numel)
        dist.all_gather_into_tensor(full, b.gbuf.main_grad_shard, group=dp)
        grads[s] = {sl.name: full[sl.start : sl.end].view(sl.shape).clone() for sl in b.pbuf.layout.slots}
    return {"grads": grads, "gathers": chunks[0].stats.dp_allgather_calls}


def _case_groups(rank, dp, c):
    """Megatron's parameter groups (default_param_groups) next to the rule the D=2 cases apply."""
    from megatron.core.optimizer import OptimizerConfig

    from megatron_bfpp.sharded import default_param_groups

    chunks, _, _ = _build(2, True, 1, torch.float32, dp, SMALL_ALIGN)
    names = {p: n for ch in chunks for n, p in ch.named_parameters()}

    def summary(groups):
        return sorted((g["wd_mult"], tuple(sorted(names[p] for p in g["params"]))) for g in groups if g["params"])

    megatron = default_param_groups(chunks, OptimizerConfig(optimizer="adam", lr=LR, weight_decay=WD))
    return {"megatron": summary(megatron), "rule": summary(_megatron_rule_groups(chunks, LR))}


CASES = {"groups": _case_groups, "train": _case_train, "roundtrip": _case_roundtrip, "ckpt_save": _case_ckpt_save,
         "ckpt_load": _case_ckpt_load, "runtime": _case_runtime}


_GROUPS: dict = {}


def _world():
    return _GROUPS.get("world")


def _worker(rank: int, world: int, cases2: dict, cases4: dict) -> dict:
    """4 processes: the D=2 cases run on two pairs of ranks at once (split between them), then the D=4
    cases on all four. The D=2 checkpoint save is collective over the world: both pairs save the same
    state, and replica ids over the world make global rank 0 the only writer."""
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    _GROUPS["world"] = dist.new_group(list(range(world)))
    _GROUPS["self"] = [dist.new_group([r]) for r in range(world)][rank]
    pair, prank = divmod(rank, 2)
    out2 = {}
    plain = [k for k in sorted(cases2) if cases2[k]["kind"] != "ckpt_save"]
    for i, key in enumerate(plain):
        if i % 2 == pair:
            out2[key] = CASES[cases2[key]["kind"]](prank, pairs[pair], cases2[key])
    for key, c in cases2.items():
        if c["kind"] == "ckpt_save":
            out2[key] = CASES[c["kind"]](prank, pairs[pair], c)
    dist.barrier()
    out4 = {key: CASES[c["kind"]](rank, _world(), c) for key, c in cases4.items()}
    return {"pair": pair, "prank": prank, 2: out2, 4: out4}


# -- the two jobs -------------------------------------------------------------------------------------------


def _train(sched, zero, v=2, m=4, steps=3, tied=False, dtype=torch.float32, align=SMALL_ALIGN, opt=None, **kw):
    return dict(kind="train", sched=sched, zero=zero, v=v, m=m, steps=steps, tied=tied, dtype=dtype, align=align,
                opt=opt, **kw)


def _cases_d2(ckpt_dir: str) -> dict:
    cases = {}
    for sched in ("breadth-first", "interleaved-1f1b"):
        for zero in (1, 2, 3):
            cases[f"{sched}-z{zero}"] = _train(sched, zero, v=3 if zero == 3 else 2, tied=zero == 2)
    cases["bf16-z3"] = _train("breadth-first", 3, dtype=torch.bfloat16)
    cases["bf16-z1"] = _train("interleaved-1f1b", 1, dtype=torch.bfloat16, tied=True)
    cases["fp16-z2"] = _train("breadth-first", 2, dtype=torch.float16, steps=3, record_scale=True, poison_first=True,
                              opt=dict(initial_loss_scale=2.0**10, min_loss_scale=1.0, hysteresis=1))
    cases["clip-z2"] = _train("breadth-first", 2, tied=True, opt=dict(clip_grad=0.05))
    cases["default-align-z3"] = _train("breadth-first", 3, align={})
    for m in (3, 12):  # V=3 > 2 weight buffers
        cases[f"bf-m{m}-z3"] = _train("breadth-first", 3, v=3, m=m, steps=1)
        cases[f"il-m{m}-z3"] = _train("interleaved-1f1b", 3, v=3, m=m, steps=1)
    cases["z1-mem"] = _train("breadth-first", 1, steps=1, align={})
    cases["roundtrip"] = dict(kind="roundtrip", sched="interleaved-1f1b", zero=2, v=2, m=2, tied=True,
                              align=SMALL_ALIGN)
    cases["ckpt"] = dict(kind="ckpt_save", sched="breadth-first", zero=3, v=2, m=4, tied=True, align=SMALL_ALIGN,
                         dir=ckpt_dir)
    cases["runtime"] = dict(kind="runtime", sched="breadth-first", zero=3, v=2, m=4)
    return cases


def _cases_d4(ckpt_dir: str) -> dict:
    return {
        "breadth-first-z3": _train("breadth-first", 3, m=2, steps=2),
        "z1-mem": _train("breadth-first", 1, steps=1, align={}),
        "default-align-z3": _train("breadth-first", 3, m=2, align={}),
        "groups": dict(kind="groups"),
        "ckpt": dict(kind="ckpt_load", sched="interleaved-1f1b", zero=1, v=2, m=2, tied=True, align={},
                     dir=ckpt_dir),
    }


@pytest.fixture(scope="module")
def jobs(run_distributed, tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("ckpt"))
    res = run_distributed(_worker, 4, _cases_d2(ckpt), _cases_d4(ckpt), timeout=400)
    d2: list[dict] = [{}, {}]  # by rank within the pair that ran the case
    for r in res:
        for key, value in r[2].items():
            if key not in d2[r["prank"]] or r["pair"] == 0:
                d2[r["prank"]][key] = value
    return {2: d2, 4: [r[4] for r in res]}


def _assert_params(got: list[dict], want: list[dict], rtol=1e-5, atol=1e-6, what=""):
    for s, (g, w) in enumerate(zip(got, want)):
        assert g.keys() == w.keys()
        for k in g:
            torch.testing.assert_close(g[k], w[k].float(), rtol=rtol, atol=atol, msg=f"{what} stage {s} {k}")


# -- in this process: layout arithmetic, bad input, one data-parallel rank ------------------------------------

from hypothesis import given, settings, strategies as st  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(1, 9), min_size=1, max_size=3), min_size=1, max_size=6),
    dp=st.integers(1, 5), shard_align=st.integers(1, 16), param_align=st.integers(1, 8),
)
def test_layout_shards_are_equal_aligned_and_cover_each_parameter_once(shapes, dp, shard_align, param_align):
    from megatron_bfpp.sharded import FlatLayout

    lay = FlatLayout([(f"p{i}", s) for i, s in enumerate(shapes)], dp, shard_align, param_align)
    assert lay.shard_numel % shard_align == 0 and lay.padded_numel == dp * lay.shard_numel >= lay.numel
    for slot in lay.slots:
        assert slot.start % param_align == 0
        pieces = [(r, p) for r in range(dp) if (p := lay.piece(slot, r)) is not None]
        assert sum(p.numel for _, p in pieces) == slot.numel
        covered = [(p.param_lo, p.param_hi) for _, p in pieces]
        assert covered[0][0] == 0 and covered[-1][1] == slot.numel
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))  # contiguous, in rank order
        for r, p in pieces:
            lo, _ = lay.shard_range(r)
            assert lo + p.shard_lo == slot.start + p.param_lo
            assert p in lay.pieces(r)


def _fake_dp():
    """A group object for D=1 without torch.distributed: every collective short-circuits."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("torch.distributed is initialized in this process")
    return object()


def _wrap(module, **kw):
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_bfpp.sharded import ShardedDataParallel

    return ShardedDataParallel(SimpleNamespace(), DistributedDataParallelConfig(), module,
                               pg_collection=SimpleNamespace(dp_cp=_fake_dp()), **kw)


def test_bad_zero_stage_names_the_flag():
    with pytest.raises(ValueError, match="--zero-stage must be 1, 2 or 3"):
        _wrap(torch.nn.Linear(2, 2), zero_stage=4)


def test_missing_data_parallel_group_is_named():
    from megatron.core.distributed import DistributedDataParallelConfig

    from megatron_bfpp.sharded import ShardedDataParallel

    with pytest.raises(ValueError, match="dp_cp"):
        ShardedDataParallel(SimpleNamespace(), DistributedDataParallelConfig(), torch.nn.Linear(2, 2),
                            pg_collection=SimpleNamespace())


def test_parameter_shared_between_chunks_needs_the_tied_marker():
    shared = torch.nn.Linear(2, 2)
    _wrap(torch.nn.Sequential(shared))
    with pytest.raises(ValueError, match="shared_embedding"):
        _wrap(torch.nn.Sequential(shared))


@pytest.mark.parametrize("zero", [1, 3])
def test_single_rank_in_process_matches_reference(zero):
    """D=1, no processes: the full path (buffers, hooks, driver, finalize, optimizer) against AdamW."""
    from megatron_bfpp.schedule import make_schedule

    dp = _fake_dp()
    chunks, driver, opt = _build(3, True, zero, torch.float32, dp, SMALL_ALIGN)
    sched = make_schedule("breadth-first", 1, 3, 2, zero_stage=zero)
    losses = [_train_step(chunks, driver, opt, sched, global_batch(2, step), torch.float32, dp)[0]
              for step in range(2)]
    ref_losses, _, ref_params = reference(3, True, 2, 2)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    _assert_params(_full_params(chunks), ref_params, what=f"D=1 ZeRO-{zero}")
    if zero == 3:  # at rest only the first chunk is gathered: the step boundary's all-gather for the next step
        assert [any(b.pbuf.gathered for b in c.flat_buffers) for c in chunks] == [True, False, False]


# -- equivalence ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(600)
@pytest.mark.parametrize("sched", ["breadth-first", "interleaved-1f1b"])
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_matches_single_process_adamw(jobs, sched, zero):
    key = f"{sched}-z{zero}"
    c = _cases_d2("")[key]
    ref_losses, _, ref_params = reference(c["v"], c["tied"], 2 * c["m"], c["steps"])
    for rank in range(2):
        r = jobs[2][rank][key]
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-5), key
        assert all(r["oks"])
        _assert_params(r["params"], ref_params, what=key)


@pytest.mark.timeout(600)
def test_zero3_d4_matches_single_process_adamw(jobs):
    ref_losses, _, ref_params = reference(2, False, 4 * 2, 2)
    for rank in range(4):
        r = jobs[4][rank]["breadth-first-z3"]
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-5)
        _assert_params(r["params"], ref_params, what="D=4 ZeRO-3")


@pytest.mark.timeout(600)
def test_default_alignment_matches_reference(jobs):
    ref_losses, _, ref_params = reference(2, False, 2 * 4, 3)
    for d in (2, 4):  # M = 4 at D = 2, M = 2 at D = 4: the same global batch
        r = jobs[d][0]["default-align-z3"]
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-5)
        _assert_params(r["params"], ref_params, what=f"D={d} default alignment")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("key,tied", [("bf16-z3", False), ("bf16-z1", True)])
def test_bf16_tracks_fp32_reference(jobs, key, tied):
    """bf16 parameters and activations, fp32 master weights and gradient accumulation: within 2e-2."""
    ref_losses, _, ref_params = reference(2, tied, 2 * 4, 3)
    r = jobs[2][0][key]
    assert r["losses"] == pytest.approx(ref_losses, rel=2e-2)
    _assert_params(r["params"], ref_params, rtol=2e-2, atol=2e-2, what=key)


@pytest.mark.timeout(600)
def test_fp16_overflow_skips_step_and_lowers_scale(jobs):
    """Step 0's targets make the scaled fp16 gradients overflow: the step is skipped (no update) and the
    scale halves (hysteresis 1); steps 1 and 2 update like fp32 AdamW on those batches (fp16 tolerance)."""
    r = jobs[2][0]["fp16-z2"]
    assert r["oks"] == [(False, 2.0**9), (True, 2.0**9), (True, 2.0**9)]
    assert r["norms"][0] is None and r["norms"][1] > 0
    _, _, ref_params = reference(2, False, 2 * 4, 3, start=1)
    _assert_params(r["params"], ref_params, rtol=2e-2, atol=2e-2, what="fp16")


@pytest.mark.timeout(600)
def test_clipping_equals_torch_clip_grad_norm(jobs):
    ref_losses, ref_norms, ref_params = reference(2, True, 2 * 4, 3, clip=0.05)
    for rank in range(2):
        r = jobs[2][rank]["clip-z2"]
        assert r["norms"] == pytest.approx(ref_norms, rel=1e-5)
        assert max(r["norms"]) > 0.05  # clipping was active
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-5)
        _assert_params(r["params"], ref_params, what="clip")


@pytest.mark.timeout(600)
def test_runtime_forward_backward_steps_on_wrapped_chunks(jobs):
    """Megatron's forward_step/backward_step, through the runtime and our driver, fill the gradient shards."""
    from tests.support import toy_pipeline as toy

    _, ref_grads = toy.reference(2, toy.make_batches(4))
    for rank in range(2):
        r = jobs[2][rank]["runtime"]
        for s, (w, b) in ref_grads.items():
            torch.testing.assert_close(r["grads"][s]["linear.weight"], w, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(r["grads"][s]["linear.bias"], b, rtol=1e-5, atol=1e-6)
        assert r["gathers"] > 0


# -- counts, overlap and memory -----------------------------------------------------------------------------


@pytest.mark.timeout(600)
def test_comm_counts_follow_the_schedule(jobs):
    for key in ["breadth-first-z1", "breadth-first-z2", "breadth-first-z3", "interleaved-1f1b-z3",
                "interleaved-1f1b-z2"]:
        r = jobs[2][0][key]
        c = _cases_d2("")[key]
        for i, step in enumerate(r["comm"]):
            assert step["dp_reduce_scatter_calls"] == r["reduces"], key
            if c["zero"] == 3:
                # From the second step on the first GATHER finds the first chunk gathered by the step boundary.
                assert step["dp_allgather_calls"] == r["gathers"] - (i > 0), key
            else:  # one all-gather of the updated parameters per chunk after the step
                assert step["dp_allgather_calls"] == c["v"], key
            assert step["dp_allreduce_calls"] == (1 if c["tied"] else 0), key
            # every chunk's buffer has the same size here; fp32 gradients: grad bytes == param bytes
            assert step["dp_reduce_scatter_bytes"] == r["reduces"] * r["full_bytes"][0], key
            if c["zero"] == 3:
                assert step["dp_allgather_bytes"] == (r["gathers"] - (i > 0)) * r["full_bytes"][0], key


@pytest.mark.timeout(600)
@pytest.mark.parametrize("key", ["breadth-first-z1", "breadth-first-z2", "breadth-first-z3"])
def test_optimizer_carries_out_the_step_boundary_in_order(jobs, key):
    """The optimizer steps chunk by chunk in the schedule's order, and each all-gather the boundary places is
    launched right after its chunk's step: ZeRO-1/2 every chunk, ZeRO-3 the first (the next iteration's first
    GATHER then gathers nothing)."""
    r = jobs[2][0][key]
    c = _cases_d2("")[key]
    tail = r["trace"][-(2 * c["v"] if c["zero"] < 3 else c["v"] + 1):]
    texts = [t for t, _ in tail]
    want = [x for s in range(c["v"]) for x in (f"STEP{s}", f"GATHER{s}")]
    assert texts == (want if c["zero"] < 3 else want[:2] + [f"STEP{s}" for s in range(1, c["v"])])
    gathered = [after["dp_allgather_calls"] for _, after in tail]
    before = r["trace"][-len(tail) - 1][1]["dp_allgather_calls"]
    for (text, _), n, prev in zip(tail, gathered, [before] + gathered):
        assert n == prev + (1 if text.startswith("GATHER") else 0), (key, texts)
    if c["zero"] == 3:
        body = [t for t, _ in r["trace"][:-len(tail)]]
        first = body.index("GATHER0")
        assert r["trace"][first][1]["dp_allgather_calls"] == r["trace"][first + 1][1]["dp_allgather_calls"]


@pytest.mark.timeout(600)
def test_breadth_first_zero3_counts_do_not_grow_with_microbatches(jobs):
    """V=3, two weight buffers: breadth-first gathers <= 2V times and reduce-scatters V times at M=3 and
    M=12; interleaved-1f1b re-gathers (and reduces) more as M grows."""
    bf3, bf12 = jobs[2][0]["bf-m3-z3"]["comm"][0], jobs[2][0]["bf-m12-z3"]["comm"][0]
    il3, il12 = jobs[2][0]["il-m3-z3"]["comm"][0], jobs[2][0]["il-m12-z3"]["comm"][0]
    for r in (bf3, bf12):
        assert r["dp_allgather_calls"] <= 6 and r["dp_reduce_scatter_calls"] == 3
    assert bf3 == bf12
    assert il12["dp_allgather_calls"] > il3["dp_allgather_calls"] > bf3["dp_allgather_calls"]


@pytest.mark.timeout(600)
def test_zero3_collectives_issued_ahead_of_compute(jobs):
    """From the executed action order and the collectives counted so far: the next stage's all-gather is
    issued before the current stage's first forward, and each reduce-scatter before the backward of the
    earlier stage (breadth-first, ZeRO-3, V=3)."""
    r = jobs[2][0]["breadth-first-z3"]
    texts = [t for t, _ in r["trace"]]
    issued = dict(r["trace"])  # collectives counted before each action ran
    # The trace is of the last step: its GATHER0 finds chunk 0 gathered by the previous step's boundary.
    gathers = [t for t in texts if t.startswith("GATHER")][1:]
    reduces = [t for t in texts if t.startswith("REDUCE")]
    for s in range(2):  # GATHER{s+1} has been issued when F{s}:0 starts
        assert issued[f"F{s}:0"]["dp_allgather_calls"] >= gathers.index(f"GATHER{s + 1}") + 1
    for s in (2, 1):  # REDUCE{s} has been issued when B{s-1}:0 starts
        assert issued[f"B{s - 1}:0"]["dp_reduce_scatter_calls"] >= reduces.index(f"REDUCE{s}") + 1


@pytest.mark.timeout(600)
def test_zero3_resident_bytes_scale_as_one_over_d(jobs):
    for d in (2, 4):
        z3 = jobs[d][0]["default-align-z3"]
        z1 = jobs[d][0]["z1-mem"]
        m3, m1 = z3["memory"], z1["memory"]
        shard = sum(z3["shard_bytes"])
        full = sum(z3["full_bytes"])
        # After the step only the first chunk is gathered: the step boundary's all-gather of it, for the next
        # iteration's first forward.
        assert m3["param_bytes"] == shard + z3["full_bytes"][0]
        assert m3["grad_bytes"] == shard  # fp32 gradient shards only
        assert m3["optimizer_bytes"] == 2 * shard  # Adam moments; fp32 master aliases the shard
        assert shard * d == full
        assert m1["param_bytes"] == full and m1["grad_bytes"] == full + shard
        assert m3["peak_gathered_param_bytes"] <= 2 * max(z3["full_bytes"])  # two weight buffers
        resident3 = m3["param_bytes"] - z3["full_bytes"][0] + m3["grad_bytes"] + m3["optimizer_bytes"]
        assert resident3 == pytest.approx(4 * full / d)


# -- state -------------------------------------------------------------------------------------------------


@pytest.mark.timeout(600)
def test_param_groups_are_megatrons(jobs):
    """No weight decay on biases and 1-D parameters, as Megatron groups them (and the D=2 cases assume)."""
    r = jobs[4][0]["groups"]
    assert r["megatron"] == r["rule"]
    assert {wd for wd, _ in r["megatron"]} == {0.0, 1.0}


@pytest.mark.timeout(600)
def test_state_dict_round_trip(jobs):
    ref_losses, _, ref_params = reference(2, True, 2 * 2, 3)
    r = jobs[2][0]["roundtrip"]
    assert r["loss"] == pytest.approx(ref_losses[2], rel=1e-5)
    _assert_params(r["params"], ref_params, what="round trip")


@pytest.mark.timeout(600)
def test_distributed_checkpoint_loads_at_another_data_parallel_size(jobs):
    """Saved at D=2 / ZeRO-3 / breadth-first / 8-element shards, loaded at D=4 / ZeRO-1 / 128-element
    shards: the same per-parameter optimizer state, and the next step matches the uninterrupted run."""
    saved = jobs[2][0]["ckpt"]
    for rank in range(4):
        loaded = jobs[4][rank]["ckpt"]
        assert loaded["step"] == saved["step"] == 2
        assert loaded["states"].keys() == saved["states"].keys()
        for k in saved["states"]:
            torch.testing.assert_close(loaded["states"][k], saved["states"][k], rtol=0, atol=0, msg=k)
        assert loaded["loss"] == pytest.approx(saved["loss"], rel=1e-5)
        _assert_params(loaded["params"], saved["params"], what="after reload")
