"""Small hand-built drafters and random targets for unit tests (nothing to build or download)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch

from lab.drafter import DrafterSpec, Eagle3Drafter


def small_drafter(seed: int = 0, **spec) -> Eagle3Drafter:
    """A 64-wide drafter over a 100-token vocabulary and three 64-wide captured layers."""
    torch.manual_seed(seed)
    base = dict(
        hidden_size=64,
        target_hidden_size=64,
        aux_layer_ids=[1, 2, 3],
        vocab_size=100,
        num_heads=2,
        head_dim=32,
        intermediate_size=96,
    )
    return Eagle3Drafter(DrafterSpec(**{**base, **spec})).eval()


@torch.no_grad()
def perturb(drafter: Eagle3Drafter, draft_vocab: int | None = None) -> Eagle3Drafter:
    """Norms away from 1 and weights away from their init (so that a missing or misplaced norm shows), and
    with `draft_vocab` a random pruned vocabulary; draws from torch's global generator."""
    for name, p in drafter.named_parameters():
        p.add_(torch.randn_like(p) * (0.3 if "norm" in name else 0.05))
    if draft_vocab:
        ids = torch.randperm(drafter.spec.vocab_size)[:draft_vocab].sort().values
        drafter.d2t.copy_(ids - torch.arange(draft_vocab))
    return drafter


def small_target(seed: int = 0):
    """A random 4-layer, 64-wide Llama over the same 100-token vocabulary (transformers' LlamaForCausalLM)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


HOLD_DIR = Path(__file__).resolve().parent / "hold"  # its sitecustomize.py holds training where a test says


def hold_training(env: dict[str, str], step: int, flag: Path) -> dict[str, str]:
    """`env` for a `lab` process (and the processes it starts) whose training stops after `step`, creates
    `flag` and waits for Ctrl-C (tests/hold/sitecustomize.py): the test interrupts it at a point it controls."""
    path = os.pathsep.join(p for p in (str(HOLD_DIR), env.get("PYTHONPATH", "")) if p)
    return {**env, "PYTHONPATH": path, "LAB_HOLD_AFTER_STEP": f"{step}:{flag}"}


def default_sigint() -> None:
    """Popen's preexec_fn for a child the test interrupts: Ctrl-C's default disposition, even where the suite
    itself runs with SIGINT ignored (a script's background job), which the child would otherwise inherit."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def evaluate_suite(target_model, drafter: Eagle3Drafter, suite, ks: list[int], **kwargs) -> dict:
    """A suite's evaluation metrics alone (`evaluate_suite_prompts(...).metrics`)."""
    from lab.eval.run import evaluate_suite_prompts

    return evaluate_suite_prompts(target_model, drafter, suite, ks, **kwargs).metrics


def rollout_accuracy(drafter: Eagle3Drafter, input_ids, aux, target_top, depth: int, loss_mask=None) -> list[float]:
    """Teacher-forced top-1 agreement per unrolled depth, pooled over the batch (as `heldout_evaluation` logs it)."""
    from lab.eval.probes import pooled_rollout_accuracy, rollout_counts

    return pooled_rollout_accuracy(*rollout_counts(drafter, input_ids, aux, target_top, depth, loss_mask))


def assert_decoding_equals_unroll(d: Eagle3Drafter, num_layers: int) -> None:
    """Drafting step by step with the KVCache sees exactly what training's TTT unroll sees (causal step 0,
    then each position's own earlier steps), at a few positions of one random sequence."""
    from lab.drafter import KVCache
    from lab.drafter.unroll import unroll

    t, length = 10, 3
    tokens = torch.randint(0, 100, (1, t))
    aux = torch.randn(1, t, 192) * 3
    with torch.no_grad():
        outs = unroll(d, tokens, aux, length)
        for pos in (0, 4, t - length):
            cache = KVCache(num_layers)
            ctx = d(tokens[:, : pos + 1], d.project(aux[:, : pos + 1]), torch.arange(pos + 1)[None], cache)
            torch.testing.assert_close(ctx[:, pos], outs[0][:, pos], atol=1e-5, rtol=1e-4)
            h = ctx[:, pos : pos + 1]
            for step in range(1, length):
                h = d(tokens[:, pos + step : pos + step + 1], d.feedback(h), torch.tensor([[pos + step]]), cache)
                torch.testing.assert_close(h[:, 0], outs[step][:, pos], atol=1e-5, rtol=1e-4)
