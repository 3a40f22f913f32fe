"""The trainer's prediction from costs measured on its machine (megatron_bfpp.train.measured_prediction and the
pure parts of timeline_costs, comm_bench and report): per-action costs from a recorded timeline, collective
fits, the simulator over the schedule that ran, the CPU bound of ranks sharing cores, and the printed line."""

from __future__ import annotations

import json
import types

import pytest

from megatron_bfpp.schedule import make_schedule
from megatron_bfpp.schedule.events import TimelineEvent
from megatron_bfpp.sim import Costs, simulate_schedule
from megatron_bfpp.trace.run_report import prediction_line
from megatron_bfpp.train import comm_bench, measured_prediction as mp, timeline_costs

pytestmark = pytest.mark.timeout(60)
MS = 1e-3


def ev(rank, op, stage, start, end, it, stream="compute", mb=0):
    return TimelineEvent(rank, stream, f"{op}{stage}:{mb}", op, stage, mb, start, end, it)


def test_action_costs_are_medians_less_inner_waits_over_the_chosen_iterations():
    events = []
    for it, f in ((1, 9.0), (3, 1.0), (4, 3.0), (5, 2.0)):  # iteration 1: warm-up, left out
        events += [ev(0, "F", 0, 10 * it, 10 * it + f, it), ev(1, "B", 1, 10 * it, 10 * it + 2 * f, it),
                   ev(1, "STEP", 1, 10 * it + 5, 10 * it + 5.5, it)]
    # A wait recorded inside rank 0's F of iteration 4 (3 s long, 1.5 s of it waiting): 1.5 s of F.
    events.append(TimelineEvent(0, "p2p", "wait RECV_F0:0", "WAIT", 0, 0, 41.0, 42.5, 4))
    costs = timeline_costs.action_costs(events, [3, 4, 5])
    assert costs == {("F", 0): pytest.approx(1.5), ("B", 1): pytest.approx(4.0), ("STEP", 1): pytest.approx(0.5)}
    assert timeline_costs.net_durations(events, [4])[("F", 0)] == [pytest.approx(1.5)]
    assert timeline_costs.action_costs(events, [2]) == {}


def test_latency_bandwidth_fit_and_slowest_rank():
    lat, bw = comm_bench.fit_latency_bandwidth([(1000, 1e-4 + 1000 / 1e8), (5000, 1e-4 + 5000 / 1e8),
                                                (9000, 1e-4 + 9000 / 1e8)])
    assert lat == pytest.approx(1e-4) and bw == pytest.approx(1e8)
    lat, bw = comm_bench.fit_latency_bandwidth([(4096, 2e-4)])  # one size: all of it latency
    assert lat == pytest.approx(2e-4) and bw > 1e14
    with pytest.raises(ValueError):
        comm_bench.fit_latency_bandwidth([])
    merged = comm_bench.merge_ranks([{"p2p": [(10, 1.0), (20, 2.0)], "all_gather": []},
                                     {"p2p": [[10, 3.0], [20, 1.0]], "all_gather": [(10, 5.0)]}])
    assert merged["p2p"] == [(10, 3.0), (20, 2.0)] and merged["all_gather"] == [(10, 5.0)]
    assert merged["reduce_scatter"] == []


def test_iterations_after_the_warm_up():
    assert mp.WARMUP_ITERATIONS == 2
    assert mp.calibration_iterations(1, 40) == list(range(3, 3 + mp.CALIBRATION_ITERATIONS))
    assert mp.calibration_iterations(11, 14) == [13, 14]  # a resumed run: counted from its own first iteration
    assert mp.calibration_iterations(1, 2) == []
    assert mp.steady_iterations(1, 40) == list(range(3, 41)) and mp.steady_iterations(1, 2) == []


P, V, M, D = 2, 2, 4, 2
SCHED = make_schedule("breadth-first", P, V, M, None, zero_stage=3)
F_S, B_S, STEP_S = 2 * MS, 3 * MS, 0.5 * MS


def rank_stats(rank: int, cpu: float, thread_cpu: float, cores=(0, 1)) -> dict:
    pp_rank = rank // D
    return {"pp_rank": pp_rank, "cpu_s": [cpu, cpu * 3, cpu], "thread_cpu_s": [thread_cpu] * 3, "machine": "m",
            "cpus": list(cores), "load_average_1min": 4.5,
            # 10 s of steady iterations: this rank ran 3 s of them; the machine 14 s (its first rank's reading)
            "steady_cpu_s": 3.0, "steady_wall_s": 10.0, "steady_machine_busy_s": 14.0 if rank == 0 else 99.0,
            "stage_bytes": {str(s): [1e5, 2e5] for s in range(pp_rank, P * V, P)}, "p2p_bytes": 4096.0,
            "collectives": {"all_gather": [(1e4, 1e-4 + 1e4 / 1e9), (1e6, 1e-4 + 1e6 / 1e9)],
                            "reduce_scatter": [(1e4, 2e-4), (1e6, 2e-4 + 1e6 / 1e9)],
                            "p2p": [(1e4, 5e-5), (1e6, 5e-5 + 1e6 / 2e9)]}}


def costs_measured() -> dict:
    c = {("F", s): F_S for s in range(P * V)}
    c.update({("B", s): B_S for s in range(P * V)})
    c.update({("STEP", s): STEP_S for s in range(P * V)})
    return c


def machine(cpu=0.01, thread_cpu=None, cores=(0, 1)) -> mp.MachineCosts:
    # Rank work in recorded actions per step: M micro-batches x V stages x (F + B), and V STEPs.
    in_actions = M * V * (F_S + B_S) + V * STEP_S
    thread_cpu = in_actions if thread_cpu is None else thread_cpu
    per_rank = [rank_stats(r, cpu, thread_cpu, cores) for r in range(P * D)]
    return mp.machine_costs(SCHED, costs_measured(), per_rank, [3, 4, 5], dp=D, zero_stage=3)


def test_machine_costs_from_the_gathered_measurements():
    mc = machine(thread_cpu=M * V * (F_S + B_S) + V * STEP_S + 16 * 0.1 * MS)
    assert mc.forward_s == [F_S] * 4 and mc.backward_s == [B_S] * 4 and mc.step_s == [STEP_S] * 4
    assert mc.input_grad_share is None
    # 1.6 ms of the main thread's CPU outside the recorded actions, over the rank's 16 F/B: 0.1 ms each.
    assert mc.host_s_per_action == [pytest.approx(0.1 * MS)] * P
    lat, bw = mc.collectives["all_gather"]
    assert lat == pytest.approx(1e-4) and bw == pytest.approx(1e9)
    assert mc.stage_param_bytes == [1e5] * 4 and mc.stage_grad_bytes == [2e5] * 4 and mc.p2p_bytes == 4096
    assert mc.cpu_s == [0.01] * 4 and mc.cores == {"m": 2} and mc.machine_of_rank == ["m"] * 4  # medians
    assert mp.MachineCosts.from_dict(json.loads(json.dumps(mc.to_dict()))) == mc
    with pytest.raises(ValueError, match="no recorded B3"):
        mp.machine_costs(SCHED, {k: v for k, v in costs_measured().items() if k != ("B", 3)},
                         [rank_stats(r, 0.01, 0.0) for r in range(4)], [3], dp=D, zero_stage=3)


def test_the_schedule_bound_is_the_simulator_over_the_measured_costs():
    mc = machine()
    assert mc.host_s_per_action == [0.0, 0.0]
    costs = mp.schedule_costs(mc)
    assert costs.forward == [F_S] * 4 and costs.backward == [B_S] * 4 and costs.step == [STEP_S] * 4
    assert costs.optimizer == [2 * STEP_S] * P
    # ZeRO-3: the measured all-gather of the stage's bytes (one latency for both kinds: the larger).
    latency = max(mc.collectives["all_gather"][0], mc.collectives["reduce_scatter"][0])
    assert costs.gather == [pytest.approx(latency + 1e5 / 1e9)] * 4
    assert costs.reduce == [pytest.approx(latency + 2e5 / mc.collectives["reduce_scatter"][1])] * 4
    pred = mp.predict(SCHED, mc)
    res = simulate_schedule(SCHED, costs, record_events=False)
    assert pred["schedule_bound_s"] == res.step_time_s and pred["bubble_fraction"] == res.bubble_fraction
    # Free communication and no host work: the simulator's step of the same F, B and STEP.
    free = Costs.uniform(4, P, F_S, B_S, t_optimizer=2 * STEP_S)
    assert res.step_time_s >= simulate_schedule(SCHED, free, record_events=False).step_time_s
    assert pred["basis"].startswith("costs measured on this machine: ")
    assert mp.MachineCosts.from_dict(pred["costs"]) == mc


def test_host_work_per_action_lengthens_every_compute_action():
    slow = machine(thread_cpu=M * V * (F_S + B_S) + V * STEP_S + 16 * 1 * MS)
    costs = mp.schedule_costs(slow)
    assert costs.forward == [pytest.approx(F_S + MS)] * 4 and costs.backward == [pytest.approx(B_S + MS)] * 4
    assert mp.predict(SCHED, slow)["schedule_bound_s"] > mp.predict(SCHED, machine())["schedule_bound_s"]


def test_ranks_sharing_cores_take_their_cpu_time_over_the_cores():
    few = mp.predict(SCHED, machine(cpu=0.2, cores=(0, 1)))  # 4 ranks x 0.2 s of CPU on 2 cores: 0.4 s
    assert few["bound"] == "cpu" and few["step_time_s"] == pytest.approx(0.4) == few["cpu_bound_s"]
    # Context: other processes ran 14 - 4 x 3 = 2 s of the 10 s: 0.2 cores.
    assert few["cpu_bound_machine"] == {"ranks": 4, "cores": 2, "cpu_s_per_step": pytest.approx(0.8),
                                        "load_average_1min": 4.5, "other_processes_cores": pytest.approx(0.2)}
    assert few["schedule_bound_s"] < few["step_time_s"]
    many = mp.predict(SCHED, machine(cpu=0.01, cores=range(8)))
    assert many["bound"] == "schedule" and many["step_time_s"] == many["schedule_bound_s"] > many["cpu_bound_s"]
    # Off CPU (no CPU times gathered): the schedule alone.
    mc = machine()
    mc.cpu_s, mc.machine_of_rank, mc.cores = [], [], {}
    gpu = mp.predict(SCHED, mc)
    assert gpu["bound"] == "schedule" and "cpu_bound_s" not in gpu and "share 2 cores" not in gpu["basis"]


def test_other_processes_on_the_machine():
    stats = [{"machine": "a", "steady_cpu_s": 2.0, "steady_wall_s": 4.0, "steady_machine_busy_s": 6.0},
             {"machine": "a", "steady_cpu_s": 3.0, "steady_wall_s": 5.0, "steady_machine_busy_s": 0.0},
             {"machine": "b", "steady_cpu_s": 1.0, "steady_wall_s": 4.0, "steady_machine_busy_s": None}]
    assert mp.other_processes_cores(stats) == {"a": pytest.approx(0.25), "b": None}
    stats[0]["steady_machine_busy_s"] = 4.0  # less than the ranks' own (readings a tick apart): none
    assert mp.other_processes_cores(stats)["a"] == 0.0


def test_split_backward_keeps_the_measured_input_gradient_share():
    sched = make_schedule("breadth-first-zb", P, V, M, None, zero_stage=3)
    c = {("F", s): F_S for s in range(4)}
    c.update({("I", s): 1 * MS for s in range(4)})
    c.update({("W", s): 3 * MS for s in range(4)})
    mc = mp.machine_costs(sched, c, [rank_stats(r, 0.01, 0.0) for r in range(4)], [3], dp=D, zero_stage=3)
    assert mc.backward_s == [pytest.approx(4 * MS)] * 4 and mc.input_grad_share == [pytest.approx(0.25)] * 4
    assert mp.schedule_costs(mc).input_grad_share == [pytest.approx(0.25)] * 4
    assert mp.predict(sched, mc)["schedule_bound_s"] > 0


def test_printed_side_by_side():
    base = {"basis": "costs measured on this machine: details", "step_time_s": 0.1175, "measured_step_time_s": 0.125,
            "measured_iterations": [3, 40], "bubble": 0.221, "bound": "cpu", "schedule_bound_s": 0.0612,
            "cpu_bound_s": 0.1175,
            "cpu_bound_machine": {"ranks": 4, "cores": 2, "cpu_s_per_step": 0.235, "load_average_1min": 4.4,
                                  "other_processes_cores": None}}
    line = prediction_line(base, {"bubble": 0.25, "iteration": 40})
    assert line == ("predicted (costs measured on this machine): step time 117.5 ms vs measured 125.0 ms (median of "
                    "iterations 3-40), -6.0% | bubble 22.1% vs measured 25.0% (iteration 40) | bound by CPU: 4 ranks "
                    "need 235 ms of CPU per step on 2 cores (the schedule alone, one core per rank: 61.2 ms); load "
                    "average 4.4")
    busy = {**base, "cpu_bound_machine": {**base["cpu_bound_machine"], "other_processes_cores": 0.81}}
    assert prediction_line(busy, None).endswith("61.2 ms); other processes kept 0.8 cores busy meanwhile")
    sched = prediction_line({**base, "bound": "schedule", "step_time_s": 0.2}, None)
    assert sched.endswith("+60.0% | bubble 22.1% | bound by the schedule (the ranks' CPU time over the cores: 117.5 ms)")
    assert prediction_line({"basis": "unit costs", "bubble_fraction": 0.1}, None) is None
    assert prediction_line(None, None) is None


def test_the_report_block_from_what_the_ranks_gathered(monkeypatch):
    """train/report.prediction: the unit-cost block's machine-independent figures, the measured prediction over
    them, and the measured step time beside it (median after the warm-up)."""
    import importlib

    from megatron_bfpp.train import report

    sim_predict = importlib.import_module("megatron_bfpp.sim.predict")  # the package exports a `predict` too

    unit = {"basis": "unit costs", "bubble_fraction": 0.125, "dp_collectives": {"gather": [2, 2]}}
    monkeypatch.setattr(sim_predict, "predict_for_trainer", lambda args, times: dict(unit))
    args = types.SimpleNamespace(data_parallel_size=D, world_size=4, tensor_model_parallel_size=1, zero_stage=3,
                                 global_batch_size=16, seq_length=8)
    per_rank = [{"machine": rank_stats(r, 0.01, 0.0)} for r in range(4)]
    events = [ev(r, op, s, 0.0, t, 3) for r in range(4) for s in range(r // D, 4, P)
              for op, t in (("F", F_S), ("B", B_S), ("STEP", STEP_S))]
    times = [9.0, 5.0, 0.3, 0.1, 0.2]  # iterations 1-2 warm up
    out = report.prediction(args, times, first_iteration=1, per_rank=per_rank, events=events, ran=SCHED,
                            calibration=[3])
    assert out["basis"].startswith("costs measured on this machine") and out["dp_collectives"] == {"gather": [2, 2]}
    assert out["measured_step_time_s"] == 0.2 and out["measured_iterations"] == [3, 5]
    assert out["bubble_fraction"] != 0.125 and out["tokens_per_s"] == pytest.approx(16 * 8 / out["step_time_s"])
    # Without the ranks' measurements (a run of warm-up iterations only): the unit-cost block as it was.
    assert report.prediction(args, times[:2], per_rank=[{"machine": None}] * 4, ran=SCHED) == unit
    # A failure of the measured path is said, not raised: the report is still written.
    broken = [{"machine": {**rank_stats(r, 0.01, 0.0), "collectives": {}}} for r in range(4)]
    out = report.prediction(args, times, per_rank=broken, events=[], ran=SCHED, calibration=[3])
    assert out["basis"] == "unit costs" and "no recorded F0" in out["measured_costs_error"]


def test_what_a_rank_measures_of_its_machine():
    from megatron_bfpp.train import machine

    clock = machine.CpuClock()
    for _ in range(2):
        clock.start()
        sum(i * i for i in range(20000))
        clock.stop()
    assert len(clock.process_s) == len(clock.thread_s) == len(clock.wall_s) == len(clock.machine_s) == 2
    assert all(t >= 0 for t in clock.process_s + clock.thread_s) and all(w > 0 for w in clock.wall_s)
    busy = machine.machine_busy_s()
    assert busy is None or busy > 0
    assert machine.cores_available()
    # Pipeline pairs 0 -> 1, 2 -> 3; an odd last rank sits out.
    assert [machine.p2p_peer(p, 3, [10, 11, 12]) for p in range(3)] == [(11, True), (10, False), (None, False)]
    buf = types.SimpleNamespace(pbuf=types.SimpleNamespace(full_bytes=8), gbuf=types.SimpleNamespace(full_bytes=16))
    chunks = [types.SimpleNamespace(flat_buffers=[buf, buf]), types.SimpleNamespace(flat_buffers=[buf])]
    assert machine.stage_bytes(chunks, pp_rank=1, pp=2) == {1: [16, 32], 3: [8, 16]}
