"""The target's side of a suite's evaluation, computed once: its greedy answer to every prompt, and its captured
layers and top-1 over prompt + answer, which the replay (lab/eval/replay.py) reads instead of decoding.

At temperature 0 the decoded text is the target's greedy answer whatever the drafter, so every arm and seed of
a study shares it. An answer runs to the first stop token (kept) or `length` tokens: `length` is the suite's
max_new_tokens plus the deepest k, because the decoder's last round verifies its drafts against the target
beyond max_new_tokens before it cuts the output.

Layout, as the held-out states beside it (lab/data/cache.py): `{cache_dir}/answers/{key}/answers.safetensors`
(`input_ids` [N, T] int32 right-padded, `lengths` and `prompt_lens` [N], `aux` [N, T, A*H] in the target's
dtype, `top` [N, T] int32) with a sha256 manifest, published whole under a lock. The key hashes the target
fingerprint, its dtype and device kind, the prompts' token ids, the length, the stop ids and the captured
layers, and the manifest records them (the entry's `Identity`). An entry whose file no longer matches its
manifest, or that records another identity (an entry copied or moved under this key), is computed again (one
line says so); one whose stored prompts differ from the suite's is refused in one line.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from lab.data.cache import capture_heldout, publish_tensors, verified_or_built
from lab.fsutil import Identity
from lab.target import Target
from lab.target.generate import HF_BATCH, greedy_batch

ANSWERS_FORMAT = 1
FILE = "answers.safetensors"


@dataclass
class Answers:
    """Per prompt: `sequences[i]` = prompt + greedy answer, `prompt_lens[i]`, `top[i][t]` the target's top-1
    after position t; `aux` [N, T, A*H] the captured layers (right-padded to the longest sequence)."""

    sequences: list[list[int]]
    prompt_lens: list[int]
    top: list[list[int]]
    aux: torch.Tensor
    path: Path | None = None
    hit: bool = False

    def __len__(self) -> int:
        return len(self.sequences)

    @property
    def disagreements(self) -> int:
        """Answer tokens that differ from the teacher-forced top-1 before them (0 in float32, where batched
        generation and the forward agree; a near tie in a low precision can flip)."""
        return sum(
            t != s
            for seq, top, plen in zip(self.sequences, self.top, self.prompt_lens, strict=True)
            for t, s in zip(top[plen - 1 : len(seq) - 1], seq[plen:], strict=True)
        )


def length_groups(lengths: list[int], size: int = HF_BATCH, spread: float = 1.5, slack: int = 256) -> list[list[int]]:
    """Indices in batches of at most `size`, shortest first. A batch is padded to its longest row, so a row more
    than `spread` x and `slack` tokens longer than the batch's first starts a new one: a long_context suite's
    2x, 4x and 8x prompts each get their own batch rather than all computing at the longest's width, while
    prompts of a few dozen tokens' difference stay together (each batch costs its own decoding steps)."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        first = lengths[groups[-1][0]] if groups else 0
        if groups and len(groups[-1]) < size and (lengths[i] <= spread * first or lengths[i] - first <= slack):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def greedy_answers(model, prompts: list[list[int]], length: int, eos: int) -> list[list[int]]:
    """Each prompt's greedy answer in one batch, to its first `eos` (kept) or `length` tokens."""
    outs = greedy_batch(model, prompts, [length] * len(prompts), eos)
    return [out + [eos] if len(out) < length else out for out in outs]  # greedy_batch drops the eos it stopped at


@torch.no_grad()
def compute_answers(
    target: Target, prompts: list[list[int]], length: int, stop_ids: tuple[int, ...], aux_layers: list[int]
) -> Answers:
    """Greedy answers (`greedy_batch`), then one capture over prompt + answer, in batches of similar length."""
    if len(stop_ids) > 1:
        raise ValueError(f"greedy answers stop at one token; got stop ids {list(stop_ids)}")
    eos = stop_ids[0] if stop_ids else -1  # -1: no token ends an answer
    sequences: list[list[int]] = [[] for _ in prompts]
    aux: list[torch.Tensor | None] = [None] * len(prompts)
    top: list[list[int]] = [[] for _ in prompts]
    for rows in length_groups([len(p) for p in prompts]):
        for i, answer in zip(rows, greedy_answers(target.model, [prompts[i] for i in rows], length, eos), strict=True):
            sequences[i] = prompts[i] + answer
        ids = torch.zeros(len(rows), max(len(sequences[i]) for i in rows), dtype=torch.long)  # right-padded
        for j, i in enumerate(rows):
            ids[j, : len(sequences[i])] = torch.tensor(sequences[i])
        group_aux, group_top = capture_heldout(target, ids, aux_layers)
        for j, i in enumerate(rows):
            aux[i], top[i] = group_aux[j, : len(sequences[i])], group_top[j, : len(sequences[i])].tolist()
    width = max(map(len, sequences))
    padded = torch.zeros(len(prompts), width, aux[0].shape[-1], dtype=aux[0].dtype)  # a position reads those before it
    for i, states in enumerate(aux):
        padded[i, : len(states)] = states
    return Answers(sequences, [len(p) for p in prompts], top, padded)


def answers_identity(
    target: Target, prompts: list[list[int]], length: int, stop_ids, aux_layers: list[int]
) -> Identity:
    return Identity(
        {
            "target": target.fingerprint,
            "dtype": str(target.lm_head_weight.dtype),
            "device": target.device.type,
            "prompts": hashlib.sha256(json.dumps(prompts).encode()).hexdigest(),
            "length": length,
            "stop_ids": list(stop_ids),
            "aux": list(aux_layers),
            "format": ANSWERS_FORMAT,
        }
    )


def answers_key(target: Target, prompts: list[list[int]], length: int, stop_ids, aux_layers: list[int]) -> str:
    return answers_identity(target, prompts, length, stop_ids, aux_layers).key()


def suite_answers(
    target: Target,
    prompts: list[list[int]],
    length: int,
    stop_ids: tuple[int, ...],
    aux_layers: list[int],
    cache_dir: str | Path,
) -> Answers:
    """The prompts' `Answers` from the cache, or computed once (under a lock, published whole)."""
    identity = answers_identity(target, prompts, length, stop_ids, aux_layers)
    path = Path(cache_dir) / "answers" / identity.key()
    build = functools.partial(_build, target, prompts, length, stop_ids, aux_layers, path, identity)
    _, hit = verified_or_built(path, build, identity)
    stored = load_file(str(path / FILE))
    lengths, plens = stored["lengths"].tolist(), stored["prompt_lens"].tolist()
    ids, top = stored["input_ids"].tolist(), stored["top"].tolist()
    sequences = [row[:n] for row, n in zip(ids, lengths, strict=True)]
    if [s[:p] for s, p in zip(sequences, plens, strict=True)] != prompts:
        raise RuntimeError(f"answer cache {path / FILE}: stored prompts differ from the suite's; delete {path}")
    tops = [row[:n] for row, n in zip(top, lengths, strict=True)]
    return Answers(sequences, plens, tops, stored["aux"], path, hit)


def _build(target, prompts, length, stop_ids, aux_layers, path: Path, identity: Identity) -> dict:
    answers = compute_answers(target, prompts, length, stop_ids, aux_layers)
    return write_answers(answers, path, path.name, target.fingerprint, aux_layers, length, identity)


def write_answers(
    answers: Answers,
    path: Path,
    key: str,
    fingerprint: str,
    aux_layers: list[int],
    length: int,
    identity: Identity | None = None,
) -> dict:
    """Publish `answers` whole as the entry `path`, with its manifest (recording `identity`, where given)."""
    width = answers.aux.shape[1]
    tensors = {
        "input_ids": torch.tensor([s + [0] * (width - len(s)) for s in answers.sequences], dtype=torch.int32),
        "lengths": torch.tensor([len(s) for s in answers.sequences]),
        "prompt_lens": torch.tensor(answers.prompt_lens),
        "aux": answers.aux.contiguous(),
        "top": torch.tensor([t + [0] * (width - len(t)) for t in answers.top], dtype=torch.int32),
    }
    return publish_tensors(
        path,
        FILE,
        tensors,
        identity,
        key=key,
        format=ANSWERS_FORMAT,
        target=fingerprint,
        aux_layers=list(aux_layers),
        num_prompts=len(answers),
        length=length,
        disagreements=answers.disagreements,
    )
