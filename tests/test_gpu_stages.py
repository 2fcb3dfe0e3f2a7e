"""benchmarks/gpu_stages.py's training at a Llama-3.1-8B target's drafter shape, run at its proportions at a CPU's
size (`LLAMA31_8B_SMALL`): each variant side by side (the step as it ships, the step compiled, a larger batch) gives
its row of tokens/s and FLOPs by formula, on a stand-in target that holds only an embedding and an lm_head. The
card's figures come from the same code on a GPU (`benchmarks/gpu_stages.py --only training-8b`)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def _stages():
    spec = importlib.util.spec_from_file_location("gpu_stages", ROOT / "benchmarks" / "gpu_stages.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_8b_drafter_shape_trains_each_variant(monkeypatch):
    stages = _stages()
    compile_ = torch.compile
    # dynamo traces the step as on a GPU; its graphs then run eagerly (inductor's compile costs minutes on a CPU)
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, backend="eager", **kw))
    device = torch.device("cpu")
    target = stages.shaped_target(stages.LLAMA31_8B_SMALL, device, torch.float32)
    assert target.lm_head_weight.shape == (4096, 256) and target.model.config.num_key_value_heads == 8
    rows = stages.drafter_shape_training(
        target, stages.DRAFT_VOCAB_8B_SMALL, 32, [("eager", 2), ("compiled", 2), ("eager", 4)], device,
        torch.float32, steps=1,
    )  # fmt: skip
    assert [name.rsplit("(", 1)[1] for name, *_ in rows] == ["eager)", "compiled)", "eager)"]
    for name, _shape, tokens_per_s, note in rows:
        assert not note.startswith("failed"), (name, note)
        assert math.isfinite(tokens_per_s) and tokens_per_s > 0 and "TFLOP/s by formula" in note
    assert rows[2][1].startswith("4 x 32")
