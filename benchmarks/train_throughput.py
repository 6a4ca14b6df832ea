#!/usr/bin/env python
"""Training throughput end to end: full optimizer steps of transformers models, deltamatch_fp8 against sdpa,
tokens/s, peak memory, MFU and the attention share, eager and under torch.compile.

The suite (`--suite issue45`, issue #45's training-step rows), each row eager and compiled, deltamatch_fp8 against
sdpa, bf16 linears:
  qwen3-0.6b, qwen3-1.7b  dense Qwen3 shapes: 28 layers, 16 query / 8 KV heads of dim 128, vocab 151936, tied
                          embeddings; hidden 1024 / 2048, MLP 3072 / 6144. Random init, bf16 weights, fused AdamW
                          (no autocast, no clipping), random tokens, the loss over the full logits as transformers
                          computes it. N x batch: 2048 x 8, 4096 x 4, 8192 x 1, 16384 x 1, 32768 x 1 (a shape that
                          does not fit is an OOM row, and larger ones of that configuration are skipped).
  qwen3-0.6b packed       one row of 8192 tokens holding 8 documents of seeded uneven lengths (position_ids restart
                          at each, cu_seq_lens), also against torch_varlen: FlashAttention-2 varlen through torch
                          (benchmarks/varlen_attention.py), as sdpa takes a masked path over the whole row.
  gptoss-attn             gpt-oss's attention at 8192 x 1 (below), against torch_varlen (FlashAttention-2 with the
                          windows and exact sinks: its ratio base) and, as an extra, transformers' flex_attention; its
                          sdpa row is a skip, as transformers runs gpt-oss without sdpa (SDPA has no sinks).
  hybrid-1p7b             the recipe's 8K and 64K settings (`8k`, `64k` below), as an extra torch_varlen at 8K.
They run every eager row first (dense shapes first), then every compiled row, then the extra baselines
(flex_attention on gpt-oss, torch_varlen on the hybrid).
gptoss-attn is gpt-oss-20b's attention as it is (hidden 2880, 64 query / 8 KV heads of dim 64, learnable sinks, a
128-token sliding window on every other of its 24 layers, attention biases, YaRN RoPE, vocab 201088) with its
mixture of 32 experts replaced by one expert of width 4 x 2880: the MLP work per token of gpt-oss's 4 active experts,
without a router whose data-dependent dispatch (host reads, token gathers) would add time and noise to both sides.
That is ~4.2 B parameters: bf16 weights, gradients and AdamW states in ~34 GB, with room for 8K activations on one
H200 (the 21 B model's states alone would not fit).

Compiled rows: torch.compile (inductor, default mode, use_cache=False) of each decoder layer (`--compile-scope
layers`, regional compilation as accelerate's compile_regions does: the layers share one compiled graph, so a row
compiles in a fraction of the whole model's time; embeddings, final norm, LM head and loss stay eager), the same for
both attention sides. `--compile-scope model` compiles the model with its loss as one graph (torch.compile(model)).

One H200, calls of at most 10 minutes: each call runs the rows the JSON does not hold yet, stops starting rows when
--time-budget seconds are near, and writes after every row; run again with --append until it prints "0 rows left":
  python benchmarks/train_throughput.py --suite issue45 --time-budget 540            # first call: a fresh file
  python benchmarks/train_throughput.py --suite issue45 --time-budget 540 --append   # each later call
  python benchmarks/train_throughput.py --suite issue45 --list [--append]            # the rows (and which are done)
Writes benchmarks/results/current/train_step.json (`--step-json`), train_step.md (the table for current/README.md)
and train_step-detail.json/.md (every run: windows, MFU, shares, --profile). train_step.json:
  {"meta": {"date", "gpu", "torch", "triton", "commit", "transformers", "suite", "compile_scope", "warmup",
            "calls": [{"date", "argv", "commit", "rows"}]},
   "rows": [{"model", "seq_len", "batch", "packed", "attn", "linears", "compiled", "tokens_per_s", "peak_gib",
             "ratio_to_sdpa", "tokens_per_s_spread", "windows", "runs", "ratio_base", "docs_per_row",
             "status", "reason"}]}
tokens_per_s is the mean over the row's timed windows (--repeats windows of --steps optimizer steps each, after
--warmup steps) and tokens_per_s_spread half their range, so mean +- spread covers every window; the base row can run
--baseline-runs times (separate processes, before and after the others), its windows pooled: the noise floor.
ratio_to_sdpa: tokens/s over the row with attn == ratio_base (sdpa; torch_varlen where transformers has no sdpa path)
of the same model, seq_len, batch, packed, linears and compiled; 1.0 on base rows. packed: the input is the packed
varlen layout (every recipe row; a preset with --docs-per-row > 1). status: ok, oom, skipped or failed, with a reason.
`--append` refuses a file of another GPU, torch, triton, commit or compile scope. Every configuration runs in a fresh
subprocess with --timeout seconds.

Other settings (`--settings`, comma-separated; `--attn`, `--linears`, `--norms`, `--compile` give each a row):
  qwen3-0.6b, qwen3-1.7b, gptoss-attn   the presets above, at --shapes (default: their suite shapes)
  8k   recipes/configs/hybrid-1p7b.yaml as is (8K tokens per sequence)
  64k  hybrid-1p7b's model with extend-64k.yaml's 64K settings (seq_len 65536, batch 1, RoPE base 1e6,
       gradient checkpointing, loss_chunk 8192)
  any recipe YAML path (e.g. recipes/configs/tiny-cpu.yaml)
A recipe setting builds the recipe config's model with hf_deltamatch.training (random init, as the recipe does), feeds
it random tokens in the recipe's packed layout (PackedCollator: one row of batch x seq_len tokens with cu_seq_lens;
no data needed), and runs its optimizer steps exactly as the recipe's loop does: bf16 autocast over fp32 master
weights, grad_accum micro-batches, clipping, the recipe's AdamW, gradient checkpointing and the chunked loss as the
config sets them.

MFU counts model FLOPs (recomputation under checkpointing earns nothing) against --peak-tflops (H100/H200 SXM
dense BF16: 989.4):
  6 * P per token, P = parameters that multiply activations (all but the input embedding; a tied head counts once)
  + softmax attention: 12 * Hq * D * (query-key pairs) per layer and step (forward 4 * Hq * D per pair, backward
    twice the forward; causal: n^2 / 2 pairs per document, a window W: n * W - W^2 / 2)
  + Gated DeltaNet (chunk C=64, key dim K, value dim V, HV value heads): per token and layer
    3 * 2 * HV * (3*C*K + 2*C*V + 3*K*V + C^2/3) (forward matmuls per chunk: K K^T, w = A (k beta e^g),
    q K^T: C^2 K each; u = A (v beta), (q K^T) v_new: C^2 V each; w S, K^T v_new, q S: C K V each; the
    triangular inverse C^3/3; backward twice the forward)
The attention share (eager rows, outside the suite) is measured with CUDA events (wall clock on CPU) around the
attention function (transformers' attention interface), including its recomputation under checkpointing, and in
backward from the gradient hook on its output to the gradient hook on its query; the same for the Gated DeltaNet core
(chunk_gated_delta_rule, FLA or torch). Which Gated DeltaNet backend ran is recorded. The suite's timed windows run
without those hooks (`--no-shares`); `--profile` gives where a step's time goes.

  python benchmarks/train_throughput.py --out /tmp/tp                               # 8k and 64k, every attn
  python benchmarks/train_throughput.py --settings 64k --attn deltamatch_fp8 --linears bf16,fp8,fp8-compiled \
      --out /tmp/tp
  python benchmarks/train_throughput.py --settings 64k --attn deltamatch_fp8,sdpa --norms eager,fused --out /tmp/tp
  python benchmarks/train_throughput.py --settings qwen3-0.6b --shapes 8192x1 --attn deltamatch_fp8,sdpa \\
      --compile eager,compiled --repeats 5 --profile --step-json /tmp/tp/step.json
  python benchmarks/train_throughput.py --settings recipes/configs/tiny-cpu.yaml --device cpu --steps 2 \\
      --warmup 1 --attn deltamatch_fp8,sdpa --out /tmp/tp                          # CPU smoke test
Extra arguments after `--` go to the recipe's config parser (e.g. `-- --grad_accum 1 --batch_size 1`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.util
import itertools
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import torch  # noqa: E402
import varlen_attention  # noqa: E402  (benchmarks/: the packed baseline, torch_varlen)

SETTINGS = {
    "8k": (ROOT / "recipes/configs/hybrid-1p7b.yaml", None),
    "64k": (ROOT / "recipes/configs/hybrid-1p7b.yaml", ROOT / "recipes/configs/extend-64k.yaml"),
}
SETTING_MODELS = {"8k": "hybrid-1p7b", "64k": "hybrid-1p7b"}  # the model name a recipe setting's rows carry
# what the 64K stage changes (its `model` is a checkpoint path, its data and schedule do not matter here)
EXTENSION_KEYS = ("seq_len", "batch_size", "grad_accum", "gradient_checkpointing", "loss_chunk", "rope_theta",
                  "max_position_embeddings")
GDN_CHUNK = 64
PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4}  # SXM dense BF16 tensor-core peak
SEED = 0

# Plain transformers models (random init, bf16 weights, fused AdamW): the module docstring says why each is shaped so.
_QWEN3 = dict(model_type="qwen3", vocab_size=151936, num_hidden_layers=28, num_attention_heads=16,
              num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
              tie_word_embeddings=True, attention_dropout=0.0,
              rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
DENSE_SHAPES = ((2048, 8), (4096, 4), (8192, 1), (16384, 1), (32768, 1))
MODELS = {
    "qwen3-0.6b": {"config": {**_QWEN3, "hidden_size": 1024, "intermediate_size": 3072}, "shapes": DENSE_SHAPES},
    "qwen3-1.7b": {"config": {**_QWEN3, "hidden_size": 2048, "intermediate_size": 6144}, "shapes": DENSE_SHAPES},
    "gptoss-attn": {
        "config": dict(model_type="gpt_oss", vocab_size=201088, hidden_size=2880, num_hidden_layers=24,
                       num_attention_heads=64, num_key_value_heads=8, head_dim=64, attention_bias=True,
                       sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 12,
                       num_local_experts=1, num_experts_per_tok=1, intermediate_size=4 * 2880,
                       tie_word_embeddings=False, attention_dropout=0.0),
        "shapes": ((8192, 1),),
        "ratio_base": varlen_attention.NAME,
        "refuses": {"sdpa": "transformers runs gpt-oss without sdpa (GptOssForCausalLM._supports_sdpa is False: "
                            "SDPA has no attention sinks)"},
    },
}
PACKED_DOCS = 8  # documents in the suite's packed rows


@dataclasses.dataclass(frozen=True)
class Case:
    """One comparison of the suite: a model at one shape and the attention implementations it runs with."""

    setting: str  # a MODELS preset or a recipe setting (SETTINGS)
    seq_len: int | None = None  # None: the recipe's
    batch: int | None = None
    docs_per_row: int = 1
    attns: tuple[str, ...] = ("sdpa", "deltamatch_fp8")
    steps: int | None = None  # optimizer steps per timed window (None: --steps)


def issue45_sections() -> list[tuple[list[Case], tuple[bool, ...]]]:
    """The issue's rows as (cases, compiled values) sections, in the order they run: every eager row (dense shapes
    first), then every compiled row, then the extra baselines (flex_attention on gpt-oss, torch_varlen on the hybrid),
    so that a call that runs out of time leaves the least needed rows to the next."""
    varlen = varlen_attention.NAME
    cases = [Case(m, n, b) for m in ("qwen3-0.6b", "qwen3-1.7b") for n, b in DENSE_SHAPES]
    cases += [Case("qwen3-0.6b", 8192, 1, PACKED_DOCS, ("sdpa", "deltamatch_fp8", varlen)),
              Case("gptoss-attn", 8192, 1, 1, (varlen, "deltamatch_fp8", "sdpa")),
              Case("8k", attns=("sdpa", "deltamatch_fp8"), steps=1),
              Case("64k", attns=("sdpa", "deltamatch_fp8"), steps=1)]
    extras = [Case("gptoss-attn", 8192, 1, 1, ("flex_attention",)), Case("8k", attns=(varlen,), steps=1)]
    return [(cases, (False,)), (cases, (True,)), (extras, (False, True))]


SUITES = {"issue45": issue45_sections}
STEP_JSON = ROOT / "benchmarks" / "results" / "current" / "train_step.json"


# ----------------------------------------------------------------------------------------------------
# FLOPs
# ----------------------------------------------------------------------------------------------------


def matmul_params(model) -> int:
    """Parameters that multiply activations: everything but the input embedding table (a lookup), except that
    a head tied to it is a matmul and counts once."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is emb
    return total if tied else total - emb.numel()


def layer_counts(config) -> tuple[int, int]:
    """(softmax-attention layers, full or windowed; Gated DeltaNet layers)."""
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)
    return types.count("full_attention") + types.count("sliding_attention"), types.count("linear_attention")


def attention_windows(config) -> list[int | None]:
    """The window of each softmax-attention layer, None where it is full."""
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    return [window if t == "sliding_attention" else None for t in types if t in ("full_attention", "sliding_attention")]


def causal_pairs(n: int, window: int | None) -> float:
    """Query-key pairs of causal attention over one document of n tokens (n^2 / 2, the FLOP convention), within a
    window of `window` keys: n * W - W^2 / 2."""
    return n * n / 2 if window is None or window >= n else n * window - window * window / 2


def gdn_flops_per_token(config) -> float:
    """Forward + backward model FLOPs of one Gated DeltaNet layer's chunked delta rule per token."""
    c, k, v = GDN_CHUNK, config.linear_key_head_dim, config.linear_value_head_dim
    macs = 3 * c * k + 2 * c * v + 3 * k * v + c * c / 3
    return 3 * 2 * config.linear_num_value_heads * macs


def step_flops(config, n_params: int, doc_lens_per_row: list[list[int]], grad_accum: int) -> dict:
    tokens = sum(sum(r) for r in doc_lens_per_row)
    n_gdn = layer_counts(config)[1]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dense = 6.0 * n_params * tokens
    pairs = sum(causal_pairs(n, w) for w in attention_windows(config) for r in doc_lens_per_row for n in r)
    attn = 12.0 * config.num_attention_heads * head_dim * pairs
    gdn = gdn_flops_per_token(config) * n_gdn * tokens if n_gdn else 0.0
    return {"dense": dense * grad_accum, "attention": attn * grad_accum, "gdn": gdn * grad_accum,
            "total": (dense + attn + gdn) * grad_accum}


# ----------------------------------------------------------------------------------------------------
# Timing one function inside the model, forward and backward
# ----------------------------------------------------------------------------------------------------


class SpanTimer:
    """Time spent in one function: its forward calls (recomputations included) and, in backward, from its
    output's gradient hook (its backward is next: autograd runs the most recently created nodes first) to
    its query's gradient hook (every gradient of the call has been produced)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.spans: list[list] = []
        self.calls = 0
        self.enabled = False

    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def wrap(self, fn, query_index: int):
        def timed(*args, **kwargs):
            if not self.enabled:
                return fn(*args, **kwargs)
            self.calls += 1
            start = self._mark()
            result = fn(*args, **kwargs)
            self.spans.append([start, self._mark()])
            out, query = result[0], args[query_index] if len(args) > query_index else None
            if torch.is_grad_enabled() and query is not None and out.requires_grad and query.requires_grad:
                span = [None, None]

                def begin(grad):
                    span[0] = self._mark()

                def end(grad):
                    if span[0] is not None and span[1] is None:
                        span[1] = self._mark()
                        self.spans.append(span)

                out.register_hook(begin)
                query.register_hook(end)
            return result

        timed.__wrapped__ = fn
        return timed

    def take_ms(self) -> float:
        """Milliseconds of every finished span since the last call (synchronizes)."""
        if self.cuda:
            torch.cuda.synchronize()
            total = sum(a.elapsed_time(b) for a, b in self.spans)
        else:
            total = sum((b - a) * 1e3 for a, b in self.spans)
        self.spans.clear()
        return total


def instrument(model, device):
    """(attention timer, Gated DeltaNet timer or None, short-conv timer or None, undo): wraps the attention function
    the model looks up at every call, and the gated delta rule and short convolution (`causal_conv1d_fn`, with the
    document restart of hf_deltamatch.training.short_conv where that is installed) its linear-attention layers call."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = model.config._attn_implementation
    attn = SpanTimer(device)
    had_local = name in ALL_ATTENTION_FUNCTIONS._local_mapping
    original = ALL_ATTENTION_FUNCTIONS[name]
    ALL_ATTENTION_FUNCTIONS[name] = attn.wrap(original, query_index=1)  # (module, query, key, value, mask, ...)
    # name and original bound now: the loop below rebinds `name`
    undo = [lambda name=name, original=original: ALL_ATTENTION_FUNCTIONS.__setitem__(name, original) if had_local
            else ALL_ATTENTION_FUNCTIONS._local_mapping.pop(name, None)]
    timers = {}
    layers = [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]
    if layers:
        module = sys.modules[type(layers[0]).__module__]
        for name in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn"):  # both take the query-like input first
            fn = getattr(module, name, None)
            if fn is not None:
                timers[name] = SpanTimer(device)
                setattr(module, name, timers[name].wrap(fn, query_index=0))
                undo.append(lambda name=name, fn=fn: setattr(module, name, fn))
    return (attn, timers.get("torch_chunk_gated_delta_rule"), timers.get("causal_conv1d_fn"),
            lambda: [u() for u in undo])


# ----------------------------------------------------------------------------------------------------
# Where the step time goes: one profiled step, its kernels by category (--profile)
# ----------------------------------------------------------------------------------------------------

# (category, regex on the kernel name, or on the op name on CPU), first match wins (FLA's chunk_gated_delta_*
# before this package's _delta). Names are the kernels' as the
# profiler reports them: cuBLAS/CUTLASS GEMMs (nvjet, sm90_xmma, cutlass; fp8 ones through _scaled_mm), this
# package's Triton and Gluon kernels (_fwd, _bwd_*, *_hopper, _quantize...), FLA's gated delta rule kernels,
# torch.compile's generated ones (triton_poi/red/per_), ATen's elementwise and reduction kernels.
PROFILE_CATEGORIES = [
    ("matmul", r"gemm|nvjet|xmma|cutlass|cublas|_scaled_mm|aten::(addmm|mm|bmm|matmul|linear)$"),
    ("gated deltanet", r"chunk_|solve_tril|recompute_w_u|prepare_wy|l2norm|fused_recurrent|gated_delta|kkt"),
    ("short conv", r"conv"),
    ("attention", r"_fwd_kernel|_fwd_hopper|_bwd_|_hopper_kernel|_quantize|_token_major|_delta|flash|fmha|cudnn"
                  r"|attention|sdpa"),
    ("optimizer", r"multi_tensor|adam|_foreach"),
    ("loss (softmax, cross-entropy)", r"softmax|cross_entropy|nll|log_softmax"),
    ("norms", r"norm"),
    ("torch.compile kernels", r"^triton_"),
    ("copies, casts, fills", r"copy|Memcpy|Memset|fill|CatArray|\bcat\b|convert"),  # not "cast": ATen's *_nocast
    ("elementwise", r"elementwise|vectorized|unrolled|pointwise|mul|add|silu|sigmoid|exp|neg|div|where"),
    ("reductions", r"reduce|sum|mean|max|amax|norm"),
]


def categorize(name: str) -> str:
    for category, pattern in PROFILE_CATEGORIES:
        if re.search(pattern, name, flags=re.IGNORECASE):
            return category
    return "other"


def profile_step(step, sync, device, top: int = 15) -> dict:
    """Runs `step` once under torch.profiler: GPU kernel time by category (PROFILE_CATEGORIES) and the top kernels,
    against the step's wall time (the difference: the GPU idle, waiting for the host). On a CPU: self CPU time
    of the ATen ops instead (no claim about a GPU)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    sync()
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        step()
        sync()
        wall_ms = (time.perf_counter() - t0) * 1e3
    kernels = {}
    for event in prof.key_averages():
        if cuda:
            us = getattr(event, "self_device_time_total", None)
            if us is None:
                us = getattr(event, "self_cuda_time_total", 0.0)
        else:
            us = event.self_cpu_time_total if event.key.startswith("aten::") else 0.0
        if us > 0:
            kernels[event.key] = kernels.get(event.key, 0.0) + us / 1e3
    by_category = {}
    for name, ms in kernels.items():
        by_category[categorize(name)] = by_category.get(categorize(name), 0.0) + ms
    busy = sum(kernels.values())
    return {
        "wall_ms": wall_ms, "busy_ms": busy, "what": "GPU kernel time" if cuda else "self CPU time of ATen ops",
        "categories": dict(sorted(by_category.items(), key=lambda kv: -kv[1])),
        "top": [{"name": n[:160], "ms": ms, "category": categorize(n)}
                for n, ms in sorted(kernels.items(), key=lambda kv: -kv[1])[:top]],
    }


def _annotated_modules(lm):
    """The modules whose forward calls are annotated for attribute_step: each decoder layer (its residual adds) and
    its direct children (attention or Gated DeltaNet, MLP, norms), and the rest of the model's top level."""
    inner = getattr(lm, "model", lm)
    layers = list(getattr(inner, "layers", []))
    tops = [m for name, m in inner.named_children() if name != "layers"] + \
        [m for name, m in lm.named_children() if name != "model"]
    return layers + [child for layer in layers for child in layer.children()] + tops


def attribute_step(step, sync, device, lm, top: int = 20) -> list[dict]:
    """One more step under torch.profiler with CPU ops recorded and the model's layer parts annotated: each ATen op's
    own GPU kernel time (on a CPU: its self CPU time) goes to the innermost annotated module around it (a forward,
    or its recomputation under checkpointing) or else to the autograd node that ran it (the backward), and to the
    op's category. Returns the `top` (owner, category) pairs by time: where the copies and elementwise work sit."""
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = device.type == "cuda"
    open_ranges, hooks = [], []

    def enter(mod, args):
        ctx = record_function(f"module::{type(mod).__name__}")
        ctx.__enter__()
        open_ranges.append(ctx)

    def leave(mod, args, out):
        open_ranges.pop().__exit__(None, None, None)

    for mod in _annotated_modules(lm):
        hooks += [mod.register_forward_pre_hook(enter), mod.register_forward_hook(leave)]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:
        sync()
        with profile(activities=activities) as prof:
            step()
            sync()
    finally:
        for h in hooks:
            h.remove()
    owned = {}
    for event in prof.events():
        if not event.name.startswith("aten::"):
            continue
        us = getattr(event, "self_device_time_total", 0.0) if cuda else event.self_cpu_time_total
        if us <= 0:
            continue
        owner, parent = "outside the layers", event.cpu_parent
        while parent is not None:
            if parent.name.startswith("module::"):
                owner = parent.name[len("module::"):]
                break
            if parent.name.startswith("autograd::engine::evaluate_function: "):
                owner = "backward: " + parent.name.split(": ", 1)[1]
                break
            parent = parent.cpu_parent
        key = (owner, categorize(event.name))
        owned[key] = owned.get(key, 0.0) + us / 1e3
    return [{"owner": o, "category": c, "ms": ms}
            for (o, c), ms in sorted(owned.items(), key=lambda kv: -kv[1])[:top]]

# ----------------------------------------------------------------------------------------------------
# One configuration (runs in its own process)
# ----------------------------------------------------------------------------------------------------


LINEARS = {"bf16": [], "fp8": ["--fp8_linear"], "fp8-compiled": ["--fp8_linear", "--compile_fp8_linear"]}
NORMS = {"eager": [], "fused": ["--fused_norms"]}  # transformers' RMSNorms as they are / through F.rms_norm


def recipe_config(setting: str, attn: str, linears: str, extra: list[str], norms: str = "eager"):
    from hf_deltamatch.training.config import load_config_file, parse_config

    base, extension = SETTINGS.get(setting, (Path(setting), None))
    argv = ["--config", str(base), "--attn", attn] + LINEARS[linears] + NORMS[norms]
    if extension is not None:
        ext = load_config_file(extension)
        for key in EXTENSION_KEYS:
            value = ext[key]
            if isinstance(value, bool):
                argv.append(f"--{key}" if value else f"--no-{key}")
            else:
                argv += [f"--{key}", str(value)]
    return parse_config(argv + list(extra))


def random_token_tokenizer(vocab_size: int):
    """A word-level tokenizer with `vocab_size` entries: the model config takes its size and special ids."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<pad>", "<eos>"]
    vocab = {tok: i for i, tok in enumerate(specials + [f"t{i}" for i in range(vocab_size - len(specials))])}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
                                   unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")


def random_batch(cfg, vocab_size: int, docs_per_row: int, seed: int, device):
    """The recipe's packed batch (PackedCollator) of batch_size rows of seq_len random tokens."""
    from hf_deltamatch.training.data import PackedCollator

    gen = torch.Generator().manual_seed(seed)
    base, rem = divmod(cfg.seq_len, docs_per_row)
    lens = [base + (i < rem) for i in range(docs_per_row)]
    blocks = [{"input_ids": torch.randint(3, vocab_size, (cfg.seq_len,), generator=gen), "doc_lens": lens}
              for _ in range(cfg.batch_size)]
    batch = PackedCollator()(blocks)
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}, [lens] * cfg.batch_size


def doc_lengths(total: int, docs: int, seed: int) -> list[int]:
    """`docs` uneven document lengths that sum to `total`: seeded log-normal shares (sigma 0.75), each at least 1."""
    if docs <= 1:
        return [total]
    gen = torch.Generator().manual_seed(seed)
    shares = torch.exp(torch.randn(docs, generator=gen, dtype=torch.float64) * 0.75)
    lens = [max(1, int(s)) for s in (shares / shares.sum() * total).tolist()]
    lens[lens.index(max(lens))] += total - sum(lens)
    return lens


def preset_config(name: str, override: dict | None = None):
    """The transformers config of a MODELS preset, `override` merged in (the CPU tests shrink it)."""
    from transformers import AutoConfig

    spec = {**MODELS[name]["config"], **(override or {})}
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    config.use_cache = False
    return config


def preset_batch(seq_len: int, batch: int, docs_per_row: int, vocab_size: int, seed: int, device):
    """batch rows of seq_len random tokens; with several documents per row, the packed layout (PackedCollator: one
    row with position_ids restarting at each document and cu_seq_lens)."""
    gen = torch.Generator().manual_seed(seed)
    if docs_per_row <= 1:
        ids = torch.randint(3, vocab_size, (batch, seq_len), generator=gen).to(device)
        return {"input_ids": ids, "labels": ids}, [[seq_len]] * batch
    from hf_deltamatch.training.data import PackedCollator

    lens = doc_lengths(seq_len, docs_per_row, seed)
    blocks = [{"input_ids": torch.randint(3, vocab_size, (seq_len,), generator=gen), "doc_lens": lens}
              for _ in range(batch)]
    out = PackedCollator()(blocks)
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in out.items()}, [lens] * batch


@dataclasses.dataclass
class Setup:
    """What a configuration's optimizer step needs."""

    lm: torch.nn.Module  # the transformers *ForCausalLM
    wrapped: torch.nn.Module  # its loss wrapper (CausalLMWithLoss): forward(**batch) -> (loss, tokens)
    optimizers: list
    batch: dict
    doc_lens: list
    grad_accum: int
    autocast: object
    clip_grad: float
    info: dict  # the report's description of the configuration


def setup_recipe(spec: dict, device) -> Setup:
    from hf_deltamatch.training.modeling import CausalLMWithLoss, build_model, causal_lm, gdn_backend
    from hf_deltamatch.training.optim import build_optimizers

    extra = list(spec["extra"])
    if spec.get("seq_len"):
        extra += ["--seq_len", str(spec["seq_len"]), "--batch_size", str(spec["batch"])]
    cfg = recipe_config(spec["setting"], spec["attn"], spec["linears"], extra, spec["norms"])
    if device.type == "cpu" and cfg.cpu_threads > 0:
        torch.set_num_threads(cfg.cpu_threads)
    torch.manual_seed(cfg.seed)
    tokenizer = random_token_tokenizer(cfg.vocab_size)
    with torch.device(device):  # parameters created on the GPU: no 7 GB detour through host memory
        model = build_model(cfg, tokenizer)
    model.to(device)
    wrapped = CausalLMWithLoss(model, cfg.loss_chunk)
    lm = causal_lm(model)
    if device.type == "cpu" and layer_counts(lm.config)[1] and gdn_backend() == "fla":
        raise SystemExit("transformers will call flash-linear-attention's Triton kernels, which need a CUDA GPU: "
                         "run on the GPU, or on CPU in an environment without flash-linear-attention.")
    batch, doc_lens = random_batch(cfg, len(tokenizer), spec["docs_per_row"], cfg.seed, device)
    info = {"precision": cfg.precision if cfg.attn == "deltamatch_fp8" else None,
            "delta": cfg.delta if cfg.attn == "deltamatch_fp8" else None,
            "seq_len": cfg.seq_len, "batch_size": cfg.batch_size, "gradient_checkpointing": cfg.gradient_checkpointing,
            "loss_chunk": cfg.loss_chunk, "mixed_precision": cfg.mixed_precision, "optimizer": "the recipe's AdamW"}
    return Setup(lm, wrapped, build_optimizers(wrapped, cfg), batch, doc_lens, cfg.grad_accum,
                 torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.mixed_precision == "bf16"),
                 cfg.clip_grad, info)


def setup_preset(spec: dict, device) -> Setup:
    """A MODELS preset as a user trains it: bf16 weights, fused AdamW on CUDA, no autocast, no clipping."""
    from hf_deltamatch._quiet_imports import import_torchao_float8, import_transformers_modeling
    from hf_deltamatch.training.config import TrainConfig
    from hf_deltamatch.training.modeling import CausalLMWithLoss, convert_linear_to_fp8, setup_attention

    if spec["linears"] != "bf16":
        import_torchao_float8()
    import_transformers_modeling()
    from transformers import AutoModelForCausalLM

    if device.type == "cpu":
        torch.set_num_threads(1)  # as the recipes' cpu_threads: tiny ops, shared cores
    impl = setup_attention(TrainConfig(attn=spec["attn"]))  # deltamatch_fp8: fp8, matching delta (the defaults)
    config = preset_config(spec["setting"], spec.get("override"))
    torch.manual_seed(SEED)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=impl, dtype=torch.bfloat16)
    if spec["norms"] == "fused":
        from hf_deltamatch.training.norms import fuse_rms_norms

        fuse_rms_norms(model)
    if spec["linears"] != "bf16":
        convert_linear_to_fp8(model, compile=spec["linears"] == "fp8-compiled")
    batch, doc_lens = preset_batch(spec["seq_len"], spec["batch"], spec["docs_per_row"], config.vocab_size, SEED,
                                   device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=device.type == "cuda")
    info = {"precision": "fp8" if spec["attn"] == "deltamatch_fp8" else None,
            "delta": "matching" if spec["attn"] == "deltamatch_fp8" else None,
            "seq_len": spec["seq_len"], "batch_size": spec["batch"], "gradient_checkpointing": False,
            "loss_chunk": spec.get("loss_chunk", 0), "mixed_precision": "bf16 weights",
            "optimizer": "AdamW, fused" if device.type == "cuda" else "AdamW"}
    return Setup(model, CausalLMWithLoss(model, spec.get("loss_chunk", 0)), [opt], batch, doc_lens, 1,
                 contextlib.nullcontext(), 0.0, info)


def decoder_layers(lm) -> list:
    inner = getattr(lm, getattr(lm, "base_model_prefix", ""), None) or getattr(lm, "model", lm)
    layers = getattr(inner, "layers", None)
    if not layers:
        raise ValueError(f"{type(lm).__name__} has no decoder layers at .{lm.base_model_prefix}.layers to compile")
    return list(layers)


def compile_for_training(setup: Setup, scope: str, backend: str):
    """The callable the step runs: the loss wrapper with each decoder layer compiled (scope "layers": identical
    layers reuse one graph) or compiled whole with its loss (scope "model")."""
    if scope == "model":
        return torch.compile(setup.wrapped, backend=backend)
    layers = decoder_layers(setup.lm)
    import torch._dynamo as dynamo

    # should a guard tell layers apart after all, each may take its own graph rather than fall back to eager
    dynamo.config.recompile_limit = max(dynamo.config.recompile_limit, 2 * len(layers))
    for layer in layers:
        layer.compile(backend=backend)
    return setup.wrapped


def _is_oom(exc: BaseException) -> bool:
    """An out-of-memory error, possibly wrapped (torch.compile re-raises backend errors in its own)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower():
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _one_line(exc: BaseException, limit: int = 600) -> str:
    text = " ".join(w for w in f"{type(exc).__name__}: {exc}".split() if w.strip("^~"))  # no traceback carets
    return text if len(text) <= limit else text[:limit // 2] + " ... " + text[-limit // 2:]  # the innermost frame


def run_one(spec: dict) -> dict:
    """One configuration: its report entry. An out-of-memory error becomes status "oom" with the peak reached, any
    other exception status "failed" with its message (torch.compile's names the user code it stopped in) and the
    end of its traceback."""
    import traceback

    device = torch.device(spec["device"])
    try:
        return _run_one(spec, device)
    except Exception as exc:  # noqa: BLE001  (reported as the row's result)
        traceback.print_exc()
        if _is_oom(exc):
            from hf_deltamatch.training.loop import _memory_gb

            return {"status": "oom", "reason": _one_line(exc), "peak_memory_gib": _memory_gb(device)}
        return {"status": "failed", "reason": _one_line(exc, 1500), "traceback": traceback.format_exc()[-4000:]}


def _run_one(spec: dict, device) -> dict:
    from hf_deltamatch.training.loop import _memory_gb
    from hf_deltamatch.training.modeling import gdn_backend

    if spec["attn"] == varlen_attention.NAME:
        varlen_attention.register()
    setup = (setup_preset if spec["setting"] in MODELS else setup_recipe)(spec, device)
    lm, batch, doc_lens = setup.lm, setup.batch, setup.doc_lens
    n_params = matmul_params(lm)
    flops = step_flops(lm.config, n_params, doc_lens, setup.grad_accum)
    compiled = spec.get("compiled", False)
    shares = spec.get("shares", True) and not compiled  # the hooks would break the compiled graphs
    fn = compile_for_training(setup, spec["compile_scope"], spec["compile_backend"]) if compiled else setup.wrapped
    if shares:
        attn_timer, gdn_timer, conv_timer, undo = instrument(lm, device)
    else:
        attn_timer = gdn_timer = conv_timer = None
        undo = lambda: None  # noqa: E731
    opt_timer = SpanTimer(device)

    def step():
        for _ in range(setup.grad_accum):
            with setup.autocast:
                loss, _ = fn(**batch)
            (loss / setup.grad_accum).backward()
        start = opt_timer._mark() if opt_timer.enabled else None
        if setup.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(setup.wrapped.parameters(), setup.clip_grad)
        for opt in setup.optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        if start is not None:
            opt_timer.spans.append([start, opt_timer._mark()])
        return loss.detach()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    setup.wrapped.train()
    losses, warmup_s = [], []
    for _ in range(spec["warmup"]):
        t0 = time.perf_counter()
        losses.append(float(step()))  # float(): waits for the step
        warmup_s.append(time.perf_counter() - t0)
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    timers = [t for t in (attn_timer, gdn_timer, conv_timer) if t is not None] + [opt_timer]
    attn_ms = gdn_ms = conv_ms = opt_ms = 0.0
    steps, repeats = spec["steps"], spec.get("repeats", 1)
    step_ms, window_ms = [], []
    for _ in range(repeats):
        for _ in range(steps):
            for timer in timers:
                timer.enabled = True
            sync()
            t0 = time.perf_counter()
            loss = step()
            sync()
            step_ms.append((time.perf_counter() - t0) * 1e3)
            losses.append(float(loss))
            attn_ms += attn_timer.take_ms() if attn_timer is not None else 0.0
            gdn_ms += gdn_timer.take_ms() if gdn_timer is not None else 0.0
            conv_ms += conv_timer.take_ms() if conv_timer is not None else 0.0
            opt_ms += opt_timer.take_ms()
        window_ms.append(sum(step_ms[-steps:]))
    for timer in timers:
        timer.enabled = False
    peak_gib = _memory_gb(device)
    profile = profile_step(step, sync, device) if spec.get("profile") else None
    if profile is not None:
        profile["by_owner"] = attribute_step(step, sync, device, lm)
    undo()
    total_ms = sum(step_ms)
    tokens_per_step = sum(sum(r) for r in doc_lens) * setup.grad_accum
    windows = [tokens_per_step * steps / (ms / 1e3) for ms in window_ms]
    peak = spec.get("peak_tflops")
    achieved = flops["total"] * len(step_ms) / (total_ms / 1e3) / 1e12
    n_attn, n_gdn = layer_counts(lm.config)
    return {
        "setting": spec["setting"], "attn": spec["attn"], "linears": spec["linears"], "norms": spec["norms"],
        "compiled": compiled, "compile_scope": spec["compile_scope"] if compiled else None,
        "attn_implementation": lm.config._attn_implementation,
        "gdn_backend": gdn_backend() if n_gdn else None,
        **setup.info, "grad_accum": setup.grad_accum, "docs_per_row": spec["docs_per_row"],
        "layers": {"attention": n_attn, "gated_deltanet": n_gdn},
        "params_total": sum(p.numel() for p in {id(p): p for p in lm.parameters()}.values()),
        "params_matmul": n_params,
        "tokens_per_step": tokens_per_step, "warmup": spec["warmup"], "steps": steps, "repeats": repeats,
        "warmup_s": warmup_s, "step_ms": total_ms / len(step_ms), "step_ms_all": step_ms,
        "window_tokens_per_s": windows, "tokens_per_s": sum(windows) / len(windows),
        "tokens_per_s_spread": (max(windows) - min(windows)) / 2,
        "peak_memory_gib": peak_gib,
        "peak_memory_kind": "torch.cuda.max_memory_allocated" if device.type == "cuda" else "process max RSS",
        "flops_per_step": flops, "achieved_tflops": achieved,
        "mfu": achieved / peak if peak else None, "peak_tflops": peak,
        "attention_share": attn_ms / total_ms if shares else None,
        "gdn_share": gdn_ms / total_ms if gdn_timer is not None else None,
        "short_conv_share": conv_ms / total_ms if conv_timer is not None else None,
        "optimizer_share": opt_ms / total_ms,
        "attention_calls": attn_timer.calls if attn_timer is not None else None, "losses": losses,
        "profile": profile,
    }


# ----------------------------------------------------------------------------------------------------
# Rows: what to run, what train_step.json holds
# ----------------------------------------------------------------------------------------------------


def _peak_tflops(device, given):
    if given is not None:
        return given
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def _variant(r: dict) -> str:
    """The report's linears cell: the linear layers, and the norms where they are not transformers' own."""
    return r["linears"] + (" + fused norms" if r.get("norms", "eager") != "eager" else "")


def skip_reason(attn: str, linears: str, device, setting: str | None = None) -> str | None:
    refusal = MODELS.get(setting, {}).get("refuses", {}).get(attn)
    if refusal:
        return refusal
    if attn == varlen_attention.NAME and device.type != "cuda":
        return f"{attn} (FlashAttention-2 through torch) needs a CUDA GPU"
    if attn == varlen_attention.NAME and importlib.util.find_spec("torch.nn.attention.varlen") is None:
        return f"{attn} needs torch.nn.attention.varlen (torch >= 2.10)"
    if attn == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        return "flash_attention_2 needs the flash-attn package, which is not installed"
    if attn == "flash_attention_2" and device.type != "cuda":
        return "flash_attention_2 needs a CUDA GPU"
    if attn == "flex_attention" and device.type != "cuda":
        return "flex_attention runs on CUDA in this benchmark (transformers' flex path refuses sinks on a CPU)"
    if linears != "bf16" and importlib.util.find_spec("torchao") is None:
        return f"--linears {linears} needs torchao, which is not installed"
    return None


_RECIPE_SHAPES: dict = {}


def plan_row(setting: str, attn: str, linears: str, norms: str, compiled: bool, seq_len: int | None = None,
             batch: int | None = None, docs_per_row: int = 1, steps: int | None = None, run: int = 1,
             extra: tuple = ()) -> dict:
    """One configuration to run, with the identity its train_step.json row carries."""
    if setting in MODELS:
        model, packed, base = setting, docs_per_row > 1, MODELS[setting].get("ratio_base", "sdpa")
    else:
        key = (setting, seq_len, batch, tuple(extra))
        if key not in _RECIPE_SHAPES:
            shape = ["--seq_len", str(seq_len), "--batch_size", str(batch)] if seq_len else []
            cfg = recipe_config(setting, "sdpa", "bf16", list(extra) + shape)
            _RECIPE_SHAPES[key] = (cfg.seq_len, cfg.batch_size)
        model, packed, base = SETTING_MODELS.get(setting, Path(setting).stem), True, "sdpa"
        seq_len, batch = _RECIPE_SHAPES[key]
    return {"setting": setting, "model": model, "seq_len": seq_len, "batch": batch, "docs_per_row": docs_per_row,
            "packed": packed, "attn": attn, "linears": linears, "norms": norms, "compiled": compiled, "steps": steps,
            "ratio_base": base, "run": run}


def step_key(r: dict) -> tuple:
    """What identifies a row of train_step.json (the issue's schema)."""
    linears = r["linears"] if "norms" not in r else _variant(r)
    return r["model"], r["seq_len"], r["batch"], bool(r["packed"]), r["attn"], linears, bool(r["compiled"])


def row_label(r: dict) -> str:
    return (f"{r['model']} {r['seq_len']}x{r['batch']}{' packed' if r['packed'] else ''} {r['attn']} {_variant(r)} "
            f"{'compiled' if r['compiled'] else 'eager'}" + (f" (run {r['run']})" if r.get("run", 1) > 1 else ""))


def _with_baseline_runs(group: list[dict], runs: int) -> list[dict]:
    """The group's rows, then its base rows again (runs 2..`runs`, separate processes): the noise floor."""
    again = [{**r, "run": k} for k in range(2, runs + 1) for r in group if r["attn"] == r["ratio_base"]]
    return group + again


def plan_rows(args) -> list[dict]:
    rows = []
    if args.suite:
        for cases, compiled_values in SUITES[args.suite]():
            for compiled in compiled_values:
                if compiled not in args.compile:
                    continue
                for case in cases:
                    attns = [a for a in case.attns if args.attn is None or a in args.attn]
                    group = [plan_row(case.setting, a, linears, norms, compiled, case.seq_len, case.batch,
                                      case.docs_per_row, case.steps, extra=tuple(args.extra))
                             for linears, norms in itertools.product(args.linears, args.norms) for a in attns]
                    rows += _with_baseline_runs(group, args.baseline_runs)
    else:
        for setting in args.settings:
            shapes = args.shapes or (MODELS[setting]["shapes"] if setting in MODELS else [(None, None)])
            for seq_len, batch in shapes:
                group = [plan_row(setting, attn, linears, norms, compiled, seq_len, batch, args.docs_per_row,
                                  extra=tuple(args.extra))
                         for attn in args.attn or DEFAULT_ATTNS
                         for linears, norms in itertools.product(args.linears, args.norms)
                         for compiled in args.compile]
                rows += _with_baseline_runs(group, args.baseline_runs)
    if args.match:
        rows = [r for r in rows if any(m in row_label(r) for m in args.match)]
    return rows


def oom_reason(row: dict, rows: list[dict]) -> str | None:
    """A row of a configuration that ran out of memory at a shape no larger in sequence and batch cannot fit."""
    for r in rows:
        if (r.get("status") == "oom" and (r["model"], r["packed"], r["attn"], r["linears"], r["compiled"])
                == (row["model"], row["packed"], row["attn"], _variant(row), row["compiled"])
                and r["seq_len"] <= row["seq_len"] and r["batch"] <= row["batch"]):
            return f"not run: out of memory at {r['seq_len']} x {r['batch']} already"
    return None


def step_row(row: dict, result: dict) -> dict:
    """The train_step.json row of one run (or of a skip: `result` then holds status and reason)."""
    ok = result.get("status", "ok") == "ok"
    windows = result.get("window_tokens_per_s") or []
    return {"model": row["model"], "seq_len": result.get("seq_len") or row["seq_len"],
            "batch": result.get("batch_size") or row["batch"], "packed": row["packed"], "attn": row["attn"],
            "linears": _variant(row), "compiled": row["compiled"],
            "tokens_per_s": result.get("tokens_per_s") if ok else None,
            "peak_gib": result.get("peak_memory_gib") if ok else None, "ratio_to_sdpa": None,
            "tokens_per_s_spread": result.get("tokens_per_s_spread") if ok else None,
            "windows": windows if ok else [], "runs": 1 if ok else 0, "ratio_base": row["ratio_base"],
            "docs_per_row": row["docs_per_row"], "status": result.get("status", "ok"), "reason": result.get("reason")}


def merge_step_row(rows: list[dict], new: dict, run: int = 1) -> None:
    """Adds `new` to train_step.json's rows. A configuration measured again (the base's further runs) pools its
    windows: tokens_per_s their mean, the spread half their range, peak_gib the larger; a failed further run leaves
    the row as it was, with a note. Otherwise the new row replaces an old one of the same key."""
    for i, old in enumerate(rows):
        if step_key(old) != step_key(new):
            continue
        if old.get("status") == "ok" and new["status"] == "ok":
            windows = old["windows"] + new["windows"]
            old.update(windows=windows, runs=old["runs"] + 1, tokens_per_s=sum(windows) / len(windows),
                       tokens_per_s_spread=(max(windows) - min(windows)) / 2,
                       peak_gib=max(old["peak_gib"], new["peak_gib"]))
        elif old.get("status") == "ok":
            old["reason"] = f"run {run}: {new['status']}: {new['reason']}"
        else:
            rows[i] = new
        return
    rows.append(new)


def add_ratios(rows: list[dict]) -> None:
    """ratio_to_sdpa: tokens/s over the base row's (attn == ratio_base) of the same model, shape, packing, linears
    and compilation; None where either did not run."""
    ok = {step_key(r): r for r in rows if r.get("status") == "ok"}
    for r in rows:
        key = step_key(r)
        base = ok.get(key[:4] + (r["ratio_base"],) + key[5:])
        r["ratio_to_sdpa"] = (r["tokens_per_s"] / base["tokens_per_s"]
                              if r.get("status") == "ok" and base and base["tokens_per_s"] else None)


def done(row: dict, rows: list[dict], retry_failed: bool) -> bool:
    old = next((r for r in rows if step_key(r) == step_key(row)), None)
    if old is None:
        return False
    if old["status"] == "ok":
        return old["runs"] >= row["run"] or (old.get("reason") or "").startswith(f"run {row['run']}:")
    return old["status"] != "failed" or not retry_failed


def _fmt(x, spec):
    return format(x, spec) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else "—"


def _target(ours: dict, base: dict) -> str:
    """The issue's targets: ratio >= 1.00 (>= 1.05 at N >= 8192) and peak memory <= the base's."""
    if ours.get("ratio_to_sdpa") is None or base is None:
        return "—"
    need = 1.05 if ours["seq_len"] >= 8192 else 1.0
    missed = ([f"ratio < {need:.2f}"] if ours["ratio_to_sdpa"] < need else []) + \
        (["memory"] if ours["peak_gib"] > base["peak_gib"] else [])
    return "missed: " + ", ".join(missed) if missed else "met"


def _cell(r: dict | None, spec=",.0f") -> str:
    if r is None:
        return "not run"
    if r["status"] != "ok":
        return r["status"]
    return f"{_fmt(r['tokens_per_s'], spec)} ± {_fmt(r['tokens_per_s_spread'], spec)}"


def step_md(step: dict) -> str:
    """train_step.md: the comparison table for results/current/README.md, then every row."""
    meta, rows = step["meta"], step["rows"]
    scope = {"layers": "each decoder layer", "model": "the model with its loss"}.get(meta.get("compile_scope"), "—")
    calls = "; ".join(f"`python benchmarks/train_throughput.py {' '.join(c['argv'])}` ({c['date']}, {c['rows']} rows)"
                      for c in meta.get("calls", []))
    lines = [f"# Training step: deltamatch_fp8 against its baseline ({meta['date']})", "",
             f"GPU {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, transformers "
             f"{meta.get('transformers')}, commit {meta['commit']}. Compiled rows: torch.compile of {scope}. "
             f"Calls: {calls}.", "",
             "tokens/s: mean ± half the range of the row's timed windows (each of `steps` optimizer steps, after "
             f"{meta.get('warmup')} warm-up steps); ratio: over the base row (sdpa; torch_varlen for gpt-oss, which "
             "transformers runs without sdpa) of the same model, shape, packing, linears and compilation. Target: "
             "the issue's (≥ 1.00×, ≥ 1.05× at N ≥ 8192, peak memory ≤ the base's), on the means.", "",
             "| model | N × batch | packed | linears | compiled | base | base tokens/s | deltamatch_fp8 tokens/s | "
             "ratio | peak GiB ours / base | target | others (ratio) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    groups: dict = {}
    for r in rows:
        groups.setdefault(step_key(r)[:4] + step_key(r)[5:], []).append(r)
    for (model, n, b, packed, linears, compiled), members in groups.items():
        by_attn = {r["attn"]: r for r in members}
        base_attn = members[0]["ratio_base"]
        base, ours = by_attn.get(base_attn), by_attn.get("deltamatch_fp8")
        others = [f"{a} {_fmt(r['ratio_to_sdpa'], '.3f')}×" if r["status"] == "ok" else f"{a} {r['status']}"
                  for a, r in by_attn.items() if a not in (base_attn, "deltamatch_fp8")]
        peaks = (f"{_fmt(ours and ours['peak_gib'], '.1f')} / {_fmt(base and base['peak_gib'], '.1f')}")
        ratio = _fmt(ours.get("ratio_to_sdpa"), ".3f") + "×" if ours and ours.get("ratio_to_sdpa") else "—"
        lines.append(f"| {model} | {n} × {b} | {'yes' if packed else 'no'} | {linears} | "
                     f"{'yes' if compiled else 'no'} | {base_attn} | {_cell(base)} | {_cell(ours)} | {ratio} | "
                     f"{peaks} | {_target(ours, base) if ours else '—'} | {', '.join(others) or '—'} |")
    lines += ["", "## Every row", "",
              "| model | N × batch | packed | attn | linears | compiled | tokens/s | windows | runs | peak GiB | "
              "ratio | status |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        status = r["status"] + (f": {r['reason']}" if r.get("reason") else "")
        lines.append(f"| {r['model']} | {r['seq_len']} × {r['batch']} | {'yes' if r['packed'] else 'no'} | "
                     f"{r['attn']} | {r['linears']} | {'yes' if r['compiled'] else 'no'} | {_cell(r)} | "
                     f"{len(r['windows'])} | {r['runs']} | {_fmt(r['peak_gib'], '.1f')} | "
                     f"{_fmt(r['ratio_to_sdpa'], '.3f')} | {status.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def report_md(report) -> str:
    env, meta = report["environment"], report["meta"]
    lines = [f"# Training throughput ({meta['date']})", "",
             f"GPU {env.get('gpu')}, torch {env.get('torch')}, triton {env.get('triton')}, transformers "
             f"{meta['transformers']}, fla {meta['fla']}, tilelang {meta['tilelang']}, torchao {meta['torchao']}, "
             f"commit {env.get('git_commit')}.", f"Command: `python benchmarks/train_throughput.py "
             f"{' '.join(meta['argv'])}`", "",
             "MFU: model FLOPs (6·P + causal attention + Gated DeltaNet, no credit for recomputation) over "
             f"{meta['peak_tflops']} TFLOP/s. tokens/s: the mean over the timed windows ± half their range. Shares: "
             "time inside the attention function / the gated delta rule / the Gated DeltaNet short convolution, "
             "forward (with recomputation) + backward, and in gradient clipping + the optimizer step, over step time "
             "(eager rows with the hooks on); the rest is the matmuls, norms, activations and loss.",
             "",
             "| setting | attn | linears | compiled | GDN | seq × batch × accum | ckpt | step ms | tokens/s | "
             "peak GiB | TFLOP/s | MFU | attention share | GDN share | short conv share | optimizer share |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        compiled = "yes" if r.get("compiled") else "no"
        if r.get("status") != "ok":
            lines.append(f"| {r['setting']} | {r['attn']} | {_variant(r)} | {compiled} | {r.get('status')}: "
                         f"{(r.get('reason') or '').replace('|', '/')} |" + " |" * 11)
            continue
        r = {k: r.get(k) for k in ("gdn_backend", "grad_accum", "gradient_checkpointing", "step_ms", "achieved_tflops",
                                   "mfu", "attention_share", "gdn_share", "short_conv_share", "optimizer_share")} | r
        spread = f" ± {_fmt(r.get('tokens_per_s_spread'), ',.0f')}" if (r.get("repeats") or 1) > 1 else ""
        lines.append(
            f"| {r['setting']} | {r['attn']} | {_variant(r)} | {compiled} | {r['gdn_backend']} | "
            f"{r['seq_len']} × {r['batch_size']} × {r['grad_accum']} | "
            f"{'yes' if r['gradient_checkpointing'] else 'no'} | {_fmt(r['step_ms'], '.0f')} | "
            f"{_fmt(r['tokens_per_s'], ',.0f')}{spread} | {_fmt(r['peak_memory_gib'], '.1f')}"
            f" | {_fmt(r['achieved_tflops'], '.1f')} | {_fmt(r['mfu'], '.1%')} | {_fmt(r['attention_share'], '.1%')} |"
            f" {_fmt(r['gdn_share'], '.1%')} | {_fmt(r['short_conv_share'], '.1%')} |"
            f" {_fmt(r['optimizer_share'], '.1%')} |")
    ok = [r for r in report["runs"] if r.get("status") == "ok" and r.get("flops_per_step")]
    if ok:
        r = ok[0]
        f = r["flops_per_step"]
        lines += ["", f"FLOPs per step of the first row: dense {f['dense']:.3g}, attention {f['attention']:.3g}, "
                  f"Gated DeltaNet {f['gdn']:.3g} (P = {r['params_matmul'] / 1e9:.3f} B of "
                  f"{r['params_total'] / 1e9:.3f} B parameters)."]
    profiled = [r for r in ok if r.get("profile")]
    if profiled:
        lines += ["", "## Where the step time goes (one profiled step after the timed ones)", "",
                  f"{profiled[0]['profile']['what']} by category (PROFILE_CATEGORIES: kernel names), ms per step and "
                  "the share of the step's wall time; idle: wall time without a kernel running (the host "
                  "behind, synchronizations).", ""]
        cats = []
        for r in profiled:
            cats += [c for c in r["profile"]["categories"] if c not in cats]
        lines += ["| setting | attn | linears | wall ms | " + " | ".join(cats) + " | idle |",
                  "|---|---|---|---|" + "---|" * (len(cats) + 1)]
        for r in profiled:
            p = r["profile"]
            cells = [f"{_fmt(p['categories'].get(c), '.0f')} ({_fmt(p['categories'].get(c, 0) / p['wall_ms'], '.0%')})"
                     for c in cats]
            idle = max(p["wall_ms"] - p["busy_ms"], 0.0)
            lines.append(f"| {r['setting']} | {r['attn']} | {_variant(r)} | {_fmt(p['wall_ms'], '.0f')} | "
                         + " | ".join(cells) + f" | {_fmt(idle, '.0f')} ({_fmt(idle / p['wall_ms'], '.0%')}) |")
        for r in profiled:
            lines += ["", f"Top kernels, {r['setting']} {r['attn']} {_variant(r)}:", "",
                      "| kernel | category | ms |", "|---|---|---|"]
            lines += [f"| `{k['name'][:100]}` | {k['category']} | {_fmt(k['ms'], '.1f')} |"
                      for k in r["profile"]["top"]]
            if r["profile"].get("by_owner"):
                lines += ["", f"By owner, {r['setting']} {r['attn']} {_variant(r)} (another profiled step, CPU ops "
                          "recorded: each ATen op's own kernels, to the innermost layer part around it, or to "
                          "the autograd node that ran it):", "", "| owner | category | ms |", "|---|---|---|"]
                lines += [f"| {k['owner']} | {k['category']} | {_fmt(k['ms'], '.1f')} |"
                          for k in r["profile"]["by_owner"]]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------------

DEFAULT_ATTNS = ["deltamatch_fp8", "sdpa", varlen_attention.NAME, "flash_attention_2"]
COMPILE = {"eager": False, "compiled": True}
# what a row of a kind is expected to need before any of its kind has run: a call does not start one it cannot finish
FIRST_ROW_S = {False: 90.0, True: 180.0}
MODE_DEFAULTS = {  # (legacy settings, suite): what a flag left unset means
    "warmup": (3, 2), "steps": (5, 2), "repeats": (1, 3), "timeout": (1800.0, 400.0), "shares": (True, False),
    "compile": ("eager", "eager,compiled"),
}


def _list(text: str | None) -> list[str] | None:
    return None if text is None else [x.strip() for x in text.split(",") if x.strip()]


def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", choices=sorted(SUITES),
                   help="a named row set (module docstring); writes --step-json; --attn, --compile, --match narrow it")
    p.add_argument("--settings", default=None,
                   help=f"{', '.join(MODELS)}, 8k, 64k, or recipe YAML paths, comma-separated (default 8k,64k)")
    p.add_argument("--shapes", default=None,
                   help="seq_len x batch pairs, e.g. 8192x1,4096x4 (default: a preset's suite shapes, a recipe's own)")
    p.add_argument("--attn", default=None,
                   help=f"attention implementations (default {','.join(DEFAULT_ATTNS)}; a suite's own); "
                        f"{varlen_attention.NAME}: FlashAttention-2 varlen through torch "
                        "(benchmarks/varlen_attention.py)")
    p.add_argument("--linears", default="bf16",
                   help=f"comma-separated, each a configuration: {', '.join(LINEARS)} (torchao float8; -compiled: "
                        "under torch.compile, the recipe's --compile_fp8_linear)")
    p.add_argument("--fp8-linear", action="store_true", help="shorthand for --linears bf16,fp8")
    p.add_argument("--norms", default="eager",
                   help=f"comma-separated, each a configuration: {', '.join(NORMS)} (fused: the recipe's "
                        "--fused_norms)")
    p.add_argument("--compile", default=None,
                   help="comma-separated, each a configuration: eager, compiled (default eager; a suite: both)")
    p.add_argument("--compile-scope", default="layers", choices=["layers", "model"],
                   help="compiled rows: torch.compile on each decoder layer, or on the model with its loss")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend (the CPU tests: aot_eager)")
    p.add_argument("--warmup", type=int, default=None, help="optimizer steps before timing (default 3; a suite 2)")
    p.add_argument("--steps", type=int, default=None,
                   help="optimizer steps per timed window (default 5; a suite 2, 1 for its hybrid rows)")
    p.add_argument("--repeats", type=int, default=None, help="timed windows per row (default 1; a suite 3)")
    p.add_argument("--baseline-runs", type=int, default=1,
                   help="run each base row (sdpa; torch_varlen for gpt-oss) this many times, in separate processes "
                        "after the group's other rows; train_step.json pools their windows")
    p.add_argument("--docs-per-row", type=int, default=1, help="documents per packed sequence (presets: > 1 packs)")
    p.add_argument("--loss-chunk", type=int, default=0, help="presets: cross-entropy over chunks of this many tokens")
    p.add_argument("--override", default=None, help="JSON merged into every preset's model config (tiny CPU runs)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="for MFU (default: 989.4 on H100/H200, none elsewhere)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per configuration (default 1800; a suite 400)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds for this call: no row starts that the rest would not cover (by the longest of its "
                        "kind so far); a row the budget cuts short is left for the next call")
    p.add_argument("--step-json", default=None,
                   help=f"the issue's JSON (default for a suite: {STEP_JSON.relative_to(ROOT)}); train_step.md and "
                        "-detail.json/.md next to it")
    p.add_argument("--append", action="store_true",
                   help="add to --step-json's rows (same GPU, torch, triton, commit, compile scope), running only "
                        "the rows it does not hold")
    p.add_argument("--retry-failed", action="store_true", help="with --append: run failed rows again")
    p.add_argument("--match", default=None, help="only rows whose label contains one of these, comma-separated")
    p.add_argument("--list", action="store_true", help="print the rows (and, with --append, which are done); run none")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"),
                   help="where a run without --step-json writes its train-throughput-<date>-<gpu> report")
    p.add_argument("--shares", action=argparse.BooleanOptionalAction, default=None,
                   help="time the attention / Gated DeltaNet / optimizer inside the timed steps (hooks; eager rows; "
                        "default on, a suite off)")
    p.add_argument("--profile", action="store_true",
                   help="after the timed steps, one step under torch.profiler: kernel time by category and the top "
                        "kernels (where the step time goes); then one more with CPU ops recorded: that time by the "
                        "layer part or backward node that ran it")
    p.add_argument("--single", help=argparse.SUPPRESS)  # internal: run one JSON spec, write the result there
    args = p.parse_args(argv)
    args.argv, args.extra = argv + (["--"] + extra if extra else []), extra
    suite = 1 if args.suite else 0
    for name, defaults in MODE_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, defaults[suite])
    if args.settings is None:
        args.settings = "" if args.suite else "8k,64k"
    elif args.suite:
        p.error("--suite and --settings: choose one")
    args.settings, args.attn, args.match = _list(args.settings), _list(args.attn), _list(args.match)
    args.linears = _list("bf16,fp8" if args.fp8_linear else args.linears)
    unknown = [x for x in args.linears if x not in LINEARS]
    if unknown or not args.linears:
        p.error(f"--linears {','.join(unknown) or '(empty)'}: choose from {', '.join(LINEARS)}")
    args.norms = _list(args.norms)
    unknown = [x for x in args.norms if x not in NORMS]
    if unknown or not args.norms:
        p.error(f"--norms {','.join(unknown) or '(empty)'}: choose from {', '.join(NORMS)}")
    modes = _list(args.compile)
    if not modes or any(m not in COMPILE for m in modes):
        p.error(f"--compile {args.compile}: comma-separated {', '.join(COMPILE)}")
    args.compile = [COMPILE[m] for m in modes]
    try:
        args.shapes = [tuple(int(v) for v in s.lower().split("x")) for s in _list(args.shapes)] if args.shapes else None
        assert all(len(s) == 2 and min(s) > 0 for s in args.shapes or [])
    except (ValueError, AssertionError):
        p.error(f"--shapes {args.shapes}: seq_len x batch pairs, e.g. 8192x1,4096x4")
    args.override = json.loads(args.override) if args.override else None
    if args.retry_failed and not args.append:
        p.error("--retry-failed goes with --append")
    return args


def _commit(env: dict, run) -> str:
    """The recorded commit, "+dirty" where the code this benchmark runs has uncommitted changes."""
    commit = env.get("git_commit") or "unknown"
    if not os.environ.get("GIT_COMMIT") and run(["git", "status", "--porcelain", "--", "hf_deltamatch",
                                                   "benchmarks/train_throughput.py",
                                                   "benchmarks/varlen_attention.py"]):
        commit += "+dirty"
    return commit


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def _compatible(old: dict, new: dict) -> str | None:
    """Why rows of `old` (a train_step.json's meta) and of this call cannot share one file, or None."""
    for key in ("gpu", "torch", "triton", "commit", "compile_scope"):
        if old.get(key) != new.get(key):
            return f"it holds a run with {key} {old.get(key)!r}, this call has {new.get(key)!r}"
    return None


def predicted_s(row: dict, runs: list[dict]) -> float:
    """Seconds a row is expected to take: the longest finished row of its model and compilation, with a margin,
    else FIRST_ROW_S."""
    same = [r["wall_s"] for r in runs if r.get("wall_s") and r.get("model") == row["model"]
            and bool(r.get("compiled")) == row["compiled"]]
    return 1.2 * max(same) if same else FIRST_ROW_S[row["compiled"]]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.single:
        spec = json.loads(Path(args.single).read_text())
        result = run_one(spec)
        Path(spec["result"]).write_text(json.dumps(result))
        return 0
    import attention as attention_bench  # benchmarks/attention.py: environment, slug, _sanitize

    rows = plan_rows(args)
    step_path = Path(args.step_json) if args.step_json else (STEP_JSON if args.suite else None)
    step = _load(step_path) if step_path and args.append and step_path.is_file() else None
    if args.list:
        held = step["rows"] if step else []
        for i, row in enumerate(rows, 1):
            print(f"{i:3d} {'done ' if done(row, held, args.retry_failed) else 'to do'} {row_label(row)}")
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device; for a CPU smoke test pass --device cpu and a small recipe config.",
              file=sys.stderr)
        return 2
    device = torch.device(args.device)
    # each configuration is a fresh process: without the on-disk cache flash-linear-attention autotunes again in each
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    now = datetime.datetime.now(datetime.timezone.utc)
    date = now.strftime("%Y-%m-%d %H:%M UTC")
    env = attention_bench.environment(device)
    peak = _peak_tflops(device, args.peak_tflops)
    versions = {name: attention_bench.package_version(name) for name in ("transformers", "fla", "tilelang", "torchao")}
    commit = _commit(env, attention_bench._run)
    call = {"date": date, "argv": args.argv, "commit": commit, "rows": 0}
    if step_path:
        meta = {"date": date, "gpu": env.get("gpu"), "torch": env.get("torch"), "triton": env.get("triton"),
                "commit": commit, "transformers": versions["transformers"],
                "suite": args.suite, "compile_scope": args.compile_scope, "warmup": args.warmup, "calls": []}
        if step is not None:
            why = _compatible(step["meta"], meta)
            if why:
                print(f"error: --append to {step_path}: {why}. Run without --append to start the file afresh, or "
                      "give another --step-json.", file=sys.stderr)
                return 2
        else:
            step = {"meta": meta, "rows": []}
        detail_path = step_path.with_name(step_path.stem + "-detail.json")
    else:
        out = Path(args.out)
        detail_path = out / f"train-throughput-{now.strftime('%Y-%m-%d-%H%M')}-{attention_bench.slug(env['gpu'])}.json"
    detail_path.parent.mkdir(parents=True, exist_ok=True)
    if step_path and args.append and detail_path.is_file():
        report = _load(detail_path)
    else:
        report = {"meta": {"date": date, "argv": args.argv, **versions, "peak_tflops": peak,
                           **({"step_json": step_path.name, "calls": []} if step_path else {})},
                  "environment": env, "runs": []}
    held = step["rows"] if step else []  # what train_step.json holds (without one, this call's rows)

    def write():
        detail_path.write_text(json.dumps(attention_bench._sanitize(report), indent=1))
        detail_path.with_suffix(".md").write_text(report_md(report))
        if step_path:
            add_ratios(step["rows"])
            step_path.write_text(json.dumps(attention_bench._sanitize(step), indent=1))
            step_path.with_suffix(".md").write_text(step_md(step))

    def record(row: dict, result: dict):
        report["runs"].append({**{k: row[k] for k in ("setting", "model", "attn", "linears", "norms", "compiled",
                                                      "docs_per_row", "packed", "run")},
                               "seq_len": row["seq_len"], "batch_size": row["batch"], **result})
        merge_step_row(held, step_row(row, result), row["run"])
        call["rows"] += 1
        if step_path and call not in step["meta"]["calls"]:  # a call that runs nothing is not recorded
            step["meta"]["calls"].append(call)
            report["meta"]["calls"].append(call)
        write()

    todo = [r for r in rows if not done(r, held, args.retry_failed)]
    start, left, failed = time.monotonic(), len(todo), False
    for i, row in enumerate(todo, 1):
        label = row_label(row)
        reason = skip_reason(row["attn"], row["linears"], device, row["setting"]) or oom_reason(row, held)
        if reason:
            record(row, {"status": "skipped", "reason": reason})
            left -= 1
            continue
        remaining = args.time_budget - (time.monotonic() - start) if args.time_budget else None
        need = predicted_s(row, report["runs"])
        if remaining is not None and remaining < need:
            print(f"[train_throughput] {remaining:.0f} s of --time-budget left, {label} may need {need:.0f} s: "
                  "stopping here", file=sys.stderr, flush=True)
            break
        timeout = args.timeout if remaining is None else min(args.timeout, remaining)
        print(f"[train_throughput] {i}/{len(todo)} {label}", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory() as tmp:
            spec = {**row, "device": args.device, "warmup": args.warmup, "steps": row["steps"] or args.steps,
                    "repeats": args.repeats, "extra": args.extra, "peak_tflops": peak, "profile": args.profile,
                    "shares": args.shares, "compile_scope": args.compile_scope,
                    "compile_backend": args.compile_backend, "override": args.override,
                    "loss_chunk": args.loss_chunk, "result": str(Path(tmp) / "result.json")}
            (Path(tmp) / "spec.json").write_text(json.dumps(spec))
            try:
                proc = subprocess.run([sys.executable, __file__, "--single", str(Path(tmp) / "spec.json")],
                                      capture_output=True, text=True, timeout=timeout)
            except subprocess.TimeoutExpired:
                if timeout < args.timeout:  # the call's budget, not the row's own limit: the next call runs it
                    print(f"[train_throughput] {label}: stopped at the end of --time-budget; left for the next call",
                          file=sys.stderr, flush=True)
                    break
                result = {"status": "failed", "reason": f"timeout {args.timeout:.0f} s"}
            else:
                if proc.returncode == 0:
                    result = json.loads(Path(spec["result"]).read_text())
                    result.setdefault("status", "ok")
                else:
                    text = (proc.stderr or proc.stdout).strip()
                    oom = re.search(r"OutOfMemoryError|out of memory", text, flags=re.IGNORECASE)
                    result = {"status": "oom" if oom else "failed",
                              "reason": " / ".join(text.splitlines()[-3:])[-1500:]}
                    if not oom:
                        print(proc.stderr[-4000:], file=sys.stderr)
        result["wall_s"] = time.monotonic() - t0
        failed |= result["status"] == "failed"
        print(f"[train_throughput]   {result['status']}"
              + (f", {result['tokens_per_s']:,.0f} tokens/s" if result["status"] == "ok" else
                 f" ({(result.get('reason') or '')[:400]})") + f", {result['wall_s']:.0f} s",
              file=sys.stderr, flush=True)
        record(row, result)
        left -= 1
    if call["rows"]:  # a call that ran nothing leaves the files as they are
        write()
    print(step_md(step) if step_path else report_md(report))
    print(f"wrote {detail_path} and .md" + (f", {step_path} and .md" if step_path else ""), file=sys.stderr)
    if step_path:
        print(f"{left} rows left" + (": run again with --append" if left else ""), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
