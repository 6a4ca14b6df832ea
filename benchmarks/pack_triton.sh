#!/usr/bin/env bash
# A Triton wheel cut down to what the H200 runs need, so that it travels to the GPU machine (64 MiB per call, the
# working tree included) with the FLA and datasets wheels beside it:
#
#   bash benchmarks/pack_triton.sh WHEEL OUT_DIR --keep-ptxas ptxas-blackwell   # Triton 3.9: sm_90 takes ptxas-blackwell
#   bash benchmarks/pack_triton.sh WHEEL OUT_DIR --keep-ptxas ptxas             # Triton 3.7.x: the CUDA 12 ptxas
#
# Drops the AMD backend, the CUPTI libraries (kernel profiling only) and the ptxas that sm_90 does not run (which one
# it runs: triton_versions.sh's versions.txt), and strips the shared libraries' debug info (3.9's libtriton.so: 477 ->
# 184 MB). Keeps cuobjdump and nvdisasm (sm90_registers.py reads resource usage and SASS with them). Writes
# OUT_DIR/triton-<version>.tar.xz (3.9.0: 52 MiB); with --part-mib N, parts of N MiB (.part.aa, .ab, ...) instead.
# On the GPU machine:
#   mkdir -p /tmp/tsite && cat OUT_DIR/triton-*.tar.xz* | xz -d | tar x -C /tmp/tsite
#   PYTHONPATH=/tmp/tsite:$PYTHONPATH HF_DELTAMATCH_GLUON=1 bash benchmarks/triton_versions.sh "$OUT"
set -euo pipefail

usage() { echo "usage: bash benchmarks/pack_triton.sh WHEEL OUT_DIR --keep-ptxas ptxas|ptxas-blackwell [--part-mib N]" >&2; exit 2; }
[ $# -ge 2 ] || usage
WHEEL=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
OUT=$2
shift 2
KEEP="" PART=0
while [ $# -gt 0 ]; do
    case $1 in
        --keep-ptxas) KEEP=${2:-}; shift 2 ;;
        --part-mib) PART=${2:-}; shift 2 ;;
        *) usage ;;
    esac
done
case $KEEP in ptxas|ptxas-blackwell) ;; *) usage ;; esac
[ -f "$WHEEL" ] || { echo "error: no wheel at $WHEEL" >&2; exit 2; }
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"
# extract with each file's recorded mode (`python -m zipfile -e` drops it: ptxas came out not executable)
python3 - "$WHEEL" <<'PYEOF'
import os, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for info in z.infolist():
        path = z.extract(info)
        mode = info.external_attr >> 16 & 0o777
        if mode and not info.is_dir():
            os.chmod(path, mode)
PYEOF
[ -d triton/backends/nvidia ] || { echo "error: $WHEEL holds no triton/backends/nvidia" >&2; exit 2; }
BIN=triton/backends/nvidia/bin
[ -f "$BIN/$KEEP" ] || { echo "error: the wheel has no $BIN/$KEEP (it has: $(ls "$BIN" | tr '\n' ' '))" >&2; exit 2; }
for p in ptxas ptxas-blackwell; do
    [ "$p" = "$KEEP" ] || rm -f "$BIN/$p"
done
rm -rf triton/backends/amd triton/backends/nvidia/lib/cupti*
sed -i '/amd/d' triton-*.dist-info/entry_points.txt 2>/dev/null || true
if command -v strip > /dev/null; then
    find triton -name '*.so*' -type f | while read -r so; do
        # ELF files only (b'\x7fELF'); strip keeps the dynamic symbols the loader needs
        if [ "$(head -c 4 "$so" | od -An -c | tr -d ' ')" = '177ELF' ]; then strip --strip-unneeded "$so"; fi
    done
else
    echo "warning: no 'strip' (binutils): the libraries keep their debug info and the archive is ~2x larger" >&2
fi
VERSION=$(sed -n 's/^Version: //p' triton-*.dist-info/METADATA)
NAME="triton-$VERSION.tar.xz"
rm -f "$OUT/$NAME" "$OUT/$NAME".part.*
if [ "$PART" -gt 0 ]; then
    tar c triton triton-*.dist-info | xz -T0 -9 | split -b "${PART}M" - "$OUT/$NAME.part."
else
    tar c triton triton-*.dist-info | xz -T0 -9 > "$OUT/$NAME"
fi
ls -l "$OUT/$NAME"*
