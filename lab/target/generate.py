"""Greedy generation with the target, batched: the answers that regeneration (lab/data/regenerate.py) puts in
place of a dataset's own, so that a drafter learns what its target actually says.

One object, `Greedy`, over two backends (`open_generator` says how each runs): `hf`, the loaded transformers
model in a hand-written KV-cache loop, and `vllm`, one worker process for the life of the context, so that the
engine starts once. `Greedy(prompts, limits)` answers a batch whole; `Greedy.stream(requests)` returns as soon as
any request finishes, so that a caller keeps the engine's batch full by refilling it (regeneration's rolling
pool), and which requests share a step never depends on timing. Every continuation stops at, and excludes, the
eos, or after its limit (fewer where the prompt would run past the context); outputs keep the prompts' order.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from lab.config.shape import vllm_engine_options
from lab.fsutil import last_error_line
from lab.target import static_decode

BACKENDS = ("auto", "hf", "vllm")
KV_CACHES = ("auto", "dynamic", "static")  # the hf loop's KV cache (the config's `kv_cache`)
HF_BATCH = 16  # rows of a batch on a CPU
HF_BATCH_MAX = 512  # on a GPU: rows of a batch at the most (`hf_batch_rows`)
VLLM_MAX_NUM_SEQS = 64
VLLM_KV_CACHE_GIB = 2
WORKER_EXIT_S = 60  # how long a closed worker may take to exit before it is killed

Requests = dict[int, tuple[list[int], int]]  # request id -> (prompt, max new tokens)


class Greedy:
    """Greedy generation over one target (see the module docstring). `run(prompts, limits)` answers a batch;
    `step(requests)` adds requests to those under way and returns the ids and answers of those that finished
    (at least one while any runs). Both see only prompts with room to generate; this class clamps every
    limit to the context, answers the rest with nothing, and cuts each answer at the eos."""

    def __init__(
        self,
        run: Callable[[list[list[int]], list[int]], list[list[int]]],
        step: Callable[[Requests], dict[int, list[int]]],
        eos: int,
        max_positions: int,
        rows: Callable[[int], int] = lambda length: 0,
    ):
        self._run, self._step, self.eos, self.max_positions = run, step, eos, max_positions
        self.rows = rows  # requests of up to `length` tokens the engine serves best at once (0: no preference)

    def _limit(self, prompt: list[int], wanted: int) -> int:
        return max(0, min(wanted, self.max_positions - len(prompt))) if prompt else 0

    def __call__(self, prompts: list[list[int]], max_new_tokens: int | list[int]) -> list[list[int]]:
        """One continuation per prompt, in order; `max_new_tokens` is one limit for all or one per prompt."""
        wanted = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompts)
        limits = [self._limit(p, n) for p, n in zip(prompts, wanted, strict=True)]
        todo = [i for i, n in enumerate(limits) if n > 0]
        outs: list[list[int]] = [[] for _ in prompts]
        if todo:
            done = self._run([list(prompts[i]) for i in todo], [limits[i] for i in todo])
            for i, out in zip(todo, done, strict=True):
                outs[i] = _until_eos(out, self.eos)[: limits[i]]
        return outs

    def stream(self, requests: Requests) -> dict[int, list[int]]:
        """Start `requests` and return those that finished since the last call: at least one, unless nothing
        runs. A request with no room to generate finishes at once, empty."""
        done: dict[int, list[int]] = {}
        todo: Requests = {}
        for key, (prompt, wanted) in requests.items():
            limit = self._limit(prompt, wanted)
            if limit > 0:
                todo[key] = (list(prompt), limit)
            else:
                done[key] = []
        if todo or not done:  # nothing to wait for when some finished at once and none were added
            for key, out in self._step(todo).items():
                done[key] = _until_eos(out, self.eos)
        return done


def resolve_backend(name: str) -> str:
    """`hf` or `vllm`: `auto` is vllm where it is installed, else hf."""
    name = getattr(name, "value", name)  # a config enum (lab.config.Generator) as well as a string
    if name not in BACKENDS:
        raise ValueError(f"unknown generation backend '{name}' (expected one of {', '.join(BACKENDS)})")
    if name == "auto":
        return "vllm" if importlib.util.find_spec("vllm") is not None else "hf"
    return name


def resolve_kv_cache(name: str, device: torch.device) -> str:
    """`dynamic` or `static`: `auto` is static on CUDA (the step captured in CUDA graphs), else dynamic."""
    name = getattr(name, "value", name)  # a config enum (lab.config.KvCache) as well as a string
    if name not in KV_CACHES:
        raise ValueError(f"unknown KV cache '{name}' (expected one of {', '.join(KV_CACHES)})")
    if name == "auto":
        return "static" if device.type == "cuda" else "dynamic"
    return name


def resolve_dtype(dtype: str) -> str:
    """vLLM's dtype: `auto` is bfloat16 on a GPU or a CPU with bf16 instructions (AVX512-BF16, AMX), else
    float32: a CPU without them only emulates bfloat16, and vLLM runs several times slower in it
    (docs/benchmarks.md#regeneration-backends)."""
    if dtype != "auto":
        return dtype
    if torch.cuda.is_available():
        return "bfloat16"
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "bfloat16"
    return "bfloat16" if "avx512_bf16" in flags or "amx_bf16" in flags else "float32"


@contextlib.contextmanager
def open_generator(
    target: Any,
    backend: str = "auto",
    threads: int | None = None,
    progress: bool = True,
    dtype: str = "auto",
    log_path: str | Path | None = None,
    kv_cache_gib: float = VLLM_KV_CACHE_GIB,
    kv_cache: str = "auto",
) -> Iterator[Greedy]:
    """A `Greedy` generator over `target` (lab.target.Target) for the body of the context. `dtype` and
    `kv_cache_gib` are vLLM's (hf uses the loaded model as it is, on its device and in its dtype;
    `dtype="auto"`: see resolve_dtype), `kv_cache` is hf's (`resolve_kv_cache`); `progress` shows a bar over each
    call's prompts (hf only: vLLM's would go to its log). The vLLM worker's output goes to `log_path` (default: a
    temp file, removed after a clean run), which a RuntimeError from a failed worker names.

    - `hf`: prompts are sorted by length and left-padded into batches of `HF_BATCH` (on a GPU, as many as its
      memory holds), then decoded by `greedy_batch` over one of two caches: `dynamic`, transformers'
      `DynamicCache`, dropping finished rows from the batch and the cache (on a CPU the cost of a step grows with
      its rows, and answers end at very different lengths); or `static`, a `StaticCache` padded to fixed buckets
      with the step captured in CUDA graphs on a GPU (lab/target/static_decode.py), where a step costs about the
      same whatever its rows. Both give the same tokens, deterministically (argmax, fixed shapes for the same
      inputs). Its `stream` answers every request it holds before it returns: a batch cannot take new rows
      halfway.
    - `vllm`: ONE worker process (`python -m lab.target.vllm_generate`) for the life of the context, however
      many batches follow. This module never imports vllm: only worker modules, each in its own process, do
      (vLLM's CPU engine binds threads and keeps global state for the life of a process). Its `stream` steps
      vLLM's engine until a request finishes."""
    backend = resolve_backend(backend)
    eos = target.tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the target's tokenizer has no eos token: greedy answers would never stop")
    max_positions = int(target.model.config.max_position_embeddings)

    if backend == "hf":
        previous = torch.get_num_threads()
        if threads:
            torch.set_num_threads(threads)
        cache = resolve_kv_cache(kv_cache, target.device)

        def run(prompts: list[list[int]], limits: list[int]) -> list[list[int]]:
            return _hf_generate(target.model, prompts, limits, eos, progress, cache)

        def step(requests: Requests) -> dict[int, list[int]]:  # answers them all: nothing is left running
            keys = list(requests)
            return dict(zip(keys, run([requests[k][0] for k in keys], [requests[k][1] for k in keys]), strict=True))

        try:
            # on a CPU, no preference: regeneration's pool stays at its chunk size
            rows = (lambda n: _batch_rows(target.model, n, cache)) if target.device.type == "cuda" else (lambda n: 0)
            yield Greedy(run, step, eos, max_positions, rows)
        finally:
            torch.set_num_threads(previous)
        return

    job = {
        "target": str(target.path),
        "dtype": resolve_dtype(dtype),
        "max_model_len": max_positions,
        "max_num_seqs": VLLM_MAX_NUM_SEQS,
        "kv_cache_gib": kv_cache_gib,
        "threads": threads,
        "eos": eos,
        "seed": 0,
    }
    job["engine_options"] = vllm_engine_options(target.path, job["dtype"], cpu=not torch.cuda.is_available())
    with _VllmWorker(job, log_path) as worker:
        yield Greedy(worker.generate, worker.step, eos, max_positions)


def vllm_token_logprobs(
    target: Any,
    sequences: list[list[int]],
    engine_options: dict | None = None,
    threads: int | None = None,
    dtype: str = "float32",
    log_path: str | Path | None = None,
) -> list[list[float]]:
    """vLLM's log-probability of each token of each sequence after its first, given those before it (its
    prompt logprobs), from a vllm worker over `target`'s folder: with the workbench's engine settings for
    it, or `engine_options` in their place. `hf_token_logprobs` is the transformers side."""
    job = {
        "target": str(target.path),
        "dtype": resolve_dtype(dtype),
        "max_model_len": int(target.model.config.max_position_embeddings),
        "max_num_seqs": VLLM_MAX_NUM_SEQS,
        "kv_cache_gib": 1,
        "threads": threads,
        "eos": target.tokenizer.eos_token_id,
        "seed": 0,
    }
    if engine_options is None:
        engine_options = vllm_engine_options(target.path, job["dtype"], cpu=not torch.cuda.is_available())
    job["engine_options"] = engine_options
    with _VllmWorker(job, log_path) as worker:
        return worker.score(sequences)


@torch.no_grad()
def hf_token_logprobs(model: Any, sequences: list[list[int]]) -> list[list[float]]:
    """The transformers model's log-probability of each token of each sequence after its first (one
    unpadded forward per sequence)."""
    device = model.get_output_embeddings().weight.device
    out = []
    for ids in sequences:
        x = torch.tensor([ids], device=device)
        logprobs = torch.log_softmax(model(x).logits[0, :-1].float(), dim=-1)
        out.append(logprobs.gather(-1, x[0, 1:, None])[:, 0].tolist())
    return out


def _until_eos(ids: list[int], eos: int) -> list[int]:
    return ids[: ids.index(eos)] if eos in ids else ids


# ---------------------------------------------------------------- hf


def hf_batch_rows(config: Any, dtype: torch.dtype, length: int, free_bytes: int | None) -> int:
    """Rows of one `greedy_batch` whose sequences reach `length` tokens: HF_BATCH on a CPU (`free_bytes` None),
    where a step's cost grows with its rows; on a GPU, where a step costs about the same for 16 rows or 256
    (its time is launch overhead), as many as half the free memory holds: each row's KV cache at full length,
    its prompt's widest activations (the MLP's) and its last logits, capped at HF_BATCH_MAX."""
    if free_bytes is None:
        return HF_BATCH
    size = torch.tensor([], dtype=dtype).element_size()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    kv = 2 * config.num_hidden_layers * kv_heads * head_dim * size * length
    activations = length * (4 * config.hidden_size + 3 * config.intermediate_size) * size
    per_row = kv + activations + 4 * config.vocab_size
    return max(HF_BATCH, min(HF_BATCH_MAX, free_bytes // 2 // per_row))


def _batch_rows(model: Any, length: int, cache: str = "dynamic") -> int:
    """`hf_batch_rows` for `model` on its device (the free memory read where it is a GPU); with a static cache,
    for its bucket's length and rounded down to a bucket of rows, so that only a last batch is padded."""
    weight = model.get_output_embeddings().weight
    free = torch.cuda.mem_get_info(weight.device)[0] if weight.device.type == "cuda" else None
    if cache != "static":
        return hf_batch_rows(model.config, weight.dtype, length, free)
    rows = hf_batch_rows(model.config, weight.dtype, static_decode.length_bucket(length), free)
    return static_decode.rows_at_most(rows)


def _hf_generate(
    model: Any, prompts: list[list[int]], limits: list[int], eos: int, progress: bool, cache: str = "dynamic"
) -> list[list[int]]:
    """Batches of similar length (less padding), longest first, so a memory or length problem shows at once;
    as many rows a batch as `hf_batch_rows` says the device holds."""
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    outs: list[list[int]] = [[] for _ in prompts]
    batch = _batch_rows(model, max((len(p) + n for p, n in zip(prompts, limits, strict=True)), default=1), cache)
    with tqdm(total=len(prompts), desc="greedy (hf)", unit="prompt", leave=False, disable=not progress) as bar:
        for start in range(0, len(order), batch):
            rows = order[start : start + batch]
            done = greedy_batch(model, [prompts[i] for i in rows], [limits[i] for i in rows], eos, cache)
            for i, out in zip(rows, done, strict=True):
                outs[i] = out
            bar.update(len(rows))
    return outs


def greedy_batch(
    model: Any, prompts: list[list[int]], limits: list[int], eos: int, kv_cache: str = "auto"
) -> list[list[int]]:
    """Greedy continuations of left-padded `prompts` (row i stops at eos, excluded, or after limits[i] tokens),
    one forward per step; over a static cache in CUDA graphs (`kv_cache` static, or auto on CUDA:
    lab/target/static_decode.py), else a dynamic one holding only the rows still running."""
    device = model.get_output_embeddings().weight.device
    if resolve_kv_cache(kv_cache, device) == "static":
        return static_decode.static_greedy_batch(model, prompts, limits, eos)
    return _dynamic_greedy_batch(model, prompts, limits, eos)


@torch.inference_mode()
def _dynamic_greedy_batch(model: Any, prompts: list[list[int]], limits: list[int], eos: int) -> list[list[int]]:
    from transformers import DynamicCache

    n, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros((n, width), dtype=torch.long)  # the pad id never matters: masked out
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    device = model.get_output_embeddings().weight.device
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    outs: list[list[int]] = [[] for _ in prompts]
    alive = list(range(n))  # the original row of each row still in the batch
    step_ids = ids
    while alive:
        logits = model(
            input_ids=step_ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,  # the prompt's full-vocabulary logits are never needed
        ).logits[:, -1]
        next_ids = logits.argmax(-1)  # the next step's input, on the device: read once, never uploaded
        tokens = next_ids.tolist()
        keep = []
        for j, row in enumerate(alive):
            if tokens[j] == eos:
                continue
            outs[row].append(tokens[j])
            if len(outs[row]) < limits[row]:
                keep.append(j)
        if len(keep) < len(alive):
            if not keep:
                break
            index = torch.tensor(keep, device=device)
            cache.batch_select_indices(index)
            mask = mask[index]
            alive = [alive[j] for j in keep]
            next_ids = next_ids[index]
        positions = mask.sum(-1, keepdim=True)  # the new token's position: the real tokens before it
        mask = torch.cat([mask, torch.ones((len(alive), 1), dtype=torch.long, device=device)], dim=1)
        step_ids = next_ids[:, None]
    return outs


# ---------------------------------------------------------------- vllm


class _VllmWorker:
    """The worker process: JSON lines in on its stdin, JSON lines out on its stdout (the worker points every
    other write to stdout at its stderr, which goes to the log)."""

    def __init__(self, job: dict, log_path: str | Path | None):
        self.job = job
        self.own_log = log_path is None
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix="lab-vllm-generate-", suffix=".log")
            os.close(fd)
            log_path = name
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen | None = None
        self.failed = False

    def __enter__(self) -> _VllmWorker:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # a named log is appended to: a resumed build keeps the earlier runs' lines (their timings)
        self.log = open(self.log_path, "a")
        self.log_start = self.log.tell()
        cmd = [sys.executable, "-m", "lab.target.vllm_generate", json.dumps(self.job)]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, env=_worker_env(self.job)
        )
        try:
            ready = self._read()
            if not ready.get("ready"):
                self._fail(f"vLLM generation worker did not start: {ready.get('error', ready)}")
        except BaseException as exc:
            self.__exit__(type(exc), exc, exc.__traceback__)  # `with` calls no __exit__ when __enter__ fails
            raise
        return self

    def generate(self, prompts: list[list[int]], limits: list[int]) -> list[list[int]]:
        self._send({"prompts": prompts, "max_tokens": limits})
        reply = self._read()
        if "outputs" not in reply:
            self._fail(f"vLLM generation failed: {reply.get('error', reply)}")
        return reply["outputs"]

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        self._send({"score": sequences})
        reply = self._read()
        if "logprobs" not in reply:
            self._fail(f"vLLM scoring failed: {reply.get('error', reply)}")
        return reply["logprobs"]

    def step(self, requests: Requests) -> dict[int, list[int]]:
        self._send({"add": [[key, prompt, limit] for key, (prompt, limit) in requests.items()]})
        reply = self._read()
        if "finished" not in reply:
            self._fail(f"vLLM generation failed: {reply.get('error', reply)}")
        return {key: out for key, out in reply["finished"]}

    def _send(self, message: dict) -> None:
        try:
            self.proc.stdin.write(json.dumps(message) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self._exited()

    def _exited(self) -> None:
        self.proc.wait()
        why = last_error_line(self.log_path, self.log_start)
        self._fail(f"vLLM generation worker exited with {self.proc.returncode}: {why}")

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self._exited()
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            self._fail(f"vLLM generation worker wrote something unexpected: {line[:200]!r}")

    def _fail(self, message: str) -> None:
        self.failed = True
        raise RuntimeError(f"{message} (log: {self.log_path})")

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if self.proc.poll() is None:
                if exc_type is not None:
                    self.proc.kill()  # the caller gave up: the batch under way is wanted no more
                with contextlib.suppress(BrokenPipeError, OSError):
                    self.proc.stdin.close()  # the worker's signal to exit
                try:
                    self.proc.wait(timeout=WORKER_EXIT_S)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        finally:
            self.proc.stdout.close()
            self.log.close()
        if self.own_log and not self.failed and exc_type is None:
            self.log_path.unlink(missing_ok=True)


def _worker_env(job: dict) -> dict[str, str]:
    """The environment the worker starts in. OpenMP reads its thread count once, when the library loads,
    and the worker imports torch (through `lab`) before it could set anything itself: one thread too many
    on a busy machine makes every step spin-wait, many times slower."""
    from lab.target.vllm_generate import engine_environment

    # the worker must import this checkout's `lab`, wherever the caller runs from
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    return engine_environment(job, env)
