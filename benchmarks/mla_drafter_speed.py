"""Training tokens/s of an MLA drafter (drafter.attention=mla) beside a GQA drafter of the same hidden size: the
native TTT step (ttt_loss, backward, AdamW) on synthetic captured states, the two arms interleaved round by
round in one process so that both see the same machine; the median over rounds.

    .venv/bin/python benchmarks/mla_drafter_speed.py [--hidden 256] [--heads 4] [--kv-heads 4] [--vocab 4096]
        [--batch 8] [--seq 128] [--ttt 3] [--q-lora 64] [--kv-lora 512] [--nope 32] [--rope 64] [--v 32]
        [--steps 5] [--rounds 3] [--threads N]

The defaults are micro_mla's MLA dims (a 512 + 64 latent vLLM can serve) on a tiny_code-sized drafter.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lab.drafter import DrafterSpec, Eagle3Drafter
from lab.train.loss import ttt_loss


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in [
        ("hidden", 256), ("heads", 4), ("kv-heads", 4), ("vocab", 4096), ("batch", 8), ("seq", 128), ("ttt", 3),
        ("q-lora", 64), ("kv-lora", 512), ("nope", 32), ("rope", 64), ("v", 32), ("steps", 5), ("rounds", 3),
        ("threads", 0),
    ]:  # fmt: skip
        p.add_argument(f"--{name}", type=int, default=default)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    base = dict(
        hidden_size=a.hidden, target_hidden_size=a.hidden, aux_layer_ids=[1, 2, 3], vocab_size=a.vocab,
        num_heads=a.heads, head_dim=a.hidden // a.heads, intermediate_size=3 * a.hidden, fc_norm="per_layer",
        norm_output=True,
    )  # fmt: skip
    arms = {
        "gqa": DrafterSpec(**base, num_kv_heads=a.kv_heads),
        "mla": DrafterSpec(
            **base,
            attention="mla",
            q_lora_rank=a.q_lora,
            kv_lora_rank=a.kv_lora,
            qk_nope_head_dim=a.nope,
            qk_rope_head_dim=a.rope,
            v_head_dim=a.v,
        ),  # fmt: skip
    }
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g)
    aux = torch.randn(a.batch, a.seq, 3 * a.hidden, generator=g)
    final = torch.randn(a.batch, a.seq, a.hidden, generator=g)
    lm_head = torch.randn(a.vocab, a.hidden, generator=g) * 0.05
    mask = torch.ones(a.batch, a.seq, dtype=torch.uint8)
    mask[:, : a.seq // 4] = 0  # the prompt: no loss there, as on chat data
    drafters, opts, times = {}, {}, {k: [] for k in arms}
    for name, spec in arms.items():
        torch.manual_seed(0)
        drafters[name] = Eagle3Drafter(spec).train()
        opts[name] = torch.optim.AdamW([q for q in drafters[name].parameters() if q.requires_grad], lr=1e-3)

    def step(name: str) -> None:
        opts[name].zero_grad(set_to_none=True)
        ttt_loss(drafters[name], ids, aux, final, lm_head, a.ttt, 0.8, mask).loss.backward()
        opts[name].step()

    for name in arms:  # warm-up
        step(name)
    for _ in range(a.rounds):
        for name in arms:
            start = time.perf_counter()
            for _ in range(a.steps):
                step(name)
            times[name].append((time.perf_counter() - start) / a.steps)
    tokens = a.batch * a.seq
    print(f"hidden {a.hidden}, {a.heads} heads, batch {a.batch} x seq {a.seq}, TTT {a.ttt}, vocab {a.vocab}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")  # fmt: skip
    print("| drafter | attention params | params (trainable) | ms/step | tokens/s |")
    print("|---|---|---|---|---|")
    for name, d in drafters.items():
        attn = sum(q.numel() for q in d.layers[0].self_attn.parameters())
        params = sum(q.numel() for q in d.parameters() if q.requires_grad)
        dims = f"kv {a.kv_heads} x {a.hidden // a.heads}" if name == "gqa" else (
            f"q {a.q_lora}, latent {a.kv_lora}+{a.rope}, nope {a.nope}, v {a.v}"
        )  # fmt: skip
        ms = statistics.median(times[name]) * 1000
        print(f"| {name} ({dims}) | {attn / 1e6:.2f} M | {params / 1e6:.2f} M | {ms:.0f} | {tokens / ms * 1000:,.0f} |")


if __name__ == "__main__":
    main()
