"""How a case is judged: it runs in process through `lab.cli.main`, where the calls a verb's work starts with
raise `Valid`; any other end must be exit 2 and one line `error: ...` naming the key or option and what is expected
(`problem`), and a file case must also leave its folder as it was (`file_problem`)."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fuzz.surface import STORE, Case
from lab import cli
from lab.sweep import experiment

VALID = "valid"
# the words by which an error line says what is expected
EXPECTS = re.compile(
    r"expected|must|allowed|available|required|at least|at most|choose from|needs|only with|only |e\.g\.|"
    r"not a |no such|is a directory|cannot|give "
)


class Valid(BaseException):
    """Raised where a verb's work starts (`WORK`): the case passed every check. Not an Exception, which a verb
    may catch around its work (`lab server` around preparing its store) and say as an error."""


@dataclass
class Outcome:
    rc: Any
    out: str
    err: str
    error: str = ""  # a traceback

    @property
    def valid(self) -> bool:
        return self.rc == VALID


def problem(outcome: Outcome, names: tuple[str, ...]) -> str | None:
    """Why the outcome is neither valid nor exit 2 with one line naming one of `names` and what is expected."""
    if outcome.valid:
        return None
    if outcome.error:
        return f"traceback: {outcome.error.strip().splitlines()[-1]}"
    lines = outcome.err.strip().splitlines()
    if outcome.rc != 2:
        return f"exit {outcome.rc}: {' | '.join(lines)[-300:]}"
    if len(lines) != 1:
        return f"{len(lines)} stderr lines: {' | '.join(lines)[-300:]}"
    line = lines[0]
    if not line.startswith("error: "):
        return f"not an error line: {line}"
    if not any(n in line for n in names):
        return f"names none of {names}: {line}"
    if not EXPECTS.search(line):
        return f"does not say what is expected: {line}"
    return None


@dataclass
class Fuzzer:
    root: Path
    specs: Path
    run_id: str
    capsys: Any
    monkeypatch: Any
    overrides: list[str]  # the overrides that point a command at the store (STORE in a case's argv)
    files: Path | None = None  # where file cases make their paths (never the store's folder)
    log: list[str] = field(default_factory=list)
    path: str = ""  # the path the current file case made

    def argv(self, case: Case) -> list[str]:
        out = []
        for a in case.argv:
            if a == STORE:
                out += self.overrides
            else:
                out.append(a.replace("{root}", str(self.root)).replace("{specs}", str(self.specs)).replace(
                    "{run}", self.run_id).replace("{path}", self.path))  # fmt: skip
        return out

    def names(self, case: Case) -> tuple[str, ...]:
        return tuple(n.replace("{specs}", str(self.specs)).replace("{path}", self.path) for n in case.names)

    def make(self, case: Case) -> Path:
        """A fresh folder for a file case, with the case's path made in it."""
        assert self.files is not None and case.make is not None
        folder = self.files / hashlib.sha256(str(case).encode()).hexdigest()[:12]
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        self.path = str(case.make(folder, self.root))
        return folder

    def write_spec(self, case: Case) -> None:
        if case.spec is not None:
            kind, stem, data = case.spec
            folder = self.specs if kind == "sweeps" else self.specs / "experiments"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{stem}.yaml").write_text(yaml.safe_dump(data, sort_keys=False))

    def outcome(self, case: Case) -> Outcome:
        self.write_spec(case)
        self.capsys.readouterr()
        with self.monkeypatch.context() as m:
            if case.spec is not None and case.spec[0] == "experiments":
                m.setattr(experiment, "EXPERIMENT_DIR", self.specs / "experiments")
            try:
                rc: Any = cli.main(self.argv(case))
            except Valid:
                rc = VALID
            except SystemExit as exc:
                rc = exc.code
            except BaseException:
                out, err = self.capsys.readouterr()
                return Outcome("traceback", out, err, traceback.format_exc())
        out, err = self.capsys.readouterr()
        return Outcome(rc, out, err)

    def __call__(self, cases: list[Case]) -> list[str]:
        found = []
        for case in cases:
            if case.make is not None:
                folder = self.make(case)
                before = tree(folder)
                outcome = self.outcome(case)
                why = file_problem(case, outcome, self.names(case), before, tree(folder))
            else:
                outcome = self.outcome(case)
                why = problem(outcome, self.names(case))
            shown = "valid" if outcome.valid else (outcome.err.strip().splitlines() or ["?"])[-1]
            self.log.append(f"{case}: {'PROBLEM ' + why if why else shown}")
            if why:
                found.append(f"{case}: {why}")
        if os.environ.get("LAB_FUZZ_LOG"):
            with open(os.environ["LAB_FUZZ_LOG"], "a") as f:
                f.write("".join(line + "\n" for line in self.log))
        self.log.clear()
        return found


def tree(folder: Path) -> dict[str, str]:
    """What is in a case's folder (without following links): each entry's kind and its content's hash."""
    out = {}
    for p in sorted(folder.rglob("*")):
        rel = str(p.relative_to(folder))
        if p.is_symlink():
            out[rel] = f"link {os.readlink(p)}"
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            out[rel] = "dir"
    return out


def file_problem(case: Case, outcome: Outcome, names: tuple[str, ...], before: dict, after: dict) -> str | None:
    """Why a file case's outcome is wrong: a good path refused, a bad one passing validation (its verb's work
    would start on it), a refusal that is not one line naming the key and what is expected, or the case's
    folder changed before the work."""
    if before != after:
        return f"changed its files before any work: {sorted(set(after.items()) ^ set(before.items()))[:3]}"
    if case.good:
        if outcome.valid:
            return None
        return "a good path refused: " + (problem(outcome, names) or outcome.err.strip())
    if outcome.valid:
        return "passed every check: the verb's work would start on it"
    return problem(outcome, names)
