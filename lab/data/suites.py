"""Evaluation suites: fixed, seeded prompt sets, the same for every arm."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from lab.data.text import streams, windows

SUITE_SEED = 4321


@dataclass
class Suite:
    name: str
    prompts: list[list[int]]  # token ids
    max_new_tokens: int

    def describe(self) -> dict:
        return {
            "name": self.name,
            "num_prompts": len(self.prompts),
            "prompt_lens": sorted({len(p) for p in self.prompts}),
        }


def in_dist(tokenizer, cfg: DictConfig) -> Suite:
    """Held-out library source at the prompt length: the training distribution, unseen text."""
    s = streams(tokenizer, cfg.data.corpus_bytes)
    prompts = windows(s.heldout, cfg.eval.prompt_len, cfg.eval.num_prompts, "eval.num_prompts", seed=SUITE_SEED)
    return Suite("in_dist", prompts.tolist(), cfg.eval.max_new_tokens)


SUITES = {"in_dist": in_dist}


def load_suite(name: str, tokenizer, cfg: DictConfig) -> Suite:
    return SUITES[name](tokenizer, cfg)
