"""The one rule engine for every value a user writes: the config schema (lab/config.py) and the schema of a
study's spec files (lab/sweep/schema.py) declare each field's rules with `checked`; `problem` applies them,
`words` says what a good value is, and `expected_got` is the one form of the error about a bad value,
`expected WHAT, got VALUE` (the caller puts the key, and the file, in front: lab/validation.py's `check_rules`
for a config, lab/sweep/specfile.py for a spec file).

A field's rules are its metadata:

- `min` / `above` / `max`: bounds of a number, or of each number of a list (a bounded float must also be
  finite);
- `nonempty`: a string with more than blanks, a non-empty list or mapping;
- `distinct`: a list's items; `pair`: a [low, high] range, low <= high;
- `check`: any other test of the value (a function: is it good?);
- `expected`: what a good value is, in words, where the words made from the type and the bounds would not
  say it all (then they are also said of a value of the wrong type).

A null value keeps every rule. This module imports nothing of `lab` (tests/test_layers.py checks), so that
both schemas use it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from collections.abc import Callable
from enum import Enum
from typing import Any

from omegaconf import MISSING

SEED_MAX = 2**32 - 1  # numpy's generators take seeds in 0..2**32 - 1
ABSENT = object()  # a required key that is not there: shown as "nothing"

BOUNDS = ("min", "above", "max", "nonempty", "distinct", "pair")


def checked(
    default: Any = MISSING,
    *,
    factory: Any = None,
    expected: str | None = None,
    check: Callable[[Any], bool] | None = None,
    **bounds: Any,
) -> Any:
    """A dataclass field whose value (once its type is right, and unless null) also keeps its rules: `bounds`
    (`min`, `above`, `max`, `nonempty`, `distinct`, `pair`), `check`, and the words `expected` (see the module's
    docstring). The rules are the schema's own, so that tests/test_fuzz_input.py and the errors read them
    from there."""
    unknown = sorted(set(bounds) - set(BOUNDS))
    if unknown:
        raise TypeError(f"unknown rules {unknown}; known: {', '.join(BOUNDS)}")
    rules = dict(bounds)
    if expected is not None:
        rules["expected"] = expected
    if check is not None:
        rules["check"] = check
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=rules)
    return dataclasses.field(default=default, metadata=rules)


def problem(rules: typing.Mapping[str, Any], value: Any) -> bool:
    """Whether `value` breaks `rules` (a field's metadata); a null value breaks none."""
    if value is None:
        return False
    check = rules.get("check")
    if check is not None and not check(value):
        return True
    if isinstance(value, str):
        return bool(rules.get("nonempty")) and not value.strip()
    if isinstance(value, dict):
        return bool(rules.get("nonempty")) and not value
    if isinstance(value, list):
        if rules.get("nonempty") and not value:
            return True
        if rules.get("distinct") and len({json.dumps(v, sort_keys=True) for v in value}) != len(value):
            return True
        if rules.get("pair") and (len(value) != 2 or value[0] > value[1]):
            return True
        return any(_number_problem(rules, v) for v in value if isinstance(v, (int, float)))
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return _number_problem(rules, value)
    return False


def _number_problem(rules: typing.Mapping[str, Any], v: float) -> bool:
    if not any(k in rules for k in ("min", "above", "max")):
        return False  # a number without bounds is left as it is
    if not math.isfinite(v):
        return True
    return (
        ("min" in rules and v < rules["min"])
        or ("max" in rules and v > rules["max"])
        or ("above" in rules and v <= rules["above"])
    )


def strip_optional(tp: Any) -> Any:
    """`X` for a type hint `X | None` (or `Optional[X]`); any other hint as it is."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return tp


def is_optional(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp)


_PLURAL = {int: "integers", float: "numbers", str: "strings", bool: "true/false values"}


def expected_words(tp: Any) -> str:
    """What a value of type `tp` is, in words (the config's and the spec files' errors say the same)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        text = "a number" if set(rest) == {int, float} else " or ".join(expected_words(a) for a in rest)
        return f"{text} or null" if len(rest) < len(args) else text
    if origin is list:
        item = args[0]
        return f"a list of {_PLURAL[item]}" if item in _PLURAL else f"a list, each {expected_words(item)}"
    if origin is dict:
        return f"a mapping of name -> {expected_words(args[1])}"
    if isinstance(tp, type) and issubclass(tp, Enum):
        return "one of " + ", ".join(e.value for e in tp)
    if dataclasses.is_dataclass(tp):
        return getattr(tp, "EXPECTED", "a mapping")
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, "any value")


def words(tp: Any, rules: typing.Mapping[str, Any]) -> str:
    """What a good value of type `tp` keeping `rules` is, in words: the rules' own `expected`, else words made
    from the type and the bounds (the type's alone without any)."""
    if rules.get("expected"):
        return rules["expected"]
    if not any(k in rules for k in BOUNDS):
        return expected_words(tp)
    tp, optional = strip_optional(tp), is_optional(tp)
    bound = []
    if "min" in rules and "max" in rules:
        bound.append(f"in {rules['min']}..{rules['max']}")
    elif "min" in rules:
        bound.append(f">= {rules['min']}")
    if "above" in rules:
        bound.append(f"> {rules['above']}" + (f" and <= {rules['max']}" if "max" in rules else ""))
    elif "max" in rules and "min" not in rules:
        bound.append(f"<= {rules['max']}")
    bound_text = " ".join(bound)
    if typing.get_origin(tp) is list:
        item = typing.get_args(tp)[0]
        if rules.get("pair"):
            text = f"[low, high] with {rules.get('min', 0)} <= low <= high"
        else:
            text = "a non-empty list" if rules.get("nonempty") else "a list"
            text += f" of {'distinct ' if rules.get('distinct') else ''}{_PLURAL.get(item, 'values')}"
            text += f" {bound_text}" if bound_text else ""
    elif tp is str:
        text = "a non-empty string"
    else:
        text = f"{'a finite number' if tp is float else 'an integer'}{' ' + bound_text if bound_text else ''}"
    return f"{text} or null" if optional else text


def shown(value: Any) -> str:
    """A value as an error shows it: YAML's words for null and booleans, `nothing` for a missing one, strings
    quoted, at most 80 characters."""
    if value is ABSENT:
        return "nothing"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def expected_got(expected: str, value: Any) -> str:
    """The error about a bad value, after its key: `expected EXPECTED, got VALUE`."""
    return f"expected {expected}, got {shown(value)}"
