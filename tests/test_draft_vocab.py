"""The pruned draft vocabulary (`drafter.draft_vocab_size=N`, EAGLE-3's d2t / t2d): every draft id maps back
to its target id, through our checkpoints in both formats; pruning away tokens the drafter never picks
changes nothing it drafts; a checkpoint whose mapping does not fit the target is refused in one line."""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import small_drafter
from safetensors.torch import load_file, save_file

from lab.config import ConfigError
from lab.config.shape import aux_layers
from lab.data.suites import build_suite
from lab.drafter import (
    CheckpointError,
    Eagle3Drafter,
    draft_vocabulary,
    init_drafter,
    inspect_checkpoint,
    load_checkpoint,
    save_native,
    save_speculators,
)
from lab.drafter.formats import MANIFEST, WEIGHTS
from lab.drafter.imported import resolve
from lab.eval.reference import DecodeStats, speculative_decode

DRAFT_VOCAB = 96  # of the micro target's 512


def save_for_speculators(drafter: Eagle3Drafter, out: Path) -> Path:
    return save_speculators(drafter, out, verifier="/models/target", num_speculative_tokens=3)


SAVERS: dict[str, Callable[[Eagle3Drafter, Path], Path]] = {"native": save_native, "speculators": save_for_speculators}


@pytest.fixture(scope="module")
def counts(micro_target, micro_hidden) -> torch.Tensor:
    """How often each target id is a token to learn in the training data."""
    learned = micro_hidden.input_ids[micro_hidden.loss_mask.bool()]
    return torch.bincount(learned, minlength=micro_target.vocab_size)


@pytest.fixture(scope="module")
def pruned(micro_cfg, micro_target, counts) -> Eagle3Drafter:
    dcfg = micro_cfg.drafter.copy()
    dcfg.draft_vocab_size = DRAFT_VOCAB
    return init_drafter(micro_target, dcfg, aux_layers(micro_cfg), seed=0, token_counts=counts).eval()


# -- every draft id maps back to its target id ---------------------------------------------------------


def assert_maps_back(drafter: Eagle3Drafter, ids: torch.Tensor) -> None:
    """`ids` (ascending target ids) is the drafter's draft vocabulary, in draft order, both ways."""
    n, vocab = len(ids), drafter.spec.vocab_size
    assert drafter.spec.draft_vocab_size == n == drafter.lm_head.weight.shape[0]
    assert torch.equal(drafter.draft_token_ids(), ids)
    assert torch.equal(drafter.to_target_ids(torch.arange(n)), ids)
    draft = torch.randint(0, n, (3, 7), generator=torch.Generator().manual_seed(0))
    assert torch.equal(drafter.to_target_ids(draft), ids[draft])
    t2d = drafter.target_mask()
    assert t2d.dtype == torch.bool and t2d.shape == (vocab,) and int(t2d.sum()) == n
    assert torch.equal(t2d.nonzero().squeeze(-1), ids)
    # the inverse map speculators reads off t2d: a target id's draft id is its rank among the marked ids
    assert torch.equal((t2d.cumsum(0) - 1)[ids], torch.arange(n))
    probs = torch.softmax(torch.randn(2, n, generator=torch.Generator().manual_seed(1)), -1)
    spread = drafter.to_target_probs(probs)
    assert spread.shape == (2, vocab)
    assert torch.equal(spread[:, ids], probs) and not spread[:, ~t2d].any()


def test_draft_vocabulary_is_the_most_frequent_ids_and_maps_back(micro_target, counts, pruned):
    ids = draft_vocabulary(counts, DRAFT_VOCAB)
    assert ids.tolist() == sorted(set(ids.tolist())) and int(ids.max()) < micro_target.vocab_size
    others = torch.ones(micro_target.vocab_size, dtype=torch.bool).index_fill_(0, ids, False)
    assert counts[ids].min() >= counts[others].max()
    assert_maps_back(pruned, ids)
    # init_lm_head_from_target: draft row i is the target's row of target id ids[i]
    assert torch.equal(pruned.lm_head.weight, micro_target.lm_head_weight[ids].to(pruned.lm_head.weight.dtype))


@pytest.mark.parametrize("fmt", list(SAVERS))
def test_mapping_survives_both_formats(tmp_path, counts, pruned, fmt):
    ids = draft_vocabulary(counts, DRAFT_VOCAB)
    folder = SAVERS[fmt](pruned, tmp_path / fmt)
    config = json.loads((folder / "config.json").read_text())
    assert config["draft_vocab_size"] == DRAFT_VOCAB
    weights = load_file(str(folder / WEIGHTS))
    assert weights["d2t"].dtype == torch.int64 and torch.equal(weights["d2t"], ids - torch.arange(DRAFT_VOCAB))
    assert weights["t2d"].dtype == torch.bool and torch.equal(weights["t2d"], pruned.target_mask())
    assert inspect_checkpoint(folder).spec.draft_vocab_size == DRAFT_VOCAB
    back = load_checkpoint(folder)
    assert back.spec == pruned.spec
    assert "t2d" not in back.state_dict()  # the module keeps d2t only; t2d is rebuilt on export
    for name, tensor in pruned.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
    assert_maps_back(back, ids)


def test_an_unpruned_export_has_no_mapping(tmp_path):
    for fmt, save in SAVERS.items():
        keys = set(load_file(str(save(small_drafter(0), tmp_path / fmt) / WEIGHTS)))
        assert not keys & {"d2t", "t2d"}, fmt


def test_d2t_without_t2d_and_a_uint8_t2d_still_load(tmp_path):
    """vLLM-style checkpoints carry d2t alone; a 0/1 mask stored as uint8 is the same mask."""
    src = pruned_small()
    for name, edit in {
        "no t2d": lambda s: s.pop("t2d"),
        "uint8 t2d": lambda s: s.update(t2d=s["t2d"].to(torch.uint8)),
    }.items():
        folder = save_native(src, tmp_path / name.replace(" ", "_"))
        edit_weights(folder, edit)
        assert torch.equal(load_checkpoint(folder).d2t, src.d2t), name


# -- pruning what the drafter never picks changes nothing --------------------------------------------------


def decode_all(target_model, drafter: Eagle3Drafter, prompts: list[list[int]]) -> list[tuple[list[int], tuple]]:
    """Tokens and round statistics (not the time) of greedy decoding, per prompt and k."""
    out = []
    for prompt, k in itertools.product(prompts, (1, 4)):
        tokens, stats = speculative_decode(target_model, drafter, prompt, 32, k)
        out.append((tokens, counted(stats)))
    return out


def counted(stats: DecodeStats) -> tuple:
    return stats.rounds, stats.accepted, list(stats.accepted_at), stats.generated


def with_vocabulary(full: Eagle3Drafter, ids: torch.Tensor) -> Eagle3Drafter:
    """`full`'s weights with lm_head cut to the rows of target ids `ids` (ascending)."""
    drafter = Eagle3Drafter(dataclasses.replace(full.spec, draft_vocab_size=len(ids)))
    state = dict(full.state_dict())
    state["lm_head.weight"] = state["lm_head.weight"][ids]
    state["d2t"] = ids - torch.arange(len(ids))
    drafter.load_state_dict(state, strict=True)
    return drafter.eval()


def test_acceptance_is_unchanged_when_the_argmax_stays_inside(
    tmp_path, micro_cfg, micro_target, counts, trained_eagle3
):
    trained, _ = trained_eagle3
    model, vocab = micro_target.model, micro_target.vocab_size
    prompts = build_suite("in_dist", micro_target.tokenizer, micro_cfg).prompts[:3]
    full = Eagle3Drafter(trained.spec)  # a copy: the session's drafter stays untouched
    full.load_state_dict(trained.state_dict())
    full.eval()
    picked: set[int] = set()
    logits = full.logits

    def recording(h_out: torch.Tensor) -> torch.Tensor:
        z = logits(h_out)
        picked.update(z.argmax(-1).flatten().tolist())  # full vocabulary: draft id == target id
        return z

    full.logits = recording  # every token the greedy drafter proposes, accepted or not
    reference = decode_all(model, full, prompts)
    assert sum(stats[1] for _, stats in reference) > 0, "a drafter that is never accepted shows nothing"

    keep = torch.tensor(sorted(picked | {t for p in prompts for t in p}))
    boosted = counts.clone()
    boosted[keep] += counts.sum() + 1  # ahead of every other id; the rest by frequency, as in training
    size = len(keep) + 32
    assert size < vocab // 2, "a draft vocabulary near the full one would test little"
    ids = draft_vocabulary(boosted, size)
    assert set(keep.tolist()) <= set(ids.tolist())
    pruned = with_vocabulary(full, ids)
    assert decode_all(model, pruned, prompts) == reference
    for fmt, save in SAVERS.items():  # and as vLLM / speculators would get it
        assert decode_all(model, load_checkpoint(save(pruned, tmp_path / fmt)), prompts) == reference, fmt

    # the same test sees a vocabulary that lacks what the drafter picks
    starved = torch.ones(vocab, dtype=torch.bool).index_fill_(0, torch.tensor(sorted(picked)), False)
    lacking = with_vocabulary(full, starved.nonzero().squeeze(-1)[:size])
    assert [stats for _, stats in decode_all(model, lacking, prompts)] != [stats for _, stats in reference]


# -- a mapping that does not fit is refused -------------------------------------------------------------


def pruned_small(draft_vocab: int = 40) -> Eagle3Drafter:
    """A 100-token drafter over an arbitrary draft vocabulary (target order)."""
    drafter = small_drafter(0, draft_vocab_size=draft_vocab)
    ids = torch.randperm(100, generator=torch.Generator().manual_seed(5))[:draft_vocab].sort().values
    drafter.d2t.copy_(ids - torch.arange(draft_vocab))
    return drafter


def edit_weights(folder: Path, edit: Callable[[dict[str, torch.Tensor]], object]) -> None:
    """Change the weight file as another writer could have; the manifest goes (it would refuse any edit)."""
    state = load_file(str(folder / WEIGHTS))
    edit(state)
    save_file(state, str(folder / WEIGHTS))
    (folder / MANIFEST).unlink()


def _unmarked(state: dict[str, torch.Tensor]) -> int:
    return int((~state["t2d"]).nonzero()[0])


def _move_one_mark(state: dict[str, torch.Tensor]) -> None:
    outside = _unmarked(state)
    state["t2d"][int(state["t2d"].nonzero()[0])] = False
    state["t2d"][outside] = True


BAD: dict[str, tuple[Callable[[dict[str, torch.Tensor]], object], str]] = {
    "d2t past the vocabulary": (
        lambda s: s["d2t"].__setitem__(-1, 100 - 39 + 3),
        "d2t maps draft ids onto ids outside the target vocabulary or onto one id twice; "
        "expected offsets to 40 distinct ids below 100",
    ),
    "d2t below zero": (
        lambda s: s["d2t"].__setitem__(0, -1),
        "d2t maps draft ids onto ids outside the target vocabulary",
    ),
    "d2t of the wrong length": (
        lambda s: s.update(d2t=s["d2t"][:-1].contiguous()),
        "d2t has shape [39], expected [40]",
    ),
    "t2d disagreeing with d2t": (
        _move_one_mark,
        "t2d disagrees with d2t (d2t maps draft id 0 to target id",
    ),
    "t2d marking too many": (
        lambda s: s["t2d"].__setitem__(_unmarked(s), True),
        "t2d marks 41 target ids; expected 40 (draft_vocab_size of config.json)",
    ),
    "t2d too short": (
        lambda s: s.update(t2d=s["t2d"][:-1].contiguous()),
        "t2d has shape [99], expected [100] (one entry per target id, vocab_size of config.json)",
    ),
    "t2d too long": (
        lambda s: s.update(t2d=torch.cat([s["t2d"], torch.zeros(1, dtype=torch.bool)])),
        "t2d has shape [101], expected [100]",
    ),
    "t2d not a mask": (
        lambda s: s.update(t2d=s["t2d"].to(torch.uint8) * 2),
        "t2d holds values other than 0 and 1",
    ),
}


@pytest.mark.parametrize("fmt", list(SAVERS))
@pytest.mark.parametrize("case", list(BAD))
def test_a_mapping_that_does_not_fit_is_refused_in_one_line(tmp_path, fmt, case):
    damage, message = BAD[case]
    folder = SAVERS[fmt](pruned_small(), tmp_path / "ckpt")
    load_checkpoint(folder)  # sound before the damage
    edit_weights(folder, damage)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(folder)
    text = str(err.value)
    assert "\n" not in text
    assert text.startswith(str(folder / WEIGHTS)), text
    assert message in text, text


def test_resolve_refuses_a_mapping_for_another_vocabulary_before_loading(tmp_path):
    """`drafter.checkpoint=DIR` is checked at composition, from the file's header: no tensor is read."""
    folder = save_native(pruned_small(), tmp_path / "ckpt")
    assert resolve(folder, num_layers=6, hidden_size=64, vocab_size=100).spec.draft_vocab_size == 40
    with pytest.raises(ConfigError, match="vocab_size 100, the target's is 128"):
        resolve(folder, num_layers=6, hidden_size=64, vocab_size=128)
    edit_weights(folder, lambda s: s.update(t2d=torch.cat([s["t2d"], torch.zeros(28, dtype=torch.bool)])))
    with pytest.raises(ConfigError, match=r"t2d has shape \[128\], expected \[100\]"):
        resolve(folder, num_layers=6, hidden_size=64, vocab_size=100)
