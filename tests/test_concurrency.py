"""Many `lab` processes at once on one MLflow store and one cache (docs/running.md, "Many processes, one
store"): started together on a fresh store, then on the existing one, with the verbs mixed, every process
exits 0, the store holds exactly the runs expected, each FINISHED with its metrics, and `lab report` over
them equals the report of the same runs made one at a time. Nothing here waits on the clock: the processes
race as the operating system schedules them, and the checks hold whatever the order."""

from __future__ import annotations

import fcntl
import filecmp
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from helpers import default_sigint, logged
from mlflow.tracking import MlflowClient

EXPERIMENT = ["experiment=drift_2x2", "--seeds", "0", "--no-progress"]  # 4 arms x 1 seed
ARMS = {"eagle3", "fc_norm", "norm_output", "eagle31"}
AL = "eval/in_dist/ref/k3/al"
TINY = ["profile=micro", "threads=1", "train.reuse=false", "train.steps=6", "eval.num_prompts=2"]


def _store(root: Path, cache: Path, uri: str | None = None) -> list[str]:
    """Overrides of one store under `root` (a SQLite store unless `uri`) and the cache `cache`."""
    return [
        *TINY,
        f"cache_dir={cache}",
        f"tracking.uri={uri or _sqlite(root)}",
        f"tracking.artifact_root={root / 'artifacts'}",
        f"tracking.optuna_storage={root / 'optuna.journal'}",
    ]


def _sqlite(root: Path) -> str:
    return f"sqlite:///{root / 'mlflow.db'}"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Procs:
    """`lab` subprocesses started together, each logging into its own file under `folder`."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.started: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, *args: str) -> subprocess.Popen:
        log = open(self.folder / f"{name}.log", "w")
        cmd = [sys.executable, "-m", "lab.cli", *args]
        # Ctrl-C stops a server: its default disposition, even where the suite runs with SIGINT ignored
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=self.folder, preexec_fn=default_sigint)
        self.started.append((name, proc))
        return proc

    def log(self, name: str) -> str:
        return (self.folder / f"{name}.log").read_text()

    def wait_all(self, servers: dict[str, str]) -> None:
        """Every server answers at its URL (then is stopped) and every other process exits 0."""
        try:
            for name, url in servers.items():
                _answers(url, dict(self.started)[name], lambda n=name: self.log(n))
            for name, proc in self.started:
                if name in servers:
                    proc.send_signal(signal.SIGINT)
                    proc.wait(timeout=60)
                else:
                    assert proc.wait(timeout=900) == 0, f"{name} failed:\n{self.log(name)[-3000:]}"
        finally:
            for _, proc in self.started:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()


def _answers(url: str, proc: subprocess.Popen, log) -> None:
    """Polls `url` until the server behind it answers; fails if its process ends first."""
    deadline = time.time() + 300
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except urllib.error.HTTPError as exc:
            if exc.code < 500:
                return
        except OSError:
            pass
        assert proc.poll() is None and time.time() < deadline, log()[-3000:]
        time.sleep(0.5)


def _runs(uri: str) -> list:
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    client = MlflowClient(uri)
    ids = [e.experiment_id for e in client.search_experiments()]
    return client.search_runs(ids, max_results=1000)


def _check_store(uri: str, plain_seeds: set[int]) -> str:
    """The store holds one study (one parent, one FINISHED child per arm with its metrics) and one plain
    run per seed in `plain_seeds`, nothing else, nothing left RUNNING; returns the parent's id."""
    runs = _runs(uri)
    assert all(r.info.status == "FINISHED" for r in runs), [(r.info.run_name, r.info.status) for r in runs]
    parents = [r for r in runs if r.data.tags.get("lab.role") == "parent"]
    assert len(parents) == 1, [p.info.run_id for p in parents]  # never a second parent of the same study
    parent = parents[0].info.run_id
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent]
    assert sorted(r.data.tags["arm"] for r in children) == sorted(ARMS)  # each arm once: none lost or doubled
    plain = [r for r in runs if r not in parents and r not in children]
    assert sorted(int(r.data.tags["seed"]) for r in plain) == sorted(plain_seeds)
    assert all(AL in r.data.metrics for r in children + plain)
    return parent


def _tables(folder: Path) -> list[str]:
    names = sorted(p.name for p in (folder / "tables").iterdir())
    assert any(n.endswith(".csv") for n in names)
    return names


def _same_report(report: Path, reference: Path) -> None:
    names = _tables(reference)
    assert _tables(report) == names
    _, mismatch, errors = filecmp.cmpfiles(report / "tables", reference / "tables", names, shallow=False)
    assert not mismatch and not errors, mismatch + errors


# ------------------------------------------------------------------------------------- the store's locks


def _open_store(uri: str) -> subprocess.Popen:
    code = "import sys; from lab import track; track.configure(sys.argv[1]); print('open')"
    return subprocess.Popen(
        [sys.executable, "-c", code, uri], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_a_store_being_created_is_waited_for_and_a_current_one_opens_without_the_lock(tmp_path):
    uri = _sqlite(tmp_path)
    with open(tmp_path / "mlflow.db.lab-schema.lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as another process holds it while it creates the store
        proc = _open_store(uri)
        said = logged(proc.stderr.readline())[0]  # it says why it waits, then waits
        assert said.startswith("waiting: another lab process is creating or upgrading the MLflow store"), said
        assert proc.poll() is None and not (tmp_path / "mlflow.db").exists()
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and out == "open\n", err[-2000:]
    with open(tmp_path / "mlflow.db.lab-schema.lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # a store that exists and is current never waits for the lock
        again = _open_store(uri)
        out, err = again.communicate(timeout=300)
    assert again.returncode == 0 and out == "open\n" and "waiting" not in err, err[-2000:]


@pytest.mark.slow
def test_a_rekey_is_refused_beside_a_writer_and_a_writer_beside_a_rekey(tmp_path):
    from lab import track
    from lab.track.writers import _writing

    uri, artifacts = _sqlite(tmp_path), str(tmp_path / "artifacts")
    store = [f"tracking.uri={uri}", f"tracking.artifact_root={artifacts}"]
    with track.start_run(uri, artifacts, "s", "old", {"config_hash": "0123456789ab"}):
        pass  # keyed by the first scheme: `lab doctor --rekey` has work to do
    lab = [sys.executable, "-m", "lab.cli"]
    with track.start_run(uri, artifacts, "s", "open", {}):  # a run of this process is open
        said = subprocess.run([*lab, "doctor", "--rekey", *store], capture_output=True, text=True, cwd=tmp_path)
    assert said.returncode == 2 and said.stderr.count("\n") == 1, said.stderr
    assert said.stderr.startswith("error: --rekey: refused while `") and f"(pid {os.getpid()}) writes" in said.stderr
    with _writing(uri, exclusive=True):  # as `lab doctor --rekey` holds the store
        said = subprocess.run([*lab, "run", *TINY, f"cache_dir={tmp_path / 'cache'}", *store], capture_output=True,
                              text=True, cwd=tmp_path)  # fmt: skip
    assert said.returncode == 2 and said.stderr.count("\n") == 1, said.stderr
    assert said.stderr.startswith("error: tracking.uri: refused while `") and "re-keys this store" in said.stderr
    assert not (tmp_path / "cache").exists()  # refused before any work


# ----------------------------------------------------------------------------------- the stress test


@pytest.fixture(scope="module")
def cache(micro_overrides, micro_target) -> Path:
    """The session's cache, its micro target built (the stores of this module share it)."""
    return Path(next(o for o in micro_overrides if o.startswith("cache_dir=")).split("=", 1)[1])


def _lab(*args: str) -> None:
    """A `lab` command in this process (a reader: nothing here races it)."""
    from lab.cli import main

    assert main(list(args)) == 0


@pytest.fixture(scope="module")
def one_at_a_time(tmp_path_factory, cache) -> Path:
    """The reference: the same study's runs made one at a time (one worker), its report and its archive."""
    root = tmp_path_factory.mktemp("concurrency") / "sequential"
    root.mkdir()
    procs = Procs(root)
    store = _store(root, cache)
    procs.start("ablate", "ablate", *EXPERIMENT, *store)
    procs.wait_all({})
    _lab("report", *EXPERIMENT[:3], "--out", str(root / "report"), *store)
    _lab("study", "export", *EXPERIMENT[:3], "--out", str(root / "study.tar.gz"), *store)
    return root


@pytest.mark.slow
def test_mixed_verbs_at_once_on_a_fresh_then_an_existing_sqlite_store(one_at_a_time, cache, micro_target):
    root = one_at_a_time.parent / "sqlite"
    root.mkdir()
    # a cache of its own, the target copied in (building it takes longer than all the rest): the hidden states
    # and the held-out states are built by whichever process comes first while the others wait and load them
    built = micro_target.path.parent
    shutil.copytree(built, root / "cache" / "targets" / built.name)
    store, uri = _store(root, root / "cache"), _sqlite(root)

    # a fresh store and a fresh cache: two runs, the same ablation launched twice (once with a worker
    # subprocess of its own) and the MLflow UI, all at once
    first = Procs(root)
    first.start("run1", "run", "seed=1", *store)
    first.start("run2", "run", "seed=2", *store)
    first.start("ablate1", "ablate", *EXPERIMENT, *store)
    first.start("ablate2", "ablate", *EXPERIMENT, "--workers", "2", *store)
    ui = _free_port()
    first.start("ui", "ui", "--port", str(ui), *store)
    first.wait_all({"ui": f"http://127.0.0.1:{ui}/health"})
    parent = _check_store(uri, {1, 2})
    run1 = first.log("run1").strip().splitlines()[-1]

    # the existing store: a run, the ablation again (nothing left to run), its report, the paper, the study's
    # archive, a drafter's export and the Optuna dashboard, all at once; beside them two imports of the
    # reference study into a fresh store
    other = root.parent / "imported"
    other.mkdir()
    second = Procs(root)
    second.start("run3", "run", "seed=3", *store)
    second.start("ablate3", "ablate", *EXPERIMENT, *store)
    second.start("report", "report", *EXPERIMENT[:3], "--run", parent, "--out", str(root / "report"), *store)
    second.start("paper", "paper", "--out", str(root / "paper.md"), *store)
    second.start("study_export", "study", "export", *EXPERIMENT[:3], "--out", str(root / "study.tar.gz"), *store)
    second.start("export", "export", run1, "--out", str(root / "export"), "--format", "native", *store)
    board = _free_port()
    second.start("dashboard", "dashboard", *EXPERIMENT[:3], "--port", str(board), *store)
    second.start("import1", "study", "import", str(one_at_a_time / "study.tar.gz"), *_store(other, cache))
    second.start("import2", "study", "import", str(one_at_a_time / "study.tar.gz"), *_store(other, cache))
    second.wait_all({"dashboard": f"http://127.0.0.1:{board}/"})

    assert _check_store(uri, {1, 2, 3}) == parent
    _check_store(_sqlite(other), set())
    _same_report(root / "report", one_at_a_time / "report")
    assert (root / "export" / "model.safetensors").is_file() and (root / "paper.md").is_file()


@pytest.mark.slow
def test_mixed_verbs_at_once_on_a_fresh_postgres_store(one_at_a_time, cache, fresh_database):
    root = one_at_a_time.parent / "postgres"
    root.mkdir()
    uri = fresh_database("lab_test_concurrency")
    store = _store(root, cache, uri)
    # a fresh database: a run, the same ablation launched twice and `lab server` over it, all at once
    procs = Procs(root)
    procs.start("run1", "run", "seed=1", *store)
    procs.start("ablate1", "ablate", *EXPERIMENT, *store)
    procs.start("ablate2", "ablate", *EXPERIMENT, *store)
    port = _free_port()
    procs.start("server", "server", "--port", str(port), *store)  # two server processes open the store
    procs.wait_all({"server": f"http://127.0.0.1:{port}/health"})
    parent = _check_store(uri, {1})
    _lab("report", *EXPERIMENT[:3], "--run", parent, "--out", str(root / "report"), *store)
    _same_report(root / "report", one_at_a_time / "report")
