"""Megatron-LM's `pretrain_gpt.py` on CPU ranks (gloo, the test shim): the runner, its cache and the
comparisons every Megatron-LM test shares.

Each run is `tests/support/pretrain_runner.py [--launch] pretrain_gpt.py ...` on N ranks with
`PYTHONPATH=tests/support/cpu_shim BFPP_CPU_SHIM=1`, forked with torchrun's environment from servers that imported
Megatron once (or under torchrun itself, `launcher="torchrun"`); the runner records `training_log`'s arguments at full precision
(Megatron prints the grad norm with three decimals) and the log lines are parsed too. One `Runner` per checkout
per test session (the `mlm` / `mlm016` fixtures in tests/conftest.py): a configuration's run, the stock reference
included, is computed once and shared by every test that asks for it.
"""


from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support.distributed import free_port
from tests.support.forkserver import ForkServers, Job
from tests.support.paths import ROOT, megatron_lm_dir, subprocess_pythonpath

SHIM = ROOT / "tests" / "support" / "cpu_shim"
RUNNER = ROOT / "tests" / "support" / "pretrain_runner.py"
MEGATRON_LM_DIR = megatron_lm_dir()
RTOL = 1e-5

needs_checkout = pytest.mark.skipif(
    not MEGATRON_LM_DIR or not Path(MEGATRON_LM_DIR, "pretrain_gpt.py").is_file(),
    reason="MEGATRON_LM_DIR is not set to a Megatron-LM checkout (core_v0.19.0 / core_v0.16.1): "
           ".ci/run and scripts/test.sh set it to ../shared/megatron-lm/core_v0.19.0 when present",
)

# A tiny GPT: 4 layers, P = 2 with V = 2 (one layer per virtual stage), mock data, no dropout, fp32, and the
# local (non-TransformerEngine) layers with every fusion off so CPU runs the same math as stock. The optimizer's
# hyper-parameters are those LLM runs use, not Megatron's defaults (beta2 0.999, eps 1e-8, weight decay 0.01),
# which equal torch's: an optimizer that ignored the run's and took torch's would match stock otherwise.
TINY = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    "--vocab-size 128 --tokenizer-type NullTokenizer --mock-data --seed 1234 "
    "--micro-batch-size 1 --global-batch-size 8 --train-iters 4 --lr 1e-3 --lr-decay-style constant "
    "--adam-beta2 0.95 --adam-eps 1e-5 --weight-decay 0.1 --clip-grad 1.0 "
    "--hidden-dropout 0 --attention-dropout 0 --log-interval 1 --log-params-norm "
    "--eval-iters 1 --eval-interval 2 --distributed-backend gloo --num-workers 0 "
    "--transformer-impl local --no-gradient-accumulation-fusion --no-masked-softmax-fusion "
    "--no-bias-gelu-fusion --no-bias-dropout-fusion --no-rope-fusion --no-persist-layer-norm"
).split()
P2V2 = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]

ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|(.*)")
VALIDATION = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([0-9.E+-]+)")


def _field(line: str, name: str) -> str | None:
    m = re.search(re.escape(name) + r":\s*([^|]+)\|", line)
    return m.group(1).strip() if m else None


@dataclass
class Run:
    """One pretrain_gpt.py run: the output, its parsed log lines and the full-precision records."""

    name: str
    output: str
    seconds: float
    returncode: int = 0
    records: list[dict] = field(default_factory=list)
    log: dict[int, dict] = field(default_factory=dict)  # iteration -> parsed Megatron log line
    validation: dict[int, float] = field(default_factory=dict)

    def iterations(self) -> list[int]:
        return sorted(self.log)

    def by_iteration(self) -> dict[int, dict]:
        return {r["iteration"]: r for r in self.records}


def _parse(run: Run) -> None:
    for line in run.output.splitlines():
        m = ITERATION.search(line)
        if m and ("lm loss" in line or "number of skipped iterations" in line):
            loss = _field(line, "lm loss")
            run.log[int(m.group(1))] = {
                "lm loss": float(loss) if loss else None,
                "grad norm": float(_field(line, "grad norm")) if _field(line, "grad norm") else None,
                "params norm": float(_field(line, "params norm")) if _field(line, "params norm") else None,
                "num zeros": _field(line, "num zeros"),
                "skipped": int(_field(line, "number of skipped iterations") or 0),
                "loss scale": float(_field(line, "loss scale") or "nan"),
            }
        m = VALIDATION.search(line)
        if m:
            run.validation[int(m.group(1))] = float(m.group(2))


# What a rank of each kind of run imports before it trains, preloaded once per session by its fork servers. A
# stock run never imports the plugin.
MEGATRON_PRELOAD = ["torch", "torch.distributed", "megatron.core", "megatron.core.models.gpt", "megatron.training",
                    "megatron.training.training", "megatron.training.arguments", "megatron.training.initialize"]
PLUGIN_PRELOAD = ["megatron_bfpp", "megatron_bfpp.megatron", "megatron_bfpp.runtime", "megatron_bfpp.sharded",
                  "megatron_bfpp.run_megatron_script"]
# Every run's environment (on top of the test session's): the CPU shim, as each torchrun rank under it sees it.
RUN_ENV = {"BFPP_CPU_SHIM": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1", "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "ignore", "TORCHDYNAMO_DISABLE": "1"}


def torchrun_env(rank: int, world: int, port: int, run_id: str) -> dict[str, str]:
    """The variables torchrun's agent sets for each local worker of a one-node job
    (torch/distributed/elastic/agent/server/local_elastic_agent.py); no agent hosts the store here, so rank 0
    does (TORCHELASTIC_USE_AGENT_STORE=False)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
            "ROLE_NAME": "default", "LOCAL_WORLD_SIZE": str(world), "WORLD_SIZE": str(world),
            "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_USE_AGENT_STORE": "False",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


class Runner:
    """Starts (and caches) pretrain_gpt.py runs on a checkout: stock, patched, or through the script runner.

    Each run's ranks are forked from fork servers (tests/support/forkserver.py) that imported torch and the
    checkout's Megatron once per session, with torchrun's environment per rank; one set of servers per kind of
    run (stock: the original checkout, Megatron only; launch: the original checkout and the plugin; patched: the
    patched copy and the plugin). `launcher="torchrun"` runs it under torchrun itself, as users do."""

    def __init__(self, original: Path, patched: Path, workdir: Path) -> None:
        self.original, self.patched, self.workdir = original, patched, workdir
        self.cache: dict[tuple, Run] = {}
        self.count = 0
        self.servers: dict[str, ForkServers] = {}

    def close(self) -> None:
        for servers in self.servers.values():
            servers.close()
        self.servers = {}

    @staticmethod
    def _base_env() -> dict[str, str]:
        """The session's environment without launcher or plugin variables, with the CPU shim's: what every rank
        and every fork server starts from."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("BFPP_", "MASTER_", "TORCHELASTIC"))}
        env.update(PYTHONPATH=subprocess_pythonpath(str(SHIM)), **RUN_ENV)
        return env

    def _env(self, record: Path, extra_env: dict[str, str] | None) -> dict[str, str]:
        return dict(self._base_env(), BFPP_PRETRAIN_RECORD=str(record), **(extra_env or {}))

    def _servers(self, mode: str) -> ForkServers:
        if mode not in self.servers:
            checkout = self.patched if mode == "patched" else self.original
            preload = MEGATRON_PRELOAD + ([] if mode == "stock" else PLUGIN_PRELOAD)
            self.servers[mode] = ForkServers(preload, env=self._base_env(), path_prepend=[str(checkout)])
        return self.servers[mode]

    def run(self, mode: str, args: list[str], nproc: int = 2, expect_ok: bool = True, timeout: int = 240,
            extra_env: dict[str, str] | None = None, launcher: str = "forkserver") -> Run:
        """mode: 'stock' (original script, unmodified), 'patched' (our patch series) or 'launch' (original
        script through python -m megatron_bfpp.run_megatron_script). `extra_env`: extra variables for the runner
        (e.g. its test-only fault injection, BFPP_PRETRAIN_NAN_GRAD). `launcher`: 'forkserver' or 'torchrun'."""
        key = (mode, tuple(args), nproc, expect_ok, tuple(sorted((extra_env or {}).items())), launcher)
        if key in self.cache:
            return self.cache[key]
        self.count += 1
        name = f"run{self.count:02d}-{mode}"
        record = self.workdir / f"{name}.jsonl"
        script = (self.patched if mode == "patched" else self.original) / "pretrain_gpt.py"
        argv = [str(RUNNER)] + (["--launch"] if mode == "launch" else []) + [str(script), *args]
        env = self._env(record, extra_env)
        start = time.monotonic()
        if launcher == "torchrun":
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
                   str(free_port()), *argv]
            r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=self.workdir, timeout=timeout)
            output, returncode = r.stdout + r.stderr, r.returncode
            command = " ".join(cmd)
        else:
            output, returncode = self._fork_run(mode, name, argv, env, nproc, timeout)
            command = f"[{nproc} ranks forked with torchrun's environment] python " + " ".join(argv)
        run = Run(name, output, time.monotonic() - start, returncode)
        (self.workdir / f"{name}.log").write_text(command + "\n\n" + run.output)
        if expect_ok:
            assert returncode == 0, f"{name} failed (exit {returncode}): {' '.join(args)}\n{_tail(run.output)}"
        if record.exists():
            run.records = [json.loads(line) for line in record.read_text().splitlines() if line.strip()]
        _parse(run)
        self.cache[key] = run
        return run

    def _fork_run(self, mode: str, name: str, argv: list[str], env: dict[str, str], nproc: int,
                  timeout: int) -> tuple[str, int]:
        """The ranks of one run, forked; their output in rank order, then torchrun's failure summary lines."""
        port = free_port()
        logs = [self.workdir / f"{name}.rank{r}.log" for r in range(nproc)]
        jobs = [Job(env=dict(env, **torchrun_env(r, nproc, port, name)), cwd=str(self.workdir), log=str(logs[r]),
                    argv=argv) for r in range(nproc)]
        codes = self._servers(mode).run(jobs, timeout, fail_grace=5.0)
        if any(c is None for c in codes):
            raise AssertionError(f"{name}: ranks {[r for r, c in enumerate(codes) if c is None]} still running "
                                 f"after {timeout} s (killed); logs: {logs}")
        output = "".join(log.read_text(errors="replace") for log in logs if log.exists())
        failed = [(r, c) for r, c in enumerate(codes) if c != 0]
        for r, c in failed:
            output += f"[forked ranks] rank {r} (local_rank: {r}) failed: exitcode: {c}\n"
        return output, (1 if failed else 0)


def _tail(text: str, n: int = 60) -> str:
    lines = [ln for ln in text.splitlines() if "Warning" not in ln and "warnings.warn" not in ln]
    return "\n".join(lines[-n:])


def _apply_patches(checkout: Path) -> None:
    r = subprocess.run(["bash", str(ROOT / "scripts" / "apply_megatron_patches.sh"), str(checkout)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def _missing_module(checkout: Path) -> str | None:
    """The first third-party Python package the checkout imports that this environment lacks, or None. Any
    other import failure (a module of the checkout or the plugin missing, a TypeError, ...) fails the test:
    only a missing optional package may turn into a skip."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import runpy\n"
            "import megatron.training.training, megatron.training.arguments")
    env = dict(os.environ, PYTHONPATH=subprocess_pythonpath(str(SHIM)), BFPP_CPU_SHIM="1", PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, "-c", code, str(checkout)], capture_output=True, text=True, env=env,
                       timeout=180)
    m = re.search(r"ModuleNotFoundError: No module named '([\w.]+)'", r.stderr)
    if m and m.group(1).split(".")[0] not in ("megatron", "megatron_bfpp"):
        return m.group(1)
    assert r.returncode == 0, f"Megatron-LM at {checkout} does not import:\n{_tail(r.stderr, 5)}"
    return None


# ------------------------------------------------------------------------------------------------ comparisons

def _close(a: float | None, b: float | None, rtol: float = RTOL) -> bool:
    if a is None or b is None:
        return a is b
    return math.isclose(a, b, rel_tol=rtol, abs_tol=0.0)


def assert_same_training(run: Run, ref: Run, iterations: list[int] | None = None, rtol: float = RTOL,
                         params_norm: bool = True, logged: list[int] | None = None) -> None:
    """Same losses, grad norms, params norms and skipped iterations, per iteration, as the reference; and the
    same Megatron log lines (for the `logged` iterations, default all compared)."""
    got, want = run.by_iteration(), ref.by_iteration()
    its = iterations or sorted(want)
    assert its and set(its) <= set(got), f"{run.name}: iterations {sorted(got)}, expected {its}"
    assert set(its) <= set(run.log), f"{run.name}: Megatron logged iterations {run.iterations()}, expected {its}"
    for it in its:
        g, w = got[it], want[it]
        what = f"{run.name} vs {ref.name}, iteration {it}"
        assert g["skipped"] == w["skipped"], f"{what}: skipped {g['skipped']} != {w['skipped']}"
        assert set(g["losses"]) == set(w["losses"]), what
        for key in w["losses"]:
            assert _close(g["losses"][key], w["losses"][key], rtol), f"{what}: {key} {g['losses'][key]} != {w['losses'][key]}"
        assert _close(g["grad_norm"], w["grad_norm"], rtol), f"{what}: grad norm {g['grad_norm']} != {w['grad_norm']}"
        if params_norm:
            assert _close(g["params_norm"], w["params_norm"], rtol), f"{what}: params norm {g['params_norm']} != {w['params_norm']}"
        # Megatron's own line says the same (to its printed precision).
        if logged is not None and it not in logged:
            continue
        assert run.log[it]["skipped"] == ref.log[it]["skipped"]
        if ref.log[it]["lm loss"] is not None:
            assert _close(run.log[it]["lm loss"], ref.log[it]["lm loss"], 1e-5), f"{what}: logged lm loss"


def assert_same_validation(run: Run, ref: Run, rtol: float = RTOL) -> None:
    assert ref.validation, f"{ref.name}: no validation loss lines"
    assert sorted(run.validation) == sorted(ref.validation), f"{run.name}: validation at {sorted(run.validation)}"
    for it, loss in ref.validation.items():
        assert _close(run.validation[it], loss, rtol), f"{run.name}: validation loss at {it}: {run.validation[it]} != {loss}"


def stock_ref(mlm: Runner) -> Run:
    ref = mlm.run("stock", TINY + P2V2)
    assert ref.iterations() == [1, 2, 3, 4], _tail(ref.output)
    return ref


def _checkout_016() -> Path | None:
    """core_v0.16.1: $MEGATRON_LM_DIR_016, else beside MEGATRON_LM_DIR (../shared/megatron-lm/core_v0.16.1)."""
    explicit = os.environ.get("MEGATRON_LM_DIR_016")
    candidates = [Path(explicit)] if explicit else []
    if MEGATRON_LM_DIR:
        candidates.append(Path(MEGATRON_LM_DIR).resolve().parent / "core_v0.16.1")
    return next((c for c in candidates if (c / "pretrain_gpt.py").is_file()), None)




def make_runner(original: Path, work: Path) -> Runner:
    """A Runner over `original` and a patched copy of it in `work` (the checkout itself is never modified)."""
    patched = work / "Megatron-LM"
    shutil.copytree(original, patched, ignore=shutil.ignore_patterns("*.pyc", "__pycache__"))
    _apply_patches(patched)
    return Runner(original, patched, work)


# A small GPT's flags for the argument checks (no run).
CHECK = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "1", "--global-batch-size", "8",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--train-iters", "4", "--lr", "1e-3",
         "--mock-data", *P2V2, "--pipeline-schedule", "breadth-first"]


# An 8-layer GPT at P = 4 for the argument checks and the script runs that stop at Megatron's CUDA requirement.
P4_TINY = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
           "--max-position-embeddings", "32", "--micro-batch-size", "1", "--tokenizer-type", "NullTokenizer",
           "--vocab-size", "128", "--train-iters", "10", "--lr", "1e-3", "--mock-data",
           "--pipeline-model-parallel-size", "4"]
P4_VIRTUAL = ["--num-layers-per-virtual-pipeline-stage", "1"]  # 8 layers / P=4 -> V = 2
P4_WORLD = 8  # P=4 -> data-parallel size 2
