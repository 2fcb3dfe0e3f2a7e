"""`lab torchspec-config`: a TorchSpec training YAML and draft-model JSON for one arm; the arms TorchSpec cannot
train refused in one line; checked against TorchSpec itself where it is installed."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import yaml

from lab.cli import main
from lab.config.composition import compose
from lab.config.identity import config_hash

MICRO = ["profile=micro"]
TORCHSPEC_MISSING = "TorchSpec is not installed: docs/torchspec.md says how to install it and run this test"


def export(tmp_path: Path, *args: str, name: str = "out") -> tuple[int, Path]:
    out = tmp_path / name
    rc = main(["torchspec-config", *args, f"cache_dir={tmp_path / 'cache'}", "--out", str(out)])
    return rc, out


def read(out: Path) -> tuple[dict, dict, str]:
    text = (out / "train.yaml").read_text()
    return yaml.safe_load(text), json.loads((out / "draft_model.json").read_text()), text


@pytest.mark.parametrize(
    "preset, fc_norm, norm_output", [("eagle3", False, False), ("eagle31", True, True)], ids=["eagle3", "eagle31"]
)
def test_yaml_and_json_carry_the_arm(tmp_path, capsys, preset, fc_norm, norm_output):
    args = [*MICRO, f"drafter={preset}", "train.ttt_length=5", "train.lr=1e-3", "train.step_weight=0.7"]
    rc, out = export(tmp_path, *args)
    assert rc == 0
    ts, draft, text = read(out)
    cfg = compose([*args, f"cache_dir={tmp_path / 'cache'}"])
    t = ts["training"]
    assert t["ttt_length"] == 5 and t["loss_type"] == "forward_kl"
    assert t["ploss_weights"] == pytest.approx([0.7**i for i in range(5)])
    assert t["learning_rate"] == 1e-3 and t["min_lr"] == pytest.approx(1e-3 * cfg.train.min_lr_ratio)
    assert t["lr_decay_style"] == "cosine" and t["num_train_steps"] == cfg.train.steps
    assert int(t["warmup_ratio"] * cfg.train.steps) == cfg.train.warmup_steps  # how TorchSpec reads it back
    assert t["max_grad_norm"] == cfg.train.grad_clip and t["micro_batch_size"] == cfg.train.batch_size
    assert t["max_seq_length"] == cfg.data.seq_len and t["attention_backend"] == "flex_attention"
    # the micro target's 4 layers: vLLM ids [1, 2, 3] are TorchSpec's [0, 1, 2]; the JSON keeps vLLM's
    assert ts["inference"]["aux_hidden_states_layers"] == [0, 1, 2]
    assert draft["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert draft["fc_norm"] is fc_norm and draft["norm_output"] is norm_output and draft["norm_before_fc"] is False
    assert draft["architectures"] == ["LlamaForCausalLMEagle3"] and draft["num_hidden_layers"] == 1
    assert (draft["hidden_size"], draft["target_hidden_size"], draft["head_dim"]) == (64, 64, 32)
    assert (draft["intermediate_size"], draft["vocab_size"]) == (128, 512) and "lab" not in draft
    assert ts["model"]["draft_model_config"] == str(out / "draft_model.json")
    assert ts["dataset"]["chat_template"] == "qwen"  # our chatml under TorchSpec's name
    # provenance, and what the user must fill in: placeholders that fail in TorchSpec's load_config
    assert f"lab config_hash: {config_hash(cfg)}" in text and f"drafter={preset}" in text
    assert "AdamW betas" in text
    assert ts["model"]["target_model_path"] == "${FILL_IN_target_model_path}"
    assert ts["dataset"]["train_data_path"] == "${FILL_IN_train_data_path}"
    printed = capsys.readouterr().out
    assert "lab target build profile=micro" in printed and "python -m torchspec.train_entry --config" in printed


def test_the_drafter_is_shaped_as_init_drafter_shapes_it():
    """Without the target's weights, the same DrafterSpec the native trainer builds."""
    from transformers import LlamaForCausalLM

    from lab.drafter import drafter_spec, init_drafter
    from lab.target import Target
    from lab.target.build import llama_config
    from lab.train.torchspec_config import _VocabOnly

    cfg = compose([*MICRO, "drafter=eagle31", "drafter.draft_vocab_size=100", "drafter.aux_layers=[1,3]"])
    model = LlamaForCausalLM(llama_config(cfg.target, _VocabOnly(cfg.target.vocab_size)))
    target = Target(model=model, tokenizer=None, path=Path("."), fingerprint="test")
    ours = init_drafter(target, cfg.drafter, [1, 3], seed=0, token_counts=torch.ones(cfg.target.vocab_size))
    assert drafter_spec(model.config, cfg.drafter, [1, 3]) == ours.spec


def test_a_built_target_gives_its_path_and_vocabulary(tmp_path, capsys):
    from lab.target.build import BUILD_INFO, target_dir

    cfg = compose([*MICRO, f"cache_dir={tmp_path / 'cache'}"])
    root = target_dir(cfg.target, cfg.cache_dir)
    (root / "model").mkdir(parents=True)
    (root / BUILD_INFO).write_text("{}")
    hf = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 2}
    hf.update(intermediate_size=128, vocab_size=500)  # a small corpus: fewer BPE tokens than target.vocab_size
    (root / "model" / "config.json").write_text(json.dumps(hf))
    data = tmp_path / "train.jsonl"
    data.write_text('{"conversations": []}\n')
    rc, out = export(tmp_path, *MICRO, "--data", str(data))
    assert rc == 0
    ts, draft, _ = read(out)
    assert ts["model"]["target_model_path"] == str((root / "model").absolute())
    assert ts["dataset"]["train_data_path"] == str(data)
    assert draft["vocab_size"] == 500  # the built tokenizer's size, not target.vocab_size
    assert "fill in" not in capsys.readouterr().out


def test_an_arm_of_an_experiment_as_lab_ablate_composes_it(tmp_path, capsys):
    from lab.sweep import experiment

    rc, out = export(tmp_path, "--experiment", "drift_2x2", "--arm", "eagle31", *MICRO)
    assert rc == 0
    ts, draft, text = read(out)
    assert draft["fc_norm"] is True and draft["norm_output"] is True
    exp = experiment.load("drift_2x2")
    extra = [*MICRO, f"cache_dir={tmp_path / 'cache'}"]
    overrides = exp.as_sweep(extra).trial_overrides({"arm": "eagle31"}, exp.seeds[0], extra)
    assert f"lab config_hash: {config_hash(compose(overrides))}" in text  # the tag of that arm's MLflow run
    assert "arm: experiments/drift_2x2.yaml arm eagle31 (seed 0)" in text and "arm='eagle31'" in text
    assert "experiments/drift_2x2.yaml arm eagle31" in capsys.readouterr().out
    # the arm's own overrides are the experiment's: the EAGLE-3 arm is EAGLE-3
    rc, out = export(tmp_path, "--experiment", "drift_2x2", "--arm", "eagle3", *MICRO, "seed=2", name="e3")
    ts, draft, _ = read(out)
    assert (draft["fc_norm"], draft["norm_output"], ts["training"]["seed"]) == (False, False, 2)


@pytest.mark.parametrize(
    "args, key",
    [
        (["drafter.fc_norm=concat"], "drafter.fc_norm"),
        (["drafter=eagle31", "drafter.norm_type=layernorm"], "drafter.norm_type"),
        (["drafter.num_layers=2"], "drafter.num_layers"),
        (["drafter.aux_layers=[0,2,3]"], "drafter.aux_layers"),
        (["--experiment", "norm_type", "--arm", "concat"], "experiments/norm_type.yaml arm 'concat': drafter.fc_norm"),
    ],
    ids=["concat", "layernorm", "two_layers", "aux_0", "experiment_arm"],
)
def test_arms_torchspec_cannot_train_are_refused_in_one_line(tmp_path, capsys, args, key):
    rc, out = export(tmp_path, *MICRO, *args)
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"error: {key}: ") and err.count("\n") == 1, err
    assert not out.exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["torchspec-config", "--format", "native"], "error: --format: unrecognized"),
        (["torchspec-config", "--arm", "eagle31"], "error: --experiment: required with --arm"),
        (["torchspec-config", "--experiment", "drift_2x2", "--arm", "x"], "error: --arm: unknown arm 'x'"),
        (["export", "RUN_ID", "--data", "x.jsonl"], "error: --data x.jsonl: unrecognized"),
        (["export", "drafter=eagle31"], "error: SOURCE: 'drafter=eagle31' is an override"),
    ],
    ids=["format", "arm_alone", "unknown_arm", "data_for_a_run", "override_as_source"],
)
def test_a_wrong_combination_is_one_line(tmp_path, capsys, argv, message):
    try:
        rc = main([*argv, "--out", str(tmp_path / "out")])
    except SystemExit as exc:  # argparse's errors (an option the verb does not take)
        rc = exc.code
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err


def test_exporting_a_trained_drafter_still_works(tmp_path, capsys):
    from helpers import small_drafter

    from lab.drafter import save_native

    save_native(small_drafter(0, fc_norm="per_layer", norm_output=True), tmp_path / "ckpt")
    assert main(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "x"), "--format", "native"]) == 0
    assert json.loads((tmp_path / "x" / "config.json").read_text())["fc_norm"] is True
    assert "fc_norm=per_layer" in capsys.readouterr().out


def test_an_mla_arm_is_written_as_torchspec_mla_drafter(tmp_path):
    """drafter.attention=mla: the draft JSON is TorchSpec's Eagle3DeepseekV2ForCausalLM, with the MLA dims."""
    rc, out = export(tmp_path, *MICRO, "drafter=eagle31", "attention=mla", "drafter.q_lora_rank=16")
    assert rc == 0
    _, draft, _ = read(out)
    assert draft["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and draft["model_type"] == "deepseek_v2"
    assert (draft["q_lora_rank"], draft["kv_lora_rank"], draft["qk_rope_head_dim"]) == (16, 512, 64)
    assert draft["fc_norm"] is True and draft["norm_output"] is True and draft["num_hidden_layers"] == 1


@pytest.mark.skipif(importlib.util.find_spec("torchspec") is None, reason=TORCHSPEC_MISSING)
@pytest.mark.parametrize("preset", ["eagle3", "eagle31", "eagle31-mla"])
def test_torchspec_reads_the_config_and_builds_the_drafter(tmp_path, preset):
    from omegaconf.errors import InterpolationKeyError
    from torchspec import AutoDraftModelConfig, AutoEagle3DraftModel
    from torchspec.config.train_config import config_to_flat_args, load_config
    from torchspec.training.lr_scheduler import LRSchedulerWithWarmup
    from transformers import LlamaConfig

    from lab.schedule import warmup_cosine

    target = tmp_path / "target"
    LlamaConfig(
        vocab_size=1000,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=8,
        num_attention_heads=4,
        max_position_embeddings=8192,
    ).save_pretrained(target)
    data = tmp_path / "conversations.jsonl"
    data.write_text(json.dumps({"conversations": [{"role": "user", "content": "hi"}]}) + "\n")
    preset, _, attention = preset.partition("-")
    mla = ["attention=mla", "drafter.q_lora_rank=32"] if attention else []
    args = [f"drafter={preset}", "data=code", "target=hf", f"target.path={target}", "drafter.aux_layers=[2,4,7]", *mla]
    rc, out = export(tmp_path, *args, "train.ttt_length=4", "--data", str(data))
    assert rc == 0
    flat = config_to_flat_args(load_config(config_path=str(out / "train.yaml")))
    assert (flat.ttt_length, flat.aux_hidden_states_layers, flat.target_model_path) == (4, [1, 3, 6], str(target))
    assert flat.ploss_weights == pytest.approx([0.8**i for i in range(4)]) and flat.train_data_path == str(data)
    model = AutoEagle3DraftModel.from_config(AutoDraftModelConfig.from_file(flat.draft_model_config))
    fc_norm = preset == "eagle31"
    assert (model.fc_norm is not None, model.norm_output) == (fc_norm, fc_norm)
    assert len(model.fc_norm or [None] * 3) == 3 and model.fc.in_features == 3 * 128
    if attention:  # TorchSpec's MLA drafter, at the dims the JSON gives (512 + 64 latent, rank-32 query)
        attn = model.midlayer.self_attn
        assert type(model).__name__ == "Eagle3DeepseekV2ForCausalLM" and attn.q_a_proj.out_features == 32
        assert attn.kv_a_proj_with_mqa.weight.shape == (512 + 64, 2 * 128) and attn.o_proj.in_features == 4 * 32
    # TorchSpec's schedule is ours from the end of the warm-up on
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=flat.learning_rate)
    warmup = int(flat.warmup_ratio * flat.num_train_steps)
    sched = LRSchedulerWithWarmup(opt, flat.learning_rate, flat.num_train_steps, warmup, min_lr=flat.min_lr)
    cfg = compose(args)
    for step in range(flat.num_train_steps):
        if step >= warmup:
            assert sched.get_lr()[0] == pytest.approx(
                warmup_cosine(step, cfg.train.steps, cfg.train.warmup_steps, cfg.train.lr, cfg.train.min_lr_ratio)
            )
        opt.step()
        sched.step()
    # without --data, TorchSpec stops at its config, naming what is missing
    rc, out = export(tmp_path, *args, name="no_data")
    with pytest.raises(InterpolationKeyError, match="FILL_IN_train_data_path"):
        load_config(config_path=str(out / "train.yaml"))
