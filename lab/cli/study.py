"""move a study (its parent and child runs, optionally its Optuna study) between MLflow stores

lab study export: one study of `lab ablate experiment=NAME` or `lab sweep sweep=NAME` (the one the same
overrides ran, else the newest; --run picks one) into one .tar.gz: the parent and child runs with their tags,
params, every metric's history, dataset inputs and artifacts (per-prompt records, suites, config, report),
checked by a manifest of sha256 hashes. Drafter checkpoints only with --with-checkpoints, the Optuna study only
with --with-optuna, the study's small cache entries (its regenerations; its answers and held-out states where each
fits --cache-limit) only with --with-caches. Written atomically; its size is printed.

lab study import ARCHIVE: those runs into the store of tracking.uri / tracking.artifact_root (and the Optuna
study into its storage), after checking the whole archive: a damaged archive, or one of an unknown schema
version, is refused in one line and nothing is written. Runs already there (imported before, tagged
lab.imported_from) are skipped, so importing twice changes nothing. Cache entries the archive carries are restored
into cache_dir where it has none, so that the same `lab ablate` command resumes the study there without paying
those stages again (--no-caches leaves them).
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

from lab.cli.common import STORE_KEYS, SWEEP_FILE, Verb, path_type, reachable
from lab.config import ConfigError, redact
from lab.config.composition import compose
from lab.config.rules import PathRule
from lab.preflight import check_paths

logger = logging.getLogger(__name__)

EPILOG = (  # `lab study -h`'s
    "examples:\n  lab study export experiment=drift_2x2 profile=quick --seeds 0,1 --out drift.tar.gz\n"
    "  lab study export sweep=tpe_eagle31 --with-optuna --out tpe.tar.gz\n"
    "  lab study import drift.tar.gz tracking.uri=sqlite:///laptop/mlflow.db tracking.artifact_root=laptop/art\n"
    "  lab report experiment=drift_2x2 profile=quick --seeds 0,1 tracking.uri=sqlite:///laptop/mlflow.db"
)


def cmd_study_export(args: argparse.Namespace) -> int:
    """a study's runs (and optionally its Optuna study and checkpoints) into one .tar.gz

    Write one study of an experiment or sweep into one archive (see `lab study -h`).
    """
    from lab import track
    from lab.report import find_parent
    from lab.sweep import find

    sweep, kind, extra, cfg = find.study_spec(args.overrides, args.seeds, "export")
    uri = reachable(cfg.tracking.uri)
    verb = "ablate" if kind == "experiment" else "sweep"
    parents = track.study_parents(uri, sweep.experiment, sweep.name)
    note = ""
    if args.run is not None:
        parent_id = find.parent_of(sweep, kind, uri, args.run)
    elif not parents:
        raise ConfigError(
            kind, f"no study of '{sweep.name}' in {redact(uri)}; expected one run by `lab {verb} {kind}={sweep.name}`"
        )
    else:
        parent_id, note = find_parent(uri, sweep.experiment, sweep.name, sweep.study_name(extra))
    parent = next(p for p in parents if p.info.run_id == parent_id)
    study_name = parent.data.tags.get("optuna_study", parent_id)
    out = Path(args.out or f"{study_name}.tar.gz")
    if out.is_dir():
        raise ConfigError(
            "--out", f"'{out}' is a directory; expected the archive's file, e.g. {out / study_name}.tar.gz"
        )
    url = None
    if args.with_optuna:
        from lab.sweep.dashboard import read_studies
        from lab.sweep.storage import storage_url

        url = storage_url(cfg)
        held = read_studies(url, "--with-optuna").studies
        if study_name not in held:
            raise ConfigError(
                "--with-optuna",
                f"no Optuna study '{study_name}' in '{redact(url)}' (it holds {', '.join(sorted(held))}); expected the "
                "storage the study ran with (tracking.optuna_storage)",
            )
    from lab.track import study_archive
    from lab.track.study_archive import caches

    if note:
        logger.warning(note)
    study = {"kind": kind, "name": sweep.name, "experiment": sweep.experiment, "optuna_study": study_name}
    study["overrides"] = [redact(o) for o in extra]
    cached = _study_caches(uri, parent_id, Path(cfg.cache_dir), args.cache_limit) if args.with_caches else None
    with tempfile.TemporaryDirectory(prefix="lab-optuna-") as tmp:
        files, optuna = {}, None
        if url is not None:
            from lab.sweep import optuna_archive

            journal = Path(tmp) / "study.journal"
            trials = optuna_archive.dump(url, study_name, journal)
            files = {"optuna/study.journal": journal}
            optuna = {"study": study_name, "file": "optuna/study.journal", "trials": trials}
        listed = None
        if cached is not None:
            files |= caches.member_files(Path(cfg.cache_dir), cached.carried)
            listed = caches.describe(cached.carried)
        done = study_archive.export_study(uri, parent_id, out, study, args.with_checkpoints, files, optuna, listed)
    size = done.bytes / 1024
    said = f"{size:.1f} KiB" if size < 1024 else f"{size / 1024:.1f} MiB"
    print(
        f"study {study_name}: {done.runs} runs (parent {parent_id} and {done.runs - 1} children), "
        f"{done.artifacts} artifact files" + (f", the Optuna study ({optuna['trials']} trials)" if optuna else "")
    )
    if done.checkpoints_left_out:
        print(f"  left out: {done.checkpoints_left_out} checkpoint files (--with-checkpoints carries them)")
    if cached is not None:
        print(cached.summary(args.cache_limit))
    print(f"archive: {out} ({said}, {done.bytes} bytes)")
    print(f"import it elsewhere with: lab study import {out.name} [tracking.uri=... tracking.artifact_root=...]")
    return 0


@dataclass
class _Cached:
    """The study's cache entries an export carries, and those over the limit it leaves out."""

    carried: list
    larger: list

    def summary(self, limit_mib: float) -> str:
        said = ", ".join(f"{e.name} ({_size(e.bytes)})" for e in self.carried) or "none"
        total = _size(sum(e.bytes for e in self.carried))
        text = f"  caches: {len(self.carried)} entries, {total}: {said}"
        if self.larger:
            over = ", ".join(f"{e.name} ({_size(e.bytes)})" for e in self.larger)
            text += f"\n  left out, each over --cache-limit {limit_mib:g} MiB: {over}"
        return text


def _study_caches(uri: str, parent_id: str, cache_dir: Path, limit_mib: float) -> _Cached:
    """The entries of `cache_dir` made with the study's targets (its runs' `target` tags), by size."""
    from lab import track
    from lab.track.study_archive import caches

    if not limit_mib > 0:
        raise ConfigError("--cache-limit", f"expected a size in MiB above 0, got {limit_mib:g}")
    runs = [*track.child_runs(uri, parent_id)]
    targets = {r.data.tags["target"] for r in runs if "target" in r.data.tags}
    return _Cached(*caches.study_entries(cache_dir, targets, int(limit_mib * 2**20)))


def _size(n: int) -> str:
    return f"{n / 1024:.1f} KiB" if n < 2**20 else f"{n / 2**20:.1f} MiB"


def _restore_caches(archive, cache_dir: Path) -> str:  # noqa: ANN001 - a study_archive.Archive
    """The archive's cache entries restored into `cache_dir` (those it lacks); what to say about it."""
    from lab.track.study_archive import caches

    try:
        entries = caches.listed(archive.manifest)
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError("ARCHIVE", f"{archive.path}: {exc}") from None
    if not entries:
        return ""
    restored, kept = caches.restore(archive.folder, entries, cache_dir)
    said = ", ".join(e.name for e in restored) or "none"
    there = f"; {len(kept)} already there, kept" if kept else ""
    return f"caches into {cache_dir}: restored {len(restored)} of {len(entries)} ({said}){there}"


def cmd_study_import(args: argparse.Namespace) -> int:
    """an archive of `lab study export` into the configured store

    Import an archive of `lab study export` into tracking.uri (see `lab study -h`).
    """
    from lab import track
    from lab.track import study_archive

    path = Path(args.archive)
    if "=" in args.archive and not path.exists():
        raise ConfigError(
            "ARCHIVE",
            f"'{args.archive}' is an override, not an archive; expected `lab study import ARCHIVE [overrides]`",
        )
    cfg = compose(args.overrides)
    check_paths(cfg, keys=STORE_KEYS)
    uri = reachable(cfg.tracking.uri)
    try:
        # under the lock a study's parent run is found or created with (track.parent_run): two imports at once
        # would each plan every run as missing and write it twice, and a study launched during an import would
        # create a second parent under the imported one's key
        waiting = f"another lab process is importing into {redact(uri)} or creating a study's parent run there"
        with (
            study_archive.open_archive(path) as archive,  # checked through before anything is written
            track.store_lock(uri, "parents", waiting),
        ):
            try:
                plan = study_archive.plan_import(uri, cfg.tracking.artifact_root, archive)
            except ValueError as exc:
                raise ConfigError("tracking.uri", str(exc)) from None
            url = storage = None
            if archive.optuna is not None:  # opened (created if need be) now: a bad URL fails before any write
                from lab.preflight import check_optuna_storage
                from lab.sweep.storage import open_storage, storage_url

                url = storage_url(cfg)
                check_optuna_storage(url)
                storage = open_storage(url)
            result = study_archive.apply_import(plan, {"optuna_storage": redact(url)} if url else None)
            optuna_said = ""
            if url is not None:
                from lab.sweep import optuna_archive

                name = archive.optuna["study"]
                journal = archive.file(archive.optuna["file"])
                written, trials = optuna_archive.load(journal, storage, name, result.run_ids)
                optuna_said = f"; Optuna study {name} ({trials} trials) " + (
                    f"into {redact(url)}" if written else f"already in {redact(url)}"
                )
            caches_said = "" if args.no_caches else _restore_caches(archive, Path(cfg.cache_dir))
    except study_archive.ArchiveError as exc:
        raise ConfigError("ARCHIVE", f"{path}: {exc}") from None
    study = archive.study
    replaced = f", {result.replaced} cut short before and imported again" if result.replaced else ""
    print(
        f"imported {result.created} of {len(archive.runs)} runs into {redact(uri)} ({result.skipped} already there"
        f"{replaced}){optuna_said}"
    )
    kind, name = study.get("kind", "experiment"), study.get("name", "?")
    if caches_said:
        print(caches_said)
    print(f"study {study.get('optuna_study', '?')}: parent run {result.parent_run_id}")
    if kind == "experiment":
        store = " ".join(redact(o) for o in args.overrides if o.startswith("tracking."))
        print(f"report: lab report experiment={name} --run {result.parent_run_id} {store}".rstrip())
    return 0


def _export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", help="experiment=NAME or sweep=NAME, then the overrides it ran with")
    archive = path_type(PathRule("out-file", "archive"))
    p.add_argument("--out", type=archive, help="the archive (default: STUDY.tar.gz here)")
    p.add_argument("--run", help="the study's MLflow parent run id (default: found by name and overrides)")
    p.add_argument("--seeds", help="with experiment=NAME: the seeds `lab ablate --seeds` ran")
    p.add_argument("--with-optuna", action="store_true", help="carry the study's Optuna study too")
    p.add_argument(
        "--with-checkpoints", action="store_true", help="carry the drafter checkpoints (`checkpoint/` artifacts) too"
    )
    p.add_argument(
        "--with-caches",
        action="store_true",
        help="carry the study's small cache entries too (its regenerations; its answers and held-out states where "
        "they fit), which `lab study import` restores, so that the study resumed elsewhere pays no stage again",
    )
    p.add_argument(
        "--cache-limit",
        type=float,
        default=16.0,
        metavar="MIB",
        help="with --with-caches: the largest cache entry carried, in MiB (default 16)",
    )


def _import_arguments(p: argparse.ArgumentParser) -> None:
    archive = path_type(PathRule("file", "archive"))
    p.add_argument("archive", type=archive, metavar="ARCHIVE", help="a .tar.gz written by `lab study export`")
    p.add_argument(
        "overrides", nargs="*", help="the destination: tracking.uri=..., tracking.artifact_root=..., cache_dir=..."
    )
    p.add_argument("--no-caches", action="store_true", help="do not restore the archive's cache entries (if any)")


EXPORT = Verb(
    cmd_study_export,
    _export_arguments,
    epilog="examples:\n  lab study export experiment=drift_2x2 --out drift_2x2.tar.gz\n"
    "  lab study export experiment=drift_2x2 --run PARENT_RUN_ID --with-checkpoints --out drift_2x2.tar.gz\n"
    "  lab study export sweep=tpe_eagle31 --with-optuna",
    named_files=(SWEEP_FILE,),
)
IMPORT = Verb(
    cmd_study_import,
    _import_arguments,
    epilog="examples:\n  lab study import drift_2x2.tar.gz\n"
    "  lab study import drift_2x2.tar.gz tracking.uri=sqlite:///laptop/mlflow.db "
    "tracking.artifact_root=laptop/artifacts",
)
