"""The cases of every config key, spec key and verb option: each mutated in a command that is valid
otherwise (a config override on `lab run`, a field of a valid spec file, an option of its verb's base)."""

from __future__ import annotations

import argparse
import hashlib
import re
from typing import Any

import yaml

from fuzz.mutations import HUGE, hydra_value, mutation, mutation_classes
from fuzz.surface import CONFIG_KEYS, EXAMPLES, STORE, VERBS, Case, base_argvs, seeded_rng, spec_leaves
from lab.config.composition import compose
from lab.sweep import spec_schema


def _config_pairs() -> dict[str, list[str]]:
    """The (key, class) pairs of this run: every key once (a class the seed picks), then up to
    CONFIG_EXAMPLES pairs in all, drawn by the seed."""
    pairs = [(k, c) for k, tp in CONFIG_KEYS for c in mutation_classes(tp)]
    rng = seeded_rng("pairs")
    chosen = {(k, rng.choice(mutation_classes(tp))) for k, tp in CONFIG_KEYS if mutation_classes(tp)}
    rest = [p for p in pairs if p not in chosen]
    rng.shuffle(rest)
    budget = len(pairs) if EXAMPLES == "all" else max(int(EXAMPLES), len(chosen))
    chosen |= set(rest[: budget - len(chosen)])
    return {k: [c for c in mutation_classes(tp) if (k, c) in chosen] for k, tp in CONFIG_KEYS}


CONFIG_PAIRS = _config_pairs()
_BASE: dict[str, Any] = {}


def base_config() -> Any:
    if "cfg" not in _BASE:
        _BASE["cfg"] = compose(["profile=micro"])
    return _BASE["cfg"]


def evaluable_suites() -> list[str]:
    """Configured suites the base run can evaluate on their own (found by composing, not listed)."""
    if "suites" not in _BASE:
        ok = []
        for name in sorted(base_config().suites):
            try:
                compose(["profile=micro", f"eval.suites=[{name}]"])
                ok.append(name)
            except ValueError:
                pass
        _BASE["suites"] = ok
    return _BASE["suites"]


def config_cases(key: str, tp: Any) -> list[Case]:
    from omegaconf import OmegaConf

    kinds, extra, rng = CONFIG_PAIRS[key], [], seeded_rng(key)
    if ".*." in key:
        suite = rng.choice(evaluable_suites())
        key, extra = key.replace(".*.", f".{suite}."), [f"eval.suites=[{suite}]"]
    current = OmegaConf.select(base_config(), key)
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
SPECS = {"sweeps": (spec_schema.SweepSpec, SWEEP_BASE), "experiments": (spec_schema.ExperimentSpec, EXPERIMENT_BASE)}
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
    rng = seeded_rng(kind, key)
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


def action_words(action: argparse.Action) -> tuple[str, ...]:
    return tuple(action.option_strings) or (action.dest, action.dest.upper(), str(action.metavar))


def option_cases(verb: str, parser: argparse.ArgumentParser) -> list[Case]:
    """Every action of the verb's parser, each given a missing, a malformed and out-of-range values."""
    cases = []
    rng = seeded_rng(verb)
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
            cases.append(Case(action.dest, "missing", dropped, action_words(action)))
            cases.append(Case(action.dest, "malformed", base[:at] + [rng.choice(["", "-", "x y"])] + base[at + 1 :],
                              action_words(action)))  # fmt: skip
            continue
        option, names = action.option_strings[-1], action_words(action)
        without = drop_option(base, action)
        if action.nargs == 0:
            cases.append(Case(option, "malformed", [*without, f"{option}=x"], names))
            continue
        cases.append(Case(option, "missing", [*without, option], names))
        if action.required:
            cases.append(Case(option, "left out", without, names))
        if action.type is int:
            cases.append(Case(option, "wrong type", [*without, option, rng.choice(["abc", "1.5", ""])], names))
            cases.append(Case(option, "below range", [*without, option, rng.choice(["-1", "0"])], names))
            cases.append(Case(option, "huge", [*without, option, str(HUGE)], names))
        elif action.choices:
            cases.append(Case(option, "unknown member", [*without, option, "nosuch"], names))
        else:
            value = rng.choice(["", "nope", "a,b", "1,1", "-1", "{root}/mlruns"])
            cases.append(Case(option, "malformed", [*without, f"{option}={value}"], names))
    return cases


def drop_option(argv: list[str], action: argparse.Action) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in action.option_strings:
            skip = action.nargs != 0
        else:
            out.append(a)
    return out


def all_cases() -> list[Case]:
    return (
        [c for k, tp in CONFIG_KEYS for c in config_cases(k, tp)]
        + [c for kind, k, tp in SPEC_KEYS for c in spec_cases(kind, k, tp)]
        + [c for verb, parser in VERBS.items() for c in option_cases(verb, parser)]
    )
