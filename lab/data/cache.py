"""The hidden-state cache: target forward passes over the drafter's training data, computed once.

Layout: `{cache_dir}/hidden/{key}/shard_00000.safetensors ... manifest.json`. Each shard holds
`input_ids` [n, T] (int32), `loss_mask` [n, T] (uint8), `aux` [n, T, A*H] and `final` [n, T, H]
(bfloat16). The key hashes the target fingerprint, the data config and the captured layer ids; the
manifest records each shard's sha256 and what the key hashes (its `Identity`), both checked on every load: a
corrupted or truncated shard, or an entry found under a key that is not its own (copied or moved there),
is rebuilt, never used. A build writes its shards into `{key}.partial/` first (each through a temp
name, flushed, then renamed), so an interrupted build resumes from the shards it finished, and renames that
folder onto `{key}` once it holds every shard and the manifest: an entry is whole or absent.

The held-out rollout's side of the target (`heldout_states`) is cached beside it, once per target, held-out
set and captured layers: `{cache_dir}/heldout/{key}/states.safetensors` (`input_ids` int32, `aux` in the
target's dtype, `top` the target's argmax, int32) with its manifest. Every run of a study evaluates its
drafter on the same held-out conversations; their target forward and lm_head cost as much as the rollout.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from lab.data.code_data import Sequences, training_sequences
from lab.fsutil import (
    IDENTITY,
    Identity,
    atomic_file,
    entry_name,
    file_lock,
    mismatched_file,
    read_manifest,
    replace_dir,
    sha256_file,
    staging_dir,
)
from lab.target import Target, capture, chunked_argmax, corpus, target_logits
from lab.target.capture import Captured

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
SHARD_SEQUENCES = 256
STORE_DTYPE = torch.bfloat16
FORMAT = 2
HELDOUT_FORMAT = 1


@dataclass
class HiddenStates:
    input_ids: torch.Tensor  # [N, T] int64
    loss_mask: torch.Tensor  # [N, T] uint8: 1 where the token is the assistant's
    aux: torch.Tensor  # [N, T, A*H] bf16
    final: torch.Tensor  # [N, T, H] bf16
    path: Path
    stats: dict = field(default_factory=dict)  # hit, seconds, target_forward_tokens

    def __len__(self) -> int:
        return self.input_ids.shape[0]


def hidden_identity(target: Target, dcfg: DictConfig, aux_layers: list[int]) -> Identity:
    data = OmegaConf.to_container(dcfg, enum_to_str=True)
    return Identity({"target": target.fingerprint, "data": data, "aux": list(aux_layers), "format": FORMAT})


def cache_key(target: Target, dcfg: DictConfig, aux_layers: list[int]) -> str:
    return hidden_identity(target, dcfg, aux_layers).key()


def _check(path: Path, identity: Identity | None) -> tuple[dict | None, str | None]:
    """The entry's manifest if it records `identity` (where given) and every shard is there with its recorded
    hash; else None and what is wrong with the entry (None: there is none)."""
    manifest = read_manifest(path, MANIFEST)
    if manifest is None:
        return None, None
    wrong = identity.mismatch(manifest) if identity is not None else None
    if wrong is not None:
        return None, f"cache entry {entry_name(path)}: {wrong}"
    bad = mismatched_file(path, {shard["file"]: shard["sha256"] for shard in manifest["shards"]})
    if bad is not None:
        return None, f"cache entry {path / bad} is missing or does not match its manifest hash"
    return manifest, None


def _verify(path: Path, identity: Identity | None = None) -> dict | None:
    """The manifest if every shard is present with its recorded hash (and the entry records `identity`), else None."""
    return _check(path, identity)[0]


def publish_tensors(
    path: Path, file: str, tensors: dict[str, torch.Tensor], identity: Identity | None, **info: Any
) -> dict:
    """Publish `tensors` as the one-file entry `path` (staged whole, then renamed), with a manifest of `info`, the
    entry's `identity` and the file's sha256, which `verified_or_built` checks; returns the manifest."""
    with staging_dir(path) as tmp:
        save_file(tensors, str(tmp / file))
        recorded = {IDENTITY: identity.fields} if identity is not None else {}
        manifest = {**info, **recorded, "shards": [{"file": file, "sha256": sha256_file(tmp / file)}]}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def verified_or_built(path: Path, build: Callable[[], dict], identity: Identity) -> tuple[dict, bool]:
    """The entry's manifest and whether it was there (whole, and the entry `identity` names), else `build()`'s,
    built under the entry's lock. An entry there that fails a check is rebuilt; one line says why."""
    manifest, _ = _check(path, identity)
    if manifest is not None:
        logger.debug(f"cache entry {entry_name(path)}: reused")
        return manifest, True
    with file_lock(path.with_suffix(".lock")):
        manifest, wrong = _check(path, identity)  # another process may have built it while we waited
        if manifest is not None:
            logger.debug(f"cache entry {entry_name(path)}: reused, built by another process")
            return manifest, True
        if wrong is not None:
            logger.warning(f"{wrong}; rebuilding it")
        manifest = build()
        logger.debug(f"cache entry {entry_name(path)}: built")
        return manifest, False


def _read(path: Path, manifest: dict) -> dict[str, torch.Tensor]:
    parts = [load_file(str(path / s["file"])) for s in manifest["shards"]]
    return {name: torch.cat([p[name] for p in parts]) for name in ("input_ids", "loss_mask", "aux", "final")}


def build_or_load(
    target: Target,
    sequences: Sequences,
    dcfg: DictConfig,
    aux_layers: list[int],
    cache_dir: str | Path,
    batch_size: int = 16,
    progress: bool = True,
) -> HiddenStates:
    """Captured states for the sequences; runs the target only if the cache entry is absent."""
    identity = hidden_identity(target, dcfg, aux_layers)
    path = Path(cache_dir) / "hidden" / identity.key()
    started = time.time()
    build = functools.partial(_build, target, sequences, aux_layers, path, identity, batch_size, progress)
    manifest, hit = verified_or_built(path, build, identity)
    stored = _read(path, manifest)
    ids = stored["input_ids"].long()
    if not torch.equal(ids, sequences.input_ids) or not torch.equal(stored["loss_mask"], sequences.loss_mask):
        raise RuntimeError(f"hidden-state cache {path}: stored tokens differ from the requested sequences")
    stats = {
        "hit": hit,
        "seconds": time.time() - started,
        "target_forward_tokens": 0 if hit else int(sequences.input_ids.numel()),
        "bytes": sum(s["bytes"] for s in manifest["shards"]),
        "build_seconds": manifest.get("build_seconds"),  # what a hit saves (absent in older entries)
    }
    return HiddenStates(ids, stored["loss_mask"], stored["aux"], stored["final"], path, stats)


def capture_batch(model, batch: torch.Tensor, aux_layers: list[int]) -> Captured:
    """What the cache stores of one batch: the aux and final states, already in `STORE_DTYPE`
    (`benchmarks/capture_overhead.py` times exactly this against the target's plain forward)."""
    return capture(model, batch, aux_layers, dtype=STORE_DTYPE)


def _build(target, sequences, aux_layers, path, identity: Identity, batch_size, progress) -> dict:
    """Capture shard by shard into `{key}.partial/` (each shard written whole or not at all), then publish the
    entry: an interrupted build resumes from the shards it finished."""
    partial = path.parent / f"{path.name}.partial"
    _start_partial(partial, identity)
    shards = []
    started = time.time()
    bar = tqdm(total=len(sequences), desc="hidden-state cache", unit="seq", disable=not progress)
    for index, start in enumerate(range(0, len(sequences), SHARD_SEQUENCES)):
        chunk = sequences.input_ids[start : start + SHARD_SEQUENCES]
        mask = sequences.loss_mask[start : start + SHARD_SEQUENCES]
        name = f"shard_{index:05d}.safetensors"
        if not _finished_shard(partial / name, chunk):
            aux, final = [], []
            for batch in chunk.to(target.device).split(batch_size):  # the stored ids stay on the CPU
                out = capture_batch(target.model, batch, aux_layers)
                aux.append(out.aux)
                final.append(out.final)
                bar.update(len(batch))
            tensors = {
                "input_ids": chunk.to(torch.int32).contiguous(),
                "loss_mask": mask.contiguous(),
                "aux": torch.cat(aux),
                "final": torch.cat(final),
            }
            with atomic_file(partial / name) as tmp:
                save_file(tensors, str(tmp))
        else:
            bar.update(len(chunk))
        if not progress:  # a log without bars still says how far a long capture is
            logger.info(f"hidden-state cache: {start + len(chunk)} of {len(sequences)} sequences")
        shards.append(
            {
                "file": name,
                "sha256": sha256_file(partial / name),
                "num_sequences": len(chunk),
                "bytes": (partial / name).stat().st_size,
            }
        )
    bar.close()
    manifest = {
        "key": path.name,
        "format": FORMAT,
        "target": target.fingerprint,
        "aux_layers": list(aux_layers),
        "num_sequences": len(sequences),
        "seq_len": sequences.input_ids.shape[1],
        "dtype": str(STORE_DTYPE),
        IDENTITY: identity.fields,
        "shards": shards,
        "build_seconds": time.time() - started,
    }
    with atomic_file(partial / MANIFEST) as tmp:
        tmp.write_text(json.dumps(manifest, indent=1))
    # the finished folder becomes the entry in one rename: a process killed before it leaves every shard in
    # `{key}.partial/`, which the next build finds finished and publishes without a target forward (moving the
    # shards one by one into a staging folder would lose those moved if it were killed half-way)
    replace_dir(partial, path)
    return manifest


def _start_partial(partial: Path, identity: Identity) -> None:
    """Make `partial` a folder of this entry's shards only: one that a build of another identity left (copied or
    moved here) starts over. Its manifest records the identity before the first shard is captured."""
    wrong = identity.mismatch(read_manifest(partial, MANIFEST))
    if wrong is not None:
        logger.warning(f"cache entry {entry_name(partial)}: {wrong}; capturing its shards again")
        shutil.rmtree(partial)
    partial.mkdir(parents=True, exist_ok=True)
    with atomic_file(partial / MANIFEST) as tmp:
        tmp.write_text(json.dumps({IDENTITY: identity.fields, "shards": []}, indent=1))


def _finished_shard(file: Path, chunk: torch.Tensor) -> bool:
    """Whether an interrupted build left this shard whole, for these sequences."""
    if not file.is_file():
        return False
    try:
        with safe_open(str(file), framework="pt") as f:
            return torch.equal(f.get_tensor("input_ids").long(), chunk.long())
    except (SafetensorError, OSError):
        return False


def heldout_identity(target: Target, ids: torch.Tensor, aux_layers: list[int]) -> Identity:
    return Identity(
        {
            "target": target.fingerprint,
            "dtype": str(target.lm_head_weight.dtype),
            "ids": hashlib.sha256(ids.to(torch.int64).numpy().tobytes()).hexdigest(),
            "shape": list(ids.shape),
            "aux": list(aux_layers),
            "format": HELDOUT_FORMAT,
        }
    )


@dataclass
class HeldoutStates:
    """The target's side of the held-out rollout, for sequences [N, T]: its captured layers `aux`
    [N, T, A*H] in the target's own dtype (the rollout reads what a fresh capture would give) and its
    argmax `top` [N, T] at each position."""

    aux: torch.Tensor
    top: torch.Tensor
    path: Path
    hit: bool


def heldout_states(
    target: Target, heldout: Sequences, aux_layers: list[int], cache_dir: str | Path, batch_size: int = 16
) -> HeldoutStates:
    """The held-out sequences' captured states and target argmax, from the cache or captured once (under a
    lock, published whole; an entry whose file no longer matches its manifest hash, or that records another
    identity, is captured again)."""
    ids = heldout.input_ids
    identity = heldout_identity(target, ids, aux_layers)
    path = Path(cache_dir) / "heldout" / identity.key()
    build = functools.partial(_capture_heldout, target, ids, aux_layers, path, identity, batch_size)
    _, hit = verified_or_built(path, build, identity)
    stored = load_file(str(path / "states.safetensors"))
    if not torch.equal(stored["input_ids"].long(), ids):
        raise RuntimeError(f"held-out cache {path}: stored tokens differ from the held-out sequences")
    return HeldoutStates(stored["aux"], stored["top"].long(), path, hit)


@torch.no_grad()
def capture_heldout(
    target: Target, ids: torch.Tensor, aux_layers: list[int], batch_size: int = 16
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's captured layers [N, T, A*H] and argmax [N, T] over sequences `ids` [N, T], on its device."""
    aux, top = [], []
    for batch in ids.to(target.lm_head_weight.device).split(batch_size):
        out = capture(target.model, batch, aux_layers)
        aux.append(out.aux)
        top.append(chunked_argmax(out.final, lambda h: target_logits(h, target.lm_head_weight)))
    return torch.cat(aux), torch.cat(top)


def _capture_heldout(
    target: Target, ids: torch.Tensor, aux_layers: list[int], path: Path, identity: Identity, batch_size: int
) -> dict:
    aux, top = capture_heldout(target, ids, aux_layers, batch_size)
    tensors = {"input_ids": ids.to(torch.int32).contiguous(), "aux": aux.cpu(), "top": top.to(torch.int32).cpu()}
    return publish_tensors(
        path,
        "states.safetensors",
        tensors,
        identity,
        key=path.name,
        format=HELDOUT_FORMAT,
        target=target.fingerprint,
        aux_layers=list(aux_layers),
        num_sequences=int(ids.shape[0]),
    )


def sequences_identity(target: Target, dcfg: DictConfig) -> Identity:
    """What data=code's chosen sequences are keyed by: the target's fingerprint, the data config and the corpus."""
    return Identity(
        {
            "target": target.fingerprint,
            "data": OmegaConf.to_container(dcfg, enum_to_str=True),
            "corpus": corpus.manifest_hash(corpus.select(dcfg.corpus_bytes)),
        }
    )


def code_sequences(target: Target, dcfg: DictConfig, cache_dir: str | Path) -> tuple[Sequences, Sequences]:
    """data=code's (train, held-out) sequences (lab/data/code_data.py `training_sequences`), chosen once and kept in
    `{cache_dir}/sequences/{key}/`: choosing them renders and encodes every conversation of the corpus split,
    seconds of every run of a study for the same result. The key hashes the
    target's fingerprint, the data config and the corpus; an entry that no longer matches its manifest hash, or
    records another identity, is chosen again."""
    identity = sequences_identity(target, dcfg)
    path = Path(cache_dir) / "sequences" / identity.key()

    def choose() -> dict:
        train, heldout = training_sequences(target.tokenizer, dcfg)
        tensors = {"train_ids": train.input_ids, "train_mask": train.loss_mask}
        tensors.update(heldout_ids=heldout.input_ids, heldout_mask=heldout.loss_mask)
        return publish_tensors(path, "sequences.safetensors", tensors, identity)

    verified_or_built(path, choose, identity)
    t = load_file(str(path / "sequences.safetensors"))
    return Sequences(t["train_ids"], t["train_mask"]), Sequences(t["heldout_ids"], t["heldout_mask"])
