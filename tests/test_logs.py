"""The log (lab/logs.py): every line a real `lab run` writes to stderr, outside its progress bars, opens with the
time and the level; `-q` keeps the warnings, `-v` adds the debug lines, and every verb takes both; a sweep's
worker lines name their worker; the command's output stays on stdout; and nothing in lab/ outside lab/cli/
prints."""

from __future__ import annotations

import argparse
import ast
import logging
import os
import re
from pathlib import Path

from helpers import logged

from lab import logs
from lab.cli import build_parser, main
from lab.cli.registry import COMMANDS

LAB = Path(__file__).resolve().parent.parent / "lab"
FAST = ["train.steps=6", "train.val_prompts=0", "eval.num_prompts=1"]
# a record's opening: lab's (lab/logs.py) and the libraries' that keep their own format (MLflow: `2026/12/02 ...`)
OPENING = re.compile(r"\d{4}[-/]\d\d[-/]\d\d \d\d:\d\d:\d\d (DEBUG|INFO|WARNING|ERROR|CRITICAL) ")
LEVEL = re.compile(r"\S+ \S+ ([A-Z]+) +(?:\[worker [^]]+\] )?lab[\w.]*: ")
BAR = re.compile(r"\[\d+:\d\d[<,\]]")  # a tqdm bar's elapsed time: `15/150 [00:02<00:17, ...]`, `3it [00:01, ...]`


def _lines(err: str) -> list[str]:
    """The lines of a captured stderr, less the progress bars (the pieces tqdm redraws with a carriage return)."""
    pieces = [piece for line in err.split("\n") for piece in line.split("\r")]
    return [piece for piece in pieces if piece.strip() and not BAR.search(piece)]


def _levels(err: str) -> set[str]:
    return {m.group(1) for line in err.splitlines() if (m := LEVEL.match(line))}


def test_a_record_opens_each_of_its_lines_with_the_time_the_level_and_the_worker(capsys):
    logs.setup(worker="3")
    logging.getLogger("lab.pipeline").warning("two lines\nof one record")
    logs.setup()  # a plain command's: INFO, no worker
    logging.getLogger("lab.pipeline").info("a plain one")
    logging.getLogger("lab.pipeline").debug("a debug line, unasked")
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3, err
    for line, said in zip(err[:2], ("two lines", "of one record"), strict=True):
        assert re.fullmatch(rf"\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d WARNING \[worker 3\] lab\.pipeline: {said}", line)
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d INFO    lab\.pipeline: a plain one", err[2])


def test_every_verb_takes_quiet_and_verbose():
    verbs = []

    def leaves(parser: argparse.ArgumentParser) -> None:
        groups = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not groups:
            verbs.append(parser)
        for group in groups:
            for sub in group.choices.values():
                leaves(sub)

    leaves(build_parser())
    assert len(verbs) == len([c for c in COMMANDS.values() if c.attr is not None])
    for verb in verbs:
        options = {o for a in verb._actions for o in a.option_strings}
        assert {"-q", "--quiet", "-v", "--verbose"} <= options, verb.prog


def _run(capsys, micro_overrides: list[str], *words: str) -> tuple[str, str]:
    """A short `lab run` of the micro target in this process, `words` last: its stdout and stderr."""
    capsys.readouterr()
    assert main(["run", *micro_overrides, *FAST, *words]) == 0
    return capsys.readouterr()


def test_a_run_logs_time_stamped_lines_and_prints_its_output(micro_overrides, micro_target, capsys):
    """-v: every line a run logs, the debug ones too, opens with the time and the level."""
    out, err = _run(capsys, micro_overrides, "-v")
    lines = _lines(err)
    assert lines and all(OPENING.match(line) for line in lines), [line for line in lines if not OPENING.match(line)]
    said = logged(err)
    assert "stage train: start" in said and any(re.fullmatch(r"stage train: end, \d+\.\d s", s) for s in said)
    assert any(re.fullmatch(r"cache entry hidden/\S+: (reused|built)", s) for s in said)  # a debug line
    assert _levels(err) == {"DEBUG", "INFO"}  # no warning in a good run
    assert out.startswith("plan: lab run") and not OPENING.search(out)  # the plan, metrics, run id: the output
    assert re.fullmatch(r"[0-9a-f]{32}", out.splitlines()[-1])


def test_quiet_keeps_the_warnings_alone(micro_overrides, micro_target, capsys):
    threads = (os.cpu_count() or 1) + 1
    out, err = _run(capsys, micro_overrides, "-q", f"threads={threads}")  # more threads than cores: a warning
    assert _levels(err) == {"WARNING"} and f"threads={threads}: capped at" in err
    assert re.fullmatch(r"[0-9a-f]{32}", out.splitlines()[-1])  # the output as without -q


def test_a_sweeps_worker_lines_name_their_worker(tmp_path, micro_overrides, micro_target, capsys):
    """Two workers, this process and a subprocess, over the session's store (a study of its own name)."""
    spec = tmp_path / "logs_two_workers.yaml"
    spec.write_text("space: {train.lr: [1.0e-3, 2.0e-3]}\nsampler: grid\nobjectives: [eval/in_dist/ref/k3/al]\n")
    capsys.readouterr()
    code = main(["sweep", f"sweep={spec}", "--workers", "2", "--no-progress", *micro_overrides, *FAST])
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    lines = _lines(err)
    assert all(OPENING.match(line) for line in lines), [line for line in lines if not OPENING.match(line)]
    workers = {m.group(1) for line in lines if (m := re.match(r"\S+ \S+ [A-Z]+ +\[worker (\d+)\] ", line))}
    assert workers == {"0", "1"}, lines
    joined = [line for line in lines if "[worker 1]" in line and "joined study" in line]
    assert joined and "lab.sweep.engine: worker " in joined[0]  # the worker's own record, forwarded as it is
    assert "study " in out and not OPENING.search(out)  # the summary: the output


def _prints(source: str) -> list[int]:
    """The lines of the `print` calls in `source`."""
    calls = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call)]
    return [n.lineno for n in calls if isinstance(n.func, ast.Name) and n.func.id == "print"]


def test_nothing_outside_the_cli_prints():
    assert _prints("import sys\n\ndef f():\n    print('x', file=sys.stderr)\n") == [4]  # the check finds one
    found = [
        f"{path.relative_to(LAB.parent)}:{line}"
        for path in sorted(LAB.rglob("*.py"))
        if "cli" not in path.relative_to(LAB).parts[:1]
        for line in _prints(path.read_text())
    ]
    assert not found, f"log records (logging.getLogger(__name__)), not print: {found}"
