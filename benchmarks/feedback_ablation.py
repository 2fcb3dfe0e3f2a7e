"""What does a drafter read: the target's features, the state it feeds back, or neither? The held-out rollout
of logged runs, teacher-forced as the runs logged it, with the drafter's own inputs and then with one of them
shuffled across the positions of the batch (`lab.eval.probes.shuffled_rollout_counts`): the target's captured
states (every depth reads them) or the state fed to each later drafting step (depth 1 reads none). What a
shuffle costs is what the drafter takes from that input. Runs are grouped by drafter (fc_norm, norm_output,
TTT length); each shuffled / own ratio gets its 95 % paired bootstrap interval over seeds and held-out
sequences (lab/report/paired.py).

    .venv/bin/python benchmarks/feedback_ablation.py mlruns/artifacts/RUN_ID/artifacts [...] [--depth 9]
        [--shuffles 3] [--batch 8] [--threads N] [--figure PATH]

A run's folder holds what the run logged: config.yaml, checkpoint/ and per_prompt/rollout.json. The
held-out conversations and their captured states come from the cache the runs used (rebuilt if absent).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from lab.config import Config, rollout_depth
from lab.data.cache import heldout_states
from lab.drafter.formats import load_checkpoint
from lab.eval.probes import SHUFFLED, rollout_counts, shuffled_rollout_counts
from lab.pipeline import _training_data, set_threads
from lab.report.paired import paired_ratio, share
from lab.target import load as load_target

# (fc_norm, norm_output) -> the name the studies give the drafter
ARMS = {
    ("none", False): "EAGLE-3",
    ("per_layer", False): "FC norm alone",
    ("none", True): "post-norm feedback alone",
    ("per_layer", True): "EAGLE 3.1",
}
INPUTS = (None, *SHUFFLED)  # None: the drafter's own inputs
NAMES = {None: "own", "features": "features shuffled", "feedback": "feedback shuffled"}


def drafter_label(cfg) -> str:
    toggles = (cfg.drafter.fc_norm.name, bool(cfg.drafter.norm_output))
    name = ARMS.get(toggles, f"fc_norm={toggles[0]}, norm_output={toggles[1]}")
    return f"{name}, TTT {cfg.train.ttt_length}"


def rollout(drafter, heldout, states, depth: int, shuffled: str | None, seed: int, batch: int) -> np.ndarray:
    """(hits, counted) per held-out sequence at each depth, [N, depth, 2]; unshuffled, the rollout the runs log."""
    parts = []
    for a in range(0, len(heldout.input_ids), batch):
        rows = slice(a, a + batch)
        args = (drafter, heldout.input_ids[rows], states.aux[rows], states.top[rows], depth, heldout.loss_mask[rows])
        if shuffled is None:
            hits, counted = rollout_counts(*args)
        else:
            hits, counted = shuffled_rollout_counts(*args, shuffled=shuffled, seed=seed * 100_003 + a)
        parts.append(torch.stack([hits, counted], -1).transpose(0, 1))
    return torch.cat(parts).numpy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", type=Path, nargs="+", help="runs' artifact folders (config.yaml, checkpoint/)")
    parser.add_argument("--depth", type=int, default=None, help="unrolled depth (default: what the run logged)")
    parser.add_argument("--shuffles", type=int, default=3, help="shuffle seeds, pooled")
    parser.add_argument("--batch", type=int, default=8, help="held-out sequences per dense unroll")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: the runs' `threads`)")
    parser.add_argument("--figure", type=Path, default=None, help="also draw a panel per drafter (PNG or PDF)")
    args = parser.parse_args()
    # drafter -> input shuffled (None: none) -> seed -> [N, depth, 2]
    groups: dict[str, dict[str | None, dict[int, np.ndarray]]] = defaultdict(lambda: defaultdict(dict))
    target, data = None, {}
    for run in args.runs:
        cfg = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(run / "config.yaml"))  # typed
        if target is None:
            set_threads(cfg)
            if args.threads:
                torch.set_num_threads(args.threads)
            target = load_target(cfg, progress=False)
        drafter = load_checkpoint(run / "checkpoint", embed_weight=target.embed_weight).eval()
        layers = list(drafter.spec.aux_layer_ids)
        key = json.dumps([OmegaConf.to_container(cfg.data, resolve=True), layers], sort_keys=True, default=str)
        if key not in data:
            heldout = _training_data(cfg, target, progress=False)[1]
            data[key] = heldout, heldout_states(target, heldout, layers, cfg.cache_dir)
        heldout, states = data[key]
        depth = args.depth or rollout_depth(cfg)
        label = drafter_label(cfg)
        for shuffled in INPUTS:
            draws = range(1 if shuffled is None else args.shuffles)
            counts = sum(rollout(drafter, heldout, states, depth, shuffled, n, args.batch) for n in draws)
            groups[label][shuffled][cfg.seed] = counts
        logged = json.loads((run / "per_prompt" / "rollout.json").read_text())["sequences"]
        own = groups[label][None][cfg.seed]
        if any(s["hits"][:depth] != own[i, : len(s["hits"]), 0].tolist() for i, s in enumerate(logged)):
            print(f"{run}: the rollout's hits differ from the logged ones (another held-out set or drafter?)")
        accuracies = "; ".join(f"{NAMES[name]} {accuracy(groups[label][name][cfg.seed])}" for name in INPUTS)
        print(f"{run.parent.name} ({label}, seed {cfg.seed}): {accuracies}", flush=True)
    print("\nheld-out rollout accuracy (mean over seeds); shuffled / own [95 % interval]")
    curves: dict[str, dict[str | None, list[float]]] = defaultdict(lambda: defaultdict(list))
    for label, by_input in groups.items():
        depth = next(iter(by_input[None].values())).shape[1]
        print(f"\n{label} ({len(by_input[None])} seeds)")
        print("| depth | own | features shuffled | / own | feedback shuffled | / own |\n|---|---|---|---|---|---|")
        for d in range(depth):
            at = {
                name: {seed: {str(i): c[i, d] for i in range(len(c))} for seed, c in runs.items()}
                for name, runs in by_input.items()
            }
            cells = []
            for name in INPUTS:
                mean = float(np.mean([share(sum(c.values())) for c in at[name].values()]))
                curves[label][name].append(mean)
                cells.append(f"{mean:.3f}")
                if name is not None:
                    ratio = paired_ratio(at[name], at[None], share)
                    cells.append("-" if ratio is None else f"{ratio.ratio:.3f} [{ratio.low:.3f}, {ratio.high:.3f}]")
            print(f"| {d + 1} | {' | '.join(cells)} |")
    if args.figure:
        draw(curves, args.figure)
        print(f"\nfigure: {args.figure}")


def accuracy(counts: np.ndarray) -> list[float]:
    """Pooled accuracy per depth of [N, depth, 2] counts, as the run logs it."""
    return [round(float(a), 3) for a in share(counts.sum(0))]


def draw(curves: dict[str, dict[str | None, list[float]]], path: Path) -> None:
    """Accuracy per depth, a panel per drafter: own inputs, features shuffled, fed-back state shuffled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, len(curves), figsize=(3.2 * len(curves), 3.6), sharey=True, squeeze=False)
    for ax, (label, by_input) in zip(axes[0], curves.items(), strict=True):
        for i, name in enumerate(INPUTS):
            values = by_input[name]
            ax.plot(range(1, len(values) + 1), values, color=f"C{i}", marker="o", markersize=3, label=NAMES[name])
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("unrolled depth")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("held-out rollout accuracy")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150)


if __name__ == "__main__":
    main()
