"""One run, end to end: target -> hidden-state cache -> TTT training -> evaluation -> MLflow.

Training writes a resume state every `train.resume_every` steps (lab/train/resume.py): a run
that is interrupted (Ctrl-C: the MLflow run ends KILLED) or fails is continued by rerunning the same
command, in a new MLflow run tagged `resumed_from_step` and `resumed_from_run`.

With `drafter.checkpoint` the run evaluates a drafter trained elsewhere instead: target -> load and check
the checkpoint -> evaluation -> MLflow (no hidden-state cache, no training), logged like a trained run.

A trained run is tagged `train_key` (lab/train/resume.py `drafter_key`). With `train.reuse` (the default),
a run whose key a finished run of any study already carries takes that run's drafter and training curves
instead of training again (tagged `trained_by_run`): an arm shared by several studies trains once."""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from lab import metrics as metric_keys
from lab import track
from lab.config import ConfigError, DataSource, Decoder, rollout_depth
from lab.config.identity import CONFIG_HASH_SCHEME, arm_name, config_hash, flatten
from lab.config.shape import aux_layers
from lab.data.answers import Answers, suite_answers
from lab.data.cache import HeldoutStates, build_or_load, code_sequences, heldout_states
from lab.data.chat_data import chat_data
from lab.data.chat_suites import ChatSuiteInputs
from lab.data.regenerate import regenerate
from lab.data.suites import build_suite
from lab.drafter import Eagle3Drafter, init_drafter, load_checkpoint, save_native
from lab.drafter import imported as imported_drafter
from lab.drafter.formats import CheckpointError, CheckpointInfo
from lab.eval import vllm_backend
from lab.eval.evaluate import evaluate_suite_prompts, heldout_evaluation, timed_prompts
from lab.fsutil import claim
from lab.target import Target
from lab.target import load as load_target
from lab.train import resume, torchspec_backend
from lab.train.loss import ttt_loss
from lab.train.step import LossFn
from lab.train.ttt import train


@dataclass
class RunHooks:
    """What a caller (a sweep) hears during a run. `on_train_metrics` may raise `track.RunStopped` to end
    the run early (pruning)."""

    # target, data, drafter|cache, suites, train, eval SUITE, rollout
    on_stage: Callable[[str], None] = lambda stage: None
    on_start: Callable[[str], None] = lambda run_id: None  # the MLflow run id, once the run exists
    on_train_metrics: Callable[[dict[str, float], int], None] = lambda metrics, step: None


@dataclass
class RunResult:
    run_id: str
    metrics: dict[str, float | list[float]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)


def thread_count(cfg: DictConfig) -> int:
    """`threads`, at most the machine's cores (None: all of them)."""
    cores = os.cpu_count() or 1
    return min(cfg.threads, cores) if cfg.threads else cores


def set_threads(cfg: DictConfig) -> None:
    cores = os.cpu_count() or 1
    if cfg.threads and cfg.threads > cores:
        print(f"threads={cfg.threads}: capped at {cores}, this machine's cores")
    torch.set_num_threads(thread_count(cfg))


@dataclass
class Prepared:
    """What a run has before its MLflow run starts: the target, the drafter to evaluate when one is loaded
    (`source`), the training data and its cached hidden states, the suites. Everything here is cached on disk
    and shared by every run of the same target and data."""

    target: Target
    source: tuple[CheckpointInfo, Eagle3Drafter] | None
    train_tags: dict[str, str]  # a trained drafter's identity: `train_key` and the code behind it (none imported)
    reused: tuple[track.TrainedRun, Eagle3Drafter] | None  # the drafter of a finished run that trained alike
    logged: DictConfig  # the config as logged (a loaded drafter's own shape)
    layers: list[int]
    heldout: Any  # held-out sequences, for the rollout
    rollout_states: HeldoutStates  # the target's side of the rollout on them, cached
    data_stats: dict[str, float]
    hidden: Any  # the hidden-state cache; None when a drafter is loaded
    suites: list
    answers: dict[str, Answers]  # per suite, with eval.decoder=replay: the target's greedy answers, cached
    seconds: dict[str, float]


def _prepare(cfg: DictConfig, progress: bool, stage: Callable[[str], None], reuse: bool = True) -> Prepared:
    """The stages before the MLflow run: target, drafter checkpoint (imported, or with `reuse` one trained
    alike) or hidden-state cache, data, suites. Bad input fails here, before any run is recorded."""
    seconds: dict[str, float] = {}
    t0 = time.time()
    stage("target")
    target = load_target(cfg, progress=progress)
    seconds["target"] = time.time() - t0
    source: tuple[CheckpointInfo, Eagle3Drafter] | None = None
    if cfg.drafter.checkpoint:
        t0 = time.time()
        stage("drafter")
        source = _load_checkpoint(cfg, target)
        seconds["drafter"] = time.time() - t0
        logged = _as_loaded(cfg, source[0])
        layers = list(source[1].spec.aux_layer_ids)
    else:
        logged = cfg
        layers = aux_layers(cfg)
    train_tags, reused = {}, None
    if source is None:
        external = torchspec_backend.provenance() if cfg.train.backend == "torchspec" else {}
        train_tags = {"train_key": resume.drafter_key(cfg, target.fingerprint, layers, external), **external}
        if reuse and cfg.train.reuse:
            t0 = time.time()
            stage("drafter")
            reused = _trained_alike(cfg, target, train_tags["train_key"], layers)
            seconds["drafter"] = time.time() - t0
    t0 = time.time()
    stage("data")
    train_seqs, heldout, chat_inputs, data_stats = _training_data(cfg, target, progress)
    seconds["data"] = time.time() - t0
    hidden = None
    if source is None and reused is None:
        t0 = time.time()
        stage("cache")
        hidden = build_or_load(target, train_seqs, cfg.data, layers, cfg.cache_dir, progress=progress)
        seconds["cache"] = time.time() - t0
    t0 = time.time()
    stage("heldout")
    rollout_states = heldout_states(target, heldout, layers, cfg.cache_dir)
    seconds["heldout"] = time.time() - t0
    t0 = time.time()
    stage("suites")
    suites = [build_suite(name, target.tokenizer, cfg, chat_inputs) for name in cfg.eval.suites]
    seconds["suites"] = time.time() - t0
    answers = {}
    if cfg.eval.decoder == Decoder.replay and "ref" in cfg.eval.backends:
        t0 = time.time()
        stage("answers")
        for suite in suites:
            if cfg.eval.timed_prompts > len(suite.prompts):
                raise ConfigError(
                    "eval.timed_prompts",
                    f"expected at most the {len(suite.prompts)} prompts of suite '{suite.name}', got "
                    f"{cfg.eval.timed_prompts}",
                )
            length = suite.max_new_tokens + max(cfg.eval.num_speculative_tokens)  # the last round verifies past it
            answers[suite.name] = suite_answers(target, suite.prompts, length, suite.stop_ids, layers, cfg.cache_dir)
        seconds["answers"] = time.time() - t0
    return Prepared(
        target,
        source,
        train_tags,
        reused,
        logged,
        layers,
        heldout,
        rollout_states,
        data_stats,
        hidden,
        suites,
        answers,
        seconds,
    )


def warm_caches(cfg: DictConfig, progress: bool = True) -> dict[str, float]:
    """Build what `cfg`'s runs share (the target's conversion, regenerated data, hidden states, the suites'
    answers) on every core, and nothing else; returns the seconds per stage. A study with several workers
    calls it before they start, so its first cache is not built on one worker's share of the cores while
    the others wait for it."""
    set_threads(cfg)
    return _prepare(cfg, progress, lambda stage: None, reuse=False).seconds


def run(
    cfg: DictConfig,
    progress: bool = True,
    parent_run_id: str | None = None,
    hooks: RunHooks | None = None,
    tags: dict[str, Any] | None = None,
) -> RunResult:
    """One run, logged as an MLflow run (nested under `parent_run_id`) carrying `tags` too."""
    hooks = hooks or RunHooks()
    stage = hooks.on_stage
    set_threads(cfg)
    prepared = _prepare(cfg, progress, stage)
    target, source, logged, layers = prepared.target, prepared.source, prepared.logged, prepared.layers
    hidden, suites, seconds = prepared.hidden, prepared.suites, prepared.seconds

    arm = arm_name(logged)
    tags = {
        "study": cfg.study,
        "arm": arm,
        "seed": cfg.seed,
        "git_commit": track.git_commit(),
        "config_hash": config_hash(cfg),
        "config_hash_scheme": CONFIG_HASH_SCHEME,
        "target": target.fingerprint,
        "target_path": str(Path(target.path).resolve()),  # `lab export` names it as the verifier
        **(tags or {}),
    }
    if source is not None:
        tags.update({"drafter_source": str(source[0].path.resolve()), "drafter_format": source[0].format})
    tags.update(prepared.train_tags)
    reused = prepared.reused
    if reused is not None:
        tags["trained_by_run"] = reused[0].trained_by
    t = cfg.tracking
    resume_dir = None
    if source is None and reused is None and cfg.train.resume_every > 0:
        resume_dir = resume.checkpoint_dir(cfg, target.fingerprint, layers)
    with (
        _resume_checkpoint(resume_dir) as resume_dir,
        track.start_run(t.uri, t.artifact_root, cfg.study, f"{arm}-seed{cfg.seed}", tags, parent_run_id) as mlrun,
        _records_error(mlrun),
    ):
        hooks.on_start(mlrun.id)
        params = {**flatten(logged), "resolved.aux_layers": layers, **resolved_device(target)}
        if source is not None:
            params["drafter.norm_before_residual"] = source[1].spec.norm_before_residual
        mlrun.log_params(params)
        mlrun.log_dict(OmegaConf.to_container(logged, resolve=True, enum_to_str=True), "config.yaml")
        setup: dict[str, float] = {}
        if hidden is not None:
            setup = {
                metric_keys.cache_stat("hit"): float(hidden.stats["hit"]),
                metric_keys.cache_stat("seconds"): hidden.stats["seconds"],
            }
            if hidden.stats.get("build_seconds") is not None:
                setup[metric_keys.cache_stat("build_seconds")] = hidden.stats["build_seconds"]
        if "val_loss" in target.info:
            setup[metric_keys.target_val_loss()] = target.info["val_loss"]
        setup.update(prepared.data_stats)
        if setup:
            mlrun.log_metrics(setup)

        metrics: dict[str, float | list[float]] = dict(setup)
        if source is not None:
            drafter = source[1]
        elif reused is not None:
            drafter = reused[1]
            _replay_training(mlrun, reused[0], hooks)
        else:
            drafter, tokens_per_s = _train(cfg, mlrun, target, hidden, layers, resume_dir, hooks, progress, seconds)
            if tokens_per_s > 0:  # none when the resumed checkpoint was already the last step
                metrics[metric_keys.train_stat("final_tokens_per_s")] = tokens_per_s
        if t.log_checkpoint:  # an imported drafter too, in our format: `lab export RUN_ID` works alike
            with tempfile.TemporaryDirectory() as tmp:
                mlrun.log_artifacts(save_native(drafter, Path(tmp) / "checkpoint"), "checkpoint")

        t0 = time.time()
        e = cfg.eval
        for suite in suites:
            mlrun.log_dict({"suite": suite.describe(), "prompts": suite.records()}, f"suites/{suite.name}.json")
            mlrun.log_dataset(suite.name, suite.records())
            if "ref" not in e.backends:
                continue
            stage(f"eval {suite.name}")
            suite_started = time.time()
            evaluated = evaluate_suite_prompts(
                target.model,
                drafter,
                suite,
                list(e.num_speculative_tokens),
                progress=progress,
                probes=e.probes,
                n_sink=e.n_sink,
                temperature=e.temperature,
                seed=cfg.seed,
                answers=prepared.answers.get(suite.name),
                timed=timed_prompts(len(suite.prompts), e.timed_prompts),
            )
            seconds[f"eval_{suite.name}"] = time.time() - suite_started  # every k of the suite, and its baseline
            mlrun.log_curves(evaluated.metrics)  # as each suite finishes: a later failure keeps them
            mlrun.log_dict(evaluated.per_prompt, f"per_prompt/{suite.name}.json")  # the report's paired bootstrap
            metrics.update(evaluated.metrics)
        if "vllm" in e.backends:
            stage("eval vllm")
            metrics.update(_evaluate_vllm(cfg, mlrun, target, drafter, suites, progress))
        stage("rollout")
        rollout = heldout_evaluation(
            target, drafter, prepared.heldout, rollout_depth(cfg), seed=cfg.seed, states=prepared.rollout_states
        )
        final = dict(rollout.metrics)
        seconds["eval"] = time.time() - t0
        final.update({metric_keys.stage_seconds(k): v for k, v in seconds.items()})
        mlrun.log_curves(final)
        mlrun.log_dict(rollout.per_prompt, "per_prompt/rollout.json")
        metrics.update(final)
        return RunResult(mlrun.id, metrics, seconds)


def resolved_device(target: Target) -> dict[str, str]:
    """The run's params `resolved.device` and `resolved.dtype`: where `device=auto` / `dtype=auto` put the
    target (the params `device` and `dtype` say only what was asked for)."""
    return {"resolved.device": str(target.device), "resolved.dtype": str(target.dtype).removeprefix("torch.")}


def _training_data(cfg: DictConfig, target, progress: bool):
    """(train, held-out) sequences, what chat suites are built from (None for code data), data/... metrics."""
    if cfg.data.source == DataSource.code:
        train_seqs, heldout = code_sequences(target, cfg.data, cfg.cache_dir)
        return train_seqs, heldout, None, {}
    data = chat_data(target, cfg.data, cfg.cache_dir, thread_count(cfg), progress, cfg.dtype.value, cfg.kv_cache.value)

    def answer(conversations):  # MT-Bench's turn-1 answers: the same greedy regeneration, cached alike
        return regenerate(
            target,
            conversations,
            data.chat,
            max_new_tokens=cfg.data.max_new_tokens,
            seq_len=target.max_positions,
            backend=str(cfg.data.generator.value),
            cache_dir=cfg.cache_dir,
            progress=progress,
            threads=thread_count(cfg),
            dtype=cfg.dtype.value,
            kv_cache=cfg.kv_cache.value,
        ).conversations

    inputs = ChatSuiteInputs(data.heldout_conversations, data.chat, answer, str(cfg.cache_dir))
    return data.train, data.heldout, inputs, data.stats


def _trained_alike(cfg: DictConfig, target, train_key: str, layers: list[int]):
    """The drafter of the first finished run tagged `train_key` (of any study in the store), loaded with the
    run it came from; None when no run trained it yet."""
    with tempfile.TemporaryDirectory() as tmp:
        found = track.trained_run(cfg.tracking.uri, train_key, tmp, metric_keys.is_training_curve)
        if found is None:
            return None
        drafter = load_checkpoint(found.checkpoint, embed_weight=target.embed_weight, aux_layers=layers)
    print(
        f"training: the drafter of run {found.trained_by} (train_key {train_key}), trained with the same "
        "config, seed and code; train.reuse=false trains it again"
    )
    return found, drafter.to(target.device)


def _replay_training(mlrun, trained: track.TrainedRun, hooks: RunHooks) -> None:
    """Log the training curves of the run whose drafter this run reuses, step by step, as training would
    (a sweep's pruner hears them too)."""
    by_step: dict[int, dict[str, float]] = {}
    for key, curve in trained.curves.items():
        for step, value in curve:
            by_step.setdefault(step, {})[key] = value
    for step, metrics in sorted(by_step.items()):
        mlrun.log_metrics(metrics, step)
        hooks.on_train_metrics(metrics, step)


def _train(cfg: DictConfig, mlrun, target, hidden, layers, resume_dir, hooks: RunHooks, progress: bool, seconds):
    """Train the configured drafter on the cached hidden states (resuming a checkpoint if one is left);
    returns it and its final training tokens/s."""
    counts = torch.bincount(hidden.input_ids[hidden.loss_mask.bool()], minlength=target.vocab_size)
    drafter = init_drafter(target, cfg.drafter, layers, cfg.seed, counts)
    checkpoint, state = None, None
    if resume_dir is not None:
        checkpoint = resume.Checkpointing(resume_dir, cfg.train.resume_every, mlrun.id)
        state = resume.load(resume_dir, cfg.train.steps)
    if state is not None:
        print(f"resuming training from step {state.step} of {state.steps} (checkpoint {resume_dir.name})")
        mlrun.set_tags({"resumed_from_step": state.step, "resume_checkpoint": resume_dir.name})
        if state.run_id:
            mlrun.set_tags({"resumed_from_run": state.run_id})
    t0 = time.time()
    hooks.on_stage("train")

    def log_train(metrics: dict[str, float], step: int) -> None:
        mlrun.log_metrics(metrics, step)
        hooks.on_train_metrics(metrics, step)

    result = train(
        drafter,
        hidden,
        target.lm_head_weight,
        cfg.train,
        cfg.seed,
        log=log_train,
        progress=progress,
        checkpoint=checkpoint,
        resume=state,
        loss=training_loss(drafter, cfg.train),
    )
    seconds["train"] = time.time() - t0
    return drafter, result.tokens_per_s


def training_loss(drafter: Eagle3Drafter, tcfg: DictConfig) -> LossFn:
    """The TTT loss of `train.backend`, bound to `drafter`: ours (`ttt_loss`), or TorchSpec's drafter and
    loss over the same weights (lab/train/torchspec_backend.py)."""
    if tcfg.backend == "torchspec":
        return torchspec_backend.TorchSpecTTT.for_drafter(drafter, tcfg.ttt_length).loss
    return functools.partial(ttt_loss, drafter)


def _load_checkpoint(cfg: DictConfig, target) -> tuple[CheckpointInfo, Eagle3Drafter]:
    """drafter.checkpoint checked against the loaded target (its vocabulary is known only now) and loaded,
    the target's embedding filling a checkpoint saved without one."""
    info = imported_drafter.resolve(
        cfg.drafter.checkpoint, target.num_layers, target.hidden_size, target.vocab_size, cfg.drafter.aux_layers
    )
    try:
        drafter = load_checkpoint(info.path, embed_weight=target.embed_weight, aux_layers=info.spec.aux_layer_ids)
    except (FileNotFoundError, CheckpointError) as exc:
        raise ConfigError("drafter.checkpoint", str(exc)) from None
    return info, drafter.to(target.device)


def _as_loaded(cfg: DictConfig, info: CheckpointInfo) -> DictConfig:
    """`cfg` with the drafter.* keys of the loaded checkpoint: what the run's params and config.yaml say."""
    out = copy.deepcopy(cfg)
    for key, value in imported_drafter.config_values(info.spec, info.format).items():
        out.drafter[key] = value
    return out


@contextlib.contextmanager
def _resume_checkpoint(path: Path | None) -> Iterator[Path | None]:
    """The run's resume state folder, held by this process for the run: removed when the run
    finishes (its drafter is in MLflow) or is pruned (never resumed), kept when it fails or is
    interrupted (a rerun resumes it). None when checkpointing is off or another process trains the
    same configuration right now (both writing one checkpoint would interleave two runs)."""
    if path is None:
        yield None
        return
    with claim(path.with_name(path.name + ".lock")) as mine:
        if not mine:
            print(f"resume state {path.name}: another process trains this configuration now; none for this run")
            yield None
            return
        try:
            yield path
        except track.RunStopped:
            resume.discard(path)
            raise
        resume.discard(path)


@contextlib.contextmanager
def _records_error(mlrun: track.Run) -> Iterator[None]:
    """A run that fails says why in its tag `error` (e.g. "FloatingPointError: non-finite training loss
    at step 3: nan"); the run then ends FAILED."""
    try:
        yield
    except track.RunStopped:
        raise
    except Exception as exc:
        with contextlib.suppress(Exception):  # a tracking failure here must not hide the run's error
            mlrun.set_tags({"error": f"{type(exc).__name__}: {exc}"[:5000]})
        raise


def _evaluate_vllm(cfg: DictConfig, mlrun, target, drafter, suites, progress: bool) -> dict:
    """The vLLM backend; a drafter vLLM cannot serve over this target (vllm_backend.unservable) is evaluated
    by the reference backend only, and the run says so (tag `vllm_skipped`)."""
    reason = vllm_backend.unservable(drafter.spec, target.path, cfg.eval.vllm.format, torch.cuda.is_available())
    if reason:
        mlrun.set_tags({"vllm_skipped": reason})
        print(f"vLLM backend skipped, reference backend only: {reason}")
        return {}
    log = Path(cfg.cache_dir) / "logs" / mlrun.id / "vllm_worker.log"  # kept: a failure names it
    try:
        metrics = vllm_backend.evaluate(
            target.path,
            drafter,
            suites,
            list(cfg.eval.num_speculative_tokens),
            cfg.eval,
            cfg.seed,
            thread_count(cfg),
            log,
            max_model_len=target.max_positions,
            progress=progress,
        )
    finally:
        if log.is_file():
            mlrun.log_artifact(log, "vllm")
    mlrun.log_curves(metrics)
    return metrics
