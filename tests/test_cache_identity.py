"""A cache entry is what its key says: every kind records what its key hashes (its `Identity`, lab/fsutil.py), and
an entry moved under another configuration's key, whole by its own manifest, is rebuilt or refused in one line
that names the field, never read as that configuration's. Entries that record no identity keep loading, and no
key changes."""

from __future__ import annotations

import json
import os
import shutil
import types
from pathlib import Path

import pytest
import torch
from helpers import logged
from omegaconf import OmegaConf

from lab.config import ConfigError
from lab.config.composition import compose
from lab.data import answers as answers_mod
from lab.data import cache
from lab.data import regenerate as regen
from lab.data.code_data import training_sequences
from lab.data.conversations import Conversation
from lab.fsutil import IDENTITY, Identity, Mismatch, short_hash
from lab.target import build as target_build
from lab.target import gguf
from lab.target.chat_template import HandChat

LAYERS, OTHER_LAYERS = [1, 2, 3], [0, 2, 3]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run fastest on one thread."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def move(entry: Path, key: str) -> Path:
    """Rename the entry folder `entry` onto `key` beside it, as a copy between machines under a wrong name would
    leave it; the new path."""
    moved = entry.parent / key
    shutil.rmtree(moved, ignore_errors=True)
    os.replace(entry, moved)
    return moved


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def forget_identity(folder: Path, name: str) -> None:
    """Leave the entry's manifest as an entry that records no identity has it."""
    record = json.loads((folder / name).read_text())
    record.pop(IDENTITY)
    (folder / name).write_text(json.dumps(record, indent=1))


# ------------------------------------------------------------------------------------------------ the rule


def test_the_first_differing_field_is_named_with_both_values():
    asked = Identity({"target": "micro-1", "data": {"num_sequences": 768, "chunk_chars": [100, 400]}, "format": 2})
    stored = {IDENTITY: {"target": "micro-1", "data": {"num_sequences": 512, "chunk_chars": [100, 400]}, "format": 2}}
    wrong = asked.mismatch(stored)
    assert wrong == Mismatch("data.num_sequences", 512, 768)
    assert str(wrong) == "built for data.num_sequences=512, this run asks 768"
    assert asked.mismatch({IDENTITY: asked.fields}) is None
    assert asked.mismatch({"shards": []}) is None and asked.mismatch(None) is None  # no identity recorded: as it is
    # a field only one side has, a list, and values Python calls equal but the key tells apart
    assert str(asked.mismatch({IDENTITY: {**asked.fields, "extra": 1}})) == "built for extra=1, this run asks (none)"
    data = {**asked.fields["data"], "chunk_chars": [100, 500]}
    assert asked.mismatch({IDENTITY: {**asked.fields, "data": data}}).field == "data.chunk_chars"
    assert Identity({"lr": 1}).mismatch({IDENTITY: {"lr": 1.0}}) == Mismatch("lr", 1.0, 1)
    assert "\n" not in str(Identity({"t": "a\nb" * 40}).mismatch({IDENTITY: {"t": "c"}}))  # one line, cut short


def test_the_key_is_the_hash_of_the_identity_as_recorded():
    """What JSON lacks goes in as its str(), as `short_hash` hashes it: the recorded identity gives the key back."""
    fields = {"spec": {"chunk_chars": OmegaConf.create([100, 400]), "lr": 5e-3, "seed": 0}, "shape": (3, 4)}
    identity = Identity(fields)
    assert identity.key() == short_hash(fields) == Identity(json.loads(json.dumps(identity.fields))).key()


def test_no_key_changes():
    """Keys a user's cache already holds (tests/test_target_families.py pins the built targets')."""
    target = types.SimpleNamespace(
        fingerprint="micro-0123456789ab", lm_head_weight=torch.zeros(1), device=torch.device("cpu")
    )
    dcfg = OmegaConf.create({"name": "micro", "num_sequences": 256, "chunk_chars": [100, 400]})
    chat = types.SimpleNamespace(identity={"kind": "test", "template": "x"})
    assert cache.cache_key(target, dcfg, LAYERS) == "e83dd31895f0"
    assert cache.heldout_identity(target, torch.arange(12).reshape(3, 4), LAYERS).key() == "ef7e28455053"
    assert answers_mod.answers_key(target, [[1, 2], [3]], 12, (2,), LAYERS) == "2cb8904b3577"
    assert regen.cache_key(target, chat, 8, 512, "hf", "float32", 64) == "0332ffd9ca0d"


# ------------------------------------------------------------------------------------------- each kind


def same_hidden(a: cache.HiddenStates, b: cache.HiddenStates) -> bool:
    return all(torch.equal(getattr(a, k), getattr(b, k)) for k in ("input_ids", "loss_mask", "aux", "final"))


@pytest.mark.parametrize(
    ("change", "line"),
    [
        pytest.param({"aux": OTHER_LAYERS}, "built for aux=[1, 2, 3], this run asks [0, 2, 3]", id="aux"),
        pytest.param({"num_sequences": 255}, "built for data.num_sequences=256, this run asks 255", id="data"),
    ],
)
def test_hidden_states_under_another_key_are_rebuilt(
    micro_cfg, micro_target, micro_sequences, tmp_path, capsys, change, line
):
    """The same tokens under another data config or other captured layers: the stored token check passes, so only
    the identity tells the entry apart."""
    seqs = micro_sequences[0][:4]
    dcfg = OmegaConf.merge(micro_cfg.data, {k: v for k, v in change.items() if k != "aux"})
    layers = change.get("aux", LAYERS)
    built = cache.build_or_load(micro_target, seqs, micro_cfg.data, LAYERS, tmp_path / "cache", progress=False)
    fresh = cache.build_or_load(micro_target, seqs, dcfg, layers, tmp_path / "fresh", progress=False)
    key = cache.cache_key(micro_target, dcfg, layers)
    move(built.path, key)
    capsys.readouterr()
    got = cache.build_or_load(micro_target, seqs, dcfg, layers, tmp_path / "cache", progress=False)
    out = logged(capsys.readouterr().err)  # the line, then the capture's progress
    assert out == [f"cache entry hidden/{key}: {line}; rebuilding it", "hidden-state cache: 4 of 4 sequences"]
    assert not got.stats["hit"] and same_hidden(got, fresh)
    assert cache.build_or_load(micro_target, seqs, dcfg, layers, tmp_path / "cache", progress=False).stats["hit"]


def test_an_interrupted_build_of_another_key_starts_over(micro_cfg, micro_target, micro_sequences, tmp_path, capsys):
    """A `{key}.partial/` folder of another entry's shards (same tokens, other layers) is captured again, not
    published as this entry."""
    seqs = micro_sequences[0][:4]
    built = cache.build_or_load(micro_target, seqs, micro_cfg.data, LAYERS, tmp_path / "cache", progress=False)
    fresh = cache.build_or_load(micro_target, seqs, micro_cfg.data, OTHER_LAYERS, tmp_path / "fresh", progress=False)
    key = cache.cache_key(micro_target, micro_cfg.data, OTHER_LAYERS)
    move(built.path, f"{key}.partial")
    capsys.readouterr()
    got = cache.build_or_load(micro_target, seqs, micro_cfg.data, OTHER_LAYERS, tmp_path / "cache", progress=False)
    line = f"cache entry hidden/{key}.partial: built for aux=[1, 2, 3], this run asks [0, 2, 3]; capturing its shards"
    assert logged(capsys.readouterr().err)[0].startswith(line)
    assert same_hidden(got, fresh)


def test_heldout_states_under_another_key_are_rebuilt(micro_target, micro_sequences, tmp_path, capsys):
    heldout = micro_sequences[1][:3]
    built = cache.heldout_states(micro_target, heldout, LAYERS, tmp_path / "cache")
    fresh = cache.heldout_states(micro_target, heldout, OTHER_LAYERS, tmp_path / "fresh")
    key = cache.heldout_identity(micro_target, heldout.input_ids, OTHER_LAYERS).key()
    move(built.path, key)
    capsys.readouterr()
    got = cache.heldout_states(micro_target, heldout, OTHER_LAYERS, tmp_path / "cache")
    line = f"cache entry heldout/{key}: built for aux=[1, 2, 3], this run asks [0, 2, 3]; rebuilding it"
    assert logged(capsys.readouterr().err) == [line]
    assert not got.hit and torch.equal(got.aux, fresh.aux) and torch.equal(got.top, fresh.top)


def test_code_sequences_under_another_key_are_chosen_again(micro_cfg, micro_target, tmp_path, capsys):
    other = OmegaConf.merge(micro_cfg.data, {"heldout_sequences": 8})
    cache.code_sequences(micro_target, micro_cfg.data, tmp_path / "cache")
    cache.code_sequences(micro_target, other, tmp_path / "probe")
    (built,) = (p for p in (tmp_path / "cache" / "sequences").iterdir() if p.is_dir())
    (key,) = (p.name for p in (tmp_path / "probe" / "sequences").iterdir() if p.is_dir())
    move(built, key)
    capsys.readouterr()
    got = cache.code_sequences(micro_target, other, tmp_path / "cache")
    line = f"cache entry sequences/{key}: built for data.heldout_sequences=16, this run asks 8; rebuilding it"
    assert logged(capsys.readouterr().err) == [line]
    want = training_sequences(micro_target.tokenizer, other)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.input_ids, w.input_ids) and torch.equal(g.loss_mask, w.loss_mask)


def test_answers_under_another_key_are_rebuilt(micro_target, tmp_path, capsys):
    """A suite's answers of another length, whole and for the same prompts (so the stored prompt check passes)."""
    prompts, stops = [[1, 5, 9, 13], [2, 6, 10]], (micro_target.tokenizer.eos_token_id,)
    built = answers_mod.suite_answers(micro_target, prompts, 12, stops, LAYERS, tmp_path / "cache")
    fresh = answers_mod.suite_answers(micro_target, prompts, 10, stops, LAYERS, tmp_path / "fresh")
    key = answers_mod.answers_key(micro_target, prompts, 10, stops, LAYERS)
    move(built.path, key)
    capsys.readouterr()
    got = answers_mod.suite_answers(micro_target, prompts, 10, stops, LAYERS, tmp_path / "cache")
    line = f"cache entry answers/{key}: built for length=12, this run asks 10; rebuilding it"
    assert logged(capsys.readouterr().err) == [line]
    assert not got.hit and got.sequences == fresh.sequences and torch.equal(got.aux, fresh.aux)


CONVERSATIONS = [
    Conversation(
        "a", ({"role": "user", "content": "Write a function."}, {"role": "assistant", "content": "def f(): pass"})
    ),
    Conversation("b", ({"role": "user", "content": "import os"}, {"role": "assistant", "content": "import sys"})),
]


def regenerate(target, cache_dir: Path, max_new_tokens: int) -> regen.RegenResult:
    chat = HandChat(target.tokenizer, "chatml")
    return regen.regenerate(
        target, CONVERSATIONS, chat, max_new_tokens=max_new_tokens, seq_len=256, backend="hf", cache_dir=cache_dir,
        progress=False, threads=1,
    )  # fmt: skip


def test_a_regeneration_under_another_key_is_refused_and_left_as_it_is(micro_target, tmp_path):
    """Its parts are whole generations for its own key: refused in one line that says where it belongs, nothing
    of it read or regenerated over; moved back there, it is a hit."""
    built = regenerate(micro_target, tmp_path, 4)
    own = built.path.name
    key = regenerate(micro_target, tmp_path / "probe", 5).path.name
    moved = move(built.path, key)
    before = snapshot(moved)
    want = (
        f"cache_dir: cache entry regen/{key}: built for max_new_tokens=4, this run asks 5; it belongs at regen/{own}: "
        "move it there or delete it"
    )
    with pytest.raises(ConfigError) as err:
        regenerate(micro_target, tmp_path, 5)
    assert str(err.value) == want
    assert snapshot(moved) == before
    move(moved, own)
    again = regenerate(micro_target, tmp_path, 4)
    assert again.stats["hit"] and again.conversations == built.conversations


def small_target_cfg(cache_dir: Path, steps: int):
    """The micro target at 2 or 3 steps over a small corpus: built in about a second."""
    return compose(["profile=micro", f"cache_dir={cache_dir}", f"target.steps={steps}", "target.corpus_bytes=100000"])


def test_a_built_target_under_another_key_is_built_again(tmp_path, capsys):
    first = target_build.build(small_target_cfg(tmp_path, 2).target, tmp_path, progress=False)
    tcfg = small_target_cfg(tmp_path, 3).target
    wanted = target_build.target_dir(tcfg, tmp_path)
    move(first, wanted.name)
    capsys.readouterr()
    got = target_build.build(tcfg, tmp_path, progress=False)
    assert got == wanted
    line = f"cache entry targets/{wanted.name}: built for spec.steps=2, this run asks 3; rebuilding it"
    assert logged(capsys.readouterr().err) == [line]
    info = json.loads((got / target_build.BUILD_INFO).read_text())
    assert info["config"]["steps"] == 3 and info[IDENTITY] == target_build.target_identity(tcfg, _files(tcfg)).fields
    assert target_build.target_key(tcfg, _files(tcfg)) == wanted.name.removeprefix(f"{tcfg.name}-")


def _files(tcfg):
    from lab.target import corpus

    return corpus.select(tcfg.corpus_bytes)


def fake_gguf_conversion(monkeypatch) -> None:
    """`gguf.convert` over any file as the GGUF: transformers' loading replaced by a small model folder."""

    class Model:
        hf_quantizer = None
        config = types.SimpleNamespace()

        def save_pretrained(self, folder):
            Path(folder).mkdir(parents=True, exist_ok=True)
            (Path(folder) / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))

    class Tokenizer:
        chat_template = "{{ messages }}"

        def save_pretrained(self, folder):
            (Path(folder) / "tokenizer.json").write_text("{}")

    import transformers

    monkeypatch.setattr(gguf, "gguf_file", lambda tcfg, cache_dir: Path(tcfg.path))
    monkeypatch.setattr(gguf, "_parsed_once", lambda: __import__("contextlib").nullcontext())
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: Model())
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: Tokenizer())


def test_a_converted_gguf_under_another_key_is_converted_again(tmp_path, monkeypatch, capsys):
    fake_gguf_conversion(monkeypatch)
    files = [tmp_path / f"model-{i}.gguf" for i in range(2)]
    for i, file in enumerate(files):
        file.write_bytes(b"GGUF" + bytes([i]) * 60)
    tcfgs = [OmegaConf.create({"name": "t", "path": str(file), "asset": None}) for file in files]
    first = gguf.convert(tcfgs[0], tmp_path / "cache", progress=False)
    digest = json.loads((first / gguf.BUILD_INFO).read_text())["sha256"]
    wanted = gguf.convert(tcfgs[1], tmp_path / "probe", progress=False).name
    moved = move(first, wanted)
    capsys.readouterr()
    got = gguf.convert(tcfgs[1], tmp_path / "cache", progress=False)
    assert got == moved
    info = json.loads((got / gguf.BUILD_INFO).read_text())
    line = f"cache entry targets/{wanted}: built for sha256={digest}, this run asks {info['sha256']}; rebuilding it"
    assert logged(capsys.readouterr().err) == [line]
    assert info["sha256"].startswith(wanted.removeprefix("t-")) and info[IDENTITY] == {"sha256": info["sha256"]}


# ------------------------------------------------------------------------- entries that record no identity


def test_entries_that_record_no_identity_keep_loading(micro_cfg, micro_target, micro_sequences, tmp_path, monkeypatch):
    """Their files still match their manifests' hashes: each is a hit, with nothing built again."""
    seqs, heldout = micro_sequences[0][:4], micro_sequences[1][:2]
    prompts, stops = [[1, 5, 9]], (micro_target.tokenizer.eos_token_id,)
    hidden = cache.build_or_load(micro_target, seqs, micro_cfg.data, LAYERS, tmp_path, progress=False)
    held = cache.heldout_states(micro_target, heldout, LAYERS, tmp_path)
    answers = answers_mod.suite_answers(micro_target, prompts, 6, stops, LAYERS, tmp_path)
    regenerated = regenerate(micro_target, tmp_path, 4)
    target = target_build.build(small_target_cfg(tmp_path, 2).target, tmp_path, progress=False)
    for folder, name in [
        (hidden.path, cache.MANIFEST),
        (held.path, cache.MANIFEST),
        (answers.path, cache.MANIFEST),
        (regenerated.path, regen.MANIFEST),
        (target, target_build.BUILD_INFO),
    ]:
        forget_identity(folder, name)

    def forbidden(*args, **kwargs):
        raise AssertionError("the target ran for an entry that was there")

    monkeypatch.setattr(micro_target.model, "forward", forbidden)
    monkeypatch.setattr(target_build, "train_tokenizer", forbidden)
    assert cache.build_or_load(micro_target, seqs, micro_cfg.data, LAYERS, tmp_path, progress=False).stats["hit"]
    assert cache.heldout_states(micro_target, heldout, LAYERS, tmp_path).hit
    assert answers_mod.suite_answers(micro_target, prompts, 6, stops, LAYERS, tmp_path).hit
    assert regenerate(micro_target, tmp_path, 4).stats["hit"]
    assert target_build.build(small_target_cfg(tmp_path, 2).target, tmp_path, progress=False) == target


def test_a_resume_state_under_another_key_is_refused_and_left_as_it_is(micro_cfg, tmp_path):
    """Another training's progress moved under this training's key: refused before the run opens, never
    trained over."""
    import torch

    from lab.config import ConfigError
    from lab.train import resume

    faster = micro_cfg.copy()
    faster.train.lr = micro_cfg.train.lr * 2
    mine, theirs = (resume.training_identity(c, "target-fp", [1, 2]) for c in (micro_cfg, faster))
    state = resume.ResumeState(
        step=1, steps=2, model={"w": torch.zeros(2)}, optimizer={}, order=torch.arange(4), cursor=1,
        generator=torch.Generator().get_state(), log_every=1,
    )  # fmt: skip
    written = tmp_path / "resume" / mine.key()
    resume.save(written, state, mine)
    resume.check_identity(written, mine)  # its own key: taken
    moved = move(written, theirs.key())
    before = snapshot(moved)
    with pytest.raises(ConfigError, match=rf"^cache_dir: resume state resume/{theirs.key()}: built for train.lr="):
        resume.check_identity(moved, theirs)
    assert snapshot(moved) == before
    resume.check_identity(tmp_path / "resume" / "absent", theirs)  # nothing there: nothing to refuse
