"""`lab dashboard` in a real browser: over an Optuna storage written by Optuna itself (a study with three
complete trials and a pruned one, fixed params and values), the `lab dashboard` subprocess serves
optuna-dashboard on 127.0.0.1, and headless Chromium shows the study in the study list, then every trial
with its state, value and params. Two storages: the journal file of `lab sweep sweep=toggles_grid`
(found from the sweep's name and the store's overrides, as a user calls it) and a sqlite database given
with --storage. Kept in test-artifacts/: a screenshot and the page source of both pages, and the log.

Bad input exits 2 with one line on stderr, touches nothing and serves nothing: no study named, an unknown
sweep, a storage that is not there (not created either), that holds no study, or not the sweep's study.

The browser (and its skip, or failure when LAB_REQUIRE_BROWSER=1) is tests/test_ui.py's."""

from __future__ import annotations

import contextlib
import hashlib
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna
import pytest
import test_ui
from optuna.distributions import CategoricalDistribution, FloatDistribution
from optuna.trial import TrialState

from lab.sweep import search_space

if TYPE_CHECKING:
    from selenium.webdriver.remote.webdriver import WebDriver

browser = test_ui.browser  # headless Chromium, skipped without it (failed with LAB_REQUIRE_BROWSER=1)
ARTIFACTS = test_ui.ARTIFACTS

SWEEP = "toggles_grid"
SERVER_TIMEOUT = 60  # finding a sweep's storage imports MLflow; two slow cores
PAGE_TIMEOUT = 60

DISTRIBUTIONS = {
    "fc_norm": CategoricalDistribution(["none", "shared", "per_layer"]),
    "lr": FloatDistribution(1e-4, 1e-2, log=True),
}
# (state, value, params) of trials 0..3, as a sweep leaves them: AL objective, one trial pruned
TRIALS = [
    (TrialState.COMPLETE, 1.25, {"fc_norm": "none", "lr": 0.001}),
    (TrialState.COMPLETE, 1.5, {"fc_norm": "shared", "lr": 0.002}),
    (TrialState.COMPLETE, 1.75, {"fc_norm": "per_layer", "lr": 0.004}),
    (TrialState.PRUNED, None, {"fc_norm": "shared", "lr": 0.008}),
]


@dataclass
class Storage:
    """A storage holding one study, and the `lab dashboard` arguments that find it."""

    study: str
    args: list[str]


def _write_study(storage: str | optuna.storages.BaseStorage, name: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Optuna's ExperimentalWarning for the journal storage
        study = optuna.create_study(study_name=name, storage=storage, direction="maximize")
        for state, value, params in TRIALS:
            intermediate = {5: 1.1} if state == TrialState.PRUNED else {}
            study.add_trial(
                optuna.trial.create_trial(
                    state=state,
                    value=value,
                    params=params,
                    distributions=DISTRIBUTIONS,
                    intermediate_values=intermediate,
                )
            )


def _journal(path: Path) -> optuna.storages.JournalStorage:
    return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(path)))


def _store_overrides(root: Path) -> list[str]:
    return [f"tracking.uri=sqlite:///{root / 'mlruns' / 'mlflow.db'}", f"tracking.artifact_root={root / 'art'}"]


def _sweep_journal(root: Path) -> Storage:
    """The sweep's study where `lab sweep sweep=toggles_grid` keeps it: a journal beside the MLflow database."""
    extra = _store_overrides(root)
    name = search_space.load(SWEEP).study_name(extra)
    path = root / "mlruns" / "optuna.journal"
    path.parent.mkdir(parents=True)
    _write_study(_journal(path), name)
    return Storage(name, [f"sweep={SWEEP}", *extra])


def _sqlite(root: Path) -> Storage:
    url = f"sqlite:///{root / 'optuna.db'}"
    _write_study(url, "rdb-study")
    return Storage("rdb-study", ["--storage", url])


# artifacts are kept as test-artifacts/optuna_dashboard_{KEY}_*
STORAGES: dict[str, Callable[[Path], Storage]] = {"sweep_journal": _sweep_journal, "sqlite_storage": _sqlite}


def _lab(args: list[str], cwd: Path, **kwargs: Any) -> subprocess.Popen | subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "lab.cli", "dashboard", *args]
    if kwargs.pop("background", False):
        return subprocess.Popen(cmd, cwd=cwd, start_new_session=True, **kwargs)
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120, **kwargs)


@dataclass
class Served:
    root_url: str  # the URL `lab dashboard` printed first
    study_url: str  # the study page it printed
    study: str
    artifacts: str  # the prefix of the files kept in test-artifacts/


@pytest.fixture(params=list(STORAGES))
def served(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Served]:
    """`lab dashboard` over a storage, as a user starts it; what it printed, once the page answers 200."""
    storage = STORAGES[request.param](tmp_path)
    port = test_ui._free_port()
    prefix = f"optuna_dashboard_{request.param}"
    ARTIFACTS.mkdir(exist_ok=True)
    for old in ARTIFACTS.glob(f"{prefix}_*"):  # a previous run's pages would mislead
        old.unlink()
    log_path = ARTIFACTS / f"{prefix}_server.log"
    with open(log_path, "w") as log:
        proc = _lab([*storage.args, "--port", str(port)], tmp_path, background=True, stdout=log, stderr=log)
    try:
        printed = _wait_until_served(f"http://127.0.0.1:{port}/", proc, log_path)
        roots = re.findall(r"^Optuna dashboard on (\S+) over ", printed, re.M)
        studies = re.findall(rf"^  study {re.escape(storage.study)}: (\S+)$", printed, re.M)
        assert roots == [f"http://127.0.0.1:{port}/"], printed
        assert len(studies) == 1, printed
        yield Served(roots[0], studies[0], storage.study, prefix)
    finally:
        test_ui._stop(proc)


def _wait_until_served(url: str, proc: subprocess.Popen, log_path: Path) -> str:
    """What `lab dashboard` printed, once it has printed its URLs and `url` answers 200."""
    deadline = time.monotonic() + SERVER_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"`lab dashboard` exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        printed = log_path.read_text()
        if "Ctrl-C stops it" in printed:
            try:
                with urllib.request.urlopen(url, timeout=5) as response:
                    if response.status == 200:
                        return printed
            except (urllib.error.URLError, OSError):
                pass
        time.sleep(0.2)
    pytest.fail(f"`lab dashboard` not answering at {url} after {SERVER_TIMEOUT}s:\n{log_path.read_text()[-3000:]}")


def _wait(driver: WebDriver, name: str, what: str, ready: Callable[[WebDriver], Any]) -> Any:
    """What `ready` returns once it is truthy; else keep the page (NAME.png, NAME.html; the server's log is
    beside them) and fail."""
    from selenium.common.exceptions import StaleElementReferenceException, TimeoutException, WebDriverException
    from selenium.webdriver.support.ui import WebDriverWait

    try:  # the page re-renders as its requests come back: an element found a moment ago may be gone
        return WebDriverWait(driver, PAGE_TIMEOUT, ignored_exceptions=[StaleElementReferenceException]).until(ready)
    except WebDriverException as exc:  # a timeout, or the browser itself failing
        with contextlib.suppress(WebDriverException):
            test_ui._keep(driver, name)
        why = f"within {PAGE_TIMEOUT}s" if isinstance(exc, TimeoutException) else f"({exc.msg})"
        pytest.fail(f"{what} not shown {why} (see test-artifacts/{name}.png, .html)")


def _study_card(study: str) -> Callable[[WebDriver], tuple[str, str] | None]:
    """The text and link of the study list's entry of `study`, once it is rendered."""

    def ready(driver: WebDriver) -> tuple[str, str] | None:
        links = driver.find_elements("xpath", f"//a[contains(normalize-space(), '{study}')]")
        return (links[0].text, links[0].get_attribute("href")) if links else None

    return ready


def _trials(count: int) -> Callable[[WebDriver], dict[str, tuple[str, str | None, list[str]]] | None]:
    """Each shown trial's (state, value, params) by its heading, once all `count` have rendered."""

    def ready(driver: WebDriver) -> dict[str, tuple[str, str | None, list[str]]] | None:
        shown = {}
        for heading in driver.find_elements("xpath", "//h4[starts-with(normalize-space(), 'Trial ')]"):
            box = heading.find_element("xpath", "..")
            state = box.find_element("xpath", ".//span[contains(@class, 'MuiChip-label')]").text
            values = box.find_elements("xpath", ".//p[normalize-space()='Value']/following-sibling::div[1]")
            params = box.find_elements("xpath", ".//p[normalize-space()='Parameter']/following-sibling::div[1]//p")
            value = values[0].text if values else None
            shown[heading.text.split(" (", 1)[0]] = (state, value, sorted(p.text for p in params))
        return shown if len(shown) == count and all(params for _, _, params in shown.values()) else None

    return ready


@pytest.mark.slow
def test_dashboard_shows_the_study_and_its_trials(browser: WebDriver, served: Served) -> None:
    name = f"{served.artifacts}_studies"
    browser.get(served.root_url)  # redirects to the study list
    text, link = _wait(browser, name, f"study {served.study} in the study list", _study_card(served.study))
    test_ui._keep(browser, name)
    assert "Direction: MAXIMIZE" in text
    assert link == served.study_url  # the page `lab dashboard` printed for the study

    name = f"{served.artifacts}_trials"
    numbers = ",".join(str(n) for n in range(len(TRIALS)))
    browser.get(f"{served.study_url}/trials?numbers={numbers}")  # the trial list with every trial's details
    shown = _wait(browser, name, f"the {len(TRIALS)} trials of {served.study}", _trials(len(TRIALS)))
    test_ui._keep(browser, name)
    body = browser.find_element("tag name", "body").text
    assert served.study in body and f"{len(TRIALS)} Trials" in body
    assert shown == {
        f"Trial {n}": (state.name.capitalize(), _shown(value), sorted(f"{k} {_shown(v)}" for k, v in params.items()))
        for n, (state, value, params) in enumerate(TRIALS)
    }


def _shown(value: object) -> str:
    """A value as the dashboard writes it: 0.001, 1.5; a pruned trial's missing value as None."""
    return f"{value:g}" if isinstance(value, float) else str(value)


# (id, arguments with {root} for the temporary folder, the key named, what is said)
BAD = [
    ("no study named", [], "sweep", "required: sweep=NAME, experiment=NAME or --storage URL"),
    ("unknown sweep", ["sweep=nope"], "sweep", "unknown sweep 'nope'; available: "),
    ("unknown experiment", ["experiment=nope"], "experiment", "unknown experiment 'nope'; available: "),
    ("missing journal", ["--storage", "{root}/none.journal"], "--storage", "no such file, so no Optuna study yet"),
    ("empty journal", ["--storage", "{root}/empty.journal"], "--storage", "holds no Optuna study yet"),
    ("missing sqlite", ["--storage", "sqlite:///{root}/none.db"], "--storage", "no such file, so no Optuna study"),
    ("sqlite, no study", ["--storage", "sqlite:///{root}/empty.db"], "--storage", "holds no Optuna study yet"),
    ("sqlite, no tables", ["--storage", "sqlite:///{root}/blank.db"], "--storage", "has no Optuna tables"),
    ("not a database", ["--storage", "redis://{root}"], "--storage", "unknown database 'redis'"),
    (
        "not the sweep's study",
        [f"sweep={SWEEP}", *_store_overrides(Path("{root}")), "tracking.optuna_storage={root}/other.journal"],
        f"sweeps/{SWEEP}.yaml",
        f"no study '{SWEEP}-",
    ),
    ("port taken", ["--storage", "{root}/other.journal", "--port", "{port}"], "--port", "cannot listen on 127.0.0.1:"),
]


@pytest.fixture
def storages(tmp_path: Path) -> Path:
    """An empty journal, an Optuna database with no study, an empty sqlite file, a journal of another study."""
    (tmp_path / "empty.journal").touch()
    optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'empty.db'}")  # creates Optuna's tables
    (tmp_path / "blank.db").touch()
    _write_study(_journal(tmp_path / "other.journal"), "another-study")
    return tmp_path


def _files(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    }


@pytest.mark.parametrize(("args", "key", "said"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_input_is_one_line_and_touches_nothing(storages: Path, args: list[str], key: str, said: str) -> None:
    with socket.socket() as taken:  # a port something else listens on
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        before = _files(storages)
        result = _lab([a.format(root=storages, port=port) for a in args], storages)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {key}: "), result.stderr
    assert said in lines[0]
    assert result.stdout == ""  # no URL printed: nothing is served
    assert _files(storages) == before  # nothing created, nothing written
