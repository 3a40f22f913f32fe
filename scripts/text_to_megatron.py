#!/usr/bin/env python3
"""Turn a plain-text file into Megatron's indexed dataset (OUTPUT_PREFIX.bin / OUTPUT_PREFIX.idx).

    python scripts/text_to_megatron.py INPUT.txt OUTPUT_PREFIX [--vocab-size N]

Tokenizer: byte level, shipped here (no network, no vocabulary file). Each UTF-8 byte b is token b; the
end-of-document token is N - 1, matching Megatron's NullTokenizer(N), which `--data-path` loading uses.
Documents are paragraphs (blocks separated by blank lines); each gets the end-of-document token appended,
as Megatron's preprocess_data.py --append-eod does. Written with Megatron's own IndexedDatasetBuilder.

N defaults to 257 (all 256 byte values + end-of-document). A smaller N fits text whose bytes are all below
N - 1 (ASCII text: N >= 129); the training run's --vocab-size must be at least N.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

DEFAULT_VOCAB_SIZE = 257


def documents(text: str) -> list[str]:
    """Paragraphs: blocks separated by one or more blank lines, stripped, empty ones dropped."""
    return [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]


def encode(doc: str, vocab_size: int) -> list[int]:
    """Byte ids of one document followed by the end-of-document id (vocab_size - 1)."""
    ids = list(doc.encode("utf-8"))
    if ids and max(ids) >= vocab_size - 1:
        raise ValueError(f"byte value {max(ids)} does not fit --vocab-size {vocab_size} (ids must stay below the "
                         f"end-of-document id {vocab_size - 1}): use --vocab-size {max(ids) + 2} or more")
    return ids + [vocab_size - 1]


def decode(ids: list[int], vocab_size: int) -> list[str]:
    """Inverse of encode over a stream: split at end-of-document ids, bytes back to text."""
    docs, cur = [], []
    for i in ids:
        if i == vocab_size - 1:
            docs.append(bytes(cur).decode("utf-8"))
            cur = []
        else:
            cur.append(int(i))
    if cur:
        docs.append(bytes(cur).decode("utf-8"))
    return docs


def convert(input_path: str, output_prefix: str, vocab_size: int = DEFAULT_VOCAB_SIZE) -> tuple[int, int]:
    """Write OUTPUT_PREFIX.bin/.idx; returns (documents, tokens)."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    if vocab_size < 2:
        raise ValueError(f"--vocab-size must be >= 2, got {vocab_size}")
    with open(input_path, encoding="utf-8") as f:
        docs = documents(f.read())
    if not docs:
        raise ValueError(f"{input_path}: no text found (documents are blank-line separated paragraphs)")
    top = max(max(d.encode("utf-8")) for d in docs)
    if top >= vocab_size - 1:  # checked over the whole text, so the suggested size is enough
        raise ValueError(f"byte value {top} does not fit --vocab-size {vocab_size} (ids must stay below the "
                         f"end-of-document id {vocab_size - 1}): use --vocab-size {top + 2} or more")
    encoded = [encode(d, vocab_size) for d in docs]
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    # Same dtype choice as Megatron's preprocess_data.py (uint16 below 65500 tokens).
    builder = IndexedDatasetBuilder(output_prefix + ".bin", dtype=DType.optimal_dtype(vocab_size))
    for ids in encoded:
        builder.add_document(torch.tensor(ids, dtype=torch.int64), [len(ids)])
    builder.finalize(output_prefix + ".idx")
    return len(encoded), int(np.sum([len(e) for e in encoded]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("input", help="plain-text file (UTF-8)")
    parser.add_argument("output_prefix", help="writes OUTPUT_PREFIX.bin and OUTPUT_PREFIX.idx (pass it to --data-path)")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE,
                        help=f"token ids 0..N-2 are bytes, N-1 ends a document (default {DEFAULT_VOCAB_SIZE})")
    args = parser.parse_args(argv)
    try:
        n_docs, n_tokens = convert(args.input, args.output_prefix, args.vocab_size)
    except (OSError, ValueError) as e:
        print(f"text_to_megatron: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.output_prefix}.bin/.idx: {n_docs} documents, {n_tokens} tokens, vocab size {args.vocab_size}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
