"""The validation pass while a drafter trains (lab/data/validation.py, lab/eval/validation.py, lab/train/ttt.py
`Validation`): its prompts are disjoint from the training sequences; its proxies count what they say on planted
chains; it changes no trained weight, logs every key and resumes to the same curves and the same best step;
`train.select=best` keeps the best pass's weights and says why, whatever the evaluation suites hold; the pruner
reads the exact AL (the proxy when the spec names it); too many prompts are refused before any model loads."""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

import pytest
import torch

from lab import metrics as metric_keys
from lab import track
from lab.config import select_k, val_every
from lab.config.composition import compose
from lab.config.shape import aux_layers
from lab.data import code_data
from lab.data import validation as val_data
from lab.data.answers import suite_answers
from lab.data.cache import HiddenStates
from lab.drafter import init_drafter, load_checkpoint
from lab.eval.validation import ValidationSet, _chain_counts, proxy_metrics, validate
from lab.pipeline import RunHooks, run
from lab.sweep import search_space
from lab.train import resume
from lab.train.resume import ResumeWriter
from lab.train.ttt import Validation, ValidationPass, train

VAL_PROMPTS = 12


@pytest.fixture(scope="module")
def prompts(micro_cfg, micro_target, micro_sequences):
    return val_data.validation_prompts(
        micro_target, micro_cfg.data, VAL_PROMPTS, micro_sequences[0], micro_cfg.cache_dir
    )


@pytest.fixture(scope="module")
def vset(micro_cfg, micro_target, prompts) -> ValidationSet:
    eos = micro_target.tokenizer.eos_token_id
    length = micro_cfg.eval.max_new_tokens + 3
    answers = suite_answers(micro_target, prompts, length, (eos,), aux_layers(micro_cfg), micro_cfg.cache_dir)
    return ValidationSet(answers, 3, micro_cfg.eval.max_new_tokens, (eos,))


def test_validation_prompts_are_disjoint_from_the_training_sequences(micro_cfg, micro_target, micro_sequences, prompts):
    """Each prompt is a leftover row of the training split cut before the assistant's turn; none begins a training
    sequence or a held-out one (the split the suites and the rollout read); chosen once, the same again."""
    train_seqs, heldout = micro_sequences
    rows = code_data.split_rows(micro_target.tokenizer, micro_cfg.data, heldout=False)
    taken = set(code_data.chosen(len(rows), micro_cfg.data.num_sequences))
    leftover = {tuple(ids[: mask.index(1)]) for i, (ids, mask) in enumerate(rows) if i not in taken}
    assert len(prompts) == VAL_PROMPTS == len({tuple(p) for p in prompts})
    for p in prompts:
        assert tuple(p) in leftover
        assert not val_data.starts_a_sequence(p, train_seqs.input_ids)
        assert not val_data.starts_a_sequence(p, heldout.input_ids)
    again = val_data.validation_prompts(micro_target, micro_cfg.data, VAL_PROMPTS, train_seqs, micro_cfg.cache_dir)
    assert again == prompts


def test_a_prompt_that_starts_a_training_sequence_is_passed_over(micro_cfg, micro_target, micro_sequences, monkeypatch):
    """A duplicate of a training conversation among the leftover rows (the stdlib repeats license headers,
    ShareGPT repeats conversations) is never a validation prompt: it was trained on."""
    train_ids = micro_sequences[0].input_ids
    trained = train_ids[0, : int(micro_sequences[0].loss_mask[0].nonzero()[0])].tolist()
    fresh = [[1, 2, 3], [1, 2, 4]]
    monkeypatch.setattr(val_data, "_code_prompts", lambda target, dcfg: iter([trained, fresh[0], trained, fresh[1]]))
    got = list(val_data._candidates(micro_target, micro_cfg.data, micro_sequences[0], micro_cfg.cache_dir))
    assert got == fresh


def test_conversation_prompts_skip_duplicates_of_training_conversations(micro_overrides, micro_target, tmp_path):
    """data=jsonl: the validation prompts are the first user turns of the fitting conversations after the training
    selection; a conversation repeated under another id (as ShareGPT does) that the training took is passed over."""
    from lab.data.chat_data import chat_data

    rows = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"say the number {i}"},
                                          {"role": "assistant", "content": f"{i}"}]} for i in range(60)]  # fmt: skip
    copies = [{**r, "id": f"copy-{r['id']}"} for r in rows]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows + copies))
    data_keys = ["data.template=chatml", "data.seq_len=128", "data.num_sequences=20", "data.heldout_sequences=2"]
    cfg = compose([*micro_overrides, "data=jsonl", f"data.path={tmp_path / 'chats.jsonl'}", *data_keys])
    data = chat_data(micro_target, cfg.data, cfg.cache_dir, progress=False)
    raw = list(val_data._chat_prompts(micro_target, cfg.data, cfg.cache_dir))
    trained = [p for p in raw if val_data.starts_a_sequence(p, data.train.input_ids)]
    assert trained, "the leftover conversations hold no copy of a training one: the planted case is missing"
    expected: list = []
    for p in raw:
        if p not in trained and p not in expected:
            expected.append(p)
    chosen = val_data.validation_prompts(micro_target, cfg.data, 10, data.train, cfg.cache_dir)
    assert chosen == expected[:10] and len(chosen) == 10


def test_too_many_validation_prompts_are_refused_before_any_model_loads(
    micro_overrides, micro_target, monkeypatch, capsys
):
    """Asking for more prompts than the training split leaves beside the training sequences is one line naming
    train.val_prompts, exit 2, before any model loads (lab/preflight.py counts the rows with the tokenizer)."""
    import transformers

    from lab.cli import main

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_model)
    assert main(["run", *micro_overrides, "train.val_prompts=100000"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: train.val_prompts: asks for 100000 validation prompts"), err


def test_chain_counts_on_planted_drafts():
    """Two anchors of one sequence, depth 3: the marginal hits, the whole chain, the chain before and the anchors
    counted, as docs/metrics.md defines them; the proxies of the summed counts."""
    top = torch.tensor([[5, 6, 7, 8, 9, 0]])  # top-1 after positions 0..5; the sequence holds 6 tokens
    anchors = torch.tensor([[False, True, True, False, False, False]])
    keep = anchors.flatten().nonzero().squeeze(1)
    # anchor 1 drafts top[2], top[3], top[4] = 7, 8, 9; anchor 2 drafts top[3], top[4], top[5] = 8, 9, 0
    drafts = [torch.tensor([7, 1]), torch.tensor([8, 9]), torch.tensor([1, 0])]
    counts = _chain_counts(drafts, keep, top, anchors, torch.tensor([[6]]))[0]
    hits, full, prior, counted = counts.tolist()
    assert hits == [1, 2, 1] and full == [1, 1, 0] and prior == [2, 1, 1] and counted == [2, 2, 2]
    metrics = proxy_metrics(counts, 3)
    assert metrics["val/k2/simulated_acc_len"] == pytest.approx(0.5 + 0.5 * 1.0)
    assert metrics["val/k3/tau_sim"] == pytest.approx(1 + 0.5 + 0.5 + 0.0)
    assert metrics["val/full_acc_2"] == 0.5 and metrics["val/cond_acc_2"] == 1.0 and metrics["val/acc_3"] == 0.5


def _validation(vset, cfg, log, keep_best=False, every=4, publish=lambda checkpoints: None) -> Validation:
    return Validation(
        lambda d: ValidationPass(**vars(validate(d, vset))),
        every=every,
        steps=cfg.steps,
        key=metric_keys.val_al(3),
        keep_best=keep_best,
        log=log,
        publish=publish,
        tokens_per_step=cfg.batch_size * 128,
        set_id="test",
    )


def _data(micro_hidden) -> HiddenStates:
    h = micro_hidden
    return HiddenStates(h.input_ids[:64], h.loss_mask[:64], h.aux[:64], h.final[:64], h.path)


def _tcfg(micro_cfg, steps: int = 10):
    cfg = micro_cfg.train.copy()
    cfg.steps, cfg.batch_size, cfg.log_every, cfg.warmup_steps = steps, 16, 4, 2
    return cfg


def test_the_pass_changes_no_weight_and_logs_every_key(micro_cfg, micro_target, micro_hidden, vset):
    """Training with the pass ends with the weights of training without it, bit for bit; each pass logs every key
    of docs/metrics.md's validation table, at its step, with the training tokens seen so far."""
    cfg, data, layers = _tcfg(micro_cfg), _data(micro_hidden), aux_layers(micro_cfg)
    plain = init_drafter(micro_target, micro_cfg.drafter, layers, seed=3)
    train(plain, data, micro_target.lm_head_weight, cfg, seed=3, progress=False)
    logged: list = []
    watched = init_drafter(micro_target, micro_cfg.drafter, layers, seed=3)
    validation = _validation(vset, cfg, lambda m, s: logged.append((s, m)))
    result = train(watched, data, micro_target.lm_head_weight, cfg, seed=3, progress=False, validation=validation)
    for k, v in plain.state_dict().items():
        assert torch.equal(v, watched.state_dict()[k]), k
    passes = [(s, m) for s, m in logged if metric_keys.val_al(1) in m]
    assert [s for s, _ in passes] == [4, 8, 10]  # every 4 steps and after the last
    assert all(set(m) == set(metric_keys.validation_keys(3)) for _, m in passes)
    assert [m[metric_keys.val_stat("train_tokens")] for _, m in passes] == [s * 16 * 128 for s in (4, 8, 10)]
    assert result.selected.step == 10 and result.selected.why.startswith("train.select=last")


def test_resumed_training_logs_the_same_validation_and_keeps_the_same_best(
    micro_cfg, micro_target, micro_hidden, vset, tmp_path
):
    """Interrupted at step 8 (its last resume state at step 6), resumed: the same validation curves (the
    passes before the interruption sent again, then the same passes), the same per-prompt records, the same best
    step and the same kept weights as an uninterrupted training with train.select=best."""
    cfg, data, layers = _tcfg(micro_cfg, 12), _data(micro_hidden), aux_layers(micro_cfg)

    def trained(log, **kw):
        published: list = []
        d = init_drafter(micro_target, micro_cfg.drafter, layers, seed=5)
        v = _validation(vset, cfg, log, keep_best=True, every=3, publish=lambda c: published.append(json.dumps(c)))
        result = train(d, data, micro_target.lm_head_weight, cfg, seed=5, log=log, progress=False, validation=v, **kw)
        return d, result, published

    def passes(logged):
        drop = metric_keys.val_stat("seconds")
        return [(s, {k: v for k, v in m.items() if k != drop}) for s, m in logged if metric_keys.val_al(1) in m]

    straight: list = []
    expected, result, published = trained(lambda m, s: straight.append((s, m)))

    def interrupt_at_8(metrics, step):
        if step == 8:
            raise KeyboardInterrupt

    writer = ResumeWriter(tmp_path / "ckpt", every=6)
    with pytest.raises(KeyboardInterrupt):
        trained(interrupt_at_8, resume_writer=writer)
    state = resume.load(writer.path, cfg.steps)
    assert state is not None and state.step == 6 and [s for s, _ in state.validation["history"]] == [3, 6]
    resumed: list = []
    got, again, republished = trained(lambda m, s: resumed.append((s, m)), resume=state)
    assert passes(resumed) == passes(straight)
    assert json.loads(republished[-1]) == json.loads(published[-1])  # every pass's per-prompt counts
    assert (again.selected.step, again.selected.why) == (result.selected.step, result.selected.why)
    for k, v in expected.state_dict().items():
        assert torch.equal(v, got.state_dict()[k]), k


@pytest.fixture(scope="module")
def best_runs(micro_overrides, workdir):
    """Two `lab run`s with train.select=best, the second with other in_dist prompts (eval.prompt_len), in one
    store; the first also records what its pruner would hear."""
    store = workdir / "validation-store"
    base = [
        *micro_overrides,
        f"tracking.uri=sqlite:///{store / 'mlflow.db'}",
        f"tracking.artifact_root={store / 'artifacts'}",
        "study=validation",
        "seed=7",
        "train.steps=12",
        "train.val_every=3",
        "train.select=best",
        "train.resume_every=0",
    ]
    heard: list = []
    first = run(compose(base), progress=False, hooks=RunHooks(on_train_metrics=lambda m, s: heard.append((s, m))))
    second = run(compose([*base, "eval.prompt_len=80", "eval.num_prompts=3"]), progress=False)
    return compose(base), first, second, heard


@pytest.mark.slow
def test_select_best_keeps_the_best_pass_and_says_why(best_runs, micro_target, vset):
    """The run keeps the weights of its best exact validation AL at train.select_k: its tags name that step and
    why, and its logged checkpoint validated again gives that pass's metrics."""
    cfg, first, _, _ = best_runs
    uri = cfg.tracking.uri
    key = metric_keys.val_al(select_k(cfg))
    history = track.metric_curve(uri, first.run_id, key)
    steps = list(range(val_every(cfg), cfg.train.steps + 1, val_every(cfg)))
    best = steps[max(range(len(history)), key=lambda i: (history[i], -i))]
    tags = track.get_run(uri, first.run_id).data.tags
    assert tags["selected_step"] == str(best)
    assert tags["selected_why"].startswith(f"train.select=best: {key} {max(history):.4f} at step {best}, the best of 4")
    prompts = val_data.validation_prompts(
        micro_target, cfg.data, cfg.train.val_prompts, _training_sequences(cfg, micro_target), cfg.cache_dir
    )
    eos = micro_target.tokenizer.eos_token_id
    length = cfg.eval.max_new_tokens + 3
    answers = suite_answers(micro_target, prompts, length, (eos,), aux_layers(cfg), cfg.cache_dir)
    with tempfile.TemporaryDirectory() as tmp:
        kept = load_checkpoint(track.run_checkpoint(uri, first.run_id, Path(tmp))[0])
    again = validate(kept, ValidationSet(answers, 3, cfg.eval.max_new_tokens, (eos,)))
    assert again.metrics[key] == pytest.approx(max(history), abs=1e-9)


def _training_sequences(cfg, target):
    from lab.data.cache import code_sequences

    return code_sequences(target, cfg.data, cfg.cache_dir)[0]


@pytest.mark.slow
def test_selection_never_reads_an_evaluation_suite(best_runs):
    """Other in_dist prompts change the suite's metrics, and neither the validation curves nor the step kept."""
    cfg, first, second, _ = best_runs
    uri = cfg.tracking.uri
    one, two = (track.get_run(uri, r.run_id) for r in (first, second))
    assert one.data.tags["selected_step"] == two.data.tags["selected_step"]
    # the suite did change: its drift probes' sink mass, a continuous measure (an untrained drafter's AL may be 1.0
    # over either prompts)
    sink = metric_keys.drift("in_dist", 3, "sink_mass")
    assert one.data.metrics[sink] != two.data.metrics[sink]
    for key in metric_keys.validation_keys(3):
        if key != metric_keys.val_stat("seconds"):
            assert track.metric_curve(uri, first.run_id, key) == track.metric_curve(uri, second.run_id, key), key


@pytest.mark.slow
def test_the_pruner_hears_the_exact_validation_al(best_runs, tmp_path):
    """A trial reports the exact validation AL at train.select_k unless the spec names the proxy: the run delivers
    it at every validation pass, and the sweep's prune key is the exact AL's or the one its spec names."""
    cfg, first, _, heard = best_runs
    key = metric_keys.val_al(select_k(cfg))
    at = [s for s, m in heard if key in m]
    assert at == [3, 6, 9, 12]
    assert [m[key] for s, m in heard if key in m] == track.metric_curve(cfg.tracking.uri, first.run_id, key)
    spec = "space: {train.lr: [0.001, 0.002]}\nobjectives: [eval/in_dist/ref/k3/al]\n"
    exact, proxy = tmp_path / "exact.yaml", tmp_path / "proxy.yaml"
    exact.write_text(spec + "pruner: {name: median, n_warmup_steps: 3}\n")
    proxy.write_text(spec + "pruner: {name: median, metric: train/simulated_acc_len}\n")
    assert search_space.load(str(exact)).prune_key(cfg) == key
    assert search_space.load(str(proxy)).prune_key(cfg) == metric_keys.train_stat("simulated_acc_len")
    assert search_space.load(str(proxy)).pruner == {"name": "median"}  # the metric is not an option of Optuna's


def test_a_pruned_studys_key_names_its_pruner_metric_and_an_unpruned_ones_does_not(micro_overrides, tmp_path):
    """Studies without a pruner keep their names; one whose pruner reads another metric is another study."""
    spec = "space: {train.lr: [0.001, 0.002]}\nobjectives: [eval/in_dist/ref/k3/al]\n"
    proxy = "pruner: {name: median, metric: train/simulated_acc_len}\n"
    paths = {}
    for name, pruner in {"none": "", "exact": "pruner: median\n", "proxy": proxy}.items():
        paths[name] = tmp_path / f"{name}.yaml"
        paths[name].write_text(spec + pruner)
    keys = {n: search_space.load(str(p)).key(micro_overrides) for n, p in paths.items()}
    assert len(set(keys.values())) == 3
    unpruned = search_space.load(str(paths["none"]))
    assert dataclasses.replace(unpruned, prune_metric="val/k3/tau_sim").key(micro_overrides) == keys["none"]
