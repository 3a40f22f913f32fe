"""Device hygiene: the package creates no tensor whose device is not derived from the model or a process group.

On GPU a tensor created without a device lands on the CPU; added to a CUDA tensor it raises, and passed to a
collective over an NCCL group it fails or hangs. On CPU with gloo every such bug is invisible, so this test
makes it visible: a `TorchFunctionMode` sees every tensor factory call (`torch.zeros`, `empty`, `tensor`,
`full`, `ones`, `arange`, ...) and flags those made directly from a frame inside `megatron_bfpp/`
that pass no `device=`. A factory that names the CPU literally (`device="cpu"`) must be deliberate host data
and is allowed only at the sites listed in `HOST_DATA`, each with its reason.

The mode is installed in every process of a real multi-process trainer run (P = 2, V = 2, D = 2, ZeRO-3
breadth-first, fp16 with dynamic loss scaling, per-token loss), so the runtime, the sharded data
parallelism, the optimizer and the trainer are all exercised. A deviceless token counter in the
executor or a CPU loss accumulator in the trainer makes it fail.
"""

from __future__ import annotations

import linecache
import os
import re
import sys
from dataclasses import dataclass

import pytest
import torch
from torch.overrides import TorchFunctionMode

from tests.distributed import run_distributed

PACKAGE_DIR = os.path.dirname(os.path.abspath(__import__("megatron_bfpp").__file__))
TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))

FACTORIES = {
    torch.zeros, torch.ones, torch.empty, torch.full, torch.tensor, torch.arange, torch.range, torch.linspace,
    torch.logspace, torch.eye, torch.rand, torch.randn, torch.randint, torch.randperm, torch.empty_strided,
    torch.scalar_tensor, torch.as_tensor, torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like,
    torch.rand_like, torch.randn_like, torch.randint_like,
}
# `*_like` take the device of their input; `as_tensor` of a tensor keeps its device.
INHERITS_DEVICE = {torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like, torch.rand_like,
                   torch.randn_like, torch.randint_like}

# Deliberate host data: (file relative to the package, function, factories) -> why a CPU tensor is right there.
HOST_DATA = {
    ("model.py", "init_value", ("zeros", "ones", "empty")):
        "initial values are drawn from the CPU generator (identical whatever the layout and device), then "
        "copied to each parameter's device",
    ("sharded/optimizer.py", "step_with_ready_grads", ("tensor",)):
        "torch's functional Adam (capturable=False) takes its step counts as CPU scalars",
    ("data.py", "causal_mask", ("ones",)):
        "the data loader's attention mask is host data like its batches (as Megatron's loader); "
        "gpt_forward_step moves the batch to the model's device",
    ("faults.py", "check_numerics", ("zeros",)):
        "the per-rank NaN flags are built on the host and moved to the group's device for the all-reduce",
}
_LITERAL_CPU = re.compile(r"""device\s*=\s*(torch\.device\()?["']cpu["']""")


@dataclass(frozen=True)
class Finding:
    path: str  # relative to the package
    line: int
    function: str
    factory: str
    problem: str
    source: str

    def __str__(self) -> str:
        return f"megatron_bfpp/{self.path}:{self.line} in {self.function}: {self.factory} {self.problem}: {self.source}"


class DeviceAudit(TorchFunctionMode):
    """Records factory calls made from the package's frames without a device derived from the model/group."""

    def __init__(self) -> None:
        super().__init__()
        self.findings: list[Finding] = []
        self.calls = 0  # factory calls from the package that were checked

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and func not in INHERITS_DEVICE:
            self._check(func, args, kwargs)
        return func(*args, **kwargs)

    def _check(self, func, args, kwargs) -> None:
        frame = sys._getframe(2)  # the caller of the factory (1 is __torch_function__)
        while frame is not None and frame.f_code.co_filename.startswith(TORCH_DIR):
            frame = frame.f_back  # torch's Python wrappers (torch.functional, ...) are not the call site
        if frame is None:
            return
        filename = os.path.abspath(frame.f_code.co_filename)
        if not filename.startswith(PACKAGE_DIR + os.sep):
            return
        if func is torch.as_tensor and args and torch.is_tensor(args[0]) and "device" not in kwargs:
            return  # a tensor stays where it is
        self.calls += 1
        path = os.path.relpath(filename, PACKAGE_DIR).replace(os.sep, "/")
        fn = frame.f_code.co_name
        source = linecache.getline(filename, frame.f_lineno).strip()
        name = getattr(func, "__name__", str(func))
        allowed = any(path == p and fn == f and name in names for p, f, names in HOST_DATA)
        problem = None
        if kwargs.get("device") is None:
            problem = "without a device (a CPU tensor on GPU runs)"
        elif _LITERAL_CPU.search(source):
            problem = "on a literal CPU device"
        if problem is not None and not allowed:
            self.findings.append(Finding(path, frame.f_lineno, fn, name, problem, source))


BASE = ("--num-layers 4 --hidden-size 16 --num-attention-heads 2 --seq-length 8 --max-position-embeddings 8 "
        "--micro-batch-size 1 --global-batch-size 8 --train-iters 2 --lr 1e-2 --lr-decay-style constant "
        "--seed 5 --vocab-size 64 --mock-data --log-interval 100 "
        "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1").split()
RUNS = [["--pipeline-schedule", "breadth-first", "--zero-stage", "3", "--fp16", "--calculate-per-token-loss"]]


def _worker(rank: int, world: int, out_dir: str) -> dict:
    import torch.distributed as dist

    from megatron_bfpp import parallel
    from megatron_bfpp.train import Trainer
    from megatron_bfpp.train_config import parse_trainer_args

    dist.init_process_group("gloo", rank=rank, world_size=world)
    audit = DeviceAudit()
    losses = []
    for i, extra in enumerate(RUNS):
        args = parse_trainer_args(BASE + extra + ["--report-json", os.path.join(out_dir, f"run{i}.json")],
                                  world_size=world)
        with audit:
            trainer = Trainer(args)
            trainer.run()
        losses.append(trainer.losses)
        parallel.destroy_parallel()
    return {"findings": [str(f) for f in sorted(set(audit.findings), key=str)], "calls": audit.calls,
            "losses": losses}


@pytest.mark.timeout(300)
def test_trainer_runs_create_tensors_on_derived_devices(tmp_path):
    results = run_distributed(_worker, 4, str(tmp_path), timeout=240)
    findings = sorted({f for r in results for f in r["findings"]})
    assert not findings, "tensors created without a device derived from the model or group:\n" + "\n".join(findings)
    assert all(r["calls"] > 0 for r in results)  # the audit saw the package's factories
    assert all(len(l) == 2 for r in results for l in r["losses"])


def _run_as_package_file(path: str, code: str) -> DeviceAudit:
    """Execute `code` as if it were written in the package file `path` (the audit judges by frame file)."""
    audit = DeviceAudit()
    with audit:
        exec(compile(code, os.path.join(PACKAGE_DIR, path), "exec"), {"torch": torch})
    return audit


@pytest.mark.parametrize("code", [
    "torch.zeros([], dtype=torch.int)",  # the executor's token counter before it took the model's device
    "torch.zeros(2, dtype=torch.float64)",  # the trainer's loss accumulator before it took the model's device
    "torch.tensor([1.0, 2.0])",
    "torch.arange(4)",
])
def test_audit_flags_deviceless_factories(code):
    audit = _run_as_package_file("runtime/executor.py", code)
    assert len(audit.findings) == 1 and "without a device" in audit.findings[0].problem


def test_audit_passes_derived_devices_and_ignores_other_code():
    ok = "p = torch.ones(2, device='cpu')\nx = torch.zeros(3, device=p.device)\ny = torch.zeros_like(x)\n" \
         "z = torch.as_tensor(x)\n"
    audit = _run_as_package_file("train.py", ok)
    # The literal 'cpu' on the first line is judged by the real train.py's source line, which has none.
    assert not [f for f in audit.findings if "without a device" in f.problem]
    with DeviceAudit() as outside:
        torch.zeros(2)  # this file is not the package
    assert not outside.findings


def test_host_data_sites_exist():
    """Every allowed host-data site names a real function of the package (no stale exemptions)."""
    for path, fn, _ in HOST_DATA:
        with open(os.path.join(PACKAGE_DIR, path)) as f:
            src = f.read()
        assert re.search(rf"def {fn}\(", src), f"{path}: no function {fn}"
