"""Cost of the drift probes in the reference decoder: the same prompts decoded with probes off and on,
interleaved prompt by prompt so machine noise hits both alike; prints the time ratio.

    .venv/bin/python benchmarks/probe_overhead.py [hydra overrides...]   # e.g. target=micro data=micro
"""

from __future__ import annotations

import sys
import time

from lab.config.composition import compose
from lab.config.shape import aux_layers
from lab.data.suites import build_suite
from lab.drafter import init_drafter
from lab.eval.probes import DriftProbes
from lab.eval.reference import speculative_decode
from lab.pipeline import set_threads
from lab.target import load


def main(overrides: list[str]) -> None:
    cfg = compose(overrides)
    set_threads(cfg)
    target = load(cfg)
    drafter = init_drafter(target, cfg.drafter, aux_layers(cfg), cfg.seed).eval()
    suite = build_suite("in_dist", target.tokenizer, cfg)
    k = max(cfg.eval.num_speculative_tokens)
    speculative_decode(target.model, drafter, suite.prompts[0], 8, k)  # warm-up
    off = on = 0.0
    for repeat in range(3):
        for prompt in suite.prompts:
            for probed in (False, True) if repeat % 2 == 0 else (True, False):
                start = time.perf_counter()
                speculative_decode(
                    target.model, drafter, prompt, suite.max_new_tokens, k, DriftProbes(k) if probed else None
                )
                elapsed = time.perf_counter() - start
                on, off = (on + elapsed, off) if probed else (on, off + elapsed)
    print(f"k={k}, {len(suite.prompts)} prompts x {suite.max_new_tokens} tokens x 3 repeats")
    print(f"probes off {off:.2f}s, on {on:.2f}s: overhead {100 * (on / off - 1):+.1f}%")


if __name__ == "__main__":
    main(sys.argv[1:])
