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
query may see: `KVCache` for decoding (all earlier positions), `TTTCache` for training (the causal
context of step 0 plus this position's own earlier drafting steps, as TorchSpec/EAGLE train).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F


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
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.num_kv_heads = self.num_kv_heads or self.num_heads
        self.draft_vocab_size = self.draft_vocab_size or self.vocab_size
        self.aux_layer_ids = list(self.aux_layer_ids)

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
    """norm(x) for an RMSNorm, through `_RMSNormFunction` (the TTT unroll's norms)."""
    return _RMSNormFunction.apply(x, norm.weight, norm.eps)


def make_norm(norm_type: str, dim: int, eps: float) -> nn.Module:
    if norm_type == "rmsnorm":
        return RMSNorm(dim, eps)
    if norm_type == "layernorm":
        return nn.LayerNorm(dim, eps=eps)
    raise ValueError(f"drafter.norm_type: unknown '{norm_type}'; allowed: rmsnorm, layernorm")


class Rotary(nn.Module):
    """Llama (neox-style) rotary embedding; positions [B, T] -> cos, sin [B, 1, T, head_dim]."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]
        return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos.to(x.dtype) + _rotate_half(x) * sin.to(x.dtype)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated: rotate_half(x) * sin == x.roll(d/2) * signed_sin(sin)."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], -1)


def apply_rotary_rolled(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """`apply_rotary` with `signed_sin(sin)`: one roll instead of rotate_half's split, negation and cat."""
    return torch.addcmul(x * cos.to(x.dtype), x.roll(x.shape[-1] // 2, -1), sin_signed.to(x.dtype))


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
        keys, values = _repeat_kv(self.k[layer], q.shape[1]), _repeat_kv(self.v[layer], q.shape[1])
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
    """Training-time-test cache (TorchSpec/EAGLE): step 0 keys are causal over the sequence; the keys
    of later steps are only visible at their own position (the diagonal), because at position t step
    i stands for the i-th token drafted after t.

    `attend` takes dense [B, heads, T, d] tensors. `attend_rows` takes the rows of the flattened B x T
    positions that the current step computes (`rows`; None: all of them), as `Eagle3Drafter.unroll`
    runs later steps only where the loss needs them: a row's attention reads step 0's keys at and
    before it and its own keys of later steps, never another row of a later step, so skipping rows
    changes nothing at the rows computed."""

    def __init__(self, num_layers: int, batch: int = 0, seq: int = 0):
        self.k: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self.v: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self.batch, self.seq = batch, seq
        self.rows: torch.Tensor | None = None  # the current step's rows of B x T (None: all)
        self.row_sets: list[torch.Tensor | None] = []  # each step's rows (None: all), set by the unroll
        self.fused: dict = {}  # weights concatenated once per unroll, for one matmul each (`fused_weight`)

    def fused_weight(self, key, *weights: torch.Tensor) -> torch.Tensor:
        """torch.cat(weights), made once per unroll and shared by its steps (their gradients meet there)."""
        if key not in self.fused:
            self.fused[key] = torch.cat(weights)
        return self.fused[key]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.k[layer].append(_repeat_kv(k, q.shape[1]))
        self.v[layer].append(_repeat_kv(v, q.shape[1]))
        k0, v0 = self.k[layer][0], self.v[layer][0]
        t = q.shape[2]
        scale = 1.0 / math.sqrt(q.shape[-1])
        causal = (q @ k0.transpose(-1, -2)) * scale  # [B, h, T, T]
        mask = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
        causal = causal.masked_fill(mask, float("-inf"))
        diag = [(q * ki).sum(-1, keepdim=True) * scale for ki in self.k[layer][1:]]  # [B, h, T, 1] each
        probs = torch.softmax(torch.cat([causal, *diag], dim=-1).float(), dim=-1).to(q.dtype)
        out = probs[..., :t] @ v0
        for i, vi in enumerate(self.v[layer][1:]):
            out = out + probs[..., t + i : t + i + 1] * vi
        return out

    def attend_rows(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention over rows of the flattened B x T positions: q [N, heads, d], k and v [N, kv_heads, d]
        at the current step's `rows` (None: all) -> [N, heads * d]. Step 0's keys are stored densely
        (every later step reads them causally); a later step's only at its rows (read on its own
        diagonal)."""
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
            # every position queries: plain causal attention (the fused kernel skips the masked blocks)
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
        at = rows
        if at is None:
            layout = None
            pos = torch.arange(t, device=q.device).expand(b, t)
        else:
            seq_of = at // t
            counts = torch.bincount(seq_of, minlength=b)
            slot = torch.arange(len(at), device=q.device) - (torch.cumsum(counts, 0) - counts)[seq_of]
            n = int(counts.max()) if len(at) else 1
            layout = (seq_of, slot, n)
            pos = torch.full((b, n), t - 1, dtype=torch.long, device=q.device)
            pos[seq_of, slot] = at % t
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
        dk = torch.stack(diag_k, 2) if diag_k else None  # [M, kv_heads, steps, d]
        dv = torch.stack(diag_v, 2) if diag_v else None
        q = q.view(-1, kv_heads, heads // kv_heads, d)  # grouped-query heads: head = kv head * groups + j
        out = _TTTAttention.apply(q, k0, v0, dk, dv, future, layout)
        return out.reshape(out.shape[0], -1)


def _to_rows(x: torch.Tensor, layout, b: int, t: int) -> torch.Tensor:
    """[B, n, ...] padded (or dense [B, T, ...]) -> the rows [M, ...]."""
    return x.reshape(b * t, *x.shape[2:]) if layout is None else x[layout[0], layout[1]]


def _to_padded(x: torch.Tensor, layout, b: int, t: int) -> torch.Tensor:
    """The rows [M, ...] -> [B, n, ...] (zeros where no row is), or dense [B, T, ...]."""
    if layout is None:
        return x.view(b, t, *x.shape[1:])
    seq_of, slot, n = layout
    return x.new_zeros(b, n, *x.shape[1:]).index_put_((seq_of, slot), x)


class _TTTAttention(torch.autograd.Function):
    """TTT attention of query rows q [M, kv_heads, groups, d]: causal over step 0's keys k0, v0 [B, kv_heads,
    T, d] (`future` [B, n, T] masks what each padded row may not see) and, on the diagonal, over the
    row's own keys and values of later steps dk, dv [M, kv_heads, steps, d] (None: none), one softmax
    over both. The causal part is CPU's fused flash attention over a [B, n] layout of the rows padded
    per sequence (`layout`: seq_of, slot, n; None: every position); the diagonal joins it through the
    log-sum-exp, and the backward hands the fused kernel the joint output and log-sum-exp, which is
    all it needs for the joint softmax's gradient."""

    @staticmethod
    def forward(ctx, q, k0, v0, dk, dv, future, layout):  # noqa: ANN001, D102
        b, kv_heads, t, d = k0.shape
        groups = q.shape[2]
        heads = kv_heads * groups
        n = t if layout is None else layout[2]
        scale = 1.0 / math.sqrt(d)
        qp = _to_padded(q, layout, b, t).permute(0, 2, 3, 1, 4).reshape(b, heads, n, d)
        k, v = (k0, v0) if groups == 1 else (k0.repeat_interleave(groups, 1), v0.repeat_interleave(groups, 1))
        mask = torch.zeros(b, 1, n, t, dtype=qp.dtype, device=qp.device).masked_fill_(future[:, None], float("-inf"))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qp, k, v, 0.0, False, attn_mask=mask, scale=scale
        )
        out = _to_rows(out.view(b, kv_heads, groups, n, d).permute(0, 3, 1, 2, 4), layout, b, t)  # [M, kv, g, d]
        lse = _to_rows(lse.view(b, kv_heads, groups, n).permute(0, 3, 1, 2), layout, b, t).to(out.dtype)
        pd = None
        if dk is not None:
            sd = (q[:, :, :, None] * dk[:, :, None]).sum(-1) * scale  # [M, kv_heads, groups, steps]
            total = torch.logaddexp(lse, torch.logsumexp(sd, -1))
            pd = (sd - total[..., None]).exp_()
            out = out * (lse - total).exp_()[..., None] + (pd[..., None] * dv[:, :, None]).sum(-2)
            lse = total
        ctx.save_for_backward(q, qp, k, v, mask, dk, dv, pd, out, lse)
        ctx.layout, ctx.groups = layout, groups
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, D102
        q, qp, k, v, mask, dk, dv, pd, out, lse = ctx.saved_tensors
        layout, groups = ctx.layout, ctx.groups
        b, heads, t, d = k.shape
        kv_heads, n = heads // groups, qp.shape[2]
        scale = 1.0 / math.sqrt(d)
        grad = grad.reshape(out.shape).contiguous()  # [M, kv_heads, groups, d]

        def padded(x: torch.Tensor) -> torch.Tensor:
            x = _to_padded(x, layout, b, t)
            return x.permute(0, 2, 3, 1, *range(4, x.dim())).reshape(b, heads, n, *x.shape[4:])

        # padded rows: zero queries and gradients, so every key is seen with a finite log-sum-exp
        dqp, dk0, dv0 = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            padded(grad), qp, k, v, padded(out), padded(lse).float(), 0.0, False, attn_mask=mask, scale=scale
        )
        dq = _to_rows(dqp.view(b, kv_heads, groups, n, d).permute(0, 3, 1, 2, 4), layout, b, t)
        if groups > 1:
            dk0, dv0 = dk0.view(b, kv_heads, groups, t, d).sum(2), dv0.view(b, kv_heads, groups, t, d).sum(2)
        ddk = ddv = None
        if dk is not None:
            delta = (grad * out).sum(-1)  # [M, kv_heads, groups]
            dsd = (grad[:, :, :, None] * dv[:, :, None]).sum(-1).sub_(delta[..., None]).mul_(pd)
            dq = dq + (dsd[..., None] * dk[:, :, None]).sum(-2) * scale
            ddk = (dsd[..., None] * q[:, :, :, None]).sum(2) * scale  # [M, kv_heads, steps, d]
            ddv = (pd[..., None] * grad[:, :, :, None]).sum(2)
        return dq, dk0, dv0, ddk, ddv, None, None


def _repeat_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
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

    def forward_rows(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: TTTCache,
        qkv: torch.Tensor | None = None,
        out_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """TTT over rows: x [N, width] -> [N, H], or [len(out_rows), H] with `out_rows` (indices into the
        rows: every row is attended, for its keys and values, but o_proj runs at those only); cos and
        `signed_sin(sin)` [N, 1, d]. `qkv` [N, (heads + 2 kv_heads) * d] is a projection of the input's
        first columns computed beforehand (layer 0's embedding half); x then holds only the remaining
        columns."""
        # q, k and v as one matmul, over the input's last x.shape[1] columns (contiguous, made once per unroll)
        first = self.q_proj.weight.shape[1] - x.shape[1]
        weight = cache.fused_weight(
            (self.layer_idx, "qkv", first), *(w.weight[:, first:] for w in (self.q_proj, self.k_proj, self.v_proj))
        )
        out = F.linear(x, weight) if qkv is None else qkv + F.linear(x, weight)
        nq, nkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = out.split([nq, nkv, nkv], -1)
        q = apply_rotary_rolled(q.reshape(-1, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary_rolled(k.reshape(-1, self.num_kv_heads, self.head_dim), cos, sin)
        out = cache.attend_rows(self.layer_idx, q, k, v.reshape(-1, self.num_kv_heads, self.head_dim))
        return self.o_proj(out if out_rows is None else out.index_select(0, out_rows))


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
        self.self_attn = Attention(spec, 2 * h if self.is_first else h, layer_idx)
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

    def forward_rows(
        self, embed_qkv: torch.Tensor | None, h: torch.Tensor, cos, sin, cache: TTTCache, out_rows=None
    ) -> torch.Tensor:
        """`forward` over rows h [N, H] for `Eagle3Drafter.unroll`; layer 0 gets the q/k/v projection of
        its embedding half (`embed_qkv` [N, ...]), computed once for every step. With `out_rows`
        (indices into the rows), keys and values are computed at every row but the rest only there, and
        the result is [len(out_rows), H]."""
        if self.is_first:
            normed = rms_norm(self.hidden_norm, h)
            if self.norm_before_residual:
                h = normed
            attn = self.self_attn.forward_rows(normed, cos, sin, cache, qkv=embed_qkv, out_rows=out_rows)
        else:
            x = rms_norm(self.input_layernorm, h)
            attn = self.self_attn.forward_rows(x, cos, sin, cache, out_rows=out_rows)
        if out_rows is not None:
            h = h.index_select(0, out_rows)
        h = h + attn
        mlp = self.mlp
        # gate and up projections as one matmul
        weight = cache.fused_weight((self.self_attn.layer_idx, "gate_up"), mlp.gate_proj.weight, mlp.up_proj.weight)
        gate, up = F.linear(rms_norm(self.post_attention_layernorm, h), weight).chunk(2, -1)
        return h + mlp.down_proj(F.silu(gate) * up)


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
        self.rotary = Rotary(spec.head_dim, spec.rope_theta)
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

    def unroll(
        self, input_ids: torch.Tensor, aux: torch.Tensor, length: int, keep: list[torch.Tensor] | None = None
    ) -> list[torch.Tensor]:
        """Training-time test over a batch: `length` steps, inputs shifted by one token per step.

        input_ids [B, T] are the tokens x_1..x_T that follow each target position (already shifted by
        one, as in TorchSpec), aux [B, T, A*H_t] the target states at positions 0..T-1. Step i at
        position t embeds x_{t+i+1} (token 0 past the end), sits at RoPE position t+i and predicts
        x_{t+i+2}. Returns the h_out of every step ([B, T, H] each).

        With `keep` (one sorted index tensor into the flattened B x T positions per step, each step's
        a subset of the previous one's), step i returns h_out at keep[i] only ([len(keep[i]), H]), and
        steps after 0 compute nothing else: a position's later steps read only that position's own
        earlier steps and step 0's causal context, which is computed everywhere.
        """
        b, t = input_ids.shape
        cache = TTTCache(len(self.layers), b, t)
        hidden = self.project(aux).reshape(b * t, -1)
        # every step's tokens at once: step i at position t embeds ext[t + i]
        ext = F.pad(input_ids, (0, length - 1))
        first = self.layers[0]
        embeds = self.embed_tokens(ext).to(hidden.dtype)
        # layer 0's q/k/v of the embedding half, once for all steps: its weight's first H columns, with
        # input_layernorm's weight folded in (the normalized embeddings need no gradient then)
        norm = first.input_layernorm
        x = embeds.float()
        x = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)).to(embeds.dtype)
        attn = first.self_attn
        hidden_size = embeds.shape[-1]
        qkv_weight = torch.cat([w.weight[:, :hidden_size] for w in (attn.q_proj, attn.k_proj, attn.v_proj)])
        embed_qkv = F.linear(x, qkv_weight * norm.weight)
        embed_qkv = embed_qkv.reshape(b * (t + length - 1), -1)  # row (s, p): sequence s, position p
        cos, sin = self.rotary(torch.arange(t + length - 1, device=input_ids.device)[None])
        cos, sin = cos[0, 0], signed_sin(sin[0, 0])  # [T + length - 1, d]
        pos = torch.arange(t, device=input_ids.device).repeat(b)  # position of each row of B x T
        flat = torch.arange(b * t, device=input_ids.device)
        step_rows = [None if keep is None or step == 0 else keep[step] for step in range(length)]
        # every step's rows of embed_qkv in one gather: step i at position p reads ext[p + i]
        where = [flat if r is None else r for r in step_rows]
        where = [r + r // t * (length - 1) + step for step, r in enumerate(where)]
        step_qkvs = embed_qkv.index_select(0, torch.cat(where)).split([len(r) for r in where])
        outs: list[torch.Tensor] = []
        for step, rows in enumerate(step_rows):
            if rows is not None:
                hidden = hidden.index_select(0, torch.searchsorted(keep[step - 1], rows))
            cache.rows = rows
            cache.row_sets.append(rows)
            at = pos if rows is None else pos.index_select(0, rows)
            step_qkv = step_qkvs[step]
            c, s = cos[at + step][:, None], sin[at + step][:, None]
            h = hidden
            last = len(self.layers) - 1
            for i, layer in enumerate(self.layers):
                # step 0's keys are every later step's context; its other outputs are needed at keep[0]
                out_rows = keep[0] if keep is not None and step == 0 and i == last else None
                h = layer.forward_rows(step_qkv if layer.is_first else None, h, c, s, cache, out_rows)
            outs.append(h.view(b, t, -1) if keep is None else h)
            hidden = rms_norm(self.norm, h) if self.spec.norm_output else h  # `feedback`
        return outs
