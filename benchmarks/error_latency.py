"""How long a bad input takes to be refused, beside Python's own start-up, measured side by side.

    .venv/bin/python benchmarks/error_latency.py [--rounds 5]

Each round runs `python -c pass` and then, for each bad input below, `lab run OVERRIDE` in a fresh process
(the CLI as a user calls it), and times each until it exits. Prints per input the median wall time, its ratio
to `python -c pass` in the same rounds, and checks that each was refused with exit code 2 and one stderr line.
Config and spec validation import neither torch, mlflow nor vllm, so a refusal waits on no heavy import.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BAD_INPUTS = [
    "drafter.fc_norm=both",  # an unknown enum member
    "train.steps=-1",  # out of range
    "eval.num_speculative_tokens=[]",  # an empty list
    "data=jsonl",  # a required key missing
    "target.path=/nonexistent.gguf",  # a file checked before any model loads
]


def timed(cmd: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    return time.perf_counter() - start, done


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    lab = [sys.executable, "-m", "lab.cli", "run"]
    baseline: list[float] = []
    seconds: dict[str, list[float]] = {bad: [] for bad in BAD_INPUTS}
    for _ in range(args.rounds):
        baseline.append(timed([sys.executable, "-c", "pass"])[0])
        for bad in BAD_INPUTS:
            took, done = timed([*lab, bad])
            lines = done.stderr.strip().splitlines()
            if done.returncode != 2 or len(lines) != 1:
                print(f"{bad}: expected exit 2 and one stderr line, got {done.returncode}:\n{done.stderr}")
                return 1
            seconds[bad].append(took)
    base = statistics.median(baseline)
    print(f"python -c pass: {base:.3f} s (median of {args.rounds})")
    for bad, times in seconds.items():
        median = statistics.median(times)
        print(f"lab run {bad:36s} {median:.3f} s  ({median / base:.1f}x python -c pass)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
