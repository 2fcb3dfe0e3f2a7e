"""The text every machine has: a fixed, recorded selection of the Python standard library's source.

Files are ordered by a hash of their relative path (so a byte budget samples across the whole
library, not just `asyncio/`), and split into train / held-out by the same hash. The manifest (path
and sha256 of each file) is part of every cache key built on this corpus.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Tests, demos and vendored trees are unlike library code, and some are huge generated tables.
_SKIP_PARTS = {"test", "tests", "idle_test", "site-packages", "turtledemo", "__pycache__", "lib2to3", "encodings"}
_MAX_FILE_BYTES = 200_000
HELDOUT_EVERY = 10  # one file in ten is held out


@dataclass(frozen=True)
class CorpusFile:
    relpath: str
    sha256: str
    size: int
    heldout: bool

    def read(self, root: Path | None = None) -> str:
        return ((root or stdlib_root()) / self.relpath).read_text(encoding="utf-8", errors="replace")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _order_key(relpath: str) -> str:
    return hashlib.sha256(relpath.encode()).hexdigest()


@functools.lru_cache(maxsize=8)
def select(max_bytes: int, root: Path | None = None) -> tuple[CorpusFile, ...]:
    """The first `max_bytes` of library source in hash order, each file marked train or held-out. Cached for
    the process: a run selects it in several stages, and walking the library costs about a second."""
    root = root or stdlib_root()
    candidates = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in _SKIP_PARTS]  # never walked into
        for name in names:
            path = Path(folder, name)
            if name.endswith(".py") and path.stat().st_size <= _MAX_FILE_BYTES:
                candidates.append(path.relative_to(root).as_posix())
    candidates.sort(key=_order_key)
    chosen: list[CorpusFile] = []
    total = 0
    for rel in candidates:
        data = (root / rel).read_bytes()
        if not data.strip():
            continue
        heldout = int(_order_key(rel)[:8], 16) % HELDOUT_EVERY == 0
        chosen.append(CorpusFile(rel, hashlib.sha256(data).hexdigest(), len(data), heldout))
        total += len(data)
        if total >= max_bytes:
            break
    if not chosen:
        raise FileNotFoundError(f"no Python source found under {root}")
    return tuple(chosen)


def manifest_hash(files: tuple[CorpusFile, ...]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.relpath}\0{f.sha256}\0{int(f.heldout)}\n".encode())
    return h.hexdigest()
