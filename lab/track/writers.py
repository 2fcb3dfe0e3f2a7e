"""The writers lock of a local store: who writes to it (an open run, a study's parent, an import) and the
re-key (`lab doctor --rekey`) exclude each other, and a refusal names the command on the other side.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lab.track.store import _lock_file

# A local store's writers (an open run, a study's parent, an import) each hold a shared lock on the file
# `writers` and leave their command line in the folder beside it, so that `lab doctor --rekey`, which rewrites
# the tags studies match finished runs by, takes that lock exclusively or is refused, naming who writes; and a
# writer is refused while a re-key runs, naming it.


def _writer_note(path: Path) -> Path:
    """This process's note beside the lock `path`: the command it runs, for a refusal to name."""
    import uuid

    from lab.config import redact

    folder = path.with_suffix(".d")
    folder.mkdir(exist_ok=True)
    note = folder / f"{os.getpid()}.{uuid.uuid4().hex[:8]}"
    words = [redact(w) for w in sys.argv[1:]]
    note.write_text(" ".join(["lab", *words])[:200] if sys.argv[0].endswith(("lab", "cli.py")) else sys.argv[0])
    return note


def _writers(path: Path) -> str:
    """The live processes that left a note beside the lock `path`: '`COMMAND` (pid N)', joined."""
    found = []
    for note in sorted(path.with_suffix(".d").glob("*")):
        if not note.name.split(".")[0].isdigit():
            continue  # not a note of ours
        pid = int(note.name.split(".")[0])
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            note.unlink(missing_ok=True)  # its process died without removing it
            continue
        except PermissionError:
            pass
        with contextlib.suppress(OSError):
            found.append(f"`{note.read_text()}` (pid {pid})")
    return ", ".join(dict.fromkeys(found)) or "another lab process"


@contextlib.contextmanager
def _writing(uri: str, exclusive: bool = False) -> Iterator[None]:
    """The body as one of the store's writers (shared), or as its only user (`exclusive`: the re-key).
    ConfigError when the other kind holds the store."""
    path = _lock_file(uri, "writers")
    if path is None:  # a server or database store: its clients are not all on this machine (docs/running.md)
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        _take(fh, path, exclusive)
        note = _writer_note(path)
        try:
            yield
        finally:
            note.unlink(missing_ok=True)


def _take(fh: Any, path: Path, exclusive: bool) -> None:
    """The writers lock on the open file `fh`, or ConfigError naming who holds it the other way."""
    import fcntl

    from lab.config import ConfigError

    try:
        fcntl.flock(fh, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        if exclusive:
            raise ConfigError(
                "--rekey", f"refused while {_writers(path)} writes to this store; run it again once it has ended"
            ) from None
        raise ConfigError(
            "tracking.uri", f"refused while {_writers(path)} re-keys this store; run this again once it has ended"
        ) from None


def check_writable(uri: str) -> None:
    """ConfigError (one line naming it) when `lab doctor --rekey` holds the local store at `uri`: a command
    that will write there is refused before its work, not when it opens its run. Creates nothing: without
    the lock file, no re-key has ever run there."""
    path = _lock_file(uri, "writers")
    if path is None or not path.is_file():
        return
    with open(path) as fh:
        _take(fh, path, exclusive=False)
