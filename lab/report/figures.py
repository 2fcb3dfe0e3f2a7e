"""Paper-style figures of a study, as PNG (300 dpi) and PDF at print width, in one colour-blind-safe
style (Okabe-Ito colours, and a marker and line style per arm so they also read in grey). Every curve is
the mean over seeds. Its band is the 95 % bootstrap interval of that mean (seeds, then prompts:
lab/report/paired.py) where the arm's runs recorded per-prompt counts for the curve, and +- one standard
deviation over seeds otherwise (runs logged before the records existed).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, never a window

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from lab import metrics as metric_keys  # noqa: E402
from lab.fsutil import atomic_file  # noqa: E402
from lab.report import paired  # noqa: E402
from lab.report import validation as val  # noqa: E402
from lab.report.study import Arm, Study  # noqa: E402

# Okabe & Ito (2008): distinguishable with every common colour-vision deficiency
PALETTE = ["#000000", "#0072B2", "#E69F00", "#009E73", "#CC79A7", "#D55E00", "#56B4E9", "#F0E442"]
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]
LINESTYLES = ["-", "--", "-.", ":", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1)), (0, (1, 2)), (0, (8, 2))]
WIDTH_IN = 6.75  # a two-column paper's text width
PANEL_HEIGHT_IN = 2.1
STYLE = {
    "font.family": "DejaVu Sans",
    "font.size": 8,
    "axes.titlesize": 8,
    "axes.labelsize": 8,
    "legend.fontsize": 7,
    "xtick.labelsize": 7,
    "ytick.labelsize": 7,
    "lines.linewidth": 1.2,
    "lines.markersize": 3.5,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "grid.linewidth": 0.5,
    "pdf.fonttype": 42,  # editable text in the PDF
}


@dataclass
class Figure:
    name: str
    caption: str
    files: list[Path]


def _look(i: int) -> dict:
    return {"color": PALETTE[i % len(PALETTE)], "marker": MARKERS[i % len(MARKERS)], "linestyle": LINESTYLES[i % 8]}


def _band(ax, x: list[float], curves: list[list[float]], i: int, label: str) -> None:
    """Mean over seeds as a line, +- std as a band (curves cut to their common length)."""
    curves = [c for c in curves if c]
    if not curves:
        return
    n = min(len(c) for c in curves)
    data = np.array([c[:n] for c in curves], dtype=float)
    mean = data.mean(axis=0)
    look = _look(i)
    ax.plot(x[:n], mean, label=f"{label} (n={len(curves)})", **look)
    if len(curves) > 1:
        std = data.std(axis=0, ddof=1)
        ax.fill_between(x[:n], mean - std, mean + std, color=look["color"], alpha=0.15, linewidth=0)


# a curve's per-prompt counts at one step (1-based) of a `per_prompt/{suite}.json` document
StepCounts = Callable[[dict, int], paired.Counts]


def _curve(
    ax, study: Study, arm: Arm, suite: str, k: int, counts: StepCounts, metric: paired.Metric, key: str, i: int
) -> None:
    """One arm's curve over steps 1..k: the mean over seeds with its 95 % bootstrap interval from the runs'
    per-prompt records when every run of the arm has them, else the logged curves (`key`) with +- std."""
    x = list(range(1, k + 1))
    docs = study.records(arm, suite)
    estimates = []
    if docs and len(docs) == len(arm.runs):
        estimates = [
            paired.mean_interval({seed: counts(doc, step) for seed, doc in docs.items()}, metric) for step in x
        ]
    if not estimates or any(e is None for e in estimates):
        _band(ax, x, study.curves(arm, key), i, arm.label)
        return
    look = _look(i)
    ax.plot(x, [e.mean for e in estimates], label=f"{arm.label} (n={len(docs)})", **look)
    low, high = [e.low for e in estimates], [e.high for e in estimates]
    ax.fill_between(x, low, high, color=look["color"], alpha=0.15, linewidth=0)


def _interval_note() -> str:
    return (
        "Bands: 95 % bootstrap interval of the mean over seeds (seeds, then prompts; "
        f"{paired.RESAMPLES} resamples) where the runs recorded per-prompt counts, else +- one std over seeds."
    )


def _bars(ax, groups: list[str], study: Study, value: Callable[[Arm, str], list[float]]) -> None:
    """Grouped bars: one group per x label, one bar per arm that has a value (an arm with none, e.g. one vLLM
    could not serve, takes no slot; each arm keeps its colour), error bar = std over seeds."""
    values = {i: [value(arm, g) for g in groups] for i, arm in enumerate(study.arms)}
    present = [i for i, vs in values.items() if any(vs)]
    width = 0.8 / max(1, len(present))
    for slot, i in enumerate(present):
        arm = study.arms[i]
        means = [np.mean(v) if v else np.nan for v in values[i]]
        stds = [np.std(v, ddof=1) if len(v) > 1 else 0.0 for v in values[i]]
        xs = np.arange(len(groups)) + (slot - (len(present) - 1) / 2) * width
        look = _look(i)
        ax.bar(xs, means, width, yerr=stds, label=arm.label, color=look["color"], capsize=1.5, error_kw={"lw": 0.6})
    ax.set_xticks(
        np.arange(len(groups)),
        groups,
        rotation=30 if len(groups) > 4 else 0,
        ha="right" if len(groups) > 4 else "center",
    )


def _panels(n: int, rows: int = 1) -> tuple:
    fig, axes = plt.subplots(rows, n, figsize=(WIDTH_IN, PANEL_HEIGHT_IN * rows + 0.5), squeeze=False)
    for ax in axes.flat:  # steps, positions and depths are whole numbers
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return fig, axes


def _legend(fig, axes) -> None:
    handles, labels = axes.flat[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 4), frameon=False)
    fig.tight_layout(rect=(0, 0.1 if len(labels) <= 4 else 0.16, 1, 1))


def al_vs_depth(study: Study) -> tuple[plt.Figure, str]:
    k, b = study.ks[-1], study.backend
    fig, axes = _panels(len(study.suites))
    for ax, s in zip(axes[0], study.suites, strict=True):
        for i, arm in enumerate(study.arms):
            implied = [list(1 + np.cumsum(c)) for c in study.curves(arm, metric_keys.accept_rate(s, k, b))]
            _band(ax, list(range(1, k + 1)), implied, i, arm.label)
            for kk in study.ks:
                v = study.scalars(arm, metric_keys.acceptance_length(s, kk, b))
                if v:
                    ax.errorbar(
                        kk,
                        np.mean(v),
                        yerr=np.std(v, ddof=1) if len(v) > 1 else 0,
                        fmt="none",
                        ecolor=_look(i)["color"],
                        capsize=2,
                        lw=0.8,
                    )
        ax.set_title(s)
        ax.set_xlabel("drafting depth")
    axes[0][0].set_ylabel("acceptance length")
    _legend(fig, axes)
    caption = (
        f"AL vs drafting depth. Lines: 1 + the cumulative per-position acceptance at k={k} (the AL a chain cut "
        f"at that depth accepts); error bars: the AL measured at k in {study.ks}."
    )
    return fig, caption


def accept_rate(study: Study) -> tuple[plt.Figure, str]:
    k, b = study.ks[-1], study.backend

    def at(doc: dict, position: int) -> paired.Counts:
        return paired.position_counts(doc, k, position)

    fig, axes = _panels(len(study.suites))
    for ax, s in zip(axes[0], study.suites, strict=True):
        key = metric_keys.accept_rate(s, k, b)
        for i, arm in enumerate(study.arms):
            if b == "ref":  # the per-prompt records are the reference decoder's
                _curve(ax, study, arm, s, k, at, paired.share, key, i)
            else:
                _band(ax, list(range(1, k + 1)), study.curves(arm, key), i, arm.label)
        ax.set_title(s)
        ax.set_xlabel("draft position")
        ax.set_ylim(bottom=0)
    axes[0][0].set_ylabel("acceptance rate")
    _legend(fig, axes)
    return fig, f"Per-position acceptance at k={k}: drafts accepted at position i / rounds. {_interval_note()}"


def sink_self_mass(study: Study) -> tuple[plt.Figure, str]:
    k = study.ks[-1]
    fig, axes = _panels(len(study.suites), rows=2)
    for col, s in enumerate(study.suites):
        for row, (curve, name) in enumerate([("sink", "sink mass"), ("self", "self mass")]):
            ax = axes[row][col]

            def at(doc: dict, step: int, curve: str = curve) -> paired.Counts:
                return paired.drift_counts(doc, k, step, curve)

            for i, arm in enumerate(study.arms):
                _curve(ax, study, arm, s, k, at, paired.share, metric_keys.drift(s, k, f"{curve}_mass"), i)
            ax.set_title(s if row == 0 else "")
            ax.set_xlabel("drafting step" if row == 1 else "")
            if col == 0:
                ax.set_ylabel(name)
    _legend(fig, axes)
    caption = (
        f"Attention drift (k={k}): the drafter's attention mass on the prompt's sink token (top) and on its "
        f"own drafted tokens (bottom) at each drafting step. {_interval_note()}"
    )
    return fig, caption


def norm_growth(study: Study) -> tuple[plt.Figure, str]:
    k = study.ks[-1]

    def at(doc: dict, step: int) -> paired.Counts:
        return paired.norm_growth_counts(doc, k, step)

    fig, axes = _panels(len(study.suites))
    for ax, s in zip(axes[0], study.suites, strict=True):
        for i, arm in enumerate(study.arms):
            _curve(ax, study, arm, s, k, at, paired.norm_growth, metric_keys.drift(s, k, "norm_growth"), i)
        ax.axhline(1.0, color="0.5", lw=0.6, ls=":")
        ax.set_title(s)
        ax.set_xlabel("drafting step")
    axes[0][0].set_ylabel("norm growth")
    _legend(fig, axes)
    caption = f"Norm of the fed-back state at each drafting step relative to step 1 (k={k}). {_interval_note()}"
    return fig, caption


def _length(variant: str) -> int:
    return int(re.sub(r"\D", "", variant) or 0)


def al_vs_context(study: Study) -> tuple[plt.Figure, str] | None:
    s, b = "long_context", study.backend
    variants = sorted(study.variants(s), key=_length)
    if s not in study.suites or not variants:
        return None
    fig, axes = _panels(len(study.ks))
    x = [_length(v) for v in variants]
    for ax, k in zip(axes[0], study.ks, strict=True):
        for i, arm in enumerate(study.arms):
            al = [metric_keys.acceptance_length(metric_keys.suite_variant(s, v), k, b) for v in variants]
            per_seed = [[r.data.metrics.get(key, np.nan) for key in al] for r in arm.runs]
            _band(ax, x, per_seed, i, arm.label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [str(v) for v in x])
        ax.minorticks_off()
        ax.set_title(f"k={k}")
        ax.set_xlabel("prompt length (tokens)")
    axes[0][0].set_ylabel("acceptance length")
    _legend(fig, axes)
    return fig, "AL vs context length (the long_context suite's prompt lengths)."


def al_per_template(study: Study) -> tuple[plt.Figure, str] | None:
    s, b = "template", study.backend
    variants = study.variants(s)
    if s not in study.suites or not variants:
        return None
    trained = study.param("data.template")
    groups = [f"{trained} (trained)", *variants] if "in_dist" in study.suites else variants
    fig, axes = _panels(len(study.ks))

    for ax, k in zip(axes[0], study.ks, strict=True):

        def value(arm: Arm, group: str, k: int = k) -> list[float]:
            suite = "in_dist" if group.endswith("(trained)") else metric_keys.suite_variant(s, group)
            return study.scalars(arm, metric_keys.acceptance_length(suite, k, b))

        _bars(ax, groups, study, value)
        ax.set_title(f"k={k}")
    axes[0][0].set_ylabel("acceptance length")
    _legend(fig, axes)
    return fig, "AL per chat template: the drafter trained on one template; the target knows them all."


def vllm_speedup(study: Study) -> tuple[plt.Figure, str] | None:
    pattern = re.compile("^" + metric_keys.throughput_speedup(r"([^/.]+)", r"(\d+)", r"(\d+)") + "$")  # suite, k, C
    found = sorted({m.groups() for r in study.runs for key in r.data.metrics if (m := pattern.match(key))})
    if not found:
        return None
    suite = found[0][0]
    ks = sorted({int(k) for s, k, _ in found if s == suite})
    cs = sorted({int(c) for s, _, c in found if s == suite})
    fig, axes = _panels(len(ks))
    for ax, k in zip(axes[0], ks, strict=True):

        def value(arm: Arm, group: str, k: int = k) -> list[float]:
            return study.scalars(arm, metric_keys.throughput_speedup(suite, k, int(group[2:])))

        _bars(ax, [f"C={c}" for c in cs], study, value)
        ax.axhline(1.0, color="0.5", lw=0.6, ls=":")
        ax.set_title(f"k={k}")
        ax.set_xlabel("concurrency")
    axes[0][0].set_ylabel("speedup over the target alone")
    _legend(fig, axes)
    return fig, f"vLLM throughput with speculation over without, same process and load ({suite})."


def rollout_acc(study: Study) -> tuple[plt.Figure, str] | None:
    key = metric_keys.rollout_accuracy("in_dist")
    if not study.has(key):
        return None
    fig, axes = _panels(1)
    ax = axes[0][0]
    for i, arm in enumerate(study.arms):
        curves = study.curves(arm, key)
        _band(ax, list(range(1, max((len(c) for c in curves), default=0) + 1)), curves, i, arm.label)
    ax.set_xlabel("rollout depth")
    ax.set_ylabel("accuracy")
    _legend(fig, axes)
    return fig, "Teacher-forced rollout accuracy per depth on held-out conversations (own states fed back)."


def fc_share(study: Study) -> tuple[plt.Figure, str] | None:
    key = metric_keys.fc_share()
    if not study.has(key):
        return None
    layers = max(len(c) for arm in study.arms for c in study.curves(arm, key))
    fig, axes = _panels(1)

    def value(arm: Arm, group: str) -> list[float]:
        return [c[int(group.split()[-1]) - 1] for c in study.curves(arm, key) if len(c) == layers]

    _bars(axes[0][0], [f"captured {i}" for i in range(1, layers + 1)], study, value)
    axes[0][0].set_ylabel("share of fc input")
    _legend(fig, axes)
    return fig, "How much each captured target layer contributes to the drafter's fc projection."


def _unfinished_line(ax, tokens: list[float], values: list[float], i: int, label: str) -> None:
    """A run that did not finish: every point it logged, dotted, its last one crossed."""
    n = min(len(tokens), len(values))
    if not n:
        return
    look = _look(i)
    ax.plot(tokens[:n], values[:n], color=look["color"], linestyle=":", lw=0.9, label=label)
    ax.plot(tokens[n - 1], values[n - 1], color=look["color"], marker="x", markersize=5, linestyle="none")


def _thousands(ax) -> None:
    """Training tokens on the x axis, in thousands."""
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(6))
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x / 1000:g}k"))


def al_curve(study: Study) -> tuple[plt.Figure, str] | None:
    """The exact validation AL against the training tokens seen, one line per arm with its seed band, for every
    evaluated k; the curves of runs that did not finish, dotted, as far as they got."""
    tokens_key = metric_keys.val_stat("train_tokens")
    runs = study.runs + study.left_out
    if not any(tokens_key in r.data.metrics for r in runs):
        return None
    fig, axes = _panels(len(study.ks))
    unfinished = 0
    for ax, k in zip(axes[0], study.ks, strict=True):
        key = metric_keys.val_al(k)
        for i, arm in enumerate(study.arms):
            finished = [r for r in arm.runs if key in r.data.metrics]
            if finished:
                _band(ax, study.curve(finished[0], tokens_key), [study.curve(r, key) for r in finished], i, arm.label)
            for r in study.unfinished(arm):
                if key in r.data.metrics:
                    unfinished += 1
                    seed = r.data.tags.get("seed", "?")
                    said = r.data.tags.get("trial_state") or r.info.status
                    label = f"{arm.label}, seed {seed}: unfinished ({said.lower()})"
                    _unfinished_line(ax, study.curve(r, tokens_key), study.curve(r, key), i, label)
        ax.set_title(f"k={k}")
        ax.set_xlabel("training tokens")
        _thousands(ax)
    axes[0][0].set_ylabel("exact validation AL")
    _legend(fig, axes)
    caption = (
        "Exact AL over the validation prompts (held out of the training data) against the training tokens seen, "
        "replayed at each validation pass: mean over seeds +- one std."
    )
    if unfinished:
        caption += (
            " Dotted, ending in x: a run that did not finish (still running, stopped or failed), as far as it got."
        )
    return fig, caption


def _ratio_line(ax, x: list[float], intervals: list[paired.Interval | None], i: int, label: str) -> None:
    points = [(a, iv) for a, iv in zip(x, intervals, strict=True) if iv is not None]
    if not points:
        return
    look = _look(i)
    xs = [a for a, _ in points]
    ax.plot(xs, [iv.ratio for _, iv in points], label=label, **look)
    ax.fill_between(
        xs, [iv.low for _, iv in points], [iv.high for _, iv in points], color=look["color"], alpha=0.15, lw=0
    )


def al_ratio_vs_k(study: Study) -> tuple[plt.Figure, str] | None:
    """Each arm's exact validation AL over the baseline's: against k = 1..K after the last step (left), and at the
    first evaluated k against the training tokens (right), with paired bootstrap intervals over seeds and prompts."""
    arms = {a.name: a for a in study.arms}
    base = arms.get(study.baseline)
    if base is None:
        return None
    theirs = study.records(base, val.RECORDS)
    if not theirs:
        return None
    first = next(iter(theirs.values()))
    depth, k0 = int(first["depth"]), val.select_k(study.runs[0].data.params, study.ks)
    passes = len(val.checkpoints(first))
    tokens = [c["train_tokens"] for c in val.checkpoints(first)]
    fig, axes = _panels(2)
    left, right = axes[0]

    def ratio(arm: Arm, j: int, k: int) -> paired.Interval | None:
        def at(doc: dict) -> paired.Counts:
            cps = val.checkpoints(doc)
            return paired.al_counts(cps[j], k) if len(cps) == passes else {}

        mine = {seed: at(doc) for seed, doc in study.records(arm, val.RECORDS).items()}
        return paired.paired_ratio(mine, {seed: at(doc) for seed, doc in theirs.items()}, paired.acceptance_length)

    for i, arm in enumerate(study.arms):
        if arm.name == study.baseline or not arm.runs:
            continue
        _ratio_line(
            left, list(range(1, depth + 1)), [ratio(arm, passes - 1, k) for k in range(1, depth + 1)], i, arm.label
        )
        _ratio_line(right, tokens, [ratio(arm, j, k0) for j in range(passes)], i, arm.label)
    for ax in (left, right):
        ax.axhline(1.0, color="0.5", lw=0.6, ls=":")
        ax.set_ylabel(f"AL / {base.label}'s")
    left.set_xlabel("drafting depth k (after the last step)")
    right.set_xlabel(f"training tokens (k={k0})")
    _thousands(right)
    _legend(fig, axes)
    caption = (
        f"Exact validation AL of each arm over {base.label}'s: against the drafting depth after the last training "
        f"step (left) and at k={k0} at each validation pass (right); bands: 95 % paired bootstrap interval "
        f"({paired.RESAMPLES} resamples; seeds, then validation prompts)."
    )
    return fig, caption


FIGURES: dict[str, Callable[[Study], tuple[plt.Figure, str] | None]] = {
    "al_vs_depth": al_vs_depth,
    "accept_rate": accept_rate,
    "sink_self_mass": sink_self_mass,
    "norm_growth": norm_growth,
    "al_vs_context": al_vs_context,
    "al_per_template": al_per_template,
    "vllm_speedup": vllm_speedup,
    "rollout_acc": rollout_acc,
    "fc_share": fc_share,
    "al_curve": al_curve,
    "al_ratio_vs_k": al_ratio_vs_k,
}
NEEDS_DRIFT = {"sink_self_mass", "norm_growth"}
UNFINISHED_TOO = {"al_curve"}  # figures that draw the runs that did not finish


def draw(study: Study, names: list[str], folder: Path) -> list[Figure]:
    """The named figures the study's metrics support (all of them when `names` is empty), saved as
    `folder/NAME.png` and `folder/NAME.pdf`. vLLM's speedup is added wherever it was measured."""
    if not study.runs and not study.left_out:
        return []
    wanted = list(names or FIGURES)
    if "vllm_speedup" not in wanted:
        wanted.append("vllm_speedup")
    if not study.runs:  # nothing finished yet: what the runs logged while they trained
        wanted = [name for name in wanted if name in UNFINISHED_TOO]
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    with plt.rc_context(STYLE):
        for name in wanted:
            if name in NEEDS_DRIFT and not study.has_drift:
                continue
            made = FIGURES[name](study)
            if made is None:
                continue
            fig, caption = made
            files = [folder / f"{name}.png", folder / f"{name}.pdf"]
            # each file whole or not at all (a full disk mid-way leaves no truncated figure); the temp name
            # has no suffix to take the format from, so it is named
            with atomic_file(files[0]) as tmp:
                fig.savefig(tmp, format="png", dpi=300, metadata={"Software": None})
            with atomic_file(files[1]) as tmp:
                fig.savefig(tmp, format="pdf", metadata={"CreationDate": None, "Producer": None, "Creator": None})
            plt.close(fig)
            out.append(Figure(name, caption, files))
    return out
