"""A drafter trained elsewhere (TorchSpec, speculators, an earlier run), checked against the target it is
to draft for. `lab run drafter.checkpoint=DIR` evaluates such a drafter instead of training one.

Every mismatch is a ConfigError naming the key to change: a checkpoint for another target would not fail
loudly later, it would draft from the wrong hidden states and report a meaningless acceptance length.
"""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig

from lab.config import ConfigError, TargetKind
from lab.config.shape import target_shape, vllm_default_aux_layers
from lab.drafter.formats import MLA_KEYS, CheckpointError, CheckpointInfo, inspect_checkpoint
from lab.drafter.model import DrafterSpec

KEY = "drafter.checkpoint"


def resolve(
    path: str | Path,
    num_layers: int,
    hidden_size: int,
    vocab_size: int | None = None,
    aux_layers: list[int] | None = None,
) -> CheckpointInfo:
    """The checkpoint at `path`, checked to fit a target of `num_layers` layers of width `hidden_size`
    (and `vocab_size` tokens, when known). Aux layer ids it does not name are `aux_layers` (the user's
    drafter.aux_layers), else vLLM's default. ConfigError in one line otherwise; nothing is loaded."""
    user = list(aux_layers) if aux_layers is not None else None
    fallback = user if user is not None else vllm_default_aux_layers(num_layers)
    try:
        info = inspect_checkpoint(path, aux_layers=fallback)
    except (FileNotFoundError, CheckpointError) as exc:
        raise ConfigError(KEY, str(exc)) from None
    spec, where = info.spec, Path(path)
    ids = spec.aux_layer_ids
    if info.aux_from_checkpoint and user is not None and user != ids:
        raise ConfigError(
            "drafter.aux_layers",
            f"{user} differs from the layers {where} was trained on ({ids}); expected null or {ids}",
        )
    if not info.aux_from_checkpoint and user is None and ids != sorted(set(ids)):
        raise ConfigError(
            KEY,
            f"{where} names no captured layers and vLLM's default (2, L//2, L-3) for the target's {num_layers} "
            f"layers is {ids}, not distinct ascending ids; set drafter.aux_layers to the layers it was trained on",
        )
    if vocab_size is not None and spec.vocab_size != vocab_size:
        raise ConfigError(
            KEY, f"{where}: vocab_size {spec.vocab_size}, the target's is {vocab_size}; expected a drafter for it"
        )
    if spec.target_hidden_size != hidden_size:
        raise ConfigError(
            KEY,
            f"{where}: target_hidden_size {spec.target_hidden_size}, the target's hidden size is {hidden_size}; "
            "expected a drafter for this target",
        )
    if not info.has_embedding and spec.hidden_size != hidden_size:
        raise ConfigError(
            KEY,
            f"{where}: no embed_tokens.weight and hidden_size {spec.hidden_size}, so the target's embedding "
            f"(width {hidden_size}) cannot fill it; expected hidden_size {hidden_size}",
        )
    if any(i >= num_layers for i in ids) or len(set(ids)) != len(ids) or ids != sorted(ids):
        # vLLM captures in layer order whatever the list's order: only ascending ids mean the same to both
        raise ConfigError(
            KEY,
            f"{where}: captured layers {ids}; expected distinct ascending ids below the target's {num_layers} layers",
        )
    return info


def resolve_for(cfg: DictConfig) -> CheckpointInfo:
    """`resolve` against the configured target, from its config alone (the vocabulary of a built target
    is known once it is built: `lab run` checks it again then)."""
    shape = target_shape(cfg)
    vocab = None
    if cfg.target.kind == TargetKind.hf:
        vocab = json.loads((Path(cfg.target.path) / "config.json").read_text()).get("vocab_size")
    elif cfg.target.kind == TargetKind.gguf:
        vocab = cfg.target.vocab_size  # declared; checked against the GGUF once converted
    return resolve(cfg.drafter.checkpoint, shape["num_layers"], shape["hidden_size"], vocab, cfg.drafter.aux_layers)


def kind(spec: DrafterSpec) -> str:
    """`eagle3`, `eagle31`, or eagle3 with the toggles it has (e.g. `eagle3+norm_before_fc`); `+mla` for an MLA
    drafter (`eagle31+mla`)."""
    toggles = {"per_layer": ["fc_norm"], "concat": ["norm_before_fc"]}.get(spec.fc_norm, [])
    toggles += ["norm_output"] if spec.norm_output else []
    mla = ["mla"] if spec.attention == "mla" else []
    if spec.fc_norm == "per_layer" and spec.norm_output:
        return "+".join(["eagle31", *mla])
    return "+".join(["eagle3", *toggles, *mla])


def config_values(spec: DrafterSpec, fmt: str) -> dict:
    """The `drafter.*` config keys describing a loaded drafter, as a trained one's config would: the
    run's params and config.yaml tell what was evaluated, not the presets it was composed with."""
    return {
        "name": f"{fmt}-{kind(spec)}",
        "fc_norm": spec.fc_norm,
        "norm_output": spec.norm_output,
        "norm_type": spec.norm_type,
        "num_layers": spec.num_layers,
        "aux_layers": list(spec.aux_layer_ids),
        # None is the full vocabulary, as in a trained run's config
        "draft_vocab_size": spec.draft_vocab_size if spec.draft_vocab_size < spec.vocab_size else None,
        "rms_norm_eps": spec.rms_norm_eps,
        # an MLA drafter's attention and dims (a GQA drafter's are the defaults: left out)
        **({"attention": "mla", **{k: getattr(spec, k) for k in MLA_KEYS}} if spec.attention == "mla" else {}),
    }
