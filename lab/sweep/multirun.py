"""Hydra's multirun on the sweep engine: `lab run -m drafter=eagle3,eagle31 train.ttt_length=3,5 seed=0,1` is an
experiment whose arms are the cross product of the swept keys' values and whose seeds are `seed`'s. It then runs
as `lab ablate` runs an experiments/NAME.yaml (one parent run, child runs, resumable, workers), not on an engine of
its own. Values are Hydra's sweeps: comma lists, `range(start, stop[, step])` and `choice(...)`; `interval()`
draws from a range and needs a sampler, which is `lab sweep`'s."""

from __future__ import annotations

import itertools
import shlex

from lab.config import ConfigError
from lab.config.rules import SEED_MAX
from lab.sweep.experiment import Arm, Experiment

DEFAULT_NAME = "multirun"


def swept(overrides: list[str]) -> tuple[list[tuple[str, list[str]]], list[str]]:
    """(key, its values) of each swept override, in the command's order, and the overrides that sweep nothing."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    sweeps, fixed = [], []
    for text in overrides:
        try:
            (override,) = parser.parse_overrides([text])
        except HydraException as exc:
            key = text.split("=", 1)[0].lstrip("+~")
            raise ConfigError(key, f"not a valid override ({str(exc).splitlines()[0]})") from None
        if not override.is_sweep_override():
            fixed.append(text)
            continue
        key = override.get_key_element()
        if not override.is_discrete_sweep():
            raise ConfigError(
                key.lstrip("+"), "interval() draws from a range: run it with a sampler, `lab sweep` (sweeps/NAME.yaml)"
            )
        values = list(dict.fromkeys(override.sweep_string_iterator()))
        if not values:
            raise ConfigError(key.lstrip("+"), f"{text}: sweeps no value; expected a list such as a,b or range(0,3)")
        sweeps.append((key, values))
    return sweeps, fixed


def experiment(overrides: list[str], name: str = DEFAULT_NAME) -> tuple[Experiment, list[str]]:
    """The experiment that `lab run -m OVERRIDES` runs, and the overrides that sweep nothing (the user's, for every
    arm): one arm per point of the swept keys (the first is the baseline), the seeds that `seed` sweeps (else its
    one value, else 0)."""
    sweeps, fixed = swept(overrides)
    seeds = [0]
    arms_swept = []
    for key, values in sweeps:
        if key == "seed":
            seeds = _seeds(values)
        else:
            arms_swept.append((key, values))
    for o in fixed:
        if o.startswith("seed="):
            seeds, fixed = _seeds([o.split("=", 1)[1]]), [f for f in fixed if f != o]
    if not arms_swept and len(seeds) == 1:
        raise ConfigError("-m", "a multirun sweeps at least one key, e.g. drafter=eagle3,eagle31 or seed=0,1")
    arms = [_arm(arms_swept, point) for point in itertools.product(*(values for _, values in arms_swept))]
    names = [a.name for a in arms]
    if len(set(names)) < len(names):
        raise ConfigError("-m", f"two points share the arm name '{names[0]}'; sweep distinct values")
    return Experiment(name, command(overrides, name), arms, seeds, arms[0].name, kind="multirun"), fixed


def command(overrides: list[str], name: str = DEFAULT_NAME) -> str:
    """The command line that runs (and resumes) the multirun; its parent run keeps it as the tag `lab.command`."""
    from lab.config import redact

    named = [] if name == DEFAULT_NAME else [f"--name {name}"]
    return " ".join(["lab run -m", *named, *(shlex.quote(redact(o)) for o in overrides)])


def from_command(line: str) -> tuple[Experiment, list[str]]:
    """The multirun of a parent's `lab.command` tag, as `experiment` built it."""
    words = shlex.split(line)[3:]  # after `lab run -m`
    name = DEFAULT_NAME
    if words[:1] == ["--name"]:
        name, words = words[1], words[2:]
    return experiment(words, name)


def _arm(swept_keys: list[tuple[str, list[str]]], point: tuple[str, ...]) -> Arm:
    """One point: named by its values (`eagle31`; `ttt_length=5`; `eagle31,ttt_length=5` for several keys)."""
    if not swept_keys:
        return Arm("default", "default", [])
    overrides = [f"{key}={value}" for (key, _), value in zip(swept_keys, point, strict=True)]
    parts = [value if "." not in key.lstrip("+") and _is_group(key) else f"{key.lstrip('+').rsplit('.', 1)[-1]}={value}"
             for (key, _), value in zip(swept_keys, point, strict=True)]  # fmt: skip
    name = ",".join(parts)
    return Arm(name, name, overrides)


def _is_group(key: str) -> bool:
    from lab.config.composition import CONFIG_DIR

    return (CONFIG_DIR / key.lstrip("+")).is_dir()


def _seeds(values: list[str]) -> list[int]:
    try:
        seeds = [int(v) for v in values]
    except ValueError:
        got = ",".join(values)
        raise ConfigError("seed", f"expected integers, e.g. seed=0,1 or seed=range(0,3); got {got}") from None
    if any(not 0 <= s <= SEED_MAX for s in seeds):
        raise ConfigError("seed", f"expected integers in 0..{SEED_MAX}, got {','.join(values)}")
    return seeds
