"""Let an unmodified Megatron-LM script accept the plugin's flags and install the plugin.

`hook_argument_parsing()` rebinds, in the Megatron modules that call them:
- `parse_args` so the script's own `extra_args_provider` (or None) is chained with `add_arguments`, and the
  plugin's flags are checked against those whose own Megatron check would fire first (`check_before_megatron`);
- `validate_args` / `validate_yaml` so that `install_or_exit(args)` runs right after Megatron validated the
  arguments: before `initialize_megatron` creates any process group and before the model is built.

Megatron-LM 0.19 calls them from `megatron.training.arguments.parse_and_validate_args` (module globals there);
0.16 from `megatron.training.initialize.initialize_megatron` (names imported into that module).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

from .flags import chain_args_providers
from .install import check_before_megatron_or_exit, install_or_exit

_MODULES = ("megatron.training.arguments", "megatron.training.initialize", "megatron.training.yaml_arguments")
_hooked: list[tuple[Any, str, Any]] = []


def _wrap_parse_args(original: Callable) -> Callable:
    def parse_args(extra_args_provider=None, ignore_unknown_args=False, *args, **kwargs):
        parsed = original(chain_args_providers(extra_args_provider), ignore_unknown_args, *args, **kwargs)
        check_before_megatron_or_exit(parsed)  # conflicts Megatron's validate_args would misreport
        return parsed

    parse_args.__wrapped__ = original  # type: ignore[attr-defined]
    return parse_args


def _wrap_validate(original: Callable) -> Callable:
    def validate(args, *rest, **kwargs):
        out = original(args, *rest, **kwargs)
        install_or_exit(out if out is not None else args)  # validate_yaml returns the args; validate_args None
        return out

    validate.__wrapped__ = original  # type: ignore[attr-defined]
    return validate


_WRAPPERS = {"parse_args": _wrap_parse_args, "validate_args": _wrap_validate, "validate_yaml": _wrap_validate}


def hook_argument_parsing(parse: bool = True) -> list[str]:
    """Install the hooks (idempotent); returns the rebound names. `parse=False` hooks validation only, for
    scripts that pass `extra_args_provider(...)` themselves. Import Megatron from the right place first (the
    script runner puts the Megatron-LM checkout on sys.path before calling this)."""
    if _hooked:
        return [f"{m.__name__}.{a}" for m, a, _ in _hooked]
    for name in _MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:  # the module exists but a dependency of it is missing: say so
                raise
            continue
        for attr, wrap in _WRAPPERS.items():
            if attr == "parse_args" and not parse:
                continue
            if callable(getattr(mod, attr, None)):
                original = getattr(mod, attr)
                _hooked.append((mod, attr, original))
                setattr(mod, attr, wrap(original))
    names = [f"{m.__name__}.{a}" for m, a, _ in _hooked]
    if not any(n.endswith(".validate_args") for n in names):
        unhook_argument_parsing()
        from .compat import UnsupportedMegatronError, megatron_core_version

        raise UnsupportedMegatronError(
            f"megatron-core {megatron_core_version()}: no megatron.training.arguments.validate_args to hook; call "
            "megatron_bfpp.megatron.install(args) yourself after parsing the arguments"
        )
    return names


def install_after_validation() -> list[str]:
    """For scripts that parse inside `pretrain()` (Megatron-LM 0.16): run `install_or_exit(args)` right after
    Megatron validated the arguments, before `initialize_megatron` creates the process groups."""
    return hook_argument_parsing(parse=False)


def unhook_argument_parsing() -> None:
    while _hooked:
        mod, attr, original = _hooked.pop()
        setattr(mod, attr, original)
