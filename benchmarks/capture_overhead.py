"""What capturing the target's hidden states for the drafter's cache costs over the target's plain forward, and
where both stand against this machine's GEMM roofline.

The plain forward (the base model alone: no lm_head, no hidden states returned, no KV cache) and capture as the
cache builder does it (`lab.data.cache.capture_batch`) run over the same random batches, interleaved round by
round so that machine noise hits both alike. Each round prints tokens/s by wall clock and per CPU second (which
waiting for a busy core does not count); the summary gives the median overhead against a 10 % bound. Writing a
shard is timed apart. `--all-states` adds capture through `output_hidden_states=True` for comparison. The roofline
is torch.mm at the target's linear-layer shapes, and each variant's achieved GFLOP/s is a share of its peak
(docs/benchmarks.md#capture-overhead says how each figure is counted).

    .venv/bin/python benchmarks/capture_overhead.py [--target smollm2|micro] [--batch 4] [--seq-len 512]
        [--batches 2] [--rounds 5] [--threads N] [--dtype float32|bfloat16] [--all-states]
        [--no-roofline] [hydra overrides...]

`--target smollm2` (default) is SmolLM2-135M (`target=smollm2`), `micro` the micro target (`profile=micro`);
overrides apply on top (e.g. `drafter.aux_layers=[1,8,20]`). On a machine whose cores are busy with other work,
use `--threads 1`.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from lab.config import ConfigError
from lab.config.composition import compose
from lab.config.shape import aux_layers
from lab.data.cache import STORE_DTYPE, capture_batch
from lab.fsutil import sha256_file
from lab.pipeline import set_threads
from lab.target import load

TARGETS = {"smollm2": ["target=smollm2"], "micro": ["profile=micro"]}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BUDGET = 0.10  # the most capture may add to the plain forward it rides on


@torch.no_grad()
def plain_forward(model, batch: torch.Tensor, aux: list[int]) -> None:
    model.base_model(input_ids=batch, use_cache=False)


@torch.no_grad()
def all_states(model, batch: torch.Tensor, aux: list[int]) -> None:
    out = model.base_model(input_ids=batch, use_cache=False, output_hidden_states=True)
    states = out.hidden_states
    torch.cat([states[i] for i in aux], dim=-1).to(STORE_DTYPE)
    states[-1].to(STORE_DTYPE)


def cache_capture(model, batch: torch.Tensor, aux: list[int]) -> None:
    capture_batch(model, batch, aux)


def forward_flops(model, batch: int, seq: int) -> tuple[int, int]:
    """(FLOPs of the base model's linear layers, of attention's two products over the causal triangle)."""
    c = model.config
    linear = sum(m.weight.numel() for m in model.base_model.modules() if isinstance(m, torch.nn.Linear))
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    attention = 2 * 2 * c.num_attention_heads * head_dim * (seq * (seq + 1) // 2) * batch * c.num_hidden_layers
    return 2 * linear * batch * seq, attention


def linear_shapes(model) -> dict[tuple[int, int], int]:
    """(in, out) of the base model's linear layers -> how many there are."""
    shapes: dict[tuple[int, int], int] = {}
    for m in model.base_model.modules():
        if isinstance(m, torch.nn.Linear):
            shapes[(m.in_features, m.out_features)] = shapes.get((m.in_features, m.out_features), 0) + 1
    return shapes


def gemm_rate(m: int, k: int, n: int, dtype: torch.dtype, min_seconds: float = 0.2) -> float:
    """GFLOP/s of torch.mm([m, k], [k, n]) with the second operand stored [n, k] (as nn.Linear's weight):
    the best of repeats after one warm-up (other work only ever slows a repeat), repeated until
    `min_seconds` have passed (at least 3)."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    torch.mm(a, w.t())
    times: list[float] = []
    while len(times) < 3 or sum(times) < min_seconds:
        start = time.perf_counter()
        torch.mm(a, w.t())
        times.append(time.perf_counter() - start)
    return 2 * m * k * n / min(times) / 1e9


def cpu_name() -> str:
    """The processor's model name and the vector instructions torch uses on it."""
    name = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    return f"{name}, {os.cpu_count()} cores, torch CPU capability {torch.backends.cpu.get_cpu_capability()}"


def roofline(model, tokens: int, square: int, dtypes: list[torch.dtype]) -> dict[torch.dtype, dict]:
    """Per dtype: GFLOP/s per linear shape and of the square product, and the peak (the best of them)."""
    result = {}
    for dtype in dtypes:
        shapes = {(k, n): gemm_rate(tokens, k, n, dtype) for k, n in linear_shapes(model)}
        sq = gemm_rate(square, square, square, dtype)
        result[dtype] = {"shapes": shapes, "square": sq, "peak": max([sq, *shapes.values()])}
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="capture_overhead.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", choices=sorted(TARGETS), default="smollm2", help="the target (default smollm2)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per batch (default 4)")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (default 512)")
    parser.add_argument("--batches", type=int, default=2, help="batches each variant runs per round (default 2)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: the config's, all cores)")
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="float32",
        help="the target's dtype for both variants (default float32)",
    )
    parser.add_argument("--all-states", action="store_true", help="also time capture with output_hidden_states=True")
    parser.add_argument("--no-roofline", action="store_true", help="skip the GEMM roofline")
    parser.add_argument("--square", type=int, default=2048, help="size of the roofline's square product (default 2048)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, on top of --target's")
    args = parser.parse_args(argv)
    for name in ("batch", "seq_len", "batches", "rounds", "square"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    overrides = [*TARGETS[args.target], *args.overrides] + ([f"threads={args.threads}"] if args.threads else [])
    try:
        cfg = compose(overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    set_threads(cfg)
    aux = aux_layers(cfg)
    dtype = DTYPES[args.dtype]
    target = load(cfg, progress=False)
    if args.seq_len > target.max_positions:
        print(
            f"error: --seq-len {args.seq_len} is above the target's {target.max_positions} positions", file=sys.stderr
        )
        return 2
    model = target.model.to(dtype)
    gen = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(0, target.vocab_size, (args.batch, args.seq_len), generator=gen) for _ in range(args.batches)
    ]
    tokens = args.batches * args.batch * args.seq_len
    variants = {"plain": plain_forward, "capture": cache_capture}
    if args.all_states:
        variants["all-states"] = all_states
    print(
        f"target {args.target}: {target.num_layers} layers, hidden {target.hidden_size}, aux layers {aux}; "
        f"{args.batches} batches of {args.batch} x {args.seq_len} tokens, {args.dtype}, "
        f"cache in {str(STORE_DTYPE)[6:]}, {torch.get_num_threads()} threads"
    )
    for run in variants.values():  # one-off allocations, lazy initialisation
        run(model, batches[0], aux)

    wall: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    writes: list[float] = []
    with tempfile.TemporaryDirectory(prefix="capture-overhead-") as tmp:
        for r in range(args.rounds):
            for name, run in variants.items():
                t0, c0 = time.perf_counter(), time.process_time()
                for batch in batches:
                    run(model, batch, aux)
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
            out = capture_batch(model, batches[0], aux)
            t0 = time.perf_counter()
            shard = Path(tmp) / "shard.safetensors"
            save_file(
                {"input_ids": batches[0].to(torch.int32), "aux": torch.cat([out.aux]), "final": torch.cat([out.final])},
                str(shard),
            )
            sha256_file(shard)
            writes.append(time.perf_counter() - t0)
            line = "   ".join(f"{n} {tokens / wall[n][-1]:8.1f} tok/s" for n in variants)
            ratios = "   ".join(
                f"{n}/plain {wall[n][-1] / wall['plain'][-1]:.3f} (CPU {cpu[n][-1] / cpu['plain'][-1]:.3f})"
                for n in variants
                if n != "plain"
            )
            print(f"round {r + 1}: {line}   {ratios}")

    print(f"median of {args.rounds} rounds:")
    for name in variants:
        print(
            f"  {name:10s} {tokens / statistics.median(wall[name]):8.1f} tokens/s   "
            f"{tokens / statistics.median(cpu[name]):8.1f} tokens per CPU second"
        )
    for name in variants:
        if name == "plain":
            continue
        ratios = [w / p for w, p in zip(wall[name], wall["plain"], strict=True)]
        cpu_ratios = [c / p for c, p in zip(cpu[name], cpu["plain"], strict=True)]
        over, cpu_over = statistics.median(ratios) - 1, statistics.median(cpu_ratios) - 1
        verdict = "within" if max(over, cpu_over) <= BUDGET else "OVER"
        print(
            f"  {name} overhead over plain: {100 * over:+.1f} % by wall clock (rounds {100 * (min(ratios) - 1):+.1f} "
            f"to {100 * (max(ratios) - 1):+.1f} %), {100 * cpu_over:+.1f} % per CPU second: {verdict} the "
            f"{100 * BUDGET:.0f} % budget"
        )
    write = statistics.median(writes)
    batch_tokens = args.batch * args.seq_len
    mb = (batch_tokens * (len(aux) + 1) * target.hidden_size * STORE_DTYPE.itemsize) / 1e6
    share = write / (statistics.median(wall["plain"]) / args.batches)
    print(
        f"  shard write (safetensors + sha256, not in the overhead): {write * 1e3:.1f} ms for {mb:.1f} MB "
        f"({batch_tokens / write:.0f} tokens/s; {100 * share:.1f} % of a batch's plain forward)"
    )

    if args.no_roofline:
        return 0
    dtypes = [torch.float32] + ([torch.bfloat16] if dtype == torch.bfloat16 else [])
    roof = roofline(model, batch_tokens, args.square, dtypes)
    linear, attention = forward_flops(model, args.batch, args.seq_len)
    flops = args.batches * (linear + attention)
    print(
        f"GEMM roofline (torch.mm, {torch.get_num_threads()} threads, best of repeats; M = {batch_tokens} tokens) "
        f"on {cpu_name()}:"
    )
    for d, r in roof.items():
        cells = "   ".join(f"[M,{k}]x[{k},{n}] {rate:6.1f}" for (k, n), rate in r["shapes"].items())
        print(
            f"  {str(d)[6:]:8s} {cells}   [{args.square}]^2 square {r['square']:6.1f}   peak {r['peak']:6.1f} GFLOP/s"
        )
    r = roof[dtype]
    shapes = linear_shapes(model)
    gemm_seconds = args.batches * sum(
        count * 2 * batch_tokens * k * n / (r["shapes"][(k, n)] * 1e9) for (k, n), count in shapes.items()
    )
    print(
        f"forward FLOPs per round: {flops / 1e9:.1f} GFLOP ({100 * args.batches * attention / flops:.1f} % attention); "
        f"the linear layers alone at their shapes' measured rates: {gemm_seconds:.3f} s"
    )
    for name in variants:
        seconds, cpu_seconds = statistics.median(wall[name]), statistics.median(cpu[name])
        rate, cpu_rate = flops / seconds / 1e9, flops / cpu_seconds / 1e9 * torch.get_num_threads()
        print(
            f"  {name:10s} {rate:6.1f} GFLOP/s = {100 * rate / r['peak']:5.1f} % of the {str(dtype)[6:]} peak "
            f"({seconds:.3f} s a round; the linear GEMMs at measured rates would take "
            f"{100 * gemm_seconds / seconds:.0f} % of it); by CPU time x threads {cpu_rate:6.1f} GFLOP/s = "
            f"{100 * cpu_rate / r['peak']:5.1f} %"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
