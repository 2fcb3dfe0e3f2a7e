"""`lab torchspec-config`: one arm of the workbench as a TorchSpec training run on a GPU cluster.

Writes `train.yaml` (read by `python -m torchspec.train_entry --config train.yaml`) and `draft_model.json`
(TorchSpec's `model.draft_model_config`, a native `LlamaForCausalLMEagle3` config, or with drafter.attention=mla
an `Eagle3DeepseekV2ForCausalLM` one) for the same drafter toggles, TTT length, loss weights, learning rate and
schedule as the workbench's trainer, shaped after the target as `lab.drafter.init_drafter` shapes it, without
loading or training the target.

Numbering: our `drafter.aux_layers` are vLLM ids (id i = the residual stream after i decoder layers);
TorchSpec's `inference.aux_hidden_states_layers` hook the output of decoder layer N (0-based), so its id is
ours - 1. The draft JSON keeps the vLLM ids under `eagle_config` (vLLM reads them there when it serves the
converted checkpoint; TorchSpec reads only their count).
"""

from __future__ import annotations

import json
import math
import os
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

from lab.config import ConfigError, TargetKind, redact
from lab.config.identity import config_hash
from lab.config.shape import aux_layers
from lab.config.validation import check_torchspec_drafter
from lab.drafter import drafter_spec
from lab.drafter.model import DrafterSpec

TRAIN_YAML = "train.yaml"
DRAFT_JSON = "draft_model.json"
LAUNCH = "python -m torchspec.train_entry --config {}"

# A value the user must supply. OmegaConf's `???` would not do: TorchSpec merges the file onto its schema,
# whose default ("") then silently wins over a missing value. An interpolation of a key that does not
# exist fails in TorchSpec's load_config, naming the key, before anything starts.
PLACEHOLDER = "${{FILL_IN_{}}}"

# Our chat templates (lab/target/chat.py) that TorchSpec's registry has under another name (same markers).
CHAT_TEMPLATES = {"chatml": "qwen", "llama3": "llama3", "phi3": "phi3"}

ATTENTION_BACKEND = "flex_attention"  # TorchSpec's choice for GPUs (sdpa | flex_attention | fa | fa4 | usp)

# TorchSpec's Mooncake store (hidden states from the inference engine to the trainer), as in its HF example
MOONCAKE = {
    "master_server_address": None,
    "metadata_server": None,
    "protocol": "tcp",
    "global_segment_size": "16GB",
    "local_buffer_size": "4GB",
}


@dataclass
class Export:
    """What `write` wrote, and what the user still has to do before launching."""

    train_yaml: Path
    draft_json: Path
    spec: DrafterSpec
    torchspec_aux: list[int]
    todo: list[str] = field(default_factory=list)  # things to fill in or run first, one line each

    @property
    def launch(self) -> str:
        return LAUNCH.format(self.train_yaml)


def check_supported(cfg: DictConfig) -> None:
    """ConfigError naming the key of an arm TorchSpec's EAGLE-3 drafter cannot express."""
    if OmegaConf.select(cfg, "drafter.checkpoint"):
        raise ConfigError(
            "drafter.checkpoint", "names a drafter trained elsewhere: nothing to train; drop it to export the arm"
        )
    check_torchspec_drafter(cfg)
    if cfg.train.warmup_steps >= cfg.train.steps:
        raise ConfigError(
            "train.warmup_steps",
            f"TorchSpec needs fewer warm-up steps than train.steps={cfg.train.steps}, got {cfg.train.warmup_steps}",
        )
    torchspec_aux_layers(aux_layers(cfg))


def torchspec_aux_layers(vllm_ids: list[int]) -> list[int]:
    """TorchSpec's `aux_hidden_states_layers` for our (vLLM-numbered) `drafter.aux_layers`."""
    if 0 in vllm_ids:
        raise ConfigError(
            "drafter.aux_layers",
            f"vLLM id 0 (the embedding output) has no TorchSpec id (TorchSpec captures decoder layer outputs: "
            f"its id = vLLM id - 1); got {list(vllm_ids)}",
        )
    return [i - 1 for i in vllm_ids]


def built_target(cfg: DictConfig) -> Path | None:
    """The built target's Hugging Face folder if `lab target build` has made it (kind=build), else None."""
    from lab.target import build

    root = build.target_dir(cfg.target, cfg.cache_dir)
    return root / "model" if (root / build.BUILD_INFO).is_file() else None


class _VocabOnly:
    """Stands in for the tokenizer of a target not built yet: `build.llama_config` needs only its size
    and the special tokens' ids (the BPE trainer gives them the first ids)."""

    def __init__(self, size: int):
        self.size = size

    def __len__(self) -> int:
        return self.size

    def convert_tokens_to_ids(self, token: str) -> int:
        from lab.target.build import SPECIAL_TOKENS

        return SPECIAL_TOKENS.index(token)


def target_model_config(cfg: DictConfig) -> tuple[Any, str | None]:
    """The target's transformers config (from its config.json where one exists, else from the build
    config) and the target folder TorchSpec should load (None: not built yet)."""
    from transformers import AutoConfig

    if cfg.target.kind == TargetKind.hf:
        return AutoConfig.from_pretrained(cfg.target.path), os.path.abspath(cfg.target.path)
    if cfg.target.kind == TargetKind.gguf:
        from lab.target.gguf import convert

        path = convert(cfg.target, cfg.cache_dir) / "model"
        return AutoConfig.from_pretrained(path), os.path.abspath(path)
    path = built_target(cfg)
    if path is not None:
        return AutoConfig.from_pretrained(path), os.path.abspath(path)
    from lab.target.build import llama_config

    return llama_config(cfg.target, _VocabOnly(cfg.target.vocab_size)), None


def draft_model_json(spec: DrafterSpec) -> dict:
    """TorchSpec's draft config: our native config without the workbench's private `lab` key; bf16 as
    TorchSpec trains it (its trainer builds the drafter in bfloat16 whatever the file says)."""
    from lab.drafter.formats import native_config

    config = {k: v for k, v in native_config(spec).items() if k != "lab"}
    config["torch_dtype"] = "bfloat16"
    return config


def warmup_ratio(warmup_steps: int, steps: int) -> float:
    """The ratio TorchSpec turns back into `int(ratio * steps)` warm-up steps: exactly ours, float
    rounding included (20 / 240 * 240 must not come back as 19)."""
    ratio = warmup_steps / steps
    while int(ratio * steps) < warmup_steps:
        ratio = math.nextafter(ratio, 1.0)
    return ratio


class _Dumper(yaml.SafeDumper):
    """Sections as blocks, lists on one line (as TorchSpec's own example configs read)."""


_Dumper.add_representer(list, lambda d, v: d.represent_sequence("tag:yaml.org,2002:seq", v, flow_style=True))


def _number(x: float) -> float:
    return float(f"{x:.10g}")  # 0.64, not 0.6400000000000001, in a file people read


def train_config(
    cfg: DictConfig, spec: DrafterSpec, draft_json: str, target_path: str | None, data: str | None
) -> dict:
    """TorchSpec's training config (`torchspec.config.train_config.Config`) for the arm of `cfg`."""
    t = cfg.train
    out = Path(draft_json).parent
    return {
        "model": {
            "target_model_path": target_path or PLACEHOLDER.format("target_model_path"),
            "draft_model_config": draft_json,
            "trust_remote_code": False,  # the workbench loads targets without remote code too
        },
        "dataset": {
            "train_data_path": data or PLACEHOLDER.format("train_data_path"),
            "chat_template": CHAT_TEMPLATES.get(cfg.data.template, PLACEHOLDER.format("chat_template")),
            "prompt_key": "conversations",
        },
        "training": {
            "attention_backend": ATTENTION_BACKEND,
            "loss_type": "forward_kl",
            "ttt_length": t.ttt_length,
            "ploss_weights": [_number(t.step_weight**i) for i in range(t.ttt_length)],
            "learning_rate": t.lr,
            "lr_decay_style": "cosine",
            "warmup_ratio": warmup_ratio(t.warmup_steps, t.steps),
            "min_lr": _number(t.lr * t.min_lr_ratio),
            "weight_decay": t.weight_decay,
            "max_grad_norm": t.grad_clip,
            "num_train_steps": t.steps,
            # one training GPU, no accumulation: TorchSpec's global batch = ours
            "micro_batch_size": t.batch_size,
            "draft_accumulation_steps": 1,
            "training_num_gpus_per_node": 1,
            "training_num_nodes": 1,
            "max_seq_length": cfg.data.seq_len,
            "seed": cfg.seed,
        },
        "inference": {
            "inference_engine_type": "hf",
            "inference_num_gpus": 1,
            "inference_num_gpus_per_engine": 1,
            "inference_num_gpus_per_node": 1,
            "inference_batch_size": 4,
            "inference_buffer_threshold": 32,
            "max_sample_pool_size": 64,
            "aux_hidden_states_layers": torchspec_aux_layers(spec.aux_layer_ids),
        },
        "mooncake": dict(MOONCAKE),
        "logging": {"report_to": "none"},
        "debug": {"save_debug_train_data": None},
        "output_dir": str(out / "outputs"),
        "cache_dir": str(out / "cache"),
    }


def _unmapped(cfg: DictConfig) -> list[str]:
    """What of the arm's training TorchSpec cannot be told (the YAML's header says so)."""
    t, d = cfg.train, cfg.data
    notes = [
        "AdamW betas: ours (0.9, 0.95); TorchSpec's AdamW has torch's default (0.9, 0.999), not configurable.",
        "warm-up: ours lr * (step + 1) / warmup_steps from step 0, TorchSpec's lr * step / warmup_steps (from 0);"
        " the same warm-up length, cosine decay to min_lr at num_train_steps.",
        "precision: TorchSpec trains in bf16 with fp32 master weights (ours: fp32 weights computing in the "
        f"target's dtype, dtype={cfg.dtype.value}; auto: bfloat16 on CUDA).",
        f"data: ours is data.num_sequences={d.num_sequences} conversations in the '{d.template}' template cut to "
        f"data.seq_len={d.seq_len} tokens from the standard library corpus, loss on the assistant's tokens; "
        "TorchSpec reads dataset.train_data_path and truncates at max_seq_length.",
        "chat template: TorchSpec renders conversations with the target tokenizer's own chat template and adds"
        " its template's default system prompt to conversations without one; a target built by the workbench"
        " has no tokenizer chat template, so give it a pretokenized dataset (Parquet with input_ids + loss_mask).",
        f"resume states (train.resume_every={t.resume_every}) and train.log_every: TorchSpec's own"
        " training.save_interval and logging.",
        "more training GPUs: global batch = micro_batch_size x GPUs x draft_accumulation_steps; divide"
        f" micro_batch_size to keep ours ({t.batch_size} sequences).",
    ]
    if cfg.data.template not in CHAT_TEMPLATES:
        notes.append(
            f"data.template={cfg.data.template}: TorchSpec has no such chat template; "
            f"ours that it has: {', '.join(f'{k} (as {v})' for k, v in CHAT_TEMPLATES.items())}."
        )
    if cfg.data.system_prompt:
        notes.append("data.system_prompt: put it into your conversations as their first (system) message.")
    if cfg.drafter.init_lm_head_from_target:
        notes.append(
            "drafter.init_lm_head_from_target=true: TorchSpec copies only the embedding from the target; its"
            " lm_head starts random."
        )
    return notes


def _header(
    cfg: DictConfig, overrides: list[str], source: str, spec: DrafterSpec, todo: list[str], train_yaml: Path
) -> str:
    fill = todo or ["nothing: the target and the data are set."]
    lines = [
        "TorchSpec training config written by `lab torchspec-config` (EAGLE-3 / EAGLE 3.1 workbench).",
        f"Launch: {LAUNCH.format(train_yaml)}",
        "",
        f"arm: {source}",
        f"lab overrides: {' '.join(redact(o) for o in overrides) or '(none: the defaults)'}",
        f"lab config_hash: {config_hash(cfg)}",
        f"drafter: fc_norm={spec.fc_norm} norm_output={str(spec.norm_output).lower()}, aux layers (vLLM ids) "
        f"{spec.aux_layer_ids} = TorchSpec ids {torchspec_aux_layers(spec.aux_layer_ids)}",
        f"training: train.ttt_length={cfg.train.ttt_length}, train.lr={cfg.train.lr}, train.steps={cfg.train.steps}"
        f" (train.warmup_steps={cfg.train.warmup_steps}, train.min_lr_ratio={cfg.train.min_lr_ratio}),"
        f" step weights train.step_weight**i, train.step_weight={cfg.train.step_weight}",
        "model.draft_model_config, output_dir and cache_dir are absolute: edit them if this folder moves.",
        "",
        "Fill in before launching:",
        *[f"  - {line}" for line in fill],
        "",
        "Does not map onto TorchSpec's options:",
        *[f"  - {line}" for line in _unmapped(cfg)],
    ]
    wrapped = [part for line in lines for part in textwrap.wrap(line, 110, subsequent_indent="      ") or [""]]
    return "".join(f"# {part}\n" if part else "#\n" for part in wrapped)


def write(cfg: DictConfig, out: str | Path, overrides: list[str], source: str, data: str | None = None) -> Export:
    """Write `train.yaml` and `draft_model.json` for the arm of `cfg` into `out`; ConfigError (nothing
    written) for an arm TorchSpec cannot train."""
    check_supported(cfg)
    model_config, target_path = target_model_config(cfg)
    spec = drafter_spec(model_config, cfg.drafter, aux_layers(cfg))
    out = Path(os.path.abspath(out))
    draft_json, train_yaml = out / DRAFT_JSON, out / TRAIN_YAML
    todo = []
    if target_path is None:
        placed = [redact(o) for o in overrides if o.startswith(("target", "profile", "cache_dir"))]
        build = " ".join(["lab target build", *placed])
        todo.append(
            f"model.target_model_path: the target is not built yet; run `{build}`, then export again "
            "(its path, and its vocabulary in draft_model.json, are read from the build)."
        )
    if data is None:
        todo.append(
            'dataset.train_data_path: your training data, a JSONL of {"conversations": [{"role": "user", '
            '"content": ...}, {"role": "assistant", ...}]} (or a pretokenized Parquet); or export with --data.'
        )
    if cfg.data.template not in CHAT_TEMPLATES:
        todo.append(
            f"dataset.chat_template: TorchSpec's name of your target's chat template (ours: {cfg.data.template})."
        )
    if data is not None and Path(data).exists():  # else a Hugging Face Hub dataset id, kept as given
        data = os.path.abspath(data)
    body = train_config(cfg, spec, str(draft_json), target_path, data)
    out.mkdir(parents=True, exist_ok=True)
    draft_json.write_text(json.dumps(draft_model_json(spec), indent=2) + "\n")
    sections = [yaml.dump({k: v}, Dumper=_Dumper, sort_keys=False, width=1000) for k, v in body.items()]
    train_yaml.write_text(_header(cfg, overrides, source, spec, todo, train_yaml) + "\n" + "".join(sections))
    return Export(train_yaml, draft_json, spec, torchspec_aux_layers(spec.aux_layer_ids), todo)
