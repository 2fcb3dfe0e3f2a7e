"""`lab report` from MLflow alone: a study written into a real MLflow store (the engine's tags and the
pipeline's metric keys, values chosen so the expected table is known) gives the expected tables in
Markdown, LaTeX and CSV, byte-identical on a second run, the figures as PNG and PDF, report.md with the
provenance, and footnotes for runs that failed or were pruned and for missing seeds and arms."""

from __future__ import annotations

import contextlib
import csv
import io
import json
from pathlib import Path

import pytest

from lab import report, track
from lab.cli import main
from lab.report.figures import FIGURES, draw
from lab.report.tables import latex_escape
from lab.sweep import experiment

SUITES = ["in_dist", "template"]
KS = [3, 8]
ARMS = {"eagle3": 0.0, "fc_norm": 0.4, "norm_output": -0.2, "eagle31": 0.6}  # AL offset per arm


def _log_run(uri: str, art: str, parent: str, arm: str, seed: int, fail: str = "") -> None:
    tags = {"study": "drift_2x2", "arm": arm, "seed": seed, "git_commit": "abc123", "config_hash": f"h{arm}{seed}"}
    tags["target"] = "tiny_code-000000000000"
    params = {"eval.suites": json.dumps(SUITES), "eval.num_speculative_tokens": json.dumps(KS)}
    params |= {"eval.backends": json.dumps(["ref"]), "target.name": "tiny_code", "data.template": "chatml"}
    metrics: dict[str, float | list[float]] = {"target/val_loss": 4.5, "drift/fc_share": [0.2, 0.3, 0.5]}
    metrics["eval/in_dist/rollout/acc"] = [0.7 - 0.05 * i + ARMS[arm] / 10 for i in range(9)]
    for s in SUITES:
        for k in KS:
            metrics[f"eval/{s}/ref/k{k}/al"] = 2.0 + ARMS[arm] + 0.1 * seed + (0.5 if k == 8 else 0.0)
            metrics[f"eval/{s}/ref/k{k}/accept_rate"] = [0.8 / (i + 1) + ARMS[arm] / 10 for i in range(k)]
            metrics[f"drift/{s}/k{k}/sink_mass"] = [0.05 - 0.004 * i for i in range(k)]
            metrics[f"drift/{s}/k{k}/self_mass"] = [0.03 * i * (1 - ARMS[arm]) for i in range(k)]
            metrics[f"drift/{s}/k{k}/norm_growth"] = [1.0 + 0.02 * i * (1 - ARMS[arm]) for i in range(k)]
    for t in ["gemma", "llama3"]:
        for k in KS:
            metrics[f"eval/template.{t}/ref/k{k}/al"] = 1.8 + ARMS[arm] + 0.05 * seed
    for c in [1, 4]:
        metrics[f"eval/in_dist/vllm/k3/c{c}/speedup"] = 1.2 + ARMS[arm] - 0.1 * c / 4 + 0.01 * seed
    tags["trial_state"] = {"PRUNED": "PRUNED", "FAILED": "FAIL"}.get(fail, "COMPLETE")
    raised = {"PRUNED": track.RunStopped, "FAILED": RuntimeError}.get(fail)
    with pytest.raises(raised) if raised else contextlib.nullcontext():
        with track.start_run(uri, art, "drift_2x2", f"{arm}-{seed}", tags, parent_run_id=parent) as run:
            run.log_params(params)
            run.log_curves(metrics)
            if fail == "PRUNED":
                raise track.RunStopped("pruned by Optuna at step 10")
            if fail == "FAILED":
                raise RuntimeError("worker died")


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> tuple[list[str], str]:
    """A drift_2x2 study of 2 seeds: eagle31 lacks seed 1 (its run failed), norm_output's seed 1 was
    pruned and then completed on retry."""
    root = tmp_path_factory.mktemp("report")
    uri, art = f"sqlite:///{root / 'mlflow.db'}", str(root / "artifacts")
    tags = {"study": "drift_2x2", "sweep": "drift_2x2", "optuna_study": "drift_2x2-test", "git_commit": "abc123"}
    with track.parent_run(uri, art, "drift_2x2", "sweep-drift_2x2", "drift_2x2-test", tags) as parent:
        parent.log_params({"sweep.seeds": [0, 1]})
        for arm in ARMS:
            for seed in (0, 1):
                if (arm, seed) == ("eagle31", 1):
                    _log_run(uri, art, parent.id, arm, seed, fail="FAILED")
                    continue
                if (arm, seed) == ("norm_output", 1):
                    _log_run(uri, art, parent.id, arm, seed, fail="PRUNED")
                _log_run(uri, art, parent.id, arm, seed)
    return [f"tracking.uri={uri}", f"tracking.artifact_root={art}"], parent.id


def _report(store, out: Path, capsys) -> str:
    overrides, _ = store
    assert main(["report", "experiment=drift_2x2", "--out", str(out), *overrides]) == 0
    return capsys.readouterr().out


def test_report_tables_figures_and_provenance(store, tmp_path, capsys):
    printed = _report(store, tmp_path / "a", capsys)
    tables, figures = tmp_path / "a" / "tables", tmp_path / "a" / "figures"
    assert sorted(p.name for p in tables.iterdir()) == [
        f"{t}.{ext}" for t in ("acceptance", "al", "drift") for ext in ("csv", "md", "tex")
    ]
    al = (tables / "al.md").read_text()
    # EAGLE-3 in_dist k=3: seeds 2.0 and 2.1; + FC norm 2.4 and 2.5 (+19.5%), the best of its column
    assert "| EAGLE-3 | 2 | 2.050 ± 0.071 |" in al
    assert "| + FC norm | 2 | 2.450 ± 0.071 (+19.5%) |" in al
    # EAGLE 3.1 has seed 0 only: the best mean of every column, n = 1
    assert "| EAGLE 3.1 | 1 | **2.600 ± 0.000** (+26.8%) |" in al
    assert "Missing: arm EAGLE 3.1 (eagle31) lacks seed 1." in al
    assert "Left out: 1 failed (eagle31 seed 1); 1 pruned (norm_output seed 1)." in al
    assert printed.startswith("**Acceptance length")
    rows = list(csv.DictReader(io.StringIO((tables / "al.csv").read_text())))
    assert len(rows) == len(ARMS) * len(SUITES) * len(KS)
    best = [r for r in rows if r["best"] == "1"]
    assert {r["arm"] for r in best} == {"eagle31"} and len(best) == len(SUITES) * len(KS)
    tex = (tables / "al.tex").read_text()
    assert r"\toprule" in tex and r"\multicolumn{2}{c}{in\_dist}" in tex and r"\textbf{2.600$\pm$0.000}" in tex
    drift = (tables / "drift.md").read_text()
    assert "| EAGLE-3 | in_dist | 2 | **0.050 ± 0.000** |" not in drift  # all arms tie at step 1: no bold
    assert "| EAGLE 3.1 | in_dist | 1 | 0.050 ± 0.000 | 0.022 ± 0.000 | 0.000 ± 0.000 | **0.084 ± 0.000** |" in drift
    names = {"al_vs_depth", "accept_rate", "sink_self_mass", "norm_growth", "al_per_template", "vllm_speedup"}
    assert {p.name for p in figures.iterdir()} == {f"{n}.{e}" for n in names for e in ("png", "pdf")}
    assert all((figures / f"{n}.png").read_bytes()[:4] == b"\x89PNG" for n in names)
    report = (tmp_path / "a" / "report.md").read_text()
    assert f"parent run `{store[1]}`" in report and "`abc123`" in report and "tiny_code-000000000000" in report
    assert "![al_vs_depth](figures/al_vs_depth.png)" in report and "| eagle31 | 1 |" in report


def test_report_is_deterministic(store, tmp_path, capsys):
    _report(store, tmp_path / "a", capsys)
    _report(store, tmp_path / "b", capsys)
    for name in ("al", "acceptance", "drift"):
        for ext in ("md", "tex", "csv"):
            first, second = (tmp_path / d / "tables" / f"{name}.{ext}" for d in "ab")
            assert first.read_bytes() == second.read_bytes()
    assert (tmp_path / "a" / "report.md").read_bytes() == (tmp_path / "b" / "report.md").read_bytes()


def test_report_errors_are_one_line(store, tmp_path, capsys):
    overrides, _ = store
    assert main(["report", "experiment=long_context", "--out", str(tmp_path), *overrides]) == 2
    assert "no study of 'long_context'" in capsys.readouterr().err
    assert main(["report", "experiment=drift_2x2", "--run", "nope", *overrides]) == 2
    assert "--run: run 'nope': not found" in capsys.readouterr().err


def test_rollout_and_fc_share_figures(store, tmp_path):
    overrides, parent = store
    uri = overrides[0].split("=", 1)[1]
    study = report.load(uri, parent, "drift_2x2", "", [(a, a) for a in ARMS], "eagle3", [0, 1])
    drawn = draw(study, ["rollout_acc", "fc_share"], tmp_path)
    assert [f.name for f in drawn] == ["rollout_acc", "fc_share", "vllm_speedup"]
    assert all(p.stat().st_size > 1000 for f in drawn for p in f.files)


@pytest.mark.parametrize("name", experiment.available())
def test_every_experiment_names_known_figures(name):
    assert set(experiment.load(name).figures) <= set(FIGURES)


def test_latex_escape():
    assert (
        latex_escape("a_b & 5% #1 {x} ~^\\")
        == r"a\_b \& 5\% \#1 \{x\} \textasciitilde{}\textasciicircum{}\textbackslash{}"
    )
