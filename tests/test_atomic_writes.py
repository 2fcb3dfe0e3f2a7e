"""Writes that cannot be left half-done: the hidden-state cache, the regeneration's parts, resume states,
drafter checkpoints, reports and study archives are whole or absent after a full disk or a kill, and the next
run notices and writes them whole (lab/fsutil.py: a temp name, fsync, a rename).

Each kind of write meets two faults, on real files in tmp_path:
- a disk that fills up half-way through the write (`FullDisk`: every write under a folder, Python's file
  objects and safetensors' alike, stops with ENOSPC once half of what the write needs is on disk, after
  writing the bytes that fit): nothing half-written is visible at the final path (the old version is there
  whole, or nothing), no temp file is left, and the next normal call writes it whole and it loads;
- SIGKILL between a write and its rename (`killed_before_rename`: the writer runs in a child process whose
  `os.replace` kills it just before the chosen rename, so the new content is on disk under its temp name):
  the final path holds the previous whole version or nothing, and the next run notices (the cache resumes
  from its whole shards, the regeneration redoes the part, a resume state loads the old step or none, a
  checkpoint cut short in a shared folder is refused) and writes it whole, removing the killed write's
  leftover.
"""

from __future__ import annotations

import builtins
import errno
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import safetensors.torch
import torch
from helpers import small_drafter, small_target
from omegaconf import OmegaConf

from lab.data import cache
from lab.data import regenerate as regen
from lab.data.code_data import Sequences
from lab.drafter import load_checkpoint, save_native, save_speculators
from lab.drafter.formats import CheckpointError
from lab.target import Target
from lab.train import resume

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
AUX = [1, 2, 3]


# ------------------------------------------------------------------------------------------- fault injection


class FullDisk:
    """A disk under `root` with `room` bytes left (None: unlimited, only counting what is written). Writes through
    Python's file objects (`open`, `Path.write_text`, tarfile, matplotlib, PIL) and safetensors' files count; a
    write that does not fit writes what fits and raises OSError(ENOSPC), as a full disk does."""

    def __init__(self, root: Path, room: int | None = None):
        self.root = str(root.resolve()) + os.sep
        self.room = room
        self.written = 0
        self._open = builtins.open
        self._serialize = safetensors.torch.serialize_file
        self._scratch = root.resolve().parent / f"scratch-{uuid.uuid4().hex[:8]}"  # outside `root`

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FullDisk:
        monkeypatch.setattr(builtins, "open", self.open)
        monkeypatch.setattr(io, "open", self.open)  # pathlib's read_text / write_text
        monkeypatch.setattr(safetensors.torch, "serialize_file", self.serialize_file)
        return self

    def take(self, n: int) -> int:
        """How many of `n` bytes fit, taken from the room left."""
        fits = n if self.room is None else min(n, self.room - self.written)
        self.written += fits
        return fits

    def open(self, file, mode: str = "r", *args, **kwargs):
        fh = self._open(file, mode, *args, **kwargs)
        writes = "w" in mode or "x" in mode  # a new file's content (a lock file opened "a+" writes nothing)
        if isinstance(file, int) or not writes or not os.path.abspath(os.fsdecode(file)).startswith(self.root):
            return fh
        return _Filling(fh, self)

    def serialize_file(self, tensors, filename, metadata=None) -> None:
        """safetensors writes from Rust: serialize into a scratch file off this disk, then copy the bytes
        through a file object of this disk."""
        self._scratch.mkdir(exist_ok=True)
        scratch = self._scratch / uuid.uuid4().hex
        self._serialize(tensors, str(scratch), metadata=metadata)
        data = scratch.read_bytes()
        scratch.unlink()
        with open(filename, "wb") as fh:
            fh.write(data)


class _Filling:
    """A file object on a `FullDisk`."""

    def __init__(self, fh, disk: FullDisk):
        self._fh, self._disk = fh, disk

    def write(self, data):
        fits = self._disk.take(len(data))
        if fits < len(data):
            self._fh.write(data[:fits])
            self._fh.flush()  # the bytes that fitted are on disk: a half-written file
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self._fh.write(data)

    def fileno(self) -> int:
        # writers that find a descriptor write through it (PIL's encoder); without one they call write()
        raise io.UnsupportedOperation("fileno")

    def __getattr__(self, name: str):
        return getattr(self._fh, name)

    def __iter__(self):
        return iter(self._fh)

    def __enter__(self) -> _Filling:
        return self

    def __exit__(self, *exc) -> None:
        self._fh.close()


def full_disk_halfway(monkeypatch: pytest.MonkeyPatch, root: Path, write, last: str | None = None) -> None:
    """Run `write(root)` into a copy of `root` once to count its bytes, then into `root` on a disk with room
    for half of them (with `last`, the name of the file written last: room for all but half of that file); it
    must fail with ENOSPC. The counting run writes into `root`'s sibling `counted-NAME`."""
    counted = root.parent / f"counted-{root.name}"
    if root.exists():  # the same starting point: what `root` holds before the write
        shutil.copytree(root, counted, symlinks=True)
    with monkeypatch.context() as m:
        disk = FullDisk(counted).install(m)
        write(counted)
    assert disk.written > 0
    room = disk.written // 2 if last is None else disk.written - (counted / last).stat().st_size // 2
    with monkeypatch.context() as m:
        FullDisk(root, room=room).install(m)
        with pytest.raises(Exception) as err:  # an ENOSPC, or an error raised while handling one
            write(root)
    cause = err.value
    while cause is not None and getattr(cause, "errno", None) != errno.ENOSPC:
        cause = cause.__cause__ or cause.__context__
    assert cause is not None, err.value


# Prepended to a child's code: `os.replace` kills the process (SIGKILL, no clean-up of any kind) just before
# the nth rename onto a name that matches argv[1]: what the write wrote is on disk under its temp name.
_KILL_HOOK = f"""
import os, re, signal, sys
sys.path.insert(0, {str(TESTS)!r})
_name, _nth, _seen, _real_replace = re.compile(sys.argv[1]), int(sys.argv[2]), [], os.replace

def _replace(src, dst, *args, **kwargs):
    if _name.fullmatch(os.path.basename(os.fspath(dst))):
        _seen.append(dst)
        if len(_seen) == _nth:
            os.kill(os.getpid(), signal.SIGKILL)
    return _real_replace(src, dst, *args, **kwargs)

os.replace = _replace
import test_atomic_writes as t
"""


def killed_before_rename(call: str, name: str, nth: int = 1) -> None:
    """Run `call` (Python, with this module as `t`) in a child process killed just before its `nth` rename onto
    a name matching the regular expression `name`; fails if the child ends any other way."""
    code = _KILL_HOOK + call
    proc = subprocess.run([sys.executable, "-c", code, name, str(nth)], cwd=ROOT, capture_output=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stderr.decode()[-3000:])


def leftovers(root: Path) -> list[str]:
    """Temp files and folders of writes under `root` (`.NAME.tmp-XXXXXXXX`, `.NAME.old-XXXXXXXX`), by path with
    the random part left out."""
    found = (p for p in root.rglob(".*") if re.fullmatch(r"\..+\.(tmp|old)-[0-9a-f]{8}", p.name))
    return sorted(re.sub(r"-[0-9a-f]{8}$", "", str(p.relative_to(root))) for p in found)


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under `root` by relative path (what "the old version, whole" is compared with)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------------ the hidden-state cache


def cache_inputs() -> tuple[Target, Sequences, object]:
    """A random 4-layer Llama as the target and 10 random sequences of 16 tokens: three shards of 4, 4 and 2
    sequences (with `SHARD_SEQUENCES` at 4), each one batch."""
    target = Target(model=small_target(0), tokenizer=None, path=Path("small"), fingerprint="small-target")
    ids = torch.randint(0, 100, (10, 16), generator=torch.Generator().manual_seed(0))
    mask = (torch.arange(16) >= 8).to(torch.uint8).expand(10, 16).contiguous()
    return target, Sequences(ids, mask), OmegaConf.create({"seq_len": 16})


def build_cache(cache_dir: Path) -> cache.HiddenStates:
    target, seqs, dcfg = cache_inputs()
    return cache.build_or_load(target, seqs, dcfg, AUX, cache_dir, batch_size=4, progress=False)


def heldout_cache(cache_dir: Path) -> cache.HeldoutStates:
    target, seqs, _ = cache_inputs()
    return cache.heldout_states(target, seqs[:6], AUX, cache_dir, batch_size=4)


@pytest.fixture()
def shards_of_4(monkeypatch):
    """Shards of 4 sequences in this process (a child sets its own)."""
    monkeypatch.setattr(cache, "SHARD_SEQUENCES", 4)


def captured_batches(monkeypatch) -> list[int]:
    """The size of every batch the target captures from now on (none: the cache needed no target forward)."""
    calls, real = [], cache.capture_batch

    def counted(model, batch, layers):
        calls.append(len(batch))
        return real(model, batch, layers)

    monkeypatch.setattr(cache, "capture_batch", counted)
    return calls


def same_states(a: cache.HiddenStates, b: cache.HiddenStates) -> bool:
    return all(torch.equal(getattr(a, k), getattr(b, k)) for k in ("input_ids", "loss_mask", "aux", "final"))


def test_cache_build_on_a_full_disk_leaves_no_entry_and_the_next_build_is_whole(tmp_path, monkeypatch, shards_of_4):
    straight = build_cache(tmp_path / "straight")
    full = tmp_path / "full"
    full_disk_halfway(monkeypatch, full, build_cache)
    entry = full / "hidden" / straight.path.name
    assert not entry.exists()  # no entry at all, rather than one missing shards
    partial = full / "hidden" / f"{entry.name}.partial"
    for shard in partial.glob("shard_*"):  # what the build finished, each shard whole
        assert safetensors.torch.load_file(str(shard))["input_ids"].shape[1] == 16
    assert leftovers(full) == []  # the shard cut short went with its temp name
    again = build_cache(full)
    assert not again.stats["hit"] and same_states(again, straight) and cache._verify(entry) is not None
    assert build_cache(full).stats["hit"]


@pytest.mark.parametrize(
    ("name", "captured"),
    [
        pytest.param(r"shard_00001\.safetensors", [4, 2], id="before-a-shard-rename"),
        pytest.param(r"[0-9a-f]{12}", [], id="before-the-entry-rename"),
    ],
)
def test_cache_build_killed_before_a_rename_is_resumed_whole(tmp_path, monkeypatch, shards_of_4, name, captured):
    """Killed with the second shard written under its temp name, the rerun captures the second and third shards
    only; killed with every shard and the manifest written, just before the folder is renamed into place, the
    rerun publishes it without a target forward."""
    straight = build_cache(tmp_path / "straight")
    killed_before_rename(f"t.cache.SHARD_SEQUENCES = 4; t.build_cache(t.Path({str(tmp_path / 'cache')!r}))", name)
    entry = tmp_path / "cache" / "hidden" / straight.path.name
    assert not entry.exists()
    shard_temp = f"hidden/{entry.name}.partial/.shard_00001.safetensors.tmp"
    assert leftovers(tmp_path / "cache") == ([shard_temp] if captured else [])
    calls = captured_batches(monkeypatch)
    again = build_cache(tmp_path / "cache")
    assert calls == captured
    assert not again.stats["hit"] and same_states(again, straight) and cache._verify(entry) is not None
    assert leftovers(tmp_path / "cache") == [] and not list((tmp_path / "cache" / "hidden").glob("*.partial"))


def test_heldout_cache_on_a_full_disk_leaves_no_entry_and_the_next_capture_is_whole(tmp_path, monkeypatch):
    straight = heldout_cache(tmp_path / "straight")
    full = tmp_path / "full"
    full_disk_halfway(monkeypatch, full, heldout_cache)
    assert not (full / "heldout" / straight.path.name).exists() and leftovers(full) == []
    again = heldout_cache(full)
    assert not again.hit and torch.equal(again.aux, straight.aux) and torch.equal(again.top, straight.top)
    assert heldout_cache(full).hit


# ---------------------------------------------------------------------------------------- the regeneration


def micro_from(path: str, fingerprint: str) -> Target:
    """The micro target loaded from its built folder, as `lab.target.load` loads it (in a child process)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, use_safetensors=True)
    model.eval().requires_grad_(False)
    return Target(model=model, tokenizer=AutoTokenizer.from_pretrained(path), path=Path(path), fingerprint=fingerprint)


def regenerate(target: Target, cache_dir: Path) -> regen.RegenResult:
    """test_regenerate.py's five conversations in chunks of two: three parts."""
    from test_regenerate import CONVERSATIONS, MAX_NEW, SEQ_LEN

    from lab.target.chat_template import HandChat

    chat = HandChat(target.tokenizer, "chatml")
    return regen.regenerate(
        target, CONVERSATIONS, chat, max_new_tokens=MAX_NEW, seq_len=SEQ_LEN, backend="hf", cache_dir=cache_dir,
        progress=False, threads=1, chunk_size=2,
    )  # fmt: skip


def parts(result: regen.RegenResult) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(result.path.glob("part_*"))}


def test_regeneration_on_a_full_disk_keeps_only_whole_parts_and_the_next_run_completes_it(
    micro_target, tmp_path, monkeypatch
):
    straight = regenerate(micro_target, tmp_path / "straight")
    full = tmp_path / "full"
    full_disk_halfway(monkeypatch, full, lambda root: regenerate(micro_target, root))
    entry = full / "regen" / straight.path.name
    manifest = json.loads((entry / regen.MANIFEST).read_text())  # whole JSON, naming only whole parts
    assert set(manifest["parts"]) < set(parts(straight)) and regen._verified(entry)["parts"] == manifest["parts"]
    for name, data in snapshot(entry).items():  # a part on disk is a whole one, recorded or not
        assert name == regen.MANIFEST or data == parts(straight)[name], name
    assert leftovers(full) == []
    again = regenerate(micro_target, full)
    assert again.conversations == straight.conversations and parts(again) == parts(straight)
    assert 0 < again.stats["chunks_generated"] < 3 and regenerate(micro_target, full).stats["hit"]


def test_regeneration_killed_before_a_part_rename_redoes_that_part(micro_target, tmp_path):
    """Killed with the second of three parts written under its temp name: the rerun loads the first part and
    generates the second and third."""
    straight = regenerate(micro_target, tmp_path / "straight")
    cache_dir = tmp_path / "cache"
    target = f"t.micro_from({str(micro_target.path)!r}, {micro_target.fingerprint!r})"
    child = f"t.regenerate({target}, t.Path({str(cache_dir)!r}))"
    killed_before_rename(child, r"part_.*\.jsonl", nth=2)
    entry = cache_dir / "regen" / straight.path.name
    first = next(iter(json.loads((entry / regen.MANIFEST).read_text())["parts"]))
    assert sorted(p.name for p in entry.glob("part_*")) == [first]
    assert len(leftovers(cache_dir)) == 1 and leftovers(cache_dir)[0].startswith(f"regen/{entry.name}/.part_")
    again = regenerate(micro_target, cache_dir)
    assert (again.stats["chunks_loaded"], again.stats["chunks_generated"]) == (1, 2)
    assert again.conversations == straight.conversations and parts(again) == parts(straight)
    assert leftovers(cache_dir) == []


# ------------------------------------------------------------------------------------- resume states


def train_state(step: int) -> resume.ResumeState:
    """A resume state's state at `step` of 10 (a small drafter's weights, made-up optimizer state)."""
    drafter = small_drafter(step)
    return resume.ResumeState(
        step=step,
        steps=10,
        model=drafter.state_dict(),
        optimizer={0: {"step": torch.tensor(float(step)), "exp_avg": torch.ones(3), "exp_avg_sq": torch.zeros(3)}},
        order=torch.randperm(32, generator=torch.Generator().manual_seed(step)),
        cursor=step,
        generator=torch.Generator().manual_seed(1).get_state(),
        log_every=5,
        window=[{"loss": 1.5, "plosses": [1.0], "accs": [0.5]}],
        history=[(2, {"train/loss": 2.0})],
        run_id=f"run-{step}",
    )


def save_state(path: Path, step: int) -> None:
    resume.save(path, train_state(step))


def loaded_step(path: Path) -> int | None:
    """The step of the resume state at `path`, checked against its manifest, or None (none usable)."""
    state = resume.load(path, steps=10)
    if state is None:
        return None
    assert all(torch.equal(v, state.model[k]) for k, v in train_state(state.step).model.items())
    return state.step


def test_resume_checkpoint_on_a_full_disk_keeps_the_previous_one(tmp_path, monkeypatch, capsys):
    path = tmp_path / "checkpoints" / "key"
    save_state(path, 4)
    full_disk_halfway(monkeypatch, path.parent, lambda root: save_state(root / "key", 8))
    assert loaded_step(path) == 4 and leftovers(path.parent) == []
    save_state(path, 8)
    assert loaded_step(path) == 8
    assert capsys.readouterr().err == ""  # never a checkpoint refused: nothing partial was there to refuse


@pytest.mark.parametrize(
    ("name", "step"),
    [
        pytest.param(r"\.key\.old-.*", 4, id="before-the-old-one-moves-aside"),
        pytest.param("key", None, id="before-the-new-one-moves-in"),
    ],
)
def test_resume_checkpoint_killed_before_its_rename_is_the_previous_one_or_none(tmp_path, capsys, name, step):
    """Killed with step 8's checkpoint written beside step 4's: the path holds step 4's, or (killed between the
    two renames) nothing, and resuming trains from step 4 or from scratch, never from a partial checkpoint;
    the next save writes step 8 whole and removes what the killed one left."""
    path = tmp_path / "checkpoints" / "key"
    save_state(path, 4)
    killed_before_rename(f"t.save_state(t.Path({str(path)!r}), 8)", name)
    assert loaded_step(path) == step and leftovers(path.parent)  # the new checkpoint, whole, under its temp name
    save_state(path, 8)
    assert loaded_step(path) == 8 and leftovers(path.parent) == []
    assert capsys.readouterr().err == ""


# ------------------------------------------------------------------------------------- drafter checkpoints


def save_drafter(out: Path, fmt: str, seed: int) -> Path:
    drafter = small_drafter(seed)
    if fmt == "native":
        return save_native(drafter, out)
    return save_speculators(drafter, out, "/models/target", 3)


def drafter_seed(out: Path) -> int:
    """Which small drafter the checkpoint at `out` holds (its manifest checked on load)."""
    loaded = load_checkpoint(out)
    seeds = [s for s in (0, 1) if torch.equal(small_drafter(s).fc.weight, loaded.fc.weight)]
    assert len(seeds) == 1
    return seeds[0]


@pytest.mark.parametrize("last", [None, "ckpt/lab_manifest.json"], ids=["halfway", "in-the-manifest"])
@pytest.mark.parametrize("fmt", ["native", "speculators"])
def test_drafter_checkpoint_on_a_full_disk_keeps_the_previous_one(tmp_path, monkeypatch, fmt, last):
    """The disk fills half-way through the checkpoint, or in its last file, the manifest (the weights and the
    config written): the folder holds the previous checkpoint, never new weights beside the old manifest."""
    out = tmp_path / "drafters" / "ckpt"
    save_drafter(out, fmt, 0)
    full_disk_halfway(monkeypatch, out.parent, lambda root: save_drafter(root / "ckpt", fmt, 1), last)
    assert drafter_seed(out) == 0 and leftovers(out.parent) == []
    save_drafter(out, fmt, 1)
    assert drafter_seed(out) == 1


@pytest.mark.parametrize(
    ("name", "before"),
    [
        pytest.param(r"\.ckpt\.old-.*", 0, id="before-the-old-one-moves-aside"),
        pytest.param("ckpt", None, id="before-the-new-one-moves-in"),
    ],
)
def test_drafter_checkpoint_killed_before_its_rename_is_the_previous_one_or_none(tmp_path, name, before):
    out = tmp_path / "drafters" / "ckpt"
    save_drafter(out, "native", 0)
    killed_before_rename(f"t.save_drafter(t.Path({str(out)!r}), 'native', 1)", name)
    if before is None:
        assert not out.exists()
    else:
        assert drafter_seed(out) == before
    assert leftovers(out.parent)
    save_drafter(out, "native", 1)
    assert drafter_seed(out) == 1 and leftovers(out.parent) == [] and not list(out.glob(".*"))


def test_drafter_checkpoint_killed_in_a_shared_folder_is_refused_never_loaded(tmp_path):
    """`lab export --out DIR` into a folder holding other files: the checkpoint's files move in one by one
    (the folder is not replaced: its other files stay). Killed with the new weights in but the old manifest
    still there, loading refuses it (the manifest's hash); the next export makes it whole."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("the user's own file\n")
    save_drafter(out, "native", 0)
    killed_before_rename(f"t.save_drafter(t.Path({str(out)!r}), 'native', 1)", r"config\.json")
    with pytest.raises(CheckpointError, match="content hash does not match lab_manifest.json"):
        load_checkpoint(out)
    save_drafter(out, "native", 1)
    assert drafter_seed(out) == 1 and (out / "notes.txt").read_text() == "the user's own file\n"
    files = ["config.json", "lab_manifest.json", "model.safetensors", "notes.txt"]
    assert sorted(p.name for p in out.iterdir()) == files  # nothing left of the killed export


# ---------------------------------------------------------------------------------- reports and archives


@pytest.fixture(scope="module")
def study_store(tmp_path_factory) -> tuple[str, str]:
    """tests/test_report.py's drift_2x2 study, one seed of each arm, in a real sqlite MLflow store; its URI and
    parent run id."""
    from test_report import ARMS, _log_run

    from lab import track

    root = tmp_path_factory.mktemp("store")
    uri, art = f"sqlite:///{root / 'mlflow.db'}", str(root / "artifacts")
    tags = {"study": "drift_2x2", "sweep": "drift_2x2", "optuna_study": "drift_2x2-test", "git_commit": "abc123"}
    with track.parent_run(uri, art, "drift_2x2", "sweep-drift_2x2", "drift_2x2-test", tags) as parent:
        parent.log_params({"sweep.seeds": [0]})
        for arm in ARMS:
            _log_run(uri, art, parent.id, arm, 0)
    return uri, parent.id


def write_report(uri: str, parent: str, folder: Path, figure: str) -> None:
    """The study's report with one figure of the experiment's (and vLLM's speedup, which is always drawn)."""
    from lab import report

    arms = [(a, a) for a in ("eagle3", "fc_norm", "norm_output", "eagle31")]
    study = report.load(uri, parent, "drift_2x2", "", arms, "eagle3", [0])
    report.write(study, [figure], folder, f"lab report experiment=drift_2x2 ({figure})")


@pytest.mark.parametrize("last", [None, "drift_2x2/report.md"], ids=["halfway", "in-report.md"])
def test_report_on_a_full_disk_keeps_the_previous_report(study_store, tmp_path, monkeypatch, last):
    """The disk fills half-way through the report, or in report.md (its tables and figures written): the
    folder holds the previous report, file for file; the rerun writes the new one, nothing of the old left."""
    uri, parent = study_store
    folder = tmp_path / "reports" / "drift_2x2"
    write_report(uri, parent, folder, "accept_rate")
    before = snapshot(folder)
    new = "al_vs_depth"  # another figure than the report there: another report
    full_disk_halfway(monkeypatch, folder.parent, lambda root: write_report(uri, parent, root / "drift_2x2", new), last)
    assert snapshot(folder) == before and leftovers(folder.parent) == []  # the old report, every file of it
    write_report(uri, parent, folder, "al_vs_depth")
    write_report(uri, parent, tmp_path / "straight", "al_vs_depth")
    assert snapshot(folder) == snapshot(tmp_path / "straight")  # the new report, whole


@pytest.mark.parametrize(
    ("name", "kept"),
    [
        pytest.param(r"\.drift_2x2\.old-.*", True, id="before-the-old-one-moves-aside"),
        pytest.param("drift_2x2", False, id="before-the-new-one-moves-in"),
    ],
)
def test_report_killed_before_its_rename_is_the_previous_one_or_none(study_store, tmp_path, name, kept):
    uri, parent = study_store
    folder = tmp_path / "reports" / "drift_2x2"
    write_report(uri, parent, folder, "accept_rate")
    before = snapshot(folder)
    killed_before_rename(f"t.write_report({uri!r}, {parent!r}, t.Path({str(folder)!r}), 'al_vs_depth')", name)
    assert snapshot(folder) == (before if kept else {}) and leftovers(folder.parent)
    write_report(uri, parent, folder, "al_vs_depth")
    write_report(uri, parent, tmp_path / "straight", "al_vs_depth")
    assert snapshot(folder) == snapshot(tmp_path / "straight") and leftovers(folder.parent) == []


def export(uri: str, parent: str, out: Path) -> None:
    from lab.track import study_archive

    study = {"kind": "experiment", "name": "drift_2x2", "experiment": "drift_2x2", "optuna_study": "drift_2x2-test"}
    study_archive.export_study(uri, parent, out, {**study, "overrides": []})


def archive_runs(out: Path) -> int:
    """The runs in the archive at `out`, read and checked through as `lab study import` reads it."""
    from lab.track import study_archive

    with study_archive.open_archive(out) as archive:
        return len(archive.runs)


def test_study_export_on_a_full_disk_keeps_the_previous_archive(study_store, tmp_path, monkeypatch):
    uri, parent = study_store
    out = tmp_path / "exports" / "study.tar.gz"
    export(uri, parent, out)
    before = out.read_bytes()
    # cut half-way through the archive itself (the runs staged before it fit)
    full_disk_halfway(monkeypatch, out.parent, lambda root: export(uri, parent, root / "study.tar.gz"), "study.tar.gz")
    assert out.read_bytes() == before and sorted(p.name for p in out.parent.iterdir()) == ["study.tar.gz"]
    export(uri, parent, out)
    assert archive_runs(out) == 5


def test_study_export_killed_before_its_rename_keeps_the_previous_archive(study_store, tmp_path):
    uri, parent = study_store
    out = tmp_path / "exports" / "study.tar.gz"
    export(uri, parent, out)
    before = out.read_bytes()
    killed_before_rename(f"t.export({uri!r}, {parent!r}, t.Path({str(out)!r}))", r"study\.tar\.gz")
    assert out.read_bytes() == before
    # the archive, whole, under its temp name, and the runs staged beside it
    assert leftovers(out.parent) == [".study.tar.gz.tmp", ".study.tar.gz.tmp"]
    export(uri, parent, out)
    assert archive_runs(out) == 5 and sorted(p.name for p in out.parent.iterdir()) == ["study.tar.gz"]
