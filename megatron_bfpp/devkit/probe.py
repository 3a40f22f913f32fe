"""What this Python environment has, as one JSON object on stdout (run by path: stdlib only, imports nothing of
the project, so it reports the environment as it is before and after the kit's install).

    python megatron_bfpp/devkit/probe.py [--device cuda|cpu]

Keys: python, torch, cuda (torch's CUDA build), nccl, gpus (device names; empty without CUDA), modules ({name:
version or null when it does not import}) for numpy, packaging, megatron.core, megatron_bfpp, with errors
({name: the import error}), transformer_engine ({"version"} or {"error"}). The GPU check (scripts/gpu_check.sh)
imports its TransformerEngine and apex checks.
"""

from __future__ import annotations

import importlib
import json
import os
import sys

# Run by path, this file's folder leads sys.path: drop it, so its sibling modules shadow nothing.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

MODULES = ("numpy", "packaging", "megatron.core", "megatron_bfpp")


def _version(name: str) -> str:
    mod = importlib.import_module(name)
    if name == "megatron.core":
        from megatron.core import package_info  # type: ignore[import-not-found]

        return str(package_info.__version__)
    return str(getattr(mod, "__version__", "unknown"))


def probe(device: str) -> dict:
    facts: dict = {"python": ".".join(map(str, sys.version_info[:3])), "torch": None, "cuda": None, "nccl": None,
                   "gpus": [], "modules": {}, "errors": {}, "paths": {}}
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
