"""Whether a RUNNING run still has a process behind it. Every run that `start_run` opens says which process writes it
(the tag `lab.worker`, "host:pid") and stamps `lab.heartbeat` (seconds since the epoch) every `HEARTBEAT_S` while
it is open. A run whose process is gone is an orphan: on the same host its process no longer exists; elsewhere
its heartbeat is older than `GRACE_S` (the sweep engine's rule for its trials). A process killed by SIGKILL, the
OOM killer or a lost node can end nothing, so the next `lab` command that opens the store ends its orphans FAILED,
tagged `lab.orphaned` with why; `lab doctor` lists them, `lab doctor --fix` closes them."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from mlflow.tracking import MlflowClient

from lab.track.queries import every_experiment, every_run
from lab.track.store import configure, local_paths

HEARTBEAT_S = 20.0  # as the sweep's trials beat
GRACE_S = 120.0  # a run on another host without a heartbeat this long is an orphan
WORKER, HEARTBEAT, ORPHANED = "lab.worker", "lab.heartbeat", "lab.orphaned"


def worker_name() -> str:
    """This process as a run's `lab.worker`: "host:pid"."""
    return f"{socket.gethostname()}:{os.getpid()}"


def process_gone(worker: str) -> bool:
    """True if `worker` ("host:pid") ran on this host and its process no longer exists."""
    host, _, pid = worker.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        pass
    return False


@contextlib.contextmanager
def beating(run_id: str, every: float = HEARTBEAT_S) -> Iterator[None]:
    """Stamp the run's heartbeat now and every `every` seconds (a thread) until the block ends."""
    client = MlflowClient()
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(every):
            with contextlib.suppress(Exception):  # a missed beat is harmless; the next one follows
                client.set_tag(run_id, HEARTBEAT, f"{time.time():.0f}")

    client.set_tag(run_id, HEARTBEAT, f"{time.time():.0f}")
    thread = threading.Thread(target=beat, name="lab-run-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


@dataclass
class Orphan:
    run: Any
    why: str

    def said(self) -> str:
        info, tags = self.run.info, self.run.data.tags
        return (
            f"run {info.run_id} ({info.run_name or tags.get('arm', '?')}, experiment {info.experiment_id}): {self.why}"
        )


def orphan_reason(run: Any, now: float, grace_s: float = GRACE_S) -> str | None:
    """Why the RUNNING `run` has no process behind it, or None while it may still have one."""
    worker = run.data.tags.get(WORKER, "")
    if not worker:
        return None  # written by a process that does not beat (an older version, or another tool)
    if process_gone(worker):
        return f"its process {worker} is gone"
    beat = run.data.tags.get(HEARTBEAT, "")
    if beat.isdigit() and now - int(beat) > grace_s and worker.rpartition(":")[0] != socket.gethostname():
        return f"no heartbeat from {worker} for {now - int(beat):.0f} s (more than {grace_s:.0f} s)"
    return None


def orphans(uri: str, grace_s: float = GRACE_S) -> list[Orphan]:
    """The store's RUNNING runs whose process is gone (a study's parent excepted: it waits RUNNING for workers
    that another launcher queued for)."""
    db = local_paths(uri)
    if db is not None and (not db.is_file() or db.stat().st_size == 0):
        return []  # nothing recorded; reading must not create a store (nor fill an empty file with one)
    configure(uri)
    client = MlflowClient()
    ids = [e.experiment_id for e in every_experiment(client)]
    running = every_run(client, ids, f"attributes.status = 'RUNNING' and tags.`{WORKER}` LIKE '%:%'")
    now = time.time()
    found = [Orphan(r, why) for r in running if r.data.tags.get("lab.role") != "parent"
             if (why := orphan_reason(r, now, grace_s))]  # fmt: skip
    return found


def close(uri: str, found: list[Orphan]) -> None:
    """End each orphan FAILED, tagged `lab.orphaned` with why (a run ended since it was found is left alone)."""
    if not found:
        return
    configure(uri)
    client = MlflowClient()
    for o in found:
        if client.get_run(o.run.info.run_id).info.status != "RUNNING":
            continue
        client.set_tag(o.run.info.run_id, ORPHANED, o.why)
        client.set_terminated(o.run.info.run_id, "FAILED")
