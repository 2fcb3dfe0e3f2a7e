#!/usr/bin/env bash
# `make demo`: the drift_2x2 ablation in the quick profile (4 arms x 2 seeds, two workers) on the tiny code
# target, its report from MLflow, and where to look. A second run reuses the target, the hidden-state cache
# and the finished runs, and only rewrites the report. The default target (SmolLM2 on regenerated ShareGPT)
# does not fit the demo's 30 minutes on 2 cores (docs/real-target.md: measured costs); `lab run profile=smoke` shows it
# end to end in minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
LAB=${LAB:-.venv/bin/lab}
EXPERIMENT=drift_2x2
TINY=(target=tiny_code data=code)
ARGS=(experiment=$EXPERIMENT profile=quick "${TINY[@]}" --seeds 0,1)
started=$SECONDS

step() { printf '\n== %s (%s elapsed)\n' "$1" "$(date -u -d @$((SECONDS - started)) +%M:%S)"; }

step "1/2 the tiny code target (built once, then cached under .cache/lab)"
"$LAB" target build "${TINY[@]}"

step "2/2 lab ablate ${ARGS[*]} --workers 2 (then the report)"
"$LAB" ablate "${ARGS[@]}" --workers 2

minutes=$(( (SECONDS - started) / 60 )); seconds=$(( (SECONDS - started) % 60 ))
cat <<MSG

== done in ${minutes}m${seconds}s
Main table: reports/$EXPERIMENT/tables/al.md (also .tex and .csv; the drift and acceptance tables beside it)
$(cat reports/$EXPERIMENT/tables/al.md)

Figures:   reports/$EXPERIMENT/figures/ ($(ls reports/$EXPERIMENT/figures | grep -c png) figures, each .png and .pdf)
Report:    reports/$EXPERIMENT/report.md (tables, figures, provenance; regenerate: lab report ${ARGS[*]})
MLflow UI: .venv/bin/lab ui, then http://127.0.0.1:5000 (experiment $EXPERIMENT; the report is also under
           the parent run's artifacts, report/)
The full study (3 seeds, the default profile; hours on 2 cores): .venv/bin/lab ablate experiment=$EXPERIMENT
MSG
