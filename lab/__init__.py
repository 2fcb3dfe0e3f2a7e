"""EAGLE-3 / EAGLE 3.1 ablation workbench.

Stages, in the one direction data flows: target -> data (corpus, suites, hidden-state cache) ->
drafter -> train -> eval -> track (MLflow) -> report. `lab.config` is shared by all.
"""

__version__ = "0.1.0"
