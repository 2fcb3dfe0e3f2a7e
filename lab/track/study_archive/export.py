"""`lab study export`: a study's parent and child runs (tags, params, every metric's full history, dataset inputs,
artifacts; checkpoints only when asked for) written into one archive, atomically.
"""

from __future__ import annotations

import json
import math
import shutil
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlflow.entities import DatasetInput
from mlflow.tracking import MlflowClient

from lab.config import redact
from lab.fsutil import atomic_file, sha256_file, temp_dir
from lab.track.queries import _equals, _no_progress_bar, every_run
from lab.track.runs import git_commit
from lab.track.store import configure
from lab.track.study_archive.reading import FORMAT, MANIFEST, PARENT_TAG, SCHEMA, _safe_name

CHECKPOINT_ARTIFACTS = ("checkpoint",)  # top-level artifact folders left out unless with_checkpoints


@dataclass
class Exported:
    path: Path
    bytes: int
    runs: int
    artifacts: int
    checkpoints_left_out: int  # checkpoint files not carried (with_checkpoints=False)


def export_study(
    uri: str,
    parent_run_id: str,
    out: Path,
    study: dict[str, Any],
    with_checkpoints: bool = False,
    extra_files: dict[str, Path] | None = None,
    optuna: dict[str, Any] | None = None,
    caches: list[dict[str, Any]] | None = None,
) -> Exported:
    """Write the study under `parent_run_id` (the parent and every child run) into the archive `out`, atomically
    (a temporary sibling, flushed to the disk and renamed into place: a full disk or a killed export leaves the
    archive that was there, or none, never a partial one). `study` is recorded in the manifest as it is;
    `extra_files` (archive name -> local file) are carried too, e.g. the Optuna study that `optuna` describes, or
    the cache entries that `caches` lists (lab/track/study_archive/caches.py)."""
    configure(uri)
    client = MlflowClient()
    parent = client.get_run(parent_run_id)
    children = every_run(client, [parent.info.experiment_id], _equals(f"tags.`{PARENT_TAG}`", parent_run_id))
    children.sort(key=lambda r: (r.info.start_time or 0, r.info.run_id))
    runs = [parent, *children]
    # staged beside the archive (on its disk, not /tmp): a killed export's copy of the runs is a leftover of
    # `out`, removed by the next export to it
    with temp_dir(out) as staging:
        left_out = 0
        for run in runs:
            left_out += _stage_run(client, run, staging, parent_run_id, with_checkpoints)
        for name, src in (extra_files or {}).items():
            _safe_name(name)
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, staging / name)
        files = sorted(str(p.relative_to(staging)) for p in staging.rglob("*") if p.is_file())
        manifest = {
            "format": FORMAT,
            "schema": SCHEMA,
            "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "written_by": f"lab {git_commit()}",
            "source": {"tracking_uri": redact(uri)},
            "study": study,
            "parent": parent_run_id,
            "runs": [r.info.run_id for r in runs],
            "with_checkpoints": with_checkpoints,
            "optuna": optuna,
            "files": {name: sha256_file(staging / name) for name in files},
        }
        if caches is not None:
            manifest["caches"] = caches
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        with atomic_file(out) as partial:
            with tarfile.open(partial, "w:gz", compresslevel=6) as tar:
                for name in [MANIFEST, *files]:  # the manifest first: a reader knows the schema at once
                    tar.add(staging / name, arcname=name, recursive=False, filter=_plain)
    artifacts = sum(1 for f in files if "/artifacts/" in f)
    return Exported(out, out.stat().st_size, len(runs), artifacts, left_out)


def _plain(info: tarfile.TarInfo) -> tarfile.TarInfo:
    """A member without this machine's user and group."""
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mode = 0o644
    return info


def _stage_run(client: MlflowClient, run: Any, staging: Path, parent_run_id: str, with_checkpoints: bool) -> int:
    """The run's document and artifacts under `staging/runs/RUN_ID/`; returns the checkpoint files left out."""
    run_id = run.info.run_id
    folder = staging / "runs" / run_id
    artifacts = folder / "artifacts"
    artifacts.mkdir(parents=True)
    left_out = 0
    with _no_progress_bar():
        for entry in client.list_artifacts(run_id):
            if entry.path in CHECKPOINT_ARTIFACTS and not with_checkpoints:
                left_out += _count_artifacts(client, run_id, entry)
                continue
            client.download_artifacts(run_id, entry.path, str(artifacts))
    metrics = {}
    for key in sorted(run.data.metrics):
        history = sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))
        metrics[key] = [[m.step, m.timestamp, _number(m.value)] for m in history]
    experiment = client.get_experiment(run.info.experiment_id).name
    document = {
        "run_id": run_id,
        "experiment": experiment,
        "parent": None if run_id == parent_run_id else parent_run_id,
        "name": run.info.run_name or "",
        "status": run.info.status,
        "start_time": run.info.start_time,
        "end_time": run.info.end_time,
        "tags": dict(run.data.tags),
        "params": dict(run.data.params),
        "metrics": metrics,
        "inputs": [_input_document(d) for d in (run.inputs.dataset_inputs if run.inputs else [])],
        "artifacts": sorted(str(p.relative_to(artifacts)) for p in artifacts.rglob("*") if p.is_file()),
    }
    (folder / "run.json").write_text(json.dumps(document, sort_keys=True))
    return left_out


def _input_document(item: DatasetInput) -> dict[str, Any]:
    """A dataset input as JSON: the dataset's fields and the input's tags."""
    d = item.dataset
    dataset = {"name": d.name, "digest": d.digest, "source_type": d.source_type, "source": d.source}
    dataset |= {"schema": d.schema, "profile": d.profile}
    return {"dataset": dataset, "tags": {t.key: t.value for t in item.tags}}


def _count_artifacts(client: MlflowClient, run_id: str, entry: Any) -> int:
    if not entry.is_dir:
        return 1
    return sum(_count_artifacts(client, run_id, e) for e in client.list_artifacts(run_id, entry.path))


def _number(value: float) -> float | str:
    """A metric value JSON can hold: NaN and the infinities as strings (json's NaN is not JSON)."""
    return value if math.isfinite(value) else str(value)
