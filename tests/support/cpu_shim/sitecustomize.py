"""Test-only CPU shim: run Megatron-LM's CUDA-only training loop (`pretrain()`) on CPU with gloo.

Contract (stable; the tests and `scripts/ab_megatron.py --cpu-smoke` rely on it):

    PYTHONPATH=<repo>/tests/cpu_shim BFPP_CPU_SHIM=1 torchrun --nproc-per-node 2 \
        <Megatron-LM>/pretrain_gpt.py ... --distributed-backend gloo

Python imports `sitecustomize` at start-up; this one does nothing unless BFPP_CPU_SHIM=1. It answers the
generic torch-level CUDA entry points Megatron-LM reaches outside its kernels, and nothing Megatron-specific
except the dataset helpers' build step:

- `torch.cuda.is_available` (Megatron asserts it) is True; `device_count` 1, `current_device` 0, `set_device`
  and `synchronize` do nothing; `get_device_properties` / `get_device_capability` report an architecture
  (`BFPP_CPU_SHIM_ARCH`, default 9) for the device-architecture queries of argument validation;
- the CUDA RNG (`get_rng_state`, `set_rng_state`, `manual_seed`, `default_generators`, `_lazy_call`, used by
  Megatron's CudaRNGStatesTracker) is the CPU generator;
- one `TorchFunctionMode` maps every `device="cuda"` / `device=<int>` argument, `Tensor.cuda()` and
  `Tensor.to("cuda")` to the CPU, reports a float tensor's `type()` with its CUDA name (clip_grads checks
  `param.grad.type() == 'torch.cuda.FloatTensor'`), and gives `Tensor.numpy()` a copy, as the host copy of a
  CUDA tensor would be (numpy sharing a storage makes it non-resizable, which code that frees storage between
  uses relies on);
- CUDA streams and events are no-ops (`Stream`, `stream`, `current_stream`, `set_stream`, `Event`), and no
  stream is ever capturing a graph (`is_current_stream_capturing`);
- `torch.accelerator.is_available` is False (no pinned memory); `TORCHDYNAMO_DISABLE=1` (torch.compile'd
  helpers run eagerly);
- `megatron.core.datasets.utils.compile_helpers` does nothing and `megatron.core.datasets.helpers_cpp` falls
  back to the extension built into the installed megatron-core wheel (a source checkout has no built helpers).
- with `BFPP_CPU_CORES=c0,c1,...` (the A/B driver's `--cpu-pair`, `--pin-cores`) the rank with LOCAL_RANK k runs on
  core c_k alone (`os.sched_setaffinity`, before torch starts a thread), and says so on stderr; processes without
  LOCAL_RANK (torchrun itself) are left as they are.

Never imported by the package: on GPU, Megatron runs as it is. Unrelated to `tests/support/megatron_cpu_shim.py`, which
patches only the stock pipeline schedules inside one process.
"""

from __future__ import annotations

import os
import runpy

# Python imports one `sitecustomize`: where this one shadows the tests' import guard, run the guard too.
runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "import_guard",
                            "sitecustomize.py"))

if os.environ.get("BFPP_CPU_SHIM") == "1":
    import contextlib
    import importlib.abc
    import importlib.machinery
    import importlib.util
    import sys
    import types

    _cores = os.environ.get("BFPP_CPU_CORES")
    if _cores and "LOCAL_RANK" in os.environ:
        _local = int(os.environ["LOCAL_RANK"])
        _core_list = [int(c) for c in _cores.split(",")]
        if _local >= len(_core_list):
            raise RuntimeError(f"BFPP_CPU_CORES={_cores} names {len(_core_list)} core(s), not one for local rank "
                               f"{_local}")
        os.sched_setaffinity(0, {_core_list[_local]})
        print(f"cpu shim: rank {os.environ.get('RANK', _local)} pinned to core {_core_list[_local]}", file=sys.stderr,
              flush=True)

    # torch.compile'd helpers (Megatron's fused bias-GeLU warm-up, ...) would target CUDA: run them eagerly.
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

    import torch
    from torch.overrides import TorchFunctionMode

    _CPU = torch.device("cpu")

    def _is_cuda(device) -> bool:
        if device is None or isinstance(device, bool):
            return False
        if isinstance(device, int):  # a bare ordinal means a CUDA device to torch
            return True
        if isinstance(device, str):
            return device.startswith("cuda")
        return isinstance(device, torch.device) and device.type == "cuda"

    _TENSOR_CUDA = torch.Tensor.cuda
    _TENSOR_TO = torch.Tensor.to
    _TENSOR_TYPE = torch.Tensor.type
    _TENSOR_NUMPY = torch.Tensor.numpy

    class _CudaOnCPU(TorchFunctionMode):
        """device="cuda" / .cuda() / .to("cuda") allocate on the CPU; float tensors report CUDA type names."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is _TENSOR_CUDA:
                return args[0]
            if "device" in kwargs and _is_cuda(kwargs["device"]):
                kwargs = dict(kwargs, device=_CPU)
            if func is _TENSOR_TO and len(args) > 1 and _is_cuda(args[1]):
                args = (args[0], _CPU, *args[2:])
            if func is _TENSOR_NUMPY:  # a CUDA tensor reaches numpy through a host copy, never its own storage
                return func(args[0].detach().clone(), *args[1:], **kwargs)
            if func is _TENSOR_TYPE and len(args) == 1 and not kwargs:
                name = func(*args)
                return name.replace("torch.", "torch.cuda.", 1) if name.startswith("torch.") else name
            return func(*args, **kwargs)

    class _Stream:
        """A CUDA stream / event stand-in: every operation completes at once."""

        def __init__(self, *args, **kwargs) -> None:
            self.device = _CPU

        def wait_stream(self, *a, **k) -> None: ...
        def wait_event(self, *a, **k) -> None: ...
        def record_event(self, *a, **k): return _Stream()
        def record(self, *a, **k) -> None: ...
        def wait(self, *a, **k) -> None: ...
        def synchronize(self) -> None: ...
        def query(self) -> bool: return True
        def elapsed_time(self, other) -> float: return 0.0
        def __enter__(self): return self
        def __exit__(self, *exc) -> None: ...

    _ARCH = int(os.environ.get("BFPP_CPU_SHIM_ARCH", "9"))

    def _properties(device=None):
        return types.SimpleNamespace(major=_ARCH, minor=0, name="cpu (BFPP_CPU_SHIM)",
                                     total_memory=64 << 30, multi_processor_count=1)

    def _get_rng_state(device="cuda"):
        return torch.get_rng_state()

    def _set_rng_state(new_state, device="cuda"):
        torch.set_rng_state(new_state)

    def _manual_seed(seed):
        torch.default_generator.manual_seed(int(seed))

    _answers = {
        "is_available": lambda: True,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "set_device": lambda device: None,
        "synchronize": lambda device=None: None,
        "get_device_properties": _properties,
        "get_device_capability": lambda device=None: (_ARCH, 0),
        "get_device_name": lambda device=None: "cpu (BFPP_CPU_SHIM)",
        "get_rng_state": _get_rng_state,
        "set_rng_state": _set_rng_state,
        "manual_seed": _manual_seed,
        "manual_seed_all": _manual_seed,
        "default_generators": (torch.default_generator,),
        "_lazy_call": lambda callable, **kwargs: callable(),
        "_lazy_init": lambda: None,
        "Stream": _Stream,
        "Event": _Stream,
        "current_stream": lambda device=None: _Stream(),
        "default_stream": lambda device=None: _Stream(),
        "set_stream": lambda stream: None,
        "stream": lambda stream=None: contextlib.nullcontext(stream),
        # Older torch's optimizers (the 2.10 floor's too) ask it every step (Optimizer._cuda_graph_capture_health_check, when
        # torch.cuda.is_available(); newer torch asks torch.accelerator): no graph is ever captured here.
        "is_current_stream_capturing": lambda: False,
    }
    for _name, _value in _answers.items():
        setattr(torch.cuda, _name, _value)
    torch.cuda.graphs.is_current_stream_capturing = _answers["is_current_stream_capturing"]
    for _name in ("get_rng_state", "set_rng_state", "manual_seed", "manual_seed_all"):
        setattr(torch.cuda.random, _name, _answers[_name])
    torch.accelerator.is_available = lambda: False

    _CudaOnCPU().__enter__()  # for the whole process (torch function modes are per thread: the main one)

    # Megatron's dataset helpers: a source checkout builds them with `make` on first use; the installed
    # megatron-core wheel ships the same extension already built.
    class _DatasetHelpers(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        UTILS = "megatron.core.datasets.utils"
        HELPERS = "megatron.core.datasets.helpers_cpp"

        def find_spec(self, fullname, path, target=None):
            if fullname not in (self.UTILS, self.HELPERS):
                return None
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if fullname == self.HELPERS:
                if spec is None:
                    spec = self._wheel_helpers()
                return spec
            if spec is not None:
                self._original = spec.loader
                spec.loader = self
            return spec

        @staticmethod
        def _wheel_helpers():
            import site

            for root in site.getsitepackages() + [site.getusersitepackages()]:
                folder = os.path.join(root, "megatron", "core", "datasets")
                if os.path.isdir(folder):
                    spec = importlib.machinery.PathFinder.find_spec("helpers_cpp", [folder])
                    if spec is not None:
                        return importlib.util.spec_from_file_location(_DatasetHelpers.HELPERS, spec.origin)
            return None

        def create_module(self, spec):
            return self._original.create_module(spec)

        def exec_module(self, module):
            self._original.exec_module(module)
            module.compile_helpers = lambda: None

    sys.meta_path.insert(0, _DatasetHelpers())
