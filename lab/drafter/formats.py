"""Drafter checkpoints: `config.json` + `model.safetensors`, in two formats vLLM reads.

native (vLLM / TorchSpec): `architectures: ["LlamaForCausalLMEagle3"]`, the EAGLE 3.1 keys (`fc_norm`,
  `norm_output`, `norm_before_fc`) at the top level and the captured layer ids under `eagle_config`.
speculators: `speculators_model_type: eagle3`, the Llama layer under `transformer_layer_config`, the
  proposal method (k) and the verifier (the target's path) under `speculators_config`.
Both carry the same weights (`fc.weight`, `fc_norm.{i}.weight`, `layers.0.*`, `norm.weight`,
`lm_head.weight`, `embed_tokens.weight`), and `d2t` only when the draft vocabulary is smaller than the
target's. What only the workbench needs to rebuild the module exactly (the norm type) lives under
`lab`, which other readers ignore. Weights are read as safetensors only (no pickle). A plain EAGLE-3
checkpoint (no 3.1 keys, `midlayer.*` weight names, no aux layer ids) loads too.

A checkpoint written here carries `lab_manifest.json` (the sha256 of each weight file; vLLM and
transformers ignore the extra file): a corrupted or truncated checkpoint is refused on load, never
silently used. One without it (TorchSpec's, a download) loads unchecked.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from lab.drafter.model import DrafterSpec, Eagle3Drafter
from lab.fsutil import atomic_file, mismatched_file, sha256_file

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
MANIFEST = "lab_manifest.json"


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


# native keys that the speculators format keeps beside the layer config, not inside it
_EAGLE3_KEYS = (
    "architectures",
    "draft_vocab_size",
    "target_hidden_size",
    "fc_norm",
    "norm_before_fc",
    "norm_output",
    "norm_before_residual",
    "eagle_config",
    "lab",
)


def speculators_config(spec: DrafterSpec, verifier: str, num_speculative_tokens: int) -> dict:
    native = native_config(spec)
    layer = {k: v for k, v in native.items() if k not in _EAGLE3_KEYS}
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        "draft_vocab_size": spec.draft_vocab_size,
        "target_hidden_size": spec.target_hidden_size,
        "norm_before_residual": False,  # speculators' default is True; this drafter's residual is raw h
        "norm_before_fc": native["norm_before_fc"],
        "fc_norm": native["fc_norm"],
        "norm_output": native["norm_output"],
        "eagle_aux_hidden_state_layer_ids": list(spec.aux_layer_ids),
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens}],
            "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]},
        },
        "torch_dtype": "float32",
        "lab": native["lab"],
    }


def vllm_incompatibility(spec: DrafterSpec) -> str | None:
    """Why vLLM cannot serve this drafter exactly, or None."""
    if spec.norm_type != "rmsnorm" and spec.fc_norm != "none":
        return (
            f"drafter.norm_type={spec.norm_type}: vLLM's EAGLE-3 drafter has RMSNorm fc norms only "
            "(export needs drafter.norm_type=rmsnorm)"
        )
    return None


def spec_from_config(cfg: dict, target_num_layers: int | None = None) -> DrafterSpec:
    """The drafter of a native or speculators `config.json`. A checkpoint without aux layer ids gets
    vLLM's default (2, L // 2, L - 3) for a target of `target_num_layers` layers."""
    if cfg.get("speculators_model_type") is not None:
        cfg = _native_from_speculators(cfg)
    lab = cfg.get("lab", {})
    fc_norm = "per_layer" if cfg.get("fc_norm") else "concat" if cfg.get("norm_before_fc") else "none"
    aux = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if aux is None and target_num_layers is not None:
        aux = [2, target_num_layers // 2, target_num_layers - 3]
    if aux is None:
        raise ValueError(f"{CONFIG}: eagle_config.eagle_aux_hidden_state_layer_ids is required")
    if cfg.get("norm_before_residual"):
        raise ValueError(f"{CONFIG}: norm_before_residual=true is not supported (the residual is the raw h)")
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


def _native_from_speculators(cfg: dict) -> dict:
    out = {**cfg.get("transformer_layer_config", {})}
    out.update({k: cfg[k] for k in _EAGLE3_KEYS if k in cfg and k != "architectures"})
    out["norm_before_residual"] = cfg.get("norm_before_residual", True)  # speculators' default
    if "eagle_aux_hidden_state_layer_ids" in cfg:
        out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": cfg["eagle_aux_hidden_state_layer_ids"]}
    return out


def _weights(drafter: Eagle3Drafter) -> dict[str, torch.Tensor]:
    state = {k: v.detach().to(torch.float32).contiguous() for k, v in drafter.state_dict().items()}
    if "d2t" in state:
        state["d2t"] = drafter.d2t.detach().to(torch.int64).contiguous()
    # vLLM builds a hidden_norm in every layer and loads strictly; only layer 0's is used
    for i in range(1, drafter.spec.num_layers):
        state[f"layers.{i}.hidden_norm.weight"] = torch.ones(drafter.spec.hidden_size)
    return state


def _write(state: dict[str, torch.Tensor], config: dict, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # each file through a rename: an interrupted export leaves an old manifest that the new weights
    # fail, never weights that pass unchecked
    with atomic_file(out / WEIGHTS) as tmp:
        save_file(state, str(tmp), metadata={"format": "pt"})
    with atomic_file(out / CONFIG) as tmp:
        tmp.write_text(json.dumps(config, indent=2) + "\n")
    with atomic_file(out / MANIFEST) as tmp:
        tmp.write_text(json.dumps({"files": {WEIGHTS: sha256_file(out / WEIGHTS)}}, indent=2) + "\n")
    return out


def verify(path: str | Path) -> None:
    """ValueError naming the file when a weight file differs from `lab_manifest.json`; nothing to check
    (and no error) without the manifest."""
    path = Path(path)
    if not (path / MANIFEST).is_file():
        return
    try:
        hashes = json.loads((path / MANIFEST).read_text())["files"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise ValueError(f"{path / MANIFEST}: unreadable (corrupted checkpoint); re-export or retrain") from None
    bad = mismatched_file(path, hashes)
    if bad is not None:
        raise ValueError(
            f"{path / bad}: content hash does not match {MANIFEST} (corrupted or truncated checkpoint); "
            "re-export or retrain"
        )


def save_native(drafter: Eagle3Drafter, out_dir: str | Path) -> Path:
    return _write(_weights(drafter), native_config(drafter.spec), out_dir)


def save_speculators(drafter: Eagle3Drafter, out_dir: str | Path, verifier: str, num_speculative_tokens: int) -> Path:
    """The speculators format; `verifier` is the target's path (vLLM loads it from there)."""
    return _write(_weights(drafter), speculators_config(drafter.spec, verifier, num_speculative_tokens), out_dir)


def load_checkpoint(
    path: str | Path, embed_weight: torch.Tensor | None = None, target_num_layers: int | None = None
) -> Eagle3Drafter:
    """Load a checkpoint in either format; `embed_weight` fills a checkpoint saved without its embedding.
    A checkpoint with `lab_manifest.json` is verified first (ValueError if a weight file differs)."""
    path = Path(path)
    for name in (CONFIG, WEIGHTS):
        if not (path / name).is_file():
            raise FileNotFoundError(f"{path / name}: missing (expected a drafter checkpoint: {CONFIG} + {WEIGHTS})")
    verify(path)
    spec = spec_from_config(json.loads((path / CONFIG).read_text()), target_num_layers)
    drafter = Eagle3Drafter(spec)
    state = {k.replace("midlayer.", "layers.0."): v for k, v in load_file(str(path / WEIGHTS)).items()}
    state = {k: v for k, v in state.items() if k != "t2d" and not _unused_hidden_norm(k)}
    if "embed_tokens.weight" not in state:
        if embed_weight is None:
            raise ValueError(f"{path / WEIGHTS}: no embed_tokens.weight; pass the target's embedding")
        state["embed_tokens.weight"] = embed_weight.detach().clone()
    drafter.load_state_dict(state, strict=True)
    return drafter.eval()


def _unused_hidden_norm(key: str) -> bool:
    return key.startswith("layers.") and key.endswith(".hidden_norm.weight") and not key.startswith("layers.0.")
