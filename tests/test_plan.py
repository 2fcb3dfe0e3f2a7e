"""The plan `lab run` and `lab ablate` print before their first stage (lab/plan.py): on a fresh cache every stage is
to build; after a micro run the target, data and hidden states are cached and the estimates come from the store,
scaled by size, and before any run from a few seconds of measurement; `--dry-run` prints the plan and writes
nothing."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import pytest
from helpers import stated_threads

from lab.config.composition import compose
from lab.plan import CACHED, EACH_RUN, NO_RATE, NOT_NEEDED, REUSED, TO_BUILD, TO_TRAIN, run_plan

SMALL = ["train.steps=6", "eval.num_prompts=2"]  # a micro run in seconds


def _store(folder: Path) -> list[str]:
    return [f"tracking.uri=sqlite:///{folder / 'mlflow.db'}", f"tracking.artifact_root={folder / 'artifacts'}"]


def _states(plan) -> dict[str, str]:
    return {step.stage: step.state for step in plan.steps}


@pytest.fixture(scope="module")
def ran(micro_overrides, micro_target, tmp_path_factory) -> list[str]:
    """One small micro run into a store of its own, over the session's cache: its overrides."""
    from lab.pipeline import run

    store = tmp_path_factory.mktemp("store")
    overrides = [o for o in micro_overrides if not o.startswith("tracking.")] + SMALL + _store(store)
    with stated_threads():
        run(compose(overrides), progress=False)
    return overrides


def _fresh(micro_overrides: list[str], folder: Path) -> list[str]:
    fresh = [o for o in micro_overrides if not o.startswith(("cache_dir=", "tracking."))]
    return [*fresh, f"cache_dir={folder / 'cache'}", *SMALL, *_store(folder / "store")]


MEASURED = ("cache", "heldout", "train")  # the stages a fresh machine's plan estimates from its own measurement


def test_a_fresh_cache_has_every_stage_to_build(micro_overrides, tmp_path):
    plan = run_plan(compose(_fresh(micro_overrides, tmp_path)))
    assert _states(plan) == {
        "target": TO_BUILD,
        "data": TO_BUILD,
        "validation": EACH_RUN,
        "cache": TO_BUILD,
        "heldout": TO_BUILD,
        "suites": EACH_RUN,
        "answers": TO_BUILD,
        "train": TO_TRAIN,
        "eval": EACH_RUN,
    }, str(plan)
    # no run here yet, no target built: the capture, the held-out states and the training at the rates measured
    # at their shapes, the rest unknown
    estimates = {step.stage: step.estimate() for step in plan.steps}
    assert all(" measured here)" in estimates[stage] for stage in MEASURED), str(plan)
    assert {s: e for s, e in estimates.items() if s not in MEASURED} == dict.fromkeys(
        set(estimates) - set(MEASURED), NO_RATE
    ), str(plan)
    assert not any(tmp_path.iterdir()), "the plan wrote into a fresh folder"


def test_the_rates_measured_are_recorded_by_the_run_for_the_next_plan(micro_overrides, tmp_path, caplog):
    """A plan writes nothing; the run after it records the rates it measured (`measure.record`, as its MLflow run
    opens), and the next plan reads them, measuring nothing, to the same estimates."""
    from lab import measure

    cfg = compose(_fresh(micro_overrides, tmp_path))
    with caplog.at_level(logging.INFO, logger="lab.measure"):
        first = run_plan(cfg)
        assert not any(tmp_path.iterdir()), "the plan wrote into a fresh folder"
        measure.record(cfg.cache_dir)
        records = list((tmp_path / "cache" / "rates").glob("*.json"))
        assert len(records) == 1 and {"decode", "prefill", "train"} <= json.loads(records[0].read_text()).keys()
        again = run_plan(cfg)
    assert sum("measuring this machine's rates" in m for m in caplog.messages) == 1, caplog.messages
    assert [s.seconds for s in again.steps] == [s.seconds for s in first.steps]


def test_a_regeneration_is_estimated_from_the_decoding_measured(micro_overrides, micro_target, tmp_path):
    """Over the session's cache, whose micro target is built, and a fresh store: the regeneration's estimate is its
    conversations' tokens at most, at the decoding rate measured."""
    store = [o for o in micro_overrides if not o.startswith("tracking.")] + _store(tmp_path / "store")
    overrides = ["data=sharegpt", "data.template=chatml", "data.num_sequences=8", "data.heldout_sequences=2"]
    cfg = compose([*store, *SMALL, *overrides])
    steps = {s.stage: s for s in run_plan(cfg).steps}
    assert steps["data"].state == TO_BUILD, steps["data"]
    assert f"at most {10 * cfg.data.seq_len:,} tokens at " in steps["data"].basis, steps["data"]
    assert "measured here: transformers' decoding" in steps["data"].basis, steps["data"]
    assert steps["data"].seconds > 0


@pytest.mark.slow
def test_after_a_run_its_caches_are_cached_and_its_times_are_rates(ran):
    plan = run_plan(compose(ran))
    states = _states(plan)
    cached = ("target", "data", "cache", "heldout", "answers")
    assert {stage: states[stage] for stage in cached} == dict.fromkeys(cached, CACHED), str(plan)
    assert states["train"] == TO_TRAIN  # the tests' runs train again (train.reuse=false)
    steps = {step.stage: step for step in plan.steps}
    for stage in ("train", "eval"):
        assert steps[stage].seconds is not None and steps[stage].basis == "from 1 run here", str(plan)
    longer = {step.stage: step for step in run_plan(compose([*ran, "train.steps=12"])).steps}
    assert longer["train"].seconds == pytest.approx(2 * steps["train"].seconds), "training's estimate scales by steps"


@pytest.mark.slow
def test_a_drafter_trained_alike_shows_as_reused(ran):
    """With train.reuse the finished run's drafter stands for this run's training, which reads no hidden states."""
    states = _states(run_plan(compose([*ran, "train.reuse=true"])))
    assert (states["train"], states["cache"]) == (REUSED, NOT_NEEDED), states


def _lab(args: list[str], cwd: Path, capsys, monkeypatch) -> tuple[int, str]:
    from lab.cli import main

    monkeypatch.chdir(cwd)
    capsys.readouterr()
    rc = main(args)
    return rc, capsys.readouterr().out


def _snapshot(*roots: Path) -> dict[str, str]:
    """Every file and folder under `roots` with its content's hash: what a dry run leaves as it was. A folder
    linked in from elsewhere (the test workers' shared targets) is left out: other workers write there."""
    return {
        str(p): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for root in roots
        for p in sorted(root.rglob("*"))
        if not any(parent.is_symlink() for parent in [p, *p.parents] if parent.is_relative_to(root))
    }


@pytest.mark.slow
def test_a_dry_run_prints_the_plan_and_writes_nothing(micro_overrides, ran, tmp_path, capsys, monkeypatch):
    """`lab run --dry-run` and `lab ablate --dry-run`, on a fresh cache and store and on the run's: exit 0 with the
    plan, and no file created or changed (no store, no cache entry, no lock) in the cache, the store or here."""
    fresh = [o for o in micro_overrides if not o.startswith(("cache_dir=", "tracking."))]
    fresh += [f"cache_dir={tmp_path / 'cache'}", *_store(tmp_path / "store")]
    cfg = compose(ran)
    roots = (tmp_path, Path(cfg.cache_dir), Path(cfg.tracking.artifact_root).parent)
    for overrides in (fresh, ran):
        before = _snapshot(*roots)
        rc, out = _lab(["run", "--dry-run", *overrides], tmp_path, capsys, monkeypatch)
        assert rc == 0 and out.startswith("plan: lab run") and "\n  target " in out, out
        rc, out = _lab(["ablate", "experiment=drift_2x2", "--seeds", "0", "--dry-run", *overrides], tmp_path, capsys,
                       monkeypatch)  # fmt: skip
        assert rc == 0 and out.startswith("plan: experiments/drift_2x2.yaml, 4 arms x 1 seed = 4 runs"), out
        assert "\n  train eagle31 " in out, out
        assert _snapshot(*roots) == before
    assert not (tmp_path / "store").exists() and not (tmp_path / "cache").exists()
