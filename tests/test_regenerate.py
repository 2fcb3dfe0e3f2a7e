"""Regeneration (lab/data/regenerate.py) on the micro target: answers equal the target's own unbatched greedy
decoding, runs are deterministic, a complete cache entry is a hit that never runs the target, an interrupted
run resumes from its finished chunks, later turns follow the target's earlier answers, and conversations
stop where the training sequence would."""

from __future__ import annotations

import contextlib
import importlib.util

import pytest
import torch
from helpers import logged, traced_steps

from lab.data import regenerate as regen
from lab.data.conversations import Conversation
from lab.target.chat_template import HandChat

MAX_NEW = 8
SEQ_LEN = 512


def conv(cid: str, *pairs: tuple[str, str], system: str | None = None) -> Conversation:
    messages = [{"role": "system", "content": system}] if system else []
    for user, assistant in pairs:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return Conversation(cid, tuple(messages))


CONVERSATIONS = [
    conv("a", ("Write a function that adds two numbers.", "def add(a, b): return a + b")),
    conv(
        "b",
        ("Write a class for a stack.", "class Stack: pass"),
        ("Now add a push method.", "def push(self, x): self.items.append(x)"),
        system="You are a helpful assistant.",
    ),
    conv(
        "c",
        ("import os", "import sys"),
        ("def main():", "    pass"),
        ("Finish the module.", "if __name__ == '__main__':"),
    ),
    conv("d", ("Continue this Python code.\nfor i in range(10):", "    print(i)")),
    conv("e", ("Keep going:\nclass Node:\n    def __init__(self):", "        self.next = None")),
]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run fastest on one thread; on a busy machine, two OpenMP threads spin-wait on each other."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture()
def chat(micro_target):
    return HandChat(micro_target.tokenizer, "chatml")  # the micro tokenizer has no chat template of its own


def run(target, chat, cache_dir, conversations=CONVERSATIONS, **kw):
    kw = {"max_new_tokens": MAX_NEW, "seq_len": SEQ_LEN, "backend": "hf", "progress": False, "threads": 1, **kw}
    return regen.regenerate(target, conversations, chat, cache_dir=cache_dir, **kw)


def plain_greedy(model, prompt: list[int], max_new: int, eos: int) -> list[int]:
    """One sequence, no cache, no padding: the reference the batched backends must reproduce."""
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(max_new):
            token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            if token == eos:
                break
            out.append(token)
            ids.append(token)
    return out


def test_answers_are_the_targets_own_greedy_decoding(micro_target, chat, tmp_path):
    result = run(micro_target, chat, tmp_path, chunk_size=2)
    tok = micro_target.tokenizer
    assert [c.id for c in result.conversations] == [c.id for c in CONVERSATIONS]
    assert result.stats["hit"] is False and result.stats["backend"] == "hf" and result.stats["generated_tokens"] > 0
    assert max(c.assistant_turns for c in result.conversations) >= 2
    for original, new in zip(CONVERSATIONS, result.conversations, strict=True):
        # the same turns, or a start of them that ends on an assistant turn (an empty answer ends it)
        assert [m["role"] for m in new.messages] == [m["role"] for m in original.messages[: len(new.messages)]]
        assert new.messages[-1]["role"] == "assistant"
        if len(new.messages) < len(original.messages):
            assert result.cut[new.id] == "empty" and new.messages[-1]["content"] == ""
        for i, m in enumerate(new.messages):
            if m["role"] != "assistant":
                assert m == original.messages[i]
                continue
            prompt = chat.prompt(list(new.messages[:i]))  # with the target's own earlier answers
            ref = plain_greedy(micro_target.model, prompt, min(MAX_NEW, SEQ_LEN - len(prompt)), tok.eos_token_id)
            assert m["content"] == tok.decode(ref, skip_special_tokens=True).strip(), (new.id, i)
            assert m["content"] != original.messages[i]["content"]


def test_deterministic(micro_target, chat, tmp_path, capsys):
    first = run(micro_target, chat, tmp_path / "one", chunk_size=2)
    assert [line.split(",")[0] for line in logged(capsys.readouterr().err)] == [
        f"regenerate: {n} of 3 chunks"
        for n in (1, 2, 3)  # without bars, a line per chunk says how far it is
    ]
    second = run(micro_target, chat, tmp_path / "two", chunk_size=2)
    assert first.conversations == second.conversations
    assert first.path.name == second.path.name  # the same key: nothing about a run leaks into it


def test_second_call_is_a_cache_hit(micro_target, chat, tmp_path, monkeypatch):
    first = run(micro_target, chat, tmp_path)

    def forbidden(*args, **kwargs):
        raise AssertionError("the target ran on a cache hit")

    monkeypatch.setattr(micro_target.model, "forward", forbidden)
    second = run(micro_target, chat, tmp_path)
    assert second.stats["hit"] is True and second.stats["generated_tokens"] == 0
    assert second.stats["total_generated_tokens"] == first.stats["generated_tokens"]
    assert second.conversations == first.conversations
    # anything in the key is a different entry (here: the answer length), which would have to run the target
    with pytest.raises(AssertionError, match="the target ran"):
        run(micro_target, chat, tmp_path, max_new_tokens=MAX_NEW + 1)


def published_by(monkeypatch, calls: list[str], stop_at: int | None = None) -> None:
    """Record the first conversation id of every part published (and interrupt at the `stop_at`-th)."""
    real = regen._publish_part

    def publish(path, manifest, name, records, seconds):
        calls.append(records[0]["id"])
        if len(calls) == stop_at:
            raise KeyboardInterrupt
        return real(path, manifest, name, records, seconds)

    monkeypatch.setattr(regen, "_publish_part", publish)


def test_interrupted_run_resumes_from_finished_chunks(micro_target, chat, tmp_path, monkeypatch):
    whole = run(micro_target, chat, tmp_path / "whole", chunk_size=2)  # 5 conversations: 3 chunks
    calls = []
    published_by(monkeypatch, calls, stop_at=2)
    with pytest.raises(KeyboardInterrupt):
        run(micro_target, chat, tmp_path / "resumed", chunk_size=2)
    assert calls == ["a", "c"]
    published_by(monkeypatch, calls := [])
    resumed = run(micro_target, chat, tmp_path / "resumed", chunk_size=2)
    assert calls == ["c", "e"]  # the first chunk came from the cache
    assert resumed.stats["chunks_generated"] == 2 and resumed.stats["chunks_loaded"] == 1
    assert resumed.conversations == whole.conversations


def test_a_larger_selection_regenerates_only_its_new_chunks(micro_target, chat, tmp_path, monkeypatch):
    small = run(micro_target, chat, tmp_path, conversations=CONVERSATIONS[:4], chunk_size=2)
    calls = []
    published_by(monkeypatch, calls)
    large = run(micro_target, chat, tmp_path, chunk_size=2)  # the same order, one more chunk
    assert calls == ["e"] and large.path == small.path
    assert large.stats["chunks_generated"] == 1 and large.stats["chunks_loaded"] == 2
    assert large.conversations[:4] == small.conversations
    again = run(micro_target, chat, tmp_path, conversations=CONVERSATIONS[:4], chunk_size=2)
    assert again.stats["hit"] and calls == ["e"]  # the smaller selection is still whole
    # a split keeps the chunks before it whatever follows: [a b] [c] | [d e]
    run(micro_target, chat, tmp_path / "split", chunk_size=2, splits=(3,))
    assert run(micro_target, chat, tmp_path / "split", conversations=CONVERSATIONS[:3], chunk_size=2).stats["hit"]


def test_later_turns_follow_the_targets_earlier_answers(micro_target, chat, tmp_path, monkeypatch):
    prompts = []
    real = regen.open_generator

    @contextlib.contextmanager
    def recording(*args, **kwargs):
        with real(*args, **kwargs) as generate:
            stream = generate.stream
            generate.stream = lambda requests: (prompts.append([p for p, _ in requests.values()]), stream(requests))[1]
            yield generate

    monkeypatch.setattr(regen, "open_generator", recording)
    result = run(micro_target, chat, tmp_path, conversations=CONVERSATIONS[1:2])
    assert [len(p) for p in prompts] == [1, 1]  # the first assistant turn, then the second
    answer = result.conversations[0].messages[2]["content"]
    assert answer
    turn2 = micro_target.tokenizer.decode(prompts[1][0])
    assert answer in turn2 and CONVERSATIONS[1].messages[2]["content"] not in turn2
    assert prompts[1][0] == chat.prompt(list(result.conversations[0].messages[:4]))


class ScriptedEngine:
    """A stand-in for an engine's `stream`, for the scheduler alone: request i takes `steps[i]` engine steps
    (in the order it was added) and answers "pass"; every step is recorded with the requests in it."""

    def __init__(self, answer: list[int], steps: list[int]):
        self.answer, self.steps, self.left, self.log = answer, list(steps), {}, []
        self.prompts: dict[int, list[int]] = {}

    def stream(self, requests: dict) -> dict[int, list[int]]:
        for key, (prompt, _) in requests.items():
            self.left[key] = self.steps.pop(0)
            self.prompts[key] = prompt
        finished: dict[int, list[int]] = {}
        while not finished and self.left:
            self.log.append(sorted(self.left))
            for key in list(self.left):
                self.left[key] -= 1
                if not self.left[key]:
                    del self.left[key]
                    finished[key] = self.answer
        return finished


class Bar:
    def __init__(self, total: int) -> None:
        self.total, self.n = total, 0

    def update(self, n: int) -> None:
        self.n += n

    def refresh(self) -> None:
        pass


def test_the_pool_keeps_its_places_full_across_chunks(micro_target, chat):
    """A slot freed by a finished turn goes at once to that conversation's next turn, else to the next
    conversation, of this chunk or the next; never more than `pool` turns run, and each chunk is published
    when its last conversation ends, even before an earlier chunk."""
    answer = micro_target.tokenizer("pass")["input_ids"]
    # turns in the order they start: a1 (slow), b1, b2, c1, c2, c3, d1, e1
    engine = ScriptedEngine(answer, [9, 1, 1, 1, 1, 1, 1, 1])
    chunks = [CONVERSATIONS[:2], CONVERSATIONS[2:4], CONVERSATIONS[4:]]
    published = []
    bar = Bar(8)
    regen._regenerate(
        engine, chat, micro_target.tokenizer, chunks, 4, SEQ_LEN, 2, lambda k, r: published.append((k, r)), bar
    )
    assert max(len(step) for step in engine.log) == 2  # the pool
    assert engine.log[:3] == [[0, 1], [0, 2], [0, 3]]  # b's second turn takes b1's place; then c starts
    assert [k for k, _ in published] == [1, 2, 0]  # chunk 0 waits on its slow first turn
    assert bar.n == bar.total == 8
    records = {r["id"]: r for _, rs in published for r in rs}
    answers = [m["content"] for r in records.values() for m in r["messages"] if m["role"] == "assistant"]
    assert answers == ["pass"] * 8 and len(records) == 5
    # the second turn of c follows c's first answer
    assert engine.prompts[4] == chat.prompt(records["c"]["messages"][:3])


def test_conversations_stop_where_the_sequence_would(micro_target, chat, tmp_path):
    long_user = conv("long", ("x = 1\n" * 400, "pass"), ("more", "pass"))
    first_prompt = len(chat.prompt(list(CONVERSATIONS[2].messages[:1])))
    seq_len = first_prompt + 4  # room for 4 answer tokens in turn 1; turn 2's prompt is past it
    result = run(micro_target, chat, tmp_path, conversations=[CONVERSATIONS[2], long_user], seq_len=seq_len)
    short, long = result.conversations
    assert [m["role"] for m in short.messages] == ["user", "assistant"]
    assert len(micro_target.tokenizer(short.messages[1]["content"])["input_ids"]) <= 4 + 1
    assert [m["role"] for m in long.messages] == ["user", "assistant"] and long.messages[1]["content"] == ""
    assert result.cut == {"c": "seq_len", "long": "seq_len"}
    assert result.stats["generated_tokens"] <= 4


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_vllm_backend(micro_target, chat, tmp_path):
    first = run(micro_target, chat, tmp_path, conversations=CONVERSATIONS[:4], backend="vllm", dtype="float32")
    assert first.stats["backend"] == "vllm" and not first.stats["hit"]
    # the micro target answers its first turns; later ones it may end at once (an empty answer, kept as "")
    assert all(next(m["content"] for m in c.messages if m["role"] == "assistant") for c in first.conversations)
    assert [c.id for c in first.conversations] == [c.id for c in CONVERSATIONS[:4]]
    # in float32, vLLM's greedy answers are the transformers model's
    assert first.conversations == run(micro_target, chat, tmp_path, conversations=CONVERSATIONS[:4]).conversations
    second = run(micro_target, chat, tmp_path, conversations=CONVERSATIONS[:4], backend="vllm", dtype="float32")
    assert second.stats["hit"] and second.conversations == first.conversations


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_vllm_worker_failure_names_its_log(micro_target, tmp_path):
    from dataclasses import replace

    from lab.target.generate import open_generator

    broken = replace(micro_target, path=tmp_path / "no-such-model")
    log = tmp_path / "worker.log"
    log.write_text("an earlier session's Error, long fixed\n")
    with pytest.raises(RuntimeError, match="log: .*worker.log") as failure:
        with open_generator(broken, "vllm", progress=False, log_path=log) as generate:
            generate([[1, 2, 3]], 4)
    # the log of a resumed build keeps the earlier sessions' lines, and the error quotes only this one's
    assert log.read_text().startswith("an earlier session's Error") and "long fixed" not in str(failure.value)


def test_hf_batches_are_sized_by_the_device():
    """A CPU keeps batches of HF_BATCH rows; a GPU takes as many rows as half its free memory holds (a row: its
    KV cache at full length, its widest prompt activations, its logits), between HF_BATCH and HF_BATCH_MAX."""
    from types import SimpleNamespace

    from lab.target.generate import HF_BATCH, HF_BATCH_MAX, hf_batch_rows

    smollm2 = SimpleNamespace(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        head_dim=64, vocab_size=49152,
    )  # fmt: skip
    assert hf_batch_rows(smollm2, torch.float32, 2048, None) == HF_BATCH
    per_row = 2 * 30 * 3 * 64 * 2 * 2048 + 2048 * (4 * 576 + 3 * 1536) * 2 + 4 * 49152  # bfloat16: 2 bytes
    assert hf_batch_rows(smollm2, torch.bfloat16, 2048, 8 << 30) == (8 << 30) // 2 // per_row == 56
    assert hf_batch_rows(smollm2, torch.bfloat16, 2048, 139 << 30) == HF_BATCH_MAX  # an H200
    assert hf_batch_rows(smollm2, torch.bfloat16, 2048, 1 << 30) == HF_BATCH  # never below the CPU's batch


def test_the_static_kv_cache_gives_the_dynamic_caches_tokens(micro_target, monkeypatch):
    """`greedy_batch` over the static KV cache (lab/target/static_decode.py; float32 on the CPU) answers as over
    the dynamic one: prompts of different lengths, different limits, rows stopping at eos, batches padded to their
    bucket of rows. Its step traces whole (`fullgraph`: a graph break would leave eager launches in every step of
    a CUDA graph) and once for every bucket (rows and length are symbols: a bucket's compile costs tens of seconds
    on a card, docs/benchmarks.md)."""
    from lab.target.generate import greedy_batch

    graphs = traced_steps(monkeypatch)
    model = micro_target.model
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, micro_target.vocab_size, (n,), generator=g).tolist() for n in (5, 17, 9, 30, 2)]
    limits = [20, 7, 33, 1, 25]
    free = greedy_batch(model, prompts, limits, -1, "dynamic")  # no eos: every row to its limit
    eos = free[2][10]  # row 2's 11th token: that row, and any that says it earlier, stops there
    dynamic = greedy_batch(model, prompts, limits, eos, "dynamic")
    assert len(dynamic[2]) <= 10 and [len(a) for a in free] == limits
    assert greedy_batch(model, prompts, limits, -1, "static") == free
    assert greedy_batch(model, prompts, limits, eos, "static") == dynamic
    assert len(graphs) == 1  # 5 rows: the bucket of 16 rows x 256 positions
    assert greedy_batch(model, prompts[1:], limits[1:], eos, "static") == dynamic[1:]  # 4 rows
    assert greedy_batch(model, prompts[:3], limits[:3], eos, "static") == dynamic[:3]  # 3 rows, padded to 4
    long = [p * 12 for p in prompts[1:4]]  # 204 to 360 tokens: a cache of 512 positions
    assert greedy_batch(model, long, limits[1:4], eos, "static") == greedy_batch(
        model, long, limits[1:4], eos, "dynamic"
    )
    assert len(graphs) == 1


def test_a_cut_at_regenerate_seconds_keeps_the_finished_chunks_for_every_later_call(
    micro_target, chat, tmp_path, monkeypatch
):
    """`seconds` (data.regenerate_seconds) stops starting training conversations (those before splits[0]) that
    long after regeneration began: the chunks that finished are the result, in order, the held-out split whole.
    The cut is recorded: a later call with the same seconds gets the same conversations without running the
    target, also after an uncut call has regenerated the rest, which another number of seconds then finds."""
    ticks = iter(range(10_000))
    monkeypatch.setattr(regen, "_now", lambda: next(ticks))  # one tick a look: the cut falls at b's first turn
    cut = run(micro_target, chat, tmp_path, chunk_size=1, splits=(4,), seconds=3)
    assert [c.id for c in cut.conversations] == ["a", "e"] and cut.dropped == 3
    assert cut.stats["cut_dropped"] == 3 and cut.stats["cut_seconds"] == 3

    def forbidden(*args, **kwargs):
        raise AssertionError("the target ran for a recorded cut")

    with monkeypatch.context() as mp:
        mp.setattr(micro_target.model, "forward", forbidden)
        again = run(micro_target, chat, tmp_path, chunk_size=1, splits=(4,), seconds=3)
    assert again.conversations == cut.conversations and again.stats["hit"] is True and again.dropped == 3
    whole = run(micro_target, chat, tmp_path, chunk_size=1, splits=(4,))  # uncut: the rest regenerated
    assert [c.id for c in whole.conversations] == ["a", "b", "c", "d", "e"] and whole.dropped == 0
    assert [whole.conversations[i] for i in (0, 4)] == cut.conversations
    assert run(micro_target, chat, tmp_path, chunk_size=1, splits=(4,), seconds=3).conversations == cut.conversations
    other = run(micro_target, chat, tmp_path, chunk_size=1, splits=(4,), seconds=10_000)
    assert other.conversations == whole.conversations and other.stats["hit"] is True
