"""The native training-time-test (TTT) trainer: batches, AdamW, warmup-cosine, metrics, resume states.

A step's loss comes from the caller's backend (`lab.train.step.LossFn`); the native one is
`lab.train.loss.ttt_loss` (TorchSpec / EAGLE semantics, only what the loss reads computed). What the loop
keeps across steps sits beside it, so that the loop reads as a training loop: `BatchOrder` (which sequences
each step reads), `TrainLog` (the logged metrics), `Validation` (the validation pass every `train.val_every`
steps, the caller's, and the checkpoint it selects) and `Resumable` (what a resume state restores and captures).
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from omegaconf import DictConfig
from tqdm.auto import tqdm

from lab import metrics as metric_keys
from lab.data.cache import HiddenStates
from lab.device import autocast
from lab.drafter import Eagle3Drafter
from lab.schedule import warmup_cosine
from lab.signals import Interrupted
from lab.train.loss import ttt_loss
from lab.train.resume import ResumeState, ResumeWriter, StopRequest
from lab.train.step import LossFn, StepStats

MetricsFn = Callable[[dict[str, float], int], None]


def simulated_acc_len(accs: list[float]) -> float:
    """sum over k of prod_{j<=k} acc_j (docs/metrics.md)."""
    total, running = 0.0, 1.0
    for a in accs:
        running *= a
        total += running
    return total


@dataclass
class Selection:
    """The checkpoint a training kept (`train.select`): after which step, and why, in words."""

    step: int
    why: str


@dataclass
class TrainResult:
    steps: int
    seconds: float  # of training in this call, its validation passes left out
    tokens_per_s: float  # of the steps trained in this call (0 when a finished resume state was resumed)
    last: dict[str, float] = field(default_factory=dict)
    selected: Selection | None = None


def optimizer(params: list[torch.nn.Parameter], tcfg: DictConfig) -> torch.optim.AdamW:
    """The trainer's AdamW (both backends): betas (0.9, 0.95), torch's fused kernel (one pass over all
    parameters rather than a loop of small ops per parameter)."""
    return torch.optim.AdamW(params, lr=tcfg.lr, betas=(0.9, 0.95), weight_decay=tcfg.weight_decay, fused=True)


class BatchOrder:
    """The resumable data order: a seeded permutation of the `n` training sequences, read `batch_size` at a
    time, and a fresh permutation from the same generator once fewer than a batch remain."""

    def __init__(self, n: int, batch_size: int, seed: int) -> None:
        self.n, self.batch_size = n, batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self.order = torch.randperm(n, generator=self.generator)
        self.cursor = 0  # the next position in `order`

    def next(self) -> torch.Tensor:
        """The indices of the next batch."""
        if self.cursor + self.batch_size > len(self.order):
            self.order, self.cursor = torch.randperm(self.n, generator=self.generator), 0
        batch = self.order[self.cursor : self.cursor + self.batch_size]
        self.cursor += self.batch_size
        return batch

    def restore(self, state: ResumeState) -> None:
        self.order, self.cursor = state.order, state.cursor
        self.generator.set_state(state.generator)


class TrainLog:
    """The training metrics: each step's stats gather in a window, averaged every `log_every` steps and at the
    last into one record of `train/...` metrics, which goes to `log` and into the history. A resume state
    carries window and history: a resumed run sends the history again first, and its next record averages the
    steps an uninterrupted run's would."""

    def __init__(self, log: MetricsFn | None, log_every: int, steps: int) -> None:
        self.send = log if log is not None else lambda metrics, step: None
        self.log_every, self.steps = log_every, steps
        self.window: list[dict] = []  # per-step stats since the last record
        self.history: list[tuple[int, dict[str, float]]] = []  # every (step, record) sent
        self.last: dict[str, float] = {}
        self.tokens, self.since = 0, time.time()  # the window's tokens and start, for its tokens/s

    def restore(self, state: ResumeState) -> None:
        if state.log_every == self.log_every:  # else its window would straddle other log steps
            self.window = list(state.window)
        self.history = list(state.history)
        for step, metrics in self.history:
            self.send(metrics, step)
            self.last = metrics
        self.since = time.time()

    def add(self, step: int, loss: float, stats: StepStats, tokens: int, lr: float) -> bool:
        """Add the stats of `step` (counted from 1), which read `tokens` tokens; whether it sent a record."""
        self.window.append({"loss": loss, "plosses": stats.plosses, "accs": stats.accs})
        self.tokens += tokens
        if step % self.log_every != 0 and step != self.steps:
            return False
        self.last = _summarize(self.window, self.tokens / max(time.time() - self.since, 1e-9), lr)
        self.history.append((step, self.last))
        self.send(self.last, step)
        self.window, self.tokens, self.since = [], 0, time.time()
        return True

    def exclude(self, seconds: float) -> None:
        """Leave `seconds` (a validation pass) out of the window's tokens/s."""
        self.since += seconds

    def postfix(self) -> dict[str, str]:
        """The progress bar's summary of the last record."""
        return {
            "loss": f"{self.last[metric_keys.train_stat('loss')]:.3f}",
            "acc0": f"{self.last[metric_keys.train_step_acc(0)]:.2f}",
            "sal": f"{self.last[metric_keys.train_stat('simulated_acc_len')]:.2f}",
        }


@dataclass
class ValidationPass:
    """What one validation pass measured: its `val/...` metrics and the per-prompt counts behind them."""

    metrics: dict[str, float]
    prompts: list[dict]


ValidateFn = Callable[[Eagle3Drafter], ValidationPass]
PublishFn = Callable[[list[dict]], None]  # every pass so far, as `per_prompt/val.json`'s checkpoints


class Validation:
    """The validation pass beside the loop: `validate` (the caller's: lab/eval/validation.py over the validation
    answers) every `every` steps and after the last, its metrics sent to `log` at the step with the training tokens
    seen so far, its per-prompt counts to `publish`; it keeps the best pass by `key` (the exact AL at
    train.select_k) and, with `keep_best`, that pass's weights. `set_id` names the validation set: a resume state
    of another set's passes restores none. Its passes' seconds stay out of training's."""

    def __init__(
        self,
        validate: ValidateFn,
        every: int,
        steps: int,
        key: str,
        keep_best: bool,
        log: MetricsFn,
        publish: PublishFn,
        tokens_per_step: int,
        set_id: str,
    ) -> None:
        self.validate, self.every, self.steps, self.key, self.keep_best = validate, every, steps, key, keep_best
        self.send, self.publish, self.tokens_per_step, self.set_id = log, publish, tokens_per_step, set_id
        self.history: list[tuple[int, dict[str, float]]] = []  # every (step, metrics) sent
        self.checkpoints: list[dict] = []  # every pass's {step, train_tokens, prompts}
        self.best_step, self.best_value = 0, None
        self.best: dict[str, torch.Tensor] = {}  # keep_best: the best pass's weights
        self.seconds = 0.0  # this call's passes

    def due(self, step: int) -> bool:
        return step % self.every == 0 or step == self.steps

    def run(self, drafter: Eagle3Drafter, step: int) -> float:
        """Validate the drafter after `step` (counted from 1); returns the pass's seconds."""
        started = time.time()
        drafter.eval()
        measured = self.validate(drafter)
        drafter.train()
        seconds = time.time() - started
        self.seconds += seconds
        tokens = step * self.tokens_per_step
        metrics = {**measured.metrics, metric_keys.val_stat("train_tokens"): tokens}
        metrics[metric_keys.val_stat("seconds")] = seconds
        value = metrics[self.key]
        if self.best_value is None or value > self.best_value:  # a tie keeps the earlier pass
            self.best_step, self.best_value = step, value
            if self.keep_best:
                self.best = {k: v.detach().clone() for k, v in drafter.state_dict().items()}
        self.history.append((step, metrics))
        self.checkpoints.append({"step": step, "train_tokens": tokens, "prompts": measured.prompts})
        self.publish(self.checkpoints)
        self.send(metrics, step)  # last: a pruner hearing it may stop the run
        return seconds

    def state(self) -> dict:
        return {
            "every": self.every,
            "key": self.key,
            "set": self.set_id,
            "history": self.history,
            "checkpoints": self.checkpoints,
            "best_step": self.best_step,
            "best_value": self.best_value,
        }

    def restore(self, state: ResumeState) -> None:
        """The passes a resume state holds, sent and published again; none when they validated another way."""
        v = state.validation
        if (v.get("every"), v.get("key"), v.get("set")) != (self.every, self.key, self.set_id):
            return
        self.history, self.checkpoints = [(int(s), m) for s, m in v["history"]], list(v["checkpoints"])
        self.best_step, self.best_value, self.best = v["best_step"], v["best_value"], dict(state.best)
        for step, metrics in self.history:
            self.send(metrics, step)
        if self.checkpoints:
            self.publish(self.checkpoints)

    def select(self, drafter: Eagle3Drafter) -> Selection:
        """With `keep_best`, load the best pass's weights into the drafter; the step kept and why."""
        if not self.keep_best or not self.history:
            return Selection(self.steps, f"train.select=last: the weights after the last step, {self.steps}")
        if self.best_step != self.steps:
            drafter.load_state_dict(self.best, strict=True)
        last_step, last = self.history[-1]
        return Selection(
            self.best_step,
            f"train.select=best: {self.key} {self.best_value:.4f} at step {self.best_step}, the best of "
            f"{len(self.history)} validation passes (the last, step {last_step}: {last[self.key]:.4f})",
        )


@dataclass
class Resumable:
    """What a resume state holds of a training: the drafter's weights, AdamW's and the loss scaler's state, the
    data order and the metrics log; restored from one, captured into one."""

    drafter: Eagle3Drafter
    opt: torch.optim.AdamW
    scaler: torch.amp.GradScaler
    batches: BatchOrder
    log: TrainLog
    validation: Validation | None = None

    def restore(self, state: ResumeState) -> None:
        self.batches.restore(state)
        self.drafter.load_state_dict(state.model, strict=True)
        # the fresh optimizer's groups (same config: the resume key covers it); lr is set per step
        self.opt.load_state_dict({"state": state.optimizer, "param_groups": self.opt.state_dict()["param_groups"]})
        if state.scaler:
            self.scaler.load_state_dict(state.scaler)
        self.log.restore(state)
        if self.validation is not None:
            self.validation.restore(state)

    def state(self, step: int, steps: int, run_id: str | None) -> ResumeState:
        return ResumeState(
            step=step,
            steps=steps,
            model=self.drafter.state_dict(),
            optimizer=self.opt.state_dict()["state"],
            order=self.batches.order,
            cursor=self.batches.cursor,
            generator=self.batches.generator.get_state(),
            log_every=self.log.log_every,
            window=self.log.window,
            history=self.log.history,
            run_id=run_id,
            scaler=self.scaler.state_dict(),
            validation=self.validation.state() if self.validation is not None else {},
            best={k: v.cpu() for k, v in self.validation.best.items()} if self.validation is not None else {},
        )


def train(
    drafter: Eagle3Drafter,
    data: HiddenStates,
    lm_head_weight: torch.Tensor,
    tcfg: DictConfig,
    seed: int,
    log: MetricsFn | None = None,
    progress: bool = True,
    resume_writer: ResumeWriter | None = None,
    resume: ResumeState | None = None,
    loss: LossFn | None = None,
    validation: Validation | None = None,
) -> TrainResult:
    """Train in place; `log(metrics, step)` receives the averaged metrics every `log_every` steps.

    `loss` computes a batch's TTT loss for `drafter` (`lab.train.step.LossFn`): the caller picks the
    backend, e.g. `TorchSpecTTT.for_drafter(drafter, ttt_length).loss` for `train.backend=torchspec`
    (lab/pipeline.py `training_loss`); None is the native `ttt_loss`, for `train.backend=native` only.

    With `resume_writer`, a resume state is written every `resume_writer.every` steps and after the last,
    and Ctrl-C stops after the current step with one. With `resume` (such a state, of the same training),
    training continues from its step and ends with the weights an uninterrupted run would have, bit for bit
    (same thread count); the metrics it logged are sent to `log` again first.

    With `validation`, its pass runs every `validation.every` steps and after the last (logged through its own
    callback), and the drafter ends with the weights it selects (`TrainResult.selected`).

    Batches go to the drafter's device. The drafter computes in `lm_head_weight`'s dtype, the target's (under
    autocast, its weights and AdamW's state staying float32; the config's `dtype` is the one knob), float16
    with a scaled loss so that small gradients do not flush to zero."""
    if loss is None and tcfg.backend != "native":
        raise ValueError(f"train.backend={tcfg.backend}: pass its loss (`loss=`); only the native one is the default")
    optimized = Optimized.of(drafter, lm_head_weight, tcfg, loss)
    batches = BatchOrder(len(data), tcfg.batch_size, seed)
    metrics = TrainLog(log, tcfg.log_every, tcfg.steps)
    resumable = Resumable(drafter, optimized.opt, optimized.scaler, batches, metrics, validation)
    start = 0
    if resume is not None:
        resumable.restore(resume)
        start = resume.step
    drafter.train()
    started = time.time()
    bar = _progress_bar(drafter, tcfg, start, progress)
    stop = StopRequest()
    with stop.installed() if resume_writer is not None else contextlib.nullcontext():
        for step in bar:
            idx = batches.next()
            lr = warmup_cosine(step, tcfg.steps, tcfg.warmup_steps, tcfg.lr, tcfg.min_lr_ratio)
            value, stats = _optimizer_step(optimized, data, idx, lr, step)
            done = step + 1
            if metrics.add(done, value, stats, len(idx) * data.input_ids.shape[1], lr):
                bar.set_postfix(**metrics.postfix())
            if validation is not None and validation.due(done):
                metrics.exclude(validation.run(drafter, done))
            # read once a step, after the step is logged: a Ctrl-C from here on still gets its resume state
            # (tests/hold/sitecustomize.py holds a test's training at its N-th read)
            stopping = stop.requested
            if resume_writer is not None and resume_writer.due(done, tcfg.steps, stopping):
                resume_writer.write(resumable.state(done, tcfg.steps, resume_writer.run_id))
            if stopping:
                raise Interrupted(stop.signum)
    bar.close()
    drafter.eval()
    seconds = time.time() - started - (validation.seconds if validation is not None else 0.0)
    tokens = (tcfg.steps - start) * tcfg.batch_size * data.input_ids.shape[1]
    selected = validation.select(drafter) if validation is not None else None
    return TrainResult(tcfg.steps, seconds, tokens / max(seconds, 1e-9), metrics.last, selected)


@dataclass
class Optimized:
    """What one optimizer step needs beside its batch: the loss, AdamW and its gradient scaler, the parameters it
    clips, the target's lm_head and the training settings."""

    loss: LossFn
    opt: torch.optim.AdamW
    scaler: torch.amp.GradScaler
    params: list[torch.nn.Parameter]
    lm_head_weight: torch.Tensor
    tcfg: DictConfig
    precision: torch.dtype

    @classmethod
    def of(
        cls, drafter: Eagle3Drafter, lm_head_weight: torch.Tensor, tcfg: DictConfig, loss: LossFn | None
    ) -> Optimized:
        """AdamW over the drafter's trainable parameters, computing in `lm_head_weight`'s dtype with `loss` (None:
        the native TTT loss)."""
        params = [p for p in drafter.parameters() if p.requires_grad]
        precision = lm_head_weight.dtype
        # disabled (every call passes through) unless float16; its loss scale travels in the resume state
        scaler = torch.amp.GradScaler(params[0].device.type, enabled=precision == torch.float16)
        loss = loss if loss is not None else functools.partial(ttt_loss, drafter)
        return cls(loss, optimizer(params, tcfg), scaler, params, lm_head_weight, tcfg, precision)


def _optimizer_step(
    o: Optimized, data: HiddenStates, idx: torch.Tensor, lr: float, step: int
) -> tuple[float, StepStats]:
    """One step over the rows `idx` of `data` at learning rate `lr`: the TTT loss, its scaled backward, the clipped
    gradient, the update. Returns the loss's value (read once, for the finite check and the log alike) and its
    stats."""
    for group in o.opt.param_groups:
        group["lr"] = lr
    device, t = o.params[0].device, o.tcfg
    with autocast(device, o.precision):
        stats = o.loss(
            data.input_ids[idx].to(device),
            data.aux[idx].to(device),
            data.final[idx].to(device),
            o.lm_head_weight,
            t.ttt_length,
            t.step_weight,
            data.loss_mask[idx].to(device),
        )
    value = stats.loss.item()
    if not math.isfinite(value):
        raise FloatingPointError(f"non-finite training loss at step {step}: {value}")
    o.opt.zero_grad(set_to_none=True)
    o.scaler.scale(stats.loss).backward()
    o.scaler.unscale_(o.opt)  # the gradient's norm is clipped as it is, not as scaled
    torch.nn.utils.clip_grad_norm_(o.params, t.grad_clip)
    o.scaler.step(o.opt)
    o.scaler.update()
    return value, stats


def step_seconds(drafter: Eagle3Drafter, data: HiddenStates, lm_head_weight: torch.Tensor, tcfg: DictConfig) -> float:
    """Seconds of the trainer's optimizer step over the first `tcfg.batch_size` rows of `data`, the second of two
    (the first warms up): the step alone, without the loop's log, stop request or resume state."""
    optimized, idx = Optimized.of(drafter, lm_head_weight, tcfg, None), torch.arange(tcfg.batch_size)
    drafter.train()
    _optimizer_step(optimized, data, idx, tcfg.lr, 0)
    began = time.perf_counter()
    _optimizer_step(optimized, data, idx, tcfg.lr, 1)  # reads the loss: the step has finished
    seconds = time.perf_counter() - began
    drafter.eval()
    return seconds


def _progress_bar(drafter: Eagle3Drafter, tcfg: DictConfig, start: int, progress: bool) -> tqdm:
    """The training steps from `start`, as a progress bar (silent without `progress`)."""
    backend = " (torchspec)" if tcfg.backend == "torchspec" else ""
    return tqdm(
        range(start, tcfg.steps),
        initial=start,
        total=tcfg.steps,
        desc=f"train {drafter.spec.fc_norm}/{drafter.spec.norm_output}{backend}",
        unit="step",
        disable=not progress,
    )


def _summarize(window: list[dict], tokens_per_s: float, lr: float) -> dict[str, float]:
    n = len(window)
    length = len(window[0]["accs"])
    accs = [sum(s["accs"][i] for s in window) / n for i in range(length)]
    summary = {
        metric_keys.train_stat("loss"): sum(s["loss"] for s in window) / n,
        metric_keys.train_stat("tokens_per_s"): tokens_per_s,
        metric_keys.train_stat("lr"): lr,
        metric_keys.train_stat("simulated_acc_len"): simulated_acc_len(accs),
    }
    for i in range(length):
        summary[metric_keys.train_step_loss(i)] = sum(s["plosses"][i] for s in window) / n
        summary[metric_keys.train_step_acc(i)] = accs[i]
    return summary
