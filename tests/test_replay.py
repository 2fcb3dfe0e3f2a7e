"""eval.decoder=replay equals the reference decoder: every prompt's rounds, accepted drafts and accepted-at counts
exactly, its drift probes within 1e-5, for an EAGLE-3, an EAGLE 3.1 and an MLA drafter on every suite of the
micro target's code data at k = 3 and 8 with stops at the eos (float32); a perturbed drafter and a shifted
position make the comparison fail. And the answer cache: reused, rebuilt when damaged, refused when it does
not hold the suite's prompts."""

from __future__ import annotations

import copy
import dataclasses
import shutil

import pytest
import torch
from helpers import perturb

from lab.config.composition import compose
from lab.config.shape import aux_layers
from lab.data.answers import compute_answers, length_groups, suite_answers, write_answers
from lab.data.suites import build_suite
from lab.eval.probes import DriftProbes
from lab.eval.reference import speculative_decode
from lab.eval.replay import replay

KS = [3, 8]
SUITES = ["in_dist", "long_context", "template", "system_prompt"]  # every suite of code data


# a few prompts of every kind: 2 in_dist, 2 long contexts, 7 templates, 4 system prompts
FEW = ["eval.num_prompts=2", "suites.long_context.context_multiples=[2,4]"] + [
    f"suites.{name}.num_prompts=1" for name in SUITES[1:]
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def suites(micro_overrides, micro_target):
    cfg = compose(micro_overrides + [f"eval.suites=[{','.join(SUITES)}]", *FEW])
    built = [build_suite(name, micro_target.tokenizer, cfg, None) for name in SUITES]
    assert all(s.stop_ids == (micro_target.tokenizer.eos_token_id,) for s in built)
    layers = aux_layers(cfg)
    return [
        (s, compute_answers(micro_target, s.prompts, s.max_new_tokens + max(KS), s.stop_ids, layers)) for s in built
    ]


def test_the_answers_batch_prompts_of_similar_length():
    """A batch is padded to its longest row: long_context's 2x, 4x and 8x prompts get batches of their own,
    prompts a few tokens apart share one, and no batch holds more than its size."""
    assert length_groups([1024, 64, 2048, 60, 4096, 1030]) == [[3, 1], [0, 5], [2], [4]]
    assert length_groups([64] * 5, size=2) == [[0, 1], [2, 3], [4]]


@pytest.fixture(scope="module")
def mla_drafter(micro_overrides, micro_target, micro_hidden):
    """An EAGLE 3.1 drafter with MLA attention over the micro target, trained a few steps (one thread)."""
    from lab.drafter import init_drafter
    from lab.train.ttt import train

    mla = ["drafter=eagle31", "drafter.attention=mla", "drafter.q_lora_rank=64", "train.steps=20"]
    cfg = compose(micro_overrides + mla)
    drafter = init_drafter(micro_target, cfg.drafter, aux_layers(cfg), seed=0)
    train(drafter, micro_hidden, micro_target.lm_head_weight, cfg.train, seed=0, progress=False)
    return drafter.eval()


def _decoded(model, drafter, suites) -> list:
    """The reference decoder's (stats, drift sums) per suite, prompt and k."""
    out = []
    for suite, _ in suites:
        for prompt in suite.prompts:
            for k in KS:
                probes = DriftProbes(k)
                _, stats = speculative_decode(
                    model, drafter, prompt, suite.max_new_tokens, k, probes, stop_ids=suite.stop_ids
                )
                out.append((stats, probes.sums()))
    return out


def _replayed(drafter, suites) -> list:
    out = []
    for suite, answers in suites:
        for r in replay(drafter, answers, KS, suite.max_new_tokens, suite.stop_ids):
            out.extend((r.stats[k], r.drift[k].sums()) for k in KS)
    return out


def differences(decoded: list, replayed: list) -> list[str]:
    """What differs between the decoder's and the replay's rounds (exactly) and drift sums (within 1e-5,
    relative to sums above 1)."""
    out = []
    for i, ((a, da), (b, db)) in enumerate(zip(decoded, replayed, strict=True)):
        if (a.rounds, a.accepted, a.accepted_at) != (b.rounds, b.accepted, b.accepted_at):
            out.append(f"{i}: rounds {a.rounds} {b.rounds}, accepted {a.accepted_at} {b.accepted_at}")
        for key, values in da.items():
            if any(abs(x - y) > 1e-5 * max(1.0, abs(x)) for x, y in zip(values, db[key], strict=True)):
                out.append(f"{i}: drift {key} {values} {db[key]}")
    return out


@pytest.mark.parametrize("drafter_fixture", ["trained_eagle3", "trained_eagle31", "mla_drafter"])
def test_the_replay_equals_the_decoder_round_by_round(micro_target, suites, drafter_fixture, request):
    drafter = request.getfixturevalue(drafter_fixture)
    drafter = drafter[0] if isinstance(drafter, tuple) else drafter
    decoded = _decoded(micro_target.model, drafter, suites)
    rounds = sum(s.rounds for s, _ in decoded)
    at = [s.accepted_at for s, _ in decoded if s.rounds]
    # a mix of counts, else equality would be trivial: rounds that accept nothing, some, all k
    assert sum(a[0] for a in at) < rounds and any(0 < a[-1] for a in at) and any(a[0] > a[-1] for a in at)
    assert differences(decoded, _replayed(drafter, suites)) == [], f"of {rounds} rounds"

    # the comparison can fail: a slightly perturbed drafter, or the target's features one position late
    torch.manual_seed(0)
    assert differences(decoded, _replayed(perturb(copy.deepcopy(drafter)), suites))
    late = [(s, dataclasses.replace(a, aux=a.aux.roll(1, dims=1))) for s, a in suites]
    assert differences(decoded, _replayed(drafter, late))


def test_a_replayed_run_checks_itself_on_its_timed_prompts(micro_target, suites, trained_eagle31):
    """A replayed evaluation decodes its timed prompts: it logs the share whose rounds equal the replay's (what
    a bfloat16 run on a GPU reports) and keeps the decoder's counts beside the replay's in the per-prompt file."""
    from lab.eval.evaluate import EvalOptions, evaluate_suite_prompts, timed_prompts

    drafter = trained_eagle31[0]
    suite, answers = suites[2]  # template: several variants, so the per-variant keys too
    options = EvalOptions(KS, timed_prompts=2)
    timed = timed_prompts(len(suite.prompts), 2)
    run = evaluate_suite_prompts(micro_target.model, drafter, suite, options, answers=answers)
    agree = {key: v for key, v in run.metrics.items() if key.endswith("/replay_agreement")}
    assert agree and set(agree.values()) == {1.0} and f"eval/{suite.name}/ref/k8/replay_agreement" in agree
    records = run.per_prompt["prompts"]
    assert run.per_prompt["timed"] == timed and len(timed) == 2
    assert [("decoded" in r["k"]["3"]) for r in records] == [i in timed for i in range(len(records))]
    assert records[0]["k"]["8"]["decoded"]["rounds"] == records[0]["k"]["8"]["rounds"]

    # it can fail: the answers' features one position late make the replay count other rounds
    late = dataclasses.replace(answers, aux=answers.aux.roll(1, dims=1))
    run = evaluate_suite_prompts(micro_target.model, drafter, suite, options, answers=late)
    assert run.metrics[f"eval/{suite.name}/ref/k8/replay_agreement"] < 1.0


def test_the_answer_cache_is_reused_rebuilt_when_damaged_and_refused_when_mismatched(micro_target, tmp_path, capsys):
    prompts, stops, layers = [[1, 5, 9, 13], [2, 6, 10]], (micro_target.tokenizer.eos_token_id,), [1, 2, 3]
    first = suite_answers(micro_target, prompts, 12, stops, layers, tmp_path)
    assert not first.hit and first.sequences[0][:4] == prompts[0] and first.disagreements == 0
    again = suite_answers(micro_target, prompts, 12, stops, layers, tmp_path)
    assert again.hit and again.sequences == first.sequences and torch.equal(again.aux, first.aux)
    file = first.path / "answers.safetensors"
    file.write_bytes(file.read_bytes()[:-8])  # truncated: no longer its manifest's hash
    rebuilt = suite_answers(micro_target, prompts, 12, stops, layers, tmp_path)
    assert not rebuilt.hit and rebuilt.sequences == first.sequences
    assert "does not match its manifest hash; rebuilding it" in capsys.readouterr().err
    other = compute_answers(micro_target, [[3, 4, 5]], 12, stops, layers)  # whole, but for other prompts
    shutil.rmtree(first.path)
    write_answers(other, first.path, first.path.name, micro_target.fingerprint, layers, 12)
    with pytest.raises(RuntimeError, match="stored prompts differ from the suite's"):
        suite_answers(micro_target, prompts, 12, stops, layers, tmp_path)


def test_more_timed_prompts_than_a_suite_holds_is_one_line_before_any_run(micro_overrides, micro_hidden):
    from lab import pipeline
    from lab.config import ConfigError

    cfg = compose(micro_overrides + ["eval.timed_prompts=7"])  # in_dist holds 6
    with pytest.raises(
        ConfigError, match=r"^eval.timed_prompts: expected at most the 6 prompts of suite 'in_dist', got 7$"
    ):
        pipeline.warm_caches(cfg, progress=False)
