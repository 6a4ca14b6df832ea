#!/usr/bin/env bash
# The convergence study with its noise floor, one command on one GPU:
#
#   bash recipes/convergence_study.sh [OUT_DIR]     # default recipes/results/<UTC date>-convergence
#
# Same data, validation split (--data_seed 0), tokenizer and model for every run; each mode runs once per seed
# (recipes' --seeds) with the attention monitor on (--attn_stats):
#   bf16          deltamatch_fp8 --precision bf16            same kernels, no quantization: the noise floor
#   fp8-matching  --precision fp8 --delta matching           Delta-Matching
#   fp8-stale     --precision fp8 --delta stale              FlashAttention's delta
#   fp8-fwd       --precision fp8_fwd                        ablation: fp8 forward, bf16 backward
#   fp8-bwd       --precision fp8_bwd                        ablation: bf16 forward, fp8 backward (Delta-Matching)
#   fp8-bwd-stale --precision fp8_bwd --delta stale          ablation: bf16 forward, fp8 backward, stale delta
# then `hf-deltamatch check --model --qk-transforms` on each mode's seed-0 final model (and on the warm-start checkpoint;
# with the outlier transforms: do they help on trained q and k?), and
# OUT_DIR/results.md: final validation CE mean ± std per mode (or at eval step STEP), the gap to bf16, whether it
# exceeds bf16's seed range, and the paired per-seed gaps (hf_deltamatch/training/sweep.py), the fidelity summary,
# loss.png and loss_attn.png (seed 0 of each mode).
#
# Where the stale failure lives (peaked attention, sinks) a small model reaches only after long training, so:
# WARM_STEPS=N first trains bf16 (seed 0) for N steps with the monitor on (loss_attn.png of runs/warm shows when
# sink mass rises) and every mode then continues from that checkpoint; INIT=DIR continues from a checkpoint you
# have instead. Seeds then vary the data order only.
#
# Environment: CFG (recipes/configs/dense-small.yaml), SEEDS (0,1,2), STEPS (600 optimizer steps of 2 x 8K
# tokens per run), MODES ("bf16 fp8-matching fp8-stale fp8-fwd fp8-bwd"; add fp8-bwd-stale to split the stale
# delta's effect), ATTN_STATS (25), WARM_STEPS (0), INIT, FID_SEQ (2048 tokens x 2 sequences for the fidelity
# check; FID_DATA: its text, default the offline corpus), PYTHON, EXTRA (more recipe flags for every run),
# SMOKE=1 (a tiny CPU rehearsal of this script), PARALLEL (1: each mode's seeds one after another in one process;
# N > 1: every (mode, seed) run in its own process, N at a time on the one GPU), RUN_GIB (16: GPU memory per run
# process; dense-small took ~14 GiB each on the H200: PARALLEL is capped at free GPU memory // RUN_GIB), STEP
# (unset: compare final validation CE; N: compare at eval step N, e.g. when time-limited runs stopped early).
# With PARALLEL > 1, PYTORCH_CUDA_ALLOC_CONF defaults to expandable_segments:True (less memory reserved and unused
# per process), and a run that died of torch.OutOfMemoryError is re-run once, alone, after the others (its first
# log kept as seed-N.oom.log); only a run that fails again fails the study.
# On the H200, dense-small at 2 x 8K tokens per step ran ~150K tokens/s alone: ~1.5 minutes per 600-step run with
# start-up, so the default 5 modes x 3 seeds take about 25-30 minutes with PARALLEL=1.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${1:-$REPO/recipes/results/$(date -u +%F)-convergence}
mkdir -p "$OUT/runs"
OUT=$(cd "$OUT" && pwd)
cd "$REPO"
PY=${PYTHON:-$(command -v python || command -v python3)}
CFG=${CFG:-recipes/configs/dense-small.yaml}
SEEDS=${SEEDS:-0,1,2}
STEPS=${STEPS:-600}
MODES=${MODES:-"bf16 fp8-matching fp8-stale fp8-fwd fp8-bwd"}
ATTN_STATS=${ATTN_STATS:-25}
WARM_STEPS=${WARM_STEPS:-0}
INIT=${INIT:-}
EXTRA=${EXTRA:-}
SMOKE=${SMOKE:-0}
PARALLEL=${PARALLEL:-1}
RUN_GIB=${RUN_GIB:-16}
STEP=${STEP:-}
FID_SEQ=${FID_SEQ:-$([ "$SMOKE" = 1 ] && echo 128 || echo 2048)}
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
# flash-linear-attention autotunes its Triton kernels in every new process (13 s of each run's first step on the
# H200): keep the results on disk so that only the first run pays.
export TRITON_CACHE_AUTOTUNING=${TRITON_CACHE_AUTOTUNING:-1}
export HF_DELTAMATCH_CACHE=${HF_DELTAMATCH_CACHE:-$OUT/cache}
export HF_DATASETS_CACHE=${HF_DATASETS_CACHE:-$OUT/cache/datasets}
exec > >(tee -a "$OUT/study.log") 2>&1
T0=$(date +%s)
stamp() { echo "[convergence $(( $(date +%s) - T0 ))s] $*"; }
source "$REPO/recipes/_common.sh"
ensure_datasets

COMMON=(--config "$CFG" --max_steps "$STEPS" --warmup_steps 30 --batch_size 2 --grad_accum 1 --lr 1e-3
        --save_every 1000000 --eval_every 50 --eval_batches 64 --log_every 5 --corpus_bytes 40000000
        --data_seed 0 --attn_stats "$ATTN_STATS")
FID=(--seq-len "$FID_SEQ" --batch 2 --qk-transforms)
if [ "$SMOKE" = 1 ]; then
  CFG="tiny-cpu defaults (SMOKE=1 rehearsal)"
  COMMON=(--max_steps "$STEPS" --warmup_steps 1 --save_every 1000000 --eval_every 2 --eval_batches 2 --log_every 1
          --corpus_bytes 400000 --vocab_size 512 --seq_len 128 --batch_size 4 --data_seed 0 --attn_stats "$ATTN_STATS")
  FID=(--seq-len "$FID_SEQ" --batch 1 --block 64 --qk-transforms)
fi
# shellcheck disable=SC2206
COMMON+=($EXTRA)

mode_flags() {
  case $1 in
    bf16) echo "--precision bf16 --delta matching" ;;
    fp8-matching) echo "--precision fp8 --delta matching" ;;
    fp8-stale) echo "--precision fp8 --delta stale" ;;
    fp8-fwd) echo "--precision fp8_fwd --delta matching" ;;
    fp8-bwd) echo "--precision fp8_bwd --delta matching" ;;
    fp8-bwd-stale) echo "--precision fp8_bwd --delta stale" ;;
    *) echo "unknown mode $1 (bf16 fp8-matching fp8-stale fp8-fwd fp8-bwd fp8-bwd-stale)" >&2; return 2 ;;
  esac
}
for mode in $MODES; do mode_flags "$mode" > /dev/null; done  # a typo fails now, not after an hour

# ---- optional warm start: bf16 until sinks form, then every mode continues from there -------------------------
if [ "$WARM_STEPS" -gt 0 ] && [ -z "$INIT" ]; then
  stamp "warm start: bf16, $WARM_STEPS steps"
  "$PY" recipes/pretrain.py "${COMMON[@]}" --max_steps "$WARM_STEPS" --attn deltamatch_fp8 --precision bf16 \
    --seed 0 --output_dir "$OUT/runs/warm" --run_name warm
  INIT="$OUT/runs/warm/final"
fi
START=()
[ -n "$INIT" ] && START=(--model "$INIT")

# ---- the sweeps ----------------------------------------------------------------------------------------------
wait_for_slot() {  # until fewer than PARALLEL background jobs run
  while [ "$(jobs -rp | wc -l)" -ge "$PARALLEL" ]; do sleep 1; done
}
TOK=()
FIRST_SEED=${SEEDS%%,*}
if [ "$PARALLEL" -le 1 ]; then
  for mode in $MODES; do
    stamp "mode $mode: seeds $SEEDS"
    # shellcheck disable=SC2046
    "$PY" recipes/pretrain.py "${COMMON[@]}" "${START[@]}" "${TOK[@]}" --attn deltamatch_fp8 $(mode_flags "$mode") \
      --seeds "$SEEDS" --output_dir "$OUT/runs/$mode" --run_name "$mode"
    if [ -z "$INIT" ] && [ ${#TOK[@]} = 0 ]; then  # one tokenizer (and tokenized-data cache) for every run
      TOK=(--tokenizer "$OUT/runs/$mode/seed-$FIRST_SEED/tokenizer")
    fi
  done
else
  # One process per (mode, seed), PARALLEL at a time on the one GPU: a small model leaves it mostly idle, and the
  # runs' numerics do not depend on their speed. The first run trains the tokenizer (and fills the tokenized-data
  # cache) alone; every other run reuses both. Each run's output goes to runs/MODE/seed-N.log.
  export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
  run_one() {  # mode seed: trains into runs/MODE/seed-N; its output in seed-N.log, its exit status in seed-N.rc
    local dir="$OUT/runs/$1/seed-$2" rc=0
    # shellcheck disable=SC2046
    "$PY" recipes/pretrain.py "${COMMON[@]}" "${START[@]}" "${TOK[@]}" --attn deltamatch_fp8 $(mode_flags "$1") \
      --seed "$2" --output_dir "$dir" --run_name "$1-seed$2" > "$dir.log" 2>&1 || rc=$?
    echo "$rc" > "$dir.rc"
    return "$rc"
  }
  PAIRS=()
  for mode in $MODES; do
    mkdir -p "$OUT/runs/$mode"
    for seed in ${SEEDS//,/ }; do PAIRS+=("$mode $seed"); done
  done
  read -r mode seed <<< "${PAIRS[0]}"
  stamp "run $mode seed $seed (alone: tokenizer and data cache)"
  run_one "$mode" "$seed" || { tail -n 40 "$OUT/runs/$mode/seed-$seed.log"; exit 1; }
  [ -z "$INIT" ] && TOK=(--tokenizer "$OUT/runs/$mode/seed-$seed/tokenizer")
  # as many runs as the free GPU memory holds (more die of OOM in their first steps); no cap without CUDA
  FREE_GIB=$("$PY" -c 'import torch; c = torch.cuda; print(c.mem_get_info()[0] // 2**30 if c.is_available() else "")')
  if [ -n "$FREE_GIB" ]; then
    CAP=$(( FREE_GIB / RUN_GIB ))
    [ "$CAP" -ge 1 ] || CAP=1
    [ "$CAP" -lt "$PARALLEL" ] || CAP=$PARALLEL
    stamp "GPU memory: $FREE_GIB GiB free, $RUN_GIB GiB per run (RUN_GIB): PARALLEL $PARALLEL -> $CAP"
    PARALLEL=$CAP
  fi
  stamp "the other $(( ${#PAIRS[@]} - 1 )) runs, $PARALLEL at a time"
  PIDS=()
  for pair in "${PAIRS[@]:1}"; do
    wait_for_slot
    # shellcheck disable=SC2086  # "mode seed": two arguments
    run_one $pair &
    PIDS+=($!)
  done
  wait "${PIDS[@]}" || true  # (a bare `wait` would also wait for the log's tee); each run's status is its .rc
  for pair in "${PAIRS[@]:1}"; do  # runs that other runs' memory starved: once more, alone
    read -r mode seed <<< "$pair"
    log="$OUT/runs/$mode/seed-$seed.log"
    if [ "$(cat "$OUT/runs/$mode/seed-$seed.rc" 2>/dev/null)" != 0 ] && grep -q "OutOfMemoryError" "$log"; then
      mv "$log" "$OUT/runs/$mode/seed-$seed.oom.log"
      stamp "run $mode seed $seed ran out of GPU memory: again, alone"
      run_one "$mode" "$seed" || true
    fi
  done
  failed=0
  for pair in "${PAIRS[@]:1}"; do
    read -r mode seed <<< "$pair"
    if [ "$(cat "$OUT/runs/$mode/seed-$seed.rc" 2>/dev/null)" != 0 ]; then
      echo "error: run $mode seed $seed failed; the end of its log:" >&2
      tail -n 40 "$OUT/runs/$mode/seed-$seed.log" >&2
      failed=1
    fi
  done
  [ "$failed" = 0 ] || exit 1
  stamp "all runs finished"
fi

# ---- fidelity of each mode's seed-0 model on held-out-style text ---------------------------------------------
FID_DATA=${FID_DATA:-$(ls "$HF_DELTAMATCH_CACHE"/corpus/stdlib-*/docs.jsonl 2>/dev/null | head -1)}
if [ -z "$FID_DATA" ]; then
  echo "error: no text for the fidelity check: set FID_DATA to a .txt or .jsonl file" >&2
  exit 2
fi
FID_MODELS=()
[ -n "$INIT" ] && FID_MODELS+=("init=$INIT")
for mode in $MODES; do FID_MODELS+=("$mode=$OUT/runs/$mode/seed-$FIRST_SEED/final"); done
mkdir -p "$OUT/fidelity"
fidelity_check() {  # name=model_dir
  "$PY" -m hf_deltamatch.cli check --model "${1#*=}" --data "$FID_DATA" "${FID[@]}" --out "$OUT/fidelity/${1%%=*}" \
    > "$OUT/fidelity/${1%%=*}.txt" 2>&1
}
PIDS=()
for entry in "${FID_MODELS[@]}"; do
  stamp "fidelity check: ${entry%%=*}"
  if [ "$PARALLEL" -le 1 ]; then
    fidelity_check "$entry" || { cat "$OUT/fidelity/${entry%%=*}.txt"; exit 1; }
    cat "$OUT/fidelity/${entry%%=*}.txt"
  else
    wait_for_slot
    fidelity_check "$entry" &
    PIDS+=($!)
  fi
done
if [ "$PARALLEL" -gt 1 ]; then
  wait "${PIDS[@]}" || true  # each check's result is its fidelity.json, checked below
  for entry in "${FID_MODELS[@]}"; do
    cat "$OUT/fidelity/${entry%%=*}.txt"
    [ -f "$OUT/fidelity/${entry%%=*}/fidelity.json" ] || { echo "error: fidelity check ${entry%%=*} failed" >&2; exit 1; }
  done
fi

# ---- report ----------------------------------------------------------------------------------------------------
stamp "summary"
SWEEPS=()
for mode in $MODES; do SWEEPS+=("$OUT/runs/$mode"); done
BASE=bf16
case " $MODES " in *" bf16 "*) ;; *) BASE=${MODES%% *} ;; esac
AT=() WHICH="Final validation CE"
[ -n "$STEP" ] && AT=(--step "$STEP") WHICH="Validation CE at step $STEP"
"$PY" -m hf_deltamatch.training.sweep "${SWEEPS[@]}" --baseline "$BASE" "${AT[@]}" --table "$OUT/table.md" \
  --json "$OUT/table.json"
SEED0=()
for mode in $MODES; do SEED0+=("$OUT/runs/$mode/seed-$FIRST_SEED"); done
[ -d "$OUT/runs/warm" ] && SEED0=("$OUT/runs/warm" "${SEED0[@]}")
"$PY" -m hf_deltamatch.training.plot "${SEED0[@]}" -o "$OUT/loss.png" --table "$OUT/table_seed0.md" --x step
"$PY" - "$OUT" > "$OUT/fidelity.md" <<'PYEOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print("| model | layers | max sink mass | max P underflow | max k channel ratio | dQ err fp8-matching "
      "| dQ err fp8-stale | dQ err bf16 | dQ err sdpa | dQ err fp8+hadamard | dQ err fp8+smooth "
      "| worst stale/matching dQ |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for f in sorted((out / "fidelity").glob("*/fidelity.json")):
    r = json.loads(f.read_text())
    L = r["layers"]
    mean = lambda mode: sum(x["modes"][mode]["err_dq"] for x in L) / len(L)
    worst = max(x["modes"]["fp8-stale"]["err_dq"] / x["modes"]["fp8-matching"]["err_dq"] for x in L)
    print(f"| {f.parent.name} | {len(L)} | {max(x['sink_mass'] for x in L):.3f} | "
          f"{max(x['p_underflow'] for x in L):.2%} | {max(x['k_channel_ratio'] for x in L):.1f} | "
          f"{mean('fp8-matching'):.4f} | {mean('fp8-stale'):.4f} | {mean('bf16'):.4f} | {mean('sdpa'):.4f} | "
          f"{mean('fp8+hadamard'):.4f} | {mean('fp8+smooth'):.4f} | {worst:.2f}x |")
print(f"\n(means over layers; {L[0]['tokens']} tokens per sequence; per-layer tables in fidelity/*/)")
PYEOF
{
  echo "# Convergence study ($(date -u +%Y-%m-%dT%H:%MZ))"
  echo
  echo '```'
  "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, \
'device', torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')"
  echo "config: $CFG  steps: $STEPS  seeds: $SEEDS  modes: $MODES  warm start: ${INIT:-none}  git: $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo '?')"
  echo '```'
  echo
  echo "## $WHICH per mode, against the $BASE seed range"
  echo
  cat "$OUT/table.md"
  echo
  echo "## Gradient fidelity of each mode's seed-0 model (hf-deltamatch check --model)"
  echo
  cat "$OUT/fidelity.md"
  echo
  echo "## Curves (seed 0 of each mode)"
  echo
  echo "![loss](loss.png) ![attention monitor](loss_attn.png)"
  echo
  cat "$OUT/table_seed0.md"
} > "$OUT/results.md"
stamp "done: $OUT/results.md"
