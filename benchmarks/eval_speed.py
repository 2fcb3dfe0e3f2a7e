"""Evaluation at the cost of one pass, measured: a run's reference evaluation (every suite of a config, every
k, the drift probes) with `eval.decoder=sequential` against `eval.decoder=replay`, side by side on the same
drafter and prompts.

    .venv/bin/python benchmarks/eval_speed.py [OVERRIDES ...] [--train-steps N] [--runs N]

OVERRIDES are `lab run`'s (`profile=micro`, `profile=quick target=tiny_code`, ...). The drafter is trained once
as the config says (`--train-steps` to shorten it: the timings hardly depend on it, the AL does). Per suite:
its prompts, the seconds of the sequential evaluation, of the target's greedy answers (once per study: every
run of a study shares them), of the replay's evaluation (its timed sample of `eval.timed_prompts` prompts
included) and of the replay alone, whether every prompt's rounds came out equal both ways (else how many
prompts and k did, and how many of the batched answers equal each prompt's greedy decoding alone: in bfloat16
a near tie can flip a token), and AL at the deepest k. Then the ratio for one
run, and for a study of `--runs` runs that computes the answers once.
"""

from __future__ import annotations

import argparse
import time

import torch

from lab.config.composition import compose
from lab.data.answers import compute_answers, greedy_answers
from lab.drafter import init_drafter
from lab.eval.replay import replay
from lab.eval.run import evaluate_suite_prompts, timed_prompts
from lab.pipeline import _prepare, set_threads
from lab.train.ttt import train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="lab run's overrides, e.g. profile=micro")
    parser.add_argument("--train-steps", type=int, default=None, help="train.steps (default: the config's)")
    parser.add_argument("--runs", type=int, default=8, help="runs of a study sharing the answers (drift_2x2: 8)")
    parser.add_argument("--replay-only", action="store_true", help="skip the sequential evaluation (its column: -)")
    args = parser.parse_args()
    extra = [f"train.steps={args.train_steps}"] if args.train_steps else []
    cfg = compose([*args.overrides, *extra, "eval.decoder=sequential"])  # the answers are timed here
    set_threads(cfg)
    prepared = _prepare(cfg, progress=False, stage=lambda _: None, reuse=False)
    target, layers, e = prepared.target, prepared.layers, cfg.eval
    drafter = init_drafter(target, cfg.drafter, layers, seed=cfg.seed)
    train(drafter, prepared.hidden, target.lm_head_weight, cfg.train, seed=cfg.seed, progress=False)
    drafter.eval()
    ks = list(e.num_speculative_tokens)
    print(f"{' '.join(args.overrides)} | {torch.get_num_threads()} threads | k {ks} | probes {e.probes}")
    print("| suite | prompts | sequential s | answers s (once) | replay s (timed sample incl.) | replay only s "
          f"| rounds equal | AL k{max(ks)} |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    totals = [0.0, 0.0, 0.0, 0.0]
    for suite in prepared.suites:
        kwargs = dict(progress=False, probes=e.probes, n_sink=e.n_sink, seed=cfg.seed)
        started = time.perf_counter()
        sequential = None if args.replay_only else evaluate_suite_prompts(target.model, drafter, suite, ks, **kwargs)
        seq_s = time.perf_counter() - started
        started = time.perf_counter()
        answers = compute_answers(target, suite.prompts, suite.max_new_tokens + max(ks), suite.stop_ids, layers)
        answers_s = time.perf_counter() - started
        started = time.perf_counter()
        timed = timed_prompts(len(suite.prompts), e.timed_prompts)
        replayed = evaluate_suite_prompts(target.model, drafter, suite, ks, **kwargs, answers=answers, timed=timed)
        replay_s = time.perf_counter() - started
        started = time.perf_counter()
        replay(drafter, answers, ks, suite.max_new_tokens, suite.stop_ids, e.n_sink, e.probes)
        only_s = time.perf_counter() - started
        pairs = [] if sequential is None else [  # (prompt, k): the decoder's rounds and the replay's, equal?
            (a["k"][k]["rounds"], a["k"][k]["accepted_at"]) == (b["k"][k]["rounds"], b["k"][k]["accepted_at"])
            for a, b in zip(sequential.per_prompt["prompts"], replayed.per_prompt["prompts"], strict=True)
            for k in a["k"]
        ]  # fmt: skip
        rounds = sum(p["k"][str(k)]["rounds"] for p in replayed.per_prompt["prompts"] for k in ks)
        al = replayed.metrics[f"eval/{suite.name}/ref/k{max(ks)}/al"]
        same = "-" if not pairs else "yes" if all(pairs) else f"NO: {sum(pairs)} of {len(pairs)} prompt x k"
        if pairs and not all(pairs):  # why: is the batched answer each prompt's own greedy decoding?
            same += f", {alone_equal(target, suite, answers, max(ks))} of {len(suite.prompts)} answers as decoded alone"
        print(f"| {suite.name} | {len(suite.prompts)} | {seq_s:.2f} | {answers_s:.2f} | {replay_s:.2f} | "
              f"{only_s:.2f} | {same} ({rounds} rounds) | {al:.3f} |")  # fmt: skip
        for i, v in enumerate((seq_s, answers_s, replay_s, only_s)):
            totals[i] += v
    seq_s, answers_s, replay_s, only_s = totals
    print(f"| all | | {seq_s:.2f} | {answers_s:.2f} | {replay_s:.2f} | {only_s:.2f} | | |")
    print(f"one run: sequential / (answers + replay) = {seq_s / (answers_s + replay_s):.1f}x")
    study = args.runs * seq_s / (answers_s + args.runs * replay_s)
    print(f"a study of {args.runs} runs (answers once): {args.runs * seq_s:.1f} s -> "
          f"{answers_s + args.runs * replay_s:.1f} s = {study:.1f}x")  # fmt: skip


def alone_equal(target, suite, answers, deepest: int) -> int:
    """How many of the batched greedy answers equal the prompt's greedy decoding on its own (batch 1): where a
    low precision rounds a near tie otherwise in the batch, the replay follows another text than the decoder."""
    length, eos = suite.max_new_tokens + deepest, suite.stop_ids[0] if suite.stop_ids else -1
    return sum(
        sequence[len(prompt) :] == greedy_answers(target.model, [prompt], length, eos)[0]
        for prompt, sequence in zip(suite.prompts, answers.sequences, strict=True)
    )


if __name__ == "__main__":
    main()
