"""Drafter training speed: the native backend against TorchSpec's model code (`train.backend=torchspec`),
on the same shapes, the same batches and the same machine, measured side by side.

Both run the full training step of our loop (TTT forward over `train.ttt_length` steps, loss,
backward, gradient clipping, AdamW) on batches shaped like the configured training data (the drafter
shaped after the configured target: width, heads, MLP, vocabulary, captured layers). The values are
random (speed does not depend on them), and the loss covers a share of the positions as the
assistant's tokens do in chat data (`--loss-share`). TorchSpec compiles its loss on first use, so both backends warm
up first; then the backends alternate in rounds, so that machine noise hits both alike, and the ratio
is reported per round and as the median.

    .venv/bin/python benchmarks/torchspec_speed.py [--rounds 5] [--steps 10] [hydra overrides...]

Needs TorchSpec (see docs/torchspec.md); without it, it prints how to install it and exits 2.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time

import torch

from lab.config import ConfigError, aux_layers, compose
from lab.drafter import Eagle3Drafter, drafter_spec
from lab.pipeline import set_threads
from lab.train.torchspec_config import target_model_config
from lab.train.ttt import ttt_loss


def drafter_for(cfg) -> Eagle3Drafter:
    """The configured arm's drafter, shaped after the configured target without loading its weights."""
    model_config, _ = target_model_config(cfg)
    torch.manual_seed(cfg.seed)
    return Eagle3Drafter(drafter_spec(model_config, cfg.drafter, aux_layers(cfg)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    parser.add_argument("--steps", type=int, default=10, help="training steps per backend per round (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per backend first (default 3)")
    parser.add_argument(
        "--loss-share",
        type=float,
        default=0.34,
        help="share of positions the loss covers (the assistant's tokens: 0.34 in data=micro's conversations); "
        "both backends skip the others before lm_head (default 0.34)",
    )
    args, overrides = parser.parse_known_args()
    try:
        cfg = compose([*overrides, "train.backend=torchspec"])
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    set_threads(cfg)
    from lab.train.torchspec import TorchSpecTTT

    t = cfg.train
    b, seq = t.batch_size, cfg.data.seq_len
    spec = drafter_for(cfg).spec
    hidden, vocab = spec.hidden_size, spec.vocab_size
    width = spec.num_aux * spec.target_hidden_size
    g = torch.Generator().manual_seed(0)
    batches = [
        (
            torch.randint(0, vocab, (b, seq), generator=g),
            torch.randn(b, seq, width, generator=g) * 4,
            torch.randn(b, seq, hidden, generator=g),
            (torch.rand(b, seq, generator=g) < args.loss_share).to(torch.uint8),
        )
        for _ in range(4)
    ]
    lm_head = torch.randn(vocab, hidden, generator=g) * 0.05

    runners = {}
    for backend in ("native", "torchspec"):
        drafter = drafter_for(cfg)
        loss = (
            functools.partial(ttt_loss, drafter)
            if backend == "native"
            else TorchSpecTTT.for_drafter(drafter, t.ttt_length).loss
        )
        params = [p for p in drafter.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=t.lr, betas=(0.9, 0.95), weight_decay=t.weight_decay)

        def step(i: int, loss=loss, params=params, opt=opt) -> None:
            input_ids, aux, final, mask = batches[i % len(batches)]
            stats = loss(input_ids, aux, final, lm_head, t.ttt_length, t.step_weight, mask)
            opt.zero_grad(set_to_none=True)
            stats.loss.backward()
            torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
            opt.step()

        runners[backend] = step

    print(
        f"drafter {cfg.drafter.fc_norm.value}/norm_output={cfg.drafter.norm_output}, hidden "
        f"{hidden}, vocab {vocab}, batch {b} x {seq} tokens, "
        f"ttt_length {t.ttt_length}, loss on {args.loss_share:.0%} of positions, {torch.get_num_threads()} threads"
    )
    started = time.time()
    for step in runners.values():
        for i in range(args.warmup):
            step(i)
    print(f"warm-up ({args.warmup} steps each, TorchSpec compiles its loss): {time.time() - started:.0f} s")
    tokens = args.steps * b * seq
    rates: dict[str, list[float]] = {name: [] for name in runners}
    for r in range(args.rounds):
        order = list(runners) if r % 2 == 0 else list(reversed(runners))
        for backend in order:
            t0 = time.perf_counter()
            for i in range(args.steps):
                runners[backend](i)
            rates[backend].append(tokens / (time.perf_counter() - t0))
        print(
            f"round {r + 1}: native {rates['native'][-1]:8.0f} tok/s   torchspec {rates['torchspec'][-1]:8.0f} tok/s   "
            f"native/torchspec {rates['native'][-1] / rates['torchspec'][-1]:.2f}"
        )
    native, ts = statistics.median(rates["native"]), statistics.median(rates["torchspec"])
    ratios = [n / s for n, s in zip(rates["native"], rates["torchspec"], strict=True)]
    print(
        f"median: native {native:.0f} tok/s, torchspec {ts:.0f} tok/s; native/torchspec "
        f"{statistics.median(ratios):.2f} (rounds {min(ratios):.2f}-{max(ratios):.2f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
