"""The format of a study archive and its reader, which checks the whole archive before anything is written: the
gzip stream to its end (its CRC and length), every member's name and checksum, the manifest's schema and every
run document's shape (`open_archive` -> `Archive`; ArchiveError, one line, when anything is wrong).
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import re
import tarfile
import tempfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from mlflow.entities import Dataset, DatasetInput, InputTag, RunStatus

FORMAT = "lab-study-archive"
SCHEMA = 1  # bump when a reader of version 1 could not read what is written: older labs then refuse it
MANIFEST = "manifest.json"
PARENT_TAG = "mlflow.parentRunId"
_RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_STATUSES = {RunStatus.to_string(s) for s in RunStatus.all_status()}


class ArchiveError(ValueError):
    """An archive that cannot be imported: str() is the reason, one line (the caller names the file)."""


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
