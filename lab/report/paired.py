"""Paired statistics of an arm against the study's baseline arm: the ratio of their means with a
percentile interval from a paired bootstrap over seeds and prompts.

Arms of one study share seeds, data order and prompts, so an arm and the baseline are compared prompt by
prompt within each seed. The runs record, per prompt (per held-out sequence for the rollout), additive
counts (`per_prompt/{suite}.json`, `per_prompt/rollout.json`, written by lab/eval/evaluate.py): a metric is a
function of their sums over the prompts, pooled exactly as the logged metric pools them (AL = 1 +
sum(accepted) / sum(rounds)). A study's value of an arm is the mean over seeds of that pooled metric, the
number the tables show. One bootstrap replicate resamples the seeds with replacement and, within each
resampled seed, its prompts with replacement, and uses the same draws for the arm and the baseline; the
interval is the 2.5 and 97.5 percentiles of the replicates' ratios. The generator is seeded (PCG64 with
`BOOTSTRAP_SEED`) and restarted for every interval, so the same records give the same interval whatever
else the report computes. Pure numpy: nothing here reads MLflow.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np

BOOTSTRAP_SEED = 12345
RESAMPLES = 2000
LEVEL = 0.95

# additive counts per prompt: prompt key -> a vector of counts (the same length for every prompt)
Counts = dict[str, np.ndarray]
# a metric of summed counts: [..., C] -> [...]
Metric = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class Interval:
    """The arm's mean over seeds divided by the baseline's, on the seeds and prompts both recorded, and the
    bootstrap interval around it."""

    ratio: float
    low: float
    high: float
    prompts: int  # paired prompts per seed (the fewest, should seeds differ)
    seeds: int  # paired seeds
    resamples: int = RESAMPLES
    level: float = LEVEL

    def excludes_one(self, digits: int | None = None) -> bool:
        """Whether the interval lies wholly above or below 1 (compared as printed with `digits`)."""
        return self.excludes(1.0, digits)

    def excludes(self, value: float, digits: int | None = None) -> bool:
        """Whether the interval lies wholly above or below `value` (0 for a difference)."""
        low, high = (self.low, self.high) if digits is None else (round(self.low, digits), round(self.high, digits))
        return low > value or high < value


def acceptance_length(sums: np.ndarray) -> np.ndarray:
    """AL from summed (accepted, rounds): 1 + accepted / rounds, as `DecodeStats.acceptance_length`."""
    return 1.0 + sums[..., 0] / np.maximum(sums[..., 1], 1)


def share(sums: np.ndarray) -> np.ndarray:
    """A share from summed (part, whole), as the runs pool it: rollout accuracy (hits, counted), acceptance
    at a draft position (accepted there, rounds), attention mass at a drafting step (mass, count)."""
    return sums[..., 0] / np.maximum(sums[..., 1], 1.0)


def norm_growth(sums: np.ndarray) -> np.ndarray:
    """Norm growth at a step from summed (feedback RMS there, its count, feedback RMS at step 1, its count):
    the mean feedback norm there over the mean at step 1, as `DriftProbes.curves` (0 where step 1's is 0)."""
    there = sums[..., 0] / np.maximum(sums[..., 1], 1)
    first = sums[..., 2] / np.maximum(sums[..., 3], 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(first != 0, there / np.where(first != 0, first, 1.0), 0.0)


def _key(record: Mapping) -> str:
    """A prompt's key for pairing: its index in the suite and its id (the hash of its tokens) when known."""
    return f"{record['index']}:{record['id']}" if record.get("id") else str(record["index"])


def _at_depth(doc: Mapping, k: int) -> Iterator[tuple[str, Mapping]]:
    """(key, record at depth k) of each prompt of a `per_prompt/{suite}.json` document that ran at k."""
    for p in doc.get("prompts", []):
        r = p.get("k", {}).get(str(k))
        if r is not None:
            yield _key(p), r


def _drift_at(doc: Mapping, k: int, step: int) -> Iterator[tuple[str, Mapping]]:
    """(key, drift probe sums at depth k) of each prompt whose probes reached `step`."""
    for key, r in _at_depth(doc, k):
        drift = r.get("drift")
        if drift is not None and len(drift["count"]) >= step:
            yield key, drift


def al_counts(doc: Mapping, k: int) -> Counts:
    """(accepted, rounds) per prompt at drafting depth k, from a `per_prompt/{suite}.json` document."""
    return {key: np.array([r["accepted"], r["rounds"]], dtype=float) for key, r in _at_depth(doc, k)}


def norm_growth_counts(doc: Mapping, k: int, step: int) -> Counts:
    """(feedback RMS sum at `step`, its count, at step 1, its count) per prompt at depth k (probes only)."""
    return {
        key: np.array([d["feedback_rms"][step - 1], d["count"][step - 1], d["feedback_rms"][0], d["count"][0]], float)
        for key, d in _drift_at(doc, k, step)
    }


def drift_counts(doc: Mapping, k: int, step: int, curve: str) -> Counts:
    """(summed `curve` mass at `step`, its count) per prompt at depth k (probes only); `curve` is `sink` or
    `self`, as `DriftProbes.sums` records them."""
    return {key: np.array([d[curve][step - 1], d["count"][step - 1]], float) for key, d in _drift_at(doc, k, step)}


def position_counts(doc: Mapping, k: int, position: int) -> Counts:
    """(drafts accepted at draft `position`, rounds) per prompt at depth k: the per-position acceptance."""
    return {
        key: np.array([r["accepted_at"][position - 1], r["rounds"]], dtype=float)
        for key, r in _at_depth(doc, k)
        if len(r.get("accepted_at", [])) >= position
    }


def rollout_counts(doc: Mapping, depth: int) -> Counts:
    """(hits, counted) per held-out sequence at unrolled `depth`, from `per_prompt/rollout.json`."""
    out = {}
    for s in doc.get("sequences", []):
        if len(s["hits"]) >= depth:
            out[_key(s)] = np.array([s["hits"][depth - 1], s["counted"][depth - 1]], dtype=float)
    return out


def pooled(counts: Counts, metric: Metric) -> float:
    """The metric over all prompts: what the run logged."""
    return float(metric(np.sum(list(counts.values()), axis=0)))


def _replicates(groups: list[tuple[np.ndarray, ...]], metric: Metric, resamples: int, seed: int) -> list[np.ndarray]:
    """Bootstrap replicates of the sum over seeds of the pooled metric: `groups` holds, per seed, the
    [prompts, C] counts of each member (arms), prompts aligned; one replicate resamples the seeds, then the
    prompts within each, with the same draws for every member. One [resamples] array per member."""
    rng = np.random.Generator(np.random.PCG64(seed))
    n_seeds, members = len(groups), len(groups[0])
    chosen = rng.integers(0, n_seeds, size=(resamples, n_seeds))  # the resampled seeds of each replicate
    sums = [np.zeros(resamples) for _ in range(members)]
    for slot in range(n_seeds):
        for s, counts in enumerate(groups):
            rows = np.flatnonzero(chosen[:, slot] == s)
            if rows.size:
                drawn = rng.integers(0, len(counts[0]), size=(rows.size, len(counts[0])))  # the same prompts for all
                for m, c in enumerate(counts):
                    sums[m][rows] += metric(c[drawn].sum(1))
    return sums


def _quantiles(replicates: np.ndarray, level: float) -> tuple[float, float]:
    tail = (1 - level) / 2
    low, high = np.quantile(replicates, [tail, 1 - tail])
    return float(low), float(high)


def paired_ratio(
    arm: Mapping[str, Counts],
    baseline: Mapping[str, Counts],
    metric: Metric,
    resamples: int = RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
    level: float = LEVEL,
) -> Interval | None:
    """The ratio of the arm's mean over seeds of the pooled metric to the baseline's, with its paired
    bootstrap interval; `arm` and `baseline` map a seed to its counts per prompt. Only seeds and prompts
    both recorded count. None when they share none, or the baseline's mean is 0."""
    pairs = []
    for s in sorted(set(arm) & set(baseline)):
        keys = sorted(set(arm[s]) & set(baseline[s]))
        if keys:
            pairs.append((np.stack([arm[s][k] for k in keys]), np.stack([baseline[s][k] for k in keys])))
    if not pairs:
        return None
    arm_mean = np.mean([metric(a.sum(0)) for a, _ in pairs])
    base_mean = np.mean([metric(b.sum(0)) for _, b in pairs])
    if base_mean == 0:
        return None
    arm_sum, base_sum = _replicates(pairs, metric, resamples, seed)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = arm_sum / base_sum  # the means' common 1 / n_seeds cancels
    low, high = _quantiles(ratios, level)
    return Interval(float(arm_mean / base_mean), low, high, min(len(a) for a, _ in pairs), len(pairs), resamples, level)


@dataclass(frozen=True)
class Estimate:
    """An arm's mean over seeds of a pooled metric, with its bootstrap interval (seeds, then prompts)."""

    mean: float
    low: float
    high: float
    prompts: int  # prompts per seed (the fewest)
    seeds: int


def mean_interval(
    runs: Mapping[str, Counts],
    metric: Metric,
    resamples: int = RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
    level: float = LEVEL,
) -> Estimate | None:
    """The mean over seeds of the pooled metric of one arm (`runs` maps a seed to its counts per prompt),
    with the bootstrap interval of that mean. None when no seed recorded a prompt."""
    groups = [(np.stack([c[k] for k in sorted(c)]),) for _, c in sorted(runs.items()) if c]
    if not groups:
        return None
    (sums,) = _replicates(groups, metric, resamples, seed)
    low, high = _quantiles(sums / len(groups), level)
    mean = float(np.mean([metric(g[0].sum(0)) for g in groups]))
    return Estimate(mean, low, high, min(len(g[0]) for g in groups), len(groups))


def method(baseline: str, unit: str = "prompts") -> str:
    """One sentence saying what a ratio and its interval are (`unit`: what is resampled within a seed)."""
    return (
        f"Ratio: the arm's mean over seeds divided by {baseline}'s, on the seeds and {unit} both recorded, "
        f"with a {LEVEL:.0%} paired bootstrap interval ({RESAMPLES} resamples, seed {BOOTSTRAP_SEED}; seeds "
        f"resampled, then {unit} within each seed, the same draws for the arm and the baseline)"
    )
