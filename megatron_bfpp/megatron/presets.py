"""Named flag sets: published models as Megatron-LM's `pretrain_gpt.py` flags (`megatron_bfpp/presets/<name>.args`).

A preset holds a model's flags only (its shape, vocabulary, sequence length, precision), never parallel sizes or
batch: `bfpp simulate --model NAME -- <flags>` puts the preset's flags first and the user's after them, so the
user's win (argparse keeps the last value). A file is flags separated by white space, shell-quoted where needed,
with `#` comments (each file cites where its numbers come from).
"""

from __future__ import annotations

import shlex
from importlib import resources

SUFFIX = ".args"


def _folder():
    return resources.files("megatron_bfpp").joinpath("presets")


def preset_names() -> list[str]:
    """Every shipped preset, sorted."""
    return sorted(p.name[: -len(SUFFIX)] for p in _folder().iterdir() if p.name.endswith(SUFFIX))


def preset_flags(name: str) -> list[str]:
    """The flags of preset `name`; ValueError naming the choices for an unknown one."""
    path = _folder().joinpath(name + SUFFIX)
    if "/" in name or not path.is_file():
        raise ValueError(f"unknown --model {name!r}: choose one of {', '.join(preset_names())}, or describe the model "
                         "with pretrain_gpt.py flags after --")
    return shlex.split(path.read_text(), comments=True)
