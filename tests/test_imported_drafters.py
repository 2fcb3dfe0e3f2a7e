"""Drafters trained elsewhere: checkpoints in TorchSpec's `tools/convert_to_hf.py` layout and in speculators'
layout, written here from a drafter of ours (neither project is needed), load into the workbench and draft
exactly as the source drafter does; `lab run drafter.checkpoint=DIR` evaluates one like a trained drafter and
logs what it evaluated; a checkpoint that does not fit is refused in one line and records nothing."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from helpers import TEST_THREADS, small_drafter, unlogged
from safetensors.torch import load_file, save_file

from lab.config import ConfigError
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
from lab.drafter.imported import resolve

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


# -- fitting the target ----------------------------------------------------------------------------------


def test_resolve_checks_the_checkpoint_fits_the_target(tmp_path):
    folder = write_torchspec(source(fc_norm="per_layer", norm_output=True), tmp_path / "ts")
    assert resolve(folder, num_layers=6, hidden_size=64, vocab_size=100).spec.aux_layer_ids == [1, 2, 3]
    cases = [
        (dict(vocab_size=128), "drafter.checkpoint", "vocab_size 100, the target's is 128"),
        (dict(hidden_size=96), "drafter.checkpoint", "target_hidden_size 64, the target's hidden size is 96"),
        (dict(num_layers=3), "drafter.checkpoint", "expected distinct ascending ids below the target's 3 layers"),
        (dict(aux_layers=[0, 1, 2]), "drafter.aux_layers", "differs from the layers"),
    ]
    for change, key, message in cases:
        args = {"num_layers": 6, "hidden_size": 64, "vocab_size": 100, **change}
        with pytest.raises(ConfigError) as err:
            resolve(folder, **args)
        assert err.value.key == key and message in str(err.value), str(err.value)

    bare = write_torchspec(source(), tmp_path / "bare", aux_ids=False)
    assert resolve(bare, num_layers=8, hidden_size=64).spec.aux_layer_ids == [2, 4, 5]
    assert resolve(bare, num_layers=4, hidden_size=64, aux_layers=[1, 2, 3]).spec.aux_layer_ids == [1, 2, 3]
    for layers, default in [(4, "[2, 2, 1]"), (3, "[2, 1, 0]")]:
        with pytest.raises(ConfigError, match=re.escape(f"is {default}, not distinct ascending ids; set drafter.aux")):
            resolve(bare, num_layers=layers, hidden_size=64)


def test_a_checkpoint_is_checked_before_any_target_and_its_own_norms_decide_vllm(tmp_path):
    """No target is built to refuse a checkpoint (lab/preflight.py, which `lab run` and a study's check run
    after composing); whether vLLM can serve it is the checkpoint's matter, not the drafter preset's."""
    from lab.config.composition import compose
    from lab.preflight import check_checkpoint, check_vllm_servable

    overrides = ["profile=micro", f"cache_dir={tmp_path / 'cache'}"]
    layernorm = save_native(source(fc_norm="per_layer", norm_type="layernorm"), tmp_path / "ln")
    cfg = compose([*overrides, "drafter=eagle31", f"drafter.checkpoint={layernorm}"])
    cfg.eval.backends = ["ref", "vllm"]  # whether vLLM is installed: check_environment's
    with pytest.raises(
        ConfigError, match="^eval.backends: drafter.checkpoint=.*: 'vllm' cannot serve drafter.norm_type=layernorm"
    ):
        check_vllm_servable(cfg)
    cfg.eval.backends = ["ref"]
    check_vllm_servable(cfg)
    with pytest.raises(ConfigError, match="drafter.checkpoint: .*nothing.*missing"):
        check_checkpoint(compose([*overrides, f"drafter.checkpoint={tmp_path / 'nothing'}"]))
    assert not (tmp_path / "cache").exists()


# -- lab run drafter.checkpoint=DIR ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> dict[str, str]:
    """A store of this module's own (the bad cases below must leave it exactly as the good run left it)."""
    root = tmp_path_factory.mktemp("import-store")
    return {"root": str(root), "uri": f"sqlite:///{root / 'mlflow.db'}", "artifacts": str(root / "artifacts")}


def _run_overrides(micro_overrides: list[str], store: dict[str, str]) -> list[str]:
    keep = [o for o in micro_overrides if not o.startswith("tracking.")]
    return [*keep, f"tracking.uri={store['uri']}", f"tracking.artifact_root={store['artifacts']}", "study=imported"]


def micro_drafter(target, **spec) -> Eagle3Drafter:
    """A bf16-exact drafter that fits the micro target, its head and embedding the target's."""
    c = target.model.config
    d = source(
        fc_norm="per_layer",
        norm_output=True,
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        target_hidden_size=c.hidden_size,
        num_heads=c.num_attention_heads,
        head_dim=c.hidden_size // c.num_attention_heads,
        intermediate_size=c.intermediate_size,
        **spec,
    )
    with torch.no_grad():
        d.lm_head.weight.copy_(target.lm_head_weight.to(torch.bfloat16).float())
        d.embed_tokens.weight.copy_(target.embed_weight)
    return d


@pytest.fixture(scope="module")
def imported_run(micro_overrides, micro_target, store, tmp_path_factory):
    """`lab run` (the eagle3 preset) on a speculators EAGLE 3.1 checkpoint without its embedding."""
    src = micro_drafter(micro_target, norm_before_residual=True)
    folder = write_speculators(src, tmp_path_factory.mktemp("ckpt") / "speculators-eagle31")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lab.cli",
            "run",
            *_run_overrides(micro_overrides, store),
            f"drafter.checkpoint={folder}",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "TQDM_DISABLE": "1"},
        cwd=store["root"],
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return src, folder, proc.stdout.strip().splitlines()[-1]


@pytest.mark.slow
def test_lab_run_evaluates_an_imported_drafter_and_logs_what_it_evaluated(
    imported_run, micro_overrides, micro_target, store, tmp_path
):
    import mlflow
    from helpers import evaluate_suite

    from lab.config.composition import compose
    from lab.data.suites import build_suite

    src, folder, run_id = imported_run
    client = mlflow.MlflowClient(tracking_uri=store["uri"])
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    params, tags, metrics = run.data.params, run.data.tags, run.data.metrics
    # the checkpoint's drafter, not the eagle3 preset the run was composed with
    assert params["drafter.fc_norm"] == "per_layer" and params["drafter.norm_output"] == "True"
    assert params["drafter.norm_type"] == "rmsnorm" and params["drafter.num_layers"] == "1"
    assert params["drafter.aux_layers"] == "[1, 2, 3]" and params["resolved.aux_layers"] == "[1, 2, 3]"
    assert params["drafter.draft_vocab_size"] == "None" and params["drafter.norm_before_residual"] == "True"
    assert params["drafter.checkpoint"] == str(folder)
    assert tags["drafter_source"] == str(folder.resolve()) and tags["drafter_format"] == "speculators"
    assert tags["arm"] == "speculators-eagle31"
    config = yaml.safe_load(Path(client.download_artifacts(run_id, "config.yaml", str(tmp_path))).read_text())
    assert config["drafter"]["fc_norm"] == "per_layer" and config["drafter"]["name"] == "speculators-eagle31"
    # evaluated, not trained: no cache, no training metrics
    assert not [k for k in metrics if k.startswith(("train/", "cache/"))]
    for key in ["eval/in_dist/ref/k3/al", "drift/in_dist/k3/sink_mass", "eval/in_dist/rollout/acc", "drift/fc_share"]:
        assert key in metrics, key
    assert metrics["eval/in_dist/ref/k3/exact_match"] == 1.0
    # the logged checkpoint is the source drafter (the target's embedding filled in), in our format
    logged = load_checkpoint(client.download_artifacts(run_id, "checkpoint", str(tmp_path)))
    for name, tensor in src.state_dict().items():
        assert torch.equal(logged.state_dict()[name], tensor), name
    # ... and the AL is the reference decoder's on that drafter
    cfg = compose(_run_overrides(micro_overrides, store))
    suite = build_suite("in_dist", micro_target.tokenizer, cfg)
    direct = evaluate_suite(micro_target.model, src, suite, [3], progress=False)["eval/in_dist/ref/k3/al"]
    assert metrics["eval/in_dist/ref/k3/al"] == pytest.approx(direct, rel=0.02)


@pytest.mark.slow
def test_lab_export_takes_the_imported_run(imported_run, store, tmp_path):
    from lab.cli import main

    src, _, run_id = imported_run
    overrides = [f"tracking.uri={store['uri']}", f"tracking.artifact_root={store['artifacts']}"]
    assert main(["export", run_id, "--out", str(tmp_path / "out"), "--format", "native", *overrides]) == 0
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["norm_before_residual"] is True and exported["fc_norm"] is True
    assert_drafts_alike(src, load_checkpoint(tmp_path / "out"))


def _snapshot(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    }


def _bad_checkpoints(target, root: Path) -> dict[str, tuple[list[str], str]]:
    """Checkpoints that do not fit the micro target (4 layers, width 64): (overrides, expected line)."""
    wrong_vocab = write_torchspec(source(vocab_size=100, fc_norm="per_layer"), root / "vocab")
    no_weights = write_torchspec(micro_drafter(target), root / "noweights")
    (no_weights / "model.safetensors").unlink()
    qwen3 = write_speculators(micro_drafter(target), root / "qwen3")
    _edit_config(qwen3, lambda c: c["transformer_layer_config"].update(model_type="qwen3"))
    no_ids = write_torchspec(micro_drafter(target), root / "noids", aux_ids=False)
    return {
        "wrong vocabulary": ([f"drafter.checkpoint={wrong_vocab}"], f"{wrong_vocab}: vocab_size 100, the target's is"),
        "no weight file": ([f"drafter.checkpoint={no_weights}"], f"{no_weights / 'model.safetensors'}: missing"),
        "qwen3 layer": ([f"drafter.checkpoint={qwen3}"], "transformer_layer_config.model_type 'qwen3'"),
        "no aux ids, shallow target": (
            [f"drafter.checkpoint={no_ids}"],
            "not distinct ascending ids; set drafter.aux_layers",
        ),
        "aux ids other than trained": (
            [
                f"drafter.checkpoint={write_torchspec(micro_drafter(target), root / 'ids')}",
                "drafter.aux_layers=[0,1,2]",
            ],
            "drafter.aux_layers: [0, 1, 2] differs from the layers",
        ),
    }


def test_a_checkpoint_that_does_not_fit_fails_in_one_line_and_records_nothing(
    imported_run, micro_overrides, micro_target, store, tmp_path, capsys
):
    from lab.cli import main

    root = Path(store["root"])
    before = _snapshot(root)
    for case, (extra, line) in _bad_checkpoints(micro_target, tmp_path).items():
        assert main(["run", *_run_overrides(micro_overrides, store), *extra]) == 2, case
        err = unlogged(capsys.readouterr().err)
        assert len(err) == 1 and err[0].startswith("error: drafter.") and line in err[0], (case, err)
        assert _snapshot(root) == before, case


# -- vLLM (slow): an imported drafter is served as vLLM serves the checkpoint itself ----------------------


def _bf16_exact(drafter: Eagle3Drafter, **spec) -> Eagle3Drafter:
    """A copy of `drafter` whose weights a bf16 checkpoint holds exactly, with `spec` fields changed."""
    out = Eagle3Drafter(DrafterSpec(**{**drafter.spec.to_dict(), **spec}))
    state = drafter.state_dict()
    out.load_state_dict({k: v.to(torch.bfloat16).to(v.dtype) if v.is_floating_point() else v for k, v in state.items()})
    return out.eval()


def _vllm_al(target, drafter: Eagle3Drafter, suite, tmp_path: Path, checkpoint: Path | None = None) -> dict:
    from omegaconf import OmegaConf

    from lab.eval import vllm_backend

    cfg = OmegaConf.create(
        {
            "max_new_tokens": suite.max_new_tokens,
            "temperature": 0.0,
            "vllm": {
                "format": "speculators",
                "concurrency": [1],
                "throughput_suites": [],
                "dtype": "float32",
                "kv_cache_gib": 1,
                "timeout_s": 600,
            },
        }
    )
    log = tmp_path / f"worker-{len(list(tmp_path.glob('worker-*')))}.log"
    return vllm_backend.evaluate(
        target.path, drafter, [suite], [3], cfg, 0, TEST_THREADS, log, 2048, checkpoint=checkpoint
    )


def _ref_al(target, drafter: Eagle3Drafter, suite) -> float:
    from helpers import evaluate_suite

    return evaluate_suite(target.model, drafter, suite, [3], progress=False)["eval/in_dist/ref/k3/al"]


@pytest.mark.slow
def test_lab_run_evaluates_a_torchspec_drafter_in_vllm_too(trained_eagle31, micro_overrides, micro_target, tmp_path):
    """A trained EAGLE 3.1 drafter as TorchSpec's convert_to_hf.py writes it: `lab run` evaluates it with
    both backends, which agree; vLLM reading the TorchSpec folder itself agrees as well."""
    import mlflow

    from lab.config.composition import compose
    from lab.data.suites import build_suite

    src = _bf16_exact(trained_eagle31[0])
    folder = write_torchspec(src, tmp_path / "torchspec-eagle31")
    store = {"root": str(tmp_path), "uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "artifacts": str(tmp_path / "art")}
    overrides = [*_run_overrides(micro_overrides, store), "eval.backends=[ref,vllm]", "eval.vllm.concurrency=[1]"]
    proc = subprocess.run(
        [sys.executable, "-m", "lab.cli", "run", *overrides, f"drafter.checkpoint={folder}"],
        capture_output=True,
        text=True,
        env={**os.environ, "TQDM_DISABLE": "1"},
        cwd=tmp_path,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = mlflow.MlflowClient(tracking_uri=store["uri"]).get_run(proc.stdout.strip().splitlines()[-1])
    assert run.data.tags["drafter_format"] == "torchspec" and "vllm_skipped" not in run.data.tags
    metrics = run.data.metrics
    ref = metrics["eval/in_dist/ref/k3/al"]
    assert ref > 1.3  # trained: parity is not trivially 1 == 1
    assert metrics["eval/in_dist/vllm/k3/exact_match"] == 1.0
    assert metrics["eval/in_dist/vllm/k3/al"] == pytest.approx(ref, rel=0.03)
    assert metrics["eval/in_dist/vllm/k3/c1/speedup"] > 0

    suite = build_suite("in_dist", micro_target.tokenizer, compose(overrides))
    direct = _vllm_al(micro_target, load_checkpoint(folder), suite, tmp_path, checkpoint=folder)
    assert direct["eval/in_dist/vllm/k3/al"] == pytest.approx(ref, rel=0.03)


@pytest.mark.slow
def test_vllm_honours_norm_before_residual_of_an_imported_drafter(
    trained_eagle31, micro_overrides, micro_target, tmp_path
):
    """The trained weights with norm_before_residual switched on, as a speculators checkpoint: the
    reference decoder's AL moves, and vLLM's follows it there."""
    from lab.config.composition import compose
    from lab.data.suites import build_suite

    off = _bf16_exact(trained_eagle31[0])
    folder = write_speculators(_bf16_exact(off, norm_before_residual=True), tmp_path / "speculators")
    on = load_checkpoint(folder, embed_weight=micro_target.embed_weight)
    assert on.spec.norm_before_residual
    suite = build_suite("in_dist", micro_target.tokenizer, compose(micro_overrides))
    ref_on, ref_off = _ref_al(micro_target, on, suite), _ref_al(micro_target, off, suite)
    assert ref_on != ref_off
    vllm_on = _vllm_al(micro_target, on, suite, tmp_path)["eval/in_dist/vllm/k3/al"]
    assert abs(vllm_on - ref_on) < abs(ref_on - ref_off) / 2, (vllm_on, ref_on, ref_off)
