"""A test's hold on training, in every Python process started with this folder on PYTHONPATH (Python imports
`sitecustomize` at startup; tests/helpers.py `hold_training` sets both): with LAB_HOLD_AFTER_STEP=C:N:FILE, the
trainer (lab/train/ttt.py) stops after its N-th step of its C-th call in the process, creates FILE and waits
there until Ctrl-C (or a kill),
so that a test interrupts training at a point it controls however fast the machine trains. It reaches the
`lab` processes a command starts itself (a sweep's workers) through their inherited environment; lab has no
such hook of its own.

It replaces lab.train.resume's `StopRequest` as that module loads (lab's `after_import`; before lab/train/ttt.py
imports it) with one whose `requested` holds on its N-th read: the trainer reads it once after each step it
finishes, where it decides on writing a resume state. A change there that moves the hold fails the tests that use
it (the file never comes, or the interrupt lands elsewhere than they check)."""

from __future__ import annotations

import os
import time
from pathlib import Path

HOLD_ENV = "LAB_HOLD_AFTER_STEP"  # tests/helpers.py `hold_training` sets it
RESUME = "lab.train.resume"


def _held(base: type) -> type:
    call, step, flag = os.environ[HOLD_ENV].split(":", 2)

    class HeldStopRequest(base):
        calls = 0  # the trainer's calls in this process so far (a sweep's trials run one after another)

        def __init__(self) -> None:
            HeldStopRequest.calls += 1
            self._steps, self._requested = 0, False
            self._held = HeldStopRequest.calls != int(call)  # only the call-th training holds
            super().__init__()

        @property
        def requested(self) -> bool:
            self._steps += 1
            if self._steps == int(step) and not self._held:
                self._held = True
                Path(flag).touch()
                while not self._requested:  # until the SIGINT handler (`_handle`) sets it
                    time.sleep(0.05)
            return self._requested

        @requested.setter
        def requested(self, value: bool) -> None:
            self._requested = value

        def _handle(self, signum, frame) -> None:
            self._steps -= 1  # the handler's own read of `requested` is no finished step
            super()._handle(signum, frame)

    return HeldStopRequest


def _patch_resume(module) -> None:
    module.StopRequest = _held(module.StopRequest)


if os.environ.get(HOLD_ENV):
    from lab import after_import  # replaces StopRequest as lab.train.resume loads (lab/__init__.py)

    after_import(RESUME, _patch_resume)
