"""Conversations rendered by the target tokenizer's own chat template (`tokenizer.apply_chat_template`).

The assistant's tokens (the drafter's loss mask) are found the way speculators and SpecForge find them:
by rendering prefixes. For the assistant message i, `P` = the messages before it with the generation
prompt, `Q` = the messages up to and including it; the assistant's span is the text `Q[len(P):]` (its
content and the template's end-of-turn markers, which the drafter must predict too). This holds only if the
template is prefix-stable (every rendering of a prefix is a prefix of the whole); a template that is not
(one that rewrites earlier turns, or has no assistant turn) is refused, never silently mis-masked.
"""

from __future__ import annotations

from typing import Any

from lab.config import ConfigError

Message = dict[str, str]  # {"role": "system" | "user" | "assistant", "content": str}
ROLES = ("system", "user", "assistant")


class TemplateError(ConfigError):
    """The tokenizer's chat template cannot render masks for this conversation."""

    def __init__(self, message: str):
        super().__init__("data.template", message)


class TokenizerChat:
    """(token ids, assistant mask) of conversations in the tokenizer's own template."""

    def __init__(self, tokenizer: Any):
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError("the target's tokenizer has no chat template; choose one of lab's (e.g. chatml)")
        self.tokenizer = tokenizer

    def text(self, messages: list[Message], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def prompt(self, messages: list[Message]) -> list[int]:
        """The ids of `messages` followed by the opening of the assistant's turn: what a generator continues."""
        return self.encode(self.text(messages, add_generation_prompt=True))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def render(self, messages: list[Message]) -> tuple[list[int], list[int]]:
        """ids and mask (1 on each assistant message's tokens and its end-of-turn markers)."""
        full = self.text(messages)
        spans = [self._assistant_span(messages, i, full) for i, m in enumerate(messages) if m["role"] == "assistant"]
        enc = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        mask = [int(any(a <= start < b for a, b in spans)) for start, _ in enc["offset_mapping"]]
        return list(enc["input_ids"]), mask

    def _assistant_span(self, messages: list[Message], i: int, full: str) -> tuple[int, int]:
        before = self.text(messages[:i], add_generation_prompt=True)
        upto = self.text(messages[: i + 1])
        if before == self.text(messages[:i]):
            raise TemplateError("the tokenizer's chat template adds no assistant turn (add_generation_prompt)")
        if not upto.startswith(before) or not full.startswith(upto):
            raise TemplateError(
                f"the tokenizer's chat template is not prefix-stable at message {i} (rendering the conversation "
                "up to a turn is not a prefix of rendering it whole), so the assistant's tokens cannot be masked"
            )
        if messages[i]["content"].strip() and messages[i]["content"].strip() not in upto[len(before) :]:
            raise TemplateError(f"the tokenizer's chat template drops the content of assistant message {i}")
        return len(before), len(upto)


def check_messages(messages: list[Any], where: str, key: str) -> list[Message]:
    """`messages` as a list of {"role", "content"} with known roles, else a ConfigError naming `where`."""
    if not isinstance(messages, list) or not messages:
        raise ConfigError(key, f"{where}: expected a non-empty list of messages")
    out = []
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ConfigError(
                key, f'{where}: expected messages like {{"role": one of {", ".join(ROLES)}, "content": text}}'
            )
        out.append({"role": m["role"], "content": m["content"]})
    return out


class HandChat:
    """The same interface over one of lab's own templates (lab/target/chat.py): for targets without a chat
    template of their own (the tiny ones) and for the template-perturbation suite."""

    def __init__(self, tokenizer: Any, template: str, bos: bool = True):
        from lab.target.chat import TEMPLATES, Renderer

        self.renderer = Renderer(tokenizer, bos=bos)
        self.template = TEMPLATES[template]

    def encode(self, text: str) -> list[int]:
        return self.renderer.encode(text)

    def prompt(self, messages: list[Message]) -> list[int]:
        return self.renderer.render_turns(self.template, [(m["role"], m["content"], []) for m in messages])[0]

    def render(self, messages: list[Message]) -> tuple[list[int], list[int]]:
        turns = [
            (m["role"], "", self.renderer.encode(m["content"]))
            if m["role"] == "assistant"
            else (m["role"], m["content"], [])
            for m in messages
        ]
        return self.renderer.render_turns(self.template, turns, open_assistant=False)


def chat_format(tokenizer: Any, template: str) -> TokenizerChat | HandChat:
    """`target` (data.template): the tokenizer's own template; otherwise the lab template of that name."""
    return TokenizerChat(tokenizer) if template == "target" else HandChat(tokenizer, template)
