"""Capture the target's auxiliary hidden states with vLLM's layer-id convention.

vLLM's aux id i is the residual stream after i decoder layers, i.e. the input of decoder layer i
(id 0: the embeddings), so ids are 0..L-1; `output_hidden_states=True` would return the same tensors as
its entries 0..L-1. Capture keeps only the requested ones: a forward pre-hook on each captured layer
copies that layer's input into one preallocated [B, T, A*H] tensor (converted to the requested dtype in
the same pass), while the other L+1-A states are freed as the forward goes, as in a plain forward. The
final, post-norm state (`last_hidden_state`, which vLLM's id L would not be: that would be pre-norm) is
what the target's lm_head reads, so it is kept as `final` to recompute the target distribution later.
No logits are computed: the forward runs the base model, without lm_head.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Captured:
    aux: torch.Tensor  # [B, T, len(aux_layers) * H]: captured layers, concatenated in id order
    final: torch.Tensor  # [B, T, H]: post-norm last hidden state (lm_head input)
    past_key_values: Any = None


def _decoder_layers(base: Any) -> torch.nn.ModuleList | None:
    """The base model's decoder layers, in order (Llama, Mistral, Qwen, Gemma, ...: `base.layers`)."""
    layers = getattr(base, "layers", None)
    if isinstance(layers, torch.nn.ModuleList) and len(layers) == base.config.num_hidden_layers:
        return layers
    return None


@torch.no_grad()
def capture(
    model: Any,
    input_ids: torch.Tensor,
    aux_layers: list[int],
    past_key_values: Any = None,
    use_cache: bool = False,
    dtype: torch.dtype | None = None,
) -> Captured:
    """One target forward over `input_ids` [B, T], continuing `past_key_values` if given (with
    `use_cache` the returned cache holds these positions too). `aux` and `final` come in `dtype`
    (default: the model's own), converted as they are copied out (the same values as converting
    afterwards: the conversion is elementwise)."""
    base = model.base_model
    kwargs = {
        "input_ids": input_ids,
        "past_key_values": past_key_values,
        "use_cache": use_cache or past_key_values is not None,
    }
    layers = _decoder_layers(base)
    if layers is None:  # an architecture without `layers`: every state, then the requested ones
        out = base(**kwargs, output_hidden_states=True)
        states = out.hidden_states
        aux = torch.cat([states[i].to(dtype) if dtype else states[i] for i in aux_layers], dim=-1)
        final = states[-1].to(dtype) if dtype else states[-1]
        return Captured(aux=aux, final=final, past_key_values=out.past_key_values)

    width = base.config.hidden_size
    slots: dict[int, list[int]] = {}
    for slot, layer_id in enumerate(aux_layers):
        slots.setdefault(layer_id, []).append(slot)
    buffer: list[torch.Tensor] = []

    def keep(layer_id: int):
        def hook(module, args, kwargs):
            state = args[0] if args else kwargs["hidden_states"]
            if not buffer:
                shape = (*state.shape[:-1], len(aux_layers) * width)
                buffer.append(torch.empty(shape, dtype=dtype or state.dtype, device=state.device))
            for slot in slots[layer_id]:
                buffer[0][..., slot * width : (slot + 1) * width].copy_(state)

        return hook

    handles = [layers[i].register_forward_pre_hook(keep(i), with_kwargs=True) for i in slots]
    try:
        out = base(**kwargs)
    finally:
        for handle in handles:
            handle.remove()
    final = out.last_hidden_state
    return Captured(aux=buffer[0], final=final.to(dtype) if dtype else final, past_key_values=out.past_key_values)


def target_logits(final: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
    """Target logits from the post-norm final hidden state, as TorchSpec's LazyTarget does."""
    return final.to(lm_head_weight.dtype) @ lm_head_weight.T


def chunked_argmax(h: torch.Tensor, logits: Callable[[torch.Tensor], torch.Tensor], rows: int = 512) -> torch.Tensor:
    """argmax over the vocabulary of logits(h) for states h [..., H] -> [...], a chunk of rows at a time: the
    logits of a whole batch of held-out conversations never exist at once (64 x 512 positions over SmolLM2's
    49,152 tokens are 6.4 GB in float32, twice that for two workers at once)."""
    flat = h.reshape(-1, h.shape[-1])
    top = torch.cat([logits(flat[a : a + rows]).argmax(-1) for a in range(0, flat.shape[0], rows)])
    return top.view(h.shape[:-1])
