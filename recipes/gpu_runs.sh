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
# fallback is too slow without flash-linear-attention) or MODEL=hybrid-1p7b (the paper-shaped hybrid,
# recipes/configs/hybrid-1p7b.yaml: 18 Gated DeltaNet + 6 GQA layers, ~1.7B params), MODES="bf16 fp8-matching
# fp8-stale" (the 8K runs, in order, any subset: the first trains the tokenizer; the 64K step starts from
# fp8-matching, or from the last run without it), EXT_STEPS=4 (optimizer steps of the 64K stage; 2 with
# SMOKE=1), MINUTES=1.4, PYTHON=python, WHEELS=dir with wheels for missing packages (datasets), SMOKE=1 (tiny CPU
# rehearsal of this script, for CI machines),
# DEADLINE_S=0 (off; >0: the whole script should end this many seconds after it starts: each 8K run gets
# min(MINUTES, its share of the time left after ~25 s start-up per run and ~90 s for the 64K step and the
# plots), and the 64K step is skipped when under 90 s are left; for a command with a hard limit, where
# one-time costs such as flash-linear-attention's first Triton autotuning are not known in advance).
#
# The preflight names the Gated DeltaNet kernel transformers actually resolved: with flash-linear-attention
# installed it must be FLA's (else transformers silently took its torch fallback, which mixes packed documents
# in this transformers, so the script stops there with the import error), and what runs the layers' short
# convolution (with FLA: transformers' conv made to restart at packed document starts, training/short_conv.py).
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
DEADLINE_S=${DEADLINE_S:-0}
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
# flash-linear-attention autotunes its Triton kernels in every new process (13 s of each run's first step on the
# H200): keep the results on disk so that only the first run pays.
export TRITON_CACHE_AUTOTUNING=${TRITON_CACHE_AUTOTUNING:-1}
export HF_DELTAMATCH_CACHE=${HF_DELTAMATCH_CACHE:-$OUT/cache}
export HF_DATASETS_CACHE=${HF_DATASETS_CACHE:-$OUT/cache/datasets}
exec > >(tee -a "$OUT/gpu_runs.log") 2>&1
T0=$(date +%s)
stamp() { echo "[gpu_runs $(( $(date +%s) - T0 ))s] $*"; }

# ---- packages --------------------------------------------------------------------------------------------
source "$REPO/recipes/_common.sh"
ensure_datasets

case $MODEL in
  dense) CFG=recipes/configs/dense-small.yaml; MODEL_NAME=dense-small ;;
  hybrid) CFG=recipes/configs/hybrid-small.yaml; MODEL_NAME=hybrid-small ;;
  hybrid-1p7b) CFG=recipes/configs/hybrid-1p7b.yaml; MODEL_NAME=hybrid-1p7b ;;
  *) echo "error: MODEL=$MODEL: use hybrid (default), dense or hybrid-1p7b" >&2; exit 2 ;;
esac
read -r -a MODES <<< "${MODES:-bf16 fp8-matching fp8-stale}"
declare -A MODE_ARGS=([bf16]="--precision bf16 --delta matching" [fp8-matching]="--precision fp8 --delta matching"
                      [fp8-stale]="--precision fp8 --delta stale")
for m in "${MODES[@]}"; do
  [ -n "${MODE_ARGS[$m]:-}" ] || { echo "error: MODES: unknown run '$m' (use bf16, fp8-matching, fp8-stale)" >&2; exit 2; }
done
[ "${#MODES[@]}" -gt 0 ] || { echo "error: MODES is empty" >&2; exit 2; }
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
    AutoConfig.for_model("qwen3_5_text" if model.startswith("hybrid") else "qwen3")
except Exception as e:
    sys.exit(f"error: this transformers ({transformers.__version__}) lacks the model: {e}; try MODEL=dense")
# One packed forward/backward of the configured model (tiny vocab), so API drift in this transformers
# version shows up now rather than after tokenizing.
import importlib.util, os, yaml, torch
from hf_deltamatch.training.config import TrainConfig
from hf_deltamatch.training.data import PackedCollator
from hf_deltamatch.training.modeling import (CausalLMWithLoss, keep_linear_attention_documents_apart,
                                             keep_short_conv_documents_apart, setup_attention)
from hf_deltamatch.training.short_conv import describe as describe_short_conv, implementation_name
dev = "cuda" if torch.cuda.is_available() else "cpu"
spec = dict(yaml.safe_load(open(os.environ["GPU_RUNS_CFG"]))["model_config"]) if not smoke else \
    dict(TrainConfig().model_config)
mt = spec.pop("model_type")
setup_attention(TrainConfig(attn="deltamatch_fp8"))
lm = transformers.AutoModelForCausalLM.from_config(AutoConfig.for_model(mt, vocab_size=1024, **spec),
                                                   attn_implementation="deltamatch_fp8").to(dev)
keep_linear_attention_documents_apart(lm)
keep_short_conv_documents_apart(lm)


def resolved(fn, depth=0):
    # the kernel behind transformers' use_kernel_func_from_hub_with_fallback wrapper (a closure variable)
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            v = cell.cell_contents
        except ValueError:
            continue
        if callable(v) and str(getattr(v, "__module__", "")).split(".")[0] in ("fla", "causal_conv1d"):
            return v
        if depth < 4 and callable(v) and v is not fn:
            found = resolved(v, depth + 1)
            if found is not None:
                return found
    return None


gdn = "no Gated DeltaNet layers"
gdn_layers = [m for m in lm.modules() if type(m).__name__.endswith("GatedDeltaNet")]
if gdn_layers:
    mod = sys.modules[type(gdn_layers[0]).__module__]
    rule, conv = getattr(mod, "torch_chunk_gated_delta_rule", None), getattr(mod, "causal_conv1d_fn", None)
    impl = resolved(rule)
    if impl is not None:
        gdn = f"{impl.__module__}.{impl.__name__} (varlen, cu_seqlens)"
    elif rule is None:
        gdn = "unknown (this transformers has no torch_chunk_gated_delta_rule)"
    elif importlib.util.find_spec("fla") is not None:
        import fla.ops.gated_delta_rule  # noqa: F401  (raises the reason transformers could not import it)
        sys.exit("error: flash-linear-attention is installed but transformers did not pick it up for Gated "
                 "DeltaNet (torch fallback); see above")
    else:
        gdn = "transformers' torch fallback, run per document"
    if conv is None:
        gdn += "; short conv: unknown (this transformers has no causal_conv1d_fn)"
    elif getattr(gdn_layers[0], "_hf_dm_per_doc", False):
        gdn += f"; short conv: {implementation_name(conv)}, run per document"
    else:
        gdn += f"; short conv: {describe_short_conv(conv)}"
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
if importlib.util.find_spec("fla") is not None:
    import importlib.metadata as md
    try:
        print(f"flash-linear-attention {md.version('flash-linear-attention')}, fla-core {md.version('fla-core')}")
    except md.PackageNotFoundError:
        pass
print(f"gated delta rule: {gdn}")
PYEOF

# ---- settings --------------------------------------------------------------------------------------------
# Short runs: 2 x 8K tokens per step (more optimizer steps in the time budget than the config's 64K/step).
COMMON=(--config "$CFG" --max_steps 300 --warmup_steps 20 --batch_size 2 --grad_accum 1
        --lr 1e-3 --save_every 1000000 --eval_every 25 --eval_batches 4 --log_every 2 --corpus_bytes 20000000
        --seed 0)
# --val_fraction 0.05: the default 2 % of this corpus holds less than one 64K block, so no eval would run
EXT=(--max_steps "${EXT_STEPS:-4}" --max_minutes 1.5 --warmup_steps 2 --eval_every 4 --eval_batches 1 --log_every 1
     --corpus_bytes 20000000 --val_fraction 0.05)
if [ "$SMOKE" = 1 ]; then
  CFG="tiny-cpu defaults (SMOKE=1 rehearsal)"
  COMMON=(--max_steps 300 --warmup_steps 5 --save_every 1000000 --eval_every 10
          --eval_batches 2 --log_every 2 --corpus_bytes 1500000 --vocab_size 1024 --seed 0)
  EXT=(--max_steps "${EXT_STEPS:-2}" --max_minutes 0.5 --warmup_steps 1 --eval_every 2 --eval_batches 1 --log_every 1
       --corpus_bytes 1500000 --seq_len 2048 --loss_chunk 512 --max_position_embeddings 2048)
fi
RUNS=()
RUN_MINUTES=()
N_8K=${#MODES[@]}  # the 8K runs below
RUN_OVERHEAD_S=25 # start-up, data, final eval and saves of one 8K run (~20 s each on the H200)
TAIL_S=90         # the 64K step and the plots
left_s() { echo $(( DEADLINE_S - ($(date +%s) - T0) )); }
run_minutes() {  # --max_minutes of the next 8K run: MINUTES, or with DEADLINE_S its share of the time left
  if [ "$DEADLINE_S" -le 0 ]; then echo "$MINUTES"; return; fi
  awk -v s="$(left_s)" -v n="$(( N_8K - ${#RUNS[@]} ))" -v m="$MINUTES" -v oh="$RUN_OVERHEAD_S" -v t="$TAIL_S" \
    'BEGIN { x = (s - t - n * oh) / n / 60; if (x > m) x = m; if (x < 0.2) x = 0.2; printf "%.2f\n", x }'
}
run() {
  local name=$1 mins; shift
  mins=$(run_minutes)
  stamp "run $name (max $mins min): $*"
  "$PY" recipes/pretrain.py "${COMMON[@]}" --max_minutes "$mins" --output_dir "$OUT/runs/$name" --run_name "$name" "$@"
  RUNS+=("$OUT/runs/$name")
  RUN_MINUTES+=("$mins")
}

# ---- 8K runs ---------------------------------------------------------------------------------------------
TOK="$OUT/runs/${MODES[0]}/tokenizer"  # trained by the first run; the same one (and tokenized data cache) for all
for m in "${MODES[@]}"; do
  # shellcheck disable=SC2086  # MODE_ARGS values are meant to split into arguments
  if [ "$m" = "${MODES[0]}" ]; then run "$m" --attn deltamatch_fp8 ${MODE_ARGS[$m]}
  else run "$m" --attn deltamatch_fp8 ${MODE_ARGS[$m]} --tokenizer "$TOK"; fi
done
EXT_FROM=fp8-matching
[[ " ${MODES[*]} " == *" fp8-matching "* ]] || EXT_FROM=${MODES[-1]}

# ---- 64K extension step ----------------------------------------------------------------------------------
EXT_DONE=1
if [ "$DEADLINE_S" -gt 0 ] && [ "$(left_s)" -lt "$TAIL_S" ]; then
  EXT_DONE=0
  stamp "64K extension step skipped: $(left_s) s left before DEADLINE_S=$DEADLINE_S"
else
  stamp "64K extension step from $EXT_FROM"
  "$PY" recipes/context_extension.py --model "$OUT/runs/$EXT_FROM/final" --output_dir "$OUT/runs/extend-64k" \
    --run_name extend-64k --attn deltamatch_fp8 --precision fp8 --delta matching "${EXT[@]}"
fi

# ---- report ----------------------------------------------------------------------------------------------
stamp "plots and tables"
"$PY" -m hf_deltamatch.training.plot "${RUNS[@]}" -o "$OUT/loss_8k.png" --table "$OUT/table_8k.md" \
  --title "$MODEL_NAME, 8K packed context: ${MODES[*]}"
if [ "$EXT_DONE" = 1 ]; then
  "$PY" -m hf_deltamatch.training.plot "$OUT/runs/extend-64k" -o "$OUT/loss_64k.png" --table "$OUT/table_64k.md" \
    --x step --smooth 0 --title "$MODEL_NAME, 8K -> 64K extension from $EXT_FROM (fp8 Delta-Matching)"
else
  echo "(skipped: not enough time left before DEADLINE_S=$DEADLINE_S)" > "$OUT/table_64k.md"
fi
{
  echo "# hf_deltamatch GPU runs ($(date -u +%Y-%m-%dT%H:%MZ))"
  echo
  echo '```'
  cat "$OUT/environment.txt"
  echo "model config: $CFG   minutes per 8K run: ${RUN_MINUTES[*]} (MINUTES=$MINUTES DEADLINE_S=$DEADLINE_S)   git: $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo '?')"
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
