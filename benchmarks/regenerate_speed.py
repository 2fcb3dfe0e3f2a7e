"""Greedy generation speed of the regeneration backends on the SmolLM2 target: answers to the first user turn
of N ShareGPT conversations, by each backend in turn in one process, so the ratio is taken on the same
prompts under the same machine load.

    .venv/bin/python benchmarks/regenerate_speed.py [--prompts 64] [--max-new-tokens 128] [--backends vllm,hf]
        [--threads N] [--dtype bfloat16] [--max-prompt-tokens 512]

tokens/s counts generated tokens over the time of the `generate` call alone (vLLM's engine start-up, tens of
seconds once per regeneration run, is printed apart). Prompts are the first user turn in the target's own
chat template, from conversations whose prompt has at most --max-prompt-tokens tokens (the seeded selection
of lab.data.conversations.select over the train split). Also printed: how many answers each backend shares
exactly with the first one (vLLM's bf16 and transformers' fp32 greedy paths part ways at near-ties).
"""

from __future__ import annotations

import argparse
import os
import time

from lab.config.composition import compose
from lab.data.conversations import select, sharegpt, split
from lab.target import load
from lab.target.chat_template import TokenizerChat
from lab.target.generate import open_generator, resolve_backend, resolve_dtype


def prompts_for(cfg, target, count: int, max_prompt_tokens: int) -> list[list[int]]:
    chat = TokenizerChat(target.tokenizer)
    train, _ = split(sharegpt(cfg.cache_dir))
    out = []
    for conv in select(train, len(train), seed=0, key="benchmark"):
        first_user = next(i for i, m in enumerate(conv.messages) if m["role"] == "user")
        prompt = chat.prompt(list(conv.messages[: first_user + 1]))  # with a leading system message, if any
        if len(prompt) <= max_prompt_tokens:
            out.append(prompt)
        if len(out) == count:
            return out
    raise SystemExit(f"only {len(out)} first turns fit in {max_prompt_tokens} tokens")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--backends", default="vllm,hf")
    parser.add_argument("--threads", type=int, default=None, help="default: torch's / OpenMP's own choice")
    parser.add_argument("--dtype", default="bfloat16", help="vLLM's: bfloat16, float32 or auto (hf runs float32)")
    parser.add_argument("--max-prompt-tokens", type=int, default=512)
    parser.add_argument("overrides", nargs="*", help="hydra overrides (default: target=smollm2)")
    args = parser.parse_args()

    cfg = compose(["target=smollm2", *args.overrides])
    target = load(cfg, progress=False)
    prompts = prompts_for(cfg, target, args.prompts, args.max_prompt_tokens)
    lengths = sorted(len(p) for p in prompts)
    print(
        f"target {target.fingerprint}: {len(prompts)} prompts ({lengths[0]}-{lengths[-1]} tokens, median "
        f"{lengths[len(lengths) // 2]}), up to {args.max_new_tokens} new tokens, threads {args.threads or 'default'}, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start"
    )
    results: dict[str, dict] = {}
    for name in args.backends.split(","):
        backend = resolve_backend(name.strip())
        started = time.perf_counter()
        with open_generator(target, backend, threads=args.threads, progress=False, dtype=args.dtype) as generate:
            startup = time.perf_counter() - started
            started = time.perf_counter()
            outs = generate(prompts, args.max_new_tokens)
            seconds = time.perf_counter() - started
        tokens = sum(len(o) for o in outs)
        results[backend] = {"outs": outs, "tokens": tokens, "seconds": seconds, "tps": tokens / seconds}
        dtype = resolve_dtype(args.dtype) if backend == "vllm" else str(target.model.dtype).removeprefix("torch.")
        label = f"{backend} ({dtype})"
        print(
            f"{label:18s} {tokens:6d} tokens in {seconds:7.1f} s = {tokens / seconds:7.1f} tokens/s "
            f"(start-up {startup:.1f} s, load average {os.getloadavg()[0]:.1f})",
            flush=True,
        )
    names = list(results)
    if len(names) >= 2:
        first = results[names[0]]
        for other in names[1:]:
            same = sum(a == b for a, b in zip(first["outs"], results[other]["outs"], strict=True))
            print(
                f"{names[0]} / {other}: {first['tps'] / results[other]['tps']:.2f}x tokens/s; "
                f"identical answers {same}/{len(prompts)}"
            )


if __name__ == "__main__":
    main()
