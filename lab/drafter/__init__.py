"""The EAGLE-3 / 3.1 drafter, its construction after a target and its checkpoint formats."""

from lab.drafter.build import draft_vocabulary, drafter_spec, init_drafter
from lab.drafter.formats import (
    CheckpointError,
    VllmFacts,
    VllmRefusal,
    checkpoint_format,
    inspect_checkpoint,
    load_checkpoint,
    save_native,
    save_speculators,
    vllm_incompatibility,
    vllm_refusal,
)
from lab.drafter.model import DrafterSpec, Eagle3Drafter, KVCache, TTTCache

__all__ = [
    "CheckpointError",
    "DrafterSpec",
    "Eagle3Drafter",
    "KVCache",
    "TTTCache",
    "VllmFacts",
    "VllmRefusal",
    "checkpoint_format",
    "draft_vocabulary",
    "drafter_spec",
    "init_drafter",
    "inspect_checkpoint",
    "load_checkpoint",
    "save_native",
    "save_speculators",
    "vllm_incompatibility",
    "vllm_refusal",
]
