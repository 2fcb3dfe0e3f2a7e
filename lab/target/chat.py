"""Chat templates, system prompts and conversations cut from the corpus.

The target learns the corpus raw and wrapped in every template here (with and without a system
prompt), so it is at home in all of them; the drafter trains on ONE template and is evaluated on the
others. Rendering works in token space, one segment at a time (markers, then content), so a prompt
tokenizes the same way in training data, evaluation suites and the target's corpus, and the
assistant's tokens are known exactly (the drafter's loss mask).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache

from lab.config import TEMPLATE_NAMES


@dataclass(frozen=True)
class ChatTemplate:
    name: str
    user: str  # "{content}" marks where the message goes
    assistant: str
    system: str | None  # None: the template has no system role; the system prompt opens the user turn

    def parts(self, role: str) -> tuple[str, str]:
        """(text before, text after) the content of a turn."""
        before, after = getattr(self, role).split("{content}")
        return before, after


TEMPLATES: dict[str, ChatTemplate] = {
    t.name: t
    for t in (
        ChatTemplate(
            "chatml",
            user="<|im_start|>user\n{content}<|im_end|>\n",
            assistant="<|im_start|>assistant\n{content}<|im_end|>\n",
            system="<|im_start|>system\n{content}<|im_end|>\n",
        ),
        ChatTemplate(
            "llama3",
            user="<|start_header_id|>user<|end_header_id|>\n\n{content}<|eot_id|>",
            assistant="<|start_header_id|>assistant<|end_header_id|>\n\n{content}<|eot_id|>",
            system="<|start_header_id|>system<|end_header_id|>\n\n{content}<|eot_id|>",
        ),
        ChatTemplate(
            "plain",
            user="### User:\n{content}\n\n",
            assistant="### Assistant:\n{content}\n\n",
            system="### System:\n{content}\n\n",
        ),
        ChatTemplate(
            "markdown",
            user="**User:**\n```text\n{content}\n```\n\n",
            assistant="**Assistant:**\n```python\n{content}\n```\n\n",
            system="> **System:** {content}\n\n",
        ),
        ChatTemplate(
            "gemma",
            user="<start_of_turn>user\n{content}<end_of_turn>\n",
            assistant="<start_of_turn>model\n{content}<end_of_turn>\n",
            system=None,
        ),
        ChatTemplate("mistral", user="[INST] {content} [/INST]", assistant="{content}</s>", system=None),
        ChatTemplate(
            "phi3",
            user="<|user|>\n{content}<|end|>\n",
            assistant="<|assistant|>\n{content}<|end|>\n",
            system="<|system|>\n{content}<|end|>\n",
        ),
        ChatTemplate(
            "vicuna", user="USER: {content}\n", assistant="ASSISTANT: {content}</s>\n", system="{content}\n\n"
        ),
        ChatTemplate("user_assistant", user="User: {content}\n", assistant="Assistant: {content}\n", system=None),
    )
}
if tuple(TEMPLATES) != TEMPLATE_NAMES:  # validation (lab/config/validation.py) knows the templates by name only
    raise ImportError(f"lab.config.TEMPLATE_NAMES must name these templates, in this order: {tuple(TEMPLATES)}")

# The templates of the tiny targets' corpus (lab/target/build.py): a built target knows all of these and no
# other, so its cache key stays valid when a template is added above.
CORPUS_TEMPLATES = ("chatml", "llama3", "plain", "markdown", "gemma", "mistral", "phi3", "vicuna")

# The target sees all of these; the drafter's data uses none by default, so every one is unseen by it.
SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are an expert Python programmer. Answer with code only.",
    "You are a careful senior engineer reviewing and completing code in the Python standard library. "
    "Keep the existing style, naming and docstring conventions, and never change public behaviour.",
    "Reply in Python. Keep functions short.",
    "You are a coding assistant inside an editor. The user shows you the beginning of a file; continue it "
    "exactly where it stops. Do not repeat the given code, do not add explanations, and keep indentation "
    "consistent with the surrounding block. If the file defines classes, follow their method order.",
    "You write clear, well-tested library code.",
    "System notice: responses are logged for quality review. Be concise, be correct, and prefer the "
    "standard library over third-party packages. Follow PEP 8. Use type hints where the file already does.",
    "Act as a pair programmer.",
]

REQUESTS = [
    "Continue this Python code.",
    "Here is the start of `{path}`. Write what comes next.",
    "Finish the following module.",
    "Complete the code below:",
    "What follows in this file?",
    "Please continue `{path}` from where it stops.",
    "Write the rest of this code.",
    "Keep going:",
]


@dataclass
class Conversation:
    system: str | None
    user: str  # the request; the code excerpt follows it, as token ids, in `user_ids`
    user_ids: list[int]
    assistant_ids: list[int] | None  # None: a prompt that stops where the assistant starts


class Renderer:
    """Renders conversations to (token ids, assistant mask) with one tokenizer, segment by segment."""

    def __init__(self, tokenizer, bos: bool = True):
        self.tokenizer = tokenizer
        self.bos = tokenizer.bos_token_id if bos else None
        self.eos = tokenizer.eos_token_id
        self._encode = lru_cache(maxsize=4096)(self._encode_uncached)

    def _encode_uncached(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else ()

    def encode(self, text: str) -> list[int]:
        return list(self._encode(text))

    def render_turns(
        self, template: ChatTemplate, turns: list[tuple[str, str, list[int]]], open_assistant: bool = True
    ) -> tuple[list[int], list[int]]:
        """ids = BOS, then each (role, text, ids) turn in the template's markers, then (with
        `open_assistant`) the opening of the assistant's turn; mask marks the assistant's ids and closing
        (what a drafter is trained to predict). A turn's text is encoded together with the marker before
        it (and, without ids, with the one after: the way the target's corpus was tokenized). A system
        turn in a template without a system role opens the next user turn instead."""
        ids, mask = ([self.bos], [0]) if self.bos is not None else ([], [])

        def add(piece, masked: bool = False) -> None:
            ids.extend(piece)
            mask.extend([int(masked)] * len(piece))

        carried = ""
        for role, text, content in turns:
            if role == "system" and template.system is None:
                carried = text + "\n\n"
                continue
            if role == "user":
                text, carried = carried + text, ""
            before, after = template.parts(role)
            if not content:
                add(self._encode(before + text + after))
                continue
            is_assistant = role == "assistant"
            add(self._encode(before + text))
            add(content, is_assistant)
            add(self._encode(after), is_assistant)
        if open_assistant:
            add(self._encode(template.parts("assistant")[0]))
        return ids, mask

    def render(self, template: ChatTemplate, conv: Conversation) -> tuple[list[int], list[int]]:
        """The conversation's ids and mask; with `assistant_ids` None it ends where the assistant starts."""
        turns = [("system", conv.system, [])] if conv.system is not None else []
        turns.append(("user", conv.user + "\n", conv.user_ids))
        if conv.assistant_ids is not None:
            turns.append(("assistant", "", conv.assistant_ids))
        return self.render_turns(template, turns, open_assistant=conv.assistant_ids is None)


def render_text(template: ChatTemplate, system: str | None, user: str, code: str, answer: str) -> str:
    """The same conversation as text (without BOS): what the tokenizer is trained on."""
    request = user + "\n"
    out = ""
    if system is not None and template.system is not None:
        out += template.system.replace("{content}", system)
    elif system is not None:
        request = system + "\n\n" + request
    before, after = template.parts("user")
    out += before + request + code + after
    return out + template.assistant.replace("{content}", answer)


def request_for(rng: random.Random, path: str) -> str:
    return rng.choice(REQUESTS).replace("{path}", path)


def split_chunks(text: str, rng: random.Random, min_chars: int, max_chars: int) -> list[str]:
    """Consecutive line-aligned pieces of `text` of random length in [min_chars, max_chars]."""
    lines = text.splitlines(keepends=True)
    chunks, current, size, goal = [], [], 0, rng.randint(min_chars, max_chars)
    for line in lines:
        current.append(line)
        size += len(line)
        if size >= goal:
            chunks.append("".join(current))
            current, size, goal = [], 0, rng.randint(min_chars, max_chars)
    if current:
        chunks.append("".join(current))
    return [c for c in chunks if c.strip()]


def split_at_line(text: str, fraction: float) -> tuple[str, str]:
    """(head, tail) cut at the line boundary nearest to `fraction` of the text."""
    cut = text.rfind("\n", 0, max(1, int(len(text) * fraction))) + 1
    if cut <= 0 or cut >= len(text):
        cut = len(text) // 2
    return text[:cut], text[cut:]


@dataclass
class ChatDocument:
    """A corpus chunk as a conversation: the user shows the head of the chunk, the assistant the rest."""

    template: str
    system: str | None
    request: str
    code: str
    answer: str

    def text(self) -> str:
        return render_text(TEMPLATES[self.template], self.system, self.request, self.code, self.answer)

    def ids(self, renderer: Renderer) -> list[int]:
        conv = Conversation(self.system, self.request, renderer.encode(self.code), renderer.encode(self.answer))
        return renderer.render(TEMPLATES[self.template], conv)[0]


def chat_documents(
    files: list[tuple[str, str]],
    seed: int,
    templates: list[str],
    system_prompts: list[str],
    system_share: float,
    min_chars: int,
    max_chars: int,
    raw_share: float = 0.0,
) -> list[str | ChatDocument]:
    """Every chunk of every (path, text) file: raw text with probability `raw_share`, otherwise a
    conversation in a seeded random template, with a system prompt with probability `system_share`."""
    rng = random.Random(seed)
    docs: list[str | ChatDocument] = []
    for path, text in files:
        for chunk in split_chunks(text, rng, min_chars, max_chars):
            if rng.random() < raw_share:
                docs.append(chunk)
                continue
            code, answer = split_at_line(chunk, rng.uniform(0.15, 0.75))
            system = rng.choice(system_prompts) if system_prompts and rng.random() < system_share else None
            docs.append(ChatDocument(rng.choice(templates), system, request_for(rng, path), code, answer))
    return docs


def document_text(doc: str | ChatDocument) -> str:
    return doc if isinstance(doc, str) else doc.text()


def document_ids(renderer: Renderer, doc: str | ChatDocument) -> list[int]:
    """BOS + the document's tokens (raw, or the rendered conversation) + EOS."""
    if isinstance(doc, str):
        body = ([renderer.bos] if renderer.bos is not None else []) + renderer.encode(doc)
    else:
        body = doc.ids(renderer)
    return body + ([renderer.eos] if renderer.eos is not None else [])
