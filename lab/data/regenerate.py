"""Regeneration: every assistant turn of a conversation replaced by the target's own greedy answer.

EAGLE-3's (and speculators') data recipe: a drafter is scored on predicting what its target says, so it learns
best from the target's own outputs. Turn i's prompt carries the target's earlier answers
(`chat.prompt(messages[:i])`), so a later turn follows the conversation the target itself would have had.
Turns go through a rolling pool (a conversation's next turn is asked for as soon as its last one is answered,
a finished conversation's place goes to the next), so the engine's batch stays full to the end; which
conversations share a step depends only on the conversations and the cache, never on timing. The cache holds
one part per chunk of conversations, published as the chunk finishes, so an interrupted run resumes and a
larger selection regenerates only its new chunks.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from lab.config import ConfigError
from lab.data.conversations import Conversation
from lab.fsutil import IDENTITY, Identity, atomic_file, entry_name, file_lock, read_manifest, sha256_file, short_hash
from lab.target.generate import Greedy, open_generator, resolve_backend, resolve_dtype

logger = logging.getLogger(__name__)

FORMAT = 2  # 2: parts named by their chunk's conversations, so selections share them
MANIFEST = "manifest.json"
CHUNK_CONVERSATIONS = 64


@dataclass
class RegenResult:
    conversations: list[Conversation]
    stats: dict  # hit, backend, generated_tokens, seconds, tokens_per_s, chunks_generated, ...
    path: Path | None = None
    cut: dict[str, str] = field(default_factory=dict)  # conversation id -> why it ends early (seq_len, empty)
    dropped: int = 0  # conversations of the first split left out at `seconds` (their chunks unfinished)


def chat_identity(chat: Any) -> Any:
    """What makes `chat` render the way it does: the tokenizer's jinja template, or lab's template and BOS."""
    from lab.target.chat_template import HandChat, TokenizerChat

    if isinstance(chat, TokenizerChat):
        return {"kind": "tokenizer", "template": chat.tokenizer.chat_template}
    if isinstance(chat, HandChat):
        return {"kind": "hand", "template": dataclasses.asdict(chat.template), "bos": chat.renderer.bos}
    if hasattr(chat, "identity"):
        return chat.identity
    raise TypeError(f"cannot key a regeneration cache on a chat format of type {type(chat).__name__}")


def conversations_hash(conversations: list[Conversation]) -> str:
    return short_hash([[c.id, list(c.messages)] for c in conversations], n=32)


def regen_identity(
    target: Any,
    chat: Any,
    max_new_tokens: int,
    seq_len: int,
    backend: str,
    dtype: str,
    chunk_size: int,
) -> Identity:
    return Identity(
        {
            "target": target.fingerprint,
            "chat": chat_identity(chat),
            "max_new_tokens": max_new_tokens,
            "seq_len": seq_len,
            "backend": backend,
            "dtype": dtype,
            "chunk_size": chunk_size,
            "format": FORMAT,
        }
    )


def cache_key(
    target: Any, chat: Any, max_new_tokens: int, seq_len: int, backend: str, dtype: str, chunk_size: int
) -> str:
    return regen_identity(target, chat, max_new_tokens, seq_len, backend, dtype, chunk_size).key()


def regenerate(
    target: Any,
    conversations: list[Conversation],
    chat: Any,
    *,
    max_new_tokens: int,
    seq_len: int,
    backend: str,
    cache_dir: str | Path,
    progress: bool = True,
    threads: int | None = None,
    dtype: str = "auto",
    chunk_size: int = CHUNK_CONVERSATIONS,
    splits: tuple[int, ...] = (),
    kv_cache: str = "auto",
    seconds: float | None = None,
) -> RegenResult:
    """`conversations` (same ids, same order) with every assistant turn the target's greedy answer; from the
    cache when the entry is complete. Up to `chunk_size` turns are under way at once, more where the generator
    serves more (`Greedy.rows`). In float32 the answers equal unbatched greedy decoding; in bfloat16 batching
    can tip a near-tie either way.

    No token is generated that the training sequence (`seq_len` tokens) would drop anyway:
    - a turn whose prompt already reaches `seq_len` tokens is not generated; the conversation ends before it,
      on the previous assistant turn. At the first assistant turn, the turn is kept with an empty answer
      (content ""), so that the conversation keeps its id and place and stays well formed;
    - an answer gets at most `min(max_new_tokens, seq_len - prompt length)` tokens;
    - an empty answer (the target ends its turn at once) is kept as "" and ends the conversation: a next turn
      would follow an assistant that said nothing, a conversation no one has.

    The cache: `{cache_dir}/regen/{key}/part_{chunk}.jsonl ... manifest.json`, one part per chunk of
    `chunk_size` conversations, named by the hash of its chunk's conversations and recorded with its sha256 in
    the manifest (checked on every load) and the seconds since the part before it. The part and then the
    manifest each go through a temp name, flushed and renamed, so a full disk or a kill leaves whole files
    only, and a part the manifest does not name yet is generated again. The manifest records what the key
    hashes (the entry's `Identity`); an entry that records another (copied or moved under this key) is refused
    in one line naming the field, never read nor regenerated over. The key hashes the target, the chat
    template, the generation settings and the backend (vLLM's bf16 and transformers' fp32 greedy answers
    differ). A selection is a seeded order cut at a count, so a larger selection starts with the smaller one's
    chunks; one whose chunks are all there is a hit that never runs the target. A file lock keeps two
    processes from regenerating the same entry at once. No chunk straddles an index in `splits` (where one
    selection ends and the next begins), so each selection's chunks are the same whatever follows it. `dtype`
    is vLLM's (the hf backend runs the loaded model as it is, and the key records that model's dtype
    instead); `kv_cache` is the hf backend's, which the key leaves out (both caches give the same tokens).

    With `seconds`, regeneration is cut that long after it began: no conversation before `splits[0]` (the
    training split) starts after it, those under way are left, and the result holds the chunks that finished,
    in order (`dropped` counts what was left out); the rest of the selection (the held-out split) is regenerated
    whole. The manifest records the cut (`cuts`, by the selection and `seconds`), so that every later call with
    the same selection and `seconds` (another arm of a study, the same study resumed elsewhere from a copied
    cache) has exactly these conversations, and regenerates nothing."""
    conversations = list(conversations)
    deadline = None if seconds is None else _now() + seconds
    backend = resolve_backend(backend)
    gen_dtype = resolve_dtype(dtype) if backend == "vllm" else str(target.model.dtype).removeprefix("torch.")
    identity = regen_identity(target, chat, max_new_tokens, seq_len, backend, gen_dtype, chunk_size)
    path = Path(cache_dir) / "regen" / identity.key()
    edges = sorted({0, len(conversations), *splits})
    chunks = [conversations[start:end] for start, end in _chunk_edges(edges, chunk_size)]
    names = [_part_name(chunk) for chunk in chunks]
    cut = Cut(names, seconds, [end <= splits[0] for _, end in _chunk_edges(edges, chunk_size)] if splits else [])
    started = time.time()
    run = {"generated_tokens": 0, "generation_seconds": 0.0, "chunks_generated": 0}

    manifest = _verified(path, identity)
    hit = _complete(manifest, cut.wanted(manifest))
    if not hit:
        with file_lock(path.with_suffix(".lock")):
            manifest = _verified(path, identity)  # another process may have finished (some of) it while we waited
            hit = _complete(manifest, cut.wanted(manifest))
            if not hit:
                manifest = _build(
                    target, chunks, cut, chat, path, identity, manifest, run, max_new_tokens, seq_len, backend,
                    gen_dtype, threads, progress, pool=chunk_size, kv_cache=kv_cache, deadline=deadline,
                )  # fmt: skip
    kept = cut.wanted(manifest)
    parts = [manifest["parts"][name] for name in kept]
    records = [r for part in parts for r in _read_part(path, part)]
    expected = [c.id for chunk, name in zip(chunks, names, strict=True) if name in kept for c in chunk]
    if [r["id"] for r in records] != expected:
        raise RuntimeError(f"regeneration cache {path}: stored conversation ids differ from the requested ones")
    out = [Conversation(r["id"], tuple(r["messages"])) for r in records]
    ended = {r["id"]: r["cut"] for r in records if r["cut"]}
    dropped = len(conversations) - len(out)
    stats = _stats(hit, backend, gen_dtype, out, run, started, len(chunks), parts, ended)
    if cut.seconds is not None:
        stats["cut_seconds"], stats["cut_dropped"] = cut.seconds, dropped
        if dropped:
            said = f"{len(out)} of {len(conversations)} conversations"
            logger.info(f"regenerate: cut at {cut.seconds:g} s (data.regenerate_seconds): {said}")
    return RegenResult(out, stats, path, ended, dropped)


def _stats(
    hit: bool,
    backend: str,
    dtype: str,
    out: list[Conversation],
    run: dict[str, Any],
    started: float,
    chunks: int,
    parts: list[dict],
    ended: dict[str, str],
) -> dict[str, Any]:
    """What a regeneration logs: what this call generated and loaded, and over the selection's `parts`, whichever
    runs produced them, what a hit saves; `ended` holds the conversations cut short, by why."""
    seconds = run["generation_seconds"]
    return {
        "hit": hit,
        "backend": backend,
        "dtype": dtype,
        "conversations": len(out),
        "generated_tokens": run["generated_tokens"],
        "seconds": time.time() - started,
        "generation_seconds": seconds,
        "tokens_per_s": run["generated_tokens"] / seconds if seconds > 0 else 0.0,
        "chunks_generated": run["chunks_generated"],
        "chunks_loaded": chunks - run["chunks_generated"],
        "total_generated_tokens": sum(p["generated_tokens"] for p in parts),
        "total_generation_seconds": sum(p["seconds"] for p in parts),
        "cut_seq_len": sum(v == "seq_len" for v in ended.values()),
        "cut_empty": sum(v == "empty" for v in ended.values()),
    }


def _now() -> float:
    """The clock of `seconds`: monotonic, whatever the wall clock does."""
    return time.monotonic()


def _chunk_edges(edges: list[int], chunk_size: int) -> list[tuple[int, int]]:
    """The (start, end) of each chunk: `chunk_size` conversations, none straddling one of `edges`."""
    return [
        (i, min(i + chunk_size, end)) for start, end in itertools.pairwise(edges) for i in range(start, end, chunk_size)
    ]


def _part_name(chunk: list[Conversation]) -> str:
    return f"part_{conversations_hash(chunk)[:16]}.jsonl"


@dataclass
class Cut:
    """Which chunks of a selection a call wants: all of them, or with `seconds` those a cut at that time kept.
    `cuttable[i]`: chunk i belongs to the split a cut may leave unfinished (the training split)."""

    names: list[str]  # every chunk's part, in the selection's order
    seconds: float | None
    cuttable: list[bool]

    @property
    def key(self) -> str:
        """The cut's entry in the manifest's `cuts`: the selection's parts and the seconds."""
        return short_hash([self.names, self.seconds], n=16)

    def wanted(self, manifest: dict | None) -> list[str]:
        """The parts this call reads: those of a cut recorded for it, else every one."""
        record = (manifest or {}).get("cuts", {}).get(self.key) if self.seconds is not None else None
        return self.names if record is None else [n for n in self.names if n in set(record["parts"])]

    def may_drop(self, index: int) -> bool:
        return self.seconds is not None and bool(self.cuttable) and self.cuttable[index]

    def record(self, manifest: dict, dropped: set[int]) -> None:
        """Note in `manifest` the parts kept when the chunks `dropped` were left unfinished."""
        kept = [name for i, name in enumerate(self.names) if i not in dropped]
        manifest.setdefault("cuts", {})[self.key] = {"seconds": self.seconds, "parts": kept}


def _verified(path: Path, identity: Identity | None = None) -> dict | None:
    """The manifest with only the parts whose files match their recorded hash (the rest are redone). An entry
    that records another identity than `identity` is refused (ConfigError): its parts are whole generations for
    its own key, the costliest entry of a cache, and regenerating over them would throw them away."""
    manifest = read_manifest(path, MANIFEST)
    if manifest is None:
        return None
    wrong = identity.mismatch(manifest) if identity is not None else None
    if wrong is not None:
        own = f"regen/{Identity(manifest[IDENTITY]).key()}"
        raise ConfigError(
            "cache_dir", f"cache entry {entry_name(path)}: {wrong}; it belongs at {own}: move it there or delete it"
        )
    good = {}
    for name, part in manifest.get("parts", {}).items():
        if (path / name).is_file() and sha256_file(path / name) == part["sha256"]:
            good[name] = part
        else:
            logger.warning(
                f"regeneration cache: {path / name} is missing or does not match its manifest hash; redoing it"
            )
    manifest["parts"] = good
    return manifest


def _complete(manifest: dict | None, names: list[str]) -> bool:
    return manifest is not None and all(name in manifest["parts"] for name in names)


def _read_part(path: Path, part: dict) -> list[dict]:
    return [json.loads(line) for line in (path / part["file"]).read_text(encoding="utf-8").splitlines() if line]


def _build(
    target, chunks, cut, chat, path, identity, manifest, run, max_new_tokens, seq_len, backend, dtype, threads,
    progress, pool, kv_cache, deadline,
) -> dict:  # fmt: skip
    path.mkdir(parents=True, exist_ok=True)
    manifest = manifest or {
        "key": path.name,
        "format": FORMAT,
        "target": target.fingerprint,
        "backend": backend,
        "dtype": dtype,
        "max_new_tokens": max_new_tokens,
        "seq_len": seq_len,
        IDENTITY: identity.fields,
        "parts": {},
    }
    names = cut.names
    todo = [i for i, name in enumerate(names) if name not in manifest["parts"]]
    if not todo:  # nothing to generate (no conversations): no reason to start an engine
        _write_manifest(path, manifest)
        return manifest
    turns = sum(c.assistant_turns for i in todo for c in chunks[i])
    last = 0.0  # when the part before was published (or generation began)

    def publish(index: int, records: list[dict]) -> None:
        nonlocal last
        seconds, last = time.perf_counter() - last, time.perf_counter()
        tokens = _publish_part(path, manifest, names[index], records, seconds)
        run["generated_tokens"] += tokens
        run["generation_seconds"] += seconds
        run["chunks_generated"] += 1
        rate = run["generated_tokens"] / max(run["generation_seconds"], 1e-9)
        bar.set_postfix(tok_s=f"{rate:.0f}")
        if not progress:  # a log without bars still says how far a long regeneration is
            logger.info(f"regenerate: {run['chunks_generated']} of {len(todo)} chunks, {rate:.0f} tokens/s")

    with (
        tqdm(total=turns, desc="regenerate", unit="turn", disable=not progress) as bar,
        open_generator(
            target,
            backend,
            threads=threads,
            progress=progress,
            dtype=dtype,
            log_path=path.with_suffix(".log"),
            kv_cache=kv_cache,
        ) as generate,
    ):
        last = time.perf_counter()  # the engine's start-up is no part's time
        stop = Stop(deadline, [cut.may_drop(i) for i in todo])
        _regenerate(generate, chat, target.tokenizer, [chunks[i] for i in todo], max_new_tokens, seq_len,
                    max(pool, generate.rows(seq_len)), lambda k, records: publish(todo[k], records), bar,
                    stop)  # fmt: skip
    if stop.dropped:
        cut.record(manifest, {todo[k] for k in stop.dropped})
        _write_manifest(path, manifest)
    return manifest


@dataclass
class Stop:
    """When regeneration stops starting conversations (`deadline`, on `_now`'s clock), and of which
    chunks (`droppable`); `dropped` holds the chunks it left unfinished."""

    deadline: float | None
    droppable: list[bool]
    dropped: set[int] = field(default_factory=set)

    def due(self) -> bool:
        return self.deadline is not None and _now() >= self.deadline

    def drop(self, left: list[int]) -> None:
        """Leave every droppable chunk with conversations still to finish (`left`), once."""
        self.dropped = {k for k, n in enumerate(left) if n and self.droppable[k]}
        self.deadline = None


def _publish_part(path: Path, manifest: dict, name: str, records: list[dict], seconds: float) -> int:
    """Write a finished chunk's part and record it in the manifest; its generated tokens."""
    with atomic_file(path / name) as tmp:
        tmp.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    tokens = sum(r["generated_tokens"] for r in records)
    manifest["parts"][name] = {
        "file": name,
        "sha256": sha256_file(path / name),
        "conversations": len(records),
        "generated_tokens": tokens,
        "seconds": seconds,
    }
    _write_manifest(path, manifest)
    return tokens


def _write_manifest(path: Path, manifest: dict) -> None:
    with atomic_file(path / MANIFEST) as tmp:
        tmp.write_text(json.dumps(manifest, indent=1))


def _regenerate(
    generate: Greedy,
    chat: Any,
    tokenizer: Any,
    chunks: list[list[Conversation]],
    max_new_tokens: int,
    seq_len: int,
    pool: int,
    publish: Callable[[int, list[dict]], None],
    bar: Any = None,
    stop: Stop | None = None,
) -> None:
    """Every chunk's records ({id, messages, generated_tokens, cut}), handed to `publish(chunk index, records)`
    as the chunk's last conversation ends, with up to `pool` turns under way at once: conversations already
    under way take a free place first, then the next one in order. Once `stop` is due, the chunks it may drop
    that have not finished are left: none of their turns is asked for again."""
    stop = stop or Stop(None, [])
    states = [[_state(c) for c in chunk] for chunk in chunks]
    waiting = deque((k, s) for k, chunk in enumerate(states) for s in chunk)  # not yet started
    ready: deque = deque()  # under way, their next turn to ask for
    left = [len(chunk) for chunk in chunks]
    running: dict[int, tuple[int, dict]] = {}  # request id -> (chunk, conversation)
    next_id = 0
    while waiting or ready or running:
        if stop.due():
            stop.drop(left)
            waiting = deque(item for item in waiting if item[0] not in stop.dropped)
            ready = deque(item for item in ready if item[0] not in stop.dropped)
        add = {}
        while len(running) < pool and (ready or waiting):
            k, s = (ready or waiting).popleft()
            request = _next_turn(s, chat, max_new_tokens, seq_len, bar)
            if request is None:  # the conversation is over
                left[k] -= 1
                if not left[k]:
                    publish(k, [_record(done) for done in states[k]])
                continue
            running[next_id] = (k, s)
            add[next_id] = request
            next_id += 1
        if not running:
            continue
        for key, ids in sorted(generate.stream(add).items()):
            k, s = running.pop(key)
            _answer(s, tokenizer.decode(ids, skip_special_tokens=True).strip(), len(ids), bar)
            if k not in stop.dropped:
                ready.append((k, s))


def _state(conversation: Conversation) -> dict:
    return {
        "id": conversation.id,
        "messages": conversation.as_list(),
        "turns": [i for i, m in enumerate(conversation.messages) if m["role"] == "assistant"],
        "turn": 0,  # the next assistant turn to generate, counted from 0
        "keep": len(conversation.messages),  # messages kept: all, unless the conversation is cut
        "generated_tokens": 0,
        "cut": None,
    }


def _next_turn(state: dict, chat: Any, max_new_tokens: int, seq_len: int, bar: Any) -> tuple[list[int], int] | None:
    """The (prompt, max new tokens) of the conversation's next assistant turn; None when it is over (all turns
    answered, or cut here because the prompt already fills the sequence)."""
    turn = state["turn"]
    if state["cut"] or turn >= len(state["turns"]):
        return None
    i = state["turns"][turn]
    prompt = chat.prompt(state["messages"][:i])
    if len(prompt) >= seq_len:
        _cut(state, turn, "seq_len", bar)
        if turn == 0:
            state["messages"][i]["content"] = ""
        return None
    return prompt, min(max_new_tokens, seq_len - len(prompt))


def _answer(state: dict, text: str, tokens: int, bar: Any) -> None:
    state["messages"][state["turns"][state["turn"]]]["content"] = text
    state["generated_tokens"] += tokens
    state["turn"] += 1
    if not text:
        _cut(state, state["turn"], "empty", bar)
    if bar is not None:
        bar.update(1)


def _record(state: dict) -> dict:
    return {
        "id": state["id"],
        "messages": state["messages"][: state["keep"]],
        "generated_tokens": state["generated_tokens"],
        "cut": state["cut"],
    }


def _cut(state: dict, keep_turns: int, why: str, bar: Any) -> None:
    """End the conversation after its first `keep_turns` assistant turns (at least the first, kept even empty)."""
    turns = state["turns"]
    state["keep"] = turns[max(keep_turns, 1) - 1] + 1
    if keep_turns < len(turns):
        state["cut"] = why
        if bar is not None:  # the turns that will never be generated
            bar.total -= len(turns) - keep_turns
            bar.refresh()
