"""The TTT trainer learns, logs the design's metric keys, is reproducible under a seed, and resumes exactly."""

from __future__ import annotations

import json

import pytest
import torch

from lab.config import aux_layers
from lab.data.cache import HiddenStates
from lab.drafter import init_drafter
from lab.train import resume
from lab.train.resume import Checkpointing
from lab.train.ttt import simulated_acc_len, train, ttt_loss


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


def test_resumed_training_ends_bitwise_identical(micro_cfg, micro_target, micro_hidden, tmp_path):
    """Interrupted after step 8 (last checkpoint at step 6, mid log window), resumed: the same weights
    and the same logged metrics as an uninterrupted run, across an epoch's reshuffle (4 steps each)."""
    h = micro_hidden
    data = HiddenStates(h.input_ids[:64], h.loss_mask[:64], h.aux[:64], h.final[:64], h.path)
    cfg = micro_cfg.train.copy()
    cfg.steps, cfg.batch_size, cfg.log_every, cfg.warmup_steps = 10, 16, 4, 2
    layers = aux_layers(micro_cfg)

    def run(log, **kw):
        d = init_drafter(micro_target, micro_cfg.drafter, layers, seed=3)
        train(d, data, micro_target.lm_head_weight, cfg, seed=3, log=log, progress=False, **kw)
        return d

    def without_speed(logged):
        return [(s, {k: v for k, v in m.items() if k != "train/tokens_per_s"}) for m, s in logged]

    straight: list = []
    expected = run(lambda m, s: straight.append((m, s)))

    def interrupt_at_8(metrics, step):
        if step == 8:
            raise KeyboardInterrupt

    ckpt = Checkpointing(tmp_path / "ckpt", every=3, run_id="first")
    with pytest.raises(KeyboardInterrupt):
        run(interrupt_at_8, checkpoint=ckpt)
    state = resume.load(ckpt.path, cfg.steps)
    assert state is not None and state.step == 6 and state.run_id == "first" and len(state.window) == 2
    assert state.optimizer[0]["step"].item() == 6.0  # AdamW's step count, a tensor

    resumed: list = []
    got = run(lambda m, s: resumed.append((m, s)), checkpoint=Checkpointing(ckpt.path, 3, "second"), resume=state)
    for k, v in expected.state_dict().items():
        assert torch.equal(v, got.state_dict()[k]), k
    assert without_speed(resumed) == without_speed(straight)  # history replayed, then the same window
    final = json.loads((ckpt.path / resume.MANIFEST).read_text())
    assert (final["step"], final["steps"], final["run_id"]) == (10, 10, "second")
