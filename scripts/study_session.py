"""Runs a study and keeps what it has in one archive at every moment: `lab ablate` in a process of its own and,
each time one of its runs ends, the study so far exported (`lab study export --with-optuna --with-caches`: its
runs, its Optuna study and its small cache entries), the archive rewritten whole. SIGTERM, SIGINT or SIGUSR1 is
passed to the study once: its running run ends KILLED with the curves it logged, and the archive is written once
more. Elsewhere, `lab study import ARCHIVE` then the same `lab ablate` command resumes the study: its finished runs
are kept and no stage whose cache came along is paid again. Exits with the study's exit code.

    python scripts/study_session.py --out OUT/drift_2x2.tar.gz --seeds 0 experiment=drift_2x2 profile=gpu [...]

`scripts/gpu_session.sh study` runs it. Its lines and the study's start with the time and the level (lab/logs.py).
"""

from __future__ import annotations

import argparse
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's lab, installed or not

from lab import logs  # noqa: E402 - after the path

logs.setup()  # this script's lines as the study's: the time and the level first

say = logging.getLogger("lab.study_session").info

ENDED = ("FINISHED", "FAILED", "KILLED")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="+", help="experiment=NAME and the overrides of `lab ablate`")
    parser.add_argument("--out", type=Path, required=True, help="the archive, rewritten after each run that ends")
    parser.add_argument("--seeds", help="`lab ablate --seeds`")
    parser.add_argument("--every", type=float, default=10.0, help="seconds between two looks at the store")
    parser.add_argument("--grace", type=float, default=300.0, help="seconds the study has to end after a signal")
    parser.add_argument("--cache-limit", default="16", help="`lab study export --cache-limit` (MiB)")
    args = parser.parse_args()
    seeds = ["--seeds", args.seeds] if args.seeds else []
    lab = [sys.executable, "-m", "lab.cli"]
    export = [*lab, "study", "export", *args.overrides, *seeds, "--with-optuna", "--with-caches"]
    export += ["--cache-limit", args.cache_limit, "--out", str(args.out)]
    # a session of its own: a signal to this script's group (`timeout`'s) reaches the study once, through here
    # its stages and compiles are log lines: when each starts and ends
    study = subprocess.Popen([*lab, "ablate", *args.overrides, *seeds, "--no-progress"], start_new_session=True)
    stop = Stop(study)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(signum, stop.pass_on)
    ended = Ended(args.overrides, args.seeds)
    while study.poll() is None:
        time.sleep(args.every)
        if stop.overdue(args.grace):
            say(f"the study has not ended {args.grace:g} s after {stop.name}: killed")
            study.kill()
        if study.poll() is None and ended.more():
            _export(export, f"after {ended.count} runs ended")
    code = study.wait()
    _export(export, f"the study ended (exit {code})")
    return code


class Stop:
    """The first stopping signal, passed on to the study; when it came."""

    def __init__(self, study: subprocess.Popen) -> None:
        self.study, self.at, self.name = study, None, ""

    def pass_on(self, signum: int, frame: object) -> None:
        if self.at is None:
            self.at, self.name = time.monotonic(), signal.Signals(signum).name
            say(f"{self.name}: passed on to the study; the archive follows when it ends")
            self.study.send_signal(signum)

    def overdue(self, grace: float) -> bool:
        return self.at is not None and time.monotonic() - self.at > grace


class Ended:
    """How many of the study's runs have ended, read from its store (none until its parent run exists)."""

    def __init__(self, overrides: list[str], seeds: str | None) -> None:
        self.overrides, self.seeds, self.count = overrides, seeds, 0

    def more(self) -> bool:
        """Whether more runs have ended than at the last look."""
        try:
            count = self._count()
        except Exception as exc:  # noqa: BLE001 - a look that fails (the store being created) is the next one's
            say(f"the store could not be read ({type(exc).__name__}: {exc}); looking again")
            return False
        more, self.count = count > self.count, max(count, self.count)
        return more

    def _count(self) -> int:
        from lab import track
        from lab.report import find_parent
        from lab.sweep import find

        sweep, _, extra, cfg = find.study_spec(self.overrides, self.seeds, "export")
        uri = cfg.tracking.uri
        if not track.study_parents(uri, sweep.experiment, sweep.name):
            return 0
        parent, _ = find_parent(uri, sweep.experiment, sweep.name, sweep.study_name(extra))
        return sum(run.info.status in ENDED for run in track.child_runs(uri, parent))


def _export(command: list[str], why: str) -> None:
    """The study so far into the archive (written whole by `lab study export`), in a session of its own."""
    say(f"exporting the study ({why})")
    done = subprocess.run(command, start_new_session=True, capture_output=True, text=True)
    for line in (done.stdout + done.stderr).splitlines():
        say(f"  {line}")
    if done.returncode != 0:
        say(f"  the export failed (exit {done.returncode}); the archive before it stays")


if __name__ == "__main__":
    sys.exit(main())
