"""The reference speculative decoder is lossless, and a trained drafter is accepted more often."""

from __future__ import annotations

import itertools

import pytest
import torch

from lab.config import aux_layers
from lab.data.suites import build_suite
from lab.drafter import init_drafter
from lab.eval.reference import DecodeStats, speculative_decode, target_decode
from lab.eval.run import evaluate_suite

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
