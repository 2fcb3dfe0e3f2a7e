"""Every read of a study's runs pages through all of them: MLflow's `search_runs` returns one page (1,000 runs by
default, 50,000 at most), so a study larger than a page would lose runs silently from its report, its listing
and the reuse of finished trials. A real SQLite store gets a study of 5,002 child runs (more than the page of
1,000 and the 5,000 that reads once asked for), written straight into MLflow's own tables so that the test
takes seconds, not the minutes that 5,002 `create_run` calls take."""

from __future__ import annotations

import time
import uuid
from types import SimpleNamespace
from typing import Any

import optuna
import pytest
from sqlalchemy import insert

from lab import track
from lab.config.composition import compose
from lab.config.identity import config_hash
from lab.report import listing
from lab.report import load as load_study

SEEDS = 2501  # x 2 arms: 5,002 child runs
KEY = "eval/in_dist/ref/k3/al"


def _bulk_children(uri: str, parent_id: str, seeds: int, oldest_hash: str) -> str:
    """Two arms x `seeds` FINISHED child runs of `parent_id`, the oldest first and tagged `oldest_hash`; returns
    its run id (the last run that a newest-first search reaches)."""
    from mlflow.store.tracking.dbmodels import models
    from mlflow.tracking._tracking_service.utils import _get_store

    parent = track.get_run(uri, parent_id)
    start = int(time.time() * 1000) - 10_000_000
    tables: dict[Any, list[dict]] = {t: [] for t in (models.SqlRun, models.SqlTag, models.SqlParam, models.SqlMetric)}
    oldest = None
    for i in range(seeds * 2):
        arm, seed = ("eagle3", "eagle31")[i % 2], str(i // 2)
        run_id = uuid.uuid4().hex
        oldest = oldest or run_id
        at = start + i
        tables[models.SqlRun].append(
            dict(
                run_uuid=run_id, name=f"{arm}-seed{seed}", source_type="LOCAL", source_name="", entry_point_name="",
                user_id="lab", status="FINISHED", start_time=at, end_time=at + 1000, source_version="",
                lifecycle_stage="active", artifact_uri=f"{parent.info.artifact_uri}/../{run_id}/artifacts",
                experiment_id=int(parent.info.experiment_id),
            )
        )  # fmt: skip
        config = oldest_hash if i == 0 else f"h-{arm}-{seed}"
        tags = {"mlflow.parentRunId": parent_id, "arm": arm, "seed": seed, "config_hash": config}
        tables[models.SqlTag] += [dict(key=k, value=v, run_uuid=run_id) for k, v in tags.items()]
        params = {"eval.suites": '["in_dist"]', "eval.num_speculative_tokens": "[3]", "eval.backends": '["ref"]'}
        tables[models.SqlParam] += [dict(key=k, value=v, run_uuid=run_id) for k, v in params.items()]
        value = 2.0 + (i % 2) * 0.5
        tables[models.SqlMetric].append(dict(key=KEY, value=value, timestamp=at, step=0, is_nan=False, run_uuid=run_id))
    tables[models.SqlLatestMetric] = tables[models.SqlMetric]
    with _get_store(uri).ManagedSessionMaker(read_only=False) as session:
        for table, rows in tables.items():
            session.execute(insert(table.__table__), rows)
    return oldest


@pytest.fixture(scope="module")
def big_study(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("paging")
    uri, art = f"sqlite:///{root / 'mlflow.db'}", str(root / "artifacts")
    tags = {"study": "big", "sweep": "big", "study_kind": "ablate", "baseline": "eagle3"}
    cfg = compose(["drafter=eagle3", "seed=0"])
    with track.parent_run(uri, art, "big", "sweep-big", "big-key", tags) as parent:
        oldest = _bulk_children(uri, parent.id, SEEDS, config_hash(cfg))
    return {"uri": uri, "parent": parent.id, "oldest": oldest, "cfg": cfg}


def test_every_child_run_is_read_past_mlflows_page(big_study):
    uri, parent = big_study["uri"], big_study["parent"]
    children = track.child_runs(uri, parent, status="FINISHED")
    assert len(children) == 2 * SEEDS > 5000
    assert len({r.info.run_id for r in children}) == 2 * SEEDS  # no page read twice
    assert len(track.search_runs(uri, "big", "tags.arm = 'eagle31'")) == SEEDS > 1000


def test_the_report_and_the_listing_count_every_run(big_study):
    uri, parent = big_study["uri"], big_study["parent"]
    seeds = list(range(SEEDS))
    study = load_study(uri, parent, "big", "", [("eagle3", "EAGLE-3"), ("eagle31", "EAGLE 3.1")], "eagle3", seeds)
    assert [len(a.runs) for a in study.arms] == [SEEDS, SEEDS] and not study.gaps()
    assert study.scalars(study.arms[1], KEY) == [2.5] * SEEDS
    (row,) = listing.studies(uri, headlines=False)
    assert row.runs == {"FINISHED": 2 * SEEDS} and len(row.seeds) == SEEDS and row.arms == ["eagle3", "eagle31"]


def test_a_finished_trial_is_found_on_the_last_page(big_study):
    """A trial reuses the FINISHED run that computed its config: the study's oldest run, on the last page of a
    newest-first search."""
    from lab.sweep.trial import _finished_run

    uri, parent, oldest = big_study["uri"], big_study["parent"], big_study["oldest"]
    study = optuna.create_study(storage=optuna.storages.InMemoryStorage())
    session = SimpleNamespace(uri=uri, parent_run_id=parent, storage=study._storage)
    found = _finished_run(session, study.ask(), big_study["cfg"], "eagle3")
    assert found is not None and found.info.run_id == oldest
