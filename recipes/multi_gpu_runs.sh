#!/usr/bin/env bash
# Multi-GPU scaling on one host (issue #4): the same recipe on 1 GPU, then DDP and FSDP2 on 2 GPUs.
#
#   bash recipes/multi_gpu_runs.sh OUT_DIR          # ~2 minutes on a 2 x H200 host
#   SMOKE=1 bash recipes/multi_gpu_runs.sh /tmp/mg  # CPU rehearsal (gloo, 2 processes), a few minutes
#
# 1. three runs of recipes/pretrain.py with identical per-GPU settings: dense GQA model
#    (recipes/configs/dense-small.yaml; MODEL=hybrid for hybrid-small, needs flash-linear-attention to be
#    fast), attn deltamatch_fp8 --precision fp8 --delta matching, 8K packed context, batch 2 blocks per GPU
#    (16K tokens per GPU per step), STEPS optimizer steps, validation only at the end:
#      1gpu   accelerate launch --config_file recipes/configs/accelerate/single_gpu.yaml  (the scaling base)
#      ddp    accelerate launch --config_file recipes/configs/accelerate/ddp.yaml   --num_processes 2
#      fsdp2  accelerate launch --config_file recipes/configs/accelerate/fsdp2.yaml --num_processes 2
#             (FSDP2 fully_shard per decoder layer + activation checkpointing, as the config says)
#    The first run trains the BPE tokenizer; the others reuse it (--tokenizer) and so the tokenized data cache.
#    Only the checkpoint the loop always writes at the last step is saved (no final save_pretrained).
# 2. OUT_DIR/results.md (environment + table + curves), OUT_DIR/table.md, OUT_DIR/loss.png, per-run dirs in
#    OUT_DIR/runs/ (metrics.jsonl, summary.json, run.log), OUT_DIR/multi_gpu_runs.log.
#    Per run: processes, steps, final train loss, final val CE, global tokens/s (steady state: steps after the
#    first quarter, so Triton compilation and warm-up are excluded; the loop's own mean is shown too), peak
#    memory of rank 0 (torch.cuda.max_memory_allocated; ranks are symmetric), scaling = tokens/s / 1-GPU
#    tokens/s and efficiency = scaling / processes, wall time of the launch.
#
# Guards: each launch runs under `timeout` (RUN_TIMEOUT s, shortened so that all three end within BUDGET_S
# of the script's start) and the loop stops training after MAX_MINUTES; a failed or timed-out run is
# reported as such and the next one still runs. Exit status 1 if any run failed.
#
# Environment knobs: MODEL=dense|hybrid (default dense), STEPS=40, MAX_MINUTES=0.75, RUN_TIMEOUT=80,
# BUDGET_S=165, NPROC=2, PYTHON=python, WHEELS=dir with wheels for missing packages (datasets),
# SMOKE=1 (CPU rehearsal: tiny-cpu defaults, gloo; FSDP2 through HF_DELTAMATCH_CPU_FSDP=1, see
# hf_deltamatch/training/loop.py; STEPS=8, BUDGET_S=900).
set -euo pipefail

OUT=${1:?usage: bash recipes/multi_gpu_runs.sh OUT_DIR   (knobs: MODEL STEPS MAX_MINUTES RUN_TIMEOUT BUDGET_S SMOKE)}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$OUT/runs"
OUT=$(cd "$OUT" && pwd)
cd "$REPO"
PY=${PYTHON:-$(command -v python || command -v python3)}
SMOKE=${SMOKE:-0}
MODEL=${MODEL:-dense}
NPROC=${NPROC:-2}
if [ "$SMOKE" = 1 ]; then
  STEPS=${STEPS:-8}; MAX_MINUTES=${MAX_MINUTES:-2}; RUN_TIMEOUT=${RUN_TIMEOUT:-300}; BUDGET_S=${BUDGET_S:-900}
else
  STEPS=${STEPS:-40}; MAX_MINUTES=${MAX_MINUTES:-0.75}; RUN_TIMEOUT=${RUN_TIMEOUT:-80}; BUDGET_S=${BUDGET_S:-165}
fi
# The GPU host requires NVLink multicast (NVLS) to stay off.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# flash-linear-attention autotunes its Triton kernels in every new process (13 s of each run's first step on the
# H200): keep the results on disk so that only the first run pays.
export TRITON_CACHE_AUTOTUNING=${TRITON_CACHE_AUTOTUNING:-1}
export HF_DELTAMATCH_CACHE=${HF_DELTAMATCH_CACHE:-$OUT/cache}
export HF_DATASETS_CACHE=${HF_DATASETS_CACHE:-$OUT/cache/datasets}
exec > >(tee -a "$OUT/multi_gpu_runs.log") 2>&1
T0=$(date +%s)
stamp() { echo "[multi_gpu_runs $(( $(date +%s) - T0 ))s] $*"; }

case "$MODEL" in
  dense) CFG=recipes/configs/dense-small.yaml ;;
  hybrid) CFG=recipes/configs/hybrid-small.yaml ;;
  *) echo "error: MODEL=$MODEL: choose dense or hybrid" >&2; exit 2 ;;
esac
for f in "$CFG" recipes/configs/accelerate/single_gpu.yaml recipes/configs/accelerate/ddp.yaml \
         recipes/configs/accelerate/fsdp2.yaml; do
  [ -f "$f" ] || { echo "error: $f is missing" >&2; exit 2; }
done
command -v timeout >/dev/null || { echo "error: needs coreutils 'timeout'" >&2; exit 2; }

# ---- packages --------------------------------------------------------------------------------------------
source "$REPO/recipes/_common.sh"
ensure_datasets

# ---- preflight: seconds, no GPU work (the 1-GPU run is the first real check) -----------------------------
"$PY" - "$SMOKE" "$MODEL" "$NPROC" <<'PYEOF' | tee "$OUT/environment.txt"
import importlib.util, os, platform, sys
import torch, transformers, accelerate, datasets
smoke, model, nproc = sys.argv[1] == "1", sys.argv[2], int(sys.argv[3])
n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
if not smoke and n_gpu < nproc:
    sys.exit(f"error: {n_gpu} CUDA GPU(s) visible, need {nproc} (SMOKE=1 rehearses this script on CPU)")
if not torch.distributed.is_available():
    sys.exit("error: this torch has no torch.distributed")
if not smoke and not torch.distributed.is_nccl_available():
    sys.exit("error: this torch has no NCCL backend")
try:
    from torch.distributed.fsdp import fully_shard  # noqa: F401  (FSDP2)
except ImportError as e:
    sys.exit(f"error: torch {torch.__version__} lacks FSDP2 (torch.distributed.fsdp.fully_shard): {e}")
import hf_deltamatch
from transformers import AttentionInterface, AutoConfig
if "deltamatch_fp8" not in AttentionInterface._global_mapping:
    sys.exit("error: hf_deltamatch did not register attn_implementation='deltamatch_fp8'")
try:
    AutoConfig.for_model("qwen3_5_text" if (model == "hybrid" or smoke) else "qwen3")
except Exception as e:
    sys.exit(f"error: this transformers ({transformers.__version__}) lacks the model: {e}; try MODEL=dense")
if not smoke and importlib.util.find_spec("triton") is None:
    sys.exit("error: triton is missing (deltamatch_fp8 would run the slow reference path on the GPU)")
names = [torch.cuda.get_device_name(i) for i in range(n_gpu)]
nccl = ".".join(map(str, torch.cuda.nccl.version())) if n_gpu else "n/a (CPU: gloo)"
print(f"preflight ok: {n_gpu} GPU(s), {nproc} processes for the multi-GPU runs")
print(f"GPUs: {', '.join(names) if names else 'none (CPU rehearsal)'}")
print(f"python {platform.python_version()}  torch {torch.__version__}  CUDA {torch.version.cuda}  NCCL {nccl}  "
      f"transformers {transformers.__version__}  accelerate {accelerate.__version__}  datasets {datasets.__version__}  "
      f"triton {'yes' if importlib.util.find_spec('triton') else 'no'}  "
      f"flash-linear-attention {'yes' if importlib.util.find_spec('fla') else 'no'}")
print("NCCL_NVLS_ENABLE=%s TORCH_SYMM_MEM_DISABLE_MULTICAST=%s NVSHMEM_DISABLE_NVLS=%s" % tuple(
    os.environ.get(k, "") for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")))
PYEOF

# ---- settings (identical per GPU for all runs) -----------------------------------------------------------
COMMON=(--config "$CFG" --attn deltamatch_fp8 --precision fp8 --delta matching
        --seq_len 8192 --batch_size 2 --grad_accum 1 --max_steps "$STEPS" --max_minutes "$MAX_MINUTES"
        --warmup_steps 10 --lr 1e-3 --log_every 2 --eval_every "$STEPS" --eval_batches 2
        --save_every 1000000 --keep_checkpoints 1 --no-save_final --corpus_bytes 20000000 --num_proc 8 --seed 0)
PER_GPU="2 x 8192-token packed blocks"
if [ "$SMOKE" = 1 ]; then
  CFG="tiny-cpu defaults (SMOKE=1 rehearsal)"; PER_GPU="2 x 256-token packed blocks"
  COMMON=(--attn deltamatch_fp8 --precision fp8 --delta matching --batch_size 2 --grad_accum 1
          --max_steps "$STEPS" --max_minutes "$MAX_MINUTES" --warmup_steps 2 --log_every 1 --eval_every "$STEPS"
          --eval_batches 1 --save_every 1000000 --keep_checkpoints 1 --no-save_final --corpus_bytes 1500000
          --vocab_size 1024 --seed 0)
  # accelerate enables FSDP only on accelerators; the loop's rehearsal switch runs its FSDP2 path on CPU/gloo.
  export HF_DELTAMATCH_CPU_FSDP=1
fi

FAILED=()
PORT=$(( 29500 + RANDOM % 2000 ))
run() {  # run NAME NPROC ACCELERATE_CONFIG [pretrain flags...]
  local name=$1 np=$2 acfg=$3; shift 3
  local left=$(( BUDGET_S - ($(date +%s) - T0) - 10 ))
  local limit=$(( left < RUN_TIMEOUT ? left : RUN_TIMEOUT ))
  if [ "$limit" -lt 20 ]; then
    stamp "run $name skipped: the time budget (BUDGET_S=$BUDGET_S) is spent"
    FAILED+=("$name"); echo "skipped (time budget spent)" > "$OUT/runs/$name.status"; return 0
  fi
  PORT=$(( PORT + 1 ))
  stamp "run $name: $np process(es), $acfg, timeout ${limit}s"
  local t=$(date +%s) rc=0
  mkdir -p "$OUT/runs/$name"
  timeout -k 15 "$limit" "$PY" -m accelerate.commands.launch --config_file "$acfg" --num_processes "$np" \
      --num_machines 1 --mixed_precision no --dynamo_backend no --main_process_port "$PORT" \
      recipes/pretrain.py "${COMMON[@]}" --output_dir "$OUT/runs/$name" --run_name "$name" "$@" \
      > >(tee "$OUT/runs/$name/run.log") 2>&1 || rc=$?
  local wall=$(( $(date +%s) - t ))
  echo "$wall" > "$OUT/runs/$name.wall_s"
  if [ "$rc" -eq 0 ] && [ -f "$OUT/runs/$name/summary.json" ]; then
    echo ok > "$OUT/runs/$name.status"; stamp "run $name done in ${wall}s"
  else
    [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && msg="timed out after ${limit}s" || msg="failed (exit $rc)"
    echo "$msg" > "$OUT/runs/$name.status"; FAILED+=("$name"); stamp "run $name $msg; see $OUT/runs/$name/run.log"
  fi
}

# ---- runs ------------------------------------------------------------------------------------------------
run 1gpu 1 recipes/configs/accelerate/single_gpu.yaml
TOK="$OUT/runs/1gpu/tokenizer"  # one tokenizer (and so one tokenized-data cache) for all runs
if [ ! -f "$TOK/tokenizer.json" ]; then
  stamp "error: the 1-GPU run produced no tokenizer; not starting the multi-GPU runs"
  exit 1
fi
run ddp "$NPROC" recipes/configs/accelerate/ddp.yaml --tokenizer "$TOK"
run fsdp2 "$NPROC" recipes/configs/accelerate/fsdp2.yaml --tokenizer "$TOK"

# ---- report ----------------------------------------------------------------------------------------------
stamp "report"
"$PY" - "$OUT" "$CFG" "$STEPS" "$PER_GPU" "$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo '?')" <<'PYEOF'
import json, sys, time
from pathlib import Path
out, cfg, steps, per_gpu, git = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
rows, base = [], None
for name in ("1gpu", "ddp", "fsdp2"):
    d = out / "runs" / name
    status = (out / "runs" / f"{name}.status").read_text().strip() if (out / "runs" / f"{name}.status").is_file() else "not run"
    wall = (out / "runs" / f"{name}.wall_s").read_text().strip() if (out / "runs" / f"{name}.wall_s").is_file() else ""
    s = json.loads((d / "summary.json").read_text()) if (d / "summary.json").is_file() else {}
    recs = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()] \
        if (d / "metrics.jsonl").is_file() else []
    train = [r for r in recs if r.get("kind") == "train"]
    evals = [r for r in recs if r.get("kind") == "eval"]
    # steady state: windows after the first quarter of the steps (compilation, allocator warm-up excluded);
    # tokens / time over those windows (each record covers tokens since the previous record)
    skip = max(2, steps // 4)
    tok = dur = 0.0
    prev = None
    for r in train:
        if prev is not None and r["step"] > skip:
            n = r["tokens"] - prev["tokens"]
            tok, dur = tok + n, dur + n / max(r["tokens_per_s"], 1e-9)
        prev = r
    steady = tok / dur if dur > 0 else s.get("tokens_per_s")
    row = dict(name=name, status=status, wall=wall, procs=s.get("num_processes"), steps=s.get("steps"),
               loss=train[-1]["loss"] if train else None, val=evals[-1]["val_loss"] if evals else None,
               tps=steady, tps_loop=s.get("tokens_per_s"), mem=max((r["mem_gb"] for r in train), default=None),
               time_limited=s.get("time_limited"))
    if name == "1gpu" and steady:
        base = steady
    rows.append(row)

def f(x, fmt):
    return "-" if x is None or x == "" else format(x, fmt)

lines = ["| run | status | processes | steps | final train loss | final val CE | tokens/s (global, steady) "
         "| tokens/s per GPU | loop mean tokens/s | peak mem rank 0 (GiB) | scaling vs 1 GPU | efficiency | wall (s) |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
for r in rows:
    ratio = r["tps"] / base if (base and r["tps"]) else None
    eff = ratio / r["procs"] if (ratio and r["procs"]) else None
    per = r["tps"] / r["procs"] if (r["tps"] and r["procs"]) else None
    status = r["status"] + (" (time-limited)" if r["time_limited"] else "")
    lines.append(f"| {r['name']} | {status} | {f(r['procs'], 'd')} | {f(r['steps'], 'd')} | {f(r['loss'], '.4f')} "
                 f"| {f(r['val'], '.4f')} | {f(r['tps'], ',.0f')} | {f(per, ',.0f')} | {f(r['tps_loop'], ',.0f')} "
                 f"| {f(r['mem'], '.2f')} | {f(ratio, '.2f')}x | {f(eff, '.0%')} | {r['wall'] or '-'} |")
table = "\n".join(lines) + "\n"
(out / "table.md").write_text(table)
env = (out / "environment.txt").read_text() if (out / "environment.txt").is_file() else ""
report = [f"# hf_deltamatch multi-GPU runs ({time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())})", "", "```", env.rstrip(),
          f"model config: {cfg}   steps: {steps}   per GPU and step: {per_gpu}   git: {git}",
          "```", "",
          "Same recipe and per-GPU batch on 1 GPU, DDP on 2, FSDP2 (+ activation checkpointing) on 2; attention "
          "deltamatch_fp8, fp8 Delta-Matching. tokens/s are global (all ranks) over the steps after the first "
          f"quarter (> step {max(2, steps // 4)}); scaling = tokens/s over the 1-GPU run's, efficiency = scaling / "
          "processes. Peak memory is rank 0's max_memory_allocated (process peak RSS on CPU). The 2-process runs "
          "see twice the tokens per step, so their losses at equal steps are not directly comparable to 1 GPU.",
          "", table]
(out / "results.md").write_text("\n".join(report))
print(table)
PYEOF
RUNS=()
for n in 1gpu ddp fsdp2; do [ -f "$OUT/runs/$n/metrics.jsonl" ] && RUNS+=("$OUT/runs/$n"); done
if [ "${#RUNS[@]}" -gt 0 ] && "$PY" -m hf_deltamatch.training.plot "${RUNS[@]}" -o "$OUT/loss.png" \
     --table "$OUT/plot_table.md" --title "$MODEL, 8K packed, fp8 Delta-Matching: 1 GPU vs DDP vs FSDP2" \
     >/dev/null 2>&1; then
  printf '\n![loss curves](loss.png)\n' >> "$OUT/results.md"
else
  stamp "no plot (matplotlib missing or no metrics); the tables are complete"
fi
if [ "${#FAILED[@]}" -gt 0 ]; then
  stamp "done with failures: ${FAILED[*]}; $OUT/results.md"
  exit 1
fi
stamp "done: $OUT/results.md"
