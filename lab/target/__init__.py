"""The target model: build the tiny one, load any local Hugging Face causal LM, capture aux states."""

from lab.target.capture import capture, target_logits
from lab.target.load import Target, load

__all__ = ["Target", "capture", "load", "target_logits"]
