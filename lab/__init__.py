"""EAGLE-3 / EAGLE 3.1 ablation workbench.

Stages, in the one direction data flows: target -> data (corpus, suites, hidden-state cache) ->
drafter -> train -> eval -> track (MLflow) -> report. `lab.config` is shared by all.
"""

import atexit
import contextlib
import importlib.abc
import importlib.machinery
import os
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import NoReturn

__version__ = "0.1.0"

# MLflow's usage telemetry stays off in every lab process and the UI servers they start, unless the user turns
# it on with MLflow's own switch (MLFLOW_DISABLE_TELEMETRY=false; docs/tracking.md). Set before any module of
# lab imports mlflow, which decides at import.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")


class AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the module `name` as the path finder does and, once it has run, calls `then(module)`: a change to
    a module made as it loads, before anything imports names from it. Put first in
    sys.meta_path by `after_import`."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]):
        self.name, self.then = name, then

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            self.loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        self.then(module)


def after_import(name: str, then: Callable[[ModuleType], None]) -> None:
    """`then(module)` once the module `name` has loaded in this process (not at all if it already has)."""
    if name not in sys.modules:
        sys.meta_path.insert(0, AfterImport(name, then))


def _without_sklearn(table: ModuleType) -> None:
    """transformers imports scikit-learn's metrics as it loads its generation utilities whenever scikit-learn is
    installed (mlflow brings it), for assisted generation's confidence threshold, which the workbench never uses:
    a sixth of transformers' import time (docs/benchmarks.md#install-and-start-up), in every lab process that
    loads a model or a tokenizer and every vLLM worker. Its table of optional packages answers that
    scikit-learn is absent; a transformers without that table is left alone."""
    if callable(getattr(table, "is_sklearn_available", None)):
        table.is_sklearn_available = lambda: False


after_import("transformers.utils.import_utils", _without_sklearn)


def exit_now(code: int, handlers: bool = True) -> NoReturn:
    """End a process whose work is done as Python would, less its teardown of every loaded module: the other
    non-daemon threads are told to stop and joined (threading's own shutdown, which thread pools hook), the exit
    handlers run (MLflow ends an open run, logging flushes, temporary folders go), stdout and stderr are
    flushed, and the process exits with `code`. Python's teardown of torch's, transformers' and mlflow's modules
    is seconds of a short run (docs/benchmarks.md#install-and-start-up). `handlers=False` skips the threads and
    the handlers too: a vLLM worker's result is written, and vLLM's own handlers tear its engines down."""
    if handlers:
        threading._shutdown()  # what the interpreter calls first at exit
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


# The `lab` loggers' lines on stderr, time-stamped, from the first import (a script, a notebook, a benchmark);
# the `lab` command sets their level (-q, -v) and a worker's name (lab/logs.py).
from lab import logs  # noqa: E402 - after what the modules of lab need set at import

logs.setup()
