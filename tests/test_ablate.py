"""Experiments compose for every arm x seed; `lab ablate` runs them as a grid study of the sweep engine,
children of one parent run, and resumes without rerunning what finished."""

from __future__ import annotations

import pytest

from lab import track
from lab.config import ConfigError
from lab.config.composition import compose
from lab.sweep import experiment
from lab.sweep.engine import launch


@pytest.mark.parametrize("name", experiment.available())
def test_every_experiment_composes(name):
    exp = experiment.load(name)
    sweep = exp.as_sweep([])
    configs = [sweep.check([])] + [compose(sweep.trial_overrides(p, s, [])) for p in sweep.points() for s in exp.seeds]
    assert len(exp.seeds) >= 3 and sweep.budget() == len(exp.arms) * len(exp.seeds)
    assert exp.baseline in {a.name for a in exp.arms}
    assert {cfg.arm for cfg in configs} == {a.name for a in exp.arms}
    assert all(cfg.study == name for cfg in configs)


def test_shipped_experiments_cover_the_paper():
    assert {
        "drift_2x2",
        "norm_type",
        "depth_extrapolation",
        "long_context",
        "template_robustness",
        "attention_2x2",
    } <= set(experiment.available())
    arms = {a.name: a.overrides for a in experiment.load("drift_2x2").arms}
    assert len(arms) == 4


def test_bad_experiments_fail_with_one_line(tmp_path):
    with pytest.raises(ConfigError, match="unknown experiment 'nope'; available: attention_2x2, depth_extrapolation"):
        experiment.load("nope")
    (tmp_path / "bad.yaml").write_text("arms:\n  a:\n    overrides: [drafter.fc_norm=both]\n")
    with pytest.raises(ConfigError, match="experiments/bad.yaml point 'a': drafter.fc_norm"):
        experiment.load("bad", tmp_path).as_sweep([])
    (tmp_path / "typo.yaml").write_text("arms:\n  a: {overrides: []}\nseed: [1]\n")
    with pytest.raises(ConfigError, match="typo.yaml: seed: unknown key"):
        experiment.load("typo", tmp_path)


@pytest.mark.slow
def test_ablate_runs_every_arm_and_seed_once_and_resumes(micro_study):
    first, uri, extra = micro_study.result, micro_study.uri, micro_study.extra
    assert first.ran == 4 and first.counts["complete"] == 4
    children = track.child_runs(uri, first.parent_run_id, status="FINISHED")
    assert sorted((r.data.tags["arm"], r.data.tags["seed"]) for r in children) == [
        ("e3", "0"),
        ("e3", "1"),
        ("e31", "0"),
        ("e31", "1"),
    ]
    assert all(r.data.tags["study"] == "tiny" and "eval/in_dist/ref/k3/al" in r.data.metrics for r in children)
    rep = micro_study.report
    table = rep.main_table()
    assert table.count("| EAGLE 3.1 | 2 |") == 1 and "| EAGLE-3 | 2 |" in table  # n = 2 seeds per arm
    assert "× [" in table  # the ratio to the baseline, with its paired bootstrap interval
    assert "over 2 prompts × 2 seeds per cell" in table  # eval.num_prompts=2, seeds 0 and 1
    # the runs validated while training (profile=micro): the proxies against the exact AL, the AL curves
    assert [t.name for t in rep.tables] == ["al", "acceptance", "drift", "rollout", "proxy_bias"]
    figures = {"al_vs_depth", "accept_rate", "sink_self_mass", "norm_growth", "al_curve", "al_ratio_vs_k"}
    assert {f.name for f in rep.figures} >= figures
    sweep = micro_study.experiment.as_sweep(extra)
    again = launch(sweep, extra, ["ablate", "worker", "experiment=tiny"], progress=False)
    assert again.parent_run_id == first.parent_run_id
    assert again.ran == 0 and again.counts["complete"] == 4
    assert len(track.child_runs(uri, first.parent_run_id)) == 4
