"""The EAGLE-3 / 3.1 drafter and its checkpoint formats."""

from lab.drafter.formats import (
    CheckpointError,
    checkpoint_format,
    inspect_checkpoint,
    load_checkpoint,
    save_native,
    save_speculators,
    vllm_incompatibility,
)
from lab.drafter.model import DrafterSpec, Eagle3Drafter, KVCache, TTTCache

__all__ = [
    "CheckpointError",
    "DrafterSpec",
    "Eagle3Drafter",
    "KVCache",
    "TTTCache",
    "checkpoint_format",
    "inspect_checkpoint",
    "load_checkpoint",
    "save_native",
    "save_speculators",
    "vllm_incompatibility",
]
