"""What the real target costs on this machine: capture tokens/s (float32 and bfloat16, side by side), drafter
training tokens/s per draft-vocabulary size, and how much of held-out ShareGPT each vocabulary size covers.

    python benchmarks/smollm2_costs.py [--batch 4 --seq 512 --vocabs 8192,16384,32768,49152 --rounds 2]

The target is `target=smollm2` (converted into the cache on first use); batches are random token ids (cost
does not depend on the text). Rounds alternate the variants so that a busy machine slows all of them alike;
each line reports the median over rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lab.config.composition import compose
from lab.data import conversations as convs
from lab.drafter import init_drafter
from lab.target import capture, load
from lab.train.loss import ttt_loss

AUX = [2, 15, 27]  # SmolLM2's default captured layers


def capture_rate(model, batch: torch.Tensor) -> float:
    start = time.perf_counter()
    capture(model, batch, AUX)
    return batch.numel() / (time.perf_counter() - start)


def train_rate(target, size: int, batch: torch.Tensor, steps: int = 2) -> float:
    cfg = compose([f"drafter.draft_vocab_size={size}"])
    counts = torch.bincount(batch.flatten(), minlength=target.vocab_size)
    drafter = init_drafter(target, cfg.drafter, AUX, 0, counts)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-3)
    cap = capture(target.model, batch, AUX)
    mask = (torch.rand(batch.shape, generator=torch.Generator().manual_seed(0)) < 0.6).to(torch.uint8)
    rates = []
    for _ in range(steps):  # the first step pays one-off allocations
        start = time.perf_counter()
        stats = ttt_loss(drafter, batch, cap.aux, cap.final, target.lm_head_weight, 3, 0.8, mask)
        stats.loss.backward()
        opt.step()
        opt.zero_grad()
        rates.append(batch.numel() / (time.perf_counter() - start))
    return rates[-1]


def coverage(tokenizer, sizes: list[int], cache_dir: str, fit: int = 2000, held: int = 1000) -> dict[int, float]:
    """Share of held-out assistant tokens inside the `size` most frequent ones of `fit` training conversations."""

    def counts(conversations) -> torch.Tensor:
        total = torch.zeros(len(tokenizer), dtype=torch.long)
        for c in conversations:
            for m in c.messages:
                if m["role"] == "assistant":
                    ids = tokenizer(m["content"][:4000], add_special_tokens=False)["input_ids"]
                    total += torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=len(tokenizer))
        return total

    train, heldout = convs.split(convs.sharegpt(cache_dir))
    order = counts(convs.select(train, fit, 1234, "fit")).argsort(descending=True)
    test = counts(heldout[:held])
    return {n: float(test[order[:n]].sum() / test.sum()) for n in sizes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--vocabs", default="8192,16384,32768,49152")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = compose([])
    target = load(cfg, progress=False)
    batch = torch.randint(0, target.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    sizes = [int(v) for v in args.vocabs.split(",")]
    capture(target.model, batch[:1, :32], AUX)  # warm-up
    rates: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for dtype in (torch.float32, torch.bfloat16):
            rates.setdefault(f"capture {str(dtype)[6:]}", []).append(capture_rate(target.model.to(dtype), batch))
        target.model.float()
        for size in sizes:
            rates.setdefault(f"train TTT 3, draft vocab {size}", []).append(train_rate(target, size, batch))
    print(f"{args.batch} x {args.seq} tokens, {torch.get_num_threads()} threads, median of {args.rounds} rounds")
    for name, values in rates.items():
        print(f"  {name:32s} {statistics.median(values):8.1f} tokens/s")
    for size, share in coverage(target.tokenizer, sizes, cfg.cache_dir).items():
        print(f"  draft vocab {size:6d} covers {100 * share:5.1f} % of held-out ShareGPT assistant tokens")


if __name__ == "__main__":
    main()
