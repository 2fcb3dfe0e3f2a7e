"""Every use of Optuna's internals in the workbench, in one place.

The engine needs more than Optuna's public `Study` / `Trial` API: a trial's storage id (the private
`_trial_id`), the storage layer itself (`BaseStorage`, which Optuna documents as an internal interface: an
atomic WAITING -> RUNNING, attributes of a trial by id), the process-wide storage cache, a `Trial` made for a
trial taken from the queue, and the bookkeeping of the (experimental) retry callback in system attributes.
They are all here, so that an Optuna upgrade that changes them changes this file only. Nothing else in
`lab/` reads `_trial_id` or calls a storage method.
"""

from __future__ import annotations

import warnings
from typing import Any

import optuna
from optuna.exceptions import UpdateFinishedTrialError
from optuna.storages import BaseStorage
from optuna.trial import FrozenTrial, Trial, TrialState

AnyTrial = Trial | FrozenTrial


def _id(trial: AnyTrial) -> int:
    return trial._trial_id


# ------------------------------------------------------------------------------------------------ storages


def rdb_storage(url: str) -> BaseStorage:
    # one cached handle for both the study and the engine's own reads and writes: a trial that another
    # process enqueued is known to Optuna's cache only once read through it
    return optuna.storages.get_storage(optuna.storages.RDBStorage(url))


def journal_storage(path: str) -> BaseStorage:
    return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(path))


# ------------------------------------------------------------------------------------------------- studies


def study_id(storage: BaseStorage, study_name: str) -> int:
    return storage.get_study_id_from_name(study_name)


def study_user_attrs(storage: BaseStorage, study_id: int) -> dict[str, Any]:
    return storage.get_study_user_attrs(study_id)


def trials(storage: BaseStorage, study_id: int, states: tuple[TrialState, ...] | None) -> list[FrozenTrial]:
    """The study's trials as the storage holds them now (not copied)."""
    return storage.get_all_trials(study_id, deepcopy=False, states=states)


# -------------------------------------------------------------------------------------------------- trials


def claim(study: optuna.Study, storage: BaseStorage, waiting: FrozenTrial) -> Trial | None:
    """Take a WAITING trial (atomically WAITING -> RUNNING in the storage) and return it to run; None when
    another worker took it first."""
    try:
        if storage.set_trial_state_values(_id(waiting), TrialState.RUNNING):
            return Trial(study, _id(waiting))
    except UpdateFinishedTrialError:
        pass
    return None


def fail_if_running(storage: BaseStorage, trial: AnyTrial, error: str) -> bool:
    """Record `error` on a trial and fail it, if it is still RUNNING; False when it is not (any more)."""
    try:
        if storage.get_trial(_id(trial)).state != TrialState.RUNNING:
            return False
        storage.set_trial_user_attr(_id(trial), "error", error)
        storage.set_trial_state_values(_id(trial), TrialState.FAIL)
    except UpdateFinishedTrialError:
        return False
    return True


def set_user_attr(storage: BaseStorage, trial: AnyTrial, key: str, value: Any) -> None:
    """A user attribute written straight to the storage (from any thread, for a trial in any state)."""
    storage.set_trial_user_attr(_id(trial), key, value)


def user_attrs(storage: BaseStorage, trial: AnyTrial) -> dict[str, Any]:
    """A trial's user attributes as the storage holds them now."""
    return storage.get_trial_user_attrs(_id(trial))


# --------------------------------------------------------------------------------------------------- retry


def requeue(study: optuna.Study, storage: BaseStorage, trial: AnyTrial, max_retry: int | None) -> None:
    """Enqueue a failed trial again with the same params and user attributes (Optuna's
    RetryHeartbeatStaleTrialCallback), unless it was retried `max_retry` times already."""
    frozen = storage.get_trial(_id(trial))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry)(study, frozen)


def retry_history(storage: BaseStorage, trial: AnyTrial) -> list[int]:
    """Numbers of the failed trials this one retries (oldest first); empty for a first attempt."""
    return storage.get_trial_system_attrs(_id(trial)).get("retry_history", [])


def is_retry(trial: FrozenTrial) -> bool:
    """Whether the trial re-runs a failed one."""
    return bool(trial.system_attrs.get("retry_history"))


def retried(trials: list[FrozenTrial]) -> set[int]:
    """Numbers of failed trials that were re-enqueued (their retry stands for them)."""
    return {n for t in trials for n in t.system_attrs.get("retry_history", [])}
