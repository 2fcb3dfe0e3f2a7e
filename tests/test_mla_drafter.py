"""The MLA drafter (drafter.attention=mla): its attention computed as DeepSeek's, training's fast path equal to
the `TTTCache` reference on every kernel (values and gradients), decoding equal to the TTT unroll, a fresh
drafter shaped after an MLA or a dense target."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import perturb, small_drafter

from lab.drafter import KVCache
from lab.drafter import ttt_attention as ttt_attention_module
from lab.drafter.model import MLAttention, TTTCache, apply_rotary, deinterleave
from lab.drafter.unroll import unroll

# micro_mla's shape (kv 512 + rope 64, nope = v = 32), and Kimi's unequal heads at toy size (qk 24 > v 16)
MLA = dict(attention="mla", q_lora_rank=24, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32)
UNEQUAL = dict(attention="mla", q_lora_rank=16, kv_lora_rank=40, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)


def mla_drafter(dims=MLA, seed=0, **spec):
    return perturb(small_drafter(seed, **dims, **spec))


def gptj_rotary(x, positions, theta=10000.0):
    """GPT-J rotary on interleaved pairs (x0, x1), (x2, x3), ..., written out pair by pair: vLLM's
    `is_neox_style=False`, what DeepSeek's rope dims get."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = positions.float()[..., None] * inv  # [..., d/2]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    cos, sin = ang.cos(), ang.sin()
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)


@pytest.mark.parametrize("dims", [MLA, UNEQUAL], ids=["micro_mla", "unequal_heads"])
def test_mla_attention_is_deepseeks(dims):
    """MLAttention over a causal KVCache equals DeepSeek's MLA written out plainly: the low-rank query, the
    latent with one shared rope key, GPT-J rotary on the rope dims only, softmax scale 1/sqrt(nope + rope),
    o_proj over heads x v_head_dim (no padding of V here)."""
    d = mla_drafter(dims)
    attn: MLAttention = d.layers[0].self_attn
    b, t, h = 2, 7, d.spec.num_heads
    nope, rope, v_dim, kv = dims["qk_nope_head_dim"], dims["qk_rope_head_dim"], dims["v_head_dim"], dims["kv_lora_rank"]
    x = torch.randn(b, t, 2 * d.spec.hidden_size)
    pos = torch.arange(t)[None].expand(b, t)
    cos, sin = d.rotary(pos)
    with torch.no_grad():
        got = attn(x, cos, sin, KVCache(1))
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x))).view(b, t, h, nope + rope)
        ckv = attn.kv_a_proj_with_mqa(x)
        kvb = attn.kv_b_proj(attn.kv_a_layernorm(ckv[..., :kv])).view(b, t, h, nope + v_dim)
        k_pe = gptj_rotary(ckv[..., kv:], pos)[:, :, None].expand(b, t, h, rope)
        qq = torch.cat([q[..., :nope], gptj_rotary(q[..., nope:], pos[..., None])], -1).transpose(1, 2)
        kk = torch.cat([kvb[..., :nope], k_pe], -1).transpose(1, 2)
        vv = kvb[..., nope:].transpose(1, 2)
        scores = qq @ kk.transpose(-1, -2) / math.sqrt(nope + rope)
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        want = attn.o_proj((scores.softmax(-1) @ vv).transpose(1, 2).reshape(b, t, h * v_dim))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # deinterleave + neox rotary on both sides leaves the dot products of GPT-J rotary unchanged
    a, c = torch.randn(5, rope), torch.randn(5, rope)
    p = torch.arange(5)
    ca, sa = d.rotary(p[None])
    neox = (apply_rotary(deinterleave(a), ca[0, 0], sa[0, 0]) * apply_rotary(deinterleave(c), ca[0, 0], sa[0, 0])).sum(
        -1
    )
    torch.testing.assert_close(neox, (gptj_rotary(a, p) * gptj_rotary(c, p)).sum(-1), rtol=1e-4, atol=1e-4)


def _reference_unroll(drafter, tokens, aux, length):
    """The TTT unroll step by step through the reference model and `TTTCache` (dense [B, heads, T, T])."""
    b, t = tokens.shape
    ext = F.pad(tokens, (0, length - 1))
    cache = TTTCache(len(drafter.layers))
    hidden, outs = drafter.project(aux), []
    for step in range(length):
        pos = (torch.arange(t) + step)[None].expand(b, t)
        h = drafter(ext[:, step : step + t], hidden, pos, cache)
        outs.append(h)
        hidden = drafter.feedback(h)
    return outs


@pytest.mark.parametrize("kernel", ["cpu-flash", "portable", "sdpa-joint"])
@pytest.mark.parametrize(("dims", "num_layers", "keep"), [(MLA, 1, True), (UNEQUAL, 2, True), (UNEQUAL, 1, False)])
def test_the_fast_path_equals_the_ttt_reference_for_mla(monkeypatch, kernel, dims, num_layers, keep):
    """Training's unroll (rows, fused input projections, each device's kernel) of an MLA drafter equals the
    reference's TTT unroll through `TTTCache`: every step's output and every gradient."""
    kernels = {k.name: k for k in (ttt_attention_module.CPU_FLASH, ttt_attention_module.PORTABLE)}
    kernels["sdpa-joint"] = ttt_attention_module.SDPA_JOINT
    monkeypatch.setattr(ttt_attention_module, "kernel_for", lambda device: kernels[kernel])
    fast, ref = mla_drafter(dims, num_layers=num_layers, fc_norm="per_layer", norm_output=True), None
    ref = small_drafter(0, **dims, num_layers=num_layers, fc_norm="per_layer", norm_output=True)
    ref.load_state_dict(fast.state_dict())
    fast.train(), ref.train()
    b, t, length = 2, 11, 3
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 100, (b, t), generator=g)
    aux = torch.randn(b, t, 192, generator=g) * 3
    want = _reference_unroll(ref, tokens, aux, length)
    if keep:  # later steps only at some rows, as the loss asks for them
        rows = [torch.arange(b * t), torch.tensor([1, 3, 4, 7, 12, 15, 20]), torch.tensor([3, 7, 15, 20])]
        got = unroll(fast, tokens, aux, length, keep=rows)
        want = [w.reshape(b * t, -1)[r] for w, r in zip(want, rows, strict=True)]
    else:
        got = unroll(fast, tokens, aux, length)
    weights = [torch.randn_like(w) for w in want]
    for step, (x, y) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5, msg=f"step {step}")
    sum((x * w).sum() for x, w in zip(got, weights, strict=True)).backward()
    sum((y * w).sum() for y, w in zip(want, weights, strict=True)).backward()
    for (name, p), q in zip(fast.named_parameters(), ref.parameters(), strict=True):
        if p.requires_grad:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=f"gradient of {name}")


def test_mla_decoding_equals_the_ttt_unroll():
    """Drafting step by step with the KVCache sees exactly what the TTT unroll trains on."""
    d = mla_drafter(UNEQUAL, num_layers=2, norm_output=True)
    t, length = 10, 3
    tokens = torch.randint(0, 100, (1, t))
    aux = torch.randn(1, t, 192) * 3
    with torch.no_grad():
        outs = unroll(d, tokens, aux, length)
        for pos in (0, 4, t - length):
            cache = KVCache(2)
            ctx = d(tokens[:, : pos + 1], d.project(aux[:, : pos + 1]), torch.arange(pos + 1)[None], cache)
            torch.testing.assert_close(ctx[:, pos], outs[0][:, pos], atol=1e-5, rtol=1e-4)
            h = ctx[:, pos : pos + 1]
            for step in range(1, length):
                h = d(tokens[:, pos + step : pos + step + 1], d.feedback(h), torch.tensor([[pos + step]]), cache)
                torch.testing.assert_close(h[:, 0], outs[step][:, pos], atol=1e-5, rtol=1e-4)


def test_a_value_head_wider_than_the_query_key_head_is_refused():
    with pytest.raises(ValueError, match="drafter.v_head_dim: expected at most 24"):
        small_drafter(**{**UNEQUAL, "v_head_dim": 32})
