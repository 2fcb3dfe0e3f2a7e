"""Small file-system helpers shared by the caches: locks, atomic publication, content hashes, cache entries'
identities, worker logs.

Every file or folder the workbench publishes (caches, checkpoints, reports, archives) is written whole or not
at all: written under a temp name beside its target, flushed to the disk (fsync), then renamed into place
(`atomic_file`, `staging_dir`, `staged_output`). A full disk or a crash leaves the old version or nothing at
the target's path, and at most a temp leftover beside it, which no reader looks at and the next write of the
same target removes."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


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


# What a write leaves beside its target while it runs: `.NAME.tmp-XXXXXXXX` (the new content, a file or a
# folder) and, for a folder, `.NAME.old-XXXXXXXX` (the one it replaces, for a moment). Readers never look at
# these names; a writer of NAME removes those whose writer is gone (see `clean_leftovers`).
_LEFTOVER_KINDS = re.compile(r"(?:tmp|old)-[0-9a-f]{8}")


def _sibling(final: Path, kind: str) -> Path:
    return final.parent / f".{final.name}.{kind}-{uuid.uuid4().hex[:8]}"


def fsync_path(path: Path) -> None:
    """Flush a file's data, or a folder's entries, to the disk. Before a rename it makes the rename publish
    written bytes (and turns an error the disk reports late, at flush time, into a failed write); after a rename,
    fsyncing the folder makes the new name itself survive a crash of the machine."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        # some file systems cannot fsync a folder (EINVAL); a file's data is never skipped
        if not (path.is_dir() and exc.errno in (errno.EINVAL, errno.ENOTSUP)):
            raise
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and folder under `root` (folders after what they hold), `root` last."""
    for folder, dirs, files in os.walk(root, topdown=False):
        for name in files + dirs:
            if not os.path.islink(os.path.join(folder, name)):
                fsync_path(Path(folder) / name)
    fsync_path(root)


def _locked_temp(final: Path, folder: bool) -> tuple[Path, int]:
    """A new temp sibling of `final` (a file or a folder) and an open descriptor holding its flock, which
    marks it as in use until the descriptor closes (with the process, however it ends)."""
    while True:
        tmp = _sibling(final, "tmp")
        try:
            if folder:
                tmp.mkdir()
                fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
            else:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileNotFoundError:
            if not final.parent.is_dir():
                raise
            continue  # a cleaner took the new name for a leftover before we locked it: another name
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if os.stat(tmp).st_ino == os.fstat(fd).st_ino:
                return tmp, fd
        except FileNotFoundError:
            pass
        os.close(fd)


def clean_leftovers(final: Path) -> list[Path]:
    """Remove what interrupted writes of `final` left beside it (see `_LEFTOVER_KINDS`), skipping any that a
    live writer still holds; what was removed. Only names made from `final`'s are touched, so a folder's
    other files, even dot-files, are never at risk."""
    prefix = f".{final.name}."
    try:
        names = os.listdir(final.parent)
    except (FileNotFoundError, NotADirectoryError):
        return []
    removed = []
    for name in names:
        if not (name.startswith(prefix) and _LEFTOVER_KINDS.fullmatch(name[len(prefix) :])):
            continue
        path = final.parent / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue  # gone already, or not ours to open
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue  # a writer is at work on it
        try:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append(path)
        finally:
            os.close(fd)
    return removed


def replace_dir(src: Path, final: Path) -> None:
    """Publish the finished folder `src` (a sibling of `final`) as `final`: flushed to the disk first, then
    renamed into place. An existing `final` is renamed aside just before and removed after, so that the path
    holds the old folder, nothing (between the two renames) or the new folder, never a mix of them. Two
    processes publishing the same folder (two reports of one study) take turns: at once, one would rename the
    other's new folder aside, or its own onto a folder that is not empty (ENOTEMPTY)."""
    fsync_tree(src)
    old = None
    with file_lock(final.parent / f".{final.name}.publish.lock"):
        clean_leftovers(final)
        if os.path.lexists(final):
            old = _sibling(final, "old")
            os.replace(final, old)
        os.replace(src, final)
        fsync_path(final.parent)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


@contextlib.contextmanager
def staging_dir(final: Path) -> Iterator[Path]:
    """Build into a sibling temp folder and publish it as `final` (`replace_dir`) only if the body succeeds:
    `final` holds the old or the new content, never a mix. A failed body's folder is removed; a killed one's
    is removed by the next write of `final`."""
    final.parent.mkdir(parents=True, exist_ok=True)
    clean_leftovers(final)
    tmp, fd = _locked_temp(final, folder=True)
    try:
        yield tmp
        replace_dir(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        os.close(fd)


@contextlib.contextmanager
def temp_dir(beside: Path) -> Iterator[Path]:
    """A scratch folder beside `beside` (on its disk), removed on exit; a killed process's is removed by the
    next writer of `beside`, like any leftover of it."""
    beside.parent.mkdir(parents=True, exist_ok=True)
    clean_leftovers(beside)
    tmp, fd = _locked_temp(beside, folder=True)
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """A temp sibling to write, flushed to the disk and renamed onto `path` only if the body succeeds: readers
    of `path` see the old or the new bytes, never a partial file. A failed body's temp is removed; a killed
    one's is removed by the next write of `path`."""
    clean_leftovers(path)
    tmp, fd = _locked_temp(path, folder=False)
    try:
        yield tmp
        fsync_path(tmp)
        os.replace(tmp, path)
        fsync_path(path.parent)
    finally:
        tmp.unlink(missing_ok=True)
        os.close(fd)


_STAGING = "staging"  # `folder/.staging.tmp-XXXXXXXX`: an output staged inside a folder it shares


def _holds_only(folder: Path, entries: tuple[str, ...]) -> bool:
    """Whether `folder` holds nothing but `entries` and leftovers of writing them (a folder a writer of
    `entries` owns and may replace whole)."""
    leftover = re.compile(rf"\.(?:{'|'.join(map(re.escape, (*entries, _STAGING)))})\.{_LEFTOVER_KINDS.pattern}")
    return all(name in entries or leftover.fullmatch(name) for name in os.listdir(folder))


@contextlib.contextmanager
def staged_output(folder: Path, entries: tuple[str, ...]) -> Iterator[Path]:
    """Build an output of several files, `entries` (the names it writes into `folder`: files or folders), in a
    staging folder, and publish it only if the body succeeds. Where `folder` is absent, or holds nothing but
    `entries`, the staging folder becomes `folder` (`staging_dir`): the old output, none, or the new one,
    never a mix. Where `folder` holds other things too (a user's own folder, or the working directory), those
    stay: the entries are moved in one by one in the order given (each one whole), so an output whose last
    entry checks the others (a manifest of hashes) is never taken for whole when it is not."""
    folder = Path(folder)
    shared = os.path.lexists(folder) and (
        folder.is_symlink()
        or not folder.is_dir()
        or Path.cwd().resolve().is_relative_to(folder.resolve())
        or not _holds_only(folder, entries)
    )
    if not shared:
        with staging_dir(folder) as tmp:
            yield tmp
        return
    anchor = folder / _STAGING
    clean_leftovers(anchor)
    tmp, fd = _locked_temp(anchor, folder=True)
    try:
        yield tmp
        fsync_tree(tmp)
        for name in entries:
            src, dst = tmp / name, folder / name
            if src.is_dir():
                replace_dir(src, dst)
            elif os.path.lexists(src):
                clean_leftovers(dst)
                os.replace(src, dst)
        fsync_path(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        os.close(fd)


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


IDENTITY = "identity"  # the field of a cache entry's manifest (or info file) that records its identity
_SHOWN_MAX = 80  # characters of a value quoted in a mismatch's line (a sha256 whole)
_ABSENT = object()


@dataclass(frozen=True)
class Mismatch:
    """The first field, dotted (`data.num_sequences`), in which a cache entry's recorded identity differs from the
    one a run asks for, with the entry's value and the run's."""

    field: str
    stored: Any
    asked: Any

    def __str__(self) -> str:
        return f"built for {self.field}={_shown(self.stored)}, this run asks {_shown(self.asked)}"


class Identity:
    """What a cache entry's key hashes. The key names the entry; the identity, recorded in the entry's manifest,
    shows on load that the entry under a key is the one that key names. Caches are shared on a disk and copied
    between machines, and a folder moved onto another key is still whole by its own manifest's hashes."""

    def __init__(self, fields: dict[str, Any]):
        # as the key hashes it and a manifest stores it: through JSON, anything JSON lacks as its str()
        self.fields: dict[str, Any] = json.loads(json.dumps(fields, default=str))

    def key(self, n: int = 12) -> str:
        return short_hash(self.fields, n)

    def mismatch(self, record: dict | None) -> Mismatch | None:
        """The first field in which the identity that `record` (a manifest) holds differs from this one, else
        None. A record that holds none is taken as it stands (its files are still checked against their hashes),
        so that entries which record no identity keep loading."""
        stored = record.get(IDENTITY) if isinstance(record, dict) else None
        if stored is None:
            return None
        return _first_difference(stored, self.fields, "")


def _first_difference(stored: Any, asked: Any, name: str) -> Mismatch | None:
    """Fields in the run's order, then those only the entry has; lists and scalars compare whole, as JSON (so
    that 1, 1.0 and true, which the key tells apart, differ here too)."""
    if isinstance(stored, dict) and isinstance(asked, dict):
        for field in [*asked, *(k for k in stored if k not in asked)]:
            dotted = f"{name}.{field}" if name else field
            found = _first_difference(stored.get(field, _ABSENT), asked.get(field, _ABSENT), dotted)
            if found is not None:
                return found
        return None
    if stored is not _ABSENT and asked is not _ABSENT and _canonical(stored) == _canonical(asked):
        return None
    return Mismatch(name or IDENTITY, stored, asked)


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _shown(value: Any) -> str:
    if value is _ABSENT:
        return "(none)"
    text = value if isinstance(value, str) and value and value.isprintable() else json.dumps(value)
    return text if len(text) <= _SHOWN_MAX else text[: _SHOWN_MAX - 3] + "..."


def entry_name(path: Path) -> str:
    """A cache entry as its messages name it: its kind's folder and its key (`hidden/ab12cd34ef56`)."""
    return f"{path.parent.name}/{path.name}"


def built_entry(folder: Path, info: str, identity: Identity, rebuilding: bool = False) -> bool:
    """Whether `folder` holds a finished entry of `identity`: its info file `info` (written last, a JSON object)
    records it. With `rebuilding` (the caller builds the entry if not), one line says why a finished entry of
    another identity is replaced."""
    record = read_manifest(folder, info)
    if record is None:
        return False
    wrong = identity.mismatch(record)
    if wrong is not None and rebuilding:
        logger.warning(f"cache entry {entry_name(folder)}: {wrong}; rebuilding it")
    return wrong is None


ERROR_LINE_MAX = 300  # characters of a tool's output quoted in a one-line message


def error_line(output: str) -> str:
    """The line of a failed tool's output (a worker's log, pip's stderr) that says what went wrong, for a
    one-line message: the last line that names an error, else the last line; '' for no output. Warnings
    (`WARNING...`, as pip and vLLM start them) are passed over while there is any other line: a retry's
    warning often names an error that is not the one the tool stopped on."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    lines = [ln for ln in lines if not ln.startswith("WARNING")] or lines
    errors = [ln for ln in lines if "Error" in ln or "error" in ln]
    return (errors or lines or [""])[-1][:ERROR_LINE_MAX]


def last_error_line(log_path: Path, start: int = 0) -> str:
    """`error_line` of a failed worker's log (from byte `start` on: a log appended to across runs)."""
    with open(log_path, "rb") as log:
        log.seek(start)
        return error_line(log.read().decode(errors="replace")) or "no output"
