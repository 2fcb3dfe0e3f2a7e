"""The schema of a study's spec file, as OmegaConf structured dataclasses: `SweepSpec` (`sweeps/NAME.yaml`)
and `ExperimentSpec` (`experiments/NAME.yaml`). Every key a file may hold is a field here, with its type,
its default and, where its type does not say it all, its rules (`checked`, lab/config/rules.py's engine, the one the
config schema uses): bounds and checks, and what a good value is in words (the error says it).
lab/sweep/spec_reader.py checks a parsed file against these classes.

A class's `EXPECTED` says what its mapping is, and `shorthand` (where there is one) expands the short form
a file may write instead of the mapping (`sampler: tpe` for `sampler: {name: tpe}`).

It imports nothing of `lab` but the rule engine, so that a spec file is checked without Hydra or Optuna.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar

from omegaconf import MISSING

from lab.config.rules import SEED_MAX, checked

MAX_TRIALS = 100_000  # a study's trials are queued one by one in its storage before any runs
# a list of seeds, as the config's `seed` bounds each (its words: "a non-empty list of distinct integers in 0..MAX")
SEEDS = {"nonempty": True, "distinct": True, "min": 0, "max": SEED_MAX}


def _distinct_metrics(v: Any) -> bool:
    return len(v) > 0 and len({o["metric"] for o in v}) == len(v)


class SamplerName(str, Enum):
    tpe = "tpe"
    random = "random"
    grid = "grid"  # every point x seed, enqueued (the engine does not use Optuna's GridSampler)
    nsga2 = "nsga2"  # two or more objectives


class PrunerName(str, Enum):
    none = "none"
    median = "median"
    percentile = "percentile"
    hyperband = "hyperband"


class Direction(str, Enum):
    maximize = "maximize"
    minimize = "minimize"


class Reduction(str, Enum):
    """How a curve (a metric logged per step) becomes one value."""

    last = "last"
    mean = "mean"
    max = "max"
    min = "min"


@dataclass
class ParamSpec:
    """One dimension of `space`: [values] (categorical), {low, high[, step, log]} (a range: integers when low,
    high and step are) or {choices: {name: [overrides]}} (named bundles of overrides); exactly one of them."""

    EXPECTED: ClassVar[str] = "[values], {low, high[, log, step]} or {choices: {name: [overrides]}}"

    values: list[Any] | None = checked(None, expected="a non-empty list of values", nonempty=True)
    choices: dict[str, list[str]] | None = checked(
        None, expected="a non-empty mapping of name -> [key=value overrides]", nonempty=True
    )
    low: int | float | None = None
    high: int | float | None = None
    step: int | float | None = checked(None, expected="a number > 0", above=0)
    log: bool = False

    @staticmethod
    def shorthand(value: Any) -> Any:
        return {"values": value} if isinstance(value, list) else value


@dataclass
class ObjectiveSpec:
    EXPECTED: ClassVar[str] = "{metric: KEY, direction: maximize|minimize, reduce: last|mean|max|min}, or KEY alone"

    metric: str = checked(MISSING, expected="a metric key, e.g. eval/in_dist/ref/k3/al", nonempty=True)
    direction: Direction = Direction.maximize
    reduce: Reduction = Reduction.last

    @staticmethod
    def shorthand(value: Any) -> Any:
        return {"metric": value} if isinstance(value, str) else value


def _named(value: Any) -> Any:
    """`NAME` or {name: NAME, OPTION: VALUE, ...} as {name: NAME, options: {OPTION: VALUE, ...}}."""
    if isinstance(value, str):
        return {"name": value}
    if isinstance(value, dict):
        return {
            **({"name": value["name"]} if "name" in value else {}),
            "options": {k: v for k, v in value.items() if k != "name"},
        }
    return value


@dataclass
class SamplerSpec:
    EXPECTED: ClassVar[str] = "a sampler's name or {name: NAME, OPTION: VALUE, ...}"

    name: SamplerName = MISSING
    options: dict[str, Any] = field(default_factory=dict)  # keyword arguments of Optuna's sampler

    shorthand = staticmethod(_named)


def _named_pruner(value: Any) -> Any:
    """A pruner as `_named` reads it, its `metric` kept apart from Optuna's options."""
    if isinstance(value, dict) and "metric" in value:
        return {**_named({k: v for k, v in value.items() if k != "metric"}), "metric": value["metric"]}
    return _named(value)


@dataclass
class PrunerSpec:
    EXPECTED: ClassVar[str] = "a pruner's name or {name: NAME, metric: KEY, OPTION: VALUE, ...}"

    name: PrunerName = MISSING
    # what a trial reports as it trains: null, the exact validation AL at train.select_k (`val/k{k}/al`); or
    # another key the trainer logs, such as the proxy over training batches, train/simulated_acc_len
    metric: str | None = checked(None, expected="a metric key the runs log while training, or null", nonempty=True)
    options: dict[str, Any] = field(default_factory=dict)  # keyword arguments of Optuna's pruner

    shorthand = staticmethod(_named_pruner)


_OVERRIDES = "a list of key=value overrides"


@dataclass
class SweepSpec:
    """`sweeps/NAME.yaml` (lab/sweep/search_space.py)."""

    EXPECTED: ClassVar[str] = "a mapping with space, objectives, sampler, ..."

    description: str | None = ""
    space: dict[str, ParamSpec] = checked(
        MISSING,
        expected="a non-empty mapping of config key -> [values], {low, high[, log, step]} or "
        "{choices: {name: [overrides]}}",
        nonempty=True,
    )
    overrides: list[str] = checked(factory=list, expected=_OVERRIDES)
    sampler: SamplerSpec = field(default_factory=lambda: SamplerSpec(name=SamplerName.tpe))
    pruner: PrunerSpec = field(default_factory=lambda: PrunerSpec(name=PrunerName.none))
    objectives: list[ObjectiveSpec] = checked(
        MISSING,
        expected="a non-empty list of {metric: KEY, direction: maximize|minimize}, each metric once",
        check=_distinct_metrics,
    )
    seeds: list[int] = checked(factory=lambda: [0], **SEEDS)
    trials: int | None = checked(
        None, expected=f"an integer in 1..{MAX_TRIALS} (the total budget of trials) or null", min=1, max=MAX_TRIALS
    )
    # the MLflow experiment; null: the sweep's name
    study: str | None = checked(None, expected="a non-empty MLflow experiment name or null", nonempty=True)
    max_retry: int = checked(2, expected="an integer >= 0 (retries of a trial whose worker died)", min=0)
    heartbeat_s: float = checked(20.0, expected="a number of seconds > 0", above=0)
    grace_s: float = checked(120.0, expected="a number of seconds > 0", above=0)  # no heartbeat this long: stale


@dataclass
class ArmSpec:
    EXPECTED: ClassVar[str] = "{label: ..., overrides: [key=value, ...]}"

    label: str | None = None  # null: the arm's name
    overrides: list[str] = checked(factory=list, expected=_OVERRIDES)


@dataclass
class ExperimentSpec:
    """`experiments/NAME.yaml` (lab/sweep/experiment.py)."""

    EXPECTED: ClassVar[str] = "a mapping with arms, baseline, seeds, ..."

    description: str | None = ""
    baseline: str | None = None  # an arm; null: the first one
    seeds: list[int] = checked(factory=lambda: [0, 1, 2], **SEEDS)
    overrides: list[str] = checked(factory=list, expected=_OVERRIDES + " (every arm's)")
    arms: dict[str, ArmSpec] = checked(
        MISSING, expected="a non-empty mapping of arm name -> {label, overrides}", nonempty=True
    )
    figures: list[str] = checked(  # lab/report/figures.py's names
        factory=list, expected="a list of distinct figure names", distinct=True
    )
