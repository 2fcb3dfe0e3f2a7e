"""`lab study import`: a checked archive's runs written into a store under new ids (MLflow chooses them), each
tagged with the id of the run that first recorded it, so that importing again skips it; a run whose import was
cut short is replaced on the next import. `plan_import` only reads the destination; `apply_import` writes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient

from lab.config import redact
from lab.track.queries import _equals, _no_progress_bar, every_run
from lab.track.runs import ensure_experiment
from lab.track.store import configure, local_paths
from lab.track.study_archive.reading import PARENT_TAG, Archive, _dataset_input
from lab.track.writers import _writing

ORIGIN_TAG = "lab.imported_from"  # the id of the run in the store that first recorded it
PARTIAL_TAG = "lab.import"  # "partial" while an import writes the run; removed once it is complete
_METRIC_BATCH, _PARAM_BATCH = 1000, 100  # MLflow's limits per log_batch call


@dataclass
class Imported:
    parent_run_id: str  # the study's parent run in the destination store
    created: int = 0
    skipped: int = 0  # already there (imported before, or the store that recorded them)
    replaced: int = 0  # an earlier import cut short: deleted and imported again
    run_ids: dict[str, str] = field(default_factory=dict)  # original run id -> destination run id


@dataclass
class ImportPlan:
    """What an import would do, found by reading the destination only (nothing is created)."""

    archive: Archive
    uri: str
    artifact_root: str
    existing: dict[str, tuple[str, bool]]  # original run id -> (destination run id, complete?)


def _origin(doc: dict[str, Any]) -> str:
    """The id of the run in the store that first recorded it (kept through a chain of imports)."""
    return doc["tags"].get(ORIGIN_TAG) or doc["run_id"]


def plan_import(uri: str, artifact_root: str, archive: Archive) -> ImportPlan:
    """The runs of `archive` the store at `uri` already holds. ValueError (one line) when the store holds
    another study under the same study key: `lab report` and a resumed study would pick either."""
    existing: dict[str, tuple[str, bool]] = {}
    db = local_paths(uri)
    if db is not None and not db.is_file():
        return ImportPlan(archive, uri, artifact_root, existing)  # an empty store: reading must not create it
    configure(uri)
    client = MlflowClient()
    origins = {_origin(r) for r in archive.runs}
    for experiment in sorted({r["experiment"] for r in archive.runs}):
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            continue
        for run in every_run(client, [exp.experiment_id], ""):
            tags = run.data.tags
            origin = tags.get(ORIGIN_TAG) or run.info.run_id
            complete = tags.get(PARTIAL_TAG) != "partial"
            if origin in origins and not existing.get(origin, ("", False))[1]:  # a complete copy wins
                existing[origin] = (run.info.run_id, complete)
        key = archive.parent["tags"].get("lab.study_key")
        if key is not None and experiment == archive.parent["experiment"]:
            query = f"tags.`lab.role` = 'parent' and {_equals('tags.`lab.study_key`', key)}"
            for other in every_run(client, [exp.experiment_id], query):
                if (other.data.tags.get(ORIGIN_TAG) or other.info.run_id) != _origin(archive.parent):
                    raise ValueError(
                        f"{redact(uri)} already holds another study '{key}' (parent run {other.info.run_id}); "
                        "expected a store without it (another tracking.uri), since reports would pick either"
                    )
    return ImportPlan(archive, uri, artifact_root, existing)


def apply_import(plan: ImportPlan, parent_tags: dict[str, str] | None = None) -> Imported:
    """Create the runs `plan` found missing (parent first), each complete before the next; `parent_tags` are
    set on the parent run when it is created here."""
    configure(plan.uri)
    with _writing(plan.uri):
        return _apply(plan, parent_tags)


def _apply(plan: ImportPlan, parent_tags: dict[str, str] | None) -> Imported:
    client = MlflowClient()
    archive = plan.archive
    result = Imported(parent_run_id="")
    for doc in archive.runs:
        origin = _origin(doc)
        found, complete = plan.existing.get(origin, ("", False))
        if complete:
            result.run_ids[doc["run_id"]] = found
            result.skipped += 1
            continue
        if found:  # cut short last time: its data may be partial
            client.delete_run(found)
            result.replaced += 1
        tags = dict(doc["tags"])
        tags[ORIGIN_TAG] = origin
        tags[PARTIAL_TAG] = "partial"
        if doc["parent"] is not None:
            tags[PARENT_TAG] = result.run_ids[doc["parent"]]
        else:
            tags.update(parent_tags or {})
        new_id = _create_run(client, plan.artifact_root, archive, doc, tags)
        result.run_ids[doc["run_id"]] = new_id
        result.created += 1
    result.parent_run_id = result.run_ids[archive.manifest["parent"]]
    return result


def _create_run(client: MlflowClient, artifact_root: str, archive: Archive, doc: dict, tags: dict[str, str]) -> str:
    exp_id = ensure_experiment(doc["experiment"], artifact_root)
    run = client.create_run(exp_id, start_time=doc.get("start_time"), tags=tags, run_name=doc["name"] or None)
    run_id = run.info.run_id
    params = [Param(k, v) for k, v in sorted(doc["params"].items())]
    for i in range(0, len(params), _PARAM_BATCH):
        client.log_batch(run_id, params=params[i : i + _PARAM_BATCH])
    metrics = [Metric(k, float(v), ts, step) for k, points in sorted(doc["metrics"].items()) for step, ts, v in points]
    for i in range(0, len(metrics), _METRIC_BATCH):
        client.log_batch(run_id, metrics=metrics[i : i + _METRIC_BATCH])
    if doc["inputs"]:
        client.log_inputs(run_id, datasets=[_dataset_input(d) for d in doc["inputs"]])
    folder = archive.file(f"runs/{doc['run_id']}/artifacts")
    if doc["artifacts"]:
        with _no_progress_bar():
            client.log_artifacts(run_id, str(folder))
    if doc["status"] != "RUNNING":  # a run still running where it was recorded stays RUNNING here too
        client.set_terminated(run_id, status=doc["status"], end_time=doc.get("end_time"))
    client.delete_tag(run_id, PARTIAL_TAG)  # last: only now is the run complete
    return run_id
