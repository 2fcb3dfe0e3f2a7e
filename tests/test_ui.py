"""`lab ui` in a real browser, after a micro study (`micro_study` in tests/conftest.py: two arms x two seeds run
as `lab ablate` runs an experiment, then its report): from the URL `lab ui experiment=tiny` prints, headless
Chromium finds the study's description, each arm's AL at k = 3, the parent run's table and a figure, each
within three clicks. Kept in test-artifacts/ for a look or a post-mortem: a screenshot and the page source of
each page, and the server's log. Without a browser: `lab ui` for a study the store lacks is one line naming
the studies there are, and MLflow's telemetry is off in lab's processes unless the user turns it on.

Needs Debian's chromium + chromium-driver (scripts/install_browser.sh) and selenium: skipped without
them, failed instead when LAB_REQUIRE_BROWSER=1 (CI)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
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
    """A study as the sweep engine starts it: an experiment, a parent run, a child run (cheap: for the checks that
    need no browser)."""
    uri = f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}"
    root = str(tmp_path / "mlruns" / "artifacts")
    tags = {"study": STUDY, "sweep": "ui"}
    with track.parent_run(uri, root, STUDY, PARENT, key="ui-test", tags=tags) as parent:
        with track.start_run(uri, root, STUDY, CHILD, {**tags, "arm": "a", "seed": 0}, parent.id) as child:
            pass
    assert [r.info.run_id for r in track.child_runs(uri, parent.id)] == [child.id]
    experiment_id = track.search_runs(uri, STUDY)[0].info.experiment_id
    return Store(uri, root, experiment_id, parent.id, child.id)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ui(micro_study, tmp_path: Path) -> Iterator[str]:
    """`lab ui experiment=tiny` over the micro study's store, as a user starts it: the URL it prints, once the
    server answers."""
    port = _free_port()
    ARTIFACTS.mkdir(exist_ok=True)
    for old in ARTIFACTS.glob("mlflow_ui_*"):  # a previous run's pages would mislead
        old.unlink()
    log_path = ARTIFACTS / "mlflow_ui_server.log"
    env = {
        **os.environ,
        "MLFLOW_WORKERS": "1",  # one uvicorn worker answers in about half the time of the default four
    }
    store = [o for o in micro_study.extra if o.startswith("tracking.")]
    cmd = [sys.executable, "-m", "lab.cli", "ui", "experiment=tiny", "--no-browser", "--port", str(port), *store]
    with open(log_path, "w") as log:
        # its own process group: `lab ui` execs mlflow, which forks uvicorn workers; all must go at the end
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, env=env, start_new_session=True
        )
    try:
        _wait_for_http(f"http://127.0.0.1:{port}/", proc, log_path)
        printed = re.search(r"MLflow UI on (\S+)", log_path.read_text())
        assert printed, f"`lab ui` printed no URL:\n{log_path.read_text()[-3000:]}"
        yield printed.group(1)
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
        ElementNotInteractableException,
        StaleElementReferenceException,
        TimeoutException,
        WebDriverException,
    )
    from selenium.webdriver.support.ui import WebDriverWait

    # the UI re-renders as its requests come back: an element found a moment ago may be gone or covered
    ignored = [StaleElementReferenceException, ElementClickInterceptedException, ElementNotInteractableException]
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
    """Clicks the element once, scrolled into view: a failed attempt (not there yet, re-rendered, covered) raises
    and is retried."""

    def ready(driver: WebDriver) -> bool:
        element = driver.find_element("xpath", xpath)
        driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", element)
        element.click()
        return True

    return ready


def _shown(xpath: str, check: Callable[[str], bool] = bool) -> Callable[[WebDriver], str | None]:
    """The text of the element at `xpath`, scrolled into view, once `check` accepts it."""

    def ready(driver: WebDriver) -> str | None:
        element = driver.find_element("xpath", xpath)
        driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", element)
        return element.text if check(element.text) else None

    return ready


def _image_loaded(name: str) -> Callable[[WebDriver], bool]:
    """Whether the page shows the image `name` (drawn: its natural width is known once it has loaded)."""

    def ready(driver: WebDriver) -> bool:
        img = driver.find_element("xpath", f"//img[contains(@alt, '{name}')]")  # the artifact view's: a blob URL
        return bool(driver.execute_script("return arguments[0].complete && arguments[0].naturalWidth > 0", img))

    return ready


NOTE = "//div[@data-testid='note-editor-preview-content']"  # a rendered description (mlflow.note.content)


@pytest.mark.slow
def test_ui_walks_the_study_from_the_url_it_prints(browser: WebDriver, ui: str, micro_study) -> None:
    exp, uri, parent_id = micro_study.experiment, micro_study.uri, micro_study.result.parent_run_id
    labels = {a.name: a.label for a in exp.arms}
    children = track.child_runs(uri, parent_id, status="FINISHED")
    # each arm's AL at k=3, as each child run's description starts (the runs table shows its first ~45 characters)
    al_lines = sorted(
        f"{labels[r.data.tags['arm']]}: AL {r.data.metrics['eval/in_dist/ref/k3/al']:.3f} at k=3, seed "
        f"{r.data.tags['seed']}"
        for r in children
    )
    assert len(al_lines) == 4

    # the URL `lab ui` printed: the study's runs in its saved view, under the start of its description
    name = "mlflow_ui_study"
    browser.get(ui)
    _wait(browser, name, "the study's description", _body_shows(f"tiny: {exp.description}"))
    _wait(browser, name, "each arm's AL at k=3 in the runs' descriptions", _body_shows(*al_lines))
    # click 1: the description unfolds: the arms and their toggles in words
    _wait(browser, name, "the description's unfold button", _clicked(EXPAND_DESCRIPTION))
    _wait(browser, name, "the arms' toggles", _body_shows("what it sets", "FC norm per captured layer, post-norm"))
    _keep(browser, name)

    # click 1: the parent run; click 2: its whole description, the report's main table
    name = "mlflow_ui_parent"
    _wait(browser, name, "the parent run's link", _clicked(f"//a[normalize-space()='sweep-{exp.name}']"))
    _wait(browser, name, "the parent run's description", _shown(NOTE))
    with contextlib.suppress(Exception):  # "Show more" is there only where the description is folded
        browser.find_element("xpath", "//button[@data-testid='show-comment-toggle']").click()
    main = micro_study.report.tables[0]
    means = [f"{row.cells[0].mean:.3f}" for row in main.rows]  # each arm's AL at k=3, as the report has it
    table = _wait(browser, name, "the report's main table", _shown(f"{NOTE}//table", lambda t: "k=3" in t))
    for row, mean in zip(main.rows, means, strict=True):
        assert re.search(rf"^{re.escape(row.label)} 2 {mean} ± ", table, re.M), (row.label, mean, table)
    _keep(browser, name)

    # click 3: a figure, in the parent run's artifacts (the link opens a tab of its own)
    name = "mlflow_ui_figure"
    tabs = set(browser.window_handles)
    _wait(browser, name, "the figure's link", _clicked(f"{NOTE}//a[normalize-space()='al_vs_depth']"))
    new = _wait(browser, name, "the figure's tab", lambda d: set(d.window_handles) - tabs)
    browser.switch_to.window(new.pop())
    _wait(browser, name, "figure al_vs_depth.png", _image_loaded("al_vs_depth.png"))
    _keep(browser, name)


EXPAND_DESCRIPTION = "//button[@data-component-id='mlflow.experiment.metadata_editor.expand_button']"


def test_ui_refuses_a_study_the_store_lacks_in_one_line(store: Store, capsys) -> None:
    from lab.cli import main

    assert main(["ui", "experiment=nope", "--no-browser", *store.overrides()]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: experiment: no study 'nope' in {store.uri}; the studies there: {STUDY}"]
    # the page of a study: its runs (with the saved view `lab report` stores, shown by tests/test_report.py)
    assert track.study_page(store.uri, STUDY) == f"#/experiments/{store.experiment_id}/runs"
    assert track.study_page(store.uri, None) == f"#/experiments/{store.experiment_id}/runs"


@pytest.mark.parametrize(("set_by_user", "seen"), [(None, "true"), ("false", "false")])
def test_mlflow_telemetry_is_off_unless_turned_on(set_by_user: str | None, seen: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_DISABLE_TELEMETRY"}
    if set_by_user is not None:
        env["MLFLOW_DISABLE_TELEMETRY"] = set_by_user
    code = "import os, lab.track; print(os.environ['MLFLOW_DISABLE_TELEMETRY'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == seen
