"""Reading a store: runs by id, a study's parent and child runs, a run's curves, config and JSON artifacts, its
drafter checkpoint downloaded. A reader never creates an empty local store where none was recorded.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlflow
import yaml
from mlflow.tracking import MlflowClient

from lab.track.serving import check_reachable
from lab.track.store import _schema_head, _schema_version, configure, is_server, local_paths


def _equals(field: str, value: str) -> str:
    """An MLflow filter clause `field = value`, quoted so that the value cannot end its string early."""
    value = str(value)
    if "'" not in value:
        return f"{field} = '{value}'"
    if '"' not in value:
        return f'{field} = "{value}"'
    raise ValueError(f"{field}: {value!r} has both kinds of quotes, which an MLflow filter cannot hold")


PAGE = 1000  # MLflow's own page of search results: every search here reads on past it, page by page


def every_run(
    client: MlflowClient, experiment_ids: list[str], filter_string: str = "", order_by: list[str] | None = None
) -> list[Any]:
    """Every active run of `experiment_ids` that `filter_string` matches, in `order_by`'s order, read page by page:
    one `search_runs` call returns at most one page, and a study may have more runs than that."""
    out: list[Any] = []
    token = None
    while experiment_ids:
        page = client.search_runs(
            experiment_ids, filter_string=filter_string, order_by=order_by, max_results=PAGE, page_token=token
        )
        out += list(page)
        token = page.token
        if not token:
            break
    return out


def every_experiment(client: MlflowClient) -> list[Any]:
    """Every active experiment of the store, page by page."""
    out: list[Any] = []
    token = None
    while True:
        page = client.search_experiments(max_results=PAGE, page_token=token)
        out += list(page)
        token = page.token
        if not token:
            return out


def child_runs(uri: str, parent_run_id: str, status: str | None = None) -> list[Any]:
    """Runs nested under `parent_run_id` (optionally only those with `status`, e.g. FINISHED)."""
    configure(uri)
    client = MlflowClient()
    parent = client.get_run(parent_run_id)
    query = _equals("tags.`mlflow.parentRunId`", parent_run_id)
    if status:
        query += f" and {_equals('attributes.status', status)}"
    return every_run(client, [parent.info.experiment_id], query)


def study_parents(uri: str, experiment: str, sweep: str) -> list[Any]:
    """Parent runs of the studies of sweep or experiment `sweep` in MLflow experiment `experiment`,
    newest first (one per set of result-changing overrides)."""
    db = local_paths(uri)
    if db is not None and not db.is_file():
        return []  # nothing recorded yet; reading must not create an empty store
    configure(uri)
    client = MlflowClient()
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return []
    query = f"tags.`lab.role` = 'parent' and {_equals('tags.sweep', sweep)}"
    return every_run(client, [exp.experiment_id], query, ["attributes.start_time DESC"])


def all_study_parents(uri: str) -> list[Any]:
    """The parent runs of every study in the store, newest first; none where no store was recorded."""
    db = local_paths(uri)
    if db is not None and not db.is_file():
        return []  # reading must not create an empty store
    configure(uri)
    client = MlflowClient()
    ids = [e.experiment_id for e in every_experiment(client)]
    return every_run(client, ids, "tags.`lab.role` = 'parent'", ["attributes.start_time DESC"])


def _existing_store(uri: str) -> None:
    """ValueError when a local store does not exist: reading it must not create an empty one."""
    db = local_paths(uri)
    if db is not None and not db.is_file():
        raise ValueError(f"tracking.uri: no MLflow store at {db} (expected the store that recorded the runs)")
    configure(uri)


def get_run(uri: str, run_id: str) -> Any:
    """A run by id; ValueError naming the id when the store has no such run."""
    _existing_store(uri)
    try:
        return MlflowClient().get_run(run_id)
    except mlflow.exceptions.MlflowException:
        raise ValueError(f"run '{run_id}': not found in {uri}") from None


def run_checkpoint(uri: str, run_id: str, dst: str | Path) -> tuple[Path, dict[str, str]]:
    """The drafter checkpoint logged by run `run_id`, downloaded into `dst`, and the run's tags."""
    _existing_store(uri)
    client = MlflowClient()
    try:
        run = client.get_run(run_id)
    except mlflow.exceptions.MlflowException:
        raise ValueError(f"run '{run_id}': not found in {uri} (expected a run id or a checkpoint folder)") from None
    try:
        with _no_progress_bar():  # a command's stderr is for its one error line
            path = client.download_artifacts(run_id, "checkpoint", str(dst))
    except (OSError, mlflow.exceptions.MlflowException):
        raise ValueError(
            f"run '{run_id}': no checkpoint artifact (expected a run logged with tracking.log_checkpoint=true)"
        ) from None
    return Path(path), dict(run.data.tags)


@dataclass
class TrainedRun:
    """A finished run that trained a drafter: its id, the run that trained it first (itself, unless it
    reused one), its checkpoint downloaded, and its training curves (metric -> [(step, value)])."""

    run_id: str
    trained_by: str
    checkpoint: Path
    curves: dict[str, list[tuple[int, float]]]


def trained_run(uri: str, train_key: str, dst: str | Path, is_curve: Callable[[str], bool]) -> TrainedRun | None:
    """The earliest finished run of any experiment tagged `train_key` that logged a drafter checkpoint, the
    checkpoint downloaded into `dst` and its metrics that `is_curve` picks read; None when none has."""
    db = local_paths(uri)
    if db is not None and not db.is_file():
        return None  # nothing recorded yet; reading must not create an empty store
    configure(uri)
    client = MlflowClient()
    runs = every_run(
        client,
        [e.experiment_id for e in every_experiment(client)],
        f"{_equals('tags.train_key', train_key)} and attributes.status = 'FINISHED'",
        ["attributes.start_time ASC"],
    )
    for run in runs:
        run_id = run.info.run_id
        try:
            with _no_progress_bar():
                path = client.download_artifacts(run_id, "checkpoint", str(dst))
        except (OSError, mlflow.exceptions.MlflowException):
            continue  # logged without its checkpoint (tracking.log_checkpoint=false)
        curves = {
            key: [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]
            for key in run.data.metrics
            if is_curve(key)
        }
        return TrainedRun(run_id, run.data.tags.get("trained_by_run", run_id), Path(path), curves)
    return None


@contextlib.contextmanager
def _no_progress_bar() -> Iterator[None]:
    """MLflow without its artifact download bar (it writes to stderr even when nothing is downloaded)."""
    name = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
    before = os.environ.get(name)
    os.environ[name] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def metric_curve(uri: str, run_id: str, key: str) -> list[float]:
    """A curve logged with step = 1, 2, ...: its values in step order."""
    configure(uri)
    history = MlflowClient().get_metric_history(run_id, key)
    return [m.value for m in sorted(history, key=lambda m: m.step)]


def search_runs(uri: str, experiment: str, filter_string: str = "") -> list[Any]:
    """The runs of MLflow experiment `experiment` that `filter_string` matches; none when it does not exist."""
    configure(uri)
    client = MlflowClient()
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return []
    return every_run(client, [exp.experiment_id], filter_string)


def logged_config(uri: str, run_id: str) -> dict | None:
    """The resolved config a run logged (`config.yaml`), or None when it has none."""
    configure(uri)
    try:
        return yaml.safe_load(mlflow.artifacts.load_text(f"runs:/{run_id}/config.yaml"))
    except (OSError, mlflow.exceptions.MlflowException, yaml.YAMLError):
        return None


def run_json(uri: str, run_id: str, path: str) -> dict | None:
    """A JSON artifact of a run (e.g. `per_prompt/in_dist.json`), or None when the run has none (a run
    logged before that artifact existed) or it is not a JSON object."""
    configure(uri)
    quiet = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"  # a report reads one per run and suite: no bar for each
    before = os.environ.get(quiet)
    os.environ[quiet] = "false"
    try:
        data = json.loads(mlflow.artifacts.load_text(f"runs:/{run_id}/{path}"))
    except (OSError, mlflow.exceptions.MlflowException, ValueError):
        return None
    finally:
        if before is None:
            del os.environ[quiet]
        else:
            os.environ[quiet] = before
    return data if isinstance(data, dict) else None


@dataclass
class RunRecord:
    """A finished run as a plan reads it (lab/plan.py): its params, tags and last metric values."""

    run_id: str
    params: dict[str, str]
    tags: dict[str, str]
    metrics: dict[str, float]


def finished_runs(uri: str, tags: dict[str, str] | None = None, newest: int = 500) -> list[RunRecord]:
    """The newest `newest` FINISHED runs of any experiment carrying `tags`; none where no store is there (or one
    at another schema) or a server does not answer: a plan (lab/plan.py) reads them for its rates, and it waits on
    no store and writes none."""
    if is_server(uri):
        try:
            check_reachable(uri)
        except ValueError:
            return []
    elif _schema_head() is None or _schema_version(uri) != _schema_head():
        return []  # no store there, or one at another schema: reading must create, fill or upgrade none
    configure(uri)
    client = MlflowClient()
    ids = [e.experiment_id for e in every_experiment(client)]
    query = " and ".join(
        ["attributes.status = 'FINISHED'", *(_equals(f"tags.`{k}`", v) for k, v in (tags or {}).items())]
    )
    if not ids:
        return []
    runs = client.search_runs(ids, query, order_by=["attributes.start_time DESC"], max_results=min(newest, PAGE))
    return [RunRecord(r.info.run_id, dict(r.data.params), dict(r.data.tags), dict(r.data.metrics)) for r in runs]
