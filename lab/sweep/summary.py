"""What a study leaves on its MLflow parent run: the spec as params, the Markdown summary (best trials first,
the hidden-state cache's saving), the totals as metrics and every trial's record."""

from __future__ import annotations

import statistics
from typing import Any

import optuna
from optuna.trial import TrialState

from lab import metrics as metric_keys
from lab import track
from lab.config import redact
from lab.sweep import optuna_adapter as adapter
from lab.sweep.queue import counts
from lab.sweep.search_space import Sweep, changing_results
from lab.sweep.storage import Session


def fmt(sweep: Sweep, values: list[float]) -> str:
    """Objective values as `metric value, ...`."""
    return ", ".join(f"{o.metric} {v:.3f}" for o, v in zip(sweep.objectives, values, strict=True))


def spec_params(sweep: Sweep, extra: list[str]) -> dict[str, Any]:
    """The spec as the parent run's params."""
    return {
        "sweep.name": sweep.name,
        "sweep.space": {p.name: p.choices or [p.low, p.high] for p in sweep.space},
        "sweep.sampler": sweep.sampler,
        "sweep.pruner": sweep.pruner,
        "sweep.objectives": [f"{o.direction} {o.metric} ({o.reduce})" for o in sweep.objectives],
        "sweep.seeds": sweep.seeds,
        "sweep.overrides": sweep.overrides + changing_results(extra),
    }


def study_span(s: Session) -> tuple[float, int]:
    """Seconds from the first trial's start to the last one's end, and how many workers ran trials."""
    trials = [t for t in s.trials() if t.datetime_start and t.datetime_complete]
    if not trials:
        return 0.0, 0
    span = max(t.datetime_complete for t in trials) - min(t.datetime_start for t in trials)
    return span.total_seconds(), len({t.user_attrs.get("worker") for t in trials})


def finish(s: Session, seconds: float, workers: int) -> str:
    """The study's summary, totals and trial records on its parent run; returns the summary."""
    text, metrics = summary(s, seconds, workers)
    track.log_metrics(s.uri, s.parent_run_id, metrics)
    track.log_dict(s.uri, s.parent_run_id, {"trials": trial_records(s)}, "sweep/trials.json")
    track.log_text(s.uri, s.parent_run_id, text, "sweep/summary.md")
    return text


def trial_records(s: Session) -> list[dict[str, Any]]:
    return [
        {
            "number": t.number,
            "state": t.state.name,
            "params": t.params,
            "values": t.values,
            **{k: v for k, v in t.user_attrs.items() if k != "heartbeat"},
        }
        for t in s.trials()
    ]


def summary(s: Session, seconds: float, workers: int) -> tuple[str, dict[str, float]]:
    """The study as Markdown (best trials first, the cache's saving) and the parent run's metrics."""
    sweep, trials = s.sweep, s.trials()
    c = counts(s)
    single = len(sweep.objectives) == 1
    lines = [
        f"# Sweep {sweep.name}",
        "",
        sweep.description,
        "",
        f"Optuna study `{s.study.study_name}` in `{redact(s.storage_url)}`; MLflow parent run `{s.parent_run_id}`.",
        f"Budget {s.user_attr('budget')} trials: {c['complete']} complete, {c['pruned']} pruned, "
        f"{c['failed']} failed, {c['running'] + c['waiting']} not finished. "
        f"Wall time {seconds / 60:.1f} min with {workers} worker(s).",
        "",
    ]
    metrics = {
        metric_keys.sweep_stat("complete"): float(c["complete"]),
        metric_keys.sweep_stat("pruned"): float(c["pruned"]),
        metric_keys.sweep_stat("failed"): float(c["failed"]),
        metric_keys.sweep_stat("seconds"): seconds,
        metric_keys.sweep_stat("workers"): float(workers),
    }
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    if complete:
        front = {t.number for t in s.study.best_trials}
        sign = [1 if o.direction == "maximize" else -1 for o in sweep.objectives]
        complete.sort(key=lambda t: (t.number not in front, -sign[0] * t.values[0]))
        best = complete[0]
        what = "Best trial" if single else f"Pareto front: trials {', '.join(map(str, sorted(front)))}; first"
        lines.append(
            f"{what}: {best.number} ({best.user_attrs.get('arm')}, seed {best.user_attrs.get('seed')}): "
            f"{fmt(sweep, best.values)}; MLflow run `{best.user_attrs.get('mlflow_run_id', '')}`."
        )
        if single:
            metrics[metric_keys.sweep_stat("best_value")] = best.values[0]
        lines.append("")
    head = ["trial", "state", "point", "seed", *(o.metric for o in sweep.objectives), "min", "MLflow run"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rest = [t for t in trials if t.state != TrialState.COMPLETE and t.state != TrialState.WAITING]
    retried = adapter.retried(trials)
    for t in complete + rest:
        vals = [f"{v:.3f}" for v in t.values] if t.values else ["-"] * len(sweep.objectives)
        minutes = f"{t.user_attrs['seconds'] / 60:.1f}" if "seconds" in t.user_attrs else "-"
        note = " (reused)" if t.user_attrs.get("reused") else " (retried)" if t.number in retried else ""
        state = t.state.name + note
        row = [str(t.number), state, str(t.user_attrs.get("arm", "")), str(t.user_attrs.get("seed", "")), *vals]
        lines.append("| " + " | ".join([*row, minutes, str(t.user_attrs.get("mlflow_run_id", ""))[:12]]) + " |")
    cache_line, cache_metrics = _cache_saving(complete)
    metrics.update(cache_metrics)
    lines += ["", cache_line]
    return "\n".join(lines) + "\n", metrics


def _cache_saving(trials: list[optuna.trial.FrozenTrial]) -> tuple[str, dict[str, float]]:
    """What the shared hidden-state cache saved each trial that found it built: its build time minus the load."""
    ran = [t for t in trials if "cache_s" in t.user_attrs]
    hits = [t for t in ran if t.user_attrs["cache_hit"]]
    builds = [t.user_attrs["cache_build_s"] for t in ran if "cache_build_s" in t.user_attrs]
    if not hits or not builds:
        return "Hidden-state cache: no trial of this study loaded a cache entry with a known build time.", {}
    build = statistics.median(builds)
    load = statistics.mean(t.user_attrs["cache_s"] for t in hits)
    trial_s = statistics.mean(t.user_attrs["seconds"] for t in hits)
    saving = build - load
    share = saving / (trial_s + saving)
    line = (
        f"Hidden-state cache: built once in {build:.1f} s; {len(hits)} of {len(ran)} trials loaded it instead "
        f"(in {load:.2f} s), saving {saving:.1f} s per trial: {share:.0%} of the {trial_s + saving:.0f} s such a "
        f"trial would take without the cache."
    )
    return line, {
        metric_keys.sweep_stat("cache_build_s"): build,
        metric_keys.sweep_stat("cache_load_s"): load,
        metric_keys.sweep_stat("cache_saving_s"): saving,
        metric_keys.sweep_stat("cache_saving_share"): share,
    }
