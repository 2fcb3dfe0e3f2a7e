"""Evaluate a drafter on suites with the reference decoder; returns metrics named as in design.md.

A value that is a list is a curve (logged with step = position 1..k).
"""

from __future__ import annotations

from tqdm.auto import tqdm

from lab.data.suites import Suite
from lab.drafter import Eagle3Drafter
from lab.eval.reference import DecodeStats, greedy_decode, speculative_decode

Metrics = dict[str, float | list[float]]


def evaluate_suite(target_model, drafter: Eagle3Drafter, suite: Suite, ks: list[int], progress: bool = True) -> Metrics:
    """AL, acceptance curves, tokens/s and speedup over plain greedy decoding, per k, side by side."""
    drafter.eval()
    # warm-up: the first forward passes pay one-off allocation costs that would skew the timings
    greedy_decode(target_model, suite.prompts[0], 4)
    speculative_decode(target_model, drafter, suite.prompts[0], 4, max(ks))

    base_seconds, base_tokens = 0.0, 0
    totals = {k: DecodeStats() for k in ks}
    matches = dict.fromkeys(ks, 0)
    bar = tqdm(suite.prompts, desc=f"eval {suite.name} k={ks}", unit="prompt", disable=not progress)
    for prompt in bar:
        reference, seconds = greedy_decode(target_model, prompt, suite.max_new_tokens)
        base_seconds += seconds
        base_tokens += len(reference)
        for k in ks:
            tokens, stats = speculative_decode(target_model, drafter, prompt, suite.max_new_tokens, k)
            totals[k].merge(stats)
            matches[k] += int(tokens == reference)
    metrics: Metrics = {f"eval/{suite.name}/ref/baseline_tokens_per_s": base_tokens / base_seconds}
    for k, st in totals.items():
        prefix = f"eval/{suite.name}/ref/k{k}"
        metrics[f"{prefix}/al"] = st.acceptance_length
        metrics[f"{prefix}/accept_rate"] = st.accept_rate
        metrics[f"{prefix}/cond_accept_rate"] = st.conditional_accept_rate
        metrics[f"{prefix}/tokens_per_s"] = st.generated / st.seconds
        metrics[f"{prefix}/speedup"] = base_seconds / st.seconds
        metrics[f"{prefix}/exact_match"] = matches[k] / len(suite.prompts)
    return metrics
