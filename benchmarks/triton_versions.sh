#!/usr/bin/env bash
# The Gluon (sm_90) kernels on the Triton found first on PYTHONPATH, in one call on the GPU machine: before a
# release joins kernels/toolchain.py's RELEASES, its GPU tests must pass and its times be recorded.
#
#   PYTHONPATH=/path/to/triton-3.9:$PYTHONPATH bash benchmarks/triton_versions.sh "$OUT"
#
# HF_DELTAMATCH_GLUON=1 is set throughout, so the Gluon kernels run on any version (toolchain.current).
# Writes under OUT:
#   versions.txt       triton, torch, the sm_90 ptxas (its CUDA release decides the dK/dV kernel's pipelined MMA:
#                      toolchain.PIPE_PTXAS_BELOW) and the GPU
#   operands.log       benchmarks/sm90_registers.py --operands for the dK/dV kernel's default configs (D=128 causal
#                      and full, D=64 causal and full) and the pipelined MMA forced on (D=128 full): compile-time,
#                      "operands: ok" or WRONG per config
#   pytest-ids.txt, pytest-gluon-<i>.log
#                      pytest -m gpu tests/test_kernels_gpu.py -k "hopper" (the Gluon kernels' GPU tests): the ids,
#                      then TV_PARALLEL (default 4) processes' verbose logs, the ids dealt round-robin
#   gpu-peak.txt       each test's peak GPU memory (GiB reserved by PyTorch; tests/conftest.py)
#   attention-*.json/.md, attention-progress.log
#                      benchmarks/attention.py on 8K causal/full at D=128 and D=64, fp8-matching vs SDPA cuDNN
# Budget ~10 min on one H200 (env-overridable, seconds): TV_TOTAL (default 590) for the whole script,
# TV_PYTEST_TIMEOUT (default 330) for the tests (each process); TV_PYTEST_K replaces the -k expression (default
# "hopper"; spaces allowed, e.g. "window or (ragged and 129-)"), TV_PYTEST_ARGS the whole selection (split on
# spaces); TV_PARALLEL (default 4) the test processes, capped at what the free GPU memory holds at
# TV_GIB_PER_PROCESS (default 8) GiB each;
# TV_SHAPES (default n8192c,n8192f,d64,B2-H32-KV32-N8192-D64-full) and TV_OPS (default dm-fp8-matching,sdpa-cudnn)
# for the benchmark, TV_BENCH=0 to leave it out (two versions' tests at once in one call, their timings apart after);
# PYTHON (default python3).
# Exit status: the benchmark's if it failed, else pytest's.
set -u

OUT="${1:-${OUT:-}}"
if [ -z "$OUT" ]; then
    echo "usage: PYTHONPATH=/path/to/triton:\$PYTHONPATH bash benchmarks/triton_versions.sh OUT_DIR" >&2
    exit 2
fi
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$(dirname "$0")/.."  # repository root: tests and the package import from here
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
export HF_DELTAMATCH_GLUON=1

PYTHON="${PYTHON:-python3}"
TOTAL="${TV_TOTAL:-590}"
PYTEST_TIMEOUT="${TV_PYTEST_TIMEOUT:-330}"
SHAPES="${TV_SHAPES:-n8192c,n8192f,d64,B2-H32-KV32-N8192-D64-full}"
OPS="${TV_OPS:-dm-fp8-matching,sdpa-cudnn}"
started=$(date +%s)

# 0. What runs: a Triton from the wrong place would make every result below about another version.
"$PYTHON" - > "$OUT/versions.txt" 2>&1 <<'EOF'
import subprocess, torch, triton
from hf_deltamatch.kernels import configs, toolchain
print("triton", triton.__version__, triton.__file__, "record:", toolchain.current())
print("torch", torch.__version__, "cuda", torch.version.cuda)
print("sm_90 ptxas", toolchain.sm90_ptxas(), "CUDA major", toolchain.sm90_ptxas_major())
print(subprocess.run([toolchain.sm90_ptxas(), "--version"], capture_output=True, text=True).stdout.strip())
cfg = configs.dkdv_hopper(128, causal=True, groups=1, padded=False, window=False, pins={})
print("pipelined dK MMA by default:", cfg["pipe"], "fresh dP accumulator:", cfg["fresh_dp"])
print("gpu", torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
EOF
cat "$OUT/versions.txt"

# 1. Compile-time check of the dK/dV kernel's MMA operands (no GPU time; a few seconds per config on 16 cores).
: > "$OUT/operands.log"
for args in "--d 128" "--d 128 --full" "--d 64" "--d 64 --full" "--d 128 --full --dkdv-pipe on"; do
    echo "== sm90_registers.py --kernels hopper --operands $args" >> "$OUT/operands.log"
    # shellcheck disable=SC2086  # $args is meant to split into arguments
    "$PYTHON" benchmarks/sm90_registers.py --kernels hopper --operands $args >> "$OUT/operands.log" 2>&1
done
echo "== operand checks (operands.log) =="
grep -E "^== |operands: " "$OUT/operands.log"

# 2. The Gluon kernels' GPU tests, in TV_PARALLEL processes (their compiles dominate and run on the host's cores): the
#    selected test ids dealt round-robin, each process verbose, so that a log names every test that passed before a
#    time limit stopped it.
PARALLEL="${TV_PARALLEL:-4}"
# Test processes peaked at 3.1-5.0 GiB of GPU memory on the H200 (gpu-peak.txt; the float64 references a head at a
# time): no more processes than the free memory holds at TV_GIB_PER_PROCESS (default 8), or the extra ones fail
# with out-of-memory errors, not test failures.
GIB_PER_PROCESS="${TV_GIB_PER_PROCESS:-8}"
if command -v nvidia-smi > /dev/null 2>&1; then
    free_mib=$(nvidia-smi --query-gpu=memory.free --format=csv,noheader,nounits 2>/dev/null | head -n 1)
    if [ -n "$free_mib" ] && [ "$free_mib" -eq "$free_mib" ] 2>/dev/null; then
        fit=$(( free_mib / (GIB_PER_PROCESS * 1024) ))
        [ "$fit" -lt 1 ] && fit=1
        if [ "$PARALLEL" -gt "$fit" ]; then
            echo "== TV_PARALLEL $PARALLEL -> $fit: $free_mib MiB of GPU memory free, $GIB_PER_PROCESS GiB per process =="
            PARALLEL=$fit
        fi
    fi
fi
if [ -n "${TV_PYTEST_ARGS:-}" ]; then
    # shellcheck disable=SC2206  # TV_PYTEST_ARGS is meant to split into arguments
    SELECT=(${TV_PYTEST_ARGS})
else
    SELECT=(-k "${TV_PYTEST_K:-hopper}")
fi
"$PYTHON" -m pytest -m gpu tests/test_kernels_gpu.py -q --collect-only -p no:cacheprovider "${SELECT[@]}" \
    2>/dev/null | grep '::' > "$OUT/pytest-ids.txt"
rm -f "$OUT"/pytest-shard-*.txt "$OUT"/pytest-gluon-*.log "$OUT/gpu-peak.txt"
# each test's peak GPU memory (tests/conftest.py), for TV_GIB_PER_PROCESS
export HF_DELTAMATCH_GPU_PEAK_LOG="$OUT/gpu-peak.txt"
if [ -s "$OUT/pytest-ids.txt" ]; then
    awk -v n="$PARALLEL" -v out="$OUT" '{ print > (out "/pytest-shard-" ((NR - 1) % n) ".txt") }' "$OUT/pytest-ids.txt"
    pids=()
    for shard in "$OUT"/pytest-shard-*.txt; do
        i=$(basename "$shard" .txt); i=${i#pytest-shard-}
        # shellcheck disable=SC2046  # one test id per line, none with spaces
        timeout "$PYTEST_TIMEOUT" "$PYTHON" -m pytest -m gpu -v -p no:cacheprovider -rs $(cat "$shard") \
            > "$OUT/pytest-gluon-$i.log" 2>&1 &
        pids+=($!)
    done
else  # nothing collected (an interpreter stand-in): one process with the selection itself
    timeout "$PYTEST_TIMEOUT" "$PYTHON" -m pytest -m gpu tests/test_kernels_gpu.py -v -p no:cacheprovider -rs \
        "${SELECT[@]}" > "$OUT/pytest-gluon-0.log" 2>&1 &
    pids=($!)
fi
pytest_rc=0
for pid in "${pids[@]}"; do
    wait "$pid"
    rc=$?
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 124 ]; then  # a failure outranks a time limit
        pytest_rc=$rc
    elif [ "$rc" -eq 124 ] && [ "$pytest_rc" -eq 0 ]; then
        pytest_rc=124
    fi
done
case $pytest_rc in
    0) pytest_status="passed" ;;
    124) pytest_status="TIMED OUT after ${PYTEST_TIMEOUT} s" ;;
    *) pytest_status="FAILED (rc=$pytest_rc)" ;;
esac
echo "== pytest -m gpu tests/test_kernels_gpu.py: $pytest_status (${#pids[@]} processes, $(( $(date +%s) - started )) s) =="
if [ -s "$OUT/gpu-peak.txt" ]; then
    echo "== the largest GPU peaks (GiB reserved, gpu-peak.txt) =="
    sort -k2 -n "$OUT/gpu-peak.txt" | tail -n 3
fi
cat "$OUT"/pytest-gluon-*.log | grep -E "^(ERRS|GLUON vs|DKDV PIPE)| (PASSED|FAILED|ERROR|SKIPPED)|passed|failed" \
    | tail -n 60

# 3. The benchmark on the shapes the Gluon kernels serve, in what is left of the budget.
BENCH_TIMEOUT=$(( TOTAL - ($(date +%s) - started) ))
if [ "${TV_BENCH:-1}" = 0 ]; then
    echo "== benchmark left out (TV_BENCH=0): benchmarks/attention.py --shapes $SHAPES --ops $OPS =="
    exit "$pytest_rc"
fi
if [ "$BENCH_TIMEOUT" -lt 90 ]; then
    echo "== benchmark skipped: ${BENCH_TIMEOUT} s left; run benchmarks/attention.py --shapes $SHAPES in a call of its own =="
    exit "$pytest_rc"
fi
timeout "$BENCH_TIMEOUT" "$PYTHON" benchmarks/attention.py --out "$OUT" --shapes "$SHAPES" --ops "$OPS" \
    --time-budget $(( BENCH_TIMEOUT - 60 )) > "$OUT/attention-stdout.md" 2> "$OUT/attention-progress.log"
bench_rc=$?
echo "== benchmark: rc=$bench_rc; total $(( $(date +%s) - started )) s =="
grep -v '^\[' "$OUT/attention-progress.log" | tail -n 15
cat "$OUT/attention-stdout.md"
rm -f "$OUT/attention-stdout.md"
if [ "$bench_rc" -ne 0 ]; then
    exit "$bench_rc"
fi
exit "$pytest_rc"
