"""The TTT attention on any device: each kernel equals CPU's fused kernel, and no CPU-only op is reachable from
a CUDA run (its branch run on the CPU under a check of every op, tests/cuda_branch.py)."""

from __future__ import annotations

import pytest
import torch
from cuda_branch import _CudaOnly, cuda_branch
from helpers import perturb, small_drafter

from lab.config.shape import aux_layers
from lab.data.suites import build_suite
from lab.drafter import init_drafter
from lab.drafter import ttt_attention as ttt_attention_module
from lab.drafter.ttt_attention import CPU_FLASH, PORTABLE, SDPA_JOINT, kernel_for, ttt_attention
from lab.eval.probes import DriftProbes, rollout_counts, shuffled_rollout_counts
from lab.eval.reference import speculative_decode, target_decode
from lab.train.loss import ttt_loss


def _case(layout: str, groups: int, steps: int, seed: int = 0):
    """Query rows, step 0's keys and values, the diagonal's, the mask and the row layout of one TTT attention
    call: b sequences of t positions, every position (`dense`) or some rows padded per sequence (`padded`)."""
    g = torch.Generator().manual_seed(seed)
    b, t, kv_heads, d = 2, 11, 2, 8
    if layout == "dense":
        lay, pos = None, torch.arange(t).expand(b, t)
        m = b * t
    else:
        rows = torch.tensor([1, 3, 4, 7, 10, 12, 15, 20])  # 5 rows of sequence 0, 3 of sequence 1
        seq_of = rows // t
        counts = torch.bincount(seq_of, minlength=b)
        slot = torch.arange(len(rows)) - (torch.cumsum(counts, 0) - counts)[seq_of]
        n = int(counts.max())
        lay = (seq_of, slot, n)
        pos = torch.full((b, n), t - 1)
        pos[seq_of, slot] = rows % t
        m = len(rows)
    future = torch.arange(t)[None, None, :] > pos[:, :, None]
    q = torch.randn(m, kv_heads, groups, d, generator=g)
    k0, v0 = torch.randn(b, kv_heads, t, d, generator=g), torch.randn(b, kv_heads, t, d, generator=g)
    dk = torch.randn(m, kv_heads, steps, d, generator=g) if steps else None
    dv = torch.randn(m, kv_heads, steps, d, generator=g) if steps else None
    return [q, k0, v0, dk, dv], future, lay


def _run(kernel, tensors, future, layout):
    inputs = [None if x is None else x.clone().requires_grad_() for x in tensors]
    out = ttt_attention(*inputs, future, layout, kernel)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.device, out.dtype)
    grads = torch.autograd.grad((out * weight).sum(), [x for x in inputs if x is not None])
    return out, grads


@pytest.mark.parametrize("kernel", ["portable", "sdpa-joint"])
@pytest.mark.parametrize("layout", ["dense", "padded"])
@pytest.mark.parametrize(("groups", "steps"), [(1, 0), (2, 0), (1, 2), (2, 3)])
def test_every_kernel_equals_the_cpu_kernel(kernel, layout, groups, steps):
    """The portable path and the CUDA path (one SDPA call over the joint keys) give CPU's fused kernel's output
    and gradients, over dense and padded row layouts, grouped-query heads and diagonal steps."""
    tensors, future, lay = _case(layout, groups, steps)
    want, want_grads = _run(CPU_FLASH, tensors, future, lay)
    got, got_grads = _run({"portable": PORTABLE, "sdpa-joint": SDPA_JOINT}[kernel], tensors, future, lay)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_the_kernel_is_chosen_by_device():
    assert kernel_for(torch.device("cpu")) is CPU_FLASH
    assert kernel_for(torch.device("cuda", 0)) is SDPA_JOINT
    assert kernel_for(torch.device("meta")) is PORTABLE


def test_the_check_finds_a_cpu_only_op():
    """The check can fail: CPU's fused kernel, which made training fail on CUDA, is reported."""
    tensors, future, lay = _case("padded", 2, 2)
    with _CudaOnly() as mode:
        _run(CPU_FLASH, tensors, future, lay)
    assert "_scaled_dot_product_flash_attention_for_cpu" in mode.violations
    assert "_scaled_dot_product_flash_attention_for_cpu_backward" in mode.violations


def test_no_cpu_only_op_is_reachable_from_a_cuda_run(monkeypatch, micro_cfg, micro_target):
    """Training's step (loss, backward, AdamW), the held-out rollout and its shuffled probe, and the reference
    decoder with drift probes reach only ops that have CUDA kernels, with every device choice on its CUDA side."""
    torch.manual_seed(0)
    drafter = perturb(small_drafter(num_kv_heads=1, num_layers=2, norm_output=True, fc_norm="per_layer"))
    vocab, hidden = drafter.spec.vocab_size, drafter.spec.hidden_size
    g = torch.Generator().manual_seed(0)
    b, t = 2, 24
    input_ids = torch.randint(0, vocab, (b, t), generator=g)
    aux = torch.randn(b, t, drafter.spec.num_aux * drafter.spec.target_hidden_size, generator=g)
    final, lm_head = torch.randn(b, t, hidden, generator=g), torch.randn(vocab, hidden, generator=g)
    loss_mask = (torch.rand(b, t, generator=g) < 0.6).to(torch.uint8)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-3, fused=True)
    target_top = (final @ lm_head.T).argmax(-1)

    decoder = init_drafter(micro_target, micro_cfg.drafter, aux_layers(micro_cfg), seed=0).eval()
    prompt = build_suite("in_dist", micro_target.tokenizer, micro_cfg).prompts[0]
    plain_decode = speculative_decode(micro_target.model, decoder, prompt, 12, 3)
    joint_calls = []
    joint = ttt_attention_module.joint_sdpa
    monkeypatch.setattr(ttt_attention_module, "joint_sdpa", lambda *a: joint_calls.append(1) or joint(*a))
    with cuda_branch(monkeypatch) as mode:
        stats = ttt_loss(drafter, input_ids, aux, final, lm_head, 3, 0.8, loss_mask)
        stats.loss.backward()
        opt.step()
        with torch.no_grad():
            rollout_counts(drafter, input_ids, aux, target_top, 4, loss_mask)
            shuffled_rollout_counts(drafter, input_ids, aux, target_top, 3, loss_mask, "feedback")
        target_decode(micro_target.model, prompt, 8)
        decoded = speculative_decode(micro_target.model, decoder, prompt, 12, 3, probes=DriftProbes(3))
    assert joint_calls  # the CUDA side did run
    assert not mode.violations, f"ops without a CUDA kernel: {sorted(mode.violations)}"
    assert decoded[0] == plain_decode[0]  # the CUDA side decodes what the CPU side decodes
