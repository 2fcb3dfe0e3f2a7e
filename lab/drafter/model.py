"""The EAGLE-3 / EAGLE 3.1 drafter, every toggle in one readable file.

Data flow of one drafting step (H = hidden size, A = number of captured target layers):

    step 0:    aux [B,T,A*H_t] --(fc_norm?)--> fc --> h [B,T,H]         (projected target features)
    step j>0:  h = feedback(h_out of step j-1): raw h_out (EAGLE-3) or norm(h_out) (EAGLE 3.1)
    layer 0:   x = concat(input_layernorm(embed(tok)), hidden_norm(h))  [B,T,2H]
               (norm_before_residual: h = hidden_norm(h) before the residual below)
               h = h + attn(x);  h = h + mlp(post_attention_layernorm(h))
    layers>0:  plain Llama decoder layers on h
    output:    logits = lm_head(norm(h_out))   (both versions: lm_head always sees norm(h))

Parameter names follow vLLM's `llama_eagle3.py` / TorchSpec's checkpoints (`fc.weight`,
`fc_norm.{i}.weight`, `layers.0.self_attn.q_proj.weight`, `norm.weight`, `lm_head.weight`), so the
state dict exports without renaming. Attention goes through a cache object that decides what a
query may see: `KVCache` for decoding (all earlier positions), `TTTCache` for the TTT unroll (the causal
context of step 0 plus this position's own earlier drafting steps, as TorchSpec/EAGLE train). Training
does not run `TTTCache`: it is the dense reference that training's fast path is held to, and the dense
unroll of the probe that shuffles the feedback between steps.

This file is the reference, one drafting step at a time over dense tensors. Training's fast path (the
whole TTT unroll over rows, with a fused attention kernel per device) lives beside it in
lab/drafter/unroll.py and lab/drafter/ttt_attention.py, and is tested against it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from lab.drafter.weights import WEIGHTS, draft_ids, module_weights, target_embedding


@dataclass
class DrafterSpec:
    hidden_size: int  # drafter width = the target's embedding width
    target_hidden_size: int  # width of each captured target state
    aux_layer_ids: list[int]  # captured target layers (vLLM ids)
    vocab_size: int  # target vocabulary (embedding rows)
    num_heads: int
    head_dim: int
    intermediate_size: int
    num_kv_heads: int | None = None
    draft_vocab_size: int | None = None  # lm_head rows; None = vocab_size
    num_layers: int = 1
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    fc_norm: str = "none"  # none | per_layer (EAGLE 3.1) | concat (norm_before_fc)
    norm_output: bool = False  # EAGLE 3.1: feed norm(h) back instead of h
    norm_type: str = "rmsnorm"  # kind of the fc norms: rmsnorm | layernorm
    # layer 0's residual is hidden_norm(h) instead of the raw h (vLLM / speculators `norm_before_residual`)
    norm_before_residual: bool = False
    # the decoder layers' attention: gqa (Llama's q/k/v projections) or mla (DeepSeek's latent attention,
    # `MLAttention`, which reads the five dims below; head_dim is then unused)
    attention: str = "gqa"
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    # an MLA drafter's rope scaling, DeepSeek's YaRN (`type`: yarn, factor, original_max_position_embeddings,
    # beta_fast, beta_slow, mscale, mscale_all_dim), taken from a target that has it (Kimi K2); None: plain RoPE
    rope_scaling: dict | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.num_kv_heads = self.num_kv_heads or self.num_heads
        self.draft_vocab_size = self.draft_vocab_size or self.vocab_size
        self.aux_layer_ids = list(self.aux_layer_ids)
        if self.attention == "mla":  # one KV head per query head; head_dim is the query-key head's
            self.num_kv_heads = self.num_heads
            self.head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def rope_dim(self) -> int:
        """The width the rotary embedding turns: the whole head (gqa) or its rope part (mla)."""
        return self.qk_rope_head_dim if self.attention == "mla" else self.head_dim

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids)

    def to_dict(self) -> dict:
        return asdict(self)


# ----------------------------------------------------------------------------------------------
# building blocks


class RMSNorm(nn.Module):
    """Llama RMSNorm: computed in float32, scaled by a learned weight."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def make_norm(norm_type: str, dim: int, eps: float) -> nn.Module:
    if norm_type == "rmsnorm":
        return RMSNorm(dim, eps)
    if norm_type == "layernorm":
        return nn.LayerNorm(dim, eps=eps)
    raise ValueError(f"drafter.norm_type: unknown '{norm_type}'; allowed: rmsnorm, layernorm")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """DeepSeek's YaRN magnitude: 0.1 * mscale * ln(factor) + 1 (1 where factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_softmax_scale(rope_scaling: dict | None) -> float:
    """The factor DeepSeek's YaRN multiplies the attention's softmax scale by: yarn_mscale(factor,
    mscale_all_dim) squared (1 without YaRN or without mscale_all_dim), as vLLM's and transformers' DeepSeek-V2/V3
    attention compute it."""
    if not rope_scaling:
        return 1.0
    return yarn_mscale(float(rope_scaling["factor"]), float(rope_scaling.get("mscale_all_dim") or 0.0)) ** 2


def yarn_inv_freq(dim: int, theta: float, rope_scaling: dict) -> tuple[torch.Tensor, float]:
    """DeepSeek's YaRN (vLLM's `deepseek_yarn`, transformers' `yarn`): inverse frequencies interpolated by
    `factor` below the correction range and kept above it, with a linear ramp between; and the cos/sin magnitude
    yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)."""
    factor = float(rope_scaling["factor"])
    original = float(rope_scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = float(rope_scaling.get("beta_fast", 32)), float(rope_scaling.get("beta_slow", 1))

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 0.001)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (the original frequency), 0: interpolate (divided by factor)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    magnitude = yarn_mscale(factor, float(rope_scaling.get("mscale", 1.0))) / yarn_mscale(
        factor, float(rope_scaling.get("mscale_all_dim") or 0.0)
    )
    return inv_freq, magnitude


class Rotary(nn.Module):
    """Llama (neox-style) rotary embedding; positions [B, T] -> cos, sin [B, 1, T, head_dim]. With
    `rope_scaling` (DeepSeek's YaRN: factor, original_max_position_embeddings, beta_fast, beta_slow, mscale,
    mscale_all_dim) its frequencies and magnitude are YaRN's (`yarn_inv_freq`)."""

    def __init__(self, head_dim: int, theta: float, rope_scaling: dict | None = None):
        super().__init__()
        self.magnitude = 1.0
        if rope_scaling:
            inv_freq, self.magnitude = yarn_inv_freq(head_dim, theta, rope_scaling)
        else:
            inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]
        if self.magnitude != 1.0:
            return emb.cos() * self.magnitude, emb.sin() * self.magnitude
        return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos.to(x.dtype) + _rotate_half(x) * sin.to(x.dtype)


# ----------------------------------------------------------------------------------------------
# attention caches: what a query may attend to


class KVCache:
    """Decoding cache: per layer K, V [B, kv_heads, S, d]. New queries see every cached position and
    the new ones causally. `crop(n)` drops rejected drafts. If `record` is set, attention
    probabilities of each call are kept in `last_probs` (per layer, [B, heads, T_new, S_total])."""

    def __init__(self, num_layers: int, record: bool = False):
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.record = record
        self.last_probs: list[torch.Tensor | None] = [None] * num_layers

    @property
    def length(self) -> int:
        return 0 if self.k[0] is None else self.k[0].shape[2]

    def crop(self, n: int) -> None:
        self.k = [None if k is None else k[:, :, :n] for k in self.k]
        self.v = [None if v is None else v[:, :, :n] for v in self.v]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        past = 0 if self.k[layer] is None else self.k[layer].shape[2]
        self.k[layer] = k if self.k[layer] is None else torch.cat([self.k[layer], k], dim=2)
        self.v[layer] = v if self.v[layer] is None else torch.cat([self.v[layer], v], dim=2)
        keys, values = repeat_kv(self.k[layer], q.shape[1]), repeat_kv(self.v[layer], q.shape[1])
        t_new, s_total = q.shape[2], keys.shape[2]
        scores = (q @ keys.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        q_pos = torch.arange(t_new, device=q.device)[:, None] + past
        k_pos = torch.arange(s_total, device=q.device)[None, :]
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        if self.record:
            self.last_probs[layer] = probs
        return probs @ values


class TTTCache:
    """Training-time-test cache (TorchSpec/EAGLE): step 0 keys are causal over the sequence; the keys of
    later steps are only visible at their own position (the diagonal), because at position t step i stands
    for the i-th token drafted after t. This dense version keeps the whole [B, heads, T, T] attention: the
    reference that training's row-wise fast path (lab/drafter/unroll.py, what training runs) is held to, and the
    dense unroll of the feedback-shuffle probe (lab/eval/probes.py)."""

    def __init__(self, num_layers: int):
        self.k: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self.v: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.k[layer].append(repeat_kv(k, q.shape[1]))
        self.v[layer].append(repeat_kv(v, q.shape[1]))
        out, _ = dense_ttt_attention(q, self.k[layer], self.v[layer], torch.arange(q.shape[2], device=q.device))
        return out


def dense_ttt_attention(
    q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], at: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """TTT attention over dense scores, under one softmax: queries q [B, h, n, d] at positions `at` ([n] or
    [B, n]) see step 0's keys keys[0] [B, h, T, d] up to their own position, and each later step's keys keys[i]
    [B, h, n, d] only at their own position (the diagonal). Returns the output [B, h, n, d] and the attention
    probabilities [B, h, n, T + len(keys) - 1] (step 0's T keys, then one per later step), in q's dtype with
    the softmax in float32. `TTTCache` runs it over every position, the replay (lab/eval/replay.py) over the
    positions its rounds start from."""
    k0, v0 = keys[0], values[0]
    t = k0.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1])
    causal = (q @ k0.transpose(-1, -2)) * scale  # [B, h, n, T]
    future = torch.arange(t, device=q.device) > at[..., None]  # [(B,) n, T]: keys after the query's position
    causal = causal.masked_fill(future.unsqueeze(-3), float("-inf"))
    diag = [(q * ki).sum(-1, keepdim=True) * scale for ki in keys[1:]]  # [B, h, n, 1] each
    probs = torch.softmax(torch.cat([causal, *diag], dim=-1).float(), dim=-1).to(q.dtype)
    out = probs[..., :t] @ v0
    for i, vi in enumerate(values[1:]):
        out = out + probs[..., t + i : t + i + 1] * vi
    return out, probs


def repeat_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """K or V [B, kv_heads, S, d] repeated to [B, num_heads, S, d]: each KV head serves its group of query heads."""
    groups = num_heads // x.shape[1]
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


# ----------------------------------------------------------------------------------------------
# decoder layer


class Attention(nn.Module):
    def __init__(self, spec: DrafterSpec, in_width: int, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_proj = nn.Linear(in_width, spec.num_heads * spec.head_dim, bias=False)
        self.k_proj = nn.Linear(in_width, spec.num_kv_heads * spec.head_dim, bias=False)
        self.v_proj = nn.Linear(in_width, spec.num_kv_heads * spec.head_dim, bias=False)
        self.o_proj = nn.Linear(spec.num_heads * spec.head_dim, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = cache.attend(self.layer_idx, q, k, v)  # [B, heads, T, d]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., d] with rotary pairs interleaved (x0, x1), (x2, x3), ... (GPT-J style) -> [evens, odds], the
    halves layout `apply_rotary` turns. Applied alike to queries and keys, it leaves their dot products as
    they were, so GPT-J rotary = `apply_rotary` after it, with no permutation back (transformers'
    DeepSeek-V3 does the same)."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


class MLAttention(nn.Module):
    """DeepSeek-V2/V3 multi-head latent attention (MLA), named as vLLM's `Eagle3DeepseekV2ForCausalLM` loads
    it, computed per head decompressed (not with the latent absorbed into the query): heads h, dims
    nope = qk_nope_head_dim, rope = qk_rope_head_dim, v = v_head_dim, qk = nope + rope.

    It hands the cache the same per-head q, k, v as `Attention` (num_kv_heads = heads), so decoding (`KVCache`),
    the TTT reference (`TTTCache`) and training's fast path (lab/drafter/unroll.py) read its attention as they
    read GQA's; V is zero-padded to qk where v < qk (the kernels take one head width; exact: the padded
    columns of the output are zero and sliced off before o_proj)."""

    def __init__(self, spec: DrafterSpec, in_width: int, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = self.num_kv_heads = spec.num_heads
        self.nope, self.rope, self.v_dim = spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim
        self.qk_dim = self.nope + self.rope
        self.kv_lora_rank = spec.kv_lora_rank
        # YaRN scales the softmax by mscale(factor, mscale_all_dim)^2: folded into q, which every kernel reads
        self.softmax_gain = yarn_softmax_scale(spec.rope_scaling)
        if self.v_dim > self.qk_dim:
            raise ValueError(
                f"drafter.v_head_dim: expected at most {self.qk_dim} (qk_nope + qk_rope), got {self.v_dim}"
            )
        h = spec.num_heads
        # query: a low-rank bottleneck with its own norm, then every head's nope and rope parts
        self.q_a_proj = nn.Linear(in_width, spec.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(spec.q_lora_rank, spec.rms_norm_eps)
        self.q_b_proj = nn.Linear(spec.q_lora_rank, h * self.qk_dim, bias=False)
        # keys and values: one latent (kv_lora_rank) plus one rope key shared by every head (the "mqa" part)
        self.kv_a_proj_with_mqa = nn.Linear(in_width, spec.kv_lora_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(spec.kv_lora_rank, spec.rms_norm_eps)
        self.kv_b_proj = nn.Linear(spec.kv_lora_rank, h * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(h * self.v_dim, spec.hidden_size, bias=False)

    def qkv(self, q_a: torch.Tensor, kv_a: torch.Tensor, cos, sin, rotary=None) -> tuple[torch.Tensor, ...]:  # noqa: ANN001
        """The first projections' outputs q_a [..., q_lora_rank], kv_a [..., kv_lora_rank + rope] (any leading
        dims L) -> per-head q, k, v [*L, heads, qk] (v zero-padded from v_dim), rotary on the rope dims only.
        cos, sin broadcast against [*L, heads, rope]; `rotary(x, cos, sin)` defaults to `apply_rotary`."""
        rotary = rotary or apply_rotary
        lead, h = q_a.shape[:-1], self.num_heads
        # Q: q_a -> q_a_layernorm -> q_b_proj: [*L, h, nope + rope]
        q = self.q_b_proj(self.q_a_layernorm(q_a)).view(*lead, h, self.qk_dim)
        q_nope, q_pe = q.split([self.nope, self.rope], -1)
        # KV: the latent -> kv_a_layernorm -> kv_b_proj: per-head k_nope [*L, h, nope] and V [*L, h, v]
        latent, k_pe = kv_a.split([self.kv_lora_rank, self.rope], -1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(*lead, h, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], -1)
        # RoPE on the rope dims only, GPT-J style (interleaved pairs, as vLLM runs DeepSeek); k_pe is one
        # key [*L, 1, rope] shared by every head
        q_pe = rotary(deinterleave(q_pe), cos, sin)
        k_pe = rotary(deinterleave(k_pe)[..., None, :], cos, sin).expand(*lead, h, self.rope)
        q = torch.cat([q_nope, q_pe], -1)
        if self.softmax_gain != 1.0:
            q = q * self.softmax_gain
        k = torch.cat([k_nope, k_pe], -1)
        return q, k, F.pad(v, (0, self.qk_dim - self.v_dim))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache) -> torch.Tensor:
        """x [B, T, in_width] -> [B, T, H]. The caches scale scores by 1/sqrt(q's width) = 1/sqrt(nope + rope),
        DeepSeek's softmax scale; with YaRN q carries its mscale^2 (`softmax_gain`)."""
        b, t, _ = x.shape
        # cos, sin [B, 1, T, rope] -> [B, T, 1, rope], against [B, T, heads, rope]
        q, k, v = self.qkv(self.q_a_proj(x), self.kv_a_proj_with_mqa(x), cos.transpose(1, 2), sin.transpose(1, 2))
        out = cache.attend(self.layer_idx, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # [B, h, T, qk]
        return self.o_proj(out[..., : self.v_dim].transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Layer 0 is EAGLE's: attention reads [input_layernorm(embed), hidden_norm(h)] (2H wide) and the
    residual is the raw h (TorchSpec; vLLM's default), or hidden_norm(h) with `norm_before_residual`
    (what speculators trains by default). Later layers are plain pre-norm Llama layers on h."""

    def __init__(self, spec: DrafterSpec, layer_idx: int):
        super().__init__()
        self.is_first = layer_idx == 0
        self.norm_before_residual = spec.norm_before_residual
        h = spec.hidden_size
        self.input_layernorm = RMSNorm(h, spec.rms_norm_eps)
        if self.is_first:
            self.hidden_norm = RMSNorm(h, spec.rms_norm_eps)
        attention = MLAttention if spec.attention == "mla" else Attention
        self.self_attn = attention(spec, 2 * h if self.is_first else h, layer_idx)
        self.post_attention_layernorm = RMSNorm(h, spec.rms_norm_eps)
        self.mlp = MLP(h, spec.intermediate_size)

    def forward(self, embeds: torch.Tensor, h: torch.Tensor, cos, sin, cache) -> torch.Tensor:
        if self.is_first:
            normed = self.hidden_norm(h)
            if self.norm_before_residual:
                h = normed  # the residual stream starts from the normalized state
            x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [B, T, 2H]
        else:
            x = self.input_layernorm(h)  # [B, T, H]
        h = h + self.self_attn(x, cos, sin, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


# ----------------------------------------------------------------------------------------------
# the drafter


class Eagle3Drafter(nn.Module):
    def __init__(self, spec: DrafterSpec):
        super().__init__()
        self.spec = spec
        h, ht = spec.hidden_size, spec.target_hidden_size
        self.embed_tokens = nn.Embedding(spec.vocab_size, h)  # copied from the target, frozen
        self.embed_tokens.weight.requires_grad_(False)
        # EAGLE-3 fuses the raw captured states; EAGLE 3.1 normalizes each one first so every captured
        # layer enters fc at the same scale; `concat` is vLLM/speculators' single norm_before_fc.
        if spec.fc_norm == "per_layer":
            self.fc_norm = nn.ModuleList(make_norm(spec.norm_type, ht, spec.rms_norm_eps) for _ in range(spec.num_aux))
        elif spec.fc_norm == "concat":
            self.input_norm = make_norm(spec.norm_type, ht * spec.num_aux, spec.rms_norm_eps)
        elif spec.fc_norm != "none":
            raise ValueError(f"drafter.fc_norm: unknown '{spec.fc_norm}'; allowed: none, per_layer, concat")
        self.fc = nn.Linear(ht * spec.num_aux, h, bias=False)
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(h, spec.rms_norm_eps)
        self.lm_head = nn.Linear(h, spec.draft_vocab_size, bias=False)
        self.rotary = Rotary(spec.rope_dim, spec.rope_theta, spec.rope_scaling if spec.attention == "mla" else None)
        if spec.draft_vocab_size != spec.vocab_size:
            # target id = draft id + d2t[draft id]
            self.register_buffer("d2t", torch.zeros(spec.draft_vocab_size, dtype=torch.long))

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """Captured target states [B, T, A*H_t] -> the step-0 hidden state [B, T, H]."""
        if self.spec.fc_norm == "per_layer":  # EAGLE 3.1
            chunks = aux.chunk(self.spec.num_aux, dim=-1)
            aux = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks, strict=True)], dim=-1)
        elif self.spec.fc_norm == "concat":
            aux = self.input_norm(aux)
        return self.fc(aux)

    def feedback(self, h_out: torch.Tensor) -> torch.Tensor:
        """What the next drafting step receives: raw h (EAGLE-3) or norm(h) (EAGLE 3.1 norm_output)."""
        return self.norm(h_out) if self.spec.norm_output else h_out

    def logits(self, h_out: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits; lm_head always reads norm(h) in both versions."""
        return self.lm_head(self.norm(h_out))

    def draft_token_ids(self) -> torch.Tensor:
        """The target ids of the draft vocabulary, in draft order [V_draft]."""
        return self.to_target_ids(torch.arange(self.spec.draft_vocab_size, device=self.lm_head.weight.device))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids] if hasattr(self, "d2t") else draft_ids

    def target_mask(self) -> torch.Tensor:
        """t2d: a bool mask over the target vocabulary [vocab_size], True at the target ids of the draft vocabulary."""
        mask = torch.zeros(self.spec.vocab_size, dtype=torch.bool)
        mask[self.draft_token_ids().cpu()] = True
        return mask

    def to_target_probs(self, draft_probs: torch.Tensor) -> torch.Tensor:
        """A distribution over the draft vocabulary [.., V_draft] as one over the target's [.., V]."""
        if not hasattr(self, "d2t"):
            return draft_probs
        out = draft_probs.new_zeros(*draft_probs.shape[:-1], self.spec.vocab_size)
        return out.index_copy_(-1, self.draft_token_ids(), draft_probs)

    def forward(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, cache: KVCache | TTTCache
    ) -> torch.Tensor:
        """One drafting step over T positions: tokens [B, T], hidden [B, T, H], positions [B, T] ->
        h_out [B, T, H] (pre-norm residual stream)."""
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        cos, sin = self.rotary(positions)
        h = hidden
        for layer in self.layers:
            h = layer(embeds, h, cos, sin, cache)
        return h

    # ------------------------------------------------------------------------------------------
    # checkpoint tensors <-> this state dict, as vLLM's model loads its own weights. The name table and
    # the d2t / t2d checks live in lab/drafter/weights.py; the files and configs around them in
    # lab/drafter/formats.py.

    def load_weights(
        self, weights: dict[str, torch.Tensor], embed_weight: torch.Tensor | None = None, where: str | Path = WEIGHTS
    ) -> Eagle3Drafter:
        """Load a checkpoint's tensors, named as vLLM, TorchSpec, speculators or EAGLE-3 save them, cast to
        this module's dtype; returns self. A checkpoint without its embedding takes `embed_weight` (the
        target's). CheckpointError naming `where` when d2t and t2d disagree or the embedding is missing;
        names and shapes are checked before (formats.inspect_checkpoint), here load_state_dict is strict."""
        spec = self.spec
        full = spec.draft_vocab_size == spec.vocab_size
        state = module_weights(weights, full)  # `midlayer.` -> `layers.0.`, what the module does not use dropped
        ids = draft_ids(weights.get("d2t"), weights.get("t2d"), spec.vocab_size, spec.draft_vocab_size, where)
        if ids is not None and not full:
            state["d2t"] = ids - torch.arange(spec.draft_vocab_size)  # int64 whatever the file's dtype
        elif ids is not None:
            # a reordered full vocabulary: put lm_head's rows in target order, which needs no d2t
            head = state["lm_head.weight"]
            state["lm_head.weight"] = torch.empty_like(head).index_copy_(0, ids, head)
        if "embed_tokens.weight" not in state:
            state["embed_tokens.weight"] = target_embedding(embed_weight, spec.vocab_size, spec.hidden_size, where)
        self.load_state_dict(state, strict=True)  # casts bf16 / fp16 weights to the module's dtype
        return self

    def export_weights(self) -> dict[str, torch.Tensor]:
        """The tensors a checkpoint holds, under the names vLLM loads: weights in float32 and, with a pruned
        vocabulary, d2t (int64 [V_draft]) and t2d (bool [V]; speculators reads it, vLLM skips it)."""
        state = {k: v.detach().to(torch.float32).contiguous() for k, v in self.state_dict().items()}
        if "d2t" in state:
            state["d2t"] = self.d2t.detach().to(torch.int64).contiguous()
            state["t2d"] = self.target_mask()
        # vLLM builds a hidden_norm in every layer and loads strictly; only layer 0's is used
        for i in range(1, self.spec.num_layers):
            state[f"layers.{i}.hidden_norm.weight"] = torch.ones(self.spec.hidden_size)
        return state
