"""`train.backend=torchspec`, and parity of the native drafter and TTT loss with TorchSpec's.

The parity tests need TorchSpec (not on PyPI) and are skipped without it; docs/torchspec.md
says how to install it and run them. TorchSpec's drafter is built here from the checkpoint
that `save_native` writes (its own config reader and key map), not from our module, so the tests also
check that our checkpoints load into TorchSpec unchanged.
"""

from __future__ import annotations

import importlib
import json
import sys

import pytest
import torch
from helpers import perturb
from omegaconf import OmegaConf

from lab.config import ConfigError
from lab.config.composition import compose
from lab.data.cache import HiddenStates
from lab.drafter import DrafterSpec, Eagle3Drafter, save_native
from lab.drafter.unroll import unroll
from lab.train.loss import ttt_loss
from lab.train.ttt import train


def _torchspec_importable() -> bool:
    try:
        importlib.import_module("torchspec.models.eagle3")
    except ImportError:
        return False
    return True


HAVE_TORCHSPEC = _torchspec_importable()
needs_torchspec = pytest.mark.skipif(
    not HAVE_TORCHSPEC,
    reason="TorchSpec is not installed: the parity tests need it (docs/torchspec.md says how to run them)",
)

VOCAB, HIDDEN, AUX_SCALES = 96, 64, (1.0, 4.0, 16.0)  # captured layers at different scales, as in a real target
# DeepSeek's latent attention (TorchSpec's Eagle3DeepseekV2ForCausalLM): a value head narrower than the query-key
# head, and a rope part narrower than the nope part, so that a swapped split or a misplaced rotary shows
MLA = dict(attention="mla", q_lora_rank=24, kv_lora_rank=40, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)
# over a target with DeepSeek's YaRN (Kimi K2): its rotary and softmax scale, on positions past the original length
YARN = dict(type="yarn", factor=4.0, original_max_position_embeddings=8, beta_fast=32, beta_slow=1, mscale=1.0)
ATTENTION = {"gqa": {}, "mla": MLA, "mla-yarn": MLA | {"rope_scaling": YARN | {"mscale_all_dim": 1.0}}}


def _drafter(
    fc_norm: str, norm_output: bool, draft_vocab: int | None = None, seed: int = 0, attention: str = "gqa"
) -> Eagle3Drafter:
    spec = DrafterSpec(
        hidden_size=HIDDEN,
        target_hidden_size=HIDDEN,
        aux_layer_ids=[1, 2, 3],
        vocab_size=VOCAB,
        draft_vocab_size=draft_vocab,
        num_heads=2,
        num_kv_heads=1,  # grouped-query attention, as in real drafters
        head_dim=32,
        intermediate_size=96,
        fc_norm=fc_norm,
        norm_output=norm_output,
        **ATTENTION[attention],
    )
    torch.manual_seed(seed)
    return perturb(Eagle3Drafter(spec), draft_vocab)


def _batch(seed: int = 1, b: int = 2, t: int = 24):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (b, t), generator=g)
    aux = torch.cat([torch.randn(b, t, HIDDEN, generator=g) * s for s in AUX_SCALES], dim=-1)
    final = torch.randn(b, t, HIDDEN, generator=g)
    lm_head = torch.randn(VOCAB, HIDDEN, generator=g) * 0.3
    loss_mask = (torch.rand(b, t, generator=g) > 0.25).to(torch.uint8)
    return input_ids, aux, final, lm_head, loss_mask


def _torchspec_drafter(drafter: Eagle3Drafter, tmp_path):
    """TorchSpec's drafter loaded from our exported checkpoint by TorchSpec's own config and key map."""
    from safetensors.torch import load_file
    from torchspec import AutoDraftModelConfig, AutoEagle3DraftModel
    from torchspec.models.draft.keymap import to_internal_keys

    path = save_native(drafter, tmp_path / "ckpt")
    model = AutoEagle3DraftModel.from_config(AutoDraftModelConfig.from_file(str(path / "config.json")))
    state = to_internal_keys(load_file(str(path / "model.safetensors")), model.state_dict().keys())
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"t2d"}, (missing, unexpected)
    if "t2d" in missing:  # our checkpoints carry d2t only, as vLLM reads them; t2d is its inverse
        model.t2d.zero_()
        model.t2d[drafter.draft_token_ids()] = True
    return model.float()


COMBOS = [("none", False), ("per_layer", False), ("none", True), ("per_layer", True)]
EAGLE3, EAGLE31 = COMBOS[0], COMBOS[-1]
TORCHSPEC_CLASS = {"gqa": "LlamaForCausalLMEagle3", "mla": "Eagle3DeepseekV2ForCausalLM"}
TORCHSPEC_CLASS["mla-yarn"] = TORCHSPEC_CLASS["mla"]


@needs_torchspec
@pytest.mark.parametrize("attention", list(ATTENTION))
@pytest.mark.parametrize(("fc_norm", "norm_output"), COMBOS)
def test_forward_parity(fc_norm, norm_output, attention, tmp_path):
    """Step by step: the projected features, every step's logits and the hidden state fed to the next
    step equal TorchSpec's, for each combination of the two EAGLE 3.1 changes, with Llama's attention and
    with DeepSeek's latent attention (MLA: TorchSpec's own GPT-J rotary and softmax scale, plain or YaRN)."""
    from lab.train.torchspec_backend import TorchSpecTTT

    length = 4
    drafter = _drafter(fc_norm, norm_output, attention=attention)
    theirs = _torchspec_drafter(drafter, tmp_path)
    assert type(theirs).__name__ == TORCHSPEC_CLASS[attention]
    assert (theirs.fc_norm is not None) == (fc_norm == "per_layer") and theirs.norm_output == norm_output
    input_ids, aux, final, lm_head, loss_mask = _batch()

    fed, out = [], []
    theirs.midlayer.register_forward_pre_hook(lambda m, a, kw: fed.append(kw["hidden_states"]), with_kwargs=True)
    theirs.midlayer.register_forward_hook(lambda m, a, kw, o: out.append(o[0]), with_kwargs=True)
    with torch.no_grad():
        TorchSpecTTT(theirs, length).forward(input_ids, aux, final, lm_head, loss_mask)
        shifted = torch.nn.functional.pad(input_ids[:, 1:], (0, 1))
        ours = unroll(drafter, shifted, aux, length)
        projected = drafter.project(aux)
        assert len(out) == len(ours) == length
        torch.testing.assert_close(fed[0], projected, rtol=1e-5, atol=1e-5)
        for step in range(length):
            torch.testing.assert_close(out[step], ours[step], rtol=1e-5, atol=1e-5, msg=f"h_out, step {step}")
            torch.testing.assert_close(
                theirs.compute_logits(out[step]), drafter.logits(ours[step]), rtol=1e-5, atol=1e-5
            )
            if step + 1 < length:
                torch.testing.assert_close(
                    fed[step + 1], drafter.feedback(ours[step]), rtol=1e-5, atol=1e-5, msg=f"feedback, step {step}"
                )
    # the toggle really changes what is fed back (else the test above could not tell them apart)
    assert not torch.allclose(drafter.norm(ours[0]), ours[0], atol=1e-3)


@needs_torchspec
@pytest.mark.parametrize(
    ("fc_norm", "norm_output", "draft_vocab", "attention"),
    [
        *[(*c, None, "gqa") for c in COMBOS],
        (*EAGLE31, 40, "gqa"),
        *[(*c, None, "mla") for c in (EAGLE3, EAGLE31)],
        (*EAGLE31, 40, "mla"),
    ],
)
def test_loss_and_gradient_parity(fc_norm, norm_output, draft_vocab, attention, tmp_path):
    """The TTT loss (every step's loss, the 0.8**i weighted sum, the accuracies) and its gradient with
    respect to every trained weight equal TorchSpec's, with the full and with a pruned draft vocabulary, for
    the GQA and (as EAGLE-3 and EAGLE 3.1) the MLA drafter."""
    from lab.train.torchspec_backend import TorchSpecTTT

    length = 3
    drafter = _drafter(fc_norm, norm_output, draft_vocab, attention=attention)
    theirs = _torchspec_drafter(drafter, tmp_path)
    input_ids, aux, final, lm_head, loss_mask = _batch(seed=2)

    native = ttt_loss(drafter, input_ids, aux, final, lm_head, length, 0.8, loss_mask)
    ts = TorchSpecTTT(theirs, length).loss(input_ids, aux, final, lm_head, length, 0.8, loss_mask)
    torch.testing.assert_close(ts.loss, native.loss, rtol=1e-5, atol=1e-5)
    assert ts.plosses == pytest.approx(native.plosses, rel=1e-5, abs=1e-6)
    if draft_vocab is None:  # with a pruned vocabulary TorchSpec's acc skips out-of-vocabulary targets
        assert ts.accs == pytest.approx(native.accs, abs=1e-6)

    native.loss.backward()
    ts.loss.backward()
    theirs_params = dict(theirs.named_parameters())
    compared = 0
    for name, p in drafter.named_parameters():
        if not p.requires_grad:
            continue
        q = theirs_params[name.replace("layers.0.", "midlayer.")]
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=f"gradient of {name}")
        compared += 1
    assert compared == sum(p.requires_grad for p in drafter.parameters()) > 10


@needs_torchspec
@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_backend_trains_the_drafters_own_weights(attention, tmp_path):
    """`train.backend=torchspec` in our loop: TorchSpec's module shares the drafter's parameters, so the
    optimizer steps, the metrics and the trained weights are the drafter's, and they match the native
    backend's after a few steps (same data order and seed), for the GQA and the MLA drafter."""
    from lab.pipeline import training_loss  # the backend's loss, as `lab run` picks it
    from lab.train.torchspec_backend import build_model

    drafter = _drafter("per_layer", True, attention=attention)
    model = build_model(drafter)
    assert type(model).__name__ == TORCHSPEC_CLASS[attention]
    for name, p in drafter.named_parameters():  # the same Parameter objects, every one
        assert model.get_parameter(name.replace("layers.0.", "midlayer.")) is p, name

    input_ids, aux, final, lm_head, loss_mask = _batch(seed=3, b=8, t=20)
    data = HiddenStates(input_ids, loss_mask, aux.bfloat16(), final.bfloat16(), tmp_path)
    base = OmegaConf.to_container(compose(["train=quick"]).train)
    trained, logs = {}, {}
    for backend in ("native", "torchspec"):
        tcfg = OmegaConf.create({**base, "backend": backend, "steps": 4, "batch_size": 4, "log_every": 2})
        d = _drafter("per_layer", True, attention=attention)
        logs[backend] = []
        train(
            d,
            data,
            lm_head,
            tcfg,
            seed=0,
            log=lambda m, s, b=backend: logs[b].append((s, m)),
            progress=False,
            loss=training_loss(d, tcfg),
        )
        trained[backend] = d.state_dict()
    assert [s for s, _ in logs["torchspec"]] == [2, 4]
    for (_, a), (_, b) in zip(logs["native"], logs["torchspec"], strict=True):
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-4)
    for name, value in trained["native"].items():
        torch.testing.assert_close(trained["torchspec"][name], value, rtol=1e-3, atol=1e-4, msg=name)
    changed = (trained["torchspec"]["fc.weight"] - drafter.fc.weight).abs().max()
    assert changed > 1e-3  # training moved the weights


@pytest.mark.skipif(HAVE_TORCHSPEC, reason="TorchSpec is installed here")
def test_torchspec_backend_refused_without_torchspec():
    """Whether TorchSpec is installed is the machine's matter: composing takes the config, `lab run`'s
    preflight and a study's check of each point (check_environment) refuse it in one line."""
    from lab.preflight import check_environment

    cfg = compose(["target=micro", "data=micro", "train=quick", "train.backend=torchspec"])
    with pytest.raises(ConfigError) as err:
        check_environment(cfg)
    message = str(err.value)
    assert message.startswith("train.backend: torchspec: TorchSpec is not importable")
    assert "\n" not in message and "git clone https://github.com/torchspec-project/TorchSpec" in message


MICRO_MLA = ["attention=mla", "drafter.q_lora_rank=16"]


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["drafter.num_layers=2"], "drafter.num_layers"),
        (["drafter.fc_norm=concat"], "drafter.fc_norm"),
        (["drafter=eagle31", "drafter.norm_type=layernorm"], "drafter.norm_type"),
        ([*MICRO_MLA, "drafter.num_layers=2"], "drafter.num_layers"),
        ([*MICRO_MLA, "drafter.fc_norm=concat"], "drafter.fc_norm"),
        (["train.backend=tensorflow"], "train.backend"),
    ],
)
def test_torchspec_backend_refuses_what_torchspec_cannot_train(overrides, key):
    backend = [] if any(o.startswith("train.backend") for o in overrides) else ["train.backend=torchspec"]
    with pytest.raises(ConfigError) as err:
        compose(["target=micro", "data=micro", "train=quick", *backend, *overrides])
    assert err.value.key == key and "\n" not in str(err.value)


@pytest.mark.parametrize("overrides", [["target=micro", *MICRO_MLA], ["target=micro_mla", "attention=mla"]])
def test_torchspec_backend_takes_an_mla_drafter(overrides):
    """TorchSpec's Eagle3DeepseekV2ForCausalLM builds every MLA drafter validation lets through (over a dense
    target with the schema's dims, over an MLA target with its own): nothing refused by the config."""
    cfg = compose([*overrides, "data=micro", "train=quick", "drafter=eagle31", "train.backend=torchspec"])
    assert cfg.drafter.attention.value == "mla"


@pytest.fixture
def torchspec_without_mla(monkeypatch):
    """A TorchSpec that lacks the MLA drafter: tests/fake_torchspec (importable, with `torchspec.models.eagle3`
    but no `torchspec.models.draft.deepseek_eagle`) first on sys.path, whether a real TorchSpec is there or not."""
    from pathlib import Path

    def ours() -> list[str]:
        return [m for m in sys.modules if m == "torchspec" or m.startswith("torchspec.")]

    for name in ours():  # a real TorchSpec imported earlier: put back by monkeypatch after the test
        monkeypatch.delitem(sys.modules, name)
    fake = Path(__file__).parent / "fake_torchspec"
    monkeypatch.syspath_prepend(str(fake))
    assert Path(importlib.import_module("torchspec").__file__).is_relative_to(fake)
    yield
    for name in ours():  # the fake's modules, before monkeypatch restores the real ones
        del sys.modules[name]


def test_torchspec_without_mla_refused_for_an_mla_drafter(torchspec_without_mla):
    """`drafter.attention=mla` with a TorchSpec that has no MLA drafter: one line naming the key, from the same
    preflight `lab run` and a study's check of each point run before any work; its GQA drafter still passes."""
    from lab.preflight import check_environment

    base = ["target=micro", "data=micro", "train=quick", "train.backend=torchspec"]
    check_environment(compose(base))  # the fake is a TorchSpec: the GQA drafter is not refused
    with pytest.raises(ConfigError) as err:
        check_environment(compose([*base, *MICRO_MLA]))
    message = str(err.value)
    assert err.value.key == "drafter.attention" and "\n" not in message, message
    assert message.startswith("drafter.attention: mla with train.backend=torchspec: the installed TorchSpec has no")
    assert "Eagle3DeepseekV2ForCausalLM" in message


@needs_torchspec
def test_torchspec_with_mla_passes_preflight():
    from lab.preflight import check_environment

    check_environment(compose(["target=micro", "data=micro", "train=quick", "train.backend=torchspec", *MICRO_MLA]))


@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_parity_fixture_checkpoint_is_what_torchspec_reads(attention, tmp_path):
    """Without TorchSpec: the exported config carries what TorchSpec's drafter reads (its class, its fc_norm /
    norm_output switches, the number of captured layers, and MLA's dims where it has them)."""
    drafter = _drafter("per_layer", True, attention=attention)
    config = json.loads((save_native(drafter, tmp_path / "c") / "config.json").read_text())
    assert config["architectures"] == [TORCHSPEC_CLASS[attention]] and config["num_hidden_layers"] == 1
    assert config["fc_norm"] is True and config["norm_output"] is True
    assert len(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]) == 3
    if attention == "mla":  # DeepseekV3Config's names, and no rope scaling (TorchSpec would scale the softmax)
        assert {k: config[k] for k in MLA if k != "attention"} == {k: v for k, v in MLA.items() if k != "attention"}
        assert config["rope_parameters"]["rope_type"] == "default" and "rope_scaling" not in config


@needs_torchspec
def test_lab_run_with_the_torchspec_backend(micro_overrides, micro_target, workdir):
    """`lab run train.backend=torchspec` end to end: trained by TorchSpec's classes, evaluated and logged
    like any run, with the TorchSpec that trained it in the run's tags."""
    import mlflow

    from lab.pipeline import run

    cfg = compose([*micro_overrides, "drafter=eagle31", "train.backend=torchspec", "study=torchspec-run"])
    result = run(cfg, progress=False)
    mlflow.set_tracking_uri(cfg.tracking.uri)
    logged = mlflow.get_run(result.run_id)
    assert logged.info.status == "FINISHED"
    assert logged.data.params["train.backend"] == "torchspec"
    assert logged.data.tags["torchspec_version"] and logged.data.tags["torchspec_commit"]
    history = mlflow.MlflowClient().get_metric_history(result.run_id, "train/loss")
    assert len(history) == cfg.train.steps // cfg.train.log_every and history[-1].value < history[0].value
    assert result.metrics["eval/in_dist/ref/k3/exact_match"] == 1.0 and result.metrics["eval/in_dist/ref/k3/al"] > 1
