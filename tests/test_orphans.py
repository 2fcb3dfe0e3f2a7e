"""No run stays RUNNING after its process is gone (lab/track/liveness.py): a `lab` process killed with SIGKILL
leaves its run RUNNING, which `lab doctor` lists, `lab doctor --fix` ends FAILED, and the next command that opens
the store closes by itself; a run written on another host is closed only once its heartbeat is older than the
grace period, and a live process's run never."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
from mlflow.tracking import MlflowClient

from lab import track
from lab.cli import main
from lab.track import liveness

OPEN_AND_HANG = textwrap.dedent(
    """
    import sys, time
    from lab import track
    with track.start_run(sys.argv[1], sys.argv[2], "orphans", "hung-seed0", {"arm": "hung"}) as run:
        print(run.id, flush=True)
        time.sleep(600)
    """
)


@pytest.fixture
def store(tmp_path):
    return f"sqlite:///{tmp_path / 'mlflow.db'}", str(tmp_path / "artifacts")


def _killed_run(uri: str, art: str) -> str:
    """A run opened by a process that is then killed with SIGKILL (it can end nothing); its id."""
    proc = subprocess.Popen([sys.executable, "-c", OPEN_AND_HANG, uri, art], stdout=subprocess.PIPE, text=True)
    run_id = proc.stdout.readline().strip()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert MlflowClient(uri).get_run(run_id).info.status == "RUNNING"
    return run_id


def _running(uri: str, art: str, worker: str, beat_age_s: float) -> str:
    """A RUNNING run tagged as written by `worker`, its heartbeat `beat_age_s` old."""
    track.configure(uri)
    client = MlflowClient()
    exp = track.ensure_experiment("orphans", art)
    tags = {liveness.WORKER: worker, liveness.HEARTBEAT: f"{time.time() - beat_age_s:.0f}"}
    return client.create_run(exp, tags=tags, run_name=f"by-{worker}").info.run_id


def test_a_killed_process_leaves_an_orphan_that_doctor_lists_and_fix_closes(store, capsys):
    uri, art = store
    run_id = _killed_run(uri, art)
    [orphan] = track.orphans(uri)
    assert orphan.run.info.run_id == run_id and orphan.why.endswith("is gone")
    assert main(["doctor", f"tracking.uri={uri}"]) == 0
    out = capsys.readouterr().out
    assert f"store: orphan run {run_id} (hung-seed0" in out and "`lab doctor --fix` ends them FAILED" in out
    assert MlflowClient(uri).get_run(run_id).info.status == "RUNNING"  # listing changes nothing
    assert main(["doctor", f"tracking.uri={uri}", "--fix"]) == 0
    run = MlflowClient(uri).get_run(run_id)
    assert run.info.status == "FAILED" and run.data.tags[liveness.ORPHANED].startswith("its process ")
    assert track.orphans(uri) == []


def test_the_next_command_that_opens_the_store_closes_an_orphan(store, capsys):
    uri, art = store
    run_id = _killed_run(uri, art)
    assert main(["studies", f"tracking.uri={uri}", "--no-headline"]) == 0
    assert f"ended FAILED run {run_id}" in capsys.readouterr().err
    assert MlflowClient(uri).get_run(run_id).info.status == "FAILED"


def test_across_hosts_only_a_stale_heartbeat_makes_an_orphan(store):
    uri, art = store
    here = socket.gethostname()
    live_here = _running(uri, art, f"{here}:{os.getpid()}", beat_age_s=10_000)  # this process: alive
    fresh_there = _running(uri, art, "other-host:1", beat_age_s=5)
    stale_there = _running(uri, art, "other-host:2", beat_age_s=liveness.GRACE_S + 60)
    found = {o.run.info.run_id: o.why for o in track.orphans(uri)}
    assert set(found) == {stale_there}, found
    assert "no heartbeat from other-host:2" in found[stale_there]
    # seen from the other host, this host's run is the foreign one: its heartbeat is old, so it is stale there
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(socket, "gethostname", lambda: "other-host")
        there = {o.run.info.run_id for o in track.orphans(uri)}
    assert live_here in there and fresh_there not in there  # other-host:1 is that host's pid 1: alive


def test_an_open_run_beats(store):
    uri, art = store
    opened = int(time.time())
    with track.start_run(uri, art, "orphans", "beating", {}) as run:
        tags = MlflowClient(uri).get_run(run.id).data.tags
        assert tags[liveness.WORKER] == liveness.worker_name()
        assert opened <= int(tags[liveness.HEARTBEAT]) <= time.time() + 1  # stamped (rounded) as the run opened
        assert track.orphans(uri) == []
    assert MlflowClient(uri).get_run(run.id).info.status == "FINISHED"
