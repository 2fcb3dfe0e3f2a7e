"""Paper-style tables of a study, each rendered as Markdown, LaTeX (booktabs) and CSV.

- `al`: AL per arm x suite x drafting depth k, mean +- std over seeds (n), change against the baseline arm;
- `acceptance`: the per-position acceptance rate (accepted at position i / drafts) at the deepest k;
- `drift`: sink and self attention mass at drafting step 1 and at the deepest step, norm growth there.

The best value of each column (within a suite) is bold. Formatting is fixed, so the same MLflow content
gives byte-identical files.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass, field

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


def _cell_text(table: Table, row: Row, cell: Cell, pm: str) -> tuple[str, str]:
    """(value text, annotation) of a cell: 'mean pm std' and '(+3.1%)', 'n=2' where fewer seeds."""
    if not cell.values:
        return "-", ""
    text = f"{_num(cell.mean, table.digits)}{pm}{_num(cell.std, table.digits)}"
    notes = []
    if cell.change is not None:
        notes.append(f"{cell.change:+.1%}")
    if cell.n < row.n:
        notes.append(f"n={cell.n}")
    return text, " ".join(notes)


def markdown(table: Table) -> str:
    best = table.best()
    grouped = any(r.group for r in table.rows)
    head = ["arm"] + (["suite"] if grouped else []) + ["n"]
    head += [f"{c.group} {c.label}".strip() for c in table.columns]
    lines = [f"**{table.title}**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, row in enumerate(table.rows):
        cells = [row.label] + ([row.group] if grouped else []) + [str(row.n)]
        for j, cell in enumerate(row.cells):
            text, note = _cell_text(table, row, cell, " ± ")
            if (i, j) in best:
                text = f"**{text}**"
            cells.append(f"{text} ({note})" if note else text)
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
}


def latex_escape(text: str) -> str:
    return "".join(_LATEX_SPECIAL.get(ch, ch) for ch in text)


def latex(table: Table) -> str:
    """A booktabs `table` environment: a header row per column group, bold best, notes under it."""
    best = table.best()
    grouped = any(r.group for r in table.rows)
    lead = ["Arm"] + (["Suite"] if grouped else []) + ["$n$"]
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
            text, note = _cell_text(table, row, cell, r"$\pm$")
            if (i, j) in best:
                text = rf"\textbf{{{text}}}"
            cells.append(text + (rf" {{\scriptsize({latex_escape(note)})}}" if note else ""))
        out.append(" & ".join(cells) + r" \\")
    out += [r"\bottomrule", r"\end{tabular}"]
    if table.notes:
        out.append(r"\par\smallskip\footnotesize " + " ".join(latex_escape(n) for n in table.notes))
    out.append(r"\end{table}")
    return "\n".join(out) + "\n"


def to_csv(table: Table) -> str:
    """Tidy rows (one per arm x column) for notebooks: the numbers unrounded."""
    best = table.best()
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(
        ["table", "arm", "label", "row_group", "column_group", "column", "mean", "std", "n", "change", "best"]
    )
    for i, row in enumerate(table.rows):
        for j, (col, cell) in enumerate(zip(table.columns, row.cells, strict=True)):
            mean, std = (repr(cell.mean), repr(cell.std)) if cell.values else ("", "")
            change = "" if cell.change is None else repr(cell.change)
            best_mark = int((i, j) in best)
            writer.writerow(
                [table.name, row.arm, row.label, row.group, col.group, col.label, mean, std, cell.n, change, best_mark]
            )
    return buf.getvalue()


def _change(cell: Cell, base: Cell | None) -> float | None:
    if base is None or cell is base or not cell.values or not base.values or base.mean == 0:
        return None
    return cell.mean / base.mean - 1


def al_table(study: Study) -> Table:
    """AL per arm x suite x k, with the change against the baseline arm."""
    b = study.backend
    columns = [Column(f"k={k}", s) for s in study.suites for k in study.ks]
    cells = {
        a.name: [Cell(study.scalars(a, f"eval/{s}/{b}/k{k}/al")) for s in study.suites for k in study.ks]
        for a in study.arms
    }
    base = cells.get(study.baseline)
    rows = []
    for a in study.arms:
        row_cells = cells[a.name]
        for j, cell in enumerate(row_cells):
            cell.change = _change(cell, base[j] if base else None)
        rows.append(Row(a.name, a.label, row_cells, n=len(a.runs)))
    base_label = next((a.label for a in study.arms if a.name == study.baseline), study.baseline)
    title = f"Acceptance length (mean ± std over seeds; change against {base_label}; {b} decoder)"
    return Table("al", title, columns, rows)


def acceptance_table(study: Study) -> Table:
    """Unconditional acceptance rate per draft position at the deepest k, on the first suite."""
    suite, k, b = study.suites[0], study.ks[-1], study.backend
    key = f"eval/{suite}/{b}/k{k}/accept_rate"
    curves = {a.name: study.curves(a, key) for a in study.arms}
    depth = max((len(c) for cs in curves.values() for c in cs), default=0)
    columns = [Column(f"pos {i}", "") for i in range(1, depth + 1)]
    rows = [
        Row(a.name, a.label, [Cell([c[i] for c in curves[a.name] if len(c) > i]) for i in range(depth)], n=len(a.runs))
        for a in study.arms
    ]
    title = f"Acceptance rate per draft position ({suite}, k={k}: accepted at position i / drafts)"
    return Table("acceptance", title, columns, rows)


def drift_table(study: Study) -> Table | None:
    """Sink and self attention mass at drafting step 1 and the deepest step, norm growth there, per suite."""
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

    def at(arm, key: str, step: int) -> Cell:
        return Cell([c[step - 1] for c in study.curves(arm, key) if len(c) >= step])

    rows = []
    for s in study.suites:
        for a in study.arms:
            d = f"drift/{s}/k{k}"
            cells = [at(a, f"{d}/sink_mass", 1), at(a, f"{d}/sink_mass", k), at(a, f"{d}/self_mass", 1)]
            cells += [at(a, f"{d}/self_mass", k), at(a, f"{d}/norm_growth", k)]
            rows.append(Row(a.name, a.label, cells, group=s, n=len(a.runs)))
    title = (
        f"Attention drift along the speculation chain (k={k}): attention mass on the sink token and on the "
        "drafter's own drafted tokens, and the growth of the fed-back state's norm"
    )
    return Table("drift", title, columns, rows)


def build(study: Study) -> list[Table]:
    """Every table the study's runs support, with the study's footnotes."""
    if not study.runs:
        return []
    tables = [al_table(study), acceptance_table(study)]
    drift = drift_table(study)
    if drift is not None:
        tables.append(drift)
    notes = [f"Missing: {gap}." for gap in study.gaps()]
    if study.left_out_note():
        notes.append(study.left_out_note())
    for t in tables:
        t.notes += notes
    return tables
