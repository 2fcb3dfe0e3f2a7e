"""Time-stamped lines for a long job's log: where each stage's time went, read in any log afterwards.

`say` writes one line to stderr, opened by the local time of day in ISO 8601 (to the second), flushed at once:
one function, so that these lines can move to `logging` as they are. A run's stages (lab/pipeline.py's
`StageClock`) and the static KV cache's compiles (lab/target/static_decode.py) say when they start and end where
the environment sets LAB_LOG_STAGES=1 (scripts/study_session.py and scripts/gpu_session.sh do); elsewhere they
are quiet, and a run's stage times are its `time/{stage}_s` metrics.
"""

from __future__ import annotations

import datetime
import os
import sys

ENV = "LAB_LOG_STAGES"


def say(message: str) -> None:
    """`message` as one time-stamped line on stderr."""
    now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    print(f"{now} {message}", file=sys.stderr, flush=True)


def logged() -> bool:
    """Whether stages and compiles say when they start and end (LAB_LOG_STAGES=1)."""
    return os.environ.get(ENV) == "1"


def stage(name: str, seconds: float | None = None) -> None:
    """A stage's start (`seconds` None) or its end after `seconds`, where stages are logged."""
    if logged():
        say(f"stage {name}: " + ("start" if seconds is None else f"end, {seconds:.1f} s"))
