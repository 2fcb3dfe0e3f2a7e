"""`lab report` (an experiment's study as tables, figures and report.md) and `lab paper` (the paper's claims
beside the studies): both from MLflow alone, nothing rerun."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from lab.cli.common import Verb, named, path_type, reachable
from lab.config import ConfigError, redact
from lab.config.composition import compose

logger = logging.getLogger(__name__)


def cmd_report(args: argparse.Namespace) -> int:
    """tables and figures of an experiment's study, from MLflow alone, into reports/NAME/

    Regenerate the report of `lab ablate experiment=NAME` from MLflow alone (nothing is rerun, no cache is
    read): tables as Markdown, LaTeX and CSV (AL per arm x suite x k, each arm's ratio to the baseline arm with a
    95 % paired bootstrap interval over seeds and prompts, per-position acceptance, rollout accuracy, drift),
    figures as PNG and PDF, and report.md with the provenance. The study is the one the same overrides ran (else
    the newest, said so).
    """
    from lab.sweep import experiment, find

    if any(o.startswith("multirun=") for o in args.overrides):
        exp, extra, uri, parent = _multirun_study(args)
        notes = []
    else:
        name, extra = named(args.overrides, "experiment", "lab report experiment=drift_2x2", experiment.available())
        exp = experiment.load(name, seeds_arg=args.seeds)
        uri = reachable(compose([*exp.overrides, *extra]).tracking.uri)
        parent, notes = _parent(exp, extra, uri, args)
    study = load_study(exp, uri, parent, exp.seeds if args.seeds is not None else None)
    if args.seeds is not None:
        notes.append(find.seeds_found(study, exp.seeds))
    for note in filter(None, notes):
        logger.warning(note)
    rep = write_report(exp, extra, study, args.out, args.seeds)
    print(rep.main_table())
    for t in rep.tables:
        print(f"table  {rep.folder / 'tables' / t.name}.{{md,tex,csv}}")
    for f in rep.figures:
        print(f"figure {f.files[0].with_suffix('')}.{{png,pdf}}")
    print(f"report: {rep.path} (parent run {parent}; also its `report/` artifacts in `lab ui`)")
    return 0


def _parent(exp: Any, extra: list[str], uri: str, args: argparse.Namespace) -> tuple[str, list[str]]:
    """The parent run of the experiment's study (`--run`, else the one these overrides ran, else the newest),
    and a note where it is not the exact one."""
    from lab import report
    from lab.sweep import find

    notes = []  # said once every check has passed: an error is the command's one line
    sweep = exp.as_sweep(extra)
    if args.run is not None:
        parent = find.parent_of(sweep, "experiment", uri, args.run)
    else:
        parent, note = report.find_parent(uri, sweep.experiment, exp.name, sweep.study_name(extra))
        notes.append(note)
    return parent, notes


def _multirun_study(args: argparse.Namespace) -> tuple[Any, list[str], str, str]:
    """`lab report multirun=NAME [tracking...]`: the multirun rebuilt from its parent run's command (the newest
    study of NAME, or `--run`), its overrides, the store and the parent run id."""
    from lab import track
    from lab.sweep import multirun

    name, rest = named(args.overrides, "multirun", "lab report multirun=multirun", [multirun.DEFAULT_NAME])
    other = [o for o in rest if not o.startswith("tracking.")]
    if other:
        raise ConfigError(other[0].split("=", 1)[0], "a multirun's report takes only multirun=NAME and tracking.*")
    if args.seeds is not None:
        raise ConfigError("--seeds", "only with experiment=NAME (a multirun's seeds are its seed=... sweep)")
    uri = reachable(compose(rest).tracking.uri)
    parents = [p for p in track.study_parents(uri, name, name) if p.data.tags.get("lab.command")]
    if args.run is not None:
        parents = [p for p in parents if p.info.run_id == args.run]
    if not parents:
        wanted = f"parent run {args.run} of" if args.run else "a study of"
        raise ConfigError("multirun", f"no {wanted} multirun '{name}' in {redact(uri)}; run `lab run -m ...` first")
    exp, extra = multirun.from_command(parents[0].data.tags["lab.command"])
    return exp, extra + rest, uri, parents[0].info.run_id


def cmd_paper(args: argparse.Namespace) -> int:
    """the paper's claims beside the studies of a profile, from MLflow alone, into one Markdown page

    For each claim of the EAGLE 3.1 paper (AL on standard benchmarks, long context and perturbed templates,
    extrapolation beyond the TTT depth, norm growth, attention on the sink and on the drafter's own tokens): the
    ratio EAGLE 3.1 / EAGLE-3 from the study of the experiment that measures it (run with the same overrides),
    with its 95 % paired bootstrap interval, the verdict its interval gives (agrees, disagrees, inconclusive),
    the training budget behind it and the run ids. A study not run yet is named as such. Nothing is rerun.
    """
    from lab.report import find_parent, paper
    from lab.sweep import experiment

    extra = list(args.overrides)
    claims = [c for c in paper.CLAIMS if args.experiment in (None, c.experiment)]
    if not claims:
        measured = sorted({c.experiment for c in paper.CLAIMS})
        raise ConfigError("--experiment", f"no claim is measured on {args.experiment!r}; expected one of {measured}")
    # each experiment composed as its ablation ran it (its own overrides, e.g. attention_2x2's target and data)
    exps = {c.experiment: experiment.load(c.experiment) for c in claims}
    cfgs = {name: compose([*exp.overrides, *extra]) for name, exp in exps.items()}
    uri = reachable(next(iter(cfgs.values())).tracking.uri)
    studies: dict[str, tuple] = {}  # experiment -> (its study or None, how it was found)
    for name, exp in exps.items():
        sweep = exp.as_sweep(extra)
        try:
            parent, note = find_parent(uri, sweep.experiment, exp.name, sweep.study_name(extra))
        except ConfigError:  # no study of it in the store: the page says so
            studies[name] = (None, "")
            continue
        studies[name] = (load_study(exp, uri, parent), note)
    findings = [paper.measure(claim, *studies[claim.experiment]) for claim in claims]
    checkpoints = None
    if paper.CHECKPOINT_CLAIM.experiment in studies:
        checkpoints = paper.measure_checkpoints(*studies[paper.CHECKPOINT_CLAIM.experiment])
    out = Path(args.out or Path("reports") / "paper.md")
    said = [redact(o) for o in extra]
    command = " ".join(
        ["lab paper", *said]
        + (["--experiment", args.experiment] if args.experiment else [])
        + (["--out", str(args.out)] if args.out else [])
    )
    on = ", ".join(sorted({cfg.target.name for cfg in cfgs.values()}))
    title = f"EAGLE 3.1's claims measured on {on}" + (f" ({' '.join(said)})" if said else "")
    out.parent.mkdir(parents=True, exist_ok=True)
    from lab.fsutil import atomic_file

    with atomic_file(out) as tmp:  # whole or absent: another `lab paper` may write or read the page too
        tmp.write_text(paper.markdown(findings, title, command, checkpoints))
    for f in findings:
        print(f"{f.claim.title}: {f.verdict()}; {f.said()}")
    if checkpoints is not None:
        print(f"{paper.CHECKPOINT_CLAIM.title}: {checkpoints.verdict()}; {checkpoints.said()}")
    print(f"page: {out}")
    return 0


def load_study(exp: Any, uri: str, parent_run_id: str, only_seeds: list[int] | None = None) -> Any:
    """The study under `parent_run_id` in store `uri`, as the experiment's report reads it (with `only_seeds`,
    the runs of those seeds alone)."""
    from lab import report

    arms = [(a.name, a.label) for a in exp.arms]
    return report.load(uri, parent_run_id, exp.name, exp.description, arms, exp.baseline, exp.seeds, only_seeds)


def _command(verb: str, exp: Any, extra: list[str], seeds_arg: str | None) -> str:
    """`lab VERB experiment=NAME [--seeds S] OVERRIDES` as said in a report and the UI (no password); a multirun's
    is `lab run -m ...` (its parent keeps it) and `lab report multirun=NAME` with where it is tracked."""
    if exp.kind == "multirun":
        if verb != "report":
            return exp.description
        placement = [redact(o) for o in extra if o.startswith("tracking.")]
        return " ".join(["lab report", f"multirun={exp.name}", *placement])
    seeds = [f"--seeds {seeds_arg}"] if seeds_arg else []
    return " ".join([f"lab {verb}", f"experiment={exp.name}", *seeds, *(redact(o) for o in extra)])


def report_command(exp: Any, extra: list[str], seeds_arg: str | None) -> str:
    """The command that writes the study's report again."""
    return _command("report", exp, extra, seeds_arg)


def write_report(exp: Any, extra: list[str], study: Any, out: str | None, seeds_arg: str | None) -> Any:
    """Write the experiment's report of `study` (into `out`, else reports/NAME), naming the command that
    writes it again, and the descriptions of the study in the MLflow UI."""
    from lab import report

    command, rerun = _command("report", exp, extra, seeds_arg), _command("ablate", exp, extra, seeds_arg)
    written = report.write(study, exp.figures, Path(out or Path("reports") / exp.name), command, rerun)
    describe_study(exp, extra, seeds_arg)
    return written


def describe_study(exp: Any, extra: list[str], seeds_arg: str | None) -> None:
    """The experiment's description in the MLflow UI: what its arms compare, each arm's toggles in words (from
    its composed config), the seeds, profile, target and data this study runs with, and its commands."""
    from lab import track
    from lab.config.identity import flatten
    from lab.report import notes

    cfgs = {a.name: compose([*exp.overrides, *a.overrides, *extra]) for a in exp.arms}
    cfg = cfgs[exp.baseline]
    profiles = [o.split("=", 1)[1] for o in extra if o.startswith("profile=")]
    e = cfg.eval
    setting = [
        f"- Seeds {', '.join(map(str, exp.seeds))}; profile "
        + (f"`{profiles[-1]}`" if profiles else "none (the default run's sizes)"),
        f"- Target `{cfg.target.name}`; data `{cfg.data.name}` ({cfg.data.source.name}); suites "
        f"{', '.join(e.suites or [])}; k in {', '.join(map(str, e.num_speculative_tokens))}; backends "
        f"{', '.join(e.backends)}",
    ]
    if exp.overrides:
        setting.append(f"- Every arm: `{' '.join(exp.overrides)}`")
    toggles = notes.arm_toggles({name: flatten(c) for name, c in cfgs.items()})
    arms = [(a.name, a.label) for a in exp.arms]
    text = notes.experiment_note(
        exp.name,
        exp.description,
        arms,
        exp.baseline,
        toggles,
        setting,
        _command("ablate", exp, extra, seeds_arg),
        _command("report", exp, extra, seeds_arg),
    )
    track.describe_experiment(cfg.tracking.uri, cfg.tracking.artifact_root, exp.name, text)


def _report_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", help="experiment=NAME, then the overrides the ablation ran with")
    p.add_argument("--run", help="the study's MLflow parent run id (default: found by experiment and overrides)")
    p.add_argument("--out", type=path_type("out-dir"), help="output folder (default: reports/NAME)")
    p.add_argument("--seeds", help="the seeds the ablation ran with --seeds (default: the experiment's)")


def _paper_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", help="the overrides the studies ran with, e.g. profile=medium")
    p.add_argument("--experiment", help="only the claims measured on this experiment, e.g. attention_2x2")
    p.add_argument("--out", type=path_type("out-file"), help="the page (default: reports/paper.md)")


REPORT = Verb(
    cmd_report,
    _report_arguments,
    epilog="examples:\n  lab report experiment=drift_2x2\n"
    "  lab report experiment=drift_2x2 profile=quick --seeds 0,1\n"
    "  lab report experiment=drift_2x2 --run PARENT_RUN_ID",
    fill=False,
)
PAPER = Verb(
    cmd_paper,
    _paper_arguments,
    epilog="examples:\n  lab paper profile=medium --out docs/results/paper.md\n  lab paper profile=quick\n"
    "  lab paper profile=quick --experiment attention_2x2",
    fill=False,
)
