"""The reference speculative decoder is lossless, and a trained drafter is accepted more often."""

from __future__ import annotations

import itertools

import pytest

from lab.config import aux_layers
from lab.data.suites import load_suite
from lab.eval.reference import DecodeStats, greedy_decode, speculative_decode
from lab.eval.run import evaluate_suite
from lab.train.ttt import init_drafter

TOGGLES = list(itertools.product(["none", "per_layer", "concat"], [False, True], ["rmsnorm", "layernorm"]))


@pytest.fixture(scope="module")
def prompts(micro_cfg, micro_target):
    return load_suite("in_dist", micro_target.tokenizer, micro_cfg).prompts[:3]


@pytest.mark.parametrize(("fc_norm", "norm_output", "norm_type"), TOGGLES)
def test_output_equals_target_greedy_for_every_toggle(
    micro_cfg, micro_target, prompts, fc_norm, norm_output, norm_type
):
    dcfg = micro_cfg.drafter.copy()
    dcfg.fc_norm, dcfg.norm_output, dcfg.norm_type = fc_norm, norm_output, norm_type
    drafter = init_drafter(micro_target, dcfg, aux_layers(micro_cfg), seed=1).eval()
    for prompt, k in zip(prompts, [1, 3, 6], strict=True):
        reference, _ = greedy_decode(micro_target.model, prompt, 24)
        tokens, stats = speculative_decode(micro_target.model, drafter, prompt, 24, k)
        assert tokens == reference
        assert stats.rounds > 0 and 1.0 <= stats.acceptance_length <= k + 1


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
    suite = load_suite("in_dist", micro_target.tokenizer, micro_cfg)
    good = evaluate_suite(micro_target.model, trained, suite, [3], progress=False)
    bad = evaluate_suite(micro_target.model, untrained, suite, [3], progress=False)
    assert good["eval/in_dist/ref/k3/al"] > bad["eval/in_dist/ref/k3/al"] + 0.2, (good, bad)
    assert good["eval/in_dist/ref/k3/exact_match"] == 1.0
    assert len(good["eval/in_dist/ref/k3/accept_rate"]) == 3
