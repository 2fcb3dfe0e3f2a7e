"""The one rule engine for every value a user writes: the config schema (lab/config) and the schema of a
study's spec files (lab/sweep/spec_schema.py) declare each field's rules with `checked`; `problem` applies them,
`words` says what a good value is, and `expected_got` is the one form of the error about a bad value,
`expected WHAT, got VALUE` (the caller puts the key, and the file, in front: lab/config/validation.py's `check_rules`
for a config, lab/sweep/spec_reader.py for a spec file).

A field's rules are its metadata:

- `min` / `above` / `max`: bounds of a number, or of each number of a list (a bounded float must also be
  finite);
- `nonempty`: a string with more than blanks, a non-empty list or mapping;
- `distinct`: a list's items; `pair`: a [low, high] range, low <= high;
- `check`: any other test of the value (a function: is it good?);
- `expected`: what a good value is, in words, where the words made from the type and the bounds would not
  say it all (then they are also said of a value of the wrong type);
- `path`: the value names a file or folder (`PathRule`: read or written, what is read there, and when). Such a
  value must be a non-empty string; what is on the disk there is checked where the command reads it, before any
  work (lab/preflight.py `check_paths`, the CLI's path arguments), with `path_problem` for its kind (a file, a
  folder, an output that may be missing) and a reader of its content (`PathRule.reads`), each in one line.

A null value keeps every rule. This module imports nothing of `lab`, so that both schemas (the config's and
the spec files') can use it.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import stat
import types
import typing
from collections.abc import Callable, Mapping
from enum import Enum
from pathlib import Path
from typing import Any

from omegaconf import MISSING

SEED_MAX = 2**32 - 1  # numpy's generators take seeds in 0..2**32 - 1
ABSENT = object()  # a required key that is not there: shown as "nothing"

BOUNDS = ("min", "above", "max", "nonempty", "distinct", "pair")

# ------------------------------------------------------------------------------------------------ paths

# what a path names: read (`file`, `dir`: it must be there) or written (`out-file`, `out-dir`: made if missing,
# but never where a file of the other kind is, nor under a file)
PATH_KINDS = {"file": "a file", "dir": "a folder", "out-file": "a file", "out-dir": "a folder"}
# what is read there, in words (lab/preflight.py reads each before any work)
PATH_READS = {
    "": "",
    "jsonl": "a JSONL file (one JSON object a line, UTF-8)",
    "yaml": "a YAML file (UTF-8)",
    "gguf": "a GGUF model file",
    "hf-model": "a Hugging Face model folder (config.json, safetensors weights, a tokenizer)",
    "checkpoint": "a drafter checkpoint folder (config.json + model.safetensors)",
    "archive": "a .tar.gz written by `lab study export`",
    "sqlite": "a SQLite database file",
    "journal": "an Optuna journal file (JSON lines)",
}


@dataclasses.dataclass(frozen=True)
class PathRule:
    """A value that names a file or folder: its `kind` (PATH_KINDS), what the workbench reads there (`reads`, a
    key of PATH_READS), `when` it is read (sibling keys' values, e.g. {"kind": "hf"} for target.path; `!X`: a
    value that does not start with X), the `prefix` of a value before its path (tracking.uri's `sqlite:///`; a
    value without it, or any other URL, names no file here), the `verb` that reads it (`run`: a run and every
    study's trials, so the run's preflight checks it before any work) and the words `what` it is (else the
    kind's and the reads')."""

    kind: str
    reads: str = ""
    when: Mapping[str, str] = dataclasses.field(default_factory=dict)
    prefix: str = ""
    verb: str = "run"
    what: str = ""

    def __post_init__(self) -> None:
        if self.kind not in PATH_KINDS or self.reads not in PATH_READS:
            raise TypeError(f"unknown path rule {self.kind!r} / {self.reads!r}; kinds: {', '.join(PATH_KINDS)}")

    @property
    def output(self) -> bool:
        return self.kind.startswith("out-")

    @property
    def thing(self) -> str:
        """What is there, in words (`a SQLite database file`)."""
        return self.what or PATH_READS[self.reads] or PATH_KINDS[self.kind]

    def words(self) -> str:
        """What a good path is, in words (an output's: `..., made if missing`)."""
        return f"{self.thing}, made if missing" if self.output else self.thing

    def applies(self, sibling: Callable[[str], Any]) -> bool:
        """Whether the rule's `when` holds, given the values of the keys beside the field (`sibling(name)`)."""
        for name, wanted in self.when.items():
            value = sibling(name)
            said = str(getattr(value, "value", value))
            negated = wanted.startswith("!")
            if (negated and said.startswith(wanted[1:])) or (not negated and said != wanted):
                return False
        return True

    def path(self, value: Any) -> str | None:
        """The path a value names under this rule, or None (null, another URL, no prefix)."""
        if value is None:
            return None
        text = str(value)
        if self.prefix:
            return text[len(self.prefix) :] if text.startswith(self.prefix) else None
        return None if "://" in text else text


def path_rules(rules: Mapping[str, Any]) -> tuple[PathRule, ...]:
    """A field's path rules (none for a field that names no file)."""
    return tuple(rules.get("path", ()))


def _as_path_rules(path: str | PathRule | tuple[PathRule, ...]) -> tuple[PathRule, ...]:
    if isinstance(path, str):
        return (PathRule(path),)
    if isinstance(path, PathRule):
        return (path,)
    return tuple(path)


MISSING_INPUT = "is missing"  # how path_problem says a missing input


def path_problem(rule: PathRule, path: str, missing: bool = True) -> str | None:
    """What is wrong with `path` for a rule's kind, from the file system alone (not the content), said after
    the path (`'PATH' is a directory, not a file`), or None. A missing output is fine (it is made); one under a
    file, a broken symlink or a symlink loop is not. `missing=False`: a missing input is not said here either
    (its reader says it in its own words)."""
    if not path.strip():
        return "names no file or folder"
    p = Path(path)
    try:
        st = os.stat(p)
    except OSError as exc:
        problem = _missing_problem(rule, p, exc)
        return None if problem and problem.startswith(MISSING_INPUT) and not missing else problem
    is_dir = stat.S_ISDIR(st.st_mode)
    if rule.kind in ("file", "out-file") and is_dir:
        return "is a directory, not a file"
    if rule.kind in ("dir", "out-dir") and not is_dir:
        return "is a file, not a folder"
    if rule.kind == "file" and not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if rule.output and not os.access(p, os.W_OK | (os.X_OK if is_dir else 0)):
        return "is not writable"
    if not rule.output and not os.access(p, os.R_OK | (os.X_OK if is_dir else 0)):
        return "cannot be read (permission denied)"
    return None


def _missing_problem(rule: PathRule, p: Path, exc: OSError) -> str | None:
    if exc.errno == errno.ELOOP:
        return "is a symlink loop"
    if exc.errno == errno.ENOTDIR:
        above = next((a for a in p.parents if a.is_file()), None)
        return f"is under '{above}', which is a file, not a folder" if above else "is under a file, not a folder"
    if exc.errno != errno.ENOENT:
        return f"cannot be reached ({exc.strerror or exc})"
    if p.is_symlink():
        return f"is a broken symlink (to '{os.readlink(p)}')"
    if not rule.output:
        return MISSING_INPUT if rule.kind == "file" else f"{MISSING_INPUT} (no such folder)"
    for above in p.parents:  # the first part that is there must be a folder the output can be made in
        if above.is_symlink() and not above.exists():
            return f"is under '{above}', a broken symlink"
        if above.exists():
            if not os.access(above, os.W_OK | os.X_OK):
                return f"cannot be made: '{above}' is not writable"
            return None
    return None


def checked(
    default: Any = MISSING,
    *,
    factory: Any = None,
    expected: str | None = None,
    check: Callable[[Any], bool] | None = None,
    path: str | PathRule | tuple[PathRule, ...] | None = None,
    **bounds: Any,
) -> Any:
    """A dataclass field whose value (once its type is right, and unless null) also keeps its rules: `bounds`
    (`min`, `above`, `max`, `nonempty`, `distinct`, `pair`), `check`, the words `expected`, and `path`: it names a
    file or folder (a PATH_KINDS name, a `PathRule`, or several of them; see the module's docstring). The rules
    are the schema's own, one place that the errors and every reader of the rules (the input fuzzer) share."""
    unknown = sorted(set(bounds) - set(BOUNDS))
    if unknown:
        raise TypeError(f"unknown rules {unknown}; known: {', '.join(BOUNDS)}")
    rules = dict(bounds)
    if expected is not None:
        rules["expected"] = expected
    if check is not None:
        rules["check"] = check
    if path is not None:
        rules["path"] = _as_path_rules(path)
        rules["nonempty"] = True  # an empty path would name the current folder, unsaid
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
        if not any(k in rules for k in ("min", "above", "max")):
            return False
        # a bounded list holds numbers: an item that is not one (OmegaConf lets `[[1]]` through a list[int]) breaks it
        return any(_number_problem(rules, v) if _is_number(v) else True for v in value)
    if _is_number(value):
        return _number_problem(rules, value)
    return False


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


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
        text = "a non-empty path" if rules.get("path") else "a non-empty string"
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
