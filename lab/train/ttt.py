"""The native training-time-test (TTT) trainer, with TorchSpec / EAGLE semantics.

Per batch: the target distribution is recomputed from the cached post-norm final state with the
target's lm_head (TorchSpec's LazyTarget); the drafter is unrolled `ttt_length` steps (step 0 from
the projected target features, later steps from its own feedback); step i's loss is the forward KL
(soft cross-entropy) against the target at position t+i+1, weighted step_weight**i.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from tqdm.auto import tqdm

from lab import metrics as keys
from lab.data.cache import HiddenStates
from lab.drafter import Eagle3Drafter
from lab.schedule import warmup_cosine
from lab.target import target_logits
from lab.train.resume import Checkpointing, StopRequest, TrainState
from lab.train.resume import save as save_state
from lab.train.step import LossFn, StepStats

MetricsFn = Callable[[dict[str, float], int], None]


def ttt_loss(
    drafter: Eagle3Drafter,
    input_ids: torch.Tensor,
    aux: torch.Tensor,
    final: torch.Tensor,
    lm_head_weight: torch.Tensor,
    length: int,
    step_weight: float,
    loss_mask: torch.Tensor | None = None,
) -> StepStats:
    """TTT loss of one batch: input_ids [B, T] (x_0..x_{T-1}), aux [B, T, A*H], final [B, T, H];
    loss_mask [B, T] marks the tokens to learn (a prediction of x_j counts where loss_mask[j] is 1)."""
    t = input_ids.shape[1]
    if length >= t:
        raise ValueError(f"train.ttt_length={length} must be below data.seq_len={t}")
    with torch.no_grad():
        target_z = target_logits(final.float(), lm_head_weight.float())  # [B, T, V]
        target_top = target_z.argmax(-1)  # [B, T]
        # target_z[j] predicts x_{j+1}: it is learned where x_{j+1} is a token to learn
        predicts = (
            torch.ones_like(input_ids, dtype=torch.float)
            if loss_mask is None
            else F.pad(loss_mask[:, 1:].float(), (0, 1))
        )
        learnable = predicts
        if drafter.spec.draft_vocab_size != drafter.spec.vocab_size:
            # EAGLE-3: the target distribution restricted to the draft vocabulary; positions whose
            # target argmax lies outside it teach nothing (and count as misses in acc)
            draft_ids = drafter.draft_token_ids()
            in_draft = torch.zeros(drafter.spec.vocab_size, dtype=torch.bool)
            in_draft[draft_ids] = True
            target_z = target_z[..., draft_ids]
            learnable = predicts * in_draft[target_top]
        target_p = torch.softmax(target_z, dim=-1)
    shifted = F.pad(input_ids[:, 1:], (0, 1))  # position t carries x_{t+1}
    outs = drafter.unroll(shifted, aux.float(), length)
    loss = torch.zeros(())
    plosses, accs = [], []
    vocab = target_p.shape[-1]
    hidden = drafter.spec.hidden_size
    for i, h_out in enumerate(outs):
        n = t - 1 - i  # positions whose target p_{t+i+1} exists; step i there predicts x_{t+i+1}
        # only the counted positions reach lm_head: in chat data most tokens are not the assistant's
        rows = predicts[:, i + 1 : i + 1 + n].reshape(-1).nonzero().squeeze(-1)
        logits = drafter.logits(h_out[:, :n].reshape(-1, hidden).index_select(0, rows)).float()
        weight = learnable[:, i + 1 : i + 1 + n].reshape(-1)[rows]
        # soft-label cross-entropy == forward KL up to the target's (constant) entropy; fused kernel
        target_rows = target_p[:, i + 1 : i + 1 + n].reshape(-1, vocab).index_select(0, rows)
        ce = F.cross_entropy(logits, target_rows, reduction="none")
        ploss = (ce * weight).sum() / weight.sum().clamp_min(1.0)
        drafted = drafter.to_target_ids(logits.detach().argmax(-1))
        hits = drafted == target_top[:, i + 1 : i + 1 + n].reshape(-1)[rows]
        acc = hits.float().sum() / max(rows.numel(), 1)
        loss = loss + (step_weight**i) * ploss
        plosses.append(ploss.item())
        accs.append(acc.item())
    return StepStats(loss, plosses, accs)


HOLD_ENV = "LAB_HOLD_AFTER_STEP"  # "N:FILE": after step N, touch FILE and wait for Ctrl-C


def _hold(done: int, stop: StopRequest) -> None:
    """With LAB_HOLD_AFTER_STEP=N:FILE, training stops after step N, says so by creating FILE and waits
    there until interrupted: a test interrupts at a point it controls, however fast the machine trains."""
    hold = os.environ.get(HOLD_ENV, "")
    if not hold or int(hold.split(":", 1)[0]) != done:
        return
    Path(hold.split(":", 1)[1]).touch()
    while not stop.requested:
        time.sleep(0.05)


def simulated_acc_len(accs: list[float]) -> float:
    """sum over k of prod_{j<=k} acc_j (docs/design.md)."""
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

    With `checkpoint`, a resume checkpoint is written every `checkpoint.every` steps and after the last,
    and Ctrl-C stops after the current step with a checkpoint. With `resume` (such a checkpoint, of the
    same training), training continues from its step and ends with the weights an uninterrupted run
    would have, bit for bit (same thread count); the metrics it logged are sent to `log` again first."""
    if loss is None and tcfg.backend != "native":
        raise ValueError(f"train.backend={tcfg.backend}: pass its loss (`loss=`); only the native one is the default")
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=tcfg.lr, betas=(0.9, 0.95), weight_decay=tcfg.weight_decay)
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
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(tcfg.autocast_bf16)):
                stats = batch_loss(
                    data.input_ids[idx],
                    data.aux[idx],
                    data.final[idx],
                    lm_head_weight,
                    tcfg.ttt_length,
                    tcfg.step_weight,
                    data.loss_mask[idx],
                )
            if not torch.isfinite(stats.loss):
                raise FloatingPointError(f"non-finite training loss at step {step}: {stats.loss.item()}")
            opt.zero_grad(set_to_none=True)
            stats.loss.backward()
            torch.nn.utils.clip_grad_norm_(params, tcfg.grad_clip)
            opt.step()
            window.append({"loss": stats.loss.item(), "plosses": stats.plosses, "accs": stats.accs})
            window_tokens += int(data.input_ids[idx].numel())
            done = step + 1
            if done % tcfg.log_every == 0 or done == tcfg.steps:
                elapsed = time.time() - window_start
                last = _summarize(window, window_tokens / max(elapsed, 1e-9), opt.param_groups[0]["lr"])
                history.append((done, last))
                if log is not None:
                    log(last, done)
                bar.set_postfix(
                    loss=f"{last[keys.train_stat('loss')]:.3f}",
                    acc0=f"{last[keys.train_step_acc(0)]:.2f}",
                    sal=f"{last[keys.train_stat('simulated_acc_len')]:.2f}",
                )
                window, window_tokens, window_start = [], 0, time.time()
            _hold(done, stop)
            stopping = stop.requested  # read once: a Ctrl-C from here on still gets its checkpoint
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
        keys.train_stat("loss"): sum(s["loss"] for s in window) / n,
        keys.train_stat("tokens_per_s"): tokens_per_s,
        keys.train_stat("lr"): lr,
        keys.train_stat("simulated_acc_len"): simulated_acc_len(accs),
    }
    for i in range(length):
        summary[keys.train_step_loss(i)] = sum(s["plosses"][i] for s in window) / n
        summary[keys.train_step_acc(i)] = accs[i]
    return summary
