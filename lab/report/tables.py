"""Ablation tables from MLflow alone: AL per arm x suite (mean +- std over seeds), rollout accuracy,
and the drift numbers (sink / self attention mass at the first and deepest drafting step, norm growth)."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from lab import track


@dataclass
class ArmRuns:
    name: str
    label: str
    runs: list = field(default_factory=list)  # MLflow runs (FINISHED children)


def _mean_std(values: list[float]) -> str:
    if not values:
        return "-"
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} ± {std:.3f}"


def _param(run, key: str, default: str = "") -> str:
    return run.data.params.get(key, default)


def collect(uri: str, parent_run_id: str, arms: list[tuple[str, str]]) -> list[ArmRuns]:
    """FINISHED child runs of the parent, grouped by arm in the experiment's order."""
    groups = {name: ArmRuns(name, label) for name, label in arms}
    for run in track.child_runs(uri, parent_run_id, status="FINISHED"):
        arm = run.data.tags.get("arm")
        if arm in groups:
            groups[arm].runs.append(run)
    return list(groups.values())


def markdown(uri: str, groups: list[ArmRuns], baseline: str) -> str:
    """The arms x suites AL table, the rollout table and the drift table, as Markdown."""
    runs = [r for g in groups for r in g.runs]
    if not runs:
        return "(no finished runs)"
    suites = json.loads(_param(runs[0], "eval.suites", "[]"))
    ks = json.loads(_param(runs[0], "eval.num_speculative_tokens", "[]"))
    depths = sorted(({int(_param(r, "train.ttt_length", "0")) for r in runs} & set(ks)) | {max(ks)})
    base = next((g for g in groups if g.name == baseline), None)

    def al(g: ArmRuns, suite: str, k: int) -> list[float]:
        key = f"eval/{suite}/ref/k{k}/al"
        return [r.data.metrics[key] for r in g.runs if key in r.data.metrics]

    head = ["arm", "n"] + [f"{s} k={k}" for s in suites for k in depths]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for g in groups:
        cells = [g.label, str(len(g.runs))]
        for s in suites:
            for k in depths:
                values, cell = al(g, s, k), _mean_std(al(g, s, k))
                if base is not None and g is not base and values and al(base, s, k):
                    change = statistics.mean(values) / statistics.mean(al(base, s, k)) - 1
                    cell += f" ({change:+.1%})"
                cells.append(cell)
        lines.append("| " + " | ".join(cells) + " |")
    tables = ["AL (mean ± std over seeds; change vs " + (base.label if base else baseline) + ")", *lines]

    kmax = max(ks)

    def curves(g: ArmRuns, key: str) -> list[list[float]]:
        return [c for r in g.runs if (c := track.metric_curve(uri, r.info.run_id, key))]

    def at(g: ArmRuns, key: str, step: int) -> str:
        return _mean_std([c[step - 1] for c in curves(g, key)])

    head = ["arm", "suite", "sink k=1", f"sink k={kmax}", "self k=1", f"self k={kmax}", f"norm growth k={kmax}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for g in groups:
        for s in suites:
            d = f"drift/{s}/k{kmax}"
            cells = [g.label, s, at(g, f"{d}/sink_mass", 1), at(g, f"{d}/sink_mass", kmax)]
            cells += [at(g, f"{d}/self_mass", 1), at(g, f"{d}/self_mass", kmax), at(g, f"{d}/norm_growth", kmax)]
            lines.append("| " + " | ".join(cells) + " |")
    tables += ["", f"Drift along the speculation chain (drafting step 1 and k={kmax})", *lines]

    head = ["arm", "rollout acc at depth 1", "rollout acc at the deepest depth", "fc_share per captured layer"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for g in groups:
        rollout = curves(g, "eval/in_dist/rollout/acc")
        shares = curves(g, "drift/fc_share")
        share = " / ".join(f"{statistics.mean(col):.2f}" for col in zip(*shares, strict=True)) if shares else "-"
        depth = len(rollout[0]) if rollout else 0
        lines.append(
            f"| {g.label} | {at(g, 'eval/in_dist/rollout/acc', 1)} | "
            f"{at(g, 'eval/in_dist/rollout/acc', depth) if depth else '-'} (depth {depth}) | {share} |"
        )
    tables += ["", "Teacher-forced rollout accuracy (held-out conversations) and fc shares", *lines]
    return "\n".join(tables)


def write_summary(
    uri: str,
    parent_run_id: str,
    name: str,
    description: str,
    arms: list[tuple[str, str]],
    baseline: str,
    folder: Path = Path("reports"),
) -> tuple[Path, str]:
    """The study's tables as `reports/NAME/summary.md` and as `summary.md` on its parent run."""
    table = markdown(uri, collect(uri, parent_run_id, arms), baseline)
    text = f"# {name}: {description}\n\nParent run {parent_run_id}.\n\n{table}\n"
    path = folder / name / "summary.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    track.log_text(uri, parent_run_id, text, "summary.md")
    return path, table
