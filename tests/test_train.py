"""The TTT trainer learns, logs the design's metric keys, and is reproducible under a seed."""

from __future__ import annotations

import pytest
import torch

from lab.config import aux_layers
from lab.train.ttt import init_drafter, simulated_acc_len, train, ttt_loss


def test_simulated_acc_len():
    assert simulated_acc_len([0.5, 0.5, 1.0]) == pytest.approx(0.5 + 0.25 + 0.25)
    assert simulated_acc_len([1.0, 1.0]) == 2.0


def test_training_lowers_the_loss_and_logs_every_key(micro_cfg, micro_target, micro_hidden):
    logged: list[tuple[dict, int]] = []
    cfg = micro_cfg.train.copy()
    cfg.steps, cfg.log_every = 40, 10
    drafter = init_drafter(micro_target, micro_cfg.drafter, aux_layers(micro_cfg), seed=0)
    batch = slice(0, 16)
    args = (
        micro_hidden.input_ids[batch],
        micro_hidden.aux[batch],
        micro_hidden.final[batch],
        micro_target.lm_head_weight,
        cfg.ttt_length,
        cfg.step_weight,
    )
    with torch.no_grad():
        before = ttt_loss(drafter, *args)
    result = train(
        drafter,
        micro_hidden,
        micro_target.lm_head_weight,
        cfg,
        seed=0,
        log=lambda m, s: logged.append((m, s)),
        progress=False,
    )
    with torch.no_grad():
        after = ttt_loss(drafter, *args)
    assert after.loss < before.loss * 0.9
    assert [s for _, s in logged] == [10, 20, 30, 40]
    keys = set(logged[-1][0])
    L = cfg.ttt_length
    assert {"train/loss", "train/simulated_acc_len", "train/tokens_per_s"} <= keys
    assert {f"train/ploss_{i}" for i in range(L)} | {f"train/acc_{i}" for i in range(L)} <= keys
    assert result.tokens_per_s > 0
    assert not drafter.embed_tokens.weight.requires_grad
    torch.testing.assert_close(drafter.embed_tokens.weight, micro_target.embed_weight)  # frozen copy


def test_same_seed_same_drafter(micro_cfg, micro_target, micro_hidden):
    cfg = micro_cfg.train.copy()
    cfg.steps = 3
    weights = []
    for _ in range(2):
        d = init_drafter(micro_target, micro_cfg.drafter, aux_layers(micro_cfg), seed=7)
        train(d, micro_hidden, micro_target.lm_head_weight, cfg, seed=7, progress=False)
        weights.append(d.fc.weight.detach().clone())
    assert torch.equal(weights[0], weights[1])


def test_loss_mask_ignores_predictions_of_prompt_tokens(micro_cfg, micro_target, micro_hidden):
    drafter = init_drafter(micro_target, micro_cfg.drafter, aux_layers(micro_cfg), seed=0)
    b = slice(0, 8)
    ids, aux, final, mask = (
        micro_hidden.input_ids[b],
        micro_hidden.aux[b],
        micro_hidden.final[b].clone(),
        micro_hidden.loss_mask[b],
    )
    W = micro_target.lm_head_weight

    def loss(f):
        with torch.no_grad():
            return ttt_loss(drafter, ids, aux, f, W, 3, 0.8, mask).loss.item()

    base = loss(final)
    predicts_prompt = torch.nn.functional.pad(mask[:, 1:], (0, 1)) == 0  # final[j] predicts x_{j+1}
    noisy = final.clone()
    noisy[predicts_prompt] = torch.randn_like(noisy[predicts_prompt]) * 5
    assert loss(noisy) == pytest.approx(base, rel=1e-6)
    noisy = final.clone()
    noisy[~predicts_prompt] = torch.randn_like(noisy[~predicts_prompt]) * 5
    assert abs(loss(noisy) - base) > 1e-3
