"""Errors that several layers of the package raise or classify, defined below all of them (the trainer's
configuration raises `TrainerConfigError`; `faults` classifies it, and `train_config` uses `faults`)."""

from __future__ import annotations


class TrainerConfigError(ValueError):
    """A bad trainer configuration; the message names the flags and the fix."""
