"""Running the workbench's CUDA branch on a CPU, to find what a CUDA run would trip on without a GPU.

`cuda_branch()` runs a block with
- every device choice forced to its CUDA side (the TTT attention's kernel, `lab.drafter.ttt_attention.kernel_for`:
  one public SDPA call over the joint keys, `joint_sdpa`);
- every aten op checked against ATen's own registry (torchgen's native_functions.yaml, shipped with torch): an op
  without a CUDA kernel (a CPU-only op such as `_scaled_dot_product_flash_attention_for_cpu`, which made training
  fail on CUDA) is recorded as a violation;
- the CUDA-only ops the CUDA side calls (the memory-efficient attention and its backward) emulated in plain math
  on the CPU, with the output shapes of their meta kernels and the memory-alignment contract of the CUDA kernel
  asserted, so the branch runs to the end;
- `F.scaled_dot_product_attention` computed by its math backend: SDPA picks its kernel from the device itself,
  and on a CPU it would pick the CPU-only flash kernel that a CUDA run never reaches.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Iterator

import torch
import torch.nn.functional as F
import torchgen
import yaml
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

DEVICE_NEUTRAL = {
    "CompositeExplicitAutograd",
    "CompositeExplicitAutogradNonFunctional",
    "CompositeImplicitAutograd",
    "CompositeImplicitAutogradNestedTensor",
}


@functools.cache
def cuda_kernels() -> dict[str, bool]:
    """aten op name (`add.Tensor`, `mm`) -> whether a CUDA build has a kernel for it, from native_functions.yaml."""
    path = os.path.join(os.path.dirname(torchgen.__file__), "packaged/ATen/native/native_functions.yaml")
    with open(path) as f:
        entries = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    keys: dict[str, set[str]] = {}
    delegate: dict[str, str] = {}
    for e in entries:
        name = e["func"].split("(", 1)[0]
        found = set()
        for key in (e.get("dispatch") or {}).keys():
            found |= {k.strip() for k in key.split(",")}
        if "ufunc_inner_loop" in e:  # kernels generated for CPU and CUDA alike
            found |= {"CPU", "CUDA"}
        if not e.get("dispatch") and "structured_delegate" not in e:
            found.add("CompositeImplicitAutograd")  # no dispatch section: decomposes into other ops
        keys[name] = found
        if "structured_delegate" in e:
            delegate[name] = e["structured_delegate"]
        for auto in e.get("autogen", "").split(","):  # generated variants are device-neutral
            if auto.strip():
                keys[auto.strip()] = {"CompositeExplicitAutograd"}
    for name, target in delegate.items():
        keys[name] |= keys.get(target, set())
    return {name: "CUDA" in found or bool(found & DEVICE_NEUTRAL) for name, found in keys.items()}


def _op_name(func: torch._ops.OpOverload) -> str:
    base = func._schema.name.split("::", 1)[1]
    return base if func._overloadname == "default" else f"{base}.{func._overloadname}"


def _emulated_efficient(q, k, v, bias, compute_lse, dropout=0.0, causal=False, *, scale=None):  # noqa: ANN001
    """`_scaled_dot_product_efficient_attention` in math, shaped as its meta kernel says."""
    assert compute_lse and dropout == 0.0 and not causal
    _check_bias(q, bias)
    meta = torch.ops.aten._scaled_dot_product_efficient_attention(
        *(x.to("meta") for x in (q, k, v, bias)), True, 0.0, False, scale=scale
    )
    s = (q.float() @ k.float().transpose(-1, -2)) * scale + bias.float()
    lse = torch.logsumexp(s, -1)
    out = ((s - lse[..., None]).exp() @ v.float()).to(q.dtype)
    padded = torch.full(meta[1].shape, float("nan"))  # rows past n are padding: never to be read
    padded[..., : lse.shape[-1]] = lse
    seed, offset = (torch.zeros(m.shape, dtype=m.dtype) for m in meta[2:])
    return out, padded, seed, offset


def _emulated_efficient_backward(
    grad, q, k, v, bias, out, lse, seed, offset, dropout, mask, causal=False, *, scale=None
):  # noqa: ANN001
    assert dropout == 0.0 and not causal and list(mask) == [True, True, True, False]
    _check_bias(q, bias)
    width = -(-q.shape[2] // 32) * 32
    assert lse.shape[-1] == width, f"the backward takes the forward's padded log-sum-exp ({width}), got {lse.shape}"
    s = (q.float() @ k.float().transpose(-1, -2)) * scale + bias.float()
    p = (s - lse[..., : q.shape[2], None]).exp()
    g = grad.float()
    ds = p * (g @ v.float().transpose(-1, -2) - (g * out.float()).sum(-1, keepdim=True))
    return (
        ((ds @ k.float()) * scale).to(q.dtype),
        ((ds.transpose(-1, -2) @ q.float()) * scale).to(k.dtype),
        (p.transpose(-1, -2) @ g).to(v.dtype),
        None,
    )


def _check_bias(q: torch.Tensor, bias: torch.Tensor) -> None:
    """What the CUDA kernel demands of its bias: q's dtype, 4 dimensions, rows aligned to 16 elements."""
    assert bias.dtype == q.dtype and bias.dim() == 4, (bias.dtype, q.dtype, bias.shape)
    assert all(st % 16 == 0 for st in bias.stride()[:-1]) and bias.stride(-1) == 1, bias.stride()


EMULATED = {
    "_scaled_dot_product_efficient_attention": _emulated_efficient,
    "_scaled_dot_product_efficient_attention_backward": _emulated_efficient_backward,
}


class _CudaOnly(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.violations: set[str] = set()
        self.emulated: dict[str, int] = {}
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        name = _op_name(func)
        self.seen.add(name)
        if func._schema.name.startswith("aten::"):
            has = cuda_kernels().get(name)
            if not has:
                self.violations.add(name if has is False else f"{name} (not in native_functions.yaml)")
        if name in EMULATED:
            self.emulated[name] = self.emulated.get(name, 0) + 1
            return EMULATED[name](*args, **kwargs)
        return func(*args, **kwargs)


class _SdpaAsMath(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return _sdpa_math(*args, **kwargs)
        return func(*args, **kwargs)


def _sdpa_math(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):  # noqa: ANN001
    """SDPA's math backend (one of the backends it picks on CUDA), in plain ops."""
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        groups = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(groups, -3), v.repeat_interleave(groups, -3)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    if is_causal:
        t, u = q.shape[-2], k.shape[-2]
        s = s.masked_fill(torch.ones(t, u, dtype=torch.bool, device=q.device).triu(u - t + 1), float("-inf"))
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask
    return torch.softmax(s.float(), -1).to(q.dtype) @ v


@contextlib.contextmanager
def cuda_branch(monkeypatch) -> Iterator[_CudaOnly]:  # noqa: ANN001
    """The block runs the CUDA branch on the CPU; the yielded mode's `violations` name every op it reached that
    has no CUDA kernel, `emulated` counts the CUDA-only ops emulated."""
    from lab.drafter import ttt_attention

    on_cuda = ttt_attention.kernel_for(torch.device("cuda"))  # whatever a CUDA run would choose
    monkeypatch.setattr(ttt_attention, "kernel_for", lambda device: on_cuda)
    mode = _CudaOnly()
    with _SdpaAsMath(), mode:
        yield mode
