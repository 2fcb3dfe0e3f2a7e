"""Small hand-built drafters for unit tests (no target needed)."""

from __future__ import annotations

import torch

from lab.drafter import DrafterSpec, Eagle3Drafter


def small_drafter(seed: int = 0, **spec) -> Eagle3Drafter:
    """A 64-wide drafter over a 100-token vocabulary and three 64-wide captured layers."""
    torch.manual_seed(seed)
    base = dict(
        hidden_size=64,
        target_hidden_size=64,
        aux_layer_ids=[1, 2, 3],
        vocab_size=100,
        num_heads=2,
        head_dim=32,
        intermediate_size=96,
    )
    return Eagle3Drafter(DrafterSpec(**{**base, **spec})).eval()
