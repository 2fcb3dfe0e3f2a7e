"""The migration of `lab doctor --rekey`: finished runs whose `config_hash` an older hash scheme computed,
found (`runs_keyed_before`) and re-keyed from the config each logged (`rekey`), under the writers lock held
exclusively (lab/track/writers.py) so that no study matches runs by either key meanwhile.
"""

from __future__ import annotations

from typing import Any

from mlflow.tracking import MlflowClient

from lab.config.identity import CONFIG_HASH_SCHEME, config_hash
from lab.track.queries import every_experiment, every_run, logged_config
from lab.track.runs import set_run_tags
from lab.track.store import configure, local_paths
from lab.track.writers import _writing


def runs_keyed_before(uri: str, scheme: int = CONFIG_HASH_SCHEME) -> list[Any]:
    """Finished runs of every experiment whose `config_hash` tag was computed by a hash scheme older than
    `scheme` (the tag `config_hash_scheme` is missing or lower): a study does not find them as done."""
    db = local_paths(uri)
    if db is not None and not db.is_file():
        return []  # nothing recorded yet; reading must not create an empty store
    configure(uri)
    client = MlflowClient()
    runs = every_run(
        client,
        [e.experiment_id for e in every_experiment(client)],
        "attributes.status = 'FINISHED' and tags.config_hash != ''",
    )
    return [r for r in runs if int(r.data.tags.get("config_hash_scheme", "1")) < scheme]


def rekey(uri: str, runs: list[Any]) -> int:
    """The migration of `lab doctor --rekey`: `runs` (of `runs_keyed_before`) re-keyed to the current
    CONFIG_HASH_SCHEME from the config each logged, the old hash kept as the tag `config_hash_previous`, so
    that studies find them as done. A run without a logged config, or an imported drafter's (its logged keys
    are the checkpoint's), is left to be rerun. Returns how many were re-keyed. Refused (ConfigError) while
    another lab process writes to a local store: a study running beside it would match runs by either key."""
    with _writing(uri, exclusive=True):
        return _rekey(uri, runs)


def _rekey(uri: str, runs: list[Any]) -> int:
    done = 0
    for run in runs:
        logged = logged_config(uri, run.info.run_id)
        if logged is None or (logged.get("drafter") or {}).get("checkpoint"):
            continue
        # before scheme 3 every prompt decoded max_new_tokens: the default now stops at eos
        logged.setdefault("eval", {}).setdefault("stop_at_eos", False)
        set_run_tags(
            uri,
            run.info.run_id,
            {
                "config_hash": config_hash(logged),
                "config_hash_scheme": CONFIG_HASH_SCHEME,
                "config_hash_previous": run.data.tags["config_hash"],
            },
        )
        done += 1
    return done
