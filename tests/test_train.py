"""The TTT trainer learns, logs the design's metric keys, is reproducible under a seed, and resumes exactly."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import perturb

from lab.config.shape import aux_layers
from lab.data.cache import HiddenStates
from lab.drafter import init_drafter
from lab.drafter.unroll import unroll
from lab.train import resume
from lab.train.loss import ttt_loss
from lab.train.resume import ResumeWriter
from lab.train.ttt import simulated_acc_len, train


def test_simulated_acc_len():
    assert simulated_acc_len([0.5, 0.5, 1.0]) == pytest.approx(0.5 + 0.25 + 0.25)
    assert simulated_acc_len([1.0, 1.0]) == 2.0


def test_training_lowers_the_loss_and_logs_every_key(micro_cfg, micro_target, micro_hidden):
    logged: list[tuple[dict, int]] = []
    cfg = micro_cfg.train.copy()
    cfg.steps, cfg.log_every = 40, 10
    drafter = init_drafter(micro_target, micro_cfg.drafter, aux_layers(micro_cfg), seed=0)
    batch = slice(0, 16)
    args = (
        micro_hidden.input_ids[batch],
        micro_hidden.aux[batch],
        micro_hidden.final[batch],
        micro_target.lm_head_weight,
        cfg.ttt_length,
        cfg.step_weight,
    )
    with torch.no_grad():
        before = ttt_loss(drafter, *args)
    result = train(
        drafter,
        micro_hidden,
        micro_target.lm_head_weight,
        cfg,
        seed=0,
        log=lambda m, s: logged.append((m, s)),
        progress=False,
    )
    with torch.no_grad():
        after = ttt_loss(drafter, *args)
    assert after.loss < before.loss * 0.9
    assert [s for _, s in logged] == [10, 20, 30, 40]
    keys = set(logged[-1][0])
    L = cfg.ttt_length
    assert {"train/loss", "train/simulated_acc_len", "train/tokens_per_s"} <= keys
    assert {f"train/ploss_{i}" for i in range(L)} | {f"train/acc_{i}" for i in range(L)} <= keys
    assert result.tokens_per_s > 0
    assert not drafter.embed_tokens.weight.requires_grad
    torch.testing.assert_close(drafter.embed_tokens.weight, micro_target.embed_weight)  # frozen copy


def test_same_seed_same_drafter(micro_cfg, micro_target, micro_hidden):
    cfg = micro_cfg.train.copy()
    cfg.steps = 3
    weights = []
    for _ in range(2):
        d = init_drafter(micro_target, micro_cfg.drafter, aux_layers(micro_cfg), seed=7)
        train(d, micro_hidden, micro_target.lm_head_weight, cfg, seed=7, progress=False)
        weights.append(d.fc.weight.detach().clone())
    assert torch.equal(weights[0], weights[1])


def test_loss_mask_ignores_predictions_of_prompt_tokens(micro_cfg, micro_target, micro_hidden):
    drafter = init_drafter(micro_target, micro_cfg.drafter, aux_layers(micro_cfg), seed=0)
    b = slice(0, 8)
    ids, aux, final, mask = (
        micro_hidden.input_ids[b],
        micro_hidden.aux[b],
        micro_hidden.final[b].clone(),
        micro_hidden.loss_mask[b],
    )
    W = micro_target.lm_head_weight

    def loss(f):
        with torch.no_grad():
            return ttt_loss(drafter, ids, aux, f, W, 3, 0.8, mask).loss.item()

    base = loss(final)
    predicts_prompt = torch.nn.functional.pad(mask[:, 1:], (0, 1)) == 0  # final[j] predicts x_{j+1}
    noisy = final.clone()
    noisy[predicts_prompt] = torch.randn_like(noisy[predicts_prompt]) * 5
    assert loss(noisy) == pytest.approx(base, rel=1e-6)
    noisy = final.clone()
    noisy[~predicts_prompt] = torch.randn_like(noisy[~predicts_prompt]) * 5
    assert abs(loss(noisy) - base) > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_resumed_training_ends_bitwise_identical(micro_cfg, micro_target, micro_hidden, tmp_path, dtype):
    """Interrupted after step 8 (last resume state at step 6, mid log window), resumed: the same weights
    and the same logged metrics as an uninterrupted run, across an epoch's reshuffle (4 steps each).
    A float16 target trains with a scaled loss: the scale it backed off to resumes with it."""
    h = micro_hidden
    data = HiddenStates(h.input_ids[:64], h.loss_mask[:64], h.aux[:64].to(dtype), h.final[:64].to(dtype), h.path)
    lm_head = micro_target.lm_head_weight.to(dtype)
    cfg = micro_cfg.train.copy()
    cfg.steps, cfg.batch_size, cfg.log_every, cfg.warmup_steps = 10, 16, 4, 2
    layers = aux_layers(micro_cfg)

    def run(log, **kw):
        d = init_drafter(micro_target, micro_cfg.drafter, layers, seed=3)
        train(d, data, lm_head, cfg, seed=3, log=log, progress=False, **kw)
        return d

    def without_speed(logged):
        return [(s, {k: v for k, v in m.items() if k != "train/tokens_per_s"}) for m, s in logged]

    straight: list = []
    expected = run(lambda m, s: straight.append((m, s)))

    def interrupt_at_8(metrics, step):
        if step == 8:
            raise KeyboardInterrupt

    ckpt = ResumeWriter(tmp_path / "ckpt", every=3, run_id="first")
    with pytest.raises(KeyboardInterrupt):
        run(interrupt_at_8, resume_writer=ckpt)
    state = resume.load(ckpt.path, cfg.steps)
    assert state is not None and state.step == 6 and state.run_id == "first" and len(state.window) == 2
    if dtype == torch.float16:  # steps that overflowed were skipped and the loss scale backed off from its start
        assert 0 < state.scaler["scale"] < torch.amp.GradScaler("cpu").get_scale()
        assert 0 < state.optimizer[0]["step"].item() < 6.0
    else:
        assert state.scaler == {} and state.optimizer[0]["step"].item() == 6.0  # AdamW's step count, a tensor

    resumed: list = []
    got = run(lambda m, s: resumed.append((m, s)), resume_writer=ResumeWriter(ckpt.path, 3, "second"), resume=state)
    for k, v in expected.state_dict().items():
        assert torch.equal(v, got.state_dict()[k]), k
    assert without_speed(resumed) == without_speed(straight)  # history replayed, then the same window
    final = json.loads((ckpt.path / resume.MANIFEST).read_text())
    assert (final["step"], final["steps"], final["run_id"]) == (10, 10, "second")


def _dense_ttt_loss(drafter, input_ids, aux, final, lm_head, length, step_weight, loss_mask):
    """The TTT loss the plain way: the target's distribution at every position, every drafting step at
    every position, lm_head over all of them, then the counted ones picked out."""
    F = torch.nn.functional
    t = input_ids.shape[1]
    target_z = final.float() @ lm_head.float().T
    target_top = target_z.argmax(-1)
    predicts = torch.ones(input_ids.shape) if loss_mask is None else F.pad(loss_mask[:, 1:].float(), (0, 1))
    learnable = predicts
    if drafter.spec.draft_vocab_size != drafter.spec.vocab_size:
        in_draft = torch.zeros(drafter.spec.vocab_size, dtype=torch.bool)
        in_draft[drafter.draft_token_ids()] = True
        target_z = target_z[..., drafter.draft_token_ids()]
        learnable = predicts * in_draft[target_top]
    target_p = torch.softmax(target_z, -1)
    outs = unroll(drafter, F.pad(input_ids[:, 1:], (0, 1)), aux.float(), length)
    loss, plosses, accs = torch.zeros(()), [], []
    for i, h in enumerate(outs):
        n = t - 1 - i
        logits = drafter.logits(h[:, :n]).float()
        w, counted = learnable[:, i + 1 : i + 1 + n], predicts[:, i + 1 : i + 1 + n]
        ce = F.cross_entropy(logits.flatten(0, 1), target_p[:, i + 1 : i + 1 + n].flatten(0, 1), reduction="none")
        ploss = (ce * w.flatten()).sum() / w.sum().clamp_min(1.0)
        hits = (drafter.to_target_ids(logits.argmax(-1)) == target_top[:, i + 1 : i + 1 + n]) & (counted > 0)
        loss = loss + step_weight**i * ploss
        plosses.append(ploss.item())
        accs.append(hits.sum().item() / max(counted.sum().item(), 1))
    return loss, plosses, accs


@pytest.mark.parametrize(
    ("num_layers", "num_kv_heads", "draft_vocab", "norm_output", "norm_before_residual", "mask"),
    [
        (1, 2, None, False, False, "spans"),
        (1, 1, 40, True, False, "random"),
        (2, 1, None, True, True, "spans"),
        (2, 2, 40, False, False, "random"),
        (1, 1, None, True, False, None),
    ],
)
def test_ttt_loss_equals_the_dense_computation(
    num_layers, num_kv_heads, draft_vocab, norm_output, norm_before_residual, mask
):
    """ttt_loss computes only what its loss reads (the target's distribution once per counted position,
    later drafting steps only where a loss needs them, lm_head and the cross-entropy chunked over the
    counted rows): its loss, per-step losses, accuracies and every gradient equal the plain dense
    computation, for several layers, grouped-query attention, a pruned vocabulary and sparse masks."""
    from lab.drafter import DrafterSpec, Eagle3Drafter

    vocab, hidden, b, t, length = 96, 64, 3, 40, 3
    spec = DrafterSpec(
        hidden_size=hidden, target_hidden_size=hidden, aux_layer_ids=[1, 2, 3], vocab_size=vocab,
        draft_vocab_size=draft_vocab, num_heads=2, num_kv_heads=num_kv_heads, head_dim=32, intermediate_size=96,
        num_layers=num_layers, fc_norm="per_layer", norm_output=norm_output, norm_before_residual=norm_before_residual,
    )  # fmt: skip
    torch.manual_seed(0)
    drafters = []
    for _ in range(2):
        d = Eagle3Drafter(spec)
        if drafters:
            d.load_state_dict(drafters[0].state_dict())
        else:
            perturb(d, draft_vocab)
        drafters.append(d)
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, vocab, (b, t), generator=g)
    aux = torch.randn(b, t, 3 * hidden, generator=g) * 3
    final = torch.randn(b, t, hidden, generator=g)
    lm_head = torch.randn(vocab, hidden, generator=g) * 0.3
    if mask == "random":
        loss_mask = (torch.rand(b, t, generator=g) < 0.3).to(torch.uint8)
    elif mask == "spans":  # the assistant's turns: runs of tokens, one sequence without any
        loss_mask = torch.zeros(b, t, dtype=torch.uint8)
        loss_mask[0, 5:12] = loss_mask[0, 30:38] = loss_mask[1, 20:] = 1
    else:
        loss_mask = None
    sparse = ttt_loss(drafters[0], input_ids, aux, final, lm_head, length, 0.8, loss_mask)
    loss, plosses, accs = _dense_ttt_loss(drafters[1], input_ids, aux, final, lm_head, length, 0.8, loss_mask)
    torch.testing.assert_close(sparse.loss, loss, rtol=1e-5, atol=1e-6)
    assert sparse.plosses == pytest.approx(plosses, rel=1e-5, abs=1e-6)
    assert sparse.accs == pytest.approx(accs, abs=1e-9)
    sparse.loss.backward()
    loss.backward()
    for (name, p), q in zip(drafters[0].named_parameters(), drafters[1].parameters(), strict=True):
        if p.requires_grad:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=f"gradient of {name}")


def test_ttt_attention_over_rows_equals_the_dense_attention():
    """The TTT attention over each step's rows (CPU's fused causal kernel over rows padded per sequence,
    the diagonal joined through the log-sum-exp, the backward written out) equals `TTTCache.attend`'s
    plain dense attention, values and gradients, with grouped-query heads."""
    from lab.drafter.model import TTTCache
    from lab.drafter.unroll import RowCache

    torch.manual_seed(0)
    b, t, heads, kv_heads, d = 2, 12, 4, 2, 8
    rows = [None, torch.tensor([1, 3, 4, 7, 11, 12, 15, 20, 23]), torch.tensor([3, 7, 12, 20, 23])]
    sizes = [b * t if r is None else len(r) for r in rows]
    qs = [torch.randn(n, heads, d, requires_grad=True) for n in sizes]
    ks = [torch.randn(n, kv_heads, d, requires_grad=True) for n in sizes]
    vs = [torch.randn(n, kv_heads, d, requires_grad=True) for n in sizes]
    sparse, dense = RowCache(1, b, t), TTTCache(1)
    outs, expected = [], []
    for step, r in enumerate(rows):
        sparse.rows = r
        sparse.row_sets.append(r)
        outs.append(sparse.attend(0, qs[step], ks[step], vs[step]))

        def full(x, r=r):  # the rows as dense [B, heads, T, d], zeros elsewhere
            if r is not None:
                x = x.new_zeros(b * t, *x.shape[1:]).index_copy(0, r, x)
            return x.view(b, t, *x.shape[1:]).transpose(1, 2)

        out = dense.attend(0, full(qs[step]), full(ks[step]), full(vs[step])).transpose(1, 2).reshape(b * t, -1)
        expected.append(out if r is None else out[r])
    for got, want in zip(outs, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    weights = [torch.randn_like(o) for o in outs]
    inputs = [*qs, *ks, *vs]
    got = torch.autograd.grad(sum((o * w).sum() for o, w in zip(outs, weights, strict=True)), inputs)
    want = torch.autograd.grad(sum((o * w).sum() for o, w in zip(expected, weights, strict=True)), inputs)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_rms_norm_function_equals_the_module():
    """The unroll's RMSNorm with its backward written out equals the RMSNorm module and its autograd."""
    from lab.drafter.model import RMSNorm
    from lab.drafter.unroll import rms_norm

    torch.manual_seed(0)
    norm = RMSNorm(16)
    with torch.no_grad():
        norm.weight.add_(torch.randn(16) * 0.3)
    x = (torch.randn(5, 7, 16) * 3).requires_grad_()
    w = torch.randn(5, 7, 16)
    got = rms_norm(norm, x)
    grads = torch.autograd.grad((got * w).sum(), [x, norm.weight])
    want = norm(x)
    expected = torch.autograd.grad((want * w).sum(), [x, norm.weight])
    torch.testing.assert_close(got, want)
    for g, e in zip(grads, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_lm_head_gemms_run_in_the_autocast_dtype():
    """Under autocast every matmul of the chunked cross-entropy (lm_head, and its gradients formed in the
    forward) runs in the narrow dtype: `mm(out=)` and `addmm_` bypass autocast, and on CUDA would run lm_head's
    gradients as float32 GEMMs without tensor cores."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lab.train.loss import _SoftLabelCrossEntropy

    class MatmulDtypes(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: set[tuple[str, torch.dtype]] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
                self.seen.add((func.overloadpacket.__name__, args[1].dtype))
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(0)
    n, hidden, vocab = 300, 16, 50
    x = torch.randn(n, hidden, generator=g, requires_grad=True)
    weight = torch.randn(vocab, hidden, generator=g, requires_grad=True)
    labels = torch.softmax(torch.randn(n, vocab, generator=g), -1)
    slots, row_weight = torch.arange(n), torch.full((n,), 1.0 / n)
    with torch.autocast("cpu", dtype=torch.bfloat16), MatmulDtypes() as mode:
        _SoftLabelCrossEntropy.apply(x, weight, labels, slots, row_weight, 128)[0].backward()
    assert mode.seen and {dtype for _, dtype in mode.seen} == {torch.bfloat16}, mode.seen
    assert x.grad.dtype == torch.float32 and weight.grad.dtype == torch.float32


@pytest.mark.parametrize(
    ("spec", "b", "t", "length"),
    [
        ({}, 2, 24, 3),
        ({"num_kv_heads": 1}, 3, 17, 2),
        ({"num_layers": 2}, 2, 24, 3),
        ({"draft_vocab_size": 50}, 2, 16, 4),
    ],
)
def test_the_flop_formula_equals_torchs_counter(spec, b, t, length, monkeypatch):
    """`ttt_step_flops` (what MFU divides by where the counter refuses grouped-query SDPA) equals torch's
    FlopCounterMode over one TTT step and its backward with the portable attention kernel, exactly, once the
    counter's two blind spots on a CPU are taken out of the formula: step 0's attention (CPU's flash SDPA, which the
    counter has no formula for) and lm_head's weight gradient (an in-place `addmm_`, which it does not count)."""
    from helpers import small_drafter
    from torch.utils.flop_counter import FlopCounterMode

    from lab.drafter import ttt_attention
    from lab.train.flops import ttt_step_flops

    drafter = small_drafter(**spec).train()
    if "draft_vocab_size" in spec:
        perturb(drafter, spec["draft_vocab_size"])  # a random draft vocabulary: some positions learn nothing
    s, g = drafter.spec, torch.Generator().manual_seed(0)
    ids = torch.randint(0, s.vocab_size, (b, t), generator=g)
    aux = torch.randn(b, t, s.num_aux * s.target_hidden_size, generator=g)
    final, lm_head = (
        torch.randn(b, t, s.hidden_size, generator=g),
        torch.randn(s.vocab_size, s.hidden_size, generator=g),
    )
    monkeypatch.setattr(ttt_attention, "kernel_for", lambda device: ttt_attention.PORTABLE)
    with FlopCounterMode(display=False) as counter:
        ttt_loss(drafter, ids, aux, final, lm_head, length, 0.8).loss.backward()
    in_draft = torch.zeros(s.vocab_size, dtype=torch.bool)
    in_draft[drafter.draft_token_ids()] = True
    learnable = in_draft[(final @ lm_head.T).argmax(-1)]
    learned = sum(int(learnable[:, i + 1 :].sum()) for i in range(length))
    unseen = s.num_layers * 14 * b * t * s.num_heads * s.head_dim * t + 2 * learned * s.hidden_size * s.draft_vocab_size
    assert ttt_step_flops(s, learnable, length) - unseen == counter.get_total_flops()
