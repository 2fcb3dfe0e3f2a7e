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
- Pruning: the run reports `train/simulated_acc_len` as it trains; a pruned trial ends its MLflow run
  KILLED, tagged `trial_state=PRUNED`.
- A trial whose exact config already FINISHED under the parent run (same arm, same config hash) is
  not rerun: it is completed from that run's metrics.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from omegaconf import DictConfig
from optuna.exceptions import UpdateFinishedTrialError
from optuna.trial import TrialState

from lab import track
from lab.config import OPTUNA_DB_PREFIXES, ConfigError, compose, config_hash, redact
from lab.fsutil import file_lock
from lab.pipeline import RunHooks
from lab.pipeline import run as run_one
from lab.preflight import check_checkpoint
from lab.sweep.spec import PRUNE_METRIC, Sweep, changing_results

optuna.logging.set_verbosity(optuna.logging.WARNING)  # each trial prints its own line


def storage_url(cfg: DictConfig) -> str:
    """`tracking.optuna_storage`, or a journal file beside the local MLflow database."""
    if cfg.tracking.optuna_storage:
        return str(cfg.tracking.optuna_storage)
    db = track.local_paths(cfg.tracking.uri)
    return str((db.parent if db else Path("mlruns")) / "optuna.journal")


def dashboard_command(url: str) -> str:
    return f"optuna-dashboard {url}"


def _open_storage(url: str) -> optuna.storages.BaseStorage:
    if url.startswith(OPTUNA_DB_PREFIXES):
        try:
            # one cached handle for both the study and the engine's own reads and writes: a trial that another
            # process enqueued is known to Optuna's cache only once read through it
            return optuna.storages.get_storage(optuna.storages.RDBStorage(url))
        except Exception as exc:  # a missing driver, a refused connection: one line
            first = str(exc).splitlines()[0]
            raise ConfigError("tracking.optuna_storage", f"cannot open '{redact(url)}': {first}") from None
    path = Path(url)
    path.parent.mkdir(parents=True, exist_ok=True)
    backend = optuna.storages.journal.JournalFileBackend(str(path))
    return optuna.storages.JournalStorage(backend)


def _sampler(sweep: Sweep, worker_index: int, history: int) -> optuna.samplers.BaseSampler:
    opts = {k: v for k, v in sweep.sampler.items() if k != "name"}
    name = sweep.sampler["name"]
    if "seed" in opts:  # a sampler restarts its random stream in every process: offset it by the worker
        # and by the trials already drawn, or a resumed study would draw its first points again
        opts["seed"] = int(opts["seed"]) + 1000 * worker_index + history
    samplers = {
        # every grid trial is enqueued with fixed params, so the sampler is never asked; Optuna's GridSampler
        # would be wrong here: its after_trial raises KeyError('grid_id') on an enqueued trial when one grid
        # point is left, and on its own it may hand one point to two parallel workers
        "grid": lambda: optuna.samplers.RandomSampler(**opts),
        "tpe": lambda: optuna.samplers.TPESampler(**opts),
        "random": lambda: optuna.samplers.RandomSampler(**opts),
        "nsga2": lambda: optuna.samplers.NSGAIISampler(**opts),
    }
    try:
        return samplers[name]()
    except TypeError as exc:
        raise ConfigError(f"{sweep.source}: sampler", f"bad option for {name}: {exc}") from None


def _pruner(sweep: Sweep) -> optuna.pruners.BasePruner:
    opts = {k: v for k, v in sweep.pruner.items() if k != "name"}
    name = sweep.pruner["name"]
    pruners = {
        "none": optuna.pruners.NopPruner,
        "median": optuna.pruners.MedianPruner,
        "percentile": optuna.pruners.PercentilePruner,
        "hyperband": optuna.pruners.HyperbandPruner,
    }
    try:
        return pruners[name](**opts)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{sweep.source}: pruner", f"bad option for {name}: {exc}") from None


@dataclass
class Session:
    """One process's handle on a study: the spec, the storage and where its runs are tracked."""

    sweep: Sweep
    extra: list[str]
    storage_url: str
    storage: optuna.storages.BaseStorage
    study: optuna.Study
    uri: str
    parent_run_id: str = ""

    @property
    def study_id(self) -> int:
        return self.storage.get_study_id_from_name(self.study.study_name)

    def user_attr(self, key: str, default: Any = None) -> Any:
        return self.storage.get_study_user_attrs(self.study_id).get(key, default)

    def trials(self, states: tuple[TrialState, ...] | None = None) -> list[optuna.trial.FrozenTrial]:
        return self.storage.get_all_trials(self.study_id, deepcopy=False, states=states)

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Serializes topping up the queue and failing a stale trial on a journal (it has no compare-and-set
        for either; an RDB's row lock covers the latter)."""
        if self.storage_url.startswith(OPTUNA_DB_PREFIXES):
            yield
        else:
            with file_lock(Path(self.storage_url).with_suffix(".lab-lock")):
                yield


def open_session(sweep: Sweep, extra: list[str], cfg: DictConfig, create: bool, worker_index: int = 0) -> Session:
    """The study of `sweep` + `extra` in the configured storage (created if `create`)."""
    url = storage_url(cfg)
    storage = _open_storage(url)
    name = sweep.study_name(extra)
    directions = [o.direction for o in sweep.objectives]
    history = next((x.n_trials for x in optuna.get_all_study_summaries(storage, False) if x.study_name == name), 0)
    sampler, pruner = _sampler(sweep, worker_index, history), _pruner(sweep)
    if create:
        study = optuna.create_study(
            study_name=name, storage=storage, sampler=sampler, pruner=pruner, directions=directions, load_if_exists=True
        )
    else:
        try:
            study = optuna.load_study(study_name=name, storage=storage, sampler=sampler, pruner=pruner)
        except KeyError:
            raise ConfigError(
                "sweep",
                f"no study '{name}' in {redact(url)}; start it with `lab sweep sweep={sweep.name}` "
                "and the same overrides, then join it",
            ) from None
    return Session(sweep, extra, url, storage, study, cfg.tracking.uri, "")


def top_up(s: Session, budget: int) -> int:
    """Enqueue the (point, seed) slots the study does not hold yet, up to `budget`; returns how many."""
    with s.lock():  # two launchers at once on one journal would otherwise both enqueue the missing slots
        return _top_up(s, budget)


def _slots(s: Session) -> set[tuple[int, int]]:
    """The (point, seed) slots the study holds, in any state."""
    return {(t.user_attrs.get("point"), t.user_attrs.get("seed")) for t in s.trials()}


def _top_up(s: Session, budget: int) -> int:
    sweep = s.sweep
    have = _slots(s)
    added = 0
    if sweep.is_grid:
        for point, params in enumerate(sweep.points()):
            for seed in sweep.seeds:
                if (point, seed) not in have:
                    s.study.enqueue_trial(params, user_attrs={"point": point, "seed": seed})
                    added += 1
    else:
        for point in range(budget // len(sweep.seeds)):
            if (point, sweep.seeds[0]) not in have:
                s.study.enqueue_trial({}, user_attrs={"point": point, "seed": sweep.seeds[0]})
                added += 1
    s.study.set_user_attr("budget", budget)
    return added


# ----------------------------------------------------------------------------------------------- workers


def _this_host() -> str:
    return socket.gethostname()


def _process_gone(worker: str) -> bool:
    """True if `worker` ("host:pid") ran on this host and its process no longer exists."""
    host, _, pid = worker.rpartition(":")
    if host != _this_host() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        pass
    return False


@contextlib.contextmanager
def _heartbeat(s: Session, trial_id: int) -> Iterator[None]:
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(s.sweep.heartbeat_s):
            with contextlib.suppress(Exception):  # a missed beat is harmless; the next one follows
                s.storage.set_trial_user_attr(trial_id, "heartbeat", time.time())

    s.storage.set_trial_user_attr(trial_id, "heartbeat", time.time())
    thread = threading.Thread(target=beat, name="lab-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _retry(s: Session, trial_id: int, max_retry: int | None) -> bool:
    """Re-enqueue a failed trial with the same params and slot; False once its retries are used up."""
    frozen = s.storage.get_trial(trial_id)
    before = len(s.trials((TrialState.WAITING,)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry)(s.study, frozen)
    return len(s.trials((TrialState.WAITING,))) > before


def recover_stale(s: Session, observed: dict[int, tuple[Any, float]], log: Callable[[str], None]) -> None:
    """Fail and retry RUNNING trials whose worker is gone; `observed` remembers when each heartbeat last changed."""
    now = time.time()
    for ft in s.trials((TrialState.RUNNING,)):
        beat, worker = ft.user_attrs.get("heartbeat"), str(ft.user_attrs.get("worker", ""))
        if observed.get(ft.number, (None, 0.0))[0] != beat or ft.number not in observed:
            observed[ft.number] = (beat, now)
        if not _process_gone(worker) and now - observed[ft.number][1] < s.sweep.grace_s:
            continue
        with s.lock():
            try:
                if s.storage.get_trial(ft._trial_id).state != TrialState.RUNNING:
                    continue
                s.storage.set_trial_user_attr(ft._trial_id, "error", f"worker {worker or '?'} stopped (no heartbeat)")
                s.storage.set_trial_state_values(ft._trial_id, TrialState.FAIL)
            except UpdateFinishedTrialError:
                continue
        run_id = ft.user_attrs.get("mlflow_run_id")
        if run_id:
            track.end_run(s.uri, run_id, "FAILED", {"trial_state": "FAIL"})
        again = _retry(s, ft._trial_id, s.sweep.max_retry)
        log(f"trial {ft.number}: worker {worker or '?'} stopped; " + ("retrying it" if again else "retries used up"))


def _pop(s: Session) -> optuna.Trial | None:
    """Take a WAITING trial within the budget (atomically WAITING -> RUNNING), or None."""
    last_point = s.user_attr("budget", 0) // len(s.sweep.seeds)  # a grid's budget is points x seeds
    for ft in s.trials((TrialState.WAITING,)):
        if ft.user_attrs.get("point", 0) >= last_point:
            continue  # the budget was lowered: this slot is no longer asked for
        try:
            if s.storage.set_trial_state_values(ft._trial_id, TrialState.RUNNING):
                return optuna.Trial(s.study, ft._trial_id)
        except UpdateFinishedTrialError:
            continue
    return None


def _retried(trials: list[optuna.trial.FrozenTrial]) -> set[int]:
    """Numbers of failed trials that were re-enqueued (their retry stands for them)."""
    return {n for t in trials for n in t.system_attrs.get("retry_history", [])}


_STATE_KEYS = {
    TrialState.COMPLETE: "complete",
    TrialState.PRUNED: "pruned",
    TrialState.FAIL: "failed",
    TrialState.RUNNING: "running",
    TrialState.WAITING: "waiting",
}


def counts(s: Session) -> dict[str, int]:
    """Trials by state, and `finished` (complete + pruned + failed); a failure that was retried is not
    counted (its retry is)."""
    trials = s.trials()
    retried = _retried(trials)
    out = {"complete": 0, "pruned": 0, "failed": 0, "running": 0, "waiting": 0}
    for t in trials:
        if not (t.state == TrialState.FAIL and t.number in retried):
            out[_STATE_KEYS[t.state]] += 1
    out["finished"] = out["complete"] + out["pruned"] + out["failed"]
    return out


def work(
    s: Session,
    threads: int | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> None:
    """Run WAITING trials until none is left and no other worker runs one (a dead worker's is retried)."""
    worker = f"{_this_host()}:{os.getpid()}"
    observed: dict[int, tuple[Any, float]] = {}
    started, waiting_said = time.time(), False
    while True:
        recover_stale(s, observed, log)
        trial = _pop(s)
        if trial is not None:
            waiting_said = False
            _run_trial(s, trial, worker, threads, progress, log)
            c = counts(s)
            minutes = (time.time() - started) / 60
            log(f"[{c['finished']}/{s.user_attr('budget')} finished, {c['running']} running, {minutes:.1f} min]")
            continue
        running = s.trials((TrialState.RUNNING,))
        if not running:
            return
        if not waiting_said:
            numbers = ", ".join(str(t.number) for t in running)
            grace = s.sweep.grace_s
            log(f"waiting for trial(s) {numbers} in other workers (retried if a worker is silent for {grace:.0f} s)")
            waiting_said = True
        time.sleep(min(5.0, s.sweep.heartbeat_s))


def _enqueue_other_seeds(s: Session, point: int, params: dict[str, Any]) -> None:
    have = _slots(s)
    for seed in s.sweep.seeds[1:]:
        if (point, seed) not in have:
            s.study.enqueue_trial(params, user_attrs={"point": point, "seed": seed})


def _finished_run(s: Session, trial: optuna.Trial, cfg: DictConfig, arm: str) -> Any | None:
    """A FINISHED child of the parent run that computed exactly this config for this slot: an earlier
    attempt of this trial (its worker died before telling Optuna), or a run logged before the study."""
    history = s.storage.get_trial_system_attrs(trial._trial_id).get("retry_history", [])
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


def _run_trial(
    s: Session, trial: optuna.Trial, worker: str, threads: int | None, progress: bool, log: Callable[[str], None]
) -> None:
    """One trial: compose, run (or reuse a finished run), tell Optuna."""
    sweep = s.sweep
    point, seed = int(trial.user_attrs["point"]), int(trial.user_attrs["seed"])
    params = {p.name: p.suggest(trial) for p in sweep.space}
    if not sweep.is_grid and seed == sweep.seeds[0] and len(sweep.seeds) > 1:
        _enqueue_other_seeds(s, point, params)
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
            log(f"{name}: already finished as MLflow run {done.info.run_id[:8]}: {_fmt(sweep, values)}")
            return

    def on_start(run_id: str) -> None:
        trial.set_user_attr("mlflow_run_id", run_id)

    def on_train_metrics(metrics: dict[str, float], step: int) -> None:
        if len(sweep.objectives) == 1 and PRUNE_METRIC in metrics:
            trial.report(metrics[PRUNE_METRIC], step)
            if trial.should_prune():
                raise track.RunStopped(f"pruned by Optuna at step {step}: {PRUNE_METRIC} {metrics[PRUNE_METRIC]:.3f}")

    hooks = RunHooks(
        on_stage=lambda stage: log(f"{name}: {stage}"), on_start=on_start, on_train_metrics=on_train_metrics
    )
    tags = {"trial": trial.number, "optuna_study": s.study.study_name, "sweep": sweep.name}
    started = time.time()
    with _heartbeat(s, trial._trial_id):
        try:
            result = run_one(cfg, progress=progress, parent_run_id=s.parent_run_id, hooks=hooks, tags=tags)
        except track.RunStopped as stop:
            s.study.tell(trial, state=TrialState.PRUNED)
            _tag_run(s, trial, "PRUNED")
            log(f"{name}: {stop}")
            return
        except KeyboardInterrupt:
            trial.set_user_attr("error", "interrupted")
            s.study.tell(trial, state=TrialState.FAIL)
            _retry(s, trial._trial_id, None)  # a rerun picks it up again
            raise
        except (RuntimeError, ValueError, FloatingPointError, OSError) as exc:  # recorded FAILED; the study goes on
            trial.set_user_attr("error", f"{type(exc).__name__}: {exc}"[:2000])
            s.study.tell(trial, state=TrialState.FAIL)
            log(f"{name}: FAILED: {type(exc).__name__}: {exc}")
            return
    try:
        values = [o.value(result.metrics) for o in sweep.objectives]
    except KeyError as exc:
        trial.set_user_attr("error", f"the run did not log the objective {exc}")
        s.study.tell(trial, state=TrialState.FAIL)
        _tag_run(s, trial, "FAIL")
        log(f"{name}: FAILED: the run did not log the objective {exc}")
        return
    m = result.metrics
    trial.set_user_attr("seconds", time.time() - started)
    trial.set_user_attr("cache_s", float(m.get("cache/seconds", 0.0)))
    trial.set_user_attr("cache_hit", bool(m.get("cache/hit", 0.0)))
    if "cache/build_seconds" in m:
        trial.set_user_attr("cache_build_s", float(m["cache/build_seconds"]))
    s.study.tell(trial, values)
    _tag_run(s, trial, "COMPLETE")
    log(f"{name}: {_fmt(sweep, values)} in {time.time() - started:.0f} s")


def _tag_run(s: Session, trial: optuna.Trial, state: str) -> None:
    run_id = s.storage.get_trial_user_attrs(trial._trial_id).get("mlflow_run_id")
    if run_id:
        track.set_run_tags(s.uri, run_id, {"trial_state": state})


def _fmt(sweep: Sweep, values: list[float]) -> str:
    return ", ".join(f"{o.metric} {v:.3f}" for o, v in zip(sweep.objectives, values, strict=True))


# ------------------------------------------------------------------------------------------- launch / join


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


def join(
    sweep: Sweep,
    extra: list[str],
    threads: int | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> None:
    """`lab sweep worker`: work on a study another process started, from this or another machine."""
    cfg = compose(sweep.trial_overrides(sweep.base_point(), sweep.seeds[0], extra))
    check_checkpoint(cfg)
    index = int(os.environ.get("LAB_WORKER_INDEX", os.getpid()))
    s = open_session(sweep, extra, cfg, create=False, worker_index=index)
    s.parent_run_id = s.user_attr("mlflow_parent_run_id", "")
    if not s.parent_run_id:
        raise ConfigError("sweep", f"study '{s.study.study_name}' has no MLflow parent run; start it with `lab sweep`")
    log(f"worker {_this_host()}:{os.getpid()} joined study {s.study.study_name} in {redact(s.storage_url)}")
    work(s, threads, progress, log)
    # the queue is empty and no trial runs anywhere: whichever worker gets here last leaves the summary
    finish(s, *_study_span(s))
    track.end_run(s.uri, s.parent_run_id, "FINISHED")


def _study_span(s: Session) -> tuple[float, int]:
    """Seconds from the first trial's start to the last one's end, and how many workers ran trials."""
    trials = [t for t in s.trials() if t.datetime_start and t.datetime_complete]
    if not trials:
        return 0.0, 0
    span = max(t.datetime_complete for t in trials) - min(t.datetime_start for t in trials)
    return span.total_seconds(), len({t.user_attrs.get("worker") for t in trials})


def finish(s: Session, seconds: float, workers: int) -> str:
    """The study's summary, totals and trial records on its parent run; returns the summary."""
    text, metrics = summary(s, seconds, workers)
    track.log_metrics(s.uri, s.parent_run_id, metrics)
    track.log_dict(s.uri, s.parent_run_id, {"trials": _trial_records(s)}, "sweep/trials.json")
    track.log_text(s.uri, s.parent_run_id, text, "sweep/summary.md")
    return text


def launch(
    sweep: Sweep,
    extra: list[str],
    worker_args: list[str],
    workers: int = 1,
    trials: int | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
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
    threads = None if workers == 1 or user_threads else max(1, (os.cpu_count() or 1) // workers)
    tags = {
        "study": sweep.experiment,
        "sweep": sweep.name,
        "optuna_study": name,
        "optuna_storage": redact(s.storage_url),
        "git_commit": track.git_commit(),
    }
    started = time.time()
    with track.parent_run(t.uri, t.artifact_root, sweep.experiment, f"sweep-{sweep.name}", name, tags) as parent:
        s.parent_run_id = parent.id
        parent.log_params(_spec_params(sweep, extra))
        parent.log_metrics({"sweep/budget": budget})
        s.study.set_user_attr("mlflow_parent_run_id", parent.id)
        s.study.set_user_attr("sweep", sweep.name)
        added = top_up(s, budget)
        c = counts(s)
        join_cmd = " ".join(["lab", *worker_args, *(redact(o) for o in extra)])  # logs keep no password
        log(
            f"sweep {sweep.name}: study {name} in {redact(s.storage_url)}\n"
            f"  budget {budget} trials: {c['finished']} finished, {c['waiting']} to run "
            f"({added} newly queued), {c['running']} running elsewhere; {workers} worker(s) here\n"
            f"  MLflow: experiment {sweep.experiment}, parent run {parent.id} (browse with `lab ui`)\n"
            f"  watch:  {dashboard_command(redact(s.storage_url))}\n"
            f"  join from another process or machine (same storage and store): {join_cmd}"
        )
        finished_before = c["finished"]
        if workers == 0 and c["waiting"] + c["running"] == 0:  # nothing to run: the parent ends now
            return SweepResult(name, redact(s.storage_url), parent.id, budget, c, 0, 0.0, finish(s, *_study_span(s)))
        if workers == 0:
            parent.end_status = "RUNNING"  # the last worker to finish ends it
            note = f"queued; the study's parent run stays RUNNING until a worker finishes its last trial: {join_cmd}"
            return SweepResult(name, redact(s.storage_url), parent.id, budget, c, 0, 0.0, note)
        helpers = min(workers, c["waiting"]) - 1  # no more workers than queued trials
        procs = [_spawn(worker_args, extra, threads, i, log) for i in range(1, helpers + 1)]
        try:
            prefix = "[w0] " if workers > 1 else ""
            work(s, threads, progress and workers == 1, lambda m: log(prefix + m))
        except BaseException:
            for proc, _ in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGINT)  # the worker re-enqueues its trial and exits
            raise
        finally:
            for proc, reader in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=60)
                if proc.poll() is None:
                    proc.kill()
                reader.join(timeout=5)
        c = counts(s)
        ran = c["finished"] - finished_before
        seconds = time.time() - started
        text = finish(s, seconds, workers)
    return SweepResult(name, redact(s.storage_url), parent.id, budget, c, ran, seconds, text)


class _Reader(threading.Thread):
    """Forwards a worker subprocess's output line by line, prefixed with the worker's number."""

    def __init__(self, proc: subprocess.Popen, prefix: str, log: Callable[[str], None]):
        super().__init__(daemon=True)
        self.proc, self.prefix, self.log = proc, prefix, log

    def run(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log(self.prefix + line.rstrip())


def _spawn(
    worker_args: list[str], extra: list[str], threads: int | None, index: int, log: Callable[[str], None]
) -> tuple[subprocess.Popen, _Reader]:
    cmd = [sys.executable, "-m", "lab.cli", *worker_args, "--no-progress", *extra]
    if threads:
        cmd.append(f"threads={threads}")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "LAB_WORKER_INDEX": str(index)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    reader = _Reader(proc, f"[w{index}] ", log)
    reader.start()
    return proc, reader


def _spec_params(sweep: Sweep, extra: list[str]) -> dict[str, Any]:
    return {
        "sweep.name": sweep.name,
        "sweep.space": {p.name: p.choices or [p.low, p.high] for p in sweep.space},
        "sweep.sampler": sweep.sampler,
        "sweep.pruner": sweep.pruner,
        "sweep.objectives": [f"{o.direction} {o.metric} ({o.reduce})" for o in sweep.objectives],
        "sweep.seeds": sweep.seeds,
        "sweep.overrides": sweep.overrides + changing_results(extra),
    }


def _trial_records(s: Session) -> list[dict[str, Any]]:
    return [
        {
            "number": t.number,
            "state": t.state.name,
            "params": t.params,
            "values": t.values,
            **{k: v for k, v in t.user_attrs.items() if k != "heartbeat"},
        }
        for t in s.trials()
    ]


def summary(s: Session, seconds: float, workers: int) -> tuple[str, dict[str, float]]:
    """The study as Markdown (best trials first, the cache's saving) and the parent run's metrics."""
    sweep, trials = s.sweep, s.trials()
    c = counts(s)
    single = len(sweep.objectives) == 1
    lines = [
        f"# Sweep {sweep.name}",
        "",
        sweep.description,
        "",
        f"Optuna study `{s.study.study_name}` in `{redact(s.storage_url)}`; MLflow parent run `{s.parent_run_id}`.",
        f"Budget {s.user_attr('budget')} trials: {c['complete']} complete, {c['pruned']} pruned, "
        f"{c['failed']} failed, {c['running'] + c['waiting']} not finished. "
        f"Wall time {seconds / 60:.1f} min with {workers} worker(s).",
        "",
    ]
    metrics = {
        "sweep/complete": float(c["complete"]),
        "sweep/pruned": float(c["pruned"]),
        "sweep/failed": float(c["failed"]),
        "sweep/seconds": seconds,
        "sweep/workers": float(workers),
    }
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    if complete:
        front = {t.number for t in s.study.best_trials}
        sign = [1 if o.direction == "maximize" else -1 for o in sweep.objectives]
        complete.sort(key=lambda t: (t.number not in front, -sign[0] * t.values[0]))
        best = complete[0]
        what = "Best trial" if single else f"Pareto front: trials {', '.join(map(str, sorted(front)))}; first"
        lines.append(
            f"{what}: {best.number} ({best.user_attrs.get('arm')}, seed {best.user_attrs.get('seed')}): "
            f"{_fmt(sweep, best.values)}; MLflow run `{best.user_attrs.get('mlflow_run_id', '')}`."
        )
        if single:
            metrics["sweep/best_value"] = best.values[0]
        lines.append("")
    head = ["trial", "state", "point", "seed", *(o.metric for o in sweep.objectives), "min", "MLflow run"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rest = [t for t in trials if t.state != TrialState.COMPLETE and t.state != TrialState.WAITING]
    retried = _retried(trials)
    for t in complete + rest:
        vals = [f"{v:.3f}" for v in t.values] if t.values else ["-"] * len(sweep.objectives)
        minutes = f"{t.user_attrs['seconds'] / 60:.1f}" if "seconds" in t.user_attrs else "-"
        note = " (reused)" if t.user_attrs.get("reused") else " (retried)" if t.number in retried else ""
        state = t.state.name + note
        row = [str(t.number), state, str(t.user_attrs.get("arm", "")), str(t.user_attrs.get("seed", "")), *vals]
        lines.append("| " + " | ".join([*row, minutes, str(t.user_attrs.get("mlflow_run_id", ""))[:12]]) + " |")
    cache_line, cache_metrics = _cache_saving(complete)
    metrics.update(cache_metrics)
    lines += ["", cache_line]
    return "\n".join(lines) + "\n", metrics


def _cache_saving(trials: list[optuna.trial.FrozenTrial]) -> tuple[str, dict[str, float]]:
    """What the shared hidden-state cache saved each trial that found it built: its build time minus the load."""
    ran = [t for t in trials if "cache_s" in t.user_attrs]
    hits = [t for t in ran if t.user_attrs["cache_hit"]]
    builds = [t.user_attrs["cache_build_s"] for t in ran if "cache_build_s" in t.user_attrs]
    if not hits or not builds:
        return "Hidden-state cache: no trial of this study loaded a cache entry with a known build time.", {}
    build = statistics.median(builds)
    load = statistics.mean(t.user_attrs["cache_s"] for t in hits)
    trial_s = statistics.mean(t.user_attrs["seconds"] for t in hits)
    saving = build - load
    share = saving / (trial_s + saving)
    line = (
        f"Hidden-state cache: built once in {build:.1f} s; {len(hits)} of {len(ran)} trials loaded it instead "
        f"(in {load:.2f} s), saving {saving:.1f} s per trial: {share:.0%} of the {trial_s + saving:.0f} s such a "
        f"trial would take without the cache."
    )
    return line, {
        "sweep/cache_build_s": build,
        "sweep/cache_load_s": load,
        "sweep/cache_saving_s": saving,
        "sweep/cache_saving_share": share,
    }
