#!/usr/bin/env bash
# Offline RULER with deltamatch_fp8 on one GPU.
#
#   eval/ruler_gpu.sh MODEL_DIR OUT_DIR [LENGTHS]
#
#   MODEL_DIR  local model directory (config.json, weights, tokenizer); nothing is downloaded
#   OUT_DIR    lm-eval writes results_*.json (+ samples_*.jsonl) under OUT_DIR/<model>/, and this script
#              copies the RULER table to OUT_DIR/ruler_summary.txt
#   LENGTHS    comma-separated context lengths, default 8192 (e.g. 4096,8192,16384)
#
# Environment (all optional):
#   RULER_ESSAYS    essay haystack (RULER's PaulGrahamEssays.json, a .txt, or a folder of .txt) -> niah_single_2/3,
#                   niah_multikey_1, niah_multivalue, niah_multiquery; skipped (with a message) when unset
#   RULER_SQUAD     SQuAD v2 dev JSON (dev-v2.0.json) -> qa_1
#   RULER_HOTPOTQA  HotpotQA dev distractor JSON (hotpot_dev_distractor_v1.json) -> qa_2
#   NUM_SAMPLES     samples per task and length (default 500, as RULER)
#   ATTN            attention implementation (default deltamatch_fp8; sdpa gives the bf16 baseline)
#   BATCH_SIZE      lm-eval batch size (default 8)
#   DTYPE           model dtype (default bfloat16)
#   DEVICE          default cuda:0
#   LIMIT           lm-eval --limit (docs per task) for a quick smoke run; it takes the first docs, i.e. the
#                   shortest length first, so pair it with NUM_SAMPLES (e.g. LIMIT=5 NUM_SAMPLES=5, one length)
#   SEED            RULER generation seed (default 42)
#   EXTRA           extra arguments passed to lm-eval verbatim
set -euo pipefail

if [[ $# -lt 2 ]]; then
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
  exit 2
fi
MODEL_DIR=$1
OUT_DIR=$2
LENGTHS=${3:-8192}
[[ -f "$MODEL_DIR/config.json" ]] || { echo "ruler_gpu.sh: $MODEL_DIR/config.json not found (need a local model dir)" >&2; exit 2; }
mkdir -p "$OUT_DIR"

MAX_LEN=$(python - "$LENGTHS" <<'PY'
import sys
print(max(int(x) for x in sys.argv[1].split(",") if x))
PY
)
META=$(python - "$LENGTHS" <<'PY'
import json, os, sys
meta = {"max_seq_lengths": [int(x) for x in sys.argv[1].split(",") if x],
        "num_samples": int(os.environ.get("NUM_SAMPLES", 500)), "seed": int(os.environ.get("SEED", 42))}
for env, key in (("RULER_ESSAYS", "essay_path"), ("RULER_SQUAD", "squad_path"), ("RULER_HOTPOTQA", "hotpotqa_path")):
    if os.environ.get(env):
        meta[key] = os.path.abspath(os.environ[env])
print(json.dumps(meta))
PY
)

ARGS=(run --model hf-deltamatch
  --model_args "pretrained=$MODEL_DIR,dtype=${DTYPE:-bfloat16},max_length=$MAX_LEN,attn_implementation=${ATTN:-deltamatch_fp8}"
  --tasks ruler_dm --metadata "$META" --device "${DEVICE:-cuda:0}" --batch_size "${BATCH_SIZE:-8}"
  --output_path "$OUT_DIR" --log_samples)
[[ -n "${LIMIT:-}" ]] && ARGS+=(--limit "$LIMIT")
# shellcheck disable=SC2206
[[ -n "${EXTRA:-}" ]] && ARGS+=($EXTRA)

echo "ruler_gpu.sh: python -m hf_deltamatch.cli eval ${ARGS[*]}" >&2
python -m hf_deltamatch.cli eval "${ARGS[@]}" 2>&1 | tee "$OUT_DIR/ruler_log.txt"
# The last table printed is the RULER summary (task x length, average).
sed -n '/^RULER (string match, %):/,$p' "$OUT_DIR/ruler_log.txt" > "$OUT_DIR/ruler_summary.txt"
echo "ruler_gpu.sh: results under $OUT_DIR (summary: $OUT_DIR/ruler_summary.txt)" >&2
