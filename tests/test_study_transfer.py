"""`lab study export` / `lab study import`: a study moved between two real MLflow stores (sqlite) in one archive.

The study is tests/test_report.py's drift_2x2 (four arms x two seeds, one failed run, one pruned and retried,
metric curves and per-prompt records), plus a drafter checkpoint on each finished child and an Optuna study
in the journal beside the database. Exported and imported into an empty store, it reports byte-identical
tables and the same report.md (run ids and paths aside), every run equal to its source; importing twice
changes nothing, a cut-short import is completed by the next one; the Optuna study and the checkpoints come
along only when asked for; a damaged archive, one of an unknown schema and a store holding another study
under the same key are refused in one line, exit 2, with the destination store unchanged; an interrupted
export leaves the archive that was there."""

from __future__ import annotations

import collections
import gzip
import hashlib
import io
import json
import re
import tarfile
from pathlib import Path

import optuna
import pytest
from mlflow.entities import Dataset, DatasetInput, InputTag, ViewType
from mlflow.tracking import MlflowClient
from test_report import ARMS, log_study

from lab import track
from lab.cli import main
from lab.track import study_archive

TABLES = [f"{t}.{ext}" for t in ("acceptance", "al", "drift", "rollout") for ext in ("csv", "md", "tex")]
STUDY = "drift_2x2-test"  # the Optuna study and the parent run's `lab.study_key`
SUITE = DatasetInput(
    Dataset("in_dist", "d0ca2a63", "code", '{"tags": {}}', '{"mlflow_colspec": []}', '{"num_rows": 40}'),
    [InputTag("mlflow.data.context", "eval")],
)


class Store:
    """A local MLflow store in `root`: the sqlite database, the artifact folder and the Optuna journal."""

    def __init__(self, root: Path):
        self.root = root
        self.uri = f"sqlite:///{root / 'mlflow.db'}"
        self.art = str(root / "artifacts")
        self.journal = root / "optuna.journal"

    @property
    def overrides(self) -> list[str]:
        return [f"tracking.uri={self.uri}", f"tracking.artifact_root={self.art}"]

    def runs(self) -> list:
        client = MlflowClient(tracking_uri=self.uri)
        experiments = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ALL)]
        return client.search_runs(experiments, run_view_type=ViewType.ALL, max_results=1000)

    def files(self) -> dict[str, str]:
        """Every file under the store's folder by content hash: what "unchanged" means."""
        if not self.root.exists():
            return {}
        return {
            str(p.relative_to(self.root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(self.root.rglob("*"))
            if p.is_file()
        }


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> tuple[Store, str]:
    """The study in its own store (test_report.py's runs), with a checkpoint on each finished child and its
    Optuna study (one trial per child, `mlflow_run_id` naming it); the parent run's id."""
    store = Store(tmp_path_factory.mktemp("source"))
    uri, art = store.uri, store.art
    parent_id = log_study(uri, art)
    checkpoint = store.root / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text('{"architectures": ["LlamaForCausalLMEagle3"]}')
    (checkpoint / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    study = optuna.create_study(study_name=STUDY, storage=_journal(store.journal), direction="maximize")
    study.set_user_attr("mlflow_parent_run_id", parent_id)
    arm_space = optuna.distributions.CategoricalDistribution(list(ARMS))
    children = sorted(track.child_runs(uri, parent_id), key=lambda r: (r.info.start_time, r.info.run_id))
    client = MlflowClient(tracking_uri=uri)
    for run in children:
        ok = run.info.status == "FINISHED"
        if ok:
            track.log_artifacts(uri, run.info.run_id, checkpoint, "checkpoint")
        client.log_inputs(run.info.run_id, [SUITE])  # as `lab run` logs each suite's prompts
        trial = optuna.trial.create_trial(
            params={"arm": run.data.tags["arm"]},
            distributions={"arm": arm_space},
            value=run.data.metrics.get("eval/in_dist/ref/k3/al") if ok else None,
            state=optuna.trial.TrialState.COMPLETE if ok else optuna.trial.TrialState.FAIL,
            user_attrs={"mlflow_run_id": run.info.run_id, "seed": int(run.data.tags["seed"])},
        )
        study.add_trial(trial)
    return store, parent_id


def _journal(path: Path) -> optuna.storages.BaseStorage:
    return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(path)))


def _export(source, out: Path, capsys, *options: str) -> str:
    store, parent = source
    argv = ["study", "export", "experiment=drift_2x2", "--run", parent, "--out", str(out), *options]
    assert main([*argv, *store.overrides]) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def _import(archive: Path, dest: Store, capsys) -> tuple[int, str, str]:
    capsys.readouterr()  # what came before is not the import's
    rc = main(["study", "import", str(archive), *dest.overrides])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def archive(source, tmp_path_factory) -> tuple[Path, str]:
    """The study exported with the defaults (no Optuna study, no checkpoints), and what the export printed."""
    out = tmp_path_factory.mktemp("archive") / "study.tar.gz"
    capsys = _Capture()
    printed = capsys.run(lambda: _export(source, out, capsys))
    return out, printed


_Captured = collections.namedtuple("_Captured", "out err")  # as pytest's capsys returns it


class _Capture:
    """capsys for a module-scoped fixture: main()'s output, read back from redirected streams."""

    def run(self, fn):
        import contextlib

        self._out, self._err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(self._out), contextlib.redirect_stderr(self._err):
            return fn()

    def readouterr(self) -> _Captured:
        out, err = self._out.getvalue(), self._err.getvalue()
        self._out.seek(0), self._out.truncate(), self._err.seek(0), self._err.truncate()
        return _Captured(out, err)


def _report(store: Store, parent: str, out: Path, capsys) -> None:
    argv = ["report", "experiment=drift_2x2", "--run", parent, "--out", str(out), *store.overrides]
    assert main(argv) == 0, capsys.readouterr().err
    capsys.readouterr()


def _imported(dest: Store) -> dict[str, str]:
    """Original run id -> the run's id in `dest`."""
    return {r.data.tags[study_archive.ORIGIN_TAG]: r.info.run_id for r in dest.runs()}


def _members(path: Path) -> dict[str, bytes]:
    with tarfile.open(path, "r:gz") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}


def _repack(path: Path, members: dict[str, bytes]) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


# ------------------------------------------------------------------------------------------------ the tests


def test_the_archive_carries_the_study_and_says_its_size(source, archive):
    store, parent = source
    path, printed = archive
    size = path.stat().st_size
    assert f"archive: {path} (" in printed and f"{size} bytes)" in printed, printed
    assert "study drift_2x2-test: 10 runs (parent" in printed and "left out: 14 checkpoint files" in printed
    members = _members(path)
    assert next(iter(members)) == "manifest.json"  # first: a reader knows the schema at once
    manifest = json.loads(members["manifest.json"])
    expected = (study_archive.FORMAT, study_archive.SCHEMA, parent)
    assert (manifest["format"], manifest["schema"], manifest["parent"]) == expected
    assert manifest["optuna"] is None and manifest["with_checkpoints"] is False
    assert set(manifest["files"]) == set(members) - {"manifest.json"}
    assert not [n for n in members if "/artifacts/checkpoint/" in n]  # checkpoints only on request
    assert len([n for n in members if n.endswith("/artifacts/per_prompt/in_dist.json")]) == 9
    doc = json.loads(members[f"runs/{manifest['runs'][1]}/run.json"])  # the first child: its curves, step by step
    points, arm = doc["metrics"]["eval/in_dist/ref/k8/accept_rate"], doc["tags"]["arm"]
    assert [p[0] for p in points] == list(range(1, 9))
    assert [p[2] for p in points] == pytest.approx([0.8 / (i + 1) + ARMS[arm] / 10 for i in range(8)])
    assert len(store.runs()) == 10


def test_an_imported_study_reports_the_same_tables(source, archive, tmp_path, capsys):
    store, parent = source
    dest = Store(tmp_path / "laptop")
    rc, out, err = _import(archive[0], dest, capsys)
    assert rc == 0 and "error" not in err, err
    assert out.startswith(f"imported 10 of 10 runs into {dest.uri} (0 already there)")
    ids = _imported(dest)
    assert len(ids) == 10 and ids.keys() == {r.info.run_id for r in store.runs()}
    # every run as it was: status, times, tags, params, metric histories (steps and timestamps), artifacts
    src, dst = MlflowClient(tracking_uri=store.uri), MlflowClient(tracking_uri=dest.uri)
    for run in store.runs():
        twin = dst.get_run(ids[run.info.run_id])
        assert (twin.info.status, twin.info.start_time, twin.info.end_time, twin.info.run_name) == (
            run.info.status,
            run.info.start_time,
            run.info.end_time,
            run.info.run_name,
        )
        pairs = [(src, run.info.run_id), (dst, twin.info.run_id)]
        moved = {study_archive.ORIGIN_TAG, "mlflow.parentRunId"}
        assert {k: v for k, v in twin.data.tags.items() if k not in moved} == {
            k: v for k, v in run.data.tags.items() if k not in moved
        }
        if "mlflow.parentRunId" in run.data.tags:
            assert twin.data.tags["mlflow.parentRunId"] == ids[run.data.tags["mlflow.parentRunId"]]
        assert twin.data.params == run.data.params and twin.data.metrics == run.data.metrics
        inputs = [sorted(json.dumps(i.to_dictionary()) for i in r.inputs.dataset_inputs) for r in (run, twin)]
        assert inputs[0] == inputs[1] and len(inputs[0]) == int("mlflow.parentRunId" in run.data.tags)
        for key in run.data.metrics:
            history = [sorted((m.step, m.timestamp, m.value) for m in c.get_metric_history(r, key)) for c, r in pairs]
            assert history[0] == history[1], key
        listed = {a.path for a in src.list_artifacts(run.info.run_id)} - {"checkpoint"}
        assert {a.path for a in dst.list_artifacts(twin.info.run_id)} == listed
    # the reports of both stores, byte for byte
    _report(store, parent, tmp_path / "a", capsys)
    _report(dest, ids[parent], tmp_path / "b", capsys)
    for name in TABLES:
        first, second = (tmp_path / d / "tables" / name for d in "ab")
        assert first.read_bytes() == second.read_bytes(), name
    assert sorted(p.name for p in (tmp_path / "b" / "tables").iterdir()) == sorted(TABLES)
    # report.md too, once each run id and the store's paths are the destination's (left-out runs are listed in
    # run-id order, which new ids change: compared as sets of lines)
    mine = (tmp_path / "a" / "report.md").read_text()
    for old, new in [*ids.items(), (store.uri, dest.uri), (store.art, dest.art), (str(store.root), str(dest.root))]:
        mine = mine.replace(old, new)
    assert sorted(mine.splitlines()) == sorted((tmp_path / "b" / "report.md").read_text().splitlines())


def test_importing_twice_changes_nothing(source, archive, tmp_path, capsys):
    store, _ = source
    before = store.files()
    rc, out, _ = _import(archive[0], store, capsys)  # into the store it came from: every run is there already
    assert rc == 0 and out.startswith(f"imported 0 of 10 runs into {store.uri} (10 already there)")
    assert store.files() == before
    dest = Store(tmp_path / "laptop")
    assert _import(archive[0], dest, capsys)[0] == 0
    before = dest.files()
    rc, out, err = _import(archive[0], dest, capsys)
    assert rc == 0 and "error" not in err
    assert out.startswith(f"imported 0 of 10 runs into {dest.uri} (10 already there)")
    assert dest.files() == before  # not a byte of the store changed
    assert len(dest.runs()) == 10


def test_an_import_cut_short_is_completed_by_the_next(archive, tmp_path, capsys, monkeypatch):
    """Killed while writing a run: that run stays tagged `lab.import=partial`; the next import replaces it."""
    dest = Store(tmp_path / "laptop")
    real, calls = MlflowClient.delete_tag, []

    def killed_at_the_third_run(self, run_id, key):
        calls.append(run_id)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self, run_id, key)

    monkeypatch.setattr(MlflowClient, "delete_tag", killed_at_the_third_run)
    assert _import(archive[0], dest, capsys)[0] == 130
    monkeypatch.undo()
    partial = [r for r in dest.runs() if r.data.tags.get("lab.import") == "partial"]
    assert len(dest.runs()) == 3 and [r.info.run_id for r in partial] == [calls[2]]
    rc, out, _ = _import(archive[0], dest, capsys)
    assert rc == 0 and out.startswith("imported 8 of 10 runs") and "(2 already there, 1 cut short before" in out
    active = [r for r in dest.runs() if r.info.lifecycle_stage == "active"]
    assert len(active) == 10 and not [r for r in active if "lab.import" in r.data.tags]
    assert len({r.data.tags[study_archive.ORIGIN_TAG] for r in active}) == 10


def test_optuna_and_checkpoints_only_on_request(source, tmp_path, capsys):
    store, parent = source
    path = tmp_path / "full.tar.gz"
    printed = _export(source, path, capsys, "--with-optuna", "--with-checkpoints")
    assert "the Optuna study (9 trials)" in printed and "left out" not in printed
    dest = Store(tmp_path / "laptop")
    rc, out, _ = _import(path, dest, capsys)
    assert rc == 0 and f"; Optuna study {STUDY} (9 trials) into {dest.journal}" in out, out
    ids = _imported(dest)
    client = MlflowClient(tracking_uri=dest.uri)
    finished = [r for r in dest.runs() if r.data.tags.get("trial_state") == "COMPLETE"]
    for run in finished:
        files = {a.path for a in client.list_artifacts(run.info.run_id, "checkpoint")}
        assert files == {"checkpoint/config.json", "checkpoint/model.safetensors"}
    # the Optuna study, its MLflow run ids those of the destination store
    copied = optuna.load_study(study_name=STUDY, storage=_journal(dest.journal))
    original = optuna.load_study(study_name=STUDY, storage=_journal(store.journal))
    assert [(t.state, t.values, t.params) for t in copied.trials] == [
        (t.state, t.values, t.params) for t in original.trials
    ]
    assert [t.user_attrs["mlflow_run_id"] for t in copied.trials] == [
        ids[t.user_attrs["mlflow_run_id"]] for t in original.trials
    ]
    assert copied.user_attrs["mlflow_parent_run_id"] == ids[parent]
    assert client.get_run(ids[parent]).data.tags["optuna_storage"] == str(dest.journal)
    before = dest.files()
    rc, out, _ = _import(path, dest, capsys)
    assert rc == 0 and f"Optuna study {STUDY} (9 trials) already in" in out and dest.files() == before


def _damaged(kind: str, good: Path, tmp_path: Path) -> Path:
    """An archive broken in one way, from the good one."""
    bad = tmp_path / f"{kind}.tar.gz"
    data = good.read_bytes()
    members = _members(good)
    manifest = json.loads(members["manifest.json"])
    if kind == "truncated":
        bad.write_bytes(data[: len(data) // 2])
    elif kind == "trailer cut off":  # the tar stream is whole; the gzip length and CRC are not
        bad.write_bytes(data[:-4])
    elif kind == "flipped byte":
        raw = bytearray(gzip.decompress(data))
        at = raw.index(b'"prompts"')  # inside a per-prompt record: only its checksum tells
        raw[at + 1] ^= 0x20
        bad.write_bytes(gzip.compress(bytes(raw)))
    elif kind == "not gzip":
        bad.write_bytes(b"PK\x03\x04 a zip file")
    elif kind == "no manifest":
        _repack(bad, {k: v for k, v in members.items() if k != "manifest.json"})
    elif kind == "manifest not JSON":
        _repack(bad, {**members, "manifest.json": members["manifest.json"][:-10]})
    elif kind == "checksum mismatch":
        name = next(n for n in members if n.endswith("per_prompt/in_dist.json"))
        _repack(bad, {**members, name: members[name] + b" "})  # still JSON, not the file that was written
    elif kind == "file missing":
        name = next(n for n in members if n.endswith("per_prompt/rollout.json"))
        _repack(bad, {k: v for k, v in members.items() if k != name})
    elif kind == "unknown schema":
        _repack(bad, {**members, "manifest.json": json.dumps({**manifest, "schema": 99}).encode()})
    elif kind == "unsafe path":
        _repack(bad, {**members, "../escape.txt": b"x"})
    elif kind == "no such file":
        bad = tmp_path / "nothing-here.tar.gz"
    return bad


REFUSALS = {
    "truncated": "damaged or not a .tar.gz",
    "trailer cut off": "damaged or not a .tar.gz",
    "flipped byte": "does not match its checksum in manifest.json; the archive is damaged",
    "not gzip": "damaged or not a .tar.gz",
    "no manifest": "no manifest.json, so not an archive written by `lab study export`",
    "manifest not JSON": "manifest.json is not valid JSON",
    "checksum mismatch": "does not match its checksum in manifest.json; the archive is damaged",
    "file missing": "is listed in manifest.json but missing",
    "unknown schema": "schema version 99 is not one this lab reads (it reads version 1)",
    "unsafe path": "member '../escape.txt' has an unsafe path",
    "no such file": "no such file; expected an archive written by `lab study export`",
}


@pytest.fixture(scope="module")
def holding(archive, tmp_path_factory) -> Store:
    """A destination that already holds the study."""
    dest = Store(tmp_path_factory.mktemp("holding"))
    capsys = _Capture()
    assert capsys.run(lambda: _import(archive[0], dest, capsys))[0] == 0
    return dest


@pytest.mark.parametrize("kind", list(REFUSALS))
def test_a_bad_archive_is_refused_in_one_line_and_writes_nothing(kind, archive, holding, tmp_path, capsys):
    bad = _damaged(kind, archive[0], tmp_path)
    empty = Store(tmp_path / "empty")
    for dest in (empty, holding):
        before = dest.files()
        rc, out, err = _import(bad, dest, capsys)
        lines = err.strip().splitlines()
        assert rc == 2 and out == "" and len(lines) == 1, (rc, out, err)
        assert lines[0].startswith(f"error: ARCHIVE: {bad}: ") and REFUSALS[kind] in lines[0], lines[0]
        assert dest.files() == before
    assert not empty.root.exists()


def test_another_study_with_the_same_key_is_refused(archive, tmp_path, capsys):
    """A store whose own study has the same key (the same study run there too): importing would leave two
    parents that `lab report` would choose between."""
    dest = Store(tmp_path / "laptop")
    with track.parent_run(dest.uri, dest.art, "drift_2x2", "sweep-drift_2x2", STUDY, {"sweep": "drift_2x2"}):
        pass
    before = dest.files()
    rc, _, err = _import(archive[0], dest, capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith(f"error: tracking.uri: {dest.uri} already holds another study '{STUDY}'"), err
    assert dest.files() == before


def test_an_interrupted_export_leaves_the_archive_that_was_there(source, archive, tmp_path, capsys, monkeypatch):
    out = tmp_path / "study.tar.gz"
    out.write_bytes(archive[0].read_bytes())
    added = []

    def killed(info):
        added.append(info.name)
        if len(added) == 5:
            raise KeyboardInterrupt
        return info

    monkeypatch.setattr(study_archive.export, "_plain", killed)
    store, parent = source
    argv = ["study", "export", "experiment=drift_2x2", "--run", parent, "--out", str(out), *store.overrides]
    assert main(argv) == 130
    assert out.read_bytes() == archive[0].read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["study.tar.gz"]  # no partial file beside it


def test_export_errors_are_one_line(source, tmp_path, capsys):
    store, _ = source
    export = ["study", "export", *store.overrides]
    cases = [
        (export, "error: experiment: required: experiment=NAME or sweep=NAME"),
        ([*export, "experiment=long_context"], "error: experiment: no study of 'long_context'"),
        ([*export, "experiment=drift_2x2", "--run", "nope"], "error: --run: run 'nope'"),
        ([*export, "experiment=drift_2x2", "--out", str(tmp_path)], "error: --out: "),
        (["study", "import", "tracking.uri=x"], "error: ARCHIVE: 'tracking.uri=x' is an override"),
    ]
    for argv, said in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(said), err
        assert re.search("expected|required", err[0]), err
    assert not list(tmp_path.iterdir())
