"""What the reports read of the validation pass: `per_prompt/val.json` (lab/eval/validation.py), one document per
run with every pass's per-prompt counts. A pass (a checkpoint) reads like a suite's per-prompt document, so the
paired bootstrap (lab/report/paired.py) resamples its prompts; the proxies are functions of summed counts, so their
gap to the exact AL gets an interval the same way. Pure numpy: nothing here reads MLflow.

Per prompt at depth k the counts are, in order: accepted drafts and rounds (the exact AL), the teacher-forced
marginal hits, whole-chain hits and anchors counted at depths 1..k, and the prompt's own AL with a 1 (0 and 0 for a
prompt without rounds), whose sums give the mean of the per-prompt ALs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from lab.report import paired

RECORDS = "val"  # per_prompt/val.json


def checkpoints(doc: Mapping) -> list[Mapping]:
    """The passes of a `per_prompt/val.json` document, in step order."""
    return sorted(doc.get("checkpoints", []), key=lambda c: c["step"])


def steps(doc: Mapping) -> list[int]:
    return [c["step"] for c in checkpoints(doc)]


def counts(checkpoint: Mapping, k: int) -> paired.Counts:
    """Per prompt of one pass, the counts at depth k (the module's order), keyed as the paired bootstrap pairs."""
    out = {}
    for p in checkpoint.get("prompts", []):
        r, tf = p["k"][str(k)], p["tf"]
        own = [1 + r["accepted"] / r["rounds"], 1.0] if r["rounds"] else [0.0, 0.0]
        row = [r["accepted"], r["rounds"], *tf["hits"][:k], *tf["full"][:k], *tf["counted"][:k], *own]
        out[f"{p['index']}:{p['id']}"] = np.array(row, dtype=float)
    return out


def exact_al(sums: np.ndarray) -> np.ndarray:
    return paired.acceptance_length(sums[..., :2])


def _depth(sums: np.ndarray) -> int:
    return (sums.shape[-1] - 4) // 3


def simulated_acc_len(sums: np.ndarray) -> np.ndarray:
    """SpecForge's and TorchSpec's proxy: the sum over d <= k of the product of the marginal agreements."""
    k = _depth(sums)
    hits, counted = sums[..., 2 : 2 + k], sums[..., 2 + 2 * k : 2 + 3 * k]
    return np.cumprod(hits / np.maximum(counted, 1), axis=-1).sum(-1)


def tau_sim(sums: np.ndarray) -> np.ndarray:
    """NeMo Automodel's proxy: 1 + the sum over d <= k of the whole-chain agreement."""
    k = _depth(sums)
    full, counted = sums[..., 2 + k : 2 + 2 * k], sums[..., 2 + 2 * k : 2 + 3 * k]
    return 1 + (full / np.maximum(counted, 1)).sum(-1)


def al_per_prompt(sums: np.ndarray) -> np.ndarray:
    """The exact AL as the mean of the prompts' own ALs (SpecForge's benchmark) rather than pooled over rounds."""
    return sums[..., -2] / np.maximum(sums[..., -1], 1)


@dataclass(frozen=True)
class Proxy:
    name: str  # the key's last part, as the runs log it (`val/k{k}/NAME`)
    label: str
    whose: str
    metric: paired.Metric


PROXIES = (
    Proxy("simulated_acc_len", "simulated_acc_len", "SpecForge, TorchSpec", simulated_acc_len),
    Proxy("tau_sim", "tau_sim", "NeMo Automodel", tau_sim),
    Proxy("al_per_prompt", "AL, mean per prompt", "SpecForge's benchmark", al_per_prompt),
)


def minus_exact(metric: paired.Metric) -> paired.Metric:
    """A proxy's gap to the exact AL, of the same summed counts."""

    def gap(sums: np.ndarray) -> np.ndarray:
        return metric(sums) - exact_al(sums)

    return gap


def values(doc: Mapping, k: int, metric: Callable[[np.ndarray], np.ndarray]) -> list[float]:
    """The metric of each pass of one run, pooled over its prompts (what the run logged), in step order."""
    return [paired.pooled(counts(c, k), metric) for c in checkpoints(doc)]


def best_step(doc: Mapping, k: int, metric: Callable[[np.ndarray], np.ndarray]) -> int:
    """The step of the pass where the metric is highest (the earliest of equals, as train.select=best keeps)."""
    vs = values(doc, k, metric)
    return steps(doc)[int(np.argmax(vs))]


def kendall_tau(a: list[float], b: list[float]) -> float:
    """Kendall's tau-b of two equally long sequences (1: the same order, -1: reversed; 0 without pairs)."""
    concordant = discordant = ties_a = ties_b = 0
    for i in range(len(a)):
        for j in range(i + 1, len(a)):
            da, db = np.sign(a[i] - a[j]), np.sign(b[i] - b[j])
            if da == 0 and db == 0:
                continue
            if da == 0:
                ties_a += 1
            elif db == 0:
                ties_b += 1
            elif da == db:
                concordant += 1
            else:
                discordant += 1
    scale = np.sqrt((concordant + discordant + ties_a) * (concordant + discordant + ties_b))
    return float((concordant - discordant) / scale) if scale else 0.0


def select_k(params: Mapping[str, str], ks: list[int]) -> int:
    """The depth train.select_k names in a run's params, else the first evaluated k (lab/config `select_k`)."""
    value = params.get("train.select_k", "None")
    return int(value) if value not in ("", "None", "null") else ks[0]
