"""The target model: build the tiny one, load any local Hugging Face causal LM, capture aux states."""

from lab.target.capture import Captured, capture, chunked_argmax, target_logits
from lab.target.load import Target, load

__all__ = ["Captured", "Target", "capture", "chunked_argmax", "load", "target_logits"]
