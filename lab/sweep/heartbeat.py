"""Heartbeats and stale trials: a running trial's worker stamps `heartbeat` every `heartbeat_s`; a RUNNING
trial whose worker is gone (same host: its process no longer exists; elsewhere: no heartbeat change for
`grace_s`) is failed, its MLflow run ended FAILED, and it is re-enqueued with the same params. The rule is the
one that finds any run left RUNNING (lab/track/liveness.py), whose names it uses."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

from optuna.trial import TrialState

from lab import track
from lab.sweep import optuna_adapter as adapter
from lab.sweep.queue import retry
from lab.sweep.storage import Session

__all__ = ["beating", "process_gone", "recover_stale", "worker_name"]
from lab.track.liveness import process_gone, worker_name

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def beating(s: Session, trial: adapter.AnyTrial) -> Iterator[None]:
    """Stamp the trial's `heartbeat` now and every `heartbeat_s` (a thread) until the block ends."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(s.sweep.heartbeat_s):
            with contextlib.suppress(Exception):  # a missed beat is harmless; the next one follows
                adapter.set_user_attr(s.storage, trial, "heartbeat", time.time())

    adapter.set_user_attr(s.storage, trial, "heartbeat", time.time())
    thread = threading.Thread(target=beat, name="lab-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def recover_stale(s: Session, observed: dict[int, tuple[Any, float]]) -> None:
    """Fail and retry RUNNING trials whose worker is gone; `observed` remembers when each heartbeat last changed."""
    now = time.time()
    for ft in s.trials((TrialState.RUNNING,)):
        beat, worker = ft.user_attrs.get("heartbeat"), str(ft.user_attrs.get("worker", ""))
        if observed.get(ft.number, (None, 0.0))[0] != beat or ft.number not in observed:
            observed[ft.number] = (beat, now)
        if not process_gone(worker) and now - observed[ft.number][1] < s.sweep.grace_s:
            continue
        with s.lock():
            if not adapter.fail_if_running(s.storage, ft, f"worker {worker or '?'} stopped (no heartbeat)"):
                continue
        run_id = ft.user_attrs.get("mlflow_run_id")
        if run_id:
            track.end_run(s.uri, run_id, "FAILED", {"trial_state": "FAIL"})
        again = retry(s, ft, s.sweep.max_retry)
        logger.warning(
            f"trial {ft.number}: worker {worker or '?'} stopped; " + ("retrying it" if again else "retries used up")
        )
