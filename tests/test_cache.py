"""The hidden-state cache: computed once, verified by content hash, reused without a target forward."""

from __future__ import annotations

import json

import torch

from lab.config import aux_layers
from lab.data.cache import MANIFEST, build_or_load


def _count_forwards(model):
    calls = []
    handle = model.model.register_forward_hook(lambda *a: calls.append(1))
    return calls, handle


def test_second_run_does_no_target_forward(micro_cfg, micro_target, micro_sequences, tmp_path):
    seqs = micro_sequences[0][:40]
    layers = aux_layers(micro_cfg)
    calls, handle = _count_forwards(micro_target.model)
    try:
        first = build_or_load(micro_target, seqs, micro_cfg.data, layers, tmp_path, batch_size=16, progress=False)
        assert not first.stats["hit"] and len(calls) == 3  # 40 sequences in batches of 16
        calls.clear()
        second = build_or_load(micro_target, seqs, micro_cfg.data, layers, tmp_path, progress=False)
        assert second.stats["hit"] and second.stats["target_forward_tokens"] == 0
        assert calls == []  # no target forward at all
    finally:
        handle.remove()
    assert torch.equal(first.aux, second.aux) and torch.equal(first.final, second.final)
    h = micro_target.hidden_size
    assert first.aux.shape == (40, seqs.input_ids.shape[1], len(layers) * h) and first.final.shape == (
        40,
        seqs.input_ids.shape[1],
        h,
    )


def test_corrupted_shard_is_detected_and_rebuilt(micro_cfg, micro_target, micro_sequences, tmp_path):
    seqs = micro_sequences[0][:8]
    layers = aux_layers(micro_cfg)
    first = build_or_load(micro_target, seqs, micro_cfg.data, layers, tmp_path, progress=False)
    shard = first.path / json.loads((first.path / MANIFEST).read_text())["shards"][0]["file"]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])  # truncated
    again = build_or_load(micro_target, seqs, micro_cfg.data, layers, tmp_path, progress=False)
    assert not again.stats["hit"]  # rebuilt, not silently used
    assert torch.equal(again.aux, first.aux)


def test_key_depends_on_aux_layers(micro_cfg, micro_target, micro_sequences, tmp_path):
    seqs = micro_sequences[0][:4]
    a = build_or_load(micro_target, seqs, micro_cfg.data, [1, 2, 3], tmp_path, progress=False)
    b = build_or_load(micro_target, seqs, micro_cfg.data, [0, 2, 3], tmp_path, progress=False)
    assert a.path != b.path and not b.stats["hit"]
