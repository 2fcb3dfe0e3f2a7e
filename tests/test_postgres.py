"""A study across independently started workers on a real PostgreSQL server (scripts/postgres.sh):
Optuna's RDB storage in one database, an `mlflow server` (`lab server`) over a second one, artifacts in
a local folder; one worker is SIGKILLed in the middle of a trial."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import optuna
import pytest
from helpers import hold_training, wait_held
from mlflow.tracking import MlflowClient

from lab.sweep import search_space

pytestmark = pytest.mark.slow

SPEC = """description: three learning rates x two seeds, run by independent workers
space: {train.lr: [0.003, 0.005, 0.008]}
sampler: grid
objectives: [eval/in_dist/ref/k3/al]
seeds: [0, 1]
heartbeat_s: 1
grace_s: 30
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture()
def mlflow_server(fresh_database, tmp_path):
    """`lab server` over a fresh PostgreSQL database, artifacts in tmp_path/artifacts; its http URI."""
    port = _free_port()
    log = open(tmp_path / "server.log", "w")
    store = fresh_database("lab_test_mlflow")
    cmd = [sys.executable, "-m", "lab.cli", "server", "--port", str(port), f"tracking.uri={store}"]
    proc = subprocess.Popen(
        [*cmd, f"tracking.artifact_root={tmp_path / 'artifacts'}"], stdout=log, stderr=subprocess.STDOUT
    )
    uri = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180  # the first start creates MLflow's tables
    while True:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2) as answer:
                if answer.status == 200:
                    break
        except OSError:
            pass
        assert proc.poll() is None and time.time() < deadline, (tmp_path / "server.log").read_text()[-3000:]
        time.sleep(1)
    yield uri
    proc.terminate()
    proc.wait(timeout=30)


def _lab(*args: str) -> list[str]:
    return [sys.executable, "-m", "lab.cli", *args]


def test_three_workers_on_postgres_survive_a_killed_worker(
    tmp_path, micro_overrides, micro_target, fresh_database, mlflow_server
):
    # micro_target: the session's target built under the stated threads, not by a worker of one thread
    (tmp_path / "spec.yaml").write_text(SPEC)
    storage = fresh_database("lab_test_optuna")
    extra = [
        *[o for o in micro_overrides if not o.startswith(("tracking.", "threads="))],
        "train.steps=6",
        "eval.num_prompts=2",
        f"tracking.uri={mlflow_server}",
        f"tracking.optuna_storage={storage}",
        "threads=1",
    ]
    queued = subprocess.run(
        _lab("sweep", f"sweep={tmp_path / 'spec.yaml'}", "--workers", "0", *extra), capture_output=True, text=True
    )
    assert queued.returncode == 0, queued.stderr[-3000:]
    assert "6 to run (6 newly queued)" in queued.stderr and ":lab@" not in queued.stderr  # no password in logs

    worker = _lab("sweep", "worker", f"sweep={tmp_path / 'spec.yaml'}", "--no-progress", *extra)
    logs = [open(tmp_path / f"worker{i}.log", "w") for i in range(3)]
    # the first worker's first training waits after its first step (its trial's MLflow run open) until killed,
    # however fast the machine trains (tests/hold/sitecustomize.py); the other two train straight through
    held = tmp_path / "held"
    envs = [hold_training(dict(os.environ), 1, held), os.environ, os.environ]
    procs = [
        subprocess.Popen(worker, stdout=log, stderr=subprocess.STDOUT, env=env)
        for log, env in zip(logs, envs, strict=True)
    ]
    sweep = search_space.load(str(tmp_path / "spec.yaml"))
    name = sweep.study_name(extra)
    victim = procs[0]

    def trials() -> list[optuna.trial.FrozenTrial]:
        return optuna.load_study(study_name=name, storage=storage).trials

    try:
        wait_held(victim, held, tmp_path / "worker0.log", timeout=300)
        (killed,) = [
            t
            for t in trials()
            if t.state.name == "RUNNING" and t.user_attrs.get("worker", "").endswith(f":{victim.pid}")
        ]
        assert "mlflow_run_id" in killed.user_attrs
        victim.send_signal(signal.SIGKILL)
        for proc in procs[1:]:
            assert proc.wait(timeout=900) == 0, [(tmp_path / f"worker{i}.log").read_text()[-3000:] for i in (1, 2)]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()

    # Optuna: the budget exactly, every slot once, the killed trial failed and retried with its params
    final = trials()
    complete = [t for t in final if t.state.name == "COMPLETE"]
    assert len(complete) == 6 and [t.state.name for t in final].count("FAIL") == 1 and len(final) == 7
    assert sorted((t.user_attrs["point"], t.user_attrs["seed"]) for t in complete) == [
        (p, s) for p in range(3) for s in (0, 1)
    ]
    retry = next(t for t in final if t.system_attrs.get("failed_trial") == killed.number)
    assert retry.state.name == "COMPLETE" and retry.params == killed.params
    assert f":{victim.pid}" in next(t for t in final if t.number == killed.number).user_attrs["error"]
    assert len({t.user_attrs["worker"] for t in final}) == 3  # all three workers ran trials

    # MLflow (through the server, on PostgreSQL): one parent, exactly one child run per trial
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    client = MlflowClient(mlflow_server)
    exp = client.get_experiment_by_name(sweep.experiment)
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if r.data.tags.get("lab.role") == "parent"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"  # the last worker ended it
    children = {r.info.run_id: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id}
    assert len(children) == len(runs) - 1 == 7
    assert sorted(t.user_attrs["mlflow_run_id"] for t in final) == sorted(children)
    assert children[killed.user_attrs["mlflow_run_id"]].info.status == "FAILED"  # never left RUNNING
    for t in complete:  # no finished trial's result lost
        run = children[t.user_attrs["mlflow_run_id"]]
        assert run.info.status == "FINISHED" and run.data.metrics["eval/in_dist/ref/k3/al"] == pytest.approx(t.value)
    summary = client.download_artifacts(parents[0].info.run_id, "sweep/summary.md", str(tmp_path))
    assert "6 complete, 0 pruned, 0 failed" in Path(summary).read_text()
    # artifacts went through the server into its folder, not into a path the workers named
    for t in complete:
        assert len(list((tmp_path / "artifacts").glob(f"*/{t.user_attrs['mlflow_run_id']}/artifacts/config.yaml"))) == 1
