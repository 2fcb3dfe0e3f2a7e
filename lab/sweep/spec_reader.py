"""Reading a study's spec file (`sweeps/NAME.yaml`, `experiments/NAME.yaml`): the YAML, then its check against
the file's schema (lab/sweep/spec_schema.py) with OmegaConf's structured configs.

Every problem is one ConfigError line naming the file and the key:
`FILE: KEY: expected WHAT, got VALUE` for a value of the wrong type, out of range or not one of an enum's,
or a required key that is missing (`got nothing`), and `FILE: KEY: unknown key; allowed: ...`.
The CLI prints it as `error: ...` and exits 2.

OmegaConf converts and validates the values of each mapping of the file against its dataclass; this module
walks the mappings itself (so that a key inside a list or a mapping of mappings is named exactly, which
OmegaConf's own messages do not always do) and applies the schema's rules with lab/config/rules.py's engine, the one the
config's `check_rules` uses, in the same words: `expected WHAT, got VALUE`.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from enum import Enum
from pathlib import Path
from typing import Any

import yaml
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lab.config import ConfigError, rules
from lab.config.rules import ABSENT, is_optional, strip_optional


def read_yaml(path: Path, where: str) -> Any:
    """The parsed YAML file; ConfigError naming `where` and the line when it cannot be read or parsed."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(where, "not a text file; expected YAML (UTF-8)") from None
    except OSError as exc:
        raise ConfigError(where, f"cannot be read ({exc.strerror or exc}); expected a readable YAML file") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        at = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        raise ConfigError(where, f"not valid YAML ({at}{problem})") from None


def check(schema: type, data: Any, where: str) -> dict[str, Any]:
    """`data` (a parsed spec file) checked against the dataclass `schema`: plain dicts and lists with every
    default filled in, enums as their values. Raises ConfigError (`where`: the file, as the user named it)."""
    return _mapping(schema, data, where, "")


def bad(where: str, key: str, expected: str, value: Any) -> ConfigError:
    """The error about a bad value: `WHERE: KEY: expected EXPECTED, got VALUE`."""
    return ConfigError(f"{where}: {key}" if key else where, rules.expected_got(expected, value))


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _mapping(schema: type, raw: Any, where: str, path: str) -> dict[str, Any]:
    shorthand = getattr(schema, "shorthand", None)
    value = shorthand(raw) if shorthand is not None else raw
    short = not isinstance(raw, dict)  # a short form: its errors are said of its own key, with its own value
    if not isinstance(value, dict):
        raise bad(where, path, schema.EXPECTED, raw)
    fields = {f.name: f for f in dataclasses.fields(schema)}
    hints = typing.get_type_hints(schema)
    for key in value:
        if key not in fields:
            raise ConfigError(f"{where}: {_join(path, key)}", f"unknown key; allowed: {', '.join(sorted(fields))}")

    def key_of(name: str) -> str:
        return path if short else _join(path, name)

    def fail(name: str, given: Any) -> ConfigError:
        return bad(where, key_of(name), rules.words(hints[name], fields[name].metadata), raw if short else given)

    nested: dict[str, Any] = {}
    flat: dict[str, Any] = {}
    for name, f in fields.items():
        if name not in value:
            if f.default is MISSING:
                raise fail(name, ABSENT)
            continue
        inner = _dataclass_in(hints[name])
        if inner is not None:
            nested[name] = _nested(
                hints[name], inner, value[name], where, key_of(name), lambda n=name: fail(n, value[n])
            )
        else:
            flat[name] = value[name]
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), flat)
    except OmegaConfBaseException:
        for name in flat:  # which key it was: OmegaConf does not always say
            try:
                OmegaConf.merge(OmegaConf.structured(schema), {name: flat[name]})
            except OmegaConfBaseException:
                raise fail(name, flat[name]) from None
        raise  # not one key's value alone (not known to happen)
    out = typing.cast(dict, OmegaConf.to_container(merged, resolve=False, enum_to_str=True))
    for name in flat:
        if not _typed(hints[name], out[name]):  # an interpolation (`${...}`) where no string belongs
            raise fail(name, flat[name])
        if strip_optional(hints[name]) is bool and flat[name] is not None and not isinstance(flat[name], bool):
            raise fail(name, flat[name])  # OmegaConf would take any integer for true
    out.update(nested)
    for name in value:
        if rules.problem(fields[name].metadata, out[name]):
            raise fail(name, value[name])
    return out


def _nested(tp: Any, inner: type, raw: Any, where: str, path: str, fail: typing.Callable[[], ConfigError]) -> Any:
    """A field holding mappings of the schema (`inner`): one, a list of them, or a mapping of names to them."""
    if raw is None and is_optional(tp):
        return None
    origin = typing.get_origin(strip_optional(tp))
    if origin is list:
        if not isinstance(raw, list):
            raise fail()
        return [_mapping(inner, item, where, f"{path}[{i}]") for i, item in enumerate(raw)]
    if origin is dict:
        if not isinstance(raw, dict):
            raise fail()
        return {str(k): _mapping(inner, item, where, _join(path, k)) for k, item in raw.items()}
    return _mapping(inner, raw, where, path)


def _dataclass_in(tp: Any) -> type | None:
    """The dataclass a field holds (itself, or as the items of a list or the values of a mapping), or None."""
    tp = strip_optional(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is list:
        tp = args[0]
    elif origin is dict:
        tp = args[1]
    return tp if dataclasses.is_dataclass(tp) else None


def _typed(tp: Any, value: Any) -> bool:
    """Whether a converted value is of type `tp` (enums by value): OmegaConf passes an interpolation string
    through any type, and a spec file has no use for one outside its strings."""
    if tp is Any:
        return True
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_typed(a, value) for a in args)
    if tp is type(None):
        return value is None
    if origin is list:
        return isinstance(value, list) and all(_typed(args[0], v) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(_typed(args[1], v) for v in value.values())
    if isinstance(tp, type) and issubclass(tp, Enum):
        return value in {e.value for e in tp}
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp)
