"""`lab dashboard`: optuna-dashboard over the Optuna storage of a sweep (`sweeps/NAME.yaml`), an ablation
(`experiments/NAME.yaml`) or a storage given by URL, served on 127.0.0.1 only.

The storage is read before anything is served, without creating anything: a journal file or sqlite
database that is not there is not made (the dashboard would show an empty storage, and a later sweep
would find a stray file), and no Optuna tables are created in a database. A storage that holds no study,
or not the study that the sweep's spec and overrides name, is refused in one line. The server is
optuna-dashboard's WSGI app (its public `wsgi()`) in a threaded wsgiref server, as its own command runs
it, but bound here so that a busy port is known before the URL is printed."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from lab.config import ConfigError, redact
from lab.sweep.find import first_point
from lab.sweep.search_space import Sweep

if TYPE_CHECKING:
    import optuna

HOST = "127.0.0.1"  # never another interface: the dashboard can rename, annotate and delete studies
DEFAULT_PORT = 8080  # optuna-dashboard's own default; a free port when it is taken and none was asked for


@dataclass
class Storage:
    """An opened Optuna storage and the studies it holds (name -> study id)."""

    url: str
    storage: optuna.storages.BaseStorage
    studies: dict[str, int]


def read_studies(url: str, key: str) -> Storage:
    """Open the storage at `url` (a journal file path or a database URL) for reading, creating nothing there,
    and list its studies; a ConfigError naming `key` when it is not there, cannot be read or holds no study."""
    # imports MLflow (lab.track) and Optuna: only once a spec, if any, has loaded
    from lab.sweep.storage import open_storage, unreadable

    storage = open_storage(url, create=False, key=key)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Optuna's ExperimentalWarning for the journal storage
        try:
            names = [s.study_name for s in storage.get_all_studies()]
            studies = {name: storage.get_study_id_from_name(name) for name in names}
        except Exception as exc:  # a refused connection, no Optuna tables, not a database
            raise unreadable(key, url, exc) from None
    if not studies:
        raise ConfigError(key, f"'{redact(url)}' holds no Optuna study yet (`lab sweep` makes one); expected a study")
    return Storage(url, storage, studies)


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # Ctrl-C does not wait for a browser's open requests


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass  # no line per request; errors still reach stderr through the server's handle_error


def bind(port: int | None) -> tuple[_Server, int]:
    """A server socket on 127.0.0.1: `port`, else 8080, else (8080 taken) a free port."""
    for candidate in [port] if port is not None else [DEFAULT_PORT, 0]:
        try:
            server = _Server((HOST, candidate), _QuietHandler)
        except OSError as exc:
            if port is not None:
                raise ConfigError("--port", f"cannot listen on {HOST}:{port}: {exc.strerror or exc}") from None
            continue
        return server, server.server_address[1]
    raise ConfigError("--port", f"no free port on {HOST}")


def serve(server: _Server, storage: Storage) -> None:
    """Serve optuna-dashboard over the storage until interrupted."""
    import optuna_dashboard

    server.set_app(optuna_dashboard.wsgi(storage.storage))
    try:
        server.serve_forever()
    finally:
        server.server_close()


def study_url(port: int, study_id: int) -> str:
    return f"http://{HOST}:{port}/dashboard/studies/{study_id}"


def study_storage(sweep: Sweep, extra: list[str]) -> str:
    """The storage a `lab sweep` / `lab ablate` of `sweep` with overrides `extra` uses: its first point's
    tracking.optuna_storage, or the journal file beside the MLflow database."""
    from lab.sweep.storage import storage_url  # imports MLflow (a second): only once the spec has loaded

    return storage_url(first_point(sweep, extra))
