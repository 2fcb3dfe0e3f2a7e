"""Checkpoint tensors <-> the drafter's state dict: the name table and the checks behind
`Eagle3Drafter.load_weights` and `Eagle3Drafter.export_weights` (lab/drafter/model.py, the entry points).

The module's own names are vLLM's (`llama_eagle3.py`), so an export needs no renaming. On load, what other
writers save differently is absorbed here, as vLLM's `load_weights` does:
- EAGLE-3 and TorchSpec name layer 0 `midlayer.` (`module_key`);
- speculators keeps a copy of the verifier's head (`verifier_*`) and an all-zero d2t for an unpruned
  vocabulary; vLLM wants a `hidden_norm` in every layer though only layer 0's is used (`ignored`);
- t2d, the target-to-draft mask, must mark exactly the ids d2t maps to (`draft_ids`), and is then dropped:
  the module keeps d2t alone, and an export rebuilds t2d from it.

This file imports nothing of the model (the model imports it), so it speaks in sizes, not specs.
"""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import torch

# the checkpoint's two files, named in errors (lab/drafter/formats.py reads and writes them)
CONFIG = "config.json"
WEIGHTS = "model.safetensors"

V = TypeVar("V")


class CheckpointError(ValueError):
    """A drafter checkpoint that cannot be used as it is; str() is one line naming the file and what was
    expected."""


def module_key(key: str) -> str:
    """A checkpoint's weight name as the module names it: EAGLE-3 / TorchSpec call layer 0 `midlayer`."""
    return key.replace("midlayer.", "layers.0.")


def ignored(key: str, full_vocabulary: bool) -> bool:
    """Weights other writers save that the module does not use (`key` in the module's names): speculators'
    copy of the verifier's head, the target-to-draft mask (checked against d2t first), an identity d2t of an
    unpruned vocabulary, and the hidden_norm vLLM wants in every layer past the first."""
    if key.startswith("verifier_") or key == "t2d" or _unused_hidden_norm(key):
        return True
    return key == "d2t" and full_vocabulary


def _unused_hidden_norm(key: str) -> bool:
    return key.startswith("layers.") and key.endswith(".hidden_norm.weight") and not key.startswith("layers.0.")


def module_weights(named: dict[str, V], full_vocabulary: bool) -> dict[str, V]:
    """The entries of a checkpoint the module loads, under its names; the values (tensors, or the shapes of
    a safetensors header) pass through."""
    return {module_key(k): v for k, v in named.items() if not ignored(module_key(k), full_vocabulary)}


def draft_ids(
    d2t: torch.Tensor | None, t2d: torch.Tensor | None, vocab_size: int, draft_vocab_size: int, where: str | Path
) -> torch.Tensor | None:
    """The target id of each draft id by d2t (None without d2t), with t2d checked against it: readers that
    use one of the two (vLLM d2t, speculators t2d) must see the same draft vocabulary. t2d's shape is
    checked before (inspect_checkpoint reads it from the header)."""
    ids = None if d2t is None else _checked_d2t(d2t, vocab_size, draft_vocab_size, where)
    if t2d is not None:
        _check_t2d(t2d, ids, draft_vocab_size, where)
    return ids


def _checked_d2t(d2t: torch.Tensor, vocab_size: int, draft_vocab_size: int, where: str | Path) -> torch.Tensor:
    """The target id of each draft id (target id = draft id + d2t[draft id]), checked to be distinct ids
    of the target vocabulary."""
    ids = torch.arange(draft_vocab_size) + d2t.to(torch.long)
    if ids.min() < 0 or ids.max() >= vocab_size or ids.unique().numel() != ids.numel():
        raise CheckpointError(
            f"{where}: d2t maps draft ids onto ids outside the target vocabulary or onto one id twice; "
            f"expected offsets to {draft_vocab_size} distinct ids below {vocab_size}"
        )
    return ids


def _check_t2d(t2d: torch.Tensor, ids: torch.Tensor | None, draft_vocab_size: int, where: str | Path) -> None:
    """t2d marks exactly draft_vocab_size target ids, and where d2t is there too exactly the ids it maps to."""
    if not ((t2d == 0) | (t2d == 1)).all():
        raise CheckpointError(
            f"{where}: t2d holds values other than 0 and 1 ({t2d.dtype}); "
            "expected a bool mask over the target vocabulary"
        )
    mask = t2d.to(torch.bool)
    marked = int(mask.sum())
    if marked != draft_vocab_size:
        raise CheckpointError(
            f"{where}: t2d marks {marked} target ids; expected {draft_vocab_size} (draft_vocab_size of {CONFIG})"
        )
    if ids is not None and not bool(mask[ids].all()):
        # ids are distinct and as many as t2d marks: all of them marked means the same set
        first = int((~mask[ids]).nonzero()[0])
        raise CheckpointError(
            f"{where}: t2d disagrees with d2t (d2t maps draft id {first} to target id {int(ids[first])}, which t2d "
            "does not mark); expected t2d True exactly at the target ids d2t maps to"
        )


def target_embedding(
    embed_weight: torch.Tensor | None, vocab_size: int, hidden_size: int, where: str | Path
) -> torch.Tensor:
    """The target's embedding in place of one the checkpoint lacks (speculators saves none), checked to be
    [vocab_size, hidden_size]; a copy, so that the drafter never writes into the target's."""
    if embed_weight is None:
        raise CheckpointError(f"{where}: no embed_tokens.weight; pass the target's embedding")
    want = [vocab_size, hidden_size]
    if list(embed_weight.shape) != want:
        raise CheckpointError(
            f"{where}: no embed_tokens.weight, and the target's embedding is {list(embed_weight.shape)}; "
            f"expected {want} (vocab_size x hidden_size of {CONFIG})"
        )
    return embed_weight.detach().clone()
