"""Megatron-LM integration: `--pipeline-schedule breadth-first` and schedule-placed ZeRO in `pretrain_gpt.py`.

Three ways in (see docs/megatron.md):
- patched script: `scripts/apply_megatron_patches.sh MEGATRON_LM_DIR` adds the flags and `install_or_exit(args)`;
- script runner: `python -m megatron_bfpp.run_megatron_script MEGATRON_LM_DIR/pretrain_gpt.py [flags]`
  (unmodified checkout);
- Python API: `args = parse_and_validate_args(extra_args_provider=add_arguments); install(args); pretrain(...)`.

Importing this package does not import Megatron; `install` does.
"""

from .arg_hooks import hook_argument_parsing, install_after_validation, unhook_argument_parsing
from .compat import SUPPORTED_VERSIONS, UnsupportedMegatronError, megatron_core_version
from .flags import PIPELINE_SCHEDULES, add_arguments, chain_args_providers, extra_args_provider
from .install import install, install_or_exit, installed_config, is_installed, uninstall
from .validation import ConfigError, PluginConfig, megatron_flag_text, validate_args

__all__ = [
    "add_arguments", "extra_args_provider", "chain_args_providers", "PIPELINE_SCHEDULES",
    "validate_args", "ConfigError", "PluginConfig", "megatron_flag_text",
    "install", "install_or_exit", "uninstall", "installed_config", "is_installed",
    "hook_argument_parsing", "install_after_validation", "unhook_argument_parsing",
    "SUPPORTED_VERSIONS", "UnsupportedMegatronError", "megatron_core_version",
]
