"""Load the configured target (built here, or a local Hugging Face directory) ready for inference."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from lab.config import ConfigError, TargetKind
from lab.config.shape import hf_config
from lab.device import resolve_device
from lab.fsutil import short_hash
from lab.target import build as target_build
from lab.target import gguf


@dataclass
class Target:
    model: Any  # a transformers causal LM in eval mode
    tokenizer: Any
    path: Path
    fingerprint: str  # identifies weights (as loaded: their dtype where not float32) + tokenizer for cache keys
    info: dict = field(default_factory=dict)  # build.json of a built target

    @property
    def num_layers(self) -> int:
        return self.model.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @property
    def max_positions(self) -> int:
        return self.model.config.max_position_embeddings

    @property
    def device(self) -> torch.device:
        return self.lm_head_weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head_weight.dtype

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight

    @property
    def embed_weight(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight


def _hf_fingerprint(path: Path) -> str:
    files = sorted(p for p in path.iterdir() if p.is_file())
    return short_hash([(p.name, p.stat().st_size) for p in files] + [(path / "config.json").read_text()])


# model types whose checkpoints are DeepSeek-V3's architecture under another name and ship their modelling as
# remote code (`auto_map`): loaded with transformers' own DeepSeek-V3 classes instead, never running that code.
# vLLM does the same (vllm/transformers_utils/config.py maps kimi_k2 to DeepseekV3Config).
DEEPSEEK_V3_ALIASES = ("kimi_k2",)


def _deepseek_v3_alias(path: Path):
    """The transformers DeepseekV3Config of a folder whose config.json names one of DEEPSEEK_V3_ALIASES with the
    DeepseekV3ForCausalLM architecture (its YaRN `rope_scaling` read as DeepSeek-V3's); None for any other."""
    hf = hf_config(str(path))
    if hf.get("model_type") not in DEEPSEEK_V3_ALIASES:
        return None
    if hf.get("architectures") != ["DeepseekV3ForCausalLM"]:
        raise ConfigError(
            "target.path",
            f"'{path}': model_type {hf['model_type']} with architectures {hf.get('architectures')}; expected "
            "[DeepseekV3ForCausalLM] (loaded with transformers' DeepSeek-V3 classes, without remote code)",
        )
    from transformers import DeepseekV3Config

    return DeepseekV3Config(**{k: v for k, v in hf.items() if k not in ("model_type", "auto_map")})


def load(cfg: DictConfig, progress: bool = True) -> Target:
    """The target of `cfg.target` in eval mode, on the device and in the dtype of `cfg.device` / `cfg.dtype`
    (lab/device.py; float32 on the CPU by default); builds the tiny target, or converts a GGUF one, on first
    use (both stored in float32 whatever the run's dtype, so that the cached folder is the same everywhere)."""
    device, dtype = resolve_device(cfg)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if not progress:
        hf_logging.disable_progress_bar()  # "Loading weights" bars, once per trial in a sweep's log
    t = cfg.target
    if t.kind == TargetKind.build:
        root = target_build.build(t, cfg.cache_dir, progress=progress)
        path, info = root / "model", json.loads((root / target_build.BUILD_INFO).read_text())
        fingerprint = root.name
    elif t.kind == TargetKind.gguf:
        root = gguf.convert(t, cfg.cache_dir, progress=progress)
        path, info = root / "model", json.loads((root / gguf.BUILD_INFO).read_text())
        fingerprint = root.name
    else:
        path = Path(t.path)
        if not (path / "config.json").is_file():
            raise ConfigError("target.path", f"'{path}' is not a Hugging Face model directory (no config.json)")
        info, fingerprint = {}, f"hf-{_hf_fingerprint(path)}"
    try:
        # safetensors only: a pytorch_model.bin is a pickle, which can run code when loaded
        alias = _deepseek_v3_alias(path)
        if alias is not None:
            from transformers import DeepseekV3ForCausalLM

            model = DeepseekV3ForCausalLM.from_pretrained(path, config=alias, dtype=dtype, use_safetensors=True)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True)
        # an alias's tokenizer is read with its DeepSeek-V3 config, so that its config.json's auto_map is not followed
        tokenizer = AutoTokenizer.from_pretrained(path, **({"config": alias} if alias is not None else {}))
    except (OSError, ValueError) as exc:
        raise ConfigError("target.path", f"cannot load a causal LM from '{path}': {str(exc).splitlines()[0]}") from None
    model.to(device).eval().requires_grad_(False)
    if dtype != torch.float32:
        # narrower weights compute other hidden states and answers: every cache keyed by the target (hidden
        # states, regenerations, resume states) keeps them apart; float32 adds nothing, so that a float32
        # target's keys are those of a config that never names a dtype
        fingerprint = f"{fingerprint}-{str(dtype).removeprefix('torch.')}"
    return Target(model=model, tokenizer=tokenizer, path=path, fingerprint=fingerprint, info=info)
