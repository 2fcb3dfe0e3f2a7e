"""The native training-time-test (TTT) loss, with TorchSpec / EAGLE semantics (lab/train/ttt.py trains with it).

Per batch: the target distribution is recomputed from the cached post-norm final state with the target's
lm_head (TorchSpec's LazyTarget); the drafter is unrolled `ttt_length` steps (step 0 from the projected target
features, later steps from its own feedback); step i's loss is the forward KL (soft cross-entropy) against the
target at position t+i+1, weighted step_weight**i.

Only what the loss reads is computed (the results equal the plain dense computation, and TorchSpec's, up to
float rounding): the target's distribution once per
position the loss counts (every step shares it), the drafter's later steps only at the positions whose loss
they feed, and lm_head with the cross-entropy chunked over those rows, its gradients formed chunk by chunk, so
that no [B, T, V] tensor (nor [rows, V] for the backward) exists.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lab.drafter import Eagle3Drafter
from lab.drafter.unroll import rms_norm, unroll
from lab.target import target_logits
from lab.train.step import StepStats

# rows of one chunk over the vocabulary. On a CPU: small enough that a chunk's [rows, V] logits stay in cache
# while they are reduced (2 MiB), large enough that lm_head's matmul stays efficient (128 rows at least). On a
# GPU the launches are what costs: chunks of 64M logits (256 MiB in float32), a few per step.
CHUNK_ELEMENTS = {"cpu": 1 << 19, "cuda": 1 << 26}


def _chunk_rows(vocab: int, device: torch.device) -> int:
    return max(128, CHUNK_ELEMENTS.get(device.type, CHUNK_ELEMENTS["cpu"]) // vocab)


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
    step = _chunk_rows(vocab, final.device)
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
                if raw.dtype == g.dtype == xs.dtype == weight.dtype:  # float32 throughout: in place
                    torch.mm(g, weight, out=gx[a:z]).mul_(w)
                    gw.addmm_(g.T, xs * w)  # accumulated in place
                else:  # autocast: the backward of lm_head in the forward's precision (mm(out=) would bypass it)
                    g = g.to(raw.dtype)
                    gx[a:z] = (g @ weight.to(raw.dtype)).to(gx.dtype) * w
                    gw += (g.T @ (xs * w).to(raw.dtype)).to(gw.dtype)
        ctx.save_for_backward(gx, gw)
        ctx.mark_non_differentiable(ce, top)
        return (ce * row_weight).sum(), ce, top

    @staticmethod
    def backward(ctx, grad, _ce, _top):  # noqa: ANN001, D102
        gx, gw = ctx.saved_tensors
        # the loss is usually backpropagated as it is; off the CPU, scaling is cheaper than a host sync to ask
        if grad.device.type != "cpu" or grad.item() != 1.0:
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
        step_slots, learns = [], []
        for i in range(length):
            # step i at position t <= T-2-i learns from target position t+i+1
            step_slots.append(F.pad(slot[:, i + 1 :], (0, i + 1), value=-1).reshape(-1))
            learns.append(F.pad(learn_slot[:, i + 1 :], (0, i + 1), value=False).reshape(-1))
        # a step computes where it or a later step learns (the later steps read its output there)
        needed = list(learns)
        for i in range(length - 2, -1, -1):
            needed[i] = needed[i] | needed[i + 1]
        # every step's rows in one nonzero and one transfer of their counts (two host syncs, not 2 x length)
        found = _rows_of(torch.stack(learns + needed))
        step_rows, keep = found[:length], found[length:]
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
        x, weight, labels, slots_all, torch.cat(weights), _chunk_rows(weight.shape[0], x.device)
    )
    # each step's mean loss and accuracy, read in one transfer
    hits = drafter.to_target_ids(top) == target_top.index_select(0, slots_all)
    sums, a = [], 0
    for i, rows in enumerate(step_rows):
        n = len(rows)
        sums += [ce[a : a + n].sum(), hits[a : a + n].sum(), (step_slots[i] >= 0).sum()]
        a += n
    read = torch.stack(sums).view(length, 3).tolist() if sums else []
    plosses = [lsum / max(len(rows), 1) for (lsum, _, _), rows in zip(read, step_rows, strict=True)]
    accs = [hit / max(total, 1) for _, hit, total in read]
    return StepStats(loss, plosses, accs)


def _rows_of(masks: torch.Tensor) -> list[torch.Tensor]:
    """The indexes where each row of masks [K, N] is True: one nonzero and one transfer of the K counts."""
    where = masks.nonzero()  # [found, 2], in row order
    counts = torch.bincount(where[:, 0], minlength=masks.shape[0]).tolist()
    return list(where[:, 1].split(counts))
