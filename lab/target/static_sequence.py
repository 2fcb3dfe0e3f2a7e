"""One sequence over a static KV cache, its forwards captured in CUDA graphs: the reference decoder's target.

The reference decoder (lab/eval/reference.py) steps the target at batch 1, one token a step when it decodes
plainly and k + 1 when it verifies a round's drafts, and on a GPU such a step is a thousand small launches, as
regeneration's is (lab/target/static_decode.py). Here the prompt's forward fills a transformers `StaticCache`
whose length is a bucket (`static_decode.length_bucket`), kept for the model's life, and every later forward is
one compiled step (`static_decode.compile_step`): on CUDA a graph for each width met, 1 and every k + 1. The step
takes the model as an argument and compiles once a process, so that the next run's target of the same shape (a
study loads its target once a run) only records its own graphs.

The cache's position is its layers' counters, device tensors that the step reads (for the positions and the
causal mask) and advances. Rejected drafts are undone by moving the counters back, not by copying: the entries
past the position stay, hidden by the causal mask, until the next forward writes over them. A bucket holds one
prompt at a time; a sequence whose bucket another prompt took since, or that needs more room, fills one again.
On a CPU the same path runs eagerly and decodes the dynamic cache's tokens.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from lab.target import static_decode
from lab.target.capture import Captured

logger = logging.getLogger(__name__)


@dataclass
class _Bucket:
    cache: Any  # transformers' StaticCache for one row of `length` positions
    keys: torch.Tensor  # [length]: the cache's positions, for the causal mask
    mask: torch.Tensor  # [1, length] ones: every slot a query may see holds a token (the causal mask hides later ones)
    length: int
    owner: object | None = None  # the sequence whose prompt the cache holds


class _Stepper:
    """A model's forward for one set of captured layers, eager and compiled, and its caches by length."""

    def __init__(self, model: Any, aux_layers: tuple[int, ...]) -> None:
        self.model_ref = weakref.ref(model)  # the stepper lives in a WeakKeyDictionary keyed by the model
        self.aux_layers = aux_layers
        self.buckets: dict[int, _Bucket] = {}
        self.device = model.get_output_embeddings().weight.device
        self.own_mask = _full_causal(model.config)
        self.compiled = _compiled(self.device)

    def forward(self, ids: torch.Tensor, bucket: _Bucket) -> tuple[torch.Tensor, torch.Tensor]:
        return _forward(self.model_ref(), self.aux_layers, self.own_mask, ids, bucket)

    def step(self, ids: torch.Tensor, bucket: _Bucket) -> tuple[torch.Tensor, torch.Tensor]:
        return self.compiled(self.model_ref(), self.aux_layers, self.own_mask, ids, bucket)

    def bucket(self, positions: int) -> _Bucket:
        from transformers import StaticCache

        length = static_decode.length_bucket(positions)
        if length not in self.buckets:
            cache = StaticCache(config=self.model_ref().config, max_cache_len=length)
            keys = torch.arange(length, device=self.device)
            mask = torch.ones((1, length), dtype=torch.long, device=self.device)
            if self.device.type == "cuda":
                torch._dynamo.mark_static_address(keys)
                torch._dynamo.mark_static_address(mask)
                # its first forward of each width records a CUDA graph
                logger.info(f"static KV cache (decoder): a new bucket of {length} positions")
            self.buckets[length] = _Bucket(cache, keys, mask, length)
        return self.buckets[length]


def _full_causal(config: Any) -> bool:
    """Whether the step may pass its own causal mask: SDPA (which takes a boolean one) and every layer attending to
    every position before it (no sliding window)."""
    types = getattr(config, "layer_types", None)
    windowed = any(t != "full_attention" for t in types) if types else getattr(config, "sliding_window", None)
    return getattr(config, "_attn_implementation", None) == "sdpa" and not windowed


def _forward(
    model: Any, aux_layers: tuple[int, ...], own_mask: bool, ids: torch.Tensor, bucket: _Bucket
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target over `ids` [1, T] at the cache's position: the captured layers and the final state."""
    if own_mask:  # causal over the cache: uncompiled, transformers' checks of a 2D mask would read the position
        queries = bucket.cache.layers[0].cumulative_length + torch.arange(ids.shape[1], device=ids.device)
        mask = (bucket.keys[None, :] <= queries[:, None])[None, None]  # [1, 1, T, length]
    else:  # a sliding window, or an attention without boolean masks: transformers builds the mask
        mask = bucket.mask
    out = model.base_model(
        input_ids=ids, attention_mask=mask, past_key_values=bucket.cache, use_cache=True, output_hidden_states=True
    )
    states = out.hidden_states  # entry i is the input of decoder layer i: vLLM's id i (lab.target.capture)
    return torch.cat([states[i] for i in aux_layers], dim=-1), out.last_hidden_state


_COMPILED: dict[str, Any] = {}  # device type -> `_forward` as compiled there


def _compiled(device: torch.device) -> Any:
    """`_forward` compiled for `device`, once a process: the model is an argument, so that the next run's target of
    the same shape (a study loads its target once a run) reuses the compile, recording only its own graphs."""
    if device.type not in _COMPILED:
        _COMPILED[device.type] = static_decode.compile_step(_forward, device, True)
    return _COMPILED[device.type]


_STEPPERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {aux layers: _Stepper}


class StaticSequence:
    """A prompt in a static cache and the target's forwards after it: `forward` over the next tokens, which it
    extends the position by, and `rewind`, which moves the position back (the reference decoder's TargetCache)."""

    def __init__(self, model: Any, prompt: torch.Tensor, aux_layers: list[int]) -> None:
        steppers = _STEPPERS.setdefault(model, {})
        key = tuple(aux_layers)
        if key not in steppers:
            steppers[key] = _Stepper(model, key)
        self.stepper, self.prompt, self.aux_layers = steppers[key], prompt, list(aux_layers)
        self.bucket: _Bucket | None = None
        self.position = 0  # the positions the cache holds for this sequence

    def prefill(self, room: int) -> Captured:
        """The prompt's forward (eager: its width varies) into a bucket with `room` positions after it."""
        self.bucket = self.stepper.bucket(self.prompt.shape[1] + room)
        self.bucket.owner = self
        self._seek(0)
        aux, final = self.stepper.forward(self.prompt, self.bucket)
        self.position = self.prompt.shape[1]
        return Captured(aux=aux, final=final)

    def restart(self, room: int) -> None:
        """Back at the prompt's end with `room` positions after it; the prompt's forward again where the bucket
        holds another prompt now, or is too short."""
        prompt_len = self.prompt.shape[1]
        if self.bucket is None or self.bucket.owner is not self or self.bucket.length < prompt_len + room:
            self.prefill(room)
        else:
            self._seek(prompt_len)

    def forward(self, tokens: torch.Tensor) -> Captured:
        """The target over `tokens` [1, T] after the position, which it extends by T."""
        bucket, width = self.bucket, tokens.shape[1]
        if bucket is None or bucket.owner is not self or self.position + width > bucket.length:
            raise RuntimeError("a static sequence stepped past its room, or after another prompt took its cache")
        if width > 1:  # one compile for every k + 1 (a width of 1 compiles apart: dynamo specializes 1)
            torch._dynamo.maybe_mark_dynamic(tokens, 1)
        if self.stepper.device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()  # the last forward's outputs are read: its graph may go on
        aux, final = self.stepper.step(tokens, bucket)
        self.position += width
        # cloned: a CUDA graph's outputs are overwritten by its next replay, and the drafter reads these later
        return Captured(aux=aux.clone(), final=final.clone())

    def rewind(self, positions: int) -> None:
        """Drop the last `positions` entries: the counters move back, the entries stay until overwritten."""
        if positions > 0:
            torch._foreach_add_(self._counters(), -positions)
            self.position -= positions

    def _seek(self, position: int) -> None:
        """Every layer's counter at `position` (no host sync: a fill of each device scalar)."""
        for counter in self._counters():
            counter.fill_(position)
        self.position = position

    def _counters(self) -> list[torch.Tensor]:
        return [layer.cumulative_length for layer in self.bucket.cache.layers]
