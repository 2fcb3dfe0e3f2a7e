"""The drafter's data: corpus chunks as conversations in ONE chat template, cut to short sequences.

Each sequence is one conversation from its start (BOS, template markers, request, the last
`seq_len / 4` tokens of the code shown), truncated or padded to `data.seq_len`, with a mask over the
assistant's tokens: the drafter is trained to predict those (as TorchSpec / EAGLE train on assistant
turns), while the prompt is context.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from lab.config import MIN_ASSISTANT_TOKENS, ConfigError
from lab.target import chat, corpus

WINDOW_SEED = 1234  # fixed: every run and seed trains on the same sequences, so caches are shared
MIN_MASKED_TOKENS = MIN_ASSISTANT_TOKENS  # a sequence must leave the drafter this many assistant tokens to learn from


@dataclass
class Sequences:
    input_ids: torch.Tensor  # [N, T]
    loss_mask: torch.Tensor  # [N, T] 1 where the token is the assistant's

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, index) -> Sequences:
        return Sequences(self.input_ids[index], self.loss_mask[index])


def corpus_files(corpus_bytes: int, heldout: bool) -> list[tuple[str, str]]:
    """(relative path, text) of the corpus files of one split."""
    return [(f.relpath, f.read()) for f in corpus.select(corpus_bytes) if f.heldout == heldout]


def _rows(tokenizer, dcfg: DictConfig, heldout: bool) -> Iterator[tuple[list[int], list[int]]]:
    """The split's conversations in `data.template`, cut to data.seq_len and padded, with their masks: those
    that leave the assistant at least MIN_MASKED_TOKENS tokens, in corpus order."""
    renderer = chat.Renderer(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else renderer.eos
    docs = chat.chat_documents(
        corpus_files(dcfg.corpus_bytes, heldout),
        seed=WINDOW_SEED + int(heldout),
        templates=[dcfg.template],
        system_prompts=[dcfg.system_prompt] if dcfg.system_prompt else [],
        system_share=1.0,
        min_chars=dcfg.chunk_chars[0],
        max_chars=dcfg.chunk_chars[1],
    )
    t = dcfg.seq_len
    for doc in docs:
        # the end of the shown code (nearest the answer), so the assistant's turn fits in the sequence
        code = renderer.encode(doc.code)[-(t // 4) :]
        conv = chat.Conversation(doc.system, doc.request, code, renderer.encode(doc.answer))
        ids, mask = renderer.render(chat.TEMPLATES[doc.template], conv)
        ids, mask = ids[:t], mask[:t]
        if sum(mask) < MIN_MASKED_TOKENS:
            continue
        yield ids + [pad] * (t - len(ids)), mask + [0] * (t - len(mask))


def too_few(key: str, count: int, found: int, dcfg: DictConfig) -> ConfigError:
    return ConfigError(
        key,
        f"asks for {count} conversations but the corpus split holds {found} with at least {MIN_MASKED_TOKENS} "
        f"assistant tokens within data.seq_len={dcfg.seq_len}; expected at most {found}, or a larger "
        "data.seq_len or data.corpus_bytes",
    )


def available(tokenizer, dcfg: DictConfig, heldout: bool, needed: int) -> int:
    """How many of the split's conversations fit (counting stops at `needed`): the check before any model
    loads (lab/preflight.py), with the target's tokenizer alone."""
    found = 0
    for _ in _rows(tokenizer, dcfg, heldout):
        found += 1
        if found >= needed:
            break
    return found


def split_rows(tokenizer, dcfg: DictConfig, heldout: bool) -> list[tuple[list[int], list[int]]]:
    """Every conversation of the split that fits, as (ids, mask) padded to data.seq_len, in corpus order."""
    return list(_rows(tokenizer, dcfg, heldout))


def chosen(total: int, count: int) -> list[int]:
    """Which of a split's `total` rows its `count` sequences are: a seeded choice, in corpus order."""
    return sorted(random.Random(WINDOW_SEED).sample(range(total), count))


def conversation_sequences(tokenizer, dcfg: DictConfig, heldout: bool, count: int, key: str) -> Sequences:
    """`count` conversations in `data.template` (with `data.system_prompt` if set), seeded choice."""
    pairs = split_rows(tokenizer, dcfg, heldout)
    rows, masks = [r for r, _ in pairs], [m for _, m in pairs]
    if count > len(rows):
        raise too_few(key, count, len(rows), dcfg)
    order = chosen(len(rows), count)
    return Sequences(
        torch.tensor([rows[i] for i in order], dtype=torch.long),
        torch.tensor([masks[i] for i in order], dtype=torch.uint8),
    )


def training_sequences(tokenizer, dcfg: DictConfig) -> tuple[Sequences, Sequences]:
    """(train, held-out) drafter sequences."""
    return (
        conversation_sequences(tokenizer, dcfg, False, dcfg.num_sequences, "data.num_sequences"),
        conversation_sequences(tokenizer, dcfg, True, dcfg.heldout_sequences, "data.heldout_sequences"),
    )
