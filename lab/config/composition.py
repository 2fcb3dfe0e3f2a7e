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
    _check_values(overrides)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            cfg = hydra_compose(config_name=config_name, overrides=overrides)
    except Exception as exc:  # Hydra/OmegaConf errors are multi-line; reduce to one line
        raise _one_line_error(exc, overrides) from None
    unknown = unknown_key(cfg)
    if unknown is not None:  # `+key=` and `++key=` add a key whatever the schema says
        raise unknown_key_error(unknown)
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
        # the override's own key where it goes below the unknown one (`a.b=1` says `a.b`)
        key = next((k for k in _override_keys(overrides) if k.startswith(f"{key}.")), key)
        return unknown_key_error(key)
    if isinstance(cause, ValidationError) and "not a subclass of SuiteConfig" in first:
        given = next((k for k in _override_keys(overrides) if k.startswith("suites.")), "suites")
        suite = ".".join(given.split(".")[:2])
        return ConfigError(
            suite,
            f"unknown suite; configured: {', '.join(_group_options('suite'))} (a new suite is configs/suite/NAME.yaml)",
        )
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


def _check_values(overrides: list[str]) -> None:
    """A value whose spelling another reader would take for another type, refused before Hydra reads it:
    a true/false key takes only true or false (OmegaConf takes any integer for true, YAML 1.1 takes yes, no, on
    and off), an integer no leading zero (YAML 1.1 reads 010 as 8, Hydra as 10), and a string key an unquoted
    value that Hydra would turn into a number or a bool first (`study=1e3` would be "1000.0")."""
    for o in overrides:
        key, eq, value = o.lstrip("+").partition("=")
        text = value.strip()
        tp = strip_optional(schema_type(key)) if eq else None
        if tp is None or text[:1] in ("'", '"') or text == "null" or _is_sweep(text):
            continue  # null: OmegaConf says whether the key takes it
        if tp is bool and text.lower() not in ("true", "false"):
            raise ConfigError(key, expected_got("true or false", value))
        if tp is int and re.fullmatch(r"[+-]?0[0-9_]+", text):
            raise ConfigError(key, expected_got("an integer without leading zeros", value))
        if tp is str and _hydra_value(text) != text:
            raise ConfigError(
                key, f"Hydra reads {value!r} as {_hydra_value(text)!r}; expected it quoted: {key}='{text}'"
            )


def _is_sweep(text: str) -> bool:
    """A multirun's value list or function (`a,b`, `range(1,3)`, `choice(...)`), which the multirun expands."""
    return "," in text and not text.startswith("[") or re.match(r"(range|choice|interval|glob)\(", text) is not None


def _hydra_value(text: str) -> str:
    """The string that Hydra's override parser and OmegaConf make of an unquoted value given to a string key."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        value = OverridesParser.create().parse_override(f"k={text}").value()
    except Exception:  # not an override Hydra parses: its own error says so later
        return text
    return text if isinstance(value, str) else str(value)


_OVERRIDE_EXPECTED = "expected key=value (e.g. train.steps=200) or group=option (drafter=eagle31)"


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


def unknown_key(cfg: Any, schema: Any = Config, prefix: str = "") -> str | None:
    """The first key of the composed `cfg` that the schema lacks (a suite's keys are SuiteConfig's), or None."""
    hints = typing.get_type_hints(schema)
    for name in cfg:
        key = f"{prefix}{name}"
        if name not in hints:
            return key
        tp = strip_optional(hints[name])
        node = cfg[name]
        if dataclasses.is_dataclass(tp) and node is not None:
            found = unknown_key(node, tp, f"{key}.")
        elif typing.get_origin(tp) is dict and dataclasses.is_dataclass(typing.get_args(tp)[1]):
            found = next((u for n in node if (u := unknown_key(node[n], typing.get_args(tp)[1], f"{key}.{n}."))), None)
        else:
            found = None
        if found is not None:
            return found
    return None


def unknown_key_error(key: str) -> ConfigError:
    """`KEY: unknown config key; nearest: ...; allowed under 'PARENT': ...`: the nearest keys by spelling, those
    beside it first, then any in the schema (a key given at the wrong level, `ttt_length=5`, is found too)."""
    import difflib

    parent = key.rsplit(".", 1)[0] if "." in key else ""
    if parent == "suites":
        suites = ", ".join(_group_options("suite"))
        return ConfigError(key, f"unknown suite; configured: {suites} (a new suite is configs/suite/NAME.yaml)")
    leaf = key.rsplit(".", 1)[-1]
    beside = [
        f"{parent}.{k}" if parent else k for k in difflib.get_close_matches(leaf, _known_keys(parent), cutoff=0.75)
    ]
    anywhere = [k for k in _schema_keys(Config) if difflib.get_close_matches(leaf, [k.rsplit(".", 1)[-1]], cutoff=0.8)]
    near = list(dict.fromkeys(beside + anywhere))[:3]
    said = f"; nearest: {', '.join(near)}" if near else ""
    allowed = ", ".join(_known_keys(parent)) or "(none)"
    return ConfigError(key, f"unknown config key{said}; allowed under '{parent or '<root>'}': {allowed}")


def _schema_keys(schema: Any, prefix: str = "") -> list[str]:
    """Every dotted key of the schema (a suite's keys as `suites.NAME.KEY`)."""
    out = []
    for name, tp in typing.get_type_hints(schema).items():
        tp = strip_optional(tp)
        if dataclasses.is_dataclass(tp):
            out += _schema_keys(tp, f"{prefix}{name}.")
        elif typing.get_origin(tp) is dict and dataclasses.is_dataclass(typing.get_args(tp)[1]):
            out += _schema_keys(typing.get_args(tp)[1], f"{prefix}{name}.NAME.")
        else:
            out.append(f"{prefix}{name}")
    return out


def _known_keys(node: str) -> list[str]:
    schema: Any = Config
    parts = [p for p in node.split(".") if p]
    while parts:
        tp = strip_optional(typing.get_type_hints(schema).get(parts.pop(0)))
        if typing.get_origin(tp) is dict and parts:  # suites.NAME: a suite's keys
            tp, _ = typing.get_args(tp)[1], parts.pop(0)
        if not dataclasses.is_dataclass(tp):
            return []
        schema = tp
    return sorted(f.name for f in dataclasses.fields(schema))


def _override_key(text: str, overrides: list[str]) -> str:
    for ov in overrides:
        key = ov.split("=", 1)[0].lstrip("+~")
        if key and key in text:
            return key
    return "overrides"


def _group_options(group: str) -> list[str]:
    folder = CONFIG_DIR / group
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []
