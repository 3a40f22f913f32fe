"""Simulator and planner for the split-backward (zero-bubble) schedules: the I/W cost split from FLOPs, the
memory a pending W keeps, closed forms of the simulated step and the planner's search over the new schedules.
Pure Python, fast."""

import dataclasses
import json

import pytest

import tests.support.megatron_parser  # noqa: F401  (Megatron's parser: imported once, at collection)
from megatron_bfpp.cli import main as cli_main
from megatron_bfpp.schedule import build, peak_pending_weight_grads
from megatron_bfpp.sim import (
    STOCK, Config, Partition, SearchSpace, analytic_costs, get_hardware, get_model, plan, predict, simulate_schedule,
    unit_costs,
)
from megatron_bfpp.sim.costs import (
    gemm_time, head_times, layer_input_grad_share, layer_times, peak_activation_bytes, split_backward_times,
)
from megatron_bfpp.sim.layer_costs import head_ops, layer_ops
from megatron_bfpp.sim.model import ModelProfile
from megatron_bfpp.sim.planner import enumerate_configs
from megatron_bfpp.sim.predict import memory, schedule_for

A100 = get_hardware("dgx-a100")
GPT52 = get_model("gpt-52b")
GPT13 = get_model("gpt-1.3b")


def _cfg(schedule="breadth-first-zb", tp=8, pp=4, vp=2, dp=8, m=8, zero=1, rc=False, **kw):
    return Config(tp, pp, vp, dp, 1, m, schedule, zero, rc, **kw)


def _step(name, pp, vp, m, g=None):
    s = build(name, pp, vp, m, g)
    return simulate_schedule(s, unit_costs(s), record_events=False)


# ------------------------------------------------------------------ I/W split from FLOPs

@pytest.mark.parametrize("model", [GPT52, GPT13, ModelProfile("odd", 4, 256, 8, 128, 512)])
def test_layer_backward_flops_follow_qi_et_al(model):
    """Qi et al. Table 1 (f = 4h): F = sbh(24h + 4s), I = sbh(24h + 8s), W = 24sbh^2, so B = I + W = 2F."""
    h, s = model.hidden_size, model.seq_length
    for b in (1, 3):
        i, w = model.layer_backward_flops(b)
        assert model.layer_forward_flops(b) == pytest.approx(s * b * h * (24 * h + 4 * s))
        assert i == pytest.approx(s * b * h * (24 * h + 8 * s))
        assert w == pytest.approx(24 * s * b * h * h)
        assert i + w == pytest.approx(2 * model.layer_forward_flops(b))
    part = Partition(model, 1, 1, 1)
    assert layer_input_grad_share(part) == pytest.approx((24 * h + 8 * s) / (48 * h + 8 * s))


def _weight_gemms(part, b=1):
    """The four weight-gradient GEMMs of a GPT layer (each the size of its forward GEMM), by hand."""
    m, t = part.model, part.tp
    tokens, h, f = b * m.seq_length, m.hidden_size, m.ffn
    return (gemm_time(A100, tokens, h, 3 * h / t) + gemm_time(A100, tokens, h / t, h)
            + gemm_time(A100, tokens, h, f / t) + gemm_time(A100, tokens, f / t, h))


def test_costs_split_the_backward_at_the_weight_gemms():
    """W is a stage's weight-gradient GEMMs, I the rest of its backward: about Qi et al.'s FLOPs split for a GPT
    layer; I + W is the fused backward; recomputation adds its forward to I; the fused schedule's B is unchanged."""
    cfg = _cfg(pp=4, vp=2)
    part = Partition(GPT52, cfg.tp, cfg.pp, cfg.vp)
    costs = analytic_costs(A100, part, cfg)
    fused = analytic_costs(A100, part, _cfg(schedule="breadth-first", pp=4, vp=2))
    lo, ho = layer_ops(A100, part, 1), head_ops(A100, part, 1)
    assert lo.weight_grad == pytest.approx(_weight_gemms(part), rel=1e-12)
    assert ho.weight_grad == pytest.approx(gemm_time(A100, GPT52.seq_length, GPT52.hidden_size,
                                                     part.padded_vocab / 8), rel=1e-12)
    share = 1 - lo.weight_grad / lo.backward
    # h = 8192, s = 2048: Qi et al.'s FLOPs share (24h + 8s) / (48h + 8s) = 0.52; the time share adds I's
    # communication and elementwise work.
    assert layer_input_grad_share(part) == pytest.approx(0.52, abs=0.01) and 0.5 < share < 0.6
    assert costs.backward == pytest.approx(fused.backward, rel=1e-12)
    n = part.layers_per_stage
    for s in range(1, part.num_stages - 1):
        assert costs.input_grad_share[s] == pytest.approx(share, rel=1e-12)
    lf, lb = layer_times(A100, part, 1)
    last = part.num_stages - 1
    assert costs.input_grad_share[last] == pytest.approx(
        (n * (lb - lo.weight_grad) + ho.backward - ho.weight_grad) / (n * lb + ho.backward), rel=1e-12)

    rc = analytic_costs(A100, part, _cfg(pp=4, vp=2, rc=True))
    middle = 1
    assert rc.backward[middle] == pytest.approx(n * (lb + lf))
    assert rc.backward[middle] * (1 - rc.input_grad_share[middle]) == pytest.approx(n * lo.weight_grad)


def test_w_rerunning_the_input_gradient_pays_the_dgrad_gemms_twice():
    part = Partition(GPT52, 8, 4, 2)
    li, lw, hi, hw_ = split_backward_times(A100, part, 1)
    li2, lw2, hi2, hw2 = split_backward_times(A100, part, 1, w_reruns_input_grad=True)
    assert (li2, hi2) == (li, hi)
    assert lw2 == pytest.approx(lw + _weight_gemms(part)) and hw2 > hw_
    fast = predict(GPT52, A100, _cfg(pp=8, vp=8, dp=8, m=4))
    slow = predict(GPT52, A100, _cfg(pp=8, vp=8, dp=8, m=4, w_reruns_input_grad=True))
    assert slow.step_time_s > fast.step_time_s
    # The fused schedules ignore the switch.
    bf = [predict(GPT52, A100, _cfg(schedule="breadth-first", w_reruns_input_grad=x)).step_time_s for x in (0, 1)]
    assert bf[0] == bf[1]


def test_w_at_input_grad_makes_a_split_schedule_its_fused_order():
    """Layers that cannot defer (TransformerEngine's) run their whole backward at I and W does nothing: I costs
    the fused backward, W nothing and keeps nothing, and interleaved-zb at M = P (ZB1P's order with B at the
    I's is interleaved 1F1B's) predicts exactly interleaved 1F1B's step and memory."""
    part = Partition(GPT52, 8, 4, 16)
    lf, lb = layer_times(A100, part, 1)
    hf, hb = head_times(A100, part, 1)
    assert split_backward_times(A100, part, 1, w_at_input_grad=True) == (lb, 0.0, hb, 0.0)
    with pytest.raises(ValueError):
        split_backward_times(A100, part, 1, w_reruns_input_grad=True, w_at_input_grad=True)
    at_i = predict(GPT52, A100, _cfg("interleaved-zb", pp=4, vp=16, dp=16, m=4, w_at_input_grad=True))
    fused = predict(GPT52, A100, _cfg("interleaved-1f1b", pp=4, vp=16, dp=16, m=4))
    deferred = predict(GPT52, A100, _cfg("interleaved-zb", pp=4, vp=16, dp=16, m=4))
    assert at_i.step_time_s == pytest.approx(fused.step_time_s, rel=1e-9)
    assert at_i.peak_memory_gib == pytest.approx(fused.peak_memory_gib, rel=1e-9)
    assert deferred.step_time_s < at_i.step_time_s
    # At Megatron's default split on both sides (free layouts are another question: test_sim_layouts.py).
    best = plan(GPT52, A100, 512, 64, SearchSpace(w_at_input_grad=True, search_layouts=False), top=1).candidates[0]
    today = plan(GPT52, A100, 512, 64, dataclasses.replace(STOCK, search_layouts=False), top=1).candidates[0]
    # Nothing to gain at 1/8: the same interleaved order, less only the first chunk's parameter gather, which stock
    # overlaps with its optimizer step (--overlap-param-gather-with-optimizer-step).
    assert today.config.param_gather_with_optimizer and not best.config.param_gather_with_optimizer
    assert best.tflops_per_gpu == pytest.approx(today.tflops_per_gpu, rel=5e-3)
    assert best.tflops_per_gpu < today.tflops_per_gpu
    assert not best.config.split_backward  # and a tie goes to the fused schedule


# ------------------------------------------------------------------ memory of pending W's

def test_pending_w_keeps_the_weight_gemm_operands():
    """32 sbh bytes per layer (inputs of QKV, proj, fc1, fc2: 14 sbh; gradients of their outputs: 18 sbh)."""
    for tp in (1, 8):
        part = Partition(GPT52, tp, 4, 2)
        sbh = GPT52.seq_length * GPT52.hidden_size
        assert part.pending_weight_grad_bytes(0, 1) == pytest.approx(part.layers_per_stage * 32 * sbh / tp)
        assert part.pending_weight_grad_bytes(0, 2) == pytest.approx(2 * part.pending_weight_grad_bytes(0, 1))
        assert part.pending_weight_grad_bytes(0, 1) < part.activation_bytes(0, 1, False)  # 32 < 34 sbh
        last = part.num_stages - 1
        assert part.pending_weight_grad_bytes(last, 1) > part.pending_weight_grad_bytes(0, 1)


@pytest.mark.parametrize("name,pp,vp,m,g", [("breadth-first-zb", 4, 2, 8, None), ("breadth-first-zb", 4, 2, 8, 4),
                                            ("interleaved-zb", 4, 2, 8, None), ("zb-h1", 4, 1, 8, None),
                                            ("breadth-first", 4, 2, 8, None)])
@pytest.mark.parametrize("rc", [False, True])
def test_activation_memory_counts_pending_ws(name, pp, vp, m, g, rc):
    """The planner's fast frontier equals walking the schedule with full activations freed at I and the
    pending-W bytes kept until W; fused schedules keep none."""
    cfg = Config(8, pp, vp, 8, 1, m, name, 1, rc, g)
    part = Partition(GPT52, 8, pp, vp)
    mem = memory(GPT52, cfg)
    sched = schedule_for(cfg)
    full = lambda s: part.activation_bytes(s, 1, rc)  # noqa: E731
    pend = lambda s: part.pending_weight_grad_bytes(s, 1)  # noqa: E731
    for r in range(pp):
        walk = peak_activation_bytes(sched, r, full, pend)
        assert mem[r]["activations"] == pytest.approx(walk, rel=1e-12)
        assert walk >= peak_activation_bytes(sched, r, full)
    pending = peak_pending_weight_grads(sched)
    assert predict(GPT52, A100, cfg).peak_pending_weight_grads == pending
    if name == "breadth-first":
        assert pending == [0] * pp
    else:
        assert max(pending) >= 1
        if name == "breadth-first-zb":
            assert max(pending) <= (g or m)  # the group size bounds the W lag


def test_breadth_first_zb_memory_against_breadth_first():
    """One group: deferring W trades full activations (34 sbh per layer) for pending-W operands (32 sbh), so
    no more memory. In groups, a group's last W's may still be pending while the next group's forwards run:
    at most the lag (G) pending W's more."""
    part = Partition(GPT52, 8, 4, 2)
    for m, g in ((4, None), (8, None), (8, 4), (16, 4)):
        a = memory(GPT52, Config(8, 4, 2, 8, 1, m, "breadth-first", 1, False, g))
        b = memory(GPT52, Config(8, 4, 2, 8, 1, m, "breadth-first-zb", 1, False, g))
        for r in range(4):
            extra = b[r]["activations"] - a[r]["activations"]
            if g is None:
                assert extra <= 1e-9 * a[r]["activations"]
            else:
                assert extra <= (g or m) * part.pending_weight_grad_bytes(r, 1) + 1e-6


# ------------------------------------------------------------------ closed forms (t_F = t_I = t_W = 1, free comm.)

@pytest.mark.parametrize("pp,vp,m", [(2, 2, 2), (2, 4, 8), (4, 2, 4), (4, 4, 8), (3, 3, 6), (8, 2, 16)])
def test_zero_bubble_steps_in_closed_form(pp, vp, m):
    """With M >= P: 1F1B-like orders take 3VM + 3(P - 1) units, breadth-first-zb 3VM + 2(P - 1) (the W's fill
    the drain of the backward), interleaved-zb 3VM + (P - 1) (only the forward fill remains)."""
    work = 3 * vp * m
    assert _step("breadth-first", pp, vp, m).step_time_s == pytest.approx(work + 3 * (pp - 1))
    assert _step("breadth-first-zb", pp, vp, m).step_time_s == pytest.approx(work + 2 * (pp - 1))
    r = _step("interleaved-zb", pp, vp, m)
    assert r.step_time_s == pytest.approx(work + (pp - 1))
    assert r.bubble_fraction == pytest.approx((pp - 1) / work)
    # The planner's gain from the bubble alone at equal layout: (3VM + 3(P-1)) / (3VM + (P-1)).
    gain = _step("interleaved-1f1b", pp, vp, m).step_time_s / r.step_time_s
    assert gain == pytest.approx((work + 3 * (pp - 1)) / (work + pp - 1))


def test_zb_h1_in_closed_form():
    for pp, m in ((2, 4), (4, 8), (4, 4)):
        assert _step("1f1b", pp, 1, m).step_time_s == pytest.approx(3 * m + 3 * (pp - 1))
        assert _step("zb-h1", pp, 1, m).step_time_s <= 3 * m + 2 * (pp - 1) + 1e-9


@pytest.mark.parametrize("pp,vp,m,g", [(2, 2, 1, None), (4, 2, 2, None), (4, 4, 3, None), (8, 8, 4, None),
                                       (8, 4, 7, None), (4, 2, 8, 4), (4, 3, 12, 4), (3, 2, 6, 3), (2, 4, 8, None)])
def test_breadth_first_zb_never_slower_than_breadth_first(pp, vp, m, g):
    bf, zb = _step("breadth-first", pp, vp, m, g), _step("breadth-first-zb", pp, vp, m, g)
    assert zb.step_time_s <= bf.step_time_s + 1e-9
    assert zb.bubble_fraction <= bf.bubble_fraction + 1e-12


def test_breadth_first_zb_small_batch_gain():
    """M < P (the 1/16-sequence-per-GPU layout of the 52B reproduction, P = 8, V = 8, M = 4): breadth-first
    idles [(V-1) max(M,P) + M + P - 1] / (VM) - 1 = 1.09 of its compute, much of it in the backward, where W
    fills it. Unit costs: 201 against 138 units, 1.46x."""
    bf, zb = _step("breadth-first", 8, 8, 4), _step("breadth-first-zb", 8, 8, 4)
    assert bf.step_time_s == pytest.approx(3 * 32 * (1 + ((8 - 1) * 8 + 4 + 8 - 1) / 32 - 1))
    assert bf.step_time_s / zb.step_time_s >= 1.2


@pytest.mark.parametrize("weight_buffers", [2, 3])
def test_breadth_first_zb_under_zero3_keeps_its_gathers_ahead(weight_buffers):
    """ZeRO-3 at M = P (52B, T/P/V/D = 8/4/16/16, M = 4): W's of one stage cut the next stage's I's into runs
    of one, and a gather prefetched only one run ahead arrived late (0.78x breadth-first). Prefetching the next
    *other* stage, and releasing a stage before W's that read no weights, keeps breadth-first-zb at least as
    fast as breadth-first; with W's that read weights it is the schedule the runtime would run on layers that
    cannot defer, and it must still validate."""
    runs = {}
    for sched, rerun in (("breadth-first", False), ("breadth-first-zb", False), ("breadth-first-zb", True)):
        cfg = _cfg(sched, pp=4, vp=16, dp=16, m=4, zero=3, weight_buffers=weight_buffers, w_reruns_input_grad=rerun)
        runs[(sched, rerun)] = predict(GPT52, A100, cfg, check=True)
    assert runs[("breadth-first-zb", False)].step_time_s <= runs[("breadth-first", False)].step_time_s
    assert runs[("breadth-first-zb", False)].dp_collectives == runs[("breadth-first", False)].dp_collectives


def test_analytic_breadth_first_zb_against_breadth_first():
    """On the cost model (ZeRO-1, overlapped communication) the W's fill bubbles: less bubble, and faster
    wherever there is a bubble worth filling. Where there is little (P = 4, V = 16 at M = P: 12% of compute;
    P = 2, V = 32: 2%), deferring the last stage's W's delays its gradient reduce-scatter at the end of the step,
    which can cost slightly more than the filled bubble saves (within 1%)."""
    for pp, vp, dp, m, gain in ((4, 16, 16, 4, 0.99), (8, 8, 8, 4, 1.25), (4, 2, 8, 8, 1.02), (2, 32, 64, 4, 0.99)):
        a = predict(GPT52, A100, _cfg("breadth-first", pp=pp, vp=vp, dp=dp, m=m))
        b = predict(GPT52, A100, _cfg("breadth-first-zb", pp=pp, vp=vp, dp=dp, m=m))
        assert b.bubble_fraction < a.bubble_fraction
        assert a.step_time_s / b.step_time_s >= gain


# ------------------------------------------------------------------ planner

def test_planner_enumerates_the_split_backward_schedules():
    configs, _ = enumerate_configs(GPT13, A100, 16, 32, SearchSpace(recompute=(False,)))
    names = {c.schedule for c in configs}
    assert {"breadth-first-zb", "interleaved-zb", "zb-h1"} <= names
    assert all(c.vp == 1 for c in configs if c.schedule == "zb-h1")
    assert all(c.vp >= 2 for c in configs if c.schedule in ("breadth-first-zb", "interleaved-zb"))
    assert any(c.group_size for c in configs if c.schedule == "breadth-first-zb")  # groups searched
    assert all(c.group_size is None for c in configs if c.schedule in ("interleaved-zb", "zb-h1"))


@pytest.mark.parametrize("zero", [1, 3])  # (one ZeRO stage a case: a test's CPU budget)
def test_plan_over_split_schedules_is_exact(zero: int) -> None:
    small = A100.replace(hbm_bytes=12e9)
    space = SearchSpace(schedules=("breadth-first", "breadth-first-zb", "interleaved-zb", "zb-h1", "1f1b"),
                        micro_batch_sizes=(1, 2), zero_stages=(zero,), tp_sizes=(2,), recompute=(False,),
                        search_layouts=False)
    res = plan(GPT13, small, 16, 32, space, top=4)
    configs, _ = enumerate_configs(GPT13, small, 16, 32, space)
    ref = sorted((p for p in (predict(GPT13, small, c) for c in configs) if p.fits), key=lambda p: -p.tflops_per_gpu)
    assert [p.tflops_per_gpu for p in res.candidates] == pytest.approx([p.tflops_per_gpu for p in ref[:4]], rel=1e-12)


def test_unrestricted_plan_picks_a_split_schedule_at_small_batch():
    """52B on 512 A100 at 1/8 sequence per GPU: the unrestricted planner beats today's Megatron (stock at its best:
    interleaved 1F1B, tuned group size, overlapped distributed optimizer) with a split-backward schedule, both at
    Megatron's default split."""
    today = plan(GPT52, A100, 512, 64, dataclasses.replace(STOCK, search_layouts=False), top=1)
    ours = plan(GPT52, A100, 512, 64, SearchSpace(recompute=(False,), search_layouts=False), top=1)
    best = ours.candidates[0]
    assert best.config.schedule in ("breadth-first-zb", "interleaved-zb")
    assert best.tflops_per_gpu > today.candidates[0].tflops_per_gpu


def _bfpp(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str]:
    """`bfpp` in this process (tests/unit/test_sim_cli.py runs the entry point as a process): exit code, stdout."""
    code = cli_main(list(args))
    return code, capsys.readouterr().out


def test_cli_simulate_and_plan_accept_the_new_schedules(capsys: pytest.CaptureFixture) -> None:
    base = ["--model", "gpt-52b", "--hardware", "dgx-a100", "--gpus", "512", "--global-batch-size", "32"]
    code, out = _bfpp(capsys, "simulate", *base, "--micro-batch-size", "1", "--tensor-model-parallel-size", "8",
                      "--pipeline-model-parallel-size", "8", "--num-layers-per-virtual-pipeline-stage", "1",
                      "--pipeline-schedule", "breadth-first-zb", "--zero-stage", "3", "--json")
    assert code == 0
    d = json.loads(out)
    assert d["config"]["pipeline_schedule"] == "breadth-first-zb" and d["config"]["w_reruns_input_grad"] is False
    assert d["peak_pending_weight_grads"] and max(d["peak_pending_weight_grads"]) >= 1
    assert {"step_time_s", "tflops_per_gpu", "bubble_fraction", "peak_memory_gib", "fits"} <= set(d)
    code, out = _bfpp(capsys, "simulate", *base, "--micro-batch-size", "1", "--tensor-model-parallel-size", "8",
                      "--pipeline-model-parallel-size", "8", "--pipeline-schedule", "zb-h1", "--split-backward-w",
                      "rerun-dgrad", "--json")
    assert code == 0
    assert json.loads(out)["config"]["w_reruns_input_grad"] is True
    code, out = _bfpp(capsys, "simulate", *base, "--micro-batch-size", "1", "--tensor-model-parallel-size", "8",
                      "--pipeline-model-parallel-size", "8", "--pipeline-schedule", "zb-h1", "--split-backward-w",
                      "at-i", "--json")
    assert code == 0
    config = json.loads(out)["config"]
    assert config["w_at_input_grad"] is True and config["w_reruns_input_grad"] is False
    # Megatron's split only: the free layouts and their refinement (tests/unit/test_sim_layouts.py) would add 15 s.
    code, out = _bfpp(capsys, "plan", *base, "--pipeline-schedule", "interleaved-zb", "--top", "2", "--json",
                      "--layout-search", "off")
    assert code == 0
    cands = json.loads(out)["candidates"]
    assert cands and all(c["config"]["pipeline_schedule"] == "interleaved-zb" for c in cands)
