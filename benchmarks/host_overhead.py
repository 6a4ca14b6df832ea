#!/usr/bin/env python
"""Host (CPU) time of one kernels.forward / kernels.backward call, Triton kernels vs the Gluon ones, on the GPU.

  python benchmarks/host_overhead.py [--out DIR] [--profile] [--op]
  python benchmarks/host_overhead.py --cpu [--tree DIR ...] [--rounds 5]   # any machine: the package's own share

A call's host time is what its launches cost the CPU; when it exceeds the kernels' GPU time the GPU waits (short
sequences, the forward). Measured on a small shape (B=1, H=2, N=1024, D=128, causal), where the GPU work is
tiny: the mean wall time of 200 calls issued back to back, synchronized once at the end. --profile adds the
top of a cProfile of 50 calls per path (where the host time goes). --op adds the whole op's forward + backward
(`deltamatch_attention` under autograd, as a model calls it) on the Gluon path, its host time at training shapes
(issue #45's B2 H16 N8192 D128 causal, GQA, a 128-token window, a packed row, sinks: OP_CASES), the host floors
(an empty Triton launch, a torch.empty, the autograd engine on an identity), its backward node called directly
and through the engine, and with --profile a cProfile of 50 op calls by self time and torch.profiler's CPU-side table.

--cpu times, on any machine, the package's own host work per kernels.forward + kernels.backward call: every kernel
launch is caught before it reaches Triton (benchmarks/launch_trace.py's recorder, with the Gluon kernels' conditions
answered as on the H200), so what is timed is choosing the kernels, allocating, viewing and preparing arguments, not
Triton's launcher or the driver (each launch adds those on a GPU). Small CPU tensors stand in for the GPU's, so the
few torch ops that compute cost microseconds, as their launches would. --tree names other checkouts of the package
to time in the same process run, round by round in turn (A, B, A, B), each round the mean of 200 calls.
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


# name: (B, Hq, Hkv, N, D, window, document lengths of a packed row, sinks): issue #45's shape and its variants
OP_CASES = {
    "dense": (2, 16, 16, 8192, 128, None, None, False),
    "gqa": (2, 16, 4, 8192, 128, None, None, False),
    "window128": (2, 16, 16, 8192, 128, 128, None, False),
    "packed": (1, 16, 16, 16384, 128, None, (3000, 1024, 4096, 500, 2260, 1500, 2004, 2000), False),
    "sinks": (2, 16, 16, 8192, 128, None, None, True),
}


def op_cases_section(res, text, calls=10):
    """Host ms per fwd+bwd of the op under autograd at training shapes: the wall time of `calls` calls issued with no
    synchronization (the GPU queue absorbs their launches, so the host never waits), beside the GPU-bound wall time
    per call once synchronized."""
    text.append("op host ms per fwd+bwd (autograd) at training shapes; GPU-bound ms per call beside it")
    for name, (B, hq, hkv, n, d, window, docs, sinks) in OP_CASES.items():
        g = torch.Generator(device="cuda").manual_seed(0)
        q, do = (torch.randn(B, hq, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        k, v = (torch.randn(B, hkv, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        s = torch.zeros(hq, device="cuda", requires_grad=True) if sinks else None
        cu = None if docs is None else torch.cumsum(torch.tensor((0, *docs)), 0).to("cuda", torch.int32)
        leaves = (q, k, v) + ((s, ) if sinks else ())

        def step():
            out = deltamatch_attention(q, k, v, causal=True, window=window, cu_seqlens_q=cu, cu_seqlens_k=cu, sinks=s)
            torch.autograd.grad(out, leaves, do)

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            step()
        host = (time.perf_counter() - t) * 1e3 / calls
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) * 1e3 / calls
        res[name] = dict(shape=[B, hq, hkv, n, d], window=window, docs=docs, sinks=sinks, host_ms=host,
                         gpu_bound_ms=wall)
        text.append(f"  {name:10s} B{B} H{hq}/{hkv} N{n} D{d}: host {host:.3f} ms, synchronized wall {wall:.3f} ms")


CPU_CASES = {  # name: (B, Hq, Hkv, N, D, causal, window, document lengths of a packed batch); small, so that the
    # few torch ops that compute on the CPU (a packed batch's row gathers) cost what their launches would
    "dense": (1, 2, 2, 256, 128, True, None, None),
    "gqa": (1, 8, 2, 256, 128, True, None, None),
    "window": (1, 2, 2, 256, 128, True, 64, None),
    "packed": (1, 2, 2, 256, 128, True, None, (100, 100, 56)),
}


def cpu_section(trees, rounds, calls=200):
    """--cpu: {tree: {case: [ms per fwd+bwd call, one per round]}}, each tree's round in a fresh process (a package
    is imported once per process), the trees taking turns round by round."""
    import subprocess

    times = {t: {f"{part} {c}": [] for part in ("kernels", "op") for c in CPU_CASES} for t in trees}
    for _ in range(rounds):
        for tree in trees:
            env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
            code = _CPU_CHILD.format(tree=tree, bench=str(ROOT / "benchmarks"), cases=repr(CPU_CASES), calls=calls)
            out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tree, capture_output=True, text=True,
                                 check=True).stdout
            for case, ms in json.loads(out.splitlines()[-1]).items():
                times[tree][case].append(ms)
    return times


# One round of --cpu: the package of `tree` (imported first, so that launch_trace's own path entry does not replace
# it), every launch caught by launch_trace's recorder, ms per kernels.forward + kernels.backward call per case
_CPU_CHILD = """
import json, sys, time
sys.path.insert(0, {tree!r})
import torch
from hf_deltamatch.config import DeltaMatchConfig
from hf_deltamatch.kernels import ops as KO
from hf_deltamatch import attention, deltamatch_attention, kernels
attention.resolve_backend = lambda config, device: "triton"  # CPU tensors, the GPU's path
kernels.supports = lambda *args: None
sys.path.insert(0, {bench!r})
import launch_trace
res = {{}}
for name, (B, hq, hkv, n, d, causal, window, docs) in {cases}.items():
    g = torch.Generator().manual_seed(0)
    q, do = (torch.randn(B, hq, n, d, generator=g).to(torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(B, hkv, n, d, generator=g).to(torch.bfloat16) for _ in range(2))
    cu = None if docs is None else torch.cumsum(torch.tensor((0, *docs)), 0).to(torch.int32)
    kw = dict(causal=causal, softmax_scale=d ** -0.5, window=window, cu_seqlens_q=cu, cu_seqlens_k=cu,
              config=DeltaMatchConfig())
    leaves = tuple(t.clone().requires_grad_() for t in (q, k, v))
    with launch_trace._as_on_the_h200() as launches:
        def kernels_step():
            f = KO.forward(q, k, v, **kw)
            KO.backward(do, q, k, v, f[0], f[1], *f[2:], **kw)
            launches.clear()

        def op_step():
            out = deltamatch_attention(*leaves, causal=causal, window=window, cu_seqlens_q=cu, cu_seqlens_k=cu)
            torch.autograd.grad(out, leaves, do)
            launches.clear()
        for part, step in (("kernels", kernels_step), ("op", op_step)):
            for _ in range(20):
                step()
            t = time.perf_counter()
            for _ in range({calls}):
                step()
            res[part + " " + name] = (time.perf_counter() - t) * 1e3 / {calls}
print(json.dumps(res))
"""


def cpu_main(args):
    trees = [str(ROOT)] + [str(Path(t).resolve()) for t in args.tree]
    times = cpu_section(trees, args.rounds)
    import statistics

    lines = [f"package host ms per fwd+bwd call, launches caught before Triton (CPU, {args.rounds} rounds of 200 calls;"
             f" mean ± std over rounds): `kernels` = kernels.forward + kernels.backward, `op` = deltamatch_attention"
             f" under autograd (the kernels' path)", "",
             "| tree | " + " | ".join(times[trees[0]]) + " |", "|---|" + "---|" * len(times[trees[0]])]
    for tree in trees:
        cells = [f"{statistics.mean(v):.3f} ± {statistics.stdev(v) if len(v) > 1 else 0:.3f}"
                 for v in times[tree].values()]
        lines.append(f"| {_describe(tree)} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "host-python-cpu.json"), "w") as fh:
            json.dump(dict(torch=torch.__version__, triton=triton.__version__, cases=CPU_CASES,
                           trees={_describe(t): times[t] for t in trees}), fh, indent=1)


def _describe(tree):
    import subprocess

    head = subprocess.run(["git", "-C", tree, "rev-parse", "--short=7", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", tree, "status", "--porcelain", "hf_deltamatch"], capture_output=True,
                           text=True).stdout.strip()
    return (head or tree) + (" + changes" if dirty else "")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--op", action="store_true")
    p.add_argument("--cpu", action="store_true", help="the package's own host work per call, on any machine")
    p.add_argument("--tree", action="append", default=[], help="with --cpu: another checkout to time beside this one")
    p.add_argument("--rounds", type=int, default=5, help="with --cpu: rounds per tree")
    args = p.parse_args()
    if args.cpu:
        return cpu_main(args)
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
        res["op_cases"] = {}
        op_cases_section(res["op_cases"], text)
    print("\n".join(text))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "host-overhead.json"), "w") as fh:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, shape=[B, H, N, D],
                           results=res), fh, indent=1)


if __name__ == "__main__":
    main()
