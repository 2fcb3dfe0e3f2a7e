"""`lab ablate` (an experiment's arms x seeds as a grid study) and `lab sweep` (an Optuna study of a sweep spec):
both run on the sweep engine, resumable, with `worker` processes joining from elsewhere."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from lab.cli.common import (
    SWEEP_FILE,
    HelpNames,
    Verb,
    capped_workers,
    integer,
    named,
    print_arms,
    print_points,
    reachable,
    worker_mode,
    worker_options,
)
from lab.config.composition import compose
from lab.sweep.spec_schema import MAX_TRIALS

if TYPE_CHECKING:
    from lab.sweep.experiment import Experiment
    from lab.sweep.search_space import Sweep


def cmd_ablate(args: argparse.Namespace) -> int:
    """every arm x seed of experiments/NAME.yaml as a grid study, child runs of one parent (resumable)

    Run every arm x seed of experiments/NAME.yaml as a grid study of the sweep engine: child MLflow runs of one
    parent run, then the tables and reports/NAME/report.md. Rerunning the same command resumes: finished runs
    are not rerun. `lab ablate worker experiment=NAME` joins a running ablation.

    Before the first run it prints the plan (lab/plan.py): the stages the runs share, once each, then each arm's
    training and evaluation, each cached, to build or finished, with its size and an estimate where this machine
    has a rate (its runs, or a few seconds of measurement). --dry-run prints the plan and starts nothing, writing
    no file.
    """
    from lab.sweep import experiment

    worker, overrides = worker_mode(args.overrides)
    if worker:
        worker_options(args, "ablate")
    name, extra = named(overrides, "experiment", "lab ablate experiment=drift_2x2", experiment.available())
    exp = experiment.load(name, seeds_arg=args.seeds)
    if args.cfg:
        print_arms(exp, extra)
        return 0
    seeds = [f"--seeds={args.seeds}"] if args.seeds else []
    return run_experiment(exp, extra, args, worker, ["ablate", "worker", f"experiment={name}", *seeds])


def run_experiment(
    exp: Experiment, extra: list[str], args: argparse.Namespace, worker: bool, worker_args: list[str]
) -> int:
    """An experiment (experiments/NAME.yaml, or `lab run -m`'s) as a grid study on the sweep engine, then its
    report; as a `worker`, join the study already queued. `worker_args` start more workers."""
    from lab.cli.report import describe_study, load_study, report_command, write_report

    sweep = exp.as_sweep(extra)
    if getattr(args, "dry_run", False):
        _study_checked(sweep, extra, every_point=True)
        from lab.plan import study_plan

        print(study_plan(sweep, extra))
        return 0
    _study_reachable(sweep, extra, every_point=not worker)
    workers = capped_workers(args)
    from lab.sweep import engine  # after the checks: it imports torch, MLflow and Optuna (seconds)

    seeds_arg = getattr(args, "seeds", None)
    if worker:
        engine.join(sweep, extra, progress=not args.no_progress)
        print(f"the study is done; its report: {report_command(exp, extra, seeds_arg)}")
        return 0
    from lab.plan import study_plan

    print(study_plan(sweep, extra), flush=True)
    describe_study(exp, extra, seeds_arg)  # the experiment's page says what it compares while it runs
    result = engine.launch(sweep, extra, worker_args, workers=workers, progress=not args.no_progress)
    if workers == 0:
        print(result.summary)
        return 0
    uri = compose([*exp.overrides, *extra]).tracking.uri
    rep = write_report(exp, extra, load_study(exp, uri, result.parent_run_id), None, seeds_arg)
    print(f"\n{rep.main_table()}")
    c = result.counts
    kind = "ablation" if exp.kind == "ablate" else "multirun"
    print(
        f"{kind} {exp.name}: {c['complete']} of {result.budget} runs finished ({result.ran} in this invocation, "
        f"{result.seconds / 60:.1f} min), {c['failed']} failed; parent run {result.parent_run_id}\n"
        f"report: {rep.path} ({len(rep.tables)} tables, {len(rep.figures)} figures); browse with `lab ui`"
    )
    return 1 if c["failed"] else 0


def cmd_sweep(args: argparse.Namespace) -> int:
    """an Optuna study over sweeps/NAME.yaml: every trial a child MLflow run (resumable, parallel)

    Create or resume the Optuna study of sweeps/NAME.yaml and run its trials up to the TOTAL budget: each trial
    composes its config, runs the pipeline as a child MLflow run of the study's parent run and reports its
    objective(s). Rerunning continues the same study. `lab sweep worker sweep=NAME` joins a running study from
    another process or machine (same storage, same overrides). The storage is a journal file beside the MLflow
    database, or tracking.optuna_storage=URL (e.g. PostgreSQL).
    """
    from lab.sweep import search_space

    worker, overrides = worker_mode(args.overrides)
    if worker:
        worker_options(args, "sweep")
    name, extra = named(overrides, "sweep", "lab sweep sweep=toggles_grid", search_space.available())
    sweep = search_space.load(name)
    if args.cfg:
        print_points(sweep, extra)
        return 0
    _study_reachable(sweep, extra, every_point=not worker)
    if not worker:
        sweep.budget(args.trials)
    workers = capped_workers(args)
    from lab.sweep import engine  # after the checks: it imports torch, MLflow and Optuna (seconds)

    if worker:
        engine.join(sweep, extra, progress=not args.no_progress)
        return 0
    result = engine.launch(
        sweep,
        extra,
        ["sweep", "worker", f"sweep={name}"],
        workers=workers,
        trials=args.trials,
        progress=not args.no_progress,
    )
    if workers == 0:
        print(result.summary)
        return 0
    c = result.counts
    print(f"\n{result.summary}")
    print(
        f"study {result.study_name}: {c['complete']} complete, {c['pruned']} pruned, {c['failed']} failed of "
        f"{result.budget}; {result.ran} finished in this invocation ({result.seconds / 60:.1f} min); "
        f"MLflow parent run {result.parent_run_id}; browse with `lab ui`"
    )
    return 0


def _study_reachable(sweep: Sweep, extra: list[str], every_point: bool = False) -> None:
    """The first point of a study (with `every_point`: every point, its objectives and its budget, as the
    engine checks them) composes, its drafter.checkpoint fits and its store answers, before the engine is even
    imported."""
    from lab.preflight import check_optuna_storage
    from lab.sweep import storage

    cfg = _study_checked(sweep, extra, every_point)
    check_optuna_storage(storage.storage_url(cfg))
    reachable(cfg.tracking.uri)


def _study_checked(sweep: Sweep, extra: list[str], every_point: bool) -> DictConfig:
    """`_study_reachable`'s checks of the study's points, without opening its stores: its first point's config."""
    from lab.sweep import find, storage  # Optuna's: the sampler and pruner take the spec's options

    if every_point:
        cfg = sweep.check(extra)
        storage.sampler(sweep, 0, 0)
        storage.pruner(sweep)
        return cfg
    return find.first_point(sweep, extra, check=_fits)


def _fits(cfg: DictConfig) -> None:
    """What the engine's check would find wrong with a point of a study this machine runs (a worker's)."""
    from lab.preflight import check_checkpoint, check_paths, check_target

    check_paths(cfg)
    check_target(cfg)
    check_checkpoint(cfg)


def _study_arguments(p: argparse.ArgumentParser) -> None:
    """What `lab ablate` and `lab sweep` share: the workers here, and progress."""
    p.add_argument(
        "--workers",
        type=integer(0),
        help="trials run in parallel here (default 1; 0: only queue them for `worker` processes; more than "
        "the machine's cores are capped to them unless --force)",
    )
    p.add_argument("--force", action="store_true", help="keep a --workers above the machine's cores")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (stage lines only)")
    p.add_argument("--cfg", choices=["job"], help="print each arm's (point's) composed config and start nothing")


def _ablate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", help="[worker] experiment=NAME, then Hydra overrides for every arm")
    p.add_argument("--seeds", help="the seeds to run, e.g. 0,1 (default: the experiment's)")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan (each shared stage and arm: cached, to build or finished, its size and time) and start "
        "nothing",
    )
    _study_arguments(p)


def _sweep_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", help="[worker] sweep=NAME, then Hydra overrides for every trial")
    p.add_argument(
        "--trials",
        type=integer(1, MAX_TRIALS),
        help=f"the total trial budget, at most {MAX_TRIALS} (default: the spec's)",
    )
    _study_arguments(p)


def _ablate_epilog(names: HelpNames) -> str:
    return (
        f"experiments: {names['experiments']}\n"
        "examples:\n  lab ablate experiment=drift_2x2 --workers 2\n"
        "  lab ablate experiment=drift_2x2 profile=quick target=tiny_code data=code --seeds 0,1 --workers 2"
        "   # the demo's\n"
        "  lab ablate experiment=drift_2x2 profile=micro\n"
        "  lab ablate experiment=drift_2x2 --dry-run   # what it builds and finds cached, and how long it takes here"
    )


def _sweep_epilog(names: HelpNames) -> str:
    return (
        f"sweeps: {names['sweeps']}\n"
        "examples:\n  lab sweep sweep=toggles_grid --workers 2 profile=micro\n"
        "  lab sweep sweep=tpe_eagle31 --trials 40\n"
        "  lab sweep worker sweep=tpe_eagle31 tracking.optuna_storage=postgresql://user@host/optuna"
    )


ABLATE = Verb(cmd_ablate, _ablate_arguments, _ablate_epilog, takes_worker=True)
SWEEP = Verb(cmd_sweep, _sweep_arguments, _sweep_epilog, takes_worker=True, named_files=(SWEEP_FILE,))
