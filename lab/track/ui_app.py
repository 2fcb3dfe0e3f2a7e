"""The MLflow server app that `lab ui` and `lab server` run (`mlflow ui --app-name lab`): MLflow's own app,
whose landing page first makes the model-training view the browser's default.

MLflow 3 opens an experiment in the view kept in the browser's localStorage (`mlflow.workflowType_v1`),
or in its GenAI view when nothing is kept, which has no runs table; it ignores experiment tags. The workbench's
experiments are training runs, so the page sets the training view where the browser has no choice yet (a
choice made with the UI's own GenAI / Model training switch stays)."""

from __future__ import annotations

from pathlib import Path

import mlflow.server
from fastapi.routing import APIRoute
from mlflow.server.fastapi_app import app
from starlette.responses import HTMLResponse

INDEX = Path(mlflow.server.__file__).parent / "js" / "build" / "index.html"
WORKFLOW_KEY = "mlflow.workflowType_v1"
SET_TRAINING_VIEW = (
    f"<script>try{{if(localStorage.getItem('{WORKFLOW_KEY}')===null)"
    f"localStorage.setItem('{WORKFLOW_KEY}','\"machine_learning\"')}}catch(e){{}}</script>"
)


async def landing_page() -> HTMLResponse:
    return HTMLResponse(INDEX.read_text().replace("<head>", f"<head>{SET_TRAINING_VIEW}", 1))


# before MLflow's catch-all mount of its Flask app at "/", which would serve the page unchanged
app.router.routes.insert(0, APIRoute("/", landing_page, methods=["GET"], include_in_schema=False))

__all__ = ["app"]
