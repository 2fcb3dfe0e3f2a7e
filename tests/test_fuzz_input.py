"""Every bad input refused in one line, found by fuzzing the whole surface rather than by a list.

The surface is enumerated, not listed here, so that a new key or option is fuzzed without editing this file:

- config keys: every field of `lab/config.py`'s `Config`, walked recursively (`suites.*` through one configured
  suite, picked by the seed among those the base run can evaluate, and evaluated in the case);
- spec keys: every field of `lab/sweep/schema.py`'s `SweepSpec` and `ExperimentSpec` and of the dataclasses
  they hold (a space's parameter, an objective, the sampler, the pruner, an arm), mutated in a valid spec file;
- options: every verb of `lab.cli.build_parser()` (its subparsers, walked; `VERB worker` where a subparser
  sets `takes_worker`) and every action of each: its options, its positional arguments and its overrides;
- files and folders: every config key with a `path` rule (lab/rules.py `PathRule`), every argument whose type
  has one (lab/cli.py `_path`) and every override a verb takes as a file (`named_files`: `sweep=PATH`), each
  given the paths of its kind (`file_inputs`: missing, empty, binary, truncated, of the other kind, under a
  file, a symlink loop, a model or checkpoint folder with the right names and the wrong contents; for an
  output, those that apply, a path not there yet being good) in a folder of its own outside the store.

Each gets the mutations its type admits: a wrong type; out of range (negative or zero, huge, not finite);
an unknown enum member; an empty list; a list with duplicates; for an option also a missing value, a malformed
one, and for the overrides malformed `key=value` words. Where a class has several values the seed picks one.
The cases are a fixed, seeded set: every key and option, and of the config keys' (key, class) pairs
`CONFIG_EXAMPLES` of them, at least one per key (`LAB_FUZZ_SEED` picks another set, `LAB_FUZZ_EXAMPLES=all`
runs every pair); `test_the_surface_is_covered` prints how many cases a run generates.

How a case is judged. It runs in process through `lab.cli.main`: the same parsing, composition, preflight,
store reachability and verb checks as the command. Every verb calls `lab.cli.validated(verb)` once its checks
have passed, right before its work starts; here that hook raises `Valid`, so a case that passes validation
stops there and counts as running correctly. That is how long work is skipped: no run, study, target build,
report, export or server is ever started (`test_every_verb_reaches_validated` checks that each verb's base
case gets there, so a verb without the hook fails that test instead of starting work). Any other end must be
exit code 2 and exactly one stderr line, `error: ...`, naming the key or option (or the spec file) and saying
what is expected; a traceback, another exit code or a second line fails. A bad file case must end so (reaching
`validated` fails it: its verb's work would start on it), a good one must reach `validated`, and neither may
change anything in its folder (every file case runs; `LAB_FUZZ_FILES=N` runs a seeded N of them, every key
and option at least once; `test_every_file_input_is_fuzzed` prints how many). A seeded sample of failing cases
(and of failing file cases) runs again through the real `lab` command in subprocesses (exit 2, the same one
line). The recorded store
(tests/test_bad_input.py's `recorded` folder, plus a study to report on) must stay exactly as it was: its files
after every test, and its `snapshot` (runs, metrics, params, tags, artifacts, files) at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import traceback
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_bad_input import _overrides, recorded, snapshot  # noqa: F401  (recorded: a fixture)

from lab import cli, track
from lab.composition import compose
from lab.config import Config
from lab.rules import PathRule, path_rules, strip_optional
from lab.sweep import experiment, schema
from lab.validation import ruled_keys

SEED = int(os.environ.get("LAB_FUZZ_SEED", "21"))
_EXAMPLES = os.environ.get("LAB_FUZZ_EXAMPLES", "140")
SUBPROCESS_SAMPLE = 6  # failing cases run again through the real command
FILE_SUBPROCESS_SAMPLE = 2  # and failing file cases
HUGE = 10**12
VALID = "valid"
STORE = "<store>"  # where a case's command takes the overrides that point it at the recorded store
# the words by which an error line says what is expected
EXPECTS = re.compile(
    r"expected|must|allowed|available|required|at least|at most|choose from|needs|only with|only |e\.g\.|"
    r"not a |no such|is a directory|cannot|give "
)


class Valid(Exception):
    """Raised by the replaced `lab.cli.validated`: the case passed every check."""


@dataclass
class Case:
    item: str  # the key or option fuzzed
    kind: str  # the class of mutation
    argv: list[str]  # STORE: the store's overrides; {root}: the store's folder; {specs}: the spec files' folder
    names: tuple[str, ...]  # the error line must name one of these
    spec: tuple[str, str, Any] | None = None  # (sweeps | experiments, file stem, content) to write first
    # a file case: makes its path in a folder of its own (given the store's folder to copy from); {path} in argv
    make: Callable[[Path, Path], Path] | None = None
    good: bool = False  # a file case a command takes (an output not there yet): it must pass validation

    def __str__(self) -> str:
        return f"{self.item} [{self.kind}] `lab {' '.join(self.argv)}`"


def _rng(*parts: object) -> random.Random:
    return random.Random(f"{SEED}:" + ":".join(map(str, parts)))


# ------------------------------------------------------------------------------------------------ the surface


def config_leaves(cls: type = Config, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, type) of every leaf of the config schema; a mapping of dataclasses as `prefix.*.`."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp, key = strip_optional(hints[f.name]), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            out += config_leaves(tp, f"{key}.")
        elif typing.get_origin(tp) is dict and dataclasses.is_dataclass(typing.get_args(tp)[1]):
            out += config_leaves(typing.get_args(tp)[1], f"{key}.*.")
        else:
            out.append((key, hints[f.name]))
    return out


def spec_leaves(cls: type, prefix: str = "") -> list[tuple[str, Any]]:
    """(key, type) of every field of a spec schema and of the dataclasses it holds: a list's item as
    `key[0].field`, a mapping's value as `key.*.field`."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp, key = strip_optional(hints[f.name]), f"{prefix}{f.name}"
        out.append((key, hints[f.name]))
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        inner = args[0] if origin is list else args[1] if origin is dict else tp
        if dataclasses.is_dataclass(inner):
            out += spec_leaves(inner, f"{key}[0]." if origin is list else f"{key}.*." if origin is dict else f"{key}.")
    return out


def verbs() -> dict[str, argparse.ArgumentParser]:
    """Every verb of the `lab` parser by its words ('run', 'target build', 'sweep worker', ...)."""
    out: dict[str, argparse.ArgumentParser] = {}

    def walk(parser: argparse.ArgumentParser, words: list[str]) -> None:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            out[" ".join(words)] = parser
            if parser._defaults.get("takes_worker"):
                out[" ".join([*words, "worker"])] = parser
            return
        for name, sub in subs[0].choices.items():
            walk(sub, [*words, name])

    walk(cli.build_parser(), [])
    return out


# The base cases of the verbs that need more than the store's overrides (the first of each must be valid:
# test_every_verb_reaches_validated); every other verb's base is the store's overrides alone.
BASES: dict[str, list[list[str]]] = {
    "ablate": [["experiment=drift_2x2", STORE]],
    "sweep": [["sweep=tpe_eagle3", STORE]],
    "report": [["experiment=drift_2x2", STORE]],
    "export": [["{root}/drafter", "--out", "{root}/exported", "--format", "native", STORE]],
    "torchspec-config": [["--out", "{root}/ts", STORE]],
    "dashboard": [["--storage", "{root}/mlruns/optuna.journal"]],  # a storage named: no overrides
    "study export": [["experiment=drift_2x2", STORE]],
    "study import": [["{root}/study.tar.gz", STORE]],  # the drift_2x2 study, into the store it came from
}


def base_argvs(verb: str) -> list[list[str]]:
    words = verb.split()
    return [[*words, *b] for b in BASES.get(words[0] if words[-1] == "worker" else verb, [[STORE]])]


# ------------------------------------------------------------------------------------------------ the mutations


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


# ------------------------------------------------------------------------------------------------ config keys

CONFIG_KEYS = config_leaves()


def _config_pairs() -> dict[str, list[str]]:
    """The (key, class) pairs of this run: every key once (a class the seed picks), then up to
    CONFIG_EXAMPLES pairs in all, drawn by the seed."""
    pairs = [(k, c) for k, tp in CONFIG_KEYS for c in mutation_classes(tp)]
    rng = _rng("pairs")
    chosen = {(k, rng.choice(mutation_classes(tp))) for k, tp in CONFIG_KEYS if mutation_classes(tp)}
    rest = [p for p in pairs if p not in chosen]
    rng.shuffle(rest)
    budget = len(pairs) if _EXAMPLES == "all" else max(int(_EXAMPLES), len(chosen))
    chosen |= set(rest[: budget - len(chosen)])
    return {k: [c for c in mutation_classes(tp) if (k, c) in chosen] for k, tp in CONFIG_KEYS}


CONFIG_PAIRS = _config_pairs()
_BASE: dict[str, Any] = {}


def _base() -> Any:
    if "cfg" not in _BASE:
        _BASE["cfg"] = compose(["profile=micro"])
    return _BASE["cfg"]


def _evaluable_suites() -> list[str]:
    """Configured suites the base run can evaluate on their own (found by composing, not listed)."""
    if "suites" not in _BASE:
        ok = []
        for name in sorted(_base().suites):
            try:
                compose(["profile=micro", f"eval.suites=[{name}]"])
                ok.append(name)
            except ValueError:
                pass
        _BASE["suites"] = ok
    return _BASE["suites"]


def config_cases(key: str, tp: Any) -> list[Case]:
    from omegaconf import OmegaConf

    kinds, extra, rng = CONFIG_PAIRS[key], [], _rng(key)
    if ".*." in key:
        suite = rng.choice(_evaluable_suites())
        key, extra = key.replace(".*.", f".{suite}."), [f"eval.suites=[{suite}]"]
    current = OmegaConf.select(_base(), key)
    if OmegaConf.is_config(current):
        current = OmegaConf.to_container(current)
    return [
        Case(key, kind, ["run", STORE, *extra, f"{key}={hydra_value(mutation(tp, kind, current, rng))}"], (key,))
        for kind in kinds
    ]


# ------------------------------------------------------------------------------------------------ spec keys

SWEEP_BASE = {
    "space": {"train.lr": {"values": [0.001, 0.002]}},
    "objectives": [{"metric": "eval/in_dist/ref/k3/al", "direction": "maximize", "reduce": "last"}],
    "sampler": {"name": "tpe", "seed": 0},
    "pruner": {"name": "median"},
    "seeds": [0],
    "trials": 2,
}
EXPERIMENT_BASE = {
    "description": "fuzz",
    "baseline": "a",
    "seeds": [0, 1],
    "overrides": ["eval.num_speculative_tokens=[3]"],
    "arms": {"a": {"label": "A", "overrides": ["drafter=eagle31"]}},
    "figures": ["al_vs_depth"],
}
SPECS = {"sweeps": (schema.SweepSpec, SWEEP_BASE), "experiments": (schema.ExperimentSpec, EXPERIMENT_BASE)}
SPEC_KEYS = [(kind, key, tp) for kind, (cls, _) in SPECS.items() for key, tp in spec_leaves(cls)]


def _set(data: dict, key: str, value: Any) -> dict:
    """`data` (a copy) with `key` (`a.b`, `a[0].b`, `a.*.b`: the mapping's first entry) set to `value`."""
    out = yaml.safe_load(yaml.safe_dump(data))
    parts = re.findall(r"\[0\]|\*|[^.\[\]*]+", key)
    node: Any = out
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if part == "[0]":
            index: Any = 0
        elif part == "*":
            index = next(iter(node))
        else:
            index = part
        if last:
            node[index] = value
        else:
            if isinstance(node, dict) and index not in node:
                node[index] = {}
            node = node[index]
    return out


def _get(data: dict, key: str) -> Any:
    node: Any = data
    for part in re.findall(r"\[0\]|\*|[^.\[\]*]+", key):
        if not isinstance(node, (dict, list)):
            return None
        node = node[0] if part == "[0]" else next(iter(node)) if part == "*" else node.get(part)
    return node


def spec_cases(kind: str, key: str, tp: Any) -> list[Case]:
    base = SPECS[kind][1]
    rng = _rng(kind, key)
    cases = []
    for cls in mutation_classes(tp):
        value = mutation(tp, cls, _get(base, key), rng)
        stem = "f" + hashlib.sha256(f"{kind}:{key}:{cls}".encode()).hexdigest()[:10]
        if kind == "sweeps":
            argv, where = ["sweep", "sweep={specs}/" + stem + ".yaml", STORE], "{specs}/" + stem + ".yaml"
        else:
            argv, where = ["ablate", f"experiment={stem}", STORE], f"experiments/{stem}.yaml"
        cases.append(Case(f"{kind}: {key}", cls, argv, (where,), (kind, stem, _set(base, key, value))))
    return cases


# ------------------------------------------------------------------------------------------------ options


def _words(action: argparse.Action) -> tuple[str, ...]:
    return tuple(action.option_strings) or (action.dest, action.dest.upper(), str(action.metavar))


def option_cases(verb: str, parser: argparse.ArgumentParser) -> list[Case]:
    """Every action of the verb's parser, each given a missing, a malformed and out-of-range values."""
    cases = []
    rng = _rng(verb)
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        base = rng.choice(base_argvs(verb))
        if action.dest == "overrides":  # key=value words
            for word in rng.sample(["noequals", "=1", "train.steps==3", "drafter=", "+train.steps=1", "~", "a.b=1"], 3):
                cases.append(Case("overrides", "malformed", [*base, word], (word, word.split("=")[0] or word)))
            continue
        if not action.option_strings:  # a positional argument other than the overrides: leave it out, mangle it
            start = len(verb.split())
            at = next((i for i, a in enumerate(base) if i >= start and a != STORE and "=" not in a), None)
            if at is None or base[at].startswith("-"):
                continue
            dropped = base[:at] + base[at + 1 :]
            cases.append(Case(action.dest, "missing", dropped, _words(action)))
            cases.append(Case(action.dest, "malformed", base[:at] + [rng.choice(["", "-", "x y"])] + base[at + 1 :],
                              _words(action)))  # fmt: skip
            continue
        option = action.option_strings[-1]
        without = _drop_option(base, action)
        if action.nargs == 0:
            cases.append(Case(option, "malformed", [*without, f"{option}=x"], _words(action)))
            continue
        cases.append(Case(option, "missing", [*without, option], _words(action)))
        if action.required:
            cases.append(Case(option, "left out", without, _words(action)))
        if action.type is int:
            cases.append(Case(option, "wrong type", [*without, option, rng.choice(["abc", "1.5", ""])], _words(action)))
            cases.append(Case(option, "below range", [*without, option, rng.choice(["-1", "0"])], _words(action)))
            cases.append(Case(option, "huge", [*without, option, str(HUGE)], _words(action)))
        elif action.choices:
            cases.append(Case(option, "unknown member", [*without, option, "nosuch"], _words(action)))
        else:
            value = rng.choice(["", "nope", "a,b", "1,1", "-1", "{root}/mlruns"])
            cases.append(Case(option, "malformed", [*without, f"{option}={value}"], _words(action)))
    return cases


def _drop_option(argv: list[str], action: argparse.Action) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in action.option_strings:
            skip = action.nargs != 0
        else:
            out.append(a)
    return out


VERBS = verbs()


# ------------------------------------------------------------------------------------------------ files and folders
#
# Every config key, option and override that names a file or folder says so in the schema or the parser: a field's
# `path` rules (lab/config.py, `checked(..., path=...)`), an option's type (lab/cli.py `_path(...)`, its `path`
# attribute) and a verb's `named_files` (`sweep=PATH`). Each rule gets the paths of its kind (`file_inputs`): a
# missing path, an empty file, binary content, a truncated file in the format it reads, a folder for a file and a
# file for a folder, a path under a file, a symlink loop, and a folder with the right names and the wrong contents
# (a target's, a drafter checkpoint's); an output gets the cases of an output, of which a path not there yet is
# good. A bad one must be refused in one line naming the key or option before its verb's work (never reaching
# `validated`), a good one must pass, and neither may change the case's folder.

JSONL_ROW = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}
BINARY = b"\xff\xfe\x00\x81 not text \x00\xc3\x28" * 8
Maker = Callable[[Path, Path], Path]  # (the case's folder, the store's folder) -> the path to give


def _write(name: str, data: bytes | str | Callable[[Path], bytes]) -> Maker:
    def make(folder: Path, root: Path) -> Path:
        content = data(root) if callable(data) else data
        path = folder / name
        path.write_bytes(content.encode() if isinstance(content, str) else content)
        return path

    return make


def _half(relative: str, keep: Callable[[int], int] = lambda n: n // 2 + 7) -> Callable[[Path], bytes]:
    """The first part of one of the store's files (cut off inside it, not at a boundary)."""

    def cut(root: Path) -> bytes:
        data = (root / relative).read_bytes()
        return data[: keep(len(data))]

    return cut


def _missing(name: str) -> Maker:
    return lambda folder, root: folder / name


def _new_under(name: str) -> Maker:  # an output whose folders are not there yet either
    return lambda folder, root: folder / "new" / "deeper" / name


def _a_folder(name: str) -> Maker:
    def make(folder: Path, root: Path) -> Path:
        (folder / name).mkdir()
        return folder / name

    return make


def _under_a_file(name: str) -> Maker:
    def make(folder: Path, root: Path) -> Path:
        (folder / "a-file").write_text("not a folder\n")
        return folder / "a-file" / name

    return make


def _loop(name: str) -> Maker:
    def make(folder: Path, root: Path) -> Path:
        (folder / name).symlink_to(folder / name)
        return folder / name

    return make


def _copied(source: str, change: dict[str, bytes | Callable[[bytes], bytes]] | None = None) -> Maker:
    """A copy of one of the store's folders (a target model, a drafter checkpoint), with files changed."""

    def make(folder: Path, root: Path) -> Path:
        out = folder / Path(source).name
        shutil.copytree(root / source, out)
        for name, new in (change or {}).items():
            (out / name).write_bytes(new((out / name).read_bytes()) if callable(new) else new)
        return out

    return make


def _cut(data: bytes) -> bytes:
    return data[: len(data) // 2 + 7]


def _flipped(data: bytes) -> bytes:  # the same size and header, another last byte: only a hash tells
    return data[:-1] + bytes([data[-1] ^ 0xFF])


# what a truncated file of each format is, and its file name
TRUNCATED: dict[str, tuple[str, bytes | str | Callable[[Path], bytes]]] = {
    "jsonl": ("data.jsonl", json.dumps(JSONL_ROW) + "\n" + json.dumps(JSONL_ROW)[:30]),
    "yaml": ("spec.yaml", "space:\n  train.lr: [0.001, 0.002\n  objectives: [{metric: eval/in"),
    "gguf": ("model.gguf", b"GGUF" + bytes(60)),
    "archive": ("study.tar.gz", _half("study.tar.gz")),
    "sqlite": ("mlflow.db", _half("mlruns/mlflow.db")),
    "journal": ("optuna.journal", _half("mlruns/optuna.journal", lambda n: n - 9)),
}
# a file of the right format holding something else
OTHER = {"jsonl": '{"text": "hi"}\n', "yaml": "- just\n- a list\n", "journal": '{"text": "hi"}\n'}
# a folder with the right names and the wrong contents, per format read there (and the good folder first)
FOLDERS: dict[str, tuple[str, dict[str, dict[str, Any]]]] = {
    "hf-model": ("chat", {
        "config.json binary": {"config.json": BINARY},
        "config.json truncated": {"config.json": _cut},
        "weights binary": {"model.safetensors": BINARY},
        "weights truncated": {"model.safetensors": _cut},
        "tokenizer truncated": {"tokenizer.json": _cut},
    }),
    "checkpoint": ("drafter", {
        "config.json binary": {"config.json": BINARY},
        "config.json truncated": {"config.json": _cut},
        "weights binary": {"model.safetensors": BINARY},
        "weights truncated": {"model.safetensors": _cut},
        "weights altered (hash)": {"model.safetensors": _flipped},
        "manifest binary": {"lab_manifest.json": BINARY},
    }),
}  # fmt: skip


def file_inputs(rule: PathRule) -> list[tuple[str, Maker, bool]]:
    """(class, maker, good) of every path the rule's kind is tried with."""
    name, truncated = TRUNCATED.get(rule.reads, ("folder" if rule.kind == "dir" else "file", None))
    if rule.kind == "out-dir":
        return [
            ("not there", _missing("out"), True),
            ("folders above not there", _new_under("out"), True),
            ("a folder there", _a_folder("out"), True),
            ("a file", _write("out", "a file\n"), False),
            ("under a file", _under_a_file("out"), False),
            ("symlink loop", _loop("out"), False),
        ]
    out = [("under a file", _under_a_file(name), False), ("symlink loop", _loop(name), False)]
    if rule.kind == "out-file":
        out += [
            ("not there", _missing(name), True),
            ("folders above not there", _new_under(name), True),
            ("a folder", _a_folder(name), False),
        ]
        if rule.reads in ("sqlite", "journal"):  # a store it opens: an empty one is a new one
            out += [("empty file", _write(name, b""), True), ("binary", _write(name, BINARY), False)]
            out += [("truncated", _write(name, truncated), False)]
        if rule.reads in OTHER:
            out += [("something else", _write(name, OTHER[rule.reads]), False)]
        return out
    out += [("missing", _missing(name), False)]
    if rule.kind == "dir":
        out += [("a file", _write(name, "a file\n"), False), ("empty folder", _a_folder(name), False)]
        if rule.reads in FOLDERS:
            source, changes = FOLDERS[rule.reads]
            out += [("the good one", _copied(source), True)]
            out += [(kind, _copied(source, change), False) for kind, change in changes.items()]
        return out
    out += [("a folder", _a_folder(name), False), ("empty file", _write(name, b""), False)]
    out += [("binary", _write(name, BINARY), False)]
    if truncated is not None:
        out += [("truncated", _write(name, truncated), False)]
    if rule.reads in OTHER:
        out += [("something else", _write(name, OTHER[rule.reads]), False)]
    return out


def _valued(rule: PathRule) -> str:
    return rule.prefix + "{path}"


def file_config_cases(key: str, rules: tuple[PathRule, ...]) -> list[Case]:
    """The file cases of a config key: on the verb that reads it, with the overrides that make it read (its
    rule's `when`, or for a suite's key: a configured suite of that kind, evaluated)."""
    cases = []
    for rule in rules:
        parent = key.rsplit(".", 1)[0]
        extra = [f"{parent}.{k}={v}" for k, v in rule.when.items() if not v.startswith("!")] if "." in key else []
        if ".*." in key:
            suites = _base().suites
            name = next(n for n in sorted(suites) if rule.applies(suites[n].get))
            key, extra = key.replace(".*.", f".{name}."), [f"eval.suites=[{name}]"]
        base = base_argvs(rule.verb)[0]
        item = f"{key} ({rule.kind}{': ' + rule.reads if rule.reads else ''})"
        argv = [*base, *extra, f"{key}={_valued(rule)}"]
        cases += [Case(item, cls, argv, (key,), make=make, good=good) for cls, make, good in file_inputs(rule)]
    return cases


def file_option_cases(verb: str, parser: argparse.ArgumentParser) -> list[Case]:
    """The file cases of every option and argument of a verb whose type names a path, and of every override it
    takes as a file (`named_files`)."""
    cases = []
    base = base_argvs(verb)[0]
    for action in parser._actions:
        for rule in getattr(action.type, "path", ()):
            if action.option_strings:
                option = action.option_strings[-1]
                argv, names = [*_drop_option(base, action), option, _valued(rule)], _words(action)
            else:
                start = len(verb.split())
                at = next(i for i, a in enumerate(base) if i >= start and a != STORE and "=" not in a)
                argv, names = [*base[:at], _valued(rule), *base[at + 1 :]], _words(action)
            item = f"{verb} {names[0]} ({rule.kind}{': ' + rule.reads if rule.reads else ''})"
            cases += [Case(item, cls, argv, names, make=make, good=good) for cls, make, good in file_inputs(rule)]
    for key, rule in parser._defaults.get("named_files", {}).items():
        words = verb.split()
        argv = [*words, f"{key}={_valued(rule)}", STORE]
        item = f"{verb} {key}=PATH ({rule.kind}: {rule.reads})"
        cases += [Case(item, cls, argv, (key, "{path}"), make=make, good=good) for cls, make, good in file_inputs(rule)]
    return cases


FILE_KEYS = [(k, path_rules(r)) for k, _, r in ruled_keys() if path_rules(r)]


def _all_file_cases() -> list[Case]:
    return [c for k, rules in FILE_KEYS for c in file_config_cases(k, rules)] + [
        c for verb, parser in VERBS.items() for c in file_option_cases(verb, parser)
    ]


def _file_sample() -> list[Case]:
    """This run's file cases: all of them, or with LAB_FUZZ_FILES=N a seeded N of them (every key and option
    at least once)."""
    cases = _all_file_cases()
    wanted = os.environ.get("LAB_FUZZ_FILES", "all")
    if wanted == "all" or int(wanted) >= len(cases):
        return cases
    rng = _rng("files")
    by_item: dict[str, list[Case]] = {}
    for c in cases:
        by_item.setdefault(c.item, []).append(c)
    chosen = [rng.choice(group) for group in by_item.values()]
    rest = [c for c in cases if c not in chosen]
    rng.shuffle(rest)
    chosen += rest[: max(0, int(wanted) - len(chosen))]
    return [c for c in cases if c in chosen]


FILE_CASES = _file_sample()


def _tree(folder: Path) -> dict[str, str]:
    """What is in a case's folder (without following links): each entry's kind and its content's hash."""
    out = {}
    for p in sorted(folder.rglob("*")):
        rel = str(p.relative_to(folder))
        if p.is_symlink():
            out[rel] = f"link {os.readlink(p)}"
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            out[rel] = "dir"
    return out


def file_problem(case: Case, outcome: Outcome, names: tuple[str, ...], before: dict, after: dict) -> str | None:
    """Why a file case's outcome is wrong: a good path refused, a bad one passing validation (its verb's work
    would start on it), a refusal that is not one line naming the key and what is expected, or the case's
    folder changed before the work."""
    if before != after:
        return f"changed its files before any work: {sorted(set(after.items()) ^ set(before.items()))[:3]}"
    if case.good:
        if outcome.valid:
            return None
        return "a good path refused: " + (problem(outcome, names) or outcome.err.strip())
    if outcome.valid:
        return "passed every check: the verb's work would start on it"
    return problem(outcome, names)


# ------------------------------------------------------------------------------------------------ running


@dataclass
class Outcome:
    rc: Any
    out: str
    err: str
    error: str = ""  # a traceback

    @property
    def valid(self) -> bool:
        return self.rc == VALID


def problem(outcome: Outcome, names: tuple[str, ...]) -> str | None:
    """Why the outcome is neither valid nor exit 2 with one line naming one of `names` and what is expected."""
    if outcome.valid:
        return None
    if outcome.error:
        return f"traceback: {outcome.error.strip().splitlines()[-1]}"
    lines = outcome.err.strip().splitlines()
    if outcome.rc != 2:
        return f"exit {outcome.rc}: {' | '.join(lines)[-300:]}"
    if len(lines) != 1:
        return f"{len(lines)} stderr lines: {' | '.join(lines)[-300:]}"
    line = lines[0]
    if not line.startswith("error: "):
        return f"not an error line: {line}"
    if not any(n in line for n in names):
        return f"names none of {names}: {line}"
    if not EXPECTS.search(line):
        return f"does not say what is expected: {line}"
    return None


@dataclass
class Fuzzer:
    root: Path
    specs: Path
    run_id: str
    capsys: Any
    monkeypatch: Any
    files: Path | None = None  # where file cases make their paths (never the store's folder)
    log: list[str] = field(default_factory=list)
    path: str = ""  # the path the current file case made

    def argv(self, case: Case) -> list[str]:
        out = []
        for a in case.argv:
            if a == STORE:
                out += _overrides(self.root)
            else:
                out.append(a.replace("{root}", str(self.root)).replace("{specs}", str(self.specs)).replace(
                    "{run}", self.run_id).replace("{path}", self.path))  # fmt: skip
        return out

    def names(self, case: Case) -> tuple[str, ...]:
        return tuple(n.replace("{specs}", str(self.specs)).replace("{path}", self.path) for n in case.names)

    def make(self, case: Case) -> Path:
        """A fresh folder for a file case, with the case's path made in it."""
        assert self.files is not None and case.make is not None
        folder = self.files / hashlib.sha256(str(case).encode()).hexdigest()[:12]
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        self.path = str(case.make(folder, self.root))
        return folder

    def write_spec(self, case: Case) -> None:
        if case.spec is not None:
            kind, stem, data = case.spec
            folder = self.specs if kind == "sweeps" else self.specs / "experiments"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{stem}.yaml").write_text(yaml.safe_dump(data, sort_keys=False))

    def outcome(self, case: Case) -> Outcome:
        self.write_spec(case)
        self.capsys.readouterr()
        with self.monkeypatch.context() as m:
            if case.spec is not None and case.spec[0] == "experiments":
                m.setattr(experiment, "EXPERIMENT_DIR", self.specs / "experiments")
            try:
                rc: Any = cli.main(self.argv(case))
            except Valid:
                rc = VALID
            except SystemExit as exc:
                rc = exc.code
            except BaseException:
                out, err = self.capsys.readouterr()
                return Outcome("traceback", out, err, traceback.format_exc())
        out, err = self.capsys.readouterr()
        return Outcome(rc, out, err)

    def __call__(self, cases: list[Case]) -> list[str]:
        found = []
        for case in cases:
            if case.make is not None:
                folder = self.make(case)
                before = _tree(folder)
                outcome = self.outcome(case)
                why = file_problem(case, outcome, self.names(case), before, _tree(folder))
            else:
                outcome = self.outcome(case)
                why = problem(outcome, self.names(case))
            shown = "valid" if outcome.valid else (outcome.err.strip().splitlines() or ["?"])[-1]
            self.log.append(f"{case}: {'PROBLEM ' + why if why else shown}")
            if why:
                found.append(f"{case}: {why}")
        if os.environ.get("LAB_FUZZ_LOG"):
            with open(os.environ["LAB_FUZZ_LOG"], "a") as f:
                f.write("".join(line + "\n" for line in self.log))
        self.log.clear()
        return found


def _files(root: Path) -> dict[str, str]:
    """The `files` part of the store's snapshot (the part a test can afford after every case group)."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(root.rglob("*"))
    }


@pytest.fixture(scope="module")
def store(recorded, tmp_path_factory) -> dict[str, Any]:  # noqa: F811
    """tests/test_bad_input.py's recorded folder plus a drift_2x2 study (a parent run and one finished child)
    under exactly the overrides `lab report experiment=drift_2x2 <store>` composes, so that the report's base
    case is valid, a drafter checkpoint for `lab export` and that study's archive for `lab study import`; its
    snapshot; and a folder for the spec files."""
    from helpers import small_drafter

    from lab.drafter import save_native
    from lab.track import study_archive

    root = recorded
    # what `lab export SOURCE` exports, and a drafter.checkpoint that fits the micro target (its 512 tokens)
    save_native(small_drafter(vocab_size=512), root / "drafter")
    extra = _overrides(root)
    exp = experiment.load("drift_2x2")
    sweep = exp.as_sweep(extra)
    cfg = compose([*exp.overrides, *extra])
    uri, art = cfg.tracking.uri, cfg.tracking.artifact_root
    tags = {"study": exp.name, "sweep": exp.name, "optuna_study": sweep.study_name(extra)}
    with track.parent_run(uri, art, sweep.experiment, "sweep-drift_2x2", sweep.study_name(extra), tags) as parent:
        parent.log_params({"sweep.seeds": exp.seeds})
        child = {"study": exp.name, "arm": "eagle3", "seed": 0}
        with track.start_run(uri, art, sweep.experiment, "eagle3-0", child, parent_run_id=parent.id) as run:
            run.log_metrics({"eval/in_dist/ref/k3/al": 2.0})
    study = {"kind": "experiment", "name": exp.name, "experiment": sweep.experiment}
    study_archive.export_study(uri, parent.id, root / "study.tar.gz", study)  # what `lab study import` reads
    before = snapshot(root)
    run_id = next(r for r, v in before["runs"].items() if v["tags"].get("study") == "recorded")  # no checkpoint
    specs, files = tmp_path_factory.mktemp("specs"), tmp_path_factory.mktemp("files")
    return {"root": root, "run": run_id, "before": before, "specs": specs, "files": files}


@pytest.fixture
def fuzz(store, capsys, monkeypatch) -> Fuzzer:
    """A Fuzzer in the store's folder with `lab.cli.validated` raising `Valid`; afterwards every file of the
    store is as it was."""

    def stop(verb: str) -> None:
        raise Valid(verb)

    monkeypatch.setattr(cli, "validated", stop)
    monkeypatch.chdir(store["root"])
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # a wheel not in the cache cannot be downloaded
    yield Fuzzer(store["root"], store["specs"], store["run"], capsys, monkeypatch, store["files"])
    assert _files(store["root"]) == store["before"]["files"]


# ------------------------------------------------------------------------------------------------ the tests


def test_every_verb_reaches_validated(fuzz):
    """The first base case of every verb passes validation (so every verb calls the hook before its work)."""
    for verb in VERBS:
        case = Case(verb, "base", base_argvs(verb)[0], ())
        outcome = fuzz.outcome(case)
        assert outcome.valid, f"{case}: {outcome.rc} {outcome.err} {outcome.error}"


@pytest.mark.parametrize(("key", "tp"), CONFIG_KEYS, ids=[k for k, _ in CONFIG_KEYS])
def test_config_key(key, tp, fuzz):
    problems = fuzz(config_cases(key, tp))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(("kind", "key", "tp"), SPEC_KEYS, ids=[f"{k}:{key}" for k, key, _ in SPEC_KEYS])
def test_spec_key(kind, key, tp, fuzz):
    problems = fuzz(spec_cases(kind, key, tp))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("verb", list(VERBS))
def test_verb_options(verb, fuzz):
    problems = fuzz(option_cases(verb, VERBS[verb]))
    assert not problems, "\n".join(problems)


def test_a_worker_count_above_the_cores_is_capped_unless_forced(fuzz, monkeypatch):
    """`--workers N` above the machine's cores runs as many workers as cores, saying so in one line;
    `--force` keeps N. Checked where the count is handed to the engine or to MLflow's server."""
    from lab import track
    from lab.sweep import engine

    used: list[int] = []

    def launched(*args, workers, **kwargs):
        used.append(workers)
        raise Valid("launch")

    def served(backend, root, host, port, workers):
        used.append(workers)
        raise Valid("server")

    monkeypatch.setattr(cli, "validated", lambda verb: None)
    monkeypatch.setattr(engine, "launch", launched)
    monkeypatch.setattr(track, "server_command", served)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    said = "--workers 64: capped at 2, this machine's cores (--force keeps 64)"
    for argv in (["sweep", "sweep=tpe_eagle3"], ["ablate", "experiment=drift_2x2"], ["server"]):
        capped = fuzz.outcome(Case("--workers", "capped", [*argv, "--workers", "64", STORE], ()))
        forced = fuzz.outcome(Case("--workers", "forced", [*argv, "--workers", "64", "--force", STORE], ()))
        assert capped.valid and forced.valid, (capped, forced)
        assert said in capped.out.splitlines() and said not in forced.out
        assert used[-2:] == [2, 64]


def _all_cases() -> list[Case]:
    return (
        [c for k, tp in CONFIG_KEYS for c in config_cases(k, tp)]
        + [c for kind, k, tp in SPEC_KEYS for c in spec_cases(kind, k, tp)]
        + [c for verb, parser in VERBS.items() for c in option_cases(verb, parser)]
    )


def _the_real_command_says(fuzz, case, store, outcome) -> None:
    """`case` through the real `lab` command in a subprocess: exit 2 and the same one line as in process."""
    env = {**os.environ, "PIP_NO_INDEX": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "lab.cli", *fuzz.argv(case)],
        capture_output=True, text=True, cwd=store["root"], env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, f"{case}: {proc.stderr[-2000:]}"
    assert proc.stderr.strip().splitlines() == outcome.err.strip().splitlines(), case


def test_failing_cases_fail_the_same_through_the_real_command(fuzz, store):
    """A seeded sample of failing cases (experiment specs aside: they are read from a patched folder) through
    `python -m lab.cli`: exit 2 and the one line the in-process run gave, and nothing recorded."""
    cases = [c for c in _all_cases() if not (c.spec and c.spec[0] == "experiments")]
    _rng("subprocess").shuffle(cases)
    checked = 0
    for case in cases:
        if checked == SUBPROCESS_SAMPLE:
            break
        outcome = fuzz.outcome(case)
        if outcome.valid:
            continue
        _the_real_command_says(fuzz, case, store, outcome)
        checked += 1
    assert checked == SUBPROCESS_SAMPLE


def test_the_surface_is_covered():
    """Every config key, spec key, verb and option is in the cases; the count of cases per run."""
    cases = _all_cases()
    items = {c.item for c in cases}
    keys = {k.split(".*.")[0] for k, _ in CONFIG_KEYS}
    assert all(any(i == k or i.startswith(k + ".") for i in items) for k in keys)
    assert {f"{kind}: {k}" for kind, k, tp in SPEC_KEYS if mutation_classes(tp)} <= items
    for verb, parser in VERBS.items():
        for action in parser._actions:
            if action.option_strings and not isinstance(action, argparse._HelpAction):
                assert action.option_strings[-1] in items, (verb, action.option_strings)
    counts = {"config": sum(len(v) for v in CONFIG_PAIRS.values())}
    counts["spec"] = sum(len(mutation_classes(tp)) for _, _, tp in SPEC_KEYS)
    counts["options"] = len(cases) - counts["config"] - counts["spec"]
    print(f"fuzz cases this run (seed {SEED}): {counts}, {len(cases)} in all, + {SUBPROCESS_SAMPLE} subprocesses")
    assert counts["config"] >= len(CONFIG_KEYS)


@pytest.mark.parametrize("item", sorted({c.item for c in FILE_CASES}))
def test_file_input(item, fuzz):
    """Every path case of one key or option: refused in one line naming it before any work, or, an output not
    there yet, passing; its folder untouched either way."""
    problems = fuzz([c for c in FILE_CASES if c.item == item])
    assert not problems, "\n".join(problems)


# the words of a field or an option that names a file or folder: each such one must say so (a path rule)
PATHLIKE_FIELD = re.compile(r"(^|_)(path|dir|root|checkpoint|uri|storage|file)$")
PATHLIKE_HELP = re.compile(r"\b(folder|file|directory|archive|storage|path)\b", re.I)


def test_every_file_input_is_fuzzed():
    """Every config key, option and override that names a file or folder declares it (a key named like a path
    has a `path` rule; an option whose help speaks of a file or folder has a path type), and every declared one
    has cases of its kind in every run."""
    items = {c.item.split(" (")[0] for c in FILE_CASES}
    for key, tp in CONFIG_KEYS:
        if strip_optional(tp) is str and PATHLIKE_FIELD.search(key.rsplit(".", 1)[-1]):
            assert any(k == key for k, _ in FILE_KEYS), f"{key} names a file or folder: give it a path rule"
    for key, _ in FILE_KEYS:
        assert any(i == key or re.fullmatch(re.escape(key).replace(r"\*", r"[^.]+"), i) for i in items), key
    for verb, parser in VERBS.items():
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction) or action.dest == "overrides":
                continue
            if PATHLIKE_HELP.search(f"{action.help} {action.metavar or ''}") and action.nargs != 0:
                assert hasattr(action.type, "path"), f"{verb} {action.option_strings or action.dest}: a path type"
            if getattr(action.type, "path", ()):
                assert f"{verb} {_words(action)[0]}" in items, (verb, action.dest)
        for key in parser._defaults.get("named_files", {}):
            assert f"{verb} {key}=PATH" in items, (verb, key)
    kinds = {}
    for c in _all_file_cases():
        kinds[c.kind] = kinds.get(c.kind, 0) + 1
    print(f"file cases this run: {len(FILE_CASES)} of {len(_all_file_cases())}; all of them by class: {kinds}")


def test_failing_file_cases_fail_the_same_through_the_real_command(fuzz, store):
    """A seeded sample of refused file cases through `python -m lab.cli`: exit 2 and the one line the in-process
    run gave, and the case's folder untouched."""
    cases = [c for c in FILE_CASES if not c.good]
    _rng("file subprocess").shuffle(cases)
    for case in cases[:FILE_SUBPROCESS_SAMPLE]:
        folder = fuzz.make(case)
        outcome = fuzz.outcome(case)
        assert not outcome.valid, case
        before = _tree(folder)
        _the_real_command_says(fuzz, case, store, outcome)
        assert _tree(folder) == before, case


def test_the_recorded_store_is_unchanged(store):
    assert snapshot(store["root"]) == store["before"]
