"""The validation prompts: prompts held out of the drafter's training data, over whose greedy answers the
validation pass measures the exact AL while the drafter trains (lab/eval/validation.py).

They come from the training split, from what the training selection left over: for data=code the corpus rows it
did not choose, a prompt being a row's tokens before the assistant's turn (its system prompt, request and code);
for conversations the fitting conversations after the selected ones in the same seeded order, a prompt being the
first user turn as the template renders it up to the assistant's answer. Not from the held-out split: the
rollout and every evaluation suite read that one (code suites cut their excerpts from its files), so a checkpoint
chosen on it would be chosen on the test set. A candidate that starts a training sequence (a duplicate in the
corpus or in ShareGPT) is passed over: no validation prompt was trained on.

Chosen once per training selection and cached: `{cache_dir}/validation/{key}/prompts.safetensors` (`input_ids`
[N, L] int32 right-padded, `lengths` [N]) with its manifest; the key hashes the target, the data config, the
training sequences' tokens, the count and, for a JSONL source, the file.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from safetensors.torch import load_file

from lab.config import MIN_ASSISTANT_ROOM, ConfigError, DataSource
from lab.data import code_data, conversations
from lab.data.cache import publish_tensors, verified_or_built
from lab.data.chat_data import SELECT_SEED, source_conversations
from lab.data.code_data import Sequences
from lab.fsutil import Identity, sha256_file
from lab.target import Target
from lab.target.chat_template import chat_format

FORMAT = 1
FILE = "prompts.safetensors"
VALIDATION_SEED = 4567  # the order the leftover rows are taken in; fixed, so every run of a study shares them


def validation_identity(target: Target, dcfg: DictConfig, count: int, train: Sequences) -> Identity:
    fields = {
        "target": target.fingerprint,
        "data": OmegaConf.to_container(dcfg, enum_to_str=True),
        "train": hashlib.sha256(train.input_ids.to(torch.int64).numpy().tobytes()).hexdigest(),
        "count": count,
        "format": FORMAT,
    }
    if dcfg.source == DataSource.jsonl:
        fields["file"] = sha256_file(Path(dcfg.path))
    return Identity(fields)


def validation_prompts(
    target: Target, dcfg: DictConfig, count: int, train: Sequences, cache_dir: str | Path
) -> list[list[int]]:
    """`count` prompts of the training split that no training sequence starts with, from the cache or chosen
    once (under a lock, published whole)."""
    identity = validation_identity(target, dcfg, count, train)
    path = Path(cache_dir) / "validation" / identity.key()

    def choose() -> dict:
        prompts = list(_candidates(target, dcfg, train, cache_dir))[:count]
        if len(prompts) < count:
            raise too_few(count, len(prompts), dcfg)
        width = max(map(len, prompts))
        ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts], dtype=torch.int32)
        tensors = {"input_ids": ids, "lengths": torch.tensor([len(p) for p in prompts])}
        return publish_tensors(path, FILE, tensors, identity, key=path.name, format=FORMAT, num_prompts=count)

    verified_or_built(path, choose, identity)
    stored = load_file(str(path / FILE))
    return [row[:n] for row, n in zip(stored["input_ids"].tolist(), stored["lengths"].tolist(), strict=True)]


def too_few(count: int, found: int, dcfg: DictConfig) -> ConfigError:
    return ConfigError(
        "train.val_prompts",
        f"asks for {count} validation prompts but the training split leaves {found} beside the "
        f"data.num_sequences={dcfg.num_sequences} training sequences; expected at most {found}, or fewer "
        "data.num_sequences",
    )


def starts_a_sequence(prompt: list[int], sequences: torch.Tensor) -> bool:
    """Whether any row of `sequences` [N, T] begins with `prompt`'s tokens."""
    if len(prompt) > sequences.shape[1]:
        return False
    return bool((sequences[:, : len(prompt)] == torch.tensor(prompt)).all(1).any())


def _candidates(target: Target, dcfg: DictConfig, train: Sequences, cache_dir: str | Path) -> Iterator[list[int]]:
    """The leftover prompts of the training split in their fixed order, each once, none that starts a training
    sequence."""
    source = _code_prompts(target, dcfg) if dcfg.source == DataSource.code else _chat_prompts(target, dcfg, cache_dir)
    seen: set[tuple[int, ...]] = set()
    for prompt in source:
        if tuple(prompt) in seen or starts_a_sequence(prompt, train.input_ids):
            continue
        seen.add(tuple(prompt))
        yield prompt


def _code_prompts(target: Target, dcfg: DictConfig) -> Iterator[list[int]]:
    """The rows of the code training split that the training selection did not choose, as prompts."""
    rows = code_data.split_rows(target.tokenizer, dcfg, heldout=False)
    taken = set(code_data.chosen(len(rows), min(dcfg.num_sequences, len(rows))))
    left = [i for i in range(len(rows)) if i not in taken]
    for i in random.Random(VALIDATION_SEED).sample(left, len(left)):
        ids, mask = rows[i]
        yield ids[: mask.index(1)]


def _chat_prompts(target: Target, dcfg: DictConfig, cache_dir: str | Path) -> Iterator[list[int]]:
    """The first user turns of the fitting training-split conversations after the training selection (the first
    data.num_sequences of them, in its seeded order: lab/data/chat_data.py `fitting`)."""
    chat = chat_format(target.tokenizer, dcfg.template)
    pool, _ = conversations.split(source_conversations(dcfg, str(cache_dir)))
    fitting = 0
    for conv in conversations.select(pool, len(pool), SELECT_SEED, "data.num_sequences"):
        prompt = first_prompt(conv, chat)
        if len(prompt) > dcfg.seq_len - MIN_ASSISTANT_ROOM:
            continue
        fitting += 1
        if fitting > dcfg.num_sequences:
            yield prompt


def first_prompt(conv: conversations.Conversation, chat) -> list[int]:
    """A conversation's messages up to its first user turn, rendered up to the assistant's answer."""
    first_user = next(i for i, m in enumerate(conv.messages) if m["role"] == "user")
    return chat.prompt(conv.as_list()[: first_user + 1])


def check_room(tokenizer, dcfg: DictConfig, count: int) -> None:
    """Before any model loads (lab/preflight.py), code data only: enough rows of the training split beside the
    training sequences for `count` validation prompts (the data stage passes over duplicates; it says so too)."""
    needed = dcfg.num_sequences + count
    found = code_data.available(tokenizer, dcfg, False, needed)
    if found < needed and found >= dcfg.num_sequences:
        raise too_few(count, found - dcfg.num_sequences, dcfg)
