"""The single-process reference that pipeline runs are checked against.

The whole model as ONE chunk (P = V = 1), the same keyed init as every layout (megatron_bfpp.train.model), the same
forward step and loss (megatron_bfpp.train.data), and Megatron's schedule normalisation: each micro-batch's
backward runs on loss_sum / num_tokens / N, N = number of micro-batches of the iteration. Passing the whole
global batch (all D*M micro-batches) therefore gives the gradient that data parallelism averages to.

Runs in a process without torch.distributed (it then creates a one-process gloo world, which Megatron's
layers need) or inside an existing world (its chunk is then built as a one-stage pipeline, communicating
with nobody).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.transformer import TransformerConfig

from megatron_bfpp.train.data import gpt_forward_step
from megatron_bfpp.train.model import build_model_chunks, global_named_parameters


@dataclass
class ReferenceStep:
    """One iteration: per-micro-batch masked loss sums and token counts, the loss Megatron-LM logs, and every
    gradient by global name (taken before the optimizer step)."""

    loss_sums: list[float]
    num_tokens: list[int]
    grads: dict[str, torch.Tensor]

    @property
    def microbatch_losses(self) -> list[float]:
        return [s / max(n, 1) for s, n in zip(self.loss_sums, self.num_tokens)]

    @property
    def lm_loss(self) -> float:
        """Megatron-LM's logged "lm loss": total loss sum over total tokens of the global batch."""
        return sum(self.loss_sums) / max(sum(self.num_tokens), 1)


@dataclass
class ReferenceRun:
    steps: list[ReferenceStep] = field(default_factory=list)
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # after the last optimizer step

    @property
    def losses(self) -> list[float]:
        return [s.lm_loss for s in self.steps]


def _ensure_groups() -> None:
    if not dist.is_initialized() or not ps.model_parallel_is_initialized():
        if dist.is_initialized() and dist.get_world_size() > 1:
            raise RuntimeError("torch.distributed is initialised without Megatron's groups: call "
                               "megatron_bfpp.train.parallel.init_parallel() first")
        from megatron_bfpp.train.parallel import init_single_process

        init_single_process()


class ReferenceModel:
    """The whole GPT as one chunk, with forward/backward over a list of micro-batches and optional Adam steps."""

    def __init__(self, config: TransformerConfig, *, vocab_size: int, max_sequence_length: int, seed: int,
                 share_embeddings_and_output_weights: bool = True, device: torch.device | str = "cpu",
                 position_embedding_type: str = "learned_absolute") -> None:
        _ensure_groups()
        (self.model,) = build_model_chunks(
            config, vocab_size=vocab_size, max_sequence_length=max_sequence_length, pp_rank=0, pp_size=1,
            vp_size=1, share_embeddings_and_output_weights=share_embeddings_and_output_weights, seed=seed,
            device=device, position_embedding_type=position_embedding_type)
        self.model.train()
        self.named = global_named_parameters([self.model], 0, 1)

    def forward_backward(self, microbatches: Sequence[dict[str, torch.Tensor]], forward_only: bool = False,
                         ) -> ReferenceStep:
        """Accumulate gradients over the micro-batches (Megatron's loss_sum / num_tokens / N per micro-batch)."""
        if not microbatches:
            raise ValueError("no micro-batches given")
        n = len(microbatches)
        sums, counts = [], []
        for mb in microbatches:
            with torch.set_grad_enabled(not forward_only):
                output, loss_fn = gpt_forward_step(iter([mb]), self.model)
                loss_sum, num_tokens, _report = loss_fn(output)
            sums.append(float(loss_sum.detach()))
            counts.append(int(num_tokens))
            if not forward_only:
                # Megatron's schedules: output_tensor /= num_tokens; output_tensor /= num_microbatches.
                (loss_sum / num_tokens / n).backward()
        grads = {} if forward_only else {
            name: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
            for name, p in self.named.items()}
        return ReferenceStep(sums, counts, grads)

    def zero_grad(self) -> None:
        for p in self.model.parameters():
            p.grad = None

    def parameters_by_name(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in self.named.items()}


def make_optimizer(named_params: dict[str, torch.nn.Parameter], name: str = "adam", lr: float = 1e-3,
                   weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                   ) -> torch.optim.Optimizer:
    """torch.optim.Adam ("adam", L2 weight decay) or AdamW ("adamw", decoupled decay as Megatron's Adam).

    Like Megatron's default parameter groups, biases and 1-D parameters (norm scales) get no weight decay.
    """
    cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}.get(name)
    if cls is None:
        raise ValueError(f"--optimizer {name!r} not supported by the reference: use adam or adamw")
    no_wd = lambda n, p: p.dim() == 1 or n.endswith(".bias")  # noqa: E731
    groups = [{"params": [p for n, p in named_params.items() if not no_wd(n, p)], "weight_decay": weight_decay},
              {"params": [p for n, p in named_params.items() if no_wd(n, p)], "weight_decay": 0.0}]
    return cls([g for g in groups if g["params"]], lr=lr, betas=betas, eps=eps)


def run_reference(
    config: TransformerConfig,
    iterations: Sequence[Sequence[dict[str, torch.Tensor]]],
    *,
    vocab_size: int,
    max_sequence_length: int,
    seed: int,
    share_embeddings_and_output_weights: bool = True,
    optimizer: str = "adam",
    lr: float = 1e-3,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    clip_grad: float | None = None,
    keep_grads: bool = True,
    device: torch.device | str = "cpu",
) -> ReferenceRun:
    """len(iterations) training steps, each over its list of micro-batches (the whole global batch):
    forward/backward, optional global-norm clipping, optimizer step. Returns each step's losses and (if
    keep_grads) gradients, and the final parameters, all by global name."""
    ref = ReferenceModel(config, vocab_size=vocab_size, max_sequence_length=max_sequence_length, seed=seed,
                         share_embeddings_and_output_weights=share_embeddings_and_output_weights, device=device)
    opt = make_optimizer(ref.named, optimizer, lr, weight_decay, betas, eps)
    run = ReferenceRun()
    for microbatches in iterations:
        ref.zero_grad()
        step = ref.forward_backward(microbatches)
        if not keep_grads:
            step.grads = {}
        if clip_grad is not None and clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(list(ref.named.values()), clip_grad)
        opt.step()
        run.steps.append(step)
    run.params = ref.parameters_by_name()
    return run
