"""Where a study lives: the Optuna storage URL (`storage_url`; `dashboard_command` watches it), opening
it, the sampler and the pruner of a spec, and `Session`, one process's handle on a study."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from omegaconf import DictConfig
from optuna.trial import TrialState

from lab import track
from lab.config import OPTUNA_DB_PREFIXES, ConfigError, redact
from lab.fsutil import file_lock
from lab.sweep import optuna_adapter as adapter
from lab.sweep.search_space import Sweep

optuna.logging.set_verbosity(optuna.logging.WARNING)  # each trial prints its own line


def storage_url(cfg: DictConfig) -> str:
    """`tracking.optuna_storage`, or a journal file beside the local MLflow database."""
    if cfg.tracking.optuna_storage:
        return str(cfg.tracking.optuna_storage)
    db = track.local_paths(cfg.tracking.uri)
    return str((db.parent if db else Path("mlruns")) / "optuna.journal")


def dashboard_command(url: str) -> str:
    return f"optuna-dashboard {url}"


def journal_path(url: str) -> Path | None:
    """The journal file `url` names, or None for a database URL."""
    return None if url.startswith(OPTUNA_DB_PREFIXES) else Path(url)


def open_storage(url: str, *, create: bool = True, key: str = "tracking.optuna_storage") -> optuna.storages.BaseStorage:
    """The Optuna storage at `url`, a journal file path or a database URL; a ConfigError naming `key` when it
    cannot be opened.

    `create=True` (a sweep, an ablation, a study's import): what is missing is made, a journal's folder and a
    database's Optuna tables. `create=False` (`lab dashboard`, a study's export): nothing is made, because a
    reader that made an empty journal, database or table would show an empty storage and leave a stray file or
    schema that a later sweep finds; there a file that is not there, an unknown database, or a database
    without Optuna's tables is refused instead."""
    if not create:
        return _open_existing(url, key)
    if url.startswith(OPTUNA_DB_PREFIXES):
        try:
            # Optuna creates its tables on first open without a lock: one process at a time
            with track.store_lock(url, "optuna-schema", f"another lab process is creating {redact(url)}"):
                return adapter.rdb_storage(url)
        except Exception as exc:  # a missing driver, a refused connection: one line
            first = str(exc).splitlines()[0]
            raise ConfigError(key, f"cannot open '{redact(url)}': {first}") from None
    path = Path(url)
    path.parent.mkdir(parents=True, exist_ok=True)
    return adapter.journal_storage(str(path))


def _open_existing(url: str, key: str) -> optuna.storages.BaseStorage:
    shown = redact(url)
    if "://" in url and not url.startswith(OPTUNA_DB_PREFIXES):
        scheme = url.split("://", 1)[0]
        raise ConfigError(key, f"unknown database '{scheme}'; expected a journal file path or a database URL")
    journal = journal_path(url)
    sqlite_file = Path(url[len("sqlite:///") :]) if url.startswith("sqlite:///") else None
    for path in (journal, sqlite_file):
        if path is not None and path.is_dir():
            raise ConfigError(key, f"'{shown}' is a directory; expected a journal file or a database URL")
        if path is not None and not path.is_file():
            raise ConfigError(key, f"'{shown}': no such file, so no Optuna study yet (`lab sweep` makes one)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Optuna's ExperimentalWarning for the journal storage
        try:
            if journal is not None:
                return adapter.journal_storage(str(journal))
            # as optuna-dashboard opens a database: no tables made, any schema version shown
            return optuna.storages.RDBStorage(url, skip_compatibility_check=True, skip_table_creation=True)
        except Exception as exc:  # a missing driver, not a database
            raise unreadable(key, url, exc) from None


def unreadable(key: str, url: str, exc: BaseException) -> ConfigError:
    """The one-line error of a storage that `open_storage(create=False)` opened, or its reader then read,
    and that failed: the driver's own first line (Optuna wraps it), said as no tables where there are none."""
    while exc.__cause__ is not None:  # Optuna wraps the driver's error, which says what is wrong
        exc = exc.__cause__
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    if "no such table" in first or ("relation" in first and "does not exist" in first):
        return ConfigError(key, f"'{redact(url)}' has no Optuna tables, so no study yet ({first})")
    return ConfigError(key, f"cannot read Optuna studies from '{redact(url)}': {first}")


def sampler(sweep: Sweep, worker_index: int, history: int) -> optuna.samplers.BaseSampler:
    opts = {k: v for k, v in sweep.sampler.items() if k != "name"}
    name = sweep.sampler["name"]
    if "seed" in opts:  # a sampler restarts its random stream in every process: offset it by the worker
        # and by the trials already drawn, or a resumed study would draw its first points again
        opts["seed"] = int(opts["seed"]) + 1000 * worker_index + history
    samplers = {
        # every grid trial is enqueued with fixed params, so the sampler is never asked; Optuna's GridSampler
        # would be wrong here: its after_trial raises KeyError('grid_id') on an enqueued trial when one grid
        # point is left, and on its own it may hand one point to two parallel workers
        "grid": lambda: optuna.samplers.RandomSampler(**opts),
        "tpe": lambda: optuna.samplers.TPESampler(**opts),
        "random": lambda: optuna.samplers.RandomSampler(**opts),
        "nsga2": lambda: optuna.samplers.NSGAIISampler(**opts),
    }
    try:
        return samplers[name]()
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"{sweep.source}: sampler",
            f"bad option for {name}: {exc}; expected keyword arguments of its Optuna sampler",
        ) from None


def pruner(sweep: Sweep) -> optuna.pruners.BasePruner:
    opts = {k: v for k, v in sweep.pruner.items() if k != "name"}
    name = sweep.pruner["name"]
    pruners = {
        "none": optuna.pruners.NopPruner,
        "median": optuna.pruners.MedianPruner,
        "percentile": optuna.pruners.PercentilePruner,
        "hyperband": optuna.pruners.HyperbandPruner,
    }
    try:
        return pruners[name](**opts)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"{sweep.source}: pruner", f"bad option for {name}: {exc}; expected keyword arguments of its Optuna pruner"
        ) from None


@dataclass
class Session:
    """One process's handle on a study: the spec, the storage and where its runs are tracked."""

    sweep: Sweep
    extra: list[str]
    storage_url: str
    storage: optuna.storages.BaseStorage
    study: optuna.Study
    uri: str
    parent_run_id: str = ""

    @property
    def study_id(self) -> int:
        return adapter.study_id(self.storage, self.study.study_name)

    def user_attr(self, key: str, default: Any = None) -> Any:
        return adapter.study_user_attrs(self.storage, self.study_id).get(key, default)

    def trials(self, states: tuple[TrialState, ...] | None = None) -> list[optuna.trial.FrozenTrial]:
        return adapter.trials(self.storage, self.study_id, states)

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Serializes topping up the queue and failing a stale trial on a journal (it has no compare-and-set
        for either; an RDB's row lock covers the latter)."""
        if self.storage_url.startswith(OPTUNA_DB_PREFIXES):
            yield
        else:
            with file_lock(Path(self.storage_url).with_suffix(".lab-lock")):
                yield


def open_session(sweep: Sweep, extra: list[str], cfg: DictConfig, create: bool, worker_index: int = 0) -> Session:
    """The study of `sweep` + `extra` in the configured storage (created if `create`)."""
    url = storage_url(cfg)
    storage = open_storage(url)
    name = sweep.study_name(extra)
    directions = [o.direction for o in sweep.objectives]
    history = next((x.n_trials for x in optuna.get_all_study_summaries(storage, False) if x.study_name == name), 0)
    chosen_sampler, chosen_pruner = sampler(sweep, worker_index, history), pruner(sweep)
    if create:
        study = optuna.create_study(
            study_name=name,
            storage=storage,
            sampler=chosen_sampler,
            pruner=chosen_pruner,
            directions=directions,
            load_if_exists=True,
        )
    else:
        try:
            study = optuna.load_study(study_name=name, storage=storage, sampler=chosen_sampler, pruner=chosen_pruner)
        except KeyError:
            starts = {"ablate": f"lab ablate experiment={sweep.name}", "multirun": "lab run -m"}
            command = starts.get(sweep.kind, f"lab sweep sweep={sweep.name}")
            raise ConfigError(
                sweep.kind if sweep.kind != "ablate" else "experiment",
                f"no study '{name}' in {redact(url)}; start it with `{command}` and the same overrides, then join it",
            ) from None
    return Session(sweep, extra, url, storage, study, cfg.tracking.uri, "")
