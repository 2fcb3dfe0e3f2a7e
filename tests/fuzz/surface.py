"""The surface the fuzzer tries, enumerated rather than listed: the config schema's leaves, the spec schemas'
fields, every verb of the `lab` parser and each verb's base command; a case (`Case`) and the seed that picks
among a class's values."""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab import cli
from lab.config import Config
from lab.config.rules import strip_optional

SEED = int(os.environ.get("LAB_FUZZ_SEED", "21"))
EXAMPLES = os.environ.get("LAB_FUZZ_EXAMPLES", "140")
STORE = "<store>"  # where a case's command takes the overrides that point it at the recorded store


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


def seeded_rng(*parts: object) -> random.Random:
    return random.Random(f"{SEED}:" + ":".join(map(str, parts)))


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
# test_every_verb_reaches_its_work); every other verb's base is the store's overrides alone.
BASES: dict[str, list[list[str]]] = {
    "ablate": [["experiment=drift_2x2", STORE]],
    "sweep": [["sweep=tpe_eagle3", STORE]],
    "report": [["experiment=drift_2x2", STORE]],
    "runs": [["experiment=drift_2x2", STORE]],
    "export": [["{root}/drafter", "--out", "{root}/exported", "--format", "native", STORE]],
    "torchspec-config": [["--out", "{root}/ts", STORE]],
    "dashboard": [["--storage", "{root}/mlruns/optuna.journal"]],  # a storage named: no overrides
    "study export": [["experiment=drift_2x2", STORE]],
    "study import": [["{root}/study.tar.gz", STORE]],  # the drift_2x2 study, into the store it came from
}


def base_argvs(verb: str) -> list[list[str]]:
    words = verb.split()
    return [[*words, *b] for b in BASES.get(words[0] if words[-1] == "worker" else verb, [[STORE]])]


VERBS = verbs()
CONFIG_KEYS = config_leaves()
