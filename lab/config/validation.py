"""Checks of a composed config that need the whole config (aux layers against the target's depth, head_dim
against vLLM's CPU kernels, lengths against the target's positions, suites against the data, ...), and of
every value against its field's rules (`check_rules`, lab/config/rules.py's engine); from the config alone and a
target folder's config.json (lab/config/shape.py). Each raises ConfigError naming the key and what is allowed.
What this machine has installed, and the user's other files, are lab/preflight.py's to check.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lab.config import (
    BACKENDS,
    CHAT_ONLY_SUITES,
    MIN_ASSISTANT_ROOM,
    MIN_ASSISTANT_TOKENS,
    MLFLOW_DB_DIALECTS,
    OPTUNA_DB_PREFIXES,
    TARGET_TEMPLATE,
    TEMPLATE_NAMES,
    TRAIN_BACKENDS,
    VLLM_CPU_HEAD_DIMS,
    VLLM_DTYPES,
    VLLM_FORMATS,
    Attention,
    Config,
    ConfigError,
    DataSource,
    Decoder,
    FcNorm,
    NormType,
    Select,
    SuiteKind,
    TargetKind,
    redact,
    rules,
    validation_depth,
)
from lab.config.shape import aux_layers, drafter_mla_dims, max_positions, target_shape


def validate(cfg: DictConfig) -> None:
    """Every value against its field's rules (`check_rules`), then the checks that need the whole config;
    raises ConfigError naming the key and what is allowed.

    A bound of one value (positive, >= 2, in (0, 1], ...) is declared on its schema field only (lab/config
    `checked`) and said by the rule engine, `KEY: expected WHAT, got VALUE`: nothing here checks it again.
    The rules run first, so that the checks below may count on them (no division by a zero target.num_heads,
    no max() of an empty eval.num_speculative_tokens)."""
    _validate_tracking(cfg.tracking)
    check_rules(cfg)
    if cfg.train.backend not in TRAIN_BACKENDS:
        raise ConfigError("train.backend", f"unknown '{cfg.train.backend}'; allowed: {', '.join(TRAIN_BACKENDS)}")
    if cfg.train.backend == "torchspec":
        check_torchspec_drafter(cfg)  # whether TorchSpec is installed is lab/preflight.py's check_environment
    if cfg.target.kind == TargetKind.build:
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
    if cfg.train.ttt_length >= cfg.data.seq_len:
        # every TTT step drafts one position further into the training sequence
        raise ConfigError(
            "train.ttt_length",
            f"must be below data.seq_len={cfg.data.seq_len}, got {cfg.train.ttt_length}",
        )
    if cfg.drafter.attention == Attention.mla:
        _validate_mla(cfg)
    _validate_suites(cfg)
    _validate_backends(cfg)
    _validate_selection(cfg)
    if cfg.eval.decoder == Decoder.replay and cfg.eval.temperature > 0:
        raise ConfigError(
            "eval.decoder",
            f"replay reads the target's greedy answers and needs eval.temperature=0, got {cfg.eval.temperature}; "
            "set eval.decoder=sequential to sample",
        )
    if cfg.eval.rollout_depth is not None and cfg.eval.rollout_depth >= cfg.data.seq_len - 1:
        raise ConfigError("eval.rollout_depth", f"must be below data.seq_len - 1 = {cfg.data.seq_len - 1}")
    _validate_lengths(cfg)


def _validate_selection(cfg: DictConfig) -> None:
    """The validation pass and what reads it: a pass within the training, a depth it measures, and a pass at all
    where the best checkpoint is kept."""
    t, depth = cfg.train, validation_depth(cfg)
    if t.val_every is not None and t.val_every > t.steps:
        raise ConfigError("train.val_every", f"expected at most train.steps={t.steps} steps, got {t.val_every}")
    if t.select_k is not None and t.select_k > depth:
        raise ConfigError(
            "train.select_k",
            f"expected a depth the validation pass measures, 1..{depth} (the deepest of eval.num_speculative_tokens), "
            f"got {t.select_k}",
        )
    if t.select == Select.best and t.val_prompts == 0:
        raise ConfigError(
            "train.select",
            "best keeps the checkpoint of the best exact validation AL and needs the validation pass; expected "
            "train.val_prompts > 0 or train.select=last, got train.val_prompts=0",
        )


def _validate_mla(cfg: DictConfig) -> None:
    """drafter.attention=mla: a query rank, rotary pairs, a value head no wider than the query-key head (it is
    zero-padded to it where a kernel wants equal dims). What vLLM serves is lab/preflight.py's."""
    dims, keys = drafter_mla_dims(cfg)
    if dims["q_lora_rank"] is None:
        raise ConfigError(
            "drafter.q_lora_rank",
            "required for drafter.attention=mla where the target gives none (the query's low rank, e.g. 64), got null",
        )
    if dims["qk_rope_head_dim"] % 2:
        raise ConfigError(
            keys["qk_rope_head_dim"],
            f"must be even (rotary pairs) for drafter.attention=mla, got {dims['qk_rope_head_dim']}",
        )
    qk = dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"]
    if dims["v_head_dim"] > qk:
        raise ConfigError(
            keys["v_head_dim"],
            f"expected at most qk_nope_head_dim + qk_rope_head_dim = {dims['qk_nope_head_dim']} + "
            f"{dims['qk_rope_head_dim']} = {qk} for drafter.attention=mla, got {dims['v_head_dim']}",
        )


def check_rules(cfg: DictConfig) -> None:
    """Every value against its field's `checked` rules (bounds, finite numbers, non-empty names, distinct
    list items, [low, high] ranges), for the whole schema and every configured suite; ConfigError naming
    the key and what is expected."""
    for key, tp, field_rules in ruled_keys(cfg):
        value = OmegaConf.select(cfg, key)
        if OmegaConf.is_config(value):
            value = OmegaConf.to_container(value)
        if rules.problem(field_rules, value):
            raise ConfigError(key, rules.expected_got(rules.words(tp, field_rules), value))


def ruled_keys(cfg: DictConfig | None = None) -> list[tuple[str, Any, dict[str, Any]]]:
    """(key, type, rules) of every schema field with rules; `suites.NAME.` for each of cfg's suites (or
    `suites.*.` without a config)."""
    out = []

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = rules.strip_optional(hints[f.name])
            if dataclasses.is_dataclass(tp):
                walk(tp, f"{prefix}{f.name}.")
            elif typing.get_origin(tp) is dict and dataclasses.is_dataclass(typing.get_args(tp)[1]):
                for name in cfg[f.name] if cfg is not None else ["*"]:
                    walk(typing.get_args(tp)[1], f"{prefix}{f.name}.{name}.")
            elif f.metadata:
                out.append((f"{prefix}{f.name}", hints[f.name], dict(f.metadata)))

    walk(Config, "")
    return out


def _validate_lengths(cfg: DictConfig) -> None:
    """Lengths that only the whole config bounds: the training sequence against the target's positions and
    the room an assistant's turn needs; the attention sink against the prompts."""
    d, positions = cfg.data, max_positions(cfg)
    if d.seq_len > positions:
        raise ConfigError(
            "data.seq_len",
            f"expected at most the target's max positions ({positions}), got {d.seq_len}",
        )
    if d.source == DataSource.code:
        # BOS, the request, the last seq_len/4 tokens of code, then the answer (lab/data/code_data.py)
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


def check_torchspec_drafter(cfg: DictConfig) -> None:
    """ConfigError naming the key of a drafter TorchSpec's EAGLE-3 cannot be: it has one decoder layer
    (`midlayer`) and RMSNorm fc norms, one per captured layer or none. Its MLA drafter
    (`Eagle3DeepseekV2ForCausalLM`, drafter.attention=mla) builds every MLA drafter `_validate_mla` lets
    through: a query rank or none, any head dims, GPT-J rotary on the rope dims (with a target's YaRN too), the
    softmax scale 1/sqrt(nope + rope) (times YaRN's mscale^2); whether the installed TorchSpec has it is
    lab/preflight.py's."""
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


def _validate_backends(cfg: DictConfig) -> None:
    backends = list(cfg.eval.backends)  # non-empty and distinct: its field's rules
    if any(b not in BACKENDS for b in backends):
        raise ConfigError("eval.backends", f"must be a non-empty list of {', '.join(BACKENDS)}; got {backends}")
    v = cfg.eval.vllm
    if v.format not in VLLM_FORMATS:
        raise ConfigError("eval.vllm.format", f"unknown format '{v.format}'; allowed: {', '.join(VLLM_FORMATS)}")
    if v.dtype not in VLLM_DTYPES:
        raise ConfigError("eval.vllm.dtype", f"unknown dtype '{v.dtype}'; allowed: {', '.join(VLLM_DTYPES)}")
    for name in v.throughput_suites or []:
        if name not in cfg.eval.suites:
            evaluated = ", ".join(cfg.eval.suites)
            raise ConfigError(
                "eval.vllm.throughput_suites", f"'{name}' is not evaluated; expected some of eval.suites: {evaluated}"
            )


_URI_EXPECTED = "expected sqlite:///PATH, http(s)://HOST:PORT of an mlflow server, or a database URL"
_STORAGE_EXPECTED = (
    "expected null (a journal file beside the MLflow database), a journal file path, "
    "or a database URL such as postgresql://USER:PW@HOST/DB"
)


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


def _validate_suites(cfg: DictConfig) -> None:
    templates = ", ".join(TEMPLATE_NAMES)
    _validate_data(cfg)
    positions, deepest = max_positions(cfg), max(cfg.eval.num_speculative_tokens)
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
        if suite.kind == SuiteKind.long_context and cfg.data.source != DataSource.code:
            lengths = list(suite.context_lengths)  # non-empty and positive: its field's rules
            if max(lengths) > room:
                raise ConfigError(
                    f"{key}.context_lengths",
                    f"{max(lengths)} tokens + max_new_tokens + k exceeds the target's max positions "
                    f"({max_positions(cfg)}); expected at most {room}",
                )
        elif suite.kind == SuiteKind.long_context:
            multiples = list(suite.context_multiples)  # non-empty and positive: its field's rules
            if max(multiples) * cfg.data.seq_len > room:
                raise ConfigError(
                    f"{key}.context_multiples",
                    f"{max(multiples)} x data.seq_len={cfg.data.seq_len} tokens + max_new_tokens + k exceeds "
                    f"the target's max positions ({max_positions(cfg)})",
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
