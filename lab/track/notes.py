"""What a study shows in the MLflow UI, in MLflow's own settings: the descriptions it renders as Markdown (the
tag `mlflow.note.content` of an experiment or a run), a saved view of an experiment's runs table (the experiment
tag `mlflow.sharedViewState.KEY`, which the UI applies when its URL carries `viewStateShareKey=KEY`), and the
page of a study that `lab ui` opens on.

MLflow 3.17 stores no default columns for an experiment: its runs table starts from columns fixed in its front
end and keeps a user's choice in the browser. A saved view is what it stores on the experiment itself.
"""

from __future__ import annotations

import json
import time
from typing import Any
from urllib.parse import quote

from mlflow.tracking import MlflowClient

from lab.config import ConfigError
from lab.track.queries import _equals, every_experiment, every_run
from lab.track.runs import ensure_experiment
from lab.track.store import configure, local_paths
from lab.track.writers import _writing

NOTE = "mlflow.note.content"  # the description MLflow's UI shows (and edits) on an experiment's or a run's page
VIEW_TAG = "mlflow.sharedViewState."  # + KEY: a saved view of the experiment's runs table
VIEW_PARAM = "viewStateShareKey"  # the URL parameter that applies one
PARENT = "tags.`lab.role` = 'parent'"


def describe_experiment(uri: str, artifact_root: str, experiment: str, text: str) -> None:
    """The experiment's description (created if new), shown at the top of its page."""
    configure(uri)
    with _writing(uri):
        MlflowClient().set_experiment_tag(ensure_experiment(experiment, artifact_root), NOTE, text)


def describe_run(uri: str, run_id: str, text: str) -> None:
    """A run's description: its page's Description, and the runs table's `Description` column (first line)."""
    configure(uri)
    MlflowClient().set_tag(run_id, NOTE, text)


def save_view(uri: str, experiment_id: str, key: str, name: str, state: dict[str, Any]) -> None:
    """A saved view `key` of the experiment's runs table: `state` holds the UI's own fields (`selectedColumns`,
    `orderByKey`, `orderByAsc`, `searchFilter`, ...), in the envelope the UI's "Views" menu writes."""
    configure(uri)
    now = int(time.time() * 1000)
    envelope = {"name": name, "createdAt": now, "updatedAt": now, "state": json.dumps(state)}
    MlflowClient().set_experiment_tag(experiment_id, VIEW_TAG + key, json.dumps(envelope))


def _studies(client: MlflowClient) -> list[Any]:
    """The parent runs of every study in the store, newest first."""
    ids = [e.experiment_id for e in every_experiment(client)]
    return every_run(client, ids, PARENT, ["attributes.start_time DESC"])


def study_page(uri: str, experiment: str | None) -> str:
    """The UI's page of study `experiment` (else of the newest study), as the part of its URL after the host:
    its runs table in the study's saved view where `lab report` stored one. Empty for a store without studies.
    ConfigError (one line, listing the studies there are) for a name the store has no experiment of."""
    db = local_paths(uri)
    if db is not None and not db.is_file():  # reading must not create an empty store
        if experiment is None:
            return ""
        raise ConfigError("experiment", f"no study '{experiment}': no MLflow store at {db} (`lab ablate` makes one)")
    configure(uri)
    client = MlflowClient()
    parents = _studies(client)
    if experiment is None:
        if not parents:
            return ""
        exp = client.get_experiment(parents[0].info.experiment_id)
    else:
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            names = sorted({client.get_experiment(p.info.experiment_id).name for p in parents})
            held = ", ".join(names) if names else "none yet (`lab ablate experiment=NAME` makes one)"
            raise ConfigError("experiment", f"no study '{experiment}' in {uri}; the studies there: {held}")
    page = f"#/experiments/{exp.experiment_id}/runs"
    newest = [p for p in parents if p.info.experiment_id == exp.experiment_id]
    key = newest[0].data.tags.get("lab.study_key") if newest else None
    if key and VIEW_TAG + key in exp.tags:
        page += f"?{VIEW_PARAM}={quote(key)}"
    return page


def study_runs_filter(key: str) -> str:
    """The runs of one study (its parent and its children): a search filter for its saved view."""
    return _equals("tags.`optuna_study`", key)
