"""A tracking server and the UI: whether a server answers before MLflow's client retries it for minutes
(`check_reachable`), and the `mlflow server` and `mlflow ui` command lines the CLI runs.
"""

from __future__ import annotations

import sys
from pathlib import Path


def check_reachable(uri: str, timeout: float = 3.0) -> None:
    """ValueError (one line) when `uri` is an MLflow server that does not answer its health check.

    MLflow's own client retries a dead server for minutes before it fails; a command checks first.
    A local or database store is not checked here (opening it tells)."""
    if not uri.startswith(("http://", "https://")):
        return
    import os
    import re
    import ssl
    import urllib.error
    import urllib.request

    shown = re.sub(r"//[^/@]*@", "//", uri)  # /health needs no credentials; a message shows none
    try:
        context = None  # the TLS settings MLflow's client honours, so that the check agrees with it
        if os.environ.get("MLFLOW_TRACKING_INSECURE_TLS", "").lower() == "true":
            context = ssl._create_unverified_context()
        elif os.environ.get("MLFLOW_TRACKING_SERVER_CERT_PATH"):
            context = ssl.create_default_context(cafile=os.environ["MLFLOW_TRACKING_SERVER_CERT_PATH"])
        with urllib.request.urlopen(shown.rstrip("/") + "/health", timeout=timeout, context=context):
            return
    except urllib.error.HTTPError as exc:
        if exc.code < 500:  # something answers (a proxy, an auth wall): MLflow reports what it is
            return
        reason: object = f"HTTP {exc.code} {exc.reason}"
    except urllib.error.URLError as exc:
        reason = exc.reason
    except (OSError, ValueError) as exc:  # a timeout while reading, a malformed address, a missing CA file
        reason = exc
    raise ValueError(f"cannot reach the MLflow server at {shown}: {' '.join(str(reason).split())}")


def ui_environment() -> dict[str, str]:
    """Environment for the UI server: without MLflow 3's job runner (GenAI scorers), which starts eight
    worker processes that keep two cores busy while the workbench has no job for them."""
    return {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


UI_APP = "lab"  # lab/track/ui_app.py, an `mlflow.app` entry point in pyproject.toml: opens runs tables


def server_command(
    backend_uri: str, artifacts_destination: str, host: str = "127.0.0.1", port: int = 5000, workers: int = 2
) -> list[str]:
    """`mlflow server` over a database backend store, serving artifacts itself: clients on other machines
    log to `http://HOST:PORT` and upload their artifacts through it into `artifacts_destination`."""
    destination = artifacts_destination
    if "://" not in destination:
        root = Path(destination).resolve()
        root.mkdir(parents=True, exist_ok=True)
        destination = root.as_uri()
    return [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--backend-store-uri",
        backend_uri,
        "--serve-artifacts",
        "--artifacts-destination",
        destination,
        "--host",
        host,
        "--port",
        str(port),
        "--workers",
        str(workers),
        "--app-name",
        UI_APP,
    ]


def ui_command(uri: str, artifact_root: str, host: str = "127.0.0.1", port: int = 5000) -> list[str]:
    """The `mlflow ui` command line over the configured store (bound to loopback by default).

    Run as `python -m mlflow` with this interpreter: the venv's `mlflow` script is not on PATH when
    `.venv/bin/lab ui` is called without activating the venv."""
    cmd = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri, "--host", host, "--port", str(port)]
    cmd += ["--app-name", UI_APP]
    if "://" not in artifact_root:
        cmd += ["--default-artifact-root", Path(artifact_root).resolve().as_uri()]
    return cmd
