"""The FLOPs of one training step, by formula: what MFU divides by where torch's FLOP counter cannot count
(its `FlopCounterMode` refuses grouped-query SDPA on CUDA in torch 2.11).

The formula counts every matrix product of `lab.train.loss.ttt_loss` and its backward, on a batch without a
loss mask, as the code computes them:
- a linear layer: 6 FLOPs per weight per row where its input needs a gradient (forward, dX, dW), 4 where it
  does not (`fc` over the captured states; the embedding half of layer 0's q/k/v, once for every step);
- the drafter's rows per step: step 0 everywhere (its keys are every later step's context), a later step where
  it or a later step learns, its attention over those rows padded per sequence;
- `lm_head` with its cross-entropy (forward and both gradients) over the rows that learn, and the target's
  `lm_head` for the soft labels (forward only);
- the attention's score and value products over the query heads, dense over the t keys as the kernels compute
  them: 2 forward and 5 backward (the scores recomputed, as torch's counter counts SDPA's backward).
Norms, rotary, softmax and the diagonal's elementwise products are left out, as the counter leaves them.
tests/test_train.py holds it to the counter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lab.drafter import DrafterSpec


def ttt_step_flops(spec: DrafterSpec, learnable: torch.Tensor, ttt_length: int) -> int:
    """FLOPs of one TTT step (loss and backward) of a GQA drafter over a batch without a loss mask; `learnable`
    [B, T] (bool) marks the target positions a step may learn from: all of them with the full vocabulary, those
    whose target argmax the draft vocabulary holds with a pruned one (EAGLE-3's d2t)."""
    if spec.attention != "gqa":
        raise ValueError(f"ttt_step_flops counts a GQA drafter's step, not drafter.attention={spec.attention}")
    h, d = spec.hidden_size, spec.head_dim
    q, kv = spec.num_heads * d, spec.num_kv_heads * d
    batch, seq_len = learnable.shape
    positions = batch * seq_len
    # step i at position t learns from target position t + i + 1; it runs where it or a later step learns
    learns = [F.pad(learnable[:, i + 1 :], (0, i + 1)) for i in range(ttt_length)]
    runs = list(learns)
    for i in range(ttt_length - 2, -1, -1):
        runs[i] = runs[i] | runs[i + 1]
    learned = sum(int(x.sum()) for x in learns)
    needed = [int(x.sum()) for x in runs]
    # a later step's attention runs over its rows padded per sequence, to the longest sequence's count
    queries = [positions, *(batch * int(x.sum(-1).max()) for x in runs[1:])]
    # step 0 runs everywhere (its keys are every later step's context); its last layer's o_proj and MLP only
    # where a later step or its loss needs them
    rows = [positions, *needed[1:]]

    def linear(n: int, fan_in: int, fan_out: int, grad_in: bool = True) -> int:
        return (6 if grad_in else 4) * n * fan_in * fan_out

    flops = linear(positions, spec.num_aux * spec.target_hidden_size, h, grad_in=False)  # fc
    flops += linear(batch * (seq_len + ttt_length - 1), h, q + 2 * kv, grad_in=False)  # embedding half, once
    attention = 14 * spec.num_heads * d * seq_len  # per query row: 2 products forward, 5 backward
    for step, (n, padded) in enumerate(zip(rows, queries, strict=True)):
        for layer in range(spec.num_layers):
            out = needed[0] if step == 0 and layer == spec.num_layers - 1 else n
            flops += linear(n, h, q + 2 * kv) + padded * attention  # q/k/v (layer 0: of its hidden half)
            flops += (
                linear(out, q, h) + linear(out, h, 2 * spec.intermediate_size) + linear(out, spec.intermediate_size, h)
            )
    flops += linear(learned, h, spec.draft_vocab_size)  # lm_head and its cross-entropy
    flops += 2 * positions * h * spec.vocab_size  # the target's lm_head: the soft labels, no gradient
    return flops
