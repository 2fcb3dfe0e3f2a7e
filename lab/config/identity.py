"""What a run is: its config flattened into MLflow params (`flatten`), its identity (`config_hash`, the tag a
study finds a finished point by, and `CONFIG_HASH_SCHEME`) and its arm's name (`arm_name`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import typing
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lab.config import Config, SuiteConfig


def to_container(cfg: DictConfig) -> dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)  # type: ignore[return-value]


def flatten(cfg: DictConfig) -> dict[str, str]:
    """`{"drafter.fc_norm": "per_layer", ...}`: the MLflow params of a run."""
    out: dict[str, str] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            out[prefix] = json.dumps(node) if isinstance(node, list) else str(node)

    walk("", to_container(cfg))
    return out


# Bumped only when a default's meaning changes (a run that left the key at its default computed something
# else then): config_hash covers the values that differ from the schema's defaults, so a key added with a
# default leaves every recorded hash unchanged. Runs carry it as the tag `config_hash_scheme`.
# 1: a hash of every key; 2: the changed values; 3: evaluation stops at the target's eos
CONFIG_HASH_SCHEME = 3
_NOT_SET = object()
# keys taken out of the schema, with the default they had: a stored run that recorded them at it keeps its hash
# (`train.autocast_bf16`: the drafter's precision is one knob, the global `dtype`)
RETIRED = {"train": {"autocast_bf16": False}}


def _schema_defaults(data: dict[str, Any]) -> dict[str, Any]:
    """The schema's default of every key in `data` (a run's config as a container)."""
    fields = {f.name: f for f in dataclasses.fields(Config)}
    hints = typing.get_type_hints(Config)
    suite_default = to_container(OmegaConf.structured(SuiteConfig))
    defaults: dict[str, Any] = {}
    for name, value in data.items():
        if name == "suites":
            defaults[name] = dict.fromkeys(value, suite_default)
        elif dataclasses.is_dataclass(hints.get(name)):
            defaults[name] = {**RETIRED.get(name, {}), **to_container(OmegaConf.structured(hints[name]))}
        else:
            defaults[name] = fields[name].default if name in fields else _NOT_SET
    return defaults


def _changed(value: Any, default: Any) -> Any:
    """The parts of `value` that differ from `default` (dicts key by key), or _NOT_SET when none does."""
    if isinstance(value, dict) and isinstance(default, dict):
        out = {k: c for k, v in value.items() if (c := _changed(v, default.get(k, _NOT_SET))) is not _NOT_SET}
        return out or _NOT_SET
    return _NOT_SET if value == default else value


def config_hash(cfg: DictConfig | dict) -> str:
    """Identity of what a run computes: the values that differ from the schema's defaults (not where the run
    is tracked, how it is labelled, on which device or GPUs, with how many threads or which KV cache it computes,
    how often it saves progress or whether it may reuse a drafter trained alike), and the hash scheme."""
    data = to_container(cfg) if isinstance(cfg, DictConfig) else dict(cfg)
    for key in ("tracking", "study", "arm", "cache_dir", "threads", "device", "gpus", "kv_cache"):
        data.pop(key, None)
    for key in ("resume_every", "checkpoint_every", "reuse"):  # checkpoint_every: resume_every's old name
        data.get("train", {}).pop(key, None)
    changed = _changed(data, _schema_defaults(data))
    identity = {"scheme": CONFIG_HASH_SCHEME, "config": {} if changed is _NOT_SET else changed}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]


def arm_name(cfg: DictConfig) -> str:
    return cfg.arm or cfg.drafter.name
