"""The native training-time-test (TTT) trainer, with TorchSpec / EAGLE semantics.

Per batch: the target distribution is recomputed from the cached post-norm final state with the
target's lm_head (TorchSpec's LazyTarget); the drafter is unrolled `ttt_length` steps (step 0 from
the projected target features, later steps from its own feedback); step i's loss is the forward KL
(soft cross-entropy) against the target at position t+i+1, weighted step_weight**i.

Only what the loss reads is computed (the results equal the plain dense computation up to float
rounding; tests/test_train.py checks it, tests/test_torchspec.py against TorchSpec): the target's
distribution once per position the loss counts (every step shares it), the drafter's later steps only
at the positions whose loss they feed, and lm_head with the cross-entropy chunked over those rows, its
gradients formed chunk by chunk, so that no [B, T, V] tensor (nor [rows, V] for the backward) exists.
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
from lab.device import autocast
from lab.drafter import Eagle3Drafter
from lab.drafter.unroll import rms_norm, unroll
from lab.schedule import warmup_cosine
from lab.target import target_logits
from lab.train.resume import Checkpointing, StopRequest, TrainState
from lab.train.resume import save as save_state
from lab.train.step import LossFn, StepStats

MetricsFn = Callable[[dict[str, float], int], None]


# rows of one chunk over the vocabulary: small enough that a chunk's [rows, V] logits stay in cache while
# they are reduced (2 MiB), large enough that lm_head's matmul stays efficient (128 rows at least)
CHUNK_ELEMENTS = 1 << 19


def _chunk_rows(vocab: int) -> int:
    return max(128, CHUNK_ELEMENTS // vocab)


@torch.no_grad()
def soft_labels(
    final: torch.Tensor, lm_head_weight: torch.Tensor, draft_ids: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's distribution at the given rows, computed once per row and chunked over rows so
    that no [B, T, V] is materialised: final [P, H] -> (argmax over the full vocabulary [P], soft labels
    [P, V'] over the draft vocabulary `draft_ids` (None: the full one), renormalized there)."""
    weight = lm_head_weight.float()
    rows, vocab = final.shape[0], weight.shape[0]
    top = torch.empty(rows, dtype=torch.long, device=final.device)
    labels = weight.new_empty(rows, vocab if draft_ids is None else len(draft_ids))
    step = _chunk_rows(vocab)
    for a in range(0, rows, step):
        z = target_logits(final[a : a + step].float(), weight)  # [c, V]
        m, top[a : a + step] = z.max(-1)
        if draft_ids is None:
            z.sub_(m[:, None])
        else:
            z = z.index_select(-1, draft_ids)
            z.sub_(z.amax(-1, keepdim=True))
        z.exp_()
        torch.div(z, z.sum(-1, keepdim=True), out=labels[a : a + step])
    return top, labels


class _SoftLabelCrossEntropy(torch.autograd.Function):
    """sum over rows of row_weight * CE(x @ weight.T, labels[slots]), chunked over rows: the logits exist
    one chunk of rows at a time (small enough to stay in cache while they are reduced), and the
    gradients of x and weight are accumulated chunk by chunk in the forward, so that nothing [N, V] is
    kept for the backward, which only scales them. Also returns each row's cross-entropy and argmax
    (not differentiable)."""

    @staticmethod
    def forward(ctx, x, weight, labels, slots, row_weight, chunk):  # noqa: ANN001, D102
        grads = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        n = x.shape[0]
        ce = x.new_zeros(n, dtype=torch.float32)
        top = torch.zeros(n, dtype=torch.long, device=x.device)
        gx = torch.zeros_like(x) if grads else None
        gw = torch.zeros_like(weight) if grads else None
        for a in range(0, n, chunk):
            z = min(n, a + chunk)
            xs = x[a:z]
            raw = F.linear(xs, weight)  # [c, V], in autocast's dtype where it is on
            logits = raw.float()
            p = labels.index_select(0, slots[a:z])
            m, top[a:z] = logits.max(-1)
            # soft-label cross-entropy (== forward KL up to the target's constant entropy): lse - p . logits,
            # with lse = max - log(softmax at the argmax)
            dot = torch.linalg.vecdot(p, logits)
            g = torch.softmax(logits, dim=-1)
            ce[a:z] = m - g.gather(1, top[a:z, None]).squeeze(1).log_() - dot
            if grads:
                # d ce / d logits = softmax - p; the row weights scale the (narrow) x and gx, not [c, V]
                g.sub_(p)
                w = row_weight[a:z, None]
                if g.dtype == xs.dtype == weight.dtype:
                    torch.mm(g, weight, out=gx[a:z]).mul_(w)
                    gw.addmm_(g.T, xs * w)  # accumulated in place
                else:  # autocast: the backward of lm_head in the forward's precision
                    g = g.to(raw.dtype)
                    gx[a:z] = (g @ weight.to(raw.dtype)).to(gx.dtype) * w
                    gw += (g.T @ (xs * w).to(raw.dtype)).to(gw.dtype)
        ctx.save_for_backward(gx, gw)
        ctx.mark_non_differentiable(ce, top)
        return (ce * row_weight).sum(), ce, top

    @staticmethod
    def backward(ctx, grad, _ce, _top):  # noqa: ANN001, D102
        gx, gw = ctx.saved_tensors
        if grad.item() != 1.0:  # the loss is usually backpropagated as it is
            gx, gw = (None if gx is None else gx * grad), (None if gw is None else gw * grad)
        return (
            gx,
            gw,
            None,
            None,
            None,
            None,
        )


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
    loss_mask [B, T] marks the tokens to learn (a prediction of x_j counts where loss_mask[j] is 1).

    Only what the loss reads is computed: the target's distribution once per counted position (step i
    at position t learns from position t+i+1's, so each is shared by every step), the drafter's later
    steps only at the positions whose loss they feed (`lab.drafter.unroll.unroll`'s `keep`), and lm_head with
    the cross-entropy chunked over the rows that count."""
    b, t = input_ids.shape
    if length >= t:
        raise ValueError(f"train.ttt_length={length} must be below data.seq_len={t}")
    pruned = drafter.spec.draft_vocab_size != drafter.spec.vocab_size
    with torch.no_grad():
        # final[j] predicts x_{j+1}: it is learned where x_{j+1} is a token to learn
        predicts = (
            torch.ones(b, t, dtype=torch.bool, device=input_ids.device)
            if loss_mask is None
            else F.pad(loss_mask[:, 1:] != 0, (0, 1))
        )
        counted = predicts.reshape(-1).nonzero().squeeze(-1)  # the target rows any step learns from
        draft_ids = drafter.draft_token_ids() if pruned else None
        target_top, labels = soft_labels(final.reshape(b * t, -1).index_select(0, counted), lm_head_weight, draft_ids)
        learnable = torch.ones_like(target_top, dtype=torch.bool)
        if pruned:
            # EAGLE-3: the target distribution restricted to the draft vocabulary; positions whose
            # target argmax lies outside it teach nothing (and count as misses in acc)
            in_draft = torch.zeros(drafter.spec.vocab_size, dtype=torch.bool, device=input_ids.device)
            in_draft[draft_ids] = True
            learnable = in_draft[target_top]
        # slot[j]: row of `labels` for target position j (flattened B x T), -1 where nothing is learned
        slot = torch.full((b * t,), -1, dtype=torch.long, device=input_ids.device)
        slot[counted] = torch.arange(len(counted), device=input_ids.device)
        slot = slot.view(b, t)
        learn_slot = torch.where(slot >= 0, learnable[slot.clamp_min(0)], False)
        step_slots, step_rows, needed = [], [], []
        for i in range(length):
            # step i at position t <= T-2-i learns from target position t+i+1
            at = F.pad(slot[:, i + 1 :], (0, i + 1), value=-1).reshape(-1)
            learns = F.pad(learn_slot[:, i + 1 :], (0, i + 1), value=False).reshape(-1)
            step_slots.append(at)
            step_rows.append(learns.nonzero().squeeze(-1))
            needed.append(learns)
        # a step computes where it or a later step learns (the later steps read its output there)
        for i in range(length - 2, -1, -1):
            needed[i] = needed[i] | needed[i + 1]
        keep = [m.nonzero().squeeze(-1) for m in needed]
    shifted = F.pad(input_ids[:, 1:], (0, 1))  # position t carries x_{t+1}
    outs = unroll(drafter, shifted, aux.float(), length, keep=keep)
    xs, slots, weights = [], [], []
    for i, h_out in enumerate(outs):
        rows = step_rows[i]
        xs.append(h_out.index_select(0, torch.searchsorted(keep[i], rows)))
        slots.append(step_slots[i].index_select(0, rows))
        weights.append(torch.full((len(rows),), step_weight**i / max(len(rows), 1), device=input_ids.device))
    x = rms_norm(drafter.norm, torch.cat(xs))  # lm_head always reads norm(h)
    weight = drafter.lm_head.weight
    slots_all = torch.cat(slots)
    loss, ce, top = _SoftLabelCrossEntropy.apply(
        x, weight, labels, slots_all, torch.cat(weights), _chunk_rows(weight.shape[0])
    )
    plosses, accs = [], []
    a = 0
    for i, rows in enumerate(step_rows):
        n = len(rows)
        plosses.append(ce[a : a + n].sum().item() / max(n, 1))
        drafted = drafter.to_target_ids(top[a : a + n])
        hits = (drafted == target_top.index_select(0, slots_all[a : a + n])).sum().item()
        accs.append(hits / max(int((step_slots[i] >= 0).sum()), 1))
        a += n
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

    With `checkpoint`, a resume checkpoint is written every `checkpoint.every` steps and after the last,
    and Ctrl-C stops after the current step with a checkpoint. With `resume` (such a checkpoint, of the
    same training), training continues from its step and ends with the weights an uninterrupted run
    would have, bit for bit (same thread count); the metrics it logged are sent to `log` again first.

    Batches go to the drafter's device. The drafter computes in `lm_head_weight`'s dtype, the target's (under
    autocast, its weights and AdamW's state staying float32; `train.autocast_bf16` asks for bfloat16 whatever
    the target's), float16 with a scaled loss so that small gradients do not flush to zero."""
    if loss is None and tcfg.backend != "native":
        raise ValueError(f"train.backend={tcfg.backend}: pass its loss (`loss=`); only the native one is the default")
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = optimizer(params, tcfg)
    device = params[0].device
    precision = torch.bfloat16 if tcfg.autocast_bf16 else lm_head_weight.dtype
    # disabled (every call passes through) unless float16; its loss scale travels in the resume checkpoint
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
            if not torch.isfinite(stats.loss):
                raise FloatingPointError(f"non-finite training loss at step {step}: {stats.loss.item()}")
            opt.zero_grad(set_to_none=True)
            scaler.scale(stats.loss).backward()
            scaler.unscale_(opt)  # the gradient's norm is clipped as it is, not as scaled
            torch.nn.utils.clip_grad_norm_(params, tcfg.grad_clip)
            scaler.step(opt)
            scaler.update()
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
        keys.train_stat("loss"): sum(s["loss"] for s in window) / n,
        keys.train_stat("tokens_per_s"): tokens_per_s,
        keys.train_stat("lr"): lr,
        keys.train_stat("simulated_acc_len"): simulated_acc_len(accs),
    }
    for i in range(length):
        summary[keys.train_step_loss(i)] = sum(s["plosses"][i] for s in window) / n
        summary[keys.train_step_acc(i)] = accs[i]
    return summary
