"""The reference speculative decoder is lossless, and a trained drafter is accepted more often."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from helpers import evaluate_suite, traced_steps

from lab.config.shape import aux_layers
from lab.data.suites import build_suite
from lab.drafter import init_drafter
from lab.eval.probes import unrolled_rounds
from lab.eval.reference import DecodeStats, prefill, speculative_decode, target_decode
from lab.target import capture

TOGGLES = list(itertools.product(["none", "per_layer", "concat"], [False, True], ["rmsnorm", "layernorm"]))


@pytest.fixture(scope="module")
def prompts(micro_cfg, micro_target):
    return build_suite("in_dist", micro_target.tokenizer, micro_cfg).prompts[:3]


@pytest.mark.parametrize(("fc_norm", "norm_output", "norm_type"), TOGGLES)
def test_output_equals_target_greedy_for_every_toggle(
    micro_cfg, micro_target, prompts, fc_norm, norm_output, norm_type
):
    dcfg = micro_cfg.drafter.copy()
    dcfg.fc_norm, dcfg.norm_output, dcfg.norm_type = fc_norm, norm_output, norm_type
    drafter = init_drafter(micro_target, dcfg, aux_layers(micro_cfg), seed=1).eval()
    for prompt, k in zip(prompts, [1, 3, 6], strict=True):
        reference, _ = target_decode(micro_target.model, prompt, 24)
        tokens, stats = speculative_decode(micro_target.model, drafter, prompt, 24, k)
        assert tokens == reference
        assert stats.rounds > 0 and 1.0 <= stats.acceptance_length <= k + 1


def test_one_prefill_serves_the_baseline_and_every_k(micro_cfg, micro_target, trained_eagle3, prompts):
    """The evaluation runs a prompt's prefill once: each decoder crops the shared cache back to the prompt
    and decodes what it decodes from a prefill of its own, and counts the shared prefill's seconds."""
    (drafter, _), model, prompt = trained_eagle3, micro_target.model, prompts[0]
    pre = prefill(model, prompt, drafter.spec.aux_layer_ids)
    shared = [target_decode(model, prompt, 24, prefilled=pre)[0]]
    own = [target_decode(model, prompt, 24)[0]]
    for k in (3, 6):
        tokens, stats = speculative_decode(model, drafter, prompt, 24, k, prefilled=pre)
        shared.append(tokens)
        own.append(speculative_decode(model, drafter, prompt, 24, k)[0])
        assert stats.seconds > pre.seconds
    assert shared == own and all(tokens == own[0] for tokens in own)
    assert pre.cache().get_seq_length() == len(prompt)


def test_decoding_ends_at_a_stop_token(micro_target, trained_eagle3, prompts):
    """With `stop_ids`, the baseline and every k end after the first stop token, which they keep: the
    target's greedy output up to it, with no round after it."""
    (drafter, _), model, prompt = trained_eagle3, micro_target.model, prompts[0]
    reference, _ = target_decode(model, prompt, 24)
    end = next(i for i, tok in enumerate(reference) if i >= 4 and tok not in reference[:i])  # first seen at i
    stop = (reference[end],)
    assert target_decode(model, prompt, 24, stop_ids=stop)[0] == reference[: end + 1]
    for k in (1, 3, 6):
        tokens, stats = speculative_decode(model, drafter, prompt, 24, k, stop_ids=stop)
        assert tokens == reference[: end + 1] and stats.generated == end + 1
        # each round outputs its accepted drafts and a bonus token, but the one that stops inside its drafts
        assert stats.accepted + stats.rounds <= len(tokens) <= 1 + stats.accepted + stats.rounds
    assert speculative_decode(model, drafter, prompt, 24, 3, stop_ids=(reference[0],))[0] == reference[:1]


def test_accepted_drafts_after_a_stop_token_do_not_count(micro_cfg, micro_target, prompts, monkeypatch):
    """A round whose accepted drafts hold a stop token counts the drafts up to it and none after: they are
    not output (vLLM's counters differ here; they count what the sampler accepted)."""
    import lab.eval.reference as reference_module

    drafter = init_drafter(micro_target, micro_cfg.drafter, aux_layers(micro_cfg), seed=1).eval()
    real = reference_module._accept
    rounds: list[list[int]] = []

    def accept_all(drafts, *args):  # every draft accepted, as a drafter that agrees with its target would be
        verdict = real(drafts, *args)
        rounds.append(verdict.drafts)
        # committed None: the round uploads its tokens from these ints
        return reference_module.Verdict(len(verdict.drafts), verdict.bonus, verdict.drafts, committed=None)

    monkeypatch.setattr(reference_module, "_accept", accept_all)
    speculative_decode(micro_target.model, drafter, prompts[0], 24, 4)
    first = rounds[0]
    at = next(i for i, tok in enumerate(first) if tok not in first[:i] and i > 0)
    tokens, stats = speculative_decode(micro_target.model, drafter, prompts[0], 24, 4, stop_ids=(first[at],))
    assert stats.rounds == 1 and stats.accepted == at + 1 and stats.accepted_at == [1] * (at + 1) + [0] * (3 - at)
    assert len(tokens) == 1 + at + 1 and tokens[-1] == first[at]


def test_smaller_draft_vocabulary_is_lossless_and_trains(micro_cfg, micro_target, micro_hidden, prompts):
    """EAGLE-3's d2t: lm_head over the most frequent tokens, mapped back to target ids."""
    from lab.train.ttt import train

    dcfg = micro_cfg.drafter.copy()
    dcfg.draft_vocab_size = 96
    counts = torch.bincount(micro_hidden.input_ids[micro_hidden.loss_mask.bool()], minlength=micro_target.vocab_size)
    drafter = init_drafter(micro_target, dcfg, aux_layers(micro_cfg), seed=0, token_counts=counts)
    ids = drafter.draft_token_ids()
    assert len(ids) == 96 and ids.tolist() == sorted(ids.tolist())
    assert counts[ids].min() >= counts[torch.ones(len(counts), dtype=torch.bool).index_fill_(0, ids, False)].max()
    tcfg = micro_cfg.train.copy()
    tcfg.steps = 20
    result = train(drafter, micro_hidden, micro_target.lm_head_weight, tcfg, seed=0, progress=False)
    assert result.last["train/acc_0"] > 0.2
    for prompt in prompts:
        reference, _ = target_decode(micro_target.model, prompt, 24)
        tokens, _ = speculative_decode(micro_target.model, drafter, prompt, 24, 3)
        assert tokens == reference


def test_acceptance_bookkeeping():
    """AL counts the bonus token; per-position rates are unconditional, as vLLM reports them."""
    stats = DecodeStats()
    for _ in range(5):
        stats.add_round(4, 4)
    assert stats.acceptance_length == 5.0 and stats.accept_rate == [1.0] * 4
    stats.add_round(4, 1)
    assert stats.acceptance_length == pytest.approx(1 + 21 / 6)
    assert stats.accept_rate == pytest.approx([1.0, 5 / 6, 5 / 6, 5 / 6])
    assert stats.conditional_accept_rate == pytest.approx([1.0, 5 / 6, 1.0, 1.0])


def test_trained_drafter_beats_untrained(micro_cfg, micro_target, trained_eagle3):
    trained, result = trained_eagle3
    untrained = init_drafter(micro_target, micro_cfg.drafter, aux_layers(micro_cfg), seed=0)
    suite = build_suite("in_dist", micro_target.tokenizer, micro_cfg)
    good = evaluate_suite(micro_target.model, trained, suite, [3], progress=False)
    bad = evaluate_suite(micro_target.model, untrained, suite, [3], progress=False)
    assert good["eval/in_dist/ref/k3/al"] > bad["eval/in_dist/ref/k3/al"] + 0.2, (good, bad)
    assert good["eval/in_dist/ref/k3/exact_match"] == 1.0
    assert len(good["eval/in_dist/ref/k3/accept_rate"]) == 3


@pytest.mark.parametrize("drafter_fixture", ["trained_eagle3", "trained_eagle31"])
def test_every_round_drafts_what_the_training_unroll_predicts(micro_target, prompts, drafter_fixture, request):
    """Decoding and training see the drafter alike: the decoder's acceptance, round by round, is what the
    teacher-forced TTT unroll (the training forward) foretells on the decoded text, at every depth. A
    mismatch of positions, cache context or feedback between the two shows here as a different count."""
    drafter, _ = request.getfixturevalue(drafter_fixture)
    model = micro_target.model
    for prompt, k in zip(prompts, [3, 6, 3], strict=True):
        output = target_decode(model, prompt, 40)[0]  # beyond 32: the last round may draft past the cut
        tokens, stats = speculative_decode(model, drafter, prompt, 32, k)
        assert tokens == output[:32]
        ids = torch.tensor([prompt + output])
        foretold = unrolled_rounds(drafter, ids, capture(model, ids, drafter.spec.aux_layer_ids).aux, len(prompt), k)
        produced, rounds = 1, 0  # the first token is the prefill's; a round adds its accepted drafts + 1
        while produced < 32:
            produced += foretold[rounds] + 1
            rounds += 1
        assert stats.rounds == rounds and stats.accepted > 0
        assert stats.accepted_at == [sum(a > i for a in foretold[:rounds]) for i in range(k)]


def test_the_chain_limit_is_al_over_one_plus_k_c():
    """`c` is the drafter's measured seconds per drafted token over the target's per plain-decoded token; the
    chain limit AL / (1 + k c) is logged beside the speedup it bounds."""
    stats = DecodeStats(rounds=4, accepted=6, draft_seconds=0.6, verify_seconds=0.6)
    assert stats.draft_cost_ratio(3, target_seconds_per_token=0.1) == pytest.approx(0.6 / 12 / 0.1)
    assert stats.verify_cost_ratio(target_seconds_per_token=0.1) == pytest.approx(0.6 / 4 / 0.1)
    from helpers import small_drafter, small_target

    from lab.data.suites import Suite

    target, drafter = small_target(0), small_drafter(0)
    suite = Suite("mix", [torch.randint(0, 100, (9,)).tolist()], ["a"], max_new_tokens=16)
    m = evaluate_suite(target, drafter, suite, [2, 4], progress=False)
    for k in (2, 4):
        c = m[f"eval/mix/ref/k{k}/draft_cost_ratio"]
        assert c > 0
        assert m[f"eval/mix/ref/k{k}/chain_limit"] == pytest.approx(m[f"eval/mix/ref/k{k}/al"] / (1 + k * c))
        v = m[f"eval/mix/ref/k{k}/verify_cost_ratio"]
        assert v > 0
        assert m[f"eval/mix/ref/k{k}/verify_limit"] == pytest.approx(m[f"eval/mix/ref/k{k}/al"] / (v + k * c))


def _chi2_pvalue(counts: torch.Tensor, expected_probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson chi-square goodness of fit; tokens with few expected counts are pooled into one bin."""
    n = counts.sum()
    expected = expected_probs * n
    big = expected >= min_expected
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    stat = ((obs - exp) ** 2 / exp.clamp_min(1e-9)).sum()
    df = torch.tensor(float(len(obs) - 1))
    return float(torch.special.gammaincc(df / 2, stat / 2))


@pytest.mark.slow
def test_speculative_sampling_matches_the_target_distribution(micro_cfg, micro_target, prompts):
    """With temperature 1, the second generated token (drafted, then accepted or resampled) must follow
    the target's exact marginal sum_x0 p(x0) p(x1 | x0); an untrained drafter forces many rejections."""
    model, prompt, temperature, n = micro_target.model, prompts[0][:16], 1.0, 2500
    with torch.no_grad():
        p0 = torch.softmax(model(input_ids=torch.tensor([prompt])).logits[0, -1] / temperature, -1)
        vocab = p0.shape[0]
        batch = torch.cat([torch.tensor([prompt]).expand(vocab, -1), torch.arange(vocab)[:, None]], dim=1)
        p1 = torch.softmax(model(input_ids=batch).logits[:, -1] / temperature, -1)  # [V, V]: p(x1 | x0)
    marginal = p0 @ p1
    drafter = init_drafter(micro_target, micro_cfg.drafter, aux_layers(micro_cfg), seed=3).eval()
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(vocab)
    rejected = 0
    for _ in range(n):
        tokens, stats = speculative_decode(model, drafter, prompt, 2, 3, temperature=temperature, generator=gen)
        counts[tokens[1]] += 1
        rejected += stats.accepted_at[0] == 0
    assert rejected > n * 0.2  # the residual path is exercised
    assert _chi2_pvalue(counts, marginal) > 1e-3
    # the same test rejects a sampler that ignores the residual (samples x1 from the drafter-free p0)
    assert _chi2_pvalue(counts, p0) < 1e-6


def test_per_prompt_records_pool_back_to_the_logged_metrics():
    """The per_prompt/{suite}.json and per_prompt/rollout.json documents: the report's pooling of their
    counts (lab/report/paired.py) gives back every logged AL, norm growth and rollout accuracy. A random
    4-layer Llama and a random drafter, sampled at temperature 1 (near-uniform: many drafts accepted)."""
    from types import SimpleNamespace

    import numpy as np
    from helpers import small_drafter, small_target

    from lab.data.code_data import Sequences
    from lab.data.suites import Suite
    from lab.eval.evaluate import EvalOptions, evaluate_suite_prompts, heldout_evaluation
    from lab.report import paired

    model = small_target(0)
    drafter = small_drafter(0)
    prompts = [torch.randint(0, 100, (n,)).tolist() for n in (9, 12, 7, 10)]
    suite = Suite("mix", prompts, ["a", "b", "a", "b"], max_new_tokens=12)
    ks = [2, 3]
    options = EvalOptions(ks, probes=True, temperature=1.0, seed=3)
    result = evaluate_suite_prompts(model, drafter, suite, options, progress=False)
    doc = result.per_prompt
    assert [(p["index"], p["variant"]) for p in doc["prompts"]] == [(0, "a"), (1, "b"), (2, "a"), (3, "b")]
    assert len({p["id"] for p in doc["prompts"]}) == 4 and doc["ks"] == ks and doc["seed"] == 3
    m = result.metrics
    for k in ks:
        counts = paired.al_counts(doc, k)
        assert paired.pooled(counts, paired.acceptance_length) == m[f"eval/mix/ref/k{k}/al"]
        assert sum(c[0] for c in counts.values()) > 0  # something was accepted: the check is not 1 == 1
        growth = paired.pooled(paired.norm_growth_counts(doc, k, k), paired.norm_growth)
        assert growth == pytest.approx(m[f"drift/mix/k{k}/norm_growth"][k - 1], rel=1e-12)
        rates = np.sum([p["k"][str(k)]["accepted_at"] for p in doc["prompts"]], axis=0)
        rounds = sum(p["k"][str(k)]["rounds"] for p in doc["prompts"])
        assert (rates / rounds).tolist() == pytest.approx(m[f"eval/mix/ref/k{k}/accept_rate"], rel=1e-12)
    # the same metrics as evaluate_suite's, but for the timings
    again = evaluate_suite(model, drafter, suite, ks, progress=False, probes=True, temperature=1.0, seed=3)
    timed = ("tokens_per_s", "speedup", "draft_cost_ratio", "chain_limit", "verify_cost_ratio", "verify_limit")
    assert {k: v for k, v in again.items() if not k.endswith(timed)} == {
        k: v for k, v in m.items() if not k.endswith(timed)
    }

    ids = torch.randint(0, 100, (5, 24))
    mask = (torch.rand(5, 24) > 0.3).long()
    target = SimpleNamespace(model=model, lm_head_weight=model.get_output_embeddings().weight)
    held = heldout_evaluation(target, drafter, Sequences(ids, mask), depth=6, seed=3)
    rollout = held.per_prompt
    assert rollout["metric"] == "eval/in_dist/rollout/acc" and len(rollout["sequences"]) == 5
    accs = held.metrics["eval/in_dist/rollout/acc"]
    assert [paired.pooled(paired.rollout_counts(rollout, d), paired.share) for d in range(1, 7)] == pytest.approx(
        accs, rel=1e-6
    )
    assert accs == heldout_metrics_of(target, drafter, Sequences(ids, mask))


def heldout_metrics_of(target, drafter, heldout) -> list[float]:
    """The rollout accuracy as `rollout_accuracy` computes it over the whole batch."""
    from helpers import rollout_accuracy

    from lab.target import capture, target_logits

    cap = capture(target.model, heldout.input_ids, drafter.spec.aux_layer_ids)
    top = target_logits(cap.final, target.lm_head_weight).argmax(-1)
    return rollout_accuracy(drafter, heldout.input_ids, cap.aux, top, 6, heldout.loss_mask)


@pytest.fixture
def traced_static_steps(monkeypatch):
    """The static cache's step traced whole by dynamo on the CPU (`fullgraph`, as on CUDA), counting its graphs."""
    import weakref

    from lab.target import static_sequence

    graphs = traced_steps(monkeypatch)
    monkeypatch.setattr(static_sequence, "_STEPPERS", weakref.WeakKeyDictionary())
    monkeypatch.setattr(static_sequence, "_COMPILED", {})
    return graphs


@pytest.mark.parametrize("drafter_fixture", ["trained_eagle3", "trained_eagle31"])
def test_the_static_cache_decodes_the_dynamic_caches_tokens_and_rounds(
    micro_target, prompts, drafter_fixture, request, traced_static_steps
):
    """`kv_cache=static` (lab/target/static_sequence.py; float32 on the CPU) decodes what the dynamic cache does:
    the baseline and every k give the same tokens, rounds and accepted drafts per position, with and without a stop
    token, from one shared prefill as the evaluation runs them. Its forward traces whole, once for the plain width
    and once for every k + 1 and every cache length (a long prompt's bucket compiles nothing), and another model
    of the same shape (the next run's target) reuses it."""
    drafter, _ = request.getfixturevalue(drafter_fixture)
    model, layers = micro_target.model, drafter.spec.aux_layer_ids
    ks = [1, 2, 3, 4, 6, 8]
    accepted = 0
    for prompt in [*prompts, prompts[0] * 12]:  # the last one: a cache of 512 positions
        reference = target_decode(model, prompt, 24, kv_cache="dynamic")[0]
        stops = [(), (reference[10],)]
        for stop_ids in stops:
            pre = {
                cache: prefill(model, prompt, layers, cache, room=24 + max(ks) + 1) for cache in ("dynamic", "static")
            }
            plain = {c: target_decode(model, prompt, 24, prefilled=pre[c], stop_ids=stop_ids)[0] for c in pre}
            assert plain["static"] == plain["dynamic"]
            for k in ks:
                out = {
                    c: speculative_decode(model, drafter, prompt, 24, k, prefilled=pre[c], stop_ids=stop_ids)
                    for c in pre
                }
                (dyn, dyn_stats), (sta, sta_stats) = out["dynamic"], out["static"]
                assert sta == dyn == plain["dynamic"]
                assert (sta_stats.rounds, sta_stats.accepted_at) == (dyn_stats.rounds, dyn_stats.accepted_at)
                accepted += dyn_stats.accepted
    assert accepted > 0  # rounds were rejected and accepted: the position moved back and on
    assert len(traced_static_steps) == 2
    want = target_decode(model, prompts[0], 24, kv_cache="dynamic")[0]
    assert speculative_decode(copy.deepcopy(model), drafter, prompts[0], 24, 3, kv_cache="static")[0] == want
    assert len(traced_static_steps) == 2


def test_a_static_prefill_taken_by_another_prompt_fills_its_cache_again(
    micro_target, trained_eagle3, prompts, traced_static_steps
):
    """A bucket holds one prompt: a static prefill whose cache another prompt's prefill took since, or that lacks
    the room a decoding needs, runs the prompt's forward again and decodes what it would have."""
    (drafter, _), model = trained_eagle3, micro_target.model
    layers = drafter.spec.aux_layer_ids
    first, second = prompts[0], prompts[1]
    want = speculative_decode(model, drafter, first, 24, 3, kv_cache="dynamic")[0]
    pre = prefill(model, first, layers, "static", room=40)
    prefill(model, second, layers, "static", room=40)  # the same bucket, another prompt
    assert speculative_decode(model, drafter, first, 24, 3, prefilled=pre)[0] == want
    long = (first * 8)[:250]
    short = prefill(model, long, layers, "static", room=0)  # a bucket of 256 positions: no room for 24 more
    assert short.static.bucket.length == 256
    long_want = speculative_decode(model, drafter, long, 24, 3, kv_cache="dynamic")[0]
    assert speculative_decode(model, drafter, long, 24, 3, prefilled=short)[0] == long_want
    assert short.static.bucket.length == 512


def test_sampled_decoding_over_the_static_cache(micro_cfg, micro_target, prompts):
    """At temperature > 0 the static cache draws what the dynamic one draws from the same seeded generator."""
    drafter = init_drafter(micro_target, micro_cfg.drafter, aux_layers(micro_cfg), seed=3).eval()
    model = micro_target.model
    for cache in ("dynamic", "static"):
        gen = torch.Generator().manual_seed(5)
        plain = target_decode(model, prompts[0], 16, 0.9, gen, kv_cache=cache)[0]
        tokens, stats = speculative_decode(
            model, drafter, prompts[0], 16, 3, temperature=0.9, generator=gen, kv_cache=cache
        )
        if cache == "dynamic":
            want = (plain, tokens, stats.rounds, stats.accepted_at)
    assert (plain, tokens, stats.rounds, stats.accepted_at) == want
