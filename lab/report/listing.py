"""What a store holds, as `lab studies` and `lab runs` print it: every study (its kind, arms, seeds, runs by state
and, once finished, its headline AL) and the runs of one study. Read from MLflow alone, like the reports: the
arms and seeds are those the child runs carry, so a study whose spec file is gone still lists."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

from lab import metrics as metric_keys
from lab import track
from lab.report import tables
from lab.report.study import Arm, Study


@dataclass
class Headline:
    """A finished study's main number: the AL of its best arm at the deepest k of its first suite, and, for an
    ablation, that arm's ratio to the baseline arm with the report's paired bootstrap interval."""

    arm: str
    suite: str
    k: int
    al: float
    al_std: float
    seeds: int
    baseline: str = ""
    ratio: float | None = None
    low: float | None = None
    high: float | None = None

    def said(self) -> str:
        seeds = f"{self.seeds} seed{'s' * (self.seeds != 1)}"
        text = f"{self.arm} AL {self.al:.3f} ± {self.al_std:.3f} ({self.suite} k={self.k}, {seeds})"
        if self.ratio is None:
            return text
        interval = f" [{self.low:.3f}, {self.high:.3f}]" if self.low is not None else ""
        return f"{text}; {self.ratio:.3f}x{interval} over {self.baseline}"


@dataclass
class StudyRow:
    name: str  # the experiment's or sweep's name
    experiment: str  # the MLflow experiment holding it
    kind: str  # ablate | sweep | multirun
    parent_run_id: str
    state: str  # the parent run's status
    started: str  # UTC, to the minute
    arms: list[str] = field(default_factory=list)
    seeds: list[str] = field(default_factory=list)
    runs: dict[str, int] = field(default_factory=dict)  # runs by state
    headline: Headline | None = None

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "headline": asdict(self.headline) if self.headline else None}


@dataclass
class RunRow:
    arm: str
    seed: str
    state: str  # the trial's state where the study recorded one (a pruned run is KILLED), else the run's status
    run_id: str
    config_hash: str
    started: str
    minutes: float | None
    al: float | None  # AL at the deepest k of the first suite, where the run logged it
    error: str = ""


def study_kind(parent: Any) -> str:
    """ablate, sweep or multirun: the parent's tag `study_kind`, or for a parent written without it, an ablation
    when its only parameter is the bundle `arm`."""
    tags = parent.data.tags
    if tags.get("study_kind"):
        return tags["study_kind"]
    space = parent.data.params.get("sweep.space", "")
    return "ablate" if space.startswith("{'arm':") or space.startswith('{"arm":') else "sweep"


def _when(ms: int | None) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M") if ms else ""


def _state(run: Any) -> str:
    trial = run.data.tags.get("trial_state", "")
    return {"PRUNED": "PRUNED", "FAIL": "FAILED"}.get(trial, run.info.status)


def studies(uri: str, headlines: bool = True) -> list[StudyRow]:
    """Every study in the store at `uri`, newest first."""
    rows = []
    for parent in track.all_study_parents(uri):
        children = track.child_runs(uri, parent.info.run_id)
        arms = list(dict.fromkeys(c.data.tags.get("arm", "?") for c in _in_start_order(children)))
        seeds = sorted({c.data.tags.get("seed", "?") for c in children}, key=_seed_order)
        row = StudyRow(
            name=parent.data.tags.get("sweep", parent.info.run_name or "?"),
            experiment=parent.data.tags.get("study", ""),
            kind=study_kind(parent),
            parent_run_id=parent.info.run_id,
            state=parent.info.status,
            started=_when(parent.info.start_time),
            arms=arms,
            seeds=seeds,
            runs=dict(sorted(Counter(_state(c) for c in children).items())),
        )
        if headlines and parent.info.status == "FINISHED":
            row.headline = headline(uri, parent, children)
        rows.append(row)
    return rows


def runs(uri: str, parent: Any) -> list[RunRow]:
    """The child runs of the study under `parent`, in the order they started."""
    out = []
    for run in _in_start_order(track.child_runs(uri, parent.info.run_id)):
        info, tags = run.info, run.data.tags
        minutes = (info.end_time - info.start_time) / 60_000 if info.end_time and info.start_time else None
        out.append(
            RunRow(
                arm=tags.get("arm", "?"),
                seed=tags.get("seed", "?"),
                state=_state(run),
                run_id=info.run_id,
                config_hash=tags.get("config_hash", ""),
                started=_when(info.start_time),
                minutes=minutes,
                al=run.data.metrics.get(_headline_key(run)) if _headline_key(run) else None,
                error=tags.get("error", "")[:200],
            )
        )
    return out


def _headline_key(run: Any) -> str | None:
    """The AL key of the run's first suite at its deepest k, from the backend the reports read."""
    params = run.data.params
    try:
        suites = json.loads(params.get("eval.suites", "[]"))
        ks = json.loads(params.get("eval.num_speculative_tokens", "[]"))
        backends = json.loads(params.get("eval.backends", '["ref"]'))
    except ValueError:
        return None
    if not suites or not ks:
        return None
    return metric_keys.acceptance_length(suites[0], max(ks), "ref" if "ref" in backends else "vllm")


def headline(uri: str, parent: Any, children: list[Any]) -> Headline | None:
    """The study's headline (see `Headline`), None when no run finished with an AL. The baseline of an
    ablation is its first arm (experiments/NAME.yaml's `baseline` where the parent recorded it)."""
    finished = [c for c in children if _state(c) == "FINISHED"]
    if not finished:
        return None
    names = list(dict.fromkeys(c.data.tags.get("arm", "?") for c in _in_start_order(finished)))
    baseline = parent.data.tags.get("baseline") or names[0]
    arms = [Arm(n, n, [c for c in finished if c.data.tags.get("arm") == n]) for n in names]
    seeds = sorted({int(s) for c in finished if (s := c.data.tags.get("seed", "")).lstrip("-").isdigit()})
    study = Study(uri, parent.data.tags.get("sweep", ""), "", parent, arms, baseline, seeds)
    if not study.suites or not study.ks:
        return None
    suite, k = study.suites[0], study.ks[-1]
    key = metric_keys.acceptance_length(suite, k, study.backend)
    table = tables.al_table(study) if study_kind(parent) != "sweep" and len(arms) > 1 else None
    column = study.suites.index(suite) * len(study.ks) + len(study.ks) - 1
    best: Headline | None = None
    for arm in arms:
        values = study.scalars(arm, key)
        if not values:
            continue
        mean = sum(values) / len(values)
        std = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5 if len(values) > 1 else 0.0
        line = Headline(arm.name, suite, k, mean, std, len(values))
        if table is not None and arm.name != baseline:
            cell = next(r for r in table.rows if r.arm == arm.name).cells[column]
            line.baseline = baseline
            if cell.interval is not None:
                line.ratio, line.low, line.high = cell.interval.ratio, cell.interval.low, cell.interval.high
            elif cell.change is not None:
                line.ratio = 1 + cell.change
        if best is None or line.al > best.al:
            best = line
    return best


def _in_start_order(runs: list[Any]) -> list[Any]:
    return sorted(runs, key=lambda r: (r.info.start_time or 0, r.info.run_id))


def _seed_order(seed: str) -> tuple[int, str]:
    return (int(seed), "") if seed.lstrip("-").isdigit() else (0, seed)


def studies_table(rows: list[StudyRow]) -> str:
    """The studies as a Markdown table."""
    lines = [
        "| study | kind | state | started (UTC) | arms | seeds | runs | headline | parent run |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        runs_said = ", ".join(f"{n} {s.lower()}" for s, n in r.runs.items()) or "none"
        lines.append(
            f"| {r.name} | {r.kind} | {r.state.lower()} | {r.started} | {len(r.arms)}: {', '.join(r.arms)} | "
            f"{', '.join(r.seeds)} | {runs_said} | {r.headline.said() if r.headline else ''} | `{r.parent_run_id}` |"
        )
    return "\n".join(lines) + "\n"


def runs_table(rows: list[RunRow]) -> str:
    """One study's runs as a Markdown table."""
    lines = [
        "| arm | seed | state | AL | started (UTC) | minutes | run id | config hash |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        al = f"{r.al:.3f}" if r.al is not None else ""
        minutes = f"{r.minutes:.1f}" if r.minutes is not None else ""
        state = r.state.lower() + (f" ({r.error})" if r.error else "")
        lines.append(
            f"| {r.arm} | {r.seed} | {state} | {al} | {r.started} | {minutes} | `{r.run_id}` | `{r.config_hash}` |"
        )
    return "\n".join(lines) + "\n"
