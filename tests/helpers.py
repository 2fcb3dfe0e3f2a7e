"""Small hand-built drafters and random targets for unit tests (nothing to build or download)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from lab.drafter import DrafterSpec, Eagle3Drafter

# Every model a test trains (the session's targets and drafters, and any test's own training) trains under this one
# thread count, whatever ran before it in the process: a trained model's weights depend on the thread count (the
# order of a reduction's sums), a test's verdict must not. LAB_TEST_THREADS runs the suite at another count, to show
# that the verdicts hold there too (docs/testing.md).
TEST_THREADS = int(os.environ.get("LAB_TEST_THREADS", "2"))
# a line of the `lab` log (lab/logs.py): `2026-12-02 02:41:07 INFO    [worker 1] lab.pipeline: message`
LOG_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d [A-Z]+ +(?:\[worker [^]]+\] )?lab[\w.]*: (.*)")


def logged(err: str) -> list[str]:
    """The messages of the `lab` log lines in `err` (a captured stderr), without their time, level, worker and
    logger."""
    return [m.group(1) for line in err.splitlines() if (m := LOG_LINE.match(line))]


def traced_steps(monkeypatch) -> list:
    """The graphs dynamo traces of the static KV cache's step (lab/target/static_decode.py `compile_step`), each run
    as traced: traced whole (`fullgraph`, as on CUDA) on the CPU, counted, and no step compiled before kept."""
    import weakref

    from lab.target import static_decode

    graphs: list = []

    def counting(gm, example_inputs):  # noqa: ANN001, ANN202 - a dynamo backend that runs the graph as traced
        graphs.append(gm)
        return gm.forward

    def compile_step(step, device, dynamic):  # noqa: ANN001, ANN202
        return torch.compile(step, backend=counting, fullgraph=True, dynamic=dynamic)

    monkeypatch.setattr(static_decode, "compile_step", compile_step)
    monkeypatch.setattr(static_decode, "_STEPPERS", weakref.WeakKeyDictionary())
    return graphs


def unlogged(err: str) -> list[str]:
    """The lines of `err` (a captured stderr) other than the `lab` log's INFO and DEBUG records: a refusal found
    after the work began comes after the log's account of that work."""
    return [line for line in err.strip().splitlines() if not re.match(r"\S+ \S+ (INFO|DEBUG) ", line)]


@contextmanager
def stated_threads(n: int = TEST_THREADS) -> Iterator[None]:
    """torch's intra-op threads set to `n` inside the block, and set back after it."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def small_drafter(seed: int = 0, **spec) -> Eagle3Drafter:
    """A 64-wide drafter over a 100-token vocabulary and three 64-wide captured layers."""
    torch.manual_seed(seed)
    base = dict(
        hidden_size=64,
        target_hidden_size=64,
        aux_layer_ids=[1, 2, 3],
        vocab_size=100,
        num_heads=2,
        head_dim=32,
        intermediate_size=96,
    )
    return Eagle3Drafter(DrafterSpec(**{**base, **spec})).eval()


@torch.no_grad()
def perturb(drafter: Eagle3Drafter, draft_vocab: int | None = None) -> Eagle3Drafter:
    """Norms away from 1 and weights away from their init (so that a missing or misplaced norm shows), and
    with `draft_vocab` a random pruned vocabulary; draws from torch's global generator."""
    for name, p in drafter.named_parameters():
        p.add_(torch.randn_like(p) * (0.3 if "norm" in name else 0.05))
    if draft_vocab:
        ids = torch.randperm(drafter.spec.vocab_size)[:draft_vocab].sort().values
        drafter.d2t.copy_(ids - torch.arange(draft_vocab))
    return drafter


def small_target(seed: int = 0):
    """A random 4-layer, 64-wide Llama over the same 100-token vocabulary (transformers' LlamaForCausalLM)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


# a fake vLLM package (tests/fake_vllm/vllm) for a worker process's PYTHONPATH or this process's sys.path
FAKE_VLLM = Path(__file__).resolve().parent / "fake_vllm"
HOLD_DIR = Path(__file__).resolve().parent / "hold"  # its sitecustomize.py holds training where a test says


def hold_training(env: dict[str, str], step: int, flag: Path, call: int = 1) -> dict[str, str]:
    """`env` for a `lab` process (and the processes it starts) whose `call`-th training in a process stops after
    `step`, creates `flag` and waits for Ctrl-C (tests/hold/sitecustomize.py): the test interrupts it at a point
    it controls."""
    path = os.pathsep.join(p for p in (str(HOLD_DIR), env.get("PYTHONPATH", "")) if p)
    return {**env, "PYTHONPATH": path, "LAB_HOLD_AFTER_STEP": f"{call}:{step}:{flag}"}


def wait_held(proc: subprocess.Popen, flag: Path, log: Path, timeout: float = 600) -> None:
    """Until the training `hold_training` holds creates `flag`; fails with the end of `log` if `proc` ends first or
    `timeout` seconds pass."""
    deadline = time.time() + timeout
    while not flag.exists():
        assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)


def default_sigint() -> None:
    """Popen's preexec_fn for a child the test interrupts: Ctrl-C's default disposition, even where the suite
    itself runs with SIGINT ignored (a script's background job), which the child would otherwise inherit."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def evaluate_suite(target_model, drafter: Eagle3Drafter, suite, ks: list[int], progress=True, **options) -> dict:
    """A suite's evaluation metrics alone (`evaluate_suite_prompts(...).metrics`); `options` are `EvalOptions`'."""
    from lab.eval.evaluate import EvalOptions, evaluate_suite_prompts

    return evaluate_suite_prompts(target_model, drafter, suite, EvalOptions(ks, **options), progress=progress).metrics


def rollout_accuracy(drafter: Eagle3Drafter, input_ids, aux, target_top, depth: int, loss_mask=None) -> list[float]:
    """Teacher-forced top-1 agreement per unrolled depth, pooled over the batch (as `heldout_evaluation` logs it)."""
    from lab.eval.probes import pooled_rollout_accuracy, rollout_counts

    return pooled_rollout_accuracy(*rollout_counts(drafter, input_ids, aux, target_top, depth, loss_mask))


def assert_decoding_equals_unroll(d: Eagle3Drafter, num_layers: int) -> None:
    """Drafting step by step with the KVCache sees exactly what training's TTT unroll sees (causal step 0,
    then each position's own earlier steps), at a few positions of one random sequence."""
    from lab.drafter import KVCache
    from lab.drafter.unroll import unroll

    t, length = 10, 3
    tokens = torch.randint(0, 100, (1, t))
    aux = torch.randn(1, t, 192) * 3
    with torch.no_grad():
        outs = unroll(d, tokens, aux, length)
        for pos in (0, 4, t - length):
            cache = KVCache(num_layers)
            ctx = d(tokens[:, : pos + 1], d.project(aux[:, : pos + 1]), torch.arange(pos + 1)[None], cache)
            torch.testing.assert_close(ctx[:, pos], outs[0][:, pos], atol=1e-5, rtol=1e-4)
            h = ctx[:, pos : pos + 1]
            for step in range(1, length):
                h = d(tokens[:, pos + step : pos + step + 1], d.feedback(h), torch.tensor([[pos + step]]), cache)
                torch.testing.assert_close(h[:, 0], outs[step][:, pos], atol=1e-5, rtol=1e-4)


# the structured MLA pair (`structured_mla_pair`): vocabulary = width, so that every token's embedding is one
# orthonormal direction; MLA dims vLLM's MLA serves (latent 512 + 64), a 96-wide query-key head
STRUCTURED_VOCAB = 128
STRUCTURED_MLA = dict(q_lora_rank=32, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32)


@torch.no_grad()
def structured_mla_pair(folder: Path, miss_share: float = 0.3, seed: int = 0):
    """A DeepSeek-V3-shaped target (MLA, routed and shared experts, the first layer dense) whose greedy
    continuation of any token x is x + 1 (mod the vocabulary), saved to `folder` (config.json + safetensors, no
    tokenizer: vLLM's worker takes token ids), and an MLA drafter (vLLM's Eagle3DeepseekV2) that drafts the same
    map for most tokens and misses a seeded `miss_share` of them. Returns (target model, drafter, missed tokens).

    The target: every layer's output projections (attention o_proj, MLP and experts' down_proj) are zero, so
    the residual stream is the embedding E[x] at every layer (E's rows orthonormal) and lm_head row x + 1 is E[x]:
    the argmax is x + 1 by a margin of sqrt(width) against 0.
    The drafter: fc takes the first captured layer (E[x]); its MLP, one unit per token, adds E[m(y)] - E[y] to
    the residual E[y], where m(y) = y + 1, or y + 2 for a missed y; its lm_head is the target's. So drafting
    step j after the verified context ...x predicts x + 2 + j as long as none of x .. x + j is missed: whether a
    draft is accepted depends on where the round starts, and the acceptance at every position lies strictly
    between 0 and 1. Its MLA attention (random, o_proj small) adds a small term that never decides a token."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    v = h = STRUCTURED_VOCAB
    config = DeepseekV3Config(
        vocab_size=v, hidden_size=h, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, n_group=1, topk_group=1, max_position_embeddings=2048, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rms_norm_eps=1e-6, num_mtp_layers=0,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, **STRUCTURED_MLA,
    )  # fmt: skip
    config.architectures = ["DeepseekV3ForCausalLM"]
    config.topk_method, config.scoring_func, config.num_nextn_predict_layers = "noaux_tc", "sigmoid", 0
    target = DeepseekV3ForCausalLM(config).eval()
    for name, p in target.named_parameters():
        if "o_proj" in name or "down_proj" in name:
            p.zero_()
    emb = torch.linalg.qr(torch.randn(h, h))[0][:v]  # orthonormal rows
    target.get_input_embeddings().weight.copy_(emb)
    target.get_output_embeddings().weight.copy_(emb[torch.roll(torch.arange(v), 1)])  # row x + 1 is E[x]
    target.save_pretrained(folder)

    missed = torch.rand(v, generator=torch.Generator().manual_seed(seed + 1)) < miss_share
    step = torch.where(missed, 2, 1)
    spec = DrafterSpec(
        hidden_size=h, target_hidden_size=h, aux_layer_ids=[1, 2, 3], vocab_size=v, num_heads=2, head_dim=96,
        intermediate_size=v, rms_norm_eps=1e-6, attention="mla", **STRUCTURED_MLA,
    )  # fmt: skip
    drafter = Eagle3Drafter(spec).eval()
    drafter.embed_tokens.weight.copy_(emb)
    drafter.fc.weight.zero_()
    drafter.fc.weight[:, :h].copy_(torch.eye(h))
    attn = drafter.layers[0].self_attn
    attn.o_proj.weight.normal_(std=1e-3)
    mlp, gain = drafter.layers[0].mlp, 8.0
    # post_attention_layernorm turns E[y] into sqrt(h) E[y]: unit y's gate is `gain`, its up 1, every other 0
    mlp.gate_proj.weight.copy_(emb * gain / h**0.5)
    mlp.up_proj.weight.copy_(emb / h**0.5)
    mapped = emb[(torch.arange(v) + step) % v]
    mlp.down_proj.weight.copy_(((mapped - emb) / torch.nn.functional.silu(torch.tensor(gain))).T)
    drafter.lm_head.weight.copy_(target.get_output_embeddings().weight)
    return target, drafter, missed
