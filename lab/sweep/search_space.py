"""Optuna sweep specs (`sweeps/NAME.yaml`): a search space over config keys, fixed overrides, the
sampler, the pruner, the objective(s), seeds per point and the total trial budget.

    space:
      drafter.fc_norm: [none, per_layer, concat]        # a list: categorical
      train.lr: {low: 1.0e-4, high: 1.0e-2, log: true}  # floats: float range (log scale)
      train.ttt_length: {low: 1, high: 7}               # integers: int range (optional step)
      preset: {choices: {e3: [drafter=eagle3], e31: [drafter=eagle31]}}   # named override bundles
    sampler: tpe            # or {name: tpe, seed: 0, n_startup_trials: 8}; random, grid, nsga2
    pruner: none            # or {name: median, n_startup_trials: 2, n_warmup_steps: 20}; percentile, hyperband;
                            # `metric:` what trials report (default: the exact validation AL at train.select_k)
    objectives:
      - {metric: eval/in_dist/ref/k5/al, direction: maximize}
      - {metric: drift/in_dist/k5/norm_growth, direction: minimize, reduce: last}
    seeds: [0]              # every point runs once per seed, each (point, seed) one trial
    trials: 24              # the TOTAL budget of trials (a grid: every point x seed, the default)

An ablation (`experiments/NAME.yaml`) is the grid over one bundle parameter, `arm`. The keys, their types,
defaults and bounds are lab/sweep/spec_schema.py's `SweepSpec`; a bad value fails in one line naming the file
and the key (lab/sweep/spec_reader.py).
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from lab import metrics as metric_keys
from lab.config import ConfigError, select_k, validation_depth
from lab.config.composition import compose
from lab.config.identity import config_hash
from lab.config.rules import PathRule, expected_got, path_problem
from lab.fsutil import short_hash
from lab.preflight import check_checkpoint, check_paths, check_target
from lab.sweep import spec_reader
from lab.sweep.spec_reader import read_yaml
from lab.sweep.spec_schema import ParamSpec, SweepSpec

SWEEP_DIR = Path(__file__).resolve().parent.parent.parent / "sweeps"
PROXY_METRIC = metric_keys.train_stat("simulated_acc_len")  # the proxy over training batches a pruner may read
# overrides that change where a trial runs or is tracked, not what it computes: not part of a study's identity
_PLACEMENT = ("tracking.", "threads=", "cache_dir=", "train.resume_every=")
SPEC_FILE = PathRule("file", "yaml")  # `sweep=PATH.yaml`


@dataclass
class Param:
    """One dimension of the search space."""

    name: str  # a config key (`train.lr`), or the name of a bundle parameter (`arm`)
    kind: str  # categorical | int | float | bundle
    choices: list[Any] = field(default_factory=list)  # categorical values; bundle names
    low: float | None = None
    high: float | None = None
    step: float | None = None
    log: bool = False
    bundles: dict[str, list[str]] = field(default_factory=dict)  # bundle name -> overrides

    def suggest(self, trial: Any) -> Any:
        """The value of this parameter in an Optuna trial (fixed for enqueued grid points and retries)."""
        if self.kind in ("categorical", "bundle"):
            return trial.suggest_categorical(self.name, self.choices)
        if self.kind == "int":
            return trial.suggest_int(self.name, int(self.low), int(self.high), step=int(self.step or 1), log=self.log)
        return trial.suggest_float(self.name, self.low, self.high, step=self.step, log=self.log)

    def overrides(self, value: Any) -> list[str]:
        if self.kind == "bundle":
            return list(self.bundles[value])
        return [f"{self.name}={_override_value(value)}"]

    def grid(self) -> list[Any]:
        """The values a grid visits: the choices, or every step of an integer range."""
        if self.kind in ("categorical", "bundle"):
            return list(self.choices)
        if self.kind == "int":
            return list(range(int(self.low), int(self.high) + 1, int(self.step or 1)))
        raise ConfigError(f"space.{self.name}", "a grid needs a list of values or an integer range, not a float range")

    def probes(self) -> list[Any]:
        """Values composed before anything runs: every choice, or both ends of a range."""
        return self.grid() if self.kind != "float" else [self.low, self.high]


@dataclass
class Objective:
    metric: str
    direction: str = "maximize"
    reduce: str = "last"

    def value(self, metrics: dict[str, float | list[float]]) -> float:
        if self.metric not in metrics:
            raise KeyError(self.metric)
        v = metrics[self.metric]
        if not isinstance(v, list):
            return float(v)
        return float({"last": v[-1], "mean": sum(v) / len(v), "max": max(v), "min": min(v)}[self.reduce])


@dataclass
class Sweep:
    name: str
    space: list[Param]
    objectives: list[Objective]
    description: str = ""
    overrides: list[str] = field(default_factory=list)
    sampler: dict[str, Any] = field(default_factory=lambda: {"name": "tpe"})
    pruner: dict[str, Any] = field(default_factory=lambda: {"name": "none"})
    prune_metric: str | None = None  # what a pruned trial reports; None: the exact validation AL (`prune_key`)
    seeds: list[int] = field(default_factory=lambda: [0])
    trials: int | None = None  # None: a grid's size (points x seeds)
    study: str | None = None  # the MLflow experiment; None: the sweep's name
    # the schema's defaults (an experiment's grid study has no keys of its own for these)
    max_retry: int = SweepSpec.max_retry  # a trial whose worker died is retried this many times
    heartbeat_s: float = SweepSpec.heartbeat_s
    grace_s: float = SweepSpec.grace_s  # a running trial without a heartbeat for this long is stale
    source: str = ""  # the file it came from, named in errors
    kind: str = "sweep"  # what `lab studies` calls it: sweep, ablate (an experiment's grid) or multirun
    baseline: str = ""  # the arm that an ablation's ratios divide by

    def __post_init__(self) -> None:
        self.source = self.source or f"sweeps/{self.name}.yaml"

    @property
    def is_grid(self) -> bool:
        return self.sampler["name"] == "grid"

    @property
    def experiment(self) -> str:
        return self.study or self.name

    def points(self) -> list[dict[str, Any]]:
        """Every point of a grid, in order (the last parameter varies fastest)."""
        names = [p.name for p in self.space]
        return [dict(zip(names, values, strict=True)) for values in itertools.product(*(p.grid() for p in self.space))]

    def budget(self, trials: int | None = None) -> int:
        """The total number of trials: `trials` (a command-line override), the spec's, or the grid's size."""
        if self.is_grid:
            return len(self.points()) * len(self.seeds)
        n = trials or self.trials
        if n is None or n < 1:
            raise ConfigError(f"{self.source}: trials", f"expected a positive total budget, got {n}")
        if n % len(self.seeds):
            raise ConfigError(
                f"{self.source}: trials",
                f"{n} trials do not split into points x {len(self.seeds)} seeds; use a multiple of {len(self.seeds)}",
            )
        return n

    def prune_key(self, cfg: DictConfig) -> str:
        """The metric a trial of `cfg` reports to the pruner as it trains: the spec's `pruner.metric`, else the
        exact validation AL at train.select_k."""
        return self.prune_metric or metric_keys.val_al(select_k(cfg))

    def label(self, params: dict[str, Any]) -> str:
        """The MLflow `arm` of a point: a bundle's name, else `key=value` pairs (short keys)."""
        if len(self.space) == 1 and self.space[0].kind == "bundle":
            return str(params[self.space[0].name])
        return ",".join(f"{k.rsplit('.', 1)[-1]}={_short(v)}" for k, v in params.items())

    def trial_overrides(self, params: dict[str, Any], seed: int, extra: list[str]) -> list[str]:
        """Sweep-wide overrides, the point's, the user's, then the trial's identity."""
        point = [o for p in self.space for o in p.overrides(params[p.name])]
        label = self.label(params)
        return [*self.overrides, *point, *extra, f"study={self.experiment}", f"arm='{label}'", f"seed={seed}"]

    def base_point(self) -> dict[str, Any]:
        """The first value of every parameter (a grid's first point)."""
        return {p.name: p.probes()[0] for p in self.space}

    def probes(self) -> list[dict[str, Any]]:
        """The points that stand for the space: a grid's every point, else the base point and each
        parameter's other probe values (a range's ends) one at a time."""
        if self.is_grid:
            return self.points()
        base = self.base_point()
        return [base] + [{**base, p.name: v} for p in self.space for v in p.probes()[1:]]

    def key(self, extra: list[str]) -> str:
        """Identity of the study: the spec without its budget, the user's overrides that change results, and
        what the points compute (their `config_hash`, composed): an edited profile, config group or schema
        default makes another study, whose runs are never mixed with the earlier ones."""
        spec = asdict(self)
        for k in ("trials", "description", "max_retry", "heartbeat_s", "grace_s", "source", "kind", "baseline"):
            spec.pop(k)
        if self.pruner["name"] == "none":  # nothing reads it: the studies without a pruner keep their names
            spec.pop("prune_metric")
        configs = sorted({config_hash(compose(self.trial_overrides(p, self.seeds[0], extra))) for p in self.probes()})
        return short_hash({"spec": spec, "extra": changing_results(extra), "configs": configs}, 8)

    def study_name(self, extra: list[str]) -> str:
        return f"{self.name}-{self.key(extra)}"

    def check(self, extra: list[str]) -> DictConfig:
        """Compose every grid point (or both ends of every range) with every override before anything
        runs, check its files and drafter.checkpoint (lab/preflight.py; not whether vLLM can serve it: a study tags
        such an arm `vllm_skipped`), and check that each objective is a metric the runs log. Returns the
        first config."""
        swept = {p.name for p in self.space if p.kind != "bundle"}
        for o in extra:
            key = o.split("=", 1)[0].lstrip("+~")
            if key in swept:
                raise ConfigError(key, f"swept by {self.source}; drop the override or the parameter")
        first = None
        for params in self.probes():
            try:
                cfg = compose(self.trial_overrides(params, self.seeds[0], extra))
                check_paths(cfg)
                check_target(cfg)
                check_checkpoint(cfg)
            except ConfigError as exc:
                raise blame(exc, f"{self.source} point '{self.label(params)}'", extra) from None
            first = first or cfg
            for obj in self.objectives:
                _check_metric(obj.metric, cfg, f"{self.source}: objectives")
            if self.pruner["name"] != "none":
                _check_prune_metric(self.prune_key(cfg), cfg, f"{self.source}: pruner.metric")
        return first


def blame(exc: ConfigError, where: str, extra: list[str] | tuple[str, ...] = ()) -> ConfigError:
    """The error of a point or arm that does not compose, said of `where`; a bad key of where runs are
    tracked (a malformed tracking.uri) is the same for every point, and a bad override of the user's own
    (`extra`) is the user's, so those are said of the key alone."""
    own = {o.split("=", 1)[0].lstrip("+~") for o in extra} | set(extra)
    if not changing_results([f"{exc.key}="]) or exc.key in own:
        return exc
    return ConfigError(f"{where}: {exc.key}", exc.message)


def changing_results(overrides: list[str]) -> list[str]:
    """The overrides that change what a run computes (not where it runs or is tracked)."""
    return [o for o in overrides if not o.startswith(_PLACEMENT)]


def _override_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _short(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else _override_value(value)


_EVAL = re.compile(r"^eval/(?P<suite>[^/]+)/(?P<backend>ref|vllm)/k(?P<k>\d+)/")
_DRIFT = re.compile(r"^drift/(?P<suite>[^/]+)/k(?P<k>\d+)/")


def _check_metric(metric: str, cfg: DictConfig, where: str) -> None:
    """A metric named after a suite, backend and k the runs do not evaluate would never be logged."""
    m = _EVAL.match(metric) or _DRIFT.match(metric)
    if not m:
        return
    e = cfg.eval
    suite = m["suite"].split(".")[0]
    if suite not in e.suites:
        raise ConfigError(where, f"'{metric}' needs suite '{suite}' in eval.suites (runs evaluate {list(e.suites)})")
    if int(m["k"]) not in e.num_speculative_tokens:
        raise ConfigError(
            where, f"'{metric}' needs k={m['k']} in eval.num_speculative_tokens ({list(e.num_speculative_tokens)})"
        )
    backend = m.groupdict().get("backend") or "ref"  # drift probes come from the reference decoder
    if backend not in e.backends:
        raise ConfigError(where, f"'{metric}' needs backend '{backend}' in eval.backends ({list(e.backends)})")


def _check_prune_metric(metric: str, cfg: DictConfig, where: str) -> None:
    """A pruner reads a metric the trainer logs as it trains: a training curve, or one of the validation pass's."""
    if metric.startswith("train/") and metric != metric_keys.train_stat("final_tokens_per_s"):
        return
    if metric.startswith("val/") and cfg.train.val_prompts == 0:
        raise ConfigError(where, f"'{metric}' needs the validation pass; the runs have train.val_prompts=0")
    logged = metric_keys.validation_keys(validation_depth(cfg))
    if metric not in logged:
        raise ConfigError(
            where,
            f"the runs log no '{metric}' while they train; expected {metric_keys.val_al(select_k(cfg))} (the "
            f"default), another val/... key of the validation pass (k to {validation_depth(cfg)}), or {PROXY_METRIC}",
        )


def available(folder: Path = SWEEP_DIR) -> list[str]:
    return sorted(p.stem for p in folder.glob("*.yaml"))


def load(name: str, folder: Path = SWEEP_DIR) -> Sweep:
    """Read and check `sweeps/NAME.yaml` (or NAME given as a path to a .yaml file) against its schema
    (lab/sweep/spec_schema.py `SweepSpec`); raises ConfigError naming the file, the key and what is expected."""
    if name.endswith((".yaml", ".yml")):
        path = Path(name)
        name, where = path.stem, name
        if path.is_dir():
            raise ConfigError(where, "is a directory; expected a sweep spec file (YAML)")
        if (problem := path_problem(SPEC_FILE, where, missing=False)) is not None:  # a loop, under a file
            raise ConfigError(where, f"{problem}; expected a sweep spec file (YAML)")
        if not path.is_file():
            raise ConfigError(
                where, f"no such file; expected a sweep spec file (YAML) or one of sweeps/: {', '.join(available())}"
            )
    else:
        path, where = folder / f"{name}.yaml", f"sweeps/{name}.yaml"
    if not path.is_file():
        raise ConfigError("sweep", f"unknown sweep '{name}'; available: {', '.join(available(folder))}")
    raw = read_yaml(path, where)
    if isinstance(raw, dict) and isinstance(raw.get("objectives"), (str, dict)):
        raw = {**raw, "objectives": [raw["objectives"]]}  # one objective, not in a list
    spec = spec_reader.check(SweepSpec, raw, where)
    sweep = Sweep(
        name=name,
        space=[_param(where, str(k), p) for k, p in spec["space"].items()],
        objectives=[Objective(o["metric"], o["direction"], o["reduce"]) for o in spec["objectives"]],
        description=spec["description"] or "",
        overrides=spec["overrides"],
        sampler=_named(raw.get("sampler"), spec["sampler"]),
        pruner=_named(raw.get("pruner"), spec["pruner"]),
        prune_metric=spec["pruner"]["metric"],
        seeds=spec["seeds"],
        trials=spec["trials"],
        study=spec["study"],
        max_retry=spec["max_retry"],
        heartbeat_s=spec["heartbeat_s"],
        grace_s=spec["grace_s"],
        source=where,
    )
    if sweep.grace_s <= sweep.heartbeat_s:
        raise ConfigError(
            f"{where}: grace_s",
            f"expected more seconds than heartbeat_s ({sweep.heartbeat_s:g}): a live worker stamps its heartbeat "
            f"every heartbeat_s, got {sweep.grace_s:g}",
        )
    if sweep.is_grid:
        for p in sweep.space:
            if p.kind == "float":
                raise ConfigError(
                    f"{where}: space.{p.name}",
                    "a grid needs a list of values or an integer range, "
                    f"not a float range (low={p.low!r} high={p.high!r})",
                )
        if sweep.trials is not None and sweep.trials != sweep.budget():
            raise ConfigError(
                f"{where}: trials", f"a grid runs every point x seed ({sweep.budget()}); drop trials or set it to that"
            )
    if len(sweep.objectives) > 1 and sweep.pruner["name"] != "none":
        raise ConfigError(f"{where}: pruner", "Optuna prunes single-objective studies only; use pruner: none")
    if sweep.sampler["name"] == "nsga2" and len(sweep.objectives) < 2:
        raise ConfigError(f"{where}: sampler", "nsga2 is for two or more objectives; use tpe for one")
    return sweep


def _param(where: str, name: str, spec: dict[str, Any]) -> Param:
    """A checked `ParamSpec` as a Param: exactly one of values, choices, or low and high."""
    key = f"{where}: space.{name}"
    is_range = spec["low"] is not None or spec["high"] is not None
    forms = [spec["values"] is not None, spec["choices"] is not None, is_range]
    if sum(forms) != 1 or (is_range and (spec["low"] is None or spec["high"] is None)):
        given = {k: v for k, v in spec.items() if v is not None and not (k == "log" and v is False)}
        raise ConfigError(key, expected_got(f"exactly one of {ParamSpec.EXPECTED}", given))
    if spec["values"] is not None:
        values = spec["values"]
        return Param(
            name, "categorical", [v if isinstance(v, (str, int, float, bool)) else json.dumps(v) for v in values]
        )
    if spec["choices"] is not None:
        bundles = spec["choices"]
        return Param(name, "bundle", list(bundles), bundles=bundles)
    low, high, step, log = spec["low"], spec["high"], spec["step"], spec["log"]
    if low >= high:
        raise ConfigError(key, f"expected numbers low < high, got low={low!r} high={high!r}")
    if log and low <= 0:
        raise ConfigError(key, f"expected low > 0 for a log range, got low={low!r}")
    is_int = isinstance(low, int) and isinstance(high, int) and isinstance(1 if step is None else step, int)
    return Param(name, "int" if is_int else "float", low=low, high=high, step=step, log=log)


def _named(raw: Any, checked: dict[str, Any]) -> dict[str, Any]:
    """A checked sampler or pruner as {name: NAME, OPTION: VALUE, ...}, in the file's order."""
    if not isinstance(raw, dict):
        return {"name": checked["name"], **checked["options"]}
    return {k: checked["name"] if k == "name" else checked["options"][k] for k in raw if k != "metric"}
