"""The reference chain speculative decoder (greedy), with KV caches for target and drafter.

One round, with n tokens committed and `pending` = the target's next token (not yet in its cache):
  1. the drafter, whose cache holds one entry per committed position (entry t = target features of
     t + embedding of token t+1), proposes d_1 from its last entry and d_2..d_k from its own feedback;
  2. the target verifies [pending, d_1..d_k] in one forward pass;
  3. the longest prefix of drafts equal to the target's argmax is kept, plus the target's next token
     (the bonus); both caches are cropped back to the committed positions, and the accepted positions'
     target features extend the drafter's context for the next round.
The output equals the target's own greedy decoding (tested for every toggle combination).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from lab.drafter import Eagle3Drafter, KVCache
from lab.eval.probes import DriftProbes
from lab.target import capture


@dataclass
class DecodeStats:
    rounds: int = 0
    accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)  # accepted at draft position i (0-based)
    generated: int = 0
    seconds: float = 0.0

    def add_round(self, k: int, accepted: int) -> None:
        if not self.accepted_at:
            self.accepted_at = [0] * k
        self.rounds += 1
        self.accepted += accepted
        for i in range(accepted):
            self.accepted_at[i] += 1

    def merge(self, other: DecodeStats) -> None:
        if not self.accepted_at:
            self.accepted_at = [0] * len(other.accepted_at)
        self.rounds += other.rounds
        self.accepted += other.accepted
        self.accepted_at = [a + b for a, b in zip(self.accepted_at, other.accepted_at, strict=True)]
        self.generated += other.generated
        self.seconds += other.seconds

    @property
    def acceptance_length(self) -> float:
        """1 + accepted / drafts: counts the bonus token (vLLM's mean acceptance length)."""
        return 1.0 + self.accepted / max(1, self.rounds)

    @property
    def accept_rate(self) -> list[float]:
        """Unconditional per-position rate: accepted at position i / rounds (as vLLM reports)."""
        return [a / max(1, self.rounds) for a in self.accepted_at]

    @property
    def conditional_accept_rate(self) -> list[float]:
        """P(accept i | accepted i-1)."""
        out, prev = [], self.rounds
        for a in self.accepted_at:
            out.append(a / prev if prev else 0.0)
            prev = a
        return out


def _argmax_last(logits: torch.Tensor) -> int:
    return int(logits[0, -1].argmax())


@torch.no_grad()
def greedy_decode(target_model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], float]:
    """Plain greedy decoding of the target with its KV cache, one token per forward: the baseline."""
    start = time.perf_counter()
    ids = torch.tensor([prompt])
    out = target_model(input_ids=ids, use_cache=True)
    past, tokens = out.past_key_values, [_argmax_last(out.logits)]
    while len(tokens) < max_new_tokens:
        out = target_model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        tokens.append(_argmax_last(out.logits))
    return tokens, time.perf_counter() - start


@torch.no_grad()
def speculative_decode(
    target_model,
    drafter: Eagle3Drafter,
    prompt: list[int],
    max_new_tokens: int,
    k: int,
    probes: DriftProbes | None = None,
) -> tuple[list[int], DecodeStats]:
    """Greedy chain speculative decoding; returns the new tokens and the round statistics. With
    `probes`, the drafter's attention and feedback at each drafting step are recorded (read-only:
    the decoded tokens are the same)."""
    aux_layers = drafter.spec.aux_layer_ids
    lm_head = target_model.get_output_embeddings().weight
    stats = DecodeStats()
    start = time.perf_counter()

    ids = torch.tensor([prompt])
    cap = capture(target_model, ids, aux_layers, use_cache=True)
    target_cache = cap.past_key_values
    pending = int((cap.final[0, -1] @ lm_head.T).argmax())
    generated = [pending]
    n = len(prompt)  # committed tokens in the target cache

    dcache = KVCache(len(drafter.layers), record=probes is not None)
    # drafter context: entry t = (features of t, token t+1), for the positions just committed
    ctx_tokens, ctx_aux, ctx_start = prompt[1:] + [pending], cap.aux, 0

    while len(generated) < max_new_tokens:
        positions = torch.arange(ctx_start, ctx_start + len(ctx_tokens))[None]
        h_out = drafter(torch.tensor([ctx_tokens]), drafter.project(ctx_aux), positions, dcache)[:, -1:]
        drafts: list[int] = []
        for j in range(k):
            tok = int(drafter.to_target_ids(drafter.logits(h_out)[0, -1].argmax()))
            drafts.append(tok)
            fed_back = drafter.feedback(h_out)
            if probes is not None:  # keys from index n on were drafted in this round
                probes.record(j + 1, dcache.last_probs, first_self_key=n, fed_back=fed_back)
            if j + 1 < k:
                h_out = drafter(torch.tensor([[tok]]), fed_back, torch.tensor([[n + j]]), dcache)
        verify = capture(target_model, torch.tensor([[pending] + drafts]), aux_layers, past_key_values=target_cache)
        preds = (verify.final[0] @ lm_head.T).argmax(-1).tolist()  # preds[i] follows drafts[:i]
        accepted = 0
        while accepted < k and drafts[accepted] == preds[accepted]:
            accepted += 1
        bonus = preds[accepted]
        stats.add_round(k, accepted)

        target_cache = verify.past_key_values
        target_cache.crop(n + accepted + 1)  # pending + accepted drafts are now committed
        dcache.crop(n)  # drop the drafted entries; the context entries stay valid
        ctx_tokens = drafts[:accepted] + [bonus]
        ctx_aux = verify.aux[:, : accepted + 1]
        ctx_start = n
        n += accepted + 1
        generated.extend(drafts[:accepted] + [bonus])
        pending = bonus

    stats.seconds = time.perf_counter() - start
    generated = generated[:max_new_tokens]
    stats.generated = len(generated)
    return generated, stats
