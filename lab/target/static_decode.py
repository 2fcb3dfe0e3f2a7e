"""Greedy batches over a static KV cache: the target's one-token step at a GPU's speed.

A small target's step is about a thousand small kernels that the host launches one by one, so the GPU mostly
waits. Here the cache is transformers' `StaticCache` and, on CUDA, the step is compiled with
`torch.compile(mode="reduce-overhead")` into a CUDA graph: one launch replays the whole step. A graph holds fixed
shapes and addresses, so every batch is padded to a bucket (its rows to the next of `ROW_BUCKETS`, its cache to
the next power of two from `MIN_LENGTH`) whose cache and inputs are kept for the model's life. The step compiles
once for every bucket (`dynamic=True`), as a compile costs far more than a bucket's graph and a run meets several
buckets (docs/benchmarks.md#static-kv-cache). Rows never leave the batch: on a GPU a step costs about the same
for few rows or many. On a CPU the same path runs eagerly and gives the dynamic path's tokens; there the dynamic
path is faster, as it drops finished rows.
"""

from __future__ import annotations

import functools
import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

ROW_BUCKETS = (1, 4, 16, 64, 256, 512)  # a batch's rows, padded up; 512 is lab.target.generate.HF_BATCH_MAX
MIN_LENGTH = 256  # the shortest cache; longer ones double
CHECK_EVERY = 16  # steps between two looks at whether every row has finished (each look waits for the GPU)
RECOMPILE_LIMIT = 64  # every (rows, length) bucket a run can meet (one row compiles apart: dynamo specializes 1)


def row_bucket(rows: int) -> int:
    """The rows a batch of `rows` is padded to (beyond the largest bucket: itself)."""
    return next((b for b in ROW_BUCKETS if b >= rows), rows)


def rows_at_most(rows: int) -> int:
    """The largest bucket within `rows` (at least 1): a full batch that fits the memory and needs no padding."""
    return max((b for b in ROW_BUCKETS if b <= rows), default=1)


def length_bucket(tokens: int) -> int:
    """The cache length of a batch whose rows reach `tokens` positions (prompt padding included)."""
    return max(MIN_LENGTH, 1 << (max(1, tokens) - 1).bit_length())


def compile_step(step: Callable, device: torch.device, dynamic: bool) -> Callable:
    """The step as it runs on `device`: compiled into CUDA graphs on CUDA (`fullgraph`: a graph break would
    leave eager launches in every step; `dynamic`: one compile over every bucket's shapes, each bucket then
    recording its own graph), as it is elsewhere."""
    if device.type != "cuda":
        return step
    return compiled(step, "reduce-overhead", dynamic)


def compiled(step: Callable, mode: str | None, dynamic: bool) -> Callable:
    """`torch.compile` of the step, with dynamo's recompile limit raised to cover every bucket."""
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    _log_compiles()
    return torch.compile(step, mode=mode, fullgraph=True, dynamic=dynamic)


@functools.cache
def _log_compiles() -> None:
    """Each compile's start and end as a log record, hooked once a process: a compile costs a GPU run tens of
    seconds, which its log then shows."""
    from torch._dynamo import callback

    started: dict[str, float] = {}

    def start(args: callback.CallbackArgs) -> None:
        started[str(args.compile_id)] = time.perf_counter()
        trigger = getattr(getattr(args, "callback_trigger", None), "name", "compile").lower()
        logger.info(f"compile {args.compile_id}: start ({trigger})")

    def end(args: callback.CallbackArgs) -> None:
        seconds = time.perf_counter() - started.pop(str(args.compile_id), time.perf_counter())
        logger.info(f"compile {args.compile_id}: end, {seconds:.1f} s")

    callback.on_compile_start(start)
    callback.on_compile_end(end)


@dataclass
class _Bucket:
    cache: Any  # transformers' StaticCache for `rows` x `length`
    mask: torch.Tensor  # [rows, length]: 1 where a row has a token (left padding 0); kept, for a static address


class _Stepper:
    """A model's compiled step and its buckets (one per (rows, length) met so far)."""

    def __init__(self, model: Any):
        self.model_ref = weakref.ref(model)  # the stepper lives in a WeakKeyDictionary keyed by the model
        self.buckets: dict[tuple[int, int], _Bucket] = {}
        device = model.get_output_embeddings().weight.device
        self.step = compile_step(self._step, device, True)  # dynamic: one compile (False: one a bucket)

    def _step(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: Any) -> torch.Tensor:
        logits = self.model_ref()(
            input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True,
            logits_to_keep=1,
        ).logits  # fmt: skip
        return logits[:, -1].argmax(-1)

    def bucket(self, rows: int, length: int) -> _Bucket:
        from transformers import StaticCache

        key = (rows, length)
        if key not in self.buckets:
            model = self.model_ref()
            device = model.get_output_embeddings().weight.device
            cache = StaticCache(config=model.config, max_cache_len=length)
            mask = torch.zeros((rows, length), dtype=torch.long, device=device)
            if device.type == "cuda":
                torch._dynamo.mark_static_address(mask)
                # a bucket records its CUDA graph (and the first, or the first of one row, compiles): say where
                logger.info(f"static KV cache: a new bucket, {rows} rows x {length} positions")
            self.buckets[key] = _Bucket(cache, mask)
        else:
            self.buckets[key].cache.reset()
        return self.buckets[key]


_STEPPERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@torch.no_grad()
def static_greedy_batch(model: Any, prompts: list[list[int]], limits: list[int], eos: int) -> list[list[int]]:
    """`lab.target.generate.greedy_batch`'s answers (row i stops at eos, excluded, or after limits[i] tokens),
    over a static cache padded to its bucket: the prompt's forward eagerly (its width varies), then the
    one-token step, compiled on CUDA."""
    stepper = _STEPPERS.get(model)
    if stepper is None:
        stepper = _STEPPERS[model] = _Stepper(model)
    n, width, steps = len(prompts), max(len(p) for p in prompts), max(limits)
    rows = row_bucket(n)
    bucket = stepper.bucket(rows, length_bucket(width + steps))
    device = bucket.mask.device
    ids = torch.zeros((rows, width), dtype=torch.long)  # the pad id never matters: masked out
    real = torch.zeros((rows, width), dtype=torch.long)
    for i, p in enumerate([*prompts, *[[0]] * (rows - n)]):  # dummy rows: one token each
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        real[i, width - len(p) :] = 1
    ids, real = ids.to(device), real.to(device)
    # the mask covers the whole cache: every slot after the prompt holds a generated token by the time a query
    # can see it (the causal mask hides the later ones), so it stays the same for every step
    bucket.mask.fill_(1)
    bucket.mask[:, :width] = real
    logits = model(
        input_ids=ids, attention_mask=bucket.mask, position_ids=(real.cumsum(-1) - 1).clamp(min=0),
        past_key_values=bucket.cache, use_cache=True, logits_to_keep=1,
    ).logits  # fmt: skip
    next_ids = logits[:, -1].argmax(-1)
    position = real.sum(-1, keepdim=True)  # the first new token's: the real tokens before it
    out = torch.empty((rows, steps), dtype=torch.long, device=device)
    ends = torch.tensor(limits + [1] * (rows - n), device=device)
    for t in range(steps):
        out[:, t] = next_ids
        if t + 1 == steps:
            break
        if (t + 1) % CHECK_EVERY == 0 and bool((((out[:, : t + 1] == eos).any(-1)) | (ends <= t + 1)).all()):
            break
        if device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs are read: its graph may go on
        # cloned: a CUDA graph's output is overwritten by its next replay
        next_ids = stepper.step(next_ids[:, None], position + t, bucket.mask, bucket.cache).clone()
    answers = [row[:limit] for row, limit in zip(out[:n, : t + 1].tolist(), limits, strict=True)]
    return [row[: row.index(eos)] if eos in row else row for row in answers]
