"""The drafter: EAGLE-3 vs 3.1 paths, TTT attention == decoding attention, checkpoint round trip."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from helpers import assert_decoding_equals_unroll, small_drafter

from lab.drafter import Eagle3Drafter, load_checkpoint, save_native
from lab.drafter.unroll import unroll

COMBOS = list(itertools.product(["none", "per_layer", "concat"], [False, True]))


def make(fc_norm="none", norm_output=False, num_layers=1, norm_type="rmsnorm", seed=0) -> Eagle3Drafter:
    drafter = small_drafter(seed, num_layers=num_layers, fc_norm=fc_norm, norm_output=norm_output, norm_type=norm_type)
    with torch.no_grad():  # non-trivial norm weights so that a skipped norm would show
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return drafter


def test_eagle3_computes_exactly_eagle3():
    d = make("none", False)
    names = [n for n, _ in d.named_parameters()]
    assert not any(n.startswith(("fc_norm", "input_norm")) for n in names)
    aux = torch.randn(1, 5, 192) * torch.tensor([1.0] * 64 + [5.0] * 64 + [20.0] * 64)
    torch.testing.assert_close(d.project(aux), aux @ d.fc.weight.T)  # raw states into fc
    h = torch.randn(1, 5, 64) * 7
    assert d.feedback(h) is h  # raw residual stream fed back
    torch.testing.assert_close(d.logits(h), d.lm_head(d.norm(h)))


def test_eagle31_normalizes_each_captured_layer_and_feeds_back_norm_h():
    d = make("per_layer", True)
    assert len(d.fc_norm) == 3
    aux = torch.randn(1, 5, 192) * torch.tensor([1.0] * 64 + [5.0] * 64 + [20.0] * 64)
    chunks = aux.chunk(3, -1)
    expected = torch.cat([n(c) for n, c in zip(d.fc_norm, chunks, strict=True)], -1) @ d.fc.weight.T
    torch.testing.assert_close(d.project(aux), expected)
    # scale invariance per layer: multiplying one captured layer does not change the projection
    scaled = torch.cat([chunks[0] * 50, chunks[1], chunks[2]], -1)
    torch.testing.assert_close(d.project(scaled), d.project(aux), atol=1e-4, rtol=1e-4)
    h = torch.randn(1, 5, 64) * 7
    torch.testing.assert_close(d.feedback(h), d.norm(h))


@pytest.mark.parametrize("num_layers", [1, 2])
@pytest.mark.parametrize(("fc_norm", "norm_output"), COMBOS)
def test_ttt_unroll_equals_step_by_step_decoding(fc_norm, norm_output, num_layers):
    """Training's TTT attention (causal step 0 + diagonal later steps) sees exactly what the decoder sees."""
    d = make(fc_norm, norm_output, num_layers)
    assert_decoding_equals_unroll(d, num_layers)


@pytest.mark.parametrize(
    ("fc_norm", "norm_output", "norm_type"), [(*c, "rmsnorm") for c in COMBOS] + [("per_layer", True, "layernorm")]
)
def test_checkpoint_round_trip(tmp_path, fc_norm, norm_output, norm_type):
    d = make(fc_norm, norm_output, norm_type=norm_type)
    save_native(d, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["fc_norm"] == (fc_norm == "per_layer") and cfg["norm_before_fc"] == (fc_norm == "concat")
    assert cfg["norm_output"] == norm_output
    assert (
        cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    )
    back = load_checkpoint(tmp_path)
    tokens, aux = torch.randint(0, 100, (2, 7)), torch.randn(2, 7, 192)
    with torch.no_grad():
        a = [d.logits(h) for h in unroll(d, tokens, aux, 3)]
        b = [back.logits(h) for h in unroll(back, tokens, aux, 3)]
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def test_checkpoint_keys_follow_vllm_names(tmp_path):
    from safetensors.torch import load_file

    save_native(make("per_layer", True), tmp_path)
    keys = set(load_file(str(tmp_path / "model.safetensors")))
    assert {
        "fc.weight",
        "fc_norm.0.weight",
        "fc_norm.2.weight",
        "norm.weight",
        "lm_head.weight",
        "layers.0.self_attn.q_proj.weight",
        "layers.0.hidden_norm.weight",
        "layers.0.input_layernorm.weight",
        "layers.0.mlp.gate_proj.weight",
    } <= keys
    assert "d2t" not in keys  # equal vocabularies: no d2t


def test_missing_checkpoint_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_checkpoint(tmp_path)


def test_speculators_format_round_trip(tmp_path):
    from lab.drafter import save_speculators

    d = make("per_layer", True)
    save_speculators(d, tmp_path, verifier="/models/target", num_speculative_tokens=5)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3"
    assert cfg["fc_norm"] is True and cfg["norm_output"] is True and cfg["norm_before_fc"] is False
    assert cfg["norm_before_residual"] is False  # speculators would default to True
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "/models/target"
    assert "fc_norm" not in cfg["transformer_layer_config"]
    back = load_checkpoint(tmp_path)
    assert back.spec == d.spec
    for name, tensor in d.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name


def test_multi_layer_export_has_the_norms_vllm_loads_strictly(tmp_path):
    from safetensors.torch import load_file

    d = make("none", False, num_layers=2)
    save_native(d, tmp_path)
    keys = set(load_file(str(tmp_path / "model.safetensors")))
    assert {"layers.0.hidden_norm.weight", "layers.1.hidden_norm.weight", "layers.1.self_attn.q_proj.weight"} <= keys
    back = load_checkpoint(tmp_path)  # the unused layer-1 hidden_norm is dropped again
    assert set(back.state_dict()) == set(d.state_dict())


def test_checkpoint_without_aux_ids_takes_vllms_default(tmp_path):
    save_native(make(), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["eagle_config"], cfg["eagle_aux_hidden_state_layer_ids"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        load_checkpoint(tmp_path)
    assert load_checkpoint(tmp_path, target_num_layers=8).spec.aux_layer_ids == [2, 4, 5]


def test_vllm_incompatibility_names_the_key():
    from lab.drafter import vllm_incompatibility

    assert vllm_incompatibility(make("per_layer", True).spec) is None
    assert "drafter.norm_type=layernorm" in vllm_incompatibility(make("per_layer", True, norm_type="layernorm").spec)


def test_lab_export_writes_both_formats_and_refuses_layernorm(tmp_path, capsys):
    from lab.cli import main

    save_native(make("per_layer", True), tmp_path / "ckpt")
    assert main(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"), "--verifier", "/m/target"]) == 0
    assert json.loads((tmp_path / "out" / "native" / "config.json").read_text())["fc_norm"] is True
    assert json.loads((tmp_path / "out" / "speculators" / "config.json").read_text())["speculators_model_type"]
    assert "vllm serve /m/target" in capsys.readouterr().out
    # no verifier known for a bare folder: the speculators format needs one
    assert main(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "o2"), "--format", "speculators"]) == 2
    assert "--verifier" in capsys.readouterr().err
    save_native(make("per_layer", True, norm_type="layernorm"), tmp_path / "ln")
    assert main(["export", str(tmp_path / "ln"), "--out", str(tmp_path / "o3"), "--format", "native"]) == 2
    assert "drafter.norm_type=layernorm" in capsys.readouterr().err
    assert not (tmp_path / "o3").exists()
