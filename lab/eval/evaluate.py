"""Evaluate a drafter on suites with the reference decoder; returns metrics named by lab/metrics.py.

A suite's prompts are counted one of two ways (`eval.decoder`): replayed over the target's greedy answers, the
decoder timing a sample of them, or decoded one by one. Either way each prompt gets a tally, the metrics pool
the tallies, and the same counts are logged per prompt (`per_prompt/*.json`, what the report's paired bootstrap
resamples): pooled over the prompts they give back the logged metrics. A value that is a list is a curve
(logged with step = position 1..k).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig
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


@dataclass(frozen=True)
class EvalOptions:
    """How the reference decoder evaluates a suite: the config's `eval` keys it reads, and the run's seed."""

    ks: list[int]  # the drafting depths k (eval.num_speculative_tokens)
    probes: bool = False  # the drift probes beside the rounds
    n_sink: int = 1  # leading positions counted as the attention sink
    temperature: float = 0.0  # 0 = greedy; > 0 = lossless speculative sampling (the decoder only)
    seed: int = 0  # of the generator the decoder samples from
    timed_prompts: int = 0  # replayed suites: how many prompts the decoder times (`timed_prompts`); 0: none
    kv_cache: str = "auto"  # the target's KV cache in the decoder (the config's `kv_cache`: auto is static on CUDA)

    @classmethod
    def from_config(cls, cfg: DictConfig) -> EvalOptions:
        e, cache = cfg.eval, str(getattr(cfg.kv_cache, "value", cfg.kv_cache))
        return cls(list(e.num_speculative_tokens), e.probes, e.n_sink, e.temperature, cfg.seed, e.timed_prompts, cache)


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
    options: EvalOptions,
    answers: Answers | None = None,
    progress: bool = True,
) -> Evaluation:
    """AL, acceptance curves, tokens/s and speedup over plain decoding of the target, per k, measured side by
    side prompt by prompt; with `options.probes`, the drift curves `drift/{suite}/k{k}/...` too (a suite with
    several variants also gets each variant's metrics under `{suite}.{variant}`). And, per prompt (in the
    suite's order, as in `suites/{suite}.json`) and k, the drafting rounds, accepted drafts, accepted drafts per
    position and, with probes, the drift probes' sums (`DriftProbes`): AL = 1 + sum(accepted) / sum(rounds)
    over the prompts is the logged `eval/{suite}/ref/k{k}/al`, and the probes' sums pooled the same way give
    the drift curves.

    Without `answers` (`eval.decoder=sequential`) the reference decoder decodes every prompt. With the
    suite's greedy `answers` (`eval.decoder=replay`, temperature 0) the rounds, acceptance and drift of every
    prompt come from the replay (lab/eval/replay.py, equal to the decoder's), and the decoder runs only on
    `options.timed_prompts` prompts (`timed_prompts`), for tokens/s, speedup, the cost ratios and exact match;
    the limits combine those cost ratios with the replay's AL. The per-prompt document names the timed prompts
    (`timed`)."""
    drafter.eval()
    if answers is None:
        counts = _sequential(target_model, drafter, suite, options, progress)
    else:
        counts = _replayed(target_model, drafter, suite, options, answers, progress)
    records = [
        _prompt_record(index, prompt, variant, counts, options.ks)
        for index, (prompt, variant) in enumerate(zip(suite.prompts, suite.variants, strict=True))
    ]
    metrics: Metrics = {}
    for name, members in _pooling_groups(suite):
        metrics.update(_pooled_metrics(name, members, counts, options))
    per_prompt = {
        "format": PER_PROMPT_FORMAT,
        "suite": suite.name,
        "seed": options.seed,
        "ks": list(options.ks),
        "decoder": counts.decoder,
        "timed": list(counts.decoded),  # the prompts the decoder ran
        "prompts": records,
    }
    return Evaluation(metrics, per_prompt)


@dataclass
class _Tally:
    """What the metrics are computed from, per k: one prompt's counts, or those of a group of prompts summed."""

    stats: dict[int, DecodeStats]  # the speculative rounds, accepted drafts and seconds (replayed: no seconds)
    matches: dict[int, int]  # decoded prompts whose speculative output equals the plain decoding's
    drift: dict[int, DriftProbes]  # the drift probes' sums; empty without probes
    prompts: int = 0  # prompts decoded plainly too (the baseline); none for a replayed one
    base_tokens: int = 0  # the plain decoding's tokens, seconds and, of those, its prefill's
    base_seconds: float = 0.0
    base_prefill_seconds: float = 0.0

    @classmethod
    def empty(cls, ks: list[int], n_sink: int, probes: bool) -> _Tally:
        drift = {k: DriftProbes(k, n_sink) for k in ks} if probes else {}
        return cls({k: DecodeStats() for k in ks}, dict.fromkeys(ks, 0), drift)

    @classmethod
    def of_replay(cls, replayed: Replayed, options: EvalOptions) -> _Tally:
        """One prompt's replayed rounds and drift (no seconds: those come from the timed prompts)."""
        tally = cls.empty(options.ks, options.n_sink, options.probes)
        for k in options.ks:
            tally.stats[k].merge(replayed.stats[k])
            if options.probes:
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


@dataclass
class _Counts:
    """A suite's tallies by prompt index: `counted` holds every prompt's rounds, acceptance and drift, `decoded`
    the decoder's tallies of the prompts it ran (every prompt, or the replay's timed sample), which give the
    timings. Sequentially they are the same tallies."""

    decoder: str  # "sequential" or "replay", as eval.decoder names it
    counted: dict[int, _Tally]
    decoded: dict[int, _Tally]


def _sequential(target_model, drafter: Eagle3Drafter, suite: Suite, options: EvalOptions, progress: bool) -> _Counts:
    """eval.decoder=sequential: the decoder on every prompt."""
    decoded = _decode(target_model, drafter, suite, list(range(len(suite.prompts))), options, options.probes, progress)
    return _Counts("sequential", decoded, decoded)


def _replayed(
    target_model, drafter: Eagle3Drafter, suite: Suite, options: EvalOptions, answers: Answers, progress: bool
) -> _Counts:
    """eval.decoder=replay: every prompt's rounds and drift from the replay over the greedy answers; the decoder
    on the timed prompts only, without probes (the replay's stand for theirs)."""
    if options.temperature > 0:
        raise ValueError("eval.decoder=replay needs temperature 0: sampled outputs are not the greedy answers")
    timed = timed_prompts(len(suite.prompts), options.timed_prompts)
    decoded = _decode(target_model, drafter, suite, timed, options, False, progress)
    ks, n_sink = options.ks, options.n_sink
    replayed = replay(drafter, answers, ks, suite.max_new_tokens, suite.stop_ids, n_sink, options.probes)
    counted = {index: _Tally.of_replay(r, options) for index, r in enumerate(replayed)}
    return _Counts("replay", counted, decoded)


def _decode(
    target_model,
    drafter: Eagle3Drafter,
    suite: Suite,
    indices: list[int],
    options: EvalOptions,
    probes: bool,
    progress: bool,
) -> dict[int, _Tally]:
    """The reference decoder, plain and at every k, on the prompts `indices`: one tally per prompt, every
    prompt drawing from one generator seeded with `options.seed`."""
    if not indices:
        return {}
    # warm-up: the first forward passes pay one-off allocation costs (on CUDA the static cache's compile and its
    # graphs for every width) that would skew the timings
    first = suite.prompts[indices[0]]
    pre = prefill(target_model, first, drafter.spec.aux_layer_ids, options.kv_cache, _room(suite, options))
    target_decode(target_model, first, 4, prefilled=pre)
    for k in options.ks:
        speculative_decode(target_model, drafter, first, 4, k, prefilled=pre)
    gen = torch.Generator().manual_seed(options.seed)
    bar = tqdm(indices, desc=f"eval {suite.name} k={options.ks}", unit="prompt", disable=not progress)
    return {index: _decode_prompt(target_model, drafter, suite, index, options, probes, gen) for index in bar}


def _decode_prompt(
    target_model,
    drafter: Eagle3Drafter,
    suite: Suite,
    index: int,
    options: EvalOptions,
    probes: bool,
    gen: torch.Generator,
) -> _Tally:
    """Prompt `index` decoded plainly (the baseline), then speculatively at each k, all from one prefill."""
    prompt, temperature = suite.prompts[index], options.temperature
    max_new, stops = suite.max_new_tokens, suite.stop_ids
    tally = _Tally.empty(options.ks, options.n_sink, probes)
    pre = prefill(target_model, prompt, drafter.spec.aux_layer_ids, options.kv_cache, _room(suite, options))
    reference, seconds = target_decode(target_model, prompt, max_new, temperature, gen, pre, stops)
    tally.base_seconds += seconds
    tally.base_prefill_seconds += pre.seconds
    tally.base_tokens += len(reference)
    tally.prompts += 1
    for k in options.ks:
        drift = DriftProbes(k, options.n_sink) if probes else None
        tokens, stats = speculative_decode(
            target_model, drafter, prompt, max_new, k, drift, temperature, gen, pre, stops
        )
        tally.stats[k].merge(stats)
        tally.matches[k] += int(tokens == reference)
        if drift is not None:
            tally.drift[k].merge(drift)
    return tally


def _room(suite: Suite, options: EvalOptions) -> int:
    """The positions a prompt's decodings write after it: its answer and the deepest round's drafts past it."""
    return suite.max_new_tokens + max(options.ks) + 1


def _rounds(stats: DecodeStats) -> dict[str, Any]:
    """A prompt's rounds at one k as its per-prompt record keeps them."""
    return {"rounds": stats.rounds, "accepted": stats.accepted, "accepted_at": list(stats.accepted_at)}


def _prompt_record(index: int, prompt: list[int], variant: str, counts: _Counts, ks: list[int]) -> dict[str, Any]:
    """One prompt's entry in `per_prompt/{suite}.json`: per k its rounds, its drift sums with probes and, on a
    prompt the decoder timed beside the replay, the decoder's own rounds under `decoded`."""
    tally = counts.counted[index]
    timed = counts.decoded.get(index) if counts.decoder == "replay" else None
    by_k = {}
    for k in ks:
        record = _rounds(tally.stats[k])
        if k in tally.drift:
            record["drift"] = tally.drift[k].sums()
        if timed is not None:
            record["decoded"] = _rounds(timed.stats[k])
        by_k[str(k)] = record
    return {"index": index, "id": prompt_id(prompt), "variant": variant, "k": by_k}


def _pooling_groups(suite: Suite) -> list[tuple[str, list[int]]]:
    """The names metrics are logged under and the prompts pooled for each: the whole suite and, where it has
    several variants, each variant (in the order they first appear)."""
    groups = [(suite.name, list(range(len(suite.prompts))))]
    variants = list(dict.fromkeys(suite.variants))
    if len(variants) > 1:
        for variant in variants:
            members = [i for i, v in enumerate(suite.variants) if v == variant]
            groups.append((metric_keys.suite_variant(suite.name, variant), members))
    return groups


def _pooled(tallies: list[_Tally], options: EvalOptions) -> _Tally:
    """The tallies summed, in the order given: float sums in another order could differ in their last bits."""
    total = _Tally.empty(options.ks, options.n_sink, options.probes)
    for tally in tallies:
        total.merge(tally)
    return total


def _pooled_metrics(name: str, members: list[int], counts: _Counts, options: EvalOptions) -> Metrics:
    """The metrics logged under `name`, from the prompts `members` (in the prompts' order): acceptance and drift
    from every one's rounds, the timings from those the decoder ran and, replayed, the replay's agreement."""
    timed = [i for i in members if i in counts.decoded]
    counted = _pooled([counts.counted[i] for i in members], options)
    timing = _pooled([counts.decoded[i] for i in timed], options)
    metrics = _acceptance_metrics(name, counted)
    metrics.update(_timing_metrics(name, counted, timing, options.temperature))
    if counts.decoder == "replay":
        metrics.update(_replay_agreement(name, [(counts.decoded[i], counts.counted[i]) for i in timed], options.ks))
    return metrics


def _acceptance_metrics(name: str, counted: _Tally) -> Metrics:
    """AL, the acceptance curves and, with probes, the drift curves, per k."""
    out: Metrics = {}
    for k, st in counted.stats.items():
        out[metric_keys.acceptance_length(name, k)] = st.acceptance_length
        out[metric_keys.accept_rate(name, k)] = st.accept_rate
        out[metric_keys.cond_accept_rate(name, k)] = st.conditional_accept_rate
        if k in counted.drift:
            out.update({metric_keys.drift(name, k, c): v for c, v in counted.drift[k].curves().items()})
    return out


def _timing_metrics(name: str, counted: _Tally, timing: _Tally, temperature: float) -> Metrics:
    """Tokens/s, speedup, the cost ratios and exact match from `timing`'s decoded prompts (none: no such keys);
    the limits combine its cost ratios with `counted`'s AL."""
    if not timing.prompts:
        return {}
    out: Metrics = {metric_keys.baseline_tokens_per_s(name): timing.base_tokens / timing.base_seconds}
    # the target's cost per decoded token: its decoding without the prefill (the first token comes from it)
    base_decoding = timing.base_seconds - timing.base_prefill_seconds
    target_per_token = base_decoding / max(1, timing.base_tokens - timing.prompts)
    for k, st in timing.stats.items():
        al = counted.stats[k].acceptance_length
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


def _replay_agreement(name: str, pairs: list[tuple[_Tally, _Tally]], ks: list[int]) -> Metrics:
    """Per k, the share of the timed prompts (decoded, replayed) whose decoded rounds equal the replay's."""
    if not pairs:
        return {}
    same = {k: sum(_rounds(decoded.stats[k]) == _rounds(replayed.stats[k]) for decoded, replayed in pairs) for k in ks}
    return {metric_keys.replay_agreement(name, k): same[k] / len(pairs) for k in ks}


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
    per_sequence = zip(heldout.input_ids.tolist(), hits.T.tolist(), counted.T.tolist(), strict=True)
    sequences = [
        {"index": i, "id": prompt_id(ids), "hits": h, "counted": c} for i, (ids, h, c) in enumerate(per_sequence)
    ]
    document = {
        "format": PER_PROMPT_FORMAT,
        "metric": key,
        "suite": suite,
        "seed": seed,
        "depth": depth,
        "sequences": sequences,
    }
    return Evaluation(metrics, document)
