"""Runs per minute that N parallel writers sustain on one MLflow store, and when SQLite says "database is
locked" (docs/running.md, "Many processes, one store").

    .venv/bin/python benchmarks/store_contention.py [--writers 1,2,4,8,16] [--seconds 30] [--postgres URL]
    # --postgres postgresql://lab:lab@127.0.0.1:55432  (scripts/postgres.sh start prints it): a fresh
    # database `lab_bench_contention_N` there for each N, beside the SQLite figures

Each writer is a process of its own that records runs back to back through lab.track for `--seconds`, each
run shaped like a `lab run` of the micro profile with its checkpoint left out: 150 params, 12 tags, 20
training curves of 12 points, 100 evaluation metrics, a dataset input and 3 small artifacts. Real runs spend
seconds to hours computing between these writes, so this is the store's ceiling, not a study's pace. A run
counts if it ended FINISHED; a writer that meets an error (SQLite's "database is locked" among them) counts
it and goes on. Each N gets a fresh store, created before the writers start. Prints one line per store and
N: runs per minute, errors, the first error's text; `--json PATH` writes them.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import tempfile
import time
from pathlib import Path


def _one_run(uri: str, artifacts: str, writer: int, n: int, folder: Path) -> None:
    from lab import track

    tags = {f"tag{i}": f"value{i}" for i in range(12)} | {"study": "bench", "seed": n}
    with track.start_run(uri, artifacts, "bench", f"w{writer}-{n}", tags) as run:
        run.log_params({f"group{i % 7}.key{i}": i * 0.5 for i in range(150)})
        run.log_curves({f"train/curve{i}": [0.1 * j for j in range(12)] for i in range(20)})
        run.log_metrics({f"eval/suite{i % 5}/ref/k{i % 4}/m{i}": i / 7 for i in range(100)})
        run.log_dataset("suite", [{"prompt": f"p{i}", "al": 1.5 + i / 10} for i in range(6)])
        for name in ("config.yaml", "per_prompt.json", "summary.md"):
            (folder / name).write_text("x" * 2000)
            run.log_artifact(folder / name)


def _writer(uri: str, artifacts: str, writer: int, seconds: float, start, ready, out) -> None:
    from lab import track

    track.configure(uri)  # importing and opening the store are not part of the measured time
    folder = Path(tempfile.mkdtemp(prefix=f"bench-w{writer}-"))
    done, errors, first = 0, 0, ""
    ready.put(writer)
    start.wait()
    end = time.time() + seconds
    n = 0
    while time.time() < end:
        n += 1
        try:
            _one_run(uri, artifacts, writer, n, folder)
            done += 1
        except Exception as exc:  # noqa: BLE001 - what a writer meets is the measurement
            errors += 1
            first = first or " ".join(str(exc).split())[:160]
    out.put((done, errors, first))


def measure(uri: str, artifacts: str, writers: int, seconds: float) -> dict:
    from mlflow.tracking import MlflowClient

    from lab import track

    track.configure(uri)  # created here, before the writers
    ctx = mp.get_context("spawn")  # no MLflow connection of this process shared with a writer
    start, ready, out = ctx.Event(), ctx.Queue(), ctx.Queue()
    args = [(uri, artifacts, i, seconds, start, ready, out) for i in range(writers)]
    procs = [ctx.Process(target=_writer, args=a) for a in args]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get()
    started = time.time()
    start.set()
    results = [out.get() for _ in procs]
    for p in procs:
        p.join()
    wall = time.time() - started
    runs = sum(r[0] for r in results)
    client = MlflowClient(uri)
    left = client.search_runs([client.get_experiment_by_name("bench").experiment_id], max_results=50000)
    return {
        "statuses": {s: sum(r.info.status == s for r in left) for s in sorted({r.info.status for r in left})},
        "writers": writers,
        "runs": runs,
        "runs_per_min": runs / wall * 60,
        "errors": sum(r[1] for r in results),
        "first_error": next((r[2] for r in results if r[2]), ""),
        "seconds": wall,
    }


def _fresh_postgres(base: str, name: str) -> str:
    import psycopg

    with psycopg.connect(f"{base}/postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    return f"{base}/{name}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--writers", default="1,2,4,8,16", help="the values of N, comma-separated")
    parser.add_argument("--seconds", type=float, default=30.0, help="how long each N's writers write")
    parser.add_argument("--postgres", help="a PostgreSQL server's base URL: measure there too")
    parser.add_argument("--json", help="write the measurements here")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="lab-contention-") as tmp:
        for n in [int(w) for w in args.writers.split(",")]:
            stores = {"sqlite": f"sqlite:///{tmp}/sqlite-{n}/mlflow.db"}
            if args.postgres:
                stores["postgresql"] = _fresh_postgres(args.postgres.rstrip("/"), f"lab_bench_contention_{n}")
            for kind, uri in stores.items():
                row = {"store": kind, **measure(uri, f"{tmp}/{kind}-{n}/artifacts", n, args.seconds)}
                rows.append(row)
                print(
                    f"{kind:10s} N={n:2d}: {row['runs_per_min']:7.1f} runs/min ({row['runs']} runs in "
                    f"{row['seconds']:.0f} s), {row['errors']} errors, runs left {row['statuses']}"
                    + (f": {row['first_error']}" if row["errors"] else ""),
                    flush=True,
                )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
