"""The reference decoder's per-step overhead: milliseconds per target forward of plain decoding and per round of
speculative decoding (k drafts, probes on), against the bare forwards they are made of, on one target.

    .venv/bin/python benchmarks/decoder_overhead.py [--baseline-rev REV] [--k 3] [--tokens 64] [overrides...]
    # e.g. profile=micro (the default), or target=smollm2 device=cuda

Bare costs: one target forward of 1 token (and of k + 1 tokens) on a KV cache, one drafter step of 1 token.
Overhead: what a decoder spends per step beyond them (Python, host syncs, tensor building). With
`--baseline-rev`, lab/eval/reference.py as committed at REV runs beside the current one, prompt by prompt
interleaved so that machine noise hits both alike, and both must decode the same tokens.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

from lab.config.composition import compose
from lab.config.shape import aux_layers
from lab.data.suites import build_suite
from lab.drafter import KVCache, init_drafter
from lab.eval import reference
from lab.eval.probes import DriftProbes
from lab.pipeline import set_threads
from lab.target import load

ROOT = Path(__file__).resolve().parent.parent


def _module_at(rev: str) -> types.ModuleType:
    source = subprocess.run(
        ["git", "show", f"{rev}:lab/eval/reference.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    module = types.ModuleType(f"reference_{rev}")
    sys.modules[module.__name__] = module  # its dataclasses look their module up
    exec(compile(source, f"reference.py@{rev}", "exec"), module.__dict__)  # noqa: S102
    return module


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def bare_costs(target, drafter, prompt: list[int], k: int, n: int = 32) -> dict[str, float]:
    """ms of one target forward of 1 and of k + 1 tokens on the prompt's cache, and of one drafter step."""
    model, device = target.model, target.device
    pre = reference.prefill(model, prompt, drafter.spec.aux_layer_ids, "dynamic")  # the dynamic cache's bare costs
    out = {}
    for width in (1, k + 1):
        ids = torch.ones(1, width, dtype=torch.long, device=device)
        cache = pre.cache()
        _sync(device)
        start = time.perf_counter()
        for _ in range(n):
            model(input_ids=ids, past_key_values=cache, use_cache=True)
            cache = pre.cache()
        _sync(device)
        out[f"target_{width}"] = (time.perf_counter() - start) / n * 1e3
    dcache = KVCache(len(drafter.layers))
    hidden = drafter.project(pre.captured.aux.to(drafter.fc.weight.dtype))
    drafter(torch.tensor([prompt], device=device), hidden, torch.arange(len(prompt), device=device)[None], dcache)
    token, h = torch.ones(1, 1, dtype=torch.long, device=device), hidden[:, -1:]
    position = torch.tensor([[len(prompt)]], device=device)
    _sync(device)
    start = time.perf_counter()
    for _ in range(n):
        drafter.logits(drafter(token, h, position, dcache)).argmax(-1)
        dcache.crop(len(prompt))
    _sync(device)
    out["draft_1"] = (time.perf_counter() - start) / n * 1e3
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-rev", help="also time lab/eval/reference.py as committed at this git revision")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per prompt")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("overrides", nargs="*", default=["profile=micro"])
    args = parser.parse_args()
    cfg = compose(args.overrides)
    set_threads(cfg)
    target = load(cfg, progress=False)
    drafter = init_drafter(target, cfg.drafter, aux_layers(cfg), cfg.seed).eval()
    prompts = build_suite("in_dist", target.tokenizer, cfg).prompts[: args.prompts]
    decoders = {"current": reference}
    if args.baseline_rev:
        decoders = {f"at {args.baseline_rev}": _module_at(args.baseline_rev), **decoders}
    for module in decoders.values():  # warm-up
        module.speculative_decode(target.model, drafter, prompts[0], 8, args.k, DriftProbes(args.k))
    times = {name: {"plain": 0.0, "spec": 0.0, "steps": 0, "rounds": 0} for name in decoders}
    for repeat in range(2):
        for prompt in prompts:
            order = list(decoders) if repeat % 2 == 0 else list(reversed(decoders))
            outputs = []
            for name in order:
                module, t = decoders[name], times[name]
                tokens, seconds = module.target_decode(target.model, prompt, args.tokens)
                t["plain"] += seconds
                t["steps"] += len(tokens)
                spec, stats = module.speculative_decode(
                    target.model, drafter, prompt, args.tokens, args.k, DriftProbes(args.k)
                )
                t["spec"] += stats.seconds
                t["rounds"] += stats.rounds
                outputs.append((tokens, spec))
            assert all(o == outputs[0] for o in outputs), "the decoders disagree"
    bare = bare_costs(target, drafter, prompts[0], args.k)
    print(f"{cfg.target.name} on {target.device} ({target.dtype}), k={args.k}, {len(prompts)} prompts x 2 repeats")
    print(
        f"bare: target forward {bare['target_1']:.2f} ms (1 token), {bare['target_' + str(args.k + 1)]:.2f} ms "
        f"({args.k + 1} tokens); drafter step {bare['draft_1']:.2f} ms"
    )
    round_bare = bare[f"target_{args.k + 1}"] + args.k * bare["draft_1"]
    print("| decoder | plain ms/token | overhead | spec ms/round | bare round | overhead |")
    print("|---|---|---|---|---|---|")
    for name, t in times.items():
        plain = t["plain"] / t["steps"] * 1e3
        spec = t["spec"] / t["rounds"] * 1e3
        print(
            f"| {name} | {plain:.2f} | {plain - bare['target_1']:+.2f} | {spec:.2f} | {round_bare:.2f} | "
            f"{spec - round_bare:+.2f} |"
        )


if __name__ == "__main__":
    sys.exit(main())
