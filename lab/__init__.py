"""EAGLE-3 / EAGLE 3.1 ablation workbench.

Stages, in the one direction data flows: target -> data (corpus, suites, hidden-state cache) ->
drafter -> train -> eval -> track (MLflow) -> report. `lab.config` is shared by all.
"""

import os

__version__ = "0.1.0"

# MLflow's usage telemetry stays off in every lab process and the UI servers they start, unless the user turns
# it on with MLflow's own switch (MLFLOW_DISABLE_TELEMETRY=false; docs/tracking.md). Set before any module of
# lab imports mlflow, which decides at import.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
