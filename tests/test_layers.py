"""Layers that import one way: every import of `lab/` (at module level and inside functions) goes to a layer
its importer may use, and no modules import each other in a circle (docs/design.md, "Import rules")."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAB = ROOT / "lab"

EVERYTHING = {"config", "metrics", "base", "target", "data", "drafter", "train", "eval", "track", "preflight"}
EVERYTHING |= {"pipeline", "sweep", "report"}
# layer: the other layers its modules may import. docs/design.md's "Import rules" table says the same; the
# last test keeps the two equal. `config` (the schema and its own modules, CONFIG_ORDER) and `metrics` (the
# metric keys) import nothing of lab besides themselves.
ALLOWED: dict[str, set[str]] = {
    "config": set(),
    "metrics": set(),
    "base": {"config", "metrics"},
    "target": {"config", "metrics", "base"},
    "data": {"config", "metrics", "base", "target"},
    "drafter": {"config", "metrics", "base"},
    "train": {"config", "metrics", "base", "target", "data", "drafter"},
    "eval": {"config", "metrics", "base", "target", "data", "drafter"},
    "track": {"config", "metrics", "base"},
    "preflight": {"config", "metrics", "base", "target", "data", "drafter"},
    "pipeline": {"config", "metrics", "base", "target", "data", "drafter", "train", "eval", "track"},
    "sweep": {"config", "metrics", "base", "preflight", "pipeline", "track"},
    "report": {"config", "metrics", "base", "track"},
    "cli": EVERYTHING,
}
BASE = {"lab", "lab.fsutil", "lab.assets", "lab.schedule", "lab.device"}
# the config layer in the order its modules import each other: each imports only those before it (docs/design.md)
CONFIG_ORDER = [
    "rules",  # the rule engine of the config's and the spec files' schemas
    "config",  # the schema, its enums, ConfigError and constants
    "shape",  # the target's shape from the config and a HF folder's config.json
    "validation",  # checks of a whole config
    "composition",  # Hydra composition and its one-line errors
    "identity",  # flatten, config_hash, arm_name
]
CONFIG_LAYER = {f"lab.{name}" for name in CONFIG_ORDER}


def layer(module: str) -> str | None:
    """The layer of a module of `lab`: config, base, a stage's package, or one of the modules above them."""
    if module in CONFIG_LAYER:
        return "config"
    if module in BASE:
        return "base"
    name = module.split(".")[1]
    return name if name in ALLOWED else None


def modules(root: Path, package: str = "lab") -> dict[str, Path]:
    """Every module of the package at `root` by dotted name (a package by its `__init__.py`)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(root: Path, package: str = "lab") -> list[tuple[str, str, str]]:
    """(importer, imported, "file:line") for every import of a module of the package by another, wherever
    it stands in the file. `from pkg import name` goes to the module `pkg.name` when there is one, else to
    `pkg`; `import pkg.a.b` to `pkg.a.b`; relative imports are resolved."""
    known = modules(root, package)
    edges = []
    for importer, path in known.items():
        is_package = path.name == "__init__.py"
        rel = path.relative_to(root.parent)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = importer.split(".")[: len(importer.split(".")) - node.level + is_package]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            for target in targets:
                if target != package and not target.startswith(package + "."):
                    continue
                while target and target not in known:  # `import lab.x.y.name`: the longest module prefix
                    target = target.rpartition(".")[0]
                if target and target != importer:
                    edges.append((importer, target, f"{rel}:{node.lineno}"))
    return sorted(edges, key=lambda e: (e[0], int(e[2].rsplit(":", 1)[1]), e[1]))


def circles(edges: list[tuple[str, str, str]]) -> list[list[tuple[str, str, str]]]:
    """Circles of imports, each as its edges in order: the shortest one back to each module that is on a
    circle and on none found before it."""
    graph: dict[str, dict[str, str]] = {}
    for a, b, where in edges:
        graph.setdefault(a, {}).setdefault(b, where)
    found, seen = [], set()
    for start in sorted(graph):
        if start in seen:
            continue
        path = _path(graph, start, start)
        if path:
            found.append(path)
            seen.update(a for a, _, _ in path)
    return found


def _path(graph: dict[str, dict[str, str]], start: str, goal: str) -> list[tuple[str, str, str]] | None:
    """The shortest chain of imports from `start` back to `goal`, or None (breadth first)."""
    previous: dict[str, tuple[str, str]] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for a in frontier:
            for b, where in sorted(graph.get(a, {}).items()):
                if b == goal:
                    chain = [(a, b, where)]
                    while chain[0][0] != start:
                        prev, w = previous[chain[0][0]]
                        chain.insert(0, (prev, chain[0][0], w))
                    return chain
                if b not in previous and b != start:
                    previous[b] = (a, where)
                    nxt.append(b)
        frontier = nxt
    return None


def wrong_layers(edges: list[tuple[str, str, str]]) -> list[str]:
    """One line per import of a layer its importer may not use (or of a module no layer holds)."""
    problems = []
    for a, b, where in edges:
        la, lb = layer(a), layer(b)
        if la is None or lb is None:
            unknown = a if la is None else b
            problems.append(f"{where}: {unknown} belongs to no layer: add it to ALLOWED and docs/design.md")
        elif la != lb and lb not in ALLOWED[la]:
            may = ", ".join(sorted(ALLOWED[la])) or "nothing of lab"
            problems.append(f"{where}: {a} ({la}) -> {b} ({lb}); {la} may import {may}")
    return problems


def _said(circle: list[tuple[str, str, str]]) -> str:
    return " -> ".join([circle[0][0], *(f"{b} ({where})" for _, b, where in circle)])


def test_lab_imports_in_no_circle():
    found = circles(imports(LAB))
    assert not found, "modules of lab import each other:\n" + "\n".join(_said(c) for c in found)


def test_no_layer_imports_a_later_one():
    problems = wrong_layers(imports(LAB))
    assert not problems, "imports across layers that docs/design.md forbids:\n" + "\n".join(problems)


def test_config_and_metrics_import_nothing_of_lab():
    """metrics imports nothing of lab; the config layer's modules only those before them in CONFIG_ORDER."""
    assert [e for e in imports(LAB) if e[0] == "lab.metrics"] == []
    rank = {f"lab.{name}": i for i, name in enumerate(CONFIG_ORDER)}
    wrong = [
        f"{where}: {a} -> {b}" for a, b, where in imports(LAB) if a in rank and (b not in rank or rank[b] >= rank[a])
    ]
    assert not wrong, "config layer modules importing other than an earlier one (CONFIG_ORDER):\n" + "\n".join(wrong)


def test_the_design_states_the_same_config_order():
    text = (ROOT / "docs" / "design.md").read_text()
    bullet = " ".join(text.split("- The config layer's modules import one way", 1)[1].split("\n- ", 1)[0].split())
    stated = re.findall(r"`lab/([a-z_]+)\.py`", bullet.split("before it in", 1)[1].split(". ", 1)[0])
    assert stated == CONFIG_ORDER


def test_the_checker_finds_circles_and_later_stages(tmp_path):
    """The checks above can fail: a made-up package with a circle through a lazy import and a drafter that
    imports the trainer, both reported with the importing file and line."""
    pkg = tmp_path / "lab"
    for name, text in {
        "__init__.py": "",
        "config.py": "import os\n",
        "drafter/__init__.py": "from lab.drafter.model import Drafter\n",
        "drafter/model.py": "from lab import config\n\n\ndef spec():\n    from lab.train import ttt\n",
        "train/__init__.py": "",
        "train/ttt.py": "from lab.drafter import Drafter\nfrom . import step\n",
        "train/step.py": "def loss():\n    import lab.train.ttt.loss\n",
    }.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    edges = imports(pkg)
    assert ("lab.train.ttt", "lab.train.step", "lab/train/ttt.py:2") in edges  # relative, resolved
    assert ("lab.train.step", "lab.train.ttt", "lab/train/step.py:2") in edges  # inside a function
    said = "\n".join(_said(c) for c in circles(edges))
    assert said == (
        "lab.drafter -> lab.drafter.model (lab/drafter/__init__.py:1) -> lab.train.ttt (lab/drafter/model.py:5)"
        " -> lab.drafter (lab/train/ttt.py:1)\n"
        "lab.train.step -> lab.train.ttt (lab/train/step.py:2) -> lab.train.step (lab/train/ttt.py:2)"
    )
    assert wrong_layers(edges) == [
        "lab/drafter/model.py:5: lab.drafter.model (drafter) -> lab.train.ttt (train); "
        "drafter may import base, config, metrics"
    ]


def test_config_knows_the_chat_templates_by_name():
    """lab/validation.py checks template names without importing the target stage: lab/config.py's list is
    chat.py's."""
    from lab.config import TEMPLATE_NAMES
    from lab.target.chat import TEMPLATES

    assert TEMPLATE_NAMES == tuple(TEMPLATES)


def test_the_design_states_the_same_rules():
    """docs/design.md's "Import rules" table: one row per layer, its modules and what it may import."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("### Import rules", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:-1] for line in section.splitlines() if line.startswith("| `")]
    stated = {}
    for name, _modules, may in rows:
        named = set(re.findall(r"`([a-z]+)`", may)) - {"lab"}  # "nothing of `lab`"
        stated[name.strip().strip("`")] = EVERYTHING if may.strip() == "everything" else named
    assert stated == ALLOWED


# lab/sweep/ in the order its data flows: each module imports only those before it (docs/design.md says the same)
SWEEP_ORDER = [
    "schema",  # the spec files' structured schema: imports nothing of lab
    "specfile",
    "spec",
    "experiment",
    "find",  # a study's parent run, its seeds, an arm's config, in a store (the CLI's look-ups)
    "optuna_adapter",  # the only module that touches Optuna's private API
    "storage",
    "queue",
    "summary",
    "heartbeat",
    "trial",
    "workers",
    "engine",
    "dashboard",
    "optuna_archive",  # the Optuna part of a study's archive (`lab study`)
]


def test_sweep_modules_import_one_way():
    sweep = {m for m in modules(LAB) if m.startswith("lab.sweep.")}
    unplaced = sorted(m for m in sweep if m.removeprefix("lab.sweep.") not in SWEEP_ORDER)
    assert not unplaced, f"place these in SWEEP_ORDER (and docs/design.md): {unplaced}"
    rank = {f"lab.sweep.{name}": i for i, name in enumerate(SWEEP_ORDER)}
    backwards = [
        f"{where}: {a} -> {b}" for a, b, where in imports(LAB) if a in rank and b in rank and rank[b] >= rank[a]
    ]
    assert not backwards, "lab/sweep/ modules importing a later one (SWEEP_ORDER):\n" + "\n".join(backwards)


def test_the_spec_schema_imports_only_the_rule_engine():
    assert {e[1] for e in imports(LAB) if e[0] == "lab.sweep.schema"} == {"lab.rules"}


# Optuna's private API: underscored attributes (`_trial_id`, ...) and what optuna.storages does not export
OPTUNA_PRIVATE = {"get_storage"}


def test_only_the_adapter_touches_optunas_private_api():
    """Every private name of Optuna the workbench needs is used in lab/sweep/optuna_adapter.py, so that an
    Optuna upgrade that changes them changes that file only."""
    found = []
    for name, path in modules(LAB).items():
        tree = ast.parse(path.read_text(), str(path))
        imports_optuna = any(
            (isinstance(n, ast.Import) and any(a.name.split(".")[0] == "optuna" for a in n.names))
            or (isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "optuna")
            for n in ast.walk(tree)
        )
        if name == "lab.sweep.optuna_adapter" or not imports_optuna:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and (
                node.attr in OPTUNA_PRIVATE or (node.attr.startswith("_") and not node.attr.startswith("__"))
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}")
    assert not found, "Optuna's private API outside lab/sweep/optuna_adapter.py:\n" + "\n".join(found)
    adapter = (LAB / "sweep" / "optuna_adapter.py").read_text()
    assert "._trial_id" in adapter and "get_storage(" in adapter  # the check above looks for the right names


def test_the_design_states_the_same_sweep_order():
    text = (ROOT / "docs" / "design.md").read_text()
    bullet = " ".join(text.split("- Inside `lab/sweep/` data flows one way too", 1)[1].split("\n- ", 1)[0].split())
    stated = re.findall(r"`([a-z_]+)`", bullet.split("before it in", 1)[1].split(". ", 1)[0])
    assert stated == SWEEP_ORDER
