"""The workbench's log: the records of the `lab` loggers (`logging.getLogger(__name__)` in every module), each
line opened by the time and the level, on stderr; a command's output (tables, run ids, paths) is the CLI's
`print` to stdout, so that it can be piped while the log scrolls.

`setup` gives the `lab` logger one handler and its level (-q: warnings, -v: debug). The root logger is left
alone, so other libraries (MLflow, Optuna, vLLM) keep their own settings, and the handler writes to whatever
`sys.stderr` is at each record (a test's capture, a redirected stream). A worker of a study names itself on
each of its lines: the launcher forwards its workers' lines to its own stderr (`forward`, lab/sweep/workers.py),
and a reader of the night's log can tell whose each one is. Each record is one write under the handler's
lock, a forwarded line too, so the lines of several threads and workers stay whole.
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass

LOGGER = "lab"
TIME = "%Y-%m-%d %H:%M:%S"
LEVELS = {-1: logging.WARNING, 0: logging.INFO, 1: logging.DEBUG}
FLAGS = {-1: ["-q"], 0: [], 1: ["-v"]}  # the verbosity as `lab` options, for the processes a command starts
# the opening of a record's line, as `_Lines` writes it: `2026-12-02 02:41:07 INFO    ...`
RECORD = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d [A-Z]+ +")


@dataclass
class _Said:
    """What `setup` was given; `as_worker` changes the worker for a block."""

    verbosity: int = 0
    worker: str | None = None


_said = _Said()


class _Lines(logging.Formatter):
    """`TIME LEVEL [worker NAME] LOGGER: message`, that opening on every line of a record of several lines (a
    traceback's too), so that each line of the log says when and how serious. A line `forward` makes for a
    worker names it (the record's `worker`), any other the process's own worker, if it has a name."""

    def format(self, record: logging.LogRecord) -> str:
        worker = getattr(record, "worker", None) or _said.worker
        tag = f"[worker {worker}] " if worker is not None else ""
        opening = f"{self.formatTime(record, TIME)} {record.levelname:<7} {tag}{record.name}: "
        return "\n".join(opening + line for line in super().format(record).splitlines() or [""])


def _beside_bars() -> contextlib.AbstractContextManager:
    """Room for a line on stderr: the progress bars there are cleared and drawn again below it (tqdm's
    `external_write_mode`) where there are bars, so that no line lands in the middle of one."""
    tqdm = sys.modules.get("tqdm")
    if tqdm is None or not getattr(tqdm.tqdm, "_instances", None):
        return contextlib.nullcontext()
    return tqdm.tqdm.external_write_mode(file=sys.stderr)


class _Stderr(logging.StreamHandler):
    """A StreamHandler on the `sys.stderr` of the moment, not the one there was at `setup`."""

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass

    def emit(self, record: logging.LogRecord) -> None:
        with _beside_bars():
            super().emit(record)


def setup(verbosity: int = 0, worker: str | None = None) -> None:
    """The `lab` logger's one handler (stderr) and level: INFO, WARNING at `verbosity` -1 (-q), DEBUG at 1
    (-v); `worker`: the name each line carries (`[worker NAME]`). Called again, it replaces what it set."""
    verbosity = max(-1, min(1, verbosity))
    _said.verbosity, _said.worker = verbosity, worker
    logger = logging.getLogger(LOGGER)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    handler = _Stderr()
    handler.setFormatter(_Lines())
    logger.addHandler(handler)
    logger.setLevel(LEVELS[verbosity])
    logger.propagate = False  # its lines once, whatever a library does to the root logger


def flags() -> list[str]:
    """The verbosity `setup` was given, as the options of a `lab` command (a worker subprocess's)."""
    return list(FLAGS[_said.verbosity])


@contextlib.contextmanager
def as_worker(name: str | None) -> Iterator[None]:
    """This process's lines carry `[worker NAME]` during the block (a launcher that works beside its workers)."""
    before, _said.worker = _said.worker, name
    try:
        yield
    finally:
        _said.worker = before


def forward(line: str, worker: str, name: str) -> None:
    """A line of a worker subprocess (its stdout and stderr) on this process's stderr: one of its records as it
    is (it names the worker); any other line (its command's output, a traceback) as a record of logger `name`
    that names the worker, whatever this process's level, since the worker runs at this process's verbosity and
    says only what it was asked to."""
    if not RECORD.match(line):
        record = logging.LogRecord(name, logging.INFO, "", 0, line.rstrip("\n"), None, None)
        record.worker = worker
        line = _Lines().format(record)
    _write(line)


def _write(line: str) -> None:
    """A line already formatted on stderr as it is, in one write under the lock the records are written under,
    so that it never lands inside one of them."""
    handlers = logging.getLogger(LOGGER).handlers
    lock = handlers[0].lock if handlers and handlers[0].lock is not None else None
    with lock if lock is not None else contextlib.nullcontext(), _beside_bars():
        sys.stderr.write(line.rstrip("\n") + "\n")
        sys.stderr.flush()
