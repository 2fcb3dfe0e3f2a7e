"""Safety by construction: no code path of the workbench unpickles (a checkpoint, a cache or a download
could then run code when loaded), and everything that serves listens on 127.0.0.1 unless told otherwise.
Each checker is also run on known-bad input, so that a checker that finds nothing is caught."""

from __future__ import annotations

import argparse
import ast
import inspect
import re
from pathlib import Path

import pytest

from lab import track
from lab.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
LOOPBACK = ("127.0.0.1", "localhost", "::1")

# modules whose load functions unpickle: importing one at all is refused
PICKLING_MODULES = ("pickle", "_pickle", "cPickle", "cloudpickle", "dill", "joblib", "shelve")
UNPICKLING_CALLS = ("pandas.read_pickle", "yaml.unsafe_load", "yaml.full_load")
TORCH_LOADS = ("torch.load", "torch.serialization.load")


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> full dotted name, from the module's imports (`np` -> numpy, `load` -> torch.load)."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                names[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def _keyword(call: ast.Call, name: str) -> ast.AST | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_true(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def unsafe_loads(source: str, where: str = "<source>") -> list[str]:
    """Every import of a pickling module and every call that may unpickle, as `where:line: what`."""
    tree = ast.parse(source)
    aliases = _aliases(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for m in modules:
                if m.split(".")[0] in PICKLING_MODULES:
                    found.append(f"{where}:{node.lineno}: import {m}")
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        if name is None:
            continue
        head, _, rest = name.partition(".")
        full = ".".join(filter(None, [aliases.get(head, head), rest]))
        unpacked = any(k.arg is None for k in node.keywords)  # **kwargs: the keyword cannot be checked
        if full in TORCH_LOADS and (unpacked or not _is_true(_keyword(node, "weights_only"))):
            found.append(f"{where}:{node.lineno}: {full}(...) without weights_only=True")
        elif full == "numpy.load" and (unpacked or _keyword(node, "allow_pickle") is not None):
            allow = _keyword(node, "allow_pickle")
            if unpacked or not (isinstance(allow, ast.Constant) and allow.value is False):
                found.append(f"{where}:{node.lineno}: numpy.load(...) with allow_pickle")
        elif full == "yaml.load":
            loader = _dotted(_keyword(node, "Loader")) if _keyword(node, "Loader") is not None else None
            if not (loader and loader.endswith("SafeLoader")):
                found.append(f"{where}:{node.lineno}: yaml.load(...) without a SafeLoader")
        elif full in UNPICKLING_CALLS or full.split(".")[0] in PICKLING_MODULES:
            found.append(f"{where}:{node.lineno}: {full}(...)")
    return found


# the same for shell scripts (and a `python -c` in them): by text
_SHELL_UNSAFE = [
    re.compile(r"\bimport\s+(c?pickle|dill|joblib|shelve)\b"),
    re.compile(r"\bpickle\.loads?\("),
    re.compile(r"\btorch\.load\((?![^)]*weights_only\s*=\s*True)"),
    re.compile(r"allow_pickle\s*=\s*True"),
]


def unsafe_shell(text: str, where: str = "<script>") -> list[str]:
    return [
        f"{where}:{i}: {line.strip()}"
        for i, line in enumerate(text.splitlines(), 1)
        if any(p.search(line) for p in _SHELL_UNSAFE)
    ]


def _sources() -> list[Path]:
    files = sorted((ROOT / "lab").rglob("*.py")) + sorted(p for p in (ROOT / "scripts").rglob("*") if p.is_file())
    assert any(p.name == "formats.py" for p in files)  # the walk found the package
    return files


def test_no_source_unpickles():
    found = []
    for path in _sources():
        rel = str(path.relative_to(ROOT))
        text = path.read_text(encoding="utf-8", errors="replace")
        found += unsafe_loads(text, rel) if path.suffix == ".py" else unsafe_shell(text, rel)
    assert not found, "\n".join(found)


UNSAFE_PY = [
    "import pickle",
    "import pickle as p",
    "from pickle import loads",
    "import dill",
    "import torch\ntorch.load('x.pt')",
    "import torch\ntorch.load('x.pt', weights_only=False)",
    "import torch\ntorch.load('x.pt', map_location='cpu', **opts)",
    "import torch as T\nT.load(f)",
    "from torch import load\nload(f)",
    "import numpy as np\nnp.load('x.npy', allow_pickle=True)",
    "import numpy\nnumpy.load('x.npy', allow_pickle=flag)",
    "import yaml\nyaml.load(text)",
    "import yaml\nyaml.unsafe_load(text)",
    "import pandas as pd\npd.read_pickle('x.pkl')",
]
SAFE_PY = [
    "import torch\ntorch.load('x.pt', weights_only=True)",
    "import torch\ntorch.load('x.pt', map_location='cpu', weights_only=True)",
    "import numpy as np\nnp.load('x.npy')",
    "import numpy as np\nnp.load('x.npy', allow_pickle=False)",
    "import yaml\nyaml.safe_load(text)",
    "import yaml\nyaml.load(text, Loader=yaml.SafeLoader)",
    "from safetensors.torch import load_file\nload_file('x.safetensors')",
    "import json\njson.load(f)",
]


@pytest.mark.parametrize("source", UNSAFE_PY)
def test_the_checker_finds_unpickling(source):
    assert unsafe_loads(source), source


@pytest.mark.parametrize("source", SAFE_PY)
def test_the_checker_passes_safe_loading(source):
    assert not unsafe_loads(source), source


def test_the_shell_checker_finds_unpickling():
    assert unsafe_shell('python -c \'import pickle; pickle.load(open("x", "rb"))\'')
    assert unsafe_shell("python -c 'import torch; torch.load(\"x.pt\")'")
    assert not unsafe_shell("python -c 'import torch; torch.load(\"x.pt\", weights_only=True)'")


# ------------------------------------------------------------------------------------------- listening


def test_ui_command_binds_loopback_by_default():
    cmd = track.ui_command("sqlite:///mlruns/mlflow.db", "mlruns/artifacts")
    assert "--host" in cmd and cmd[cmd.index("--host") + 1] == "127.0.0.1", cmd


def test_every_server_command_defaults_to_loopback():
    """Every `track.*_command` that takes a host (ui_command, and any server added later) defaults to it."""
    hosts = {
        name: inspect.signature(fn).parameters["host"].default
        for name, fn in vars(track).items()
        if name.endswith("_command") and callable(fn) and "host" in inspect.signature(fn).parameters
    }
    assert "ui_command" in hosts
    assert all(h == "127.0.0.1" for h in hosts.values()), hosts


def test_every_cli_host_option_defaults_to_loopback():
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    defaults = {
        verb: action.default
        for verb, sub in subparsers.choices.items()
        for action in sub._actions
        if "--host" in action.option_strings
    }
    assert "ui" in defaults
    assert all(d == "127.0.0.1" for d in defaults.values()), defaults
    assert parser.parse_args(["ui"]).host == "127.0.0.1"


# a script that starts a server: PostgreSQL (pg_ctl, the postgres binary) or MLflow (server, ui)
_STARTS_SERVER = re.compile(r"\bpg_ctl(cluster)?\b|(^|[\s/\"'])postgres\s+-D\b|\bmlflow\s+(server|ui)\b", re.M)
# the address it binds: postgres' listen_addresses, mlflow's --host
_BINDS = re.compile(r"listen_addresses\s*=\s*['\"]?([^\s'\"]+)|--host[=\s]+['\"]?([^\s'\"]+)")


def _default_value(text: str, value: str, depth: int = 0) -> str:
    """A shell word's value when no environment variable is set: `$HOST` with `HOST=${LAB_HOST:-127.0.0.1}`
    is 127.0.0.1; a variable without an assignment in the script stays as written."""
    m = re.fullmatch(r"\$\{?(\w+)\}?", value)
    if not m or depth > 5:
        return value
    assign = re.search(rf"^\s*(?:export\s+|local\s+|readonly\s+)?{m[1]}=(\S+)", text, re.M)
    if not assign:
        return value
    word = assign[1].strip("'\"")
    fallback = re.fullmatch(r"\$\{\w+:?-([^}]*)\}", word)
    return _default_value(text, fallback[1] if fallback else word, depth + 1)


def server_binds(text: str) -> list[str] | None:
    """The addresses a script that starts a server binds by default, or None when it starts none."""
    if not _STARTS_SERVER.search(text):
        return None
    return [_default_value(text, a or b) for a, b in _BINDS.findall(text)]


def test_scripts_that_start_a_server_bind_loopback():
    checked = {}
    for path in sorted(p for p in (ROOT / "scripts").rglob("*") if p.is_file()):
        binds = server_binds(path.read_text(encoding="utf-8", errors="replace"))
        if binds is None:
            continue
        checked[path.name] = binds
        assert binds, f"{path.name} starts a server without naming its address (listen_addresses / --host)"
        assert all(b in LOOPBACK for b in binds), f"{path.name} binds {binds} by default"
    if (ROOT / "scripts" / "postgres.sh").is_file():
        assert "postgres.sh" in checked  # the check recognises the one that exists


BAD_SCRIPTS = [
    'pg_ctl -D "$DIR" -o "-c listen_addresses=0.0.0.0" start',
    'pg_ctl -D "$DIR" -o "-c listen_addresses=\'*\'" start',
    'HOST=${LAB_PG_HOST:-0.0.0.0}\npg_ctl -D "$DIR" -o "-c listen_addresses=$HOST" start',
    'pg_ctl -D "$DIR" start',  # the cluster's own setting, unknown here
    "mlflow server --backend-store-uri sqlite:///x.db --host 0.0.0.0",
    'HOST="${HOST:-::}"\npython -m mlflow ui --host "$HOST"',
]
GOOD_SCRIPTS = [
    'HOST=${LAB_PG_HOST:-127.0.0.1}\npg_ctl -D "$DIR" -o "-c listen_addresses=$HOST -p 5432" start',
    "mlflow server --backend-store-uri sqlite:///x.db --host 127.0.0.1 --port 5000",
]


@pytest.mark.parametrize("text", BAD_SCRIPTS)
def test_the_script_checker_finds_open_binds(text):
    binds = server_binds(text)
    assert binds is not None and (not binds or any(b not in LOOPBACK for b in binds)), binds


@pytest.mark.parametrize("text", GOOD_SCRIPTS)
def test_the_script_checker_passes_loopback(text):
    binds = server_binds(text)
    assert binds and all(b in LOOPBACK for b in binds), binds
    assert server_binds("echo 'open http://127.0.0.1:5000 after: lab ui'") is None
