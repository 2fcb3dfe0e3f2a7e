"""`lab studies` (every study in the store) and `lab runs` (the runs of one study), as tables or JSON, from
MLflow alone."""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import asdict

from lab.cli.common import STORE_KEYS, SWEEP_FILE, Verb, reachable
from lab.config import redact
from lab.config.composition import compose

logger = logging.getLogger(__name__)


def cmd_studies(args: argparse.Namespace) -> int:
    """the store's studies: kind, arms, seeds, runs by state, the headline AL once finished

    List every study in the store of tracking.uri (ablations, sweeps and multiruns), newest first: its name,
    kind, state, arms, seeds, its child runs counted by state and, once it finished, its headline: the AL of its
    best arm at the deepest k of its first suite (mean ± std over seeds) and, for an ablation, that arm's ratio to
    the baseline with the report's 95 % paired bootstrap interval. `--json` prints the same as one JSON list.
    """
    from lab.report import listing

    uri = _store(args.overrides)
    rows = listing.studies(uri, headlines=not args.no_headline)
    if args.json:
        print(json.dumps([r.to_json() for r in rows], indent=2))
    elif not rows:
        print(f"no studies in {redact(uri)} (run `lab ablate experiment=NAME` or `lab sweep sweep=NAME` first)")
    else:
        print(listing.studies_table(rows), end="")
    return 0


def cmd_runs(args: argparse.Namespace) -> int:
    """the runs of one study: arm, seed, state, AL, time, run id

    List the child runs of the study of `experiment=NAME` or `sweep=NAME` that the same overrides ran (else the
    newest, said so; --run picks one by its parent run id), in the order they started: arm, seed, state (a
    pruned trial is PRUNED, a failed one names its error), the AL at the deepest k of the first suite, when it
    started and how long it took, its run id and config hash. `--json` prints the same as one JSON list.
    """
    from lab import track
    from lab.report import find_parent, listing
    from lab.sweep import find

    sweep, kind, extra, cfg = find.study_spec(args.overrides, args.seeds, "runs")
    uri = reachable(cfg.tracking.uri)
    if args.run is not None:
        parent_id, note = find.parent_of(sweep, kind, uri, args.run), ""
    else:
        parent_id, note = find_parent(uri, sweep.experiment, sweep.name, sweep.study_name(extra))
    if note:
        logger.warning(note)
    rows = listing.runs(uri, track.get_run(uri, parent_id))
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=2))
    else:
        print(listing.runs_table(rows), end="")
    return 0


def _store(overrides: list[str]) -> str:
    """The store that the overrides compose (`tracking.uri=...`, or a profile that sets it)."""
    return reachable(compose(list(overrides)).tracking.uri)


def _studies_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", help=f"the store: {', '.join(k + '=...' for k in STORE_KEYS)}")
    p.add_argument("--json", action="store_true", help="one JSON list instead of a table")
    p.add_argument(
        "--no-headline", action="store_true", help="leave out the headline AL (it reads each study's records)"
    )


def _runs_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", help="experiment=NAME or sweep=NAME, then the overrides it ran with")
    p.add_argument("--run", help="the study's MLflow parent run id (default: found by name and overrides)")
    p.add_argument("--seeds", help="with experiment=NAME: the seeds `lab ablate --seeds` ran")
    p.add_argument("--json", action="store_true", help="one JSON list instead of a table")


STUDIES = Verb(
    cmd_studies,
    _studies_arguments,
    epilog="examples:\n  lab studies\n  lab studies --json\n  lab studies tracking.uri=sqlite:///other/mlflow.db",
)
RUNS = Verb(
    cmd_runs,
    _runs_arguments,
    epilog="examples:\n  lab runs experiment=drift_2x2 profile=quick target=tiny_code data=code --seeds 0,1\n"
    "  lab runs sweep=toggles_grid --json\n  lab runs experiment=drift_2x2 --run PARENT_RUN_ID",
    named_files=(SWEEP_FILE,),
)
