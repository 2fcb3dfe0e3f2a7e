"""A study's small cache entries in its archive, so that the study resumed on another machine pays no stage whose
result came along (`lab study export --with-caches`, restored by `lab study import`).

An entry is a folder `{cache_dir}/{kind}/{key}/` whose `manifest.json` names the target it was made with
(lab/data/). What travels: every entry of the kinds in `CARRIED` whose manifest names one of the study's targets
(its runs' `target` tag) and that fits in `limit` bytes. The regenerations (`regen/`, the training conversations
and MT-Bench's turn-1 answers: text) are small; the suites' greedy answers (`answers/`) and the held-out states
(`heldout/`) hold the target's captured layers and fit only at small sizes. The hidden states, the targets and
resume states never travel: each is rebuilt from what is there (the pinned assets) or is too large.

Every carried file is a member `cache/{kind}/{key}/{file}` checked by the archive's manifest like any other. An
import restores an entry only where the destination's cache folder has none: staged beside it and renamed into
place, whole; an entry already there is kept, and each entry's own manifest still proves it on load.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from lab.fsutil import staging_dir

CARRIED = ("regen", "answers", "heldout")
MEMBER_DIR = "cache"  # the archive's folder of cache entries
ENTRY_MANIFEST = "manifest.json"


@dataclass
class CacheEntry:
    kind: str  # one of CARRIED
    key: str  # the entry's folder name
    files: list[str]  # inside the entry's folder
    bytes: int

    @property
    def name(self) -> str:
        return f"{self.kind}/{self.key}"

    def member(self, file: str) -> str:
        return f"{MEMBER_DIR}/{self.kind}/{self.key}/{file}"


def study_entries(cache_dir: Path, targets: set[str], limit: int) -> tuple[list[CacheEntry], list[CacheEntry]]:
    """The entries of `cache_dir` made with one of `targets`, in (kind, key) order: (those of at most `limit`
    bytes, those larger)."""
    carried: list[CacheEntry] = []
    larger: list[CacheEntry] = []
    for kind in CARRIED:
        folder = Path(cache_dir) / kind
        for entry in sorted(folder.iterdir()) if folder.is_dir() else []:
            if not entry.is_dir() or entry.name.startswith(".") or _target(entry) not in targets:
                continue
            files = sorted(p.name for p in entry.iterdir() if p.is_file() and not p.name.startswith("."))
            found = CacheEntry(kind, entry.name, files, sum((entry / f).stat().st_size for f in files))
            (carried if found.bytes <= limit else larger).append(found)
    return carried, larger


def _target(entry: Path) -> str | None:
    try:
        manifest = json.loads((entry / ENTRY_MANIFEST).read_text())
    except (OSError, ValueError):
        return None  # an entry being written, or damaged: its next reader rebuilds it
    return manifest.get("target") if isinstance(manifest, dict) else None


def member_files(cache_dir: Path, entries: list[CacheEntry]) -> dict[str, Path]:
    """Archive member name -> local file, for `export_study`'s `extra_files`."""
    return {e.member(f): Path(cache_dir) / e.kind / e.key / f for e in entries for f in e.files}


def describe(entries: list[CacheEntry]) -> list[dict]:
    """The entries as the archive's manifest lists them (`caches`)."""
    return [asdict(e) for e in entries]


def listed(manifest: dict) -> list[CacheEntry]:
    """The entries an archive's manifest lists, each checked to be of a carried kind, with plain names, and whole
    in the archive (ValueError, one line)."""
    entries = []
    for doc in manifest.get("caches") or []:
        entry = CacheEntry(str(doc["kind"]), str(doc["key"]), [str(f) for f in doc["files"]], int(doc["bytes"]))
        names = [entry.key, *entry.files]
        if entry.kind not in CARRIED or any("/" in n or n in ("", ".", "..") or n.startswith(".") for n in names):
            raise ValueError(f"caches: {entry.name} is not a cache entry this lab restores")
        if missing := [f for f in entry.files if entry.member(f) not in manifest["files"]]:
            raise ValueError(f"caches: {entry.name}: {missing[0]} is not in the archive")
        entries.append(entry)
    return entries


def restore(unpacked: Path, entries: list[CacheEntry], cache_dir: Path) -> tuple[list[CacheEntry], list[CacheEntry]]:
    """Each entry from the unpacked archive into `cache_dir`, where it has none; (restored, kept as they were)."""
    restored: list[CacheEntry] = []
    kept: list[CacheEntry] = []
    for entry in entries:
        final = Path(cache_dir) / entry.kind / entry.key
        if final.exists():
            kept.append(entry)
            continue
        with staging_dir(final) as tmp:
            for f in entry.files:
                shutil.copyfile(unpacked / entry.member(f), tmp / f)
        restored.append(entry)
    return restored, kept
