"""Every bad input refused in one line, found by fuzzing the whole surface rather than by a list: the fuzzer
(tests/fuzz/: what is tried, how each case is made and how it is judged) is described in tests/fuzz/__init__.py.
This module holds the recorded store the cases run against and the tests."""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fuzz.cases import CONFIG_PAIRS, SPEC_KEYS, action_words, all_cases, config_cases, option_cases, spec_cases
from fuzz.files import FILE_CASES, FILE_KEYS, all_file_cases
from fuzz.mutations import mutation_classes
from fuzz.oracle import Fuzzer, Valid, tree
from fuzz.surface import CONFIG_KEYS, SEED, STORE, VERBS, Case, base_argvs, seeded_rng
from helpers import logged
from test_bad_input import _overrides, recorded, snapshot  # noqa: F401  (recorded: a fixture)

from lab import track
from lab.config.composition import compose
from lab.config.rules import strip_optional
from lab.sweep import experiment

SUBPROCESS_SAMPLE = 6  # failing cases run again through the real command
FILE_SUBPROCESS_SAMPLE = 2  # and failing file cases


def _files(root: Path) -> dict[str, str]:
    """The `files` part of the store's snapshot (the part a test can afford after every case group)."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(root.rglob("*"))
    }


@pytest.fixture(scope="module")
def store(recorded, tmp_path_factory) -> dict[str, Any]:  # noqa: F811
    """tests/test_bad_input.py's recorded folder plus a drift_2x2 study (a parent run and one finished child)
    under exactly the overrides `lab report experiment=drift_2x2 <store>` composes, so that the report's base
    case is valid, a drafter checkpoint for `lab export` and that study's archive for `lab study import`; its
    snapshot; and a folder for the spec files."""
    from helpers import small_drafter

    from lab.drafter import save_native
    from lab.track import study_archive

    root = recorded
    # what `lab export SOURCE` exports, and a drafter.checkpoint that fits the micro target (its 512 tokens)
    save_native(small_drafter(vocab_size=512), root / "drafter")
    extra = _overrides(root)
    exp = experiment.load("drift_2x2")
    sweep = exp.as_sweep(extra)
    cfg = compose([*exp.overrides, *extra])
    uri, art = cfg.tracking.uri, cfg.tracking.artifact_root
    tags = {"study": exp.name, "sweep": exp.name, "optuna_study": sweep.study_name(extra)}
    with track.parent_run(uri, art, sweep.experiment, "sweep-drift_2x2", sweep.study_name(extra), tags) as parent:
        parent.log_params({"sweep.seeds": exp.seeds})
        child = {"study": exp.name, "arm": "eagle3", "seed": 0}
        with track.start_run(uri, art, sweep.experiment, "eagle3-0", child, parent_run_id=parent.id) as run:
            run.log_metrics({"eval/in_dist/ref/k3/al": 2.0})
    study = {"kind": "experiment", "name": exp.name, "experiment": sweep.experiment}
    study_archive.export_study(uri, parent.id, root / "study.tar.gz", study)  # what `lab study import` reads
    before = snapshot(root)
    run_id = next(r for r, v in before["runs"].items() if v["tags"].get("study") == "recorded")  # no checkpoint
    specs, files = tmp_path_factory.mktemp("specs"), tmp_path_factory.mktemp("files")
    return {"root": root, "run": run_id, "before": before, "specs": specs, "files": files}


# The calls each verb's work starts with, once every check of the verb has passed: the `fuzz` fixture makes
# them raise `Valid`, so that no case runs, builds, writes, serves or imports anything. Each is called by no
# verb's checks (so a check cannot pass for a case by raising Valid).
WORK: dict[str, list[str]] = {
    "run": ["lab.pipeline.run"],
    "ablate": ["lab.cli.report.describe_study", "lab.sweep.engine.launch"],
    "ablate worker": ["lab.sweep.engine.join"],
    "sweep": ["lab.sweep.engine.launch"],
    "sweep worker": ["lab.sweep.engine.join"],
    "target build": ["lab.pipeline.set_threads"],
    "export": ["lab.drafter.save_native", "lab.drafter.save_speculators"],
    "torchspec-config": ["lab.train.torchspec_config.write"],
    "report": ["lab.report.write"],
    "paper": ["lab.report.paper.measure"],
    "studies": ["lab.report.listing.studies"],
    "runs": ["lab.report.listing.runs"],
    "doctor": ["lab.cli.doctor.describe"],
    "ui": ["lab.track.ui_command"],
    "server": ["lab.track.prepare_store"],
    "dashboard": ["lab.sweep.dashboard.bind"],
    "study export": ["lab.sweep.optuna_archive.dump", "lab.track.study_archive.export_study"],
    "study import": ["lab.track.study_archive.apply_import"],
}


@pytest.fixture
def fuzz(store, capsys, monkeypatch) -> Fuzzer:
    """A Fuzzer in the store's folder with every call of `WORK` raising `Valid`; afterwards every file of the
    store is as it was."""

    def stopper(name: str) -> Callable[..., None]:
        def stop(*args: Any, **kwargs: Any) -> None:
            raise Valid(name)

        return stop

    for name in {n for names in WORK.values() for n in names}:
        monkeypatch.setattr(name, stopper(name))
    monkeypatch.chdir(store["root"])
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # a wheel not in the cache cannot be downloaded
    overrides = _overrides(store["root"])
    yield Fuzzer(store["root"], store["specs"], store["run"], capsys, monkeypatch, overrides, store["files"])
    assert _files(store["root"]) == store["before"]["files"]


# ------------------------------------------------------------------------------------------------ the tests


def test_every_verb_reaches_its_work(fuzz):
    """The first base case of every verb passes validation (it reaches its work, which `WORK` names for every
    verb: a verb missing there would start its work here)."""
    assert set(WORK) == set(VERBS), "name the call each verb's work starts with in WORK"
    for verb in VERBS:
        case = Case(verb, "base", base_argvs(verb)[0], ())
        outcome = fuzz.outcome(case)
        assert outcome.valid, f"{case}: {outcome.rc} {outcome.err} {outcome.error}"


@pytest.mark.parametrize(("key", "tp"), CONFIG_KEYS, ids=[k for k, _ in CONFIG_KEYS])
def test_config_key(key, tp, fuzz):
    problems = fuzz(config_cases(key, tp))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(("kind", "key", "tp"), SPEC_KEYS, ids=[f"{k}:{key}" for k, key, _ in SPEC_KEYS])
def test_spec_key(kind, key, tp, fuzz):
    problems = fuzz(spec_cases(kind, key, tp))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("verb", list(VERBS))
def test_verb_options(verb, fuzz):
    problems = fuzz(option_cases(verb, VERBS[verb]))
    assert not problems, "\n".join(problems)


def test_a_worker_count_above_the_cores_is_capped_unless_forced(fuzz, monkeypatch):
    """`--workers N` above the machine's cores runs as many workers as cores, saying so in one line;
    `--force` keeps N. Checked where the count is handed to the engine or to MLflow's server."""
    from lab import track
    from lab.sweep import engine

    used: list[int] = []

    def launched(*args, workers, **kwargs):
        used.append(workers)
        raise Valid("launch")

    def served(backend, root, host, port, workers):
        used.append(workers)
        raise Valid("server")

    monkeypatch.setattr(track, "prepare_store", lambda backend: None)  # the server's work, up to its command
    monkeypatch.setattr(engine, "launch", launched)
    monkeypatch.setattr(track, "server_command", served)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    said = "--workers 64: capped at 2, this machine's cores (--force keeps 64)"
    for argv in (["sweep", "sweep=tpe_eagle3"], ["ablate", "experiment=drift_2x2"], ["server"]):
        capped = fuzz.outcome(Case("--workers", "capped", [*argv, "--workers", "64", STORE], ()))
        forced = fuzz.outcome(Case("--workers", "forced", [*argv, "--workers", "64", "--force", STORE], ()))
        assert capped.valid and forced.valid, (capped, forced)
        assert said in logged(capped.err) and said not in forced.err
        assert used[-2:] == [2, 64]


def _the_real_command_says(fuzz, case, store, outcome) -> None:
    """`case` through the real `lab` command in a subprocess: exit 2 and the same one line as in process."""
    env = {**os.environ, "PIP_NO_INDEX": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "lab.cli", *fuzz.argv(case)],
        capture_output=True, text=True, cwd=store["root"], env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, f"{case}: {proc.stderr[-2000:]}"
    assert proc.stderr.strip().splitlines() == outcome.err.strip().splitlines(), case


def test_failing_cases_fail_the_same_through_the_real_command(fuzz, store):
    """A seeded sample of failing cases (experiment specs aside: they are read from a patched folder) through
    `python -m lab.cli`: exit 2 and the one line the in-process run gave, and nothing recorded."""
    cases = [c for c in all_cases() if not (c.spec and c.spec[0] == "experiments")]
    seeded_rng("subprocess").shuffle(cases)
    checked = 0
    for case in cases:
        if checked == SUBPROCESS_SAMPLE:
            break
        outcome = fuzz.outcome(case)
        if outcome.valid:
            continue
        _the_real_command_says(fuzz, case, store, outcome)
        checked += 1
    assert checked == SUBPROCESS_SAMPLE


def test_the_surface_is_covered():
    """Every config key, spec key, verb and option is in the cases; the count of cases per run."""
    cases = all_cases()
    items = {c.item for c in cases}
    keys = {k.split(".*.")[0] for k, _ in CONFIG_KEYS}
    assert all(any(i == k or i.startswith(k + ".") for i in items) for k in keys)
    assert {f"{kind}: {k}" for kind, k, tp in SPEC_KEYS if mutation_classes(tp)} <= items
    for verb, parser in VERBS.items():
        for action in parser._actions:
            if action.option_strings and not isinstance(action, argparse._HelpAction):
                assert action.option_strings[-1] in items, (verb, action.option_strings)
    counts = {"config": sum(len(v) for v in CONFIG_PAIRS.values())}
    counts["spec"] = sum(len(mutation_classes(tp)) for _, _, tp in SPEC_KEYS)
    counts["options"] = len(cases) - counts["config"] - counts["spec"]
    print(f"fuzz cases this run (seed {SEED}): {counts}, {len(cases)} in all, + {SUBPROCESS_SAMPLE} subprocesses")
    assert counts["config"] >= len(CONFIG_KEYS)


@pytest.mark.parametrize("item", sorted({c.item for c in FILE_CASES}))
def test_file_input(item, fuzz):
    """Every path case of one key or option: refused in one line naming it before any work, or, an output not
    there yet, passing; its folder untouched either way."""
    problems = fuzz([c for c in FILE_CASES if c.item == item])
    assert not problems, "\n".join(problems)


# the words of a field or an option that names a file or folder: each such one must say so (a path rule)
PATHLIKE_FIELD = re.compile(r"(^|_)(path|dir|root|checkpoint|uri|storage|file)$")
PATHLIKE_HELP = re.compile(r"\b(folder|file|directory|archive|storage|path)\b", re.I)


def test_every_file_input_is_fuzzed():
    """Every config key, option and override that names a file or folder declares it (a key named like a path
    has a `path` rule; an option whose help speaks of a file or folder has a path type), and every declared one
    has cases of its kind in every run."""
    items = {c.item.split(" (")[0] for c in FILE_CASES}
    for key, tp in CONFIG_KEYS:
        if strip_optional(tp) is str and PATHLIKE_FIELD.search(key.rsplit(".", 1)[-1]):
            assert any(k == key for k, _ in FILE_KEYS), f"{key} names a file or folder: give it a path rule"
    for key, _ in FILE_KEYS:
        assert any(i == key or re.fullmatch(re.escape(key).replace(r"\*", r"[^.]+"), i) for i in items), key
    for verb, parser in VERBS.items():
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction) or action.dest == "overrides":
                continue
            if PATHLIKE_HELP.search(f"{action.help} {action.metavar or ''}") and action.nargs != 0:
                assert hasattr(action.type, "path"), f"{verb} {action.option_strings or action.dest}: a path type"
            if getattr(action.type, "path", ()):
                assert f"{verb} {action_words(action)[0]}" in items, (verb, action.dest)
        for key in parser._defaults.get("named_files", {}):
            assert f"{verb} {key}=PATH" in items, (verb, key)
    kinds = {}
    for c in all_file_cases():
        kinds[c.kind] = kinds.get(c.kind, 0) + 1
    print(f"file cases this run: {len(FILE_CASES)} of {len(all_file_cases())}; all of them by class: {kinds}")


def test_failing_file_cases_fail_the_same_through_the_real_command(fuzz, store):
    """A seeded sample of refused file cases through `python -m lab.cli`: exit 2 and the one line the in-process
    run gave, and the case's folder untouched."""
    cases = [c for c in FILE_CASES if not c.good]
    seeded_rng("file subprocess").shuffle(cases)
    for case in cases[:FILE_SUBPROCESS_SAMPLE]:
        folder = fuzz.make(case)
        outcome = fuzz.outcome(case)
        assert not outcome.valid, case
        before = tree(folder)
        _the_real_command_says(fuzz, case, store, outcome)
        assert tree(folder) == before, case


def test_the_recorded_store_is_unchanged(store):
    assert snapshot(store["root"]) == store["before"]
