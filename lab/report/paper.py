"""The paper's claims beside this workbench's studies (`lab paper`): one Markdown page from MLflow alone.

Each claim of the EAGLE 3.1 paper is measured on one experiment's study (`experiments/NAME.yaml`, run with
the same overrides, e.g. `profile=medium`) as ratios of EAGLE 3.1 to EAGLE-3 with their 95 % paired
bootstrap intervals over seeds and prompts (lab/report/paired.py, the report's tables' statistics). A row's
verdict is read off its interval, compared as printed (3 decimals): wholly on the side of 1 where the paper
puts the ratio, `agrees`; wholly on the other side, `disagrees`; covering 1, `inconclusive`. A claim agrees
(or disagrees) when every row does, is inconclusive when no row leaves 1, and is `mixed` otherwise. Beside
each claim the page gives the budget behind it (training steps and top-1 agreement, the baseline's AL),
which is what an inconclusive or contrary result most often comes down to, and the run ids. The bootstrap
is seeded: the same store gives the same page, byte for byte.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from lab import metrics as metric_keys
from lab.report import paired
from lab.report import validation as val
from lab.report.study import Study

# one row of a claim: its label, the per-prompt artifact (a suite's name or `rollout`), the counts per prompt
# in one of its documents, and the metric of their sums
Row = tuple[str, str, Callable[[dict], paired.Counts], paired.Metric]
DIGITS = 3


def _variant(doc: dict, variant: str) -> dict:
    """A per-prompt document cut to the prompts of one suite variant (a template, a context length)."""
    return {**doc, "prompts": [p for p in doc.get("prompts", []) if p.get("variant") == variant]}


def _ttt(study: Study, arm: str) -> int:
    runs = next((a.runs for a in study.arms if a.name == arm), [])
    return int(runs[0].data.params.get("train.ttt_length", 0)) if runs else 0


def _al(study: Study, suites: list[str], ks: list[int]) -> list[Row]:
    return [
        (f"AL, {s}, k={k}", s, lambda doc, k=k: paired.al_counts(doc, k), paired.acceptance_length)
        for s in suites
        if s in study.suites
        for k in ks
    ]


def standard_benchmarks(study: Study) -> list[Row]:
    return _al(study, ["mtbench", "humaneval"], study.ks)


def per_variant(suites: list[str]) -> Callable[[Study], list[Row]]:
    """AL per variant of each suite at the training depth (the first k)."""

    def rows(study: Study) -> list[Row]:
        k = study.ks[0]
        return [
            (
                f"AL, {s} {v}, k={k}",
                s,
                lambda doc, v=v: paired.al_counts(_variant(doc, v), k),
                paired.acceptance_length,
            )
            for s in suites
            if s in study.suites
            for v in study.variants(s)
        ]

    return rows


def beyond_ttt(arm: str) -> Callable[[Study], list[Row]]:
    """AL at every k deeper than the arm's TTT length, and the teacher-forced rollout accuracy at 2x and 3x it
    and at the deepest depth recorded."""

    def rows(study: Study) -> list[Row]:
        ttt = _ttt(study, arm)
        out = _al(study, ["in_dist"], [k for k in study.ks if k > ttt])
        deepest = min(
            (len(c) for a in study.arms for c in study.curves(a, metric_keys.rollout_accuracy("in_dist"))), default=0
        )
        for d in sorted({d for d in (2 * ttt, 3 * ttt, deepest) if ttt < d <= deepest}):
            out.append(
                (
                    f"rollout accuracy, depth {d}",
                    "rollout",
                    lambda doc, d=d: paired.rollout_counts(doc, d),
                    paired.share,
                )
            )
        return out

    return rows


def training_depth(study: Study) -> list[Row]:
    """AL at the training depth (the first k) on every suite the study ran."""
    return _al(study, study.suites, study.ks[:1])


def norm_growth(study: Study) -> list[Row]:
    k = study.ks[-1]
    return [
        (f"norm growth, {s}, step {k}", s, lambda doc: paired.norm_growth_counts(doc, k, k), paired.norm_growth)
        for s in study.suites
    ]


def attention(curve: str) -> Callable[[Study], list[Row]]:
    """The attention mass on the sink (`sink`) or on the drafter's own tokens (`self`) at the deepest step."""

    def rows(study: Study) -> list[Row]:
        k = study.ks[-1]
        return [
            (f"{curve} mass, {s}, step {k}", s, lambda doc: paired.drift_counts(doc, k, k, curve), paired.share)
            for s in study.suites
        ]

    return rows


@dataclass(frozen=True)
class Claim:
    title: str
    paper: str  # what the paper reports
    above: bool  # whether the paper puts the ratio EAGLE 3.1 / EAGLE-3 above 1 (else below)
    experiment: str
    arm: str
    baseline: str
    rows: Callable[[Study], list[Row]]
    # figures published elsewhere than the paper, shown beside the rows as theirs: (benchmark, EAGLE-3's AL,
    # EAGLE 3.1's AL) at k = 3, and whose they are
    card: tuple[tuple[str, float, float], ...] = ()
    card_source: str = ""


# The Kimi K2.6 EAGLE 3.1 MLA drafter's model card (lightseekorg/kimi-k2.6-eagle3.1-mla): AL at k = 3 of
# its EAGLE-3 MLA drafter and its EAGLE 3.1 MLA drafter on Kimi K2.6; not measured here
KIMI_CARD = (
    ("MT-Bench", 2.602, 2.611),
    ("HumanEval", 3.192, 3.134),
    ("GSM8K", 3.191, 3.195),
    ("SPEED multilingual", 2.603, 2.800),
)

CLAIMS = [
    Claim(
        "AL on standard benchmarks",
        "AL x1.10 over seven standard benchmarks",
        True,
        "drift_2x2",
        "eagle31",
        "eagle3",
        standard_benchmarks,
    ),
    Claim(
        "AL on long context",
        "AL x1.18 on long context",
        True,
        "long_context",
        "eagle31",
        "eagle3",
        per_variant(["long_context"]),
    ),
    Claim(
        "AL under template perturbation",
        "AL up to x2 under chat-template perturbation",
        True,
        "template_robustness",
        "eagle31",
        "eagle3",
        per_variant(["template", "system_prompt"]),
    ),
    Claim(
        "Extrapolation beyond the TTT depth",
        "better extrapolation from a short TTT depth to longer drafting",
        True,
        "depth_extrapolation",
        "eagle31_ttt3",
        "eagle3_ttt3",
        beyond_ttt("eagle31_ttt3"),
    ),
    Claim(
        "Norm growth along the chain",
        "EAGLE-3's fed-back hidden state grows step by step; post-norm feedback stops it (ratio below 1)",
        False,
        "drift_2x2",
        "eagle31",
        "eagle3",
        norm_growth,
    ),
    Claim(
        "Attention on the sink per drafting step",
        "EAGLE-3's attention slides off the sink token as the chain grows; EAGLE 3.1 keeps it (ratio above 1)",
        True,
        "drift_2x2",
        "eagle31",
        "eagle3",
        attention("sink"),
    ),
    Claim(
        "Attention on the drafter's own tokens",
        "EAGLE-3's attention moves onto its own drafted tokens; EAGLE 3.1's does not (ratio below 1)",
        False,
        "drift_2x2",
        "eagle31",
        "eagle3",
        attention("self"),
    ),
    Claim(
        "EAGLE 3.1 on an MLA drafter",
        "the Kimi K2.6 card (not the paper): EAGLE 3.1 / EAGLE-3 AL at k=3 of its MLA drafter x0.98 to x1.08 "
        "over four benchmarks, above 1 on three",
        True,
        "attention_2x2",
        "mla_eagle31",
        "mla_eagle3",
        training_depth,
        KIMI_CARD,
        "the Kimi K2.6 model card (lightseekorg/kimi-k2.6-eagle3.1-mla), on Kimi K2.6 itself",
    ),
]


@dataclass
class Finding:
    """A claim measured on a study (None: the store holds no study of its experiment)."""

    claim: Claim
    study: Study | None
    rows: list[tuple[str, paired.Interval | None]] = field(default_factory=list)
    note: str = ""  # how the study was found, when not by its exact overrides

    def side(self, iv: paired.Interval) -> str:
        if not iv.excludes_one(DIGITS):
            return "inconclusive"
        return "agrees" if (iv.low > 1) == self.claim.above else "disagrees"

    @property
    def measured(self) -> list[tuple[str, paired.Interval]]:
        return [(label, iv) for label, iv in self.rows if iv is not None]

    def verdict(self) -> str:
        sides = [self.side(iv) for _, iv in self.measured]
        if not sides:
            return "not measured"
        if len(set(sides)) == 1:
            return sides[0]
        counts = ", ".join(f"{sides.count(s)} {s}" for s in ("agrees", "disagrees", "inconclusive") if s in sides)
        return f"mixed ({counts})"

    def headline(self) -> tuple[str, paired.Interval] | None:
        """The row furthest on the paper's side of 1, the first of equals (the paper reports its best case too)."""
        sign = 1 if self.claim.above else -1
        return max(self.measured, key=lambda row: sign * row[1].ratio, default=None)

    def said(self) -> str:
        """The headline row as the summary prints it: ratio [interval] (row), or '-'."""
        head = self.headline()
        return f"{_interval(head[1])} ({head[0]})" if head else "-"


@dataclass(frozen=True)
class CheckpointClaim:
    """Not the paper's: what the peers' training assumes when it keeps the checkpoint its teacher-forced proxy
    ranks best. Measured on the validation passes of an experiment's runs (`per_prompt/val.json`)."""

    title: str = "A proxy's best checkpoint is the exact best"
    claim: str = (
        "the peers keep the checkpoint their teacher-forced proxy ranks best (SpecForge and TorchSpec: "
        "simulated_acc_len; NeMo Automodel: tau_sim), taking it for the checkpoint of the best AL"
    )
    experiment: str = "drift_2x2"


CHECKPOINT_CLAIM = CheckpointClaim()
TEACHER_FORCED = [p for p in val.PROXIES if p.name in ("simulated_acc_len", "tau_sim")]


@dataclass(frozen=True)
class Pick:
    """One run's checkpoints as a proxy and the exact AL rank them: each one's best step, and the exact AL the
    proxy's pick gives up against the exact best."""

    proxy: str
    run: str  # arm label and seed
    proxy_step: int
    exact_step: int
    lost: float


@dataclass
class CheckpointFinding:
    study: Study | None
    k: int = 0
    picks: list[Pick] = field(default_factory=list)
    note: str = ""

    def verdict(self) -> str:
        if not self.picks:
            return "not measured"
        differ = sum(p.proxy_step != p.exact_step for p in self.picks)
        return "agrees" if differ == 0 else f"disagrees ({differ} of {len(self.picks)} picks differ)"

    def said(self) -> str:
        """Per proxy: in how many runs it picks the exact best, and the exact AL its picks give up."""
        parts = []
        for proxy in TEACHER_FORCED:
            mine = [p for p in self.picks if p.proxy == proxy.name]
            if mine:
                same = sum(p.proxy_step == p.exact_step for p in mine)
                lost = max(p.lost for p in mine)
                parts.append(
                    f"{proxy.name}: the exact best in {same} of {len(mine)} runs (AL given up: at most {lost:.3f})"
                )
        return "; ".join(parts) or "-"


def measure_checkpoints(study: Study | None, note: str = "") -> CheckpointFinding:
    """Every finished run's checkpoints ranked by each teacher-forced proxy and by the exact AL, at train.select_k."""
    finding = CheckpointFinding(study, note=note)
    if study is None or not study.runs:
        return finding
    finding.k = val.select_k(study.runs[0].data.params, study.ks)
    for arm in study.arms:
        for seed, doc in sorted(study.records(arm, val.RECORDS).items()):
            exact = val.values(doc, finding.k, val.exact_al)
            best = val.best_step(doc, finding.k, val.exact_al)
            for proxy in TEACHER_FORCED:
                pick = val.best_step(doc, finding.k, proxy.metric)
                lost = max(exact) - exact[val.steps(doc).index(pick)]
                finding.picks.append(Pick(proxy.name, f"{arm.label}, seed {seed}", pick, best, lost))
    return finding


def checkpoint_lines(f: CheckpointFinding) -> list[str]:
    """The claim's section of the page: every run's picks, then the verdict."""
    c = CHECKPOINT_CLAIM
    head = f"The claim (the peers', not the paper's): {c.claim}. Measured on `{c.experiment}`"
    lines = ["", f"## {c.title}", ""]
    if f.study is None:
        return [*lines, head + f": the store holds no study of it yet (`lab ablate experiment={c.experiment}`)."]
    lines.append(head + f", each run's validation passes at k={f.k} (`per_prompt/val.json`).")
    if f.note:
        lines += ["", f"Note: {f.note}."]
    if not f.picks:
        return [*lines, "", "No finished run recorded validation passes (train.val_prompts=0, or logged before them)."]
    lines += ["", "| proxy | run | proxy's best step | exact best step | exact AL given up |", "|---|---|---|---|---|"]
    lines += [f"| {p.proxy} | {p.run} | {p.proxy_step} | {p.exact_step} | {p.lost:.3f} |" for p in f.picks]
    return [*lines, "", f"Verdict: **{f.verdict()}**. {f.said()}."]


def measure(claim: Claim, study: Study | None, note: str = "") -> Finding:
    """The claim's rows on `study`: the paired ratio of the claim's arm to its baseline, where both ran."""
    finding = Finding(claim, study, note=note)
    if study is None:
        return finding
    arms = {a.name: a for a in study.arms}
    arm, base = arms.get(claim.arm), arms.get(claim.baseline)
    if arm is None or base is None or not arm.runs or not base.runs:
        return finding
    for label, artifact, counts, metric in claim.rows(study):
        mine = {seed: counts(doc) for seed, doc in study.records(arm, artifact).items()}
        theirs = {seed: counts(doc) for seed, doc in study.records(base, artifact).items()}
        finding.rows.append((label, paired.paired_ratio(mine, theirs, metric)))
    return finding


def _interval(iv: paired.Interval) -> str:
    return f"{iv.ratio:.{DIGITS}f} [{iv.low:.{DIGITS}f}, {iv.high:.{DIGITS}f}]"


def _budget(study: Study, arm_names: list[str]) -> str:
    """What the study's drafters were trained on and reached: the words a contrary result needs first."""
    parts = []
    params = study.runs[0].data.params if study.runs else {}
    if params:
        batch = params.get("train.batch_size", "?")
        parts.append(
            f"target {params.get('target.name', '?')}, {params.get('data.num_sequences', '?')} training "
            f"conversations, {params.get('train.steps', '?')} steps of {batch} sequence{'' if batch == '1' else 's'}"
        )
    acc = metric_keys.train_step_acc(0)
    for arm in study.arms:
        if arm.name not in arm_names or not arm.runs:
            continue
        agreement = [r.data.metrics[acc] for r in arm.runs if acc in r.data.metrics]
        al = study.scalars(arm, metric_keys.acceptance_length(study.suites[0], study.ks[0], study.backend))
        said = (
            [f"{arm.label}: top-1 agreement {statistics.mean(agreement):.2f} on its last training batches"]
            if agreement
            else [f"{arm.label}:"]
        )
        if al:
            said.append(f"AL {statistics.mean(al):.2f} at k={study.ks[0]} on {study.suites[0]}")
        parts.append(", ".join(said))
    return "; ".join(parts) or "no finished run yet"


def _runs(study: Study, arm_names: list[str]) -> str:
    out = [f"parent run `{study.parent.info.run_id}`"]
    for arm in study.arms:
        if arm.name in arm_names:
            ids = ", ".join(f"`{r.info.run_id}`" for r in arm.runs) or "none finished"
            out.append(f"{arm.label}: {ids}")
    return "; ".join(out)


def markdown(findings: list[Finding], title: str, command: str, checkpoints: CheckpointFinding | None = None) -> str:
    """The page: a summary table of every claim, then each claim's rows, budget and runs; with `checkpoints`, the
    claim that a proxy's best checkpoint is the exact best."""
    lines = [
        f"# {title}",
        "",
        f"Generated by `{command}` from the MLflow store alone: nothing here is typed in by hand. Each ratio is "
        "EAGLE 3.1's mean over seeds divided by EAGLE-3's, with its 95 % paired bootstrap interval "
        f"({paired.RESAMPLES} resamples, seed {paired.BOOTSTRAP_SEED}; seeds resampled, then prompts or held-out "
        "sequences within each seed, the same draws for both arms). A row agrees with the paper when its "
        "interval lies wholly on the paper's side of 1, disagrees when it lies wholly on the other side, and "
        "is inconclusive when it covers 1; a claim agrees or disagrees when all its rows do, is inconclusive "
        "when none leaves 1, and is mixed otherwise. Its headline row is the one furthest on the paper's side.",
        "",
        "| claim | the paper | this workbench (headline row) | verdict |",
        "|---|---|---|---|",
    ]
    for f in findings:
        lines.append(f"| {f.claim.title} | {f.claim.paper} | {f.said()} | {f.verdict()} |")
    if checkpoints is not None:
        c = CHECKPOINT_CLAIM
        lines.append(f"| {c.title} | (the peers') {c.claim} | {checkpoints.said()} | {checkpoints.verdict()} |")
    for f in findings:
        c = f.claim
        whose = "the card" if c.card else "the paper"
        lines += [
            "",
            f"## {c.title}",
            "",
            f"The {'claim' if c.card else 'paper'}: {c.paper}. Measured on `{c.experiment}`",
        ]
        if f.study is None:
            lines[-1] += f": the store holds no study of it yet (`lab ablate experiment={c.experiment}`)."
        else:
            lines[-1] += f" ({f.study.parent.data.tags.get('optuna_study', f.study.name)})."
        if c.card:
            lines += [
                "",
                f"The card: {c.card_source}. Its own figures, on its own benchmarks and target, not measured here:",
                "",
                "| benchmark (the card's) | EAGLE-3 AL at k=3 | EAGLE 3.1 AL at k=3 | EAGLE 3.1 / EAGLE-3 |",
                "|---|---|---|---|",
            ]
            lines += [f"| {name} | {old:.3f} | {new:.3f} | {new / old:.{DIGITS}f} |" for name, old, new in c.card]
        if f.study is None:
            continue
        study = f.study
        if f.note:
            lines += ["", f"Note: {f.note}."]
        if f.rows:
            lines += [
                "",
                "| row | EAGLE 3.1 / EAGLE-3 [95 % interval] | prompts (rollout: sequences) x seeds | verdict |",
                "|---|---|---|---|",
            ]
            for label, iv in f.rows:
                if iv is None:
                    lines.append(f"| {label} | no paired records | - | - |")
                else:
                    lines.append(f"| {label} | {_interval(iv)} | {iv.prompts} x {iv.seeds} | {f.side(iv)} |")
        else:
            lines += ["", f"No finished runs of both `{c.arm}` and `{c.baseline}` yet."]
        if c.card and f.measured:
            theirs = [new / old for _, old, new in c.card]
            ours = [iv.ratio for _, iv in f.measured]
            lines += [
                "",
                f"The card's ratios span {min(theirs):.{DIGITS}f} to {max(theirs):.{DIGITS}f}; this workbench's, "
                f"{min(ours):.{DIGITS}f} to {max(ours):.{DIGITS}f}. The verdict reads the side of 1, not the size.",
            ]
        verdict = f.verdict()
        lines += ["", f"Verdict: **{verdict}**."]
        if verdict not in ("agrees", "not measured"):
            lines[-1] += (
                f" Before this counts against {whose}, weigh the budget behind it: "
                f"{_budget(study, [c.arm, c.baseline])}; {whose}'s drafters train on far more data, for longer, "
                f"against larger targets. Runs: {_runs(study, [c.arm, c.baseline])}."
            )
    if checkpoints is not None:
        lines += checkpoint_lines(checkpoints)
    lines += ["", "## The studies"]
    studies: dict[str, tuple[Study, list[str]]] = {}  # experiment -> its study and the arms its claims compare
    for f in findings:
        if f.study is not None:
            _, arms = studies.setdefault(f.claim.experiment, (f.study, []))
            arms += [a for a in (f.claim.arm, f.claim.baseline) if a not in arms]
    for name, (study, arms) in studies.items():
        lines += ["", f"`{name}`: {_budget(study, arms)}. Runs: {_runs(study, arms)}."]
    if not studies:
        lines += ["", "None in the store yet."]
    return "\n".join(lines) + "\n"
