"""GPT data: Megatron's datasets behind per-chunk micro-batch iterators, and the pretrain_gpt forward step.

Datasets: `--mock-data` is Megatron's `MockGPTDataset`, `--data-path` Megatron's `GPTDataset` over indexed
(.bin/.idx) files, both built by `BlendedMegatronDatasetBuilder` on CPU, with Megatron's `NullTokenizer`
(token ids as they are, end-of-document = vocab_size - 1; see scripts/text_to_megatron.py).

Order: Megatron-LM's own `MegatronPretrainingSampler`. Global batch i is samples [i*G, (i+1)*G) of the
dataset (G = --global-batch-size), whatever P, V and D; within it, micro-batch j of DP rank d is samples
[(j*D + d)*b, (j*D + d + 1)*b) (b = --micro-batch-size). A one-rank run (D = 1) therefore sees the same
micro-batches, its micro-batch j*D + d being DP rank d's micro-batch j.

Micro-batches are dicts {tokens [b, s] int64, labels [b, s] int64, loss_mask [b, s] float32,
attention_mask [1, 1, s, s] bool (True = masked, Megatron's convention; explicit because Megatron's
get_default_causal_mask is CUDA-bound), position_ids [b, s] int64}.
"""

from __future__ import annotations

import os
from functools import partial
from typing import Any, Iterator, Sequence

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.utils import get_blend_from_list
from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer
from megatron.core.utils import get_attr_wrapped_model

BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def causal_mask(seq_length: int, device: torch.device | str | None = None) -> torch.Tensor:
    """[1, 1, s, s] bool, True above the diagonal (future positions masked out), as Megatron's masks."""
    return torch.triu(torch.ones(seq_length, seq_length, dtype=torch.bool, device=device), diagonal=1)[None, None]


# ------------------------------------------------------------------------------------------------ datasets
def _blend(data_path: str | Sequence[str]) -> tuple[list[str], list[float] | None]:
    items = data_path.split() if isinstance(data_path, str) else list(data_path)
    blend = get_blend_from_list(items)
    if not blend or not blend[0]:
        raise ValueError("--data-path is empty: give a dataset prefix (PREFIX.bin / PREFIX.idx) or use --mock-data")
    for prefix in blend[0]:
        missing = [prefix + ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
        if missing:
            raise FileNotFoundError(
                f"--data-path {prefix}: missing {', '.join(missing)}. Pass the prefix of Megatron indexed files "
                "(build them with scripts/text_to_megatron.py INPUT.txt PREFIX), or use --mock-data")
    return blend


def build_train_dataset(
    *, seq_length: int, vocab_size: int, num_samples: int, seed: int, data_path: str | Sequence[str] | None = None,
    data_cache_path: str | None = None, split: str = "100,0,0",
) -> GPTDataset:
    """Megatron's train split: MockGPTDataset when data_path is None, else GPTDataset over the blend.

    Collective when torch.distributed is initialised (Megatron's builder builds on rank 0 first, then
    barriers): call it on every rank.
    """
    if seq_length < 1 or vocab_size < 2 or num_samples < 1:
        raise ValueError(f"need --seq-length >= 1, --vocab-size >= 2 and at least one sample "
                         f"(got {seq_length}, {vocab_size}, {num_samples} samples: check --train-iters)")
    blend = None if data_path is None else _blend(data_path)
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        split=split,
        path_to_cache=data_cache_path,
        tokenizer=NullTokenizer(vocab_size),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,  # one shared explicit causal mask is attached per micro-batch instead
    )
    cls = MockGPTDataset if blend is None else GPTDataset
    train, _, _ = BlendedMegatronDatasetBuilder(cls, [num_samples, 0, 0], lambda: True, config).build()
    if train is None:
        raise RuntimeError(f"Megatron built no training split from --data-path {data_path} with split {split!r}")
    return train


def _sampler(total: int, micro_batch_size: int, dp_rank: int, dp_size: int, consumed: int):
    # Megatron-LM's own sampler, so the sample order matches a stock Megatron-LM run on the same data.
    from megatron.training.datasets.data_samplers import MegatronPretrainingSampler

    return MegatronPretrainingSampler(total_samples=total, consumed_samples=consumed, micro_batch_size=micro_batch_size,
                                      data_parallel_rank=dp_rank, data_parallel_size=dp_size, drop_last=True)


def _microbatches(dataset: GPTDataset, sampler, vocab_size: int, data_path: Any) -> Iterator[dict[str, torch.Tensor]]:
    mask = None
    for indices in sampler:
        samples = [dataset[i] for i in indices]
        batch = {k: torch.stack([s[k] for s in samples]) for k in ("tokens", "labels", "loss_mask", "position_ids")}
        if mask is None:
            mask = causal_mask(batch["tokens"].shape[1])
        top = int(torch.maximum(batch["tokens"].max(), batch["labels"].max()))
        if top >= vocab_size:
            shown = " ".join(map(str, data_path)) if isinstance(data_path, (list, tuple)) else data_path
            raise ValueError(f"--data-path {shown}: token id {top} >= --vocab-size {vocab_size}; raise "
                             "--vocab-size or rebuild the data with scripts/text_to_megatron.py --vocab-size")
        yield {"tokens": batch["tokens"], "labels": batch["labels"], "loss_mask": batch["loss_mask"],
               "attention_mask": mask, "position_ids": batch["position_ids"]}


def check_batch_sizes(global_batch_size: int, micro_batch_size: int, dp_size: int) -> int:
    """Micro-batches per DP rank per iteration (M = G / (b * D)), with one clear error when it does not divide."""
    if micro_batch_size < 1 or dp_size < 1 or global_batch_size < 1 or global_batch_size % (micro_batch_size * dp_size):
        raise ValueError(
            f"--global-batch-size {global_batch_size} must be a positive multiple of --micro-batch-size "
            f"{micro_batch_size} x data-parallel size {dp_size}; change one of them")
    return global_batch_size // (micro_batch_size * dp_size)


def make_microbatch_iterators(
    *,
    seq_length: int,
    vocab_size: int,
    global_batch_size: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    seed: int,
    train_iters: int,
    data_path: str | Sequence[str] | None = None,
    num_chunks: int = 1,
    data_cache_path: str | None = None,
    consumed_samples: int = 0,
) -> list[Iterator[dict[str, torch.Tensor]]]:
    """One iterator per model chunk, each yielding this DP rank's micro-batches in Megatron-LM's order
    (M per iteration; see the module docstring). data_path None -> mock data.

    Each chunk gets its own iterator over the same stream, as Megatron-LM gives interleaved chunks (only the
    first and last stage read them). Collective when torch.distributed is initialised: call on every rank.
    """
    check_batch_sizes(global_batch_size, micro_batch_size, dp_size)
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} outside [0, {dp_size})")
    if train_iters < 1:
        raise ValueError(f"--train-iters must be >= 1, got {train_iters}")
    dataset = build_train_dataset(seq_length=seq_length, vocab_size=vocab_size, seed=seed, data_path=data_path,
                                  num_samples=train_iters * global_batch_size, data_cache_path=data_cache_path)
    return [_microbatches(dataset, _sampler(len(dataset), micro_batch_size, dp_rank, dp_size, consumed_samples),
                          vocab_size, data_path) for _ in range(num_chunks)]


def global_batch_microbatches(iterator: Iterator[dict[str, torch.Tensor]], count: int) -> list[dict[str, torch.Tensor]]:
    """The next `count` micro-batches of an iterator (e.g. one iteration's M, or a D = 1 run's D*M)."""
    out = []
    for _ in range(count):
        try:
            out.append(next(iterator))
        except StopIteration:
            raise RuntimeError(f"data ran out after {len(out)} of {count} micro-batches: raise --train-iters") from None
    return out


# -------------------------------------------------------------------------------------------- forward step
def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """pretrain_gpt's loss: (masked loss sum, token count, {"lm loss": [sum, count]}) — Megatron 0.19's
    3-tuple, which its schedules divide by the token count and the number of micro-batches."""
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    return loss, num_tokens, report


def _device_of(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def gpt_forward_step(data_iterator: Iterator[dict[str, torch.Tensor]] | None, model: torch.nn.Module):
    """pretrain_gpt's forward_step: the first and last stage draw a micro-batch (moved to the model's
    device), the others pass None (their input comes through set_input_tensor); returns
    (output_tensor, partial(loss_func, loss_mask))."""
    pre = get_attr_wrapped_model(model, "pre_process")
    post = get_attr_wrapped_model(model, "post_process")
    tokens = labels = loss_mask = attention_mask = position_ids = None
    if pre or post:
        if data_iterator is None:
            raise ValueError("the first and last pipeline stages need a data iterator, got None")
        batch = next(data_iterator)
        device = _device_of(model)
        tokens, labels, loss_mask, attention_mask, position_ids = (
            batch[k].to(device, non_blocking=True) if batch.get(k) is not None else None for k in BATCH_KEYS)
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output_tensor, partial(loss_func, loss_mask)
