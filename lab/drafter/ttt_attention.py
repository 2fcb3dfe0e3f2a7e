"""The TTT unroll's attention over query rows, with one fused kernel per device (lab/drafter/unroll.py calls it).

A row of a later drafting step attends causally to step 0's keys (every position's context) and, on its own
diagonal, to its own keys of the later steps, under one softmax. The causal part runs in a fused attention
kernel that also returns the log-sum-exp; the diagonal joins it through that log-sum-exp, and the backward
hands the kernel the joint output and log-sum-exp, which is all a flash-style backward needs for the joint
softmax's gradient.

Which kernel computes it is chosen in one place, `kernel_for`, from the tensors' device:
- CPU: ATen's fused flash attention for CPU (`_scaled_dot_product_flash_attention_for_cpu`);
- CUDA: `SDPA_JOINT`, the whole attention as one public `F.scaled_dot_product_attention` call under autograd's
  own backward (`joint_sdpa`): the private memory-efficient op, handed a hand-joined log-sum-exp, gives
  non-finite bfloat16 gradients in training on an H200;
- anything else: `PORTABLE`, the same contract in plain tensor math (a [B, heads, n, T] score matrix).
All compute the same function, forward and gradients, so that what a run learns does not depend on the device
it ran on beyond float rounding.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
import torch.nn.functional as F


class Kernel(Protocol):
    """Causal attention with a log-sum-exp: q [B, H, n, d], k, v [B, H, T, d], `future` [B, n, T] (True where
    a query may not look) -> out [B, H, n, d] in q's dtype, lse [B, H, n] float32, and whatever the backward
    needs besides (`saved`). The backward takes the gradient of out and the (possibly changed) out and lse."""

    name: str

    def forward(self, q, k, v, future, scale: float) -> tuple[torch.Tensor, torch.Tensor, Any]: ...  # noqa: ANN001

    def backward(self, grad, q, k, v, out, lse, saved, scale: float): ...  # noqa: ANN001, ANN201


def _additive_mask(future: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, n, T] with -inf where a query may not look."""
    mask = torch.zeros(*future.shape[:1], 1, *future.shape[1:], dtype=dtype, device=future.device)
    return mask.masked_fill_(future[:, None], float("-inf"))


class _CpuFlash:
    name = "cpu-flash"

    def forward(self, q, k, v, future, scale):  # noqa: ANN001, D102
        mask = _additive_mask(future, q.dtype)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=mask, scale=scale
        )
        return out, lse.float(), mask

    def backward(self, grad, q, k, v, out, lse, saved, scale):  # noqa: ANN001, D102
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, 0.0, False, attn_mask=saved, scale=scale
        )


class _Portable:
    """The kernels' contract in plain tensor math, for any device (and the reference the tests hold the
    fused kernels to)."""

    name = "portable"

    def forward(self, q, k, v, future, scale):  # noqa: ANN001, D102
        scores = (q.float() @ k.float().transpose(-1, -2)) * scale
        scores = scores.masked_fill(future[:, None], float("-inf"))
        lse = torch.logsumexp(scores, -1)
        out = (scores - lse[..., None]).exp() @ v.float()
        return out.to(q.dtype), lse, future

    def backward(self, grad, q, k, v, out, lse, saved, scale):  # noqa: ANN001, D102
        qf, kf, vf, g = q.float(), k.float(), v.float(), grad.float()
        scores = ((qf @ kf.transpose(-1, -2)) * scale).masked_fill(saved[:, None], float("-inf"))
        probs = (scores - lse[..., None]).exp()  # [B, H, n, T]
        delta = (g * out.float()).sum(-1, keepdim=True)
        ds = probs * (g @ vf.transpose(-1, -2) - delta)
        dq = (ds @ kf) * scale
        dk = (ds.transpose(-1, -2) @ qf) * scale
        dv = probs.transpose(-1, -2) @ g
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _SdpaJoint:
    """Not a `Kernel`: the whole TTT attention as one public `F.scaled_dot_product_attention` call, with
    autograd's own backward. Each row's diagonal keys are appended after step 0's keys and a boolean mask lets
    a row see its causal prefix and its own diagonal, so no log-sum-exp crosses a kernel boundary. On CUDA,
    where the private memory-efficient op's bfloat16 backward, handed the joint output, gives non-finite
    gradients in training (the gpu tier, H200), while SDPA's own autograd hands that kernel its own output."""

    name = "sdpa-joint"


CPU_FLASH, PORTABLE, SDPA_JOINT = _CpuFlash(), _Portable(), _SdpaJoint()


def kernel_for(device: torch.device) -> Kernel | _SdpaJoint:
    """The one place the kernel is chosen: from the tensors' device."""
    if device.type == "cpu":
        return CPU_FLASH
    if device.type == "cuda":
        return SDPA_JOINT
    return PORTABLE


def to_rows(x: torch.Tensor, layout, b: int, t: int) -> torch.Tensor:  # noqa: ANN001
    """[B, n, ...] padded (or dense [B, T, ...]) -> the rows [M, ...]."""
    return x.reshape(b * t, *x.shape[2:]) if layout is None else x[layout[0], layout[1]]


def to_padded(x: torch.Tensor, layout, b: int, t: int) -> torch.Tensor:  # noqa: ANN001
    """The rows [M, ...] -> [B, n, ...] (zeros where no row is), or dense [B, T, ...]."""
    if layout is None:
        return x.view(b, t, *x.shape[1:])
    seq_of, slot, n = layout
    return x.new_zeros(b, n, *x.shape[1:]).index_put_((seq_of, slot), x)


class TTTAttention(torch.autograd.Function):
    """TTT attention of query rows q [M, kv_heads, groups, d]: causal over step 0's keys k0, v0 [B, kv_heads,
    T, d] (`future` [B, n, T] masks what each padded row may not see) and, on the diagonal, over the row's own
    keys and values of later steps dk, dv [M, kv_heads, steps, d] (None: none), one softmax over both. The
    causal part runs in `kernel` over a [B, n] layout of the rows padded per sequence (`layout`: seq_of, slot,
    n; None: every position). Padded rows have zero queries and gradients, so every key is seen with a finite
    log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k0, v0, dk, dv, future, layout, kernel):  # noqa: ANN001, D102
        b, kv_heads, t, d = k0.shape
        groups = q.shape[2]
        heads = kv_heads * groups
        n = t if layout is None else layout[2]
        scale = 1.0 / math.sqrt(d)
        qp = to_padded(q, layout, b, t).permute(0, 2, 3, 1, 4).reshape(b, heads, n, d)
        k, v = (k0, v0) if groups == 1 else (k0.repeat_interleave(groups, 1), v0.repeat_interleave(groups, 1))
        out, lse, saved = kernel.forward(qp, k, v, future, scale)
        out = to_rows(out.reshape(b, kv_heads, groups, n, d).permute(0, 3, 1, 2, 4), layout, b, t)  # [M, kv, g, d]
        # the log-sum-exp stays float32 (in bfloat16 its rounding would skew every probability of the backward)
        lse = to_rows(lse.view(b, kv_heads, groups, n).permute(0, 3, 1, 2), layout, b, t)
        pd = None
        if dk is not None:
            sd = (q[:, :, :, None] * dk[:, :, None]).sum(-1) * scale  # [M, kv_heads, groups, steps]
            total = torch.logaddexp(lse, torch.logsumexp(sd.float(), -1))
            pd = (sd.float() - total[..., None]).exp_().to(q.dtype)
            out = out * (lse - total).exp_().to(out.dtype)[..., None] + (pd[..., None] * dv[:, :, None]).sum(-2)
            lse = total
        ctx.save_for_backward(q, qp, k, v, dk, dv, pd, out, lse)
        ctx.layout, ctx.groups, ctx.kernel, ctx.saved = layout, groups, kernel, saved
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, D102
        q, qp, k, v, dk, dv, pd, out, lse = ctx.saved_tensors
        layout, groups = ctx.layout, ctx.groups
        b, heads, t, d = k.shape
        kv_heads, n = heads // groups, qp.shape[2]
        scale = 1.0 / math.sqrt(d)
        grad = grad.reshape(out.shape).contiguous()  # [M, kv_heads, groups, d]

        def padded(x: torch.Tensor) -> torch.Tensor:
            x = to_padded(x, layout, b, t)
            return x.permute(0, 2, 3, 1, *range(4, x.dim())).reshape(b, heads, n, *x.shape[4:])

        dqp, dk0, dv0 = ctx.kernel.backward(padded(grad), qp, k, v, padded(out), padded(lse), ctx.saved, scale)
        dq = to_rows(dqp.reshape(b, kv_heads, groups, n, d).permute(0, 3, 1, 2, 4), layout, b, t)
        if groups > 1:
            dk0, dv0 = dk0.view(b, kv_heads, groups, t, d).sum(2), dv0.view(b, kv_heads, groups, t, d).sum(2)
        ddk = ddv = None
        if dk is not None:
            delta = (grad * out).sum(-1)  # [M, kv_heads, groups]
            dsd = (grad[:, :, :, None] * dv[:, :, None]).sum(-1).sub_(delta[..., None]).mul_(pd)
            dq = dq + (dsd[..., None] * dk[:, :, None]).sum(-2) * scale
            ddk = (dsd[..., None] * q[:, :, :, None]).sum(2) * scale  # [M, kv_heads, steps, d]
            ddv = (pd[..., None] * grad[:, :, :, None]).sum(2)
        return dq, dk0, dv0, ddk, ddv, None, None, None


def joint_sdpa(q, k0, v0, dk, dv, future, layout) -> torch.Tensor:  # noqa: ANN001
    """`TTTAttention`'s function (same arguments, same output [M, kv_heads, groups, d]) as one SDPA call over
    step 0's keys [T] and every padded row's diagonal keys [n * steps], masked to the causal prefix and the
    row's own diagonal: [B, n, T + n * steps] booleans, the extra keys' cost paid for autograd's backward."""
    b, kv_heads, t, d = k0.shape
    groups = q.shape[2]
    n = t if layout is None else layout[2]
    qp = to_padded(q, layout, b, t).permute(0, 2, 3, 1, 4).reshape(b, kv_heads * groups, n, d)
    keys, values, allowed = k0, v0, ~future
    if dk is not None:
        steps = dk.shape[2]

        def appended(x: torch.Tensor) -> torch.Tensor:  # [M, kv, steps, d] -> [B, kv, n * steps, d]
            return to_padded(x, layout, b, t).permute(0, 2, 1, 3, 4).reshape(b, kv_heads, n * steps, d)

        keys, values = torch.cat([k0, appended(dk)], 2), torch.cat([v0, appended(dv)], 2)
        own = torch.eye(n, dtype=torch.bool, device=q.device).repeat_interleave(steps, 1)  # [n, n * steps]
        allowed = torch.cat([allowed, own.expand(b, n, n * steps)], -1)
    out = F.scaled_dot_product_attention(
        qp, keys.to(qp.dtype), values.to(qp.dtype), attn_mask=allowed[:, None], scale=1.0 / math.sqrt(d),
        enable_gqa=groups > 1,
    )  # fmt: skip
    return to_rows(out.reshape(b, kv_heads, groups, n, d).permute(0, 3, 1, 2, 4), layout, b, t)


def ttt_attention(q, k0, v0, dk, dv, future, layout, kernel=None) -> torch.Tensor:  # noqa: ANN001
    """The TTT attention with the kernel of the tensors' device (`kernel_for`) unless one is given."""
    kernel = kernel or kernel_for(q.device)
    if kernel is SDPA_JOINT:
        return joint_sdpa(q, k0, v0, dk, dv, future, layout)
    return TTTAttention.apply(q, k0, v0, dk, dv, future, layout, kernel)
