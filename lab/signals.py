"""The signals that end a `lab` process, all taken like Ctrl-C: SIGINT, SIGTERM (what a scheduler, `kill` and
`timeout` send, SIGKILL following after a grace period) and SIGUSR1 (what Slurm's `--signal=USR1@120` sends ahead
of a job's time limit). Each raises `Interrupted`, a KeyboardInterrupt that names its signal, so every handler of
Ctrl-C (the MLflow run ended KILLED, a sweep's trial re-enqueued, the workers told) handles them too; training
defers the first to the end of its step (lab/train/resume.py `StopRequest`). The command exits 128 + the signal's
number, as a shell reports a process that a signal ended."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


class Interrupted(KeyboardInterrupt):
    """A stop asked by `signum`."""

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def raise_interrupted(signum: int, frame: object) -> None:
    """The handler of every stopping signal outside training."""
    raise Interrupted(signum)


def install() -> None:
    """Take SIGTERM and SIGUSR1 as Ctrl-C in this process (its main thread), and SIGINT where Python's default
    handler has it."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in STOPPING:
        if signum != signal.SIGINT or signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signum, raise_interrupted)


@contextlib.contextmanager
def taken() -> Iterator[None]:
    """`install` for the block (a command run inside another program, a test, gets its handlers back)."""
    before = {signum: signal.getsignal(signum) for signum in STOPPING}
    install()
    try:
        yield
    finally:
        if threading.current_thread() is threading.main_thread():
            for signum, handler in before.items():
                signal.signal(signum, handler)


def installed() -> bool:
    """Whether this process takes the stopping signals as `install` sets them (a caller that set its own keeps
    them)."""
    return signal.getsignal(signal.SIGINT) in (raise_interrupted, signal.default_int_handler)


def signal_of(exc: BaseException) -> Interrupted:
    """The interrupt as an `Interrupted` (a plain KeyboardInterrupt is Ctrl-C's)."""
    return exc if isinstance(exc, Interrupted) else Interrupted(signal.SIGINT)
