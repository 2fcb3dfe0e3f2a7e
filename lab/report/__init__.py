"""Reports from MLflow alone: `reports/NAME/` with the tables (Markdown, LaTeX, CSV), the figures (PNG,
PDF) and `report.md` assembling them with the study's provenance, also on the study's parent run with the
descriptions the MLflow UI shows (`notes`). Nothing is rerun, no cache is read."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

from lab import metrics as metric_keys
from lab import track
from lab.config import ConfigError
from lab.fsutil import staged_output
from lab.report import figures as fig_mod
from lab.report import notes, paired
from lab.report import tables as tab_mod
from lab.report.study import Study, load

__all__ = ["Report", "Study", "find_parent", "load", "write"]

REPORT_ENTRIES = ("tables", "figures", "report.md")  # what a report writes into its folder, report.md last


@dataclass
class Report:
    folder: Path
    tables: list[tab_mod.Table]
    figures: list[fig_mod.Figure]

    @property
    def path(self) -> Path:
        return self.folder / "report.md"

    def main_table(self) -> str:
        return tab_mod.markdown(self.tables[0]) if self.tables else "(no finished runs)\n"


def find_parent(uri: str, experiment: str, name: str, study_key: str) -> tuple[str, str]:
    """The parent run of study `study_key` (the same overrides), else the newest study of `name`, with a
    line saying which was taken. ConfigError when the store holds no study of `name`."""
    parents = track.study_parents(uri, experiment, name)
    exact = [p for p in parents if p.data.tags.get("lab.study_key") == study_key]
    if exact:
        return exact[0].info.run_id, ""
    if not parents:
        raise ConfigError("experiment", f"no study of '{name}' in {uri}; run `lab ablate experiment={name}` first")
    chosen = parents[0]
    others = len(parents) - 1
    note = (
        f"no study of {name} with exactly these overrides; reporting the newest one, "
        f"{chosen.data.tags.get('optuna_study', chosen.info.run_id)} (parent run {chosen.info.run_id})"
        + (f"; {others} older one(s): pass --run PARENT_RUN_ID to pick" if others else "")
    )
    return chosen.info.run_id, note


def _provenance(study: Study, command: str) -> list[str]:
    runs = study.runs + study.left_out
    commits = sorted({r.data.tags.get("git_commit", "unknown") for r in study.runs})
    hashes = sorted({r.data.tags.get("config_hash", "?") for r in study.runs})
    val_loss = metric_keys.target_val_loss()
    val = sorted({f"{r.data.metrics[val_loss]:.3f}" for r in study.runs if val_loss in r.data.metrics})
    # a pretrained (converted) target is not trained here, so no run measured its validation loss
    loss = f"validation loss {', '.join(val)}" if val else "pretrained, no validation loss here"
    target = study.param("target.name") or "?"
    target_build = sorted({r.data.tags.get("target", "") for r in study.runs} - {""})
    p = study.parent
    return [
        f"- Regenerate: `{command}` (reads MLflow only).",
        f"- MLflow store `{study.uri}`, experiment `{study.name}`, parent run `{p.info.run_id}`"
        f" (study `{p.data.tags.get('optuna_study', '?')}`); {len(study.runs)} finished runs used of {len(runs)}.",
        f"- Code: git commit {', '.join(f'`{c}`' for c in commits) or '?'}.",
        f"- Target: `{target}` ({', '.join(f'`{t}`' for t in target_build) or 'no build tag'}; {loss}).",
        f"- Config hashes: {len(hashes)} distinct over {len(study.runs)} runs (one per arm and seed; listed below).",
        _computed_on(study.runs),
        f"- Suites {', '.join(study.suites)}; k in {study.ks}; seeds {study.seeds}; backend `{study.backend}`"
        f" ({', '.join(study.backends)} ran).",
    ]


def _computed_on(runs: list) -> str:
    """Where the runs computed, and a warning when they differ: `dtype=auto` resolves per machine (bfloat16 on a
    GPU, float32 on a CPU) and is not part of a run's config hash, so a study resumed elsewhere can mix them."""
    where = Counter(
        f"{r.data.params.get('resolved.device', '?')} {r.data.params.get('resolved.dtype', '?')}" for r in runs
    )
    said = ", ".join(f"`{w}` ({n} run{'s' * (n != 1)})" for w, n in sorted(where.items()))
    if len(where) <= 1:
        return f"- Computed on: {said or 'no runs'}."
    return (
        f"- Computed on: {said}. **Mixed**: the arms' ratios compare runs of different devices or precisions "
        "(`dtype=auto` resolves per machine); pin `dtype=` when a study is resumed on another machine."
    )


def _intervals_said(study: Study, tables: list[tab_mod.Table]) -> str:
    """What the tables' ratios and intervals are, or that the runs' records allow none."""
    base = next((a.label for a in study.arms if a.name == study.baseline), study.baseline)
    if any(c.interval is not None for t in tables for r in t.rows for c in r.cells):
        return (
            f"Ratios: an arm's mean over seeds divided by {base}'s, on the seeds and prompts both recorded "
            f"(held-out sequences for the rollout), with a {paired.LEVEL:.0%} paired bootstrap interval "
            f"({paired.RESAMPLES} resamples, seed {paired.BOOTSTRAP_SEED}): each resample draws the seeds with "
            "replacement, then the prompts within each drawn seed, the same draws for the arm and the baseline. "
            "Bold marks a ratio whose interval excludes 1, nothing else; the notes under each table give the "
            "prompts and seeds behind its cells, and its CSV gives them per cell (`ratio`, `ratio_low`, "
            "`ratio_high`, `prompts`, `seeds`, `significant`)."
        )
    return (
        "No intervals: the runs hold no per-prompt records (`per_prompt/*.json`; runs logged before lab recorded "
        "them have none), so the tables give mean ± std over seeds and the change against "
        f"{base} only, and mark nothing."
    )


def _run_table(study: Study) -> list[str]:
    lines = ["| arm | seed | run id | state | config hash | git commit |", "|---|---|---|---|---|---|"]
    for r in study.runs + sorted(study.left_out, key=lambda r: r.info.run_id):
        t = r.data.tags
        state = t.get("trial_state") or r.info.status
        lines.append(
            f"| {t.get('arm', '?')} | {t.get('seed', '?')} | `{r.info.run_id}` | {state} | "
            f"`{t.get('config_hash', '?')}` | `{t.get('git_commit', '?')[:12]}` |"
        )
    return lines


def write(study: Study, figure_names: list[str], folder: Path, command: str, rerun: str = "") -> Report:
    """Write the study's report into `folder` (and onto its parent run as the `report/` artifacts, its main
    table into the parent's description); `command` writes it again, `rerun` runs the study again."""
    unknown = [n for n in figure_names if n not in fig_mod.FIGURES]
    if unknown:
        raise ConfigError(
            f"experiments/{study.name}.yaml: figures",
            f"unknown figure '{unknown[0]}'; available: {', '.join(fig_mod.FIGURES)}",
        )
    tables = tab_mod.build(study)
    # staged and published whole: a full disk or a kill leaves the old report or none, never new tables
    # beside an old report.md (or a truncated figure); the rerun writes it all again
    with staged_output(folder, REPORT_ENTRIES) as stage:
        (stage / "tables").mkdir()
        for t in tables:
            (stage / "tables" / f"{t.name}.md").write_text(tab_mod.markdown(t))
            (stage / "tables" / f"{t.name}.tex").write_text(tab_mod.latex(t))
            (stage / "tables" / f"{t.name}.csv").write_text(tab_mod.to_csv(t))
        drawn = fig_mod.draw(study, figure_names, stage / "figures")
        (stage / "report.md").write_text(_page(study, command, tables, drawn))
    figures = [replace(f, files=[folder / "figures" / p.name for p in f.files]) for f in drawn]
    report = Report(folder, tables, figures)
    track.log_artifacts(study.uri, study.parent.info.run_id, folder, "report")
    notes.publish(study, tables, figures, rerun, command)
    return report


def _page(study: Study, command: str, tables: list[tab_mod.Table], figures: list[fig_mod.Figure]) -> str:
    """report.md: the provenance, the tables, the figures and the runs."""
    lines = [f"# {study.name}: {study.description}".rstrip(": "), "", "## Provenance", "", *_provenance(study, command)]
    lines += ["", "## Tables", ""]
    if not tables:
        lines.append("(no finished runs yet" + (": the figures draw what the runs logged so far)" if figures else ")"))
    else:
        lines += [_intervals_said(study, tables), ""]
    for t in tables:
        lines += [
            tab_mod.markdown(t),
            f"LaTeX: [tables/{t.name}.tex](tables/{t.name}.tex), CSV: [tables/{t.name}.csv](tables/{t.name}.csv)",
            "",
        ]
    lines += ["## Figures", ""]
    for f in figures:
        lines += [f"![{f.name}](figures/{f.name}.png)", "", f"*{f.caption}* ([PDF](figures/{f.name}.pdf))", ""]
    lines += ["## Runs", "", *_run_table(study), ""]
    return "\n".join(lines)
