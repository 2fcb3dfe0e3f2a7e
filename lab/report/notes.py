"""A study as the MLflow UI shows it (`lab ui`): the descriptions of its experiment (what the arms compare, how
it ran, the commands), of its parent run (the report's main table and links to the figures) and of each child
run (its arm in one line), and the saved view of its runs table. `lab ablate` and `lab report` write them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lab import metrics as metric_keys
from lab import track
from lab.report import figures as fig_mod
from lab.report import tables as tab_mod
from lab.report.study import Arm, Study

# a toggle in words; any other key an arm changes is said as `key=value`
WORDS: dict[str, dict[str, str]] = {
    "drafter.fc_norm": {
        "none": "no FC norm",
        "per_layer": "FC norm per captured layer",
        "concat": "one FC norm over the concatenation",
    },
    "drafter.norm_output": {"True": "post-norm feedback", "False": "raw feedback"},
    "drafter.norm_type": {"rmsnorm": "RMSNorm", "layernorm": "LayerNorm"},
    "drafter.attention": {"gqa": "GQA attention", "mla": "MLA attention"},
}
# config groups whose keys can tell arms apart (not where or how a run computes, nor its labels)
COMPARED = ("target.", "data.", "drafter.", "train.", "eval.")
UNCOMPARED = {"drafter.name"}  # a preset's name: the keys it sets are said instead


def arm_toggles(params: Mapping[str, Mapping[str, str]]) -> dict[str, str]:
    """Each arm's settings that differ between the arms (`params`: arm -> its flattened config), in words (empty
    where no setting differs)."""
    found = {k for p in params.values() for k in p if k.startswith(COMPARED) and k not in UNCOMPARED}
    keys = sorted(k for k in found if len({p.get(k) for p in params.values()}) > 1)
    out = {}
    for arm, p in params.items():
        said = [WORDS.get(k, {}).get(p.get(k, ""), f"`{k}={p.get(k, '-')}`") for k in keys]
        out[arm] = ", ".join(said)
    return out


def experiment_note(
    name: str,
    description: str,
    arms: list[tuple[str, str]],
    baseline: str,
    toggles: Mapping[str, str],
    setting: list[str],
    rerun: str,
    rewrite: str,
) -> str:
    """The experiment's description: what it compares (each arm's toggles in words), how its newest study ran
    (`setting`: seeds, profile, target, data... as Markdown bullets), and the commands that rerun it and rewrite
    its report."""
    lines = [f"**{name}**: {description}".rstrip(": "), "", "| arm | what it sets |", "|---|---|"]
    for arm, label in arms:
        base = " (baseline)" if arm == baseline else ""
        lines.append(f"| {label} (`{arm}`){base} | {toggles.get(arm) or '-'} |")
    lines += [
        "",
        *setting,
        f"- Run again (finished runs are kept, missing ones run): `{rerun}`",
        f"- Rewrite its report (tables, figures, these descriptions): `{rewrite}`",
        "- Each study is a parent run `sweep-NAME`: its description holds the report's main table and links to "
        "the figures.",
    ]
    return "\n".join(lines) + "\n"


def _artifact_link(study: Study, path: str) -> str:
    """The UI's page of an artifact of the study's parent run (a link inside a description)."""
    p = study.parent.info
    return f"#/experiments/{p.experiment_id}/runs/{p.run_id}/artifacts/{path}"


def headline(study: Study) -> tuple[str, int] | None:
    """(suite, k) of the AL a one-line description gives: the first suite at the smallest k, as the main table."""
    return (study.suites[0], study.ks[0]) if study.runs and study.suites and study.ks else None


def _al(study: Study, arm: Arm) -> str:
    first = headline(study)
    if first is None:
        return "-"
    values = study.scalars(arm, metric_keys.acceptance_length(*first, study.backend))
    return f"{sum(values) / len(values):.3f}" if values else "-"


def done(study: Study) -> tuple[int, int]:
    """(finished runs, runs the study asks for): one per arm and seed."""
    asked = {str(s) for s in study.seeds}
    finished = sum(1 for a in study.arms for r in a.runs if r.data.tags.get("seed") in asked)
    return finished, len(study.arms) * len(study.seeds)


def parent_note(
    study: Study, tables: list[tab_mod.Table], figures: list[fig_mod.Figure], rerun: str, rewrite: str
) -> str:
    """The parent run's description: a first line saying how far the study is and each arm's headline AL (plain
    text: the runs table shows its start), links to the figures in its artifacts, the report's main table."""
    n, budget = done(study)
    state = f"all {budget} runs done" if n >= budget else f"{n} of {budget} runs done (the table covers those)"
    first = headline(study)
    arms = ", ".join(f"{a.label} {_al(study, a)}" for a in study.arms)
    lines = [f"{study.name}: {state}" + (f"; AL at k={first[1]} ({first[0]}): {arms}." if first else "."), ""]
    if figures:
        links = [f"[{f.name}]({_artifact_link(study, f'report/figures/{f.name}.png')})" for f in figures]
        lines += [f"**Figures** (this run's artifacts, `report/figures/`): {', '.join(links)}.", ""]
    lines += [tab_mod.markdown(tables[0]) if tables else "(no finished runs yet)", ""]
    lines += [
        f"The whole report: [report/report.md]({_artifact_link(study, 'report/report.md')}), every table under "
        f"`report/tables/`. Study `{study.parent.data.tags.get('optuna_study', '?')}`.",
        "",
        f"- Rewrite this report and description: `{rewrite}`",
        f"- Run the study again (finished runs are kept): `{rerun}`" if rerun else "",
    ]
    return "\n".join(lines).rstrip() + "\n"


def run_note(study: Study, arm: Arm, run: Any, toggles: Mapping[str, str]) -> str:
    """A child run's description in one line: its arm, headline AL and seed first (the runs table shows about 45
    characters of it), then the arm's toggles."""
    first = headline(study)
    key = metric_keys.acceptance_length(*first, study.backend) if first else ""
    al = f" AL {run.data.metrics[key]:.3f} at k={first[1]}," if key in run.data.metrics else ""
    said = [f"{arm.label}:{al} seed {run.data.tags.get('seed', '?')}", toggles.get(arm.name, "")]
    return "; ".join([*filter(None, said), *([f"AL on {first[0]}"] if al else [])])


def view_state(study: Study) -> dict[str, Any]:
    """The study's runs table as its saved view: its runs only, sorted by their descriptions (an arm's runs
    together), the description and the AL at each suite and k as columns."""
    keys = [metric_keys.acceptance_length(s, k, study.backend) for s in study.suites for k in study.ks]
    return {
        "searchFilter": track.study_runs_filter(study.parent.data.tags.get("lab.study_key", "")),
        "orderByKey": f"tags.`{track.NOTE}`",
        "orderByAsc": True,
        "selectedColumns": ["attributes.`Description`", *(f"metrics.`{k}`" for k in keys)],
    }


def publish(study: Study, tables: list[tab_mod.Table], figures: list[fig_mod.Figure], rerun: str, rewrite: str) -> None:
    """The descriptions of the study's parent run and its finished child runs, and its saved view."""
    uri, parent = study.uri, study.parent
    track.describe_run(uri, parent.info.run_id, parent_note(study, tables, figures, rerun, rewrite))
    toggles = arm_toggles({a.name: a.runs[0].data.params for a in study.arms if a.runs})
    for arm in study.arms:
        for run in arm.runs:
            track.describe_run(uri, run.info.run_id, run_note(study, arm, run, toggles))
    key = parent.data.tags.get("lab.study_key")
    if key:
        name = f"{study.name}: arms, seeds and AL"
        track.save_view(uri, parent.info.experiment_id, key, name, view_state(study))
