"""Composing a config: `configs/` and the Hydra overrides of a command merged onto the schema
(lab/config), `eval.suites=null` resolved, then checked (lab/config/validation.py's `validate`). Hydra's and
OmegaConf's multi-line errors become one ConfigError line naming the key and what is expected there.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from lab.config import SUITES_FOR_DATA, Config, ConfigError
from lab.config.rules import expected_got, expected_words, strip_optional
from lab.config.validation import validate

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"  # the Hydra config groups

_registered = False


def register_schemas() -> None:
    """Put the schema into Hydra's ConfigStore (once per process)."""
    global _registered
    if _registered:
        return
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    _registered = True


def compose(overrides: list[str] | None = None, config_name: str = "config") -> DictConfig:
    """Compose `configs/config.yaml` with Hydra overrides and validate it.

    Raises ConfigError with a one-line message on any problem.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_schemas()
    overrides = list(overrides or [])
    _check_bool_overrides(overrides)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            cfg = hydra_compose(config_name=config_name, overrides=overrides)
    except Exception as exc:  # Hydra/OmegaConf errors are multi-line; reduce to one line
        raise _one_line_error(exc, overrides) from None
    if cfg.eval.suites is None:
        cfg.eval.suites = [s for s in SUITES_FOR_DATA[cfg.data.source.value] if s in cfg.suites]
    validate(cfg)
    return cfg


def _one_line_error(exc: Exception, overrides: list[str]) -> ConfigError:
    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

    cause = exc.__cause__ or exc.__context__ or exc
    key = getattr(cause, "full_key", None) or _override_key(str(exc), overrides)
    first = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)):
        parent = key.rsplit(".", 1)[0] if "." in key else ""
        # the override's own key where it goes below the unknown one (`a.b=1` says `a.b`)
        key = next((k for k in _override_keys(overrides) if k.startswith(f"{key}.")), key)
        return ConfigError(key, f"unknown config key; allowed under '{parent or '<root>'}': {_known_keys(parent)}")
    if isinstance(cause, ValidationError) and "expected one of" in first:
        return ConfigError(key, first)
    if isinstance(cause, OmegaConfBaseException) and schema_type(key) is not None:
        # a value of the wrong type: say what the schema expects there
        given = {k: o.split("=", 1)[1] for k, o in zip(_override_keys(overrides), overrides, strict=True) if "=" in o}
        value = given.get(key, getattr(cause, "value", None))
        return ConfigError(key, expected_got(expected_words(schema_type(key)), value))
    if isinstance(exc, MissingConfigException) and "Could not find '" in str(exc):
        group = str(exc).split("Could not find '")[1].split("/")[0]
        return ConfigError(group, f"{first.split(': ', 1)[-1]}; available: {', '.join(_group_options(group))}")
    bad = _bad_override(overrides, exc)
    if isinstance(exc, OverrideParseException) or isinstance(cause, OverrideParseException) or bad is not None:
        shown = bad if bad is not None else key
        detail = re.sub(r" expecting \{.*", "", first.split(": ", 1)[-1] if shown in first else first)
        return ConfigError(shown, f"not a valid override ({detail}); {_OVERRIDE_EXPECTED}")
    return ConfigError(key, f"{first}; {_OVERRIDE_EXPECTED}")


_BOOL_WORDS = ("true", "false", "yes", "no", "on", "off")


def _check_bool_overrides(overrides: list[str]) -> None:
    """A true/false key given anything else: OmegaConf would take any integer for true (`eval.probes=2`)."""
    for o in overrides:
        key, _, value = o.lstrip("+").partition("=")
        if _ and schema_type(key) is bool and value.strip().strip("'\"").lower() not in _BOOL_WORDS:
            raise ConfigError(key, expected_got("true or false", value))


_OVERRIDE_EXPECTED = (
    "expected key=value (e.g. train.steps=200), group=option (drafter=eagle31), +key=value for a key the config "
    "lacks or ~key to drop one"
)


def _override_keys(overrides: list[str]) -> list[str]:
    return [o.split("=", 1)[0].lstrip("+~") for o in overrides]


def _bad_override(overrides: list[str], exc: Exception) -> str | None:
    """The override Hydra could not parse or apply, where the error names it or it has no key."""
    text = str(exc)
    for o in overrides:
        k = o.split("=", 1)[0]
        if "=" not in o.lstrip("~") or not k.lstrip("+~") or o.count("=") > 1 and "==" in o:
            return o
        if (o.startswith("+") and "append" in text and k[1:] in text) or (o.startswith("~") and "delete" in text):
            return o
    return None


def schema_type(key: str) -> Any:
    """The schema's type of a dotted key (`eval.num_speculative_tokens[0]`: an item's, `suites.NAME.kind`: a
    suite's), or None for a key the schema does not declare."""
    tp: Any = Config
    for part in filter(None, re.split(r"\.|(\[\d+\])", key)):
        tp = strip_optional(tp)
        if part.startswith("["):
            if typing.get_origin(tp) is not list:
                return None
            tp = typing.get_args(tp)[0]
        elif typing.get_origin(tp) is dict:
            tp = typing.get_args(tp)[1]
        elif dataclasses.is_dataclass(tp):
            tp = typing.get_type_hints(tp).get(part)
            if tp is None:
                return None
        else:
            return None
    return tp


def _known_keys(node: str) -> str:
    schema: Any = Config
    for part in filter(None, node.split(".")):
        schema = typing.get_type_hints(schema).get(part)
        if not dataclasses.is_dataclass(schema):
            return "(none)"
    return ", ".join(sorted(f.name for f in dataclasses.fields(schema)))


def _override_key(text: str, overrides: list[str]) -> str:
    for ov in overrides:
        key = ov.split("=", 1)[0].lstrip("+~")
        if key and key in text:
            return key
    return "overrides"


def _group_options(group: str) -> list[str]:
    folder = CONFIG_DIR / group
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []
