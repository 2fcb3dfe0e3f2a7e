"""Running the workbench's CUDA branch on a CPU, to find what a CUDA run would trip on without a GPU.

`cuda_branch()` runs a block with
- every device choice forced to its CUDA side (the TTT attention's kernel, `lab.drafter.ttt_attention.kernel_for`:
  one public SDPA call over the joint keys, `joint_sdpa`);
- every aten op checked against ATen's own registry (torchgen's native_functions.yaml, shipped with torch): an op
  without a CUDA kernel (a CPU-only op such as `_scaled_dot_product_flash_attention_for_cpu`, which made training
  fail on CUDA) is recorded as a violation;
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


class _CudaOnly(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.violations: set[str] = set()
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        name = _op_name(func)
        self.seen.add(name)
        if func._schema.name.startswith("aten::"):
            has = cuda_kernels().get(name)
            if not has:
                self.violations.add(name if has is False else f"{name} (not in native_functions.yaml)")
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
    has no CUDA kernel."""
    from lab.drafter import ttt_attention

    on_cuda = ttt_attention.kernel_for(torch.device("cuda"))  # whatever a CUDA run would choose
    monkeypatch.setattr(ttt_attention, "kernel_for", lambda device: on_cuda)
    mode = _CudaOnly()
    with _SdpaAsMath(), mode:
        yield mode
