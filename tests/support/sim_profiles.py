"""What the tests check the simulator's model profiles against."""

from __future__ import annotations

from megatron_bfpp.sim.model import ModelProfile


def num_params(model: ModelProfile) -> int:
    """All parameters of the model: its layers, the embeddings and the output head."""
    return model.num_layers * model.layer_params() + model.embedding_params() + model.head_params()
