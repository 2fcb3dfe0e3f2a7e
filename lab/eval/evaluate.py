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
from lab.data.answers import Answers
from lab.data.cache import HeldoutStates, capture_heldout
from lab.data.code_data import Sequences
from lab.data.suites import Suite
from lab.device import autocast
from lab.drafter import Eagle3Drafter
from lab.eval.probes import DriftProbes, fc_share, pooled_rollout_accuracy, rollout_counts
from lab.eval.reference import DecodeStats, prefill, speculative_decode, target_decode
from lab.eval.replay import Replayed, replay

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


def timed_prompts(num_prompts: int, count: int) -> list[int]:
    """The prompts the decoder times with eval.decoder=replay: `count` of them, evenly spread over the suite
    (whose variants come one after another), always the same ones."""
    return sorted({i * num_prompts // count for i in range(min(count, num_prompts))})


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
    answers: Answers | None = None,
    timed: list[int] | None = None,
) -> Evaluation:
    """AL, acceptance curves, tokens/s and speedup over plain decoding of the target, per k, measured side by
    side prompt by prompt; with `probes`, the drift curves `drift/{suite}/k{k}/...` too (a suite with several
    variants also gets each variant's metrics under `{suite}.{variant}`). And, per prompt (in the suite's
    order, as in `suites/{suite}.json`) and k, the drafting rounds, accepted drafts, accepted drafts per
    position and, with `probes`, the drift probes' sums (`DriftProbes`): AL = 1 + sum(accepted) / sum(rounds)
    over the prompts is the logged `eval/{suite}/ref/k{k}/al`, and the probes' sums pooled the same way give
    the drift curves.

    Without `answers` (`eval.decoder=sequential`) the reference decoder decodes every prompt. With the
    suite's greedy `answers` (`eval.decoder=replay`, temperature 0) the rounds, acceptance and drift of every
    prompt come from the replay (lab/eval/replay.py, equal to the decoder's), and the decoder runs only on the
    prompts `timed` (indices), for tokens/s, speedup, the cost ratios and exact match; the limits combine
    those cost ratios with the replay's AL. The per-prompt document names the timed prompts (`timed`)."""
    drafter.eval()
    if answers is not None and temperature > 0:
        raise ValueError("eval.decoder=replay needs temperature 0: sampled outputs are not the greedy answers")
    timed = list(range(len(suite.prompts))) if answers is None else list(timed or [])
    sequential_probes = probes and answers is None  # the replay's probes stand for the timed sample's
    decoded = _decode(target_model, drafter, suite, ks, timed, progress, sequential_probes, n_sink, temperature, seed)
    if answers is not None:
        replayed = replay(drafter, answers, ks, suite.max_new_tokens, suite.stop_ids, n_sink, probes)
        counted = {i: _Tally.replayed(ks, n_sink, probes, r) for i, r in enumerate(replayed)}
    else:
        counted = decoded
    records = []
    for index, (prompt, variant) in enumerate(zip(suite.prompts, suite.variants, strict=True)):
        tally = counted[index]
        by_k = {}
        for k in ks:
            st = tally.stats[k]
            record: dict[str, Any] = {"rounds": st.rounds, "accepted": st.accepted, "accepted_at": list(st.accepted_at)}
            if k in tally.drift:
                record["drift"] = tally.drift[k].sums()
            if answers is not None and index in decoded:  # a timed prompt: what the decoder counted beside it
                got = decoded[index].stats[k]
                record["decoded"] = {"rounds": got.rounds, "accepted": got.accepted, "accepted_at": got.accepted_at}
            by_k[str(k)] = record
        records.append({"index": index, "id": prompt_id(prompt), "variant": variant, "k": by_k})

    def pooled(tallies: dict[int, _Tally], variant: str | None) -> _Tally:
        total = _Tally(ks, n_sink, probes)
        for i, tally in tallies.items():  # in the prompts' order, as the sums were always added
            if variant is None or suite.variants[i] == variant:
                total.merge(tally)
        return total

    def agreement(name: str, variant: str | None) -> Metrics:
        """Replay only: on the timed prompts, the share whose decoded rounds equal the replay's, per k."""
        timed_here = [i for i in decoded if variant is None or suite.variants[i] == variant]
        if answers is None or not timed_here:
            return {}
        same = {k: sum(_same_rounds(decoded[i].stats[k], counted[i].stats[k]) for i in timed_here) for k in ks}
        return {metric_keys.replay_agreement(name, k): same[k] / len(timed_here) for k in ks}

    metrics = pooled(counted, None).metrics(suite.name, temperature, pooled(decoded, None))
    metrics.update(agreement(suite.name, None))
    variants = list(dict.fromkeys(suite.variants))
    if len(variants) > 1:
        for variant in variants:
            name = metric_keys.suite_variant(suite.name, variant)
            metrics.update(pooled(counted, variant).metrics(name, temperature, pooled(decoded, variant)))
            metrics.update(agreement(name, variant))
    per_prompt = {
        "format": PER_PROMPT_FORMAT,
        "suite": suite.name,
        "seed": seed,
        "ks": list(ks),
        "decoder": "sequential" if answers is None else "replay",
        "timed": timed,
        "prompts": records,
    }
    return Evaluation(metrics, per_prompt)


def _same_rounds(a: DecodeStats, b: DecodeStats) -> bool:
    return (a.rounds, a.accepted, list(a.accepted_at)) == (b.rounds, b.accepted, list(b.accepted_at))


def _decode(
    target_model,
    drafter: Eagle3Drafter,
    suite: Suite,
    ks: list[int],
    indices: list[int],
    progress: bool,
    probes: bool,
    n_sink: int,
    temperature: float,
    seed: int,
) -> dict[int, _Tally]:
    """The reference decoder, plain and at every k, on the prompts `indices`: one tally per prompt."""
    out: dict[int, _Tally] = {}
    if not indices:
        return out
    # warm-up: the first forward passes pay one-off allocation costs that would skew the timings
    target_decode(target_model, suite.prompts[indices[0]], 4)
    speculative_decode(target_model, drafter, suite.prompts[indices[0]], 4, max(ks))
    gen = torch.Generator().manual_seed(seed)
    for index in tqdm(indices, desc=f"eval {suite.name} k={ks}", unit="prompt", disable=not progress):
        prompt, tally = suite.prompts[index], _Tally(ks, n_sink, probes)
        pre = prefill(target_model, prompt, drafter.spec.aux_layer_ids)
        reference, seconds = target_decode(
            target_model, prompt, suite.max_new_tokens, temperature, gen, pre, suite.stop_ids
        )
        tally.base_seconds += seconds
        tally.base_prefill_seconds += pre.seconds
        tally.base_tokens += len(reference)
        tally.prompts += 1
        for k in ks:
            drift = DriftProbes(k, n_sink) if probes else None
            tokens, stats = speculative_decode(
                target_model, drafter, prompt, suite.max_new_tokens, k, drift, temperature, gen, pre, suite.stop_ids
            )
            tally.stats[k].merge(stats)
            tally.matches[k] += int(tokens == reference)
            if drift is not None:
                tally.drift[k].merge(drift)
        out[index] = tally
    return out


class _Tally:
    """Decode statistics and drift probes of one suite variant (or one prompt), per k."""

    def __init__(self, ks: list[int], n_sink: int, probes: bool):
        self.base_seconds, self.base_prefill_seconds, self.base_tokens, self.prompts = 0.0, 0.0, 0, 0
        self.stats = {k: DecodeStats() for k in ks}
        self.matches = dict.fromkeys(ks, 0)
        self.drift = {k: DriftProbes(k, n_sink) for k in ks} if probes else {}

    @classmethod
    def replayed(cls, ks: list[int], n_sink: int, probes: bool, replayed: Replayed) -> _Tally:
        """One prompt's replayed rounds and drift (no seconds: those come from the timed prompts)."""
        tally = cls(ks, n_sink, probes)
        for k in ks:
            tally.stats[k].merge(replayed.stats[k])
            if probes:
                tally.drift[k].merge(replayed.drift[k])
        return tally

    def merge(self, other: _Tally) -> None:
        self.base_seconds += other.base_seconds
        self.base_prefill_seconds += other.base_prefill_seconds
        self.base_tokens += other.base_tokens
        self.prompts += other.prompts
        for k, st in other.stats.items():
            self.stats[k].merge(st)
            self.matches[k] += other.matches[k]
            if k in other.drift and k in self.drift:
                self.drift[k].merge(other.drift[k])

    def metrics(self, name: str, temperature: float, timing: _Tally) -> Metrics:
        """Acceptance and drift from this tally's rounds; tokens/s, speedup, the cost ratios and exact match
        from `timing`'s decoded prompts (the same tally when every prompt was decoded; none: no such keys)."""
        out: Metrics = {}
        for k, st in self.stats.items():
            out[metric_keys.acceptance_length(name, k)] = st.acceptance_length
            out[metric_keys.accept_rate(name, k)] = st.accept_rate
            out[metric_keys.cond_accept_rate(name, k)] = st.conditional_accept_rate
            if k in self.drift:
                out.update({metric_keys.drift(name, k, c): v for c, v in self.drift[k].curves().items()})
        if not timing.prompts:
            return out
        out[metric_keys.baseline_tokens_per_s(name)] = timing.base_tokens / timing.base_seconds
        # the target's cost per decoded token: its decoding without the prefill (the first token comes from it)
        base_decoding = timing.base_seconds - timing.base_prefill_seconds
        target_per_token = base_decoding / max(1, timing.base_tokens - timing.prompts)
        for k, st in timing.stats.items():
            al = self.stats[k].acceptance_length
            out[metric_keys.tokens_per_s(name, k)] = st.generated / st.seconds
            out[metric_keys.speedup(name, k)] = timing.base_seconds / st.seconds
            c = st.draft_cost_ratio(k, target_per_token)
            out[metric_keys.draft_cost_ratio(name, k)] = c
            out[metric_keys.chain_limit(name, k)] = al / (1 + k * c)
            # verifying k + 1 tokens costs more than one decode step: the part of the gap that is not overhead
            v = st.verify_cost_ratio(target_per_token)
            out[metric_keys.verify_cost_ratio(name, k)] = v
            out[metric_keys.verify_limit(name, k)] = al / (v + k * c)
            if temperature == 0:  # sampled outputs differ from the baseline's samples by design
                out[metric_keys.exact_match(name, k)] = timing.matches[k] / timing.prompts
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
