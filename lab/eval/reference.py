"""The reference chain speculative decoder, with KV caches for target and drafter.

One round, with n tokens committed and `pending` = the target's next token (not yet in its cache):
  1. the drafter, whose cache holds one entry per committed position (entry t = target features of
     t + embedding of token t+1), proposes d_1 from its last entry and d_2..d_k from its own feedback;
  2. the target verifies [pending, d_1..d_k] in one forward pass;
  3. the longest prefix of drafts equal to the target's argmax is kept, plus the target's next token
     (the bonus); both caches are cropped back to the committed positions, and the accepted positions'
     target features extend the drafter's context for the next round.
`_round` is one round and returns a `Round`: `_draft` does step 1, `TargetCache` the target's side of 2 and 3,
`_accept` the choice of 3 (a `Verdict`).
Greedy (temperature 0) keeps the drafts equal to the target's argmax, so the output equals the
target's own greedy decoding (tested for every toggle combination). With temperature > 0 drafts are
sampled from the drafter and accepted by lossless speculative sampling (accept d with probability
min(1, p(d)/q(d)), else resample from norm(max(0, p - q))), so the output follows the target's own
sampling distribution (tested statistically).

Both models run on the target's device. The drafter computes in the target's dtype (under autocast: its
weights stay float32, lab/device.py), reading the target's features as they come; sampling draws from the
caller's CPU generator, so that a seed gives the same draws on any device. Greedy drafting keeps its tokens on
the device: a round waits for the host once, when the drafts and the target's predictions are read together.
Where `kv_cache` resolves to static (auto: on CUDA), the target steps through a static cache whose forwards are
CUDA graphs, one for each width (1 plainly, k + 1 to verify), and a rejection moves its position back
(lab/target/static_sequence.py); elsewhere through transformers' dynamic cache, cropped. Both decode the same
tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lab.device import autocast
from lab.drafter import Eagle3Drafter, KVCache
from lab.eval.probes import DriftProbes
from lab.target import Captured, capture
from lab.target.generate import resolve_kv_cache
from lab.target.static_sequence import StaticSequence


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
    `seconds` in its own time, as if it had run the prefill itself. Over the dynamic cache `captured` holds the
    prompt's cache; over the static one `static` does (lab/target/static_sequence.py)."""

    prompt_len: int
    captured: Captured  # aux and final [1, T, ...], and the dynamic KV cache of the prompt
    seconds: float
    aux_layers: list[int] = field(default_factory=list)  # the layers `captured.aux` holds
    static: StaticSequence | None = None

    def cache(self):
        """The prompt's dynamic KV cache, cropped back to the prompt: the decoder before left its tokens in it,
        and the prompt's entries are never rewritten."""
        cache = self.captured.past_key_values
        if (extra := cache.get_seq_length() - self.prompt_len) > 0:
            cache.crop(-extra)  # transformers deprecates cropping to a positive length
        return cache

    def target(self, model, aux_layers: list[int], room: int) -> TargetCache | StaticSequence:
        """The target's cache at the prompt's end, for a decoding that adds up to `room` positions to it."""
        if self.static is None:
            return TargetCache(model, aux_layers, self.cache())
        if list(aux_layers) != self.aux_layers:
            raise ValueError(f"a static prefill captured layers {self.aux_layers}; the decoder reads {aux_layers}")
        self.static.restart(room)
        return self.static


@torch.no_grad()
def prefill(target_model, prompt: list[int], aux_layers: list[int], kv_cache: str = "auto", room: int = 0) -> Prefill:
    """The target's forward over `prompt`, into the KV cache `kv_cache` resolves to (`resolve_kv_cache`: auto is
    the static one on CUDA), which holds `room` positions after the prompt (a static cache grows if a decoding
    needs more, at the cost of the prompt's forward again)."""
    device = target_model.get_output_embeddings().weight.device
    start = time.perf_counter()
    ids = torch.tensor([prompt], device=device)
    if resolve_kv_cache(kv_cache, device) == "static":
        static = StaticSequence(target_model, ids, aux_layers)
        captured = static.prefill(room)
        return Prefill(len(prompt), captured, time.perf_counter() - start, list(aux_layers), static)
    captured = capture(target_model, ids, aux_layers, use_cache=True)
    return Prefill(len(prompt), captured, time.perf_counter() - start, list(aux_layers))


def _room(max_new_tokens: int, k: int = 0) -> int:
    """The positions a decoding writes after the prompt: its tokens and, speculatively, a round's drafts past them."""
    return max_new_tokens + k + 1


@torch.no_grad()
def target_decode(
    target_model,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    prefilled: Prefill | None = None,
    stop_ids: tuple[int, ...] = (),
    kv_cache: str = "auto",
) -> tuple[list[int], float]:
    """Plain decoding of the target with its KV cache, one token per forward: the baseline, ending after a
    token of `stop_ids` (kept) or at `max_new_tokens`. Its seconds include the prompt's prefill. Without
    `prefilled` it prefills into the cache `kv_cache` names; with it, it steps the prefill's cache."""
    lm_head = target_model.get_output_embeddings().weight
    pre = prefilled or prefill(target_model, prompt, [0], kv_cache, _room(max_new_tokens))
    start = time.perf_counter()
    step = _plain_step(target_model, pre, _room(max_new_tokens))
    tokens = [_pick(pre.captured.final[0, -1] @ lm_head.T, temperature, generator)[0]]
    token = torch.tensor([[tokens[-1]]], device=lm_head.device)
    while len(tokens) < max_new_tokens and tokens[-1] not in stop_ids:
        logits = step(token)
        if temperature == 0:  # the next input stays on the device: one read a token, no upload
            token = logits.argmax().view(1, 1)
            tokens.append(int(token))
        else:
            tokens.append(_pick(logits, temperature, generator)[0])
            token = torch.tensor([[tokens[-1]]], device=lm_head.device)
    return tokens, pre.seconds + time.perf_counter() - start


def _plain_step(target_model, pre: Prefill, room: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Plain decoding's step over the prefill's cache: the target's logits [V] after one more token [1, 1]."""
    if pre.static is not None:
        target, lm_head = pre.target(target_model, pre.aux_layers, room), target_model.get_output_embeddings()
        return lambda token: lm_head(target.forward(token).final)[0, -1]
    past = pre.cache()

    def step(token: torch.Tensor) -> torch.Tensor:
        nonlocal past
        out = target_model(input_ids=token, past_key_values=past, use_cache=True)
        past = out.past_key_values
        return out.logits[0, -1]

    return step


@dataclass
class Context:
    """The drafter's new context entries, for the positions committed since its last pass: entry t holds the
    target's features at t and the token at t + 1, so that the last entry's token is the pending one."""

    ids: torch.Tensor  # [m]: the tokens at positions start + 1 .. start + m, on the device
    aux: torch.Tensor  # [1, m, ...]: the target's features at positions start .. start + m - 1
    start: int

    @property
    def end(self) -> int:
        """The committed positions: those in the target's cache (the pending token comes next)."""
        return self.start + len(self.ids)


@dataclass
class Drafts:
    """A round's k drafts, as the target verifies them."""

    tokens: list[torch.Tensor]  # k target ids, [1] each on the device: greedy drafting never waits for the host
    probs: list[torch.Tensor | None]  # the drafter's distribution over target ids for each; None when greedy


@dataclass
class Verdict:
    """What the target's verification keeps of the drafts, and the token it adds."""

    accepted: int  # the drafts accepted, a prefix of them
    bonus: int  # the target's token after the accepted drafts
    drafts: list[int]  # all k drafts
    committed: torch.Tensor | None  # greedy: the accepted drafts and the bonus, still on the device


@dataclass
class Marks:
    """Where a round's drafting began, its verification began and its verdict was in (`Stopwatch.mark`)."""

    drafting: float | torch.cuda.Event
    verifying: float | torch.cuda.Event
    verified: float | torch.cuda.Event


@dataclass
class Round:
    """One round's outcome: what it outputs and counts, and where the next round starts."""

    accepted: int  # the drafts counted: those accepted, or those up to and including an accepted stop token
    tokens: list[int]  # the round's output: the accepted drafts and the bonus, or the drafts up to the stop token
    stopped: bool  # an accepted draft was a stop token: what follows it is no output
    context: Context | None  # the drafter's context for the next round; None once stopped
    marks: Marks


class Stopwatch:
    """The seconds of a decoding's drafts and verifications. On CUDA its marks are events in the stream of work,
    read once the decoding ends, so that a round waits for the host only for its verdict (a round's drafts are
    queued, not computed, when its verification begins); elsewhere the host's clock."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> float | torch.cuda.Event:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def totals(self, marks: list[Marks]) -> tuple[float, float]:
        """The drafts' seconds and the verifications' seconds over `marks`, in the rounds' order."""
        if self.cuda and marks:
            marks[-1].verified.synchronize()  # the decoding's one wait for its timings: every mark is then done
        draft = verify = 0.0
        for m in marks:
            draft += self._between(m.drafting, m.verifying)
            verify += self._between(m.verifying, m.verified)
        return draft, verify

    def _between(self, start: float | torch.cuda.Event, end: float | torch.cuda.Event) -> float:
        return start.elapsed_time(end) / 1000 if self.cuda else end - start


class TargetCache:
    """The target's dynamic KV cache through a decoding, and the only code that steps it: a forward over a round's
    proposed tokens, then a crop back to the committed positions. The static cache in CUDA graphs
    (lab/target/static_sequence.py's `StaticSequence`, the same two methods) takes its place where `kv_cache`
    resolves to static, without touching the round."""

    def __init__(self, model, aux_layers: list[int], past_key_values) -> None:
        self.model, self.aux_layers, self.past_key_values = model, aux_layers, past_key_values

    def forward(self, tokens: torch.Tensor) -> Captured:
        """The target over `tokens` [1, T] after the cached positions, which it extends by T."""
        out = capture(self.model, tokens, self.aux_layers, past_key_values=self.past_key_values)
        self.past_key_values = out.past_key_values
        return out

    def rewind(self, positions: int) -> None:
        """Drop the last `positions` entries (transformers crops by a negative count from the end)."""
        if positions > 0:
            self.past_key_values.crop(-positions)


@dataclass
class Decoding:
    """What one prompt's rounds share: the two models, their caches, and the decoding's settings."""

    target: TargetCache | StaticSequence
    lm_head: torch.Tensor  # the target's [V, H]
    drafter: Eagle3Drafter
    drafter_cache: KVCache
    k: int
    temperature: float
    generator: torch.Generator | None
    probes: DriftProbes | None
    stop_ids: tuple[int, ...]
    stopwatch: Stopwatch


def _draft(run: Decoding, context: Context) -> Drafts:
    """The drafter's pass over its new context entries, then k drafts, each fed back for the next (the last
    too when probes record its step)."""
    drafter, cache, n, device = run.drafter, run.drafter_cache, context.end, context.ids.device
    drafts = Drafts([], [])
    with autocast(device, run.lm_head.dtype):
        positions = torch.arange(context.start, n + run.k, device=device)[None]  # the context's, then the drafts'
        hidden = drafter.project(context.aux.to(drafter.fc.weight.dtype))  # the drafter reads features in its dtype
        h_out = drafter(context.ids[None], hidden, positions[:, : len(context.ids)], cache)[:, -1:]
        for j in range(run.k):
            logits = drafter.logits(h_out)[0, -1]
            if run.temperature == 0:
                draft, q = drafter.to_target_ids(logits.argmax()[None]), None
            else:
                draft_id, q = _pick(logits, run.temperature, run.generator)
                draft = drafter.to_target_ids(torch.tensor([draft_id], device=device))
            drafts.tokens.append(draft)
            drafts.probs.append(None if q is None else drafter.to_target_probs(q))
            last = j + 1 == run.k
            if last and run.probes is None:
                break  # the last draft feeds nothing back
            fed_back = drafter.feedback(h_out)
            if run.probes is not None:  # keys from index n on were drafted in this round
                run.probes.record(j + 1, cache.last_probs, first_self_key=n, fed_back=fed_back)
            if not last:
                at = n + j - context.start
                h_out = drafter(draft[None], fed_back, positions[:, at : at + 1], cache)
    return drafts


def _accept(
    drafts: torch.Tensor,
    draft_probs: list[torch.Tensor | None],
    target_logits: torch.Tensor,
    temperature: float,
    generator: torch.Generator | None,
) -> Verdict:
    """The verdict on the drafts [k] from the target's logits [k + 1, V] (row i follows drafts[:i]): greedy
    keeps the longest prefix equal to the target's argmax, sampling accepts by speculative sampling."""
    if temperature == 0:
        return _accept_greedy(drafts, target_logits)
    return _accept_sampled(drafts, draft_probs, target_logits, temperature, generator)


def _accept_greedy(drafts: torch.Tensor, target_logits: torch.Tensor) -> Verdict:
    """The longest prefix of drafts equal to the target's argmax, and the target's argmax after it."""
    k = len(drafts)
    preds = target_logits.argmax(-1)
    matched = (drafts == preds[:k]).int().cumprod(0).sum()
    # the round's one wait for the host: the count, the predictions and the drafts, read in one transfer
    read = torch.cat([matched[None], preds, drafts]).tolist()
    accepted, predicted, drafted = read[0], read[1 : k + 2], read[k + 2 :]
    committed = torch.cat([drafts[:accepted], preds[accepted : accepted + 1]])
    return Verdict(accepted, predicted[accepted], drafted, committed)


def _accept_sampled(
    drafts: torch.Tensor,
    draft_probs: list[torch.Tensor | None],
    target_logits: torch.Tensor,
    temperature: float,
    generator: torch.Generator | None,
) -> Verdict:
    """Accept draft d with probability min(1, p(d) / q(d)); the first rejected one is resampled from
    norm(max(0, p - q)), and after k accepted the bonus is drawn from p."""
    tokens = drafts.tolist()
    p = torch.softmax(target_logits.float() / temperature, dim=-1)
    for i, (d, q) in enumerate(zip(tokens, draft_probs, strict=True)):
        # as Python floats: the CPU generator's draw against a ratio on any device (exact: both are float32)
        if torch.rand((), generator=generator).item() >= torch.clamp(p[i, d] / q[d], max=1.0).item():
            residual = (p[i] - q).clamp_min(0)
            total = residual.sum()
            dist = residual / total if total > 0 else p[i]
            return Verdict(i, _sample(dist, generator), tokens, committed=None)
    return Verdict(len(tokens), _sample(p[len(tokens)], generator), tokens, committed=None)


def _round(run: Decoding, context: Context) -> Round:
    """Draft k tokens, verify them with the pending token in one target forward, accept a prefix, then cut
    both caches back to the committed positions and hand the drafter its next context."""
    device, n = context.ids.device, context.end
    drafting = run.stopwatch.mark()
    drafts = _draft(run, context)
    verifying = run.stopwatch.mark()
    proposed = torch.cat([context.ids[-1:], *drafts.tokens])[None]  # [1, k + 1]: the pending token, the drafts
    verified = run.target.forward(proposed)
    verdict = _accept(proposed[0, 1:], drafts.probs, verified.final[0] @ run.lm_head.T, run.temperature, run.generator)
    marks = Marks(drafting, verifying, run.stopwatch.mark())

    accepted = verdict.accepted
    stop = next((i for i, tok in enumerate(verdict.drafts[:accepted]) if tok in run.stop_ids), None)
    if stop is not None:
        return Round(stop + 1, verdict.drafts[: stop + 1], True, None, marks)
    run.target.rewind(run.k - accepted)  # the rejected drafts
    run.drafter_cache.crop(n)  # the drafted entries; the context entries stay valid
    tokens = verdict.drafts[:accepted] + [verdict.bonus]
    ids = verdict.committed if verdict.committed is not None else torch.tensor(tokens, device=device)
    following = Context(ids, verified.aux[:, : accepted + 1], start=n)
    return Round(accepted, tokens, False, following, marks)


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
    kv_cache: str = "auto",
) -> tuple[list[int], DecodeStats]:
    """Chain speculative decoding, ending after a token of `stop_ids` (kept) or at `max_new_tokens`; returns
    the new tokens and the round statistics (its seconds include the prompt's prefill). A round that
    reaches a stop token counts its accepted drafts up to and including it: what follows is no output.
    With `probes`, the drafter's attention and feedback at each drafting step are recorded (read-only: the
    decoded tokens are the same). Without `prefilled` it prefills into the cache `kv_cache` names; with it, it
    steps the prefill's cache."""
    aux_layers = drafter.spec.aux_layer_ids
    lm_head = target_model.get_output_embeddings().weight
    pre = prefilled or prefill(target_model, prompt, aux_layers, kv_cache, _room(max_new_tokens, k))
    start = time.perf_counter()
    target = pre.target(target_model, aux_layers, _room(max_new_tokens, k))
    pending = _pick(pre.captured.final[0, -1] @ lm_head.T, temperature, generator)[0]
    drafter_cache = KVCache(len(drafter.layers), record=probes is not None)
    stopwatch = Stopwatch(lm_head.device)
    run = Decoding(target, lm_head, drafter, drafter_cache, k, temperature, generator, probes, stop_ids, stopwatch)
    context = Context(torch.tensor(prompt[1:] + [pending], device=lm_head.device), pre.captured.aux, start=0)

    stats, generated, marks = DecodeStats(), [pending], []
    while len(generated) < max_new_tokens and generated[-1] not in stop_ids:
        step = _round(run, context)
        stats.add_round(k, step.accepted)
        marks.append(step.marks)
        generated.extend(step.tokens)
        if step.stopped:
            break
        context = step.context

    stats.seconds = pre.seconds + time.perf_counter() - start
    stats.draft_seconds, stats.verify_seconds = stopwatch.totals(marks)
    generated = generated[:max_new_tokens]
    stats.generated = len(generated)
    return generated, stats
