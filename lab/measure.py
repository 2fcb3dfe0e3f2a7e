"""A few seconds of measurement: this machine's rates at a run's shapes, for the plan's estimates of the stages no
finished run here has timed yet (lab/plan.py). The configured target's architecture (its config.json once it is
built, else the shape its config declares) and the drafter's, with random weights and random data: greedy decoding
with a regeneration pool's rows under way, a forward over one sequence, and the trainer's step. The run after the
plan records them under `{cache_dir}/rates/`, keyed by the machine, its threads and the shapes, so each is measured
once; a plan alone writes nothing.

The decoding is transformers' over a dynamic KV cache (`data.generator=hf`): vLLM's worker takes longer to start
than the whole measurement, so a vLLM regeneration's estimate is made at transformers' rate and says so.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from omegaconf import DictConfig

from lab.config.identity import flatten
from lab.config.shape import aux_layers
from lab.data.cache import HiddenStates
from lab.data.regenerate import CHUNK_CONVERSATIONS
from lab.device import resolve_device, thread_count
from lab.fsutil import atomic_file, short_hash

logger = logging.getLogger(__name__)

RATES_DIR = "rates"
PROMPT_TOKENS, DECODED_TOKENS = 4, 4  # a decoding measured: each row's prompt, and the steps timed


@dataclass
class Rates:
    """Tokens a second on this machine at one run's shapes."""

    decode: float  # answered greedily, a regeneration pool's answers under way at once
    prefill: float  # through the target's forward over one whole sequence (the hidden-state capture's)
    train: float | None  # trained: batch x sequence x TTT steps (None: train.backend=torchspec, not measured)
    seconds: float  # what measuring took


_MEASURED: dict[Path, Rates] = {}  # this process's measurements not yet recorded, by where they are recorded


def rates(cfg: DictConfig, model_dir: Path | None) -> Rates:
    """The rates recorded for this machine and `cfg`'s shapes, else measured, held for `record`. `model_dir`: the
    built target's folder, whose config.json is the exact architecture; None: the shape the config declares."""
    path = Path(cfg.cache_dir) / RATES_DIR / f"{_key(cfg, model_dir)}.json"
    try:
        return _MEASURED.get(path) or Rates(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        pass
    logger.info("measuring this machine's rates at the run's shapes (once: the run records them)")
    measured = _MEASURED[path] = measure(cfg, model_dir)
    logger.info(f"measured in {measured.seconds:.1f} s")
    return measured


def record(cache_dir: str | Path) -> None:
    """Record under `cache_dir` the rates this process measured for it: a run does as its MLflow run opens, so
    that a plan alone (a dry run, or a command refused before the run opens) writes nothing."""
    for path in [p for p in _MEASURED if p.parent == Path(cache_dir) / RATES_DIR]:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(path) as tmp:
            tmp.write_text(json.dumps(asdict(_MEASURED.pop(path))))


def _key(cfg: DictConfig, model_dir: Path | None) -> str:
    shapes = {k: v for k, v in flatten(cfg).items() if k.startswith(("target.", "drafter.", "train.backend"))}
    where = {"host": socket.gethostname(), "threads": thread_count(cfg), "torch": torch.__version__}
    return short_hash({**shapes, **where, "device": str(cfg.device), "dtype": str(cfg.dtype), "seq": cfg.data.seq_len,
                       "ttt": cfg.train.ttt_length, "folder": str(model_dir)})  # fmt: skip


def measure(cfg: DictConfig, model_dir: Path | None) -> Rates:
    """The rates at `cfg`'s shapes, under the threads its run trains with."""
    previous = torch.get_num_threads()
    torch.set_num_threads(thread_count(cfg))
    try:
        with torch.random.fork_rng():  # the run after the plan draws what it would have drawn without it
            return _measure(cfg, model_dir)
    finally:
        torch.set_num_threads(previous)


def _measure(cfg: DictConfig, model_dir: Path | None) -> Rates:
    began = time.perf_counter()
    torch.manual_seed(0)  # the same random weights each time
    model = target_model(cfg, model_dir)
    decode = _decode_rate(model, CHUNK_CONVERSATIONS)  # the regeneration pool's turns under way on a CPU
    prefill = _prefill_rate(model, cfg.data.seq_len)
    del model
    train = _train_rate(cfg) if cfg.train.backend == "native" else None
    return Rates(decode, prefill, train, time.perf_counter() - began)


def target_model(cfg: DictConfig, model_dir: Path | None) -> Any:
    """A causal LM of the target's architecture with random weights, on the run's device and in its dtype."""
    from transformers import AutoConfig, AutoModelForCausalLM

    device, dtype = resolve_device(cfg)
    if model_dir is not None and (model_dir / "config.json").is_file():
        config = AutoConfig.from_pretrained(model_dir)
    else:
        config = declared_config(cfg)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()


def declared_config(cfg: DictConfig) -> Any:
    """A Llama config of the shape the target's config declares (the architecture before it is built)."""
    from transformers import LlamaConfig

    t = cfg.target
    return LlamaConfig(
        vocab_size=t.vocab_size, hidden_size=t.hidden_size, num_attention_heads=t.num_heads,
        num_key_value_heads=t.num_heads, head_dim=t.hidden_size // t.num_heads, num_hidden_layers=t.num_layers,
        intermediate_size=t.intermediate_size, max_position_embeddings=t.max_positions, rope_theta=t.rope_theta,
    )  # fmt: skip


def _decode_rate(model: Any, rows: int) -> float:
    """Decoding steps of `rows` answers at once, apart from their prompts' forward: the difference of two
    decodings of the same prompts, one token and `1 + DECODED_TOKENS` tokens long."""
    from lab.target.generate import _dynamic_greedy_batch

    prompts = torch.randint(0, model.config.vocab_size, (rows, PROMPT_TOKENS)).tolist()
    seconds = []
    for tokens in (1, 1, 1 + DECODED_TOKENS):  # the first warms up
        began = time.perf_counter()
        _dynamic_greedy_batch(model, prompts, [tokens] * rows, eos=-1)
        seconds.append(time.perf_counter() - began)
    return rows * DECODED_TOKENS / max(seconds[2] - seconds[1], 1e-6)


@torch.inference_mode()
def _prefill_rate(model: Any, seq_len: int) -> float:
    device = model.get_output_embeddings().weight.device
    ids = torch.randint(0, model.config.vocab_size, (1, seq_len), device=device)
    model(input_ids=ids[:, : min(seq_len, 16)], output_hidden_states=True)  # warms up
    began = time.perf_counter()
    model(input_ids=ids, output_hidden_states=True, logits_to_keep=1).logits.tolist()  # waits for the device
    return seq_len / (time.perf_counter() - began)


def _train_rate(cfg: DictConfig) -> float:
    """The trainer's step over one sequence: its tokens x TTT steps a second."""
    from lab.drafter import init_drafter
    from lab.train.ttt import step_seconds

    target = synthetic_target(cfg)
    drafter = init_drafter(target, cfg.drafter, aux_layers(cfg), cfg.seed, torch.ones(cfg.target.vocab_size))
    tcfg = cfg.train.copy()
    tcfg.batch_size = 1
    seconds = step_seconds(drafter, synthetic_states(cfg, 1), target.lm_head_weight, tcfg)
    return cfg.data.seq_len * cfg.train.ttt_length / seconds


def synthetic_target(cfg: DictConfig, kv_heads: int | None = None) -> Any:
    """What a drafter reads of the configured target (`init_drafter`'s `TargetWeights`), random: its config (the
    declared shape, with `kv_heads` KV heads) and embedding and head weights, on the run's device."""
    device, _ = resolve_device(cfg)
    config = declared_config(cfg)
    config.num_key_value_heads = kv_heads or config.num_key_value_heads
    gen = torch.Generator().manual_seed(0)
    v, h = cfg.target.vocab_size, cfg.target.hidden_size
    return SimpleNamespace(
        model=SimpleNamespace(config=config),
        embed_weight=(torch.randn(v, h, generator=gen) * 0.02).to(device),
        lm_head_weight=(torch.randn(v, h, generator=gen) * 0.02).to(device),
    )


def synthetic_states(cfg: DictConfig, n: int) -> HiddenStates:
    """`n` training sequences of `data.seq_len` random tokens and captured states, the last three quarters of
    each the assistant's."""
    gen = torch.Generator().manual_seed(0)
    v, h, seq, layers = cfg.target.vocab_size, cfg.target.hidden_size, cfg.data.seq_len, aux_layers(cfg)
    mask = torch.zeros(n, seq, dtype=torch.uint8)
    mask[:, seq // 4 :] = 1
    aux = torch.randn(n, seq, len(layers) * h, generator=gen).to(torch.bfloat16)
    final = torch.randn(n, seq, h, generator=gen).to(torch.bfloat16)
    return HiddenStates(torch.randint(0, v, (n, seq), generator=gen), mask, aux, final, None)
