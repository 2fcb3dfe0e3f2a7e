"""Small file-system helpers shared by the caches: locks, atomic publication, content hashes, worker logs."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive inter-process lock: a second builder of the same cache entry waits here."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextlib.contextmanager
def claim(path: Path) -> Iterator[bool]:
    """A non-blocking exclusive lock held for the body: True if this process holds it, False if another
    process does. The lock file is removed on release; a process that opened it just before then sees
    another inode than the path's and opens it anew."""
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            fd = None
            break
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    if fd is None:
        yield False
        return
    try:
        yield True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.close(fd)


@contextlib.contextmanager
def staging_dir(final: Path) -> Iterator[Path]:
    """Build into a sibling temp dir and rename it into place only if the body succeeds. An existing
    `final` is renamed aside first, so that the path holds the old or the new content, never a mix."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """A temp sibling to write, renamed onto `path` only if the body succeeds: readers of `path` see
    the old or the new bytes, never a partial file."""
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_manifest(folder: Path, name: str = "manifest.json") -> dict | None:
    """A cache entry's JSON manifest, or None where it is missing or unreadable (the entry is then rebuilt)."""
    path = folder / name
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None


def mismatched_file(folder: Path, hashes: dict[str, str]) -> str | None:
    """The first of `hashes` (file name -> sha256) that is missing in `folder` or differs, else None."""
    for name, digest in hashes.items():
        f = folder / name
        if not f.is_file() or sha256_file(f) != digest:
            return name
    return None


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def short_hash(obj: Any, n: int = 12) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:n]


def last_error_line(log_path: Path, start: int = 0) -> str:
    """What a failed worker's log says last about an error (from byte `start` on: a log appended to across
    runs), for a one-line message."""
    with open(log_path, "rb") as log:
        log.seek(start)
        lines = [ln.strip() for ln in log.read().decode(errors="replace").splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln or "error" in ln]
    return (errors or lines or ["no output"])[-1][:300]
