"""`lab ui` (the MLflow UI), `lab server` (an MLflow tracking server for workers elsewhere) and `lab dashboard`
(optuna-dashboard over a study's storage): the verbs that serve until stopped."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from lab.cli.common import PORT, STORE_KEYS, SWEEP_FILE, Verb, capped_workers, fail, host, integer, path_type
from lab.config import ConfigError, redact
from lab.config.composition import compose
from lab.config.rules import PathRule
from lab.preflight import check_content, check_paths

# `lab dashboard --storage`: an Optuna storage it reads (a journal file, or a SQLite database by URL)
INPUT_JOURNAL = PathRule("file", "journal")
INPUT_SQLITE = PathRule("file", "sqlite", prefix="sqlite:///")


def cmd_ui(args: argparse.Namespace) -> int:
    """the MLflow UI over the configured store, opened on a study (127.0.0.1 unless --host)

    Serve MLflow's UI over the configured store and print the URL of the study `experiment=NAME` (else of the
    newest study): its runs in the study's saved view, each run's description saying its arm, seed and AL; the
    parent run's description holds the report's main table and links to its figures. A browser opens it where
    the machine has a display, unless --no-browser. MLflow's telemetry stays off unless
    MLFLOW_DISABLE_TELEMETRY=false is set (docs/tracking.md).
    """
    from lab.sweep.find import named_study

    names, overrides = named_study(args.overrides, ("experiment",))
    cfg = compose(overrides)
    check_paths(cfg, keys=STORE_KEYS)
    from lab import track

    page = track.study_page(cfg.tracking.uri, names["experiment"][-1] if names["experiment"] else None)
    track.configure(cfg.tracking.uri)
    cmd = track.ui_command(cfg.tracking.uri, cfg.tracking.artifact_root, args.host, args.port)
    url = f"http://{args.host}:{args.port}/{page}"
    print(f"MLflow UI on {url} over {cfg.tracking.uri}", flush=True)  # flushed: exec drops unwritten output
    if not args.no_browser and _has_display():
        _open_when_served(url.replace("//0.0.0.0:", "//127.0.0.1:"))
    os.execvpe(cmd[0], cmd, {**track.ui_environment(), **os.environ})
    return 0


def _has_display() -> bool:
    """Whether a graphical browser can open here (not over ssh without X forwarding, not in a container)."""
    return sys.platform in ("darwin", "win32") or bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


# run detached, as the server replaces `lab ui`'s process: opens the page once the server answers
_OPENER = """import sys, time, urllib.request, webbrowser
for _ in range(600):
    try:
        urllib.request.urlopen(sys.argv[1].split("#")[0], timeout=2)
        break
    except OSError:
        time.sleep(0.5)
webbrowser.open(sys.argv[1])
"""


def _open_when_served(url: str) -> None:
    quiet = subprocess.DEVNULL
    subprocess.Popen(
        [sys.executable, "-c", _OPENER, url], stdin=quiet, stdout=quiet, stderr=quiet, start_new_session=True
    )


def cmd_server(args: argparse.Namespace) -> int:
    """an MLflow tracking server over a database store, for workers on many machines (127.0.0.1 unless --host)

    Serve the store named by tracking.uri (a database URL such as postgresql://..., or the local sqlite file)
    over HTTP, artifacts included: workers anywhere then log with tracking.uri=http://HOST:PORT and upload their
    artifacts through it into tracking.artifact_root.
    """
    cfg = compose(args.overrides)
    from lab import track

    backend, root = cfg.tracking.uri, cfg.tracking.artifact_root
    if track.is_server(backend):
        return fail("tracking.uri: the server's own store is needed, e.g. postgresql://USER:PW@HOST/lab_mlflow")
    check_paths(cfg, keys=STORE_KEYS)
    workers = capped_workers(args)
    try:  # created once here: the server's workers would each migrate a new store
        track.prepare_store(backend)
    except Exception as exc:  # noqa: BLE001 - a refused connection, a missing driver: one line
        raise ConfigError("tracking.uri", f"cannot open {redact(backend)}: {str(exc).splitlines()[0]}") from None
    cmd = track.server_command(backend, root, args.host, args.port, workers)
    print(f"MLflow tracking server on http://{args.host}:{args.port}: store {redact(backend)}, artifacts in {root}")
    print(f"  workers log to it with: tracking.uri=http://{args.host}:{args.port}")
    os.execvpe(cmd[0], cmd, {**track.ui_environment(), **os.environ})
    return 0


def cmd_dashboard(args: argparse.Namespace) -> int:
    """optuna-dashboard over a sweep's or ablation's Optuna storage, on 127.0.0.1

    Serve optuna-dashboard (trial history, parameters, importances, Pareto fronts, notes) on 127.0.0.1 over the
    Optuna storage of `lab sweep sweep=NAME` or `lab ablate experiment=NAME` run with the same overrides (the
    journal file beside the MLflow database, or tracking.optuna_storage), or over --storage URL: a journal file
    or a database URL (sqlite:///..., postgresql://...). A study there is shown as it runs; its page's URL is
    printed. Nothing is created: a storage that is not there or holds no study (or not the named sweep's study)
    is refused.
    """
    from lab.sweep import dashboard, find

    sweep, verb, extra = find.dashboard_study(args.overrides, args.seeds, args.storage is not None)
    url = args.storage if args.storage is not None else dashboard.study_storage(sweep, extra)
    key = "--storage" if args.storage is not None else "tracking.optuna_storage"
    for rule in (INPUT_JOURNAL, INPUT_SQLITE):  # a journal or SQLite file read before Optuna opens it
        if (path := rule.path(url)) is not None:
            check_content(key, rule, path)
    storage = dashboard.read_studies(url, key)
    study = sweep.study_name(extra) if sweep is not None else None
    if study is not None and study not in storage.studies:
        held = ", ".join(sorted(storage.studies))
        raise ConfigError(
            sweep.source,
            f"no study '{study}' in '{redact(url)}' (it holds {held}); `{verb}` with the same overrides starts "
            f"it, --storage {redact(url)} shows the others",
        )
    server, port = dashboard.bind(args.port)
    taken = f" ({dashboard.DEFAULT_PORT} is taken)" if args.port is None and port != dashboard.DEFAULT_PORT else ""
    n = len(storage.studies)
    studies = f"{n} stud{'y' if n == 1 else 'ies'}"
    print(f"Optuna dashboard on http://{dashboard.HOST}:{port}/{taken} over {redact(url)} ({studies})")
    if study is None and len(storage.studies) == 1:
        study = next(iter(storage.studies))
    if study is not None:
        print(f"  study {study}: {dashboard.study_url(port, storage.studies[study])}")
    print("  Ctrl-C stops it", flush=True)
    try:
        dashboard.serve(server, storage)
    except KeyboardInterrupt:
        pass
    return 0


def _ui_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", type=host, default="127.0.0.1")
    p.add_argument("--port", type=PORT, default=5000)
    p.add_argument("--no-browser", action="store_true", help="print the study's URL only, open no browser")
    p.add_argument("overrides", nargs="*", help="[experiment=NAME] then Hydra overrides, e.g. tracking.uri=...")


def _server_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", type=host, default="127.0.0.1")
    p.add_argument("--port", type=PORT, default=5000)
    p.add_argument(
        "--workers",
        type=integer(1),
        default=2,
        help="server processes (default 2; capped at the cores unless --force)",
    )
    p.add_argument("--force", action="store_true", help="keep a --workers above the machine's cores")
    p.add_argument("overrides", nargs="*", help="the store: tracking.uri=..., tracking.artifact_root=...")


def _dashboard_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", help="sweep=NAME or experiment=NAME, then the overrides it ran with")
    p.add_argument(
        "--storage",
        type=path_type(INPUT_JOURNAL, INPUT_SQLITE),
        help="an Optuna storage: a journal file or a database URL (all its studies)",
    )
    p.add_argument("--seeds", help="with experiment=NAME: the seeds `lab ablate --seeds` ran")
    p.add_argument("--port", type=PORT, help="port on 127.0.0.1 (default 8080, or a free one when it is taken)")


UI = Verb(
    cmd_ui,
    _ui_arguments,
    epilog="examples:\n  lab ui                          # the newest study\n"
    "  lab ui experiment=drift_2x2\n  lab ui --no-browser tracking.uri=sqlite:///elsewhere/mlflow.db",
    fill=False,
)
SERVER = Verb(
    cmd_server,
    _server_arguments,
    epilog="example:\n  lab server --host 0.0.0.0 --port 5000 tracking.uri=postgresql://lab:PW@dbhost/lab_mlflow "
    "tracking.artifact_root=/shared/mlartifacts",
    fill=False,
)
DASHBOARD = Verb(
    cmd_dashboard,
    _dashboard_arguments,
    epilog="examples:\n  lab dashboard sweep=toggles_grid\n"
    "  lab dashboard sweep=toggles_grid profile=micro --port 8081\n"
    "  lab dashboard experiment=drift_2x2 profile=quick --seeds 0,1\n"
    "  lab dashboard --storage mlruns/optuna.journal\n"
    "  lab dashboard --storage postgresql://user@host/optuna",
    named_files=(SWEEP_FILE,),
)
