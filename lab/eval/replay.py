"""Greedy acceptance and drift without token-by-token decoding: the reference decoder's rounds replayed from
one batched unroll of the drafter over the target's greedy answers (`lab.data.answers`).

At temperature 0 the decoded text is the target's greedy answer whatever the drafter, and a round that starts
with n tokens committed drafts from the drafter's context over those n tokens alone. So every position p of
prompt + answer is a possible round start (p = n - 1, the last context entry), and the chains from all of them
are one unroll: step 0 is the drafter over the whole sequence (causal, as its KV cache holds the context),
step i >= 1 at position p embeds the drafter's own draft of step i - 1 at p and attends to step 0's keys up to
p and to the steps before it at p only (`TTTCache`'s diagonal). Unlike training's teacher-forced unroll, later
steps read the drafter's own drafts, not the answer's tokens: the decoder drafts on past a rejected draft,
and its drift probes see those steps. A walk over the positions then takes each k's rounds exactly as
`speculative_decode` does: accepted drafts are the longest prefix equal to the target's top-1, a round ends
the answer at a stop token it accepts, and the loop ends at `max_new_tokens` or a pending stop token.
`tests/test_replay.py` holds replay and decoder equal round by round.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lab.data.answers import Answers
from lab.device import autocast
from lab.drafter import Eagle3Drafter
from lab.drafter.model import dense_ttt_attention, repeat_kv
from lab.eval.probes import DriftProbes
from lab.eval.reference import DecodeStats

SCORES_BUDGET = 1 << 26  # attention scores held at once: sets the batch of prompts and step 0's chunk of rows


class ChainCache:
    """`TTTCache` whose steps after the first query only a window of positions per sequence (where its rounds
    can start: `window` [B, W], clamped to the sequence), keeping each step's attention mass on the first
    `n_sink` keys (the sink) and on this step's own chain (the diagonal keys of steps >= 1: `self_mass`), per
    layer [B, heads, W]."""

    def __init__(self, num_layers: int, window: torch.Tensor, n_sink: int):
        self.k: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self.v: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self.window, self.n_sink = window, n_sink
        self.sink: list[torch.Tensor | None] = [None] * num_layers
        self.self_mass: list[torch.Tensor | None] = [None] * num_layers

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.k[layer].append(repeat_kv(k, q.shape[1]))
        self.v[layer].append(repeat_kv(v, q.shape[1]))
        if len(self.k[layer]) > 1:  # a later step: the window's queries
            out, self.sink[layer], self.self_mass[layer] = self._attend(layer, q, self.window)
            return out
        # step 0 queries every position (a later layer's keys read them), in chunks of rows: a long prompt's
        # whole [B, heads, T, T] attention need not be held at once
        b, heads, t, _ = q.shape
        rows = max(1, SCORES_BUDGET // (b * heads * t))
        at = torch.arange(t, device=q.device).expand(b, t)
        parts = [self._attend(layer, q[:, :, i : i + rows], at[:, i : i + rows]) for i in range(0, t, rows)]
        sink = torch.cat([p[1] for p in parts], 2).gather(2, self.window[:, None].expand(-1, heads, -1))
        self.sink[layer], self.self_mass[layer] = sink, torch.zeros_like(sink)
        return torch.cat([p[0] for p in parts], 2)

    def _attend(self, layer: int, q: torch.Tensor, at: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Queries q [B, h, n, d] at positions `at` [B, n] -> (output, sink mass, self mass [B, h, n])."""
        out, probs = dense_ttt_attention(q, self.k[layer], self.v[layer], at)
        t = self.k[layer][0].shape[2]  # step 0's keys; the later steps' diagonal ones follow
        return out, probs[..., : self.n_sink].sum(-1), probs[..., t:].sum(-1)


@dataclass
class Chains:
    """The drafter's greedy chains from the positions `window` [B, W] of a batch of sequences: per step
    (1..depth) the draft [B, W] in target ids and the drift probes' values there [B, W]."""

    window: torch.Tensor
    drafts: list[torch.Tensor]
    sink: list[torch.Tensor]
    self_mass: list[torch.Tensor]
    feedback_rms: list[torch.Tensor]


@torch.no_grad()
def draft_chains(
    drafter: Eagle3Drafter, input_ids: torch.Tensor, aux: torch.Tensor, depth: int, window: torch.Tensor, n_sink: int
) -> Chains:
    """`depth` greedy drafting steps from the positions `window` [B, W] of input_ids [B, T] (right-padded: a
    position reads only those before it), with the target's captured states aux [B, T, A*H], computed in the
    target's dtype as the reference decoder computes them."""
    b, t = input_ids.shape
    device = input_ids.device
    cache = ChainCache(len(drafter.layers), window, n_sink)
    positions = torch.arange(t, device=device).expand(b, t)
    out = Chains(window, [], [], [], [])
    with autocast(device, aux.dtype):
        tokens = F.pad(input_ids[:, 1:], (0, 1))  # entry p: features of p and the token after it
        hidden = drafter.project(aux.to(drafter.fc.weight.dtype))
        for step in range(depth):
            h_out = drafter(tokens, hidden, positions, cache)
            if step == 0:  # only the window's positions draft on
                h_out = h_out.gather(1, window[..., None].expand(-1, -1, h_out.shape[-1]))
            draft = drafter.to_target_ids(drafter.logits(h_out).argmax(-1))
            fed_back = drafter.feedback(h_out)
            out.drafts.append(draft)
            out.sink.append(torch.stack(cache.sink).float().mean((0, 2)))  # the mean over layers and heads
            out.self_mass.append(torch.stack(cache.self_mass).float().mean((0, 2)))
            out.feedback_rms.append(fed_back.float().pow(2).mean(-1).sqrt())
            tokens, hidden, positions = draft, fed_back, window + step + 1
    return out


def walk(
    drafts: list[list[int]],
    start: int,
    top: list[int],
    seq: list[int],
    prompt_len: int,
    k: int,
    max_new_tokens: int,
    stops: set[int],
) -> list[tuple[int, int]]:
    """The rounds of `speculative_decode` at depth k over prompt + greedy answer `seq`, as (the round's
    position, drafts it counts): drafts[i][p - start] is step i + 1's draft from position p, top[t] the
    target's top-1 after position t. The same loop as the decoder's: `n` tokens committed, seq[n] pending."""
    rounds = []
    n, generated = prompt_len, 1
    while generated < max_new_tokens and seq[n] not in stops:
        p, accepted = n - 1, 0
        while accepted < k and n + accepted < len(top) and drafts[accepted][p - start] == top[n + accepted]:
            accepted += 1
        stop = next((i for i in range(accepted) if drafts[i][p - start] in stops), None)
        if stop is not None:  # an accepted stop token ends the answer; the drafts after it count for nothing
            rounds.append((p, stop + 1))
            break
        rounds.append((p, accepted))
        n += accepted + 1
        generated += accepted + 1
    return rounds


@dataclass
class Replayed:
    """One prompt's rounds per k, as `speculative_decode` returns them (no seconds), and its drift probes."""

    stats: dict[int, DecodeStats]
    drift: dict[int, DriftProbes]


@torch.no_grad()
def replay(
    drafter: Eagle3Drafter,
    answers: Answers,
    ks: list[int],
    max_new_tokens: int,
    stop_ids: tuple[int, ...] = (),
    n_sink: int = 1,
    probes: bool = True,
    probed_ks: list[int] | None = None,
) -> list[Replayed]:
    """Every prompt's rounds at each k and (with `probes`) its drift probes, at every k or at `probed_ks` only
    (the others' probes stay empty), from batched unrolls of depth max(ks) over the cached answers, in the
    prompts' order."""
    depth, stops = max(ks), set(stop_ids)
    device = drafter.fc.weight.device
    heads = drafter.spec.num_heads
    order = sorted(range(len(answers)), key=lambda i: len(answers.sequences[i]))  # batch alike lengths
    results: list[Replayed | None] = [None] * len(answers)
    while order:
        t = len(answers.sequences[order[0]])
        batch = [order.pop(0)]
        while order and (len(batch) + 1) * heads * len(answers.sequences[order[0]]) ** 2 <= SCORES_BUDGET:
            batch.append(order.pop(0))
            t = len(answers.sequences[batch[-1]])
        ids = torch.zeros(len(batch), t, dtype=torch.long)
        aux = answers.aux.new_zeros(len(batch), t, answers.aux.shape[-1])
        for row, i in enumerate(batch):
            seq = answers.sequences[i]
            ids[row, : len(seq)] = torch.tensor(seq)
            aux[row, : len(seq)] = answers.aux[i, : len(seq)]
        # each sequence's rounds start at its last prompt position or later
        starts = torch.tensor([answers.prompt_lens[i] - 1 for i in batch])
        width = max(len(answers.sequences[i]) - answers.prompt_lens[i] + 1 for i in batch)
        window = (starts[:, None] + torch.arange(width)).clamp(max=t - 1)
        chains = draft_chains(drafter, ids.to(device), aux.to(device), depth, window.to(device), n_sink)
        drafts = torch.stack(chains.drafts, 1).tolist()  # [B, depth, W]: one transfer each
        values = torch.stack([torch.stack(v, 1) for v in (chains.sink, chains.self_mass, chains.feedback_rms)], 2)
        values = values.tolist() if probes else None  # [B, depth, 3, W]
        for row, i in enumerate(batch):
            seq, plen = answers.sequences[i], answers.prompt_lens[i]
            start = plen - 1
            stats, drift = {}, {}
            for k in ks:
                st, pr = DecodeStats(), DriftProbes(k, n_sink)
                probed = values is not None and (probed_ks is None or k in probed_ks)
                for p, counted in walk(drafts[row], start, answers.top[i], seq, plen, k, max_new_tokens, stops):
                    st.add_round(k, counted)
                    if probed:
                        for j in range(k):
                            sink, self_mass, rms = (values[row][j][c][p - start] for c in range(3))
                            pr.add(j + 1, sink, self_mass, rms)
                stats[k], drift[k] = st, pr
            results[i] = Replayed(stats, drift)
    return results  # type: ignore[return-value]
