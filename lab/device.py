"""Where a run computes and in what precision: the config's `device` and `dtype`, resolved in one place.

The target is loaded on the resolved device in the resolved dtype (lab/target/load.py); every later stage
follows the target rather than the config (the hidden-state capture, regeneration, training, the reference
decoder), so that a caller handing a stage a target, such as the tests' float32 targets, gets exactly
what that target computes. The drafter keeps float32 weights (and AdamW state) everywhere; where the target
computes in a narrower dtype the drafter's forward runs under autocast in it (`autocast`).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _value(cfg: Any, key: str) -> str:
    value = cfg.get(key) if hasattr(cfg, "get") else getattr(cfg, key, None)
    value = getattr(value, "value", value)  # a config enum (lab.config.Device / DType) as well as a string
    return "auto" if value is None else str(value)  # a config logged before the keys existed: the defaults


def resolve_device(cfg: Any) -> tuple[torch.device, torch.dtype]:
    """(device, dtype) of a config's `device` and `dtype`: device `auto` is cuda where torch sees a GPU, else
    cpu; dtype `auto` is bfloat16 on cuda (half the memory, the tensor cores' precision; float16 on a GPU older
    than Ampere, which has no bfloat16 arithmetic) and float32 on cpu
    (a CPU without bf16 instructions only emulates bfloat16, and float32 keeps the numbers every run recorded
    so far). Explicit values are taken as they are; whether CUDA is there is `cuda_problem`'s to say."""
    device, dtype = _value(cfg, "device"), _value(cfg, "dtype")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        dtype = "float32" if device != "cuda" else "bfloat16" if _bf16_problem() is None else "float16"
    return torch.device(device), DTYPES[dtype]


def thread_count(cfg: Any) -> int:
    """`threads`, at most the machine's cores (None: all of them)."""
    cores = os.cpu_count() or 1
    return min(cfg.threads, cores) if cfg.threads else cores


def _bf16_problem() -> str | None:
    """Why the GPU cannot compute in bfloat16 (before Ampere it only emulates it, slowly), or None where it can
    or where torch cannot say (no GPU: `cuda_problem` speaks then)."""
    try:
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return None
        major, minor = torch.cuda.get_device_capability()
        name = torch.cuda.get_device_name()
    except (AssertionError, RuntimeError):  # a build without CUDA, or no GPU
        return None
    return f"{name} (compute capability {major}.{minor}) has no bfloat16 arithmetic"


def dtype_problem(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why `device` cannot compute in `dtype`, or None where it can (a CPU computes all three DTYPES)."""
    if device.type == "cuda" and dtype == torch.bfloat16:
        return _bf16_problem()
    return None


def cuda_problem() -> str | None:
    """Why this process cannot compute on CUDA, or None where it can."""
    if torch.cuda.is_available():
        return None
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a build without CUDA"
    return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU"


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """The drafter's forward in `dtype` on `device` (autocast: its float32 weights are cast per op); off for
    float32, so that a float32 run computes exactly as it did before `dtype` existed."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)
