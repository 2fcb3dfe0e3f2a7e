"""`lab ablate experiment=NAME`: every arm x seed of an experiment as child runs of one parent run.

Resumable: the parent run is found again by the study's key (spec + overrides), and a child that
already FINISHED with the same config hash is skipped, so rerunning after a crash or Ctrl-C only
runs what is missing. A failed child is recorded as FAILED and the study moves on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from lab import track
from lab.config import config_hash
from lab.pipeline import run as run_one
from lab.sweep.experiment import Experiment


@dataclass
class AblationResult:
    parent_run_id: str
    ran: list[tuple[str, int]] = field(default_factory=list)
    skipped: list[tuple[str, int]] = field(default_factory=list)
    failed: dict[tuple[str, int], str] = field(default_factory=dict)
    seconds: float = 0.0


class Progress:
    """The arms x seeds grid with each run's state, printed as runs start, change stage and end."""

    def __init__(self, exp: Experiment, total: int):
        self.exp, self.total = exp, total
        self.state: dict[tuple[str, int], str] = {(a.name, s): "." for a in exp.arms for s in exp.seeds}
        self.started = time.time()

    def set(self, arm: str, seed: int, state: str) -> None:
        self.state[(arm, seed)] = state

    def line(self, arm: str, seed: int, stage: str) -> None:
        done = sum(v in ("done", "skip") for v in self.state.values())
        elapsed = time.time() - self.started
        print(f"[{done}/{self.total} done, {elapsed / 60:.1f} min] {arm} seed {seed}: {stage}", flush=True)

    def grid(self) -> str:
        width = max(len(a.name) for a in self.exp.arms)
        rows = [" " * width + "".join(f"  seed {s:<6}" for s in self.exp.seeds)]
        for arm in self.exp.arms:
            rows.append(arm.name.ljust(width) + "".join(f"  {self.state[(arm.name, s)]:<11}" for s in self.exp.seeds))
        return "\n".join(rows)


def ablate(exp: Experiment, extra: list[str], progress: bool = True) -> AblationResult:
    configs = exp.compose_all(extra)  # every arm x seed validates before anything runs
    first = next(iter(configs.values()))
    t = first.tracking
    key = exp.key(extra)
    started = time.time()
    board = Progress(exp, len(configs))
    tags = {"study": exp.name, "git_commit": track.git_commit(), "experiment": exp.name}
    with track.parent_run(t.uri, t.artifact_root, exp.name, f"ablate-{exp.name}", key, tags) as parent:
        parent.log_params({"experiment.overrides": exp.overrides, "experiment.seeds": exp.seeds, "overrides": extra})
        result = AblationResult(parent.id)
        finished = {
            (r.data.tags.get("arm"), r.data.tags.get("seed"), r.data.tags.get("config_hash"))
            for r in track.child_runs(t.uri, parent.id, status="FINISHED")
        }
        for (arm, seed), cfg in configs.items():
            if (arm, str(seed), config_hash(cfg)) in finished:
                board.set(arm, seed, "skip")
                result.skipped.append((arm, seed))
        print(
            f"ablation {exp.name}: {len(exp.arms)} arms x {len(exp.seeds)} seeds, "
            f"{len(result.skipped)} already finished (parent run {parent.id})\n{board.grid()}",
            flush=True,
        )
        for (arm, seed), cfg in configs.items():
            if (arm, seed) in result.skipped:
                continue

            def on_stage(stage: str, arm: str = arm, seed: int = seed) -> None:
                board.set(arm, seed, stage.split()[0] if stage.startswith("eval") else stage)
                board.line(arm, seed, stage)

            try:
                run_one(cfg, progress=progress, parent_run_id=parent.id, on_stage=on_stage)
            except (RuntimeError, ValueError, FloatingPointError) as exc:  # recorded FAILED; the study goes on
                board.set(arm, seed, "FAILED")
                result.failed[(arm, seed)] = f"{type(exc).__name__}: {exc}"
                print(f"{arm} seed {seed} failed: {exc}", flush=True)
                continue
            board.set(arm, seed, "done")
            result.ran.append((arm, seed))
            board.line(arm, seed, "done")
            print(board.grid(), flush=True)
        result.seconds = time.time() - started
        parent.log_metrics({"ablate/seconds": result.seconds, "ablate/failed": len(result.failed)})
    return result
