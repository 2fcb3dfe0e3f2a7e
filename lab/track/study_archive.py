"""A study moved between MLflow stores as one archive (`lab study export` / `lab study import`).

The archive is a .tar.gz whose first member is `manifest.json` (format, schema version, the study, the runs in
order, and the sha256 of every other member); each run is `runs/RUN_ID/run.json` (experiment, name, status,
times, tags, params, every metric's full history with steps and timestamps, dataset inputs, the list of its
artifacts) and its artifacts under `runs/RUN_ID/artifacts/`. Checkpoints (`checkpoint/`) travel only when asked
for; the Optuna study, when asked for, is one more member written by the caller (lab/sweep/optuna_archive.py),
since this package does not import Optuna.

Reading checks the whole archive before anything is written: the gzip stream to its end (its CRC and length),
every member's name and checksum, the manifest's schema and every run document's shape. Importing creates
runs with new ids (MLflow chooses them), each tagged `lab.imported_from` with the id of the run that first
recorded it, so that importing again finds it and skips it; a run whose import was cut short still carries
`lab.import=partial` and is replaced on the next import.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import math
import re
import shutil
import tarfile
import tempfile
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param, RunStatus, ViewType
from mlflow.tracking import MlflowClient

from lab.config import redact
from lab.fsutil import atomic_file, sha256_file, temp_dir
from lab.track.queries import _equals, _no_progress_bar
from lab.track.runs import ensure_experiment, git_commit
from lab.track.store import configure, local_paths
from lab.track.writers import _writing

FORMAT = "lab-study-archive"
SCHEMA = 1  # bump when a reader of version 1 could not read what is written: older labs then refuse it
MANIFEST = "manifest.json"
CHECKPOINT_ARTIFACTS = ("checkpoint",)  # top-level artifact folders left out unless with_checkpoints
ORIGIN_TAG = "lab.imported_from"  # the id of the run in the store that first recorded it
PARTIAL_TAG = "lab.import"  # "partial" while an import writes the run; removed once it is complete
PARENT_TAG = "mlflow.parentRunId"
_RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_STATUSES = {RunStatus.to_string(s) for s in RunStatus.all_status()}
_PAGE = 1000  # runs per search page
_METRIC_BATCH, _PARAM_BATCH = 1000, 100  # MLflow's limits per log_batch call


class ArchiveError(ValueError):
    """An archive that cannot be imported: str() is the reason, one line (the caller names the file)."""


@dataclass
class Exported:
    path: Path
    bytes: int
    runs: int
    artifacts: int
    checkpoints_left_out: int  # checkpoint files not carried (with_checkpoints=False)


@dataclass
class Archive:
    """A read and fully checked archive, unpacked into `folder` (a temporary folder)."""

    path: Path
    folder: Path
    manifest: dict[str, Any]
    runs: list[dict[str, Any]]  # run documents, parent first

    @property
    def parent(self) -> dict[str, Any]:
        return self.runs[0]

    @property
    def study(self) -> dict[str, Any]:
        return self.manifest["study"]

    @property
    def optuna(self) -> dict[str, Any] | None:
        return self.manifest["optuna"]

    def file(self, name: str) -> Path:
        return self.folder / name

    def artifacts(self) -> int:
        return sum(len(r["artifacts"]) for r in self.runs)


@dataclass
class Imported:
    parent_run_id: str  # the study's parent run in the destination store
    created: int = 0
    skipped: int = 0  # already there (imported before, or the store that recorded them)
    replaced: int = 0  # an earlier import cut short: deleted and imported again
    run_ids: dict[str, str] = field(default_factory=dict)  # original run id -> destination run id


# ------------------------------------------------------------------------------------------------ export


def export_study(
    uri: str,
    parent_run_id: str,
    out: Path,
    study: dict[str, Any],
    with_checkpoints: bool = False,
    extra_files: dict[str, Path] | None = None,
    optuna: dict[str, Any] | None = None,
) -> Exported:
    """Write the study under `parent_run_id` (the parent and every child run) into the archive `out`, atomically
    (a temporary sibling, flushed to the disk and renamed into place: a full disk or a killed export leaves the
    archive that was there, or none, never a partial one). `study` is recorded in the manifest as it is;
    `extra_files` (archive name -> local file) are carried too, e.g. the Optuna study that `optuna` describes."""
    configure(uri)
    client = MlflowClient()
    parent = client.get_run(parent_run_id)
    children = _search(client, [parent.info.experiment_id], _equals(f"tags.`{PARENT_TAG}`", parent_run_id))
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


def _search(client: MlflowClient, experiment_ids: list[str], query: str) -> list[Any]:
    """Every active run that matches, page by page (a search returns at most one page)."""
    out: list[Any] = []
    token = None
    while True:
        page = client.search_runs(
            experiment_ids, filter_string=query, run_view_type=ViewType.ACTIVE_ONLY, max_results=_PAGE, page_token=token
        )
        out += list(page)
        token = page.token
        if not token:
            return out


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


def _dataset_input(doc: Any) -> DatasetInput:
    """The dataset input a document of `_input_document` describes (MLflow's own `from_dictionary` leaves the
    dataset a dict, which its store then cannot log)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("dataset"), dict) or not isinstance(doc.get("tags"), dict):
        raise TypeError("expected {dataset: {...}, tags: {...}}")
    fields = ("name", "digest", "source_type", "source", "schema", "profile")
    if set(doc["dataset"]) - set(fields) or not all(isinstance(doc["dataset"].get(f), str) for f in fields[:4]):
        raise TypeError(f"dataset: expected text fields {', '.join(fields)}")
    tags = [InputTag(str(k), str(v)) for k, v in doc["tags"].items()]
    return DatasetInput(Dataset(**{f: doc["dataset"].get(f) for f in fields}), tags)


def _count_artifacts(client: MlflowClient, run_id: str, entry: Any) -> int:
    if not entry.is_dir:
        return 1
    return sum(_count_artifacts(client, run_id, e) for e in client.list_artifacts(run_id, entry.path))


def _number(value: float) -> float | str:
    """A metric value JSON can hold: NaN and the infinities as strings (json's NaN is not JSON)."""
    return value if math.isfinite(value) else str(value)


# ------------------------------------------------------------------------------------------------ reading


@contextlib.contextmanager
def open_archive(path: Path) -> Iterator[Archive]:
    """The archive at `path`, unpacked into a temporary folder and checked through (ArchiveError, one line,
    when anything is wrong); the folder is removed afterwards."""
    if path.is_dir():
        raise ArchiveError("is a directory; expected an archive file written by `lab study export`")
    if not path.is_file():
        raise ArchiveError("no such file; expected an archive written by `lab study export`")
    with tempfile.TemporaryDirectory(prefix="lab-import-") as tmp:
        folder = Path(tmp)
        found = _unpack(path, folder)
        manifest = _manifest(folder, found)
        runs = [_run_document(folder, manifest, run_id, i == 0) for i, run_id in enumerate(manifest["runs"])]
        yield Archive(path, folder, manifest, runs)


def _unpack(path: Path, folder: Path) -> dict[str, str]:
    """Every member of the archive written into `folder`, by name -> sha256. The gzip stream is read to its
    end, so that a truncated or altered file fails its length or CRC check here."""
    found: dict[str, str] = {}
    try:
        with gzip.open(path, "rb") as stream:
            with tarfile.open(fileobj=stream, mode="r|") as tar:
                for member in tar:
                    name = _safe_name(member.name)
                    if not member.isfile():
                        raise ArchiveError(f"member '{name}' is not a plain file; expected files only")
                    if name in found:
                        raise ArchiveError(f"member '{name}' appears twice; expected each file once")
                    src = tar.extractfile(member)
                    if src is None:
                        raise ArchiveError(f"member '{name}' cannot be read")
                    dst = folder / name
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    digest = hashlib.sha256()
                    with open(dst, "wb") as fh:
                        while block := src.read(1 << 20):
                            digest.update(block)
                            fh.write(block)
                    found[name] = digest.hexdigest()
            while stream.read(1 << 20):  # past tar's end marker, to the gzip trailer's CRC and length
                pass
    except ArchiveError:
        raise
    except (tarfile.TarError, EOFError, zlib.error, OSError) as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise ArchiveError(
            f"damaged or not a .tar.gz ({reason}); expected an archive written by `lab study export`"
        ) from None
    return found


def _safe_name(name: str) -> str:
    """A member name that stays inside the unpacking folder (relative, no `..`)."""
    parts = PurePosixPath(name).parts
    if not parts or name.startswith("/") or any(p in ("..", ".", "") for p in parts) or "\\" in name:
        raise ArchiveError(f"member '{name}' has an unsafe path; expected relative paths inside the archive")
    return str(PurePosixPath(*parts))


def _manifest(folder: Path, found: dict[str, str]) -> dict[str, Any]:
    if MANIFEST not in found:
        raise ArchiveError(f"no {MANIFEST}, so not an archive written by `lab study export`")
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArchiveError(f"{MANIFEST} is not valid JSON ({exc}); the archive is damaged") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArchiveError(f"{MANIFEST} does not name the format '{FORMAT}'; expected an archive of `lab study export`")
    schema = manifest.get("schema")
    if schema != SCHEMA:
        raise ArchiveError(
            f"schema version {schema!r} is not one this lab reads (it reads version {SCHEMA}); "
            "expected an archive written by a lab of the same schema: import it with the lab that wrote it"
        )
    _expect(manifest, MANIFEST, {"study": dict, "parent": str, "runs": list, "files": dict, "with_checkpoints": bool})
    files = manifest["files"]
    if not all(isinstance(v, str) and _SHA256.fullmatch(v) for v in files.values()):
        raise ArchiveError(f"{MANIFEST}: files: expected a sha256 per file")
    for name in sorted(set(files) | set(found) - {MANIFEST}):
        if name not in found:
            raise ArchiveError(f"{name} is listed in {MANIFEST} but missing; the archive is incomplete")
        if name not in files:
            raise ArchiveError(f"{name} is not listed in {MANIFEST}; expected only the files it lists")
        if found[name] != files[name]:
            raise ArchiveError(f"{name} does not match its checksum in {MANIFEST}; the archive is damaged")
    runs = manifest["runs"]
    if not runs or not all(isinstance(r, str) and _RUN_ID.fullmatch(r) for r in runs) or len(set(runs)) != len(runs):
        raise ArchiveError(f"{MANIFEST}: runs: expected the run ids, each once")
    if runs[0] != manifest["parent"]:
        raise ArchiveError(f"{MANIFEST}: runs: expected the parent run first")
    optuna = manifest.get("optuna")
    if optuna is not None:
        _expect(optuna, f"{MANIFEST}: optuna", {"study": str, "file": str})
        if optuna["file"] not in files:
            raise ArchiveError(f"{MANIFEST}: optuna: {optuna['file']} is not in the archive")
    manifest.setdefault("optuna", None)
    return manifest


def _run_document(folder: Path, manifest: dict[str, Any], run_id: str, is_parent: bool) -> dict[str, Any]:
    name = f"runs/{run_id}/run.json"
    if name not in manifest["files"]:
        raise ArchiveError(f"{name} is missing; the archive is incomplete")
    try:
        doc = json.loads((folder / name).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArchiveError(f"{name} is not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ArchiveError(f"{name}: expected a JSON object")
    _expect(
        doc,
        name,
        {"run_id": str, "experiment": str, "name": str, "status": str, "tags": dict, "params": dict},
    )
    _expect(doc, name, {"metrics": dict, "inputs": list, "artifacts": list})
    if doc["run_id"] != run_id:
        raise ArchiveError(f"{name}: run_id: expected '{run_id}', got '{doc['run_id']}'")
    if doc.get("parent") != (None if is_parent else manifest["parent"]):
        raise ArchiveError(f"{name}: parent: expected {'none' if is_parent else manifest['parent']}")
    if doc["status"] not in _STATUSES:
        raise ArchiveError(f"{name}: status: expected one of {', '.join(sorted(_STATUSES))}")
    for key in ("start_time", "end_time"):
        if doc.get(key) is not None and not isinstance(doc[key], int):
            raise ArchiveError(f"{name}: {key}: expected milliseconds or null")
    for key in ("tags", "params"):
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in doc[key].items()):
            raise ArchiveError(f"{name}: {key}: expected text values")
    for key, points in doc["metrics"].items():
        if not isinstance(points, list) or not all(_point(p) for p in points):
            raise ArchiveError(f"{name}: metrics: {key}: expected [step, timestamp, value] points")
    for artifact in doc["artifacts"]:
        if not isinstance(artifact, str) or f"runs/{run_id}/artifacts/{artifact}" not in manifest["files"]:
            raise ArchiveError(f"{name}: artifact {artifact!r} is not in the archive")
    for item in doc["inputs"]:
        try:
            _dataset_input(item)
        except (TypeError, ValueError):
            raise ArchiveError(f"{name}: inputs: expected MLflow dataset inputs") from None
    return doc


def _point(p: Any) -> bool:
    return (
        isinstance(p, list)
        and len(p) == 3
        and all(isinstance(x, int) and not isinstance(x, bool) for x in p[:2])
        and (isinstance(p[2], (int, float)) or p[2] in ("nan", "inf", "-inf"))
    )


def _expect(data: dict, where: str, types: dict[str, type]) -> None:
    for key, tp in types.items():
        if not isinstance(data.get(key), tp) or (tp is int and isinstance(data.get(key), bool)):
            raise ArchiveError(f"{where}: {key}: expected {tp.__name__}, got {type(data.get(key)).__name__}")


# ------------------------------------------------------------------------------------------------ import


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
        for run in _search(client, [exp.experiment_id], ""):
            tags = run.data.tags
            origin = tags.get(ORIGIN_TAG) or run.info.run_id
            complete = tags.get(PARTIAL_TAG) != "partial"
            if origin in origins and not existing.get(origin, ("", False))[1]:  # a complete copy wins
                existing[origin] = (run.info.run_id, complete)
        key = archive.parent["tags"].get("lab.study_key")
        if key is not None and experiment == archive.parent["experiment"]:
            query = f"tags.`lab.role` = 'parent' and {_equals('tags.`lab.study_key`', key)}"
            for other in _search(client, [exp.experiment_id], query):
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
