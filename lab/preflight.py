"""Checks that read the user's files but load no model, above the target and drafter stages (lab/config.py
imports nothing of them): a drafter.checkpoint that is unreadable or does not fit the target, a drafter
vLLM cannot serve, a malformed line of the user's conversations, or a target whose chat template cannot
mask the assistant's turns is one line naming the key and file before a target is loaded or converted and
before an MLflow run is opened.

`lab run` runs them all (`preflight`); a study runs `check_checkpoint` on every point before it starts
(lab/sweep/spec.py `Sweep.check`, and the CLI on its first point), but not `check_vllm_servable`."""

from __future__ import annotations

from omegaconf import DictConfig

from lab.assets import check_gguf_file
from lab.config import TARGET_TEMPLATE, ConfigError, DataSource, FcNorm, NormType, TargetKind

SAMPLE = [
    {"role": "user", "content": "Hello?"},
    {"role": "assistant", "content": "Hi! How can I help?"},
    {"role": "user", "content": "Say more."},
    {"role": "assistant", "content": "Happy to."},
]


def preflight(cfg: DictConfig) -> None:
    """Everything `lab run` checks after composing and before any work; raises ConfigError naming the key
    (and file) of the first problem found."""
    check_checkpoint(cfg)
    check_vllm_servable(cfg)
    check_files(cfg)


def check_checkpoint(cfg: DictConfig) -> None:
    """drafter.checkpoint, when named, is readable and fits the target (lab.drafter.imported.resolve_for),
    checked from the config alone so that a wrong folder fails before any target is built."""
    if not cfg.drafter.checkpoint:
        return
    from lab.drafter.imported import resolve_for  # torch: imported only when a checkpoint is named

    resolve_for(cfg)


def check_vllm_servable(cfg: DictConfig) -> None:
    """`lab run` asking vLLM for a drafter it cannot serve is refused before training (the same rule as
    lab.drafter.formats.vllm_incompatibility). A study is not: there the arm is evaluated by the reference
    backend only and tagged `vllm_skipped`, so that its other arms still get vLLM's numbers."""
    d = cfg.drafter
    if d.checkpoint and "vllm" in cfg.eval.backends:
        from lab.drafter import vllm_incompatibility
        from lab.drafter.imported import resolve_for

        reason = vllm_incompatibility(resolve_for(cfg).spec)
        if reason:
            raise ConfigError("eval.backends", f"'vllm' cannot serve drafter.checkpoint={d.checkpoint}: {reason}")
        return
    if "vllm" in cfg.eval.backends and d.norm_type != NormType.rmsnorm and d.fc_norm != FcNorm.none:
        raise ConfigError(
            "eval.backends",
            f"'vllm' cannot serve drafter.norm_type={d.norm_type.value} with drafter.fc_norm={d.fc_norm.value} "
            "(vLLM's EAGLE-3 drafter has RMSNorm fc norms only); expected drafter.norm_type=rmsnorm, "
            "or eval.backends=[ref]",
        )


def check_files(cfg: DictConfig) -> None:
    """The user's GGUF file reads, the user's conversations (data.source=jsonl) parse, and the target
    tokenizer's own chat template (data.template=target) masks the assistant's turns."""
    if cfg.target.kind == TargetKind.gguf and cfg.target.path:
        check_gguf_file(cfg.target.path)
    if cfg.data.source == DataSource.jsonl:
        from lab.data.conversations import read_jsonl

        read_jsonl(cfg.data.path, "data.path")
    if cfg.data.template == TARGET_TEMPLATE and cfg.target.kind == TargetKind.hf:
        from transformers import AutoTokenizer

        from lab.target.chat_template import TokenizerChat

        TokenizerChat(AutoTokenizer.from_pretrained(cfg.target.path)).render(SAMPLE)
