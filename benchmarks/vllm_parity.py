"""AL parity between the reference decoder and vLLM, and vLLM's speedup at each concurrency, for the
drafters a study already trained (their MLflow `checkpoint` artifacts): no retraining.

    .venv/bin/python benchmarks/vllm_parity.py drift_2x2 [--seed 0] [hydra overrides...]

The overrides must name the target the study used (the defaults do for the default target). Prints a
markdown table per k: arm x suite, reference AL, vLLM AL, their gap, and the speedup at C = 1, 4, 16.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from lab import metrics as metric_keys
from lab import track
from lab.config.composition import compose
from lab.data.suites import build_suite
from lab.device import thread_count
from lab.drafter import load_checkpoint
from lab.eval import vllm_backend
from lab.eval.evaluate import EvalOptions, evaluate_suite_prompts
from lab.pipeline import set_threads
from lab.target import load


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("study")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write every metric of every arm here")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    cfg = compose(args.overrides + ["eval.backends=[ref,vllm]"])
    set_threads(cfg)
    target = load(cfg, progress=False)
    suites = [build_suite(name, target.tokenizer, cfg) for name in cfg.eval.suites]
    ks = list(cfg.eval.num_speculative_tokens)
    runs = [
        r
        for r in track.search_runs(cfg.tracking.uri, args.study, "attributes.status = 'FINISHED'")
        if r.data.tags.get("seed") == str(args.seed)
    ]
    rows = []
    for run in sorted(runs, key=lambda r: r.data.tags["arm"]):
        arm = run.data.tags["arm"]
        with tempfile.TemporaryDirectory() as tmp:
            ckpt, _ = track.run_checkpoint(cfg.tracking.uri, run.info.run_id, tmp)
            drafter = load_checkpoint(ckpt)
        t0 = time.time()
        ref = {}
        for suite in suites:
            ref.update(evaluate_suite_prompts(target.model, drafter, suite, EvalOptions(ks), progress=False).metrics)
        t_ref = time.time() - t0
        t0 = time.time()
        vllm = vllm_backend.evaluate(
            target.path, drafter, suites, ks, cfg.eval, cfg.seed, thread_count(cfg),
            Path(tempfile.gettempdir()) / f"vllm_parity_{arm}.log", target.max_positions,
        )  # fmt: skip
        print(f"{arm}: reference {t_ref:.0f}s, vLLM {time.time() - t0:.0f}s", flush=True)
        rows.append((arm, ref, vllm))
        if args.json:
            Path(args.json).write_text(json.dumps({a: {**r, **v} for a, r, v in rows}, indent=1))
    cs = list(cfg.eval.vllm.concurrency)
    for k in ks:
        print(f"\nk = {k} ({args.study}, seed {args.seed}, greedy, float32)\n")
        head = "| arm | suite | AL ref | AL vLLM | gap | " + " | ".join(f"speedup c{c}" for c in cs) + " |"
        print(head + "\n" + "|---" * (5 + len(cs)) + "|")
        for arm, ref, vllm in rows:
            for suite in suites:
                a_ref = ref[metric_keys.acceptance_length(suite.name, k, "ref")]
                a_vllm = vllm[metric_keys.acceptance_length(suite.name, k, "vllm")]
                speedups = [vllm.get(metric_keys.throughput_speedup(suite.name, k, c)) for c in cs]
                speed = " | ".join("-" if x is None else f"{x:.2f}x" for x in speedups)  # eval.vllm.throughput_suites
                gap = 100 * (a_vllm / a_ref - 1)
                print(f"| {arm} | {suite.name} | {a_ref:.3f} | {a_vllm:.3f} | {gap:+.1f}% | {speed} |")


if __name__ == "__main__":
    main()
