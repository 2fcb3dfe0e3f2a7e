"""A fresh drafter shaped after its target: the spec from the target's transformers config, the draft
vocabulary from the training data's token counts, the embedding (and lm_head) from the target's weights.

It reads the target only through what `Target` exposes (`model.config`, `embed_weight`,
`lm_head_weight`), so the drafter package stays below the target stage (docs/design.md, "Import rules").
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from omegaconf import DictConfig

from lab.drafter.formats import rope_kind, yarn_scaling
from lab.drafter.model import DrafterSpec, Eagle3Drafter


class TargetWeights(Protocol):
    """What `init_drafter` reads of a target (`lab.target.Target` has it)."""

    @property
    def model(self) -> Any: ...  # a transformers causal LM: its `config` shapes the drafter

    @property
    def embed_weight(self) -> torch.Tensor: ...

    @property
    def lm_head_weight(self) -> torch.Tensor: ...


def draft_vocabulary(token_counts: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` most frequent target ids (ties to the lower id), ascending: EAGLE-3's draft vocab."""
    order = torch.sort(token_counts, descending=True, stable=True).indices
    return order[:size].sort().values


MLA_DIMS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def mla_dims(model_config, dcfg: DictConfig) -> dict[str, int]:
    """drafter.attention=mla's dims: an MLA target's (its config has kv_lora_rank; its q_lora_rank where it has
    one), else drafter.*: the rule lab/config/shape.py's `drafter_mla_dims` checks before any model loads."""
    mla_target = bool(getattr(model_config, "kv_lora_rank", None))
    dims = {}
    for k in MLA_DIMS:
        value = getattr(model_config, k, None) if mla_target else None
        dims[k] = int(value if value is not None else dcfg[k]) if (value is not None or dcfg[k] is not None) else None
    if dims["q_lora_rank"] is None:
        raise ValueError("drafter.q_lora_rank: required for drafter.attention=mla where the target gives none")
    return dims


def drafter_spec(model_config, dcfg: DictConfig, aux_layers: list[int]) -> DrafterSpec:
    """The drafter shaped after a target with transformers config `model_config`: its width, heads and
    MLP, and with drafter.attention=mla the MLA dims (`mla_dims`; either attention over either kind of
    target); a `draft_vocab_size` at or above the target's vocabulary means the full vocabulary."""
    tc = model_config
    attention = str(getattr(dcfg.get("attention", "gqa"), "value", dcfg.get("attention", "gqa")))
    mla = mla_dims(tc, dcfg) if attention == "mla" else {}
    heads = tc.num_attention_heads
    draft_vocab = dcfg.draft_vocab_size if dcfg.draft_vocab_size and dcfg.draft_vocab_size < tc.vocab_size else None
    return DrafterSpec(
        hidden_size=tc.hidden_size,
        target_hidden_size=tc.hidden_size,
        aux_layer_ids=list(aux_layers),
        vocab_size=tc.vocab_size,
        draft_vocab_size=draft_vocab,
        num_heads=heads,
        num_kv_heads=heads if mla else getattr(tc, "num_key_value_heads", heads),
        # MLA: the query-key head (its V is zero-padded to it where a kernel needs one width)
        head_dim=mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]
        if mla
        else getattr(tc, "head_dim", None) or tc.hidden_size // heads,
        intermediate_size=tc.intermediate_size,
        num_layers=dcfg.num_layers,
        max_position_embeddings=tc.max_position_embeddings,
        rope_theta=_rope_theta(tc),
        rms_norm_eps=dcfg.rms_norm_eps,
        fc_norm=str(getattr(dcfg.fc_norm, "value", dcfg.fc_norm)),
        norm_output=bool(dcfg.norm_output),
        norm_type=str(getattr(dcfg.norm_type, "value", dcfg.norm_type)),
        attention=attention,
        rope_scaling=target_yarn(tc) if mla else None,
        **mla,
    )


def init_drafter(
    target: TargetWeights,
    dcfg: DictConfig,
    aux_layers: list[int],
    seed: int,
    token_counts: torch.Tensor | None = None,
) -> Eagle3Drafter:
    """A fresh drafter shaped after the target (`drafter_spec`), on the target's device; embedding copied and
    frozen; with a smaller `draft_vocab_size`, lm_head covers the most frequent tokens of `token_counts` [V].
    Initialised on the CPU, then moved: the same initial weights on every device."""
    spec = drafter_spec(target.model.config, dcfg, aux_layers)
    draft_vocab = spec.draft_vocab_size if spec.draft_vocab_size != spec.vocab_size else None
    if draft_vocab and token_counts is None:
        raise ValueError("drafter.draft_vocab_size: a smaller draft vocabulary needs the training data's token counts")
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(spec)
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(target.embed_weight)
        if draft_vocab:
            ids = draft_vocabulary(token_counts, draft_vocab)
            drafter.d2t.copy_(ids.cpu() - torch.arange(draft_vocab))
        if dcfg.init_lm_head_from_target:
            head = target.lm_head_weight
            drafter.lm_head.weight.copy_(head[drafter.draft_token_ids().to(head.device)])
    return drafter.to(target.lm_head_weight.device)


def target_yarn(model_config) -> dict | None:
    """The target's YaRN rope scaling (DeepSeek-V3 / Kimi K2: `rope_scaling` of type yarn, which transformers
    reads into `rope_parameters`), as an MLA drafter takes it: its rotary frequencies and softmax scale are then
    the target's; None for plain RoPE. Another scaling is refused: the drafter computes only these two."""
    params = getattr(model_config, "rope_parameters", None) or getattr(model_config, "rope_scaling", None) or {}
    kind = rope_kind(params)
    if kind == "default":
        return None
    if kind != "yarn":
        raise ValueError(f"target rope scaling '{kind}': an MLA drafter computes plain RoPE or YaRN only")
    return yarn_scaling(params)


def _rope_theta(model_config) -> float:
    params = getattr(model_config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(model_config, "rope_theta", 10000.0)))
