"""Opening an MLflow store: the tracking URI set explicitly, the store created or upgraded once under a lock
whatever other lab processes open it at the same time (`configure`, `prepare_store`, `store_lock`).

A local store is a sqlite database plus an artifact folder, created on first use; a database store (PostgreSQL)
is locked with advisory locks; a server store (http) is its server's to prepare.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlflow
from mlflow.tracking import MlflowClient

logger = logging.getLogger(__name__)


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
                    logger.info(f"waiting: {waiting} (lock {path})")
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
                logger.info(f"waiting: {waiting}")
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
            logger.warning(f"upgrading the MLflow store {_shown(uri)} from schema {found} to {head}")
            utils._upgrade_db(engine)
    finally:
        engine.dispose()
