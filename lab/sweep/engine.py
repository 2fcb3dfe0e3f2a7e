"""Optuna studies over composed Hydra configs; every trial is one pipeline run, an MLflow child run.

How a study keeps its promises, whatever the sampler:
- The budget is a queue. The launcher enqueues one WAITING trial per (point, seed) slot: every grid
  point x seed with fixed params (the full factorial, without Optuna's GridSampler); for the other
  samplers one empty trial per point, whose params the sampler draws when a worker takes it (its
  other seeds are then enqueued with the same params).
  Workers only take WAITING trials (an atomic WAITING -> RUNNING in the storage), so N workers never
  run a slot twice and never exceed the total budget; rerunning tops the queue up to the total.
- Heartbeats: a running trial's worker stamps `heartbeat` every `heartbeat_s`. A trial whose worker
  died (same host: the process is gone; elsewhere: no heartbeat change for `grace_s`) is failed and
  re-enqueued with the same params (Optuna's RetryHeartbeatStaleTrialCallback, up to `max_retry`).
  Ctrl-C re-enqueues the interrupted trial too, so a rerun continues where it stopped.
- Pruning: the run reports the spec's `pruner.metric` as it trains (the exact validation AL at
  train.select_k unless it names another, such as the proxy `train/simulated_acc_len`); a pruned trial ends its
  MLflow run KILLED, tagged `trial_state=PRUNED`.
- A trial whose exact config already FINISHED under the parent run (same arm, same config hash) is
  not rerun: it is completed from that run's metrics.

This module only orchestrates (`launch`, `join`, and the worker loop `work`); each concern has its module:
`storage` (where the study lives, the sampler, the pruner, `Session`), `queue` (the budget as a queue of
slots), `heartbeat` (heartbeats, stale trials), `trial` (one trial), `summary` (what the parent run
records), `workers` (worker subprocesses), and `optuna_adapter` (every use of Optuna's internals).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig
from optuna.trial import TrialState

from lab import logs, track
from lab import metrics as metric_keys
from lab.config import ConfigError, redact
from lab.config.composition import compose
from lab.device import resolve_device
from lab.pipeline import warm_caches
from lab.preflight import check_checkpoint
from lab.sweep.heartbeat import recover_stale, worker_name
from lab.sweep.queue import counts, pop, top_up
from lab.sweep.search_space import Sweep
from lab.sweep.storage import Session, dashboard_command, open_session
from lab.sweep.summary import finish, spec_params, study_span
from lab.sweep.trial import RUN_FAILURES, run_trial
from lab.sweep.workers import gpu_placement, place_this_process, worker_subprocesses

logger = logging.getLogger(__name__)


@dataclass
class SweepResult:
    study_name: str
    storage: str
    parent_run_id: str
    budget: int
    counts: dict[str, int]
    ran: int  # trials finished while this invocation ran (all workers; reused finished runs included)
    seconds: float
    summary: str


def run_waiting_trials(s: Session, threads: int | None = None, progress: bool = True) -> None:
    """Run WAITING trials until none is left and no other worker runs one (a dead worker's is retried)."""
    worker = worker_name()
    observed: dict[int, tuple[Any, float]] = {}
    started, waiting_said = time.time(), False
    while True:
        recover_stale(s, observed)
        trial = pop(s)
        if trial is not None:
            waiting_said = False
            run_trial(s, trial, worker, threads, progress)
            c = counts(s)
            minutes = (time.time() - started) / 60
            logger.info(
                f"[{c['finished']}/{s.user_attr('budget')} finished, {c['running']} running, {minutes:.1f} min]"
            )
            continue
        running = s.trials((TrialState.RUNNING,))
        if not running:
            return
        if not waiting_said:
            numbers = ", ".join(str(t.number) for t in running)
            grace = s.sweep.grace_s
            logger.info(
                f"waiting for trial(s) {numbers} in other workers (retried if a worker is silent for {grace:.0f} s)"
            )
            waiting_said = True
        time.sleep(min(5.0, s.sweep.heartbeat_s))


def join(sweep: Sweep, extra: list[str], threads: int | None = None, progress: bool = True) -> None:
    """`lab sweep worker`: work on a study another process started, from this or another machine."""
    cfg = compose(sweep.trial_overrides(sweep.base_point(), sweep.seeds[0], extra))
    check_checkpoint(cfg)
    index = int(os.environ.get("LAB_WORKER_INDEX", os.getpid()))
    s = open_session(sweep, extra, cfg, create=False, worker_index=index)
    s.parent_run_id = s.user_attr("mlflow_parent_run_id", "")
    if not s.parent_run_id:
        raise ConfigError("sweep", f"study '{s.study.study_name}' has no MLflow parent run; start it with `lab sweep`")
    logger.info(f"worker {worker_name()} joined study {s.study.study_name} in {redact(s.storage_url)}")
    run_waiting_trials(s, threads, progress)
    # the queue is empty and no trial runs anywhere: whichever worker gets here last leaves the summary
    finish(s, *study_span(s))
    track.end_run(s.uri, s.parent_run_id, "FINISHED")


def _warm(cfg: DictConfig, progress: bool) -> None:
    """The first trial's shared caches, built here on every core before the workers start: else the first
    worker builds them on its share of the cores while the others wait on the cache's lock. A failure is left
    to the trials, which record it (each builds what it needs)."""
    logger.info(
        "warming the caches the trials share (target, data, hidden states, suites, greedy answers) on every core first"
    )
    try:
        seconds = warm_caches(cfg, progress)
    except RUN_FAILURES as exc:
        logger.warning(f"warming the caches failed ({type(exc).__name__}: {exc}); each trial builds what it needs")
        return
    logger.info(f"caches warm in {sum(seconds.values()):.0f} s")


def _placement(cfg: DictConfig, workers: int) -> list[str | None]:
    """Each worker's GPU (`gpu_placement`) where the study computes on CUDA; this process (worker 0) takes
    its own with `set_device`."""
    if resolve_device(cfg)[0].type != "cuda":
        if cfg.gpus:
            raise ConfigError("gpus", f"expected device=cuda (or auto on a GPU machine), got device={cfg.device}")
        return [None] * workers
    count = torch.cuda.device_count()
    gpus = list(cfg.gpus) if cfg.gpus else None
    placed = gpu_placement(workers, gpus, count, os.environ.get("CUDA_VISIBLE_DEVICES"))
    if placed[0] is not None:
        place_this_process(gpus, count)
        logger.info("GPUs: " + ", ".join(f"worker {i} on GPU {gpu}" for i, gpu in enumerate(placed)))
    return placed


def launch(
    sweep: Sweep,
    extra: list[str],
    worker_args: list[str],
    workers: int = 1,
    trials: int | None = None,
    progress: bool = True,
) -> SweepResult:
    """Create or resume the study, top its queue up to the total budget, run `workers` workers (this
    process and workers - 1 subprocesses `lab <worker_args> ...`) until the queue is empty, summarize.
    With `workers=0` only queue: workers started elsewhere run the trials, and the last one summarizes."""
    if workers < 0:
        raise ConfigError("--workers", f"must be 0 (only queue the trials) or more, got {workers}")
    cfg = sweep.check(extra)  # every point composes before anything runs
    budget = sweep.budget(trials)
    s = open_session(sweep, extra, cfg, create=True)
    name = s.study.study_name
    t = cfg.tracking
    user_threads = any(o.startswith("threads=") for o in extra)
    # --workers 0 only queues: the workers that join later choose their own threads
    threads = None if workers <= 1 or user_threads else max(1, (os.cpu_count() or 1) // workers)
    tags = {
        "study": sweep.experiment,
        "sweep": sweep.name,
        "optuna_study": name,
        "optuna_storage": redact(s.storage_url),
        "git_commit": track.git_commit(),
        "study_kind": sweep.kind,
        **({"baseline": sweep.baseline} if sweep.baseline else {}),
        **({"lab.command": sweep.description} if sweep.kind == "multirun" else {}),  # `lab report multirun=NAME`
    }
    started = time.time()
    with track.parent_run(t.uri, t.artifact_root, sweep.experiment, f"sweep-{sweep.name}", name, tags) as parent:
        s.parent_run_id = parent.id
        parent.log_params(spec_params(sweep, extra))
        parent.log_metrics({metric_keys.sweep_stat("budget"): budget})
        s.study.set_user_attr("mlflow_parent_run_id", parent.id)
        s.study.set_user_attr("sweep", sweep.name)
        added = top_up(s, budget)
        c = counts(s)
        join_cmd = " ".join(["lab", *worker_args, *(redact(o) for o in extra)])  # logs keep no password
        logger.info(
            f"sweep {sweep.name}: study {name} in {redact(s.storage_url)}\n"
            f"  budget {budget} trials: {c['finished']} finished, {c['waiting']} to run "
            f"({added} newly queued), {c['running']} running elsewhere; {workers} worker(s) here\n"
            f"  MLflow: experiment {sweep.experiment}, parent run {parent.id} (browse with `lab ui`)\n"
            f"  watch:  {dashboard_command(redact(s.storage_url))}\n"
            f"  join from another process or machine (same storage and store): {join_cmd}"
        )
        finished_before = c["finished"]
        if workers == 0 and c["waiting"] + c["running"] == 0:  # nothing to run: the parent ends now
            return SweepResult(name, redact(s.storage_url), parent.id, budget, c, 0, 0.0, finish(s, *study_span(s)))
        if workers == 0:
            parent.end_status = "RUNNING"  # the last worker to finish ends it
            note = f"queued; the study's parent run stays RUNNING until a worker finishes its last trial: {join_cmd}"
            return SweepResult(name, redact(s.storage_url), parent.id, budget, c, 0, 0.0, note)
        count = min(workers, c["waiting"]) - 1  # no more workers than queued trials
        gpus = _placement(cfg, count + 1)
        if count > 0:
            _warm(cfg, progress)
        # with workers beside it, this process is worker 0, and its lines say so
        with worker_subprocesses(worker_args, extra, threads, count, gpus), logs.as_worker("0" if count else None):
            run_waiting_trials(s, threads, progress and workers == 1)
        c = counts(s)
        ran = c["finished"] - finished_before
        seconds = time.time() - started
        text = finish(s, seconds, workers)
    return SweepResult(name, redact(s.storage_url), parent.id, budget, c, ran, seconds, text)
