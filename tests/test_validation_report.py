"""The validation pass in the reports, from MLflow alone: on a store with planted validation records the
`proxy_bias` table gives the known gaps, rank agreement and picks, `al_curve` and `al_ratio_vs_k` are drawn,
`lab paper`'s checkpoint claim says which proxy picks the exact best; a run that did not finish is drawn as far as
it got, marked unfinished, and a study with no finished run at all still reports its curves. Then a real study
killed in the middle of its training reports its curves marked unfinished."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import hold_training, wait_held

from lab import track
from lab.cli import main
from lab.report import load, paper
from lab.report import tables as tab_mod

KS = [3, 8]
STEPS = [10, 20, 30]
PROMPTS = 6
# per checkpoint: the exact AL at every k, the teacher-forced marginal agreement at depth 1 and the whole chain's
EXACT, MARGINAL, CHAIN = [2.0, 2.4, 2.2], [0.5, 0.6, 0.7], [0.3, 0.45, 0.4]
ARMS = {"eagle3": 0.0, "eagle31": 0.3}  # exact AL offset per arm


def _prompts(al: float, marginal: float, chain: float) -> list[dict]:
    """Alike prompts of 10 rounds each at every k with AL `al`; teacher-forced hits at depth 1 only."""
    tf = {"hits": [100 * marginal] + [0] * 7, "full": [100 * chain] + [0] * 7, "prior": [100] * 8, "counted": [100] * 8}
    k = {str(d): {"rounds": 10, "accepted": round(10 * (al - 1))} for d in range(1, 9)}
    k["8"]["accepted_at"] = [0] * 8
    return [{"index": i, "id": f"v{i}", "k": k, "tf": tf} for i in range(PROMPTS)]


def _log_run(uri: str, art: str, parent: str, arm: str, seed: int, passes: int, status: str = "FINISHED") -> None:
    tags = {"study": "drift_2x2", "arm": arm, "seed": seed, "git_commit": "abc123", "config_hash": f"h{arm}{seed}"}
    tags["trial_state"] = "COMPLETE" if status == "FINISHED" else "FAIL"
    params = {"eval.suites": json.dumps(["in_dist"]), "eval.num_speculative_tokens": json.dumps(KS)}
    params |= {"eval.backends": json.dumps(["ref"]), "target.name": "tiny_code", "train.select_k": "None"}
    checkpoints = [
        {"step": s, "train_tokens": s * 1024, "prompts": _prompts(EXACT[j] + ARMS[arm], MARGINAL[j], CHAIN[j])}
        for j, s in enumerate(STEPS[:passes])
    ]
    with track.start_run(uri, art, "drift_2x2", f"{arm}-{seed}", tags, parent_run_id=parent) as run:
        run.log_params(params)
        for j, s in enumerate(STEPS[:passes]):
            metrics = {"val/train_tokens": s * 1024.0}
            metrics |= {f"val/k{k}/al": EXACT[j] + ARMS[arm] for k in KS}
            run.log_metrics(metrics, s)
        if status == "FINISHED":
            run.log_metrics({f"eval/in_dist/ref/k{k}/al": 2.0 + ARMS[arm] for k in KS})
        doc = {"format": 1, "suite": "val", "seed": seed, "ks": list(range(1, 9)), "depth": 8}
        run.log_dict({**doc, "checkpoints": checkpoints}, "per_prompt/val.json")
        if status != "FINISHED":
            run.end_status = status


def _study(root: Path, finished: bool) -> tuple[str, str, str]:
    uri, art = f"sqlite:///{root / 'mlflow.db'}", str(root / "artifacts")
    tags = {"study": "drift_2x2", "sweep": "drift_2x2", "optuna_study": "drift_2x2-val", "git_commit": "abc123"}
    tags |= {"study_kind": "ablate", "baseline": "eagle3"}
    with track.parent_run(uri, art, "drift_2x2", "sweep-drift_2x2", "drift_2x2-val", tags) as parent:
        parent.log_params({"sweep.seeds": [0, 1]})
        for arm in ARMS:
            for seed in (0, 1):
                if finished:
                    _log_run(uri, art, parent.id, arm, seed, 3)
            _log_run(uri, art, parent.id, arm, 2, 2, status="KILLED")  # cut short after its second pass
    return uri, art, parent.id


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> tuple[str, str, str]:
    return _study(tmp_path_factory.mktemp("validation-report"), finished=True)


def _loaded(uri: str, parent: str):
    return load(uri, parent, "drift_2x2", "", [("eagle3", "EAGLE-3"), ("eagle31", "EAGLE 3.1")], "eagle3", [0, 1])


def test_proxy_bias_gives_the_planted_gaps_and_picks(store):
    """simulated_acc_len = the depth-1 agreement here, tau_sim = 1 + the chain's: their gaps to the exact AL at
    k=3 at each checkpoint, Kendall's tau of their order against the exact one's, and whether they pick its best."""
    uri, _, parent = store
    study = _loaded(uri, parent)
    table = tab_mod.proxy_bias_table(study)
    assert [c.label for c in table.columns] == ["step 10", "step 20", "step 30", "Kendall τ", "same best"]
    rows = {(r.group.split(" (")[0], r.arm): r for r in table.rows}
    sim, tau = rows[("simulated_acc_len", "eagle3")], rows[("tau_sim", "eagle3")]
    for j in range(3):
        assert sim.cells[j].mean == pytest.approx(MARGINAL[j] - EXACT[j])
        assert tau.cells[j].mean == pytest.approx(1 + CHAIN[j] - EXACT[j])
        assert sim.cells[j].interval.low == pytest.approx(sim.cells[j].mean)  # alike prompts: no spread
    assert sim.cells[3].mean == pytest.approx(1 / 3) and sim.cells[4].mean == 0.0  # it picks step 30, not 20
    assert tau.cells[3].mean == pytest.approx(1.0) and tau.cells[4].mean == 1.0
    per_prompt = rows[("AL, mean per prompt", "eagle31")]
    assert all(c.mean == pytest.approx(0.0) for c in per_prompt.cells[:3])
    text = tab_mod.markdown(table)
    assert "-1.500 ± 0.000 (**[-1.500, -1.500]**)" in text and "×" not in text.split("\n\n", 1)[1].split("Interval")[0]


def test_the_report_draws_the_curves_and_marks_the_unfinished(store, tmp_path, capsys):
    uri, art, _ = store
    out = tmp_path / "report"
    assert main(["report", "experiment=drift_2x2", "--out", str(out), f"tracking.uri={uri}",
                 f"tracking.artifact_root={art}"]) == 0  # fmt: skip
    names = {p.name for p in (out / "figures").iterdir()}
    assert {"al_curve.png", "al_curve.pdf", "al_ratio_vs_k.png", "al_ratio_vs_k.pdf"} <= names
    assert (out / "tables" / "proxy_bias.md").is_file()
    page = (out / "report.md").read_text()
    assert "Dotted, ending in x: a run that did not finish" in page


def test_a_study_with_no_finished_run_still_reports_its_curves(tmp_path, capsys):
    uri, art, _ = _study(tmp_path / "store", finished=False)
    out = tmp_path / "report"
    assert main(["report", "experiment=drift_2x2", "--out", str(out), f"tracking.uri={uri}",
                 f"tracking.artifact_root={art}"]) == 0  # fmt: skip
    assert sorted(p.name for p in (out / "figures").iterdir()) == ["al_curve.pdf", "al_curve.png"]
    page = (out / "report.md").read_text()
    assert "(no finished runs yet: the figures draw what the runs logged so far)" in page
    assert "Dotted, ending in x: a run that did not finish" in page


def test_the_papers_checkpoint_claim_says_which_proxy_picks_the_exact_best(store):
    uri, _, parent = store
    finding = paper.measure_checkpoints(_loaded(uri, parent))
    assert finding.k == 3 and len(finding.picks) == 8  # 2 arms x 2 seeds x 2 proxies
    assert {(p.proxy, p.proxy_step, p.exact_step) for p in finding.picks} == {
        ("simulated_acc_len", 30, 20),
        ("tau_sim", 20, 20),
    }
    assert finding.verdict() == "disagrees (4 of 8 picks differ)"
    page = paper.markdown([], "claims", "lab paper", finding)
    assert "## A proxy's best checkpoint is the exact best" in page
    assert (
        "tau_sim: the exact best in 4 of 4 runs" in page and "simulated_acc_len: the exact best in 0 of 4 runs" in page
    )


@pytest.mark.slow
def test_a_study_killed_mid_training_reports_its_curves_marked_unfinished(micro_overrides, micro_target, tmp_path):
    """A study (`lab run -m`, two arms) killed with SIGKILL, its whole process group, while its first run trains
    after two validation passes: `lab report` draws that run's curve as far as it got, marked unfinished, from
    MLflow alone (the run itself ended FAILED by the report's opening of the store: its process is gone)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    store = [f"tracking.uri={uri}", f"tracking.artifact_root={tmp_path / 'artifacts'}"]
    swept = ["drafter=eagle3,eagle31", "train.steps=12", "train.val_every=3", "train.resume_every=0"]
    cmd = [sys.executable, "-m", "lab.cli", "run", "-m", *swept, *micro_overrides, *store, "--no-progress"]
    log, held = tmp_path / "study.log", tmp_path / "held"
    with open(log, "w") as out:
        env = hold_training({**os.environ, "TQDM_DISABLE": "1"}, 7, held)  # after the passes at steps 3 and 6
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            wait_held(proc, held, log)
            os.killpg(proc.pid, signal.SIGKILL)
        finally:
            proc.wait()
    report = tmp_path / "report"
    assert main(["report", "multirun=multirun", "--out", str(report), *store]) == 0
    assert sorted(p.name for p in (report / "figures").iterdir()) == ["al_curve.pdf", "al_curve.png"]
    assert "Dotted, ending in x: a run that did not finish" in (report / "report.md").read_text()
    (run,) = [r for r in track.search_runs(uri, "multirun") if "arm" in r.data.tags]
    assert run.info.status == "FAILED"
    assert len(track.metric_curve(uri, run.info.run_id, "val/k3/al")) == 2  # its passes at steps 3 and 6
