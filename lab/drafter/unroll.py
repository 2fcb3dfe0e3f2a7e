"""The training fast path: the drafter's TTT unroll over rows of the flattened B x T positions.

lab/drafter/model.py is the reference: one drafting step at a time over dense [B, T] tensors (`TTTCache.attend`
keeps the whole [B, heads, T, T] attention). `unroll` computes the same function for training and the
held-out rollout, faster:
- later drafting steps run only at the rows whose loss (or a later step) needs them (`keep`), since a row's
  later steps read only its own earlier steps and step 0's causal context;
- layer 0's q/k/v (MLA: q_a / kv_a) of the embedding half are computed once for every step;
- q/k/v and gate/up are one matmul each (weights concatenated once per unroll);
- the norms have their backward written out (`rms_norm`), the rotary embedding is one roll;
- attention is a fused kernel per device with the diagonal joined through the log-sum-exp
  (lab/drafter/ttt_attention.py).
Equal to the reference in values and gradients (up to float rounding) is its contract: the reference is the
readable statement of what training computes, so a change here that the reference does not make is a bug.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lab.drafter.model import Attention, DecoderLayer, Eagle3Drafter, MLAttention, RMSNorm
from lab.drafter.ttt_attention import ttt_attention


class _RMSNormFunction(torch.autograd.Function):
    """`RMSNorm.forward` with its backward written out (fewer passes over the rows than autograd's)."""

    @staticmethod
    def forward(ctx, x, weight, eps):  # noqa: ANN001, D102
        xf = x.float()
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True).add_(eps))
        normed = (xf * r).to(x.dtype)
        ctx.save_for_backward(normed, weight, r)
        ctx.x_dtype = x.dtype
        return weight * normed

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, D102
        normed, weight, r = ctx.saved_tensors
        dweight = (grad * normed).reshape(-1, grad.shape[-1]).sum(0).to(weight.dtype)
        g = (grad * weight).float()
        nf = normed.float()
        dx = g.addcmul_(nf, torch.linalg.vecdot(g, nf)[..., None], value=-1.0 / g.shape[-1]).mul_(r)
        return dx.to(ctx.x_dtype), dweight, None


def rms_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """norm(x) for an RMSNorm, through `_RMSNormFunction` (the same values as the module)."""
    return _RMSNormFunction.apply(x, norm.weight, norm.eps)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated: rotate_half(x) * sin == x.roll(d/2) * signed_sin(sin)."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], -1)


def apply_rotary_rolled(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """`apply_rotary` with `signed_sin(sin)`: one roll instead of rotate_half's split, negation and cat."""
    return torch.addcmul(x * cos.to(x.dtype), x.roll(x.shape[-1] // 2, -1), sin_signed.to(x.dtype))


class RowCache:
    """`TTTCache` over rows: what each step's query rows may attend to. Step 0 runs at every position and its
    keys are stored densely (every later step reads them causally); a later step's keys only at its rows
    (read on its own diagonal). `rows` is the current step's rows of B x T (None: all), `row_sets` every
    step's so far."""

    def __init__(self, num_layers: int, batch: int, seq: int):
        self.k: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self.v: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self.batch, self.seq = batch, seq
        self.rows: torch.Tensor | None = None
        self.row_sets: list[torch.Tensor | None] = []
        self.fused: dict = {}  # weights concatenated once per unroll, for one matmul each (`fused_weight`)

    def fused_weight(self, key, *weights: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        """torch.cat(weights), made once per unroll and shared by its steps (their gradients meet there)."""
        if key not in self.fused:
            self.fused[key] = torch.cat(weights)
        return self.fused[key]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [N, heads, d], k and v [N, kv_heads, d] at the current step's `rows` -> [N, heads * d]."""
        b, t = self.batch, self.seq
        rows = self.rows
        step = len(self.k[layer])
        if step == 0:
            if rows is not None:
                raise ValueError("step 0 of the TTT unroll runs at every position")
            k0 = k.view(b, t, *k.shape[1:]).transpose(1, 2).contiguous()  # [B, kv_heads, T, d]
            v0 = v.view(b, t, *v.shape[1:]).transpose(1, 2).contiguous()
            self.k[layer].append(k0)
            self.v[layer].append(v0)
            # every position queries: plain causal attention (the fused kernels skip the masked blocks)
            out = F.scaled_dot_product_attention(
                q.view(b, t, *q.shape[1:]).transpose(1, 2), k0, v0, is_causal=True, enable_gqa=True
            )
            return out.transpose(1, 2).reshape(b * t, -1)
        self.k[layer].append(k)
        self.v[layer].append(v)
        k0, v0 = self.k[layer][0], self.v[layer][0]
        kv_heads, d = k0.shape[1], k0.shape[-1]
        heads = q.shape[1]
        # the queries' flat positions, then a [B, n, ...] layout padded to the most rows of one sequence
        if rows is None:
            layout = None
            pos = torch.arange(t, device=q.device).expand(b, t)
        else:
            seq_of = rows // t
            counts = torch.bincount(seq_of, minlength=b)
            slot = torch.arange(len(rows), device=q.device) - (torch.cumsum(counts, 0) - counts)[seq_of]
            n = int(counts.max()) if len(rows) else 1  # one host sync per step and layer: the padded width
            layout = (seq_of, slot, n)
            pos = torch.full((b, n), t - 1, dtype=torch.long, device=q.device)
            pos[seq_of, slot] = rows % t
        future = torch.arange(t, device=q.device)[None, None, :] > pos[:, :, None]  # [B, n, T]
        # later steps' keys and values: each row reads its own, on the diagonal
        diag_k, diag_v = [], []
        for j in range(1, step + 1):
            kj = k if j == step else self.k[layer][j]
            vj = v if j == step else self.v[layer][j]
            if j < step and rows is not None and self.row_sets[j] is not None:
                idx = torch.searchsorted(self.row_sets[j], rows)
                kj, vj = kj.index_select(0, idx), vj.index_select(0, idx)
            diag_k.append(kj)
            diag_v.append(vj)
        dk = torch.stack(diag_k, 2)  # [M, kv_heads, steps, d]
        dv = torch.stack(diag_v, 2)
        q = q.view(-1, kv_heads, heads // kv_heads, d)  # grouped-query heads: head = kv head * groups + j
        out = ttt_attention(q, k0, v0, dk, dv, future, layout)
        return out.reshape(out.shape[0], -1)


def input_projections(attn: Attention | MLAttention) -> tuple[torch.nn.Linear, ...]:
    """The projections that read the attention's input, in the order their outputs are concatenated: q, k, v
    (GQA) or q_a, kv_a (MLA). Layer 0's embedding half of each is computed once per unroll."""
    if isinstance(attn, MLAttention):
        return attn.q_a_proj, attn.kv_a_proj_with_mqa
    return attn.q_proj, attn.k_proj, attn.v_proj


def attention_rows(
    attn: Attention | MLAttention,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: RowCache,
    qkv: torch.Tensor | None = None,
    out_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """`Attention.forward` / `MLAttention.forward` over rows: x [N, width] -> [N, H], or [len(out_rows), H] with
    `out_rows` (indices into the rows: every row is attended, for its keys and values, but o_proj runs at those
    only); cos and `signed_sin(sin)` [N, 1, d] (d: the rotary width). `qkv` [N, sum of the input projections'
    widths] is a projection of the input's first columns computed beforehand (layer 0's embedding half); x then
    holds only the remaining columns."""
    # the input projections as one matmul, over the input's last x.shape[1] columns (made once per unroll)
    projections = input_projections(attn)
    first = projections[0].weight.shape[1] - x.shape[1]
    weight = cache.fused_weight((attn.layer_idx, "qkv", first), *(w.weight[:, first:] for w in projections))
    out = F.linear(x, weight) if qkv is None else qkv + F.linear(x, weight)
    if isinstance(attn, MLAttention):
        # MLA: the latents -> per-head q, k, v [N, heads, qk] (v zero-padded), rotary on the rope dims
        q_a, kv_a = out.split([w.weight.shape[0] for w in projections], -1)
        q, k, v = attn.qkv(q_a, kv_a, cos, sin, rotary=apply_rotary_rolled)
        out = cache.attend(attn.layer_idx, q, k, v)  # [N, heads * qk]
        out = out.view(out.shape[0], attn.num_heads, -1)[..., : attn.v_dim].reshape(out.shape[0], -1)
    else:
        nq, nkv = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
        q, k, v = out.split([nq, nkv, nkv], -1)
        q = apply_rotary_rolled(q.reshape(-1, attn.num_heads, attn.head_dim), cos, sin)
        k = apply_rotary_rolled(k.reshape(-1, attn.num_kv_heads, attn.head_dim), cos, sin)
        out = cache.attend(attn.layer_idx, q, k, v.reshape(-1, attn.num_kv_heads, attn.head_dim))
    return attn.o_proj(out if out_rows is None else out.index_select(0, out_rows))


def layer_rows(
    layer: DecoderLayer,
    embed_qkv: torch.Tensor | None,
    h: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: RowCache,
    out_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """`DecoderLayer.forward` over rows h [N, H]; layer 0 gets the q/k/v projection of its embedding half
    (`embed_qkv` [N, ...]), computed once for every step. With `out_rows` (indices into the rows), keys and
    values are computed at every row but the rest only there, and the result is [len(out_rows), H]."""
    if layer.is_first:
        normed = rms_norm(layer.hidden_norm, h)
        if layer.norm_before_residual:
            h = normed
        attn = attention_rows(layer.self_attn, normed, cos, sin, cache, qkv=embed_qkv, out_rows=out_rows)
    else:
        x = rms_norm(layer.input_layernorm, h)
        attn = attention_rows(layer.self_attn, x, cos, sin, cache, out_rows=out_rows)
    if out_rows is not None:
        h = h.index_select(0, out_rows)
    h = h + attn
    mlp = layer.mlp
    # gate and up projections as one matmul
    weight = cache.fused_weight((layer.self_attn.layer_idx, "gate_up"), mlp.gate_proj.weight, mlp.up_proj.weight)
    gate, up = F.linear(rms_norm(layer.post_attention_layernorm, h), weight).chunk(2, -1)
    return h + mlp.down_proj(F.silu(gate) * up)


def unroll(
    drafter: Eagle3Drafter,
    input_ids: torch.Tensor,
    aux: torch.Tensor,
    length: int,
    keep: list[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Training-time test over a batch: `length` drafting steps, inputs shifted by one token per step.

    input_ids [B, T] are the tokens x_1..x_T that follow each target position (already shifted by one, as in
    TorchSpec), aux [B, T, A*H_t] the target states at positions 0..T-1. Step i at position t embeds
    x_{t+i+1} (token 0 past the end), sits at RoPE position t+i and predicts x_{t+i+2}. Returns the h_out of
    every step ([B, T, H] each); each step after the first receives `drafter.feedback` of the one before.

    With `keep` (one sorted index tensor into the flattened B x T positions per step, each step's a subset of
    the previous one's), step i returns h_out at keep[i] only ([len(keep[i]), H]), and steps after 0 compute
    nothing else: a position's later steps read only that position's own earlier steps and step 0's causal
    context, which is computed everywhere.
    """
    b, t = input_ids.shape
    device = input_ids.device
    cache = RowCache(len(drafter.layers), b, t)
    hidden = drafter.project(aux).reshape(b * t, -1)
    # every step's tokens at once: step i at position t embeds ext[t + i]
    ext = F.pad(input_ids, (0, length - 1))
    first = drafter.layers[0]
    embeds = drafter.embed_tokens(ext).to(hidden.dtype)
    # layer 0's q/k/v of the embedding half, once for all steps: its weight's first H columns, with
    # input_layernorm's weight folded in (the normalized embeddings need no gradient then)
    norm = first.input_layernorm
    x = embeds.float()
    x = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)).to(embeds.dtype)
    attn = first.self_attn
    hidden_size = embeds.shape[-1]
    qkv_weight = torch.cat([w.weight[:, :hidden_size] for w in input_projections(attn)])
    embed_qkv = F.linear(x, qkv_weight * norm.weight)
    embed_qkv = embed_qkv.reshape(b * (t + length - 1), -1)  # row (s, p): sequence s, position p
    cos, sin = drafter.rotary(torch.arange(t + length - 1, device=device)[None])
    cos, sin = cos[0, 0], signed_sin(sin[0, 0])  # [T + length - 1, d]
    pos = torch.arange(t, device=device).repeat(b)  # position of each row of B x T
    flat = torch.arange(b * t, device=device)
    step_rows = [None if keep is None or step == 0 else keep[step] for step in range(length)]
    # every step's rows of embed_qkv in one gather: step i at position p reads ext[p + i]
    where = [flat if r is None else r for r in step_rows]
    where = [r + r // t * (length - 1) + step for step, r in enumerate(where)]
    step_qkvs = embed_qkv.index_select(0, torch.cat(where)).split([len(r) for r in where])
    outs: list[torch.Tensor] = []
    last = len(drafter.layers) - 1
    for step, rows in enumerate(step_rows):
        if rows is not None:
            hidden = hidden.index_select(0, torch.searchsorted(keep[step - 1], rows))
        cache.rows = rows
        cache.row_sets.append(rows)
        at = pos if rows is None else pos.index_select(0, rows)
        c, s = cos[at + step][:, None], sin[at + step][:, None]
        h = hidden
        for i, layer in enumerate(drafter.layers):
            # step 0's keys are every later step's context; its other outputs are needed at keep[0]
            out_rows = keep[0] if keep is not None and step == 0 and i == last else None
            h = layer_rows(layer, step_qkvs[step] if layer.is_first else None, h, c, s, cache, out_rows)
        outs.append(h.view(b, t, -1) if keep is None else h)
        hidden = drafter.feedback(h)
    return outs
