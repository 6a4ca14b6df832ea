#!/usr/bin/env python
"""Attention benchmark: `deltamatch_attention` against PyTorch's BF16 attention kernels, in one run.

Times fwd, bwd and fwd+bwd of
  dm-fp8-matching  deltamatch_attention, precision="fp8",  delta="matching"  (the method)
  dm-fp8-stale     deltamatch_attention, precision="fp8",  delta="stale"     (FlashAttention's delta, ablation)
  dm-bf16          deltamatch_attention, precision="bf16", delta="matching"  (same kernels, no quantization)
  dm-fp8-sinks     dm-fp8-matching with learnable attention sinks (gpt-oss s_aux; not by default: --sinks)
  sdpa-flash       F.scaled_dot_product_attention under SDPBackend.FLASH_ATTENTION (FA2)
  sdpa-cudnn       F.scaled_dot_product_attention under SDPBackend.CUDNN_ATTENTION (the ratio base)
  flex             FlexAttention, torch.compile'd, block mask built once outside the timed region
and records peak memory and the relative error of out/dq/dk/dv against an fp32 reference for each.
Results go to <out>/attention-<date>-<gpu>.json and .md; the markdown is printed to stdout last.

  python benchmarks/attention.py                 # every preset (the baselines' shapes, D=64, GQA, N=65536, N=8000)
  python benchmarks/attention.py --quick         # one shape (N=8192 causal)
  python benchmarks/attention.py --shapes n8192c,gqa --ops dm-fp8-matching,sdpa-cudnn
  python benchmarks/attention.py --shapes gptoss --sinks   # the sinks row (gpt-oss-like GQA 8:1, D=64)
  python benchmarks/attention.py --dry-run       # CPU smoke test of the code path and writers, no timing claims
  python benchmarks/attention.py --quick --qk-transforms --ops dm-fp8-matching,sdpa-cudnn
                                                 # + the cost of qk_rotation / smooth_k vs dm-fp8-matching
  python benchmarks/attention.py --shapes window4096,window128 --ops dm-fp8-matching,flex \
      [--tune "{'fwd_kernel': 'triton', 'dq_kernel': 'triton', 'dkdv_kernel': 'triton'}"]
                                                 # sliding windows: the Gluon kernels, or (pinned) the Triton ones

Conventions (those of docs/baselines.md): FLOPs fwd = 4*B*Hq*N^2*D (halved for causal; with a sliding window of W keys
4*B*Hq*D times the (query, key) pairs it shows, W*N - W*(W-1)/2), bwd = 2.5x, fwd+bwd = 3.5x;
times are triton.testing.do_bench medians with the L2 flushed before each run.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import datetime
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python benchmarks/attention.py` puts benchmarks/, not the repo root, on the path
    sys.path.insert(0, str(ROOT))

# The benchmark chooses each op's precision and delta itself: these overrides would silently change what a
# column measures (deltamatch_attention applies them at every call), so they are dropped and reported.
_DROPPED_ENV = {var: os.environ.pop(var) for var in ("HF_DELTAMATCH_PRECISION", "HF_DELTAMATCH_DELTA",
                                                     "HF_DELTAMATCH_BACKEND", "HF_DELTAMATCH_QK_ROTATION",
                                                     "HF_DELTAMATCH_SMOOTH_K") if var in os.environ}

import torch  # noqa: E402  (after the environment clean-up above)

# ----------------------------------------------------------------------------------------------------
# Shapes
# ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    B: int
    Hq: int
    Hkv: int
    N: int
    D: int
    causal: bool
    window: int | None = None  # a causal sliding window: each query sees its `window` most recent keys
    Dv: int | None = None  # v's head dim where it differs from q's and k's (MLA: D=192, Dv=128)

    @property
    def dv(self) -> int:
        return self.D if self.Dv is None else self.Dv

    @property
    def label(self) -> str:
        heads = f"H{self.Hq}" if self.Hq == self.Hkv else f"H{self.Hq}/{self.Hkv}"
        window = f" window {self.window}" if self.window is not None else ""
        dims = f"D{self.D}" if self.Dv is None else f"D{self.D}/{self.Dv}"
        return f"B{self.B} {heads} N{self.N} {dims} {'causal' if self.causal else 'full'}{window}"


# docs/baselines.md's shapes: B*N = 16384 tokens, hidden 2048 -> Hq = 2048 / D. N = 65536 runs at B = 1 (as there).
PRESETS = {
    "n4096c": Shape("n4096c", 4, 16, 16, 4096, 128, True),
    "n8192c": Shape("n8192c", 2, 16, 16, 8192, 128, True),
    "n8192f": Shape("n8192f", 2, 16, 16, 8192, 128, False),
    "n16384c": Shape("n16384c", 1, 16, 16, 16384, 128, True),
    "d64": Shape("d64", 2, 32, 32, 8192, 64, True),
    "gqa": Shape("gqa", 2, 16, 4, 8192, 128, True),
    "n65536c": Shape("n65536c", 1, 16, 16, 65536, 128, True),
    "gptoss": Shape("gptoss", 2, 32, 4, 8192, 64, True),  # gpt-oss's head dim and 8:1 GQA (with --sinks)
    # N not a multiple of 128 (issue #32): the Gluon kernels' padded path; B*N = 16000
    "ragged": Shape("ragged", 2, 16, 16, 8000, 128, True),
    # sliding windows (issue #32): Mistral's 4096 and gpt-oss's 128 at 8K; the Gluon kernels, the Triton ones with
    # --tune pinning them (the module docstring)
    "window4096": Shape("window4096", 2, 16, 16, 8192, 128, True, 4096),
    "window128": Shape("window128", 2, 16, 16, 8192, 128, True, 128),
    # head dim 256 (Gemma 3, Qwen3-Next) and MLA's Dqk=192 / Dv=128 (DeepSeek-V3, Kimi Linear): the Gluon forward,
    # dQ and dK/dV (kernels.configs.GLUON_WIDE_DIMS; the Triton ones with --tune pinning them)
    "d256": Shape("d256", 2, 8, 8, 8192, 256, True),
    "mla": Shape("mla", 2, 16, 16, 8192, 192, True, Dv=128),
}
QUICK = ["n8192c"]
# Dry run (CPU, reference backend): GQA + causal, and full attention with a short last tile.
DRY_RUN_SHAPES = [Shape("tiny-gqa", 1, 4, 2, 192, 64, True), Shape("tiny-full", 1, 2, 2, 96, 32, False)]

# docs/baselines.md's fwd+bwd ms on the H200 for kernels this run cannot time (extra wheels). They are compared through
# the ratio to SDPA cuDNN measured in this run: est = this run's cuDNN * anchor / anchor cuDNN.
ANCHOR_FWDBWD_MS = {
    "n4096c": {"sdpa-cudnn": 2.098, "fa4": None, "cudnn-fp8": 1.750},
    "n8192c": {"sdpa-cudnn": 3.865, "fa4": 3.440, "cudnn-fp8": 2.968},
    "n8192f": {"sdpa-cudnn": 7.154, "fa4": 6.329, "cudnn-fp8": 5.457},
    "n16384c": {"sdpa-cudnn": 7.324, "fa4": 6.414, "cudnn-fp8": 5.546},
    "d64": {"sdpa-cudnn": 4.768, "fa4": 3.974, "cudnn-fp8": None},  # cuDNN 9.19: no FP8 bwd at D=64 on Hopper
}
ANCHOR_NAMES = {"fa4": "FA4 est.", "cudnn-fp8": "cuDNN FP8 est."}


def parse_shape(token: str) -> Shape:
    """A preset name, or a custom shape like `B2-H16-KV4-N8192-D128-causal` (KV defaults to H; `full`; `W4096`: a
    causal sliding window of 4096 keys; `DV128`: v's head dim where it differs from D)."""
    if token in PRESETS:
        return PRESETS[token]
    fields = {"causal": True}
    for part in token.split("-"):
        m = re.fullmatch(r"(B|H|KV|N|DV|D|W)(\d+)", part, flags=re.IGNORECASE)
        if m:
            fields[m.group(1).upper()] = int(m.group(2))
        elif part.lower() in ("causal", "full"):
            fields["causal"] = part.lower() == "causal"
        else:
            raise ValueError(f"cannot parse shape {token!r} (part {part!r}); use a preset "
                             f"({', '.join(PRESETS)}) or e.g. B2-H16-KV4-N8192-D128-causal")
    missing = [f for f in ("B", "H", "N", "D") if f not in fields]
    if missing:
        raise ValueError(f"shape {token!r} lacks {missing}; e.g. B2-H16-KV4-N8192-D128-causal")
    hkv = fields.get("KV", fields["H"])
    if fields["H"] % hkv:
        raise ValueError(f"shape {token!r}: H ({fields['H']}) must be a multiple of KV ({hkv})")
    if "W" in fields and not (fields["causal"] and fields["W"] >= 1):
        raise ValueError(f"shape {token!r}: a window (W) needs causal and W >= 1")
    return Shape(token, fields["B"], fields["H"], hkv, fields["N"], fields["D"], fields["causal"], fields.get("W"),
                 fields.get("DV"))


def attention_flops(shape: Shape) -> dict:
    """FlashAttention convention: fwd = 2*B*Hq*(D + Dv) per query-key pair shown (4*B*Hq*N^2*D at D = Dv, halved
    for causal), bwd = 2.5 fwd, fwd+bwd = 3.5 fwd; a sliding window of W keys shows W*N - W*(W-1)/2 pairs (W <= N)."""
    per_pair = 2.0 * shape.B * shape.Hq * (shape.D + shape.dv)
    if shape.window is not None:
        w = min(shape.window, shape.N)
        fwd = per_pair * (w * shape.N - w * (w - 1) / 2)
        return {"fwd": fwd, "bwd": 2.5 * fwd, "fwdbwd": 3.5 * fwd}
    fwd = per_pair * shape.N * shape.N * (0.5 if shape.causal else 1.0)
    return {"fwd": fwd, "bwd": 2.5 * fwd, "fwdbwd": 3.5 * fwd}


# ----------------------------------------------------------------------------------------------------
# Ops
# ----------------------------------------------------------------------------------------------------

DM_OPS = {  # name -> DeltaMatchConfig fields
    "dm-fp8-matching": {"precision": "fp8", "delta": "matching"},
    "dm-fp8-stale": {"precision": "fp8", "delta": "stale"},
    "dm-bf16": {"precision": "bf16", "delta": "matching"},
    "dm-fp8-sinks": {"precision": "fp8", "delta": "matching"},
}
SINK_OPS = ("dm-fp8-sinks",)  # with sinks (make_sinks), d sinks computed in every backward; run with --sinks
# The outlier pre-transforms (docs/numerics.md, "Outlier channels"), timed with --qk-transforms; their cost is
# reported against dm-fp8-matching in the same run (issue #29's target: <= 3 % of fwd+bwd at D=128, N=8192).
QK_TRANSFORM_OPS = {
    "dm-fp8-hadamard": {"precision": "fp8", "delta": "matching", "qk_rotation": "hadamard"},
    "dm-fp8-smooth-k": {"precision": "fp8", "delta": "matching", "smooth_k": True},
    "dm-fp8-hadamard-smooth-k": {"precision": "fp8", "delta": "matching", "qk_rotation": "hadamard",
                                 "smooth_k": True},
}
COST_BASE = "dm-fp8-matching"
CUDA_BASELINES = ["sdpa-flash", "sdpa-cudnn", "flex"]
DEFAULT_OPS = [*DM_OPS, *CUDA_BASELINES]
DM_OPS.update(QK_TRANSFORM_OPS)
ALL_OPS = [*DM_OPS, *CUDA_BASELINES]
DEFAULT_OPS = [o for o in ALL_OPS if o not in SINK_OPS]
DRY_RUN_BASE = "sdpa-math"  # CPU stand-in for the ratio base in --dry-run only
OP_TITLES = {"dm-fp8-matching": "dm fp8-matching", "dm-fp8-stale": "dm fp8-stale", "dm-bf16": "dm bf16",
             "dm-fp8-sinks": "dm fp8 + sinks",
             "sdpa-flash": "SDPA flash", "sdpa-cudnn": "SDPA cuDNN", "flex": "Flex", "sdpa-math": "SDPA math",
             "dm-fp8-hadamard": "dm fp8 +hadamard", "dm-fp8-smooth-k": "dm fp8 +smooth_k",
             "dm-fp8-hadamard-smooth-k": "dm fp8 +both"}
# Sanity bounds for the "check" column (not the test suite's tolerances): BF16 kernels land near 3e-3 against
# fp32 (docs/baselines.md), FP8 ones near 3-5 %; anything far beyond is a broken kernel, however fast.
ERR_BOUND = {"bf16": 2e-2, "fp8": 1.5e-1}


class Skip(Exception):
    """An op that does not apply here (recorded as skipped, not as a failure)."""


def _warning_text(caught) -> str:
    msgs = []
    for w in caught:
        text = str(w.message).strip().replace("\n", " ")
        if text and text not in msgs:
            msgs.append(text)
    return " | ".join(msgs)


def _call_collecting_warnings(fn):
    """Run fn; on failure re-raise with the warnings it emitted (SDPA explains 'No available kernel' in them)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            return fn()
        except Exception as exc:
            reasons = _warning_text(caught)
            if reasons:
                raise RuntimeError(f"{type(exc).__name__}: {exc} [warnings: {reasons}]") from exc
            raise


def fwd_bwd(fwd, q, k, v, do):
    out = fwd(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), do)
    return out, grads


def graphed(fn):
    """fn captured once into a CUDA graph, after two warm-up calls on a side stream (compiles, plan caches, the
    allocator's pool); returns the graph's replay, which runs fn's kernels without its host time (Python, launches)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


_FLEX = {}


def _compiled_flex():
    """torch.compile(flex_attention) once per process; shapes are static so each preset gets its own kernels."""
    if "fn" not in _FLEX:
        import torch._dynamo.config as dynamo_config
        from torch.nn.attention.flex_attention import flex_attention

        # One recompilation per shape: raise the limit so later presets do not fall back to eager flex.
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo_config, name):
                setattr(dynamo_config, name, max(64, getattr(dynamo_config, name)))
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX["fn"]


def make_sinks(shape: Shape, device, seed: int) -> torch.Tensor:
    """fp32 sinks (Hq,) of about log(N): each takes a share of a row comparable to the keys'; a leaf that
    requires grad, so every backward computes d sinks too (as in training)."""
    g = torch.Generator().manual_seed(seed + 1)
    sinks = math.log(shape.N) - 1.0 + 2.0 * torch.randn(shape.Hq, generator=g)
    return sinks.to(device).requires_grad_()


def build_op(name: str, shape: Shape, q, k, v, do, args):
    """Returns (fwd(q, k, v) -> out, info dict). Raises Skip when the op does not apply here."""
    device = q.device
    gqa = shape.Hq != shape.Hkv
    groups = shape.Hq // shape.Hkv
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if name in DM_OPS:
        from hf_deltamatch import DeltaMatchConfig, deltamatch_attention

        cfg = DeltaMatchConfig(backend=args.backend, **DM_OPS[name])
        if name in SINK_OPS and shape.window is not None:
            raise Skip("sinks with a sliding window: the reference (_with_sink_key) has no window")
        sinks = make_sinks(shape, device, args.seed) if name in SINK_OPS else None
        return (lambda q, k, v: deltamatch_attention(q, k, v, causal=shape.causal, window=shape.window, config=cfg,
                                                     sinks=sinks),
                {"config": dataclasses.asdict(cfg), **({"sinks": "fp32 (Hq,), d sinks in every backward"}
                                                      if sinks is not None else {})})
    if name == "sdpa-math":
        mask = window_mask(shape, device)

        def fwd(q, k, v):
            with sdpa_kernel(SDPBackend.MATH):
                return torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, is_causal=shape.causal and mask is None, enable_gqa=gqa)
        return fwd, {"gqa": "enable_gqa=True" if gqa else None}
    if device.type != "cuda":
        raise Skip("CUDA-only baseline; --dry-run runs on the CPU")
    if name in ("sdpa-flash", "sdpa-cudnn"):
        if shape.window is not None:
            raise Skip("no sliding window in SDPA's flash and cuDNN backends (Flex has one)")

        backend = SDPBackend.FLASH_ATTENTION if name == "sdpa-flash" else SDPBackend.CUDNN_ATTENTION

        def make(repeat_kv: bool):
            def fwd(q, k, v):
                with sdpa_kernel(backend):
                    if repeat_kv:  # inside the timed region: a model without native GQA pays for it too
                        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
                    return torch.nn.functional.scaled_dot_product_attention(
                        q, k, v, is_causal=shape.causal, enable_gqa=gqa and not repeat_kv)
            return fwd

        if not gqa:
            return make(False), {}
        # GQA: native enable_gqa=True when this backend has it, else KV heads repeated inside the timed region.
        fwd = make(False)
        try:
            _call_collecting_warnings(lambda: fwd_bwd(fwd, q, k, v, do))
            return fwd, {"gqa": "enable_gqa=True"}
        except Exception as exc:  # noqa: BLE001
            torch.cuda.empty_cache()
            return make(True), {"gqa": "repeat_interleave(KV) inside the timed region",
                                "enable_gqa_error": _one_line(exc)}
    if name == "flex":
        from torch.nn.attention.flex_attention import create_block_mask

        flex = _compiled_flex()
        block_mask = None
        if shape.window is not None:
            def window_mask_mod(b, h, q_idx, kv_idx):
                return (q_idx >= kv_idx) & (q_idx - kv_idx < shape.window)
            block_mask = create_block_mask(window_mask_mod, None, None, shape.N, shape.N, device=device)
        elif shape.causal:
            def causal_mask(b, h, q_idx, kv_idx):
                return q_idx >= kv_idx
            block_mask = create_block_mask(causal_mask, None, None, shape.N, shape.N, device=device)
        return (lambda q, k, v: flex(q, k, v, block_mask=block_mask, enable_gqa=gqa),
                {"gqa": "enable_gqa=True" if gqa else None, "compile": "torch.compile(dynamic=False)"})
    raise ValueError(f"unknown op {name!r}; choose from {ALL_OPS}")


# ----------------------------------------------------------------------------------------------------
# Reference and errors
# ----------------------------------------------------------------------------------------------------


def _with_sink_key(q, k, v, sinks, scale):
    """q, k, v (KV heads already repeated) with the sinks as one more key, exactly: a key at position 0 whose
    score is s_h for every query (q gets a coordinate 1, that key s_h / scale there, the others 0; 8 columns
    for alignment) and whose value is 0, and a dummy query at position 0 (so that with the top-left causal
    mask query i + 1 sees the sink and keys 0..i). Drop the first output row."""
    B, H, N, D = q.shape
    z = lambda *s: q.new_zeros(*s)  # noqa: E731
    q = torch.cat([z(B, H, 1, D + 8), torch.cat([q, q.new_ones(B, H, N, 1), z(B, H, N, 7)], -1)], 2)
    sink = torch.cat([z(H, D), (sinks.to(q.dtype) / scale)[:, None], z(H, 7)], -1)
    k = torch.cat([sink[None, :, None].expand(B, H, 1, D + 8), torch.cat([k, z(B, H, N, 8)], -1)], 2)
    v = torch.cat([z(B, H, 1, v.shape[-1]), v], 2)
    return q, k, v


def window_mask(shape: Shape, device):
    """The boolean (N, N) mask of the shape's sliding window (True: seen; query i sees keys i - window < j <= i), or
    None without one."""
    if shape.window is None:
        return None
    i = torch.arange(shape.N, device=device)
    return (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - shape.window)


def reference_fwd_bwd(shape: Shape, q, k, v, do, sinks=None):
    """out, (dq, dk, dv) of exact attention on the same (bf16-valued) inputs, and a description.

    CUDA: fp32 through SDPA's memory-efficient backend (fp32-capable, O(N) memory, so N = 65536 fits), KV heads
    repeated for GQA (autograd sums dk/dv over the group). Falls back to SDPA cuDNN then flash in BF16 if that
    fails. CPU: float64 through the math backend. With sinks: the same attention with the sinks as one more
    key (_with_sink_key). A sliding window: its boolean mask (window_mask), not with sinks.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    groups = shape.Hq // shape.Hkv
    mask = window_mask(shape, q.device)
    if mask is not None and sinks is not None:
        raise ValueError("the reference with sinks has no sliding window (_with_sink_key)")
    if q.device.type == "cuda":
        attempts = [(torch.float32, SDPBackend.EFFICIENT_ATTENTION, "fp32, SDPA mem-efficient backend"),
                    (torch.bfloat16, SDPBackend.CUDNN_ATTENTION, "BF16 SDPA cuDNN (fp32 reference failed)"),
                    (torch.bfloat16, SDPBackend.FLASH_ATTENTION, "BF16 SDPA flash (fp32 reference failed)")]
    else:
        attempts = [(torch.float64, SDPBackend.MATH, "float64, SDPA math backend")]
    failures = []
    for dtype, backend, label in attempts:
        try:
            qr, kr, vr = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))

            def fwd(qq, kk, vv):
                if groups > 1:
                    kk, vv = kk.repeat_interleave(groups, dim=1), vv.repeat_interleave(groups, dim=1)
                if sinks is not None:
                    scale = shape.D ** -0.5
                    with sdpa_kernel(backend):
                        return torch.nn.functional.scaled_dot_product_attention(
                            *_with_sink_key(qq, kk, vv, sinks.detach(), scale), is_causal=shape.causal,
                            scale=scale)[:, :, 1:]
                with sdpa_kernel(backend):
                    return torch.nn.functional.scaled_dot_product_attention(
                        qq, kk, vv, attn_mask=mask, is_causal=shape.causal and mask is None)

            out, grads = _call_collecting_warnings(lambda: fwd_bwd(fwd, qr, kr, vr, do.to(dtype)))
            return out.detach(), [g.detach() for g in grads], label, failures
        except Exception as exc:  # noqa: BLE001
            failures.append(f"{label}: {_one_line(exc)}")
            if q.device.type == "cuda":
                torch.cuda.empty_cache()
    raise RuntimeError("no reference could be computed: " + " ; ".join(failures))


# ----------------------------------------------------------------------------------------------------
# Timing and memory
# ----------------------------------------------------------------------------------------------------


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_ms(fn, device, args) -> float:
    """Median ms of fn. CUDA: triton.testing.do_bench (events, L2 flushed before every run, warm-up first).

    do_bench's `rep` is a duration, so a 200 ms op would get a single timed run: one event-timed call sizes
    rep to give at least --min-reps timed runs (and no more than needed at N = 65536).
    CPU (--dry-run only): wall-clock time of one call; exercises the code path, no performance claim.
    """
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    from triton.testing import do_bench

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    estimate = start.elapsed_time(end)
    rep = max(float(args.rep), args.min_reps * estimate)
    return float(do_bench(fn, warmup=args.warmup, rep=rep, return_mode="median"))


def _one_line(exc: BaseException, limit: int = 2000) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ").strip()
    return text if len(text) <= limit else text[:limit] + " ..."


def saved_for_backward(fn):
    """(fn(), MiB of the storages autograd saves for the backward of fn, the output's own storage excluded).

    What an attention op holds from its forward to its backward is its share of a model's activation memory;
    the output is excluded because the next layer (o_proj) keeps it anyway. Inputs the op saves count: without
    the op they could be freed after the forward (q/k/v come out of RoPE, whose backward does not need them).
    """
    storages = {}

    def pack(t):
        st = t.untyped_storage()
        storages[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    storages.pop(out.untyped_storage().data_ptr(), None)
    return out, sum(storages.values()) / 2**20


def measure_op(name, shape: Shape, q, k, v, do, ref, args, log) -> dict:
    """Everything about one op on one shape; every failure is caught and recorded in the result."""
    device = q.device
    res = {"op": name, "status": "ok"}
    stage = "build"
    try:
        fwd, info = build_op(name, shape, q, k, v, do, args)
        res.update(info)

        stage = "first call (compile / autotune)"
        t0 = time.perf_counter()
        _call_collecting_warnings(lambda: fwd_bwd(fwd, q, k, v, do))
        _sync(device)
        res["first_call_s"] = time.perf_counter() - t0
        if device.type == "cuda":
            fwd_bwd(fwd, q, k, v, do)  # a second warm-up call: lazy allocations, cuDNN plan caches
            _sync(device)

        stage = "memory and correctness"
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        out, res["saved_mib"] = saved_for_backward(lambda: fwd(q, k, v))
        _sync(device)
        if device.type == "cuda":  # out plus whatever autograd keeps for the backward
            res["after_fwd_mib"] = (torch.cuda.memory_allocated() - base) / 2**20
        grads = torch.autograd.grad(out, (q, k, v), do)
        _sync(device)
        if device.type == "cuda":
            res["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        if ref is not None:
            from hf_deltamatch.testing import rel_err  # ||x - ref|| / ||ref|| in float64, NaN for a non-finite x

            res["err"] = {key: rel_err(r, x) for key, x, r in zip(("out", "dq", "dk", "dv"), (out, *grads),
                                                                   (ref[0], *ref[1]))}
        del out, grads

        stage = "timing fwd"
        res["fwd_ms"] = time_ms(lambda: fwd(q, k, v), device, args)
        stage = "timing fwd+bwd"
        res["fwdbwd_ms"] = time_ms(lambda: fwd_bwd(fwd, q, k, v, do), device, args)
        if args.cuda_graph and device.type == "cuda":
            stage = "timing fwd+bwd from a CUDA graph"
            try:  # the host-free time: what a model replaying CUDA graphs (or torch.compile's reduce-overhead) pays
                res["graph_fwdbwd_ms"] = time_ms(graphed(lambda: fwd_bwd(fwd, q, k, v, do)), device, args)
            except Exception as exc:  # noqa: BLE001  (an op that cannot be captured is a result too)
                res["graph_error"] = _one_line(exc)
        stage = "timing bwd"
        try:  # backward alone: replay the backward of one retained graph
            out = fwd(q, k, v)
            res["bwd_ms"] = time_ms(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True),
                                    device, args)
            res["bwd_method"] = "retained graph"
        except Exception as exc:  # noqa: BLE001  (a backward that cannot be replayed: fall back to a difference)
            res["bwd_ms"] = res["fwdbwd_ms"] - res["fwd_ms"]
            res["bwd_method"] = "fwd+bwd minus fwd"
            res["bwd_retain_error"] = _one_line(exc)
        finally:
            out = None
    except Skip as exc:
        res.update(status="skipped", error=str(exc))
    except Exception as exc:  # noqa: BLE001  (a failing op must not kill the run)
        res.update(status="error", stage=stage, error=_one_line(exc),
                   traceback=traceback.format_exc(limit=8)[-4000:])
        log(f"    {name}: FAILED at {stage}: {_one_line(exc, 300)}")
    finally:
        if device.type == "cuda":
            try:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            except Exception as exc:  # noqa: BLE001  (a sticky CUDA error: later ops will fail and say so)
                res.setdefault("cuda_error_after", _one_line(exc))
    return res


def _cuda_alive() -> bool:
    """False after a sticky CUDA error (e.g. an illegal address in a kernel): every later call would fail."""
    try:
        torch.ones(1, device="cuda").add_(1).item()
        torch.cuda.synchronize()
        return True
    except Exception:  # noqa: BLE001
        return False


def run_shape(shape: Shape, ops, args, device, log) -> dict:
    flops = attention_flops(shape)
    entry = {"shape": dataclasses.asdict(shape), "label": shape.label, "flops": flops, "ops": {}}
    torch.manual_seed(args.seed)
    kw = {"device": device, "dtype": torch.bfloat16}
    q = torch.randn(shape.B, shape.Hq, shape.N, shape.D, **kw).requires_grad_()
    k = torch.randn(shape.B, shape.Hkv, shape.N, shape.D, **kw).requires_grad_()
    v = torch.randn(shape.B, shape.Hkv, shape.N, shape.dv, **kw).requires_grad_()
    do = torch.randn(shape.B, shape.Hq, shape.N, shape.dv, **kw)

    ref = None
    if not args.skip_correctness:
        t0 = time.perf_counter()
        try:
            out_ref, grads_ref, label, failures = reference_fwd_bwd(shape, q, k, v, do)
            ref = (out_ref, grads_ref)
            entry["reference"] = label
            if failures:
                entry["reference_failures"] = failures
        except Exception as exc:  # noqa: BLE001
            entry["reference"] = None
            entry["reference_error"] = _one_line(exc)
            log(f"    reference FAILED: {_one_line(exc, 300)}")
        log(f"    reference: {entry.get('reference')} ({time.perf_counter() - t0:.1f} s)")
    ref_sinks = None
    if not args.skip_correctness and any(o in SINK_OPS for o in ops):
        try:  # exact attention with the same sinks, for the sink ops' errors
            out_ref, grads_ref, label, _ = reference_fwd_bwd(shape, q, k, v, do, make_sinks(shape, device, args.seed))
            ref_sinks = (out_ref, grads_ref)
            entry["reference_sinks"] = label + ", sinks as one more key"
        except Exception as exc:  # noqa: BLE001
            entry["reference_sinks_error"] = _one_line(exc)
            log(f"    reference with sinks FAILED: {_one_line(exc, 300)}")

    # Baselines first: if one of our kernels breaks the CUDA context, the shape still has its baselines.
    for name in sorted(ops, key=lambda o: o in DM_OPS):
        t0 = time.perf_counter()
        if args.cuda_broken:
            entry["ops"][name] = {"op": name, "status": "error", "stage": "not run",
                                  "error": f"CUDA context broken earlier ({args.cuda_broken})"}
            continue
        res = measure_op(name, shape, q, k, v, do, ref_sinks if name in SINK_OPS else ref, args, log)
        if res["status"] == "error" and device.type == "cuda" and not _cuda_alive():
            args.cuda_broken = f"after {shape.name} {name}: {res['error'][:200]}"
            log(f"    CUDA context is broken (sticky error): nothing after {shape.name} {name} can run")
        for key in ("fwd", "bwd", "fwdbwd"):
            if res.get(f"{key}_ms"):
                res[f"{key}_tflops"] = flops[key] / (res[f"{key}_ms"] * 1e-3) / 1e12
        entry["ops"][name] = res
        if res["status"] == "ok":
            err = res.get("err")
            err_txt = "/".join(f"{e:.1e}" for e in err.values()) if err else "-"
            log(f"    {name:16s} fwd {res['fwd_ms']:.3f} bwd {res['bwd_ms']:.3f} fwd+bwd {res['fwdbwd_ms']:.3f} ms "
                f"({res.get('fwdbwd_tflops', 0):.0f} TFLOP/s)  err {err_txt}  [{time.perf_counter() - t0:.1f} s]")
        elif res["status"] == "skipped":
            log(f"    {name:16s} skipped: {res['error']}")

    entry["ops"] = {name: entry["ops"][name] for name in ops}  # back to the requested order
    base_name = args.ratio_base
    base = entry["ops"].get(base_name)
    entry["ratio_base"] = base_name
    for name, res in entry["ops"].items():
        check = _check(name, res)
        if check:
            res["check"] = check
        if base and base.get("status") == "ok" and res.get("status") == "ok":
            # > 1: faster than SDPA cuDNN BF16 measured in this run on the same inputs
            res["speedup_vs_base"] = {key: base[f"{key}_ms"] / res[f"{key}_ms"] for key in ("fwd", "bwd", "fwdbwd")}
        cost_base = entry["ops"].get(COST_BASE)
        if name in QK_TRANSFORM_OPS and cost_base and cost_base.get("status") == "ok" and res.get("status") == "ok":
            # the transforms' share: their op's time over dm-fp8-matching's, minus 1 (target <= 0.03 at fwd+bwd)
            res["cost_vs_fp8_matching"] = {key: res[f"{key}_ms"] / cost_base[f"{key}_ms"] - 1
                                           for key in ("fwd", "bwd", "fwdbwd")}
    anchors = ANCHOR_FWDBWD_MS.get(shape.name)
    if anchors and device.type == "cuda" and base and base.get("status") == "ok":
        entry["anchor_estimates_ms"] = {
            key: base["fwdbwd_ms"] * ms / anchors["sdpa-cudnn"] for key, ms in anchors.items()
            if key != "sdpa-cudnn" and ms is not None}
    del q, k, v, do, ref, ref_sinks
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return entry


def _check(name, res) -> str | None:
    if res.get("status") != "ok" or not res.get("err"):
        return None
    precision = DM_OPS.get(name, {}).get("precision", "bf16")
    worst = max(res["err"].values())
    if not math.isfinite(worst):
        return "FAIL (non-finite)"
    return "ok" if worst <= ERR_BOUND[precision] else f"FAIL (> {ERR_BOUND[precision]:g})"


# ----------------------------------------------------------------------------------------------------
# Environment
# ----------------------------------------------------------------------------------------------------


def _run(cmd) -> str | None:
    try:
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=20,
                              check=True).stdout.strip()
    except Exception:  # noqa: BLE001
        return None


def package_version(name: str) -> str:
    """`name`'s __version__, or "not installed" (for the reports' environment lines)."""
    try:
        return __import__(name).__version__
    except Exception:  # noqa: BLE001  (a broken optional install is reported, not fatal)
        return "not installed"


def environment(device) -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "host": platform.node()}
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception as exc:  # noqa: BLE001
        env["triton"] = f"unavailable ({_one_line(exc, 100)})"
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    env["cudnn"] = f"{cudnn // 10000}.{cudnn // 100 % 100}.{cudnn % 100}" if cudnn and cudnn >= 10000 else cudnn
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, sm_count=props.multi_processor_count, capability=f"{props.major}.{props.minor}",
                   gpu_memory_gib=round(props.total_memory / 2**30, 1))
        smi = _run(["nvidia-smi", "--query-gpu=driver_version,power.limit,clocks.max.sm",
                    "--format=csv,noheader"])
        if smi:
            env["nvidia_smi"] = smi.splitlines()[0]
    else:
        env["gpu"] = "cpu"
    # GIT_COMMIT first: a copied working tree (the device tool's) can carry a stale .git
    commit = os.environ.get("GIT_COMMIT") or _run(["git", "rev-parse", "HEAD"])
    env["git_commit"] = commit or "unknown (no git checkout)"
    if commit and not os.environ.get("GIT_COMMIT"):
        dirty = _run(["git", "status", "--porcelain", "--", "hf_deltamatch", "benchmarks/attention.py"])
        env["git_dirty"] = bool(dirty)
    try:
        import hf_deltamatch

        env["hf_deltamatch"] = hf_deltamatch.__version__
    except Exception as exc:  # noqa: BLE001
        env["hf_deltamatch"] = f"import failed: {_one_line(exc, 300)}"
    if _DROPPED_ENV:
        env["dropped_env_overrides"] = _DROPPED_ENV
    return env


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


# ----------------------------------------------------------------------------------------------------
# Writers
# ----------------------------------------------------------------------------------------------------


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _ms_tf(res, key) -> str:
    ms, tf = res.get(f"{key}_ms"), res.get(f"{key}_tflops")
    if not _finite(ms):
        return "—"
    if not _finite(tf):
        return f"{ms:.3f}"
    return f"{ms:.3f} ({tf:.0f})" if tf >= 10 else f"{ms:.3f} ({tf:.2g})"  # dry-run CPU numbers are tiny


def _status_cell(res) -> str:
    return "skipped" if res.get("status") == "skipped" else "failed"


def _sanitize(obj):
    """Strict JSON: NaN/inf become strings."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _sanitize(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_sanitize(v) for v in obj]
    return obj


def header_md(report) -> list[str]:
    env, meta = report["environment"], report["meta"]
    lines = [f"# Attention benchmark: hf_deltamatch vs PyTorch BF16 kernels ({meta['date']})", ""]
    if meta["dry_run"]:
        lines += [f"**DRY RUN** on the CPU: our op through backend={meta['backend']}, tiny shapes, wall-clock "
                  "timings of one call. It exercises the script; no number here is a performance claim.", ""]
    gpu = env.get("gpu")
    if env.get("sm_count"):
        gpu += f" ({env['sm_count']} SMs, sm_{env['capability'].replace('.', '')}, {env['gpu_memory_gib']} GiB)"
    lines.append(f"- GPU: {gpu}" + (f"; nvidia-smi driver, power limit, max SM clock: {env['nvidia_smi']}"
                                     if env.get("nvidia_smi") else ""))
    lines.append(f"- torch {env['torch']} (CUDA {env['cuda']}), triton {env['triton']}, cuDNN {env['cudnn']}, "
                 f"Python {env['python']}; hf_deltamatch {env.get('hf_deltamatch')}, commit "
                 f"{env['git_commit'][:12]}{' (uncommitted changes)' if env.get('git_dirty') else ''}")
    lines.append(f"- timing: {meta['timing']}")
    lines.append(f"- FLOPs: {meta['flops']}")
    lines.append(f"- ratios: {meta['ratio']}")
    lines.append(f"- ops: {meta['ops_doc']}")
    lines.append(f"- memory: {meta['memory']}")
    refs = sorted({s.get("reference") or "none" for s in report["shapes"] if s.get("status") != "skipped"})
    lines.append(f"- correctness: relative Frobenius error ‖x − ref‖/‖ref‖ of out/dq/dk/dv, ref = "
                 f"{', '.join(refs) or 'n/a'} on the same inputs; check = {meta['check']}")
    gqa = {res.get("gqa") for s in report["shapes"] for name, res in s.get("ops", {}).items()
           if name.startswith("sdpa") and res.get("gqa")}
    if gqa:
        lines.append(f"- GQA in SDPA baselines: {'; '.join(sorted(gqa))}")
    if env.get("dropped_env_overrides"):
        lines.append(f"- ignored environment overrides: {env['dropped_env_overrides']}")
    return lines + [""]


def summary_md(report) -> list[str]:
    """The summary table: one row per shape, fwd+bwd ms (TFLOP/s) per op; ours also × vs the base."""
    ops = report["meta"]["ops"]
    has_anchor = any(s.get("anchor_estimates_ms") for s in report["shapes"])
    anchor_cols = list(ANCHOR_NAMES) if has_anchor else []
    base = report["meta"]["ratio_base"]
    lines = [f"## fwd+bwd: ms (TFLOP/s), × = speed-up vs {OP_TITLES.get(base, base)} in this run",
             "",
             "| shape | " + " | ".join(OP_TITLES.get(o, o) for o in ops)
             + "".join(f" | {ANCHOR_NAMES[a]}" for a in anchor_cols) + " |",
             "|---" * (1 + len(ops) + len(anchor_cols)) + "|"]
    for s in report["shapes"]:
        if s.get("status") == "skipped":
            lines.append(f"| {s['name']}: {s['label']} | " + " | ".join(["skipped"] * (len(ops) + len(anchor_cols)))
                         + " |")
            continue
        cells = []
        for o in ops:
            res = s["ops"].get(o, {})
            if res.get("status") != "ok":
                cells.append(_status_cell(res))
                continue
            cell = _ms_tf(res, "fwdbwd")
            sp = res.get("speedup_vs_base", {}).get("fwdbwd")
            if o in DM_OPS and _finite(sp):
                cell += f" {sp:.2f}×"
            cost = res.get("cost_vs_fp8_matching", {}).get("fwdbwd")
            if _finite(cost):
                cell += f" ({100 * cost:+.1f} % vs {OP_TITLES[COST_BASE]})"
            if res.get("check", "ok") != "ok":
                cell += " **WRONG**"
            cells.append(cell)
        est = s.get("anchor_estimates_ms", {})
        flops = s["flops"]["fwdbwd"]
        for a in anchor_cols:
            ms = est.get(a)
            cells.append(f"{ms:.3f} ({flops / (ms * 1e-3) / 1e12:.0f})" if _finite(ms) else "—")
        lines.append(f"| {s['name']}: {s['label']} | " + " | ".join(cells) + " |")
    if anchor_cols:
        lines += ["", "FA4 est. / cuDNN FP8 est.: docs/baselines.md's times for kernels this run cannot load, scaled "
                      "by (this run's SDPA cuDNN / docs/baselines.md's SDPA cuDNN)."]
    return lines + [""]


def detail_md(report) -> list[str]:
    lines = ["## Per op: ms (TFLOP/s), speed-up vs the base (fwd/bwd/fwd+bwd), peak memory, errors", "",
             "| shape | op | fwd | bwd | fwd+bwd | × fwd/bwd/f+b | peak MiB | saved MiB | err out/dq/dk/dv | check |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for s in report["shapes"]:
        if s.get("status") == "skipped":
            lines.append(f"| {s['name']} | — | {s.get('reason', 'skipped')} | | | | | | | |")
            continue
        for o in report["meta"]["ops"]:
            res = s["ops"].get(o)
            if res is None:
                continue
            if res.get("status") == "skipped":
                lines.append(f"| {s['name']} | {o} | skipped: {res.get('error', '')[:80]} | | | | | | | |")
                continue
            if res.get("status") != "ok":
                lines.append(f"| {s['name']} | {o} | failed at {res.get('stage')} (see Failures) | | | | | | | |")
                continue
            sp = res.get("speedup_vs_base")
            sp_txt = "/".join(f"{sp[key]:.2f}" for key in ("fwd", "bwd", "fwdbwd")) if sp else "—"
            bwd = _ms_tf(res, "bwd") + ("†" if res.get("bwd_method") != "retained graph" else "")
            peak = f"{res['peak_mib']:.0f}" if _finite(res.get("peak_mib")) else "—"
            saved = f"{res['saved_mib']:.0f}" if _finite(res.get("saved_mib")) else "—"
            err = res.get("err")
            err_txt = "/".join(f"{e:.1e}" for e in err.values()) if err else "—"
            lines.append(f"| {s['name']} | {o} | {_ms_tf(res, 'fwd')} | {bwd} | {_ms_tf(res, 'fwdbwd')} | {sp_txt} "
                         f"| {peak} | {saved} | {err_txt} | {res.get('check', '—')} |")
    lines += ["", "bwd: backward alone, replayed on a retained graph; † = fwd+bwd minus fwd (the retained-graph "
                  "backward failed, see JSON)."]
    return lines + [""]


def graph_md(report) -> list[str]:
    """--cuda-graph: each op's fwd+bwd replayed from a CUDA graph beside its eager time, and the graphed time over
    the graphed base's (a baseline's that ran where the base did not: Flex on the window presets)."""
    rows = [(s, o, res) for s in report["shapes"] for o, res in s.get("ops", {}).items()
            if "graph_fwdbwd_ms" in res or "graph_error" in res]
    if not rows:
        return []
    base = report["meta"]["ratio_base"]
    lines = ["## fwd+bwd from a CUDA graph (no host time): ms, and over the graphed base in this run", "",
             "| shape | op | eager fwd+bwd | graphed fwd+bwd | graphed / graphed base |", "|---|---|---|---|---|"]
    for s, o, res in rows:
        if "graph_error" in res:
            lines.append(f"| {s['name']} | {o} | {res['fwdbwd_ms']:.3f} | "
                         f"capture failed: {res['graph_error'][:80]} | |")
            continue
        times = {o_: r["graph_fwdbwd_ms"] for s_, o_, r in rows if s_ is s and "graph_fwdbwd_ms" in r}
        ref = times.get(base) or next((t for o_, t in times.items() if o_ not in DM_OPS), None)
        ratio = f"{res['graph_fwdbwd_ms'] / ref:.2f}×" if ref else "—"
        lines.append(f"| {s['name']} | {o} | {res['fwdbwd_ms']:.3f} | {res['graph_fwdbwd_ms']:.3f} | {ratio} |")
    return lines + [""]


def failures_md(report) -> list[str]:
    lines = []
    for s in report["shapes"]:
        if s.get("reference_error"):
            lines.append(f"- {s['name']} reference: {s['reference_error'][:300]}")
        for o, res in s.get("ops", {}).items():
            if res.get("status") == "error":
                lines.append(f"- {s['name']} {o} (at {res.get('stage')}): {res.get('error', '')[:300]}")
            elif res.get("status") == "skipped" and not report["meta"]["dry_run"]:
                lines.append(f"- {s['name']} {o} skipped: {res.get('error', '')[:300]}")
    return (["## Failures", "", *lines, ""]) if lines else []


def write_outputs(report, json_path: Path, md_path: Path):
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(_sanitize(report), indent=1, allow_nan=False) + "\n")
    md = header_md(report) + summary_md(report) + graph_md(report) + detail_md(report) + failures_md(report)
    md_path.write_text("\n".join(md))


def stdout_md(report) -> str:
    """Header, details and failures first, the summary table last (the runner keeps the output's tail)."""
    return "\n".join(header_md(report) + detail_md(report) + failures_md(report) + graph_md(report)
                     + summary_md(report))


# ----------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Presets: " + ", ".join(f"{n} ({s.label})" for n, s in PRESETS.items()))
    p.add_argument("--shapes", help="comma-separated presets or custom shapes like B2-H16-KV4-N8192-D128-causal "
                                    "(default: every preset)")
    p.add_argument("--quick", action="store_true", help=f"one shape ({', '.join(QUICK)})")
    p.add_argument("--ops", help=f"comma-separated subset of {','.join(ALL_OPS)} (default: all but dm-fp8-sinks "
                                 f"and the {', '.join(QK_TRANSFORM_OPS)} of --qk-transforms; sdpa-cudnn is "
                                 "the ratio base, keep it for ratios)")
    p.add_argument("--qk-transforms", action="store_true",
                   help=f"also time {', '.join(QK_TRANSFORM_OPS)} (DeltaMatchConfig qk_rotation / smooth_k) and "
                        f"report their fwd+bwd cost against {COST_BASE} (added to the ops if missing)")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU smoke test: tiny shapes, reference backend, CUDA-only baselines skipped, no timing claims")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="output directory")
    p.add_argument("--backend", choices=["triton", "auto", "reference"],
                   help="DeltaMatchConfig.backend for our op (default: triton; reference with --dry-run, where "
                        "triton needs TRITON_INTERPRET=1)")
    p.add_argument("--warmup", type=float, default=25.0, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=float, default=100.0, help="do_bench repetition time, ms")
    p.add_argument("--min-reps", type=int, default=5,
                   help="at least this many timed runs per measurement (stretches rep for slow ops)")
    p.add_argument("--time-budget", type=float, default=0.0,
                   help="seconds; shapes not started by then are recorded as skipped (0 = no limit)")
    p.add_argument("--sinks", action="store_true",
                   help="add the dm-fp8-sinks op (learnable attention sinks, d sinks in every backward)")
    p.add_argument("--skip-correctness", action="store_true", help="no reference, no error columns")
    p.add_argument("--cuda-graph", action="store_true",
                   help="also time each op's fwd+bwd replayed from a CUDA graph (no host time; CUDA only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--list", action="store_true", help="list the presets and exit")
    p.add_argument("--tune", default="{}",
                   help="plan pins and kernels.TUNE launch shapes for the whole run "
                        "(hf_deltamatch.kernels.plan.variant), e.g. "
                        "\"{'fwd_kernel': 'triton', 'dq_kernel': 'triton', 'dkdv_kernel': 'triton'}\" (the Triton "
                        "kernels); recorded in the report")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list:
        for name, s in PRESETS.items():
            print(f"{name:10s} {s.label}{'  (--quick)' if name in QUICK else ''}")
        return 0
    started = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - started:7.1f} s] {msg}", file=sys.stderr, flush=True)

    if args.dry_run:
        device = torch.device("cpu")
        args.backend = args.backend or "reference"
        shapes = [parse_shape(t) for t in args.shapes.split(",")] if args.shapes else DRY_RUN_SHAPES
    else:
        if not torch.cuda.is_available():
            print("error: no CUDA device. This benchmark times GPU kernels; on a CPU machine run "
                  "`python benchmarks/attention.py --dry-run` (smoke test only).", file=sys.stderr)
            return 2
        device = torch.device("cuda")
        args.backend = args.backend or "triton"
        tokens = QUICK if args.quick else (args.shapes.split(",") if args.shapes else list(PRESETS))
        shapes = [parse_shape(t.strip()) for t in tokens if t.strip()]
    ops = [o.strip() for o in args.ops.split(",")] if args.ops else list(DEFAULT_OPS)
    if args.sinks and not any(o in SINK_OPS for o in ops):
        ops.insert(len([o for o in ops if o in DM_OPS]), SINK_OPS[0])
    if args.qk_transforms:
        ops += [o for o in (COST_BASE, *QK_TRANSFORM_OPS) if o not in ops]
    unknown = [o for o in ops if o not in ALL_OPS]
    if unknown:
        print(f"error: unknown op(s) {unknown}; choose from {ALL_OPS}", file=sys.stderr)
        return 2
    if args.dry_run and DRY_RUN_BASE not in ops:
        ops.append(DRY_RUN_BASE)
    args.ratio_base = DRY_RUN_BASE if args.dry_run else "sdpa-cudnn"
    tune = ast.literal_eval(args.tune)
    if tune:
        from hf_deltamatch.kernels import plan
        plan.variant(tune).__enter__()  # for the whole run (a fresh process)
    args.cuda_broken = None  # set once a sticky CUDA error makes every later measurement meaningless

    now = datetime.datetime.now(datetime.timezone.utc)
    env = environment(device)
    stamp = now.strftime("%Y-%m-%d-%H%M")  # minutes in the name: several runs a day must not overwrite each other
    out_dir = Path(args.out)
    json_path = out_dir / f"attention-{stamp}-{slug(env['gpu'])}.json"
    md_path = json_path.with_suffix(".md")
    report = {
        "meta": {
            "date": now.strftime("%Y-%m-%d %H:%M UTC"),
            "dry_run": args.dry_run,
            "ratio_base": args.ratio_base,
            "tune": tune,
            "backend": args.backend,
            "argv": sys.argv[1:] if argv is None else list(argv),
            "ops": ops,
            "ops_doc": "dm-* = hf_deltamatch.deltamatch_attention (backend=%s): fp8-matching, fp8-stale "
                       "(FlashAttention's delta = rowsum(dO*O)), bf16 (same algorithm, no quantization, matching "
                       "delta), fp8-sinks (fp8-matching with learnable sinks, errors against exact attention "
                       "with the same sinks), fp8 +hadamard/+smooth_k/+both (fp8-matching with "
                       "qk_rotation='hadamard' / smooth_k=True / both; in parentheses their fwd+bwd time over "
                       "fp8-matching's); SDPA "
                       "flash/cuDNN pinned with sdpa_kernel; Flex = torch.compile(flex_attention, dynamic=False) "
                       "with a causal block mask built outside timing" % args.backend,
            "timing": ("triton.testing.do_bench median, L2 flushed before every run (its default), warm-up %g ms, "
                       "rep %g ms stretched to >= %d timed runs; 2 untimed warm-up fwd+bwd calls first; fwd runs "
                       "with grad enabled (as in training); bwd = backward alone on a retained graph "
                       "(torch.autograd.grad(..., retain_graph=True)); bf16 inputs ~ N(0, 1)"
                       % (args.warmup, args.rep, args.min_reps)) if not args.dry_run else
                      "CPU wall-clock of one call (dry run: not a measurement)",
            "flops": "fwd = 4·B·Hq·N²·D (halved for causal), bwd = 2.5× fwd, fwd+bwd = 3.5× fwd (FlashAttention)",
            "ratio": "speed-up = base ms / op ms with base = %s measured in this run on the same inputs (> 1 = "
                     "faster)" % ("SDPA cuDNN BF16" if not args.dry_run else DRY_RUN_BASE),
            "memory": "peak = torch.cuda.max_memory_allocated() − memory_allocated() before one fwd+bwd (after "
                      "reset_peak_memory_stats), inputs excluded, out and grads included; saved = storages autograd "
                      "keeps from the forward for the backward (saved_tensors_hooks), inputs included, the output "
                      "excluded (the next layer keeps it anyway): the op's share of activation memory",
            "check": f"ok when every error ≤ {ERR_BOUND['bf16']:g} (bf16 ops) / {ERR_BOUND['fp8']:g} (fp8 ops): "
                     "a sanity bound against fast-but-wrong kernels, not the test tolerance",
        },
        "environment": env,
        "shapes": [],
    }
    log(f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, cuDNN {env['cudnn']}; "
        f"{len(shapes)} shape(s) x {len(ops)} op(s); writing {json_path}")

    for shape in shapes:
        elapsed = time.perf_counter() - started
        reason = None
        if args.cuda_broken:
            reason = f"skipped: CUDA context broken ({args.cuda_broken})"
        elif args.time_budget and elapsed > args.time_budget:
            reason = f"skipped: time budget of {args.time_budget:g} s used up ({elapsed:.0f} s)"
        if reason:
            report["shapes"].append({"name": shape.name, "label": shape.label, "status": "skipped",
                                     "reason": reason, "shape": dataclasses.asdict(shape)})
            log(f"{shape.name}: {reason}")
        else:
            log(f"{shape.name}: {shape.label}")
            try:
                entry = run_shape(shape, ops, args, device, log)
                entry.update(status="done")
            except Exception as exc:  # noqa: BLE001  (e.g. inputs that do not fit: record it, try the next shape)
                log(f"{shape.name}: FAILED: {_one_line(exc, 300)}")
                entry = {"label": shape.label, "shape": dataclasses.asdict(shape), "status": "skipped",
                         "reason": f"failed: {_one_line(exc, 300)}", "traceback": traceback.format_exc(limit=8)}
            entry.update(name=shape.name, seconds=time.perf_counter() - started - elapsed)
            report["shapes"].append(entry)
        write_outputs(report, json_path, md_path)  # after every shape: a killed run still leaves its results

    report["meta"]["total_seconds"] = time.perf_counter() - started
    write_outputs(report, json_path, md_path)
    log(f"wrote {json_path} and {md_path.name} ({report['meta']['total_seconds']:.0f} s)")
    sys.stderr.flush()
    print(stdout_md(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
