"""Under a scheduler: a study outlives its launcher and workers killed together (SIGTERM or SIGKILL to the whole
process group), the same command then finishing it with every arm and seed FINISHED once, no run left RUNNING and
the report whole; and the Slurm worker script (scripts/slurm/worker.sbatch, docs/distributed.md) run as Slurm runs
it: SIGUSR1 ahead of the time limit stops its worker after a step, which queues its trial again, and the script
requeues the job; SIGTERM to the job's processes (preemption) stops it the same way; the requeued job finishes the
study."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from helpers import hold_training, wait_held

from lab import track
from lab.sweep import storage

ROOT = Path(__file__).resolve().parent.parent
WORKER_SCRIPT = ROOT / "scripts" / "slurm" / "worker.sbatch"
ARMS = ["eagle3", "fc_norm", "norm_output", "eagle31"]


def _store(tmp_path: Path, micro_overrides: list[str]) -> list[str]:
    db = tmp_path / "store" / "mlflow.db"
    return [*micro_overrides, f"tracking.uri=sqlite:///{db}", f"tracking.artifact_root={tmp_path / 'store' / 'art'}"]


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_study_outlives_its_launcher_and_workers(signum, micro_overrides, micro_target, tmp_path):
    extra = [*_store(tmp_path, micro_overrides), "train.steps=12"]
    cmd = [sys.executable, "-m", "lab.cli", "ablate", "experiment=drift_2x2", "--seeds", "0", "--workers", "2",
           "--no-progress", *extra]  # fmt: skip
    log, held = tmp_path / "killed.log", tmp_path / "held"
    # each process's first training holds after step 3 (its run open, its resume state at step 0 not yet due)
    env = hold_training(dict(os.environ), 3, held)
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True, env=env,
                            cwd=tmp_path)  # fmt: skip
    try:
        wait_held(proc, held, log)
        os.killpg(proc.pid, signum)  # the launcher and its workers at once, as a scheduler ends a job
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    uri = _uri(extra)
    parent = track.all_study_parents(uri)[0]
    assert any(r.info.status in ("RUNNING", "KILLED") for r in track.child_runs(uri, parent.info.run_id))

    again = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=1200)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    runs = track.child_runs(uri, parent.info.run_id)
    finished = sorted(r.data.tags["arm"] for r in runs if r.info.status == "FINISHED")
    assert finished == sorted(ARMS)  # every arm and seed FINISHED, exactly once
    assert not [r for r in runs if r.info.status == "RUNNING"]
    stopped = [r for r in runs if r.info.status != "FINISHED"]
    assert stopped and all(r.info.status == ("KILLED" if signum == signal.SIGTERM else "FAILED") for r in stopped)
    table = (tmp_path / "reports" / "drift_2x2" / "tables" / "al.md").read_text()
    for label in ("EAGLE-3", "+ FC norm", "+ post-norm feedback", "EAGLE 3.1"):
        assert f"| {label} | 1 |" in table, table


def _uri(extra: list[str]) -> str:
    """The store the overrides name (the last tracking.uri wins, as in Hydra)."""
    return [o for o in extra if o.startswith("tracking.uri=")][-1].split("=", 1)[1]


def _sweep_spec(tmp_path: Path) -> Path:
    path = tmp_path / "slurm.yaml"
    path.write_text("space: {train.lr: [0.003, 0.005]}\nsampler: grid\nobjectives: [eval/in_dist/ref/k3/al]\n")
    return path


def _trials(extra: list[str]) -> list[optuna.trial.FrozenTrial]:
    """The trials of the one study in the store's journal."""
    db = _uri(extra).split("sqlite:///", 1)[1]
    journal = storage.open_storage(str(Path(db).parent / "optuna.journal"))
    (name,) = optuna.get_all_study_names(journal)
    return optuna.load_study(study_name=name, storage=journal).trials


@pytest.mark.slow
@pytest.mark.parametrize(
    ("signum", "group", "requeued_by_script"),
    [(signal.SIGUSR1, False, True), (signal.SIGTERM, True, False)],
    ids=["time-limit-USR1", "preemption-TERM"],
)
def test_the_slurm_worker_stops_requeues_and_its_next_start_finishes(
    signum, group, requeued_by_script, micro_overrides, micro_target, tmp_path
):
    spec = _sweep_spec(tmp_path)
    extra = [*_store(tmp_path, micro_overrides), "train.steps=30"]
    lab = [sys.executable, "-m", "lab.cli"]
    queued = subprocess.run([*lab, "sweep", f"sweep={spec}", "--workers", "0", *extra], capture_output=True, text=True)
    assert queued.returncode == 0, queued.stderr[-3000:]
    # Slurm's own commands, as the job sees them: `scontrol requeue` records its arguments
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol.log"}\n')
    (bin_dir / "scontrol").chmod(0o755)
    (bin_dir / "lab").write_text(f'#!/bin/sh\nexec {sys.executable} -m lab.cli "$@"\n')
    (bin_dir / "lab").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242"}
    job = ["bash", str(WORKER_SCRIPT), "sweep", "worker", f"sweep={spec}", "--no-progress", *extra]
    log, held = tmp_path / "job.log", tmp_path / "held"
    proc = subprocess.Popen(job, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                            env=hold_training(env, 5, held))  # fmt: skip
    try:
        wait_held(proc, held, log)
        if group:
            os.killpg(proc.pid, signum)  # preemption: every process of the job
        else:
            proc.send_signal(signum)  # --signal=B:USR1@120: the batch script alone, which passes it on
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert rc == 128 + signum, log.read_text()[-3000:]
    states = [t.state.name for t in _trials(extra)]
    assert states.count("FAIL") == 1 and states.count("WAITING") >= 1  # the stopped trial queued again at once
    said = (tmp_path / "scontrol.log").read_text().split() if (tmp_path / "scontrol.log").exists() else []
    assert said == (["requeue", "4242"] if requeued_by_script else [])

    # the requeued job: the same script, the same arguments
    again = subprocess.run(job, capture_output=True, text=True, env=env, timeout=1200)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    trials = _trials(extra)
    assert sorted(t.params["train.lr"] for t in trials if t.state.name == "COMPLETE") == [0.003, 0.005]
    uri = _uri(extra)
    parent = track.all_study_parents(uri)[0]
    assert parent.info.status == "FINISHED"  # the last worker ended the queued study's parent
    assert not [r for r in track.child_runs(uri, parent.info.run_id) if r.info.status == "RUNNING"]
