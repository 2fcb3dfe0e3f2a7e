"""`lab ui` in a real browser: over an MLflow store written by `lab.track` (a study's experiment, its
parent run and one child run with an eval metric), the `lab ui` subprocess serves the MLflow UI, and
headless Chromium shows the study's experiment with its parent run, then the child run with the
metric's key and value. Kept in test-artifacts/ for a look or a post-mortem: a screenshot and the
page source of both pages, and the server's log.

Needs Debian's chromium + chromium-driver (scripts/install_browser.sh) and selenium: skipped without
them, failed instead when LAB_REQUIRE_BROWSER=1 (CI)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from lab import track

if TYPE_CHECKING:
    from selenium.webdriver.remote.webdriver import WebDriver

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"

STUDY = "ui-study"
PARENT = "sweep-ui"
CHILD = "arm-a-s0"
METRIC = "eval/in_dist/ref/k3/al"
VALUE = 2.345

SERVER_TIMEOUT = 120  # uvicorn imports the whole MLflow server app: tens of seconds on two slow cores
PAGE_TIMEOUT = 60  # the UI fetches the experiment and runs after its bundle loads


@dataclass
class Store:
    uri: str
    artifact_root: str
    experiment_id: str
    parent_id: str
    child_id: str

    def overrides(self) -> list[str]:
        return [f"tracking.uri={self.uri}", f"tracking.artifact_root={self.artifact_root}"]


def _browser_missing() -> str | None:
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if importlib.util.find_spec("selenium") is None:
        missing.append("the selenium package")
    if not missing:
        return None
    return f"{' and '.join(missing)} not installed (scripts/install_browser.sh, pip install selenium)"


@pytest.fixture
def browser(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[WebDriver]:
    """Headless Chromium driven through Debian's chromedriver."""
    reason = _browser_missing()
    if reason:
        if os.environ.get("LAB_REQUIRE_BROWSER") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    # Both paths are given, so Selenium Manager has nothing to look up; offline, it could not download anyway.
    monkeypatch.setenv("SE_OFFLINE", "true")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (
        "--headless=new",
        "--no-sandbox",  # runs as root in containers
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        # no calls home on a closed network: they only add timeouts and log noise
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1600,1000",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def store(tmp_path: Path) -> Store:
    """A study as the sweep engine leaves it: an experiment, a parent run, a child run with a metric."""
    uri = f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}"
    root = str(tmp_path / "mlruns" / "artifacts")
    tags = {"study": STUDY, "sweep": "ui"}
    with track.parent_run(uri, root, STUDY, PARENT, key="ui-test", tags=tags) as parent:
        with track.start_run(uri, root, STUDY, CHILD, {**tags, "arm": "a", "seed": 0}, parent.id) as child:
            child.log_metrics({METRIC: VALUE})
    assert [r.info.run_id for r in track.child_runs(uri, parent.id)] == [child.id]
    experiment_id = track.search_runs(uri, STUDY)[0].info.experiment_id
    return Store(uri, root, experiment_id, parent.id, child.id)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ui(store: Store, tmp_path: Path) -> Iterator[str]:
    """`lab ui` over the store, as a user starts it; its base URL once it answers 200."""
    port = _free_port()
    ARTIFACTS.mkdir(exist_ok=True)
    for old in ARTIFACTS.glob("mlflow_ui_*"):  # a previous run's pages would mislead
        old.unlink()
    log_path = ARTIFACTS / "mlflow_ui_server.log"
    env = {
        **os.environ,
        "MLFLOW_WORKERS": "1",  # one uvicorn worker answers in about half the time of the default four
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "DO_NOT_TRACK": "true",
    }
    cmd = [sys.executable, "-m", "lab.cli", "ui", "--port", str(port), *store.overrides()]
    with open(log_path, "w") as log:
        # its own process group: `lab ui` execs mlflow, which forks uvicorn workers; all must go at the end
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, env=env, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}/"
    try:
        _wait_for_http(url, proc, log_path)
        yield url
    finally:
        _stop(proc)


def _wait_for_http(url: str, proc: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + SERVER_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"`lab ui` exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    pytest.fail(f"`lab ui` not answering at {url} after {SERVER_TIMEOUT}s:\n{log_path.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the whole group (uvicorn's workers too), then SIGKILL to whatever ignored it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=15)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _keep(driver: WebDriver, name: str) -> None:
    """The page as it is now: test-artifacts/NAME.png and NAME.html."""
    driver.save_screenshot(str(ARTIFACTS / f"{name}.png"))
    (ARTIFACTS / f"{name}.html").write_text(driver.page_source)


def _wait(driver: WebDriver, name: str, what: str, ready: Callable[[WebDriver], Any]) -> Any:
    """What `ready` returns once it is truthy; else keep the page (NAME.png, NAME.html) and fail."""
    from selenium.common.exceptions import (
        ElementClickInterceptedException,
        StaleElementReferenceException,
        TimeoutException,
        WebDriverException,
    )
    from selenium.webdriver.support.ui import WebDriverWait

    # the UI re-renders as its requests come back: an element found a moment ago may be gone or covered
    ignored = [StaleElementReferenceException, ElementClickInterceptedException]
    try:
        return WebDriverWait(driver, PAGE_TIMEOUT, ignored_exceptions=ignored).until(ready)
    except WebDriverException as exc:  # a timeout, or the browser itself failing (e.g. a crashed tab)
        with contextlib.suppress(WebDriverException):
            _keep(driver, name)
        why = f"within {PAGE_TIMEOUT}s" if isinstance(exc, TimeoutException) else f"({exc.msg})"
        pytest.fail(f"{what} not shown {why} (see test-artifacts/{name}.png, .html, mlflow_ui_server.log)")


def _body_shows(*texts: str) -> Callable[[WebDriver], bool]:
    def ready(driver: WebDriver) -> bool:
        body = driver.find_element("tag name", "body").text
        return all(t in body for t in texts)

    return ready


def _clicked(xpath: str) -> Callable[[WebDriver], bool]:
    """Clicks the element once: a failed attempt (not there yet, re-rendered, covered) raises and is retried."""

    def ready(driver: WebDriver) -> bool:
        driver.find_element("xpath", xpath).click()
        return True

    return ready


def _metric_row(key: str) -> Callable[[WebDriver], list[str] | None]:
    """The cell texts of the row of `key` in the run page's metrics table, once it is rendered."""

    def ready(driver: WebDriver) -> list[str] | None:
        row = driver.find_element("xpath", f"//div[@role='row'][.//a[normalize-space()='{key}']]")
        driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", row)
        cells = [c.text for c in row.find_elements("xpath", "./div[@role='cell']")]
        return cells if len(cells) >= 2 and all(cells) else None

    return ready


@pytest.mark.slow
def test_ui_shows_the_study_and_its_child_runs_metric(browser: WebDriver, ui: str, store: Store) -> None:
    # A plain link, as the UI's experiment list makes: MLflow 3 opens a new browser profile on its GenAI overview,
    # which has no runs table, unless the landing page (lab/track/ui_app.py) chose the training view.
    name = "mlflow_ui_experiment"
    browser.get(f"{ui}#/experiments/{store.experiment_id}")
    _wait(browser, name, f"experiment {STUDY} with run {PARENT}", _body_shows(STUDY, PARENT))
    # The child is folded under its parent (tag mlflow.parentRunId); unfolding it proves the nesting.
    expand = f"//a[normalize-space()='{PARENT}']/ancestor::*[@role='gridcell'][1]//button"
    _wait(browser, name, f"the expand button of run {PARENT}", _clicked(expand))
    _wait(browser, name, f"child run {CHILD} under {PARENT}", _body_shows(CHILD))
    _keep(browser, name)

    name = "mlflow_ui_run"
    browser.get(f"{ui}#/experiments/{store.experiment_id}/runs/{store.child_id}")
    cells = _wait(browser, name, f"metric {METRIC} of run {CHILD}", _metric_row(METRIC))
    _keep(browser, name)
    assert cells == [METRIC, f"{VALUE:g}"]
    assert CHILD in browser.find_element("tag name", "body").text
