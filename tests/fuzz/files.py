"""Every config key, option and override that names a file or folder says so in the schema or the parser: a field's
`path` rules (lab/config, `checked(..., path=...)`), an option's type (lab/cli/common.py `path_type(...)`, its `path`
attribute) and a verb's `named_files` (`sweep=PATH`). Each rule gets the paths of its kind (`file_inputs`): a
missing path, an empty file, binary content, a truncated file in the format it reads, a folder for a file and a file
for a folder, a path under a file, a symlink loop, and a folder with the right names and the wrong contents (a
target's, a drafter checkpoint's); an output gets the cases of an output, of which a path not there yet is good. A
bad one must be refused in one line naming the key or option before its verb's work (never reaching its work), a
good one must pass, and neither may change the case's folder."""

from __future__ import annotations

import argparse
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fuzz.cases import action_words, base_config, drop_option
from fuzz.surface import STORE, VERBS, Case, base_argvs, seeded_rng
from lab.config.rules import PathRule, path_rules
from lab.config.validation import ruled_keys

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
            suites = base_config().suites
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
                argv, names = [*drop_option(base, action), option, _valued(rule)], action_words(action)
            else:
                start = len(verb.split())
                at = next(i for i, a in enumerate(base) if i >= start and a != STORE and "=" not in a)
                argv, names = [*base[:at], _valued(rule), *base[at + 1 :]], action_words(action)
            item = f"{verb} {names[0]} ({rule.kind}{': ' + rule.reads if rule.reads else ''})"
            cases += [Case(item, cls, argv, names, make=make, good=good) for cls, make, good in file_inputs(rule)]
    for key, rule in parser._defaults.get("named_files", {}).items():
        words = verb.split()
        argv = [*words, f"{key}={_valued(rule)}", STORE]
        item = f"{verb} {key}=PATH ({rule.kind}: {rule.reads})"
        cases += [Case(item, cls, argv, (key, "{path}"), make=make, good=good) for cls, make, good in file_inputs(rule)]
    return cases


FILE_KEYS = [(k, path_rules(r)) for k, _, r in ruled_keys() if path_rules(r)]


def all_file_cases() -> list[Case]:
    return [c for k, rules in FILE_KEYS for c in file_config_cases(k, rules)] + [
        c for verb, parser in VERBS.items() for c in file_option_cases(verb, parser)
    ]


def file_sample() -> list[Case]:
    """This run's file cases: all of them, or with LAB_FUZZ_FILES=N a seeded N of them (every key and option
    at least once)."""
    cases = all_file_cases()
    wanted = os.environ.get("LAB_FUZZ_FILES", "all")
    if wanted == "all" or int(wanted) >= len(cases):
        return cases
    rng = seeded_rng("files")
    by_item: dict[str, list[Case]] = {}
    for c in cases:
        by_item.setdefault(c.item, []).append(c)
    chosen = [rng.choice(group) for group in by_item.values()]
    rest = [c for c in cases if c not in chosen]
    rng.shuffle(rest)
    chosen += rest[: max(0, int(wanted) - len(chosen))]
    return [c for c in cases if c in chosen]


FILE_CASES = file_sample()
