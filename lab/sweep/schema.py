"""The schema of a study's spec file, as OmegaConf structured dataclasses: `SweepSpec` (`sweeps/NAME.yaml`)
and `ExperimentSpec` (`experiments/NAME.yaml`). Every key a file may hold is a field here, with its type,
its default and, where its type does not say it all, a `rule`: what a good value is, in words (the error
says it) and as a check. lab/sweep/specfile.py checks a parsed file against these classes.

A class's `EXPECTED` says what its mapping is, and `shorthand` (where there is one) expands the short form
a file may write instead of the mapping (`sampler: tpe` for `sampler: {name: tpe}`).

Like lab/config.py, this module imports nothing of `lab` (tests/test_layers.py checks).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar

from omegaconf import MISSING


def rule(expected: str, check: Callable[[Any], bool] | None = None, **kwargs: Any) -> Any:
    """A dataclass field whose value (once its type is right) also passes `check`; `expected` says what a good
    value is, for the one-line error about a bad one. A null value is not checked."""
    return field(metadata={"expected": expected, "check": check}, **kwargs)


def _positive(v: Any) -> bool:
    return v > 0


def _not_negative(v: Any) -> bool:
    return v >= 0


def _non_empty(v: Any) -> bool:
    return len(v) > 0


def _distinct_non_empty(v: Any) -> bool:
    return len(v) > 0 and len(set(v)) == len(v)


def _distinct(v: Any) -> bool:
    return len(set(v)) == len(v)


def _named_text(v: Any) -> bool:
    return bool(v.strip())


SEED_MAX = 2**32 - 1  # numpy's generators take seeds in 0..2**32 - 1 (lab/config.py says the same)
MAX_TRIALS = 100_000  # a study's trials are queued one by one in its storage before any runs


def _seeds(v: Any) -> bool:
    return _distinct_non_empty(v) and all(0 <= s <= SEED_MAX for s in v)


def _trials(v: Any) -> bool:
    return 0 < v <= MAX_TRIALS


def _distinct_metrics(v: Any) -> bool:
    return len(v) > 0 and len({o["metric"] for o in v}) == len(v)


_SEEDS = f"a non-empty list of distinct integers in 0..{SEED_MAX}"


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

    values: list[Any] | None = rule("a non-empty list of values", _non_empty, default=None)
    choices: dict[str, list[str]] | None = rule(
        "a non-empty mapping of name -> [key=value overrides]", _non_empty, default=None
    )
    low: int | float | None = None
    high: int | float | None = None
    step: int | float | None = rule("a number > 0", _positive, default=None)
    log: bool = False

    @staticmethod
    def shorthand(value: Any) -> Any:
        return {"values": value} if isinstance(value, list) else value


@dataclass
class ObjectiveSpec:
    EXPECTED: ClassVar[str] = "{metric: KEY, direction: maximize|minimize, reduce: last|mean|max|min}, or KEY alone"

    metric: str = rule("a metric key, e.g. eval/in_dist/ref/k3/al", _named_text, default=MISSING)
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


@dataclass
class PrunerSpec:
    EXPECTED: ClassVar[str] = "a pruner's name or {name: NAME, OPTION: VALUE, ...}"

    name: PrunerName = MISSING
    options: dict[str, Any] = field(default_factory=dict)  # keyword arguments of Optuna's pruner

    shorthand = staticmethod(_named)


_OVERRIDES = "a list of key=value overrides"


@dataclass
class SweepSpec:
    """`sweeps/NAME.yaml` (lab/sweep/spec.py)."""

    EXPECTED: ClassVar[str] = "a mapping with space, objectives, sampler, ..."

    description: str | None = ""
    space: dict[str, ParamSpec] = rule(
        "a non-empty mapping of config key -> [values], {low, high[, log, step]} or {choices: {name: [overrides]}}",
        _non_empty,
        default=MISSING,
    )
    overrides: list[str] = rule(_OVERRIDES, default_factory=list)
    sampler: SamplerSpec = field(default_factory=lambda: SamplerSpec(name=SamplerName.tpe))
    pruner: PrunerSpec = field(default_factory=lambda: PrunerSpec(name=PrunerName.none))
    objectives: list[ObjectiveSpec] = rule(
        "a non-empty list of {metric: KEY, direction: maximize|minimize}, each metric once",
        _distinct_metrics,
        default=MISSING,
    )
    seeds: list[int] = rule(_SEEDS, _seeds, default_factory=lambda: [0])
    trials: int | None = rule(
        f"an integer in 1..{MAX_TRIALS} (the total budget of trials) or null", _trials, default=None
    )
    # the MLflow experiment; null: the sweep's name
    study: str | None = rule("a non-empty MLflow experiment name or null", _named_text, default=None)
    max_retry: int = rule("an integer >= 0 (retries of a trial whose worker died)", _not_negative, default=2)
    heartbeat_s: float = rule("a number of seconds > 0", _positive, default=20.0)
    grace_s: float = rule("a number of seconds > 0", _positive, default=120.0)  # no heartbeat this long: stale


@dataclass
class ArmSpec:
    EXPECTED: ClassVar[str] = "{label: ..., overrides: [key=value, ...]}"

    label: str | None = None  # null: the arm's name
    overrides: list[str] = rule(_OVERRIDES, default_factory=list)


@dataclass
class ExperimentSpec:
    """`experiments/NAME.yaml` (lab/sweep/experiment.py)."""

    EXPECTED: ClassVar[str] = "a mapping with arms, baseline, seeds, ..."

    description: str | None = ""
    baseline: str | None = None  # an arm; null: the first one
    seeds: list[int] = rule(_SEEDS, _seeds, default_factory=lambda: [0, 1, 2])
    overrides: list[str] = rule(_OVERRIDES + " (every arm's)", default_factory=list)
    arms: dict[str, ArmSpec] = rule(
        "a non-empty mapping of arm name -> {label, overrides}", _non_empty, default=MISSING
    )
    figures: list[str] = rule(  # lab/report/figures.py's names
        "a list of distinct figure names", _distinct, default_factory=list
    )
