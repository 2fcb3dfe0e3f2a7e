"""A study brought home whole or in part (scripts/study_session.py, which `scripts/gpu_session.sh study` runs):
drift_2x2 at toy size on regenerated conversations (the micro target, JSONL data), cut by SIGTERM in the middle of
an arm once one arm has been exported. The archive in its output folder then holds every finished run, the cut
run with the curves it logged, the Optuna study and the small caches (the regeneration, the answers, the held-out
states). Imported into a fresh store and cache, `lab report` reports the finished arms, and the same `lab ablate`
command resumes the study there: the finished runs are kept, the regeneration is not paid again, and its tables
equal those of the same study run uncut. About four minutes on two cores."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.entities import ViewType
from mlflow.tracking import MlflowClient

from lab.track import study_archive
from lab.track.study_archive import caches

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
TABLES = [f"{t}.csv" for t in ("acceptance", "al", "drift", "rollout")]


def _conversations(path: Path) -> Path:
    """Code-like chats the micro target's tokenizer keeps short: 200, every third with a second turn."""
    lines = []
    for i in range(200):
        messages = [{"role": "user", "content": f"def f_{i}(x):"}, {"role": "assistant", "content": f"    return {i}"}]
        if i % 3 == 0:
            messages += [{"role": "user", "content": "# more"}, {"role": "assistant", "content": "pass"}]
        lines.append(json.dumps({"id": f"c{i}", "messages": messages}))
    path.write_text("\n".join(lines) + "\n")
    return path


class Place:
    """A machine's store and cache in `root` (its targets shared with the test session's: the micro target is
    rebuilt, not carried)."""

    def __init__(self, root: Path, targets: Path) -> None:
        self.root = root
        (root / "cache").mkdir(parents=True)
        (root / "cache" / "targets").symlink_to(targets, target_is_directory=True)

    @property
    def overrides(self) -> list[str]:
        r = self.root
        return [
            f"cache_dir={r / 'cache'}",
            f"tracking.uri=sqlite:///{r / 'mlflow.db'}",
            f"tracking.artifact_root={r}/a",
        ]

    def children(self) -> list:
        client = MlflowClient(tracking_uri=f"sqlite:///{self.root / 'mlflow.db'}")
        ids = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ALL)]
        return client.search_runs(ids, "tags.`mlflow.parentRunId` != ''", ViewType.ALL, max_results=100)


@pytest.fixture(scope="module")
def study(tmp_path_factory, workdir, micro_target) -> list[str]:
    data = _conversations(tmp_path_factory.mktemp("data") / "chats.jsonl")
    return [
        "experiment=drift_2x2", "profile=micro", "device=cpu", "threads=1", "data=jsonl", f"data.path={data}",
        "data.template=chatml", "data.regenerate=true", "data.generator=hf", "data.num_sequences=24",
        "data.heldout_sequences=4", "data.seq_len=160", "data.max_new_tokens=12", "train.steps=60",
        "train.resume_every=0", "eval.num_prompts=2",
    ]  # fmt: skip


def _lab(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-m", "lab.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, f"lab {' '.join(args[:3])}: {done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def _tables(place: Place, study: list[str], cwd: Path) -> dict[str, str]:
    out = place.root / "report"
    _lab(["report", *study, "--seeds", "0", *place.overrides, "--out", str(out)], cwd)
    return {name: (out / "tables" / name).read_text() for name in TABLES}


@pytest.fixture(scope="module")
def uncut(study, tmp_path_factory, workdir) -> dict[str, str]:
    """The tables of the study run whole, in one go."""
    cwd = tmp_path_factory.mktemp("uncut")
    place = Place(cwd / "store", workdir / "cache" / "targets")
    _lab(["ablate", *study, "--seeds", "0", "--no-progress", *place.overrides], cwd)
    return _tables(place, study, cwd)


def _cut_mid_arm(study: list[str], place: Place, archive: Path) -> tuple[int, str]:
    """scripts/study_session.py over the study, sent SIGTERM a second into the training of its third arm (the
    export after its first began by then); its exit code and output."""
    log = place.root / "session.log"
    command = [sys.executable, str(ROOT / "scripts" / "study_session.py"), "--out", str(archive), "--every", "1"]
    command += ["--seeds", "0", *study, *place.overrides]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as out:
        session = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=place.root, env=env)
    deadline = time.monotonic() + 900
    while session.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
        if "trial 2 (norm_output, seed 0): train\n" in log.read_text():
            time.sleep(1)
            session.send_signal(signal.SIGTERM)
            break
    code = session.wait(timeout=600)
    return code, log.read_text()


def test_a_study_cut_mid_arm_comes_home_and_resumes_elsewhere(study, uncut, tmp_path, workdir):
    targets = workdir / "cache" / "targets"
    node, home = Place(tmp_path / "node", targets), Place(tmp_path / "home", targets)
    archive = node.root / "out" / "drift_2x2.tar.gz"
    code, said = _cut_mid_arm(study, node, archive)
    assert code == 128 + signal.SIGTERM, said[-4000:]
    assert "SIGTERM: passed on to the study" in said and f"the study ended (exit {code})" in said, said[-4000:]
    assert "exporting the study (after 1 runs ended)" in said  # the export after each run that ends

    # the archive: every finished run, the cut one with what it logged, the Optuna study, the small caches
    node_runs = {r.info.run_id: r for r in node.children()}
    with study_archive.open_archive(archive) as got:
        statuses = sorted(doc["status"] for doc in got.runs[1:])
        cut = next(doc for doc in got.runs[1:] if doc["status"] == "KILLED")
        entries = caches.listed(got.manifest)
        assert got.optuna is not None
    finished = statuses.count("FINISHED")
    assert finished == 2 and statuses.count("KILLED") == 1 and len(statuses) == finished + 1
    logged = node_runs[cut["run_id"]].data.metrics
    assert set(cut["metrics"]) == set(logged) and any(k.startswith("train/") for k in logged)
    assert {entry.kind for entry in entries} == {"regen", "answers", "heldout"}

    # home: a fresh store and cache; the report of the finished arms, then the same command resumes the study
    imported = _lab(["study", "import", str(archive), *home.overrides], home.root).stdout
    assert f"restored {len(entries)} of {len(entries)}" in imported, imported
    regen = home.root / "cache" / "regen"
    before = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in regen.rglob("*") if p.is_file()}
    assert before
    partial = home.root / "partial"
    _lab(["report", *study, "--seeds", "0", *home.overrides, "--out", str(partial)], home.root)
    reported = [row.split(",") for row in (partial / "tables" / "al.csv").read_text().splitlines()[1:]]
    assert sum(row[8] == "1" for row in reported) == 2 * finished  # each finished arm, at k = 3 and 8

    _lab(["ablate", *study, "--seeds", "0", "--no-progress", *home.overrides], home.root)
    runs = home.children()
    kept = [r for r in runs if r.data.tags.get("lab.imported_from") and r.info.status == "FINISHED"]
    new = [r for r in runs if not r.data.tags.get("lab.imported_from")]
    assert len(kept) == finished and len(new) == 4 - finished
    assert all(r.data.metrics["data/regen_hit"] == 1.0 for r in new)  # the regeneration came home: not paid again
    assert {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in regen.rglob("*") if p.is_file()} == before
    assert _tables(home, study, home.root) == uncut
