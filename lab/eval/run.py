"""Evaluate a drafter on suites with the reference decoder; returns metrics named by lab/metrics.py.

A value that is a list is a curve (logged with step = position 1..k). Beside the metrics, the counts
behind them per prompt (per held-out sequence for the rollout), the `per_prompt/*.json` artifacts that
the report's paired bootstrap resamples: pooled over the prompts they give back the logged metrics.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from lab import metrics as metric_keys
from lab.data.cache import HeldoutStates, capture_heldout
from lab.data.suites import Suite
from lab.data.text import Sequences
from lab.device import autocast
from lab.drafter import Eagle3Drafter
from lab.eval.probes import DriftProbes, fc_share, pooled_rollout_accuracy, rollout_counts
from lab.eval.reference import DecodeStats, prefill, speculative_decode, target_decode

Metrics = dict[str, float | list[float]]
PER_PROMPT_FORMAT = 1  # the version of the per_prompt/*.json artifacts (docs/metrics.md)


@dataclass
class Evaluation:
    """Metrics as logged, and the per-prompt (per-sequence) counts behind them: the JSON document logged
    as `per_prompt/{suite}.json` (`per_prompt/rollout.json` for the held-out rollout)."""

    metrics: Metrics
    per_prompt: dict[str, Any]


def prompt_id(tokens: list[int]) -> str:
    """A prompt's (a sequence's) identity across runs: the first 12 hex digits of the sha256 of its token
    ids as JSON, so that a report pairs the same prompt and never two that merely share an index."""
    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:12]


def evaluate_suite_prompts(
    target_model,
    drafter: Eagle3Drafter,
    suite: Suite,
    ks: list[int],
    progress: bool = True,
    probes: bool = False,
    n_sink: int = 1,
    temperature: float = 0.0,
    seed: int = 0,
) -> Evaluation:
    """AL, acceptance curves, tokens/s and speedup over plain decoding of the target, per k, measured side by
    side prompt by prompt; with `probes`, the drift curves `drift/{suite}/k{k}/...` too (a suite with several
    variants also gets each variant's metrics under `{suite}.{variant}`). And, per prompt (in the suite's
    order, as in `suites/{suite}.json`) and k, the drafting rounds, accepted drafts, accepted drafts per
    position and, with `probes`, the drift probes' sums (`DriftProbes`): AL = 1 + sum(accepted) / sum(rounds)
    over the prompts is the logged `eval/{suite}/ref/k{k}/al`, and the probes' sums pooled the same way give
    the drift curves."""
    drafter.eval()
    # warm-up: the first forward passes pay one-off allocation costs that would skew the timings
    target_decode(target_model, suite.prompts[0], 4)
    speculative_decode(target_model, drafter, suite.prompts[0], 4, max(ks))

    results = {v: _Tally(ks, n_sink, probes) for v in dict.fromkeys(suite.variants)}
    bar = tqdm(suite.prompts, desc=f"eval {suite.name} k={ks}", unit="prompt", disable=not progress)
    gen = torch.Generator().manual_seed(seed)
    records = []
    for index, (prompt, variant) in enumerate(zip(bar, suite.variants, strict=True)):
        tally = results[variant]
        pre = prefill(target_model, prompt, drafter.spec.aux_layer_ids)
        reference, seconds = target_decode(
            target_model, prompt, suite.max_new_tokens, temperature, gen, pre, suite.stop_ids
        )
        tally.base_seconds += seconds
        tally.base_prefill_seconds += pre.seconds
        tally.base_tokens += len(reference)
        tally.prompts += 1
        by_k = {}
        for k in ks:
            drift = DriftProbes(k, n_sink) if probes else None
            tokens, stats = speculative_decode(
                target_model, drafter, prompt, suite.max_new_tokens, k, drift, temperature, gen, pre, suite.stop_ids
            )
            tally.stats[k].merge(stats)
            tally.matches[k] += int(tokens == reference)
            record: dict[str, Any] = {"rounds": stats.rounds, "accepted": stats.accepted}
            record["accepted_at"] = list(stats.accepted_at)
            if drift is not None:
                tally.drift[k].merge(drift)
                record["drift"] = drift.sums()
            by_k[str(k)] = record
        records.append({"index": index, "id": prompt_id(prompt), "variant": variant, "k": by_k})
    total = _Tally(ks, n_sink, probes)
    for tally in results.values():
        total.merge(tally)
    metrics = total.metrics(suite.name, temperature)
    if len(results) > 1:
        for variant, tally in results.items():
            metrics.update(tally.metrics(metric_keys.suite_variant(suite.name, variant), temperature))
    per_prompt = {
        "format": PER_PROMPT_FORMAT,
        "suite": suite.name,
        "seed": seed,
        "ks": list(ks),
        "prompts": records,
    }
    return Evaluation(metrics, per_prompt)


class _Tally:
    """Decode statistics and drift probes of one suite variant, per k."""

    def __init__(self, ks: list[int], n_sink: int, probes: bool):
        self.base_seconds, self.base_prefill_seconds, self.base_tokens, self.prompts = 0.0, 0.0, 0, 0
        self.stats = {k: DecodeStats() for k in ks}
        self.matches = dict.fromkeys(ks, 0)
        self.drift = {k: DriftProbes(k, n_sink) for k in ks} if probes else {}

    def merge(self, other: _Tally) -> None:
        self.base_seconds += other.base_seconds
        self.base_prefill_seconds += other.base_prefill_seconds
        self.base_tokens += other.base_tokens
        self.prompts += other.prompts
        for k, st in other.stats.items():
            self.stats[k].merge(st)
            self.matches[k] += other.matches[k]
            if k in other.drift:
                self.drift[k].merge(other.drift[k])

    def metrics(self, name: str, temperature: float) -> Metrics:
        out: Metrics = {metric_keys.baseline_tokens_per_s(name): self.base_tokens / self.base_seconds}
        # the target's cost per decoded token: its decoding without the prefill (the first token comes from it)
        target_per_token = (self.base_seconds - self.base_prefill_seconds) / max(1, self.base_tokens - self.prompts)
        for k, st in self.stats.items():
            out[metric_keys.acceptance_length(name, k)] = st.acceptance_length
            out[metric_keys.accept_rate(name, k)] = st.accept_rate
            out[metric_keys.cond_accept_rate(name, k)] = st.conditional_accept_rate
            out[metric_keys.tokens_per_s(name, k)] = st.generated / st.seconds
            out[metric_keys.speedup(name, k)] = self.base_seconds / st.seconds
            c = st.draft_cost_ratio(k, target_per_token)
            out[metric_keys.draft_cost_ratio(name, k)] = c
            out[metric_keys.chain_limit(name, k)] = st.acceptance_length / (1 + k * c)
            # verifying k + 1 tokens costs more than one decode step: the part of the gap that is not overhead
            v = st.verify_cost_ratio(target_per_token)
            out[metric_keys.verify_cost_ratio(name, k)] = v
            out[metric_keys.verify_limit(name, k)] = st.acceptance_length / (v + k * c)
            if temperature == 0:  # sampled outputs differ from the baseline's samples by design
                out[metric_keys.exact_match(name, k)] = self.matches[k] / self.prompts
            if k in self.drift:
                out.update({metric_keys.drift(name, k, c): v for c, v in self.drift[k].curves().items()})
        return out


@torch.no_grad()
def heldout_evaluation(
    target,
    drafter: Eagle3Drafter,
    heldout: Sequences,
    depth: int,
    suite: str = "in_dist",
    seed: int = 0,
    states: HeldoutStates | None = None,
) -> Evaluation:
    """Teacher-forced rollout accuracy per depth (on the assistant's tokens) and the captured layers' fc shares,
    on held-out conversations, and, per held-out sequence, the rollout's hits and counted positions per depth
    (`per_prompt/rollout.json`): sum(hits) / sum(counted) over the sequences is the logged accuracy. The
    target's side (its captured layers and argmax) comes from `states` (the cache stage's
    `heldout_states`) or, without them, from a capture here."""
    device, dtype = target.lm_head_weight.device, target.lm_head_weight.dtype
    input_ids, loss_mask = heldout.input_ids.to(device), heldout.loss_mask.to(device)
    if states is None:
        aux, top = capture_heldout(target, heldout.input_ids, drafter.spec.aux_layer_ids)
    else:
        aux, top = states.aux.to(device), states.top.to(device)
    with autocast(device, dtype):  # the drafter in the target's dtype, as the reference decoder runs it
        hits, counted = rollout_counts(drafter, input_ids, aux, top, depth, loss_mask)
    key = metric_keys.rollout_accuracy(suite)
    metrics: Metrics = {key: pooled_rollout_accuracy(hits, counted), metric_keys.fc_share(): fc_share(drafter, aux)}
    sequences = [
        {"index": i, "id": prompt_id(ids), "hits": h, "counted": c}
        for i, (ids, h, c) in enumerate(
            zip(heldout.input_ids.tolist(), hits.T.tolist(), counted.T.tolist(), strict=True)
        )
    ]
    per_sequence = {
        "format": PER_PROMPT_FORMAT,
        "metric": key,
        "suite": suite,
        "seed": seed,
        "depth": depth,
        "sequences": sequences,
    }
    return Evaluation(metrics, per_sequence)
