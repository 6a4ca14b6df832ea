#!/usr/bin/env bash
# One call on the GPU machine: the GPU tests, then the attention benchmark, the benchmark's table printed last.
#
#   bash benchmarks/gpu_check.sh "$OUT"          # $OUT: the folder whose files come back from the device
#
# Writes under OUT: nvidia-smi.txt, pytest-gpu.log, attention-progress.log and the benchmark's
# attention-<date>-<gpu>.json/.md. Budget ~10 min on one H200 (env-overridable, seconds):
#   GPU_CHECK_TOTAL            the whole script (default 590)
#   GPU_CHECK_PYTEST_TIMEOUT   `pytest -m gpu` (default 570; the whole GPU suite takes more than one 600 s call);
#                              the benchmark gets what is left of the total and is skipped when that is under
#                              120 s: run it in a call of its own
#   GPU_CHECK_LAST_SHAPE       room kept for the last shape: the benchmark starts no new shape once less than
#                              this is left (default 100; N=65536 is the longest). At the total the benchmark is
#                              killed; it writes its results after every shape, so the finished ones remain.
#   GPU_CHECK_PYTEST_ARGS      extra arguments for pytest, to split the GPU tests over two calls: -k "hopper or
#                              dense_fp8 or modes or exact_attention" (~420 s) and the rest (~190 s); the
#                              benchmark then gets a call of its own
#   GPU_CHECK_BENCH_ARGS       extra arguments for benchmarks/attention.py (e.g. "--quick")
#   PYTHON                     interpreter (default python3: the GPU image has no `python`)
# Exit status: the benchmark's if it failed, else pytest's (5 = no gpu tests collected counts as success).
set -u

OUT="${1:-${OUT:-}}"
if [ -z "$OUT" ]; then
    echo "usage: bash benchmarks/gpu_check.sh OUT_DIR" >&2
    exit 2
fi
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$(dirname "$0")/.."  # repository root: tests and the package import from here

PYTHON="${PYTHON:-python3}"
TOTAL="${GPU_CHECK_TOTAL:-590}"
PYTEST_TIMEOUT="${GPU_CHECK_PYTEST_TIMEOUT:-570}"
LAST_SHAPE="${GPU_CHECK_LAST_SHAPE:-100}"
started=$(date +%s)

nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || echo "nvidia-smi failed (see $OUT/nvidia-smi.txt)"

# 1. GPU tests. A hang must not eat the benchmark's time: timeout kills pytest after PYTEST_TIMEOUT.
# shellcheck disable=SC2086  # GPU_CHECK_PYTEST_ARGS is meant to split into arguments
timeout "$PYTEST_TIMEOUT" "$PYTHON" -m pytest -m gpu tests -q -p no:cacheprovider ${GPU_CHECK_PYTEST_ARGS:-} \
    > "$OUT/pytest-gpu.log" 2>&1
pytest_rc=$?
case $pytest_rc in
    0) pytest_status="passed" ;;
    5) pytest_status="no gpu tests collected"; pytest_rc=0 ;;
    124) pytest_status="TIMED OUT after ${PYTEST_TIMEOUT} s" ;;
    *) pytest_status="FAILED (rc=$pytest_rc)" ;;
esac
echo "== pytest -m gpu: $pytest_status ($(( $(date +%s) - started )) s; log: pytest-gpu.log) =="
tail -n 25 "$OUT/pytest-gpu.log"

# 2. The benchmark: progress to a log, the markdown (stdout) kept to print last; skipped when the tests left it
# less than two minutes (the whole GPU suite takes more than a 10-minute call).
bench_started=$(date +%s)
BENCH_TIMEOUT=$(( TOTAL - (bench_started - started) ))
if [ "$BENCH_TIMEOUT" -lt 120 ]; then
    echo
    echo "== benchmark skipped: ${BENCH_TIMEOUT} s left of ${TOTAL}; run python3 benchmarks/attention.py --out \$OUT in a call of its own =="
    echo "== total $(( $(date +%s) - started )) s; pytest -m gpu: $pytest_status =="
    exit "$pytest_rc"
fi
BENCH_BUDGET=$(( BENCH_TIMEOUT - LAST_SHAPE ))
[ "$BENCH_BUDGET" -lt 1 ] && BENCH_BUDGET=1
# shellcheck disable=SC2086  # GPU_CHECK_BENCH_ARGS is meant to split into arguments
timeout "$BENCH_TIMEOUT" "$PYTHON" benchmarks/attention.py --out "$OUT" --time-budget "$BENCH_BUDGET" \
    ${GPU_CHECK_BENCH_ARGS:-} > "$OUT/attention-stdout.md" 2> "$OUT/attention-progress.log"
bench_rc=$?
echo
echo "== benchmark: rc=$bench_rc$([ "$bench_rc" -eq 124 ] && echo " (killed at ${BENCH_TIMEOUT} s)") ($(( $(date +%s) - bench_started )) s; budget ${BENCH_BUDGET} s; progress log: attention-progress.log) =="
grep -v '^\[' "$OUT/attention-progress.log" | tail -n 15  # warnings and tracebacks, not the progress lines
echo "== total $(( $(date +%s) - started )) s; pytest -m gpu: $pytest_status =="
echo

if [ -s "$OUT/attention-stdout.md" ]; then
    cat "$OUT/attention-stdout.md"
else  # killed or crashed before printing: show the report of the shapes it finished, if any
    tail -n 30 "$OUT/attention-progress.log"
    latest=$(ls -t "$OUT"/attention-*.md 2>/dev/null | grep -v attention-stdout.md | head -n 1)
    if [ -n "$latest" ]; then
        echo "(partial report: $(basename "$latest"))"
        cat "$latest"
    fi
fi
rm -f "$OUT/attention-stdout.md"  # the same content is in attention-<date>-<gpu>.md

if [ "$bench_rc" -ne 0 ]; then
    exit "$bench_rc"
fi
exit "$pytest_rc"
