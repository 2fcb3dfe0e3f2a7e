"""What one TTT training step computes, shared by the trainer (`ttt.py`) and the TorchSpec backend
(`torchspec_backend.py`) so that neither imports the other: the caller picks the backend's loss and passes it to
`lab.train.ttt.train`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class StepStats:
    loss: torch.Tensor  # weighted sum over steps (differentiable)
    plosses: list[float]
    accs: list[float]


# A batch's TTT loss, bound to the drafter being trained:
#   loss(input_ids [B, T], aux [B, T, A*H], final [B, T, H], lm_head_weight, length, step_weight, loss_mask)
# (`lab.train.loss.ttt_loss` without its drafter argument; `TorchSpecTTT.loss`).
LossFn = Callable[..., StepStats]
