"""The Optuna part of a study's archive (`lab study export --with-optuna`, `lab study import`): the study
copied into a journal file of its own, and from there into the destination's storage.

Only Optuna's public API is used (`copy_study`, `create_study`, `add_trials`); the MLflow part of the archive
is lab/track/study_archive/'s. On import the trials' `mlflow_run_id` and the study's `mlflow_parent_run_id` are
rewritten to the runs' ids in the destination store, so that the engine resuming the study there finds its
runs. A study already in the destination is left as it is (importing twice changes nothing), unless an import
was cut short while writing it (its user attribute `lab.import` is still `partial`): then it is written again.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import optuna

from lab.config import ConfigError, redact
from lab.sweep import optuna_adapter as adapter
from lab.sweep.dashboard import read_studies as open_for_reading

PARTIAL = "lab.import"  # a study attribute, "partial" until every trial is written


def dump(url: str, study_name: str, dst: Path, key: str = "--with-optuna") -> int:
    """Copy study `study_name` of the storage at `url` (opened for reading: nothing is created there) into a new
    journal file `dst`; the number of its trials. ConfigError naming `key` when the storage lacks it."""
    source = open_for_reading(url, key)
    if study_name not in source.studies:
        held = ", ".join(sorted(source.studies))
        raise ConfigError(
            key, f"no Optuna study '{study_name}' in '{redact(url)}' (it holds {held}); expected the study's storage"
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # the journal storage
        optuna.copy_study(
            from_study_name=study_name, from_storage=source.storage, to_storage=adapter.journal_storage(str(dst))
        )
    return len(optuna.load_study(study_name=study_name, storage=source.storage).trials)


def load(src: Path, storage: optuna.storages.BaseStorage, study_name: str, run_ids: dict[str, str]) -> tuple[bool, int]:
    """Write the study of the journal `src` into `storage` (lab/sweep/storage.py's `open_storage`), with its
    MLflow run ids mapped through `run_ids` (original -> destination). Returns (written here?, its trials)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        source = optuna.load_study(study_name=study_name, storage=adapter.journal_storage(str(src)))
        if study_name in optuna.study.get_all_study_names(storage):
            there = optuna.load_study(study_name=study_name, storage=storage)
            if there.user_attrs.get(PARTIAL) != "partial":
                return False, len(there.trials)
            optuna.delete_study(study_name=study_name, storage=storage)  # cut short last time: write it again
        study = optuna.create_study(study_name=study_name, storage=storage, directions=source.directions)
        study.set_user_attr(PARTIAL, "partial")
        for key, value in source.user_attrs.items():
            study.set_user_attr(key, run_ids.get(value, value) if key == "mlflow_parent_run_id" else value)
        trials = []
        for trial in source.get_trials(deepcopy=False):
            trial = copy.deepcopy(trial)
            attrs = dict(trial.user_attrs)
            if attrs.get("mlflow_run_id") in run_ids:
                attrs["mlflow_run_id"] = run_ids[attrs["mlflow_run_id"]]
            trial.user_attrs = attrs
            trials.append(trial)
        study.add_trials(trials)
        study.set_user_attr(PARTIAL, "complete")
    return True, len(trials)
