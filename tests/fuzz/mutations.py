"""The mutations of a value by its type: the classes a type admits (`mutation_classes`), one value of a class
(`mutation`, the seed picking among several) and that value in Hydra's override grammar."""

from __future__ import annotations

import dataclasses
import math
import random
import re
import types
import typing
from enum import Enum
from typing import Any

from lab.config.rules import strip_optional

HUGE = 10**12


def mutation_classes(tp: Any) -> list[str]:
    base = strip_optional(tp)
    origin = typing.get_origin(base)
    if base is typing.Any:
        return []
    if origin is list:
        return ["wrong type", "empty list", "duplicates"]
    if origin is dict:
        return ["wrong type", "empty mapping"]
    if isinstance(base, type) and issubclass(base, Enum):
        return ["wrong type", "unknown member"]
    if base is bool or dataclasses.is_dataclass(base):
        return ["wrong type"]
    if base is str:
        return ["wrong type", "empty"]
    return ["wrong type", "below range", "huge"]  # int, float, int | float


def mutation(tp: Any, kind: str, current: Any, rng: random.Random) -> Any:
    """The value (Python data) of one mutation of a value of type `tp`; `current` is a valid value, if known."""
    base = strip_optional(tp)
    origin, args = typing.get_origin(base), typing.get_args(base)
    number = base is float or origin in (typing.Union, types.UnionType)
    if kind == "wrong type":
        if origin is list:
            return rng.choice(["text", {"a": 1}, [[1]] if args[0] is not typing.Any else {"a": 1}])
        if origin is dict:
            return rng.choice(["text", 5, ["a"]])
        if isinstance(base, type) and issubclass(base, Enum):
            return rng.choice([[1], 3])
        if base is bool:
            return rng.choice(["maybe", [True], 2])
        if base is str:
            return rng.choice([["a", "b"], {"a": 1}])
        if dataclasses.is_dataclass(base):
            return rng.choice([5, ["x"]])
        return rng.choice(["abc", [1]] if number else ["abc", 1.5, [1]])
    if kind == "empty list":
        return []
    if kind == "empty mapping":
        return {}
    if kind == "duplicates":
        sample = list(current)[:1] if current else [3] if args[0] is int else ["x"]
        return sample * 2
    if kind == "unknown member":
        return "nosuch"
    if kind == "empty":
        return ""
    if kind == "below range":
        return rng.choice([-1.0, 0.0] if number else [-1, 0])
    if kind == "huge":
        return rng.choice([1e300, math.nan, math.inf]) if number else HUGE
    raise AssertionError(kind)


def hydra_value(value: Any) -> str:
    """A value in Hydra's override grammar."""
    if isinstance(value, str):
        return value if re.fullmatch(r"[A-Za-z_][\w./-]*", value) else f"'{value}'"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else "inf"
    if isinstance(value, list):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{hydra_value(v)}" for k, v in value.items()) + "}"
    return str(value)
