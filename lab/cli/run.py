"""`lab run` (one run of the pipeline) and `lab target build` (its first stage alone)."""

from __future__ import annotations

import argparse
from pathlib import Path

from omegaconf import DictConfig

from lab import metrics as metric_keys
from lab.cli.common import (
    Verb,
    fail,
    integer,
    overrides_only,
    print_arms,
    print_config,
    reachable,
    worker_mode,
    worker_options,
)
from lab.config.composition import compose
from lab.preflight import check_paths, check_target, preflight


def cmd_run(args: argparse.Namespace) -> int:
    """one run: target -> cache -> train -> evaluate -> MLflow; prints the run id

    One run: build or find the target, cache its hidden states, train the configured drafter, evaluate it
    (eval.backends: ref, vllm) and log everything to MLflow; prints the run id.

    drafter.checkpoint=DIR evaluates a drafter trained elsewhere instead (a TorchSpec convert_to_hf.py folder, a
    speculators checkpoint, a `lab export`): no cache, no training. It is checked against the target first
    (vocabulary, hidden size, captured layers) and logged like a trained drafter: its own drafter.* values as
    params, the tags drafter_source and drafter_format, the run's `checkpoint` artifact. Captured layers it does
    not name: drafter.aux_layers, else vLLM's default (2, L//2, L-3).

    -m (Hydra's multirun) runs the cross product of the swept keys' values (`key=a,b`, `range(0,3)`, `choice(..)`)
    as one study on the sweep engine, as `lab ablate` runs an experiment: a parent MLflow run, a child run per arm
    and seed (`seed=0,1` sweeps the seeds), resumable by the same command, `--workers` in parallel, its report in
    reports/NAME/ (`lab report multirun=NAME` again). `lab run -m worker ...` joins it from another process.

    --cfg job prints the composed config, every default filled in, and starts nothing (with -m, each arm's).

    Before its first stage it prints the plan (lab/plan.py): each stage, whether the cache holds it or it is to
    build, its size, and an estimate where this machine has a rate (its earlier runs in the store, else a few
    seconds of measurement at the run's shapes, which the run records in the cache). --dry-run prints the plan and
    starts nothing, writing no file.
    """
    if args.multirun:
        return _multirun(args)
    cfg = compose(args.overrides)
    if args.cfg:
        print_config(cfg)
        return 0
    preflight(cfg)
    from lab.plan import run_plan  # every check has passed: the heavy imports start here

    if args.dry_run:
        print(run_plan(cfg))
        return 0
    reachable(cfg.tracking.uri)
    print(run_plan(cfg), flush=True)
    from lab.pipeline import run

    try:
        result = run(cfg)
    except FloatingPointError as exc:  # an expected outcome of a bad setting, not a bug: no traceback
        return fail(f"training diverged: {exc} (the MLflow run ended FAILED with this as its tag `error`)", 1)
    for key in sorted(_headline_keys(cfg) & result.metrics.keys()):
        print(f"  {key:40s} {result.metrics[key]:.3f}")
    print("time: " + ", ".join(f"{k} {v:.0f}s" for k, v in result.seconds.items()))
    print(f"MLflow run id: {result.run_id}   (store: {cfg.tracking.uri}; browse with `lab ui`)")
    print(result.run_id)
    return 0


def _multirun(args: argparse.Namespace) -> int:
    """`lab run -m`: the swept overrides as an experiment (lab/sweep/multirun.py) on the sweep engine."""
    from lab.cli.ablate import run_experiment
    from lab.sweep import multirun

    worker, overrides = worker_mode(args.overrides)
    if worker:
        worker_options(args, "run -m")
    exp, extra = multirun.experiment(overrides, args.name or multirun.DEFAULT_NAME)
    if args.cfg:
        print_arms(exp, extra)
        return 0
    named = ["--name", args.name] if args.name else []
    swept = [o for o in overrides if o not in extra]  # the engine adds `extra` to a worker's command itself
    return run_experiment(exp, extra, args, worker, ["run", "-m", *named, "worker", *swept])


def _headline_keys(cfg: DictConfig) -> set[str]:
    """What `lab run` prints: each suite's (not its variants') AL per backend and k, and its speedups."""
    e, shown = cfg.eval, set()
    for suite in e.suites:
        for k in e.num_speculative_tokens:
            shown |= {metric_keys.acceptance_length(suite, k, backend) for backend in e.backends}
            shown |= {metric_keys.speedup(suite, k), metric_keys.chain_limit(suite, k)}
            shown |= {metric_keys.throughput_speedup(suite, k, c) for c in e.vllm.concurrency}
    return shown


def cmd_target_build(args: argparse.Namespace) -> int:
    """build (or find in the cache) the configured target"""
    cfg = compose(args.overrides)
    check_paths(cfg, keys=("target.path", "cache_dir"))
    check_target(cfg)
    from lab.pipeline import set_threads  # every check has passed: the work starts here
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


def _run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. drafter=eagle31 train.ttt_length=5")
    p.add_argument("-m", "--multirun", action="store_true", help="sweep every key=a,b as one study (see above)")
    p.add_argument("--name", help="with -m: the study's name (default: multirun)")
    p.add_argument("--cfg", choices=["job"], help="print the composed config (job) and start nothing")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan (each stage: cached or to build, its size and time) and start nothing",
    )
    p.add_argument("--workers", type=integer(0), help="with -m: runs in parallel here (default 1)")
    p.add_argument("--force", action="store_true", help="with -m: keep a --workers above the machine's cores")
    p.add_argument("--no-progress", action="store_true", help="with -m: no progress bars (stage lines only)")


RUN = Verb(
    cmd_run,
    _run_arguments,
    epilog="examples:\n  lab run drafter=eagle31 train.ttt_length=5\n"
    "  lab run profile=micro\n"
    "  lab run drafter.checkpoint=/ckpts/torchspec-eagle31 target=hf target.path=/models/llama "
    "eval.backends=[ref,vllm]\n"
    "  lab run drafter.checkpoint=/ckpts/speculators-eagle3 drafter.aux_layers=[2,16,29]\n"
    "  lab run -m drafter=eagle3,eagle31 seed=0,1 profile=micro --workers 2\n"
    "  lab run --cfg job drafter=eagle31\n"
    "  lab run --dry-run                  # what it builds and finds cached, and how long it takes here",
)
TARGET_BUILD = Verb(cmd_target_build, overrides_only("Hydra overrides, e.g. target=tiny_code"))
