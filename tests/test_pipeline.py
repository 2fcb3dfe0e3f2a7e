"""`lab run` end to end on the micro target: fast, and its run is in MLflow with the design's keys."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import TEST_THREADS

VLLM = ["eval.backends=[ref,vllm]", "eval.vllm.concurrency=[1,4]"]


@pytest.mark.slow
def test_lab_run_micro_end_to_end(micro_overrides, micro_target, workdir):
    env = {**os.environ, "TQDM_DISABLE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "lab.cli", "run", *micro_overrides, "drafter=eagle31", "study=pipeline-test", *VLLM],
        capture_output=True,
        text=True,
        env=env,
        cwd=workdir,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_id = proc.stdout.strip().splitlines()[-1]

    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{workdir / 'mlruns' / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["pipeline-test"], output_format="list")
    assert [r.info.run_id for r in runs] == [run_id]
    run = runs[0]
    assert run.info.status == "FINISHED"
    metrics = run.data.metrics
    for key in [
        "train/loss",
        "train/ploss_0",
        "train/acc_2",
        "train/simulated_acc_len",
        "train/tokens_per_s",
        "eval/in_dist/ref/k3/al",
        "eval/in_dist/ref/k3/accept_rate",
        "eval/in_dist/ref/k3/tokens_per_s",
        "eval/in_dist/ref/k3/speedup",
        "eval/in_dist/vllm/k3/al",
        "eval/in_dist/vllm/k3/accept_rate",
        "eval/in_dist/vllm/k3/c1/speedup",
        "eval/in_dist/vllm/k3/c4/speedup",
    ]:
        assert key in metrics, key
    assert metrics["eval/in_dist/ref/k3/exact_match"] == 1.0
    assert metrics["eval/in_dist/vllm/k3/exact_match"] == 1.0  # vLLM's speculation is lossless too
    assert metrics["eval/in_dist/vllm/k3/al"] == pytest.approx(metrics["eval/in_dist/ref/k3/al"], rel=0.03)
    for key in ["sink_mass", "self_mass", "context_mass", "feedback_norm", "norm_growth"]:
        assert f"drift/in_dist/k3/{key}" in metrics, key
    assert "eval/in_dist/rollout/acc" in metrics and "drift/fc_share" in metrics
    tags, params = run.data.tags, run.data.params
    assert {"study", "arm", "seed", "git_commit", "config_hash", "config_hash_scheme"} <= set(tags)
    assert tags["arm"] == "eagle31" and tags["study"] == "pipeline-test"
    assert params["drafter.fc_norm"] == "per_layer" and params["drafter.norm_output"] == "True"
    assert params["train.ttt_length"] == "3"
    assert (params["device"], params["resolved.device"], params["resolved.dtype"]) == ("cpu", "cpu", "float32")
    client = mlflow.MlflowClient()
    curve = client.get_metric_history(run_id, "eval/in_dist/ref/k3/accept_rate")
    assert sorted(m.step for m in curve) == [1, 2, 3]
    assert [a.path for a in client.list_artifacts(run_id, "vllm")] == ["vllm/vllm_worker.log"]
    rollout = client.get_metric_history(run_id, "eval/in_dist/rollout/acc")
    assert len(rollout) == 3 * 3  # 3 x train.ttt_length, beyond the training depth
    assert len(client.get_metric_history(run_id, "drift/fc_share")) == 3  # one per captured layer
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"checkpoint", "config.yaml", "per_prompt"} <= artifacts
    per_prompt = {a.path for a in client.list_artifacts(run_id, "per_prompt")}
    assert per_prompt == {"per_prompt/in_dist.json", "per_prompt/rollout.json", "per_prompt/val.json"}
    # the per-prompt records pool back to the logged metrics (the report's paired bootstrap reads them)
    from lab.report import paired

    records = mlflow.artifacts.load_dict(f"runs:/{run_id}/per_prompt/in_dist.json")
    al = paired.pooled(paired.al_counts(records, 3), paired.acceptance_length)
    assert al == pytest.approx(metrics["eval/in_dist/ref/k3/al"], rel=1e-12)
    sequences = mlflow.artifacts.load_dict(f"runs:/{run_id}/per_prompt/rollout.json")
    accs = [m.value for m in sorted(rollout, key=lambda m: m.step)]
    pooled = [paired.pooled(paired.rollout_counts(sequences, d), paired.share) for d in range(1, len(accs) + 1)]
    assert pooled == pytest.approx(accs, rel=1e-6)
    ckpt = {a.path for a in client.list_artifacts(run_id, "checkpoint")}
    assert {"checkpoint/config.json", "checkpoint/model.safetensors"} <= ckpt


SUITES = ["in_dist", "long_context", "template", "system_prompt", "mtbench", "humaneval"]


@pytest.mark.slow
def test_lab_run_smollm2_smoke(workdir):
    """The default target and data (SmolLM2 on regenerated ShareGPT) end to end in the smoke profile: every
    suite, greedy speculative decoding equal to the target's own, the data stage's metrics."""
    store = workdir / "mlruns-smollm2"
    overrides = [
        "profile=smoke",
        "drafter=eagle31",
        "study=smollm2-smoke",
        f"cache_dir={workdir / 'cache'}",
        f"tracking.uri=sqlite:///{store / 'mlflow.db'}",
        f"tracking.artifact_root={store / 'artifacts'}",
        f"threads={TEST_THREADS}",
        "data.generator=hf",  # vLLM regenerates in tests/test_regenerate.py; its engine costs a minute here
        # half the profile's conversations (regeneration was 74 of the run's 290 s): enough for its 4 x 4 steps
        "data.num_sequences=8",
        "data.heldout_sequences=2",
    ]
    env = {**os.environ, "TQDM_DISABLE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "lab.cli", "run", *overrides], capture_output=True, text=True, env=env, cwd=workdir
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{store / 'mlflow.db'}")
    (run,) = mlflow.search_runs(experiment_names=["smollm2-smoke"], output_format="list")
    assert run.info.status == "FINISHED"
    metrics, params = run.data.metrics, run.data.params
    assert params["target.name"] == "smollm2" and params["data.template"] == "target"
    assert json.loads(params["eval.suites"]) == SUITES
    for suite in SUITES:
        assert metrics[f"eval/{suite}/ref/k3/al"] >= 1.0, suite
        assert metrics[f"eval/{suite}/ref/k3/exact_match"] == 1.0, suite  # lossless: the target's own tokens
        assert f"drift/{suite}/k3/sink_mass" in metrics, suite
        assert metrics[f"time/eval_{suite}_s"] > 0, suite
    for variant in ["llama3", "gemma", "mistral", "user_assistant"]:
        assert f"eval/template.{variant}/ref/k3/al" in metrics, variant
    assert metrics["data/train_sequences"] == 8 and metrics["data/regen_generated_tokens"] > 0


def test_warm_caches_builds_what_the_runs_then_find(micro_overrides, micro_target):
    """What a study warms before its workers start (lab/sweep/engine.py) is the runs' own hidden-state cache and
    the suites' greedy answers (eval.decoder=replay): built once by the first call, found by the next."""
    from lab.config.composition import compose
    from lab.pipeline import warm_caches

    cfg = compose([*micro_overrides, "data.num_sequences=24"])  # a selection no other test caches
    caches = [Path(cfg.cache_dir) / "hidden", Path(cfg.cache_dir) / "answers"]
    before = [set(c.glob("*")) for c in caches]
    stages = {"target", "data", "validation", "cache", "heldout", "suites", "answers"}  # validation: its answers
    assert set(warm_caches(cfg, progress=False)) == stages
    built = [set(c.glob("*")) - b for c, b in zip(caches, before, strict=True)]
    assert len([p for p in built[0] if (p / "manifest.json").is_file()]) == 1
    assert any(caches[1].glob("*/manifest.json"))  # the answers (built here, or by an earlier test's same suites)
    warm_caches(cfg, progress=False)
    assert [set(c.glob("*")) - b for c, b in zip(caches, before, strict=True)] == built


def _store(path: Path) -> list[str]:
    """Overrides for an MLflow store of this test's own."""
    return [f"tracking.uri=sqlite:///{path / 'mlflow.db'}", f"tracking.artifact_root={path / 'artifacts'}"]


@pytest.mark.slow
def test_a_drafter_trained_alike_is_reused_not_trained_again(micro_overrides, micro_target, tmp_path, capsys):
    """A run of another study with the same training (different evaluation) takes the first run's drafter and
    training curves instead of training: no cache or train stage, the same weights, tagged with where they
    come from; train.reuse=false trains again."""
    import tempfile

    import torch

    from lab import track
    from lab.config.composition import compose
    from lab.drafter import load_checkpoint
    from lab.pipeline import RunHooks, run

    common = [*micro_overrides, *_store(tmp_path), "train.reuse=true", "train.steps=6", "eval.num_prompts=1"]
    first = run(compose([*common, "study=reuse-a"]), progress=False)
    stages: list[str] = []
    hooks = RunHooks(on_stage=stages.append)
    capsys.readouterr()
    second = run(compose([*common, "study=reuse-b", "eval.num_speculative_tokens=[2]"]), progress=False, hooks=hooks)
    assert f"training: the drafter of run {first.run_id} (train_key " in capsys.readouterr().err
    assert "cache" not in stages and "train" not in stages and "drafter" in stages
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    a, b = track.get_run(uri, first.run_id), track.get_run(uri, second.run_id)
    assert b.data.tags["train_key"] == a.data.tags["train_key"] and "trained_by_run" not in a.data.tags
    assert b.data.tags["trained_by_run"] == first.run_id
    assert "time/train_s" in a.data.metrics and "time/train_s" not in b.data.metrics
    for key in ("train/loss", "train/acc_0", "train/lr"):
        assert track.metric_curve(uri, second.run_id, key) == track.metric_curve(uri, first.run_id, key), key
    with tempfile.TemporaryDirectory() as tmp:
        wa = load_checkpoint(track.run_checkpoint(uri, first.run_id, Path(tmp) / "a")[0]).state_dict()
        wb = load_checkpoint(track.run_checkpoint(uri, second.run_id, Path(tmp) / "b")[0]).state_dict()
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert "eval/in_dist/ref/k2/al" in b.data.metrics

    third = run(compose([*common, "study=reuse-b", "train.reuse=false"]), progress=False)
    c = track.get_run(uri, third.run_id)
    assert c.data.tags["train_key"] == a.data.tags["train_key"] and "trained_by_run" not in c.data.tags
    assert "time/train_s" in c.data.metrics


def test_drafter_key_covers_what_trains_and_nothing_else(micro_overrides, micro_target):
    from lab.config.composition import compose
    from lab.config.shape import aux_layers
    from lab.train.resume import drafter_key

    def key(*overrides: str, external: dict[str, str] | None = None) -> str:
        cfg = compose([*micro_overrides, *overrides])
        return drafter_key(cfg, micro_target.fingerprint, aux_layers(cfg), external or {})

    base = key()
    assert base == key()
    for same in ("train.reuse=false", "train.log_every=3", "train.resume_every=7", "eval.num_prompts=1", "study=x"):
        assert key(same) == base, same
    for other in ("seed=1", "train.steps=7", "drafter=eagle31", "data.seq_len=48"):
        assert key(other) != base, other
    assert key(external={"torchspec_commit": "abc"}) != base
