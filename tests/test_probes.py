"""Drift probes: read-only, exact on a hand-built drafter, and they see the norm_output effect."""

from __future__ import annotations

import pytest
import torch
from helpers import rollout_accuracy, small_drafter

from lab.config.shape import aux_layers
from lab.data.suites import build_suite
from lab.drafter import Eagle3Drafter, init_drafter
from lab.eval.probes import (
    DriftProbes,
    chunked_argmax,
    fc_share,
    rollout_counts,
    shuffled_rollout_counts,
)
from lab.eval.reference import speculative_decode
from lab.target import capture


@pytest.fixture(scope="module")
def prompt(micro_cfg, micro_target):
    return build_suite("in_dist", micro_target.tokenizer, micro_cfg).prompts[0]


def test_probes_do_not_change_what_is_decoded(micro_target, trained_eagle3, prompt):
    drafter, _ = trained_eagle3
    plain, st1 = speculative_decode(micro_target.model, drafter, prompt, 30, 4)
    probed, st2 = speculative_decode(micro_target.model, drafter, prompt, 30, 4, probes=DriftProbes(4))
    assert plain == probed and st1.accepted_at == st2.accepted_at


def test_uniform_attention_gives_the_known_masses(micro_cfg, micro_target, prompt):
    """Zero q/k projections make every score equal: step j of the first round attends uniformly over
    the P context entries plus the j-1 entries drafted so far."""
    drafter = init_drafter(micro_target, micro_cfg.drafter, aux_layers(micro_cfg), seed=0)
    with torch.no_grad():
        for layer in drafter.layers:
            layer.self_attn.q_proj.weight.zero_()
            layer.self_attn.k_proj.weight.zero_()
    k, p = 5, len(prompt)
    probes = DriftProbes(k)
    speculative_decode(micro_target.model, drafter, prompt, 2, k, probes=probes)  # exactly one round
    curves = probes.curves()
    for j in range(1, k + 1):
        assert curves["sink_mass"][j - 1] == pytest.approx(1 / (p + j - 1), rel=1e-4)
        assert curves["self_mass"][j - 1] == pytest.approx((j - 1) / (p + j - 1), rel=1e-4)
    assert curves["norm_growth"][0] == 1.0


def _growing(norm_output: bool) -> Eagle3Drafter:
    """A drafter whose MLP adds a large multiple of its input: the raw residual stream grows."""
    d = small_drafter(intermediate_size=64, norm_output=norm_output)
    with torch.no_grad():
        mlp = d.layers[0].mlp
        mlp.gate_proj.weight.copy_(torch.eye(64) * 4)
        mlp.up_proj.weight.copy_(torch.eye(64))
        mlp.down_proj.weight.copy_(torch.eye(64))
        d.norm.weight.fill_(1.5)
    return d


@pytest.mark.parametrize("norm_output", [False, True])
def test_feedback_norm_growth_with_and_without_norm_output(norm_output):
    d = _growing(norm_output)
    t, k = 6, 5
    tokens, aux = torch.randint(0, 100, (1, t)), torch.randn(1, t, 192)
    from lab.drafter import KVCache

    cache = KVCache(1, record=True)
    probes = DriftProbes(k)
    with torch.no_grad():
        h = d(tokens, d.project(aux), torch.arange(t)[None], cache)[:, -1:]
        for j in range(k):
            fed = d.feedback(h)
            probes.record(j + 1, cache.last_probs, first_self_key=t, fed_back=fed)
            h = d(tokens[:, :1], fed, torch.tensor([[t + j]]), cache)
    fb = probes.curves()["feedback_norm"]
    if norm_output:
        assert max(fb) <= 1.5 + 1e-4  # bounded by the norm's scale
    else:
        assert probes.curves()["norm_growth"][-1] > 2.0  # the raw residual stream grows step by step


def test_fc_share_balances_layers_only_with_fc_norm():
    scales = torch.tensor([1.0] * 64 + [4.0] * 64 + [16.0] * 64)
    aux = torch.randn(2, 8, 192) * scales
    shares = {}
    for fc_norm in ("none", "per_layer"):
        shares[fc_norm] = fc_share(small_drafter(intermediate_size=64, fc_norm=fc_norm), aux)
    assert sum(shares["none"]) == pytest.approx(1.0) and shares["none"][2] > 0.7
    assert max(shares["per_layer"]) < 0.45 and min(shares["per_layer"]) > 0.22


def test_rollout_accuracy_beyond_training_depth(micro_cfg, micro_target, micro_sequences, trained_eagle3):
    drafter, _ = trained_eagle3
    heldout = micro_sequences[1][:8]
    cap = capture(micro_target.model, heldout.input_ids, aux_layers(micro_cfg))
    top = (cap.final @ micro_target.lm_head_weight.T).argmax(-1)
    depth = 2 * micro_cfg.train.ttt_length
    accs = rollout_accuracy(drafter, heldout.input_ids, cap.aux, top, depth, heldout.loss_mask)
    untrained = init_drafter(micro_target, micro_cfg.drafter, aux_layers(micro_cfg), seed=0)
    base = rollout_accuracy(untrained, heldout.input_ids, cap.aux, top, depth, heldout.loss_mask)
    assert len(accs) == depth and all(0.0 <= a <= 1.0 for a in accs)
    assert accs[0] > base[0] + 0.1


def test_shuffled_inputs_change_only_the_depths_that_read_them(
    micro_cfg, micro_target, micro_sequences, trained_eagle3
):
    """The dense unroll unshuffled counts what the rollout counts. Shuffling the fed-back state across positions
    leaves depth 1 (which reads none) as it is and changes the deeper depths; shuffling the target's features
    changes depth 1. The same seed, the same counts."""
    drafter, _ = trained_eagle3
    heldout = micro_sequences[1][:8]
    cap = capture(micro_target.model, heldout.input_ids, aux_layers(micro_cfg))
    top = (cap.final @ micro_target.lm_head_weight.T).argmax(-1)
    args = (drafter, heldout.input_ids, cap.aux, top, 2 * micro_cfg.train.ttt_length, heldout.loss_mask)
    hits, counted = rollout_counts(*args)
    dense_hits, dense_counted = shuffled_rollout_counts(*args, shuffled=None)
    assert torch.equal(dense_hits, hits) and torch.equal(dense_counted, counted)
    feedback, feedback_counted = shuffled_rollout_counts(*args, shuffled="feedback", seed=0)
    assert torch.equal(feedback_counted, counted)
    assert torch.equal(feedback[0], hits[0]) and not torch.equal(feedback[1:], hits[1:])
    assert torch.equal(shuffled_rollout_counts(*args, shuffled="feedback", seed=0)[0], feedback)
    features = shuffled_rollout_counts(*args, shuffled="features", seed=0)[0]
    assert features[0].sum() < hits[0].sum()
    with pytest.raises(ValueError, match="shuffled: unknown 'zeros'"):
        shuffled_rollout_counts(*args, shuffled="zeros")


def test_chunked_argmax_is_the_argmax_of_the_whole():
    """The rollout's argmax over the vocabulary, a chunk of rows at a time (chunks that do not divide the rows
    included), equals the argmax of the logits of all rows at once."""
    gen = torch.Generator().manual_seed(0)
    h, weight = torch.randn(3, 50, 16, generator=gen), torch.randn(97, 16, generator=gen)
    whole = (h @ weight.T).argmax(-1)
    for rows in (1, 7, 150, 1000):
        assert torch.equal(chunked_argmax(h, lambda x: x @ weight.T, rows=rows), whole), rows
    assert torch.equal(chunked_argmax(h[:, :13], lambda x: x @ weight.T, rows=8), whole[:, :13])  # a strided view
