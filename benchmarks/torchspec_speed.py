"""Drafter training speed: the native backend against TorchSpec's model code (`train.backend=torchspec`),
on the same shapes, batches, precision (float32) and machine, side by side.

Both run our loop's full training step (TTT forward, loss, backward, clipping, AdamW) on random batches shaped
like the configured data, with the loss over a scattered share of positions (`--loss-share`: the native backend
skips positions no loss reads, and scattered ones leave it the least to skip). After a warm-up (TorchSpec
compiles its loss on first use) the backends alternate in rounds so that machine noise hits both alike; the
ratio is per round and the median, by wall clock and per CPU second. Then each backend trains in a fresh
process for the peak resident memory of one step (VmHWM, reset after warm-up through /proc/self/clear_refs).

    .venv/bin/python benchmarks/torchspec_speed.py [--shape tiny|smollm2|smollm2-full|config]
        [--rounds 5] [--steps 10] [--no-memory] [hydra overrides...]

`--shape` (default `tiny`): `tiny` is `target=tiny_code data=code`, `smollm2` is `target=smollm2 data=sharegpt`
(the pruned draft vocabulary of 16,384), `smollm2-full` adds `drafter.draft_vocab_size=null`, `config` takes the
overrides alone. Overrides apply on top of the shape, e.g. `threads=1`, or `attention=mla drafter.q_lora_rank=64`
for an MLA drafter (TorchSpec's `Eagle3DeepseekV2ForCausalLM`).

Needs TorchSpec (see docs/torchspec.md); without it, it prints how to install it and exits 2.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import statistics
import subprocess
import sys
import time

import torch

from lab.config import ConfigError
from lab.config.composition import compose
from lab.config.shape import aux_layers
from lab.drafter import Eagle3Drafter, drafter_spec
from lab.pipeline import set_threads
from lab.train.loss import ttt_loss
from lab.train.torchspec_config import target_model_config
from lab.train.ttt import optimizer

SHAPES = {
    "tiny": ["target=tiny_code", "data=code"],
    "smollm2": ["target=smollm2", "data=sharegpt"],
    "smollm2-full": ["target=smollm2", "data=sharegpt", "drafter.draft_vocab_size=null"],
    "config": [],
}
BACKENDS = ("native", "torchspec")


def drafter_for(cfg) -> Eagle3Drafter:
    """The configured arm's drafter, shaped after the configured target without loading its weights."""
    model_config, _ = target_model_config(cfg)
    torch.manual_seed(cfg.seed)
    return Eagle3Drafter(drafter_spec(model_config, cfg.drafter, aux_layers(cfg)))


def shape_overrides(shape: str, overrides: list[str]) -> list[str]:
    """The shape's overrides, less those whose key the user's overrides set, then the user's."""
    keys = {o.lstrip("+~").split("=", 1)[0] for o in overrides}
    return [o for o in SHAPES[shape] if o.split("=", 1)[0] not in keys] + overrides


def make_batches(cfg, loss_share: float, n: int = 4) -> tuple[list[tuple], torch.Tensor]:
    spec = drafter_for(cfg).spec
    b, seq = cfg.train.batch_size, cfg.data.seq_len
    width = spec.num_aux * spec.target_hidden_size
    g = torch.Generator().manual_seed(0)
    batches = [
        (
            torch.randint(0, spec.vocab_size, (b, seq), generator=g),
            torch.randn(b, seq, width, generator=g) * 4,
            torch.randn(b, seq, spec.hidden_size, generator=g),
            (torch.rand(b, seq, generator=g) < loss_share).to(torch.uint8),
        )
        for _ in range(n)
    ]
    lm_head = torch.randn(spec.vocab_size, spec.hidden_size, generator=g) * 0.05
    return batches, lm_head


def make_step(cfg, backend: str, batches: list[tuple], lm_head: torch.Tensor):
    """One training step of `backend` on batch i (mod the batches), as `lab.train.ttt.train` steps."""
    from lab.train.torchspec_backend import TorchSpecTTT

    t = cfg.train
    drafter = drafter_for(cfg)
    loss = (
        functools.partial(ttt_loss, drafter)
        if backend == "native"
        else TorchSpecTTT.for_drafter(drafter, t.ttt_length).loss
    )
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = optimizer(params, t)  # the trainer's

    def step(i: int) -> None:
        input_ids, aux, final, mask = batches[i % len(batches)]
        stats = loss(input_ids, aux, final, lm_head, t.ttt_length, t.step_weight, mask)
        opt.zero_grad(set_to_none=True)
        stats.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
        opt.step()

    return step


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.M).group(1))


def memory_probe(cfg, backend: str, loss_share: float, warmup: int) -> dict:
    """In this (fresh) process: warm `backend` up, then the peak RSS of one training step."""
    batches, lm_head = make_batches(cfg, loss_share)
    step = make_step(cfg, backend, batches, lm_head)
    for i in range(warmup):
        step(i)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        reset = True
    except OSError:
        reset = False
    before = _status_kib("VmRSS")
    step(warmup)
    peak = _status_kib("VmHWM")
    return {"backend": backend, "before_kib": before, "peak_kib": peak, "reset": reset}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny", help="the configuration (default tiny)")
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
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory processes")
    parser.add_argument("--memory-probe", choices=BACKENDS, help=argparse.SUPPRESS)  # the child processes
    args, overrides = parser.parse_known_args()
    try:
        cfg = compose([*shape_overrides(args.shape, overrides), "train.backend=torchspec"])
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    set_threads(cfg)
    if args.memory_probe:
        print("MEMORY " + json.dumps(memory_probe(cfg, args.memory_probe, args.loss_share, max(args.warmup, 1))))
        return 0
    try:
        import torchspec  # noqa: F401
    except ImportError:
        print("error: TorchSpec is not installed (docs/torchspec.md says how to install it)", file=sys.stderr)
        return 2

    t = cfg.train
    b, seq = t.batch_size, cfg.data.seq_len
    batches, lm_head = make_batches(cfg, args.loss_share)
    spec = drafter_for(cfg).spec
    runners = {backend: make_step(cfg, backend, batches, lm_head) for backend in BACKENDS}
    print(
        f"shape {args.shape}: drafter {spec.attention} {cfg.drafter.fc_norm.value}/norm_output="
        f"{cfg.drafter.norm_output}, hidden {spec.hidden_size}, vocab {spec.vocab_size} "
        f"(draft {spec.draft_vocab_size}), batch {b} x {seq} tokens, "
        f"ttt_length {t.ttt_length}, float32, loss on {args.loss_share:.0%} of positions, "
        f"{torch.get_num_threads()} threads"
    )
    started = time.time()
    for step in runners.values():
        for i in range(args.warmup):
            step(i)
    print(f"warm-up ({args.warmup} steps each, TorchSpec compiles its loss): {time.time() - started:.0f} s")
    tokens = args.steps * b * seq
    rates: dict[str, list[float]] = {name: [] for name in runners}
    cpu_rates: dict[str, list[float]] = {name: [] for name in runners}
    for r in range(args.rounds):
        order = list(runners) if r % 2 == 0 else list(reversed(runners))
        for backend in order:
            t0, c0 = time.perf_counter(), time.process_time()
            for i in range(args.steps):
                runners[backend](i)
            rates[backend].append(tokens / (time.perf_counter() - t0))
            cpu_rates[backend].append(tokens / (time.process_time() - c0))
        print(
            f"round {r + 1}: native {rates['native'][-1]:8.0f} tok/s   torchspec {rates['torchspec'][-1]:8.0f} tok/s   "
            f"native/torchspec {rates['native'][-1] / rates['torchspec'][-1]:.2f}   (per CPU second: "
            f"{cpu_rates['native'][-1]:.0f} / {cpu_rates['torchspec'][-1]:.0f} = "
            f"{cpu_rates['native'][-1] / cpu_rates['torchspec'][-1]:.2f})"
        )
    native, ts = statistics.median(rates["native"]), statistics.median(rates["torchspec"])
    ratios = [n / s for n, s in zip(rates["native"], rates["torchspec"], strict=True)]
    cpu_ratios = [n / s for n, s in zip(cpu_rates["native"], cpu_rates["torchspec"], strict=True)]
    print(
        f"median: native {native:.0f} tok/s, torchspec {ts:.0f} tok/s; native/torchspec "
        f"{statistics.median(ratios):.2f} (rounds {min(ratios):.2f}-{max(ratios):.2f}); per CPU second "
        f"{statistics.median(cpu_ratios):.2f} (rounds {min(cpu_ratios):.2f}-{max(cpu_ratios):.2f})"
    )
    if args.no_memory:
        return 0
    for backend in BACKENDS:
        cmd = [sys.executable, os.path.abspath(__file__), "--memory-probe", backend, "--shape", args.shape]
        cmd += ["--warmup", str(max(args.warmup, 1)), "--loss-share", str(args.loss_share), *overrides]
        out = subprocess.run(cmd, capture_output=True, text=True)
        found = [line for line in out.stdout.splitlines() if line.startswith("MEMORY ")]
        if out.returncode != 0 or not found:
            print(f"peak RSS, {backend}: the probe failed (exit {out.returncode}): {out.stderr.strip()[-400:]}")
            continue
        m = json.loads(found[-1][len("MEMORY ") :])
        how = "VmHWM over one step after warm-up" if m["reset"] else "VmHWM of the whole process (no reset here)"
        print(
            f"peak RSS of a training step, {backend:9s}: {m['peak_kib'] / 1024:7.0f} MiB "
            f"(+{(m['peak_kib'] - m['before_kib']) / 1024:.0f} MiB over the {m['before_kib'] / 1024:.0f} MiB "
            f"before the step; {how}, in a fresh process)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
