"""The micro target builds fast and is cached; capture follows vLLM's layer-id convention."""

from __future__ import annotations

import torch

from lab.target import capture, corpus, load


def test_corpus_selection_is_recorded_and_split():
    files = corpus.select(200_000)
    assert sum(f.size for f in files) >= 200_000
    assert any(f.heldout for f in files) and any(not f.heldout for f in files)
    # a second walk (past the process cache) selects the same files
    assert corpus.manifest_hash(files) == corpus.manifest_hash(corpus.select.__wrapped__(200_000))


def test_corpus_walk_skips_tests_vendored_trees_and_huge_files(tmp_path):
    files = {
        "a.py": "x = 1\n",
        "pkg/b.py": "y = 2\n",
        "pkg/tests.py": "z = 3\n",  # a module named like a skipped folder is still library code
        "pkg/test/c.py": "t = 1\n",
        "site-packages/d.py": "v = 1\n",
        "pkg/__pycache__/e.py": "c = 1\n",
        "huge.py": "#" * (corpus._MAX_FILE_BYTES + 1),
        "empty.py": "\n",
        "notes.txt": "not python\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    chosen = corpus.select(10**9, tmp_path)
    assert sorted(f.relpath for f in chosen) == ["a.py", "pkg/b.py", "pkg/tests.py"]


def test_micro_target_builds_and_is_reused(micro_cfg, micro_target, monkeypatch):
    from lab.target import build

    info = micro_target.info
    assert info["val_loss"] < 6.0  # well below log(512)=6.24: it learned something
    assert (micro_target.path / "tokenizer.json").is_file()
    # a second load finds the cached build: training it again would fail here
    monkeypatch.setattr(build, "train_tokenizer", lambda *a, **k: (_ for _ in ()).throw(AssertionError("rebuilt")))
    again = load(micro_cfg, progress=False)
    assert again.fingerprint == micro_target.fingerprint
    assert again.info["seconds"] == info["seconds"]  # same build, not a new one


def test_aux_id_i_is_the_residual_stream_after_i_layers(micro_target):
    model = micro_target.model
    ids = torch.randint(0, micro_target.vocab_size, (2, 12))
    seen = {}
    hooks = [
        layer.register_forward_hook(
            lambda m, a, out, i=i: seen.__setitem__(i + 1, out[0] if isinstance(out, tuple) else out)
        )
        for i, layer in enumerate(model.model.layers)
    ]
    try:
        cap = capture(model, ids, [0, 1, 2, 3])
    finally:
        for h in hooks:
            h.remove()
    h = micro_target.hidden_size
    torch.testing.assert_close(cap.aux[..., :h], model.model.embed_tokens(ids))
    for slot, layer_id in enumerate([1, 2, 3]):
        torch.testing.assert_close(cap.aux[..., (slot + 1) * h : (slot + 2) * h], seen[layer_id])
    # final is post-norm: the target's own logits come from it
    logits = model(input_ids=ids).logits
    torch.testing.assert_close(cap.final @ micro_target.lm_head_weight.T, logits, atol=1e-4, rtol=1e-4)


def test_any_local_hf_directory_loads_as_target(micro_overrides, micro_target):
    from lab.config.composition import compose

    cfg = compose([*micro_overrides, "target=hf", f"target.path={micro_target.path}"])
    target = load(cfg, progress=False)
    assert target.fingerprint.startswith("hf-") and target.num_layers == micro_target.num_layers
    ids = torch.randint(0, target.vocab_size, (1, 8))
    torch.testing.assert_close(capture(target.model, ids, [1, 2]).aux, capture(micro_target.model, ids, [1, 2]).aux)


def test_directory_without_config_json_is_refused(tmp_path):
    import pytest

    from lab.config import ConfigError
    from lab.config.composition import compose

    with pytest.raises(ConfigError, match=r"^target\.path: .*no config\.json"):
        compose(["target=hf", f"target.path={tmp_path}"])
