"""EAGLE-3 / EAGLE 3.1 ablation workbench.

Stages, in the one direction data flows: target -> data (corpus, suites, hidden-state cache) ->
drafter -> train -> eval -> track (MLflow) -> report. `lab.config` is shared by all.
"""

import importlib.abc
import importlib.machinery
import os
import sys

__version__ = "0.1.0"

# MLflow's usage telemetry stays off in every lab process and the UI servers they start, unless the user turns
# it on with MLflow's own switch (MLFLOW_DISABLE_TELEMETRY=false; docs/tracking.md). Set before any module of
# lab imports mlflow, which decides at import.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

SKLEARN_TABLE = "transformers.utils.import_utils"  # where transformers decides which optional packages it has


class _WithoutSklearn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """transformers imports scikit-learn's metrics as it loads its generation utilities whenever scikit-learn is
    installed (mlflow brings it), for assisted generation's confidence threshold, which the workbench never uses:
    2 of the 12 s `from transformers import AutoTokenizer, AutoModelForCausalLM` takes on 2 cores (12.0 -> 9.9 s,
    three runs each), in every lab process that loads a model or a tokenizer and every vLLM worker. This finder
    loads transformers' table of optional packages as the path finder would, then has it answer that
    scikit-learn is absent; nothing else changes, and a transformers without that table is left alone."""

    def find_spec(self, name, path, target=None):
        if name != SKLEARN_TABLE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            self.loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        if callable(getattr(module, "is_sklearn_available", None)):
            module.is_sklearn_available = lambda: False


if SKLEARN_TABLE not in sys.modules:  # before transformers loads in this process
    sys.meta_path.insert(0, _WithoutSklearn())
