"""Evaluation suites: fixed, seeded prompt sets, the same for every arm.

Every suite is built from the same held-out excerpts (a request and the code it shows), so suites
differ only in what they claim to vary: `in_dist` renders them in the drafter's training template;
`template` in each template the drafter never saw; `system_prompt` behind each unseen system prompt;
`long_context` shows more code, up to several times the drafter's training length; `jsonl` reads
prompts prepared elsewhere. A suite's prompts carry a variant label (template, system prompt,
context length, jsonl category) so results can be broken down per variant.
"""

from __future__ import annotations

import functools
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig

from lab.config import ConfigError, DataSource, SuiteKind
from lab.data.chat_suites import ChatSuiteInputs, build_chat_prompts
from lab.data.code_data import corpus_files
from lab.data.conversations import jsonl_rows
from lab.target import chat
from lab.target.chat_template import HandChat, TokenizerChat

SUITE_SEED = 4321

# Unseen by a drafter trained without a system prompt; short and long ones (the target saw them all).
EVAL_SYSTEM_PROMPTS = [chat.SYSTEM_PROMPTS[i] for i in (1, 2, 4, 6)]


@dataclass
class Suite:
    name: str
    prompts: list[list[int]]  # token ids
    variants: list[str]  # per prompt: the template, system prompt, context length or category
    max_new_tokens: int
    texts: list[str] = field(default_factory=list)  # decoded prompts, for the record
    stop_ids: tuple[int, ...] = ()  # decoding ends after one of these (the target's eos), else at max_new_tokens

    def describe(self) -> dict:
        return {
            "name": self.name,
            "num_prompts": len(self.prompts),
            "variants": sorted(set(self.variants)),
            "prompt_lens": [min(map(len, self.prompts)), max(map(len, self.prompts))],
            "max_new_tokens": self.max_new_tokens,
            "stop_ids": list(self.stop_ids),
        }

    def records(self) -> list[dict]:
        """One row per prompt: what is logged as the suite's MLflow dataset."""
        return [
            {"variant": v, "num_tokens": float(len(p)), "text": t, "token_ids": json.dumps(p)}
            for p, v, t in zip(self.prompts, self.variants, self.texts, strict=True)
        ]


@functools.lru_cache(maxsize=4)
def _heldout_files(corpus_bytes: int) -> tuple[tuple[str, str, list[int]], ...]:
    """(path, text, line starts) of the held-out files, read once per process for every suite."""
    return tuple(
        (path, text, [i + 1 for i, ch in enumerate(text) if ch == "\n"])
        for path, text in corpus_files(corpus_bytes, heldout=True)
    )


@dataclass
class Excerpt:
    request: str
    code: list[int]


def excerpts(renderer: chat.Renderer, corpus_bytes: int, count: int, code_tokens: int, seed: int) -> list[Excerpt]:
    """`count` held-out code excerpts of exactly `code_tokens` tokens, each starting at a line start."""
    rng = random.Random(seed)
    files = list(_heldout_files(corpus_bytes))
    rng.shuffle(files)
    out: list[Excerpt] = []
    for _ in range(count * 4):  # a corpus with few long files yields several excerpts per file
        for path, text, lines in files:
            start = rng.choice([0, *lines[: max(1, len(lines) // 2)]])
            code = renderer.encode(text[start : start + 16 * code_tokens])  # ample text for that many tokens
            if len(code) >= code_tokens:
                out.append(Excerpt(chat.request_for(rng, path), code[:code_tokens]))
                if len(out) == count:
                    return out
    raise ValueError(
        f"data.corpus_bytes: the held-out files hold fewer than {count} excerpts of {code_tokens} tokens; "
        "raise data.corpus_bytes or lower the prompt lengths"
    )


def _render(renderer, template: str, system: str | None, ex: Excerpt) -> list[int]:
    return renderer.render(chat.TEMPLATES[template], chat.Conversation(system, ex.request, ex.code, None))[0]


def _code_budget(renderer, template: str, system: str | None, total: int, key: str) -> int:
    overhead = len(_render(renderer, template, system, Excerpt(chat.REQUESTS[0], [])))
    if total - overhead < 8:
        raise ConfigError(key, f"{total} tokens leave no room for code after the template ({overhead} tokens)")
    return total - overhead


def build_suite(name: str, tokenizer, cfg: DictConfig, chat_inputs: ChatSuiteInputs | None = None) -> Suite:
    """The prompts of suite `name` (`cfg.suites[name]`): from held-out code for data.source=code, from
    held-out conversations and the benchmarks otherwise (`chat_inputs`, lab/data/chat_suites.py)."""
    spec = cfg.suites[name]
    renderer = chat.Renderer(tokenizer)
    template, system = cfg.data.template, cfg.data.system_prompt
    n = spec.num_prompts or cfg.eval.num_prompts
    prompts: list[tuple[str, list[int]]] = []
    if spec.kind == SuiteKind.jsonl:
        fmt = chat_inputs.chat if chat_inputs and (spec.template or template) == template else None
        prompts = read_jsonl(Path(spec.path), renderer, spec.template or template, f"suites.{name}.path", fmt)
    elif cfg.data.source != DataSource.code:
        if chat_inputs is None:
            raise ValueError("suites of conversations need the held-out conversations (chat_inputs)")
        prompts = [(v, ids) for v, ids, _ in build_chat_prompts(name, spec, cfg, tokenizer, chat_inputs)]
    elif spec.kind in (SuiteKind.mtbench, SuiteKind.humaneval):
        raise ConfigError(f"suites.{name}.kind", f"{spec.kind.value} needs a chat target and data (e.g. data=sharegpt)")
    elif spec.kind == SuiteKind.long_context:
        for multiple in spec.context_multiples:
            total = multiple * cfg.data.seq_len
            budget = _code_budget(renderer, template, system, total, f"suites.{name}.context_multiples")
            for ex in excerpts(renderer, cfg.data.corpus_bytes, n, budget, SUITE_SEED + multiple):
                prompts.append((f"L{total}", _render(renderer, template, system, ex)))
    else:
        budget = _code_budget(renderer, template, system, cfg.eval.prompt_len, "eval.prompt_len")
        items = excerpts(renderer, cfg.data.corpus_bytes, n, budget, SUITE_SEED)
        if spec.kind == SuiteKind.in_dist:
            prompts = [(template, _render(renderer, template, system, ex)) for ex in items]
        elif spec.kind == SuiteKind.template:
            unseen = spec.templates or [t for t in chat.CORPUS_TEMPLATES if t != template]
            prompts = [(t, _render(renderer, t, system, ex)) for t in unseen for ex in items]
        elif spec.kind == SuiteKind.system_prompt:
            pool = spec.system_prompts or [p for p in EVAL_SYSTEM_PROMPTS if p != system]
            prompts = [(f"sp{i}", _render(renderer, template, p, ex)) for i, p in enumerate(pool) for ex in items]
    return Suite(
        name=name,
        prompts=[p for _, p in prompts],
        variants=[v for v, _ in prompts],
        max_new_tokens=cfg.eval.max_new_tokens,
        texts=[tokenizer.decode(p) for _, p in prompts],
        stop_ids=(tokenizer.eos_token_id,) if cfg.eval.stop_at_eos and tokenizer.eos_token_id is not None else (),
    )


def read_jsonl(
    path: Path, renderer: chat.Renderer, template: str, key: str, fmt: TokenizerChat | HandChat | None = None
) -> list[tuple[str, list[int]]]:
    """(category, prompt ids) per line: {"prompt": text} is used as is (after BOS); {"messages": [...]}
    is rendered in `template` (by `fmt` where given: the training data's format), ending where the
    assistant answers (a final assistant turn is dropped)."""
    out = []
    for row, messages in prompt_rows(path, key):
        if messages is None:
            ids = ([renderer.bos] if renderer.bos is not None else []) + renderer.encode(str(row["prompt"]))
        else:
            if fmt is not None:
                ids = fmt.prompt([{"role": m["role"], "content": str(m.get("content", ""))} for m in messages])
            else:
                turns = [(m["role"], str(m.get("content", "")), []) for m in messages]
                ids = renderer.render_turns(chat.TEMPLATES[template], turns)[0]
        out.append((str(row.get("category", "all")), ids))
    return out


def prompt_rows(path: Path, key: str) -> list[tuple[dict, list[dict] | None]]:
    """The rows of a jsonl suite's file, checked (no tokenizer needed: lab/preflight.py reads them before any
    work): each row and its messages up to the assistant's answer (None for a {"prompt": ...} row)."""
    out: list[tuple[dict, list[dict] | None]] = []
    for _, where, row in jsonl_rows(path, key):
        if not isinstance(row, dict) or not ("prompt" in row) ^ ("messages" in row):
            raise ConfigError(key, f"{where}: expected an object with either 'prompt' or 'messages'")
        if "prompt" in row:
            out.append((row, None))
            continue
        raw = row["messages"]
        messages = list(raw) if isinstance(raw, list) and all(isinstance(m, dict) for m in raw) else None
        if messages is None:
            raise ConfigError(key, f"{where}: messages: expected a list of role/content objects, got {raw!r:.60}")
        if messages and messages[-1].get("role") == "assistant":
            messages = messages[:-1]
        roles = {m.get("role") for m in messages}
        if not messages or not roles <= {"system", "user", "assistant"}:
            raise ConfigError(
                key, f"{where}: messages: expected roles among system/user/assistant, got {sorted(map(str, roles))}"
            )
        out.append((row, messages))
    if not out:
        raise ConfigError(key, f'{path} holds no prompts; expected one {{"prompt": ...}} or {{"messages": ...}} a line')
    return out
