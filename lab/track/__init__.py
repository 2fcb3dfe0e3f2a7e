"""MLflow conventions: the one module of the workbench that imports mlflow.

The tracking URI is always set explicitly (never MLflow's implicit default); a local store is a
sqlite database plus an artifact folder, created on first use. One experiment per study; a run
carries the study's tags (study, arm, seed, git_commit, config_hash), the flattened resolved config
as params, the config file and the drafter checkpoint as artifacts.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlflow
import yaml
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from lab.config.identity import CONFIG_HASH_SCHEME, config_hash

_PARAM_BATCH = 100  # MLflow's limit per log_batch call
# a server store makes MLflow print two "View run" links per run: the workbench prints its own lines
os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")


def local_paths(uri: str) -> Path | None:
    """The sqlite file behind a local URI, or None for a server URI."""
    if uri.startswith("sqlite:///"):
        return Path(uri[len("sqlite:///") :])
    return None


def is_server(uri: str) -> bool:
    """True for the URI of an MLflow tracking server (shared by workers on many machines)."""
    return uri.startswith(("http://", "https://"))


def configure(uri: str) -> None:
    """Point MLflow at `uri`, creating the local database's folder if needed, and the store itself, once
    (`prepare_store`)."""
    db = local_paths(uri)
    if db is not None:
        db.parent.mkdir(parents=True, exist_ok=True)
    mlflow.set_tracking_uri(uri)
    prepare_store(uri)


# ---------------------------------------------------------------------------------- many processes, one store
#
# MLflow creates a database store's tables, and migrates them through every schema revision, the first time a
# process opens it, without a lock: two processes opening a fresh store at once both migrate it, and one of them
# fails (duplicate column, "table already exists", alembic's "expected to match one row"). Every lab process
# opens a store through `prepare_store`, which does that once, under a lock (a file beside a SQLite database or a
# file store, a PostgreSQL advisory lock), and skips the lock for a store that exists and is current.

_PREPARED: set[str] = set()  # the stores this process has found current


def _file_store_root(uri: str) -> Path | None:
    """The folder of an MLflow file store (`file:///...` or a plain path), or None."""
    if uri.startswith("file:"):
        return Path(uri.removeprefix("file://") if uri.startswith("file://") else uri.removeprefix("file:"))
    if ":" not in uri and uri != "databricks":
        return Path(uri)
    return None


def _lock_file(uri: str, name: str) -> Path | None:
    """The lock file of `name` for a local store (beside its database or folder), or None."""
    place = local_paths(uri) or _file_store_root(uri)
    if place is None:
        return None
    place = place.resolve()
    return place.with_name(f"{place.name}.lab-{name}.lock")


def _advisory_key(name: str) -> int:
    """A stable signed 64-bit key of `name` for PostgreSQL's advisory locks."""
    import hashlib

    return int.from_bytes(hashlib.sha256(f"lab.{name}".encode()).digest()[:8], "big", signed=True)


@contextlib.contextmanager
def store_lock(uri: str, name: str, waiting: str = "") -> Iterator[None]:
    """An exclusive lock `name` on the store at `uri` across every process of this machine (a file lock beside
    a local store) or every client of the database (a PostgreSQL advisory lock). A process that has to wait
    says so once on stderr with `waiting`, if given. A server store (http) has no lock here: its clients may be
    anywhere (docs/running.md)."""
    path = _lock_file(uri, name)
    if path is not None:
        import fcntl

        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a+") as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if waiting:
                    print(f"waiting: {waiting} (lock {path})", file=sys.stderr, flush=True)
                fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)
        return
    if not uri.startswith(("postgresql", "postgres:")):
        yield  # a server store, or a database without advisory locks
        return
    from sqlalchemy import text

    key = _advisory_key(name)
    with _engine(uri).connect() as conn:
        if not conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": key}).scalar():
            if waiting:
                print(f"waiting: {waiting}", file=sys.stderr, flush=True)
            conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": key})
        conn.commit()
        try:
            yield
        finally:
            conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": key})
            conn.commit()


@functools.cache
def _engine(uri: str) -> Any:
    """One small SQLAlchemy engine per database URL, for the locks and the schema checks of this module."""
    import sqlalchemy

    return sqlalchemy.create_engine(uri, poolclass=sqlalchemy.pool.NullPool)


@functools.cache
def _schema_head() -> str | None:
    """The schema revision of the installed MLflow (None where MLflow's layout changed: then every open of a
    database store takes the lock, which is only slower)."""
    try:
        from mlflow.store.db.utils import _get_latest_schema_revision

        return _get_latest_schema_revision()
    except Exception:  # noqa: BLE001 - a private helper of MLflow: any change falls back to the lock
        return None


def _schema_version(uri: str) -> str | None:
    """The schema revision a database store holds; None when it is absent, empty, half created or busy. A
    SQLite file is read without being created or written."""
    db = local_paths(uri)
    try:
        if db is not None:
            import sqlite3

            if not db.is_file():
                return None
            with contextlib.closing(sqlite3.connect(db.resolve().as_uri() + "?mode=ro", uri=True, timeout=1)) as conn:
                row = conn.execute("SELECT version_num FROM alembic_version").fetchone()
        else:
            from sqlalchemy import text

            with _engine(uri).connect() as conn:
                row = conn.execute(text("SELECT version_num FROM alembic_version")).fetchone()
    except Exception:  # noqa: BLE001 - no table yet, locked, unreachable: the locked path decides
        return None
    return row[0] if row else None


def _file_store_ready(root: Path) -> bool:
    return (root / "0" / "meta.yaml").is_file() and (root / ".trash").is_dir()


def prepare_store(uri: str) -> None:
    """Create or upgrade the store at `uri` once, whatever other lab processes open it at the same time.

    A store that exists at the installed MLflow's schema is left alone without any lock. Otherwise this
    process takes the store's `schema` lock (`store_lock`; waiting with a message while another process
    creates or upgrades it), looks again, and creates the tables and migrates them to the current revision
    (MLflow's own steps, which are not safe to run twice at once), or upgrades an older store. A server store
    is its server's to prepare."""
    if uri in _PREPARED or is_server(uri):
        return
    root = _file_store_root(uri)
    if root is not None:
        if not _file_store_ready(root):
            with store_lock(uri, "schema", f"another lab process is creating the MLflow store {root}"):
                MlflowClient(uri).search_experiments(max_results=1)  # FileStore() creates its folders
        _PREPARED.add(uri)
        return
    head = _schema_head()
    if head is None or _schema_version(uri) != head:
        shown = local_paths(uri) or _shown(uri)
        with store_lock(uri, "schema", f"another lab process is creating or upgrading the MLflow store {shown}"):
            _create_or_upgrade(uri, head)
    _PREPARED.add(uri)


# A local store's writers (an open run, a study's parent, an import) each hold a shared lock on the file
# `writers` and leave their command line in the folder beside it, so that `lab doctor --rekey`, which rewrites
# the tags studies match finished runs by, takes that lock exclusively or is refused, naming who writes; and a
# writer is refused while a re-key runs, naming it.


def _writer_note(path: Path) -> Path:
    """This process's note beside the lock `path`: the command it runs, for a refusal to name."""
    import uuid

    from lab.config import redact

    folder = path.with_suffix(".d")
    folder.mkdir(exist_ok=True)
    note = folder / f"{os.getpid()}.{uuid.uuid4().hex[:8]}"
    words = [redact(w) for w in sys.argv[1:]]
    note.write_text(" ".join(["lab", *words])[:200] if sys.argv[0].endswith(("lab", "cli.py")) else sys.argv[0])
    return note


def _writers(path: Path) -> str:
    """The live processes that left a note beside the lock `path`: '`COMMAND` (pid N)', joined."""
    found = []
    for note in sorted(path.with_suffix(".d").glob("*")):
        if not note.name.split(".")[0].isdigit():
            continue  # not a note of ours
        pid = int(note.name.split(".")[0])
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            note.unlink(missing_ok=True)  # its process died without removing it
            continue
        except PermissionError:
            pass
        with contextlib.suppress(OSError):
            found.append(f"`{note.read_text()}` (pid {pid})")
    return ", ".join(dict.fromkeys(found)) or "another lab process"


@contextlib.contextmanager
def _writing(uri: str, exclusive: bool = False) -> Iterator[None]:
    """The body as one of the store's writers (shared), or as its only user (`exclusive`: the re-key).
    ConfigError when the other kind holds the store."""
    path = _lock_file(uri, "writers")
    if path is None:  # a server or database store: its clients are not all on this machine (docs/running.md)
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        _take(fh, path, exclusive)
        note = _writer_note(path)
        try:
            yield
        finally:
            note.unlink(missing_ok=True)


def _take(fh: Any, path: Path, exclusive: bool) -> None:
    """The writers lock on the open file `fh`, or ConfigError naming who holds it the other way."""
    import fcntl

    from lab.config import ConfigError

    try:
        fcntl.flock(fh, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        if exclusive:
            raise ConfigError(
                "--rekey", f"refused while {_writers(path)} writes to this store; run it again once it has ended"
            ) from None
        raise ConfigError(
            "tracking.uri", f"refused while {_writers(path)} re-keys this store; run this again once it has ended"
        ) from None


def check_writable(uri: str) -> None:
    """ConfigError (one line naming it) when `lab doctor --rekey` holds the local store at `uri`: a command
    that will write there is refused before its work, not when it opens its run. Creates nothing: without
    the lock file, no re-key has ever run there."""
    path = _lock_file(uri, "writers")
    if path is None or not path.is_file():
        return
    with open(path) as fh:
        _take(fh, path, exclusive=False)


def _shown(uri: str) -> str:
    import re

    return re.sub(r"//[^/@]*@", "//", uri)  # no credentials in a message


def _create_or_upgrade(uri: str, head: str | None) -> None:
    """Under the store's schema lock: MLflow's tables created and migrated to `head`, or an older store's
    upgraded (MLflow itself refuses to open one: `mlflow db upgrade` was left to the user)."""
    from mlflow.store.db import utils

    engine = utils.create_sqlalchemy_engine_with_retry(uri)
    try:
        if not utils._all_tables_exist(engine):
            utils._initialize_tables(engine)  # creates the first schema, then migrates it to the head
        elif head is not None and (found := _schema_version(uri)) != head:
            print(f"upgrading the MLflow store {_shown(uri)} from schema {found} to {head}", file=sys.stderr)
            utils._upgrade_db(engine)
    finally:
        engine.dispose()


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
    except KeyboardInterrupt:
        mlflow.end_run(status="KILLED")
        raise
    except BaseException:
        mlflow.end_run(status="FAILED")
        raise
    else:
        mlflow.end_run(status=run.end_status)


@contextlib.contextmanager
def start_run(
    uri: str,
    artifact_root: str,
    experiment: str,
    run_name: str,
    tags: dict[str, Any],
    parent_run_id: str | None = None,
) -> Iterator[Run]:
    """An MLflow run that ends FINISHED, FAILED on an exception, KILLED on Ctrl-C."""
    configure(uri)
    with _writing(uri):
        exp_id = ensure_experiment(experiment, artifact_root)
        active = mlflow.start_run(
            experiment_id=exp_id,
            run_name=run_name,
            nested=parent_run_id is not None,
            parent_run_id=parent_run_id,
            tags={k: str(v) for k, v in tags.items()},
        )
        with _ends_with_status(Run(active.info.run_id)) as run:
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
            else:
                active = mlflow.start_run(experiment_id=exp_id, run_name=run_name, tags=all_tags)
        with _ends_with_status(Run(active.info.run_id)) as run:
            yield run


def _equals(field: str, value: str) -> str:
    """An MLflow filter clause `field = value`, quoted so that the value cannot end its string early."""
    value = str(value)
    if "'" not in value:
        return f"{field} = '{value}'"
    if '"' not in value:
        return f'{field} = "{value}"'
    raise ValueError(f"{field}: {value!r} has both kinds of quotes, which an MLflow filter cannot hold")


def child_runs(uri: str, parent_run_id: str, status: str | None = None) -> list[Any]:
    """Runs nested under `parent_run_id` (optionally only those with `status`, e.g. FINISHED)."""
    configure(uri)
    client = MlflowClient()
    parent = client.get_run(parent_run_id)
    query = _equals("tags.`mlflow.parentRunId`", parent_run_id)
    if status:
        query += f" and {_equals('attributes.status', status)}"
    return client.search_runs([parent.info.experiment_id], filter_string=query, max_results=5000)


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
    return client.search_runs([exp.experiment_id], filter_string=query, order_by=["attributes.start_time DESC"])


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
    runs = client.search_runs(
        [e.experiment_id for e in client.search_experiments()],
        filter_string=f"{_equals('tags.train_key', train_key)} and attributes.status = 'FINISHED'",
        order_by=["attributes.start_time ASC"],
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
    configure(uri)
    client = MlflowClient()
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return []
    return client.search_runs([exp.experiment_id], filter_string=filter_string)


def runs_keyed_before(uri: str, scheme: int = CONFIG_HASH_SCHEME) -> list[Any]:
    """Finished runs of every experiment whose `config_hash` tag was computed by a hash scheme older than
    `scheme` (the tag `config_hash_scheme` is missing or lower): a study does not find them as done."""
    db = local_paths(uri)
    if db is not None and not db.is_file():
        return []  # nothing recorded yet; reading must not create an empty store
    configure(uri)
    client = MlflowClient()
    runs = client.search_runs(
        [e.experiment_id for e in client.search_experiments()],
        filter_string="attributes.status = 'FINISHED' and tags.config_hash != ''",
        max_results=50000,
    )
    return [r for r in runs if int(r.data.tags.get("config_hash_scheme", "1")) < scheme]


def rekey(uri: str, runs: list[Any]) -> int:
    """The migration of `lab doctor --rekey`: `runs` (of `runs_keyed_before`) re-keyed to the current
    CONFIG_HASH_SCHEME from the config each logged, the old hash kept as the tag `config_hash_previous`, so
    that studies find them as done. A run without a logged config, or an imported drafter's (its logged keys
    are the checkpoint's), is left to be rerun. Returns how many were re-keyed. Refused (ConfigError) while
    another lab process writes to a local store: a study running beside it would match runs by either key."""
    with _writing(uri, exclusive=True):
        return _rekey(uri, runs)


def _rekey(uri: str, runs: list[Any]) -> int:
    done = 0
    for run in runs:
        logged = logged_config(uri, run.info.run_id)
        if logged is None or (logged.get("drafter") or {}).get("checkpoint"):
            continue
        # before scheme 3 every prompt decoded max_new_tokens: the default now stops at eos
        logged.setdefault("eval", {}).setdefault("stop_at_eos", False)
        set_run_tags(
            uri,
            run.info.run_id,
            {
                "config_hash": config_hash(logged),
                "config_hash_scheme": CONFIG_HASH_SCHEME,
                "config_hash_previous": run.data.tags["config_hash"],
            },
        )
        done += 1
    return done


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


def check_reachable(uri: str, timeout: float = 3.0) -> None:
    """ValueError (one line) when `uri` is an MLflow server that does not answer its health check.

    MLflow's own client retries a dead server for minutes before it fails; a command checks first.
    A local or database store is not checked here (opening it tells)."""
    if not uri.startswith(("http://", "https://")):
        return
    import os
    import re
    import ssl
    import urllib.error
    import urllib.request

    shown = re.sub(r"//[^/@]*@", "//", uri)  # /health needs no credentials; a message shows none
    try:
        context = None  # the TLS settings MLflow's client honours, so that the check agrees with it
        if os.environ.get("MLFLOW_TRACKING_INSECURE_TLS", "").lower() == "true":
            context = ssl._create_unverified_context()
        elif os.environ.get("MLFLOW_TRACKING_SERVER_CERT_PATH"):
            context = ssl.create_default_context(cafile=os.environ["MLFLOW_TRACKING_SERVER_CERT_PATH"])
        with urllib.request.urlopen(shown.rstrip("/") + "/health", timeout=timeout, context=context):
            return
    except urllib.error.HTTPError as exc:
        if exc.code < 500:  # something answers (a proxy, an auth wall): MLflow reports what it is
            return
        reason: object = f"HTTP {exc.code} {exc.reason}"
    except urllib.error.URLError as exc:
        reason = exc.reason
    except (OSError, ValueError) as exc:  # a timeout while reading, a malformed address, a missing CA file
        reason = exc
    raise ValueError(f"cannot reach the MLflow server at {shown}: {' '.join(str(reason).split())}")


def ui_environment() -> dict[str, str]:
    """Environment for the UI server: without MLflow 3's job runner (GenAI scorers), which starts eight
    worker processes that keep two cores busy while the workbench has no job for them."""
    return {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


UI_APP = "lab"  # lab/track/ui_app.py, an `mlflow.app` entry point in pyproject.toml: opens runs tables


def server_command(
    backend_uri: str, artifacts_destination: str, host: str = "127.0.0.1", port: int = 5000, workers: int = 2
) -> list[str]:
    """`mlflow server` over a database backend store, serving artifacts itself: clients on other machines
    log to `http://HOST:PORT` and upload their artifacts through it into `artifacts_destination`."""
    destination = artifacts_destination
    if "://" not in destination:
        root = Path(destination).resolve()
        root.mkdir(parents=True, exist_ok=True)
        destination = root.as_uri()
    return [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--backend-store-uri",
        backend_uri,
        "--serve-artifacts",
        "--artifacts-destination",
        destination,
        "--host",
        host,
        "--port",
        str(port),
        "--workers",
        str(workers),
        "--app-name",
        UI_APP,
    ]


def ui_command(uri: str, artifact_root: str, host: str = "127.0.0.1", port: int = 5000) -> list[str]:
    """The `mlflow ui` command line over the configured store (bound to loopback by default).

    Run as `python -m mlflow` with this interpreter: the venv's `mlflow` script is not on PATH when
    `.venv/bin/lab ui` is called without activating the venv."""
    cmd = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri, "--host", host, "--port", str(port)]
    cmd += ["--app-name", UI_APP]
    if "://" not in artifact_root:
        cmd += ["--default-artifact-root", Path(artifact_root).resolve().as_uri()]
    return cmd
