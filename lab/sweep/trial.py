"""One trial: compose its config, run it as a child MLflow run under its heartbeat (or complete it from a
run that already computed exactly this config), report training to the pruner, tell Optuna the outcome."""

from __future__ import annotations

import logging
import time
from typing import Any

import optuna
from omegaconf import DictConfig
from optuna.trial import TrialState

from lab import metrics as metric_keys
from lab import signals, track
from lab.config.composition import compose
from lab.config.identity import config_hash
from lab.pipeline import RunHooks
from lab.pipeline import run as run_one
from lab.preflight import check_checkpoint
from lab.sweep import optuna_adapter as adapter
from lab.sweep.heartbeat import beating
from lab.sweep.queue import enqueue_other_seeds, retry
from lab.sweep.storage import Session
from lab.sweep.summary import fmt

logger = logging.getLogger(__name__)

# what fails one run (bad data, a non-finite loss, a full disk) and not the study
RUN_FAILURES = (RuntimeError, ValueError, FloatingPointError, OSError)


def _finished_run(s: Session, trial: optuna.Trial, cfg: DictConfig, arm: str) -> Any | None:
    """A FINISHED child of the parent run that computed exactly this config for this slot: an earlier
    attempt of this trial (its worker died before telling Optuna), or a run logged before the study."""
    history = adapter.retry_history(s.storage, trial)
    h, attempts = config_hash(cfg), {str(n) for n in history}
    for run in track.child_runs(s.uri, s.parent_run_id, status="FINISHED"):
        tags = run.data.tags
        if tags.get("arm") == arm and tags.get("config_hash") == h and tags.get("trial", "") in attempts | {""}:
            return run
    return None


def _values_of_run(s: Session, run: Any) -> list[float]:
    metrics: dict[str, float | list[float]] = {}
    for obj in s.sweep.objectives:
        if obj.reduce == "last" and obj.metric in run.data.metrics:
            metrics[obj.metric] = run.data.metrics[obj.metric]
        else:
            curve = track.metric_curve(s.uri, run.info.run_id, obj.metric)
            if curve:
                metrics[obj.metric] = curve
    return [obj.value(metrics) for obj in s.sweep.objectives]


def run_trial(s: Session, trial: optuna.Trial, worker: str, threads: int | None, progress: bool) -> None:
    """One trial: compose, run (or reuse a finished run), tell Optuna."""
    sweep = s.sweep
    point, seed = int(trial.user_attrs["point"]), int(trial.user_attrs["seed"])
    params = {p.name: p.suggest(trial) for p in sweep.space}
    if not sweep.is_grid and seed == sweep.seeds[0] and len(sweep.seeds) > 1:
        enqueue_other_seeds(s, point, params)
    arm = sweep.label(params)
    name = f"trial {trial.number} ({arm}, seed {seed})"
    trial.set_user_attr("worker", worker)
    trial.set_user_attr("arm", arm)
    cfg = compose(sweep.trial_overrides(params, seed, s.extra) + ([f"threads={threads}"] if threads else []))
    check_checkpoint(cfg)  # compose does not read drafter.checkpoint; it may have changed since Sweep.check

    done = _finished_run(s, trial, cfg, arm)
    if done is not None:
        try:
            values = _values_of_run(s, done)
        except KeyError:
            done = None  # the finished run lacks the objective: run it again
        else:
            trial.set_user_attr("mlflow_run_id", done.info.run_id)
            trial.set_user_attr("reused", True)
            s.study.tell(trial, values)
            logger.info(f"{name}: already finished as MLflow run {done.info.run_id[:8]}: {fmt(sweep, values)}")
            return

    def on_start(run_id: str) -> None:
        trial.set_user_attr("mlflow_run_id", run_id)

    prune_key = sweep.prune_key(cfg)

    def on_train_metrics(metrics: dict[str, float], step: int) -> None:
        if len(sweep.objectives) == 1 and prune_key in metrics:
            trial.report(metrics[prune_key], step)
            if trial.should_prune():
                raise track.RunStopped(f"pruned by Optuna at step {step}: {prune_key} {metrics[prune_key]:.3f}")

    hooks = RunHooks(
        on_stage=lambda stage: logger.info(f"{name}: {stage}"), on_start=on_start, on_train_metrics=on_train_metrics
    )
    tags = {"trial": trial.number, "optuna_study": s.study.study_name, "sweep": sweep.name}
    started = time.time()
    with beating(s, trial):
        try:
            result = run_one(cfg, progress=progress, parent_run_id=s.parent_run_id, hooks=hooks, tags=tags)
        except track.RunStopped as stop:
            s.study.tell(trial, state=TrialState.PRUNED)
            _tag_run(s, trial, "PRUNED")
            logger.info(f"{name}: {stop}")
            return
        except KeyboardInterrupt as exc:  # Ctrl-C, SIGTERM or SIGUSR1: queued again at once, not after the grace
            trial.set_user_attr("error", f"interrupted ({signals.signal_of(exc).name})")
            s.study.tell(trial, state=TrialState.FAIL)
            retry(s, trial, None)  # a rerun picks it up again
            raise
        except RUN_FAILURES as exc:  # recorded FAILED; the study goes on
            trial.set_user_attr("error", f"{type(exc).__name__}: {exc}"[:2000])
            s.study.tell(trial, state=TrialState.FAIL)
            logger.warning(f"{name}: FAILED: {type(exc).__name__}: {exc}")
            return
    try:
        values = [o.value(result.metrics) for o in sweep.objectives]
    except KeyError as exc:
        trial.set_user_attr("error", f"the run did not log the objective {exc}")
        s.study.tell(trial, state=TrialState.FAIL)
        _tag_run(s, trial, "FAIL")
        logger.warning(f"{name}: FAILED: the run did not log the objective {exc}")
        return
    m = result.metrics
    trial.set_user_attr("seconds", time.time() - started)
    trial.set_user_attr("cache_s", float(m.get(metric_keys.cache_stat("seconds"), 0.0)))
    trial.set_user_attr("cache_hit", bool(m.get(metric_keys.cache_stat("hit"), 0.0)))
    if metric_keys.cache_stat("build_seconds") in m:
        trial.set_user_attr("cache_build_s", float(m[metric_keys.cache_stat("build_seconds")]))
    s.study.tell(trial, values)
    _tag_run(s, trial, "COMPLETE")
    logger.info(f"{name}: {fmt(sweep, values)} in {time.time() - started:.0f} s")


def _tag_run(s: Session, trial: optuna.Trial, state: str) -> None:
    run_id = adapter.user_attrs(s.storage, trial).get("mlflow_run_id")
    if run_id:
        track.set_run_tags(s.uri, run_id, {"trial_state": state})
