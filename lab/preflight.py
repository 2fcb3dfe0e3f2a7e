"""Checks that read files but load no model, run by the CLI before any work: a malformed line of the
user's conversations, or a target whose chat template cannot mask the assistant's turns, is one line
naming the key and file before a target is loaded or converted and before an MLflow run is opened."""

from __future__ import annotations

from omegaconf import DictConfig

from lab.config import TARGET_TEMPLATE, DataSource, TargetKind

SAMPLE = [
    {"role": "user", "content": "Hello?"},
    {"role": "assistant", "content": "Hi! How can I help?"},
    {"role": "user", "content": "Say more."},
    {"role": "assistant", "content": "Happy to."},
]


def preflight(cfg: DictConfig) -> None:
    """Raises ConfigError naming the key and file of the first problem found."""
    if cfg.data.source == DataSource.jsonl:
        from lab.data.conversations import read_jsonl

        read_jsonl(cfg.data.path, "data.path")
    if cfg.data.template == TARGET_TEMPLATE and cfg.target.kind == TargetKind.hf:
        from transformers import AutoTokenizer

        from lab.target.chat_template import TokenizerChat

        TokenizerChat(AutoTokenizer.from_pretrained(cfg.target.path)).render(SAMPLE)
