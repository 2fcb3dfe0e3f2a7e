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
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from lab import measure, track
from lab import metrics as metric_keys
from lab.config import ConfigError, DataSource, Decoder, Select, rollout_depth, select_k, val_every, validation_depth
from lab.config.identity import CONFIG_HASH_SCHEME, arm_name, config_hash, flatten
from lab.config.shape import aux_layers
from lab.data.answers import Answers, suite_answers
from lab.data.cache import HeldoutStates, HiddenStates, build_or_load, code_sequences, heldout_states
from lab.data.chat_data import chat_data
from lab.data.chat_suites import ChatSuiteInputs
from lab.data.code_data import Sequences
from lab.data.regenerate import regenerate
from lab.data.suites import Suite, build_suite
from lab.data.validation import validation_prompts
from lab.device import thread_count
from lab.drafter import Eagle3Drafter, init_drafter, load_checkpoint, save_native
from lab.drafter import imported as imported_drafter
from lab.drafter.formats import CheckpointError, CheckpointInfo
from lab.eval import vllm_backend
from lab.eval.evaluate import EvalOptions, evaluate_suite_prompts, heldout_evaluation
from lab.eval.validation import ValidationSet, checkpoints_document, validate
from lab.fsutil import claim
from lab.target import Target
from lab.target import load as load_target
from lab.train import resume, torchspec_backend
from lab.train.loss import ttt_loss
from lab.train.step import LossFn
from lab.train.ttt import Validation, ValidationPass, train

logger = logging.getLogger(__name__)


@dataclass
class RunHooks:
    """What a caller (a sweep) hears during a run. `on_train_metrics` may raise `track.RunStopped` to end
    the run early (pruning)."""

    # each stage as it starts: target, drafter, data, validation, cache, heldout, suites, answers, train, eval SUITE,
    # eval vllm, rollout
    on_stage: Callable[[str], None] = lambda stage: None
    on_start: Callable[[str], None] = lambda run_id: None  # the MLflow run id, once the run exists
    on_train_metrics: Callable[[dict[str, float], int], None] = lambda metrics, step: None


@dataclass
class RunResult:
    run_id: str
    metrics: dict[str, float | list[float]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)


VALIDATION_RECORDS = "per_prompt/val.json"  # every validation pass's per-prompt counts
SELECTION_TAGS = ("selected_step", "selected_why")  # the checkpoint a run kept (train.select), and why


def set_threads(cfg: DictConfig) -> None:
    cores = os.cpu_count() or 1
    if cfg.threads and cfg.threads > cores:
        logger.warning(f"threads={cfg.threads}: capped at {cores}, this machine's cores")
    torch.set_num_threads(thread_count(cfg))


class StageClock:
    """A run's stages, one after another: each is announced to `on_stage` as it starts and its seconds are
    recorded in `seconds` as it ends (the run's `time/{stage}_s`); a stage that fails records none. Its start and
    its end with the seconds are log lines, so a long job's log says where its time went."""

    def __init__(self, on_stage: Callable[[str], None] = lambda stage: None) -> None:
        self.on_stage = on_stage
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, name: str, heard_as: str | None = None) -> Iterator[None]:
        """Time the block as stage `name`; `on_stage` hears `heard_as` (default: `name`) as it starts."""
        with self.timed(name):
            self.on_stage(name if heard_as is None else heard_as)
            yield

    @contextlib.contextmanager
    def timed(self, name: str) -> Iterator[None]:
        """Time the block as `name` unannounced: a span of stages that `on_stage` hears one by one."""
        started = time.time()
        logger.info(f"stage {name}: start")
        yield
        self.seconds[name] = time.time() - started
        logger.info(f"stage {name}: end, {self.seconds[name]:.1f} s")


@dataclass
class Loaded:
    """A drafter trained elsewhere (`drafter.checkpoint`), checked against the target and loaded."""

    info: CheckpointInfo
    drafter: Eagle3Drafter


@dataclass
class Reused:
    """The drafter of a finished run that trained alike (`train.reuse`), and that run."""

    run: track.TrainedRun
    drafter: Eagle3Drafter


@dataclass
class TrainingData:
    """The training and held-out sequences, what chat suites are built from (None for code data) and the
    run's `data/...` metrics."""

    train: Sequences
    heldout: Sequences
    suite_inputs: ChatSuiteInputs | None
    stats: dict[str, float]


@dataclass
class Prepared:
    """What a run has before its MLflow run starts. Everything here is cached on disk and shared by every run of
    the same target and data."""

    target: Target
    layers: list[int]  # the target's captured layers the drafter reads (vLLM's ids)
    logged: DictConfig  # the config as logged (a loaded drafter's own shape)
    loaded: Loaded | None  # drafter.checkpoint's drafter
    train_tags: dict[str, str]  # a trained drafter's identity: `train_key` and the code behind it (none loaded)
    reused: Reused | None  # the drafter of a finished run that trained alike
    data_stats: dict[str, float]
    hidden: HiddenStates | None  # the hidden-state cache, to train on; None when a drafter is loaded or reused
    heldout: Sequences  # held-out sequences, for the rollout
    rollout_states: HeldoutStates  # the target's side of the rollout on them
    suites: list[Suite]
    answers: dict[str, Answers]  # per suite, with eval.decoder=replay: the target's greedy answers
    validation: ValidationSet | None = None  # what the validation pass replays (a run that trains, val_prompts > 0)

    @property
    def trains(self) -> bool:
        """Whether the run trains its drafter (none is loaded or reused)."""
        return self.loaded is None and self.reused is None


def _prepare(cfg: DictConfig, progress: bool, clock: StageClock, reuse: bool = True) -> Prepared:
    """The stages before the MLflow run: target, drafter checkpoint (imported, or with `reuse` one trained
    alike) or hidden-state cache, data, suites, answers. Bad input fails here, before any run is recorded."""
    with clock.stage("target"):
        target = load_target(cfg, progress=progress)
    loaded, train_tags, reused = None, {}, None
    if cfg.drafter.checkpoint:
        with clock.stage("drafter"):
            loaded = _load_checkpoint(cfg, target)
        logged, layers = _as_loaded(cfg, loaded.info), list(loaded.drafter.spec.aux_layer_ids)
    else:
        logged, layers = cfg, aux_layers(cfg)
        external = torchspec_backend.provenance() if cfg.train.backend == "torchspec" else {}
        train_tags = {"train_key": resume.drafter_key(cfg, target.fingerprint, layers, external), **external}
        if reuse and cfg.train.reuse:
            with clock.stage("drafter"):
                reused = _trained_alike(cfg, target, train_tags["train_key"], layers)
    with clock.stage("data"):
        data = _training_data(cfg, target, progress)
    validation = None
    if loaded is None and reused is None and cfg.train.val_prompts > 0:
        with clock.stage("validation"):
            validation = _validation_set(cfg, target, data.train, layers)
    hidden = None
    if loaded is None and reused is None:
        with clock.stage("cache"):
            hidden = build_or_load(target, data.train, cfg.data, layers, cfg.cache_dir, progress=progress)
    with clock.stage("heldout"):
        rollout_states = heldout_states(target, data.heldout, layers, cfg.cache_dir)
    with clock.stage("suites"):
        suites = [build_suite(name, target.tokenizer, cfg, data.suite_inputs) for name in cfg.eval.suites]
    answers = {}
    if cfg.eval.decoder == Decoder.replay and "ref" in cfg.eval.backends:
        with clock.stage("answers"):
            answers = _suite_answers(cfg, target, suites, layers)
    return Prepared(
        target=target,
        layers=layers,
        logged=logged,
        loaded=loaded,
        train_tags=train_tags,
        reused=reused,
        data_stats=data.stats,
        hidden=hidden,
        heldout=data.heldout,
        rollout_states=rollout_states,
        suites=suites,
        answers=answers,
        validation=validation,
    )


def _validation_set(cfg: DictConfig, target: Target, train_seqs: Sequences, layers: list[int]) -> ValidationSet:
    """The validation prompts (held out of the training data) and the target's greedy answers to them, as a suite's
    (cached alike): what the validation pass replays while the drafter trains."""
    prompts = validation_prompts(target, cfg.data, cfg.train.val_prompts, train_seqs, cfg.cache_dir)
    depth, eos = validation_depth(cfg), target.tokenizer.eos_token_id
    stops = (eos,) if cfg.eval.stop_at_eos and eos is not None else ()
    length = cfg.train.val_new_tokens or cfg.eval.max_new_tokens
    answers = suite_answers(target, prompts, length + depth, stops, layers, cfg.cache_dir)
    return ValidationSet(answers, depth, length, stops, cfg.eval.n_sink)


def _suite_answers(cfg: DictConfig, target: Target, suites: list[Suite], layers: list[int]) -> dict[str, Answers]:
    """Each suite's greedy answers by the target, which `eval.decoder=replay` evaluates over (cached)."""
    answers = {}
    for suite in suites:
        if cfg.eval.timed_prompts > len(suite.prompts):
            raise ConfigError(
                "eval.timed_prompts",
                f"expected at most the {len(suite.prompts)} prompts of suite '{suite.name}', got "
                f"{cfg.eval.timed_prompts}",
            )
        length = suite.max_new_tokens + max(cfg.eval.num_speculative_tokens)  # the last round verifies past it
        answers[suite.name] = suite_answers(target, suite.prompts, length, suite.stop_ids, layers, cfg.cache_dir)
    return answers


def prepare(cfg: DictConfig, progress: bool = True) -> Prepared:
    """What a run of `cfg` that trains has before its MLflow run starts (the target, its data, hidden states,
    validation set, suites and answers), built or loaded from the caches: what benchmarks time stages on."""
    set_threads(cfg)
    return _prepare(cfg, progress, StageClock(), reuse=False)


def warm_caches(cfg: DictConfig, progress: bool = True) -> dict[str, float]:
    """Build what `cfg`'s runs share (the target's conversion, regenerated data, hidden states, the suites'
    answers) on every core, and nothing else; returns the seconds per stage. A study with several workers
    calls it before they start, so its first cache is not built on one worker's share of the cores while
    the others wait for it."""
    set_threads(cfg)
    clock = StageClock()
    _prepare(cfg, progress, clock, reuse=False)
    return clock.seconds


def run(
    cfg: DictConfig,
    progress: bool = True,
    parent_run_id: str | None = None,
    hooks: RunHooks | None = None,
    tags: dict[str, Any] | None = None,
) -> RunResult:
    """One run, logged as an MLflow run (nested under `parent_run_id`) carrying `tags` too."""
    hooks = hooks or RunHooks()
    clock = StageClock(hooks.on_stage)
    set_threads(cfg)
    prepared = _prepare(cfg, progress, clock)
    arm = arm_name(prepared.logged)
    run_tags = _run_tags(cfg, prepared, arm, tags or {})
    resume_dir = None
    if prepared.trains and cfg.train.resume_every > 0:
        resume_dir = resume.state_dir(cfg, prepared.target.fingerprint, prepared.layers)
        resume.check_identity(resume_dir, resume.training_identity(cfg, prepared.target.fingerprint, prepared.layers))
    t = cfg.tracking
    name = f"{arm}-seed{cfg.seed}"
    with (
        _held_resume_dir(resume_dir) as resume_dir,
        track.start_run(t.uri, t.artifact_root, cfg.study, name, run_tags, parent_run_id, t.system_metrics) as mlrun,
        _records_error(mlrun),
    ):
        hooks.on_start(mlrun.id)
        measure.record(cfg.cache_dir)  # the rates its plan measured, for the next plan; like the run, not before
        _log_params(mlrun, prepared)
        metrics: dict[str, float | list[float]] = _log_setup_metrics(mlrun, prepared)
        trained = _drafter(cfg, mlrun, prepared, resume_dir, hooks, clock, progress)
        metrics.update(trained.metrics)
        if t.log_checkpoint:  # an imported drafter too, in our format: `lab export RUN_ID` works alike
            with tempfile.TemporaryDirectory() as tmp:
                mlrun.log_artifacts(save_native(trained.drafter, Path(tmp) / "checkpoint"), "checkpoint")
        metrics.update(_evaluate(cfg, mlrun, prepared, trained.drafter, clock, progress))
        return RunResult(mlrun.id, metrics, clock.seconds)


def _run_tags(cfg: DictConfig, prepared: Prepared, arm: str, extra: dict[str, Any]) -> dict[str, Any]:
    """The run's tags: what it is (study, arm, seed, code, config hash, target), the caller's `extra`, and where
    its drafter comes from (a checkpoint, a trained drafter's `train_key`, the run that trained it)."""
    target = prepared.target
    tags = {
        "study": cfg.study,
        "arm": arm,
        "seed": cfg.seed,
        "git_commit": track.git_commit(),
        "config_hash": config_hash(cfg),
        "config_hash_scheme": CONFIG_HASH_SCHEME,
        "target": target.fingerprint,
        "target_path": str(Path(target.path).resolve()),  # `lab export` names it as the verifier
        **extra,
    }
    if prepared.loaded is not None:
        info = prepared.loaded.info
        tags.update({"drafter_source": str(info.path.resolve()), "drafter_format": info.format})
    tags.update(prepared.train_tags)
    if prepared.reused is not None:
        tags["trained_by_run"] = prepared.reused.run.trained_by
    return tags


def _log_params(mlrun: track.Run, prepared: Prepared) -> None:
    """The run's params (the logged config, flattened, and what `auto` resolved to) and its config.yaml."""
    params = {**flatten(prepared.logged), "resolved.aux_layers": prepared.layers, **resolved_device(prepared.target)}
    if prepared.loaded is not None:
        params["drafter.norm_before_residual"] = prepared.loaded.drafter.spec.norm_before_residual
    trained_on = prepared.data_stats.get(metric_keys.data_stat("train_sequences"))
    if prepared.logged.data.get("regenerate_seconds") is not None and trained_on is not None:
        params["resolved.data.num_sequences"] = int(trained_on)  # what the cut at data.regenerate_seconds left
    mlrun.log_params(params)
    mlrun.log_dict(OmegaConf.to_container(prepared.logged, resolve=True, enum_to_str=True), "config.yaml")


def _log_setup_metrics(mlrun: track.Run, prepared: Prepared) -> dict[str, float]:
    """What preparing measured, logged and returned: the hidden-state cache's hit and seconds, the target's
    validation loss, the data's metrics."""
    setup: dict[str, float] = {}
    hidden = prepared.hidden
    if hidden is not None:
        setup = {
            metric_keys.cache_stat("hit"): float(hidden.stats["hit"]),
            metric_keys.cache_stat("seconds"): hidden.stats["seconds"],
        }
        if hidden.stats.get("build_seconds") is not None:
            setup[metric_keys.cache_stat("build_seconds")] = hidden.stats["build_seconds"]
    if "val_loss" in prepared.target.info:
        setup[metric_keys.target_val_loss()] = prepared.target.info["val_loss"]
    setup.update(prepared.data_stats)
    if setup:
        mlrun.log_metrics(setup)
    return dict(setup)


@dataclass
class Trained:
    """The drafter a run evaluates (trained by this run, by a run that trained alike, or elsewhere) and what
    training in this run measured (`train/final_tokens_per_s`; none without training here)."""

    drafter: Eagle3Drafter
    metrics: dict[str, float] = field(default_factory=dict)


def _drafter(
    cfg: DictConfig,
    mlrun: track.Run,
    prepared: Prepared,
    resume_dir: Path | None,
    hooks: RunHooks,
    clock: StageClock,
    progress: bool,
) -> Trained:
    """The drafter to evaluate: drafter.checkpoint's, that of a finished run that trained alike (its training
    curves logged again), or one trained now."""
    if prepared.loaded is not None:
        return Trained(prepared.loaded.drafter)
    if prepared.reused is not None:
        _replay_training(cfg, mlrun, prepared.reused.run, hooks)
        return Trained(prepared.reused.drafter)
    t, hidden, layers, vset = prepared.target, prepared.hidden, prepared.layers, prepared.validation
    return _train(cfg, mlrun, t, hidden, layers, resume_dir, hooks, clock, progress, validation=vset)


def _evaluate(
    cfg: DictConfig, mlrun: track.Run, prepared: Prepared, drafter: Eagle3Drafter, clock: StageClock, progress: bool
) -> dict[str, float | list[float]]:
    """All of evaluation, timed as `eval`: the suites, vLLM, the teacher-forced rollout; then the rollout's
    metrics and every stage's seconds are logged. Returns the metrics evaluation logged."""
    target = prepared.target
    with clock.timed("eval"):
        metrics = _evaluate_suites(cfg, mlrun, prepared, drafter, clock, progress)
        if "vllm" in cfg.eval.backends:
            clock.on_stage("eval vllm")
            metrics.update(_evaluate_vllm(cfg, mlrun, target, drafter, prepared.suites, progress))
        clock.on_stage("rollout")
        rollout = heldout_evaluation(
            target, drafter, prepared.heldout, rollout_depth(cfg), seed=cfg.seed, states=prepared.rollout_states
        )
    final = {**rollout.metrics, **{metric_keys.stage_seconds(k): v for k, v in clock.seconds.items()}}
    mlrun.log_curves(final)
    mlrun.log_dict(rollout.per_prompt, "per_prompt/rollout.json")
    return {**metrics, **final}


def _evaluate_suites(
    cfg: DictConfig, mlrun: track.Run, prepared: Prepared, drafter: Eagle3Drafter, clock: StageClock, progress: bool
) -> dict[str, float | list[float]]:
    """Each suite logged (its prompts, also as a dataset) and, with the reference backend, evaluated as stage
    `eval_{suite}` (every k of the suite, and its baseline); its metrics and per-prompt records are logged as it
    finishes, so a later failure keeps them."""
    target, e = prepared.target, cfg.eval
    metrics: dict[str, float | list[float]] = {}
    for suite in prepared.suites:
        mlrun.log_dict({"suite": suite.describe(), "prompts": suite.records()}, f"suites/{suite.name}.json")
        mlrun.log_dataset(suite.name, suite.records())
        if "ref" not in e.backends:
            continue
        with clock.stage(f"eval_{suite.name}", heard_as=f"eval {suite.name}"):
            evaluated = evaluate_suite_prompts(
                target.model,
                drafter,
                suite,
                EvalOptions.from_config(cfg),
                answers=prepared.answers.get(suite.name),
                progress=progress,
            )
        mlrun.log_curves(evaluated.metrics)
        mlrun.log_dict(evaluated.per_prompt, f"per_prompt/{suite.name}.json")  # the report's paired bootstrap
        metrics.update(evaluated.metrics)
    return metrics


def resolved_device(target: Target) -> dict[str, str]:
    """The run's params `resolved.device` and `resolved.dtype`: where `device=auto` / `dtype=auto` put the
    target (the params `device` and `dtype` say only what was asked for)."""
    return {"resolved.device": str(target.device), "resolved.dtype": str(target.dtype).removeprefix("torch.")}


def _training_data(cfg: DictConfig, target: Target, progress: bool) -> TrainingData:
    """The configured data: code sequences, or conversations (ShareGPT or JSONL, regenerated by the target)."""
    if cfg.data.source == DataSource.code:
        train_seqs, heldout = code_sequences(target, cfg.data, cfg.cache_dir)
        return TrainingData(train_seqs, heldout, None, {})
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
    return TrainingData(data.train, data.heldout, inputs, data.stats)


def _trained_alike(cfg: DictConfig, target: Target, train_key: str, layers: list[int]) -> Reused | None:
    """The drafter of the first finished run tagged `train_key` (of any study in the store), loaded with the
    run it came from; None when no run trained it yet."""
    with tempfile.TemporaryDirectory() as tmp:
        found = track.trained_run(cfg.tracking.uri, train_key, tmp, metric_keys.is_training_curve)
        if found is None:
            return None
        drafter = load_checkpoint(found.checkpoint, embed_weight=target.embed_weight, aux_layers=layers)
    logger.info(
        f"training: the drafter of run {found.trained_by} (train_key {train_key}), trained with the same "
        "config, seed and code; train.reuse=false trains it again"
    )
    return Reused(found, drafter.to(target.device))


def _replay_training(cfg: DictConfig, mlrun, trained: track.TrainedRun, hooks: RunHooks) -> None:
    """Log the training and validation curves of the run whose drafter this run reuses, step by step, as
    training would (a sweep's pruner hears them too), its validation records and the step it kept."""
    by_step: dict[int, dict[str, float]] = {}
    for key, curve in trained.curves.items():
        for step, value in curve:
            by_step.setdefault(step, {})[key] = value
    for step, metrics in sorted(by_step.items()):
        mlrun.log_metrics(metrics, step)
        hooks.on_train_metrics(metrics, step)
    records = track.run_json(cfg.tracking.uri, trained.run_id, VALIDATION_RECORDS)
    if records is not None:
        mlrun.log_dict(records, VALIDATION_RECORDS)
    tags = track.get_run(cfg.tracking.uri, trained.run_id).data.tags
    mlrun.set_tags({k: tags[k] for k in SELECTION_TAGS if k in tags})


def _train(
    cfg: DictConfig,
    mlrun: track.Run,
    target: Target,
    hidden: HiddenStates,
    layers: list[int],
    resume_dir: Path | None,
    hooks: RunHooks,
    clock: StageClock,
    progress: bool,
    validation: ValidationSet | None = None,
) -> Trained:
    """Train the configured drafter on the cached hidden states, continuing from the resume state in
    `resume_dir` when an interrupted run left one there; with a `validation` set, its pass every train.val_every
    steps and the checkpoint it selects."""
    counts = torch.bincount(hidden.input_ids[hidden.loss_mask.bool()], minlength=target.vocab_size)
    drafter = init_drafter(target, cfg.drafter, layers, cfg.seed, counts)
    writer, state = _resume_state(cfg, mlrun, target, layers, resume_dir)

    def log_train(metrics: dict[str, float], step: int) -> None:
        mlrun.log_metrics(metrics, step)
        hooks.on_train_metrics(metrics, step)

    validating = (
        None if validation is None else _validation(cfg, mlrun, validation, log_train, hidden.input_ids.shape[1])
    )
    with clock.stage("train"):
        result = train(
            drafter,
            hidden,
            target.lm_head_weight,
            cfg.train,
            cfg.seed,
            log=log_train,
            progress=progress,
            resume_writer=writer,
            resume=state,
            loss=training_loss(drafter, cfg.train),
            validation=validating,
        )
    if result.selected is not None:
        mlrun.set_tags(dict(zip(SELECTION_TAGS, (result.selected.step, result.selected.why), strict=True)))
        logger.info(f"training kept the weights after step {result.selected.step}: {result.selected.why}")
    if result.tokens_per_s > 0:  # none when the resume state was already at the last step
        return Trained(drafter, {metric_keys.train_stat("final_tokens_per_s"): result.tokens_per_s})
    return Trained(drafter)


def _resume_state(
    cfg: DictConfig, mlrun: track.Run, target: Target, layers: list[int], resume_dir: Path | None
) -> tuple[resume.ResumeWriter | None, resume.ResumeState | None]:
    """Where this training writes its resume states, and the one it continues from (tagged on the run)."""
    if resume_dir is None:
        return None, None
    identity = resume.training_identity(cfg, target.fingerprint, layers)
    writer = resume.ResumeWriter(resume_dir, cfg.train.resume_every, mlrun.id, identity)
    state = resume.load(resume_dir, cfg.train.steps)
    if state is not None:
        logger.info(f"resuming training from step {state.step} of {state.steps} (resume state {resume_dir.name})")
        mlrun.set_tags({"resumed_from_step": state.step, "resume_checkpoint": resume_dir.name})
        if state.run_id:
            mlrun.set_tags({"resumed_from_run": state.run_id})
    return writer, state


def _validation(
    cfg: DictConfig, mlrun: track.Run, vset: ValidationSet, log: Callable[[dict[str, float], int], None], seq_len: int
) -> Validation:
    """The trainer's validation pass over `vset`: its metrics logged through `log` at the training step, every
    pass's per-prompt counts as `per_prompt/val.json` (rewritten after each, so a run cut short keeps them)."""

    def measure(drafter: Eagle3Drafter) -> ValidationPass:
        measured = validate(drafter, vset)
        return ValidationPass(measured.metrics, measured.prompts)

    def publish(checkpoints: list[dict]) -> None:
        mlrun.log_dict(checkpoints_document(checkpoints, cfg.seed, vset.depth), VALIDATION_RECORDS)

    return Validation(
        measure,
        every=val_every(cfg),
        steps=cfg.train.steps,
        key=metric_keys.val_al(select_k(cfg)),
        keep_best=cfg.train.select == Select.best,
        log=log,
        publish=publish,
        tokens_per_step=cfg.train.batch_size * seq_len,
        set_id=vset.answers.path.name if vset.answers.path is not None else "",
    )


def training_loss(drafter: Eagle3Drafter, tcfg: DictConfig) -> LossFn:
    """The TTT loss of `train.backend`, bound to `drafter`: ours (`ttt_loss`), or TorchSpec's drafter and
    loss over the same weights (lab/train/torchspec_backend.py)."""
    if tcfg.backend == "torchspec":
        return torchspec_backend.TorchSpecTTT.for_drafter(drafter, tcfg.ttt_length).loss
    return functools.partial(ttt_loss, drafter)


def _load_checkpoint(cfg: DictConfig, target: Target) -> Loaded:
    """drafter.checkpoint checked against the loaded target (its vocabulary is known only now) and loaded,
    the target's embedding filling a checkpoint saved without one."""
    info = imported_drafter.resolve(
        cfg.drafter.checkpoint, target.num_layers, target.hidden_size, target.vocab_size, cfg.drafter.aux_layers
    )
    try:
        drafter = load_checkpoint(info.path, embed_weight=target.embed_weight, aux_layers=info.spec.aux_layer_ids)
    except (FileNotFoundError, CheckpointError) as exc:
        raise ConfigError("drafter.checkpoint", str(exc)) from None
    return Loaded(info, drafter.to(target.device))


def _as_loaded(cfg: DictConfig, info: CheckpointInfo) -> DictConfig:
    """`cfg` with the drafter.* keys of the loaded checkpoint: what the run's params and config.yaml say."""
    out = copy.deepcopy(cfg)
    for key, value in imported_drafter.config_values(info.spec, info.format).items():
        out.drafter[key] = value
    return out


@contextlib.contextmanager
def _held_resume_dir(path: Path | None) -> Iterator[Path | None]:
    """The run's resume state folder, held by this process for the run: removed when the run
    finishes (its drafter is in MLflow) or is pruned (never resumed), kept when it fails or is
    interrupted (a rerun resumes it). None when resume states are off or another process trains the
    same configuration right now (both writing one resume state would interleave two runs)."""
    if path is None:
        yield None
        return
    with claim(path.with_name(path.name + ".lock")) as mine:
        if not mine:
            logger.warning(
                f"resume state {path.name}: another process trains this configuration now; none for this run"
            )
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
        logger.warning(f"vLLM backend skipped, reference backend only: {reason}")
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
