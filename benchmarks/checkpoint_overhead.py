"""Cost of resume states in training: the same drafter trained with `train.resume_every=0` and
with the configured interval, alternating over repeats so machine noise hits both alike; prints the
time ratio and checks that both end with the same weights.

    .venv/bin/python benchmarks/checkpoint_overhead.py [--repeats 2] [hydra overrides...]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from lab.config.composition import compose
from lab.config.shape import aux_layers
from lab.data.cache import build_or_load
from lab.data.code_data import training_sequences
from lab.drafter import init_drafter
from lab.pipeline import set_threads
from lab.target import load
from lab.train import resume
from lab.train.ttt import train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    args, overrides = parser.parse_known_args()
    cfg = compose(overrides)
    every = cfg.train.resume_every or 50
    set_threads(cfg)
    target = load(cfg)
    layers = aux_layers(cfg)
    sequences, _ = training_sequences(target.tokenizer, cfg.data)
    hidden = build_or_load(target, sequences, cfg.data, layers, cfg.cache_dir)

    def trained(checkpointing: bool) -> tuple[float, dict[str, torch.Tensor]]:
        drafter = init_drafter(target, cfg.drafter, layers, cfg.seed)
        with tempfile.TemporaryDirectory() as tmp:
            writer = resume.ResumeWriter(Path(tmp) / "resume", every) if checkpointing else None
            start = time.perf_counter()
            train(drafter, hidden, target.lm_head_weight, cfg.train, cfg.seed, progress=False, resume_writer=writer)
            return time.perf_counter() - start, drafter.state_dict()

    seconds = {False: 0.0, True: 0.0}
    weights = {}
    for repeat in range(args.repeats):
        for checkpointing in (False, True) if repeat % 2 == 0 else (True, False):
            elapsed, weights[checkpointing] = trained(checkpointing)
            seconds[checkpointing] += elapsed
    same = all(torch.equal(weights[False][k], weights[True][k]) for k in weights[False])
    n = cfg.train.steps // every + (cfg.train.steps % every > 0)
    print(f"{cfg.train.steps} steps x {args.repeats} repeats, a checkpoint every {every} steps ({n} per run)")
    print(
        f"without {seconds[False]:.1f}s, with {seconds[True]:.1f}s: overhead "
        f"{100 * (seconds[True] / seconds[False] - 1):+.1f}%; same weights: {same}"
    )


if __name__ == "__main__":
    main()
