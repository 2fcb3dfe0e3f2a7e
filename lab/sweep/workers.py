"""Worker subprocesses of `lab sweep --workers N`: each is `lab <worker_args> ...` (a `lab sweep worker`), its
log lines (which carry its number) forwarded line by line to the launcher's stderr; Ctrl-C reaches them, and none
outlives the launcher. Each line goes out in one write under the lock the launcher's own records are written
under (lab/logs.py), so no two lines run together."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

import torch

from lab import logs, signals
from lab.config import ConfigError

logger = logging.getLogger(__name__)


class _Reader(threading.Thread):
    """Forwards a worker subprocess's output (its stdout and stderr) to this process's stderr line by line: its
    log records as they are (they name the worker), any other line (its command's output, a traceback) as a
    record of this process that names the worker."""

    def __init__(self, proc: subprocess.Popen, worker: str):
        super().__init__(daemon=True)
        self.proc, self.worker = proc, worker

    def run(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            logs.forward(line, self.worker, logger.name)


def gpu_placement(count: int, gpus: list[int] | None, device_count: int, visible: str | None) -> list[str | None]:
    """The CUDA_VISIBLE_DEVICES of workers 0..count-1 (None: left as it is): worker i on GPU i mod
    `device_count`, or on gpus[i mod len(gpus)] where `gpus=` names them. Indexes count the GPUs this process
    sees, so within a CUDA_VISIBLE_DEVICES already set (`visible`) they name its entries. One GPU or none
    (and no `gpus=`): nothing to place."""
    if not gpus:
        if device_count <= 1:
            return [None] * count
        gpus = list(range(device_count))
    wrong = [g for g in gpus if not 0 <= g < device_count]
    if wrong:
        sees = f"{device_count} GPU(s), indexes 0 to {device_count - 1}" if device_count else "no GPU"
        raise ConfigError("gpus", f"expected indexes of the GPUs torch sees ({sees}), got {wrong}")
    names = [v.strip() for v in visible.split(",")] if visible else [str(i) for i in range(device_count)]
    return [names[gpus[i % len(gpus)]] for i in range(count)]


def place_this_process(gpus: list[int] | None, device_count: int) -> None:
    """Worker 0 is this process, whose CUDA is set up already: its GPU is chosen with `set_device`."""
    if device_count > 1 or gpus:
        torch.cuda.set_device((gpus or [0])[0])


def _spawn(
    worker_args: list[str],
    extra: list[str],
    threads: int | None,
    index: int,
    gpu: str | None = None,
) -> tuple[subprocess.Popen, _Reader]:
    cmd = [sys.executable, "-m", "lab.cli", *worker_args, "--no-progress", *logs.flags(), *extra]
    if threads:
        cmd.append(f"threads={threads}")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "LAB_WORKER_INDEX": str(index)}
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    reader = _Reader(proc, str(index))
    reader.start()
    return proc, reader


@contextlib.contextmanager
def worker_subprocesses(
    worker_args: list[str],
    extra: list[str],
    threads: int | None,
    count: int,
    gpus: list[str | None] | None = None,
) -> Iterator[None]:
    """`count` worker subprocesses (numbered 1..count; worker i on GPU `gpus[i]`, `gpu_placement`'s) for the
    duration of the block. An exception in the block (Ctrl-C) interrupts them: each re-enqueues its trial and
    exits. At the end each is waited for (a minute at most, then killed)."""
    gpus = gpus or [None] * (count + 1)
    procs = [_spawn(worker_args, extra, threads, i, gpus[i]) for i in range(1, count + 1)]
    try:
        yield
    except BaseException as exc:
        # the signal the launcher got (Ctrl-C's for any other exception): each worker re-enqueues its trial and exits
        signum = signals.signal_of(exc).signum if isinstance(exc, KeyboardInterrupt) else signal.SIGINT
        for proc, _ in procs:
            if proc.poll() is None:
                proc.send_signal(signum)
        raise
    finally:
        for proc, reader in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=60)
            if proc.poll() is None:
                proc.kill()
            reader.join(timeout=5)
