"""Megatron-LM's argument parser, for the unit tests that read `pretrain_gpt.py` flags (`import
tests.support.megatron_parser`): imported at collection, so that no test's CPU budget pays the seconds of importing
torch and Megatron, and what that import created moved out of the cyclic garbage collector's reach (`gc.freeze`),
which would otherwise walk those millions of long-lived objects again in every later test."""

import gc

import megatron.training.arguments  # noqa: F401

gc.freeze()
