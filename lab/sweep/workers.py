"""Worker subprocesses of `lab sweep --workers N`: each is `lab <worker_args> ...` (a `lab sweep worker`),
its output forwarded line by line with its number; Ctrl-C reaches them, and none outlives the launcher."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TextIO

import torch

from lab import signals
from lab.config import ConfigError


class WholeLines(io.TextIOBase):
    """The launcher's stdout while its worker subprocesses run: each thread's text goes out in whole lines, one
    write each. `print` writes a line and its newline apart, so a line forwarded from a worker could otherwise land
    between them and run two workers' lines together."""

    def __init__(self, out: TextIO):
        self.out = out
        self.lock = threading.Lock()
        self.pending: dict[int, str] = {}  # per thread, text after its last newline

    def write(self, text: str) -> int:
        me = threading.get_ident()
        with self.lock:
            whole, newline, rest = (self.pending.pop(me, "") + text).rpartition("\n")
            if newline:
                self.out.write(whole + newline)
                self.out.flush()
            if rest:
                self.pending[me] = rest
        return len(text)

    def flush(self) -> None:
        with self.lock:
            self.out.flush()

    def close_lines(self) -> None:
        """Ends what any thread left without a newline, each on a line of its own."""
        with self.lock:
            for rest in self.pending.values():
                self.out.write(rest + "\n")
            self.pending.clear()
            self.out.flush()


class _Reader(threading.Thread):
    """Forwards a worker subprocess's output line by line, prefixed with the worker's number."""

    def __init__(self, proc: subprocess.Popen, prefix: str, log: Callable[[str], None]):
        super().__init__(daemon=True)
        self.proc, self.prefix, self.log = proc, prefix, log

    def run(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log(self.prefix + line.rstrip())


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
    log: Callable[[str], None],
    gpu: str | None = None,
) -> tuple[subprocess.Popen, _Reader]:
    cmd = [sys.executable, "-m", "lab.cli", *worker_args, "--no-progress", *extra]
    if threads:
        cmd.append(f"threads={threads}")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "LAB_WORKER_INDEX": str(index)}
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    reader = _Reader(proc, f"[w{index}] ", log)
    reader.start()
    return proc, reader


@contextlib.contextmanager
def worker_subprocesses(
    worker_args: list[str],
    extra: list[str],
    threads: int | None,
    count: int,
    log: Callable[[str], None],
    gpus: list[str | None] | None = None,
) -> Iterator[None]:
    """`count` worker subprocesses (numbered 1..count; worker i on GPU `gpus[i]`, `gpu_placement`'s) for the
    duration of the block. An exception in the block (Ctrl-C) interrupts them: each re-enqueues its trial and
    exits. At the end each is waited for (a minute at most, then killed)."""
    lines = WholeLines(sys.stdout)
    gpus = gpus or [None] * (count + 1)
    procs = [_spawn(worker_args, extra, threads, i, log, gpus[i]) for i in range(1, count + 1)]
    try:
        with contextlib.redirect_stdout(lines) if count else contextlib.nullcontext():
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
        lines.close_lines()
