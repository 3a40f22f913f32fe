"""Device hygiene: the package creates no tensor whose device is not derived from the model or a process group.

On GPU a tensor created without a device lands on the CPU; added to a CUDA tensor it raises, and passed to a
collective over an NCCL group it fails or hangs. On CPU with gloo every such bug is invisible, so two checks
make it visible. A factory that names a device literally (`device="cpu"`) or runs without one must be
deliberate host data and is allowed only at the sites listed in `HOST_DATA`, each with its reason.

Statically, every call of a tensor factory (`torch.zeros`, `empty`, `tensor`, `full`, `ones`, `arange`, ...) in
the package's source must name a `device=` that is not a literal, whatever configuration reaches it (split
backward, sequence parallelism, fused accumulation, every ZeRO stage and schedule): a factory bound to a local
name is checked at that name's calls, and one referenced any other way is a finding (its calls escape the check).

Dynamically, a `TorchFunctionMode` sees every tensor factory call made directly from a frame inside
`megatron_bfpp/` and flags those whose device is None at run time (a `device=` argument that was None). The
mode is installed in every process of a real multi-process trainer run (P = 2, V = 2, D = 2, ZeRO-3
breadth-first, fp16 with dynamic loss scaling, per-token loss), so the runtime, the sharded data
parallelism, the optimizer and the trainer are all exercised. A deviceless token counter in the
executor or a CPU loss accumulator in the trainer makes it fail.
"""

from __future__ import annotations

import ast
import linecache
import os
import re
import sys
from dataclasses import dataclass

import pytest
import torch
from torch.overrides import TorchFunctionMode

from tests.support.distributed import run_distributed

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
    ("train/model.py", "init_value", ("zeros", "ones", "empty")):
        "initial values are drawn from the CPU generator (identical whatever the layout and device), then "
        "copied to each parameter's device",
    ("sharded/optimizer.py", "_step_chunk", ("tensor",)):
        "torch's functional Adam (capturable=False) takes its step counts as CPU scalars",
    ("train/data.py", "causal_mask", ("ones",)):
        "the data loader's attention mask is host data like its batches (as Megatron's loader); "
        "gpt_forward_step moves the batch to the model's device",
    ("sharded/checkpoint.py", "saving_sharded_state_dict", ("tensor",)):
        "the checkpoint's optimizer step is a CPU scalar, as torch's Adam and Megatron's optimizers save it",
    ("train/faults.py", "check_numerics", ("zeros",)):
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


# ------------------------------------------------------------------------------------- the static check
STATIC_FACTORIES = {f.__name__ for f in FACTORIES - INHERITS_DEVICE} | {"from_numpy"}  # from_numpy: host only


class _SourceScan(ast.NodeVisitor):
    """Every tensor factory site of one package file: its calls must name a non-literal device."""

    def __init__(self, path: str, source: str) -> None:
        self.path = path
        self.lines = source.splitlines()
        self.functions = ["<module>"]
        self.aliases: list[dict[str, str]] = [{}]  # per function: local names bound to factories
        self.findings: list[Finding] = []
        self.calls = 0

    def _find(self, node: ast.AST, factory: str, problem: str) -> None:
        allowed = any(self.path == p and self.functions[-1] == f and factory in names for p, f, names in HOST_DATA)
        if not allowed:
            self.findings.append(Finding(self.path, node.lineno, self.functions[-1], factory, problem,
                                         self.lines[node.lineno - 1].strip()))

    @staticmethod
    def _factory(expr: ast.AST) -> str | None:
        if (isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name) and expr.value.id == "torch"
                and expr.attr in STATIC_FACTORIES):
            return expr.attr
        return None

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.functions.append(node.name)
        self.aliases.append({})
        self.generic_visit(node)
        self.functions.pop()
        self.aliases.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for alias in node.names:
            if node.module == "torch" and alias.name in STATIC_FACTORIES:
                self._find(node, alias.name, "imported by name (call it as torch.%s)" % alias.name)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name == "torch" and alias.asname:
                self._find(node, "torch", f"imported as {alias.asname} (its factories escape the check)")

    def visit_Assign(self, node: ast.Assign) -> None:
        # `make = torch.zeros if ... else torch.empty`: calls of `make` are checked as the factories'.
        value = node.value
        options = [value.body, value.orelse] if isinstance(value, ast.IfExp) else [value]
        names = [self._factory(o) for o in options]
        if all(names) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            self.aliases[-1][node.targets[0].id] = "/".join(names)
            if isinstance(value, ast.IfExp):
                self.visit(value.test)
            return
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        name = self._factory(node.func)
        if name is None and isinstance(node.func, ast.Name):
            name = self.aliases[-1].get(node.func.id)
        if name is None:
            self.generic_visit(node)
            return
        self.calls += 1
        device = next((k.value for k in node.keywords if k.arg == "device"), None)
        if device is None:
            unpacked = any(k.arg is None for k in node.keywords)
            self._find(node, name, "with a device hidden in **kwargs" if unpacked else "without a device")
        elif isinstance(device, ast.Constant) or (isinstance(device, ast.Call) and self._literal_device(device)):
            self._find(node, name, f"on a literal device ({ast.unparse(device)})")
        for child in [*node.args, *node.keywords]:
            self.visit(child)

    @staticmethod
    def _literal_device(call: ast.Call) -> bool:
        """torch.device("cpu") and the like."""
        return (isinstance(call.func, ast.Attribute) and call.func.attr == "device"
                and all(isinstance(a, ast.Constant) for a in call.args))

    def visit_Attribute(self, node: ast.Attribute) -> None:
        name = self._factory(node)
        if name is not None:
            self._find(node, name, "referenced, not called (its calls escape the check)")
        self.generic_visit(node)


def scan_source(path: str, source: str) -> tuple[list[Finding], int]:
    """The findings in one package file's source (`path` relative to the package) and how many calls it checked."""
    scan = _SourceScan(path, source)
    scan.visit(ast.parse(source))
    return scan.findings, scan.calls


def test_package_source_names_a_derived_device_at_every_factory_call():
    findings, calls = [], 0
    for folder, _, files in os.walk(PACKAGE_DIR):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path) as f:
                    found, n = scan_source(os.path.relpath(path, PACKAGE_DIR).replace(os.sep, "/"), f.read())
                findings += found
                calls += n
    assert not findings, "tensor factories without a device derived from the model or group:\n" + "\n".join(
        map(str, findings))
    assert calls > 20  # the scan reached the package's factory calls


@pytest.mark.parametrize("code", [
    "def f(n):\n    return torch.zeros(n, dtype=torch.int)\n",
    "def f(x):\n    return torch.tensor([1.0], dtype=x.dtype)\n",
    "def f(x):\n    return torch.arange(4, device='cpu')\n",
    "def f(x):\n    return torch.empty(4, device=torch.device('cpu'))\n",
    "def f(x):\n    return torch.full((2,), 1.0, device=None)\n",
    "def f(x, **kw):\n    return torch.ones(2, **kw)\n",
    "def f(x, c):\n    make = torch.zeros if c else torch.empty\n    return make(3, dtype=x.dtype)\n",
    "def f(x):\n    return x.new_zeros(1) + max(map(torch.zeros, [1]))\n",
    "from torch import zeros\n",
    "import torch as t\n",
])
def test_source_scan_flags_deviceless_factories(code):
    findings, _ = scan_source("runtime/executor.py", code)
    assert len(findings) == 1, findings


def test_source_scan_passes_derived_devices():
    code = ("def f(x, c):\n    a = torch.zeros(2, device=x.device)\n    b = torch.zeros_like(x)\n"
            "    make = torch.zeros if c else torch.empty\n    return make(3, device=a.device), x.new_ones(1)\n"
            "def g(n):\n    return torch.tensor([n])\n")
    findings, calls = scan_source("runtime/executor.py", code)
    assert calls == 3 and [(f.function, f.factory) for f in findings] == [("g", "tensor")]
    # The same deviceless call is allowed only at a listed host-data site.
    assert scan_source("train/faults.py", "def check_numerics():\n    return torch.zeros(2)\n")[0] == []
    assert len(scan_source("train/faults.py", "def other():\n    return torch.zeros(2)\n")[0]) == 1


# ------------------------------------------------------------------------------------ the dynamic check
BASE = ("--num-layers 4 --hidden-size 16 --num-attention-heads 2 --seq-length 8 --max-position-embeddings 8 "
        "--micro-batch-size 1 --global-batch-size 8 --train-iters 2 --lr 1e-2 --lr-decay-style constant "
        "--seed 5 --vocab-size 64 --mock-data --log-interval 100 "
        "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1").split()
RUNS = [["--pipeline-schedule", "breadth-first", "--zero-stage", "3", "--fp16", "--calculate-per-token-loss"]]


def _worker(rank: int, world: int, out_dir: str) -> dict:
    import torch.distributed as dist

    from megatron_bfpp.train import parallel
    from megatron_bfpp.train import Trainer
    from megatron_bfpp.train.config import parse_trainer_args

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
def test_trainer_runs_create_tensors_on_derived_devices(run_distributed, tmp_path):
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
    audit = _run_as_package_file("train/loop.py", ok)
    # The literal 'cpu' on the first line is judged by the real train/loop.py's source line, which has none.
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
