#!/usr/bin/env bash
# The sinks-task study, one command on one GPU:
#
#   bash recipes/sinks_study.sh [OUT_DIR]     # default recipes/results/<UTC date>-sinks-task
#
# Every mode trains recipes/configs/sinks-task.yaml (the Bigram-Backcopy task, on which sinks on <bos> form; the
# same generated data, validation sequences and tokenizer for every run) once per seed, with the attention
# monitor on (the config's --attn_stats):
#   bf16          deltamatch_fp8 --precision bf16 --delta matching   same kernels, no quantization: the noise floor
#   fp8-matching  --precision fp8 --delta matching                   Delta-Matching
#   fp8-stale     --precision fp8 --delta stale                      FlashAttention's delta
# (cuDNN's per-tensor-scaled FP8 with a stale delta is not among them: DeltaMatchConfig's scales are per tile of
# 64 or 128 tokens, with no per-tensor option, so the reference cannot emulate it.)
# then `hf-deltamatch check --model` on every final checkpoint (the task's validation sequences, dQ/dK errors against
# float64 per layer) and the analysis (python -m hf_deltamatch.training.sink_study), which writes
#   OUT_DIR/summary.json   {"modes": {MODE: {"val_loss", "val_acc", "max_sink_mass", "final_ds_residual": [per
#                          seed]}}, "steps": N, "conclusion": "..."}
#   OUT_DIR/results.md     per mode mean ± std and range, gaps against bf16's seed range, the fidelity table
#   OUT_DIR/sink_mass.png, ds_residual.png, val.png
# beside runs/MODE/seed-N/ (metrics.jsonl, summary.json, config.yaml, TensorBoard, final model), fidelity/MODE/seed-N/,
# task.json (the task's parameters), environment.txt and study.log.
#
# Resumable: a finished run is skipped, an unfinished one continues from its last checkpoint (--resume auto; the
# config saves every save_every steps), a finished check is kept. After an interruption (a time limit, Ctrl-C),
# run the same command again.
#
# Environment: CFG (recipes/configs/sinks-task.yaml), SEEDS (0,1,2), MODES ("bf16 fp8-matching fp8-stale"), STEPS
# (the config's max_steps), PARALLEL (runs at once on the one GPU; default every run; capped at free GPU memory //
# RUN_GIB, RUN_GIB 8), EXTRA (more recipe flags for every run), FID_SEQ (the config's seq_len) and FID_BATCH (8):
# the check's sequences, PYTHON, SMOKE=1 (a CPU rehearsal: recipes/configs/sinks-cpu.yaml, STEPS 20, PARALLEL 1,
# FID_BATCH 2).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${1:-$REPO/recipes/results/$(date -u +%F)-sinks-task}
mkdir -p "$OUT/runs" "$OUT/fidelity"
OUT=$(cd "$OUT" && pwd)
cd "$REPO"
PY=${PYTHON:-$(command -v python || command -v python3)}
SMOKE=${SMOKE:-0}
if [ "$SMOKE" = 1 ]; then
  CFG=${CFG:-recipes/configs/sinks-cpu.yaml}
  STEPS=${STEPS:-20}
  PARALLEL=${PARALLEL:-1}
  FID_BATCH=${FID_BATCH:-2}
else
  CFG=${CFG:-recipes/configs/sinks-task.yaml}
fi
SEEDS=${SEEDS:-0,1,2}
MODES=${MODES:-"bf16 fp8-matching fp8-stale"}
RUN_GIB=${RUN_GIB:-8}
FID_BATCH=${FID_BATCH:-8}
EXTRA=${EXTRA:-}
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export HF_DELTAMATCH_CACHE=${HF_DELTAMATCH_CACHE:-$OUT/cache}
export HF_DATASETS_CACHE=${HF_DATASETS_CACHE:-$OUT/cache/datasets}
exec > >(tee -a "$OUT/study.log") 2>&1
T0=$(date +%s)
stamp() { echo "[sinks_study $(( $(date +%s) - T0 ))s] $*"; }
source "$REPO/recipes/_common.sh"
ensure_datasets

mode_flags() {
  case $1 in
    bf16) echo "--precision bf16 --delta matching" ;;
    fp8-matching) echo "--precision fp8 --delta matching" ;;
    fp8-stale) echo "--precision fp8 --delta stale" ;;
    *) echo "unknown mode $1 (bf16 fp8-matching fp8-stale)" >&2; return 2 ;;
  esac
}
for mode in $MODES; do mode_flags "$mode" > /dev/null; done  # a typo fails now, not after the runs
case " $MODES " in *" bf16 "*) ;; *) echo "error: MODES must include bf16 (the noise floor)" >&2; exit 2 ;; esac
# shellcheck disable=SC2206
COMMON=(--config "$CFG" --attn deltamatch_fp8 ${STEPS:+--max_steps "$STEPS"} $EXTRA)

# ---- the task's data, tokenizer and packed blocks, once for every run (a second call finds them made) -------
stamp "preparing the task's data ($CFG)"
PREP=$("$PY" -m hf_deltamatch.training.tasks "${COMMON[@]}" --output_dir "$OUT/cache/prep" | tail -n 1)
# the prepared paths, the run length and the sequence length (the check's default)
{ read -r VAL; read -r TASK_JSON; read -r TOK_DIR; read -r STEPS; read -r SEQ_LEN; } < <("$PY" -c '
import json, sys
p = json.loads(sys.argv[1])
print(*(p[k] for k in ("val", "task", "tokenizer", "max_steps", "seq_len")), sep="\n")' "$PREP")
FID_SEQ=${FID_SEQ:-$SEQ_LEN}
cp "$TASK_JSON" "$OUT/task.json"
TOK=(--tokenizer "$TOK_DIR")
{
  "$PY" -c "
import torch, transformers
try:
    import triton
    tv = triton.__version__
except ImportError:
    tv = 'not installed'
print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', tv, 'device',
      torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')"
  echo "config: $CFG  steps: $STEPS  seeds: $SEEDS  modes: $MODES  extra: ${EXTRA:-none}"
  echo "git: $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo '?')"
  echo "validation sequences: $(sha256sum "$VAL" | cut -c1-16) (sha256 of val.jsonl, $(wc -l < "$VAL") lines)"
} > "$OUT/environment.txt"
cat "$OUT/environment.txt"

# ---- the runs: one process per (mode, seed), PARALLEL at a time ----------------------------------------------
finished() {  # run dir: its summary says it trained all STEPS
  "$PY" - "$1/summary.json" "$STEPS" <<'PYEOF'
import json, sys
from pathlib import Path
p = Path(sys.argv[1])
s = json.loads(p.read_text()) if p.is_file() else {}
sys.exit(0 if s.get("steps") == int(sys.argv[2]) and not s.get("interrupted") else 1)
PYEOF
}
run_one() {  # mode seed: trains into runs/MODE/seed-N (continuing a checkpoint there); output in seed-N.log
  local dir="$OUT/runs/$1/seed-$2" rc=0 fd
  if command -v flock > /dev/null; then
    # the run's lock, inherited by its training process: a run left going by an earlier call of the study (whose
    # shell was killed) is waited for, not started twice into one directory
    exec {fd}> "$dir.lock"
    flock "$fd"
    if finished "$dir"; then echo 0 > "$dir.rc"; return 0; fi
  fi
  # shellcheck disable=SC2046
  "$PY" recipes/pretrain.py "${COMMON[@]}" "${TOK[@]}" $(mode_flags "$1") --seed "$2" --output_dir "$dir" \
    --run_name "$1-seed$2" --resume auto >> "$dir.log" 2>&1 || rc=$?
  echo "$rc" > "$dir.rc"
  return "$rc"
}
PAIRS=()
for mode in $MODES; do
  mkdir -p "$OUT/runs/$mode"
  for seed in ${SEEDS//,/ }; do
    if finished "$OUT/runs/$mode/seed-$seed"; then
      stamp "run $mode seed $seed: finished before, kept"
    else
      PAIRS+=("$mode $seed")
    fi
  done
done
PARALLEL=${PARALLEL:-${#PAIRS[@]}}
[ "$PARALLEL" -ge 1 ] || PARALLEL=1
FREE_GIB=
[ ${#PAIRS[@]} = 0 ] || FREE_GIB=$("$PY" -c 'import torch; c = torch.cuda
print(c.mem_get_info()[0] // 2**30 if c.is_available() else "")')
if [ -n "$FREE_GIB" ]; then
  CAP=$(( FREE_GIB / RUN_GIB ))
  [ "$CAP" -ge 1 ] || CAP=1
  [ "$CAP" -lt "$PARALLEL" ] || CAP=$PARALLEL
  PARALLEL=$CAP
fi
stamp "${#PAIRS[@]} runs to do, $PARALLEL at a time"
wait_for_slot() { while [ "$(jobs -rp | wc -l)" -ge "$PARALLEL" ]; do sleep 1; done; }
PIDS=()
for pair in "${PAIRS[@]}"; do
  wait_for_slot
  stamp "run $pair"
  # shellcheck disable=SC2086  # "mode seed": two arguments
  run_one $pair &
  PIDS+=($!)
done
[ ${#PIDS[@]} = 0 ] || wait "${PIDS[@]}" || true  # (a bare `wait` would also wait for the log's tee)
failed=0
for pair in "${PAIRS[@]}"; do
  read -r mode seed <<< "$pair"
  if ! finished "$OUT/runs/$mode/seed-$seed"; then
    echo "error: run $mode seed $seed did not finish; the end of its log:" >&2
    tail -n 30 "$OUT/runs/$mode/seed-$seed.log" >&2
    failed=1
  fi
done
[ "$failed" = 0 ] || { echo "run the same command again to continue the unfinished runs" >&2; exit 1; }
stamp "all runs finished"

# ---- hf-deltamatch check --model on every final checkpoint ----------------------------------------------------
# One process checks every model (`hf-deltamatch check`'s own functions; the start-up once): per model
# fidelity/MODE/seed-N/fidelity.json, fidelity.png, and the CLI's tables in fidelity/MODE/seed-N.txt.
CHECKS=()
for mode in $MODES; do
  for seed in ${SEEDS//,/ }; do
    [ -f "$OUT/fidelity/$mode/seed-$seed/fidelity.json" ] || CHECKS+=("$mode/seed-$seed")
  done
done
if [ ${#CHECKS[@]} -gt 0 ]; then
  stamp "hf-deltamatch check --model on ${#CHECKS[@]} final checkpoint(s): ${FID_BATCH} x ${FID_SEQ} tokens each"
  "$PY" - "$OUT" "$VAL" "$FID_SEQ" "$FID_BATCH" "${CHECKS[@]}" <<'PYEOF'
import json, sys
from pathlib import Path

import torch

from hf_deltamatch import fidelity

out, val, seq, batch = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
for run in sys.argv[5:]:
    report = fidelity.check_model(out / "runs" / run / "final", val, seq_len=seq, batch=batch,
                                  device="cuda" if torch.cuda.is_available() else "cpu")
    dest = out / "fidelity" / run
    dest.mkdir(parents=True, exist_ok=True)
    fidelity.plot(report, dest / "fidelity.png")
    (dest.parent / f"{dest.name}.txt").write_text(fidelity.format_tables(report) + "\n")
    (dest / "fidelity.json").write_text(json.dumps(report, indent=1))  # last: it marks the check done
    print(f"checked {run}", flush=True)
PYEOF
fi

# ---- analysis --------------------------------------------------------------------------------------------------
stamp "analysis"
"$PY" -m hf_deltamatch.training.sink_study "$OUT/runs" --out "$OUT" --modes "${MODES// /,}" --baseline bf16 \
  --fidelity "$OUT/fidelity"
stamp "done: $OUT/summary.json, $OUT/results.md"
