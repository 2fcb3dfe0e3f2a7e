"""Regeneration's two schedules on the SmolLM2 target, side by side: the rolling pool that
`lab.data.regenerate` uses (a conversation's next turn starts as soon as its last one is answered, a freed
place goes to the next conversation) against waves (within each chunk, every conversation's first assistant
turn as one batch, then every second one, ...), whose batches thin out at each chunk's end.

    .venv/bin/python benchmarks/regenerate_schedule.py [--conversations 64] [--chunk 32] [--max-new-tokens 256]
        [--seq-len 512] [--rounds 2] [--backend vllm] [--dtype auto] [--threads N]

Both schedules regenerate the same ShareGPT conversations (a seeded selection of the train split) with the
same cuts, one after the other, `--rounds` times in alternating order, each on a fresh engine (started
outside the timing) so that neither finds the other's prompts in vLLM's prefix cache. tokens/s counts the
tokens generated over the wall time of the schedule alone. Also printed: how many conversations the two
regenerate identically (all of them in float32; in bfloat16 batching can tip a near-tie).
"""

from __future__ import annotations

import argparse
import os
import time

from lab.config.composition import compose
from lab.data import regenerate as regen
from lab.data.conversations import select, sharegpt, split
from lab.target import load
from lab.target.chat_template import TokenizerChat
from lab.target.generate import open_generator, resolve_dtype


def waves(generate, chat, tokenizer, chunks, max_new_tokens: int, seq_len: int) -> list[dict]:
    """The per-chunk waves the pool is measured against: per chunk, one batch per assistant-turn index."""
    records = []
    for chunk in chunks:
        states = [regen._state(c) for c in chunk]
        while True:
            batch = [(s, r) for s in states if (r := regen._next_turn(s, chat, max_new_tokens, seq_len, None))]
            if not batch:
                break
            outs = generate([r[0] for _, r in batch], [r[1] for _, r in batch])
            for (s, _), ids in zip(batch, outs, strict=True):
                regen._answer(s, tokenizer.decode(ids, skip_special_tokens=True).strip(), len(ids), None)
        records += [regen._record(s) for s in states]
    return records


def pool(generate, chat, tokenizer, chunks, max_new_tokens: int, seq_len: int) -> list[dict]:
    parts: dict[int, list[dict]] = {}
    regen._regenerate(
        generate, chat, tokenizer, chunks, max_new_tokens, seq_len, len(chunks[0]), parts.__setitem__, None
    )
    return [r for k in sorted(parts) for r in parts[k]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=32, help="conversations per chunk, and the pool's places")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--backend", default="vllm")
    parser.add_argument("--dtype", default="auto", help="vLLM's: auto (float32 without CPU bf16), bfloat16, float32")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("overrides", nargs="*", help="hydra overrides (default: target=smollm2)")
    args = parser.parse_args()

    cfg = compose(["target=smollm2", *args.overrides])
    target = load(cfg, progress=False)
    chat = TokenizerChat(target.tokenizer)
    train, _ = split(sharegpt(cfg.cache_dir))
    chosen = list(select(train, args.conversations, seed=0, key="benchmark"))
    chunks = [chosen[i : i + args.chunk] for i in range(0, len(chosen), args.chunk)]
    print(
        f"target {target.fingerprint}: {len(chosen)} conversations ({sum(c.assistant_turns for c in chosen)} "
        f"assistant turns) in {len(chunks)} chunks of {args.chunk}, up to {args.max_new_tokens} new tokens, "
        f"seq_len {args.seq_len}, backend {args.backend} ({resolve_dtype(args.dtype)}), {os.cpu_count()} CPUs"
    )
    schedules = {"waves": waves, "pool": pool}
    totals = {name: [0, 0.0] for name in schedules}
    answers: dict[str, list[dict]] = {}
    for round_ in range(args.rounds):
        order = list(schedules) if round_ % 2 == 0 else list(reversed(schedules))
        for name in order:
            # a fresh engine each time: vLLM's prefix cache would otherwise hand the second schedule every
            # prompt the first one computed
            with open_generator(target, args.backend, threads=args.threads, progress=False, dtype=args.dtype) as gen:
                started = time.perf_counter()
                records = schedules[name](gen, chat, target.tokenizer, chunks, args.max_new_tokens, args.seq_len)
                seconds = time.perf_counter() - started
            tokens = sum(r["generated_tokens"] for r in records)
            totals[name][0] += tokens
            totals[name][1] += seconds
            answers[name] = records
            print(
                f"round {round_ + 1} {name:5s}: {tokens:6d} tokens in {seconds:7.1f} s = "
                f"{tokens / seconds:6.1f} tokens/s (load average {os.getloadavg()[0]:.1f})",
                flush=True,
            )
    (wt, ws), (pt, ps) = totals["waves"], totals["pool"]
    same = sum(a == b for a, b in zip(answers["waves"], answers["pool"], strict=True))
    print(
        f"pool / waves: {(pt / ps) / (wt / ws):.2f}x tokens/s, {ws / ps:.2f}x less wall time; "
        f"identical conversations {same}/{len(chosen)}"
    )


if __name__ == "__main__":
    main()
