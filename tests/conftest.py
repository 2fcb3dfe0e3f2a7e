"""Shared fixtures: one micro target, hidden-state cache and trained drafter per test session, all in a
temporary folder (cache and MLflow store), never in the repository's own `.cache/` or `mlruns/`."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from helpers import TEST_THREADS, stated_threads

from lab import logs
from lab.config.composition import compose
from lab.config.shape import aux_layers

MICRO = ["profile=micro"]


# `make test` runs the suite on pytest-xdist workers (`-n 4 --dist loadgroup`). A file runs whole on one worker, so
# its module fixtures are built once; files that share a costly session fixture run on the same worker, so it is
# built once too (micro_study, micro_mla_target, the converted SmolLM2 in the session's cache), and the PostgreSQL
# server that the `postgres` fixture starts and stops belongs to one worker's tests only.
SAME_WORKER = {
    "test_ui": "test_ablate",  # micro_study
    "test_target_families": "test_mla_drafter",  # micro_mla_target
    "test_real_data": "test_pipeline",  # SmolLM2 and the pinned wheels in workdir's cache
    "test_postgres": "test_concurrency",  # postgres
}
# Workers take the groups in collection order, so the longest go first and none is left to run alone at the end:
# seconds per group on one worker, the mean of five `make test` runs on 2 cores (their JUnit); groups not named here
# are short and follow. With four workers on two cores the order moves the wall little (the cores stay busy while
# two workers are): with this table the workers of two runs ended within 10 and 24 s of each other.
GROUP_SECONDS = {
    "test_vllm": 831, "test_pipeline": 771, "test_concurrency": 748, "test_sweep": 545, "test_fuzz_input": 498,
    "test_scheduler": 400,
    "test_imported_drafters": 274, "test_atomic_writes": 271, "test_ablate": 172, "test_bad_input": 172,
    "test_reference": 138, "test_fake_cuda": 137, "test_mla_drafter": 134, "test_dashboard": 132, "test_report": 119,
    "test_faults": 119, "test_config": 113, "test_study_transfer": 104, "test_regenerate": 97, "test_cache": 83,
    "test_paper": 72, "test_replay": 71, "test_train": 39, "test_device": 31,
}  # fmt: skip


def _group(path: str | Path) -> str:
    """The worker group of a test file: its name, or the file it shares a worker with."""
    stem = Path(path).stem
    return SAME_WORKER.get(stem, stem)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: -GROUP_SECONDS.get(_group(item.path), 0))  # stable: each file keeps its order


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`--dist loadgroup` by `_group`: a group's tests on one worker, the groups taken in collection order. (xdist's
    own loadgroup writes a marker's group into the test's node id, which pytest 9.2's node ids no longer take: the
    tests of one file then ran on several workers.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid.split("::")[0])

    config.option.loadscopereorder = False  # the order above, not xdist's most-tests-first
    return FileGroups(config, log)


@pytest.fixture(autouse=True)
def _default_log():
    """Each test starts with the log as a plain `lab` command sets it (INFO, no worker name), whatever a `-q`,
    `-v` or worker command before it set."""
    logs.setup()


@pytest.fixture(autouse=True)
def _stated_threads():
    """Each test starts at the stated thread count (tests/helpers.py `TEST_THREADS`), whatever the test before it
    set (an in-process `lab run` sets its config's `threads`): what it trains does not depend on the order."""
    with stated_threads():
        yield


@pytest.fixture(scope="session")
def workdir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("lab")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # the workers share their built targets: each is built once, the others waiting on its lock in the cache
        shared = tmp_path_factory.getbasetemp().parent / "targets"
        shared.mkdir(exist_ok=True)
        (folder / "cache").mkdir()
        (folder / "cache" / "targets").symlink_to(shared, target_is_directory=True)
    return folder


@pytest.fixture(scope="session")
def micro_overrides(workdir) -> list[str]:
    return MICRO + [
        f"cache_dir={workdir / 'cache'}",
        f"tracking.uri=sqlite:///{workdir / 'mlruns' / 'mlflow.db'}",
        f"tracking.artifact_root={workdir / 'mlruns' / 'artifacts'}",
        f"threads={TEST_THREADS}",  # what `lab` subprocesses train with: the stated count
        "device=cpu",  # the shared target is the CPU's float32 reference, also on a GPU machine (auto: CUDA)
        "train.reuse=false",  # tests share this store: each trains what it tests (reuse has its own test)
    ]


@pytest.fixture(scope="session")
def micro_cfg(micro_overrides):
    return compose(micro_overrides)


@pytest.fixture(scope="session")
def micro_target(micro_cfg):
    from lab.target import load

    with stated_threads():  # a built target is trained: under the stated count
        return load(micro_cfg, progress=False)


@pytest.fixture(scope="session")
def micro_mla_cfg(micro_overrides):
    """The micro profile over the micro target's DeepSeek-V3-shaped sibling (MLA + experts)."""
    return compose(micro_overrides + ["target=micro_mla"])


@pytest.fixture(scope="session")
def micro_mla_target(micro_mla_cfg):
    from lab.target import load

    with stated_threads():
        return load(micro_mla_cfg, progress=False)


@pytest.fixture(scope="session")
def micro_sequences(micro_cfg, micro_target):
    from lab.data.code_data import training_sequences

    return training_sequences(micro_target.tokenizer, micro_cfg.data)


@pytest.fixture(scope="session")
def micro_hidden(micro_cfg, micro_target, micro_sequences):
    from lab.data.cache import build_or_load

    return build_or_load(
        micro_target, micro_sequences[0], micro_cfg.data, aux_layers(micro_cfg), micro_cfg.cache_dir, progress=False
    )


@pytest.fixture(scope="session")
def trained_eagle3(micro_cfg, micro_target, micro_hidden):
    from lab.drafter import init_drafter
    from lab.train.ttt import train

    drafter = init_drafter(micro_target, micro_cfg.drafter, aux_layers(micro_cfg), seed=0)
    with stated_threads():
        result = train(drafter, micro_hidden, micro_target.lm_head_weight, micro_cfg.train, seed=0, progress=False)
    return drafter, result


@pytest.fixture(scope="session")
def trained_eagle31(micro_overrides, micro_target, micro_hidden):
    from lab.drafter import init_drafter
    from lab.train.ttt import train

    cfg = compose(micro_overrides + ["drafter=eagle31"])
    drafter = init_drafter(micro_target, cfg.drafter, aux_layers(cfg), seed=0)
    with stated_threads():
        result = train(drafter, micro_hidden, micro_target.lm_head_weight, cfg.train, seed=0, progress=False)
    return drafter, result


@dataclass
class MicroStudy:
    """A finished micro ablation: its store, the overrides it ran with, the engine's result and its report."""

    uri: str
    extra: list[str]
    experiment: Any  # lab.sweep.experiment.Experiment
    result: Any  # lab.sweep.engine.SweepResult
    report: Any  # lab.report.Report


TINY_EXPERIMENT = """\
description: EAGLE-3 vs EAGLE 3.1 on the micro target
baseline: e3
seeds: [0, 1]
overrides: [train.steps=6, eval.num_prompts=2]
arms:
  e3: {label: EAGLE-3, overrides: [drafter=eagle3]}
  e31: {label: EAGLE 3.1, overrides: [drafter=eagle31]}
"""


@pytest.fixture(scope="session")
def micro_study(micro_overrides, micro_target, workdir) -> MicroStudy:
    """experiments/tiny.yaml (2 arms x 2 seeds, 6 training steps, 2 prompts) run as `lab ablate` runs an
    experiment: its description, the grid study on two workers, then its report and the UI's descriptions.
    Shared by tests/test_ablate.py (the engine) and tests/test_ui.py (the study in a browser). micro_target: the
    session's target, built under the stated threads before the study's warm-up (at every core: its workers split
    them) could build it."""
    from lab.cli.report import describe_study, load_study, write_report
    from lab.sweep import experiment
    from lab.sweep.engine import launch

    folder = workdir / "micro_study"
    folder.mkdir()
    (folder / "tiny.yaml").write_text(TINY_EXPERIMENT)
    exp = experiment.load("tiny", folder)
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    extra = [o for o in micro_overrides if not o.startswith(("threads=", "tracking."))]  # two workers, a thread each
    extra += [f"tracking.uri={uri}", f"tracking.artifact_root={folder / 'art'}"]
    describe_study(exp, extra, None)
    result = launch(exp.as_sweep(extra), extra, ["ablate", "worker", "experiment=tiny"], workers=2, progress=False)
    study = load_study(exp, uri, result.parent_run_id)
    report = write_report(exp, extra, study, str(folder / "report"), None)
    return MicroStudy(uri, extra, exp, result, report)


ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def postgres() -> str:
    """The base URL of the project's own local PostgreSQL server (scripts/postgres.sh), started for the
    session and stopped after it if it was not running before. Skips without a server installed, unless
    LAB_REQUIRE_POSTGRES=1 (CI), where that fails."""
    script = ["bash", str(ROOT / "scripts" / "postgres.sh")]
    installed = subprocess.run([*script, "install"], capture_output=True, text=True)
    if installed.returncode != 0:
        if os.environ.get("LAB_REQUIRE_POSTGRES") == "1":
            pytest.fail(f"no PostgreSQL server: {installed.stderr.strip()}")
        pytest.skip("no PostgreSQL server (scripts/postgres.sh install needs root or sudo)")
    was_running = subprocess.run([*script, "status"]).returncode == 0
    started = subprocess.run([*script, "start"], capture_output=True, text=True)
    assert started.returncode == 0, started.stderr
    yield started.stdout.strip().splitlines()[-1]
    if not was_running:
        subprocess.run([*script, "stop"], check=False)


@pytest.fixture()
def fresh_database(postgres):
    """`make(name)`: the URL of an empty database `name` on the test server (dropped first if it exists)."""
    import psycopg

    def make(name: str) -> str:
        with psycopg.connect(f"{postgres}/postgres", autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            conn.execute(f'CREATE DATABASE "{name}"')
        return f"{postgres}/{name}"

    return make
