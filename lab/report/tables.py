"""Paper-style tables of a study, each rendered as Markdown, LaTeX (booktabs) and CSV.

- `al`: AL per arm x suite x drafting depth k, mean +- std over seeds (n), ratio against the baseline arm;
- `acceptance`: the per-position acceptance rate (accepted at position i / drafts) at the deepest k;
- `backends` (where the reference decoder and vLLM both ran): AL and per-position acceptance at the training
  depth from each, side by side;
- `drift`: sink and self attention mass at drafting step 1 and at the deepest step, norm growth there;
- `rollout`: teacher-forced rollout accuracy on held-out data at depth 1, the deepest k and the deepest depth;
- `proxy_bias` (where the runs validated while training): each proxy of the AL minus the exact validation AL at
  every checkpoint, with its bootstrap interval, and whether proxy and exact AL rank the checkpoints alike.

AL, norm growth and rollout accuracy of every arm but the baseline carry the ratio of the arm's mean to the
baseline's with a 95 % paired bootstrap interval over prompts and seeds (lab/report/paired.py), from the
runs' per-prompt records; a cell is bold only when its interval excludes 1. Runs without those records
give mean +- std and the change against the baseline only, and the table says so.
The CSV also flags each column's best mean (`best`). Formatting is fixed and the bootstrap seeded, so the
same MLflow content gives byte-identical files.
"""

from __future__ import annotations

import csv
import io
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from lab import metrics as metric_keys
from lab.report import paired
from lab.report import validation as val
from lab.report.study import Study, mean_std


@dataclass
class Column:
    label: str  # e.g. "k=3"
    group: str = ""  # e.g. the suite: columns of one group share a header cell
    better: str = "high"  # high | low | one (closest to 1) | "" (no bold)


@dataclass
class Cell:
    values: list[float]
    change: float | None = None  # relative to the baseline arm's mean
    interval: paired.Interval | None = None  # the paired ratio to the baseline arm, where records allow

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return mean_std(self.values)[0]

    @property
    def std(self) -> float:
        return mean_std(self.values)[1]


@dataclass
class Row:
    arm: str
    label: str
    cells: list[Cell]
    group: str = ""  # e.g. the suite in the drift table: bold is chosen within a group
    n: int = 0  # finished runs of the arm


@dataclass
class Table:
    name: str  # file stem
    title: str
    columns: list[Column]
    rows: list[Row]
    notes: list[str] = field(default_factory=list)
    digits: int = 3
    unit: str = "prompts"  # what an interval resamples within a seed
    centre: float = 1.0  # what a cell's interval is compared with: 1 for a ratio, 0 for a difference
    grouped_by: str = "suite"  # what the rows' groups are

    def marked(self) -> set[tuple[int, int]]:
        """(row, column) of the cells whose interval excludes 1: the only cells set in bold."""
        return {
            (i, j)
            for i, row in enumerate(self.rows)
            for j, cell in enumerate(row.cells)
            if cell.interval is not None and cell.interval.excludes(self.centre)
        }

    def counts(self) -> tuple[int, int] | None:
        """The (prompts, seeds) behind most of the table's intervals (a cell with others says so)."""
        found = Counter(
            (c.interval.prompts, c.interval.seeds) for r in self.rows for c in r.cells if c.interval is not None
        )
        return min(found, key=lambda pair: (-found[pair], pair)) if found else None

    def best(self) -> set[tuple[int, int]]:
        """(row, column) of the best mean per column within each row group."""
        out = set()
        for j, col in enumerate(self.columns):
            if not col.better:
                continue
            groups: dict[str, list[tuple[float, int]]] = {}
            for i, row in enumerate(self.rows):
                cell = row.cells[j]
                if cell.values:
                    score = {"high": -cell.mean, "low": cell.mean, "one": abs(cell.mean - 1.0)}[col.better]
                    # compared as printed: values that print the same tie
                    groups.setdefault(row.group, []).append((round(score, self.digits), i))
            for scored in groups.values():
                if len({s for s, _ in scored}) > 1:  # a column where all tie has no best
                    top = min(s for s, _ in scored)
                    out |= {(i, j) for s, i in scored if s == top}
        return out


def _num(x: float, digits: int) -> str:
    return f"{x:.{digits}f}"


def _seeds(n: int) -> str:
    return f"{n} seed{'s' * (n != 1)}"


def _cell_text(table: Table, row: Row, cell: Cell, pm: str) -> tuple[str, str, list[str]]:
    """(value text, ratio text, annotations) of a cell: 'mean pm std', '1.195× [1.171, 1.219]' (the
    ratio to the baseline and its interval) or else the change '+3.1%' in the annotations, 'n=2' where
    fewer seeds, '40 prompts × 1 seed' (in the table's unit) where the interval rests on other counts than
    most of the table's."""
    if not cell.values:
        return "-", "", []
    d = table.digits
    text = f"{_num(cell.mean, d)}{pm}{_num(cell.std, d)}"
    ratio, notes = "", []
    iv = cell.interval
    if iv is not None:
        bounds = f"[{_num(iv.low, d)}, {_num(iv.high, d)}]"
        ratio = f"{_num(iv.ratio, d)}× {bounds}" if table.centre == 1.0 else bounds  # a difference's is the value
        if (iv.prompts, iv.seeds) != table.counts():
            notes.append(f"{iv.prompts} {table.unit} × {_seeds(iv.seeds)}")
    elif cell.change is not None:
        notes.append(f"{cell.change:+.1%}")
    if cell.n < row.n:
        notes.append(f"n={cell.n}")
    return text, ratio, notes


def markdown(table: Table) -> str:
    marked = table.marked()
    grouped = any(r.group for r in table.rows)
    head = ["arm"] + ([table.grouped_by] if grouped else []) + ["n"]
    head += [f"{c.group} {c.label}".strip() for c in table.columns]
    lines = [f"**{table.title}**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, row in enumerate(table.rows):
        cells = [row.label] + ([row.group] if grouped else []) + [str(row.n)]
        for j, cell in enumerate(row.cells):
            text, ratio, notes = _cell_text(table, row, cell, " ± ")
            if ratio and (i, j) in marked:
                ratio = f"**{ratio}**"
            notes = [ratio, *notes] if ratio else notes
            cells.append(f"{text} ({', '.join(notes)})" if notes else text)
        lines.append("| " + " | ".join(cells) + " |")
    lines += [""] + [f"{note}" for note in table.notes]
    return "\n".join(lines).rstrip() + "\n"


_LATEX_SPECIAL = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
    "±": r"$\pm$",
    "×": r"$\times$",
}


def latex_escape(text: str) -> str:
    return "".join(_LATEX_SPECIAL.get(ch, ch) for ch in text)


def latex(table: Table) -> str:
    """A booktabs `table` environment: a header row per column group, bold ratios whose interval excludes 1,
    notes under it."""
    marked = table.marked()
    grouped = any(r.group for r in table.rows)
    lead = ["Arm"] + ([table.grouped_by.capitalize()] if grouped else []) + ["$n$"]
    spec = "l" * (len(lead) - 1) + "r" + "c" * len(table.columns)
    out = [
        r"\begin{table}[t]",
        r"\centering",
        r"\small",
        rf"\caption{{{latex_escape(table.title)}}}",
        rf"\label{{tab:{table.name}}}",
        rf"\begin{{tabular}}{{{spec}}}",
        r"\toprule",
    ]
    spans: list[tuple[str, int]] = []
    for col in table.columns:
        if spans and spans[-1][0] == col.group:
            spans[-1] = (col.group, spans[-1][1] + 1)
        else:
            spans.append((col.group, 1))
    if any(g for g, _ in spans):
        header, rules, at = [""] * len(lead), [], len(lead) + 1
        for group, width in spans:
            header.append(rf"\multicolumn{{{width}}}{{c}}{{{latex_escape(group)}}}")
            rules.append(rf"\cmidrule(lr){{{at}-{at + width - 1}}}")
            at += width
        out += [" & ".join(header) + r" \\", " ".join(rules)]
    out.append(" & ".join(lead + [latex_escape(c.label) for c in table.columns]) + r" \\")
    out.append(r"\midrule")
    previous_group = None
    for i, row in enumerate(table.rows):
        if grouped and previous_group is not None and row.group != previous_group:
            out.append(r"\midrule")
        previous_group = row.group
        cells = [latex_escape(row.label)] + ([latex_escape(row.group)] if grouped else []) + [str(row.n)]
        for j, cell in enumerate(row.cells):
            text, ratio, notes = _cell_text(table, row, cell, r"$\pm$")
            parts = [latex_escape(n) for n in notes]
            if ratio:
                ratio = latex_escape(ratio)
                parts.insert(0, rf"\textbf{{{ratio}}}" if (i, j) in marked else ratio)
            cells.append(text + (rf" {{\scriptsize({', '.join(parts)})}}" if parts else ""))
        out.append(" & ".join(cells) + r" \\")
    out += [r"\bottomrule", r"\end{tabular}"]
    if table.notes:
        out.append(r"\par\smallskip\footnotesize " + " ".join(latex_escape(n) for n in table.notes))
    out.append(r"\end{table}")
    return "\n".join(out) + "\n"


def to_csv(table: Table) -> str:
    """Tidy rows (one per arm x column) for notebooks: the numbers unrounded. `best`: the column's best mean
    (within a row group); `ratio`, `ratio_low`, `ratio_high`: the ratio to the baseline arm and its paired
    bootstrap interval, over `prompts` prompts x `seeds` seeds; `significant`: 1 where the interval excludes
    1 (empty where there is no interval)."""
    best, marked = table.best(), table.marked()
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    head = ["table", "arm", "label", "row_group", "column_group", "column", "mean", "std", "n", "change", "best"]
    writer.writerow(head + ["ratio", "ratio_low", "ratio_high", "prompts", "seeds", "significant"])
    for i, row in enumerate(table.rows):
        for j, (col, cell) in enumerate(zip(table.columns, row.cells, strict=True)):
            mean, std = (repr(cell.mean), repr(cell.std)) if cell.values else ("", "")
            change = "" if cell.change is None else repr(cell.change)
            out = [table.name, row.arm, row.label, row.group, col.group, col.label, mean, std, cell.n, change]
            out.append(int((i, j) in best))
            iv = cell.interval
            if iv is None:
                out += ["", "", "", "", "", ""]
            else:
                out += [repr(iv.ratio), repr(iv.low), repr(iv.high), iv.prompts, iv.seeds, int((i, j) in marked)]
            writer.writerow(out)
    return buf.getvalue()


def _change(cell: Cell, base: Cell | None) -> float | None:
    if base is None or cell is base or not cell.values or not base.values or base.mean == 0:
        return None
    return cell.mean / base.mean - 1


# where a cell's paired ratio comes from: the per-prompt artifact (a suite's name or `rollout`), the counts
# per prompt in one of its documents, and the metric of their sums
Source = tuple[str, Callable[[dict], paired.Counts], paired.Metric]


def _base_label(study: Study) -> str:
    return next((a.label for a in study.arms if a.name == study.baseline), study.baseline)


def _against(study: Study, table: Table) -> str:
    """What the cells compare with the baseline: the ratio where there are intervals, else the change."""
    return f"{'ratio to' if table.counts() else 'change against'} {_base_label(study)}"


def _pair(study: Study, table: Table, source: Callable[[Row, int], Source | None], what: str) -> None:
    """Give each cell of the arms other than the baseline that `source` names the paired ratio to the
    baseline's cell with its interval, and add the notes that say what the intervals are and which cells
    lack one (`what`: the records, e.g. "per-prompt records")."""
    arms = {a.name: a for a in study.arms}
    base = arms.get(study.baseline)
    lacking: dict[str, set[str]] = {}  # artifact -> labels of arms with a value but no interval
    for row in table.rows:
        for j, cell in enumerate(row.cells):
            src = source(row, j)
            if src is None or not cell.values or row.arm == study.baseline:
                continue
            name, counts, metric = src
            if base is not None:
                mine = {seed: counts(doc) for seed, doc in study.records(arms[row.arm], name).items()}
                theirs = {seed: counts(doc) for seed, doc in study.records(base, name).items()}
                cell.interval = paired.paired_ratio(mine, theirs, metric)
            if cell.interval is None:
                lacking.setdefault(name, set()).add(row.label)
    counts = table.counts()
    if counts is not None:
        prompts, seeds = counts
        some_differ = any(
            c.interval is not None and (c.interval.prompts, c.interval.seeds) != counts
            for r in table.rows
            for c in r.cells
        )
        table.notes.append(
            f"{paired.method(_base_label(study), table.unit)}, over {prompts} {table.unit} × {_seeds(seeds)} per cell"
            + (" unless the cell says otherwise" if some_differ else "")
            + ". Bold: the interval excludes 1."
        )
    if lacking:
        files = ", ".join(f"per_prompt/{name}.json" for name in sorted(lacking))
        labels = sorted({label for labels in lacking.values() for label in labels})
        table.notes.append(
            f"No interval for {', '.join(labels)}: their runs or the baseline's hold no {what} ({files}) for the "
            "same seeds and prompts (runs logged before lab recorded them have none); those cells give mean ± std "
            "over seeds and the change against the baseline only, never bold."
        )


def _at(study: Study, arm, key: str, i: int) -> Cell:
    """Position i (0-based) of the curve `key` in each of the arm's runs whose curve reaches it."""
    return Cell([c[i] for c in study.curves(arm, key) if len(c) > i])


def al_table(study: Study) -> Table:
    """AL per arm x suite x k, with the ratio to the baseline arm (or the change, without records)."""
    b = study.backend
    pairs = [(s, k) for s in study.suites for k in study.ks]
    columns = [Column(f"k={k}", s) for s, k in pairs]
    cells = {
        a.name: [Cell(study.scalars(a, metric_keys.acceptance_length(s, k, b))) for s, k in pairs] for a in study.arms
    }
    base = cells.get(study.baseline)
    rows = []
    for a in study.arms:
        row_cells = cells[a.name]
        for j, cell in enumerate(row_cells):
            cell.change = _change(cell, base[j] if base else None)
        rows.append(Row(a.name, a.label, row_cells, n=len(a.runs)))
    table = Table("al", "", columns, rows)
    if b == "ref":  # the per-prompt records are the reference decoder's

        def source(row: Row, j: int) -> Source:
            s, k = pairs[j]
            return s, lambda doc: paired.al_counts(doc, k), paired.acceptance_length

        _pair(study, table, source, "per-prompt records")
    else:
        table.notes.append("No intervals: the per-prompt records are the reference decoder's, which did not run.")
    table.title = f"Acceptance length (mean ± std over seeds; {_against(study, table)}; {b} decoder)"
    return table


def acceptance_table(study: Study) -> Table:
    """Unconditional acceptance rate per draft position at the deepest k, on the first suite."""
    suite, k, b = study.suites[0], study.ks[-1], study.backend
    key = metric_keys.accept_rate(suite, k, b)
    curves = {a.name: study.curves(a, key) for a in study.arms}
    depth = max((len(c) for cs in curves.values() for c in cs), default=0)
    columns = [Column(f"pos {i}", "") for i in range(1, depth + 1)]
    rows = [Row(a.name, a.label, [_at(study, a, key, i) for i in range(depth)], n=len(a.runs)) for a in study.arms]
    title = f"Acceptance rate per draft position ({suite}, k={k}: accepted at position i / drafts)"
    return Table("acceptance", title, columns, rows)


def backends_table(study: Study) -> Table | None:
    """AL and the per-position acceptance rate on the first suite at the training depth (the first k), from the
    reference decoder and from vLLM side by side: one drafter, two decoders, the same prompts. None unless both
    ran. An arm vLLM could not serve (its runs' `vllm_skipped` tag) has '-' under vLLM and a note saying why."""
    if set(study.backends) != {"ref", "vllm"}:
        return None
    suite, k = study.suites[0], study.ks[0]
    columns, keys = [], []
    for b in ("ref", "vllm"):
        columns += [Column(f"AL k={k}", b)] + [Column(f"pos {i}", b) for i in range(1, k + 1)]
        keys += [(metric_keys.acceptance_length(suite, k, b), None)]
        keys += [(metric_keys.accept_rate(suite, k, b), i) for i in range(k)]

    def cell(arm, key: str, i: int | None) -> Cell:
        return Cell(study.scalars(arm, key)) if i is None else _at(study, arm, key, i)

    rows = [Row(a.name, a.label, [cell(a, key, i) for key, i in keys], n=len(a.runs)) for a in study.arms]
    title = (
        f"The reference decoder and vLLM side by side ({suite}, k={k}): AL and the acceptance rate per draft "
        "position, mean ± std over seeds"
    )
    table = Table("backends", title, columns, rows)
    skipped = {r.data.tags["vllm_skipped"] for a in study.arms for r in a.runs if "vllm_skipped" in r.data.tags}
    table.notes += [f"vLLM did not run ('-'): {reason}." for reason in sorted(skipped)]
    return table


def drift_table(study: Study) -> Table | None:
    """Sink and self attention mass at drafting step 1 and the deepest step, norm growth there, per suite;
    norm growth with the ratio to the baseline arm."""
    k = study.ks[-1]
    if not study.has_drift:
        return None
    columns = [
        Column("sink, step 1", better="high"),
        Column(f"sink, step {k}", better="high"),
        Column("self, step 1", better="low"),
        Column(f"self, step {k}", better="low"),
        Column(f"norm growth, step {k}", better="one"),
    ]

    rows = []
    for s in study.suites:
        for a in study.arms:
            sink, self_mass = metric_keys.drift(s, k, "sink_mass"), metric_keys.drift(s, k, "self_mass")
            cells = [_at(study, a, sink, 0), _at(study, a, sink, k - 1), _at(study, a, self_mass, 0)]
            cells += [_at(study, a, self_mass, k - 1), _at(study, a, metric_keys.drift(s, k, "norm_growth"), k - 1)]
            rows.append(Row(a.name, a.label, cells, group=s, n=len(a.runs)))
    title = (
        f"Attention drift along the speculation chain (k={k}): attention mass on the sink token and on the "
        "drafter's own drafted tokens, and the growth of the fed-back state's norm"
    )
    table = Table("drift", title, columns, rows)

    def source(row: Row, j: int) -> Source | None:
        if j != len(columns) - 1:
            return None
        return row.group, lambda doc: paired.norm_growth_counts(doc, k, k), paired.norm_growth

    _pair(study, table, source, "per-prompt probe records")
    if table.counts():
        table.title += f" (its ratio to {_base_label(study)})"
    return table


ROLLOUT_KEY = metric_keys.rollout_accuracy("in_dist")


def rollout_table(study: Study) -> Table | None:
    """Teacher-forced rollout accuracy on held-out data at depth 1, the deepest k and the deepest depth all
    runs reached, with the ratio to the baseline arm (bootstrapped over held-out sequences and seeds)."""
    curves = {a.name: study.curves(a, ROLLOUT_KEY) for a in study.arms}
    lengths = [len(c) for cs in curves.values() for c in cs]
    if not lengths or min(lengths) == 0:
        return None
    deepest = min(lengths)
    depths = sorted({d for d in (1, study.ks[-1] if study.ks else 1, deepest) if d <= deepest})
    columns = [Column(f"depth {d}", better="high") for d in depths]
    cells = {a.name: [Cell([c[d - 1] for c in curves[a.name]]) for d in depths] for a in study.arms}
    base = cells.get(study.baseline)
    rows = []
    for a in study.arms:
        for j, cell in enumerate(cells[a.name]):
            cell.change = _change(cell, base[j] if base else None)
        rows.append(Row(a.name, a.label, cells[a.name], n=len(a.runs)))
    table = Table("rollout", "", columns, rows, unit="held-out sequences")

    def source(row: Row, j: int) -> Source:
        return "rollout", lambda doc: paired.rollout_counts(doc, depths[j]), paired.share

    _pair(study, table, source, "per-sequence records")
    table.title = (
        "Teacher-forced rollout accuracy on held-out data at unrolled depth d (the drafter's own states fed "
        f"back; mean ± std over seeds; {_against(study, table)})"
    )
    return table


def proxy_bias_table(study: Study) -> Table | None:
    """Each proxy of the AL minus the exact validation AL at train.select_k, per arm and checkpoint (the mean over
    seeds with its bootstrap interval over seeds and prompts), and across checkpoints whether they rank them alike
    (Kendall's tau) and pick the same best (the share of seeds). None unless the runs validated while training."""
    docs = {a.name: study.records(a, val.RECORDS) for a in study.arms}
    first = next((d for ds in docs.values() for d in ds.values()), None)
    if first is None:
        return None
    k, steps = val.select_k(study.runs[0].data.params, study.ks), val.steps(first)
    columns = [Column(f"step {s}", better="") for s in steps]
    columns += [Column("Kendall τ", better="high"), Column("same best", better="high")]
    rows = []
    for proxy in val.PROXIES:
        for a in study.arms:
            runs = [doc for doc in docs[a.name].values() if val.steps(doc) == steps]
            seeds = [seed for seed, doc in docs[a.name].items() if val.steps(doc) == steps]
            cells = _bias_cells(dict(zip(seeds, runs, strict=True)), len(steps), k, proxy)
            rows.append(Row(a.name, a.label, cells, group=f"{proxy.label} ({proxy.whose})", n=len(a.runs)))
    title = (
        f"Proxy minus the exact validation AL at k={k} per checkpoint (mean over seeds [95 % interval]), and whether "
        "each proxy ranks the checkpoints as the exact AL does (Kendall τ) and picks the same best (share of seeds)"
    )
    table = Table("proxy_bias", title, columns, rows, centre=0.0, grouped_by="proxy")
    table.notes.append(
        "Interval: the 2.5 and 97.5 percentiles of the mean over seeds of the pooled difference, "
        f"{paired.RESAMPLES} bootstrap resamples (seed {paired.BOOTSTRAP_SEED}; seeds, then validation prompts "
        "within each). Bold: the interval excludes 0. simulated_acc_len counts no bonus token: 1 of its gap is "
        "that alone."
    )
    return table


def _bias_cells(runs: dict[str, dict], checkpoints: int, k: int, proxy: val.Proxy) -> list[Cell]:
    """One arm's row of `proxy_bias`: the gap at each checkpoint over its seeds' runs, Kendall's tau, the same best."""
    gap = val.minus_exact(proxy.metric)
    cells = []
    for j in range(checkpoints):
        per_seed = {seed: val.counts(val.checkpoints(doc)[j], k) for seed, doc in runs.items()}
        cell = Cell([paired.pooled(c, gap) for c in per_seed.values()])
        estimate = paired.mean_interval(per_seed, gap) if per_seed else None
        if estimate is not None:
            cell.interval = paired.Interval(
                estimate.mean, estimate.low, estimate.high, estimate.prompts, estimate.seeds
            )
        cells.append(cell)
    exact = [val.values(doc, k, val.exact_al) for doc in runs.values()]
    proxied = [val.values(doc, k, proxy.metric) for doc in runs.values()]
    cells.append(Cell([val.kendall_tau(p, e) for p, e in zip(proxied, exact, strict=True)]))
    same = [val.best_step(doc, k, proxy.metric) == val.best_step(doc, k, val.exact_al) for doc in runs.values()]
    return cells + [Cell([float(s) for s in same])]


def build(study: Study) -> list[Table]:
    """Every table the study's runs support, with the study's footnotes."""
    if not study.runs:
        return []
    tables = [al_table(study), acceptance_table(study)]
    for optional in (backends_table(study), drift_table(study), rollout_table(study), proxy_bias_table(study)):
        if optional is not None:
            tables.append(optional)
    notes = [f"Missing: {gap}." for gap in study.gaps()]
    if study.left_out_note():
        notes.append(study.left_out_note())
    for t in tables:
        t.notes += notes
    return tables
