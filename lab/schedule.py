"""Learning-rate schedule shared by the target build and the drafter trainer."""

from __future__ import annotations

import math


def warmup_cosine(step: int, total: int, warmup: int, peak: float, min_ratio: float = 0.1) -> float:
    """Linear warm-up to `peak` over `warmup` steps, then cosine decay to `min_ratio * peak` at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
