"""Wall time of one sweep with 1 and with N workers, side by side, and what the shared hidden-state cache
saves each trial.

    .venv/bin/python benchmarks/sweep_workers.py [--sweep toggles_grid] [--workers 2] [hydra overrides...]
    # default overrides: the micro target (profile=micro)

Each leg gets a fresh MLflow store, Optuna journal and hidden-state cache (so its first trial builds the
cache and the others load it) in a temporary folder; the target is built once and shared. Each leg is
`lab sweep` in a process of its own. Prints the legs' wall times, their ratio and the cache line of each
sweep's summary; `--json PATH` writes them.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MICRO = ["profile=micro"]


def leg(sweep: str, workers: int, overrides: list[str], root: Path, targets: Path) -> dict:
    folder = root / f"workers{workers}"
    (folder / "cache").mkdir(parents=True)
    shutil.copytree(targets, folder / "cache" / "targets")
    store = [
        f"cache_dir={folder / 'cache'}",
        f"tracking.uri=sqlite:///{folder / 'mlflow.db'}",
        f"tracking.artifact_root={folder / 'artifacts'}",
    ]
    cmd = [sys.executable, "-m", "lab.cli", "sweep", f"sweep={sweep}", f"--workers={workers}", "--no-progress"]
    started = time.time()
    out = subprocess.run([*cmd, *overrides, *store], capture_output=True, text=True)
    seconds = time.time() - started
    if out.returncode:
        sys.exit(f"sweep with {workers} worker(s) failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    cache = next((line for line in out.stdout.splitlines() if line.startswith("Hidden-state cache")), "")
    saving = re.search(r"saving ([\d.]+) s per trial: (\d+)%", cache)
    trials = len(re.findall(r"^\| \d+ \| COMPLETE", out.stdout, flags=re.M))
    return {
        "workers": workers,
        "seconds": seconds,
        "trials": trials,
        "cache": cache,
        "cache_saving_s": float(saving[1]) if saving else None,
        "cache_saving_share": int(saving[2]) / 100 if saving else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", default="toggles_grid")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", help="write the measurements here")
    args, overrides = parser.parse_known_args()
    overrides = overrides or MICRO
    with tempfile.TemporaryDirectory(prefix="lab-bench-") as tmp:
        root = Path(tmp)
        build = [sys.executable, "-m", "lab.cli", "target", "build", *overrides, f"cache_dir={root / 'shared'}"]
        subprocess.run(build, check=True, capture_output=True)
        legs = [leg(args.sweep, n, overrides, root, root / "shared" / "targets") for n in (1, args.workers)]
    one, many = legs
    for r in legs:
        print(f"{r['workers']} worker(s): {r['trials']} trials in {r['seconds'] / 60:.2f} min")
        print(f"  {r['cache']}")
    print(f"speed-up with {args.workers} workers: {one['seconds'] / many['seconds']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"sweep": args.sweep, "overrides": overrides, "legs": legs}, indent=1))


if __name__ == "__main__":
    main()
