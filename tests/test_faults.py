"""Faults never cost a result silently: corrupted checkpoints are refused, a failed run says why, and an
interrupted `lab run` resumes from its checkpoint to the weights an uninterrupted run would have."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from helpers import default_sigint, hold_training, logged, small_drafter, wait_held

from lab import track
from lab.config.composition import compose
from lab.config.shape import aux_layers
from lab.drafter import load_checkpoint, save_native
from lab.drafter.formats import MANIFEST as DRAFTER_MANIFEST
from lab.fsutil import sha256_file
from lab.train import resume


def _store(path: Path) -> list[str]:
    """Overrides for an MLflow store of this test's own."""
    return [f"tracking.uri=sqlite:///{path / 'mlflow.db'}", f"tracking.artifact_root={path / 'artifacts'}"]


def _damage(f: Path, how: str) -> None:
    data = bytearray(f.read_bytes())
    if how == "truncate":
        f.write_bytes(data[: len(data) // 2])
    else:  # one flipped bit in the last byte (tensor data, not the header)
        data[-1] ^= 1
        f.write_bytes(bytes(data))


# -- drafter checkpoints ------------------------------------------------------------------------------


def test_drafter_checkpoint_carries_content_hashes(tmp_path):
    drafter = small_drafter()
    out = save_native(drafter, tmp_path / "ckpt")
    manifest = json.loads((out / DRAFTER_MANIFEST).read_text())
    assert manifest["files"] == {"model.safetensors": sha256_file(out / "model.safetensors")}
    loaded = load_checkpoint(out)
    for k, v in drafter.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k
    assert not list(out.glob(".*"))  # no temp file left beside it


@pytest.mark.parametrize("how", ["truncate", "flip"])
def test_corrupted_drafter_checkpoint_is_refused(tmp_path, how):
    out = save_native(small_drafter(), tmp_path / "ckpt")
    _damage(out / "model.safetensors", how)
    message = (
        f"{out / 'model.safetensors'}: content hash does not match lab_manifest.json "
        "(corrupted or truncated checkpoint); re-export or retrain"
    )
    with pytest.raises(ValueError) as err:
        load_checkpoint(out)
    assert str(err.value) == message


def test_checkpoint_without_manifest_still_loads(tmp_path):
    """TorchSpec's or vLLM's checkpoints carry no lab_manifest.json: loaded unchecked."""
    drafter = small_drafter()
    out = save_native(drafter, tmp_path / "ckpt")
    (out / DRAFTER_MANIFEST).unlink()
    assert torch.equal(load_checkpoint(out).fc.weight, drafter.fc.weight)


# -- resume states -------------------------------------------------------------------------------


def _state(step: int = 4, steps: int = 10) -> resume.ResumeState:
    drafter = small_drafter()
    return resume.ResumeState(
        step=step,
        steps=steps,
        model=drafter.state_dict(),
        optimizer={0: {"step": torch.tensor(4.0), "exp_avg": torch.ones(3), "exp_avg_sq": torch.zeros(3)}},
        order=torch.randperm(32),
        cursor=16,
        generator=torch.Generator().manual_seed(1).get_state(),
        log_every=5,
        window=[{"loss": 1.5, "plosses": [1.0], "accs": [0.5]}],
        history=[(2, {"train/loss": 2.0})],
        run_id="abc",
    )


def test_resume_checkpoint_round_trips(tmp_path):
    saved = _state()
    resume.save(tmp_path / "ckpt", saved)
    got = resume.load(tmp_path / "ckpt", steps=10)
    assert got is not None and (got.step, got.cursor, got.run_id, got.log_every) == (4, 16, "abc", 5)
    assert torch.equal(got.order, saved.order) and torch.equal(got.generator, saved.generator)
    assert torch.equal(got.optimizer[0]["step"], torch.tensor(4.0))
    assert got.window == saved.window and got.history == saved.history
    assert all(torch.equal(v, got.model[k]) for k, v in saved.model.items())
    assert resume.load(tmp_path / "ckpt", steps=20) is None  # another training's length: not this one's


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.safetensors", "state.json"])
def test_corrupted_resume_checkpoint_is_ignored(tmp_path, capsys, name):
    path = tmp_path / "ckpt"
    resume.save(path, _state())
    _damage(path / name, "flip")
    assert resume.load(path, steps=10) is None
    out = logged(capsys.readouterr().err)
    assert out == [
        f"resume state {path}: {name} does not match its manifest hash (corrupted or truncated); "
        "ignoring it, training from scratch"
    ]


@pytest.mark.slow
def test_corrupted_resume_checkpoint_trains_from_scratch(micro_overrides, micro_target, tmp_path, capsys):
    """In a run: stopped at step 5 (checkpoint at 3), checkpoint corrupted, rerun -> refused with its line,
    trained from step 0 (no resume tag), FINISHED; the first run ended KILLED."""
    from lab.pipeline import RunHooks, run

    overrides = [*micro_overrides, *_store(tmp_path), "study=faults", "seed=4243"]
    cfg = compose([*overrides, "train.steps=6", "train.resume_every=3", "eval.num_prompts=1"])
    path = resume.state_dir(cfg, micro_target.fingerprint, aux_layers(cfg))

    def stop_at_5(metrics, step):
        if step == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(cfg, progress=False, hooks=RunHooks(on_train_metrics=stop_at_5))
    assert json.loads((path / resume.MANIFEST).read_text())["step"] == 3
    _damage(path / "optimizer.safetensors", "truncate")
    capsys.readouterr()
    result = run(cfg, progress=False)
    out = capsys.readouterr().err
    assert f"resume state {path}: optimizer.safetensors does not match its manifest hash" in out
    assert "resuming" not in out
    runs = {r.info.run_id: r for r in track.search_runs(cfg.tracking.uri, "faults")}
    assert sorted(r.info.status for r in runs.values()) == ["FINISHED", "KILLED"]
    assert "resumed_from_step" not in runs[result.run_id].data.tags
    assert not path.exists()  # a finished run's checkpoint is removed


# -- a failed run says why ----------------------------------------------------------------------------


@pytest.mark.slow
def test_non_finite_loss_fails_the_run_with_its_reason(micro_overrides, micro_target, tmp_path):
    from lab.pipeline import run

    cfg = compose([*micro_overrides, *_store(tmp_path), "study=faults-nan", "train.lr=1e30"])
    with pytest.raises(FloatingPointError, match="non-finite training loss"):
        run(cfg, progress=False)
    (failed,) = track.search_runs(cfg.tracking.uri, "faults-nan")
    assert failed.info.status == "FAILED"
    error = failed.data.tags["error"]
    assert error.startswith("FloatingPointError: non-finite training loss at step ") and error.endswith(": nan")


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGUSR1], ids=["SIGINT", "SIGUSR1"])
def test_every_stopping_signal_ends_training_with_a_resume_state(
    signum, micro_overrides, micro_target, workdir, tmp_path
):
    """Ctrl-C and Slurm's `--signal=USR1` stop as SIGTERM does: the step finished, its resume state written, the
    run KILLED naming the signal, exit 128 + its number; a second signal would stop at once."""
    overrides = [*micro_overrides, "study=faults", f"seed={4300 + signum}", "train.steps=40", "train.resume_every=5"]
    cfg = compose([*overrides, *_store(tmp_path)])
    path = resume.state_dir(cfg, micro_target.fingerprint, aux_layers(cfg))
    cmd = [sys.executable, "-m", "lab.cli", "run", *overrides, *_store(tmp_path)]
    err, held = tmp_path / "stderr", tmp_path / "held"
    with open(err, "w") as e:
        hold = hold_training({**os.environ, "TQDM_DISABLE": "1"}, 7, held)
        proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=e, env=hold, cwd=workdir, preexec_fn=default_sigint
        )
        wait_held(proc, held, err, timeout=150)
        proc.send_signal(signum)
        assert proc.wait(timeout=120) == 128 + signum, err.read_text()[-3000:]
    name = signal.Signals(signum).name
    assert err.read_text().strip().splitlines()[-1] == f"error: interrupted ({name})"
    (killed,) = track.search_runs(cfg.tracking.uri, "faults")
    assert killed.info.status == "KILLED" and killed.data.tags["lab.signal"] == name
    assert json.loads((path / resume.MANIFEST).read_text())["step"] == 7  # the held step's state, written on the signal


# -- a stopping signal (SIGTERM, as a scheduler sends it), then the same command again --------------------------


@pytest.mark.slow
def test_sigterm_then_rerun_resumes_to_the_uninterrupted_weights(micro_overrides, micro_target, workdir, tmp_path):
    from lab.pipeline import run

    # a seed of its own: the checkpoint key (and folder) differs from every other test's
    overrides = [*micro_overrides, "study=faults", "seed=4242", "train.steps=40", "train.resume_every=5"]
    cfg = compose([*overrides, *_store(tmp_path / "a")])
    path = resume.state_dir(cfg, micro_target.fingerprint, aux_layers(cfg))
    cmd = [sys.executable, "-m", "lab.cli", "run", *overrides, *_store(tmp_path / "a")]
    env = {**os.environ, "TQDM_DISABLE": "1"}
    out, err, held = tmp_path / "stdout", tmp_path / "stderr", tmp_path / "held"
    with open(out, "w") as o, open(err, "w") as e:
        # training waits after step 7 (its step-5 checkpoint written) until interrupted (tests/hold/sitecustomize.py)
        hold = hold_training(env, 7, held)
        proc = subprocess.Popen(cmd, stdout=o, stderr=e, text=True, env=hold, cwd=workdir, preexec_fn=default_sigint)
        wait_held(proc, held, err, timeout=150)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 128 + signal.SIGTERM, err.read_text()[-3000:]
    lines = err.read_text().strip().splitlines()
    assert lines[-1] == "error: interrupted (SIGTERM)" and sum(line.startswith("error:") for line in lines) == 1
    (killed,) = track.search_runs(cfg.tracking.uri, "faults")
    assert killed.info.status == "KILLED" and killed.data.tags["lab.signal"] == "SIGTERM"
    manifest = json.loads((path / resume.MANIFEST).read_text())
    assert 5 <= manifest["step"] < manifest["steps"] == 40 and manifest["run_id"] == killed.info.run_id

    again = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=workdir)
    assert again.returncode == 0, again.stderr[-3000:]
    step = manifest["step"]
    assert f"resuming training from step {step} of 40 (resume state {path.name})" in again.stderr
    run_id = again.stdout.strip().splitlines()[-1]
    finished = track.get_run(cfg.tracking.uri, run_id)
    assert finished.info.status == "FINISHED"
    assert finished.data.tags["resumed_from_step"] == str(step)
    assert finished.data.tags["resumed_from_run"] == killed.info.run_id
    assert not path.exists()

    # the same training uninterrupted, in this process, into another store
    straight = run(compose([*overrides, *_store(tmp_path / "b"), "train.resume_every=0"]), progress=False)
    uri_b = f"sqlite:///{tmp_path / 'b' / 'mlflow.db'}"
    with tempfile.TemporaryDirectory() as tmp:
        a = load_checkpoint(track.run_checkpoint(cfg.tracking.uri, run_id, Path(tmp) / "a")[0]).state_dict()
        b = load_checkpoint(track.run_checkpoint(uri_b, straight.run_id, Path(tmp) / "b")[0]).state_dict()
    for k, v in b.items():
        assert torch.equal(v, a[k]), k
    assert track.metric_curve(cfg.tracking.uri, run_id, "train/loss") == track.metric_curve(
        uri_b, straight.run_id, "train/loss"
    )
    assert finished.data.metrics["eval/in_dist/ref/k3/al"] == straight.metrics["eval/in_dist/ref/k3/al"]


def test_a_suite_logged_by_two_workers_at_once_is_recorded_once_in_each_run(tmp_path, monkeypatch):
    """Two workers of a study log the same suite dataset at the same moment; MLflow's get-or-create of a
    dataset is not atomic, so the slower insert breaks the unique key. The run must retry, not fail."""
    import mlflow
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    uri, artifacts = f"sqlite:///{tmp_path / 'mlflow.db'}", str(tmp_path / "artifacts")
    rows = [{"variant": "a", "num_tokens": 3.0, "text": "x", "token_ids": "[1, 2, 3]"}]
    with track.start_run(uri, artifacts, "race", "first", {"study": "race"}) as first:
        first.log_dataset("in_dist", rows)  # the other worker's row, already there
    real, calls = mlflow.log_input, []

    def racing(*args, **kwargs):  # the first attempt loses the race, as the demo's second worker did
        calls.append(1)
        if len(calls) == 1:
            raise MlflowException("(sqlite3.IntegrityError) UNIQUE constraint failed: datasets.experiment_id")
        return real(*args, **kwargs)

    monkeypatch.setattr(mlflow, "log_input", racing)
    with track.start_run(uri, artifacts, "race", "second", {"study": "race"}) as second:
        second.log_dataset("in_dist", rows)
    assert len(calls) == 2
    inputs = MlflowClient(uri).get_run(second.id).inputs.dataset_inputs
    assert [d.dataset.name for d in inputs] == ["in_dist"]


def test_a_quote_in_a_study_name_cannot_break_a_store_query(tmp_path):
    """MLflow filters are built with the value quoted so that it cannot end its string: a sweep named with a
    quote finds its own parent run, and one crafted to widen the query finds nothing."""
    uri, root = f"sqlite:///{tmp_path / 'mlflow.db'}", str(tmp_path / "artifacts")
    for sweep in ("it's", "plain"):
        with track.parent_run(uri, root, "quotes", f"sweep-{sweep}", key=sweep, tags={"sweep": sweep}):
            pass
    (found,) = track.study_parents(uri, "quotes", "it's")
    assert found.data.tags["sweep"] == "it's"
    assert track.study_parents(uri, "quotes", "x' or tags.sweep = 'plain") == []
    with pytest.raises(ValueError, match="both kinds of quotes"):
        track.study_parents(uri, "quotes", "a'b\"c")
