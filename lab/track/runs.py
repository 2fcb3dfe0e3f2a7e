"""A run's lifecycle and what it logs: experiments found or created, a run or a study's parent run started and
ended with the status its block earned (`start_run`, `parent_run` -> `Run`), and tags, metrics and artifacts
logged on any run, active or ended, by id.

A run carries the study's tags (study, arm, seed, git_commit, config_hash), the flattened resolved config as
params, the config file and the drafter checkpoint as artifacts.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlflow
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from lab import signals
from lab.track import liveness
from lab.track.queries import _equals
from lab.track.store import configure, is_server, store_lock
from lab.track.writers import _writing

SIGNAL_TAG = "lab.signal"  # the signal that stopped a run (ended KILLED); a study's parent sheds it when resumed

_PARAM_BATCH = 100  # MLflow's limit per log_batch call
# a server store makes MLflow print two "View run" links per run: the workbench prints its own lines
os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
# the system metrics' monitor says when it starts and stops, four lines a run: only its warnings are kept
logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)


def ensure_experiment(name: str, artifact_root: str) -> str:
    """The experiment id of `name`, created with its artifacts under `artifact_root` if new."""
    client = MlflowClient()
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    location = None  # a server's own artifact store: a local path would name this machine's disk
    if "://" in artifact_root:
        location = artifact_root
    elif artifact_root and not is_server(mlflow.get_tracking_uri()):
        root = Path(artifact_root).resolve()
        root.mkdir(parents=True, exist_ok=True)
        location = root.as_uri()
    try:
        return client.create_experiment(name, artifact_location=location)
    except mlflow.exceptions.MlflowException:  # created concurrently by another worker
        return client.get_experiment_by_name(name).experiment_id


@functools.cache
def git_commit() -> str:
    """The commit of the code this process runs (read once: later commits do not change it)."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, cwd=Path(__file__).parent
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


class Run:
    """A thin handle on an active MLflow run, so callers never touch mlflow themselves."""

    def __init__(self, run_id: str):
        self.id = run_id
        # the status it ends with when its block succeeds; a study's parent set to RUNNING stays open for
        # workers started elsewhere, the last of which ends it (`end_run`)
        self.end_status = "FINISHED"
        self._client = MlflowClient()

    def log_params(self, params: dict[str, Any]) -> None:
        items = [(k, str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), _PARAM_BATCH):
            mlflow.log_params(dict(items[i : i + _PARAM_BATCH]))

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        mlflow.log_metrics({k: float(v) for k, v in metrics.items()}, step=step)

    def log_curves(self, metrics: dict[str, float | list[float]], first_step: int = 1) -> None:
        """Scalars as they are; a list is a curve, one point per step (first_step, first_step+1, ...)."""
        import time

        now = int(time.time() * 1000)
        batch = []
        for key, value in metrics.items():
            if isinstance(value, list):
                batch += [Metric(key, float(v), now, first_step + i) for i, v in enumerate(value)]
            else:
                batch.append(Metric(key, float(value), now, 0))
        for i in range(0, len(batch), 1000):
            self._client.log_batch(self.id, metrics=batch[i : i + 1000])

    def set_tags(self, tags: dict[str, Any]) -> None:
        mlflow.set_tags({k: str(v) for k, v in tags.items()})

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        mlflow.log_artifact(str(path), artifact_path=artifact_path)

    def log_artifacts(self, folder: str | Path, artifact_path: str | None = None) -> None:
        mlflow.log_artifacts(str(folder), artifact_path=artifact_path)

    def log_dict(self, data: dict, name: str) -> None:
        mlflow.log_dict(data, name)

    def log_dataset(self, name: str, records: list[dict], context: str = "eval") -> None:
        """A table of rows as an MLflow dataset input of the run (shown in the UI's Datasets panel)."""
        import pandas as pd
        from mlflow.exceptions import MlflowException

        dataset = mlflow.data.from_pandas(pd.DataFrame.from_records(records), name=name)
        for attempt in range(3):
            try:
                mlflow.log_input(dataset, context=context)
                return
            except MlflowException as exc:
                # Workers of one study log the same suite at once, and MLflow's get-or-create of a dataset
                # is not atomic: the loser's insert breaks the unique key; a retry finds the winner's row.
                if "unique constraint" not in str(exc).lower() or attempt == 2:
                    raise


class RunStopped(Exception):
    """Raised inside a run to end it early on purpose (a pruned trial): the run ends KILLED, its reason
    in the tag `stopped`."""


@contextlib.contextmanager
def _ends_with_status(run: Run) -> Iterator[Run]:
    """Ends the active run with `run.end_status`, FAILED on an exception, KILLED on Ctrl-C or RunStopped."""
    try:
        yield run
    except RunStopped as stop:
        mlflow.set_tag("stopped", str(stop))
        mlflow.end_run(status="KILLED")
        raise
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM / SIGUSR1 (lab/signals.py): named in a tag
        with contextlib.suppress(Exception):
            mlflow.set_tag(SIGNAL_TAG, signals.signal_of(exc).name)
        mlflow.end_run(status="KILLED")
        raise
    except BaseException:
        mlflow.end_run(status="FAILED")
        raise
    else:
        mlflow.end_run(status=run.end_status)


SYSTEM_METRICS_SECONDS = 10  # MLflow's default interval


@contextlib.contextmanager
def start_run(
    uri: str,
    artifact_root: str,
    experiment: str,
    run_name: str,
    tags: dict[str, Any],
    parent_run_id: str | None = None,
    system_metrics: bool = False,
) -> Iterator[Run]:
    """An MLflow run that ends FINISHED, FAILED on an exception, KILLED on Ctrl-C; while open it says which
    process writes it and beats (lab/track/liveness.py), so that one left RUNNING by a dead process is found and
    closed. With `system_metrics`, MLflow
    samples the machine beside it (`system/cpu_utilization_percentage`, memory, and each GPU where nvidia-ml-py is
    installed) every `SYSTEM_METRICS_SECONDS`."""
    configure(uri)
    with _writing(uri):
        exp_id = ensure_experiment(experiment, artifact_root)
        if system_metrics:
            mlflow.set_system_metrics_sampling_interval(SYSTEM_METRICS_SECONDS)
        active = mlflow.start_run(
            experiment_id=exp_id,
            run_name=run_name,
            nested=parent_run_id is not None,
            parent_run_id=parent_run_id,
            tags={**{k: str(v) for k, v in tags.items()}, liveness.WORKER: liveness.worker_name()},
            log_system_metrics=system_metrics,
        )
        with _ends_with_status(Run(active.info.run_id)) as run, liveness.beating(run.id):
            yield run


@contextlib.contextmanager
def parent_run(
    uri: str,
    artifact_root: str,
    experiment: str,
    run_name: str,
    key: str,
    tags: dict[str, Any],
) -> Iterator[Run]:
    """The parent run of a study, resumed if one with the same `key` exists (rerunning continues it)."""
    configure(uri)
    all_tags = {**{k: str(v) for k, v in tags.items()}, "lab.role": "parent", "lab.study_key": key}
    query = f"tags.`lab.role` = 'parent' and {_equals('tags.`lab.study_key`', key)}"
    with _writing(uri):
        exp_id = ensure_experiment(experiment, artifact_root)
        # found or created by one launcher at a time: two launching the same study at once would each find
        # none and create a parent, splitting the study's runs between them
        with store_lock(uri, "parents"):
            found = MlflowClient().search_runs([exp_id], filter_string=query, max_results=1)
            if found:
                active = mlflow.start_run(run_id=found[0].info.run_id)
                mlflow.set_tags(all_tags)
                if SIGNAL_TAG in found[0].data.tags:  # the stop it names is over: the study runs again
                    MlflowClient().delete_tag(active.info.run_id, SIGNAL_TAG)
            else:
                active = mlflow.start_run(experiment_id=exp_id, run_name=run_name, tags=all_tags)
        with _ends_with_status(Run(active.info.run_id)) as run:
            yield run


def set_run_tags(uri: str, run_id: str, tags: dict[str, Any]) -> None:
    """Tags on any run, active or ended."""
    configure(uri)
    client = MlflowClient()
    for k, v in tags.items():
        client.set_tag(run_id, k, str(v))


def end_run(uri: str, run_id: str, status: str, tags: dict[str, Any] | None = None) -> None:
    """End a run another process left RUNNING (its worker died) with `status`."""
    configure(uri)
    client = MlflowClient()
    with contextlib.suppress(mlflow.exceptions.MlflowException):
        if tags:
            set_run_tags(uri, run_id, tags)
        if client.get_run(run_id).info.status == "RUNNING":
            client.set_terminated(run_id, status=status)


def log_metrics(uri: str, run_id: str, metrics: dict[str, float]) -> None:
    """Scalar metrics on any run, active or ended (e.g. a study's totals on its parent)."""
    import time

    configure(uri)
    now = int(time.time() * 1000)
    MlflowClient().log_batch(run_id, metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items()])


def log_dict(uri: str, run_id: str, data: dict, name: str) -> None:
    """A JSON artifact on any run, active or ended."""
    configure(uri)
    MlflowClient().log_dict(run_id, data, name)


def log_text(uri: str, run_id: str, text: str, name: str) -> None:
    """A text artifact on any run, active or ended (e.g. a study's summary on its parent run)."""
    configure(uri)
    MlflowClient().log_text(run_id, text, name)


def log_artifacts(uri: str, run_id: str, folder: str | Path, artifact_path: str) -> None:
    """A folder's files as artifacts of any run, active or ended (e.g. a study's report on its parent)."""
    configure(uri)
    MlflowClient().log_artifacts(run_id, str(folder), artifact_path)
