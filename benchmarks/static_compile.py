"""The static KV cache's step compiled once for every bucket (`dynamic=True`, lab/target/static_decode.py) against
once a bucket (`dynamic=False`), side by side on this device: per bucket met, the first
batch's seconds (a compile, or only a CUDA graph's recording) and the next's, the graphs dynamo compiled, and
whether the tokens equal the dynamic cache's. On the CPU the step is compiled here too (the workbench runs it
eagerly there), so the compile counts and the tokens can be checked anywhere; the seconds that matter are a GPU's.

    .venv/bin/python benchmarks/static_compile.py              # CUDA: a random SmolLM2-135M-shaped target
    .venv/bin/python benchmarks/static_compile.py --small      # a 2-layer toy: the CPU check
"""

from __future__ import annotations

import argparse
import time
from unittest.mock import patch

import torch
from torch._dynamo.utils import counters

from lab.target import static_decode
from lab.target.generate import greedy_batch

# (rows, prompt tokens, new tokens): four buckets, rows 4, 16, 16 and 64 over caches of 256, 256, 512, 1024
BATCHES = [(3, 20, 10), (10, 20, 10), (10, 300, 10), (40, 600, 20)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="a 2-layer toy model instead of SmolLM2's shape")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    from gpu_stages import SMOLLM2  # the stage benchmark's shape (this folder is on the path)
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(SMOLLM2, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2) if args.small else SMOLLM2  # fmt: skip
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    mode = "reduce-overhead" if device.type == "cuda" else None  # CUDA graphs where there are any
    print("| compile | bucket (rows x length) | first batch s | next batch s | graphs compiled so far | tokens equal |")
    print("|---|---|---|---|---|---|")
    for dynamic in (True, False):
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**shape)).to(device, dtype).eval().requires_grad_(False)
        torch._dynamo.reset()
        counters.clear()
        g = torch.Generator().manual_seed(0)
        compile_step = lambda step, _device, _dynamic, d=dynamic: static_decode.compiled(step, mode, d)  # noqa: E731, B023
        with patch.object(static_decode, "compile_step", compile_step):
            for rows, width, new in BATCHES:
                prompts = torch.randint(0, shape["vocab_size"], (rows, width), generator=g).tolist()
                seconds = []
                for _ in range(2):
                    start = time.perf_counter()
                    got = static_decode.static_greedy_batch(model, prompts, [new] * rows, -1)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    seconds.append(time.perf_counter() - start)
                want = greedy_batch(model, prompts, [new] * rows, -1, "dynamic")
                bucket = f"{static_decode.row_bucket(rows)} x {static_decode.length_bucket(width + new)}"
                print(
                    f"| {'once' if dynamic else 'per bucket'} | {bucket} | {seconds[0]:.1f} | {seconds[1]:.2f} | "
                    f"{counters['stats']['unique_graphs']} | {'yes' if got == want else 'NO'} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
