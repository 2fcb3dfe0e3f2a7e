"""Drift probes (docs/design.md): where the drafter's attention goes along a speculation chain, how the
fed-back hidden state grows, how the captured layers share the fused input, and teacher-forced
rollout accuracy far beyond the training depth.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from lab.drafter import Eagle3Drafter
from lab.drafter.model import TTTCache
from lab.drafter.unroll import unroll
from lab.target import chunked_argmax


@dataclass
class DriftProbes:
    """Accumulates per-drafting-step (j = 1..k) sums over heads, layers, rounds and prompts: the attention mass
    on the first `n_sink` keys (`sink`) and on the keys of this round's own drafts (`self_mass`), and the RMS of
    the state fed back (`feedback_rms`). `record` keeps each step's values on the device and they are read in
    one transfer when the sums are (a host sync per step would stall a GPU's decoding); they are added as Python
    floats in recording order, so that the sums do not depend on when they are read."""

    k: int
    n_sink: int = 1
    sink: list[float] = field(default_factory=list)
    self_mass: list[float] = field(default_factory=list)
    feedback_rms: list[float] = field(default_factory=list)
    count: list[int] = field(default_factory=list)
    _pending: list[tuple[int, torch.Tensor]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        for name in ("sink", "self_mass", "feedback_rms"):
            setattr(self, name, [0.0] * self.k)
        self.count = [0] * self.k

    def record(self, j: int, probs: list[torch.Tensor], first_self_key: int, fed_back: torch.Tensor) -> None:
        """Step j (1-based): `probs` per layer [B, heads, 1, S] for the step's query; keys at index
        >= first_self_key came from the drafter's own output in this round; `fed_back` is the hidden
        state this step passes on."""
        rows = torch.stack([p[..., -1, :] for p in probs])  # [layers, B, heads, S]
        values = torch.stack(
            [
                rows[..., : self.n_sink].sum(-1).mean(),
                rows[..., first_self_key:].sum(-1).mean(),
                fed_back.float().pow(2).mean().sqrt(),
            ]
        )
        self._pending.append((j, values))

    def add(self, j: int, sink: float, self_mass: float, feedback_rms: float) -> None:
        """Step j's values as `record` computes them (the replay's, lab/eval/replay.py), added in order."""
        self._flush()
        self.sink[j - 1] += sink
        self.self_mass[j - 1] += self_mass
        self.feedback_rms[j - 1] += feedback_rms
        self.count[j - 1] += 1

    def _flush(self) -> None:
        if not self._pending:
            return
        values = torch.stack([v.float() for _, v in self._pending]).tolist()  # one transfer
        pending, self._pending = self._pending, []
        for (j, _), (sink, self_mass, rms) in zip(pending, values, strict=True):
            self.add(j, sink, self_mass, rms)

    def merge(self, other: DriftProbes) -> None:
        self._flush()
        other._flush()
        for name in ("sink", "self_mass", "feedback_rms", "count"):
            setattr(self, name, [a + b for a, b in zip(getattr(self, name), getattr(other, name), strict=True)])

    def sums(self) -> dict[str, list[float] | list[int]]:
        """The running sums per drafting step, as `per_prompt/{suite}.json` records them: summed over
        prompts and divided as `curves` divides them, they give the logged curves."""
        self._flush()
        names = {"sink": self.sink, "self": self.self_mass, "feedback_rms": self.feedback_rms, "count": self.count}
        return {name: list(values) for name, values in names.items()}

    def curves(self) -> dict[str, list[float]]:
        self._flush()
        n = [max(c, 1) for c in self.count]
        sink = [s / c for s, c in zip(self.sink, n, strict=True)]
        self_mass = [s / c for s, c in zip(self.self_mass, n, strict=True)]
        fb = [s / c for s, c in zip(self.feedback_rms, n, strict=True)]
        return {
            "sink_mass": sink,
            "self_mass": self_mass,
            "context_mass": [1.0 - a - b for a, b in zip(sink, self_mass, strict=True)],
            "feedback_norm": fb,
            "norm_growth": [f / fb[0] if fb[0] else 0.0 for f in fb],
        }


@torch.no_grad()
def fc_share(drafter: Eagle3Drafter, aux: torch.Tensor) -> list[float]:
    """Share of each captured layer in the fc output: ||W_i x_i|| / sum_j ||W_j x_j||, averaged over
    positions, where x_i is captured layer i as fc sees it (after fc_norm when enabled)."""
    spec = drafter.spec
    chunks = aux.float().chunk(spec.num_aux, dim=-1)
    if spec.fc_norm == "per_layer":
        chunks = tuple(norm(c) for norm, c in zip(drafter.fc_norm, chunks, strict=True))
    elif spec.fc_norm == "concat":
        chunks = drafter.input_norm(aux.float()).chunk(spec.num_aux, dim=-1)
    blocks = drafter.fc.weight.float().chunk(spec.num_aux, dim=-1)  # [H, H_t] each
    norms = torch.stack([(c @ w.T).norm(dim=-1) for c, w in zip(chunks, blocks, strict=True)])  # [A, ...]
    shares = norms / norms.sum(0, keepdim=True).clamp_min(1e-12)
    return shares.flatten(1).mean(1).tolist()


def pooled_rollout_accuracy(hits: torch.Tensor, counted: torch.Tensor) -> list[float]:
    """Accuracy per depth from `rollout_counts`' per-sequence sums [depth, B]: hits / counted pooled over
    the sequences (a depth with nothing counted is 0)."""
    return (hits.sum(1) / counted.sum(1).clamp_min(1.0)).tolist()


@torch.no_grad()
def rollout_counts(
    drafter: Eagle3Drafter,
    input_ids: torch.Tensor,
    aux: torch.Tensor,
    target_top: torch.Tensor,
    depth: int,
    loss_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced rollout counts per held-out sequence: (hits, counted), each [depth, B], the positions
    where the drafter agreed with the target and the positions counted, at each unrolled depth."""
    t = input_ids.shape[1]
    if depth >= t - 1:
        raise ValueError(f"rollout depth {depth} needs sequences longer than {depth + 1} tokens")
    outs = unroll(drafter, F.pad(input_ids[:, 1:], (0, 1)), aux.float(), depth)
    return _count_agreement(drafter, outs, input_ids, target_top, loss_mask)


SHUFFLED = ("features", "feedback")


@torch.no_grad()
def shuffled_rollout_counts(
    drafter: Eagle3Drafter,
    input_ids: torch.Tensor,
    aux: torch.Tensor,
    target_top: torch.Tensor,
    depth: int,
    loss_mask: torch.Tensor | None = None,
    shuffled: str | None = "feedback",
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rollout_counts` with one of the drafter's inputs shuffled across the positions of the batch (a seeded
    permutation): the same distribution of values, none of them about its own position, so the accuracy a
    shuffle costs is what the drafter reads from that input. `features`: the target's captured states
    (every depth reads them, through step 0). `feedback`: the state fed to each later drafting step (depth 1
    reads none and is unchanged), shuffled between steps, which training's `unroll` runs inside one call: so
    this unroll is the reference model's, step by step with `TTTCache` (the same function, with dense
    [B, heads, T, T] attention per step); None runs that dense unroll unshuffled."""
    if shuffled not in (*SHUFFLED, None):
        raise ValueError(f"shuffled: unknown '{shuffled}'; allowed: {', '.join(SHUFFLED)}")
    b, t = input_ids.shape
    gen = torch.Generator().manual_seed(seed)
    if shuffled == "features":
        order = torch.randperm(b * t, generator=gen).to(aux.device)
        aux = aux.reshape(b * t, -1)[order].view_as(aux)
        return rollout_counts(drafter, input_ids, aux, target_top, depth, loss_mask)
    if depth >= t - 1:
        raise ValueError(f"rollout depth {depth} needs sequences longer than {depth + 1} tokens")
    ext = F.pad(input_ids[:, 1:], (0, depth))  # step i at position p embeds ext[p + i]
    positions = torch.arange(t, device=input_ids.device).expand(b, t)
    cache = TTTCache(len(drafter.layers))
    hidden = drafter.project(aux.float())
    outs = []
    for step in range(depth):
        h_out = drafter(ext[:, step : step + t], hidden, positions + step, cache)
        outs.append(h_out)
        hidden = drafter.feedback(h_out)
        if shuffled == "feedback":
            order = torch.randperm(b * t, generator=gen).to(hidden.device)
            hidden = hidden.reshape(b * t, -1)[order].view_as(hidden)
    return _count_agreement(drafter, outs, input_ids, target_top, loss_mask)


def _count_agreement(
    drafter: Eagle3Drafter,
    outs: list[torch.Tensor],
    input_ids: torch.Tensor,
    target_top: torch.Tensor,
    loss_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hits and counted positions [depth, B] of an unroll's h_out per step (each [B, T, H])."""
    t = input_ids.shape[1]
    # target_top[j] predicts x_{j+1}: counted where x_{j+1} is the assistant's
    counted = (
        torch.ones_like(input_ids, dtype=torch.float) if loss_mask is None else F.pad(loss_mask[:, 1:].float(), (0, 1))
    )
    hits, weights = [], []
    for i, h_out in enumerate(outs):
        n = t - 1 - i
        pred = drafter.to_target_ids(chunked_argmax(h_out[:, :n], drafter.logits))
        weight = counted[:, i + 1 : i + 1 + n]
        agree = (pred == target_top[:, i + 1 : i + 1 + n]).float()
        hits.append((agree * weight).sum(1))  # whole numbers: their sums are exact in float32
        weights.append(weight.sum(1))
    return torch.stack(hits), torch.stack(weights)


@torch.no_grad()
def unrolled_rounds(
    drafter: Eagle3Drafter, input_ids: torch.Tensor, aux: torch.Tensor, prompt_len: int, k: int
) -> list[int]:
    """Accepted drafts per round of a greedy chain decode at depth k that produced input_ids[0, prompt_len:],
    foretold by the drafter's teacher-forced TTT unroll (the training forward) over input_ids [1, T] with
    the target's states aux [1, T, A*H]. Step i at position t predicts token t + i + 2, and the round whose
    next token is at position p drafts what the unroll predicts at p - 1: its inputs are the target's
    tokens for as long as the drafts before were accepted, and a rejected draft ends the round. The last
    round stops at the end of input_ids."""
    outs = unroll(drafter, F.pad(input_ids[:, 1:], (0, 1)), aux.float(), k)
    preds = [drafter.to_target_ids(drafter.logits(h).argmax(-1))[0].tolist() for h in outs]
    seq, pending, rounds = input_ids[0].tolist(), prompt_len, []
    while pending < len(seq) - 1:
        accepted = 0
        while accepted < k and pending + 1 + accepted < len(seq):
            if preds[accepted][pending - 1] != seq[pending + 1 + accepted]:
                break
            accepted += 1
        rounds.append(accepted)
        pending += accepted + 1
    return rounds
