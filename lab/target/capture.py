"""Capture the target's auxiliary hidden states with vLLM's layer-id convention.

`output_hidden_states=True` returns L+1 entries: entry i (i < L) is the residual stream after i
decoder layers, which is exactly vLLM's aux id i; the LAST entry has the final norm applied (vLLM's
id L would be pre-norm, which is why ids are limited to 0..L-1). That last, post-norm entry is what
the target's lm_head reads, so it is kept as `final` to recompute the target distribution later.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Captured:
    aux: torch.Tensor  # [B, T, len(aux_layers) * H]: captured layers, concatenated in id order
    final: torch.Tensor  # [B, T, H]: post-norm last hidden state (lm_head input)
    past_key_values: Any = None


@torch.no_grad()
def capture(
    model: Any,
    input_ids: torch.Tensor,
    aux_layers: list[int],
    past_key_values: Any = None,
    use_cache: bool = False,
) -> Captured:
    """One target forward over `input_ids` [B, T], continuing `past_key_values` if given (with
    `use_cache` the returned cache holds these positions too)."""
    out = model.base_model(
        input_ids=input_ids,
        past_key_values=past_key_values,
        use_cache=use_cache or past_key_values is not None,
        output_hidden_states=True,
    )
    states = out.hidden_states
    aux = torch.cat([states[i] for i in aux_layers], dim=-1)
    return Captured(aux=aux, final=states[-1], past_key_values=out.past_key_values)


def target_logits(final: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
    """Target logits from the post-norm final hidden state, as TorchSpec's LazyTarget does."""
    return final.to(lm_head_weight.dtype) @ lm_head_weight.T
