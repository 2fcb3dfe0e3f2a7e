"""MLflow conventions: the one package of the workbench that imports mlflow.

The tracking URI is always set explicitly (never MLflow's implicit default). One experiment per study; a run
carries the study's tags, the flattened resolved config as params, the config file and the drafter checkpoint
as artifacts. The package holds, by concern:

- `store`: opening a store, created or upgraded once under a lock (`configure`, `prepare_store`, `store_lock`);
- `writers`: the lock that keeps a local store's writers and the re-key apart (`check_writable`);
- `runs`: a run's lifecycle (`start_run`, `parent_run` -> `Run`) and logging on any run by id;
- `queries`: reading runs, curves, logged configs, JSON artifacts and checkpoints back;
- `rekey`: `lab doctor --rekey`'s migration of runs keyed by an older config hash scheme;
- `notes`: what the UI shows of a study: descriptions, a saved view of its runs table, the page `lab ui` opens;
- `serving`: a tracking server's reachability and the `mlflow server` / `mlflow ui` command lines;
- `study_archive/`: a study moved between stores as one archive (`lab study export` / `import`);
- `ui_app`: the MLflow app `lab ui` and `lab server` run.

The public names of the first seven are re-exported here, so that callers write `track.start_run(...)` without
knowing which module holds it. A test that patches one patches it here when a caller goes through `lab.track`
(`track.server_command`), and in its module when another function of the package calls it.
"""

from __future__ import annotations

from lab.track.liveness import Orphan, orphans
from lab.track.notes import NOTE, describe_experiment, describe_run, save_view, study_page, study_runs_filter
from lab.track.queries import (
    TrainedRun,
    all_study_parents,
    child_runs,
    get_run,
    logged_config,
    metric_curve,
    run_checkpoint,
    run_json,
    search_runs,
    study_parents,
    trained_run,
)
from lab.track.rekey import rekey, runs_keyed_before
from lab.track.runs import (
    Run,
    RunStopped,
    end_run,
    ensure_experiment,
    git_commit,
    log_artifacts,
    log_dict,
    log_metrics,
    log_text,
    parent_run,
    set_run_tags,
    start_run,
)
from lab.track.serving import UI_APP, check_reachable, server_command, ui_command, ui_environment
from lab.track.store import configure, is_server, local_paths, prepare_store, store_lock
from lab.track.writers import check_writable


def close_orphans(uri: str) -> list[Orphan]:
    """End FAILED every run of the store left RUNNING by a process that is gone (lab/track/liveness.py); returns
    them."""
    from lab.track import liveness

    found = orphans(uri)
    liveness.close(uri, found)
    return found


__all__ = [
    "NOTE",
    "Orphan",
    "UI_APP",
    "Run",
    "RunStopped",
    "TrainedRun",
    "all_study_parents",
    "check_reachable",
    "check_writable",
    "child_runs",
    "configure",
    "describe_experiment",
    "describe_run",
    "end_run",
    "ensure_experiment",
    "get_run",
    "git_commit",
    "is_server",
    "local_paths",
    "log_artifacts",
    "log_dict",
    "log_metrics",
    "log_text",
    "logged_config",
    "metric_curve",
    "orphans",
    "close_orphans",
    "parent_run",
    "prepare_store",
    "rekey",
    "run_checkpoint",
    "run_json",
    "runs_keyed_before",
    "save_view",
    "search_runs",
    "server_command",
    "set_run_tags",
    "start_run",
    "store_lock",
    "study_page",
    "study_parents",
    "study_runs_filter",
    "trained_run",
    "ui_command",
    "ui_environment",
]
