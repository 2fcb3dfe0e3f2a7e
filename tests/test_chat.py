"""Chat templates render the same way everywhere; the drafter's data uses one template and masks the
assistant's tokens; every suite is fixed, seeded and varies only what it claims to."""

from __future__ import annotations

import json

import pytest

from lab.config import ConfigError
from lab.config.composition import compose
from lab.data.suites import EVAL_SYSTEM_PROMPTS, build_suite
from lab.target import chat


@pytest.fixture(scope="module")
def renderer(micro_target):
    return chat.Renderer(micro_target.tokenizer)


@pytest.mark.parametrize("name", list(chat.TEMPLATES))
def test_mask_covers_exactly_the_assistant_turn(renderer, name):
    tok = renderer.tokenizer
    answer = renderer.encode("    return x\n")
    conv = chat.Conversation("Be brief.", "Continue:", renderer.encode("def f(x):\n"), answer)
    ids, mask = renderer.render(chat.TEMPLATES[name], conv)
    assert len(ids) == len(mask) and ids[0] == tok.bos_token_id
    masked = [i for i, m in zip(ids, mask, strict=True) if m]
    closing = renderer.encode(chat.TEMPLATES[name].parts("assistant")[1])
    assert masked == answer + closing
    prompt, prompt_mask = renderer.render(
        chat.TEMPLATES[name], chat.Conversation("Be brief.", "Continue:", conv.user_ids, None)
    )
    assert ids[: len(prompt)] == prompt and not any(prompt_mask)  # the prompt is the conversation's prefix
    assert "Be brief." in tok.decode(prompt)  # templates without a system role carry it in the user turn


def test_templates_differ(renderer):
    conv = chat.Conversation(None, "Continue:", renderer.encode("x = 1\n"), None)
    rendered = {tuple(renderer.render(t, conv)[0]) for t in chat.TEMPLATES.values()}
    assert len(rendered) == len(chat.TEMPLATES) >= 4


def test_drafter_data_uses_one_template_and_masks_the_assistant(micro_target, micro_sequences):
    train, heldout = micro_sequences
    tok = micro_target.tokenizer
    texts = [tok.decode(row) for row in train.input_ids[:50]]
    assert all("<|im_start|>assistant" in t for t in texts)
    others = ["<start_of_turn>", "### User:", "[INST]", "<|user|>", "USER:", "<|start_header_id|>", "**User:**"]
    assert not any(marker in t for t in texts for marker in others)
    first_assistant = train.loss_mask.float().argmax(1)
    assert (train.loss_mask.sum(1) >= 16).all() and (first_assistant > 5).all()  # prompt tokens are context


def test_suites_are_seeded_and_share_their_excerpts(micro_cfg, micro_target):
    tok = micro_target.tokenizer
    cfg = compose([*_overrides(micro_cfg), "eval.suites=[in_dist,template,system_prompt,long_context]"])
    in_dist = build_suite("in_dist", tok, cfg)
    assert in_dist.prompts == build_suite("in_dist", tok, cfg).prompts  # fixed
    template = build_suite("template", tok, cfg)
    assert sorted(set(template.variants)) == sorted(t for t in chat.CORPUS_TEMPLATES if t != "chatml")
    n = cfg.suites.template.num_prompts
    renderer = chat.Renderer(tok)
    chatml = chat.TEMPLATES["chatml"]
    closing = len(renderer.encode(chatml.parts("user")[1])) + len(renderer.encode(chatml.parts("assistant")[0]))
    code_tails = [p[-closing - 6 : -closing] for p in in_dist.prompts[:n]]
    assert all("<|im_start|>" not in t for t in template.texts)
    # the same excerpts, in another template: the code of prompt i appears in each variant's prompt i
    for variant in set(template.variants):
        variant_prompts = [p for p, v in zip(template.prompts, template.variants, strict=True) if v == variant]
        for tail, prompt in zip(code_tails, variant_prompts, strict=True):
            assert any(prompt[i : i + 6] == tail for i in range(len(prompt))), variant
    system = build_suite("system_prompt", tok, cfg)
    assert len(set(system.variants)) == len(EVAL_SYSTEM_PROMPTS)
    assert all(any(p in t for p in EVAL_SYSTEM_PROMPTS) for t in system.texts)
    long = build_suite("long_context", tok, cfg)
    for prompt, variant in zip(long.prompts, long.variants, strict=True):
        total = int(variant[1:])  # L{total}: k x the training length, plus or minus the request's length
        assert total in [m * cfg.data.seq_len for m in cfg.suites.long_context.context_multiples]
        assert abs(len(prompt) - total) <= 0.15 * total


def test_jsonl_suite_reads_prompts_and_conversations(micro_cfg, micro_target, tmp_path):
    path = tmp_path / "bench.jsonl"
    rows = [
        {"prompt": "def add(a, b):\n", "category": "code"},
        {
            "messages": [
                {"role": "system", "content": "Be terse."},
                {"role": "user", "content": "Sort a list."},
                {"role": "assistant", "content": "sorted(xs)"},
            ],
            "category": "chat",
        },
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = compose([*_overrides(micro_cfg), "eval.suites=[jsonl]", f"suites.jsonl.path={path}"])
    suite = build_suite("jsonl", micro_target.tokenizer, cfg)
    assert suite.variants == ["code", "chat"]
    assert suite.texts[0].endswith("def add(a, b):\n")
    assert suite.texts[1].endswith("<|im_start|>assistant\n") and "sorted(xs)" not in suite.texts[1]
    path.write_text('{"prompt": "ok"}\n{"nope": 1}\n')
    with pytest.raises(ConfigError, match=r"bench.jsonl:2: expected an object with either 'prompt' or 'messages'"):
        build_suite("jsonl", micro_target.tokenizer, cfg)


def _overrides(cfg) -> list[str]:
    return ["profile=micro", f"cache_dir={cfg.cache_dir}"]
