"""The documentation stays a front door and true to the tree: the README is short, every relative link of
`README.md` and `docs/*.md` reaches an existing file (and heading), docs/design.md stays readable in one
sitting, and every test file has its row in docs/testing.md's table. Reads files only: no target, no model,
no MLflow."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
DESIGN = DOCS / "design.md"
TESTING = DOCS / "testing.md"
README_LIMIT = 12_000
DESIGN_LIMIT = 25_000  # one sitting: the design alone (metric keys: metrics.md, tests: TESTING, history: CHANGELOG)
TEST_TABLE = "## What each file covers"

FENCE = re.compile(r"^```.*?^```[^\n]*$", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.M)


def _pages() -> list[Path]:
    return [README, ROOT / "CHANGELOG.md", *sorted(DOCS.glob("*.md"))]


def _prose(text: str) -> str:
    """`text` without fenced code blocks and code spans, where brackets and '#' are not Markdown."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, title in HEADING.findall(FENCE.sub("", path.read_text())):
        slug = _slug(title)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_docs_exist():
    assert DESIGN.is_file(), "docs/design.md is the design of the workbench"
    assert len(_pages()) > 2


def test_readme_is_a_front_door():
    size = len(README.read_text())
    assert size < README_LIMIT, f"README.md has {size} characters; move detail into docs/ (limit {README_LIMIT})"


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path):
    broken = []
    for target in LINK.findall(_prose(page.read_text())):
        if SCHEME.match(target):
            continue  # http(s), mailto: not checked here
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target} (no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest})")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no heading with anchor #{anchor} in {dest.relative_to(ROOT)})")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {'; '.join(broken)}"


def test_the_design_is_read_in_one_sitting():
    size = len(DESIGN.read_text())
    assert size <= DESIGN_LIMIT, f"docs/design.md has {size} characters; keep it to the design (limit {DESIGN_LIMIT})"


def _test_table_files() -> set[str]:
    text = TESTING.read_text()
    assert TEST_TABLE in text, f"docs/testing.md needs the section '{TEST_TABLE}'"
    section = text.split(TEST_TABLE, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    return {m for row in rows for m in re.findall(r"tests/[\w.]+\.py", row.split("|")[1])}


def test_every_test_file_has_a_row_in_the_test_table():
    listed = _test_table_files()
    missing = sorted(p.name for p in (ROOT / "tests").glob("test_*.py") if f"tests/{p.name}" not in listed)
    assert not missing, f"docs/testing.md's table '{TEST_TABLE}' has no row for: {', '.join(missing)}"
    stale = sorted(f for f in listed if not (ROOT / f).is_file())
    assert not stale, f"docs/testing.md's test table names files that do not exist: {', '.join(stale)}"


def test_the_readme_sweep_example_is_the_one_documented():
    """tests/test_sweep.py composes the README's first YAML block; docs/experiments.md shows the same spec."""

    def first_yaml(path: Path) -> str:
        return path.read_text().split("```yaml\n", 1)[1].split("```", 1)[0]

    assert first_yaml(README) == first_yaml(DOCS / "experiments.md")


def test_help_names_every_experiment_and_sweep():
    """`lab --help` lists the studies from their folders: a new experiments/ or sweeps/ file shows up."""
    import subprocess
    import sys

    said = subprocess.run(
        [sys.executable, "-m", "lab.cli", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for folder in ("experiments", "sweeps"):
        names = sorted(p.stem for p in (ROOT / folder).glob("*.yaml"))
        assert names and f"{folder} ({folder}/): {' '.join(names)}" in said
