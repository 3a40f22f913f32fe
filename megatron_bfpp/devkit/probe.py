"""What this Python environment has, as one JSON object on stdout (run by path: stdlib only, imports nothing of
the project, so it reports the environment as it is before and after the kit's install).

    python megatron_bfpp/devkit/probe.py [--device cuda|cpu]

Keys: python, torch, cuda (torch's CUDA build), nccl, gpus (device names; empty without CUDA), modules ({name:
version or null when it does not import}) for numpy, packaging, megatron.core, megatron_bfpp, with errors
({name: the import error}), transformer_engine ({"version"} or {"error"}); with --device cuda also compute_mode
(the GPU's, from the driver, asked before torch opens a context) and cuda_check (whether torch can use CUDA and
NCCL here: is_available, device count, CUDA_VISIBLE_DEVICES, the driver, a context opened, NCCL built in). The GPU
check (scripts/gpu_check.sh) imports its TransformerEngine and apex checks.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import subprocess
import sys

# Run by path, this file's folder leads sys.path: drop it, so its sibling modules shadow nothing.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

MODULES = ("numpy", "packaging", "megatron.core", "megatron_bfpp")
# CUdevice_attribute CU_DEVICE_ATTRIBUTE_COMPUTE_MODE and its values (cuda.h).
_CU_COMPUTE_MODE = 20
COMPUTE_MODES = {0: "DEFAULT", 1: "EXCLUSIVE_THREAD", 2: "PROHIBITED", 3: "EXCLUSIVE_PROCESS"}


def _version(name: str) -> str:
    mod = importlib.import_module(name)
    if name == "megatron.core":
        from megatron.core import package_info  # type: ignore[import-not-found]

        return str(package_info.__version__)
    return str(getattr(mod, "__version__", "unknown"))


def probe(device: str) -> dict:
    facts: dict = {"python": ".".join(map(str, sys.version_info[:3])), "torch": None, "cuda": None, "nccl": None,
                   "gpus": [], "modules": {}, "errors": {}, "paths": {}}
    if device == "cuda":  # first: EXCLUSIVE_PROCESS would make torch's own context below the only one
        facts["compute_mode"] = compute_mode()
    try:
        import torch

        facts["torch"] = torch.__version__
        facts["cuda"] = torch.version.cuda
        if device == "cuda" and torch.cuda.is_available():
            facts["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            try:
                v = torch.cuda.nccl.version()
                facts["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
            except Exception as e:  # torch built without NCCL
                facts["errors"]["nccl"] = f"{type(e).__name__}: {e}"
        if device == "cuda":
            facts["cuda_check"] = cuda_check(torch)
    except Exception as e:
        facts["errors"]["torch"] = f"{type(e).__name__}: {e}"
    for name in MODULES:
        try:
            facts["modules"][name] = _version(name)
            facts["paths"][name] = getattr(sys.modules[name], "__file__", None)
        except Exception as e:
            facts["modules"][name] = None
            facts["errors"][name] = f"{type(e).__name__}: {e}"
    facts["transformer_engine"] = transformer_engine_facts()
    return facts


def compute_mode() -> dict:
    """{"mode": DEFAULT | EXCLUSIVE_PROCESS | PROHIBITED | ..., "source"} of the first visible GPU, read from the
    driver (libcuda, no context made), else from nvidia-smi; {"error"} when neither answers."""
    errors = []
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        dev, mode = ctypes.c_int(), ctypes.c_int()
        for call, args in (("cuInit", (0,)), ("cuDeviceGet", (ctypes.byref(dev), 0)),
                           ("cuDeviceGetAttribute", (ctypes.byref(mode), _CU_COMPUTE_MODE, dev))):
            rc = getattr(cuda, call)(*args)
            if rc != 0:
                raise OSError(f"{call} returned CUresult {rc}")
        return {"mode": COMPUTE_MODES.get(mode.value, str(mode.value)), "source": "libcuda"}
    except (OSError, AttributeError) as e:
        errors.append(f"libcuda: {e}")
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=compute_mode", "--format=csv,noheader", "-i", "0"],
                           capture_output=True, text=True, timeout=30)
        if r.returncode == 0 and r.stdout.strip():
            return {"mode": r.stdout.strip().upper(), "source": "nvidia-smi"}
        errors.append(f"nvidia-smi: exit {r.returncode} {r.stderr.strip()[:200]}")
    except (OSError, subprocess.TimeoutExpired) as e:
        errors.append(f"nvidia-smi: {e}")
    return {"error": "; ".join(errors)}


def cuda_check(torch) -> dict:
    """Whether torch can use CUDA and NCCL here, with what tells why not."""
    check: dict = {"available": False, "device_count": 0, "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                   "driver": None, "context": None, "nccl_available": None}
    try:
        with open("/proc/driver/nvidia/version") as f:
            check["driver"] = f.readline().strip()[:200]
    except OSError:
        pass
    try:
        import torch.distributed as dist

        check["nccl_available"] = bool(dist.is_available() and dist.is_nccl_available())
    except Exception as e:
        check["nccl_error"] = f"{type(e).__name__}: {e}"[:300]
    try:
        check["available"] = bool(torch.cuda.is_available())
        check["device_count"] = int(torch.cuda.device_count())
        if check["available"]:
            # cudaMemGetInfo needs the device's context: this opens it (and fails as a second context would).
            free, total = torch.cuda.mem_get_info()
            torch.cuda.synchronize()
            check["context"] = "opened"
            check["memory_free_gib"] = round(free / 2**30, 2)
            check["memory_total_gib"] = round(total / 2**30, 2)
        else:
            torch.cuda.init()  # raises with torch's reason (no CUDA build, no driver, no device)
    except Exception as e:
        check["error"] = f"{type(e).__name__}: {e}"[:400]
    return check


def cuda_problem(facts: dict) -> str | None:
    """Why the legs cannot run on CUDA with NCCL here (facts of `probe("cuda")`), or None when they can."""
    check = facts.get("cuda_check") or {}
    mode = (facts.get("compute_mode") or {}).get("mode")
    where = (f"torch {facts.get('torch')} (built for CUDA {facts.get('cuda') or 'none: a CPU build'}), "
             f"{check.get('device_count', 0)} device(s), CUDA_VISIBLE_DEVICES={check.get('visible')!r}, driver: "
             f"{check.get('driver') or 'no /proc/driver/nvidia/version'}")
    if not check.get("available"):
        why = f"torch.cuda.is_available() is False ({where}{'; ' + check['error'] if check.get('error') else ''})"
    elif check.get("context") != "opened":
        why = f"a CUDA context does not open ({check.get('error')}; {where}; compute mode {mode})"
    elif mode == "PROHIBITED":
        why = f"the GPU's compute mode is PROHIBITED ({where})"
    elif not check.get("nccl_available"):
        why = (f"torch has no NCCL (torch.distributed.is_nccl_available() is False"
               f"{'; ' + check['nccl_error'] if check.get('nccl_error') else ''}; {where})")
    else:
        return None
    return (f"CUDA is not usable: {why}. The legs need CUDA and NCCL: run on the GPU machine's python with a CUDA "
            f"build of torch (PYTHON=...), or rehearse everything but the GPU with --device cpu")


def shared_gpu_problem(facts: dict) -> str | None:
    """Why several ranks cannot share the GPU (its compute mode), or None."""
    mode = (facts.get("compute_mode") or {}).get("mode")
    if mode in ("EXCLUSIVE_PROCESS", "EXCLUSIVE_THREAD"):
        return (f"the GPU's compute mode is {mode}: one process at a time, so several ranks cannot share it "
                f"(nvidia-smi -c DEFAULT, as root, allows it)")
    return None


def transformer_engine_facts() -> dict:
    """{"version"} when TransformerEngine's PyTorch layers import (those Megatron-LM builds), else {"error"}."""
    try:
        import transformer_engine
        import transformer_engine.pytorch  # noqa: F401  (the layers Megatron-LM builds)

        return {"version": str(getattr(transformer_engine, "__version__", "unknown"))}
    except Exception as e:  # not installed, or built against another torch
        return {"error": f"{type(e).__name__}: {e}"[:300]}


def apex_fused_wgrad() -> bool:
    """Whether apex's fused_weight_gradient_mlp_cuda imports after torch, as Megatron-Core's tensor_parallel/layers.py
    imports it (without it Megatron-LM's default gradient-accumulation fusion fails in ColumnParallelLinear)."""
    try:
        import torch  # noqa: F401  (the extension links against torch's libraries)
        import fused_weight_gradient_mlp_cuda  # noqa: F401

        return True
    except Exception:
        return False


def main(argv: list[str]) -> int:
    device = argv[argv.index("--device") + 1] if "--device" in argv else "cpu"
    print(json.dumps(probe(device)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
