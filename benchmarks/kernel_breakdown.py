#!/usr/bin/env python
"""Per-kernel time of hf_deltamatch.kernels (quantize, forward, correction pass, dQ, dK/dV) on the GPU,
with SDPA cuDNN BF16 timed in the same run as the base, and launch-config variants.

  python benchmarks/kernel_breakdown.py --out DIR [--shapes ...] [--variants ...] [--tag TAG]
  python benchmarks/kernel_breakdown.py --profile-once SHAPE     # under a profiler: benchmarks/ncu_profile.sh

Per-kernel device times come from torch.profiler (sum of each kernel's CUDA time per call); totals from
triton.testing.do_bench (median, L2 flushed). The correction pass is the dQ kernel's time with
delta="matching" minus with delta="stale" (the stale dQ kernel skips the first pass over the keys).
FLOPs: docs/baselines.md's convention (fwd 4*B*H*N^2*D, halved for causal; bwd 2.5x; fwd+bwd 3.5x).
"""

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from hf_deltamatch import kernels as K  # noqa: E402
from hf_deltamatch.config import DeltaMatchConfig  # noqa: E402
from hf_deltamatch.kernels import plan  # noqa: E402

SHAPES = {
    "d128-causal": (2, 16, 16, 8192, 128, True),
    "d128-full": (2, 16, 16, 8192, 128, False),
    "d64-causal": (2, 32, 32, 8192, 64, True),
    "d64-full": (2, 32, 32, 8192, 64, False),
    "gqa-causal": (2, 16, 4, 8192, 128, True),
    "d256-causal": (2, 8, 8, 8192, 256, True),
    # MLA (DeepSeek-V3, Kimi Linear): Dqk = 192, Dv = 128, given as (Dqk, Dv)
    "mla-causal": (2, 16, 16, 8192, (192, 128), True),
    # N not a multiple of 128: the Gluon kernels' padded path (the Triton kernels with --variants
    # "{'fwd_kernel': 'triton', 'dq_kernel': 'triton', 'dkdv_kernel': 'triton'}")
    "ragged-d128": (2, 16, 16, 8000, 128, True),
    # packed batches (varlen, B = 1, causal within each document): 32768 tokens, as four 8K training rows that
    # DataCollatorWithFlattening flattened into one, documents of PACKED_DOCS' seeded lengths
    "packed-d128": (1, 16, 16, 32768, 128, True),
    "packed-gqa": (1, 16, 4, 32768, 128, True),
    "packed-d64": (1, 32, 32, 32768, 64, True),
    # causal sliding windows (a 7th field, the window): variant shapes only (no SDPA baseline has a window; the
    # window presets of attention.py time Flex), e.g. --variant-shapes window128-d128 --variants
    # "{};{'fwd_kernel': 'triton', 'dq_kernel': 'triton', 'dkdv_kernel': 'triton'}": which kernel the small
    # window's time goes to, Gluon or Triton
    "window128-d128": (2, 16, 16, 8192, 128, True, 128),
    "window512-d128": (2, 16, 16, 8192, 128, True, 512),
    "window1024-d128": (2, 16, 16, 8192, 128, True, 1024),
    "window2048-d128": (2, 16, 16, 8192, 128, True, 2048),
    "window4096-d128": (2, 16, 16, 8192, 128, True, 4096),
}


def head_dims(D):
    """(Dqk, Dv) of a shape's head dim field: one int, or MLA's pair."""
    return tuple(D) if isinstance(D, tuple) else (D, D)


def shape_of(name):
    """(B, Hq, Hkv, N, D, causal, window) of SHAPES[name], window None for the unwindowed shapes."""
    B, Hq, Hkv, N, D, causal, *window = SHAPES[name]
    return B, Hq, Hkv, N, D, causal, (window[0] if window else None)


def packed_cu(total, seed=0):
    """cu_seqlens of documents filling `total` tokens: log-normal lengths (median ~900, a long tail, at most 8192,
    at least 16), the last one cut to fit; the same for a given seed everywhere."""
    g = torch.Generator().manual_seed(seed)
    lengths, n = [], 0
    while n < total:
        length = int(min(8192, max(16, torch.empty(1).log_normal_(6.8, 1.0, generator=g).item())))
        length = min(length, total - n)
        lengths.append(length)
        n += length
    return torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)


def _cu(name, N):
    return packed_cu(N).cuda() if name.startswith("packed") else None


def flops(B, H, N, D, causal, cu=None, window=None):
    """Attention FLOPs of the forward (2 per multiply-add of QK^T over Dqk and PV over Dv); a packed batch's are its
    documents' sum; a causal window of W keys shows W*N - W*(W-1)/2 query-key pairs (benchmarks/attention.py's
    count)."""
    if cu is not None:
        return sum(flops(B, H, int(n), D, causal) for n in (cu[1:] - cu[:-1]).tolist())
    dsum = sum(head_dims(D))
    if window is not None:
        w = min(window, N)
        return 2 * B * H * dsum * (w * N - w * (w - 1) / 2)
    f = 2 * B * H * N * N * dsum
    return f / 2 if causal else f


def bench(fn):
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def kernel_times(fn, iters=5):
    """{kernel name: ms per call} from the profiler."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out = {}
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t > 0:
            name = ev.key if len(ev.key) < 60 else ev.key[:57] + "..."
            out[name] = out.get(name, 0.0) + t / 1000.0 / iters
    return out


def profile_once(name):
    """One warm fwd+bwd of SHAPES[name] (fp8, matching) between cudaProfilerStart and Stop, for
    `ncu --profile-from-start off` (benchmarks/ncu_profile.sh)."""
    B, Hq, Hkv, N, D, causal, window = shape_of(name)
    dqk, dv = head_dims(D)
    q = torch.randn(B, Hq, N, dqk, device="cuda", dtype=torch.bfloat16)
    do = torch.randn(B, Hq, N, dv, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, Hkv, N, dqk, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, Hkv, N, dv, device="cuda", dtype=torch.bfloat16)
    cu = _cu(name, N)
    kw = dict(causal=causal, softmax_scale=dqk ** -0.5, window=window, cu_seqlens_q=cu, cu_seqlens_k=cu,
              config=DeltaMatchConfig())

    def step():
        f = K.forward(q, k, v, **kw)
        K.backward(do, q, k, v, f[0], f[1], *f[2:], **kw)

    step()  # compiles every kernel
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def run_shape(name, B, Hq, Hkv, N, D, causal, window=None, precision="fp8", delta="matching", fwd_only=False):
    cfg = DeltaMatchConfig(precision=precision, delta=delta)
    dqk, dv = head_dims(D)
    q = torch.randn(B, Hq, N, dqk, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, Hkv, N, dqk, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, Hkv, N, dv, device="cuda", dtype=torch.bfloat16)
    do = torch.randn(B, Hq, N, dv, device="cuda", dtype=torch.bfloat16)
    cu = _cu(name, N)
    kw = dict(causal=causal, softmax_scale=dqk ** -0.5, window=window, cu_seqlens_q=cu, cu_seqlens_k=cu, config=cfg)
    f = K.forward(q, k, v, **kw)
    fwd = lambda: K.forward(q, k, v, **kw)  # noqa: E731
    bwd = lambda: K.backward(do, q, k, v, f[0], f[1], *f[2:], **kw)  # noqa: E731
    t_fwd, t_bwd = bench(fwd), (float("nan") if fwd_only else bench(bwd))
    kf, kb = kernel_times(fwd), ({} if fwd_only else kernel_times(bwd))
    F = flops(B, Hq, N, D, causal, cu, window)
    return dict(name=name, precision=precision, delta=delta, fwd_ms=t_fwd, bwd_ms=t_bwd, total_ms=t_fwd + t_bwd,
                fwd_tflops=F / t_fwd / 1e9, total_tflops=3.5 * F / (t_fwd + t_bwd) / 1e9,
                fwd_kernels=kf, bwd_kernels=kb)


def varlen_flash(Hq, Hkv, N, D, cu):
    """torch.nn.attention.varlen.varlen_attn (FlashAttention-2) on a packed batch, causal: the base of the packed
    shapes (SDPA has no packed batches)."""
    from torch.nn.attention.varlen import varlen_attn
    q = torch.randn(N, Hq, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(N, Hkv, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(N, Hkv, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn(N, Hq, D, device="cuda", dtype=torch.bfloat16)
    longest = int((cu[1:] - cu[:-1]).max())
    try:  # torch >= 2.10: causal as a window
        varlen_attn(q, k, v, cu, cu, longest, longest, window_size=(-1, 0))
        f = lambda: varlen_attn(q, k, v, cu, cu, longest, longest, window_size=(-1, 0))  # noqa: E731
    except TypeError:
        f = lambda: varlen_attn(q, k, v, cu, cu, longest, longest, is_causal=True)  # noqa: E731
    return dict(fwd_ms=bench(f), total_ms=bench(lambda: torch.autograd.grad(f(), (q, k, v), do)))


def sdpa(B, Hq, Hkv, N, D, causal, backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    dqk, dv = head_dims(D)
    q = torch.randn(B, Hq, N, dqk, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, Hkv, N, dqk, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, Hkv, N, dv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn(B, Hq, N, dv, device="cuda", dtype=torch.bfloat16)
    be = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]
    gqa = Hq != Hkv
    with sdpa_kernel(be):
        f = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)  # noqa
        f()  # compile and warm up outside the timing
        t_fwd = bench(f)
        t_all = bench(lambda: torch.autograd.grad(f(), (q, k, v), do))
    return dict(fwd_ms=t_fwd, total_ms=t_all)


class _Lines(list):
    """The report's lines, also printed as they come (a run killed at its time limit still shows them)."""

    def append(self, line):
        print(line, flush=True)
        super().append(line)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--variants", default="", help="semicolon-separated dicts of plan pins and kernels.TUNE launch "
                   "shapes (hf_deltamatch.kernels.plan.variant) to try on --variant-shapes; "
                   "'SHAPE=DICT' tries DICT on SHAPE only")
    p.add_argument("--variant-shapes", default="d128-causal")
    p.add_argument("--variants-fwd-only", action="store_true", help="time only the forward of the variants")
    p.add_argument("--tag", default="", help="appended to the result files' names (e.g. the Triton version)")
    p.add_argument("--profile-once", metavar="SHAPE", help="one fwd+bwd of SHAPE for a profiler, nothing timed")
    args = p.parse_args()
    if args.profile_once:
        return profile_once(args.profile_once)
    rows, lines = [], _Lines()
    for name in filter(None, args.shapes.split(",")):  # --shapes "": the variants only
        B, Hq, Hkv, N, D, causal, window = shape_of(name)
        if window is not None:
            raise SystemExit(f"{name}: a window shape runs as --variant-shapes only (no SDPA baseline has a window; "
                             "benchmarks/attention.py's window presets time Flex)")
        base_name = "sdpa-cudnn"
        cu = _cu(name, N)
        try:
            if cu is not None:
                base_name = "varlen-flash2"
                base = varlen_flash(Hq, Hkv, N, D, cu)
            else:
                base = sdpa(B, Hq, Hkv, N, D, causal, "cudnn")
        except (RuntimeError, ImportError) as e:  # cuDNN may not take the head dim: FlashAttention-2 then
            lines.append(f"{name:12s} {base_name} failed ({str(e)[:80]}); base: sdpa-flash")
            base_name = "sdpa-flash"
            base = sdpa(B, Hq, Hkv, N, D, causal, "flash")
        F = flops(B, Hq, N, D, causal, cu)
        base["fwd_tflops"] = F / base["fwd_ms"] / 1e9
        base["total_tflops"] = 3.5 * F / base["total_ms"] / 1e9
        rows.append(dict(name=name, op=base_name, **base))
        lines.append(f"{name:12s} {base_name:18s}  fwd {base['fwd_ms']:7.3f} ({base['fwd_tflops']:4.0f})"
                     f"  fwd+bwd {base['total_ms']:7.3f} ({base['total_tflops']:4.0f})")
        modes = [("fp8", "matching"), ("fp8", "stale"), ("bf16", "matching")] if name == "d128-causal" else \
            [("fp8", "matching")]
        for prec, delta in modes:
            r = run_shape(name, B, Hq, Hkv, N, D, causal, precision=prec, delta=delta)
            r["op"] = f"dm-{prec}-{delta}"
            rows.append(r)
            lines.append(f"{name:12s} {r['op']:18s}  fwd {r['fwd_ms']:7.3f} ({r['fwd_tflops']:4.0f})  fwd+bwd "
                         f"{r['total_ms']:7.3f} ({r['total_tflops']:4.0f})  x{r['total_ms'] / base['total_ms']:.3f}"
                         f" of {base_name[5:]}  bwd {r['bwd_ms']:.3f}")
            ks = {**{"F:" + k_: v_ for k_, v_ in r["fwd_kernels"].items()},
                  **{"B:" + k_: v_ for k_, v_ in r["bwd_kernels"].items()}}
            lines.append("      " + "  ".join(f"{k_}={v_:.3f}" for k_, v_ in sorted(ks.items(), key=lambda x: -x[1])))
    todo = []  # (TUNE dict text, shape): "SHAPE=DICT" runs on SHAPE only, a bare DICT on every --variant-shapes
    for v_ in filter(None, args.variants.split(";")):
        shape_, _, dict_ = v_.partition("=") if "=" in v_.split("{")[0] else ("", "", v_)
        todo += [(dict_, s_) for s_ in (shape_.split(",") if shape_ else args.variant_shapes.split(","))]
    for var, vshape in todo:
        try:
            with plan.variant(eval(var)):  # noqa: S307  (our own command line)
                r = run_shape(vshape, *shape_of(vshape), fwd_only=args.variants_fwd_only)
            r["op"], r["tune"] = "dm-fp8-matching", var
            rows.append(r)
            kb = {k_[:14]: round(v_, 3) for k_, v_ in r["bwd_kernels"].items() if "_bwd" in k_}
            kf = {k_[:11]: round(v_, 3) for k_, v_ in r["fwd_kernels"].items() if "_fwd" in k_}
            lines.append(f"variant {vshape} {var}: fwd {r['fwd_ms']:.3f} bwd {r['bwd_ms']:.3f} {kf} {kb}")
        except Exception as e:  # a config that does not compile (smem) is a result too
            lines.append(f"variant {vshape} {var}: FAILED {type(e).__name__}: {str(e)[:120]}")
    now = datetime.datetime.now(datetime.timezone.utc)
    meta = dict(date=now.strftime("%Y-%m-%dT%H:%M:%SZ"),
                gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                python=platform.python_version())
    os.makedirs(args.out, exist_ok=True)
    stamp = now.strftime("%Y%m%d-%H%M") + (f"-{args.tag}" if args.tag else "")
    with open(os.path.join(args.out, f"kernel-breakdown-{stamp}.json"), "w") as fh:
        json.dump(dict(meta=meta, rows=rows), fh, indent=1)
    text = "\n".join([f"# kernel breakdown {meta}", "ms (TFLOP/s)", *lines])
    with open(os.path.join(args.out, f"kernel-breakdown-{stamp}.md"), "w") as fh:
        fh.write("```\n" + text + "\n```\n")


if __name__ == "__main__":
    main()
