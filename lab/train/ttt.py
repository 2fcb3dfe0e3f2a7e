"""The native training-time-test (TTT) trainer: batches, AdamW, warmup-cosine, metrics, resumable checkpoints.

A step's loss comes from the caller's backend (`lab.train.step.LossFn`); the native one is
`lab.train.loss.ttt_loss` (TorchSpec / EAGLE semantics, only what the loss reads computed).
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
from lab.train.loss import ttt_loss
from lab.train.resume import Checkpointing, StopRequest, TrainState
from lab.train.resume import save as save_state
from lab.train.step import LossFn

MetricsFn = Callable[[dict[str, float], int], None]


def simulated_acc_len(accs: list[float]) -> float:
    """sum over k of prod_{j<=k} acc_j (docs/metrics.md)."""
    total, running = 0.0, 1.0
    for a in accs:
        running *= a
        total += running
    return total


@dataclass
class TrainResult:
    steps: int
    seconds: float
    tokens_per_s: float  # of the steps trained in this call (0 when a finished checkpoint was resumed)
    last: dict[str, float] = field(default_factory=dict)


def optimizer(params: list[torch.nn.Parameter], tcfg: DictConfig) -> torch.optim.AdamW:
    """The trainer's AdamW (both backends): betas (0.9, 0.95), torch's fused kernel (one pass over all
    parameters rather than a loop of small ops per parameter)."""
    return torch.optim.AdamW(params, lr=tcfg.lr, betas=(0.9, 0.95), weight_decay=tcfg.weight_decay, fused=True)


def train(
    drafter: Eagle3Drafter,
    data: HiddenStates,
    lm_head_weight: torch.Tensor,
    tcfg: DictConfig,
    seed: int,
    log: MetricsFn | None = None,
    progress: bool = True,
    checkpoint: Checkpointing | None = None,
    resume: TrainState | None = None,
    loss: LossFn | None = None,
) -> TrainResult:
    """Train in place; `log(metrics, step)` receives the averaged metrics every `log_every` steps.

    `loss` computes a batch's TTT loss for `drafter` (`lab.train.step.LossFn`): the caller picks the
    backend, e.g. `TorchSpecTTT.for_drafter(drafter, ttt_length).loss` for `train.backend=torchspec`
    (lab/pipeline.py `training_loss`); None is the native `ttt_loss`, for `train.backend=native` only.

    With `checkpoint`, a resume state is written every `checkpoint.every` steps and after the last,
    and Ctrl-C stops after the current step with a checkpoint. With `resume` (such a checkpoint, of the
    same training), training continues from its step and ends with the weights an uninterrupted run
    would have, bit for bit (same thread count); the metrics it logged are sent to `log` again first.

    Batches go to the drafter's device. The drafter computes in `lm_head_weight`'s dtype, the target's (under
    autocast, its weights and AdamW's state staying float32; the config's `dtype` is the one knob), float16
    with a scaled loss so that small gradients do not flush to zero."""
    if loss is None and tcfg.backend != "native":
        raise ValueError(f"train.backend={tcfg.backend}: pass its loss (`loss=`); only the native one is the default")
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = optimizer(params, tcfg)
    device = params[0].device
    precision = lm_head_weight.dtype
    # disabled (every call passes through) unless float16; its loss scale travels in the resume state
    scaler = torch.amp.GradScaler(device.type, enabled=precision == torch.float16)
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(data), generator=gen)
    cursor, start = 0, 0
    window: list[dict] = []  # per-step stats since the last log
    history: list[tuple[int, dict[str, float]]] = []
    last: dict[str, float] = {}
    if resume is not None:
        start, order, cursor = resume.step, resume.order, resume.cursor
        gen.set_state(resume.generator)
        drafter.load_state_dict(resume.model, strict=True)
        # the fresh optimizer's groups (same config: the checkpoint key covers it); lr is set per step
        opt.load_state_dict({"state": resume.optimizer, "param_groups": opt.state_dict()["param_groups"]})
        if resume.scaler:
            scaler.load_state_dict(resume.scaler)
        if resume.log_every == tcfg.log_every:  # else its window would straddle other log steps
            window = list(resume.window)
        history = list(resume.history)
        for step, metrics in history:
            if log is not None:
                log(metrics, step)
            last = metrics
    batch_loss = loss if loss is not None else functools.partial(ttt_loss, drafter)
    drafter.train()
    window_tokens, window_start = 0, time.time()
    started = time.time()
    bar = tqdm(
        range(start, tcfg.steps),
        initial=start,
        total=tcfg.steps,
        desc=f"train {drafter.spec.fc_norm}/{drafter.spec.norm_output}"
        + (" (torchspec)" if tcfg.backend == "torchspec" else ""),
        unit="step",
        disable=not progress,
    )
    stop = StopRequest()
    with stop.installed() if checkpoint is not None else contextlib.nullcontext():
        for step in bar:
            if cursor + tcfg.batch_size > len(order):
                order, cursor = torch.randperm(len(data), generator=gen), 0
            idx = order[cursor : cursor + tcfg.batch_size]
            cursor += tcfg.batch_size
            for group in opt.param_groups:
                group["lr"] = warmup_cosine(step, tcfg.steps, tcfg.warmup_steps, tcfg.lr, tcfg.min_lr_ratio)
            with autocast(device, precision):
                stats = batch_loss(
                    data.input_ids[idx].to(device),
                    data.aux[idx].to(device),
                    data.final[idx].to(device),
                    lm_head_weight,
                    tcfg.ttt_length,
                    tcfg.step_weight,
                    data.loss_mask[idx].to(device),
                )
            value = stats.loss.item()  # one host sync a step, for the finite check and the log alike
            if not math.isfinite(value):
                raise FloatingPointError(f"non-finite training loss at step {step}: {value}")
            opt.zero_grad(set_to_none=True)
            scaler.scale(stats.loss).backward()
            scaler.unscale_(opt)  # the gradient's norm is clipped as it is, not as scaled
            torch.nn.utils.clip_grad_norm_(params, tcfg.grad_clip)
            scaler.step(opt)
            scaler.update()
            window.append({"loss": value, "plosses": stats.plosses, "accs": stats.accs})
            window_tokens += int(data.input_ids[idx].numel())
            done = step + 1
            if done % tcfg.log_every == 0 or done == tcfg.steps:
                elapsed = time.time() - window_start
                last = _summarize(window, window_tokens / max(elapsed, 1e-9), opt.param_groups[0]["lr"])
                history.append((done, last))
                if log is not None:
                    log(last, done)
                bar.set_postfix(
                    loss=f"{last[metric_keys.train_stat('loss')]:.3f}",
                    acc0=f"{last[metric_keys.train_step_acc(0)]:.2f}",
                    sal=f"{last[metric_keys.train_stat('simulated_acc_len')]:.2f}",
                )
                window, window_tokens, window_start = [], 0, time.time()
            # read once a step: a Ctrl-C from here on still gets its checkpoint (and tests/hold/sitecustomize.py
            # holds a test's training at its N-th read)
            stopping = stop.requested
            if checkpoint is not None and (done % checkpoint.every == 0 or done == tcfg.steps or stopping):
                state = TrainState(
                    step=done,
                    steps=tcfg.steps,
                    model=drafter.state_dict(),
                    optimizer=opt.state_dict()["state"],
                    order=order,
                    cursor=cursor,
                    generator=gen.get_state(),
                    log_every=tcfg.log_every,
                    window=window,
                    history=history,
                    run_id=checkpoint.run_id,
                    scaler=scaler.state_dict(),
                )
                save_state(checkpoint.path, state)
            if stopping:
                raise KeyboardInterrupt
    bar.close()
    drafter.eval()
    seconds = time.time() - started
    tokens = (tcfg.steps - start) * tcfg.batch_size * data.input_ids.shape[1]
    return TrainResult(tcfg.steps, seconds, tokens / max(seconds, 1e-9), last)


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
