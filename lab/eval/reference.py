"""The reference chain speculative decoder, with KV caches for target and drafter.

One round, with n tokens committed and `pending` = the target's next token (not yet in its cache):
  1. the drafter, whose cache holds one entry per committed position (entry t = target features of
     t + embedding of token t+1), proposes d_1 from its last entry and d_2..d_k from its own feedback;
  2. the target verifies [pending, d_1..d_k] in one forward pass;
  3. the longest prefix of drafts equal to the target's argmax is kept, plus the target's next token
     (the bonus); both caches are cropped back to the committed positions, and the accepted positions'
     target features extend the drafter's context for the next round.
Greedy (temperature 0) keeps the drafts equal to the target's argmax, so the output equals the
target's own greedy decoding (tested for every toggle combination). With temperature > 0 drafts are
sampled from the drafter and accepted by lossless speculative sampling (accept d with probability
min(1, p(d)/q(d)), else resample from norm(max(0, p - q))), so the output follows the target's own
sampling distribution (tested statistically).

Both models run on the target's device. The drafter computes in the target's dtype (under autocast: its
weights stay float32, lab/device.py), reading the target's features as they come; sampling draws from the
caller's CPU generator, so that a seed gives the same draws on any device. Greedy drafting keeps its tokens on
the device: a round waits for the host once, when the drafts and the target's predictions are read together.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from lab.device import autocast
from lab.drafter import Eagle3Drafter, KVCache
from lab.eval.probes import DriftProbes
from lab.target import Captured, capture


@dataclass
class DecodeStats:
    rounds: int = 0
    accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)  # accepted at draft position i (0-based)
    generated: int = 0
    seconds: float = 0.0
    draft_seconds: float = 0.0  # of `seconds`: the drafter's forwards and lm_head, k per round
    verify_seconds: float = 0.0  # of `seconds`: the target's forward over the k + 1 tokens and its lm_head

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
        if other.accepted_at:
            self.accepted_at = [a + b for a, b in zip(self.accepted_at, other.accepted_at, strict=True)]
        self.generated += other.generated
        self.seconds += other.seconds
        self.draft_seconds += other.draft_seconds
        self.verify_seconds += other.verify_seconds

    @property
    def acceptance_length(self) -> float:
        """1 + accepted / drafts: counts the bonus token (vLLM's mean acceptance length)."""
        return 1.0 + self.accepted / max(1, self.rounds)

    def draft_cost_ratio(self, k: int, target_seconds_per_token: float) -> float:
        """`c`: the drafter's seconds per drafted token (k per round) over the target's per decoded token."""
        return self.draft_seconds / max(1, self.rounds * k) / target_seconds_per_token

    def verify_cost_ratio(self, target_seconds_per_token: float) -> float:
        """`v`: one verification (k + 1 tokens through the target) over the target's seconds per decoded token."""
        return self.verify_seconds / max(1, self.rounds) / target_seconds_per_token

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


def _pick(
    logits: torch.Tensor, temperature: float, generator: torch.Generator | None
) -> tuple[int, torch.Tensor | None]:
    """Argmax (temperature 0) or a sample from softmax(logits / temperature), with its distribution."""
    if temperature == 0:
        return int(logits.argmax()), None
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return _sample(probs, generator), probs


def _sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from `probs`, on the CPU where the seeded generator lives (a no-op move on a CPU run)."""
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


@dataclass
class Prefill:
    """The target's forward over a prompt and the seconds it took, computed once per prompt and shared by
    the baseline and every k (a long prompt's prefill costs more than its decoding); each decoder counts
    `seconds` in its own time, as if it had run the prefill itself."""

    prompt_len: int
    captured: Captured  # aux and final [1, T, ...], the KV cache of the prompt
    seconds: float

    def cache(self):
        """The prompt's KV cache, cropped back to the prompt: the decoder before left its tokens in it, and
        the prompt's entries are never rewritten."""
        cache = self.captured.past_key_values
        if (extra := cache.get_seq_length() - self.prompt_len) > 0:
            cache.crop(-extra)  # transformers deprecates cropping to a positive length
        return cache


@torch.no_grad()
def prefill(target_model, prompt: list[int], aux_layers: list[int]) -> Prefill:
    device = target_model.get_output_embeddings().weight.device
    start = time.perf_counter()
    captured = capture(target_model, torch.tensor([prompt], device=device), aux_layers, use_cache=True)
    return Prefill(len(prompt), captured, time.perf_counter() - start)


@torch.no_grad()
def target_decode(
    target_model,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    prefilled: Prefill | None = None,
    stop_ids: tuple[int, ...] = (),
) -> tuple[list[int], float]:
    """Plain decoding of the target with its KV cache, one token per forward: the baseline, ending after a
    token of `stop_ids` (kept) or at `max_new_tokens`. Its seconds include the prompt's prefill."""
    lm_head = target_model.get_output_embeddings().weight
    pre = prefilled or prefill(target_model, prompt, [0])
    start = time.perf_counter()
    past, tokens = pre.cache(), [_pick(pre.captured.final[0, -1] @ lm_head.T, temperature, generator)[0]]
    token = torch.tensor([[tokens[-1]]], device=lm_head.device)
    while len(tokens) < max_new_tokens and tokens[-1] not in stop_ids:
        out = target_model(input_ids=token, past_key_values=past, use_cache=True)
        past = out.past_key_values
        if temperature == 0:  # the next input stays on the device: one read a token, no upload
            token = out.logits[0, -1].argmax().view(1, 1)
            tokens.append(int(token))
        else:
            tokens.append(_pick(out.logits[0, -1], temperature, generator)[0])
            token = torch.tensor([[tokens[-1]]], device=lm_head.device)
    return tokens, pre.seconds + time.perf_counter() - start


def _accept(
    drafts: torch.Tensor,
    draft_probs: list[torch.Tensor | None],
    target_z: torch.Tensor,
    temperature: float,
    generator: torch.Generator | None,
) -> tuple[int, int, list[int], torch.Tensor | None]:
    """(number of drafts accepted, the token that follows them, the drafts as ints, and greedy's committed
    tokens, the accepted drafts and that token, still on the device) from the drafts [k] and the target's
    logits [k+1, V]: greedy reads them from the device in one transfer a round."""
    k = len(drafts)
    if temperature == 0:
        preds = target_z.argmax(-1)  # preds[i] follows drafts[:i]
        accepted = (drafts == preds[:k]).int().cumprod(0).sum()  # the longest prefix that matches
        said = torch.cat([accepted[None], preds, drafts]).tolist()
        accepted = said[0]
        return accepted, said[1 + accepted], said[k + 2 :], torch.cat([drafts[:accepted], preds[accepted:][:1]])
    tokens = drafts.tolist()
    p = torch.softmax(target_z.float() / temperature, dim=-1)
    for i, (d, q) in enumerate(zip(tokens, draft_probs, strict=True)):
        # as Python floats: the CPU generator's draw against a ratio on any device (exact: both are float32)
        if torch.rand((), generator=generator).item() >= torch.clamp(p[i, d] / q[d], max=1.0).item():
            residual = (p[i] - q).clamp_min(0)
            total = residual.sum()
            dist = residual / total if total > 0 else p[i]
            return i, _sample(dist, generator), tokens, None
    return k, _sample(p[k], generator), tokens, None


@torch.no_grad()
def speculative_decode(
    target_model,
    drafter: Eagle3Drafter,
    prompt: list[int],
    max_new_tokens: int,
    k: int,
    probes: DriftProbes | None = None,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    prefilled: Prefill | None = None,
    stop_ids: tuple[int, ...] = (),
) -> tuple[list[int], DecodeStats]:
    """Chain speculative decoding, ending after a token of `stop_ids` (kept) or at `max_new_tokens`; returns
    the new tokens and the round statistics (its seconds include the prompt's prefill). A round that
    reaches a stop token counts its accepted drafts up to and including it: what follows is no output.
    With `probes`, the drafter's attention and feedback at each drafting step are recorded (read-only: the
    decoded tokens are the same)."""
    aux_layers = drafter.spec.aux_layer_ids
    lm_head = target_model.get_output_embeddings().weight
    device, features = lm_head.device, drafter.fc.weight.dtype  # the drafter reads features in its own dtype
    stats = DecodeStats()
    pre = prefilled or prefill(target_model, prompt, aux_layers)
    start = time.perf_counter()
    cap, target_cache = pre.captured, pre.cache()
    pending = _pick(cap.final[0, -1] @ lm_head.T, temperature, generator)[0]
    generated = [pending]
    n = len(prompt)  # committed tokens in the target cache

    dcache = KVCache(len(drafter.layers), record=probes is not None)
    # drafter context: entry t = (features of t, token t+1), for the positions just committed; its tokens on
    # the device (greedy rounds never upload them: they are the last round's accepted drafts and bonus)
    ctx_ids, ctx_aux, ctx_start = torch.tensor(prompt[1:] + [pending], device=device), cap.aux, 0

    while len(generated) < max_new_tokens and pending not in stop_ids:
        drafting = time.perf_counter()
        with autocast(device, lm_head.dtype):
            positions = torch.arange(ctx_start, n + k, device=device)[None]  # the context's, then the drafts'
            hidden = drafter.project(ctx_aux.to(features))
            context = positions[:, : len(ctx_ids)]
            h_out = drafter(ctx_ids[None], hidden, context, dcache)[:, -1:]
            drafted: list[torch.Tensor] = []  # [1] each, on the device: greedy drafting never waits for the host
            draft_probs: list[torch.Tensor | None] = []
            for j in range(k):
                logits = drafter.logits(h_out)[0, -1]
                if temperature == 0:
                    draft, q = drafter.to_target_ids(logits.argmax()[None]), None
                else:
                    draft_id, q = _pick(logits, temperature, generator)
                    draft = drafter.to_target_ids(torch.tensor([draft_id], device=device))
                drafted.append(draft)
                draft_probs.append(None if q is None else drafter.to_target_probs(q))
                if j + 1 == k and probes is None:
                    break  # the last draft feeds nothing back
                fed_back = drafter.feedback(h_out)
                if probes is not None:  # keys from index n on were drafted in this round
                    probes.record(j + 1, dcache.last_probs, first_self_key=n, fed_back=fed_back)
                if j + 1 < k:
                    position = positions[:, n + j - ctx_start : n + j - ctx_start + 1]
                    h_out = drafter(draft[None], fed_back, position, dcache)
        if device.type == "cuda":  # the drafts were queued, not computed: time what they cost
            torch.cuda.synchronize(device)
        verifying = time.perf_counter()
        stats.draft_seconds += verifying - drafting
        proposed = torch.cat([ctx_ids[-1:], *drafted])[None]  # [1, k + 1]: the pending token, the drafts
        verify = capture(target_model, proposed, aux_layers, past_key_values=target_cache)
        accepted, bonus, drafts, committed = _accept(
            proposed[0, 1:], draft_probs, verify.final[0] @ lm_head.T, temperature, generator
        )
        stats.verify_seconds += time.perf_counter() - verifying
        stop = next((i for i, tok in enumerate(drafts[:accepted]) if tok in stop_ids), None)
        if stop is not None:  # an accepted draft ends the answer: nothing after it is output
            stats.add_round(k, stop + 1)
            generated.extend(drafts[: stop + 1])
            break
        stats.add_round(k, accepted)

        target_cache = verify.past_key_values
        if accepted < k:  # drop the rejected drafts (a negative count: tokens to remove from the end)
            target_cache.crop(-(k - accepted))
        dcache.crop(n)  # drop the drafted entries; the context entries stay valid
        ctx_ids = committed if committed is not None else torch.tensor(drafts[:accepted] + [bonus], device=device)
        ctx_aux = verify.aux[:, : accepted + 1]
        ctx_start = n
        n += accepted + 1
        generated.extend(drafts[:accepted] + [bonus])
        pending = bonus

    stats.seconds = pre.seconds + time.perf_counter() - start
    generated = generated[:max_new_tokens]
    stats.generated = len(generated)
    return generated, stats
