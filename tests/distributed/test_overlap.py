"""ZeRO-3 overlap, proven from the collectives themselves: when each all-gather and reduce-scatter was launched
and when it completed (its work object polled from a thread; at the latest, when waited on), against the compute it must hide behind.

A real trainer run (breadth-first, P = 2, V = 2, D = 2, ZeRO-3): every parameter all-gather of a stage is
launched before the compute preceding that stage's use starts (prefetch), and every reduce-scatter right
after the stage's last backward, before the next compute starts. The same run with the schedule's GATHER
made a no-op (parameters gathered lazily when first needed) fails the prefetch check, and with REDUCE made a
no-op (everything reduced at the end) fails the reduce check: the checks see what the collectives did, not
where the schedule's actions were recorded.

Asynchrony itself: the second data-parallel replica launches each collective DELAY late (it sleeps first), so
on the first replica, the observer, a collective cannot complete before DELAY after its launch. There each
launch must return before its collective completes (not complete when the call returns), and each
collective's launch-to-completion interval must contain compute of the same rank (an F or B running), unless
the schedule gives it nothing to hide behind: a gather whose very next compute is its own stage's, a
reduce-scatter after the rank's last compute. A blocking collective (the same run with `sharded.comm`'s
launches waiting for their work before returning) fails both.
"""

from __future__ import annotations

import threading
import time

import pytest

from tests.support.distributed import run_distributed

P, V, D, M = 2, 2, 2, 4
BASE = ("--num-layers 4 --hidden-size 16 --num-attention-heads 2 --seq-length 16 --max-position-embeddings 16 "
        f"--micro-batch-size 1 --global-batch-size {M * D} --train-iters 1 --lr 1e-3 --seed 5 --vocab-size 64 "
        f"--mock-data --pipeline-model-parallel-size {P} --num-layers-per-virtual-pipeline-stage 1 "
        "--pipeline-schedule breadth-first --zero-stage 3 --log-interval 100").split()
MUTATIONS = (None, "lazy-gather", "late-reduce", "blocking")
DELAY = 0.1  # seconds the second replica waits before each collective: longer than a busy 2-core machine stalls a rank


def _worker(rank: int, world: int) -> list:
    import torch.distributed as dist

    import megatron_bfpp.runtime as runtime
    from megatron_bfpp.train import parallel
    from megatron_bfpp.sharded import comm
    from megatron_bfpp.sharded.ddp import ShardedDataParallel
    from megatron_bfpp.sharded.driver import ShardedDriver
    from megatron_bfpp.train import Trainer
    from megatron_bfpp.train.config import parse_trainer_args

    dist.init_process_group("gloo", rank=rank, world_size=world)
    current: list = [None]
    records: list[dict] = []
    in_flight: list = []  # (record, work) not seen complete yet
    stop = threading.Event()

    def poll() -> None:
        """Observe completions as they happen (gloo runs collectives on its own threads; some of its works
        have no future)."""
        while not stop.is_set():
            for item in list(in_flight):
                if item[1].is_completed():
                    item[0]["done"] = time.time()
                    in_flight.remove(item)
            time.sleep(0.0002)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    original_wait = comm.Pending.wait

    def wait(self) -> None:  # gloo's reduce-scatter work reports completion only once waited on
        original_wait(self)
        rec = getattr(self, "_observed", None)
        if rec is not None and rec["done"] is None:
            rec["done"] = time.time()

    comm.Pending.wait = wait

    def observed(kind, launch):
        def wrapper(out, inp, group, *args, **kwargs):
            observer = comm.group_rank(group) == 0
            if not observer:
                time.sleep(DELAY)
            t = time.time()
            pending = launch(out, inp, group, *args, **kwargs)
            returned = time.time()
            rec = {"kind": kind, "chunk": current[0], "launch": t, "returned": returned, "done": None,
                   "observer": observer}
            records.append(rec)
            if pending.work is None or pending.work.is_completed():
                rec["done"] = returned  # complete when the launch returned (None: run synchronously)
            else:
                in_flight.append((rec, pending.work))
            pending._observed = rec
            return pending
        return wrapper

    def blocking(fn, tensors, unrecorded=()):  # the mutation: every launch waits for its collective
        work = originals["launch"](fn, tensors, unrecorded)
        if work is not None:
            work.wait()
        return work

    def in_chunk(method):
        def wrapper(self, *args, **kwargs):
            current[0] = id(self)
            try:
                return method(self, *args, **kwargs)
            finally:
                current[0] = None
        return wrapper

    originals = {"ag": comm.all_gather, "rs": comm.reduce_scatter,
                 "spg": ShardedDataParallel.start_param_gather, "sgs": ShardedDataParallel.start_grad_sync,
                 "gather": ShardedDriver.gather, "reduce": ShardedDriver.reduce, "set_recorder": runtime.set_recorder,
                 "launch": comm._launch}
    comm.all_gather = observed("gather", originals["ag"])
    comm.reduce_scatter = observed("reduce", originals["rs"])
    ShardedDataParallel.start_param_gather = in_chunk(originals["spg"])
    ShardedDataParallel.start_grad_sync = in_chunk(originals["sgs"])
    recorders: list = []
    runtime.set_recorder = lambda r: (recorders.append(r), originals["set_recorder"](r))
    results = []
    for mutation in MUTATIONS:
        ShardedDriver.gather = (lambda self, chunk: None) if mutation == "lazy-gather" else originals["gather"]
        ShardedDriver.reduce = (lambda self, chunk: None) if mutation == "late-reduce" else originals["reduce"]
        comm._launch = blocking if mutation == "blocking" else originals["launch"]
        records.clear()
        trainer = Trainer(parse_trainer_args(BASE, world_size=world))
        trainer.run()
        stage_of = {id(c): trainer.pp_rank + i * P for i, c in enumerate(trainer.model)}
        recorder = next(r for r in recorders if r is not None)
        recorders.clear()
        events = [e.to_dict() for e in recorder.events if e.iteration == 1]
        colls = [{**r, "stage": stage_of.get(r["chunk"])} for r in records]
        results.append({"events": events, "collectives": colls})
        parallel.destroy_parallel()
    ShardedDriver.gather, ShardedDriver.reduce = originals["gather"], originals["reduce"]
    comm._launch = originals["launch"]
    stop.set()
    poller.join()
    return results


def overlap_problems(events: list[dict], collectives: list[dict]) -> list[str]:
    """What in one rank's recorded iteration shows a collective not overlapped with compute."""
    computes = sorted((e for e in events if e["stream"] == "compute" and e["op"] in ("F", "B")),
                      key=lambda e: e["start"])
    lo = min(e["start"] for e in events)  # the recorded iteration is the run's last: all after lo is its own
    mine = [c for c in collectives if c["stage"] is not None and c["launch"] >= lo]
    problems = []
    for c in mine:
        if c["done"] is None or c["done"] < c["launch"]:
            problems.append(f"{c['kind']} of stage {c['stage']}: no completion observed")
    for g in (c for c in mine if c["kind"] == "gather"):
        uses = [k for k, e in enumerate(computes) if e["stage"] == g["stage"] and e["start"] >= g["launch"]]
        if not uses or uses[0] == 0:
            continue  # the rank's first compute has nothing to hide its gather behind
        prev = computes[uses[0] - 1]
        if prev["stage"] != g["stage"] and g["launch"] > prev["start"]:
            problems.append(f"all-gather of stage {g['stage']} launched at {g['launch']:.6f}, after "
                            f"{prev['name']} started ({prev['start']:.6f}): not prefetched")
    for r in (c for c in mine if c["kind"] == "reduce"):
        backs = [k for k, e in enumerate(computes) if e["op"] == "B" and e["stage"] == r["stage"]]
        last = backs[-1]
        if last + 1 < len(computes):
            nxt = computes[last + 1]
            if not computes[last]["end"] <= r["launch"] <= nxt["start"]:
                problems.append(f"reduce-scatter of stage {r['stage']} launched at {r['launch']:.6f}, not between "
                                f"its last backward and {nxt['name']} ({nxt['start']:.6f})")
    return problems


def asynchrony_problems(events: list[dict], collectives: list[dict]) -> list[str]:
    """On the observer replica (whose peer launches DELAY late): a collective complete when its launch returned,
    or one whose launch-to-completion interval holds no compute of this rank although compute followed."""
    computes = sorted((e for e in events if e["stream"] == "compute" and e["op"] in ("F", "B")),
                      key=lambda e: e["start"])
    lo = min(e["start"] for e in events)
    problems = []
    for c in (c for c in collectives if c["observer"] and c["stage"] is not None and c["launch"] >= lo):
        what = f"{c['kind']} of stage {c['stage']} launched at {c['launch']:.6f}"
        if c["done"] is None:
            problems.append(f"{what}: no completion observed")
            continue
        if c["done"] <= c["returned"]:
            problems.append(f"{what}: complete when its launch returned ({c['returned']:.6f}): blocking")
        after = [e for e in computes if e["start"] >= c["returned"]]
        if not after or (c["kind"] == "gather" and after[0]["stage"] == c["stage"]):
            continue  # nothing the schedule could run while it is in flight
        if not any(e["start"] < c["done"] and e["end"] > c["launch"] for e in computes):
            problems.append(f"{what}, done at {c['done']:.6f}: no compute of this rank ran meanwhile "
                            f"(next compute {after[0]['name']} at {after[0]['start']:.6f})")
    return problems


@pytest.fixture(scope="module")
def runs(run_distributed):
    return run_distributed(_worker, P * D, timeout=600)


@pytest.mark.timeout(700)
def test_prefetch_and_reduce_overlap_compute(runs):
    for rank, per_run in enumerate(runs):
        res = per_run[MUTATIONS.index(None)]
        kinds = {c["kind"] for c in res["collectives"]}
        assert kinds == {"gather", "reduce"}, kinds
        assert overlap_problems(res["events"], res["collectives"]) == [], rank


@pytest.mark.timeout(700)
def test_collectives_are_asynchronous_and_hidden_behind_compute(runs):
    observed = {"gather": 0, "reduce": 0}
    for rank, per_run in enumerate(runs):
        res = per_run[MUTATIONS.index(None)]
        assert asynchrony_problems(res["events"], res["collectives"]) == [], rank
        for c in res["collectives"]:
            if c["observer"] and c["stage"] is not None:
                observed[c["kind"]] += 1
    assert observed["gather"] > 0 and observed["reduce"] > 0, observed


@pytest.mark.timeout(700)
@pytest.mark.parametrize("mutation,needle,check", [
    ("lazy-gather", "not prefetched", overlap_problems), ("late-reduce", "reduce-scatter", overlap_problems),
    ("blocking", "blocking", asynchrony_problems), ("blocking", "no compute of this rank ran", asynchrony_problems),
])
def test_checks_fail_when_the_overlap_is_disabled(runs, mutation, needle, check):
    found = []
    for per_run in runs:
        res = per_run[MUTATIONS.index(mutation)]
        found += check(res["events"], res["collectives"])
    assert any(needle in p for p in found), found
