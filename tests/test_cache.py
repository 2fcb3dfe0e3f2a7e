"""The hidden-state cache: computed once, verified by content hash, reused without a target forward; two
processes that need the same entry (or the same target) at once build it once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import logged
from safetensors.torch import load_file

from lab.config.shape import aux_layers
from lab.data.cache import MANIFEST, STORE_DTYPE, _verify, build_or_load, heldout_states
from lab.target.build import BUILD_INFO


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


def test_cache_holds_the_target_states_bit_for_bit(micro_cfg, micro_target, micro_sequences, tmp_path):
    """Capture keeps only the aux layers (forward pre-hooks, converted as they are copied out), yet stores
    the same bytes as taking every state with output_hidden_states=True, concatenating, then converting."""
    seqs = micro_sequences[0][:6]
    layers = [0, 3, 1]  # the embeddings, and the ids out of order: concatenated in the order given
    hidden = build_or_load(micro_target, seqs, micro_cfg.data, layers, tmp_path, batch_size=4, progress=False)
    aux, final = [], []
    with torch.no_grad():
        for batch in seqs.input_ids.split(4):  # the builder's batches: a GEMM's rounding may depend on them
            states = micro_target.model.base_model(input_ids=batch, use_cache=False, output_hidden_states=True)
            states = states.hidden_states
            aux.append(torch.cat([states[i] for i in layers], dim=-1).to(STORE_DTYPE))
            final.append(states[-1].to(STORE_DTYPE))
    assert hidden.aux.dtype == hidden.final.dtype == STORE_DTYPE
    assert torch.equal(hidden.aux.view(torch.int16), torch.cat(aux).view(torch.int16))
    assert torch.equal(hidden.final.view(torch.int16), torch.cat(final).view(torch.int16))


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


def test_code_sequences_are_chosen_once_and_a_damaged_file_is_chosen_again(
    micro_cfg, micro_target, micro_sequences, tmp_path, monkeypatch
):
    """data=code's sequences come from the cache on a second call; a file whose bytes changed (a flipped bit in a
    tensor, a cut) is not used: they are chosen again, the same."""
    import lab.data.cache as cache

    def both():
        return cache.code_sequences(micro_target, micro_cfg.data, tmp_path)

    def same(got):
        return all(
            torch.equal(a, b)
            for g, m in zip(got, micro_sequences, strict=True)
            for a, b in ((g.input_ids, m.input_ids), (g.loss_mask, m.loss_mask))
        )

    assert same(both())
    (path,) = (tmp_path / "sequences").glob("*/sequences.safetensors")
    chosen = []
    monkeypatch.setattr(cache, "training_sequences", lambda *a: chosen.append(1) or micro_sequences)
    assert same(both()) and not chosen  # read, not chosen again
    data = bytearray(path.read_bytes())
    for damaged in (data[:-1] + bytes([data[-1] ^ 1]), data[: len(data) // 2]):
        path.write_bytes(damaged)
        assert same(both())
    assert len(chosen) == 2 and path.read_bytes() == bytes(data)


def test_heldout_states_are_captured_once_and_give_the_rollout_of_a_fresh_capture(
    micro_cfg, micro_target, micro_sequences, trained_eagle31, tmp_path, capsys
):
    """The rollout reads the target's side from the cache exactly as from its own capture, and a second run
    does no target forward; a corrupted entry is captured again, other held-out ids get their own entry."""
    from lab.eval.evaluate import heldout_evaluation

    drafter = trained_eagle31[0]
    heldout = micro_sequences[1]
    layers = list(drafter.spec.aux_layer_ids)
    calls, handle = _count_forwards(micro_target.model)
    try:
        first = heldout_states(micro_target, heldout, layers, tmp_path, batch_size=4)
        assert not first.hit and len(calls) == -(-len(heldout.input_ids) // 4)
        calls.clear()
        second = heldout_states(micro_target, heldout, layers, tmp_path)
        assert second.hit and calls == []
    finally:
        handle.remove()
    assert second.aux.dtype == micro_target.lm_head_weight.dtype and second.top.shape == heldout.input_ids.shape
    fresh = heldout_evaluation(micro_target, drafter, heldout, depth=4)
    cached = heldout_evaluation(micro_target, drafter, heldout, depth=4, states=second)
    assert cached.metrics == fresh.metrics and cached.per_prompt == fresh.per_prompt

    aux, top = first.aux.clone(), first.top.clone()  # the loaded tensors map the file truncated below
    states = second.path / "states.safetensors"
    states.write_bytes(states.read_bytes()[:1000])
    again = heldout_states(micro_target, heldout, layers, tmp_path)
    assert not again.hit and torch.equal(again.aux, aux) and torch.equal(again.top, top)
    assert f"cache entry {states} is missing or does not match its manifest hash" in capsys.readouterr().err
    other = heldout_states(micro_target, type(heldout)(heldout.input_ids[:2], heldout.loss_mask[:2]), layers, tmp_path)
    assert other.path != again.path and torch.equal(other.top, top[:2])


def test_interrupted_build_resumes_from_its_finished_shards(
    micro_cfg, micro_target, micro_sequences, tmp_path, monkeypatch, capsys
):
    """Ctrl-C during the third of three shards: the rerun captures only that one, and the entry is the one an
    uninterrupted build makes, bit for bit."""
    from lab.data import cache

    seqs, layers = micro_sequences[0][:10], aux_layers(micro_cfg)
    monkeypatch.setattr(cache, "SHARD_SEQUENCES", 4)  # shards of 4, 4 and 2 sequences, one batch each
    straight = build_or_load(micro_target, seqs, micro_cfg.data, layers, tmp_path / "straight", 4, progress=False)
    real, calls = cache.capture_batch, []

    def interrupted(model, batch, layers):
        calls.append(len(batch))
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(model, batch, layers)

    monkeypatch.setattr(cache, "capture_batch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build_or_load(micro_target, seqs, micro_cfg.data, layers, tmp_path / "resumed", 4, progress=False)
    monkeypatch.setattr(cache, "capture_batch", lambda *a: (calls.append(len(a[1])), real(*a))[1])
    capsys.readouterr()
    resumed = build_or_load(micro_target, seqs, micro_cfg.data, layers, tmp_path / "resumed", 4, progress=False)
    assert calls == [4, 4, 2, 2]  # the rerun captured the last shard only
    assert logged(capsys.readouterr().err) == [f"hidden-state cache: {n} of 10 sequences" for n in (4, 8, 10)]
    assert not resumed.stats["hit"] and not list((tmp_path / "resumed" / "hidden").glob("*.partial"))
    assert torch.equal(resumed.aux, straight.aux) and torch.equal(resumed.final, straight.final)
    assert (
        json.loads((resumed.path / MANIFEST).read_text())["shards"]
        == json.loads((straight.path / MANIFEST).read_text())["shards"]
    )


def test_key_depends_on_aux_layers(micro_cfg, micro_target, micro_sequences, tmp_path):
    seqs = micro_sequences[0][:4]
    a = build_or_load(micro_target, seqs, micro_cfg.data, [1, 2, 3], tmp_path, progress=False)
    b = build_or_load(micro_target, seqs, micro_cfg.data, [0, 2, 3], tmp_path, progress=False)
    assert a.path != b.path and not b.stats["hit"]


# Run by each of two processes at once: set up, wait until both are ready, then build the same entry
# under `shared`, and report whether this process built it (and what it got).
_RACER = """
import json, sys, time
from pathlib import Path
from lab.config.composition import compose
from lab.config.shape import aux_layers

what, out, shared, overrides = sys.argv[1], Path(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
cfg = compose(overrides)
if what == "hidden":
    from safetensors.torch import save_file
    from lab.data.cache import build_or_load
    from lab.data.code_data import training_sequences
    from lab.target import load

    target = load(cfg, progress=False)
    seqs = training_sequences(target.tokenizer, cfg.data)[0]
    build = lambda: build_or_load(target, seqs, cfg.data, aux_layers(cfg), shared, progress=False)
else:
    import lab.target.build as tb

    built = []
    train_tokenizer = tb.train_tokenizer
    tb.train_tokenizer = lambda *a: built.append(1) or train_tokenizer(*a)  # only a builder trains one
    build = lambda: tb.build(cfg.target, shared, progress=False)
(out / "ready").touch()
while len(list(out.parent.glob("*/ready"))) < 2:
    time.sleep(0.01)
started = time.time()
result = build()
report = {"started": started, "ended": time.time()}
if what == "hidden":
    report.update(built=not result.stats["hit"], path=str(result.path))
    save_file({"input_ids": result.input_ids, "aux": result.aux, "final": result.final}, str(out / "got.safetensors"))
else:
    report.update(built=bool(built), path=str(result))
(out / "report.json").write_text(json.dumps(report))
"""


def _race(what: str, overrides: list[str], shared: Path, tmp_path: Path) -> list[dict]:
    """Two processes build the same entry under `shared` at once; their reports, with `out` added."""
    outs = [tmp_path / f"racer{i}" for i in range(2)]
    procs = []
    for out in outs:
        out.mkdir()
        cmd = [sys.executable, "-c", _RACER, what, str(out), str(shared), json.dumps(overrides)]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err.decode()[-3000:]
    reports = [{**json.loads((out / "report.json").read_text()), "out": out} for out in outs]
    assert sorted(r["built"] for r in reports) == [False, True]  # one built, the other did not
    builder, waiter = sorted(reports, key=lambda r: not r["built"])
    assert waiter["started"] < builder["ended"]  # it came while the entry was being built: it waited
    assert reports[0]["path"] == reports[1]["path"]
    return reports


@pytest.mark.slow
def test_two_processes_build_one_hidden_state_entry(micro_overrides, micro_target, tmp_path):
    """Two `lab run`s needing the same cache entry at once: one builds it, the other waits and hits."""
    shared = tmp_path / "shared"
    reports = _race("hidden", micro_overrides, shared, tmp_path)
    got = [load_file(str(r["out"] / "got.safetensors")) for r in reports]
    assert all(torch.equal(got[0][k], got[1][k]) for k in got[0])
    entry = Path(reports[0]["path"])
    assert _verify(entry) is not None  # every shard matches its manifest hash
    left = sorted(p.name for p in (shared / "hidden").iterdir())
    assert left == [f".{entry.name}.publish.lock", entry.name, f"{entry.name}.lock"]  # no temp (the locks stay)


@pytest.mark.slow
def test_two_processes_build_one_target(micro_overrides, tmp_path):
    """The same for the target build: one trains it, the other waits and loads it."""
    shared = tmp_path / "shared"
    reports = _race("target", [*micro_overrides, "target.steps=3"], shared, tmp_path)
    entry = Path(reports[0]["path"])
    assert (entry / BUILD_INFO).is_file() and (entry / "model" / "model.safetensors").is_file()
    left = sorted(p.name for p in (shared / "targets").iterdir())
    assert left == [f".{entry.name}.publish.lock", entry.name, f"{entry.name}.lock"]  # no temp (the locks stay)
