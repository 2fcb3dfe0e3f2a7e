"""`device` and `dtype`: resolved in one place, `device=cuda` refused in one line where torch has no CUDA, and a
CPU run with either key at its CPU value computing exactly what a float32 CPU run computed before they existed.

Everything here runs on the CPU: a bfloat16 or float16 target on the CPU goes through the same casts and
autocast as it would on a GPU."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import small_target
from omegaconf import OmegaConf

from lab.config import ConfigError, DrafterConfig, TrainConfig
from lab.config.composition import compose
from lab.config.identity import config_hash
from lab.data.cache import build_or_load
from lab.data.code_data import Sequences
from lab.device import resolve_device
from lab.drafter import init_drafter
from lab.eval.evaluate import heldout_evaluation
from lab.eval.reference import speculative_decode, target_decode
from lab.pipeline import resolved_device
from lab.preflight import check_target
from lab.target import load
from lab.target.load import Target
from lab.train.ttt import train

CUDA = torch.cuda.is_available()
LAYERS = [1, 2, 3]

# device, dtype, whether torch sees CUDA -> the device and dtype a run gets
RESOLVED = [
    ("auto", "auto", False, "cpu", torch.float32),
    ("auto", "auto", True, "cuda", torch.bfloat16),
    ("cpu", "auto", True, "cpu", torch.float32),
    ("cuda", "auto", True, "cuda", torch.bfloat16),
    ("cuda", "auto", False, "cuda", torch.bfloat16),  # taken as asked: preflight refuses it (below)
    ("auto", "float32", True, "cuda", torch.float32),
    ("auto", "bfloat16", False, "cpu", torch.bfloat16),
    ("cpu", "float16", True, "cpu", torch.float16),
    ("cuda", "float16", True, "cuda", torch.float16),
]


@pytest.mark.parametrize(("device", "dtype", "cuda", "want_device", "want_dtype"), RESOLVED)
def test_resolution(monkeypatch, device, dtype, cuda, want_device, want_dtype):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    cfg = compose([f"device={device}", f"dtype={dtype}"])
    assert resolve_device(cfg) == (torch.device(want_device), want_dtype)


def test_the_defaults_and_a_config_logged_before_the_keys(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = compose([])
    assert (cfg.device.value, cfg.dtype.value) == ("auto", "auto")
    assert resolve_device(cfg) == resolve_device({"seed": 0}) == (torch.device("cpu"), torch.float32)


def test_unknown_values_are_refused_by_the_schema():
    with pytest.raises(ConfigError, match=r"^device: .*expected one of \[auto, cpu, cuda\]"):
        compose(["device=gpu"])
    with pytest.raises(ConfigError, match=r"^dtype: .*expected one of \[auto, float32, bfloat16, float16\]"):
        compose(["dtype=fp8"])


def _pre_ampere(monkeypatch) -> None:
    """torch as it answers on a V100: CUDA, but no bfloat16 arithmetic."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-16GB")


def test_a_dtype_the_device_cannot_compute_is_refused_in_one_line(monkeypatch, tmp_path, capsys):
    """bfloat16 on a GPU without bfloat16 arithmetic is refused before any work; `auto` picks float16 there."""
    from lab.cli import main

    _pre_ampere(monkeypatch)
    monkeypatch.chdir(tmp_path)
    assert resolve_device(compose(["device=cuda"])) == (torch.device("cuda"), torch.float16)
    assert main(["run", "device=cuda", "dtype=bfloat16"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        "error: dtype: bfloat16 on cuda: Tesla V100-SXM2-16GB (compute capability 7.0) has no bfloat16 arithmetic; "
        "expected dtype=float16 or float32"
    ]
    assert list(tmp_path.iterdir()) == []  # refused before any work: no store, no cache
    check_target(compose(["device=cuda", "dtype=float16"]))  # what it says to use is taken
    check_target(compose(["device=cpu", "dtype=bfloat16"]))  # a CPU computes bfloat16


@pytest.mark.skipif(CUDA, reason="torch sees a GPU here, so device=cuda is not refused")
def test_cuda_without_cuda_is_refused_in_one_line(tmp_path):
    said = subprocess.run(
        [sys.executable, "-m", "lab.cli", "run", "device=cuda"], capture_output=True, text=True, cwd=tmp_path
    )
    assert said.returncode == 2, said.stderr
    lines = said.stderr.strip().splitlines()
    assert len(lines) == 1, said.stderr
    assert lines[0].startswith("error: device: cuda: torch ") and "expected device=auto or device=cpu" in lines[0]
    assert list(tmp_path.iterdir()) == []  # refused before any work: no store, no cache


def test_a_study_checks_the_device_of_every_point(monkeypatch):
    """check_target (lab run's preflight, a study's check of each point, lab target build) refuses device=cuda
    where torch has no CUDA, and lets it through where it has."""
    cfg = compose(["device=cuda"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"^device: cuda: "):
        check_target(cfg)
    check_target(compose(["device=auto"]))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    check_target(cfg)


# ------------------------------------------------------------------------------------------ what a run computes


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """tests/helpers.py's random Llama saved as a Hugging Face folder (float32 safetensors and a tokenizer)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("target")
    small_target(0).save_pretrained(path)
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(100)}, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=words, eos_token="t1").save_pretrained(path)
    return path


def _load(folder: Path, tmp_path: Path, **keys: str) -> Target:
    """The target as `lab run` loads it, from a config with `keys` (none: one logged before they existed)."""
    cfg = OmegaConf.create({"target": {"kind": "hf", "path": str(folder)}, "cache_dir": str(tmp_path), **keys})
    return load(cfg, progress=False)


def _sequences(n: int = 8, t: int = 16) -> Sequences:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (n, t), generator=gen)
    return Sequences(ids, (torch.rand(n, t, generator=gen) > 0.3).to(torch.uint8))


def _run(target: Target, cache_dir: Path) -> dict:
    """A small run's stages on `target`, as lab/pipeline.py chains them: the hidden-state cache, a drafter moved
    to the target's device and trained, the reference decoder (greedy and sampled) and the held-out rollout."""
    seqs = _sequences()
    hidden = build_or_load(target, seqs, OmegaConf.create({"name": "random"}), LAYERS, cache_dir, progress=False)
    dcfg = OmegaConf.structured(DrafterConfig(name="t", draft_vocab_size=50, fc_norm="per_layer", norm_output=True))
    counts = torch.bincount(seqs.input_ids.flatten(), minlength=100)
    drafter = init_drafter(target, dcfg, LAYERS, seed=0, token_counts=counts).to(target.device)
    tcfg = OmegaConf.structured(TrainConfig(steps=4, batch_size=4, warmup_steps=1, log_every=2, resume_every=0))
    result = train(drafter, hidden, target.lm_head_weight, tcfg, seed=0, progress=False)
    prompt, decoded = seqs.input_ids[0, :10].tolist(), []
    for temperature in (0.0, 0.9):
        gen = torch.Generator().manual_seed(3)
        reference, _ = target_decode(target.model, prompt, 12, temperature, gen)
        tokens, stats = speculative_decode(target.model, drafter, prompt, 12, 3, temperature=temperature, generator=gen)
        decoded.append((reference, tokens, stats.accepted_at))
    rollout = heldout_evaluation(target, drafter, Sequences(seqs.input_ids[:4], seqs.loss_mask[:4]), 4)
    return {
        "fingerprint": target.fingerprint,
        "cache": hidden.path.name,
        "hidden": (hidden.aux, hidden.final),
        "drafter": drafter.state_dict(),
        "loss": {k: v for k, v in result.last.items() if "tokens_per_s" not in k},
        "decoded": decoded,
        "rollout": rollout.metrics,
    }


def _same(a: dict, b: dict) -> None:
    assert (a["fingerprint"], a["cache"]) == (b["fingerprint"], b["cache"])
    for x, y in zip(a["hidden"], b["hidden"], strict=True):
        assert torch.equal(x, y)
    assert a["drafter"].keys() == b["drafter"].keys()
    for name, value in a["drafter"].items():
        assert value.dtype == b["drafter"][name].dtype and torch.equal(value, b["drafter"][name]), name
    assert (a["loss"], a["decoded"], a["rollout"]) == (b["loss"], b["decoded"], b["rollout"])


def test_cpu_and_auto_compute_what_a_float32_cpu_run_did(folder, tmp_path, monkeypatch):
    """device=cpu, and device=auto / dtype=auto where torch has no CUDA, load the target as float32 on the
    CPU with the fingerprint it always had (so every cache key is unchanged) and compute, bit for bit, what
    the same stages compute on the float32 model they were given before `device` and `dtype` existed."""
    from lab.target.load import _hf_fingerprint

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    before = Target(model=small_target(0), tokenizer=None, path=folder, fingerprint=f"hf-{_hf_fingerprint(folder)}")
    expected = _run(before, tmp_path / "before")
    configs = [{}, {"device": "cpu", "dtype": "auto"}, {"device": "auto", "dtype": "auto"}]
    for i, keys in enumerate(configs):
        target = _load(folder, tmp_path, **keys)
        assert (target.device, target.dtype) == (torch.device("cpu"), torch.float32), keys
        assert resolved_device(target) == {"resolved.device": "cpu", "resolved.dtype": "float32"}  # run params
        _same(_run(target, tmp_path / f"cache{i}"), expected)


def _cache_key(target: Target) -> str:
    from lab.data.cache import cache_key

    return cache_key(target, OmegaConf.create({"name": "random"}), LAYERS)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_narrower_target_trains_a_float32_drafter_and_decodes_losslessly(folder, tmp_path, dtype):
    """The path a GPU run takes, on the CPU: the target in bfloat16 (float16), its own fingerprint and cache
    key, the drafter's weights still float32 after training under autocast (float16 with a scaled loss), and
    greedy speculative decoding equal to the target's own greedy decoding."""
    name = str(dtype).removeprefix("torch.")
    target = _load(folder, tmp_path, device="cpu", dtype=name)
    plain = _load(folder, tmp_path, device="cpu", dtype="float32")
    assert target.model.dtype == dtype and target.fingerprint == f"{plain.fingerprint}-{name}"
    assert resolved_device(target) == {"resolved.device": "cpu", "resolved.dtype": name}
    got = _run(target, tmp_path / "cache")
    assert got["cache"] == _cache_key(target) != _cache_key(plain)  # cached apart from the float32 states
    assert all(v.dtype in (torch.float32, torch.long) for v in got["drafter"].values())
    assert all(math.isfinite(v) for v in got["loss"].values())
    reference, tokens, _ = got["decoded"][0]
    assert tokens == reference and len(tokens) == 12
    assert config_hash(compose([f"dtype={name}"])) != config_hash(compose([]))
