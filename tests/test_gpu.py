"""The gpu tier (`pytest -m gpu`): every stage on CUDA with small shapes, in minutes, held to the CPU's float32.

Where torch sees no GPU the whole module is skipped in one line (CI is CPU-only). `LAB_GPU_TIER_DEVICE=cpu`
runs the tier on the CPU instead, to check the tier itself on a machine without a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from helpers import perturb, small_drafter

from lab.config.composition import compose
from lab.config.shape import aux_layers
from lab.device import cuda_problem

DEVICE = os.environ.get("LAB_GPU_TIER_DEVICE", "cuda")
if DEVICE == "cuda" and cuda_problem():
    pytest.skip(f"gpu tier: {cuda_problem()}", allow_module_level=True)

pytestmark = pytest.mark.gpu
DEV = torch.device(DEVICE)


@pytest.fixture(scope="module")
def on_device(micro_overrides) -> list[str]:
    return [*(o for o in micro_overrides if not o.startswith("device=")), f"device={DEVICE}"]


@pytest.fixture(scope="module")
def bf16_target(on_device, micro_target):
    from lab.target import load

    return load(compose([*on_device, "dtype=bfloat16"]), progress=False)


@pytest.fixture(scope="module")
def f32_target(on_device, micro_target):
    from lab.target import load

    return load(compose([*on_device, "dtype=float32"]), progress=False)


def test_the_target_loads_in_bfloat16(bf16_target, micro_target):
    """The built (float32, CPU) target loads on the device in bfloat16 and predicts what the CPU's float32 does."""
    p = next(bf16_target.model.parameters())
    assert (p.device.type, p.dtype) == (DEVICE, torch.bfloat16)
    assert bf16_target.fingerprint.endswith("-bfloat16")
    ids = torch.randint(0, micro_target.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = bf16_target.model(ids.to(DEV)).logits.float().cpu()
        want = micro_target.model(ids).logits
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9  # bfloat16 rounding flips near-ties only


def test_capture(f32_target, micro_target):
    """The captured states on the device equal the CPU's (float32 both)."""
    from lab.target import capture

    ids = torch.randint(0, micro_target.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    layers = [1, 2, 3]
    got = capture(f32_target.model, ids.to(DEV), layers)
    want = capture(micro_target.model, ids, layers)
    assert got.aux.device.type == DEVICE
    torch.testing.assert_close(got.aux.cpu(), want.aux, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(got.final.cpu(), want.final, rtol=1e-3, atol=1e-3)


def test_the_static_kv_cache_on_the_device(f32_target):
    """Greedy batches over the static KV cache, its step compiled into CUDA graphs (`kv_cache` auto on CUDA), give
    the dynamic cache's tokens (float32 both), and a second batch of a bucket already met compiles nothing."""
    from torch._dynamo.utils import counters

    from lab.target.generate import greedy_batch

    model = f32_target.model
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, f32_target.vocab_size, (n,), generator=g).tolist() for n in (5, 17, 9, 30, 2)]
    limits = [20, 7, 33, 1, 25]
    want = greedy_batch(model, prompts, limits, -1, "dynamic")
    assert greedy_batch(model, prompts, limits, -1) == want
    graphs = counters["stats"]["unique_graphs"]
    assert greedy_batch(model, prompts[::-1], limits[::-1], -1) == want[::-1]
    assert counters["stats"]["unique_graphs"] == graphs


def test_regeneration_with_hf(f32_target, micro_target, tmp_path):
    """`generator=hf` regenerates on the device the answers the CPU regenerates (float32 both)."""
    from test_regenerate import CONVERSATIONS, run

    from lab.target.chat_template import HandChat

    chat = HandChat(micro_target.tokenizer, "chatml")
    got = run(f32_target, chat, tmp_path / "dev", dtype="float32")
    want = run(micro_target, chat, tmp_path / "cpu")
    assert got.stats["generated_tokens"] > 0
    assert [c.messages for c in got.conversations] == [c.messages for c in want.conversations]
    assert len(got.conversations) == len(CONVERSATIONS)


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_ttt_attention_kernel_equals_the_cpu_kernel(kv_heads):
    """The device's fused TTT attention (with the diagonal joined through its log-sum-exp) equals CPU's fused
    kernel, values and gradients, over padded rows, grouped-query heads and diagonal steps."""
    from test_ttt_attention import _case, _run

    from lab.drafter.ttt_attention import CPU_FLASH, kernel_for

    for layout, steps in [("dense", 0), ("padded", 2)]:
        tensors, future, lay = _case(layout, 2 // kv_heads, steps)
        want, want_grads = _run(CPU_FLASH, tensors, future, lay)
        moved = [None if x is None else x.to(DEV) for x in tensors]
        dev_layout = None if lay is None else (lay[0].to(DEV), lay[1].to(DEV), lay[2])
        got, got_grads = _run(kernel_for(DEV), moved, future.to(DEV), dev_layout)
        torch.testing.assert_close(got.cpu(), want, rtol=2e-4, atol=2e-4)
        for a, b in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(a.cpu(), b, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize(("kv_heads", "groups", "d", "t"), [(2, 2, 8, 11), (3, 3, 64, 200)])
def test_ttt_attention_bfloat16_gradients_with_several_heads(kv_heads, groups, d, t):
    """In bfloat16 the device's kernel computes its backward's row delta itself, from the output's layout: with
    several heads its values and gradients still equal the portable kernel's (float32 math over the same
    bfloat16 inputs) to bfloat16's rounding, over dense and padded rows and diagonal steps."""
    from test_ttt_attention import _run

    from lab.drafter.ttt_attention import PORTABLE, kernel_for

    g = torch.Generator().manual_seed(3)
    for layout, steps in [(None, 0), ("padded", 2)]:
        b = 2
        if layout is None:
            lay, pos, m = None, torch.arange(t).expand(b, t), b * t
        else:
            rows = torch.randperm(b * t, generator=g)[: (b * t) // 2].sort().values
            seq_of = rows // t
            counts = torch.bincount(seq_of, minlength=b)
            slot = torch.arange(len(rows)) - (torch.cumsum(counts, 0) - counts)[seq_of]
            n = int(counts.max())
            lay, pos, m = (seq_of.to(DEV), slot.to(DEV), n), torch.full((b, n), t - 1), len(rows)
            pos[seq_of, slot] = rows % t
        future = (torch.arange(t)[None, None, :] > pos[:, :, None]).to(DEV)
        shapes = [(m, kv_heads, groups, d), (b, kv_heads, t, d), (b, kv_heads, t, d)]
        if steps:
            shapes += [(m, kv_heads, steps, d)] * 2
        tensors = [torch.randn(s, generator=g).to(DEV, torch.bfloat16) for s in shapes] + [None] * (5 - len(shapes))
        want, want_grads = _run(PORTABLE, tensors, future, lay)
        got, got_grads = _run(kernel_for(DEV), tensors, future, lay)
        assert got.dtype == torch.bfloat16
        names = ["out", "dq", "dk0", "dv0", "ddk", "ddv"][: 1 + len(got_grads)]
        for name, a, b_ in zip(names, [got, *got_grads], [want, *want_grads], strict=True):
            error = (a.float() - b_.float()).abs().max() / b_.float().abs().max()
            assert error < 2e-2, f"{name} ({layout or 'dense'}): max error {error:.3f} of the largest value"


def test_native_training(micro_cfg, micro_target, micro_hidden, f32_target, bf16_target):
    """One TTT loss and its gradients on the device equal the CPU's (float32); a few bfloat16 steps train."""
    from lab.drafter import init_drafter
    from lab.train.loss import ttt_loss
    from lab.train.ttt import train

    torch.manual_seed(0)
    cpu = perturb(small_drafter(num_kv_heads=1, num_layers=2, norm_output=True, fc_norm="per_layer"))
    dev = perturb(small_drafter(num_kv_heads=1, num_layers=2, norm_output=True, fc_norm="per_layer")).to(DEV)
    dev.load_state_dict(cpu.state_dict())
    g = torch.Generator().manual_seed(0)
    b, t, vocab, hidden = 3, 64, cpu.spec.vocab_size, cpu.spec.hidden_size
    batch = [
        torch.randint(0, vocab, (b, t), generator=g),
        torch.randn(b, t, 3 * hidden, generator=g),
        torch.randn(b, t, hidden, generator=g),
        torch.randn(vocab, hidden, generator=g),
    ]
    mask = (torch.rand(b, t, generator=g) < 0.5).to(torch.uint8)
    want = ttt_loss(cpu, *batch, 3, 0.8, mask)
    got = ttt_loss(dev, *(x.to(DEV) for x in batch), 3, 0.8, mask.to(DEV))
    torch.testing.assert_close(got.loss.cpu(), want.loss, rtol=1e-4, atol=1e-5)
    want.loss.backward()
    got.loss.backward()
    for (name, p), q in zip(cpu.named_parameters(), dev.parameters(), strict=True):
        if p.requires_grad:
            torch.testing.assert_close(q.grad.cpu(), p.grad, rtol=1e-3, atol=1e-5, msg=f"gradient of {name}")

    drafter = init_drafter(bf16_target, micro_cfg.drafter, aux_layers(micro_cfg), seed=0)
    assert drafter.fc.weight.device.type == DEVICE
    tcfg = micro_cfg.train.copy()
    tcfg.steps = 8
    result = train(drafter, micro_hidden, bf16_target.lm_head_weight, tcfg, seed=0, progress=False)
    assert result.steps == 8 and all(torch.isfinite(p).all() for p in drafter.parameters())


@pytest.mark.parametrize("kernel", ["device", "portable"])
def test_bfloat16_training_steps_stay_finite(kernel, micro_cfg, micro_hidden, bf16_target, monkeypatch):
    """Training's own steps (the micro drafter on the micro cache, bfloat16 autocast, AdamW, clipping) keep a
    finite loss and finite gradients, with the device's attention kernel and with the portable one; where a
    gradient is not finite, autograd's anomaly mode names the op that made it."""
    from lab.device import autocast
    from lab.drafter import init_drafter, ttt_attention
    from lab.train.loss import ttt_loss
    from lab.train.ttt import optimizer

    if kernel == "portable":
        monkeypatch.setattr(ttt_attention, "kernel_for", lambda device: ttt_attention.PORTABLE)
    tcfg, data = micro_cfg.train, micro_hidden
    drafter = init_drafter(bf16_target, micro_cfg.drafter, aux_layers(micro_cfg), seed=0).train()
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = optimizer(params, tcfg)

    def loss(idx: torch.Tensor) -> torch.Tensor:
        with autocast(DEV, torch.bfloat16):
            batch = (data.input_ids[idx], data.aux[idx], data.final[idx])
            return ttt_loss(
                drafter, *(x.to(DEV) for x in batch), bf16_target.lm_head_weight, tcfg.ttt_length, tcfg.step_weight,
                data.loss_mask[idx].to(DEV),
            ).loss  # fmt: skip

    for step in range(4):
        idx = torch.arange(step * tcfg.batch_size, (step + 1) * tcfg.batch_size) % len(data)
        value = loss(idx)
        opt.zero_grad(set_to_none=True)
        value.backward()
        bad = [n for n, p in drafter.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
        print(f"step {step}: loss {value.item():.4f}, non-finite gradients: {bad or 'none'}")
        if bad or not torch.isfinite(value):
            opt.zero_grad(set_to_none=True)
            try:
                with torch.autograd.detect_anomaly(check_nan=True):
                    loss(idx).backward()
                why = "anomaly mode found no op"
            except RuntimeError as exc:
                why = str(exc).splitlines()[0]
            pytest.fail(f"{kernel} kernel, step {step}: loss {value.item()}, non-finite gradients of {bad}: {why}")
        torch.nn.utils.clip_grad_norm_(params, tcfg.grad_clip)
        opt.step()


def test_resume_on_the_device_keeps_steps_and_order(micro_cfg, micro_hidden, bf16_target, tmp_path):
    """What resume promises on CUDA: the same steps and the same data order as an uninterrupted run, and weights
    and logged losses equal within bfloat16 training's nondeterminism (the attention's backward and
    `index_select`'s accumulate with atomics, so bit for bit holds on the CPU only): 2e-2 relative on the
    losses, 1e-2 on each weight."""
    from lab.data.cache import HiddenStates
    from lab.drafter import init_drafter
    from lab.train import resume
    from lab.train.resume import ResumeWriter
    from lab.train.ttt import train

    h = micro_hidden
    data = HiddenStates(h.input_ids[:64], h.loss_mask[:64], h.aux[:64], h.final[:64], h.path)
    cfg = micro_cfg.train.copy()
    cfg.steps, cfg.batch_size, cfg.log_every, cfg.warmup_steps = 10, 16, 2, 2

    def run(log, **kw):  # noqa: ANN001, ANN202
        d = init_drafter(bf16_target, micro_cfg.drafter, aux_layers(micro_cfg), seed=3)
        train(d, data, bf16_target.lm_head_weight, cfg, seed=3, log=log, progress=False, **kw)
        return d

    straight: list = []
    expected = run(lambda m, s: straight.append((s, m["train/loss"])))

    def interrupt_at_8(metrics, step):  # noqa: ANN001, ANN202
        if step == 8:
            raise KeyboardInterrupt

    ckpt = ResumeWriter(tmp_path / "ckpt", every=3, run_id="first")
    with pytest.raises(KeyboardInterrupt):
        run(interrupt_at_8, resume_writer=ckpt)
    state = resume.load(ckpt.path, cfg.steps)
    assert state is not None and state.step == 6
    resumed: list = []
    got = run(lambda m, s: resumed.append((s, m["train/loss"])), resume=state)
    assert [s for s, _ in resumed] == [s for s, _ in straight]  # the same steps logged
    for (_, a), (_, b) in zip(resumed, straight, strict=True):
        assert a == pytest.approx(b, rel=2e-2)
    for k, v in expected.state_dict().items():
        torch.testing.assert_close(got.state_dict()[k], v, rtol=1e-2, atol=1e-2, msg=k)


def test_reference_decoder_with_probes(micro_cfg, f32_target, bf16_target):
    """Speculative decoding on the device is lossless (float32: the target's own greedy output) with the drift
    probes on, and runs in bfloat16."""
    from lab.data.suites import build_suite
    from lab.drafter import init_drafter
    from lab.eval.probes import DriftProbes
    from lab.eval.reference import speculative_decode, target_decode

    prompts = build_suite("in_dist", f32_target.tokenizer, micro_cfg).prompts[:2]
    for target in (f32_target, bf16_target):
        drafter = init_drafter(target, micro_cfg.drafter, aux_layers(micro_cfg), seed=1).eval()
        for prompt in prompts:
            reference, _ = target_decode(target.model, prompt, 24)
            probes = DriftProbes(3)
            tokens, stats = speculative_decode(target.model, drafter, prompt, 24, 3, probes=probes)
            if target is f32_target:
                assert tokens == reference
            assert stats.rounds > 0 and len(probes.curves()["sink_mass"]) == 3


def test_the_static_cache_decoder_on_the_device(micro_cfg, f32_target):
    """The reference decoder over the static KV cache in CUDA graphs (`kv_cache` auto on CUDA) decodes the dynamic
    cache's tokens and rounds (float32 both), plainly and at k = 1 and 3 from one prefill; a second prompt of the
    same bucket compiles nothing."""
    from torch._dynamo.utils import counters

    from lab.data.suites import build_suite
    from lab.drafter import init_drafter
    from lab.eval.reference import prefill, speculative_decode, target_decode

    model, layers = f32_target.model, aux_layers(micro_cfg)
    drafter = init_drafter(f32_target, micro_cfg.drafter, layers, seed=1).eval()
    prompts = build_suite("in_dist", f32_target.tokenizer, micro_cfg).prompts[:2]
    graphs = None
    for prompt in prompts:
        pre = {cache: prefill(model, prompt, layers, cache, room=24 + 4) for cache in ("dynamic", "static")}
        plain = {c: target_decode(model, prompt, 24, prefilled=pre[c])[0] for c in pre}
        assert plain["static"] == plain["dynamic"]
        for k in (1, 3):
            (dyn, d), (sta, s) = (speculative_decode(model, drafter, prompt, 24, k, prefilled=pre[c]) for c in pre)
            assert sta == dyn == plain["dynamic"] and (s.rounds, s.accepted_at) == (d.rounds, d.accepted_at)
        if graphs is None:
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs


def test_export(micro_cfg, bf16_target, tmp_path):
    """A drafter trained on the device saves, exports (`lab export`: native and speculators) and loads back on
    the CPU, equal."""
    from lab.drafter import init_drafter, load_checkpoint, save_native

    drafter = init_drafter(bf16_target, micro_cfg.drafter, aux_layers(micro_cfg), seed=2)
    save_native(drafter, tmp_path / "ckpt")
    said = subprocess.run(
        [sys.executable, "-m", "lab.cli", "export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"),
         "--verifier", str(bf16_target.path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert said.returncode == 0, said.stderr[-3000:]
    for folder in (tmp_path / "ckpt", *sorted(p for p in (tmp_path / "out").iterdir() if p.is_dir())):
        back = load_checkpoint(folder)
        for (name, p), q in zip(drafter.state_dict().items(), back.state_dict().values(), strict=True):
            assert torch.equal(p.cpu(), q), (folder.name, name)


@pytest.mark.slow
def test_ablate_micro(on_device, tmp_path):
    """`lab ablate experiment=drift_2x2 profile=micro` on the device: every arm, its report."""
    store = [f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}", f"tracking.artifact_root={tmp_path / 'art'}"]
    overrides = [o for o in on_device if not o.startswith("tracking.")] + store
    said = subprocess.run(
        [sys.executable, "-m", "lab.cli", "ablate", "experiment=drift_2x2", "--seeds", "0", *overrides],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert said.returncode == 0, said.stderr[-3000:]
    assert "ablation drift_2x2: 4 of 4 runs finished" in said.stdout
    assert any((tmp_path / "reports" / "drift_2x2").iterdir())
