"""Resume states of the TTT trainer: an interrupted `lab run` continues where it stopped.

Layout: `{cache_dir}/resume/{key}/` with `model.safetensors` (the drafter's state),
`optimizer.safetensors` (AdamW's per-parameter state), `data.safetensors` (the data-order permutation
and the generator state), `state.json` (step, cursor, the metrics window and history, float16's loss scale) and
`manifest.json` (each file's sha256, `step`, `steps`, the MLflow run that wrote it). Safetensors and
JSON only, no pickle. The key hashes everything that determines the trained weights, so a resume state
is only ever resumed by the same training. One with `step < steps` is partial: it resumes training and is
never taken for a finished drafter (that one is the MLflow run's checkpoint artifact). A file that does not
match its manifest hash is refused with one line and training starts from scratch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from lab import signals
from lab.config import ConfigError
from lab.fsutil import (
    IDENTITY,
    Identity,
    entry_name,
    mismatched_file,
    read_manifest,
    sha256_file,
    short_hash,
    staging_dir,
)
from lab.signals import Interrupted

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FILES = ("model.safetensors", "optimizer.safetensors", "data.safetensors", "state.json", "best.safetensors")
FORMAT = 2  # 2: the validation pass's history and, with train.select=best, the best pass's weights
# keys that change how a run is watched or whether it trains, not the weights it trains
_NOT_IN_KEY = ("resume_every", "log_every", "reuse")
# the validation pass only watches a training that keeps its last weights (train.select=last)
_WATCHING = ("val_prompts", "val_every", "val_new_tokens", "select", "select_k")
# the code that turns a training's config into weights: lab/ paths, hashed into `drafter_key`
TRAINING_CODE = ("train", "drafter", "schedule.py", "device.py")


def training_identity(cfg: DictConfig, target_fingerprint: str, aux_layers: list[int]) -> Identity:
    """Everything in the config that determines the trained weights: what `training_key` hashes, and what a
    resume state records, so that one moved or copied under another training's key is refused."""
    train = OmegaConf.to_container(cfg.train, resolve=True, enum_to_str=True)
    for k in _NOT_IN_KEY + (_WATCHING if train.get("select", "last") == "last" else ()):
        train.pop(k, None)
    return Identity(
        {
            "format": FORMAT,
            "target": target_fingerprint,
            "data": OmegaConf.to_container(cfg.data, resolve=True, enum_to_str=True),
            "aux": list(aux_layers),
            "drafter": OmegaConf.to_container(cfg.drafter, resolve=True, enum_to_str=True),
            "train": train,
            "seed": cfg.seed,
        }
    )


def training_key(cfg: DictConfig, target_fingerprint: str, aux_layers: list[int]) -> str:
    """Everything in the config that determines the trained weights, hashed."""
    return training_identity(cfg, target_fingerprint, aux_layers).key()


def check_identity(path: Path, identity: Identity) -> None:
    """Refuse a resume state at `path` that records another identity: another training's progress, moved or copied
    under this key, which training here from scratch would write over. One that records none is taken as it
    stands (`load` still checks its hashes, format and steps)."""
    manifest = read_manifest(path, MANIFEST)
    wrong = identity.mismatch(manifest)
    if wrong is not None:
        own = f"resume/{Identity(manifest[IDENTITY]).key()}"
        raise ConfigError(
            "cache_dir", f"resume state {entry_name(path)}: {wrong}; it belongs at {own}: move it there or delete it"
        )


def state_dir(cfg: DictConfig, target_fingerprint: str, aux_layers: list[int]) -> Path:
    """Where the resume state of this training lives."""
    return Path(cfg.cache_dir) / "resume" / training_key(cfg, target_fingerprint, aux_layers)


def drafter_key(cfg: DictConfig, target_fingerprint: str, aux_layers: list[int], external: dict[str, str]) -> str:
    """The identity of a trained drafter (a run's tag `train_key`): its training key, the training code,
    torch's version and `external` (the versions of other code that trains, e.g. TorchSpec's). Two runs
    with the same key train the same weights (bit for bit on the same thread count), so a finished one's
    drafter stands for the other's (`train.reuse`); a change to the code that trains, even a comment,
    gives new keys rather than a drafter trained by other code."""
    root = Path(__file__).resolve().parents[1]
    files = sorted(
        file
        for name in TRAINING_CODE
        for file in ((root / name).rglob("*.py") if (root / name).is_dir() else [root / name])
    )
    code = {str(f.relative_to(root)): sha256_file(f) for f in files}
    training = training_key(cfg, target_fingerprint, aux_layers)
    return short_hash({"training": training, "code": code, "torch": torch.__version__, "external": external})


@dataclass
class ResumeState:
    """Everything the trainer needs to continue bit for bit after `step` of `steps` steps."""

    step: int
    steps: int
    model: dict[str, torch.Tensor]
    optimizer: dict[int, dict[str, torch.Tensor]]  # AdamW state per parameter index (`step` is a tensor)
    order: torch.Tensor  # the current epoch's permutation of the training sequences
    cursor: int  # the next position in `order`
    generator: torch.Tensor  # torch.Generator state (draws the next permutations)
    log_every: int
    window: list[dict] = field(default_factory=list)  # per-step stats since the last log
    history: list[tuple[int, dict[str, float]]] = field(default_factory=list)  # every (step, metrics) logged
    run_id: str | None = None
    scaler: dict = field(default_factory=dict)  # float16's GradScaler (its loss scale); empty otherwise
    validation: dict = field(default_factory=dict)  # the validation pass's passes so far (lab/train/ttt.py)
    best: dict[str, torch.Tensor] = field(default_factory=dict)  # train.select=best: the best pass's weights


@dataclass
class ResumeWriter:
    """Where and when the trainer writes its resume state: to `path` every `every` steps, after the last and
    on a stop request (Ctrl-C); `run_id` is recorded as the run that wrote it."""

    path: Path
    every: int
    run_id: str | None = None
    identity: Identity | None = None  # recorded in each state it writes

    def due(self, step: int, steps: int, stopping: bool) -> bool:
        """Whether the state after `step` (counted from 1) of `steps` is written."""
        return step % self.every == 0 or step == steps or stopping

    def write(self, state: ResumeState) -> None:
        save(self.path, state, self.identity)


def save(path: Path, state: ResumeState, identity: Identity | None = None) -> None:
    """Write `state` to `path`, replacing what is there atomically: staged beside it, flushed, renamed into
    place, so a full disk or a crash leaves the old state (or, killed between its two renames, none: training
    then starts from scratch), never a partial one; a killed write's leftover is removed by the next."""
    with staging_dir(path) as tmp:
        save_file({k: v.contiguous() for k, v in state.model.items()}, str(tmp / "model.safetensors"))
        opt = {f"{i}.{name}": t.contiguous() for i, s in state.optimizer.items() for name, t in s.items()}
        save_file(opt, str(tmp / "optimizer.safetensors"))
        save_file({"order": state.order, "generator": state.generator}, str(tmp / "data.safetensors"))
        save_file({k: v.contiguous() for k, v in state.best.items()}, str(tmp / "best.safetensors"))
        info = {
            "cursor": state.cursor,
            "log_every": state.log_every,
            "window": state.window,
            "history": state.history,
            "scaler": state.scaler,
            "validation": state.validation,
        }
        (tmp / "state.json").write_text(json.dumps(info))
        manifest = {
            "format": FORMAT,
            "step": state.step,
            "steps": state.steps,
            "run_id": state.run_id,
            "files": {name: sha256_file(tmp / name) for name in FILES},
            **({IDENTITY: identity.fields} if identity else {}),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))


def load(path: Path, steps: int) -> ResumeState | None:
    """The resume state at `path` if there is a valid one for `steps` total steps, else None; one that fails
    its manifest is refused with one printed line (and never used)."""
    mf = path / MANIFEST
    if not mf.is_file():
        return None

    def refuse(why: str) -> None:
        logger.warning(f"resume state {path}: {why}; ignoring it, training from scratch")

    try:
        manifest = json.loads(mf.read_text())
        files, step = manifest["files"], int(manifest["step"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        return refuse(f"{MANIFEST} is unreadable (corrupted)")
    if manifest.get("format") != FORMAT or sorted(files) != sorted(FILES):
        return refuse(f"format {manifest.get('format')} is not this trainer's ({FORMAT})")
    if manifest.get("steps") != steps or not 0 < step <= steps:
        return refuse(f"written at step {step} of {manifest.get('steps')}, not of {steps} steps")
    bad = mismatched_file(path, files)
    if bad is not None:
        return refuse(f"{bad} does not match its manifest hash (corrupted or truncated)")
    try:
        opt: dict[int, dict[str, torch.Tensor]] = {}
        for name, t in load_file(str(path / "optimizer.safetensors")).items():
            index, key = name.split(".", 1)
            opt.setdefault(int(index), {})[key] = t
        data = load_file(str(path / "data.safetensors"))
        info = json.loads((path / "state.json").read_text())
        return ResumeState(
            step=step,
            steps=steps,
            model=load_file(str(path / "model.safetensors")),
            optimizer=opt,
            order=data["order"],
            cursor=int(info["cursor"]),
            generator=data["generator"],
            log_every=int(info["log_every"]),
            window=info["window"],
            history=[(int(s), m) for s, m in info["history"]],
            run_id=manifest.get("run_id"),
            scaler=info.get("scaler", {}),  # a state.json without one: no loss scale to restore
            validation=info["validation"],
            best=load_file(str(path / "best.safetensors")),
        )
    except (SafetensorError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        return refuse(f"unreadable ({type(exc).__name__}: {exc})")


def discard(path: Path) -> None:
    """Remove the resume state (its run finished: the drafter is in MLflow)."""
    shutil.rmtree(path, ignore_errors=True)


class StopRequest:
    """A stopping signal while training (Ctrl-C, SIGTERM, SIGUSR1: lab/signals.py): the trainer finishes its
    step, writes a resume state and raises `Interrupted`, so nothing computed is lost; a second signal (a second or
    more after the first) interrupts at once. Only in the main thread and where the process takes those signals
    as lab sets them (elsewhere, signals stay as they are)."""

    SAME_STOP_S = 1.0  # a signal that comes this soon after the first is the same stop, delivered twice

    def __init__(self) -> None:
        self.requested = False
        self.signum = signal.SIGINT
        self._at = 0.0

    def _handle(self, signum, frame) -> None:
        # a scheduler's signal to the process group reaches a worker both directly and through its launcher
        if self.requested and time.monotonic() - self._at > self.SAME_STOP_S:
            raise Interrupted(signum)
        if self.requested:
            return
        self.requested, self.signum, self._at = True, signum, time.monotonic()
        name = signal.Signals(signum).name
        logger.warning(f"{name}: stopping after this step (a resume state is written); a second signal stops at once")

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopRequest]:
        if threading.current_thread() is not threading.main_thread() or not signals.installed():
            yield self
            return
        before = {signum: signal.getsignal(signum) for signum in signals.STOPPING}
        for signum in signals.STOPPING:
            signal.signal(signum, self._handle)
        try:
            yield self
        finally:
            for signum, handler in before.items():
                signal.signal(signum, handler)
