"""The text every machine has: a fixed, recorded selection of the Python standard library's source.

Files are ordered by a hash of their relative path (so a byte budget samples across the whole
library, not just `asyncio/`), and split into train / held-out by the same hash. The manifest (path
and sha256 of each file) is part of every cache key built on this corpus.
"""

from __future__ import annotations

import hashlib
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


def select(max_bytes: int, root: Path | None = None) -> list[CorpusFile]:
    """The first `max_bytes` of library source in hash order, each file marked train or held-out."""
    root = root or stdlib_root()
    candidates = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if _SKIP_PARTS.intersection(rel.parts) or path.stat().st_size > _MAX_FILE_BYTES:
            continue
        candidates.append(rel.as_posix())
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
    return chosen


def manifest_hash(files: list[CorpusFile]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.relpath}\0{f.sha256}\0{int(f.heldout)}\n".encode())
    return h.hexdigest()
