"""Drafter checkpoints in the vLLM / TorchSpec native format: `config.json` + `model.safetensors`.

The config carries the EAGLE 3.1 keys (`fc_norm`, `norm_output`, `norm_before_fc`) and the captured
layer ids under `eagle_config`; `d2t` is written only when the draft vocabulary is smaller than the
target's. What only the workbench needs to rebuild the module exactly (the norm type) lives under
`lab`, which other readers ignore. Weights are read as safetensors only (no pickle).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from lab.drafter.model import DrafterSpec, Eagle3Drafter

CONFIG = "config.json"
WEIGHTS = "model.safetensors"


def native_config(spec: DrafterSpec) -> dict:
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "num_hidden_layers": spec.num_layers,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rope_theta": spec.rope_theta,
        "rms_norm_eps": spec.rms_norm_eps,
        "tie_word_embeddings": False,
        "vocab_size": spec.vocab_size,
        "draft_vocab_size": spec.draft_vocab_size,
        "target_hidden_size": spec.target_hidden_size,
        "fc_norm": spec.fc_norm == "per_layer",
        "norm_before_fc": spec.fc_norm == "concat",
        "norm_output": spec.norm_output,
        "norm_before_residual": False,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(spec.aux_layer_ids),
            "use_aux_hidden_state": True,
        },
        "torch_dtype": "float32",
        "lab": {"norm_type": spec.norm_type, **spec.extra},
    }


def spec_from_config(cfg: dict) -> DrafterSpec:
    lab = cfg.get("lab", {})
    fc_norm = "per_layer" if cfg.get("fc_norm") else "concat" if cfg.get("norm_before_fc") else "none"
    aux = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if aux is None:
        raise ValueError(f"{CONFIG}: eagle_config.eagle_aux_hidden_state_layer_ids is required")
    heads = cfg["num_attention_heads"]
    return DrafterSpec(
        hidden_size=cfg["hidden_size"],
        target_hidden_size=cfg.get("target_hidden_size") or cfg["hidden_size"],
        aux_layer_ids=aux,
        vocab_size=cfg["vocab_size"],
        num_heads=heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        intermediate_size=cfg["intermediate_size"],
        num_kv_heads=cfg.get("num_key_value_heads", heads),
        draft_vocab_size=cfg.get("draft_vocab_size"),
        num_layers=cfg.get("num_hidden_layers", 1),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        rope_theta=cfg.get("rope_theta", 10000.0),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        fc_norm=fc_norm,
        norm_output=bool(cfg.get("norm_output", False)),
        norm_type=lab.get("norm_type", "rmsnorm"),
        extra={k: v for k, v in lab.items() if k != "norm_type"},
    )


def save_native(drafter: Eagle3Drafter, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.float32).contiguous() for k, v in drafter.state_dict().items()}
    if "d2t" in state:
        state["d2t"] = drafter.d2t.detach().to(torch.int64).contiguous()
    save_file(state, str(out / WEIGHTS), metadata={"format": "pt"})
    (out / CONFIG).write_text(json.dumps(native_config(drafter.spec), indent=2) + "\n")
    return out


def load_native(path: str | Path, embed_weight: torch.Tensor | None = None) -> Eagle3Drafter:
    """Load a native checkpoint; `embed_weight` fills a checkpoint saved without its embedding."""
    path = Path(path)
    for name in (CONFIG, WEIGHTS):
        if not (path / name).is_file():
            raise FileNotFoundError(f"{path / name}: missing (expected a drafter checkpoint: {CONFIG} + {WEIGHTS})")
    spec = spec_from_config(json.loads((path / CONFIG).read_text()))
    drafter = Eagle3Drafter(spec)
    state = load_file(str(path / WEIGHTS))
    if "embed_tokens.weight" not in state:
        if embed_weight is None:
            raise ValueError(f"{path / WEIGHTS}: no embed_tokens.weight; pass the target's embedding")
        state["embed_tokens.weight"] = embed_weight.detach().clone()
    drafter.load_state_dict(state, strict=True)
    return drafter.eval()
