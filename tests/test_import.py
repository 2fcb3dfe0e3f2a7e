"""Drafters trained elsewhere: checkpoints in TorchSpec's `tools/convert_to_hf.py` layout and in speculators'
layout, written here from a drafter of ours (neither project is needed), load into the workbench and draft
exactly as the source drafter does; an unusable one is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import small_drafter
from safetensors.torch import load_file, save_file

from lab.drafter import (
    CheckpointError,
    DrafterSpec,
    Eagle3Drafter,
    KVCache,
    checkpoint_format,
    load_checkpoint,
    save_native,
    save_speculators,
)

# -- writers of the two foreign layouts (from what their sources write) ---------------------------------


def _layer_config(spec: DrafterSpec) -> dict:
    return {
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "num_hidden_layers": spec.num_layers,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "vocab_size": spec.vocab_size,
        "attention_bias": False,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def _bf16_state(drafter: Eagle3Drafter, embed: bool = True) -> dict[str, torch.Tensor]:
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in drafter.state_dict().items() if k != "d2t"}
    if not embed:
        del state["embed_tokens.weight"]
    return state


def _pruning(drafter: Eagle3Drafter) -> dict[str, torch.Tensor]:
    spec = drafter.spec
    if spec.draft_vocab_size == spec.vocab_size:
        return {}
    t2d = torch.zeros(spec.vocab_size, dtype=torch.bool)
    t2d[drafter.draft_token_ids()] = True
    return {"d2t": drafter.d2t.to(torch.int64).clone(), "t2d": t2d}


def write_torchspec(drafter: Eagle3Drafter, out: Path, aux_ids: bool = True) -> Path:
    """tools/convert_to_hf.py: the draft-model JSON as is (+ draft_vocab_size, _torchspec_version,
    torch_dtype) and the whole state dict in bf16 with `layers.0.*` names, `t2d` beside `d2t` when pruned."""
    spec = drafter.spec
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        **_layer_config(spec),
        "draft_vocab_size": spec.draft_vocab_size,
        "_torchspec_version": "0.3.0",
        "torch_dtype": "bfloat16",
    }
    if spec.fc_norm == "per_layer":
        config["fc_norm"] = True
    if spec.norm_output:
        config["norm_output"] = True
    if aux_ids:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(spec.aux_layer_ids)}
        config["target_hidden_size"] = spec.target_hidden_size
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    state = {**_bf16_state(drafter), **_pruning(drafter)}
    save_file(state, str(out / "model.safetensors"), metadata={"torchspec_version": "0.3.0"})
    return out


def write_speculators(drafter: Eagle3Drafter, out: Path, embed: bool = False) -> Path:
    """speculators' Eagle3 checkpoint: the layer config nested, d2t / t2d saved even for an unpruned
    vocabulary (d2t all zero), usually no embedding, the verifier's norm and head beside the drafter's."""
    spec = drafter.spec
    layer = {"architectures": ["LlamaForCausalLM"], **_layer_config(spec), "mlp_bias": False}
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.4.0",
        "transformer_layer_config": layer,
        "draft_vocab_size": spec.draft_vocab_size,
        "norm_before_residual": spec.norm_before_residual,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": list(spec.aux_layer_ids),
        "norm_before_fc": spec.fc_norm == "concat",
        "fc_norm": spec.fc_norm == "per_layer",
        "norm_output": spec.norm_output,
        "embed_requires_grad": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "verifier": {"name_or_path": "target", "architectures": ["LlamaForCausalLM"]},
        },
        "torch_dtype": "bfloat16",
    }
    state = _bf16_state(drafter, embed=embed)
    pruning = _pruning(drafter) or {
        "d2t": torch.zeros(spec.vocab_size, dtype=torch.int64),
        "t2d": torch.ones(spec.vocab_size, dtype=torch.bool),
    }
    state.update(pruning)
    state["verifier_norm.weight"] = torch.ones(spec.hidden_size, dtype=torch.bfloat16)
    state["verifier_lm_head.weight"] = torch.randn(spec.vocab_size, spec.hidden_size).to(torch.bfloat16)
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(state, str(out / "model.safetensors"))
    return out


# -- source drafters and what they draft -----------------------------------------------------------------


def source(seed: int = 0, draft_vocab: int | None = None, **spec) -> Eagle3Drafter:
    """A drafter of ours with non-trivial weights (norms far from 1), its floats rounded to bf16 so that a
    bf16 checkpoint of it holds exactly its weights: loaded back, it must draft bit for bit the same."""
    d = small_drafter(seed, draft_vocab_size=draft_vocab, **spec)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.4 * torch.randn_like(p))
            p.copy_(p.to(torch.bfloat16).float())
        if draft_vocab is not None:  # an arbitrary draft vocabulary, in target order
            ids = torch.randperm(d.spec.vocab_size, generator=torch.Generator().manual_seed(seed))[:draft_vocab]
            d.d2t.copy_(ids.sort().values - torch.arange(draft_vocab))
    return d


def drafting(d: Eagle3Drafter, steps: int = 4) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per drafting step after a 6-token context: the target-vocabulary distribution, the drafted target
    token and the hidden state fed back. Captured layers at very different scales, so that every norm counts."""
    g = torch.Generator().manual_seed(7)
    t, spec = 6, d.spec
    tokens = torch.randint(0, spec.vocab_size, (1, t), generator=g)
    scales = torch.tensor([1.0, 6.0, 25.0]).repeat_interleave(spec.target_hidden_size)
    aux = torch.randn(1, t, spec.num_aux * spec.target_hidden_size, generator=g) * scales
    cache = KVCache(spec.num_layers)
    out = []
    with torch.no_grad():
        h = d(tokens, d.project(aux), torch.arange(t)[None], cache)[:, -1:]
        for j in range(steps):
            probs = d.to_target_probs(d.logits(h).softmax(-1))
            token = probs.argmax(-1)
            out.append((probs, token, d.feedback(h)))
            h = d(token, d.feedback(h), torch.tensor([[t + j]]), cache)
    return out


def assert_drafts_alike(a: Eagle3Drafter, b: Eagle3Drafter) -> None:
    for (pa, ta, fa), (pb, tb, fb) in zip(drafting(a), drafting(b), strict=True):
        assert torch.equal(pa, pb) and torch.equal(ta, tb) and torch.equal(fa, fb)


TOGGLES = [("none", False), ("per_layer", False), ("none", True), ("per_layer", True)]


# -- TorchSpec -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("fc_norm", "norm_output"), TOGGLES)
@pytest.mark.parametrize("draft_vocab", [None, 40])
def test_torchspec_checkpoint_drafts_like_its_source(tmp_path, fc_norm, norm_output, draft_vocab):
    src = source(draft_vocab=draft_vocab, fc_norm=fc_norm, norm_output=norm_output)
    folder = write_torchspec(src, tmp_path / "ts")
    assert load_file(str(folder / "model.safetensors"))["fc.weight"].dtype == torch.bfloat16
    loaded = load_checkpoint(folder)
    assert checkpoint_format(folder) == "torchspec"
    assert loaded.spec.fc_norm == fc_norm and loaded.spec.norm_output == norm_output
    assert loaded.spec.draft_vocab_size == (draft_vocab or 100)
    assert loaded.fc.weight.dtype == torch.float32
    assert "t2d" not in loaded.state_dict()
    assert hasattr(loaded, "d2t") == (draft_vocab is not None)
    assert_drafts_alike(src, loaded)


def test_torchspec_checkpoint_without_aux_ids_takes_the_given_or_vllms_default(tmp_path):
    src = source(fc_norm="per_layer", norm_output=True, aux_layer_ids=[2, 4, 5])
    folder = write_torchspec(src, tmp_path / "ts", aux_ids=False)
    with pytest.raises(CheckpointError, match="eagle_aux_hidden_state_layer_ids"):
        load_checkpoint(folder)
    assert load_checkpoint(folder, target_num_layers=8).spec.aux_layer_ids == [2, 4, 5]  # vLLM's (2, L//2, L-3)
    assert load_checkpoint(folder, aux_layers=[1, 3, 6]).spec.aux_layer_ids == [1, 3, 6]
    assert_drafts_alike(src, load_checkpoint(folder, target_num_layers=8))


def test_plain_eagle_checkpoint_is_told_apart(tmp_path):
    src = source()
    folder = write_torchspec(src, tmp_path / "plain")
    config = json.loads((folder / "config.json").read_text())
    del config["_torchspec_version"]
    (folder / "config.json").write_text(json.dumps(config))
    state = load_file(str(folder / "model.safetensors"))
    save_file({k.replace("layers.0.", "midlayer."): v for k, v in state.items()}, str(folder / "model.safetensors"))
    assert checkpoint_format(folder) == "eagle"
    assert_drafts_alike(src, load_checkpoint(folder))
    assert checkpoint_format(save_native(src, tmp_path / "ours")) == "lab"


# -- speculators -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("norm_before_residual", [False, True])
@pytest.mark.parametrize(("fc_norm", "norm_output"), [("none", False), ("per_layer", True), ("concat", True)])
def test_speculators_checkpoint_drafts_like_its_source(tmp_path, norm_before_residual, fc_norm, norm_output):
    src = source(fc_norm=fc_norm, norm_output=norm_output, norm_before_residual=norm_before_residual)
    folder = write_speculators(src, tmp_path / "spec")
    keys = set(load_file(str(folder / "model.safetensors")))
    assert {"d2t", "t2d", "verifier_norm.weight", "verifier_lm_head.weight"} <= keys
    assert "embed_tokens.weight" not in keys
    assert checkpoint_format(folder) == "speculators"
    with pytest.raises(CheckpointError, match="no embed_tokens.weight"):
        load_checkpoint(folder)
    loaded = load_checkpoint(folder, embed_weight=src.embed_tokens.weight)  # the target's embedding
    assert loaded.spec.norm_before_residual is norm_before_residual
    assert loaded.spec.fc_norm == fc_norm
    assert not hasattr(loaded, "d2t")  # an all-zero d2t over the whole vocabulary is no mapping
    assert_drafts_alike(src, loaded)


def test_speculators_pruned_vocabulary_with_embedding(tmp_path):
    src = source(draft_vocab=32, fc_norm="per_layer", norm_output=True, norm_before_residual=True)
    loaded = load_checkpoint(write_speculators(src, tmp_path / "spec", embed=True))
    assert torch.equal(loaded.d2t, src.d2t)
    assert_drafts_alike(src, loaded)


def test_speculators_without_norm_before_residual_means_false(tmp_path):
    """speculators' config default is false (vLLM 0.32 reads a missing key as true: our exports always
    write it)."""
    src = source(fc_norm="per_layer", norm_output=True)
    folder = write_speculators(src, tmp_path / "spec", embed=True)
    config = json.loads((folder / "config.json").read_text())
    del config["norm_before_residual"]
    (folder / "config.json").write_text(json.dumps(config))
    assert load_checkpoint(folder).spec.norm_before_residual is False


def test_a_reordered_full_vocabulary_puts_lm_head_in_target_order(tmp_path):
    src = source(fc_norm="per_layer", norm_output=True)
    folder = write_speculators(src, tmp_path / "spec", embed=True)
    state = load_file(str(folder / "model.safetensors"))
    order = torch.randperm(100, generator=torch.Generator().manual_seed(3))  # draft id i is target id order[i]
    state["lm_head.weight"] = state["lm_head.weight"][order]
    state["d2t"] = order - torch.arange(100)
    save_file(state, str(folder / "model.safetensors"))
    assert_drafts_alike(src, load_checkpoint(folder))


def test_norm_before_residual_starts_the_residual_from_hidden_norm():
    """vLLM's llama_eagle3: `h = hidden_norm(h); residual = h` instead of `residual = h; h = hidden_norm(h)`."""
    d = source(norm_before_residual=True)
    layer = d.layers[0]
    embeds, h = torch.randn(1, 5, 64), torch.randn(1, 5, 64) * 4
    cos, sin = d.rotary(torch.arange(5)[None])
    with torch.no_grad():
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(h)], -1)
        mid = layer.hidden_norm(h) + layer.self_attn(x, cos, sin, KVCache(1))
        expected = mid + layer.mlp(layer.post_attention_layernorm(mid))
        torch.testing.assert_close(layer(embeds, h, cos, sin, KVCache(1)), expected)
        d.spec.norm_before_residual = layer.norm_before_residual = False  # the same weights, raw residual
        assert not torch.allclose(layer(embeds, h, cos, sin, KVCache(1)), expected)


@pytest.mark.parametrize("save", ["native", "speculators"])
def test_norm_before_residual_round_trips_through_our_formats(tmp_path, save):
    src = source(fc_norm="per_layer", norm_output=True, norm_before_residual=True)
    if save == "native":
        folder = save_native(src, tmp_path / "x")
    else:
        folder = save_speculators(src, tmp_path / "x", "target", 3)
    assert json.loads((folder / "config.json").read_text())["norm_before_residual"] is True
    back = load_checkpoint(folder)
    assert back.spec == src.spec
    assert_drafts_alike(src, back)


# -- refusals: one line naming the file and what was expected ------------------------------------------


def _edit_config(folder: Path, edit) -> None:
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))


def _edit_weights(folder: Path, edit) -> None:
    state = load_file(str(folder / "model.safetensors"))
    edit(state)
    save_file(state, str(folder / "model.safetensors"))


BAD = {
    "qwen3 layer": (
        "speculators",
        lambda f: _edit_config(f, lambda c: c["transformer_layer_config"].update(model_type="qwen3")),
        "config.json: transformer_layer_config.model_type 'qwen3' is not supported; expected llama",
    ),
    "missing weight": (
        "torchspec",
        lambda f: _edit_weights(f, lambda s: s.pop("fc_norm.1.weight")),
        "model.safetensors: no fc_norm.1.weight; expected the weights of the drafter config.json describes",
    ),
    "mis-shaped weight": (
        "torchspec",
        lambda f: _edit_weights(f, lambda s: s.update({"fc.weight": s["fc.weight"][:, :128].contiguous()})),
        "model.safetensors: fc.weight has shape [64, 128], expected [64, 192]",
    ),
    "unknown weight": (
        "torchspec",
        lambda f: _edit_weights(f, lambda s: s.update({"layers.0.self_attn.q_norm.weight": torch.ones(32)})),
        "model.safetensors: unexpected layers.0.self_attn.q_norm.weight",
    ),
    "no weight file": (
        "torchspec",
        lambda f: (f / "model.safetensors").rename(f / "pytorch_model.bin"),
        "model.safetensors: missing (expected a drafter checkpoint: config.json + model.safetensors); "
        "found pytorch_model.bin",
    ),
    "not safetensors": (
        "torchspec",
        lambda f: (f / "model.safetensors").write_bytes(b"\x00" * 64),
        "model.safetensors: not a readable safetensors file",
    ),
    "rope scaling": (
        "torchspec",
        lambda f: _edit_config(f, lambda c: c.update(rope_scaling={"rope_type": "llama3", "factor": 8.0})),
        "config.json: rope_scaling of type 'llama3' is not supported",
    ),
    "d2t off the vocabulary": (
        "torchspec",
        lambda f: _edit_weights(f, lambda s: s["d2t"].fill_(99)),
        "model.safetensors: d2t maps draft ids onto ids outside the target vocabulary",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_unusable_checkpoint_is_refused_in_one_line(tmp_path, case):
    fmt, damage, message = BAD[case]
    src = source(draft_vocab=40, fc_norm="per_layer", norm_output=True)
    folder = (write_torchspec if fmt == "torchspec" else write_speculators)(src, tmp_path / "ckpt")
    damage(folder)
    with pytest.raises((CheckpointError, FileNotFoundError)) as err:
        load_checkpoint(folder, embed_weight=src.embed_tokens.weight)
    text = str(err.value)
    assert "\n" not in text
    assert text.startswith(str(folder)), text
    assert message in text, text
