"""Decoding against training on a logged run: decode a suite's prompts with the run's drafter (greedy, to the
eos), replay the same rounds from the drafter's teacher-forced TTT unroll over the decoded text, and print
both acceptance counts (equal when decoding sees the drafter as training does) and how often the unrolled
drafter is right over the first `--head` tokens of each answer and over whole answers.

    .venv/bin/python benchmarks/unroll_replay.py mlruns/artifacts/RUN_ID/artifacts [--suite in_dist]
        [--k 3] [--max-new-tokens 512] [--head 64]

The run's folder holds what the run logged: config.yaml, checkpoint/ and suites/{suite}.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from omegaconf import OmegaConf

from lab.drafter.formats import load_checkpoint
from lab.eval.probes import rollout_counts, unrolled_rounds
from lab.eval.reference import DecodeStats, speculative_decode
from lab.pipeline import set_threads
from lab.target import capture, target_logits
from lab.target import load as load_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a run's artifact folder (config.yaml, checkpoint/, suites/)")
    parser.add_argument("--suite", default="in_dist")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--head", type=int, default=64, help="the answer's first tokens, scored apart")
    args = parser.parse_args()
    cfg = OmegaConf.load(args.run / "config.yaml")
    set_threads(cfg)
    target = load_target(cfg, progress=False)
    drafter = load_checkpoint(args.run / "checkpoint", embed_weight=target.embed_weight).to(target.device).eval()
    logged = json.loads((args.run / "suites" / f"{args.suite}.json").read_text())
    stop_ids = tuple(logged["suite"].get("stop_ids", ()))
    decoded, replayed, right = DecodeStats(), [], {"head": [0, 0], "whole": [0, 0]}
    for record in logged["prompts"]:
        ids = record["token_ids"]
        prompt = json.loads(ids) if isinstance(ids, str) else ids  # the MLflow dataset stores them as JSON text
        output, stats = speculative_decode(
            target.model, drafter, prompt, args.max_new_tokens, args.k, stop_ids=stop_ids
        )
        decoded.merge(stats)
        seq = torch.tensor([prompt + output], device=target.device)
        cap = capture(target.model, seq, drafter.spec.aux_layer_ids)
        rounds = unrolled_rounds(drafter, seq, cap.aux, len(prompt), args.k)
        replayed += rounds
        top = target_logits(cap.final, target.lm_head_weight).argmax(-1)
        for part, end in (("head", len(prompt) + args.head), ("whole", seq.shape[1])):
            answer = torch.zeros_like(seq)  # the output's tokens after the first (the prefill's)
            answer[0, len(prompt) + 1 : end] = 1
            hits, counted = rollout_counts(drafter, seq, cap.aux, top, 1, answer)
            right[part][0] += hits.sum().item()
            right[part][1] += counted.sum().item()
        print(f"{len(prompt)}-token prompt, {len(output)} tokens: decoded {stats.accepted_at} in {stats.rounds} rounds")
    counts = [sum(a > i for a in replayed) for i in range(args.k)]
    print(
        f"decoded : AL {decoded.acceptance_length:.3f}, {decoded.rounds} rounds, accepted at 1..k {decoded.accepted_at}"
    )
    print(f"replayed: AL {1 + sum(replayed) / len(replayed):.3f}, {len(replayed)} rounds, accepted at 1..k {counts}")
    for part, (hit, n) in right.items():
        print(f"first draft right (teacher-forced) over the {part} answers: {hit / n:.3f} of {n:.0f} positions")


if __name__ == "__main__":
    main()
