"""A finished (or partly finished) study as the report sees it: read from MLflow alone.

Runs are grouped by arm in the experiment's order; within an arm, one run per seed (the latest FINISHED
one if a seed was run twice). Runs that did not finish are kept aside, to be counted in a footnote; the
curves they logged while they trained (still running, stopped, failed or pruned) are theirs to draw, marked.
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from lab import metrics as metric_keys
from lab import track


@dataclass
class Arm:
    name: str
    label: str
    runs: list[Any] = field(default_factory=list)  # FINISHED MLflow runs, by seed


@dataclass
class Study:
    uri: str
    name: str  # experiment name (experiments/NAME.yaml)
    description: str
    parent: Any  # the MLflow parent run
    arms: list[Arm]
    baseline: str
    seeds: list[int]  # the seeds the experiment asks for
    left_out: list[Any] = field(default_factory=list)  # runs that failed, were pruned or are still running
    # the seeds of the study's finished runs, before `only_seeds` kept some of them
    recorded_seeds: list[int] = field(default_factory=list)
    _curves: dict[tuple[str, str], list[float]] = field(default_factory=dict, repr=False)
    _records: dict[tuple[str, str], dict | None] = field(default_factory=dict, repr=False)

    @property
    def runs(self) -> list[Any]:
        return [r for a in self.arms for r in a.runs]

    def param(self, key: str, default: str = "") -> str:
        """A config value shared by the study's runs (the first finished run's, else the first unfinished one's)."""
        runs = self.runs or self.left_out
        return runs[0].data.params.get(key, default) if runs else default

    @cached_property
    def suites(self) -> list[str]:
        return json.loads(self.param("eval.suites", "[]"))

    @cached_property
    def ks(self) -> list[int]:
        return sorted(json.loads(self.param("eval.num_speculative_tokens", "[]")))

    @cached_property
    def backends(self) -> list[str]:
        return json.loads(self.param("eval.backends", '["ref"]'))

    @property
    def backend(self) -> str:
        """The backend the tables read AL from: the reference decoder when it ran."""
        return "ref" if "ref" in self.backends else "vllm"

    def variants(self, suite: str) -> list[str]:
        """The suite's variants (templates, context lengths, system prompts) the runs logged, in a
        natural order (L256 before L1024)."""
        # every variant logs its AL at every k: the variant and k of those keys as a pattern
        variant = re.escape(metric_keys.suite_variant(suite, "")) + "([^/]+)"
        pattern = re.compile("^" + metric_keys.acceptance_length(variant, r"\d+", self.backend) + "$")
        found = {m.group(1) for r in self.runs for k in r.data.metrics if (m := pattern.match(k))}
        return sorted(found, key=lambda v: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", v)])

    def scalars(self, arm: Arm, key: str) -> list[float]:
        """The metric's final value in each of the arm's runs that logged it."""
        return [r.data.metrics[key] for r in arm.runs if key in r.data.metrics]

    def curves(self, arm: Arm, key: str) -> list[list[float]]:
        """The metric's curve (values in step order) in each of the arm's runs that logged it."""
        return [self.curve(r, key) for r in arm.runs if key in r.data.metrics]

    def curve(self, run: Any, key: str) -> list[float]:
        """One run's curve of the metric, values in step order (read once)."""
        cache_key = (run.info.run_id, key)
        if cache_key not in self._curves:
            self._curves[cache_key] = track.metric_curve(self.uri, run.info.run_id, key)
        return self._curves[cache_key]

    def unfinished(self, arm: Arm) -> list[Any]:
        """The arm's runs that did not finish (still running, stopped, failed or pruned) and whose seed has no
        finished run: what they logged so far is all there is of that seed."""
        done = {r.data.tags.get("seed") for r in arm.runs}
        return [r for r in self.left_out if r.data.tags.get("arm") == arm.name and r.data.tags.get("seed") not in done]

    def records(self, arm: Arm, name: str) -> dict[str, dict]:
        """The per-prompt records `per_prompt/{name}.json` (a suite's name, `rollout` or `val`) of each of the
        arm's runs that logged them, by seed; runs logged before these records existed have none."""
        out = {}
        for r in arm.runs:
            doc = self.run_records(r, name)
            if doc is not None:
                out[r.data.tags.get("seed", "")] = doc
        return out

    def run_records(self, run: Any, name: str) -> dict | None:
        """One run's `per_prompt/{name}.json` (read once), None when it has none."""
        cache_key = (run.info.run_id, name)
        if cache_key not in self._records:
            self._records[cache_key] = track.run_json(self.uri, run.info.run_id, f"per_prompt/{name}.json")
        return self._records[cache_key]

    def has(self, key: str) -> bool:
        return any(key in r.data.metrics for r in self.runs)

    @property
    def has_drift(self) -> bool:
        """Whether the runs recorded the drift probes (eval.probes)."""
        return bool(self.runs) and self.has(metric_keys.drift(self.suites[0], self.ks[-1], "sink_mass"))

    def gaps(self) -> list[str]:
        """What the study lacks: arms without a finished run, seeds without a finished run."""
        out = []
        for arm in self.arms:
            have = {int(r.data.tags.get("seed", -1)) for r in arm.runs}
            missing = [s for s in self.seeds if s not in have]
            if not arm.runs:
                out.append(f"arm {arm.label} ({arm.name}) has no finished run")
            elif missing:
                seeds = ", ".join(str(s) for s in missing)
                out.append(f"arm {arm.label} ({arm.name}) lacks seed{'s' * (len(missing) > 1)} {seeds}")
        return out

    def left_out_note(self) -> str:
        """One sentence counting the runs left out, by state, naming arm and seed; a run whose arm and seed
        finished later (a retried trial) says so, since the table then holds that seed after all."""
        if not self.left_out:
            return ""
        finished = {(a.name, r.data.tags.get("seed")) for a in self.arms for r in a.runs}
        by_state: dict[str, list[str]] = {}
        for r in self.left_out:
            state = r.data.tags.get("trial_state") or r.info.status
            state = {"FAIL": "FAILED", "KILLED": "stopped"}.get(state, state).lower()
            if (r.data.tags.get("arm"), r.data.tags.get("seed")) in finished:
                state += " then retried"
            by_state.setdefault(state, []).append(f"{r.data.tags.get('arm', '?')} seed {r.data.tags.get('seed', '?')}")
        parts = [f"{len(v)} {k} ({', '.join(sorted(v))})" for k, v in sorted(by_state.items())]
        return f"Left out: {'; '.join(parts)}."


def mean_std(values: list[float]) -> tuple[float, float]:
    if not values:
        return float("nan"), float("nan")
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def load(
    uri: str,
    parent_run_id: str,
    name: str,
    description: str,
    arms: list[tuple[str, str]],
    baseline: str,
    seeds: list[int],
    only_seeds: list[int] | None = None,
) -> Study:
    """The study under `parent_run_id`: its child runs grouped by the `arm` tag, in the given order; with
    `only_seeds` (`lab report --seeds`), the runs of those seeds alone."""
    parent = track.get_run(uri, parent_run_id)
    if "sweep.seeds" in parent.data.params:  # what the study was asked to run (`lab ablate --seeds`)
        seeds = json.loads(parent.data.params["sweep.seeds"])
    if only_seeds is not None:
        seeds = list(only_seeds)
    groups = {n: Arm(n, label) for n, label in arms}
    finished: dict[tuple[str, str], Any] = {}
    left_out = []
    children = sorted(track.child_runs(uri, parent_run_id), key=lambda r: (r.info.start_time or 0, r.info.run_id))
    recorded: set[str] = set()
    for run in children:
        arm, seed = run.data.tags.get("arm"), run.data.tags.get("seed", "")
        if arm not in groups:
            continue
        if run.info.status == "FINISHED":
            recorded.add(seed)
        if only_seeds is not None and seed not in {str(s) for s in only_seeds}:
            continue
        if run.info.status == "FINISHED" and run.data.tags.get("trial_state", "COMPLETE") == "COMPLETE":
            finished[(arm, seed)] = run  # a seed run twice: the later run counts
        else:
            left_out.append(run)
    for (arm, _), run in sorted(finished.items(), key=lambda item: _seed_order(item[0][1])):
        groups[arm].runs.append(run)
    recorded_seeds = sorted(int(s) for s in recorded if s.lstrip("-").isdigit())
    return Study(uri, name, description, parent, list(groups.values()), baseline, seeds, left_out, recorded_seeds)


def _seed_order(seed: str) -> tuple[int, str]:
    return (int(seed), "") if seed.lstrip("-").isdigit() else (0, seed)
