"""What the GPU runs, run on the fake CUDA device of tests/fake_cuda.py: no device mix, no op without a CUDA
kernel, and no more host syncs than today. Not collected by the main session (the harness needs a fresh
process): `python tests/fake_cuda.py` runs this file; tests/test_fake_cuda.py starts that.

One tiny Hugging Face Llama (4 layers, 64 wide) is loaded by the pipeline with device=cuda dtype=bfloat16, so
that every stage runs on "cuda" in bfloat16 under autocast, as on a GPU: the hidden-state capture, one and
two training steps (`_train`: init_drafter, the move, the loss, backward, AdamW), the checkpoint load, the
reference decoder with drift probes, and regeneration's greedy batch. The planted tests show the checks
fail: a CPU tensor in the training step's CUDA path is a device mix; one more `.item()` is one more sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from fake_cuda import CudaTensor, Report, fake_cuda

from lab.config.composition import compose

# Host syncs measured on this code (CPU torch 2.13, the fake device; `python tests/fake_cuda.py -s` prints
# where each one is): a new one fails here. Lower a bound when a change removes syncs.
# one training step (ttt_length 3): the TTT loss's rows (one nonzero for the counted rows, one for every
# step's, their counts read once), its per-step stats read once, the loss read once (the finite check and the
# log), unroll's padded width per later step, the batch's uploads. It was 14 reads and 9 shapes (27 in all)
# before the loss batched them.
SYNCS_PER_TRAIN_STEP = {"read": 5, "shape": 5, "upload": 4, "synchronize": 0}
# one round of the reference decoder: one read of the drafts and the target's predictions (greedy rounds keep the
# committed tokens on the device; the drafts and the verification are timed by CUDA events, read at the end); once
# per prompt: its first token read, its context uploaded, its timing events waited for. The same over the static KV
# cache (its position moved back on the device, never read)
SYNCS_PER_ROUND = {"read": 1, "shape": 0, "upload": 0, "synchronize": 0}
SYNCS_PER_DECODE = {"read": 1, "shape": 0, "upload": 1, "synchronize": 1}
# (per step, per batch) of regeneration's greedy batch. Dynamic cache: a step reads the tokens (the next input
# stays on the device) and transformers' mask check (`bool` of a tensor); once per batch: the prompts uploaded,
# the prefill's second mask check, the kept rows' index when rows finish (twice here). Static cache: no sync a
# step (one look at whether every row has finished every static_decode.CHECK_EVERY steps, fewer than here);
# once per batch: the prompts and limits uploaded, the prefill's mask check, the tokens read at the end, and on
# a bucket's first batch each cache layer's counter (4 layers)
SYNCS_PER_GREEDY = {
    "dynamic": (dict(read=2, shape=0, upload=0, synchronize=0), dict(read=1, shape=0, upload=4, synchronize=0)),
    "static": (dict(read=0, shape=0, upload=0, synchronize=0), dict(read=2, shape=0, upload=7, synchronize=0)),
}

TTT_LENGTH = 3
K = 3


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A 4-layer, 64-wide Llama with a byte-level tokenizer, as a Hugging Face folder (`target=hf`)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from lab.target.build import train_tokenizer

    folder = tmp_path_factory.mktemp("fake-cuda-target")
    tokenizer = train_tokenizer(["def f(x):\n    return x + 1\n"] * 20, 300)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
        eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def cfg(hf_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("fake-cuda-work")
    return compose(
        [
            "profile=micro",
            "target=hf",
            f"target.path={hf_dir}",
            "device=cuda",
            "dtype=bfloat16",
            f"cache_dir={work / 'cache'}",
            "threads=2",
            f"train.ttt_length={TTT_LENGTH}",
            "train.batch_size=2",
            "train.log_every=1",
            "train.warmup_steps=1",
        ]
    )


@dataclass
class Stage:
    report: Report
    target: object
    layers: list[int]


@pytest.fixture(scope="module")
def loaded(cfg):
    """The pipeline's target load on the fake device (device=cuda, dtype=bfloat16)."""
    from lab.config.shape import aux_layers
    from lab.pipeline import load_target

    with pytest.MonkeyPatch.context() as mp, fake_cuda(mp) as report:
        target = load_target(cfg, progress=False)
    return Stage(report, target, aux_layers(cfg))


def _sync_counts(report: Report) -> dict[str, int]:
    counts = dict.fromkeys(SYNCS_PER_TRAIN_STEP, 0)
    for event in report.syncs:
        counts[event.kind] += 1
    return counts


def _clean(report: Report) -> None:
    """No device mix, no op without a CUDA kernel: each named with the lab/ line that ran it."""
    assert not report.mixes, "device mixes:\n" + "\n".join(f"  {e.op} at {e.where}" for e in report.mixes)
    assert not report.violations, "ops without a CUDA kernel:\n" + "\n".join(
        f"  {e.op} at {e.where}" for e in report.violations
    )


def _on_cuda(module: torch.nn.Module, dtype: torch.dtype | None = None) -> None:
    """Every parameter and buffer on the device; the parameters in `dtype` (buffers keep theirs: transformers
    keeps the rotary frequencies float32)."""
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        assert isinstance(t, CudaTensor), f"{name} is on {t.device}"
    for name, t in module.named_parameters():
        assert dtype is None or t.dtype == dtype, f"{name} is {t.dtype}"


def test_target_load_moves_the_model(loaded):
    _clean(loaded.report)
    _on_cuda(loaded.target.model, torch.bfloat16)
    assert loaded.target.device.type == "cuda" and loaded.target.dtype == torch.bfloat16


@pytest.fixture(scope="module")
def hidden(loaded, cfg):
    """The hidden-state cache's capture (`capture_batch`, the stored dtype) over a few sequences, on the fake
    device, brought to the CPU as the cache stores it."""
    from lab.data.cache import HiddenStates, capture_batch

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, loaded.target.vocab_size, (4, 32), generator=gen)
    with pytest.MonkeyPatch.context() as mp, fake_cuda(mp) as report:
        out = capture_batch(loaded.target.model, ids.to(loaded.target.device), loaded.layers)
        aux, final = out.aux.cpu(), out.final.cpu()
    _clean(report)
    mask = torch.ones_like(ids, dtype=torch.uint8)
    return HiddenStates(input_ids=ids, loss_mask=mask, aux=aux, final=final, path=Path("unused"))


def test_capture(hidden):
    assert hidden.aux.dtype == hidden.final.dtype == torch.bfloat16 and hidden.aux.device.type == "cpu"


class _Run:
    """What `_train` logs to, recording the report's syncs at each logged step."""

    id = "fake-cuda"

    def __init__(self, report: Report) -> None:
        self.report, self.after_step = report, []

    def log_metrics(self, metrics: dict, step: int) -> None:
        self.after_step.append(len(self.report.syncs))

    def set_tags(self, tags: dict) -> None:
        pass


def _train(cfg, loaded, hidden, steps: int, mp) -> tuple[Report, _Run, object]:  # noqa: ANN001
    from omegaconf import OmegaConf

    from lab import pipeline

    cfg = OmegaConf.merge(cfg, {"train": {"steps": steps}})
    with fake_cuda(mp) as report:
        run = _Run(report)
        drafter = pipeline._train(
            cfg, run, loaded.target, hidden, loaded.layers, None, pipeline.RunHooks(), pipeline.StageClock(), False
        ).drafter
    return report, run, drafter


def _per_step(report: Report, run: _Run) -> dict[str, int]:
    """Syncs of the second training step (the first also sets up AdamW's state)."""
    first, second = run.after_step[0], run.after_step[1]
    counts = dict.fromkeys(SYNCS_PER_TRAIN_STEP, 0)
    for event in report.syncs[first:second]:
        counts[event.kind] += 1
    return counts


def test_training_step(cfg, loaded, hidden):
    from lab.drafter import ttt_attention

    calls: list[int] = []
    joint = ttt_attention.joint_sdpa
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ttt_attention, "joint_sdpa", lambda *a: calls.append(1) or joint(*a))
        report, run, drafter = _train(cfg, loaded, hidden, 2, mp)
    _clean(report)
    _on_cuda(drafter, torch.float32)  # the drafter keeps float32 weights; autocast computes in bfloat16
    per_step = _per_step(report, run)
    print(f"\nhost syncs per training step: {per_step} (total {sum(per_step.values())})")
    print(report.sync_table())
    assert calls  # the CUDA side's TTT attention ran (one SDPA call over the joint keys), backward included
    _within(per_step, SYNCS_PER_TRAIN_STEP)


def _within(per_step: dict[str, int], bounds: dict[str, int]) -> None:
    for kind, bound in bounds.items():
        assert per_step[kind] <= bound, f"{per_step[kind]} host syncs of kind {kind} per training step, at most {bound}"


@pytest.fixture(scope="module")
def drafter(cfg, loaded, hidden, tmp_path_factory):
    """A drafter trained one step on the fake device, saved, and loaded back by the pipeline's checkpoint
    load (`drafter.checkpoint`), which moves it to the target's device."""
    from omegaconf import OmegaConf

    from lab import pipeline
    from lab.drafter import save_native

    with pytest.MonkeyPatch.context() as mp:
        _, _, trained = _train(cfg, loaded, hidden, 1, mp)
    with pytest.MonkeyPatch.context() as mp, fake_cuda(mp):
        folder = save_native(trained, tmp_path_factory.mktemp("fake-cuda-drafter") / "drafter")
    with pytest.MonkeyPatch.context() as mp, fake_cuda(mp) as report:
        loaded_drafter = pipeline._load_checkpoint(
            OmegaConf.merge(cfg, {"drafter": {"checkpoint": str(folder)}}), loaded.target
        ).drafter
    _clean(report)
    return loaded_drafter


def test_checkpoint_load_moves_the_drafter(drafter):
    _on_cuda(drafter, torch.float32)


def _rounds(report: Report, start: int, stop: int) -> dict[str, int]:
    counts = dict.fromkeys(SYNCS_PER_ROUND, 0)
    for event in report.syncs[start:stop]:
        counts[event.kind] += 1
    return counts


@pytest.mark.parametrize("kv_cache", ["dynamic", "static"])
def test_reference_decoder(loaded, drafter, kv_cache):
    """`speculative_decode` with drift probes: prefill, then rounds of k drafts and one verification, over either
    KV cache (the static one's forward uncompiled: the fake device has no CUDA graphs); and plain decoding, one
    host sync a token."""
    from lab.eval.probes import DriftProbes
    from lab.eval.reference import prefill, speculative_decode, target_decode

    prompt = list(range(5, 25))
    model = loaded.target.model
    with pytest.MonkeyPatch.context() as mp, fake_cuda(mp) as report:
        pre = prefill(model, prompt, loaded.layers, kv_cache, room=16 + K + 1)
        start = len(report.syncs)
        probes = DriftProbes(K)
        tokens, stats = speculative_decode(model, drafter, prompt, 16, K, probes=probes, prefilled=pre)
        decoding = len(report.syncs)
        curves = probes.curves()
        before_plain = len(report.syncs)
        plain, _ = target_decode(model, prompt, 16, prefilled=pre)
        plain_syncs = len(report.syncs) - before_plain
    _clean(report)
    assert stats.rounds > 0 and len(tokens) == 16 and len(curves["sink_mass"]) == K
    per_round = _rounds(report, start, decoding)
    total = decoding - start
    print(
        f"\nreference decoder ({kv_cache}): {len(tokens)} tokens in {stats.rounds} rounds (k={K}): {total} host "
        f"syncs, {total / len(tokens):.2f} per decoded token, {total / stats.rounds:.2f} per round: {per_round}; "
        f"plain decoding: {plain_syncs} host syncs for {len(plain)} tokens"
    )
    print(report.sync_table())
    assert total <= stats.rounds + sum(SYNCS_PER_DECODE.values())  # at most one host sync a round
    assert plain_syncs <= len(plain) - 1 + SYNCS_PER_DECODE["read"] + SYNCS_PER_DECODE["upload"]  # one a token
    for kind, bound in SYNCS_PER_ROUND.items():
        most = bound * stats.rounds + SYNCS_PER_DECODE[kind]
        assert per_round[kind] <= most, (
            f"{per_round[kind]} host syncs of kind {kind} in {stats.rounds} rounds: at most {most}"
        )


@pytest.mark.parametrize("kv_cache", ["dynamic", "static"])
def test_greedy_batch(loaded, kv_cache):
    """Regeneration's batched greedy loop (`greedy_batch`, the hf backend) on the fake device, over either KV
    cache (the static one's step uncompiled: the fake device has no CUDA graphs)."""
    from lab.target.generate import greedy_batch

    model = loaded.target.model
    eos = loaded.target.tokenizer.eos_token_id
    prompts = [list(range(5, 17)), list(range(20, 27)), list(range(40, 49))]
    limits = [6, 4, 8]
    with pytest.MonkeyPatch.context() as mp, fake_cuda(mp) as report:
        outs = greedy_batch(model, prompts, limits, eos, kv_cache)
    _clean(report)
    steps = max(len(o) for o in outs)
    counts = _rounds(report, 0, len(report.syncs))
    total = sum(counts.values())
    print(f"\ngreedy batch ({kv_cache}): {sum(map(len, outs))} tokens in {steps} steps: {total} host syncs {counts}")
    print(report.sync_table())
    per_step, per_batch = SYNCS_PER_GREEDY[kv_cache]
    for kind, bound in per_step.items():
        most = bound * steps + per_batch[kind]
        assert counts[kind] <= most, f"{counts[kind]} host syncs of kind {kind} in {steps} steps: at most {most}"


def test_regeneration_generator(loaded):
    """Regeneration's generator (`open_generator`, backend hf) on the fake device: its batch size read from the
    GPU's free memory, the same answers as one `greedy_batch`."""
    from lab.target.generate import greedy_batch, open_generator

    prompts = [list(range(5, 17)), list(range(20, 27))]
    with pytest.MonkeyPatch.context() as mp, fake_cuda(mp) as report:
        with open_generator(loaded.target, backend="hf", progress=False) as greedy:
            answers = greedy(prompts, 5)
            assert greedy.rows(64) > 16  # a GPU's batch: as many rows as half the free memory holds
        again = greedy_batch(loaded.target.model, prompts, [5, 5], loaded.target.tokenizer.eos_token_id)
    _clean(report)
    assert answers == again


# ---------------------------------------------------------------- the checks can fail


def test_the_harness_flags_what_cuda_refuses():
    """The rules on small ops: a CPU tensor beside a cuda one is a mix; a CPU 0-dim scalar, CPU indices and
    moves are not; reads, data-dependent shapes and blocking uploads are syncs."""
    with pytest.MonkeyPatch.context() as mp, fake_cuda(mp) as report:
        x = torch.ones(4, device="cuda")
        assert isinstance(x, CudaTensor) and x.device.type == "cuda"
        y = x + torch.tensor(2.0) + x[torch.tensor([0, 1, 2, 3])]  # a CPU scalar, CPU indices: allowed
        assert not report.mixes and [e.op for e in report.syncs] == ["index.Tensor (CPU indices)"]
        _ = x + torch.ones(4)  # a CPU tensor in a cuda op
        assert [e.op for e in report.mixes] == ["add.Tensor"]
        assert y.sum().item() == 16.0 and y.nonzero().shape == (4, 1) and y.cpu().tolist() == [4.0] * 4
        assert [e.kind for e in report.syncs[1:]] == ["read", "shape", "read"]  # item, nonzero, cpu()
        with torch.autocast("cuda", dtype=torch.bfloat16):  # CUDA's autocast is on for labelled tensors
            assert (x[None] @ torch.ones(4, 2, device="cuda")).dtype == torch.bfloat16
        z = torch.zeros(3, 1, device="cuda").squeeze_(1)  # an in-place view: the label follows
        assert z.shape == (3,) and isinstance(z, CudaTensor)
        layer = torch.nn.Linear(2, 2)
        weight = layer.weight
        layer.to("cuda")  # a module's move keeps its Parameter objects, as on a GPU
        assert layer.weight is weight and isinstance(weight, CudaTensor)
        layer.cpu()
        assert layer.weight is weight and type(weight.data) is torch.Tensor and weight.device.type == "cpu"


def test_a_planted_cpu_tensor_is_a_device_mix(cfg, loaded, hidden):
    """The target's soft labels left on the CPU (as a forgotten `.to(device)` would): the training step's
    check fails, naming the loss's line."""
    from lab.train import loss

    soft_labels = loss.soft_labels
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loss, "soft_labels", lambda *args: tuple(t.cpu() for t in soft_labels(*args)))
        report, _, _ = _train(cfg, loaded, hidden, 1, mp)
    with pytest.raises(AssertionError, match="device mixes"):
        _clean(report)
    assert any(e.where.startswith("lab/train/loss.py") for e in report.mixes), report.mixes


def test_a_planted_item_is_one_more_sync_per_step(cfg, loaded, hidden):
    """One `.item()` added to the loss: the training step's count grows by exactly one and its bound fails."""
    from lab.train import loss

    rms_norm = loss.rms_norm

    def reads_a_value(norm, x):  # noqa: ANN001, ANN202
        out = rms_norm(norm, x)
        out.sum().item()
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loss, "rms_norm", reads_a_value)
        report, run, _ = _train(cfg, loaded, hidden, 2, mp)
    per_step = _per_step(report, run)
    assert per_step["read"] == SYNCS_PER_TRAIN_STEP["read"] + 1, per_step
    with pytest.raises(AssertionError, match="host syncs of kind read per training step"):
        _within(per_step, SYNCS_PER_TRAIN_STEP)


def test_init_drafter_gives_a_drafter_on_the_targets_device(cfg, loaded, hidden):
    """A fresh drafter trained as the tests' fixtures and the benchmarks train one: `init_drafter`, then
    `train`, with no move between (the pipeline's own move is checked by `test_training_step`)."""
    from omegaconf import OmegaConf

    from lab.drafter import init_drafter
    from lab.train.ttt import train

    with pytest.MonkeyPatch.context() as mp, fake_cuda(mp) as report:
        drafter = init_drafter(loaded.target, cfg.drafter, loaded.layers, seed=0)
        tcfg = OmegaConf.merge(cfg.train, {"steps": 1})
        train(drafter, hidden, loaded.target.lm_head_weight, tcfg, seed=0, progress=False)
    _on_cuda(drafter, torch.float32)
    _clean(report)


def test_sampled_decoding_and_the_heldout_rollout(loaded, drafter, hidden):
    """The other paths a GPU run takes: the baseline and speculative decoding at temperature 0.9 (sampling on
    the CPU's seeded generator) and the held-out rollout: no device mix, no op without a CUDA kernel."""
    from lab.data.code_data import Sequences
    from lab.eval.evaluate import heldout_evaluation
    from lab.eval.reference import speculative_decode, target_decode

    prompt, model = list(range(5, 15)), loaded.target.model
    with pytest.MonkeyPatch.context() as mp, fake_cuda(mp) as report:
        gen = torch.Generator().manual_seed(3)
        target_decode(model, prompt, 8, 0.9, gen)
        tokens, _ = speculative_decode(model, drafter, prompt, 8, K, temperature=0.9, generator=gen)
        rollout = heldout_evaluation(loaded.target, drafter, Sequences(hidden.input_ids, hidden.loss_mask), K)
    _clean(report)
    assert len(tokens) == 8 and rollout.metrics
    print(f"\nsampled decoding and the held-out rollout: {len(report.syncs)} host syncs")
    print(report.sync_table())


@pytest.mark.slow
def test_a_whole_run(cfg, tmp_path):
    """`lab run` itself (`lab.pipeline.run`) on the fake device, at toy size: every stage the GPU runs, from
    the data and the hidden-state cache to the suites' evaluation and MLflow (about 25 s)."""
    from omegaconf import OmegaConf

    from lab import pipeline

    small = {
        "data": {"num_sequences": 16, "heldout_sequences": 4},
        "train": {"steps": 2, "resume_every": 0},
        "eval": {"num_prompts": 2, "max_new_tokens": 8},
        "tracking": {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "artifact_root": str(tmp_path / "artifacts")},
    }
    with pytest.MonkeyPatch.context() as mp, fake_cuda(mp) as report:
        result = pipeline.run(OmegaConf.merge(cfg, small), progress=False)
    _clean(report)
    assert result.metrics
    print(f"\na whole run: {len(report.syncs)} host syncs")
    print(report.sync_table())
