"""The GPU's code paths on a fake CUDA device, in CI without a GPU: no device mix, no op without a CUDA kernel,
no new host sync per training step or per decoded token (tests/fake_cuda.py says how; the checks are
tests/fake_cuda_checks.py).

The harness patches torch process-wide and for good (a CUDA device guard and CUDA hooks from a C++ shim,
loaded before torch), so it runs in a process of its own: `python tests/fake_cuda.py`, which this test starts
and whose report (the host syncs per training step and per decoded token, and where each one is) it prints.
Without a C++ compiler to build the shim it skips, unless LAB_REQUIRE_FAKE_CUDA=1 (CI), where that fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _checks(*options: str) -> None:
    """Run tests/fake_cuda_checks.py with `options` in a fresh process; print its report; fail with it."""
    import torch

    if torch.version.cuda is not None or torch.version.hip is not None:
        pytest.skip("a CUDA build of torch: the fake device is for CPU builds (tests/test_gpu.py runs on a GPU)")
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        if os.environ.get("LAB_REQUIRE_FAKE_CUDA") == "1":
            pytest.fail("no C++ compiler to build the fake CUDA shim (tests/fake_cuda.py)")
        pytest.skip("no C++ compiler to build the fake CUDA shim (tests/fake_cuda.py)")
    # this checkout's lab first, as in this session (an editable install may point at another one)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "fake_cuda.py"), "-q", "-s", "-p", "no:randomly", *options],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    print(done.stdout[-20000:])
    assert done.returncode == 0, f"tests/fake_cuda_checks.py failed:\n{done.stdout[-12000:]}\n{done.stderr[-4000:]}"


def test_gpu_paths_on_a_fake_cuda_device():
    """Each stage on the fake device (about 30 s), with the host syncs per training step and per decoded token."""
    _checks("-m", "not slow")


@pytest.mark.slow
def test_a_whole_run_on_a_fake_cuda_device():
    """`lab run` end to end on the fake device (about 40 s)."""
    _checks("-m", "slow")
