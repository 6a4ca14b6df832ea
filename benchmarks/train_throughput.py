#!/usr/bin/env python
"""End-to-end training throughput of a recipe's model: tokens/s, peak memory, MFU and the attention share.

Builds the model of a recipe config with hf_deltamatch.training (random init, as the recipe does), feeds it
random tokens in the recipe's packed layout (PackedCollator: one row of batch x seq_len tokens with
cu_seq_lens; no data needed), and runs W warm-up + S timed optimizer steps exactly as the recipe's loop does:
bf16 autocast over fp32 master weights, grad_accum micro-batches, clipping, AdamW, gradient checkpointing and
the chunked loss as the config sets them. Each configuration (setting x --attn x --linears x --norms) runs in a
fresh subprocess. Settings:
  8k   recipes/configs/hybrid-1p7b.yaml as is (8K tokens per sequence)
  64k  hybrid-1p7b's model with extend-64k.yaml's 64K settings (seq_len 65536, batch 1, RoPE base 1e6,
       gradient checkpointing, loss_chunk 8192)
  any recipe YAML path (e.g. recipes/configs/tiny-cpu.yaml)

MFU counts model FLOPs (recomputation under checkpointing earns nothing) against --peak-tflops (H100/H200 SXM
dense BF16: 989.4):
  6 * P per token, P = parameters that multiply activations (all but the input embedding; a tied head counts once)
  + softmax attention: 6 * L_attn * Hq * D * sum_docs(len^2) per step (causal: half of 4*Hq*D*len^2 forward
    per layer, backward twice the forward)
  + Gated DeltaNet (chunk C=64, key dim K, value dim V, HV value heads): per token and layer
    3 * 2 * HV * (3*C*K + 2*C*V + 3*K*V + C^2/3) (forward matmuls per chunk: K K^T, w = A (k beta e^g),
    q K^T: C^2 K each; u = A (v beta), (q K^T) v_new: C^2 V each; w S, K^T v_new, q S: C K V each; the
    triangular inverse C^3/3; backward twice the forward)
The attention share is measured with CUDA events (wall clock on CPU) around the attention function
(transformers' attention interface), including its recomputation under checkpointing, and in backward from
the gradient hook on its output to the gradient hook on its query; the same for the Gated DeltaNet core
(chunk_gated_delta_rule, FLA or torch). Which Gated DeltaNet backend ran is recorded.

  python benchmarks/train_throughput.py --out /tmp/tp                               # 8k and 64k, every attn
  python benchmarks/train_throughput.py --settings 64k --attn deltamatch_fp8 --linears bf16,fp8,fp8-compiled --out /tmp/tp
  python benchmarks/train_throughput.py --settings 64k --attn deltamatch_fp8,sdpa --norms eager,fused --out /tmp/tp
  python benchmarks/train_throughput.py --settings recipes/configs/tiny-cpu.yaml --device cpu --steps 2 \\
      --warmup 1 --attn deltamatch_fp8,sdpa --out /tmp/tp                          # CPU smoke test
Extra arguments after `--` go to the recipe's config parser (e.g. `-- --grad_accum 1 --batch_size 1`).
"""

from __future__ import annotations

import argparse
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
# what the 64K stage changes (its `model` is a checkpoint path, its data and schedule do not matter here)
EXTENSION_KEYS = ("seq_len", "batch_size", "grad_accum", "gradient_checkpointing", "loss_chunk", "rope_theta",
                  "max_position_embeddings")
GDN_CHUNK = 64
PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4}  # SXM dense BF16 tensor-core peak


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
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)
    return types.count("full_attention"), types.count("linear_attention")


def gdn_flops_per_token(config) -> float:
    """Forward + backward model FLOPs of one Gated DeltaNet layer's chunked delta rule per token."""
    c, k, v = GDN_CHUNK, config.linear_key_head_dim, config.linear_value_head_dim
    macs = 3 * c * k + 2 * c * v + 3 * k * v + c * c / 3
    return 3 * 2 * config.linear_num_value_heads * macs


def step_flops(config, n_params: int, doc_lens_per_row: list[list[int]], grad_accum: int) -> dict:
    tokens = sum(sum(r) for r in doc_lens_per_row)
    n_attn, n_gdn = layer_counts(config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dense = 6.0 * n_params * tokens
    attn = 6.0 * n_attn * config.num_attention_heads * head_dim * sum(n * n for r in doc_lens_per_row for n in r)
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


def run_one(spec: dict) -> dict:
    from hf_deltamatch.training.loop import _memory_gb
    from hf_deltamatch.training.modeling import CausalLMWithLoss, build_model, causal_lm, gdn_backend
    from hf_deltamatch.training.optim import build_optimizers

    device = torch.device(spec["device"])
    if spec["attn"] == varlen_attention.NAME:
        varlen_attention.register()
    cfg = recipe_config(spec["setting"], spec["attn"], spec["linears"], spec["extra"], spec["norms"])
    if device.type == "cpu" and cfg.cpu_threads > 0:
        torch.set_num_threads(cfg.cpu_threads)
    torch.manual_seed(cfg.seed)
    tokenizer = random_token_tokenizer(cfg.vocab_size)
    with torch.device(device):  # parameters created on the GPU: no 7 GB detour through host memory
        model = build_model(cfg, tokenizer)
    model.to(device)
    wrapped = CausalLMWithLoss(model, cfg.loss_chunk)
    optimizers = build_optimizers(wrapped, cfg)
    lm = causal_lm(model)
    if device.type == "cpu" and layer_counts(lm.config)[1] and gdn_backend() == "fla":
        raise SystemExit("transformers will call flash-linear-attention's Triton kernels, which need a CUDA GPU: "
                         "run on the GPU, or on CPU in an environment without flash-linear-attention.")
    batch, doc_lens = random_batch(cfg, len(tokenizer), spec["docs_per_row"], cfg.seed, device)
    n_params = matmul_params(lm)
    flops = step_flops(lm.config, n_params, doc_lens, cfg.grad_accum)
    attn_timer, gdn_timer, conv_timer, undo = instrument(lm, device)
    opt_timer = SpanTimer(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.mixed_precision == "bf16")

    def step():
        for _ in range(cfg.grad_accum):
            with autocast:
                loss, _ = wrapped(**batch)
            (loss / cfg.grad_accum).backward()
        start = opt_timer._mark() if opt_timer.enabled else None
        if cfg.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(wrapped.parameters(), cfg.clip_grad)
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        if start is not None:
            opt_timer.spans.append([start, opt_timer._mark()])
        return loss.detach()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    wrapped.train()
    losses = [float(step()) for _ in range(spec["warmup"])]
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    attn_ms = gdn_ms = conv_ms = opt_ms = 0.0
    step_ms = []
    for _ in range(spec["steps"]):
        for timer in (attn_timer, gdn_timer, conv_timer, opt_timer):
            if timer is not None:
                timer.enabled = True
        sync()
        t0 = time.perf_counter()
        loss = step()
        sync()
        step_ms.append((time.perf_counter() - t0) * 1e3)
        losses.append(float(loss))
        attn_ms += attn_timer.take_ms()
        gdn_ms += gdn_timer.take_ms() if gdn_timer is not None else 0.0
        conv_ms += conv_timer.take_ms() if conv_timer is not None else 0.0
        opt_ms += opt_timer.take_ms()
    for timer in (attn_timer, gdn_timer, conv_timer, opt_timer):
        if timer is not None:
            timer.enabled = False
    profile = profile_step(step, sync, device) if spec.get("profile") else None
    if profile is not None:
        profile["by_owner"] = attribute_step(step, sync, device, lm)
    undo()
    total_ms = sum(step_ms)
    tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum
    peak = spec.get("peak_tflops")
    achieved = flops["total"] * spec["steps"] / (total_ms / 1e3) / 1e12
    n_attn, n_gdn = layer_counts(lm.config)
    return {
        "setting": spec["setting"], "attn": spec["attn"], "linears": spec["linears"], "norms": spec["norms"],
        "attn_implementation": lm.config._attn_implementation,
        "gdn_backend": gdn_backend() if n_gdn else None,
        "precision": cfg.precision if cfg.attn == "deltamatch_fp8" else None,
        "delta": cfg.delta if cfg.attn == "deltamatch_fp8" else None,
        "seq_len": cfg.seq_len, "batch_size": cfg.batch_size, "grad_accum": cfg.grad_accum,
        "docs_per_row": spec["docs_per_row"], "gradient_checkpointing": cfg.gradient_checkpointing,
        "loss_chunk": cfg.loss_chunk, "mixed_precision": cfg.mixed_precision,
        "layers": {"attention": n_attn, "gated_deltanet": n_gdn},
        "params_total": sum(p.numel() for p in {id(p): p for p in lm.parameters()}.values()),
        "params_matmul": n_params,
        "tokens_per_step": tokens_per_step, "warmup": spec["warmup"], "steps": spec["steps"],
        "step_ms": total_ms / spec["steps"], "step_ms_all": step_ms,
        "tokens_per_s": tokens_per_step * spec["steps"] / (total_ms / 1e3),
        "peak_memory_gib": _memory_gb(device),
        "peak_memory_kind": "torch.cuda.max_memory_allocated" if device.type == "cuda" else "process max RSS",
        "flops_per_step": flops, "achieved_tflops": achieved,
        "mfu": achieved / peak if peak else None, "peak_tflops": peak,
        "attention_share": attn_ms / total_ms, "gdn_share": gdn_ms / total_ms if gdn_timer is not None else None,
        "short_conv_share": conv_ms / total_ms if conv_timer is not None else None,
        "optimizer_share": opt_ms / total_ms,
        "attention_calls": attn_timer.calls, "losses": losses, "profile": profile,
    }


# ----------------------------------------------------------------------------------------------------
# Driver
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


def skip_reason(attn: str, linears: str, device) -> str | None:
    if attn == varlen_attention.NAME and device.type != "cuda":
        return f"{attn} (FlashAttention-2 through torch) needs a CUDA GPU"
    if attn == varlen_attention.NAME and importlib.util.find_spec("torch.nn.attention.varlen") is None:
        return f"{attn} needs torch.nn.attention.varlen (torch >= 2.10)"
    if attn == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        return "flash_attention_2 needs the flash-attn package, which is not installed"
    if attn == "flash_attention_2" and device.type != "cuda":
        return "flash_attention_2 needs a CUDA GPU"
    if linears != "bf16" and importlib.util.find_spec("torchao") is None:
        return f"--linears {linears} needs torchao, which is not installed"
    return None


def _fmt(x, spec):
    return format(x, spec) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else "—"


def report_md(report) -> str:
    env, meta = report["environment"], report["meta"]
    lines = [f"# Training throughput ({meta['date']})", "",
             f"GPU {env.get('gpu')}, torch {env.get('torch')}, triton {env.get('triton')}, transformers "
             f"{meta['transformers']}, fla {meta['fla']}, tilelang {meta['tilelang']}, torchao {meta['torchao']}, "
             f"commit {env.get('git_commit')}.", f"Command: `python benchmarks/train_throughput.py "
             f"{' '.join(meta['argv'])}`", "",
             "MFU: model FLOPs (6·P + causal attention + Gated DeltaNet, no credit for recomputation) over "
             f"{meta['peak_tflops']} TFLOP/s. Shares: time inside the attention function / the gated delta rule / "
             "the Gated DeltaNet short convolution, forward (with recomputation) + backward, and in gradient "
             "clipping + the optimizer step, over step time; the rest is the matmuls, norms, activations and loss.",
             "",
             "| setting | attn | linears | GDN | seq × batch × accum | ckpt | step ms | tokens/s | peak GiB | "
             "TFLOP/s | MFU | attention share | GDN share | short conv share | optimizer share |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        if r.get("status") != "ok":
            lines.append(f"| {r['setting']} | {r['attn']} | {_variant(r)} | {r.get('status')}: "
                         f"{r.get('reason', '')} |" + " |" * 11)
            continue
        lines.append(
            f"| {r['setting']} | {r['attn']} | {_variant(r)} | {r['gdn_backend']} | "
            f"{r['seq_len']} × {r['batch_size']} × {r['grad_accum']} | "
            f"{'yes' if r['gradient_checkpointing'] else 'no'} | {_fmt(r['step_ms'], '.0f')} | {_fmt(r['tokens_per_s'], ',.0f')} | {_fmt(r['peak_memory_gib'], '.1f')}"
            f" | {_fmt(r['achieved_tflops'], '.1f')} | {_fmt(r['mfu'], '.1%')} | {_fmt(r['attention_share'], '.1%')} |"
            f" {_fmt(r['gdn_share'], '.1%')} | {_fmt(r.get('short_conv_share'), '.1%')} |"
            f" {_fmt(r.get('optimizer_share'), '.1%')} |")
    ok = [r for r in report["runs"] if r.get("status") == "ok"]
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


def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--settings", default="8k,64k", help="8k, 64k, or recipe YAML paths, comma-separated")
    p.add_argument("--attn", default=f"deltamatch_fp8,sdpa,{varlen_attention.NAME},flash_attention_2",
                   help=f"attention implementations; {varlen_attention.NAME}: FlashAttention-2 varlen through torch "
                        "(benchmarks/varlen_attention.py), the packed rows' fair baseline")
    p.add_argument("--linears", default="bf16",
                   help=f"comma-separated, each a configuration: {', '.join(LINEARS)} (torchao float8; -compiled: "
                        "under torch.compile, the recipe's --compile_fp8_linear)")
    p.add_argument("--fp8-linear", action="store_true", help="shorthand for --linears bf16,fp8")
    p.add_argument("--norms", default="eager",
                   help=f"comma-separated, each a configuration: {', '.join(NORMS)} (fused: the recipe's --fused_norms)")
    p.add_argument("--warmup", type=int, default=3, help="optimizer steps before timing")
    p.add_argument("--steps", type=int, default=5, help="timed optimizer steps")
    p.add_argument("--docs-per-row", type=int, default=1, help="equal documents per packed sequence")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="for MFU (default: 989.4 on H100/H200, none elsewhere)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per configuration")
    p.add_argument("--profile", action="store_true",
                   help="after the timed steps, one step under torch.profiler: kernel time by category and the top "
                        "kernels (where the step time goes); then one more with CPU ops recorded: that time by the "
                        "layer part or backward node that ran it")
    p.add_argument("--single", help=argparse.SUPPRESS)  # internal: run one JSON spec, write the result there
    args = p.parse_args(argv)
    args.extra = extra
    args.linears = [x.strip() for x in ("bf16,fp8" if args.fp8_linear else args.linears).split(",") if x.strip()]
    unknown = [x for x in args.linears if x not in LINEARS]
    if unknown or not args.linears:
        p.error(f"--linears {','.join(unknown) or '(empty)'}: choose from {', '.join(LINEARS)}")
    args.norms = [x.strip() for x in args.norms.split(",") if x.strip()]
    unknown = [x for x in args.norms if x not in NORMS]
    if unknown or not args.norms:
        p.error(f"--norms {','.join(unknown) or '(empty)'}: choose from {', '.join(NORMS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.single:
        spec = json.loads(Path(args.single).read_text())
        result = run_one(spec)
        Path(spec["result"]).write_text(json.dumps(result))
        return 0
    import attention as attention_bench  # benchmarks/attention.py: environment, slug, _sanitize

    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device; for a CPU smoke test pass --device cpu and a small recipe config.",
              file=sys.stderr)
        return 2
    device = torch.device(args.device)
    # each configuration is a fresh process: without the on-disk cache flash-linear-attention autotunes again in each
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    now = datetime.datetime.now(datetime.timezone.utc)
    env = attention_bench.environment(device)
    peak = _peak_tflops(device, args.peak_tflops)
    report = {"meta": {"date": now.strftime("%Y-%m-%d %H:%M UTC"), "argv": sys.argv[1:] if argv is None else argv,
                       **{name: attention_bench.package_version(name)
                          for name in ("transformers", "fla", "tilelang", "torchao")}, "peak_tflops": peak},
              "environment": env, "runs": []}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"train-throughput-{now.strftime('%Y-%m-%d-%H%M')}-{attention_bench.slug(env['gpu'])}"

    def write():
        stem.with_suffix(".json").write_text(json.dumps(attention_bench._sanitize(report), indent=1))
        stem.with_suffix(".md").write_text(report_md(report))

    for setting in [s.strip() for s in args.settings.split(",") if s.strip()]:
        for attn in [a.strip() for a in args.attn.split(",") if a.strip()]:
            for linears, norms in itertools.product(args.linears, args.norms):
                row = {"setting": setting, "attn": attn, "linears": linears, "norms": norms}
                reason = skip_reason(attn, linears, device)
                if reason:
                    report["runs"].append({**row, "status": "skipped", "reason": reason})
                    write()
                    continue
                print(f"[train_throughput] {setting} {attn} linears={linears} norms={norms}", file=sys.stderr,
                      flush=True)
                with tempfile.TemporaryDirectory() as tmp:
                    spec = {**row, "device": args.device, "warmup": args.warmup, "steps": args.steps,
                            "docs_per_row": args.docs_per_row, "extra": args.extra, "peak_tflops": peak,
                            "profile": args.profile,
                            "result": str(Path(tmp) / "result.json")}
                    (Path(tmp) / "spec.json").write_text(json.dumps(spec))
                    try:
                        proc = subprocess.run([sys.executable, __file__, "--single", str(Path(tmp) / "spec.json")],
                                              capture_output=True, text=True, timeout=args.timeout)
                        if proc.returncode == 0:
                            report["runs"].append({**json.loads(Path(spec["result"]).read_text()), "status": "ok"})
                        else:
                            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
                            report["runs"].append({**row, "status": "failed", "reason": " / ".join(tail)[-1500:]})
                            print(proc.stderr[-4000:], file=sys.stderr)
                    except subprocess.TimeoutExpired:
                        report["runs"].append({**row, "status": "failed", "reason": f"timeout {args.timeout} s"})
                write()
    print(report_md(report))
    print(f"wrote {stem}.json and .md", file=sys.stderr)
    return 0 if all(r["status"] != "failed" for r in report["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
