#!/usr/bin/env bash
# Nsight Compute on the attention kernels: where each kernel's warps stall, per kernel and per SASS instruction.
#
#   bash benchmarks/ncu_profile.sh OUT [SHAPE ...]     # SHAPEs from kernel_breakdown.py (default d128-causal)
#
# Profiles one fwd+bwd per shape (after a warm-up call that compiles everything; only the profiled call is
# between cudaProfilerStart/Stop) with `--set full` and the clocks left alone (METHOD.md), then writes under OUT,
# per shape: ncu-SHAPE-details.txt (every section of every kernel), ncu-SHAPE-source.tar.gz (per kernel,
# ncu-SHAPE-source-KERNEL.csv.gz: per SASS instruction, warp stall samples by reason and instructions executed;
# read them with benchmarks/ncu_stalls.py) and ncu-SHAPE.log; with NCU_KEEP_REPORT=1 also ncu-SHAPE.ncu-rep (the
# report for the Nsight Compute GUI, ~11 MB). Three files per shape: the device tool returns few files per call.
# Needs a machine whose runtime exposes the hardware counters (KINDS.md: Firecracker).
# NCU_KERNELS: the kernel-name regex (default: every kernel but the quantize/copy ones).
set -eu
OUT="$1"; shift
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
KERNELS="${NCU_KERNELS:-regex:_fwd|_bwd}"
for shape in "${@:-d128-causal}"; do
    ncu --clock-control none --profile-from-start off --set full --import-source no -k "$KERNELS" \
        -f -o "$OUT/ncu-$shape" "$PYTHON" benchmarks/kernel_breakdown.py --profile-once "$shape" \
        > "$OUT/ncu-$shape.log" 2>&1 || { tail -20 "$OUT/ncu-$shape.log"; exit 1; }
    ncu -i "$OUT/ncu-$shape.ncu-rep" --page details > "$OUT/ncu-$shape-details.txt"
    for k in _fwd_kernel _fwd_hopper_kernel _bwd_dq_kernel _bwd_dq_hopper_kernel _bwd_dkdv_kernel \
             _bwd_dkdv_hopper_kernel; do
        f="$OUT/ncu-$shape-source-$k.csv"
        ncu -i "$OUT/ncu-$shape.ncu-rep" -k "$k" --page source --csv --print-source sass > "$f" 2>&1 || true
        if [ "$(wc -l < "$f")" -gt 5 ]; then gzip -f "$f"; else rm -f "$f"; fi  # rm: not in this shape's run
    done
    (cd "$OUT" && tar czf "ncu-$shape-source.tar.gz" ncu-"$shape"-source-*.csv.gz && rm -f ncu-"$shape"-source-*.csv.gz)
    [ "${NCU_KEEP_REPORT:-0}" = 1 ] || rm -f "$OUT/ncu-$shape.ncu-rep"
    grep -E '^  [_a-z]|Duration|Warp Cycles Per Issued|Issue Slots Busy|Issued Ipc|Stall|Registers Per' \
        "$OUT/ncu-$shape-details.txt" | head -80
done
