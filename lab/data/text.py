"""Token windows cut from the corpus: drafter training sequences and held-out sequences."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from lab.target import corpus
from lab.target.build import encode_stream

WINDOW_SEED = 1234  # fixed: every run and seed trains on the same sequences, so caches are shared


@dataclass
class Streams:
    train: torch.Tensor  # 1-D token stream of the training split
    heldout: torch.Tensor  # 1-D token stream of the held-out split


def streams(tokenizer, corpus_bytes: int) -> Streams:
    files = corpus.select(corpus_bytes)
    return Streams(
        train=encode_stream(tokenizer, [f.read() for f in files if not f.heldout]),
        heldout=encode_stream(tokenizer, [f.read() for f in files if f.heldout]),
    )


def windows(stream: torch.Tensor, seq_len: int, count: int, key: str, seed: int = WINDOW_SEED) -> torch.Tensor:
    """`count` distinct non-overlapping windows [count, seq_len], chosen by a seeded permutation."""
    available = len(stream) // seq_len
    if count > available:
        raise ValueError(
            f"{key}: asks for {count} windows of {seq_len} tokens but the corpus holds {available}; "
            f"lower it or raise data.corpus_bytes"
        )
    order = torch.randperm(available, generator=torch.Generator().manual_seed(seed))[:count].sort().values
    return stream[: available * seq_len].view(available, seq_len)[order]


def training_sequences(tokenizer, dcfg: DictConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(train [N, T], heldout [M, T]) token windows for the drafter."""
    s = streams(tokenizer, dcfg.corpus_bytes)
    return (
        windows(s.train, dcfg.seq_len, dcfg.num_sequences, "data.num_sequences"),
        windows(s.heldout, dcfg.seq_len, dcfg.heldout_sequences, "data.heldout_sequences"),
    )
