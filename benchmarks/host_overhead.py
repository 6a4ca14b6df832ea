#!/usr/bin/env python
"""Host (CPU) time of one kernels.forward / kernels.backward call, Triton kernels vs the Gluon ones, on the GPU.

  python benchmarks/host_overhead.py [--out DIR] [--profile] [--op]

A call's host time is what its launches cost the CPU; when it exceeds the kernels' GPU time the GPU waits (short
sequences, the forward). Measured on a small shape (B=1, H=2, N=1024, D=128, causal), where the GPU work is
tiny: the mean wall time of 200 calls issued back to back, synchronized once at the end. --profile adds the
top of a cProfile of 50 calls per path (where the host time goes). --op adds the whole op's forward + backward
(`deltamatch_attention` under autograd, as a model calls it) on the Gluon path, the host floors (an empty Triton
launch, a torch.empty, the autograd engine on an identity), its backward node called directly and through the
engine, and with --profile a cProfile of 50 op calls by self time and torch.profiler's CPU-side table.
"""

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from hf_deltamatch import deltamatch_attention  # noqa: E402
from hf_deltamatch import kernels as K  # noqa: E402
from hf_deltamatch.config import DeltaMatchConfig  # noqa: E402

PATHS = {"triton": dict(fwd_kernel="triton", dq_kernel="triton", dkdv_kernel="triton"),
         "gluon": dict(fwd_kernel="gluon", dq_kernel="gluon", dkdv_kernel="gluon")}


def host_ms(fn, n=200):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3 / n


@triton.jit
def _empty_kernel(X, Y, n, m, BLOCK: tl.constexpr):
    pass


def _profile(fn, calls, sort, lines):
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats(sort).print_stats(lines)
    return s.getvalue()


def op_section(q, k, v, do, res, text, profile):
    """The op as a model calls it (Gluon path), and the floors it sits on."""
    x = torch.empty(16, device="cuda")
    res["launch_floor_ms"] = host_ms(lambda: _empty_kernel[(1, )](x, x, 1, 2, BLOCK=16), n=1000)
    res["torch_empty_ms"] = host_ms(lambda: torch.empty((1, 2, 1024), device="cuda"), n=1000)
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

    def step():
        out = deltamatch_attention(qg, kg, vg, causal=True)
        torch.autograd.grad(out, (qg, kg, vg), do)

    def fwd():
        with torch.no_grad():
            deltamatch_attention(q, k, v, causal=True)

    def fwd_graph():  # the forward with grad (a graph built), dropped unused
        deltamatch_attention(qg, kg, vg, causal=True)

    class _Identity(torch.autograd.Function):  # the autograd engine's own floor, on CUDA tensors
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            return g

    def engine_floor():
        torch.autograd.grad(_Identity.apply(qg), (qg, ), do)

    pins = K.pinned(**PATHS["gluon"])
    pins.__enter__()
    res["op_fwd_bwd_ms"] = host_ms(step)
    res["op_fwd_nograd_ms"] = host_ms(fwd)
    res["op_fwd_grad_ms"] = host_ms(fwd_graph)
    res["engine_floor_ms"] = host_ms(engine_floor, n=1000)
    out = deltamatch_attention(qg, kg, vg, causal=True)
    node = out.grad_fn  # its backward called directly, without the engine (saved tensors kept)
    res["op_bwd_node_ms"] = host_ms(lambda: node.apply(do, *(None, ) * 7))
    res["op_bwd_engine_ms"] = host_ms(lambda: torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True))
    # the time kernels.backward itself takes inside those calls: on the engine's CUDA thread vs this one
    inner, real = [], K.backward

    def timed(*a, **kw):
        t = time.perf_counter()
        r = real(*a, **kw)
        inner.append(time.perf_counter() - t)
        return r

    K.backward = timed
    try:
        for name, fn in (("node", lambda: node.apply(do, *(None, ) * 7)),
                         ("engine", lambda: torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True))):
            inner.clear()
            host_ms(fn)
            res[f"kernels_backward_in_{name}_ms"] = sum(inner[1:]) / len(inner[1:]) * 1e3
    finally:
        K.backward = real
    text.append(f"floors: empty Triton launch {res['launch_floor_ms']:.3f} ms, torch.empty {res['torch_empty_ms']:.4f}"
                f" ms\nop (gluon) host ms per call: fwd+bwd (autograd) {res['op_fwd_bwd_ms']:.3f}, fwd no-grad "
                f"{res['op_fwd_nograd_ms']:.3f}, fwd with grad {res['op_fwd_grad_ms']:.3f}, the backward node called "
                f"directly {res['op_bwd_node_ms']:.3f}; autograd engine floor (identity fwd+bwd) "
                f"{res['engine_floor_ms']:.3f}; the backward alone through the engine (retained graph) "
                f"{res['op_bwd_engine_ms']:.3f}; kernels.backward inside it {res['kernels_backward_in_engine_ms']:.3f},"
                f" inside the direct node call {res['kernels_backward_in_node_ms']:.3f}")
    if profile:
        text.append("--- op fwd+bwd: cProfile of 50 calls, by self time\n" + _profile(step, 50, "tottime", 40))
        text.append("--- op fwd+bwd: cProfile of 50 calls, cumulative\n" + _profile(step, 50, "cumulative", 40))
        # the C++ side: CUDA runtime and driver calls (allocations, synchronizations, launches) by CPU time
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                step()
            torch.cuda.synchronize()
        text.append("--- op fwd+bwd: torch.profiler of 20 calls, by self CPU time\n"
                    + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=70))
    pins.__exit__(None, None, None)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--op", action="store_true")
    args = p.parse_args()
    B, H, N, D = 1, 2, 1024, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    kw = dict(causal=True, softmax_scale=D ** -0.5, window=None, cu_seqlens_q=None, cu_seqlens_k=None,
              config=DeltaMatchConfig())
    res, text = {}, []
    for name, tune in PATHS.items():
        pins = K.pinned(**tune)
        pins.__enter__()
        f = K.forward(q, k, v, **kw)
        fwd = lambda: K.forward(q, k, v, **kw)  # noqa: E731
        bwd = lambda: K.backward(do, q, k, v, f[0], f[1], *f[2:], **kw)  # noqa: E731
        res[name] = dict(fwd_ms=host_ms(fwd), bwd_ms=host_ms(bwd))
        text.append(f"{name:7s} host ms per call: forward {res[name]['fwd_ms']:.3f}  "
                    f"backward {res[name]['bwd_ms']:.3f}")
        if args.profile:
            for part, fn in (("forward", fwd), ("backward", bwd)):
                text.append(f"--- {name} {part}: cProfile of 50 calls\n" + _profile(fn, 50, "cumulative", 18))
        pins.__exit__(None, None, None)
    if args.op:
        res["op"] = {}
        op_section(q, k, v, do, res["op"], text, args.profile)
    print("\n".join(text))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "host-overhead.json"), "w") as fh:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, shape=[B, H, N, D],
                           results=res), fh, indent=1)


if __name__ == "__main__":
    main()
