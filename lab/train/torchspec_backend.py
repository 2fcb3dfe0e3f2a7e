"""The TorchSpec training backend (`train.backend=torchspec`): TorchSpec's own drafter and TTT loss,
driven by our loop, data and logging.

TorchSpec (torchspec-project/TorchSpec; EAGLE 3.1 in its PR #97) is not on PyPI. Its model code runs on
CPU; only its training entry needs CUDA, Ray and Mooncake, and that entry is not used here.

The TorchSpec module (`LlamaForCausalLMEagle3`, or `Eagle3DeepseekV2ForCausalLM` for drafter.attention=mla;
one `midlayer`) is built from the same draft config JSON that `lab export` writes, and its parameters ARE
the workbench drafter's (shared tensors, not copies): the optimizer, resume states, the exported
checkpoint and the reference evaluator all see the weights TorchSpec trains, and nothing is converted back.
Per batch, `Eagle3Model.forward` unrolls the TTT steps (its attention cache, its feedback with `norm_output`,
its compiled forward-KL loss against the target's lm_head applied to the cached final states, as in
TorchSpec's `Eagle3Trainer._forward`); the step losses are weighted `step_weight**i` like TorchSpec's
`ploss_weights`.

Conventions bridged here: TorchSpec's batch shifts `input_ids` and the target states one position
left (position t carries x_{t+1} and the final state of t+1) but not `loss_mask`, whose entry t+i then
gates step i at position t; our `loss_mask[j]` marks x_j as a token to learn, and step i at t predicts
x_{t+i+2}, so TorchSpec receives our mask shifted two positions left. With a draft vocabulary smaller
than the target's, TorchSpec's `acc_i` counts only positions whose target argmax is in the draft
vocabulary (ours counts the others as misses); the losses agree.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from lab.drafter import Eagle3Drafter
from lab.drafter.formats import native_config
from lab.train.step import StepStats


def provenance() -> dict[str, str]:
    """Which TorchSpec trained the run (MLflow tags): its version and, for a checkout, its commit."""
    import torchspec

    try:
        version = importlib.metadata.version("torchspec")
    except importlib.metadata.PackageNotFoundError:  # a checkout on sys.path, not installed
        version = "unknown"
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(torchspec.__file__).parent
    ).stdout.strip()
    return {"torchspec_version": version, "torchspec_commit": commit or "unknown"}


def _internal_name(ours: str) -> str:
    return "midlayer." + ours[len("layers.0.") :] if ours.startswith("layers.0.") else ours


def build_model(drafter: Eagle3Drafter, attention_backend: str = "sdpa") -> nn.Module:
    """TorchSpec's drafter for `drafter`, sharing its parameters: `LlamaForCausalLMEagle3`, or with MLA
    attention `Eagle3DeepseekV2ForCausalLM` (its DeepSeek names are ours: q_a_proj, kv_a_proj_with_mqa, ...).
    Config validation has refused the drafters TorchSpec cannot build (more than one layer, concat or LayerNorm
    fc norms), preflight an MLA drafter where the installed TorchSpec has none."""
    from torchspec import AutoDraftModelConfig, AutoEagle3DraftModel

    config = {k: v for k, v in native_config(drafter.spec).items() if k != "lab"}
    model = AutoEagle3DraftModel.from_config(
        AutoDraftModelConfig.from_dict(config), attention_backend=attention_backend
    )
    model.to(drafter.embed_tokens.weight.device)  # its own buffers (d2t, t2d, rotary) beside the shared weights
    ours = dict(drafter.named_parameters())
    theirs = dict(model.named_parameters())
    expected = {_internal_name(name) for name in ours}
    if set(theirs) != expected:
        raise RuntimeError(
            f"TorchSpec's drafter has parameters {sorted(set(theirs) ^ expected)} that the workbench's does not "
            "match (a TorchSpec version with another layout?)"
        )
    for name, param in ours.items():
        path, _, leaf = _internal_name(name).rpartition(".")
        owner = model.get_submodule(path)
        if getattr(owner, leaf).shape != param.shape:
            raise RuntimeError(f"TorchSpec's {_internal_name(name)} has shape {tuple(getattr(owner, leaf).shape)}")
        setattr(owner, leaf, param)  # the same Parameter object: one set of weights, two modules
    if hasattr(drafter, "d2t"):
        model.d2t.copy_(drafter.d2t)
        model.t2d.zero_()
        model.t2d[drafter.draft_token_ids()] = True
    if getattr(model, "norm_output", None) is not drafter.spec.norm_output:
        # a TorchSpec before EAGLE 3.1 would silently ignore the key and train an EAGLE-3 feedback
        raise RuntimeError("the installed TorchSpec predates EAGLE 3.1 (no norm_output); install a newer one")
    return model


class TorchSpecTTT:
    """TorchSpec's `Eagle3Model` over a TorchSpec drafter; `loss(...)` has `lab.train.loss.ttt_loss`'s
    signature and meaning (up to the acc_i note in the module docstring)."""

    def __init__(self, draft_model: nn.Module, length: int, attention_backend: str = "sdpa"):
        from torchspec import Eagle3Model

        self.draft_model = draft_model
        # activation checkpointing trades compute for memory: off, as our native loop has none
        self.model = Eagle3Model(
            draft_model, length=length, attention_backend=attention_backend, gradient_checkpointing=False
        )

    @classmethod
    def for_drafter(cls, drafter: Eagle3Drafter, length: int, attention_backend: str = "sdpa") -> TorchSpecTTT:
        """Over TorchSpec's drafter sharing `drafter`'s parameters (`build_model`)."""
        return cls(build_model(drafter, attention_backend), length, attention_backend)

    def forward(
        self,
        input_ids: torch.Tensor,
        aux: torch.Tensor,
        final: torch.Tensor,
        lm_head_weight: torch.Tensor,
        loss_mask: torch.Tensor | None = None,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """TorchSpec's per-step losses and accuracies for input_ids [B, T], aux [B, T, A*H], final [B, T, H]."""
        from torchspec.models.eagle3 import compute_lazy_target_padded, compute_target_p_padded
        from torchspec.utils.tensor import padding

        b, t = input_ids.shape
        device = input_ids.device
        predicts = torch.ones(b, t, device=device) if loss_mask is None else F.pad(loss_mask[:, 1:].float(), (0, 1))
        ts_mask = padding(predicts, left=False)  # TorchSpec gates step i at t with its mask[t + i]
        target_states = padding(final.float(), left=False)
        length = self.model.length
        if hasattr(self.draft_model, "t2d"):
            target = compute_target_p_padded(
                target_states, lm_head_weight.float(), self.draft_model.t2d, ts_mask, length
            )
        else:
            target = compute_lazy_target_padded(target_states, lm_head_weight.float(), length)
        plosses, _, accs, _, _ = self.model(
            input_ids=padding(input_ids, left=False),
            attention_mask=torch.ones(b, t, dtype=torch.long, device=device),
            target=target,
            loss_mask=ts_mask,
            hidden_states=aux.float(),
        )
        return plosses, accs

    def loss(
        self,
        input_ids: torch.Tensor,
        aux: torch.Tensor,
        final: torch.Tensor,
        lm_head_weight: torch.Tensor,
        length: int,
        step_weight: float,
        loss_mask: torch.Tensor | None = None,
    ) -> StepStats:
        if length != self.model.length:
            raise ValueError(
                f"train.ttt_length={length}, but TorchSpec's Eagle3Model was built for {self.model.length}"
            )
        plosses, accs = self.forward(input_ids, aux, final, lm_head_weight, loss_mask)
        loss = sum((step_weight**i) * p for i, p in enumerate(plosses))
        return StepStats(loss, [p.item() for p in plosses], [float(a) for a in accs])
