"""Hydra's multirun on the sweep engine (lab/sweep/multirun.py): `lab run -m key=a,b seed=0,1` is one study, a
parent run with a child run per arm and seed, resumable by the same command, reported by `lab report
multirun=NAME`; `--cfg job` prints each arm's composed config and starts nothing; what a multirun cannot sweep is
refused in one line."""

from __future__ import annotations

import pytest

from lab import track
from lab.cli import main
from lab.config import ConfigError
from lab.sweep import multirun


def test_the_swept_keys_cross_into_arms_and_seed_into_seeds():
    exp, fixed = multirun.experiment(["drafter=eagle3,eagle31", "train.ttt_length=range(3,5)", "seed=0,1", "x.y=1"])
    assert [a.name for a in exp.arms] == ["eagle3,ttt_length=3", "eagle3,ttt_length=4", "eagle31,ttt_length=3",
                                          "eagle31,ttt_length=4"]  # fmt: skip
    assert exp.arms[3].overrides == ["drafter=eagle31", "train.ttt_length=4"]
    assert (exp.seeds, exp.baseline, fixed, exp.kind) == ([0, 1], "eagle3,ttt_length=3", ["x.y=1"], "multirun")
    # the parent keeps its command: `lab report multirun=NAME` builds the same experiment from it
    again, fixed_again = multirun.from_command(exp.description)
    assert again.arms == exp.arms and again.seeds == exp.seeds and fixed_again == fixed
    exp, _ = multirun.experiment(["train.lr=choice(0.001,0.003)"])
    assert [a.name for a in exp.arms] == ["lr=0.001", "lr=0.003"] and exp.seeds == [0]


@pytest.mark.parametrize(
    ("overrides", "key", "said"),
    [
        (["train.lr=interval(0.001,0.01)"], "train.lr", "run it with a sampler, `lab sweep`"),
        (["drafter=eagle31"], "-m", "sweeps at least one key"),
        (["seed=a,b"], "seed", "expected integers"),
        (["train.steps=[1,2"], "train.steps", "not a valid override"),
    ],
)
def test_what_a_multirun_cannot_sweep_is_refused_in_one_line(overrides, key, said):
    with pytest.raises(ConfigError) as info:
        multirun.experiment(overrides)
    assert str(info.value).startswith(f"{key}: ") and said in str(info.value), str(info.value)


def test_cfg_job_prints_each_arms_config_and_starts_nothing(micro_overrides, capsys):
    assert main(["run", "-m", "drafter=eagle3,eagle31", *micro_overrides, "--cfg", "job"]) == 0
    out = capsys.readouterr().out
    assert out.count("# arm ") == 2 and out.count("\n---\n") == 1
    assert "norm_output: false" in out.split("---")[0] and "norm_output: true" in out.split("---")[1]
    assert main(["run", "--cfg", "job", "drafter=eagle31", *micro_overrides]) == 0
    assert "fc_norm: per_layer" in capsys.readouterr().out


@pytest.mark.slow
def test_a_multirun_is_one_resumable_study_with_its_report(
    micro_overrides, micro_target, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)  # reports/NAME/ lands here
    store = [f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}", f"tracking.artifact_root={tmp_path / 'art'}"]
    argv = ["run", "-m", "drafter=eagle3,eagle31", "seed=0", "train.steps=4", *micro_overrides, *store, "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "multirun multirun: 2 of 2 runs finished (2 in this invocation" in out
    assert (tmp_path / "reports" / "multirun" / "report.md").is_file()
    uri = store[0].split("=", 1)[1]
    (parent,) = track.study_parents(uri, "multirun", "multirun")
    assert parent.data.tags["study_kind"] == "multirun" and parent.data.tags["lab.command"].startswith("lab run -m ")
    children = track.child_runs(uri, parent.info.run_id)
    assert sorted(c.data.tags["arm"] for c in children) == ["eagle3", "eagle31"]
    assert all(c.info.status == "FINISHED" for c in children)
    assert main(argv) == 0  # the same command again: nothing runs twice
    assert "2 of 2 runs finished (0 in this invocation" in capsys.readouterr().out
    assert main(["report", "multirun=multirun", *store, "--out", str(tmp_path / "again")]) == 0
    table = (tmp_path / "again" / "tables" / "al.md").read_text()
    assert "| eagle3 | 1 |" in table and "| eagle31 | 1 |" in table
