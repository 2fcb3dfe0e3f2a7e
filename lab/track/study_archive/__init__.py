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

With `--with-caches` the archive carries the study's small cache entries too (`cache/{kind}/{key}/...`, listed in
the manifest's `caches`), which an import restores into the destination's cache folder (`caches`).

`reading` holds the format and its checks, `export` writes an archive, `importing` writes one into a store,
`caches` picks and restores cache entries; their public names are re-exported here for the CLI.
"""

from __future__ import annotations

from lab.track.study_archive.export import CHECKPOINT_ARTIFACTS, Exported, export_study
from lab.track.study_archive.importing import ORIGIN_TAG, PARTIAL_TAG, Imported, ImportPlan, apply_import, plan_import
from lab.track.study_archive.reading import FORMAT, MANIFEST, PARENT_TAG, SCHEMA, Archive, ArchiveError, open_archive

__all__ = [
    "CHECKPOINT_ARTIFACTS",
    "FORMAT",
    "MANIFEST",
    "ORIGIN_TAG",
    "PARENT_TAG",
    "PARTIAL_TAG",
    "SCHEMA",
    "Archive",
    "ArchiveError",
    "Exported",
    "ImportPlan",
    "Imported",
    "apply_import",
    "export_study",
    "open_archive",
    "plan_import",
]
