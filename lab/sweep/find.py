"""Finding a study and its parts from what a command names: the sweep or experiment that `sweep=NAME` /
`experiment=NAME` picks and its first point composed (`first_point`, `study_spec`; `dashboard_study` for
`lab dashboard`), the parent run `--run` names (`parent_of`), the seeds `--seeds` asks for among those recorded
(`seeds_found`), and one arm of an experiment composed as `lab ablate` composes it (`experiment_arm`). Each
raises ConfigError naming the option or key and what is there to choose from. MLflow (lab.track) is imported
only by the look-ups that read a store.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig

from lab.config import ConfigError
from lab.config.composition import compose
from lab.sweep import experiment, search_space
from lab.sweep.search_space import Sweep, blame

STUDY_KINDS = ("sweep", "experiment")  # `sweep=NAME` / `experiment=NAME`


def named_study(overrides: list[str], kinds: tuple[str, ...] = STUDY_KINDS) -> tuple[dict[str, list[str]], list[str]]:
    """The names given as `sweep=NAME` and `experiment=NAME` (or as `KIND=NAME` of the `kinds` given; each a
    list: the last one counts), and the other overrides."""
    named = {key: [o.split("=", 1)[1] for o in overrides if o.startswith(f"{key}=")] for key in kinds}
    extra = [o for o in overrides if not o.startswith(tuple(f"{key}=" for key in kinds))]
    return named, extra


def first_point(sweep: Sweep, extra: list[str], check: Callable[[DictConfig], None] | None = None) -> DictConfig:
    """The study's first point composed as its first trial is (and passed through `check`, where given): what
    says where its runs are tracked and its Optuna study is stored. A ConfigError is said of that point (`blame`)."""
    base = sweep.base_point()
    try:
        cfg = compose(sweep.trial_overrides(base, sweep.seeds[0], extra))
        if check is not None:
            check(cfg)
    except ConfigError as exc:
        raise blame(exc, f"{sweep.source} point '{sweep.label(base)}'", extra) from None
    return cfg


def study_spec(overrides: list[str], seeds: str | None, verb: str) -> tuple[Sweep, str, list[str], DictConfig]:
    """The sweep (an experiment's as a grid study) named by `sweep=NAME` or `experiment=NAME`, its kind, the
    other overrides, and the study's first point composed (where its runs are tracked). `verb` is the
    `lab study` verb the error's example names."""
    named, extra = named_study(overrides)
    if named["sweep"] and named["experiment"]:
        raise ConfigError("experiment", "give sweep=NAME or experiment=NAME, not both")
    if not (named["sweep"] or named["experiment"]):
        raise ConfigError(
            "experiment",
            f"required: experiment=NAME or sweep=NAME, e.g. `lab study {verb} experiment=drift_2x2`; "
            f"experiments: {', '.join(experiment.available())}; sweeps: {', '.join(search_space.available())}",
        )
    if named["sweep"]:
        if seeds is not None:
            raise ConfigError("--seeds", "only with experiment=NAME (the seeds `lab ablate --seeds` ran)")
        sweep, kind = search_space.load(named["sweep"][-1]), "sweep"
    else:
        sweep, kind = experiment.load(named["experiment"][-1], seeds_arg=seeds).as_sweep(extra), "experiment"
    return sweep, kind, extra, first_point(sweep, extra)


def dashboard_study(
    overrides: list[str], seeds: str | None, storage_given: bool
) -> tuple[Sweep | None, str, list[str]]:
    """`lab dashboard`'s study: the sweep (an experiment's as a grid study) named by `sweep=NAME` or
    `experiment=NAME`, or None where `--storage` names a storage instead; the command that runs it (for the
    error about a storage without it); the other overrides."""
    named, extra = named_study(overrides)
    if named["sweep"] and named["experiment"]:
        raise ConfigError("experiment", "give sweep=NAME or experiment=NAME, not both")
    if not (named["sweep"] or named["experiment"]):
        if not storage_given:
            raise ConfigError(
                "sweep",
                "required: sweep=NAME, experiment=NAME or --storage URL, e.g. `lab dashboard sweep=toggles_grid`; "
                f"sweeps: {', '.join(search_space.available())}; experiments: {', '.join(experiment.available())}",
            )
        if extra:
            key = extra[0].split("=", 1)[0]
            raise ConfigError(key, "overrides pick a sweep's study: give sweep=NAME or experiment=NAME too")
    if seeds is not None and not named["experiment"]:
        raise ConfigError("--seeds", "only with experiment=NAME (the seeds `lab ablate --seeds` ran)")
    if named["sweep"]:
        return search_space.load(named["sweep"][-1]), f"lab sweep sweep={named['sweep'][-1]}", extra
    if named["experiment"]:
        exp = experiment.load(named["experiment"][-1], seeds_arg=seeds)
        return exp.as_sweep(extra), f"lab ablate experiment={exp.name}", extra
    return None, "", extra


def parent_of(sweep: Sweep, kind: str, uri: str, run_id: str) -> str:
    """`--run RUN_ID`, once it is the parent run of a study of the sweep (an experiment's as a grid study;
    `kind`: "experiment" or "sweep"), not a child run nor another study's: a run that is not would make an
    empty report or archive."""
    from lab import track

    parents = track.study_parents(uri, sweep.experiment, sweep.name)
    if any(p.info.run_id == run_id for p in parents):
        return run_id
    try:
        track.get_run(uri, run_id)
    except ValueError as exc:
        raise ConfigError("--run", f"{exc}; expected {_parents_said(sweep, kind, parents)}") from None
    raise ConfigError(
        "--run",
        f"run '{run_id}' is not the parent run of a study of {sweep.name}; "
        f"expected {_parents_said(sweep, kind, parents)}",
    )


def _parents_said(sweep: Sweep, kind: str, parents: list[Any]) -> str:
    if not parents:
        verb = "ablate" if kind == "experiment" else "sweep"
        return (
            f"the parent run of a study of {sweep.name}, and the store has none (run `lab {verb} {kind}={sweep.name}`)"
        )
    shown = ", ".join(f"{p.info.run_id} ({p.data.tags.get('optuna_study', '?')})" for p in parents[:5])
    return f"one of the parent runs of its studies: {shown}" + (
        f" and {len(parents) - 5} more" if len(parents) > 5 else ""
    )


def seeds_found(study: Any, asked: list[int], option: str = "--seeds") -> str:
    """--seeds that match no finished run of `study` (lab.report's `Study`) are an error naming the seeds there
    are; some missing, a note (returned; "" when none is)."""
    have = study.recorded_seeds
    found = [s for s in asked if s in have]
    where = f"study {study.parent.data.tags.get('optuna_study', study.parent.info.run_id)}"
    if not found:
        raise ConfigError(
            option,
            f"no finished run of seed {', '.join(map(str, asked))} in {where}; expected some of the seeds it has: "
            f"{', '.join(map(str, have)) or 'none'}",
        )
    missing = [s for s in asked if s not in have]
    if not missing:
        return ""
    return (
        f"{option}: seed {', '.join(map(str, missing))} has no finished run in {where}; reporting "
        f"seed {', '.join(map(str, found))}"
    )


def experiment_arm(
    name: str | None, arm: str | None, extra: list[str], example: str
) -> tuple[DictConfig, list[str], str]:
    """One arm of experiments/NAME.yaml (`--experiment NAME --arm ARM`: both or neither) composed as
    `lab ablate` composes its runs (the experiment's overrides, the arm's, the user's, then study / arm /
    seed: the first seed unless `seed=N`): the config, its overrides and the arm said in words. `example` is
    the command the error about a missing option shows."""
    if arm is None or name is None:
        given, missing = ("--experiment", "--arm") if arm is None else ("--arm", "--experiment")
        raise ConfigError(missing, f"required with {given}, e.g. `{example}`")
    exp = experiment.load(name)
    arms = [a.name for a in exp.arms]
    if arm not in arms:
        raise ConfigError("--arm", f"unknown arm '{arm}' of experiments/{exp.name}.yaml; arms: {', '.join(arms)}")
    seeds = [o.split("=", 1)[1] for o in extra if o.startswith("seed=")]
    extra = [o for o in extra if not o.startswith("seed=")]
    try:
        seed = int(seeds[-1]) if seeds else exp.seeds[0]
    except ValueError:
        raise ConfigError("seed", f"expected an integer, got '{seeds[-1]}'") from None
    sweep = exp.as_sweep(extra)
    overrides = sweep.trial_overrides({"arm": arm}, seed, extra)
    try:
        cfg = compose(overrides)
    except ConfigError as exc:
        raise blame(exc, f"experiments/{exp.name}.yaml point '{arm}'", extra) from None
    return cfg, overrides, f"experiments/{exp.name}.yaml arm {arm} (seed {seed})"
