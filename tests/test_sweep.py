"""Optuna sweeps: specs compose and fail with one line; on the micro target a grid covers every point x
seed once, an interrupted sweep resumes to exactly its total budget, two workers share one journal
study without duplicates, and a clearly worse trial is pruned."""

from __future__ import annotations

import io
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import optuna
import pytest
from helpers import default_sigint, hold_training, logged, wait_held

from lab import logs, track
from lab.config import ConfigError, redact
from lab.sweep import engine, experiment, queue, search_space, storage
from lab.sweep import optuna_adapter as adapter
from lab.sweep.engine import launch
from lab.sweep.search_space import Sweep
from lab.sweep.workers import worker_subprocesses

FAST = ["train.steps=6", "eval.num_prompts=2"]


@pytest.mark.parametrize("name", search_space.available())
def test_every_shipped_sweep_composes(name, micro_overrides):
    sweep = search_space.load(name)
    assert sweep.check([]) is not None  # the default target
    cfg = sweep.check(micro_overrides)  # and the micro one
    assert cfg.study == name and sweep.budget() >= 8


def test_shipped_sweeps_cover_the_issue():
    grid = search_space.load("toggles_grid")
    toggles = {p.name for p in grid.space}
    assert grid.is_grid and {"drafter.fc_norm", "drafter.norm_output", "drafter.norm_type"} <= toggles
    assert len(toggles) == 4 and grid.budget() == len(grid.points()) == 16
    for preset in ("eagle3", "eagle31"):
        tpe = search_space.load(f"tpe_{preset}")
        assert tpe.sampler["name"] == "tpe" and f"drafter={preset}" in tpe.overrides
        assert {p.name: p.kind for p in tpe.space} == {"train.lr": "float", "train.ttt_length": "int"}
        assert next(p for p in tpe.space if p.name == "train.lr").log and tpe.pruner["name"] == "median"
    pareto = search_space.load("pareto_al_drift")
    assert [o.direction for o in pareto.objectives] == ["maximize", "minimize"]


def test_the_readme_example_spec_composes(tmp_path, micro_overrides):
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    example = readme.split("```yaml\n", 1)[1].split("```", 1)[0]
    sweep = search_space.load(str(_write(tmp_path, "example", example)))
    assert {p.kind for p in sweep.space} == {"categorical", "float", "int", "bundle"}
    assert sweep.check(micro_overrides).eval.suites == ["in_dist", "long_context"]


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return path


GOOD = "space: {train.lr: [1]}\nobjectives: [x]\n"
SEEDS = "expected a non-empty list of distinct integers in 0..4294967295"  # the schema's seed rule
# (the spec, the key named after the file, the rest of the one line); the schema is lab/sweep/spec_schema.py's SweepSpec
BAD_SPECS = [
    # unknown keys
    (GOOD + "samplr: tpe\n", "samplr", "unknown key; allowed: description, grace_s, heartbeat_s, max_retry"),
    ("space: {train.lr: [1]}\nobjectives: [{metric: x, goal: up}]\n", "objectives[0].goal", "unknown key; allowed:"),
    ("space: {train.lr: {low: 1, high: 2, scale: log}}\nobjectives: [x]\n", "space.train.lr.scale", "unknown key"),
    # out of range
    (GOOD + "heartbeat_s: 0\n", "heartbeat_s", "expected a number of seconds > 0, got 0"),
    (GOOD + "heartbeat_s: -5\n", "heartbeat_s", "expected a number of seconds > 0, got -5"),
    (GOOD + "grace_s: 0\n", "grace_s", "expected a number of seconds > 0, got 0"),
    (GOOD + "heartbeat_s: 30\ngrace_s: 20\n", "grace_s", "expected more seconds than heartbeat_s (30)"),
    (GOOD + "max_retry: -1\n", "max_retry", "expected an integer >= 0"),
    (GOOD + "trials: 0\n", "trials", "expected an integer in 1..100000 (the total budget of trials) or null, got 0"),
    (GOOD + "seeds: [0, 0]\n", "seeds", SEEDS + ", got [0, 0]"),
    (GOOD + "seeds: []\n", "seeds", SEEDS + ", got []"),
    ("space: {train.lr: {low: 1, high: 0}}\nobjectives: [x]\n", "space.train.lr", "expected numbers low < high"),
    (
        "space: {train.lr: {low: 0, high: 1, log: true}}\nobjectives: [x]\n",
        "space.train.lr",
        "expected low > 0 for a log",
    ),
    ("space: {train.ttt_length: {low: 1, high: 7, step: 0}}\nobjectives: [x]\n", "space.train.ttt_length.step", "> 0"),
    ("space: {train.lr: []}\nobjectives: [x]\n", "space.train.lr", "expected a non-empty list of values, got []"),
    ("space: {}\nobjectives: [x]\n", "space", "expected a non-empty mapping of config key -> [values]"),
    # wrong types
    (GOOD + "heartbeat_s: often\n", "heartbeat_s", "expected a number of seconds > 0, got 'often'"),
    (GOOD + "heartbeat_s: [1]\n", "heartbeat_s", "expected a number of seconds > 0, got [1]"),
    (GOOD + "max_retry: 1.5\n", "max_retry", "expected an integer >= 0"),
    (GOOD + "trials: many\n", "trials", "expected an integer in 1..100000"),
    (GOOD + "seeds: [0, one]\n", "seeds", SEEDS + ", got [0, 'one']"),
    (GOOD + "overrides: train.steps=3\n", "overrides", "expected a list of key=value overrides, got 'train.steps=3'"),
    ("space: {train.lr: {low: small, high: 1}}\nobjectives: [x]\n", "space.train.lr.low", "expected a number or"),
    ("space: {train.lr: {low: 1, high: 2, log: maybe}}\nobjectives: [x]\n", "space.train.lr.log", "true or false"),
    ("space: {train.lr: 0.1}\nobjectives: [x]\n", "space.train.lr", "expected [values], {low, high[, log, step]}"),
    ("space: {train.lr: {low: 1}}\nobjectives: [x]\n", "space.train.lr", "expected exactly one of [values], {low,"),
    ("space: {train.lr: [1]}\n", "objectives", "expected a non-empty list of {metric: KEY, direction: maximize|"),
    ("space: {train.lr: [1]}\nobjectives: [{direction: minimize}]\n", "objectives[0].metric", "got nothing"),
    ("- a list\n", "", "expected a mapping with space, objectives, sampler, ..., got ['a list']"),
    # bad enum values
    (
        "space: {train.lr: [1]}\nobjectives: [{metric: x, direction: up}]\n",
        "objectives[0].direction",
        "expected one of maximize, minimize, got 'up'",
    ),
    (
        "space: {train.lr: [1]}\nobjectives: [{metric: x, reduce: median}]\n",
        "objectives[0].reduce",
        "one of last, mean, max, min",
    ),
    (GOOD + "sampler: bayes\n", "sampler", "expected one of tpe, random, grid, nsga2, got 'bayes'"),
    (GOOD + "sampler: {name: bayes, seed: 0}\n", "sampler.name", "expected one of tpe, random, grid, nsga2"),
    (GOOD + "pruner: always\n", "pruner", "expected one of none, median, percentile, hyperband, got 'always'"),
    # combinations
    (GOOD + "sampler: nsga2\n", "sampler", "nsga2 is for two or more objectives"),
    ("space: {train.lr: [1]}\nobjectives: [x, y]\npruner: median\n", "pruner", "prunes single-objective studies only"),
    (
        "space: {train.lr: {low: 0.1, high: 1.0}}\nobjectives: [x]\nsampler: grid\n",
        "space.train.lr",
        "a grid needs a list",
    ),
    (GOOD + "sampler: grid\ntrials: 3\n", "trials", "a grid runs every point x seed (1)"),
]


@pytest.mark.parametrize("text,key,message", BAD_SPECS, ids=[f"{c[1] or 'file'}-{i}" for i, c in enumerate(BAD_SPECS)])
def test_bad_specs_fail_with_one_line_naming_the_file_and_key(tmp_path, text, key, message):
    path = _write(tmp_path, "bad", text)
    with pytest.raises(ConfigError) as info:
        search_space.load(str(path))
    line = str(info.value)
    assert "\n" not in line
    assert line.startswith(f"{path}: {key}: " if key else f"{path}: "), line
    assert message in line, line


EXPERIMENT = "arms:\n  a: {label: A, overrides: [drafter=eagle3]}\n  b: {overrides: [drafter=eagle31]}\n"
# the same for experiments (lab/sweep/spec_schema.py's ExperimentSpec)
BAD_EXPERIMENTS = [
    (
        EXPERIMENT + "seed: [1]\n",
        "seed",
        "unknown key; allowed: arms, baseline, description, figures, overrides, seeds",
    ),
    ("arms:\n  a: {label: A, overide: [drafter=eagle3]}\n", "arms.a.overide", "unknown key; allowed: label, overrides"),
    (EXPERIMENT + "seeds: [1, 1]\n", "seeds", SEEDS + ", got [1, 1]"),
    (EXPERIMENT + "seeds: []\n", "seeds", SEEDS + ", got []"),
    (EXPERIMENT + "seeds: [0, x]\n", "seeds", SEEDS + ", got [0, 'x']"),
    (EXPERIMENT + "overrides: train.steps=3\n", "overrides", "expected a list of key=value overrides"),
    ("arms:\n  a: drafter=eagle3\n", "arms.a", "expected {label: ..., overrides: [key=value, ...]}, got 'drafter"),
    ("arms:\n  a: {overrides: drafter=eagle3}\n", "arms.a.overrides", "expected a list of key=value overrides"),
    ("arms: {}\n", "arms", "expected a non-empty mapping of arm name -> {label, overrides}, got {}"),
    ("description: no arms\n", "arms", "expected a non-empty mapping of arm name -> {label, overrides}, got nothing"),
    (EXPERIMENT + "baseline: c\n", "baseline", "expected one of the arms (a, b), got 'c'"),
    (EXPERIMENT + "figures: al_vs_depth\n", "figures", "expected a list of distinct figure names, got 'al_vs_depth'"),
]


@pytest.mark.parametrize(
    "text,key,message", BAD_EXPERIMENTS, ids=[f"{c[1]}-{i}" for i, c in enumerate(BAD_EXPERIMENTS)]
)
def test_bad_experiments_fail_with_one_line_naming_the_file_and_key(tmp_path, text, key, message):
    (tmp_path / "bad.yaml").write_text(text)
    with pytest.raises(ConfigError) as info:
        experiment.load("bad", tmp_path)
    line = str(info.value)
    assert "\n" not in line and line.startswith(f"experiments/bad.yaml: {key}: "), line
    assert message in line, line


def test_a_good_experiment_takes_the_schemas_defaults(tmp_path):
    (tmp_path / "good.yaml").write_text(EXPERIMENT)
    exp = experiment.load("good", tmp_path)
    assert [(a.name, a.label) for a in exp.arms] == [("a", "A"), ("b", "b")]
    assert exp.seeds == [0, 1, 2] and exp.baseline == "a" and exp.overrides == [] and exp.figures == []
    with pytest.raises(ConfigError, match="^--seeds: expected distinct integers"):
        experiment.load("good", tmp_path, seeds_arg="1,1")
    sweep = exp.as_sweep([])
    assert (sweep.heartbeat_s, sweep.grace_s, sweep.max_retry) == (20.0, 120.0, 2)  # the sweep schema's defaults


def test_bad_points_and_objectives_fail_before_any_run(tmp_path, micro_overrides):
    with pytest.raises(ConfigError, match="unknown sweep 'nope'; available: pareto_al_drift"):
        search_space.load("nope")
    path = _write(tmp_path, "s", "space: {drafter.fc_norm: [none, both]}\nobjectives: [eval/in_dist/ref/k3/al]\n")
    with pytest.raises(ConfigError, match="point 'fc_norm=both': drafter.fc_norm"):
        search_space.load(str(path)).check(micro_overrides)
    path = _write(tmp_path, "s", "space: {train.lr: [0.001]}\nobjectives: [eval/long_context/ref/k3/al]\n")
    with pytest.raises(ConfigError, match="needs suite 'long_context' in eval.suites"):
        search_space.load(str(path)).check(micro_overrides)
    path = _write(tmp_path, "s", "space: {train.lr: [0.001]}\nobjectives: [drift/in_dist/k9/sink_mass]\n")
    with pytest.raises(ConfigError, match="needs k=9 in eval.num_speculative_tokens"):
        search_space.load(str(path)).check(micro_overrides)
    with pytest.raises(ConfigError, match="train.lr: swept by"):
        search_space.load(str(path)).check([*micro_overrides, "train.lr=0.1"])
    path = _write(tmp_path, "s", "space: {train.lr: [0.001]}\nobjectives: [x]\nseeds: [0, 1]\ntrials: 3\n")
    with pytest.raises(ConfigError, match="use a multiple of 2"):
        search_space.load(str(path)).budget()


def test_study_identity_ignores_budget_and_placement():
    sweep = search_space.load("tpe_eagle3")
    key = sweep.key(["profile=micro"])
    assert sweep.key(["profile=micro", "threads=1", "tracking.uri=sqlite:///x.db"]) == key
    assert sweep.key(["profile=micro", "train.steps=9"]) != key
    sweep.trials = 99
    assert sweep.key(["profile=micro"]) == key
    assert redact("postgresql://me:secret@db:5432/optuna") == "postgresql://me:***@db:5432/optuna"


def test_an_edited_profile_makes_another_study(tmp_path, monkeypatch):
    """The same overrides name the profile, but it now trains otherwise: the study's runs must not mix."""
    import shutil

    from lab.config import composition
    from lab.sweep import experiment

    configs = tmp_path / "configs"
    shutil.copytree(composition.CONFIG_DIR, configs)
    monkeypatch.setattr(composition, "CONFIG_DIR", configs)
    extra = ["profile=micro"]
    sweep = experiment.load("drift_2x2").as_sweep(extra)
    key = sweep.key(extra)
    assert sweep.key(extra) == key
    profile = configs / "profile" / "micro.yaml"
    original = profile.read_text()
    has_train = "\ntrain:\n" in original  # the profile's own train block takes the key, or a new one holds it
    profile.write_text(
        original.replace("\ntrain:\n", "\ntrain:\n  steps: 7\n") if has_train else original + "train:\n  steps: 7\n"
    )
    assert sweep.key(extra) != key
    drafter = configs / "drafter" / "eagle31.yaml"  # one arm's config group
    profile.write_text(original)
    assert sweep.key(extra) == key
    drafter.write_text(drafter.read_text() + "num_layers: 2\n")
    assert sweep.key(extra) != key


# ------------------------------------------------------------------------------- real sweeps (micro target)


def _store(tmp_path: Path, micro_overrides: list[str]) -> list[str]:
    """The session's micro target and cache, a fresh MLflow store and journal for this test."""
    return [
        *micro_overrides,
        *FAST,
        f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}",
        f"tracking.artifact_root={tmp_path / 'artifacts'}",
    ]


def _launch(sweep: Sweep, extra: list[str], **kwargs):
    """The sweep of a spec file, its worker subprocesses given the same file."""
    return launch(sweep, extra, ["sweep", "worker", f"sweep={sweep.source}"], progress=False, **kwargs)


def _study(sweep: Sweep, extra: list[str]) -> optuna.Study:
    return optuna.load_study(study_name=sweep.study_name(extra), storage=storage.open_storage(_journal(extra)))


def _journal(extra: list[str]) -> str:
    db = _uri(extra).split("sqlite:///", 1)[1]
    return str(Path(db).parent / "optuna.journal")


def _slots(study: optuna.Study) -> list[tuple[int, int]]:
    done = study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    return [(t.user_attrs["point"], t.user_attrs["seed"]) for t in done]


def _children(extra: list[str], parent: str) -> list:
    return track.child_runs(_uri(extra), parent)


def _uri(extra: list[str]) -> str:
    return [o for o in extra if o.startswith("tracking.uri=")][-1].split("=", 1)[1]


@pytest.mark.slow
def test_grid_covers_every_point_and_seed_once_then_resumes_without_rerunning(tmp_path, micro_overrides):
    path = _write(
        tmp_path,
        "grid",
        "space: {drafter.fc_norm: [none, per_layer]}\nsampler: grid\nseeds: [0, 1]\n"
        "objectives: [eval/in_dist/ref/k3/al]\n",
    )
    sweep, extra = search_space.load(str(path)), _store(tmp_path, micro_overrides)
    first = _launch(sweep, extra)
    assert first.counts["complete"] == 4 and first.ran == 4
    study = _study(sweep, extra)
    assert sorted(_slots(study)) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    runs = _children(extra, first.parent_run_id)
    assert len(runs) == 4 and all(r.info.status == "FINISHED" for r in runs)
    by_trial = {t.number: t for t in study.trials}
    for run in runs:  # the trial knows its run, the run knows its trial; params and tags match
        trial = by_trial[int(run.data.tags["trial"])]
        assert trial.user_attrs["mlflow_run_id"] == run.info.run_id
        assert run.data.params["drafter.fc_norm"] == trial.params["drafter.fc_norm"]
        assert run.data.tags["seed"] == str(trial.user_attrs["seed"]) and run.data.tags["study"] == "grid"
        assert run.data.tags["trial_state"] == "COMPLETE"
        assert trial.values[0] == pytest.approx(run.data.metrics["eval/in_dist/ref/k3/al"])
    assert "Best trial" in first.summary and "Hidden-state cache" in first.summary
    again = _launch(sweep, extra)
    assert again.parent_run_id == first.parent_run_id and again.ran == 0
    assert len(_study(sweep, extra).trials) == 4 and len(_children(extra, first.parent_run_id)) == 4


@pytest.mark.parametrize("workers", [1, 2])
def test_worker_subprocesses_start_after_the_shared_caches_are_warm_on_every_core(
    tmp_path, micro_overrides, monkeypatch, workers
):
    """With workers beside it, the launcher first builds the first trial's caches on every core (`threads`
    unset), then starts them on their shares; a lone worker builds them in its own trial."""
    calls: list[tuple] = []

    class Started(Exception):
        pass

    def started(worker_args, extra, threads, count, gpus=None):
        calls.append(("worker_subprocesses", threads, count))
        raise Started

    monkeypatch.setattr(engine, "warm_caches", lambda cfg, progress: calls.append(("warm", cfg.threads)) or {})
    monkeypatch.setattr(engine, "worker_subprocesses", started)
    spec_text = "space: {train.lr: [1.0e-3, 2.0e-3]}\nsampler: grid\nobjectives: [eval/in_dist/ref/k3/al]\n"
    sweep = search_space.load(str(_write(tmp_path, "warm", spec_text)))
    extra = [o for o in _store(tmp_path, micro_overrides) if not o.startswith("threads=")]
    with pytest.raises(Started):
        _launch(sweep, extra, workers=workers)
    share = max(1, (os.cpu_count() or 1) // 2)
    assert calls == (
        [("worker_subprocesses", None, 0)] if workers == 1 else [("warm", None), ("worker_subprocesses", share, 1)]
    )


@pytest.mark.slow
def test_two_workers_share_one_journal_study_without_duplicates(tmp_path, micro_overrides, monkeypatch):
    path = _write(
        tmp_path,
        "two",
        "space:\n  train.lr: {low: 1.0e-3, high: 1.0e-2, log: true}\n  drafter.norm_output: [false, true]\n"
        "sampler: {name: random, seed: 0}\ntrials: 6\nobjectives:\n  - eval/in_dist/ref/k3/al\n"
        "  - {metric: drift/in_dist/k3/norm_growth, direction: minimize}\n",
    )
    sweep, extra = search_space.load(str(path)), _store(tmp_path, micro_overrides)
    _first_trial_waits_for_another_worker(monkeypatch, sweep, extra)
    result = _launch(sweep, extra, workers=2)
    study = _study(sweep, extra)
    assert result.counts["complete"] == 6 and len(study.trials) == 6
    assert sorted(_slots(study)) == [(p, 0) for p in range(6)]  # every slot once
    assert len({t.user_attrs["worker"] for t in study.trials}) == 2  # both workers ran trials
    assert all(len(t.values) == 2 for t in study.trials)  # two objectives
    runs = _children(extra, result.parent_run_id)
    assert sorted(int(r.data.tags["trial"]) for r in runs) == list(range(6))
    assert len({r.data.params["train.lr"] for r in runs}) == 6 and "Pareto front" in result.summary


def _first_trial_waits_for_another_worker(monkeypatch, sweep: Sweep, extra: list[str], timeout: float = 600) -> None:
    """The launcher's own worker starts its first trial's run once the subprocess worker has taken a trial: how
    fast a subprocess starts beside the launcher's first trial then decides nothing."""
    import lab.sweep.trial as trial_module

    real, waited = trial_module.run_one, []

    def run_one(*args, **kwargs):
        if not waited:
            waited.append(True)
            deadline = time.time() + timeout
            while time.time() < deadline:
                workers = {t.user_attrs.get("worker") for t in _study(sweep, extra).trials} - {None}
                if len(workers) > 1:
                    break
                time.sleep(0.2)
        return real(*args, **kwargs)

    monkeypatch.setattr(trial_module, "run_one", run_one)


class Piecemeal(io.StringIO):
    """A stream that takes each write a character at a time, letting other threads run between them: two writers
    without a common lock would run their lines together."""

    def write(self, text: str) -> int:
        for char in text:
            super().write(char)
            time.sleep(0)
        return len(text)


def test_records_and_forwarded_lines_from_many_threads_never_run_together(monkeypatch):
    """The launcher logs its own trials while its worker subprocesses' lines are forwarded from other threads
    (lab/sweep/workers.py): each record and each forwarded line comes out whole, one write under one lock."""
    out = Piecemeal()
    monkeypatch.setattr(sys, "stderr", out)
    log = logging.getLogger("lab.sweep.trial")
    forwarded = "2026-12-02 02:41:07 INFO    [worker 1] lab.sweep.trial: trial 1 (eagle31, seed 0): data"

    def records() -> None:
        for i in range(20):
            log.info(f"trial 0 (eagle3, seed 0): step {i}")

    def forwards() -> None:
        for _ in range(20):
            logs.forward(forwarded + "\n", "1", "lab.sweep.workers")

    threads = [threading.Thread(target=f) for f in (records, forwards, records, forwards)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = out.getvalue().splitlines()
    assert len(lines) == 80 and lines.count(forwarded) == 40
    assert logged(out.getvalue()).count("trial 0 (eagle3, seed 0): step 7") == 2


def test_worker_subprocesses_forward_each_line_naming_its_worker(capsys):
    """A worker's lines that are not its own records (its command's output: here its help) are forwarded as the
    launcher's records that name the worker; the launcher's own lines name it worker 0."""
    with worker_subprocesses(["--help"], [], None, 1), logs.as_worker("0"):
        logging.getLogger("lab.sweep.engine").info("a stage line")
    err = capsys.readouterr().err.splitlines()
    assert any(re.fullmatch(r"\S+ \S+ INFO    \[worker 0\] lab.sweep.engine: a stage line", line) for line in err)
    assert any(re.match(r"\S+ \S+ INFO    \[worker 1\] lab.sweep.workers: usage: lab", line) for line in err)
    assert all(re.match(r"\S+ \S+ INFO    \[worker [01]\] ", line) for line in err), err


@pytest.mark.slow
def test_killed_sweep_resumes_to_exactly_its_total_budget(tmp_path, micro_overrides, micro_target):
    # micro_target: the target is built before the sweep starts, so the kill waits on trials alone
    path = _write(
        tmp_path,
        "resume",
        "space: {train.lr: {low: 1.0e-3, high: 1.0e-2, log: true}}\nsampler: {name: tpe, seed: 0}\n"
        "trials: 3\nobjectives: [eval/in_dist/ref/k3/al]\n",
    )
    sweep, extra = search_space.load(str(path)), _store(tmp_path, micro_overrides)
    cmd = [sys.executable, "-m", "lab.cli", "sweep", f"sweep={path}", "--no-progress", *extra]
    log, held = open(tmp_path / "killed.log", "w"), tmp_path / "held"
    # the third trial's training waits after its first step (its MLflow run open) until killed, however fast
    # the machine is: polling for that moment raced a fast third trial on a loaded machine
    env = hold_training(dict(os.environ), 1, held, call=3)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        wait_held(proc, held, tmp_path / "killed.log")
        trials = _study(sweep, extra).trials
        assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE", "RUNNING"]
        assert "mlflow_run_id" in trials[2].user_attrs
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    killed = next(t for t in _study(sweep, extra).trials if t.state == optuna.trial.TrialState.RUNNING)

    resumed = _launch(sweep, extra)
    study = _study(sweep, extra)
    states = [t.state.name for t in study.trials]
    assert states.count("COMPLETE") == 3 and states.count("FAIL") == 1 and len(states) == 4
    retry = next(t for t in study.trials if t.system_attrs.get("failed_trial") == killed.number)
    assert retry.params == killed.params and retry.state.name == "COMPLETE"  # the same point, run again
    assert sorted(_slots(study)) == [(p, 0) for p in range(3)]
    runs = _children(extra, resumed.parent_run_id)
    dead = next(r for r in runs if r.info.run_id == killed.user_attrs["mlflow_run_id"])
    assert dead.info.status == "FAILED"  # the killed worker's run does not stay RUNNING forever

    more = _launch(sweep, extra, trials=4)
    assert more.parent_run_id == resumed.parent_run_id and more.ran == 1 and more.counts["complete"] == 4
    assert _launch(sweep, extra, trials=4).ran == 0


@pytest.mark.slow
def test_a_clearly_worse_trial_is_pruned(tmp_path, micro_overrides):
    path = _write(
        tmp_path,
        "prune",
        "space: {train.lr: [5.0e-3, 1.0e-7]}\nsampler: grid\n"
        "pruner: {name: median, n_startup_trials: 1, n_warmup_steps: 10, interval_steps: 1}\n"
        "objectives: [eval/in_dist/ref/k3/al]\n",
    )
    extra = [*_store(tmp_path, micro_overrides), "train.steps=40", "train.log_every=5"]
    sweep = search_space.load(str(path))
    result = _launch(sweep, extra)
    good, bad = sorted(_study(sweep, extra).trials, key=lambda t: t.number)
    assert good.state.name == "COMPLETE" and bad.state.name == "PRUNED" and result.counts["pruned"] == 1
    assert max(bad.intermediate_values) < 40  # stopped early
    run = next(r for r in _children(extra, result.parent_run_id) if r.data.tags["trial"] == str(bad.number))
    assert (
        run.info.status == "KILLED"
        and run.data.tags["trial_state"] == "PRUNED"
        and "pruned" in run.data.tags["stopped"]
    )
    assert "eval/in_dist/ref/k3/al" not in run.data.metrics


@pytest.mark.slow
def test_an_rdb_storage_by_override_holds_the_study(tmp_path, micro_overrides):
    path = _write(
        tmp_path, "rdb", "space: {train.lr: [0.003, 0.005]}\nsampler: grid\nobjectives: [eval/in_dist/ref/k3/al]\n"
    )
    url = f"sqlite:///{tmp_path / 'optuna.db'}"  # any SQLAlchemy URL: postgresql://... the same way
    sweep, extra = search_space.load(str(path)), [*_store(tmp_path, micro_overrides), f"tracking.optuna_storage={url}"]
    result = _launch(sweep, extra)
    assert result.storage == url and result.counts["complete"] == 2
    study = optuna.load_study(study_name=result.study_name, storage=url)
    assert [t.state.name for t in study.trials] == ["COMPLETE", "COMPLETE"]
    assert not Path(_journal(extra)).exists()  # nothing went to the default journal


def _queued(tmp_path: Path, micro_overrides: list[str], text: str) -> tuple[Sweep, list[str], storage.Session]:
    """A grid sweep's study (`text` adds to the grid and its objective) with its slots queued, none taken."""
    path = _write(tmp_path, "queued", text + "sampler: grid\nobjectives: [eval/in_dist/ref/k3/al]\n")
    sweep, extra = search_space.load(str(path)), _store(tmp_path, micro_overrides)
    s = storage.open_session(sweep, extra, sweep.check(extra), create=True)
    queue.top_up(s, sweep.budget())
    return sweep, extra, s


@pytest.mark.slow
def test_a_trial_whose_remote_worker_went_silent_is_retried_after_the_grace_period(tmp_path, micro_overrides):
    sweep, extra, s = _queued(tmp_path, micro_overrides, "space: {train.lr: [0.003]}\nheartbeat_s: 1\ngrace_s: 3\n")
    # a worker on another machine took the only trial, stamped one heartbeat, and went silent
    taken = adapter.claim(s.study, s.storage, s.trials()[0])
    assert taken is not None
    adapter.set_user_attr(s.storage, taken, "worker", "another-host:4242")
    adapter.set_user_attr(s.storage, taken, "heartbeat", time.time())
    started = time.time()
    result = _launch(sweep, extra)
    trials = sorted(_study(sweep, extra).trials, key=lambda t: t.number)
    assert [t.state.name for t in trials] == ["FAIL", "COMPLETE"] and result.counts["complete"] == 1
    assert trials[1].system_attrs["failed_trial"] == 0 and "another-host:4242" in trials[0].user_attrs["error"]
    assert time.time() - started >= 3  # not before the grace period


def test_a_retried_trial_is_taken_before_the_slots_still_waiting(tmp_path, micro_overrides):
    sweep, _, s = _queued(tmp_path, micro_overrides, "space: {train.lr: [0.001, 0.002, 0.003]}\n")
    first = queue.pop(s)
    assert first is not None and first.number == 0
    with s.lock():
        assert adapter.fail_if_running(s.storage, first, "worker stopped")
    assert queue.retry(s, first, sweep.max_retry)
    again = queue.pop(s)  # the retry (trial 3), not trial 1
    assert again is not None and again.number == 3
    assert adapter.retry_history(s.storage, again) == [0] and again.user_attrs["point"] == 0
    assert [queue.pop(s).number for _ in range(2)] == [1, 2] and queue.pop(s) is None


@pytest.mark.slow
def test_each_sampled_point_runs_once_per_seed(tmp_path, micro_overrides):
    path = _write(
        tmp_path,
        "seeds",
        "space: {train.lr: {low: 1.0e-3, high: 1.0e-2, log: true}}\nsampler: {name: random, seed: 0}\n"
        "seeds: [0, 1]\ntrials: 4\nobjectives: [eval/in_dist/ref/k3/al]\n",
    )
    sweep, extra = search_space.load(str(path)), _store(tmp_path, micro_overrides)
    result = _launch(sweep, extra)
    study = _study(sweep, extra)
    trials = study.trials
    assert result.counts["complete"] == 4 and sorted(_slots(study)) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for point in (0, 1):  # both seeds of a point share its sampled params and its MLflow arm
        pair = [t for t in trials if t.user_attrs["point"] == point]
        assert pair[0].params == pair[1].params and pair[0].user_attrs["arm"] == pair[1].user_attrs["arm"]
    assert len({t.params["train.lr"] for t in trials}) == 2  # two points, each run twice


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_stops_a_sweep_cleanly_and_the_rerun_finishes_it(signum, tmp_path, micro_overrides):
    """Ctrl-C in its terminal, or a scheduler's SIGTERM to the job's process group: the interrupted trial is queued
    again at once (no heartbeat grace), its run KILLED naming the signal, the command exits 128 + the signal."""
    path = _write(
        tmp_path, "ctrlc", "space: {train.lr: [0.003, 0.005]}\nsampler: grid\nobjectives: [eval/in_dist/ref/k3/al]\n"
    )
    sweep, extra = search_space.load(str(path)), [*_store(tmp_path, micro_overrides), "train.steps=40"]
    cmd = [sys.executable, "-m", "lab.cli", "sweep", f"sweep={path}", "--no-progress", *extra]
    log, held = tmp_path / "ctrlc.log", tmp_path / "held"
    # the first trial's training waits after step 5 until interrupted: the interrupt lands mid-training however
    # fast the machine is (tests/hold/sitecustomize.py)
    env = hold_training(dict(os.environ), 5, held)
    proc = subprocess.Popen(
        cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True, env=env, preexec_fn=default_sigint
    )
    try:
        wait_held(proc, held, log)
        os.killpg(proc.pid, signum)  # what Ctrl-C in its terminal does, or scancel to a job
        assert proc.wait(timeout=120) == 128 + signum, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    name = signal.Signals(signum).name
    assert log.read_text().strip().splitlines()[-1] == f"error: interrupted ({name})"
    stopped = _study(sweep, extra).trials
    assert [t.state.name for t in stopped] == ["FAIL", "WAITING", "WAITING"]  # the interrupted one queued again
    assert stopped[0].user_attrs["error"] == f"interrupted ({name})" and stopped[2].params == stopped[0].params
    killed_run = stopped[0].user_attrs["mlflow_run_id"]

    resumed = _launch(sweep, extra)
    study = _study(sweep, extra)
    assert resumed.counts["complete"] == 2 and sorted(_slots(study)) == [(0, 0), (1, 0)]
    runs = {r.info.run_id: r for r in _children(extra, resumed.parent_run_id)}
    assert runs[killed_run].info.status == "KILLED" and runs[killed_run].data.tags["lab.signal"] == name
    assert len(runs) == 3
    assert sorted(r.info.status for r in runs.values()) == ["FINISHED", "FINISHED", "KILLED"]
    parent = track.get_run(f"sqlite:///{tmp_path / 'mlflow.db'}", resumed.parent_run_id)
    assert parent.info.status == "FINISHED" and "lab.signal" not in parent.data.tags  # the stop is over


@pytest.mark.slow
def test_a_non_finite_loss_fails_its_trial_with_the_reason_and_the_sweep_goes_on(tmp_path, micro_overrides):
    path = _write(
        tmp_path, "nan", "space: {train.lr: [1.0e30, 0.003]}\nsampler: grid\nobjectives: [eval/in_dist/ref/k3/al]\n"
    )
    sweep, extra = search_space.load(str(path)), _store(tmp_path, micro_overrides)
    result = _launch(sweep, extra)
    blown, good = sorted(_study(sweep, extra).trials, key=lambda t: t.number)
    assert (blown.state.name, good.state.name) == ("FAIL", "COMPLETE") and result.counts["failed"] == 1
    assert blown.user_attrs["error"].startswith("FloatingPointError: non-finite training loss at step")
    run = next(r for r in _children(extra, result.parent_run_id) if r.info.run_id == blown.user_attrs["mlflow_run_id"])
    assert run.info.status == "FAILED" and run.data.tags["error"] == blown.user_attrs["error"]
    assert blown.number not in adapter.retried(_study(sweep, extra).trials)  # a deterministic failure is not retried
    assert _launch(sweep, extra).ran == 0  # nor rerun by a rerun


@pytest.mark.slow
def test_queue_only_then_a_worker_finishes_the_study_and_ends_its_parent(tmp_path, micro_overrides, micro_target):
    # micro_target: the session's target built under the stated threads, not by this study's worker at all cores
    path = _write(
        tmp_path, "queue", "space: {train.lr: [0.003]}\nsampler: grid\nobjectives: [eval/in_dist/ref/k3/al]\n"
    )
    sweep = search_space.load(str(path))
    # without threads=: the queue-only launch divides no cores among its zero workers
    extra = [o for o in _store(tmp_path, micro_overrides) if not o.startswith("threads=")]
    queued = _launch(sweep, extra, workers=0)
    assert queued.counts["waiting"] == 1 and queued.ran == 0 and "stays RUNNING" in queued.summary
    assert track.get_run(_uri(extra), queued.parent_run_id).info.status == "RUNNING"

    engine.join(sweep, extra, progress=False)  # `lab sweep worker`, started on its own
    parent = track.get_run(_uri(extra), queued.parent_run_id)
    assert parent.info.status == "FINISHED" and parent.data.metrics["sweep/complete"] == 1
    again = _launch(sweep, extra, workers=0)  # nothing left to queue: the parent does not stay open
    assert again.counts["complete"] == 1 and "1 complete" in again.summary
    assert track.get_run(_uri(extra), queued.parent_run_id).info.status == "FINISHED"
