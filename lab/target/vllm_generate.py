"""The vLLM side of `lab.target.generate`'s vllm backend: `python -m lab.target.vllm_generate JOB_JSON`.

A persistent worker: it builds ONE `LLM` over the target folder (engine in this process,
`VLLM_ENABLE_V1_MULTIPROCESSING=0`, `uni` executor, eager mode, no tokenizer: token ids in and out), says
`{"ready": true}`, then answers one JSON line per request line on stdin until stdin closes:
`{"prompts": [[ids]], "max_tokens": [n per prompt]}` -> `{"outputs": [[ids]], "seconds": s}` (greedy,
stopping at the job's eos id); or, for a caller that keeps the batch full itself,
`{"add": [[key, ids, max_tokens], ...]}` -> `{"finished": [[key, ids], ...]}`: the requests join those under
way, and the engine steps until at least one request finishes (none are left out of a step that finishes
several); or `{"score": [[ids]]}` -> `{"logprobs": [[lp of each token after the first]]}` (teacher-forced:
vLLM's prompt logprobs, the parity check against transformers); or `{"error": "..."}`. The job's
`engine_options` (lab/config/shape.py `vllm_engine_options`) go to the `LLM` as they are. The protocol has the
process's stdout to itself: file descriptor 1 is pointed at stderr (the parent's log) before vllm is
imported, so nothing vLLM or its C++ kernels print can interleave with a reply. Only this module, in its
own process, imports vllm.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from typing import Any, TextIO

from lab import exit_now

logger = logging.getLogger(__name__)


def engine_environment(job: dict, env: dict[str, str]) -> dict[str, str]:
    """`env` with what vLLM reads at import: a small CPU KV cache, the engine in this process, the asked-for
    threads (the parent starts the worker in it: OpenMP reads its thread count when torch loads, before
    this module runs)."""
    env = dict(env)
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(job["kv_cache_gib"]))
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    if job.get("threads"):
        env["OMP_NUM_THREADS"] = str(job["threads"])  # asked for explicitly: wins over the caller's env
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def protocol_channel() -> TextIO:
    """The real stdout for replies; fd 1 itself now writes to stderr."""
    sys.stdout.flush()
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return channel


def reply(channel: TextIO, message: dict) -> None:
    channel.write(json.dumps(message) + "\n")
    channel.flush()


def build(job: dict) -> Any:
    from vllm import LLM

    return LLM(
        model=job["target"],
        dtype=job["dtype"],
        enforce_eager=True,
        max_model_len=job["max_model_len"],
        max_num_seqs=job["max_num_seqs"],
        seed=job["seed"],
        distributed_executor_backend="uni",
        skip_tokenizer_init=True,
        load_format="safetensors",  # never a pickled .bin/.pt
        **job.get("engine_options", {}),
    )


def generate(llm: Any, job: dict, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    from vllm.inputs import TokensPrompt

    params = [_params(job, n) for n in max_tokens]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def score(llm: Any, sequences: list[list[int]]) -> list[list[float]]:
    """The log-probability of each token of each sequence after its first, given the tokens before it."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences], params, use_tqdm=False)
    return [
        [float(at[token].logprob) for at, token in zip(o.prompt_logprobs[1:], ids[1:], strict=True)]
        for o, ids in zip(outs, sequences, strict=True)
    ]


class Stream:
    """Requests under way across `add` messages, named by the caller's keys; a log line a minute sums them up."""

    LOG_EVERY_S = 60.0

    def __init__(self, llm: Any, job: dict):
        self.llm, self.job = llm, job
        self.tokens, self.finished, self.since = 0, 0, time.perf_counter()

    def add(self, requests: list[list]) -> list[list]:
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        for key, prompt, limit in requests:
            params = _params(self.job, limit)
            params.output_kind = RequestOutputKind.FINAL_ONLY  # as LLM.generate asks: no partial outputs
            # the caller's key is the request id that outputs carry (vLLM adds its own suffix inside)
            engine.add_request(str(key), TokensPrompt(prompt_token_ids=prompt), params)
        finished: list[list] = []
        while not finished and engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished.append([int(out.request_id), list(out.outputs[0].token_ids)])
        self.tokens += sum(len(ids) for _, ids in finished)
        self.finished += len(finished)
        seconds = time.perf_counter() - self.since
        running = engine.get_num_unfinished_requests()
        if seconds >= self.LOG_EVERY_S or not running:
            logger.info(f"stream: {self.finished} finished, {running} running, {self.tokens} tokens in {seconds:.1f}s")
            self.tokens, self.finished, self.since = 0, 0, time.perf_counter()
        return finished


def _params(job: dict, max_tokens: int) -> Any:
    from vllm import SamplingParams

    # the eos is named explicitly: without a tokenizer, vLLM would only know the model config's
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=[job["eos"]], detokenize=False)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        sys.stderr.write("usage: python -m lab.target.vllm_generate JOB_JSON\n")
        return 2
    job = json.loads(argv[0])
    channel = protocol_channel()
    os.environ.update(engine_environment(job, dict(os.environ)))  # started by hand: vLLM's own settings at least
    try:
        start = time.perf_counter()
        llm = build(job)
        import vllm

        logger.info(f"engine up in {time.perf_counter() - start:.1f}s (vllm {vllm.__version__})")
    except Exception as exc:
        reply(channel, {"error": f"{type(exc).__name__}: {exc}"})
        raise
    reply(channel, {"ready": True, "startup_s": time.perf_counter() - start, "vllm_version": vllm.__version__})
    stream = Stream(llm, job)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
            if "add" in request:
                reply(channel, {"finished": stream.add(request["add"])})
                continue
            if llm.llm_engine.has_unfinished_requests():  # a whole batch would run (and swallow) them too
                raise RuntimeError("a batch was sent while streamed requests run")
            if "score" in request:
                reply(channel, {"logprobs": score(llm, request["score"])})
                continue
            start = time.perf_counter()
            outputs = generate(llm, job, request["prompts"], request["max_tokens"])
            seconds = time.perf_counter() - start
            tokens = sum(len(o) for o in outputs)
            logger.info(f"{len(outputs)} prompts, {tokens} tokens in {seconds:.1f}s")
            reply(channel, {"outputs": outputs, "seconds": seconds})
        except Exception as exc:
            traceback.print_exc()  # into the log, which the parent's error names
            reply(channel, {"error": f"{type(exc).__name__}: {exc}"})
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    # every reply is sent: vLLM's exit handlers and Python's teardown would only free what the exit frees
    exit_now(code, handlers=False)
