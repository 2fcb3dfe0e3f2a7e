"""The documentation stays a front door and true to the tree: the README is short, every relative link of the
README, the CHANGELOG and `docs/**/*.md` reaches an existing file (and heading), docs/design.md stays short enough
to read at once, every test file has its row in docs/testing.md's table, and no page tells how the workbench was
made instead of how it is used. Reads files only: no target, no model, no MLflow."""

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
DESIGN_LIMIT = 25_000  # read at once: the design alone (metric keys: metrics.md, tests: TESTING, history: CHANGELOG)
TEST_TABLE = "## What each file covers"

FENCE = re.compile(r"^```.*?^```[^\n]*$", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.M)
# Words that tell of the workbench's making (who lent which machine, its upload limits, sittings, issue, ticket and
# stop numbers) rather than of its use. Peers' issues cited as `project#N` or `owner/repo#N` are references.
MAKING = re.compile(
    "|".join(
        (
            r"\bsittings?\b",
            r"\bsessions?\b",
            r"\blent\b",
            r"\bborrow(?:s|ed|ing)?\b",
            r"\bloans?\b",
            r"\bdevice[- ](?:time|seconds|minutes|budget)\b",
            r"\bmachine's budget\b",
            r"\b(?:one|two|three|four|five|\d+) carries\b|\b(?:a|one|per) carry\b",  # uploads, counted
            r"\bcarr(?:y|ies|ied) with the tree\b",
            r"\bupload limits?\b",
            r"\bone call's\b",
            r"\bstops? \d+",
            r"\bissues? #?\d+",
            r"(?<![\w/.-])(?<!PR )#\d+\b",  # a bare "#53"; a peer's `PR #97` or `vllm#42508` is a reference
            r"\btickets?\b",
            r"\bdevice tool\b",
            r"\bthe project's (?:own )?machines?\b",
            r"\bfarm-(?:bench|studio)\b",
        )
    ),
    re.I,
)
# What those words may name in this project: pytest's session scope, the summary file scripts/gpu_session.sh writes
ALLOWED = re.compile(r"\bsession[- ]scoped\b|\bsession\.md\b", re.I)


def _pages() -> list[Path]:
    return [README, ROOT / "CHANGELOG.md", *sorted(DOCS.glob("*.md"))]


def _all_pages() -> list[Path]:
    """Every page a reader opens: the README, the CHANGELOG and docs/ with its results."""
    return [README, ROOT / "CHANGELOG.md", *sorted(DOCS.rglob("*.md"))]


def making_words(text: str) -> list[tuple[int, str]]:
    """(line number, phrase) of each word in `text` that tells of the workbench's making."""
    hits = []
    for number, line in enumerate(text.splitlines(), 1):
        line = ALLOWED.sub(lambda allowed: " " * len(allowed.group()), line)
        hits += [(number, found.group()) for found in MAKING.finditer(line)]
    return hits


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


@pytest.mark.parametrize("page", _all_pages(), ids=lambda p: str(p.relative_to(ROOT)))
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


def test_the_design_is_short():
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


@pytest.mark.parametrize("page", _all_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_docs_speak_of_the_workbench_not_of_its_making(page: Path):
    """A page says what a command does, costs and found; not who lent which machine, a place's upload limit,
    the sittings it took or the ticket it answered."""
    hits = [f"{page.relative_to(ROOT)}:{line}: {phrase!r}" for line, phrase in making_words(page.read_text())]
    assert not hits, "words that tell of the making, not the use:\n" + "\n".join(hits)


def test_the_making_check_finds_what_it_refuses():
    sample = """The next sitting should rerun it: 838 of the session's 900 device seconds went on the borrowed H200.
It came in three carries (the upload limit of one call's 64 MiB) on machines lent to the project.
Fixed in stop 65 (issue 53, ticket #54), measured with farm-bench."""
    assert making_words(sample) == [
        (1, "sitting"), (1, "session"), (1, "device seconds"), (1, "borrowed"),
        (2, "three carries"), (2, "upload limit"), (2, "one call's"), (2, "lent"),
        (3, "stop 65"), (3, "issue 53"), (3, "ticket"), (3, "#54"), (3, "farm-bench"),
    ]  # fmt: skip
    legitimate = """Runs carry the tag `study`; a session-scoped fixture; `session.md` lists the stages.
See speculators#613, vllm#42508, SafeAILab/EAGLE#339 and TorchSpec PR #97; the total trial budget; each carries
its tag.
Training stops at step 50 of 600; blocking uploads; the eos stops decoding."""
    assert making_words(legitimate) == []
