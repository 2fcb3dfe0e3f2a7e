"""`lab paper` from MLflow alone: studies planted in a real store give each claim the verdict its intervals say.
drift_2x2: EAGLE 3.1 1.1 x EAGLE-3's AL prompt by prompt (agrees), no norm growth against EAGLE-3's 1.5
(agrees), the same sink mass (inconclusive), twice the mass on its own tokens (disagrees); template_robustness:
x1.5 on one template, equal on another (mixed); depth_extrapolation: a rollout that holds against one that
falls (agrees, beyond the TTT depth only); attention_2x2: the MLA drafters' EAGLE 3.1 x1.1 (agrees), beside
the Kimi K2.6 card's figures; long_context not run (not measured). Run ids are named and the
page is the same byte for byte on a rerun."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lab import track
from lab.cli import main
from lab.report import paired
from lab.report.paper import CLAIMS, Finding
from lab.sweep import experiment

SUITES, KS, SEEDS, PROMPTS, ROUNDS = ["mtbench", "humaneval"], [3, 8], [0, 1, 2], 30, 20


def _zero_sum(rng: np.random.Generator, scale: float) -> np.ndarray:
    """Noise per prompt that sums to 0: the arm's pooled value stays the planted one."""
    x = rng.uniform(-scale, scale, PROMPTS)
    return x - x.mean()


def _doc(suite: str, seed: int, arm: str, variants: dict[str, float] | None = None, ks: list[int] = KS) -> dict:
    """per_prompt/{suite}.json of a planted run; `variants` gives each variant's AL scale of EAGLE 3.1 (one
    variant of scale 1.1 when None), the prompts split evenly among them."""
    better = "eagle31" in arm
    scales = variants or {"": 1.1}
    names = [v for v in scales for _ in range(PROMPTS // len(scales))]
    difficulty = _zero_sum(np.random.Generator(np.random.PCG64(seed)), 0.4)  # shared by the arms
    rng = np.random.Generator(np.random.PCG64([seed, int(better), SUITES.index(suite) if suite in SUITES else 9]))
    prompts = [{"index": i, "id": f"p{i}", "variant": v, "k": {}} for i, v in enumerate(names)]
    for k in ks:
        scale = np.array([scales[v] if better else 1.0 for v in names])
        al = scale * (1.8 + difficulty) + _zero_sum(rng, 0.05)
        sink = 0.3 + _zero_sum(rng, 0.05)
        for i, p in enumerate(prompts):
            growth = [1.0] * k if better else [1.0 + 0.5 * j / (k - 1) for j in range(k)]
            own = [0.05 * j * (2 if better else 1) for j in range(k)]
            drift = {"sink": [ROUNDS * sink[i]] * k, "self": [ROUNDS * x for x in own]}
            drift |= {"feedback_rms": [ROUNDS * g for g in growth], "count": [ROUNDS] * k}
            p["k"][str(k)] = {
                "rounds": ROUNDS,
                "accepted": (al[i] - 1) * ROUNDS,
                "accepted_at": [0] * k,
                "drift": drift,
            }
    return {"format": 1, "suite": suite, "seed": seed, "ks": ks, "prompts": prompts}


def _rollout(seed: int, arm: str, depth: int = 9) -> dict:
    """per_prompt/rollout.json: EAGLE 3.1 holds 0.5 at every depth, EAGLE-3 falls from 0.5 by 0.05 a step."""
    acc = [0.5 if "eagle31" in arm else 0.5 - 0.05 * d for d in range(depth)]
    return {
        "format": 1,
        "seed": seed,
        "depth": depth,
        "sequences": [{"index": 0, "id": "s0", "hits": [a * 100 for a in acc], "counted": [100] * depth}],
    }


def _plant(
    uri: str, art: str, overrides: list[str], name: str, arms: list[str], suites: list[str], ks: list[int], docs
) -> None:
    sweep = experiment.load(name).as_sweep(overrides)
    tags = {"study": name, "sweep": name, "optuna_study": f"{name}-planted"}
    with track.parent_run(uri, art, sweep.experiment, f"sweep-{name}", sweep.study_name(overrides), tags) as parent:
        for arm in arms:
            for seed in SEEDS:
                run_tags = {"study": name, "arm": arm, "seed": seed, "trial_state": "COMPLETE"}
                with track.start_run(uri, art, sweep.experiment, f"{arm}-{seed}", run_tags, parent.id) as run:
                    run.log_params(
                        {"eval.suites": json.dumps(suites), "eval.num_speculative_tokens": json.dumps(ks)}
                        | {"eval.backends": '["ref"]', "target.name": "smollm2", "data.num_sequences": 2048}
                        | {"train.steps": 40, "train.batch_size": 8, "train.ttt_length": 3}
                    )
                    planted = docs(arm, seed)
                    first = planted[suites[0]]
                    al = paired.pooled(paired.al_counts(first, ks[0]), paired.acceptance_length)
                    run.log_curves({f"eval/{suites[0]}/ref/k{ks[0]}/al": al, "train/acc_0": 0.4})
                    for v in {p["variant"] for doc in planted.values() for p in doc.get("prompts", [])} - {""}:
                        run.log_curves({f"eval/{suites[0]}.{v}/ref/k{ks[0]}/al": al})
                    if "rollout" in planted:
                        acc = [
                            h / c for h, c in zip(planted["rollout"]["sequences"][0]["hits"], [100] * 9, strict=True)
                        ]
                        run.log_curves({"eval/in_dist/rollout/acc": acc})
                    for s, doc in planted.items():
                        run.log_dict(doc, f"per_prompt/{s}.json")


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> list[str]:
    """drift_2x2 on mtbench and humaneval; template_robustness with EAGLE 3.1 x1.5 on one template and equal
    on another; depth_extrapolation (TTT 3) at k = 3 and 5 with its rollout to depth 9."""
    root = tmp_path_factory.mktemp("paper")
    uri, art = f"sqlite:///{root / 'mlflow.db'}", str(root / "artifacts")
    overrides = [f"tracking.uri={uri}", f"tracking.artifact_root={art}"]
    _plant(
        uri,
        art,
        overrides,
        "drift_2x2",
        ["eagle3", "eagle31"],
        SUITES,
        KS,
        lambda arm, seed: {s: _doc(s, seed, arm) for s in SUITES},
    )
    _plant(
        uri,
        art,
        overrides,
        "template_robustness",
        ["eagle3", "eagle31"],
        ["template"],
        KS,
        lambda arm, seed: {"template": _doc("template", seed, arm, {"gemma": 1.5, "llama3": 1.0})},
    )
    _plant(
        uri,
        art,
        overrides,
        "depth_extrapolation",
        ["eagle3_ttt3", "eagle31_ttt3"],
        ["in_dist"],
        [3, 5],
        lambda arm, seed: {"in_dist": _doc("in_dist", seed, arm, ks=[3, 5]), "rollout": _rollout(seed, arm)},
    )
    _plant(
        uri,
        art,
        overrides,
        "attention_2x2",
        ["mla_eagle3", "mla_eagle31"],
        ["in_dist"],
        KS,
        lambda arm, seed: {"in_dist": _doc("in_dist", seed, arm)},
    )
    return overrides


def _page(store, path, capsys) -> str:
    assert main(["paper", "--out", str(path), *store]) == 0
    capsys.readouterr()
    return path.read_text()


def test_the_page_gives_each_claim_the_verdict_its_intervals_say(store, tmp_path, capsys):
    page = _page(store, tmp_path / "first" / "paper.md", capsys)
    summary = {line.split(" | ")[0].lstrip("| "): line for line in page.splitlines() if line.startswith("| ")}
    benchmarks = summary["AL on standard benchmarks"]
    assert benchmarks.endswith("| agrees |") and "| 1.100 [" in benchmarks
    low, high = (float(x) for x in benchmarks.split("[")[1].split("]")[0].split(", "))
    assert low < 1.1 < high and high - low < 0.05
    assert summary["Norm growth along the chain"].endswith("| agrees |")
    assert "| 0.667 [0.667, 0.667] (norm growth, mtbench, step 8) |" in summary["Norm growth along the chain"]
    assert summary["Attention on the sink per drafting step"].endswith("| inconclusive |")
    assert summary["Attention on the drafter's own tokens"].endswith("| disagrees |")
    assert summary["AL on long context"].endswith("| - | not measured |")
    assert "the store holds no study of it yet (`lab ablate experiment=long_context`)" in page
    template = summary["AL under template perturbation"]  # x1.5 on gemma, equal on llama3
    assert template.endswith("(AL, template gemma, k=3) | mixed (1 agrees, 1 inconclusive) |")
    low, high = (float(x) for x in template.split("[")[1].split("]")[0].split(", "))
    assert low < 1.5 < high
    assert "| AL, template llama3, k=3 | " in page
    depth = summary["Extrapolation beyond the TTT depth"]  # rollout 0.5 against 0.5 - 0.05 x (depth - 1)
    assert depth.endswith("| 5.000 [5.000, 5.000] (rollout accuracy, depth 9) | agrees |")
    assert "| rollout accuracy, depth 6 | 2.000 [2.000, 2.000] | 1 x 3 | agrees |" in page
    beyond = page.split("## Extrapolation beyond the TTT depth")[1].split("\n## ")[0]
    assert "| AL, in_dist, k=5 | 1.100 [" in beyond and "AL, in_dist, k=3 |" not in beyond  # only beyond TTT 3
    assert "| AL, mtbench, k=8 | 1.100 [" in page and "| 30 x 3 | agrees |" in page
    assert "Measured on `drift_2x2` (drift_2x2-planted)." in page
    for name in ("drift_2x2", "template_robustness", "depth_extrapolation"):
        runs = track.search_runs(store[0].split("=", 1)[1], name)
        assert len(runs) == 7 and all(f"`{r.info.run_id}`" in page for r in runs)  # the parent and every child
    assert "EAGLE-3: top-1 agreement 0.40 on its last training batches, AL 1.80 at k=3 on mtbench" in page
    studies = page.split("## The studies")[1]
    assert studies.count("parent run `") == 4  # each study's budget and runs once, at the end
    # a claim that does not agree names, beside its verdict, the budget and the runs behind it; one that agrees does not
    own_tokens = page.split("## Attention on the drafter's own tokens")[1].split("\n## ")[0]
    said = "Verdict: **disagrees**. Before this counts against the paper, weigh the budget behind it: target "
    assert said in own_tokens
    assert "2048 training conversations, 40 steps of 8 sequences" in own_tokens
    drift_runs = track.search_runs(store[0].split("=", 1)[1], "drift_2x2")
    assert sum(f"`{r.info.run_id}`" in own_tokens for r in drift_runs) == 7
    assert "Before this counts" not in page.split("## Norm growth along the chain")[1].split("\n## ")[0]
    assert "2048 training conversations, 40 steps of 8 sequences" in page
    # the MLA claim: the MLA arms' ratio at the training depth, the card's figures beside it as the card's
    mla = page.split("## EAGLE 3.1 on an MLA drafter")[1].split("\n## ")[0]
    assert summary["EAGLE 3.1 on an MLA drafter"].endswith("(AL, in_dist, k=3) | agrees |")
    assert mla.startswith("\n\nThe claim: the Kimi K2.6 card (not the paper)")
    assert "The card's ratios span 0.982 to 1.076; this workbench's, 1.100 to 1.100." in mla
    assert "| AL, in_dist, k=3 | 1.100 [" in mla and "k=8" not in mla
    assert "| HumanEval | 3.192 | 3.134 | 0.982 |" in mla and "| SPEED multilingual | 2.603 | 2.800 | 1.076 |" in mla
    only = tmp_path / "mla.md"
    assert main(["paper", "--experiment", "attention_2x2", "--out", str(only), *store]) == 0
    mla_page = only.read_text()
    assert mla_page.count("\n## ") == 2 and "## EAGLE 3.1 on an MLA drafter" in mla_page  # the claim, the study
    assert "--experiment attention_2x2 --out" in mla_page
    again = _page(store, tmp_path / "first" / "paper.md", capsys)
    assert again == page  # seeded bootstrap: the same page on a rerun


def test_a_claim_whose_rows_differ_is_mixed_and_says_how():
    claim = next(c for c in CLAIMS if c.title == "AL on standard benchmarks")
    rows = [("a", paired.Interval(1.2, 1.1, 1.3, 10, 3)), ("b", paired.Interval(1.0, 0.9, 1.1, 10, 3))]
    assert Finding(claim, None, rows).verdict() == "mixed (1 agrees, 1 inconclusive)"
    below = [("c", paired.Interval(0.8, 0.7, 0.9, 10, 3))]
    assert Finding(claim, None, below).verdict() == "disagrees"
    assert Finding(claim, None, [("d", None)]).verdict() == "not measured"
    # compared as printed: an interval that touches 1 at three decimals covers it
    assert Finding(claim, None, [("e", paired.Interval(1.1, 1.0004, 1.2, 10, 3))]).verdict() == "inconclusive"
