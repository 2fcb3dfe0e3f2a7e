"""Evaluation at the cost of one pass, measured: a run's reference evaluation (every suite of a config, every
k, the drift probes) with `eval.decoder=sequential` against `eval.decoder=replay`, side by side on the same
drafter and prompts.

    .venv/bin/python benchmarks/eval_speed.py [OVERRIDES ...] [--train-steps N] [--runs N]

OVERRIDES are `lab run`'s (`profile=micro`, `profile=quick target=tiny_code`, ...). The drafter is trained once
as the config says (`--train-steps` to shorten it: the timings hardly depend on it, the AL does). Per suite:
its prompts, the seconds of the sequential evaluation, of the target's greedy answers (once per study: every
run of a study shares them), of the replay's evaluation (its timed sample of `eval.timed_prompts` prompts
included) and of the replay alone, whether every prompt's rounds came out equal both ways, and AL at the
deepest k (the replay's, the decoder's beside it). Then the ratio for one run, and for a study of `--runs` runs
that computes the answers once.

Where rounds differ (in bfloat16 a near tie can round either way), the column says how many prompt x k did,
and why each other one parted at its first differing round: `text`, the batched answer is not the prompt's
greedy decoding alone (the replay follows another text); `draft`, the decoder drafted another token there
than the replay's chain from the same position (the drafter's side: its step by step passes, or the prompt's
features from the prefill against the answer's pass); `verify`, the target's top-1 in the decoder's
verification of k + 1 tokens is not the answer pass's at that position (the target's side); `draft+verify`,
both.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections import Counter

import torch

from lab.config.composition import compose
from lab.data.answers import compute_answers, greedy_answers
from lab.drafter import init_drafter
from lab.eval import reference
from lab.eval import replay as replay_module
from lab.eval.evaluate import EvalOptions, evaluate_suite_prompts
from lab.eval.probes import DriftProbes
from lab.eval.reference import prefill, speculative_decode
from lab.eval.replay import replay
from lab.pipeline import StageClock, _prepare, set_threads
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
    prepared = _prepare(cfg, progress=False, clock=StageClock(), reuse=False)
    target, layers, e = prepared.target, prepared.layers, cfg.eval
    drafter = init_drafter(target, cfg.drafter, layers, seed=cfg.seed)
    train(drafter, prepared.hidden, target.lm_head_weight, cfg.train, seed=cfg.seed, progress=False)
    drafter.eval()
    ks = list(e.num_speculative_tokens)
    print(f"{' '.join(args.overrides)} | {torch.get_num_threads()} threads | k {ks} | probes {e.probes}")
    print("| suite | prompts | sequential s | answers s (once) | replay s (timed sample incl.) | replay only s "
          f"| rounds equal | AL k{max(ks)}, replay (decoder) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    totals = [0.0, 0.0, 0.0, 0.0]
    # greedy (the config's temperature aside): the replay compares with the greedy answers
    options = EvalOptions(ks, e.probes, e.n_sink, seed=cfg.seed, timed_prompts=e.timed_prompts)
    for suite in prepared.suites:
        started = time.perf_counter()
        sequential = None
        if not args.replay_only:
            sequential = evaluate_suite_prompts(target.model, drafter, suite, options, progress=False)
        seq_s = time.perf_counter() - started
        started = time.perf_counter()
        answers = compute_answers(target, suite.prompts, suite.max_new_tokens + max(ks), suite.stop_ids, layers)
        answers_s = time.perf_counter() - started
        started = time.perf_counter()
        replayed = evaluate_suite_prompts(target.model, drafter, suite, options, answers=answers, progress=False)
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
        al = f"{replayed.metrics[f'eval/{suite.name}/ref/k{max(ks)}/al']:.3f}"
        if sequential is not None:
            al += f" ({sequential.metrics[f'eval/{suite.name}/ref/k{max(ks)}/al']:.3f})"
        same = "-" if not pairs else "yes" if all(pairs) else f"NO: {sum(pairs)} of {len(pairs)} prompt x k"
        if pairs and not all(pairs):
            decoded = [(i, int(k), a["k"][k]["rounds"]) for i, a in enumerate(sequential.per_prompt["prompts"])
                       for k in a["k"]]  # fmt: skip
            differing = [d for d, equal in zip(decoded, pairs, strict=True) if not equal]
            why = parted(target, drafter, suite, answers, ks, differing, e.probes, e.n_sink)
            agreed = sum(d[2] for d, equal in zip(decoded, pairs, strict=True) if equal) + sum(a for _, a in why)
            total = sum(d[2] for d in decoded)
            same += f", {agreed} of {total} decoded rounds before any parted ({agreed / total:.1%}); why the others: "
            same += ", ".join(f"{n} {cause}" for cause, n in Counter(c for c, _ in why).most_common())
        print(f"| {suite.name} | {len(suite.prompts)} | {seq_s:.2f} | {answers_s:.2f} | {replay_s:.2f} | "
              f"{only_s:.2f} | {same} ({rounds} rounds) | {al} |")  # fmt: skip
        for i, v in enumerate((seq_s, answers_s, replay_s, only_s)):
            totals[i] += v
    seq_s, answers_s, replay_s, only_s = totals
    print(f"| all | | {seq_s:.2f} | {answers_s:.2f} | {replay_s:.2f} | {only_s:.2f} | | |")
    print(f"one run: sequential / (answers + replay) = {seq_s / (answers_s + replay_s):.1f}x")
    study = args.runs * seq_s / (answers_s + args.runs * replay_s)
    print(f"a study of {args.runs} runs (answers once): {args.runs * seq_s:.1f} s -> "
          f"{answers_s + args.runs * replay_s:.1f} s = {study:.1f}x")  # fmt: skip


def parted(
    target, drafter, suite, answers, ks: list[int], differing: list[tuple[int, int, int]], probes: bool, n_sink: int
) -> list[tuple[str, int]]:
    """Why each (prompt, k, the decoder's rounds) of `differing` parted from the replay, at its first differing
    round (the module's docstring names the causes). The decoder runs again as the evaluation ran it, its rounds
    recorded (`unreproduced` where their number is not the evaluation's); the replay's chains are those of the
    same batched unroll (the replay run again, its unrolls recorded). Each with the decoder's rounds before it
    parted."""
    deepest, eos = max(ks), suite.stop_ids[0] if suite.stop_ids else -1
    chains: list[tuple[torch.Tensor, torch.Tensor, list]] = []  # per unroll: ids [B, T], window [B, W], drafts
    with _recording(replay_module, "draft_chains", lambda out, a: chains.append(
        (a[1].cpu(), a[4].cpu(), torch.stack(out.drafts, 1).tolist())
    )):  # fmt: skip
        replay(drafter, answers, ks, suite.max_new_tokens, suite.stop_ids, n_sink, probes)
    # per prompt (both its k's may differ): is the batched answer the prompt's greedy decoding alone?
    as_alone = {
        i: answers.sequences[i][answers.prompt_lens[i] :]
        == greedy_answers(target.model, [suite.prompts[i]], suite.max_new_tokens + deepest, eos)[0]
        for i in {i for i, _, _ in differing}
    }
    causes = []
    for i, k, decoded in differing:
        seq, plen, top = answers.sequences[i], answers.prompt_lens[i], answers.top[i]
        drafts = next(  # the row of prompt i in the replay's unrolls: drafts[step][p - (plen - 1)]
            d[r] for ids, window, d in chains for r in range(len(ids))
            if ids[r, : len(seq)].tolist() == seq and int(window[r, 0]) == plen - 1
        )  # fmt: skip
        rounds: list[tuple[list[int], list[int]]] = []  # per decoder round: its drafts, the target's top-1s
        with _recording(
            reference, "_accept", lambda out, a, r=rounds: r.append((a[0].tolist(), a[2].argmax(-1).tolist()))
        ):
            pre = prefill(target.model, suite.prompts[i], drafter.spec.aux_layer_ids)
            drift = DriftProbes(k, n_sink) if probes else None
            speculative_decode(target.model, drafter, suite.prompts[i], suite.max_new_tokens, k, drift,
                               prefilled=pre, stop_ids=tuple(suite.stop_ids))  # fmt: skip
        n, agreed, cause = plen, 0, "end" if len(rounds) == decoded else "unreproduced"  # "end": none parted
        for ours, preds in rounds:
            if n - plen >= len(drafts[0]):  # the decoder went on past the replay's answer
                break
            theirs = [drafts[j][n - plen] for j in range(k)]  # the chain from position n - 1
            accepted = next((j for j in range(k) if ours[j] != preds[j]), k)
            replayed = next((j for j in range(k) if n + j >= len(top) or theirs[j] != top[n + j]), k)
            if accepted != replayed:
                j = min(accepted, replayed)
                if n + j < len(top):  # else the replay ran out of answer: "end"
                    sides = [side for side, differs in (("draft", ours[j] != theirs[j]),
                                                        ("verify", preds[j] != top[n + j])) if differs]  # fmt: skip
                    cause = "+".join(sides)
                break
            n, agreed = n + accepted + 1, agreed + 1
        causes.append((cause if as_alone[i] else "text", agreed))
    return causes


@contextlib.contextmanager
def _recording(module, name: str, record):
    """`module.name` calls `record(its result, its arguments)` on every call, for the block: what the decoder
    and the replay computed, observed where they compute it."""
    original = getattr(module, name)

    def recorded(*args):
        out = original(*args)
        record(out, args)
        return out

    setattr(module, name, recorded)
    try:
        yield
    finally:
        setattr(module, name, original)


if __name__ == "__main__":
    main()
