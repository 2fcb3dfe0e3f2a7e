"""Evaluate a drafter on suites with the reference decoder; returns metrics named as in design.md.

A value that is a list is a curve (logged with step = position 1..k).
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from lab.data.suites import Suite
from lab.drafter import Eagle3Drafter
from lab.eval.probes import DriftProbes, fc_share, rollout_accuracy
from lab.eval.reference import DecodeStats, speculative_decode, target_decode
from lab.target import capture, target_logits

Metrics = dict[str, float | list[float]]


def evaluate_suite(
    target_model,
    drafter: Eagle3Drafter,
    suite: Suite,
    ks: list[int],
    progress: bool = True,
    probes: bool = False,
    n_sink: int = 1,
    temperature: float = 0.0,
    seed: int = 0,
) -> Metrics:
    """AL, acceptance curves, tokens/s and speedup over plain decoding of the target, per k, measured
    side by side prompt by prompt; with `probes`, the drift curves `drift/{suite}/k{k}/...` too."""
    drafter.eval()
    # warm-up: the first forward passes pay one-off allocation costs that would skew the timings
    target_decode(target_model, suite.prompts[0], 4)
    speculative_decode(target_model, drafter, suite.prompts[0], 4, max(ks))

    base_seconds, base_tokens = 0.0, 0
    totals = {k: DecodeStats() for k in ks}
    matches = dict.fromkeys(ks, 0)
    drift = {k: DriftProbes(k, n_sink) for k in ks} if probes else {}
    bar = tqdm(suite.prompts, desc=f"eval {suite.name} k={ks}", unit="prompt", disable=not progress)
    gen = torch.Generator().manual_seed(seed)
    for prompt in bar:
        reference, seconds = target_decode(target_model, prompt, suite.max_new_tokens, temperature, gen)
        base_seconds += seconds
        base_tokens += len(reference)
        for k in ks:
            tokens, stats = speculative_decode(
                target_model, drafter, prompt, suite.max_new_tokens, k, drift.get(k), temperature, gen
            )
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
        if temperature == 0:  # sampled outputs differ from the baseline's samples by design
            metrics[f"{prefix}/exact_match"] = matches[k] / len(suite.prompts)
        if probes:
            metrics.update({f"drift/{suite.name}/k{k}/{name}": c for name, c in drift[k].curves().items()})
    return metrics


@torch.no_grad()
def heldout_metrics(
    target, drafter: Eagle3Drafter, heldout: torch.Tensor, depth: int, suite: str = "in_dist"
) -> Metrics:
    """Teacher-forced rollout accuracy per depth and the captured layers' fc shares, on held-out text."""
    cap = capture(target.model, heldout, drafter.spec.aux_layer_ids)
    top = target_logits(cap.final, target.lm_head_weight).argmax(-1)
    return {
        f"eval/{suite}/rollout/acc": rollout_accuracy(drafter, heldout, cap.aux, top, depth),
        "drift/fc_share": fc_share(drafter, cap.aux),
    }
