"""The validation pass while a drafter trains: the exact acceptance of its rounds at every drafting depth k = 1..K
over the target's greedy answers to the validation prompts (lab/data/validation.py, held out of the training data),
replayed from one batched unroll (lab/eval/replay.py, round by round what the decoder counts), and beside it, from
the same answers, the teacher-forced proxies by which the peers pick checkpoints (docs/metrics.md names whose each
is). The trainer calls it every `train.val_every` steps (lab/train/ttt.py); it reads no evaluation suite.

The proxies come from one teacher-forced unroll of depth K (training's, lab/drafter/unroll.py): the chain from
anchor p drafts d tokens ahead on the answer's own tokens, and `d` drafts from p are right together when each of
them equals the target's top-1. Over the anchors where a round can start (the answer's first `max_new_tokens`
positions, the last prompt position included) each prompt counts, per depth d: the anchors whose d-th draft is
right (`hits`), whose first d drafts all are (`full`), whose first d - 1 are (`prior`), and the anchors counted.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from lab import metrics as metric_keys
from lab.data.answers import Answers
from lab.device import autocast
from lab.drafter import Eagle3Drafter
from lab.drafter.unroll import unroll
from lab.eval.evaluate import prompt_id
from lab.eval.probes import DriftProbes
from lab.eval.reference import DecodeStats
from lab.eval.replay import Replayed, replay
from lab.target import chunked_argmax

TF_BATCH = 16  # prompts per teacher-forced unroll
TF_COUNTS = ("hits", "full", "prior", "counted")


@dataclass(frozen=True)
class ValidationSet:
    """The validation prompts' greedy answers and how their rounds are counted: to `max_new_tokens` (the
    answers run K further, as the last round verifies past it), ending at a stop token as a served answer."""

    answers: Answers
    depth: int  # K, the deepest drafting depth measured
    max_new_tokens: int
    stop_ids: tuple[int, ...] = ()
    n_sink: int = 1


@dataclass
class Validated:
    """One pass: its metrics (`val/...`) and, per prompt, the counts behind them (`per_prompt/val.json`)."""

    metrics: dict[str, float]
    prompts: list[dict[str, Any]]


@torch.no_grad()
def validate(drafter: Eagle3Drafter, vset: ValidationSet) -> Validated:
    """The exact AL at k = 1..K (pooled over rounds and as the mean of the prompts' own), the acceptance per
    position at K, the sink mass and norm growth at K's last step, and the teacher-forced proxies."""
    ks = list(range(1, vset.depth + 1))
    replayed = replay(
        drafter, vset.answers, ks, vset.max_new_tokens, vset.stop_ids, vset.n_sink, probes=True, probed_ks=[vset.depth]
    )
    counts = teacher_forced_counts(drafter, vset.answers, vset.depth, vset.max_new_tokens)
    metrics = {**exact_metrics(replayed, vset.depth, vset.n_sink), **proxy_metrics(counts.sum(0), vset.depth)}
    prompts = [
        _record(i, vset.answers, r, counts[i], vset.depth) for i, r in enumerate(replayed)
    ]  # in the prompts' order
    return Validated(metrics, prompts)


def exact_metrics(replayed: list[Replayed], depth: int, n_sink: int) -> dict[str, float]:
    """The replayed rounds' metrics: AL at every k both ways, acceptance per position and drift at K."""
    out: dict[str, float] = {}
    for k in range(1, depth + 1):
        total = DecodeStats()
        for r in replayed:
            total.merge(r.stats[k])
        own = [r.stats[k].acceptance_length for r in replayed if r.stats[k].rounds]
        out[metric_keys.val_al(k)] = total.acceptance_length
        out[metric_keys.val_al_per_prompt(k)] = statistics.fmean(own) if own else 1.0
        if k == depth:
            for i, (rate, cond) in enumerate(zip(total.accept_rate, total.conditional_accept_rate, strict=True)):
                out[metric_keys.val_accept_rate(k, i + 1)] = rate
                out[metric_keys.val_cond_accept_rate(k, i + 1)] = cond
    probes = DriftProbes(depth, n_sink)
    for r in replayed:
        probes.merge(r.drift[depth])
    curves = probes.curves()
    out[metric_keys.val_drift(depth, "sink_mass")] = curves["sink_mass"][-1]
    out[metric_keys.val_drift(depth, "norm_growth")] = curves["norm_growth"][-1]
    return out


def proxy_metrics(sums: torch.Tensor, depth: int) -> dict[str, float]:
    """The teacher-forced proxies from the counts summed over prompts, `sums` [4, K] (`TF_COUNTS`): per depth d
    the marginal, whole-chain and conditional agreement, and at each k SpecForge's and TorchSpec's
    simulated_acc_len (sum over d <= k of the product of the marginals, no bonus token) and NeMo Automodel's
    tau_sim (1 + the sum over d <= k of the whole-chain agreement)."""
    hits, full, prior, counted = (sums[i].tolist() for i in range(len(TF_COUNTS)))
    acc = [h / max(c, 1.0) for h, c in zip(hits, counted, strict=True)]
    chain = [f / max(c, 1.0) for f, c in zip(full, counted, strict=True)]
    out: dict[str, float] = {}
    product, simulated, tau = 1.0, 0.0, 1.0
    for d in range(1, depth + 1):
        product *= acc[d - 1]
        simulated += product
        tau += chain[d - 1]
        out[metric_keys.val_teacher_forced("acc", d)] = acc[d - 1]
        out[metric_keys.val_teacher_forced("full_acc", d)] = chain[d - 1]
        out[metric_keys.val_teacher_forced("cond_acc", d)] = full[d - 1] / max(prior[d - 1], 1.0)
        out[metric_keys.val_proxy(d, "simulated_acc_len")] = simulated
        out[metric_keys.val_proxy(d, "tau_sim")] = tau
    return out


@torch.no_grad()
def teacher_forced_counts(drafter: Eagle3Drafter, answers: Answers, depth: int, max_new_tokens: int) -> torch.Tensor:
    """Per prompt, the teacher-forced counts [N, 4, depth] (`TF_COUNTS`) over its anchors, in batches of alike
    lengths, computed in the target's dtype as the rollout computes them. The drafting steps run at the anchors
    only (`unroll`'s `keep`), step 0 everywhere (their context)."""
    device = drafter.fc.weight.device
    out = torch.zeros(len(answers), len(TF_COUNTS), depth)
    order = sorted(range(len(answers)), key=lambda i: len(answers.sequences[i]))
    for start in range(0, len(order), TF_BATCH):
        batch = order[start : start + TF_BATCH]
        t = max(len(answers.sequences[i]) for i in batch)
        ids = torch.zeros(len(batch), t, dtype=torch.long)
        top = torch.zeros(len(batch), t, dtype=torch.long)
        for row, i in enumerate(batch):
            n = len(answers.sequences[i])
            ids[row, :n], top[row, :n] = torch.tensor(answers.sequences[i]), torch.tensor(answers.top[i])
        # anchors: from a round's first (the last prompt position) to max_new_tokens past it, within the sequence
        first = torch.tensor([answers.prompt_lens[i] - 1 for i in batch])[:, None]
        lengths = torch.tensor([len(answers.sequences[i]) for i in batch])[:, None]
        at = torch.arange(t).expand(len(batch), t)
        anchors = (at >= first) & (at < first + max_new_tokens) & (at < lengths - 1)
        keep = anchors.flatten().nonzero().squeeze(1).to(device)
        with autocast(device, answers.aux.dtype):
            tokens = F.pad(ids[:, 1:], (0, 1)).to(device)
            outs = unroll(drafter, tokens, answers.aux[batch, :t].to(device).float(), depth, [keep] * depth)
            drafts = [drafter.to_target_ids(chunked_argmax(h, drafter.logits)) for h in outs]
        out[batch] = _chain_counts(drafts, keep.cpu(), top, anchors, lengths)
    return out


def _chain_counts(
    drafts: list[torch.Tensor], keep: torch.Tensor, top: torch.Tensor, anchors: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """[B, 4, depth] counts of an unroll's drafts (step i's at the flattened anchors `keep`): step i at anchor p
    drafts the target's top-1 after position p + i + 1, counted while that position is in the sequence."""
    b, t = top.shape
    at = torch.arange(t).expand(b, t)
    chain = torch.ones(b, t, dtype=torch.bool)
    out = []
    for i, draft in enumerate(drafts):
        dense = torch.full((b * t,), -1, dtype=torch.long)
        dense[keep] = draft.cpu()
        ahead = F.pad(top[:, i + 1 :], (0, i + 1), value=-2)  # the top-1 step i is compared with, at each anchor
        right = dense.view(b, t) == ahead
        valid = anchors & (at + i + 1 < lengths)
        prior = chain & valid
        chain = chain & right
        out.append(torch.stack([(right & valid).sum(1), (chain & valid).sum(1), prior.sum(1), valid.sum(1)], 1))
    return torch.stack(out, 2).float()


def _record(index: int, answers: Answers, replayed: Replayed, counts: torch.Tensor, depth: int) -> dict[str, Any]:
    """One prompt's entry in a checkpoint of `per_prompt/val.json`: per k its rounds and accepted drafts (at K
    per position too), and its teacher-forced counts per depth."""
    by_k = {}
    for k in range(1, depth + 1):
        st = replayed.stats[k]
        by_k[str(k)] = {"rounds": st.rounds, "accepted": st.accepted}
        if k == depth:
            by_k[str(k)]["accepted_at"] = list(st.accepted_at) or [0] * depth
    prompt = answers.sequences[index][: answers.prompt_lens[index]]
    tf = {name: [int(v) for v in counts[c].tolist()] for c, name in enumerate(TF_COUNTS)}
    return {"index": index, "id": prompt_id(prompt), "k": by_k, "tf": tf}


def checkpoints_document(checkpoints: list[dict[str, Any]], seed: int, depth: int) -> dict[str, Any]:
    """`per_prompt/val.json`: every validation pass so far, each `{step, train_tokens, prompts}` (`_record`s);
    a checkpoint's `prompts` read as a suite's per-prompt document (lab/report/paired.py `al_counts`)."""
    return {
        "format": 1,
        "suite": "val",
        "seed": seed,
        "ks": list(range(1, depth + 1)),
        "depth": depth,
        "checkpoints": checkpoints,
    }
