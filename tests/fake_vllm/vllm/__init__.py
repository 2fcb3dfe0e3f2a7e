"""Just enough of vLLM's API for lab/eval/vllm_worker.py, importable by a worker process (tests/fake_vllm on its
PYTHONPATH): engines that echo a fixed answer and count drafts like a speculative engine. A model path holding
`broken` fails to load, one holding `slow` never finishes loading, and one holding `unfinished` writes half a line
and exits with code 3. Each import appends this process's pid to the file $FAKE_VLLM_IMPORTS, where set."""

import os
import sys
import time
from types import SimpleNamespace

from vllm import inputs  # noqa: F401  # `vllm.inputs`, as the real package has it

__version__ = "0.0-fake"

if os.environ.get("FAKE_VLLM_IMPORTS"):
    with open(os.environ["FAKE_VLLM_IMPORTS"], "a") as f:
        f.write(f"{os.getpid()}\n")


def SamplingParams(**kw):  # noqa: N802  # vLLM's class name
    return SimpleNamespace(**kw)


class LLM:
    def __init__(self, model: str, speculative_config: dict | None = None, **engine):
        if "broken" in model:
            raise RuntimeError(f"fake vllm: cannot load {model}")
        if "slow" in model:
            time.sleep(3600)
        if "unfinished" in model:
            os.write(sys.stdout.fileno(), b"fake vllm: half a line")
            os._exit(3)
        self.calls = 0

    def generate(self, prompts, params, use_tqdm=False):
        self.calls += 1
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[1] * params.max_tokens)]) for _ in prompts]

    def get_metrics(self):
        n = self.calls
        return [
            SimpleNamespace(name="vllm:spec_decode_num_drafts", value=10 * n),
            SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens", value=5 * n),
            SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=[3 * n, 2 * n]),
        ]
