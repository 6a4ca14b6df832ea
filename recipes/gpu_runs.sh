#!/usr/bin/env bash
# The H200 comparison runs, one command, ~8 minutes on one GPU:
#
#   bash recipes/gpu_runs.sh OUT_DIR
#
# 1. the small hybrid (recipes/configs/hybrid-small.yaml: 6 Gated DeltaNet + 2 GQA layers, head_dim 128, ~44M
#    params) at 8K packed context for MINUTES (default 1.4) of training each in
#      bf16          deltamatch_fp8 --precision bf16   (same kernels, no quantization: the reference)
#      fp8-matching  deltamatch_fp8 --precision fp8 --delta matching   (Delta-Matching)
#      fp8-stale     deltamatch_fp8 --precision fp8 --delta stale      (FlashAttention's delta: the failure mode)
#    on the offline corpus (Python's stdlib) with one BPE tokenizer trained by the first run and reused;
# 2. a short 8K -> 64K extension step (RoPE base 1M, activation checkpointing, chunked loss) from the
#    fp8-matching model;
# 3. OUT_DIR/loss_8k.png (curves + gap to bf16), OUT_DIR/results.md (tables, environment), per-run dirs under
#    OUT_DIR/runs/ (metrics.jsonl, TensorBoard, summary.json, final model), and OUT_DIR/gpu_runs.log.
#
# Environment knobs: MODEL=dense (dense GQA model instead of the hybrid, e.g. if the Gated DeltaNet torch
# fallback is too slow without flash-linear-attention), MINUTES=1.4, PYTHON=python, WHEELS=dir with wheels
# for missing packages (datasets), SMOKE=1 (tiny CPU rehearsal of this script, for CI machines).
set -euo pipefail

OUT=${1:?usage: bash recipes/gpu_runs.sh OUT_DIR}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$OUT/runs"
OUT=$(cd "$OUT" && pwd)
cd "$REPO"
PY=${PYTHON:-$(command -v python || command -v python3)}
MODEL=${MODEL:-hybrid}
MINUTES=${MINUTES:-1.4}
SMOKE=${SMOKE:-0}
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
export HF_DELTAMATCH_CACHE=${HF_DELTAMATCH_CACHE:-$OUT/cache}
export HF_DATASETS_CACHE=${HF_DATASETS_CACHE:-$OUT/cache/datasets}
exec > >(tee -a "$OUT/gpu_runs.log") 2>&1
T0=$(date +%s)
stamp() { echo "[gpu_runs $(( $(date +%s) - T0 ))s] $*"; }

# ---- packages --------------------------------------------------------------------------------------------
if ! "$PY" -c "import datasets" 2>/dev/null; then
  WHEELS=${WHEELS:-$REPO/.whl}
  if [ -d "$WHEELS" ]; then
    stamp "installing datasets from $WHEELS (offline)"
    "$PY" -m pip install --no-index --find-links "$WHEELS" datasets
  else
    echo "error: the 'datasets' package is missing; pip install it, or put its wheels (and deps) in $WHEELS" >&2
    exit 2
  fi
fi

if [ "$MODEL" = dense ]; then CFG=recipes/configs/dense-small.yaml; else CFG=recipes/configs/hybrid-small.yaml; fi
export GPU_RUNS_CFG=$CFG

# ---- preflight: fail in seconds, not after the first run ------------------------------------------------
"$PY" - "$SMOKE" "$MODEL" <<'PYEOF' | tee "$OUT/environment.txt"
import sys, platform
import torch, transformers, accelerate, datasets
smoke, model = sys.argv[1] == "1", sys.argv[2]
if not smoke and not torch.cuda.is_available():
    sys.exit("error: no CUDA GPU visible (SMOKE=1 rehearses this script on CPU)")
import hf_deltamatch
from transformers import AttentionInterface, AutoConfig
if "deltamatch_fp8" not in AttentionInterface._global_mapping:
    sys.exit("error: hf_deltamatch did not register attn_implementation='deltamatch_fp8'")
try:
    AutoConfig.for_model("qwen3_5_text" if model == "hybrid" else "qwen3")
except Exception as e:
    sys.exit(f"error: this transformers ({transformers.__version__}) lacks the model: {e}; try MODEL=dense")
# One packed forward/backward of the configured model (tiny vocab), so API drift in this transformers
# version shows up now rather than after tokenizing.
import importlib.util, os, yaml, torch
from hf_deltamatch.training.config import TrainConfig
from hf_deltamatch.training.data import PackedCollator
from hf_deltamatch.training.modeling import CausalLMWithLoss, keep_linear_attention_documents_apart, setup_attention
dev = "cuda" if torch.cuda.is_available() else "cpu"
spec = dict(yaml.safe_load(open(os.environ["GPU_RUNS_CFG"]))["model_config"]) if not smoke else \
    dict(TrainConfig().model_config)
mt = spec.pop("model_type")
setup_attention(TrainConfig(attn="deltamatch_fp8"))
lm = transformers.AutoModelForCausalLM.from_config(AutoConfig.for_model(mt, vocab_size=1024, **spec),
                                                   attn_implementation="deltamatch_fp8").to(dev)
keep_linear_attention_documents_apart(lm)
batch = PackedCollator()([{"input_ids": list(range(1, 1001)), "doc_lens": [300, 700]}])
batch = {k: v.to(dev) if hasattr(v, "to") else v for k, v in batch.items()}
with torch.autocast(dev, dtype=torch.bfloat16):
    loss, _ = CausalLMWithLoss(lm)(**batch)
loss.backward()
assert torch.isfinite(loss), loss
print(f"preflight: {mt} forward/backward with deltamatch_fp8 on packed input ok (loss {loss.item():.3f})")
print(f"device: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}")
print(f"python {platform.python_version()}  torch {torch.__version__}  transformers {transformers.__version__}  "
      f"accelerate {accelerate.__version__}  datasets {datasets.__version__}  "
      f"triton {'yes' if importlib.util.find_spec('triton') else 'no'}  "
      f"flash-linear-attention {'yes' if importlib.util.find_spec('fla') else 'no (torch fallback, per document)'}")
PYEOF

# ---- settings --------------------------------------------------------------------------------------------
# Short runs: 2 x 8K tokens per step (more optimizer steps in the time budget than the config's 64K/step).
COMMON=(--config "$CFG" --max_minutes "$MINUTES" --max_steps 300 --warmup_steps 20 --batch_size 2 --grad_accum 1
        --lr 1e-3 --save_every 1000000 --eval_every 25 --eval_batches 4 --log_every 2 --corpus_bytes 20000000
        --seed 0)
EXT=(--max_steps 4 --max_minutes 1.5 --warmup_steps 2 --eval_every 4 --eval_batches 1 --log_every 1
     --corpus_bytes 20000000)
if [ "$SMOKE" = 1 ]; then
  CFG="tiny-cpu defaults (SMOKE=1 rehearsal)"
  COMMON=(--max_minutes "$MINUTES" --max_steps 300 --warmup_steps 5 --save_every 1000000 --eval_every 10
          --eval_batches 2 --log_every 2 --corpus_bytes 1500000 --vocab_size 1024 --seed 0)
  EXT=(--max_steps 2 --max_minutes 0.5 --warmup_steps 1 --eval_every 2 --eval_batches 1 --log_every 1
       --corpus_bytes 1500000 --seq_len 2048 --loss_chunk 512 --max_position_embeddings 2048)
fi
RUNS=()
run() {
  local name=$1; shift
  stamp "run $name: $*"
  "$PY" recipes/pretrain.py "${COMMON[@]}" --output_dir "$OUT/runs/$name" --run_name "$name" "$@"
  RUNS+=("$OUT/runs/$name")
}

# ---- 8K runs ---------------------------------------------------------------------------------------------
run bf16 --attn deltamatch_fp8 --precision bf16 --delta matching
TOK="$OUT/runs/bf16/tokenizer"  # the same tokenizer (and so the same tokenized data cache) for every run
run fp8-matching --attn deltamatch_fp8 --precision fp8 --delta matching --tokenizer "$TOK"
run fp8-stale --attn deltamatch_fp8 --precision fp8 --delta stale --tokenizer "$TOK"

# ---- 64K extension step ----------------------------------------------------------------------------------
stamp "64K extension step from fp8-matching"
"$PY" recipes/context_extension.py --model "$OUT/runs/fp8-matching/final" --output_dir "$OUT/runs/extend-64k" \
  --run_name extend-64k --attn deltamatch_fp8 --precision fp8 --delta matching "${EXT[@]}"

# ---- report ----------------------------------------------------------------------------------------------
stamp "plots and tables"
"$PY" -m hf_deltamatch.training.plot "${RUNS[@]}" -o "$OUT/loss_8k.png" --table "$OUT/table_8k.md" \
  --title "$MODEL-small, 8K packed context: bf16 vs fp8 Delta-Matching vs fp8 stale delta"
"$PY" -m hf_deltamatch.training.plot "$OUT/runs/extend-64k" -o "$OUT/loss_64k.png" --table "$OUT/table_64k.md" \
  --x step --smooth 0
{
  echo "# hf_deltamatch GPU runs ($(date -u +%Y-%m-%dT%H:%MZ))"
  echo
  echo '```'
  cat "$OUT/environment.txt"
  echo "model config: $CFG   minutes per 8K run: $MINUTES   git: $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo '?')"
  echo '```'
  echo
  echo "## 8K context (time-limited runs; compare at the common step)"
  echo
  cat "$OUT/table_8k.md"
  echo
  echo "![loss curves](loss_8k.png)"
  echo
  echo "## 8K -> 64K extension step (fp8 Delta-Matching, activation checkpointing, chunked loss)"
  echo
  cat "$OUT/table_64k.md"
} > "$OUT/results.md"
stamp "done: $OUT/results.md"
