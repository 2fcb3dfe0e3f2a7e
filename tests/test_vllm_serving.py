"""The vLLM backend's CPU workers, served: one process per lab process imports vLLM once and forks a child per
job (lab/eval/vllm_worker.py `serve`). Against tests/fake_vllm, so that it takes seconds: each job's result
as a fresh worker writes it, one import for several jobs, a failed or timed-out job reported and the next one
served, and a changed environment served by a process of its own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import FAKE_VLLM

from lab.eval import vllm_backend, vllm_worker


def _run(tmp_path: Path, name: str, target: str = "t", timeout_s: float = 120) -> tuple[int, Path]:
    """A small job over `target` through the backend's worker: its exit code and log."""
    job = {
        "target": target, "drafter": "d", "dtype": "float32", "ks": [2], "max_new_tokens": 3, "temperature": 0.0,
        "concurrency": [1], "throughput_suites": [], "max_model_len": 64, "kv_cache_gib": 1, "threads": 1, "seed": 0,
        "suites": [{"name": "s", "prompts": [[5, 6], [7]], "variants": ["a", "a"], "stop_ids": []}],
    }  # fmt: skip
    (tmp_path / f"{name}.json").write_text(json.dumps(job))
    paths, log = [str(tmp_path / f"{name}.json"), str(tmp_path / f"{name}.result.json")], tmp_path / f"{name}.log"
    return vllm_backend._run_worker(job, paths, log, timeout_s, progress=False), log


def _counts(result_path: Path) -> dict:
    """A worker's result less its clock: the counts per suite, depth and variant, and the target's outputs."""
    result = json.loads(result_path.read_text())
    for by_k in result["results"].values():
        for res in by_k.values():
            for variant in res["variants"].values():
                variant.pop("seconds")
    return {"results": result["results"], "outputs": result["outputs"]}


@pytest.fixture
def served(tmp_path, monkeypatch):
    """The backend as on a CPU machine, its workers importing tests/fake_vllm and saying so in `imports`; their
    output unbuffered, as some machines set it (a `print` is then two writes)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("PYTHONUNBUFFERED", "1")
    monkeypatch.setenv("PYTHONPATH", str(FAKE_VLLM))
    monkeypatch.setenv("FAKE_VLLM_IMPORTS", str(tmp_path / "imports"))
    yield tmp_path / "imports"
    vllm_backend.stop_serving()


def test_jobs_are_forked_from_one_process_that_imported_vllm_once(served, tmp_path, monkeypatch):
    assert _run(tmp_path, "first")[0] == 0 and _run(tmp_path, "second")[0] == 0
    (server,) = vllm_backend._served.values()
    assert served.read_text().split() == [str(server.pid)]  # one import, in the serving process
    first = _counts(tmp_path / "first.result.json")
    assert _counts(tmp_path / "second.result.json") == first and first["outputs"] == {"s": [[1, 1, 1], [1, 1, 1]]}

    # what the child wrote is what a worker of its own writes for the same job
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # on CUDA: a process per job
    assert _run(tmp_path, "alone")[0] == 0
    assert _counts(tmp_path / "alone.result.json") == first
    assert len(served.read_text().split()) == 2  # its own import; the serving process stays as it was
    assert list(vllm_backend._served.values()) == [server] and server.poll() is None


def test_a_failed_or_timed_out_job_is_reported_and_the_next_one_served(served, tmp_path, monkeypatch):
    rc, log = _run(tmp_path, "broken", target="broken")
    assert rc == 1 and "fake vllm: cannot load broken" in log.read_text()
    # the job's last line has no newline: the server's `exit` still ends it
    rc, log = _run(tmp_path, "unfinished", target="unfinished")
    assert rc == 3 and log.read_text().endswith("fake vllm: half a line")
    with pytest.raises(vllm_backend.VllmError, match=r"ran past eval.vllm.timeout_s=2; see .*slow.log"):
        _run(tmp_path, "slow", target="slow", timeout_s=2)
    assert _run(tmp_path, "after")[0] == 0 and (tmp_path / "after.result.json").is_file()

    # another environment, another serving process; the previous one ends
    (before,) = vllm_backend._served.values()
    monkeypatch.setenv("LAB_SOMETHING_NEW", "1")
    assert _run(tmp_path, "elsewhere")[0] == 0
    (now,) = vllm_backend._served.values()
    assert now.pid != before.pid and before.wait(timeout=30) is not None


def test_the_worker_refuses_a_bad_command_line(capsys):
    assert vllm_worker.main(["only-one"]) == 2
    assert "usage: python -m lab.eval.vllm_worker" in capsys.readouterr().err
