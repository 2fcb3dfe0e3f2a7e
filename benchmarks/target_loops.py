"""Does the target's greedy continuation fall into a loop? Per evaluation prompt of each suite, the target's own
greedy continuation (as the reference decoder verifies it) and the smallest period p <= --max-period such that
every one of the last --tail new tokens equals the token p positions before it (none: no loop). A study's AL is
only as informative as this says: a drafter that copies a one-token loop reaches AL = k + 1 without predicting
anything else.

    .venv/bin/python benchmarks/target_loops.py [overrides ...] [--suites in_dist,template] [--tail 16]
        [--max-period 8]
    .venv/bin/python benchmarks/target_loops.py target=tiny_mla data=code profile=quick

The overrides are a run's (the target, data and eval.max_new_tokens come from them); the target must be built
(`lab target build ...`). Prints one line per suite.
"""

from __future__ import annotations

import argparse

import torch

from lab.config.composition import compose
from lab.data.suites import build_suite
from lab.target import load


def period(tokens: list[int], tail: int, max_period: int) -> int | None:
    """The smallest p <= max_period with tokens[i] == tokens[i - p] for each of the last `tail` tokens."""
    start = len(tokens) - tail
    if start < 1:
        return None
    return next(
        (
            p
            for p in range(1, min(max_period, start) + 1)
            if all(tokens[i] == tokens[i - p] for i in range(start, len(tokens)))
        ),
        None,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("overrides", nargs="*")
    p.add_argument("--suites", default=None, help="comma-separated (default: the run's eval.suites)")
    p.add_argument("--tail", type=int, default=16)
    p.add_argument("--max-period", type=int, default=8)
    a = p.parse_args()
    cfg = compose(a.overrides)
    target = load(cfg, progress=False)
    new = int(cfg.eval.max_new_tokens)
    for name in a.suites.split(",") if a.suites else list(cfg.eval.suites):
        suite = build_suite(name, target.tokenizer, cfg)
        found = []
        for prompt in suite.prompts:
            ids = torch.tensor([prompt], device=target.model.device)
            with torch.no_grad():
                out = target.model.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False
                )
            found.append(period(out[0, len(prompt) :].tolist(), a.tail, a.max_period))
        loops = sum(x is not None for x in found)
        said = ", ".join("-" if x is None else str(x) for x in found)
        print(f"{cfg.target.name} {name}: {loops}/{len(found)} prompts end in a loop (periods: {said})")


if __name__ == "__main__":
    main()
